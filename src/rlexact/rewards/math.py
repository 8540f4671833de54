"""Math answer reward: extract the final answer and check it against the ground truth with ``math_verify``.

Extraction (:func:`extract_final_answer`): the content of the **last** ``\\boxed{...}`` (balanced braces, also
``\\fbox{...}`` and ``\\boxed 5``); otherwise the **last number** in the text (``-1,234.5``, ``3/4``; thousands
separators removed); otherwise nothing (reward 0).

Comparison: equal strings after whitespace removal score 1 at once; otherwise both sides are parsed with
``math_verify.parse`` (as LaTeX ``$...$`` first, then as plain text) and compared with ``math_verify.verify``.
Any error, empty parse or timeout scores 0 — the reward never raises.

Bounded time. sympy evaluates integer powers and factorials eagerly, so a policy's ``\\boxed{9^{9^{9^{9}}}}`` would
compute for hours, inside C code that no signal can interrupt. ``MathReward`` therefore guarantees:

1. *Guard* (always, in every process): before parsing, an answer longer than ``max_answer_chars``, or one that
   :func:`explosion_reason` finds would build a number of more than ``max_digits`` digits (a power, a tower of
   powers, a factorial or a binomial of a large argument), scores 0 without reaching sympy.
2. *Backstop* (when called directly, ``reward(prompts, completions, answers)``): the batch is scored through a shared
   :class:`~rlexact.rewards.RewardExecutor` in worker processes, so every sample returns within ``time_limit_s``
   seconds of wall-clock time (plus the workers' one-time start-up on the first call); a sample over the limit scores
   0 and its worker is replaced. When the reward already runs under an executor (in a worker, or an executor scoring
   in process), or with ``time_limit_s=None``, it scores directly and only the guard applies.

``math_verify``'s own timeouts use ``signal.alarm``, which fails outside the main thread (and would replace the
process's SIGALRM handler), so they are off by default (``timeout_seconds=None``); pass ``timeout_seconds=N`` to use
them on the main thread (they are skipped off it).
"""

from __future__ import annotations

import logging
import math
import re
import threading

from rlexact.rewards.base import PerSampleReward
from rlexact.rewards.executor import inside_reward_executor, shared_executor

__all__ = ["MathReward", "explosion_reason", "extract_final_answer", "last_boxed_content", "last_number"]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces allowed), or None.

    ``\\boxed 5`` (no braces) yields the following non-space run up to ``$``. An unclosed brace yields None.
    """
    for m in reversed(list(_BOXED_RE.finditer(text))):
        start = m.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for j in range(start, len(text)):
                c = text[j]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : j].strip()
            continue  # unbalanced: try an earlier \boxed
        if m.group(0) != m.group(0).rstrip():  # "\boxed 5" form
            rest = re.match(r"[^\s$]+", text[start:])
            if rest:
                return rest.group(0)
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (integer, decimal or simple fraction), thousands separators removed; or None."""
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    return re.sub(r"\s+", "", matches[-1]).replace(",", "")


def extract_final_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` content if any, else the last number, else None."""
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    return last_number(text)


_TOKEN_RE = re.compile(r"\d+(?:\.\d*)?|\.\d+|\\[A-Za-z]+|\*\*|\S")
_CLOSE = {"{": "}", "(": ")", "[": "]"}
_OPERATOR_COMMANDS = frozenset(
    r"\left \right \frac \dfrac \tfrac \sqrt \cdot \times \div \pm \mp \big \Big \bigg \Bigg \, \; \: \! \quad".split()
)
_BINOMIALS = frozenset(r"\binom \dbinom \tbinom".split())
_LOG10_2 = math.log10(2.0)
_MAX_NESTING = 64


class _TooBig(Exception):
    pass


class _Magnitudes:
    """Recursive-descent upper bounds, as log10, of the values in an answer; raises _TooBig on the first number sympy
    would build with more than ``max_digits`` digits. Sums and products are bounded by the product of their terms
    (each at least 2), a symbol by 10; ``^`` and ``**`` are right-associative, ``!`` binds to the item before it."""

    def __init__(self, text: str, max_digits: float) -> None:
        self.toks = _TOKEN_RE.findall(text)
        self.pos = 0
        self.max_digits = max_digits
        self.depth = 0

    def sequence(self, close: str | None = None) -> float:
        self.depth += 1
        if self.depth > _MAX_NESTING:
            raise _TooBig(f"brackets nested deeper than {_MAX_NESTING} levels")
        total = 0.0
        while self.pos < len(self.toks):
            tok = self.toks[self.pos]
            if tok == close:
                self.pos += 1
                break
            if self._starts_item(tok):
                total += max(self.item(), _LOG10_2)
            else:  # an operator, a stray closer, a lone ^ or !
                self.pos += 1
        self.depth -= 1
        return total

    @staticmethod
    def _starts_item(tok: str) -> bool:
        return (
            tok[0].isdigit()
            or tok[0] == "."
            and len(tok) > 1
            or tok in _CLOSE
            or tok.isalpha()
            or (tok[0] == "\\" and len(tok) > 1 and tok not in _OPERATOR_COMMANDS)
        )

    def item(self) -> float:
        tok = self.toks[self.pos]
        self.pos += 1
        if tok[0].isdigit() or tok[0] == ".":
            whole = tok.split(".")[0].lstrip("0")
            value = math.log10(float(tok)) if 0 < len(whole) < 300 else float(len(whole))
            value = max(value, 0.0)
        elif tok in _CLOSE:
            value = self.sequence(_CLOSE[tok])
        elif tok in _BINOMIALS:  # C(n, k) < 2^n
            n = self.argument()
            self.argument()
            value = self.check(10.0 ** min(n, 300.0) * _LOG10_2, "a binomial coefficient")
        else:  # a symbol or a named constant / function
            value = 1.0
        while self.pos < len(self.toks):
            tok = self.toks[self.pos]
            if tok in ("^", "**"):
                self.pos += 1
                exponent = self.argument()
                value = self.check(10.0 ** min(exponent, 300.0) * value, "a power")
            elif tok == "!":
                self.pos += 1
                n = 10.0 ** min(value, 300.0)
                digits = math.lgamma(n + 1.0) / math.log(10.0) if n < 1e15 else n * math.log10(n)
                value = self.check(digits, "a factorial")
            elif tok == "_":
                self.pos += 1
                self.argument()
            else:
                break
        return value

    def argument(self) -> float:
        """The item after ``^``, ``_`` or a binomial (a sign before it is skipped); 0 when there is none."""
        while self.pos < len(self.toks) and self.toks[self.pos] in ("-", "+"):
            self.pos += 1
        if self.pos < len(self.toks) and self._starts_item(self.toks[self.pos]):
            return self.item()
        return 0.0

    def check(self, digits: float, what: str) -> float:
        if digits > self.max_digits:
            raise _TooBig(f"{what} with about {digits:.2g} digits (more than {self.max_digits:.3g})")
        return digits


def explosion_reason(expr: str, max_digits: float = 1e6) -> str | None:
    """Why parsing ``expr`` (a LaTeX or plain-text answer) with sympy could take unbounded time, or None.

    Flags a power, a tower of powers (``9^{9^{9^{9}}}``, ``2^{10^{8}}``), a factorial (``(10^{6})!``) or a binomial
    (``\\binom{10^{9}}{5}``) whose value has more than ``max_digits`` digits, and brackets nested more than 64 deep.
    It is a cheap upper bound on magnitudes (linear in ``len(expr)``), not an evaluation: it may flag a harmless
    expression of that size (``x^{10^{7}}``), and it does not know every function sympy evaluates eagerly, which is why
    :class:`MathReward` also bounds time with worker processes.
    """
    try:
        _Magnitudes(expr, max_digits).sequence()
    except _TooBig as e:
        return str(e)
    return None


class _DropTimeoutDisabledWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_MV = None  # lazily imported math_verify (sympy import is slow)


def _math_verify():
    global _MV
    if _MV is None:
        import math_verify

        # We disable math_verify's signal timeouts on purpose; silence its one-time warning about it.
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _MV = math_verify
    return _MV


def _squash(s: str) -> str:
    s = s.strip().strip("$").strip()
    if s.endswith("."):
        s = s[:-1]
    return re.sub(r"\s+", "", s)


class MathReward(PerSampleReward):
    """1.0 if the completion's final answer is mathematically equal to the ground truth, else 0.0.

    Time is bounded per sample (see the module docstring): by the guard always, and by worker processes when the
    reward is called directly.

    Args:
        timeout_seconds: math_verify's signal-based timeout for parse and verify; None (default) disables it.
            Ignored (treated as None) when called off the main thread.
        max_answer_chars: extracted answers (and ground truths) longer than this score 0 without parsing.
        float_rounding: passed to ``math_verify.verify``.
        max_digits: answers that would make sympy build a number with more digits score 0 without parsing
            (:func:`explosion_reason`); None disables this guard.
        time_limit_s: wall-clock limit per sample when called directly (worker processes of a shared
            :class:`~rlexact.rewards.RewardExecutor`); None scores in the calling process with the guard only.
        workers: worker processes for direct calls; None = :func:`~rlexact.rewards.default_workers`.
    """

    def __init__(
        self,
        timeout_seconds: int | None = None,
        max_answer_chars: int = 512,
        float_rounding: int = 6,
        max_digits: int | None = 1_000_000,
        time_limit_s: float | None = 10.0,
        workers: int | None = None,
    ):
        if max_digits is not None and (
            isinstance(max_digits, bool) or not isinstance(max_digits, int) or max_digits < 1
        ):
            raise ValueError(f"max_digits must be a positive int or None, got {max_digits!r}")
        if time_limit_s is not None and not (isinstance(time_limit_s, (int, float)) and 0 < time_limit_s < math.inf):
            raise ValueError(f"time_limit_s must be a finite number of seconds > 0 or None, got {time_limit_s!r}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive int or None, got {workers!r}")
        self.timeout_seconds = timeout_seconds
        self.max_answer_chars = max_answer_chars
        self.float_rounding = float_rounding
        self.max_digits = max_digits
        self.time_limit_s = time_limit_s
        self.workers = workers

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
        """Score a batch; each sample within ``time_limit_s`` (in worker processes) unless already under an executor."""
        if self.time_limit_s is None or inside_reward_executor():
            return super().__call__(prompts, completions, answers)
        executor = shared_executor(self, workers=self.workers, timeout_s=self.time_limit_s)
        return executor.run(prompts, completions, answers).rewards

    def warmup(self) -> None:
        """Import math_verify and build its parsers (executors call this once per worker, outside the time limit)."""
        self.score("", "\\boxed{\\frac{1}{2}}", "0.5")

    def _timeout(self) -> int | None:
        if self.timeout_seconds and threading.current_thread() is threading.main_thread():
            return int(self.timeout_seconds)
        return None

    def _parse(self, s: str) -> list:
        mv = _math_verify()
        timeout = self._timeout()
        for candidate in (f"${s}$", s):
            try:
                parsed = mv.parse(candidate, parsing_timeout=timeout)
            except Exception:
                parsed = []
            except BaseException as e:  # math_verify.errors.TimeoutException derives from BaseException
                if type(e).__name__ != "TimeoutException":
                    raise
                parsed = []
            if parsed:
                return parsed
        return []

    def score(self, prompt: str, completion: str, answer: str | None) -> float:
        if answer is None or completion is None:
            return 0.0
        try:
            gold = str(answer)
            gold = last_boxed_content(gold) or gold
            pred = extract_final_answer(str(completion))
            if pred is None:
                return 0.0
            if len(pred) > self.max_answer_chars or len(gold) > self.max_answer_chars:
                return 0.0
            if self.max_digits is not None and (
                explosion_reason(pred, self.max_digits) or explosion_reason(gold, self.max_digits)
            ):
                return 0.0
            squashed_gold = _squash(gold)
            if squashed_gold and _squash(pred) == squashed_gold:
                return 1.0
            gold_parsed = self._parse(gold)
            pred_parsed = self._parse(pred)
            if not gold_parsed or not pred_parsed:
                return 0.0
            ok = _math_verify().verify(
                gold_parsed, pred_parsed, float_rounding=self.float_rounding, timeout_seconds=self._timeout()
            )
            return 1.0 if ok else 0.0
        except Exception:
            return 0.0
        except BaseException as e:
            if type(e).__name__ == "TimeoutException":
                return 0.0
            raise
