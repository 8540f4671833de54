"""Paged K/V gathered into per-sequence rows, so that a paged prefill launch can run the packed Gluon forward.

A paged launch whose sequences have many queries each (prefill chunks after earlier chunks, a prompt after a cached
prefix) is compute-bound, and the packed Gluon kernels (:mod:`rlexact.ops.gluon_attention`, one TMA box per key tile)
carry it faster than the ``tl`` paged kernel, which addresses every key row through the block table; the paired query
tiles (:mod:`rlexact.ops.gluon_attention_pair`) take it, since each query tile of such a chunk reads many key tiles.
:func:`gather` copies each sequence's keys and values out of the caches, in position order, into ``rows`` rows per
sequence; the packed kernels then read sequence ``b``'s keys at rows ``b * rows ..`` with its queries at its last
positions. A copy moves bits unchanged, and the kernels' key tiles stay anchored at the sequence's position 0, so every
row keeps the paged launch's bits (docs/design.md §2.4). Rows past a sequence's keys hold a copy of cache row 0: the
kernels mask their scores and zero their values, as they do for every row past a sequence.

:func:`chosen` decides on the host, from sizes only: the copy reads every key once more, which pays where a
sequence's keys serve many queries (:data:`MIN_MEAN_QUERIES`), and its buffer is bounded (:data:`MAX_BYTES`).
"""

from __future__ import annotations

import torch

__all__ = ["MAX_BYTES", "MIN_MEAN_QUERIES", "chosen", "gather"]

MIN_MEAN_QUERIES = 256
"""Queries per sequence, on average over a paged launch, from which it is gathered
(``benchmarks/results/ops_attention_gather_sweep_h200.json``, the ``paged_chunk_*`` cases: gathered and ``tl`` paged
side by side)."""
MAX_BYTES = 1 << 29
"""Largest gathered K plus V buffer (about what a long prefill step's MLP activations take); a launch that would
need more stays on the paged kernel."""


def chosen(num_queries: int, num_seqs: int, rows: int, row_bytes: int) -> bool:
    """Whether a paged launch of ``num_queries`` queries over ``num_seqs`` sequences, gathered into ``rows`` rows per
    sequence of ``row_bytes`` bytes (K or V), takes the gathered packed kernel."""
    return num_queries >= MIN_MEAN_QUERIES * num_seqs and 2 * num_seqs * rows * row_bytes <= MAX_BYTES


def gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seqlens_k: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s keys ``p < seqlens_k[b]`` (cache slot ``block_tables[b, p // BS] * BS + p % BS``) into row
    ``b * rows + p`` of ``(k, v)``, ``[B * rows, Hkv, D]`` each; ``rows`` must be at least ``max(seqlens_k)``
    (and at most ``block_tables.shape[1] * BS``). Rows past a sequence's keys hold cache row 0; table entries past a
    sequence are never read as slots. No host synchronization.

    ``k_cache, v_cache [NB, BS, Hkv, D]`` contiguous; ``block_tables [B, W]`` and ``seqlens_k [B]`` integer tensors on
    the caches' device."""
    nb, page, hkv, d = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError(f"kv_gather: caches must be contiguous [NB, BS, Hkv, D], got {tuple(k_cache.shape)}")
    width = block_tables.shape[1]
    if not 0 < rows <= width * page:
        raise ValueError(f"kv_gather: rows {rows} must be in [1, block-table width {width} * page size {page}]")
    p = torch.arange(rows, device=k_cache.device)
    slots = block_tables[:, p // page].long() * page + p % page
    slots = torch.where(p < seqlens_k[:, None], slots, 0).view(-1)
    return k_cache.view(nb * page, hkv, d)[slots], v_cache.view(nb * page, hkv, d)[slots]
