"""Position-dependent query scaling (Ministral 3's ``llama_4_scaling_beta``): the rotated queries of a token at
position ``p`` are multiplied by ``1 + beta * log(1 + floor(p / original_max_position_embeddings))``, rounded to the
query dtype (transformers' ``get_llama_4_attn_scale``).

The factor takes one value per ``n = floor(p / original)``, so it is read from a table of those values, computed in fp32
on the CPU when a layer is exactified and kept, per layer, for each device and query dtype. Every path (training,
chunked prefill, decode, a transformers ``generate``) then multiplies by the same bits: an elementwise product is
correctly rounded whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def position_query_scale(m: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``scaled(q, position_ids)`` for attention layer ``m`` (``q [..., S, H, D]``, ``position_ids [..., S]``), or
    ``None`` when its config sets no ``llama_4_scaling_beta``."""
    rope = getattr(getattr(m, "config", None), "rope_parameters", None)
    beta = rope.get("llama_4_scaling_beta") if isinstance(rope, dict) else None
    if beta is None:
        return None
    period = int(rope.get("original_max_position_embeddings") or 0)
    if period < 1:
        raise ValueError(
            f"{type(m).__name__}: llama_4_scaling_beta={beta} needs rope_parameters['original_max_position_embeddings']"
        )
    periods = int(m.config.max_position_embeddings) // period + 1
    values = 1 + float(beta) * torch.log(1 + torch.arange(periods, dtype=torch.float32))
    tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def scaled(q: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        table = tables.get((q.device, q.dtype))
        if table is None:  # built on the first (eager) call, rounded to the query dtype; CUDA-graph replays read it
            table = tables[(q.device, q.dtype)] = values.to(q.device, q.dtype)
        return q * table[torch.div(position_ids, period, rounding_mode="floor")][..., None, None]

    return scaled
