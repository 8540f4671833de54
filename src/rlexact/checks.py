"""Argument checks for the config dataclasses' ``__post_init__``, the RL callbacks' constructors and token ids: each
raises ``ValueError`` naming the field (the callbacks pass ``"<Class>: <argument>"``), the value and the rule.
Booleans are refused where a number is asked for, floats where an integer is, and strings and numbers where a bool
is."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "as_index",
    "boolean",
    "choice",
    "finite",
    "fraction",
    "flag_message",
    "indices",
    "integer",
    "metric_prefix",
    "not_a_file",
    "not_text",
    "positive_int",
    "sampling_args",
    "temperature_value",
    "token_ids",
]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def boolean(name: str, value: Any) -> None:
    """``value`` is a ``bool`` (not a truthy string or number)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def metric_prefix(name: str, value: Any) -> None:
    """``value`` is a non-empty ``str`` that does not end with ``/`` (metric names are ``<prefix>/<key>``)."""
    if not isinstance(value, str) or not value or value.endswith("/"):
        raise ValueError(f"{name} must be a non-empty str not ending with '/', got {value!r}")


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


MIN_TEMPERATURE = 1.0 / torch.finfo(torch.float32).max
"""The smallest positive temperature: below it ``1 / temperature`` overflows float32 (the kernels scale the logits by
it) and every log-prob is NaN."""


def temperature_value(name: str, value: Any, *, greedy: bool = False) -> None:
    """``value`` is a finite temperature ``> 0`` (or ``0``, argmax, where ``greedy``) whose reciprocal float32 holds
    (at least :data:`MIN_TEMPERATURE`)."""
    finite(name, value, low=0.0, low_open=not greedy)
    if 0 < value < MIN_TEMPERATURE:
        instead = "0 for greedy (argmax) decoding or " if greedy else ""
        raise ValueError(
            f"{name} must be at least {MIN_TEMPERATURE:.3g}, got {value!r}: the logits are scaled by 1/{name}, which "
            f"overflows float32 below it and makes every log-prob NaN; use {instead}a temperature of at least that"
        )


def fraction(name: str, value: Any) -> None:
    """``value`` is a finite number in ``(0, 1]``."""
    finite(name, value, low=0.0, low_open=True)
    if value > 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def sampling_args(prefix: str, temperature: Any, top_p: Any, top_k: Any, *, greedy: bool = False) -> None:
    """The sampling triple that :class:`rlexact.rollout.SamplingParams`, :class:`rlexact.config.RolloutConfig` and
    ``Generator.score`` take: :func:`temperature_value` (``0`` allowed where ``greedy``), ``top_p`` in ``(0, 1]``,
    ``top_k`` an int ``>= 0``; the names are ``prefix`` + the argument's."""
    temperature_value(f"{prefix}temperature", temperature, greedy=greedy)
    fraction(f"{prefix}top_p", top_p)
    integer(f"{prefix}top_k", top_k, low=0)


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


def indices(name: str, value: Any, *, what: str, below: int | None = None) -> list[int]:
    """``value`` as a list of non-negative integers (of any type but bool, :func:`as_index`) below ``below`` where
    given; raises for a string, a single number, or an item out of range (``what`` names the items)."""
    if isinstance(value, (str, bytes, int, float)) or not hasattr(value, "__iter__"):
        one = f"; for one write [{value!r}]" if isinstance(value, (int, float)) else ""
        raise ValueError(f"{name} must be a list of {what}s, got {value!r}{one}")
    limit = "" if below is None else f" below {_power_of_two(below)}"
    out = []
    for i, item in enumerate(value):
        index = None if isinstance(item, bool) else as_index(item)
        if index is None or index < 0 or (below is not None and index >= below):
            raise ValueError(f"{name}[{i}] must be a non-negative integer {what}{limit}, got {item!r}")
        out.append(index)
    return out


def token_ids(name: str, value: Any) -> list[int]:
    """``value`` as a list of token ids (:func:`indices`); text gets its own message (tokenize it first)."""
    not_text(name, value)
    return indices(name, value, what="token id")


def _power_of_two(n: int) -> str:
    return f"2**{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def not_a_file(name: str, path: str) -> None:
    """``path`` (an output folder, created if missing) is not an existing file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{name} {path!r} is a file; give a folder (created if missing)")


def flag_message(error: Exception, names: Iterable[str]) -> str:
    """A command-line error's text for ``error`` from one of these checks: ``--<field>: <message>`` where the message
    starts with one of the field ``names`` (as every check's message does), else the message."""
    field = str(error).split(" ", 1)[0]
    return f"--{field.replace('_', '-')}: {error}" if field in set(names) else str(error)
