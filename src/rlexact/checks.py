"""Argument checks for the config dataclasses' ``__post_init__``: each raises ``ValueError`` naming the field, the
value and the rule. Booleans are refused where a number is asked for, and floats where an integer is."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["choice", "finite", "integer", "positive_int"]


def choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def integer(name: str, value: Any, *, low: int | None = None) -> None:
    """``value`` is an ``int`` (not a bool), at least ``low`` where given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


def positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    """``value`` is an ``int`` >= 1 (or ``None`` with ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def finite(name: str, value: Any, *, low: float | None = None, low_open: bool = False) -> None:
    """``value`` is a finite real number, above ``low`` (``low_open``) or at least ``low`` where given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
