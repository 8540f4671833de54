"""Hyperparameters of :class:`rlexact.RLModule` as plain values, so checkpoints load with ``weights_only=True``.

``save_hyperparameters`` keeps the constructor arguments as given: config dataclasses would be pickled as objects
(``torch.load(weights_only=True)``, torch's default, refuses them) and ``tokenizer=None`` would hide the tokenizer
actually used. ``RLModule`` records each resolved config through :func:`plain` (a dict of its fields, tuples as
lists) and the tokenizer as its resolved source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

__all__ = ["plain"]


def plain(value: Any) -> Any:
    """``value`` with dataclasses turned into dicts and tuples into lists, recursively (YAML- and
    ``weights_only``-safe)."""
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
