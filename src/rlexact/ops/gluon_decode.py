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
ring and a V ring that run ahead across item boundaries; a 4-warp consumer partition computes one item at a time in
transposed tiles (the scores as ``K @ Q^T``: a tile's keys are the wgmma's rows and the item's ``HP`` query heads,
padded to the wgmma's smallest width, its columns; the row sums as ``ones @ P^T``, the output as ``V^T @ P^T``, so
each entry is the same dot product in the same K chain as the wide tile's), issues tile ``j + 1``'s score wgmma with
tile ``j``'s P @ V and runs tile ``j + 1``'s softmax while that P @ V is in flight (no wgmma is in flight across an
item), and prefetches the next item's query rows and length. V rows past the sequence are zeroed before their P @ V,
so stale cache contents never enter a row. An item of zero keys gets one tile of padding, wholly masked, so producer
and consumer agree on every item's tile count.

Key tiles that a group of sequences shares (:mod:`rlexact.ops.shared_prefix`) are read once per group: a first
launch (:data:`DECODE_MODE` 2) walks them with the group's query rows stacked in a wide 64-row tile (``HP`` per
member) and stores each row's walk state (maximum, sum, accumulator; fp32), and the decode launch (mode 1) starts a
member's walk at its first own tile from that state. The operations on a row and their order are the uninterrupted
walk's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from .gluon_attention import descriptor, gluon, rebind
from .shared_prefix import QUERY_ROWS, SharedPrefix
from .triton_shared import num_sms

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_attention import (
        BLOCK_N,
        HEAD_DIM,
        add_row_sum,
        cta_barrier,
        kv_layout,
        launch,
        rescaled,
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
TRANSPOSED_MAX_HP = 16
"""The most query heads per item that the decode launches (modes 0 and 1) compute in transposed tiles."""
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
    DECODE_MODE = gl.constexpr(0)
    """What a launch of the kernel bound by :func:`kernel` computes: 0 every item's rows from the empty state, 1 from
    the walk state a shared-prefix launch stored (items whose first tile is past 0), 2 that shared-prefix launch."""

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
    def _producer(k_desc, v_desc, bt_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, k_smem, v_smem, k_ready,
                  k_empty, v_ready, v_empty, n_items, n_groups, hp, group, stride_bt, stride_mem, width,
                  n_rows):  # fmt: skip
        """Copy every item's key tiles (K, then V) into the rings, each slot once the consumer released it."""
        lay: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        idx = gl.arange(0, 64, layout=lay)
        d: gl.constexpr = k_desc.block_type.shape[1]
        x = 0
        for it in range(gl.program_id(0), n_items, gl.num_programs(0)):
            b, seqlen, j0 = _item_span(it, n_groups, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, stride_mem,
                                       DECODE_MODE)  # fmt: skip
            kv_col = ((it % n_groups) * hp) // group * d
            blocks = gl.load(bt_ptr + b.to(gl.int64) * stride_bt + idx, mask=idx < width, other=0)
            for j in range(j0, gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1)):  # an empty item: one padding tile
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
    def _item_span(it, n_groups, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, stride_mem, MODE: gl.constexpr):
        """``(table row, key count, first tile)`` of item ``it``: a sequence's head group from tile 0 (``MODE`` 0), from
        its ``start`` tile (1), or a shared-prefix group's head group over its shared tiles, read through its first
        member's table row (2). Both partitions derive an item's tiles from it, so they agree on every item's count."""
        if MODE == 2:
            grp = it // n_groups
            b = gl.load(members_ptr + grp * stride_mem)
            seqlen = gl.load(tiles_ptr + grp) * TILE_N
            j0 = seqlen * 0
        else:
            b = it // n_groups
            seqlen = gl.load(seqlens_ptr + b)
            if MODE == 1:  # never past the last tile, whatever the plan says: the partitions cannot disagree
                j0 = gl.minimum(gl.load(start_ptr + b), gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1) - 1)
            else:
                j0 = seqlen * 0
        return b, seqlen, j0

    @gluon.jit
    def _row_seqs(members_ptr, it, n_groups, stride_mem, rows, HP: gl.constexpr, MODE: gl.constexpr):
        """``(batch row, live)`` of each tile row ``rows`` of item ``it``: a sequence's item holds its ``HP`` heads,
        zero rows after them; a shared-prefix group's item (``MODE`` 2) the ``HP`` heads of each member in turn
        (row ``r``: member ``r // HP``, ``-1`` past the group's members)."""
        if MODE == 2:
            mem = rows // HP
            seq = gl.load(members_ptr + (it // n_groups) * stride_mem + mem, mask=mem < (16 * W) // HP, other=-1)
            return seq, seq >= 0
        else:
            return rows * 0 + it // n_groups, rows < HP

    @gluon.jit
    def _query_rows(q_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, it, n_items, n_groups, stride_qt,
                   stride_qh, stride_mem, HP: gl.constexpr, D: gl.constexpr, blk: gl.constexpr, MODE: gl.constexpr,
                   ROWS: gl.constexpr):  # fmt: skip
        """Item ``it``'s ``ROWS`` query rows (:func:`_row_seqs`; dead rows zero) and :func:`_item_span`'s key count and
        first tile. An index past the last item reads the last item again (a prefetch nobody uses)."""
        it = gl.maximum(gl.minimum(it, n_items - 1), 0)
        _, seqlen, j0 = _item_span(it, n_groups, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, stride_mem, MODE)
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
        seq, live = _row_seqs(members_ptr, it, n_groups, stride_mem, rows, HP, MODE)
        q_rows = seq.to(gl.int64) * stride_qt + ((it % n_groups) * HP + rows % HP) * stride_qh
        q = gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=live[:, None], other=0.0)
        return q, seqlen, j0

    @gluon.jit
    def _state(members_ptr, it, n_groups, stride_mem, HP: gl.constexpr, row_layout: gl.constexpr, MODE: gl.constexpr,
               ROWS: gl.constexpr):  # fmt: skip
        """``(state row, live)`` per tile row (of ``ROWS``) of item ``it``: the walk state of query head ``h`` of batch
        row ``b`` is state row ``b * Hq + h`` (:func:`_row_seqs`)."""
        rows = gl.arange(0, ROWS, layout=row_layout)
        seq, live = _row_seqs(members_ptr, it, n_groups, stride_mem, rows, HP, MODE)
        return (seq * n_groups + it % n_groups).to(gl.int64) * HP + rows % HP, live

    @gluon.jit
    def _consumer(q_ptr, o_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, ml_ptr, sacc_ptr, ones_smem, k_smem,
                  v_smem, k_ready, k_empty, v_ready, v_empty, n_items, n_groups, qk_scale, stride_qt, stride_qh,
                  stride_ot, stride_oh, stride_mem, HP: gl.constexpr, D: gl.constexpr):  # fmt: skip
        """Every item of this program, one at a time: its key tiles from the rings (tile ``j + 1``'s scores and softmax
        while tile ``j``'s P @ V runs; an empty item's one padding tile is wholly masked), then its rows' output (in
        ``DECODE_MODE`` 2 their walk state). In ``DECODE_MODE`` 1 an item whose first tile is past 0 starts from the
        walk state a ``DECODE_MODE`` 2 launch stored."""
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
        cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        s_zero = gl.zeros([BLOCK_M, TILE_N], gl.float32, layout=s_layout)
        r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)
        step = gl.num_programs(0)
        q_next, len_next, j0_next = _query_rows(q_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr,
                                                gl.program_id(0), n_items, n_groups, stride_qt, stride_qh, stride_mem,
                                                HP, D, blk, DECODE_MODE, BLOCK_M)  # fmt: skip
        x = 0
        for it in range(gl.program_id(0), n_items, step):
            q = gl.convert_layout(q_next, q_op)
            seqlen = len_next
            j0 = j0_next
            q_next, len_next, j0_next = _query_rows(q_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, it + step,
                                                    n_items, n_groups, stride_qt, stride_qh, stride_mem, HP, D, blk,
                                                    DECODE_MODE, BLOCK_M)  # fmt: skip
            n_tiles = gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1)
            n_full = seqlen // TILE_N  # tiles below it are wholly inside the sequence
            if DECODE_MODE == 1:  # the state the shared tiles left (the empty state when there are none)
                srow_s, live_s = _state(members_ptr, it, n_groups, stride_mem, HP, row_s, DECODE_MODE, BLOCK_M)
                srow_o, live_o = _state(members_ptr, it, n_groups, stride_mem, HP, row_o, DECODE_MODE, BLOCK_M)
                m_i = gl.load(ml_ptr + 2 * srow_s, mask=live_s & (j0 > 0), other=float("-inf"))
                l_i = gl.load(ml_ptr + 2 * srow_s + 1, mask=live_s & (j0 > 0), other=0.0)
                acc = gl.load(sacc_ptr + srow_o[:, None] * D + cols_o[None, :], mask=(live_o & (j0 > 0))[:, None],
                              other=0.0)  # fmt: skip
            else:
                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
                l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
                acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
            slot = x % SLOTS
            phase = (x // SLOTS) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            mbarrier.arrive(k_empty.index(slot), count=1)
            if j0 >= n_full:
                s = gl.where((j0 * TILE_N + offs_n < seqlen)[None, :], s, float("-inf"))
            m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
            rsum = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False)
            l_i = add_row_sum(l_i, alpha, rsum, row_s)
            p_op = gl.convert_layout(p, pv_op)
            for j in range(j0, n_tiles - 1):  # tile j's P @ V under tile j + 1's scores and softmax
                nxt = (x + 1) % SLOTS
                nphase = ((x + 1) // SLOTS) & 1
                mbarrier.wait(k_ready.index(nxt), nphase)
                s_tok = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = rescaled(acc, alpha, row_o)
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
                l_i = add_row_sum(l_i, alpha, rsum, row_s)
                p_op = gl.convert_layout(p, pv_op)
                x += 1
                slot = nxt
                phase = nphase
            acc = rescaled(acc, alpha, row_o)  # the last tile's P @ V
            mbarrier.wait(v_ready.index(slot), phase)
            if n_full < n_tiles:  # V rows past the sequence (stale cache rows or zero fill): zeros
                zero_tail_rows(v_smem.index(slot), (n_tiles - 1) * TILE_N, seqlen, TILE_N, blk)
            acc = warpgroup_mma(p_op, v_smem.index(slot), acc)
            mbarrier.arrive(v_empty.index(slot), count=1)
            x += 1
            if DECODE_MODE == 2:  # the walk state after the shared tiles, per member row
                srow_s, live_s = _state(members_ptr, it, n_groups, stride_mem, HP, row_s, DECODE_MODE, BLOCK_M)
                srow_o, live_o = _state(members_ptr, it, n_groups, stride_mem, HP, row_o, DECODE_MODE, BLOCK_M)
                gl.store(ml_ptr + 2 * srow_s, m_i, mask=live_s)
                gl.store(ml_ptr + 2 * srow_s + 1, l_i, mask=live_s)
                gl.store(sacc_ptr + srow_o[:, None] * D + cols_o[None, :], acc, mask=live_o[:, None])
            else:
                store_rows(o_ptr, o_ptr, o_ptr, acc, m_i, l_i, it // n_groups, 1, 0, it % n_groups, stride_ot,
                           stride_oh, 0, 0, HP, BLOCK_M // HP, D, BLOCK_M, False, o_layout)  # fmt: skip

    @gluon.jit
    def _rings(k_desc, v_desc):
        """The ones tile and the K and V rings (:data:`SLOTS` deep, each slot released by the one consumer)."""
        return rings(k_desc, v_desc, SLOTS, TILE_N, W, 1)

    @gluon.constexpr_function
    def query_columns(hp: int) -> int:
        """Columns of the transposed tiles (:func:`_consumer_t`): an item's ``hp`` query rows, at least the wgmma's
        eight."""
        return max(8, hp)

    @gluon.jit
    def _softmax_t(s, m_s, qk_scale, dt: gl.constexpr):
        """:func:`~rlexact.ops.gluon_attention.tile_softmax` on transposed scores (keys down, query rows across): the
        same operations per query row."""
        m_new = gl.maximum(m_s, gl.max(s, 0) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, gl.exp2(m_s - m_use), gl.exp2(gl.fma(s, qk_scale, -m_use[None, :])).to(dt)

    @gluon.jit
    def _stage_p(p, p_smem, x):
        """Tile ``x``'s probabilities (keys down) into buffer ``x % 2`` as the query-major rows the wgmmas read; the
        view ``[keys, rows]`` returned is their B operand."""
        pt = p_smem.index(x % 2).permute((1, 0))
        pt.store(p)
        fence_async_shared()
        cta_barrier()
        return pt

    @gluon.jit
    def _consumer_t(q_ptr, o_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, ml_ptr, sacc_ptr, q_smem, p_smem,
                    k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items, n_groups, qk_scale, stride_qt,
                    stride_qh, stride_ot, stride_oh, stride_mem, HP: gl.constexpr, D: gl.constexpr):  # fmt: skip
        """:func:`_consumer` with the tiles transposed: an item's scores are ``K @ Q^T`` (the 64 keys as the wgmma's
        rows, the item's query rows as its ``TN`` columns), its row sums ``ones @ P^T`` and its output ``V^T @ P^T``,
        so a wgmma computes ``TN`` query rows instead of 64 of which ``HP`` are live. Each row's products, their K
        chains and every per-row operation are :func:`_consumer`'s; only the operands' roles swap. Modes 0 and 1."""
        TN: gl.constexpr = query_columns(HP)
        dt: gl.constexpr = q_ptr.dtype.element_ty
        t_layout: gl.constexpr = wgmma_layout(W, TN)
        one_op: gl.constexpr = gl.DotOperandLayout(0, t_layout, 2)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        col: gl.constexpr = gl.SliceLayout(0, t_layout)
        down: gl.constexpr = gl.SliceLayout(1, t_layout)
        offs_n = gl.arange(0, TILE_N, layout=down)
        offs_d = gl.arange(0, D, layout=down)
        s_zero = gl.zeros([TILE_N, TN], gl.float32, layout=t_layout)
        ones = gl.full([TILE_N, TILE_N], 1.0, dt, layout=one_op)
        q_t = q_smem.permute((1, 0))
        step = gl.num_programs(0)
        q_next, len_next, j0_next = _query_rows(q_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr,
                                                gl.program_id(0), n_items, n_groups, stride_qt, stride_qh, stride_mem,
                                                HP, D, blk, DECODE_MODE, TN)  # fmt: skip
        x = 0
        for it in range(gl.program_id(0), n_items, step):
            q_smem.store(q_next)
            fence_async_shared()
            cta_barrier()
            seqlen = len_next
            j0 = j0_next
            q_next, len_next, j0_next = _query_rows(q_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, it + step,
                                                    n_items, n_groups, stride_qt, stride_qh, stride_mem, HP, D, blk,
                                                    DECODE_MODE, TN)  # fmt: skip
            n_tiles = gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1)
            n_full = seqlen // TILE_N
            if DECODE_MODE == 1:
                srow, live = _state(members_ptr, it, n_groups, stride_mem, HP, col, DECODE_MODE, TN)
                m_i = gl.load(ml_ptr + 2 * srow, mask=live & (j0 > 0), other=float("-inf"))
                l_i = gl.load(ml_ptr + 2 * srow + 1, mask=live & (j0 > 0), other=0.0)
                acc = gl.load(sacc_ptr + srow[None, :] * D + offs_d[:, None], mask=(live & (j0 > 0))[None, :],
                              other=0.0)  # fmt: skip
            else:
                m_i = gl.full([TN], float("-inf"), gl.float32, layout=col)
                l_i = gl.zeros([TN], gl.float32, layout=col)
                acc = gl.zeros([D, TN], gl.float32, layout=t_layout)
            slot = x % SLOTS
            phase = (x // SLOTS) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(k_smem.index(slot), q_t, s_zero, use_acc=False)
            mbarrier.arrive(k_empty.index(slot), count=1)
            if j0 >= n_full:
                s = gl.where((j0 * TILE_N + offs_n < seqlen)[:, None], s, float("-inf"))
            m_i, alpha, p = _softmax_t(s, m_i, qk_scale, dt)
            p_t = _stage_p(p, p_smem, x)
            rsum = warpgroup_mma(ones, p_t, s_zero, use_acc=False)
            l_i = gl.fma(l_i, alpha, gl.max(rsum, 0))
            for j in range(j0, n_tiles - 1):  # tile j's P @ V under tile j + 1's scores and softmax
                nxt = (x + 1) % SLOTS
                nphase = ((x + 1) // SLOTS) & 1
                mbarrier.wait(k_ready.index(nxt), nphase)
                s_tok = warpgroup_mma(k_smem.index(nxt), q_t, s_zero, use_acc=False, is_async=True)
                acc = acc * alpha[None, :]
                mbarrier.wait(v_ready.index(slot), phase)
                acc_tok = warpgroup_mma(v_smem.index(slot).permute((1, 0)), p_t, acc, is_async=True)
                s, acc = warpgroup_mma_wait(1, deps=(s_tok, acc_tok))  # the scores; P @ V may run
                mbarrier.arrive(k_empty.index(nxt), count=1)
                if j + 1 >= n_full:
                    s = gl.where(((j + 1) * TILE_N + offs_n < seqlen)[:, None], s, float("-inf"))
                m_i, alpha, p = _softmax_t(s, m_i, qk_scale, dt)
                p_t = _stage_p(p, p_smem, x + 1)
                r_tok = warpgroup_mma(ones, p_t, s_zero, use_acc=False, is_async=True)
                rsum, acc = warpgroup_mma_wait(0, deps=(r_tok, acc))
                mbarrier.arrive(v_empty.index(slot), count=1)
                l_i = gl.fma(l_i, alpha, gl.max(rsum, 0))
                x += 1
                slot = nxt
                phase = nphase
            acc = acc * alpha[None, :]  # the last tile's P @ V
            mbarrier.wait(v_ready.index(slot), phase)
            if n_full < n_tiles:  # V rows past the sequence (stale cache rows or zero fill): zeros
                zero_tail_rows(v_smem.index(slot), (n_tiles - 1) * TILE_N, seqlen, TILE_N, blk)
            acc = warpgroup_mma(v_smem.index(slot).permute((1, 0)), p_t, acc)
            mbarrier.arrive(v_empty.index(slot), count=1)
            x += 1
            out = acc * (1.0 / l_i)[None, :]  # the bits of acc / l (gluon_attention.normalized)
            heads = gl.arange(0, TN, layout=col)
            orow = (it // n_groups).to(gl.int64) * stride_ot + ((it % n_groups) * HP + heads) * stride_oh
            gl.store(o_ptr + orow[None, :] + offs_d[:, None], out.to(o_ptr.dtype.element_ty),
                     mask=(heads < HP)[None, :])  # fmt: skip

    @gluon.jit
    def _attn_decode_kernel_t(q_ptr, o_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr,
                              count_ptr, ml_ptr, sacc_ptr, n_items, n_groups, hp, group, qk_scale, stride_qt,
                              stride_qh, stride_ot, stride_oh, stride_bt, stride_mem, width, n_rows, HP: gl.constexpr,
                              D: gl.constexpr):  # fmt: skip
        """:func:`_attn_decode_kernel` with the transposed consumer (:func:`_consumer_t`; modes 0 and 1)."""
        TN: gl.constexpr = query_columns(HP)
        dt: gl.constexpr = k_desc.dtype
        _, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = _rings(k_desc, v_desc)
        q_smem = gl.allocate_shared_memory(dt, [TN, D], gl.NVMMASharedLayout.get_default_for([TN, D], dt))
        p_smem = gl.allocate_shared_memory(dt, [2, TN, TILE_N], gl.NVMMASharedLayout.get_default_for([TN, TILE_N], dt))
        gl.warp_specialize(
            [
                (_consumer_t, (q_ptr, o_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, ml_ptr, sacc_ptr, q_smem,
                               p_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items, n_groups,
                               qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_mem, HP, D)),
                (_producer, (k_desc, v_desc, bt_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, k_smem, v_smem,
                             k_ready, k_empty, v_ready, v_empty, n_items, n_groups, hp, group, stride_bt, stride_mem,
                             width, n_rows)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip

    @gluon.jit
    def _attn_decode_kernel(q_ptr, o_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr,
                            count_ptr, ml_ptr, sacc_ptr, n_items, n_groups, hp, group, qk_scale, stride_qt, stride_qh,
                            stride_ot, stride_oh, stride_bt, stride_mem, width, n_rows, HP: gl.constexpr,
                            D: gl.constexpr):  # fmt: skip
        if DECODE_MODE == 2:  # the groups in use, read on the device (n_items is the launch's bound)
            n_items = gl.minimum(gl.load(count_ptr) * n_groups, n_items)
        ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = _rings(k_desc, v_desc)
        gl.warp_specialize(
            [
                (_consumer, (q_ptr, o_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, ml_ptr, sacc_ptr, ones_smem,
                             k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items, n_groups, qk_scale,
                             stride_qt, stride_qh, stride_ot, stride_oh, stride_mem, HP, D)),
                (_producer, (k_desc, v_desc, bt_ptr, seqlens_ptr, start_ptr, members_ptr, tiles_ptr, k_smem, v_smem,
                             k_ready, k_empty, v_ready, v_empty, n_items, n_groups, hp, group, stride_bt, stride_mem,
                             width, n_rows)),
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


@functools.cache
def kernel(mode: int, transposed: bool = False) -> object:
    """The decode kernel bound to :data:`DECODE_MODE` ``mode`` (built once per mode and kept alive, since the cached
    launchers key on the kernel object); ``transposed`` selects :func:`_consumer_t` (modes 0 and 1)."""
    if transposed and mode == 2:
        raise ValueError("the shared-prefix launch (mode 2) stacks its members' rows in the wide tile: not transposed")
    base = _attn_decode_kernel_t if transposed else _attn_decode_kernel
    if mode == 0:
        return base
    consts = {"DECODE_MODE": gl.constexpr(mode)}
    producer = rebind(_producer, **consts)
    if transposed:
        return rebind(base, _producer=producer, _consumer_t=rebind(_consumer_t, **consts), **consts)
    return rebind(base, _producer=producer, _consumer=rebind(_consumer, **consts), **consts)


def transposes(hp: int) -> bool:
    """Whether the decode launches (modes 0 and 1) of items with ``hp`` query heads run the transposed consumer: a
    power of two up to :data:`TRANSPOSED_MAX_HP` (wider items fill the 64-row tile well)."""
    return hp <= TRANSPOSED_MAX_HP and hp & (hp - 1) == 0


def forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seqlens_k: torch.Tensor, scale: float, out: torch.Tensor, hp: int,
            prefix: SharedPrefix | None = None) -> None:  # fmt: skip
    """One decode step, ``q [B, Hq, 128]`` (one query per sequence) over the paged caches ``[NB, PAGE, Hkv, 128]``
    with ``block_tables [B, width]`` (int32, rows dense, ``width * PAGE`` at most the split) and ``seqlens_k [B]``
    (int32), into ``out``; ``hp`` query heads per item, :data:`PROGRAMS_PER_SM` programs per SM. Call only where
    :func:`supported` holds.

    With ``prefix`` (its ``members`` ``64 // hp`` wide) a first launch walks each group's shared tiles once and
    stores the walk state of its members' rows (fp32, in scratch of this call); the decode launch then starts each
    member at its ``start`` tile from that state. The rows are those of the launch without ``prefix``."""
    b, hq, d = q.shape
    nb, page, hkv, _ = k_cache.shape
    layout = kv_layout(q.dtype == torch.float16)
    rows, width = [nb * page, hkv * d], [hkv * d, 1]  # supported() checked the caches
    k_desc = descriptor(k_cache.view(nb * page, hkv * d), rows, width, [PAGE, d], layout)
    v_desc = descriptor(v_cache.view(nb * page, hkv * d), rows, width, [PAGE, d], layout)
    n_groups, group = hq // hp, hq // hkv
    programs = PROGRAMS_PER_SM * num_sms(q.device)
    sq, so, sb = q.stride(), out.stride(), block_tables.stride(0)
    width = block_tables.shape[1]
    tensors = (q, out, block_tables, seqlens_k, k_cache, v_cache)
    qk_scale = scale * math.log2(math.e)

    def run(mode: int, n_items: int, plan: tuple[torch.Tensor, ...], stride_mem: int) -> None:
        scalars = (n_items, n_groups, hp, group)
        strides = (sq[0], sq[1], so[0], so[1], sb, stride_mem, width, nb * page)
        args = (q, out, k_desc, v_desc, block_tables, seqlens_k, *plan, *scalars, qk_scale, *strides, hp, HEAD_DIM)
        fn = kernel(mode, mode != 2 and transposes(hp))
        launch(fn, (min(n_items, programs), 1), args, (*tensors, *plan), (*scalars, *strides, hkv * d), LAUNCH_OPTIONS)

    if prefix is None:
        run(0, b * n_groups, (seqlens_k,) * 6, 0)
        return
    if prefix.members.shape[1] != QUERY_ROWS // hp or prefix.start.shape[0] != b:
        raise ValueError(
            f"SharedPrefix: members must be {QUERY_ROWS // hp} wide and start hold {b} rows for this launch, got "
            f"{tuple(prefix.members.shape)} and {prefix.start.shape[0]}"
        )
    ml = torch.empty((b * hq, 2), dtype=torch.float32, device=q.device)
    acc = torch.empty((b * hq, d), dtype=torch.float32, device=q.device)
    plan = (prefix.start, prefix.members, prefix.tiles, prefix.count, ml, acc)
    run(2, prefix.members.shape[0] * n_groups, plan, prefix.members.stride(0))
    run(1, b * n_groups, plan, prefix.members.stride(0))
