"""Attention metadata passed explicitly through the transformers forward (no global context).

The generator and the trainer both call the model through :func:`rlexact.models.forward_hidden` with a packed token
stream (batch dimension 1, no padding) and one of these objects; transformers forwards it untouched to the attention
function that :func:`rlexact.exactify` registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlexact.ops.shared_prefix import SharedPrefix


@dataclass
class PagedKV:
    """Paged KV cache state for one forward of the generator.

    Attributes:
        caches: per decoder layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` int32; row ``b`` lists sequence ``b``'s cache blocks in position order.
        seqlens_k: ``[B]`` int32, keys per sequence after this forward's tokens are written.
        slot_mapping: ``[T]`` int64, the cache slot (``block * block_size + offset``) of every new token.
        max_seqlen_q: optional host-side ``max(nq_b)`` (``1`` for a pure decode step); lets kernels that branch on it
            (the native path) avoid a device-to-host sync, e.g. inside a CUDA-graph capture.
        max_seqlen_k: optional host-side upper bound of ``seqlens_k`` (at most ``block_tables.shape[1] * block_size``);
            the native decode path pads keys to it, so a captured graph can use a static bound.
        split_counters: optional int32 zeros shared by the layers' split-parallel attention launches
            (:func:`rlexact.ops.attention_paged`), e.g. a captured decode graph's static buffer.
        fresh: every sequence of this forward starts at position 0 (its keys are this forward's tokens alone), so
            exact attention runs packed over the new keys (:func:`rlexact.ops.attention_varlen`, the training
            kernels), which gives the paged launch's rows bitwise; the keys are still written to the cache.
        prefix: optional key tiles that groups of a decode step's sequences share (the same cache blocks), read once
            per group by the exact decode launch (:class:`rlexact.ops.shared_prefix.SharedPrefix`; same rows).
    """

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_tables: torch.Tensor
    seqlens_k: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    split_counters: torch.Tensor | None = None
    fresh: bool = False
    prefix: SharedPrefix | None = None


@dataclass
class AttnMetadata:
    """Layout of a packed forward.

    Attributes:
        cu_seqlens: ``[B+1]`` int32 boundaries of the sequences (their new tokens) in the packed stream.
        paged: ``None`` for the training path (keys are the packed tokens themselves, each sequence starting at
            position 0); a :class:`PagedKV` for the generator (prefill chunks and decode over the paged cache).
    """

    cu_seqlens: torch.Tensor
    paged: PagedKV | None = None

    def __post_init__(self) -> None:
        if self.cu_seqlens.dim() != 1 or self.cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with B+1 >= 2 entries, got shape {tuple(self.cu_seqlens.shape)}")

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1
