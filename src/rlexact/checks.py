"""Argument checks for the config dataclasses' ``__post_init__`` and for token ids: each raises ``ValueError`` naming
the field, the value and the rule. Booleans are refused where a number is asked for, and floats where an integer
is."""

from __future__ import annotations

import math
import operator
from typing import Any

__all__ = ["as_index", "choice", "finite", "integer", "not_text", "positive_int", "token_ids"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def integer(name: str, value: Any, *, low: int | None = None) -> None:
    """``value`` is an ``int`` (not a bool), at least ``low`` where given."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


def positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    """``value`` is an ``int`` >= 1 (or ``None`` with ``allow_none``)."""
    if value is None and allow_none:
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def finite(name: str, value: Any, *, low: float | None = None, low_open: bool = False) -> None:
    """``value`` is a finite real number, above ``low`` (``low_open``) or at least ``low`` where given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")


def not_text(name: str, value: Any) -> None:
    """``value`` (a sequence of token ids) is not a string: text must be tokenized first."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} is text, not token ids: tokenize it first, e.g. tokenizer(text)['input_ids']")


def as_index(value: Any) -> int | None:
    """``value`` as an ``int`` where it is an integer of any type (Python, numpy, a torch scalar, a bool:
    ``operator.index``), else ``None`` (floats, strings, ...)."""
    try:
        return operator.index(value)
    except TypeError:
        return None


def token_ids(name: str, value: Any) -> list[int]:
    """``value`` as a list of non-negative integer token ids (integers of any type, :func:`as_index`); raises for text,
    a single number, or an item that is not a non-negative integer."""
    not_text(name, value)
    if isinstance(value, (int, float)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}; for one id write [{value!r}]")
    ids = []
    for i, item in enumerate(value):
        index = as_index(item)
        if index is None or index < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative integer token id, got {item!r}")
        ids.append(index)
    return ids
