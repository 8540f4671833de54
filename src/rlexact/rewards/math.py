"""Math answer reward: extract the final answer and check it against the ground truth with ``math_verify``.

Extraction (:func:`extract_final_answer`): the content of the **last** ``\\boxed{...}`` (balanced braces, also
``\\fbox{...}`` and ``\\boxed 5``); otherwise the **last number** in the text (``-1,234.5``, ``3/4``; thousands
separators removed); otherwise nothing (reward 0).

Comparison: equal strings after whitespace removal score 1 at once; otherwise both sides are parsed with
``math_verify.parse`` (as LaTeX ``$...$`` first, then as plain text) and compared with ``math_verify.verify``.
Any error, empty parse or timeout scores 0 — the reward never raises.

Timeouts: ``math_verify`` implements timeouts with ``signal.alarm``, which fails outside the main thread (and would
replace the process's SIGALRM handler). ``MathReward`` therefore disables them by default (``parsing_timeout=None``,
``timeout_seconds=None``) and bounds the work instead by truncating extracted answers to ``max_answer_chars``.
Pass ``timeout_seconds=N`` to use math_verify's signal timeouts; they are still skipped off the main thread.
"""

from __future__ import annotations

import logging
import re
import threading

from rlexact.rewards.base import PerSampleReward

__all__ = ["MathReward", "extract_final_answer", "last_boxed_content", "last_number"]

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

    Args:
        timeout_seconds: math_verify's signal-based timeout for parse and verify; None (default) disables it.
            Ignored (treated as None) when called off the main thread.
        max_answer_chars: extracted answers (and ground truths) longer than this score 0 without parsing.
        float_rounding: passed to ``math_verify.verify``.
    """

    def __init__(self, timeout_seconds: int | None = None, max_answer_chars: int = 512, float_rounding: int = 6):
        self.timeout_seconds = timeout_seconds
        self.max_answer_chars = max_answer_chars
        self.float_rounding = float_rounding

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
