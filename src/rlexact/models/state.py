"""The per-model switch that every module exactify patches shares: exact or native kernels, the original forwards,
the rotary tables and the generator's fused projections."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

Kernels = Literal["exact", "native"]
KERNELS: tuple[str, ...] = ("exact", "native")
STATE_ATTR = "_rlexact_state"
"""The instance attribute holding the :class:`ExactState` on the model and on every attention / MLP module it
patched."""


@dataclass
class ExactState:
    """Per-model switch shared by every patched module of one model.

    Attributes:
        kernels: ``"exact"`` or ``"native"``; change it with :func:`use_kernels` (reentrant, try/finally).
        original_forwards: the replaced modules and their original ``forward`` (restored by ``enabled=False``).
        original_attn_impl: ``config._attn_implementation`` before exactify.
        rope_tables: fp32 ``(cos, sin)`` tables over ``[0, max_position_embeddings)`` per rotary module, device and
            layer type (``None`` for rotary modules with one table).
        fused: concatenated projection weights per attention layer / gated MLP, used in exact mode without autograd
            (set for the duration of a generator call by :func:`rlexact.models.fusion.use_fused_projections`).
    """

    kernels: Kernels = "exact"
    original_forwards: list[tuple[nn.Module, Callable]] = field(default_factory=list)
    original_attn_impl: str | None = None
    rope_tables: dict[tuple[nn.Module, torch.device, str | None], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    fused: dict[nn.Module, object] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.kernels == "exact"


def get_state(model: nn.Module) -> ExactState | None:
    """The :class:`ExactState` of an exactified model, or of a submodule exactify patched (an attention layer or
    gated MLP), else ``None``."""
    return model.__dict__.get(STATE_ATTR)


def is_exactified(model: nn.Module) -> bool:
    return get_state(model) is not None


@contextlib.contextmanager
def use_kernels(model: nn.Module, kernels: str) -> Iterator[None]:
    """Run ``model`` with ``"exact"`` or ``"native"`` kernels inside the block; restores the previous choice."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    state = get_state(model)
    if state is None:
        raise ValueError("use_kernels needs an exactified model: call rlexact.exactify(model) first")
    previous = state.kernels
    state.kernels = kernels  # type: ignore[assignment]
    try:
        yield
    finally:
        state.kernels = previous
