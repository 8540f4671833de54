"""Key tiles that several sequences of a decode step share, read once for all of them (docs/design.md §2.4).

The ``n`` samples of a prompt hold the same cache blocks for its full pages. A decode step's exact attention walks
each sequence's key tiles from position 0 in ascending order, so the walk's running state after the shared tiles
(row maximum, row sum, accumulator, all fp32) is the same for a sample whichever launch computed it: a first launch
walks the shared tiles once per group of sequences, the group's query rows stacked in one tile, and stores that
state; the decode launch starts each member's walk from it at the first tile it does not share. Every operation on
a row is the one the uninterrupted walk performs, so the rows are bitwise those of a launch without the prefix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["QUERY_ROWS", "SharedPrefix", "group_capacity", "heads_per_tile"]

QUERY_ROWS = 64
"""Query rows of the decode kernel's tile (the query heads of one KV head, for every sequence of a group)."""


@functools.cache
def heads_per_tile(hq: int, hkv: int, block_m: int) -> int:
    """Query heads packed into one tile: the largest divisor of the GQA group size that fits ``block_m`` rows."""
    group = hq // hkv
    return max(d for d in range(1, min(group, block_m) + 1) if group % d == 0)


def group_capacity(num_q_heads: int, num_kv_heads: int) -> int:
    """Sequences one group of a :class:`SharedPrefix` holds at most: their query heads of one tile's head group fill
    the decode kernel's :data:`QUERY_ROWS` rows."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} must be a positive multiple of kv heads {num_kv_heads}")
    return QUERY_ROWS // heads_per_tile(num_q_heads, num_kv_heads, QUERY_ROWS)


@dataclass(frozen=True)
class SharedPrefix:
    """Groups of a decode step's sequences whose first key tiles are the same cache blocks.

    Attributes:
        start: ``[B]`` int32, per sequence the first key tile its own walk reads (``0``: it shares none). A sequence
            with ``start[b] > 0`` is a member of exactly one group among the first ``count``, whose ``tiles`` equals
            ``start[b]``, and ``start[b] * 64 < seqlens_k[b]`` (at least one tile of its own).
        members: ``[G, capacity]`` int32 (:func:`group_capacity`), the batch rows of each group, ``-1`` after its last
            member; the first member's block-table row is the one read for the group's tiles, and every member's
            table holds the same blocks there.
        tiles: ``[G]`` int32, the key tiles (64 keys each) the group shares, ``>= 1`` for the first ``count`` groups.
        count: ``[1]`` int32, the groups in use (``0 <= count <= G``); read on the device, so a captured graph replays
            any plan of at most ``G`` groups.

    Only the Gluon decode launch on sm_90 (a decode step whose contexts fit one KV split) reads the shared tiles once;
    every other launch computes the same rows without it.
    """

    start: torch.Tensor
    members: torch.Tensor
    tiles: torch.Tensor
    count: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("start", "members", "tiles", "count"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError(f"SharedPrefix.{name} must be a contiguous int32 tensor, got {t.dtype}")
        if self.start.dim() != 1 or self.tiles.dim() != 1 or self.count.numel() != 1:
            raise ValueError("SharedPrefix: start and tiles must be 1-D and count a single element")
        if self.members.dim() != 2 or self.members.shape[0] != self.tiles.shape[0] or self.members.shape[0] < 1:
            raise ValueError(
                f"SharedPrefix.members must be [G, capacity] with G = len(tiles) >= 1, got {tuple(self.members.shape)}"
                f" and {self.tiles.shape[0]} tiles"
            )
