"""A synthetic, verifiable arithmetic task for the embedded demo.

Prompts are raw (chat-free) strings such as ``"12+7="`` and the ground truth is the decimal result ``"19"``; the demo
SFTs a tiny model on ``prompt → answer + "<|im_end|>"`` and then runs GRPO with
:class:`rlexact.rewards.ArithmeticReward`.

Row ``i`` of a task depends only on ``(seed, i)`` (a ``random.Random`` seeded with the string ``f"{seed}:{i}"``, which
CPython hashes with SHA-512, so it is stable across processes and ``PYTHONHASHSEED``). ``make_dataset(n, seed)`` is
therefore a prefix of ``make_dataset(m, seed)`` for ``n <= m``; use different seeds for train and eval sets.

The default (2-digit addition, operands 0-99) is learnable in part by a ~1M-parameter model after a short SFT:
answers have 1-3 digits and need carries, so accuracy has room to rise during RL.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["ArithmeticTask", "make_dataset", "read_jsonl", "write_jsonl"]

_SUPPORTED_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticTask:
    """Deterministic generator of ``"a<op>b="`` prompts with integer answers.

    Attributes:
        seed: base seed; row ``i`` is a pure function of ``(seed, i)``.
        max_operand: largest operand (inclusive).
        min_operand: smallest operand (inclusive), ``0 <= min_operand <= max_operand``.
        ops: operators drawn uniformly per row, a non-empty subset of ``("+", "-", "*")``.
        allow_negative: for ``"-"``, if False (default) the operands are ordered so the answer is ``>= 0``.
    """

    seed: int = 0
    max_operand: int = 99
    min_operand: int = 0
    ops: Sequence[str] = field(default=("+",))
    allow_negative: bool = False

    def __post_init__(self) -> None:
        ops = tuple(self.ops)
        if not ops:
            raise ValueError("ops must be non-empty")
        bad = [op for op in ops if op not in _SUPPORTED_OPS]
        if bad:
            raise ValueError(f"unsupported ops {bad}; choose from {_SUPPORTED_OPS}")
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(f"need 0 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}")
        object.__setattr__(self, "ops", ops)

    @staticmethod
    def solve(a: int, op: str, b: int) -> int:
        """The integer result of ``a <op> b``."""
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        raise ValueError(f"unsupported op {op!r}")

    @staticmethod
    def format_prompt(a: int, op: str, b: int) -> str:
        """``"12+7="`` (no spaces, no chat markup)."""
        return f"{a}{op}{b}="

    def __getitem__(self, index: int) -> dict[str, str]:
        """Row ``index``: ``{"prompt": "12+7=", "answer": "19"}``."""
        if index < 0:
            raise IndexError(f"index must be >= 0, got {index}")
        rng = random.Random(f"{self.seed}:{index}")
        op = self.ops[rng.randrange(len(self.ops))]
        a = rng.randint(self.min_operand, self.max_operand)
        b = rng.randint(self.min_operand, self.max_operand)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        return {"prompt": self.format_prompt(a, op, b), "answer": str(self.solve(a, op, b))}

    def __iter__(self) -> Iterator[dict[str, str]]:
        """Infinite stream of rows 0, 1, 2, …"""
        i = 0
        while True:
            yield self[i]
            i += 1

    def generate(self, n: int, start: int = 0) -> list[dict[str, str]]:
        """Rows ``start … start + n - 1``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self[i] for i in range(start, start + n)]


def make_dataset(
    n: int,
    seed: int = 0,
    *,
    max_operand: int = 99,
    min_operand: int = 0,
    ops: Sequence[str] = ("+",),
    allow_negative: bool = False,
) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt": str, "answer": str}`` of an :class:`ArithmeticTask` (deterministic in ``seed``)."""
    task = ArithmeticTask(
        seed=seed, max_operand=max_operand, min_operand=min_operand, ops=ops, allow_negative=allow_negative
    )
    return task.generate(n)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> str:
    """Write ``rows`` as JSON lines (UTF-8, one object per line); creates parent folders. Returns the path."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file written by :func:`write_jsonl` (blank lines are skipped)."""
    with open(os.fspath(path), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
