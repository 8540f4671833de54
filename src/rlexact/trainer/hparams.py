"""Hyperparameters of :class:`rlexact.RLModule` as plain values, so checkpoints load with ``weights_only=True``.

``save_hyperparameters`` keeps the constructor arguments as given: config dataclasses would be pickled as objects
(``torch.load(weights_only=True)``, torch's default, refuses them) and ``tokenizer=None`` would hide the tokenizer
actually used. :func:`plain_hparams` returns the replacements: each resolved config as a dict of its fields (tuples as
lists) and the tokenizer as its resolved source.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

__all__ = ["plain", "plain_hparams"]

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


def plain_hparams(hparams: Mapping[str, Any], tokenizer_source: Any, **configs: Any) -> dict[str, Any]:
    """The entries of ``hparams`` to replace: each of ``configs`` (the resolved config dataclasses, by argument
    name) as a plain dict, and ``tokenizer`` as ``tokenizer_source`` when that is a path or name (the module's
    ``model_path`` by default)."""
    out = {k: plain(v) for k, v in configs.items() if k in hparams}
    if "tokenizer" in hparams and isinstance(tokenizer_source, (str, os.PathLike)):
        out["tokenizer"] = os.fspath(tokenizer_source)
    return out
