"""The exact paged decode attention in Triton's Gluon dialect, for Hopper: persistent and warp-specialized.

Bitwise the rows of :func:`rlexact.ops.triton_attention.attention_paged`'s ``tl`` kernel for a decode step (one query
per sequence) whose contexts fit one KV split (docs/design.md §2.4): the same 64-key tiles anchored at position 0,
visited in ascending order from the empty state, and the same per-row operations in the same order (scores, the
``-inf`` mask of keys past the sequence, ``exp2(fma(s, scale, -m))``, the row sum as a dot with a ones tile, ``fma``
updates, P @ V in the MMA's K chain), so a row does not depend on which kernel computed it. Contexts past one split
keep the ``tl`` kernel (its split-parallel launch).

What differs is how the work is carried. The ``tl`` launch runs one program per (sequence, KV head group), several
waves of them at large batches, and each program's dependent loads (length, block table, first tile) are exposed
once per program. Here a grid of two programs per SM walks the (sequence, head group) items in turn. In each program
a producer warp reads an item's length and block-table row and copies its key tiles page by page (one 16-key TMA box
per page; pages past the sequence are read from past the cache's last row, which TMA fills with zeros) through a K
ring and a V ring that run ahead across item boundaries; a 4-warp consumer partition computes one item at a time
(64-row wgmma tiles of which the item's query heads use ``HP``), issues tile ``j + 1``'s score wgmma with tile
``j``'s P @ V and runs tile ``j + 1``'s softmax while that P @ V is in flight (no wgmma is in flight across an item),
and prefetches the next item's query rows and length. V rows past the sequence are zeroed before their P @ V, so
stale cache contents never enter a row. An item of zero keys gets one tile of padding, wholly masked, so producer
and consumer agree on every item's tile count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from .gluon_attention import gluon
from .triton_shared import num_sms

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .gluon_attention import (
        BLOCK_N,
        HEAD_DIM,
        kv_layout,
        launch,
        rings,
        store_rows,
        tile_softmax,
        tma_load,
        wgmma_layout,
        zero_tail_rows,
    )
    from .gluon_attention import supported as packed_supported

__all__ = ["LAUNCH_OPTIONS", "PAGE", "PROGRAMS_PER_SM", "forward", "supported"]

PAGE = 16
"""The cache page size (tokens per block) this kernel reads: one TMA box per page."""
PROGRAMS_PER_SM = 2
"""Programs per SM (each a 4-warp consumer and a producer warp; two fit the SM's shared memory and registers).
Measured against one in ``benchmarks/results/gluon_decode_probe_h200.json``."""
WARPS = 4
MAXNREG = 128
"""Registers per thread at launch (the producer's warp group gives most of its share to the consumer's)."""
LAUNCH_OPTIONS: Mapping[str, int] = MappingProxyType({"num_warps": WARPS, "maxnreg": MAXNREG})
"""The compile options of every launch of the kernel."""

if gluon is not None:
    W = gl.constexpr(WARPS)
    """Consumer warps (worker partitions take no constexpr arguments in Triton 3.6: shape constants are globals)."""
    SLOTS = gl.constexpr(2)
    """Depth of the K ring and of the V ring: two-deep rings timed against three-deep ones side by side in
    ``benchmarks/results/gluon_decode_probe_variants_h200.json`` and ``gluon_decode_probe_ahead_h200.json``."""
    TILE_N = gl.constexpr(BLOCK_N)
    PAGE_N = gl.constexpr(PAGE)
    PAGES = gl.constexpr(BLOCK_N // PAGE)
    """Pages per key tile."""
    PRODUCER_REGS = gl.constexpr(40)

    @gluon.jit
    def _copy_tile(desc, dst, bar, rows0, rows1, rows2, rows3, col):
        """One key tile: four pages (TMA boxes of ``PAGE`` rows from rows ``rows0 .. rows3``) into ``dst``; ``bar``
        expects the whole tile."""
        nbytes: gl.constexpr = TILE_N * desc.block_type.shape[1] * desc.dtype.primitive_bitwidth // 8
        mbarrier.expect(bar, nbytes)
        tma_load(desc, [rows0, col], bar, dst.slice(0, PAGE_N))
        tma_load(desc, [rows1, col], bar, dst.slice(PAGE_N, PAGE_N))
        tma_load(desc, [rows2, col], bar, dst.slice(2 * PAGE_N, PAGE_N))
        tma_load(desc, [rows3, col], bar, dst.slice(3 * PAGE_N, PAGE_N))

    @gluon.jit
    def _page_row(blocks, idx, page, n_rows):
        """The first cache row of block-table entry ``page`` (``n_rows``, past the cache, when ``page < 0``)."""
        return gl.where(page >= 0, gl.sum(gl.where(idx == page, blocks, 0), axis=0) * PAGE_N, n_rows)

    @gluon.jit
    def _producer(k_desc, v_desc, bt_ptr, seqlens_ptr, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items,
                 n_groups, hp, group, stride_bt, width, n_rows):  # fmt: skip
        """Copy every item's key tiles (K, then V) into the rings, each slot once the consumer released it."""
        lay: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        idx = gl.arange(0, 64, layout=lay)
        d: gl.constexpr = k_desc.block_type.shape[1]
        x = 0
        for it in range(gl.program_id(0), n_items, gl.num_programs(0)):
            b = it // n_groups
            kv_col = ((it % n_groups) * hp) // group * d
            seqlen = gl.load(seqlens_ptr + b)
            blocks = gl.load(bt_ptr + b.to(gl.int64) * stride_bt + idx, mask=idx < width, other=0)
            for j in range(0, gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1)):  # an empty item: one padding tile
                slot = x % SLOTS
                phase = ((x // SLOTS) & 1) ^ 1  # a fresh barrier counts as released: the first pass does not wait
                n_pg = gl.minimum((seqlen - j * TILE_N + PAGE_N - 1) // PAGE_N, PAGES)
                p0 = j * PAGES
                rows0 = _page_row(blocks, idx, gl.where(n_pg > 0, p0, -1), n_rows)
                rows1 = _page_row(blocks, idx, gl.where(n_pg > 1, p0 + 1, -1), n_rows)
                rows2 = _page_row(blocks, idx, gl.where(n_pg > 2, p0 + 2, -1), n_rows)
                rows3 = _page_row(blocks, idx, gl.where(n_pg > 3, p0 + 3, -1), n_rows)
                mbarrier.wait(k_empty.index(slot), phase)
                _copy_tile(k_desc, k_smem.index(slot), k_ready.index(slot), rows0, rows1, rows2, rows3, kv_col)
                mbarrier.wait(v_empty.index(slot), phase)
                _copy_tile(v_desc, v_smem.index(slot), v_ready.index(slot), rows0, rows1, rows2, rows3, kv_col)
                x += 1

    @gluon.jit
    def _query_rows(q_ptr, seqlens_ptr, it, n_items, n_groups, stride_qt, stride_qh, HP: gl.constexpr,
                   D: gl.constexpr, blk: gl.constexpr):  # fmt: skip
        """Item ``it``'s query rows (``HP`` heads of one sequence, zero rows after them) and its key count; an index
        past the last item reads the last item again (a prefetch nobody uses)."""
        it = gl.minimum(it, n_items - 1)
        b = it // n_groups
        rows = gl.arange(0, 16 * W, layout=gl.SliceLayout(1, blk))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
        q_rows = b.to(gl.int64) * stride_qt + ((it % n_groups) * HP + rows) * stride_qh
        q = gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=(rows < HP)[:, None], other=0.0)
        return q, gl.load(seqlens_ptr + b)

    @gluon.jit
    def _consumer(q_ptr, o_ptr, seqlens_ptr, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items,
                  n_groups, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, HP: gl.constexpr,
                  D: gl.constexpr):  # fmt: skip
        """Every item of this program, one at a time: its key tiles from the rings (tile ``j + 1``'s scores and softmax
        while tile ``j``'s P @ V runs; an empty item's one padding tile is wholly masked), then its rows' output."""
        BLOCK_M: gl.constexpr = 16 * W
        dt: gl.constexpr = q_ptr.dtype.element_ty
        s_layout: gl.constexpr = wgmma_layout(W, TILE_N)
        o_layout: gl.constexpr = wgmma_layout(W, D)
        r_layout: gl.constexpr = wgmma_layout(W, 16)
        q_op: gl.constexpr = gl.DotOperandLayout(0, s_layout, 2)
        r_op: gl.constexpr = gl.DotOperandLayout(0, r_layout, 2)
        pv_op: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        offs_n = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, TILE_N], gl.float32, layout=s_layout)
        r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)
        step = gl.num_programs(0)
        q_next, len_next = _query_rows(q_ptr, seqlens_ptr, gl.program_id(0), n_items, n_groups, stride_qt, stride_qh,
                                       HP, D, blk)  # fmt: skip
        x = 0
        for it in range(gl.program_id(0), n_items, step):
            q = gl.convert_layout(q_next, q_op)
            seqlen = len_next
            q_next, len_next = _query_rows(q_ptr, seqlens_ptr, it + step, n_items, n_groups, stride_qt, stride_qh, HP,
                                           D, blk)  # fmt: skip
            n_tiles = gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1)
            n_full = seqlen // TILE_N  # tiles below it are wholly inside the sequence
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
            slot = x % SLOTS
            phase = (x // SLOTS) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            mbarrier.arrive(k_empty.index(slot), count=1)
            if n_full == 0:
                s = gl.where((offs_n < seqlen)[None, :], s, float("-inf"))
            m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
            rsum = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False)
            l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
            p_op = gl.convert_layout(p, pv_op)
            for j in range(0, n_tiles - 1):  # tile j's P @ V under tile j + 1's scores and softmax
                nxt = (x + 1) % SLOTS
                nphase = ((x + 1) // SLOTS) & 1
                mbarrier.wait(k_ready.index(nxt), nphase)
                s_tok = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                mbarrier.wait(v_ready.index(slot), phase)
                acc_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
                s, acc, p_op = warpgroup_mma_wait(1, deps=(s_tok, acc_tok, p_op))  # the scores; P @ V may run
                mbarrier.arrive(k_empty.index(nxt), count=1)
                if j + 1 >= n_full:
                    s = gl.where(((j + 1) * TILE_N + offs_n < seqlen)[None, :], s, float("-inf"))
                m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
                r_tok = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False, is_async=True)
                rsum, acc, p_op = warpgroup_mma_wait(0, deps=(r_tok, acc, p_op))
                mbarrier.arrive(v_empty.index(slot), count=1)
                l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
                p_op = gl.convert_layout(p, pv_op)
                x += 1
                slot = nxt
                phase = nphase
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]  # the last tile's P @ V
            mbarrier.wait(v_ready.index(slot), phase)
            if n_full < n_tiles:  # V rows past the sequence (stale cache rows or zero fill): zeros
                zero_tail_rows(v_smem.index(slot), (n_tiles - 1) * TILE_N, seqlen, TILE_N, blk)
            acc = warpgroup_mma(p_op, v_smem.index(slot), acc)
            mbarrier.arrive(v_empty.index(slot), count=1)
            x += 1
            store_rows(o_ptr, o_ptr, o_ptr, acc, m_i, l_i, it // n_groups, 1, 0, it % n_groups, stride_ot, stride_oh, 0,
                       0, HP, BLOCK_M // HP, D, BLOCK_M, False, o_layout)  # fmt: skip

    @gluon.jit
    def _rings(k_desc, v_desc):
        """The ones tile and the K and V rings (:data:`SLOTS` deep, each slot released by the one consumer)."""
        return rings(k_desc, v_desc, SLOTS, TILE_N, W, 1)

    @gluon.jit
    def _attn_decode_kernel(q_ptr, o_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, n_items, n_groups, hp, group, qk_scale,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, width, n_rows, HP: gl.constexpr,
                            D: gl.constexpr):  # fmt: skip
        ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = _rings(k_desc, v_desc)
        gl.warp_specialize(
            [
                (_consumer, (q_ptr, o_ptr, seqlens_ptr, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                             n_items, n_groups, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, HP, D)),
                (_producer, (k_desc, v_desc, bt_ptr, seqlens_ptr, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                             n_items, n_groups, hp, group, stride_bt, width, n_rows)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, split: int) -> bool:
    """Whether :func:`forward` runs this paged decode launch: what the packed Gluon forward needs
    (:func:`rlexact.ops.gluon_attention.supported`: Gluon's Hopper language, sm_90, 16-bit, head dim 128, key
    tiles of ``BLOCK_N``), caches of :data:`PAGE`-token pages laid out densely (``[NB, PAGE, Hkv, 128]``), and a
    split of at most 64 pages (the block-table entries the producer holds of a sequence: a table of at most one
    split is the caller's condition)."""
    if k_cache.dim() != 4 or k_cache.shape[1] != PAGE or split > 64 * PAGE or not k_cache.is_contiguous():
        return False
    if v_cache.stride() != k_cache.stride():
        return False
    rows = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    return gluon is not None and packed_supported(q, rows, v_cache.view(rows.shape), block_n)


def forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seqlens_k: torch.Tensor, scale: float, out: torch.Tensor, hp: int) -> None:  # fmt: skip
    """One decode step, ``q [B, Hq, 128]`` (one query per sequence) over the paged caches ``[NB, PAGE, Hkv, 128]``
    with ``block_tables [B, width]`` (int32, rows dense, ``width * PAGE`` at most the split) and ``seqlens_k [B]``
    (int32), into ``out``; ``hp`` query heads per item, :data:`PROGRAMS_PER_SM` programs per SM. Call only where
    :func:`supported` holds."""
    b, hq, d = q.shape
    nb, page, hkv, _ = k_cache.shape
    layout = kv_layout(q.dtype == torch.float16)
    k_desc = GluonDescriptor(k_cache.view(nb * page, hkv * d), [nb * page, hkv * d], [hkv * d, 1], [PAGE, d], layout)
    v_desc = GluonDescriptor(v_cache.view(nb * page, hkv * d), [nb * page, hkv * d], [hkv * d, 1], [PAGE, d], layout)
    n_groups, group = hq // hp, hq // hkv
    n_items = b * n_groups
    grid = (min(n_items, PROGRAMS_PER_SM * num_sms(q.device)), 1)
    sq, so, sb = q.stride(), out.stride(), block_tables.stride(0)
    width = block_tables.shape[1]
    scalars = (n_items, n_groups, hp, group)
    strides = (sq[0], sq[1], so[0], so[1], sb, width, nb * page)
    args = (q, out, k_desc, v_desc, block_tables, seqlens_k, *scalars, scale * math.log2(math.e), *strides, hp,
            HEAD_DIM)  # fmt: skip
    tensors = (q, out, block_tables, seqlens_k, k_cache, v_cache)
    launch(_attn_decode_kernel, grid, args, tensors, (*scalars, *strides, hkv * d), LAUNCH_OPTIONS)
