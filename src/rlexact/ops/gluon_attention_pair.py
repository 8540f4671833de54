"""The exact packed attention forward, persistent and warp-specialized: :mod:`rlexact.ops.gluon_attention`'s rows.

An item is two adjacent query tiles of one sequence and head group. Each program, one per SM, runs two 4-warp consumer
partitions (the default partition and a worker), one per query tile, beside a one-warp producer partition. The producer
draws items from a counter in the launch's order (the last pair slots first: within a sequence the costliest), looks
each up, publishes its record and both query tiles (TMA) an item ahead, and streams its K and V tiles through three-deep
TMA rings that run on across items. Every K/V tile is copied once for both query tiles, and the consumers issue no
copies and look nothing up: between two items they write one tile's output over its query tile in shared memory, start
its TMA store and the next item, whose Q and first keys are already in shared memory. A ring slot is released once both
consumers are done with it (a consumer whose rows need fewer tiles releases the rest unread). Each consumer runs the
library kernel's pipelined loop over its own key tiles, with the same key tiles, KV splits, per-row operations and fold
order, so its rows are the library's bits (docs/design.md §2.4): the dispatch between the two kernels changes the speed
only. In the library's build, which waits for a tile's row sum together with its P @ V, ``ptxas`` schedules that wait
before the next tile's softmax, so the softmax follows the P @ V instead of running under it
(``benchmarks/results/pair_sass_sm90.json``); a build that kept it under ran slower (docs/design.md §2.4). The V tile
that runs past a sequence is zeroed past it by the consumer that reads it last in tile order (consumer 0 when it needs
that tile), which then signals the other through the ring slot's tail barrier; both consumers count the tails per
slot, so each waits for the right phase however far the other has run ahead.

Query rows past a sequence's end arrive with the tile (the next sequence's rows, or TMA's zero fill); rows are
independent in every operation and those are never stored.

Triton 3.6's Gluon passes a worker partition's arguments without their constexpr-ness, so the partitions'
compile-time parameters (query heads per tile, KV split, the backward's preprocessing, the GQA group, gathered keys)
are module globals bound per specialization (:func:`kernel`); only the bound copies are launched.
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType

import torch

from . import gluon_attention as ga
from .triton_shared import num_sms

if ga.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_attention import (
        add_row_sum,
        cta_barrier,
        fold,
        issue_row_sum,
        key_rows,
        load_rows,
        locate,
        mask_scores,
        normalized,
        rescale_under_row_sum,
        rescaled,
        rings,
        store_rows,
        tile_softmax,
        tma_load,
        tma_store,
        wgmma_layout,
        zero_tail_rows,
    )

__all__ = [
    "LIBRARY_BUILD",
    "MIN_MEAN_KEYS",
    "Build",
    "chosen",
    "forward",
    "kernel",
    "plan",
    "q_layout",
    "takes",
]

MIN_MEAN_KEYS = 128
"""Mean keys per sequence from which a packed launch takes this kernel (``benchmarks/results/ops_attention_h200.json``,
each prefill case's ``gluon_kernels``: less GPU time than the single-tile kernel, as CUDA-graph replays, at every case
from this mean on, the shortest measured). Where a launch's GPU time is shorter than the host's work for it (an eager
call on its own at a few thousand tokens), its four TMA descriptors can make the eager call slower; inside a model's
forward the host runs ahead of the GPU and the GPU time is what counts."""
WARPS = 4
"""Warps of each consumer partition (16 query rows per warp), as the library kernel's program."""
PROGRAMS_PER_SM = 1
"""Programs launched per SM (one fits: the rings and query tiles take most of the shared memory)."""
MAXNREG = 168
"""Registers per thread at launch over the program's nine warps; the partitions then take :data:`CONSUMER_REGS` and
:data:`PRODUCER_REGS`."""
RING_DEPTH = 3
"""Depth of the K ring and of the V ring (the library's; :class:`Build` sets others)."""
ITEM_DEPTH = 3
"""Item slots: records with their query tiles, which the producer fills ahead of the consumers and a consumer
releases one item late (the library's; :class:`Build` sets others; at least 2)."""

if ga.gluon is not None:
    SLOTS = gl.constexpr(RING_DEPTH)
    """Depth of the K ring and of the V ring of a bound specialization (:func:`kernel`)."""
    TILE_N = gl.constexpr(ga.BLOCK_N)
    HEAD_D = gl.constexpr(ga.HEAD_DIM)
    W = gl.constexpr(WARPS)
    """Warps of each consumer partition of a bound specialization (:func:`kernel`)."""
    CONSUMERS = gl.constexpr(2)
    """Consumer partitions of a bound specialization, each with one query tile of ``16 * W`` rows of every item
    (:func:`kernel`: one of ``2 * WARPS`` warps in :class:`Build`'s ``wide``)."""
    CONSUMER_REGS = gl.constexpr(240)
    PRODUCER_REGS = gl.constexpr(24)
    PAIR_HP = gl.constexpr(0)
    """Query heads per tile of a bound specialization (:func:`kernel`); 0 in the unbound functions."""
    PAIR_BWD_PREP = gl.constexpr(False)
    """Whether a bound specialization runs the backward's preprocessing (:func:`kernel`)."""
    PAIR_SPLIT = gl.constexpr(0)
    """KV split keys of a bound specialization (:func:`kernel`)."""
    PAIR_GROUP = gl.constexpr(1)
    """Query heads per KV head of a bound specialization (:func:`kernel`)."""
    PAIR_GATHERED = gl.constexpr(False)
    """Whether a bound specialization reads gathered keys (:func:`kernel`)."""
    PAIR_SCAN = gl.constexpr(ga.SCAN)
    PAIR_FIRST_FOLD = gl.constexpr(False)
    """Whether a bound specialization takes a query tile's first KV split as its state without the fold's products
    (:func:`kernel`): folding into the empty state (``m = -inf``, ``l = 0``, zero sums) multiplies the state by
    ``exp2(-inf) = 0`` and the split by ``exp2(0) = 1`` (or by 0 with the split's ``m = -inf``, whose sums are zero),
    so it adds ``+0`` to each of the split's values."""
    PAIR_SUM_WITH_PV = gl.constexpr(False)
    """Whether a bound specialization issues each key tile's row-sum wgmma with its P @ V and waits for both after
    the next tile's softmax in the source (:func:`kernel`; ``ptxas`` schedules that wait before the softmax)."""
    PAIR_COLUMN_SUMS = gl.constexpr(False)
    """Whether a bound specialization keeps a KV split's running sum per column of the row-sum wgmma's product, in
    its accumulator layout, and takes each row's maximum over the columns once per split instead of once per key tile
    (:func:`kernel`; with ``PAIR_SUM_WITH_PV``). Every column of P against the ones tile is
    the row sum, so each column runs the same ``fma`` chain as the row's sum and ends equal to it."""
    ROW_SUM_N = gl.constexpr(16)
    """Columns of the ones tile, hence of each row-sum product, of a bound specialization (:func:`kernel`)."""
    PAIR_TREE_MAX = gl.constexpr(False)
    """Whether a bound specialization takes each row's maximum as a tree (:func:`kernel`;
    :func:`~rlexact.ops.gluon_attention.tile_softmax`'s ``TREE``)."""
    PAIR_ONE_BOUND = gl.constexpr(False)
    """Whether a bound specialization masks each score with one comparison (:func:`kernel`;
    :func:`~rlexact.ops.gluon_attention.mask_scores`'s ``ONE_BOUND``)."""
    PAIR_ZERO_START = gl.constexpr(False)
    """Whether a bound specialization leaves a KV split's sum at its first key tile unscaled (:func:`kernel`): it is
    ``+0`` there and the tile's ``alpha`` is ``exp2(-inf) = +0``, so the product is ``+0`` too."""
    ITEM_SLOTS = gl.constexpr(ITEM_DEPTH)
    """Item records (and their query tiles) a bound specialization's producer may publish ahead (:func:`kernel`)."""
    INFO = gl.constexpr(8)
    """Entries of an item record: first query row, pair, head group, queries, keys, first query's position, key
    tiles, 1 (0: no further item)."""

    @gluon.jit
    def _item(cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads, i):
        """Work item ``i`` of a launch over ``n_slots`` pair slots and ``heads`` head groups, the costliest first:
        ``(has rows, first query row, pair, head group, queries, keys, first key row, first query's position, key
        tiles)`` of pair slot ``n_slots - 1 - i // heads`` and head group ``i % heads``."""
        IP: gl.constexpr = CONSUMERS * (16 * W // PAIR_HP)  # an item's query positions
        hgroup = i % heads
        b, q_begin, pair = locate(cu_ptr, num_seqs, n_slots - 1 - i // heads, IP, PAIR_SCAN, 1)
        nq = gl.load(cu_ptr + b + 1) - q_begin
        nk, kv_begin, q_start = key_rows(seqk_ptr, kv_rows, b, q_begin, nq, PAIR_GATHERED)
        n_tiles = (q_start + gl.minimum(pair * IP + IP, nq) - 1) // TILE_N + 1
        return pair * IP < nq, q_begin, pair, hgroup, nq, nk, kv_begin, q_start, n_tiles

    @gluon.jit
    def _ticket(counter_ptr, lay: gl.constexpr):
        """The next item number drawn from the launch's counter (one atomic, its result in every lane)."""
        lane = gl.arange(0, 32, layout=lay)
        old = gl.atomic_add(counter_ptr + lane * 0, gl.full([32], 1, gl.int32, layout=lay), mask=lane == 0)
        return gl.max(gl.where(lane == 0, old, -1), 0)

    @gluon.jit
    def _release_counter(counter_ptr, lay: gl.constexpr):
        """Count this program out of the launch's counter (its second entry: the programs done drawing); the last
        program out zeroes both entries. Every ticket was drawn by then (each program counts itself out after its last
        draw, and the atomics order the two), so the counter is zero again for the next launch that uses it."""
        lane = gl.arange(0, 32, layout=lay)
        done = _ticket(counter_ptr + 1, lay)
        last = done == gl.num_programs(0) - 1
        gl.store(counter_ptr + lane, gl.zeros([32], gl.int32, layout=lay), mask=(lane < 2) & last)

    @gluon.jit
    def _field(rec, k: gl.constexpr, lay: gl.constexpr):
        """Entry ``k`` of an item record held whole by every thread."""
        return gl.sum(gl.where(gl.arange(0, INFO, layout=lay) == k, rec, 0), 0)

    @gluon.jit
    def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, info_smem, item_ready, item_empty, k_ready, k_empty,
                 v_ready, v_empty, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads, counter_ptr):  # fmt: skip
        """Draw items from the counter until none is left; for each that has rows, publish its record in item slot
        ``n % ITEM_SLOTS`` (``n``: this program's items so far) with both query tiles' Q, then copy its K tile x and
        V tile x into ring slot ``(x0 + x) % SLOTS`` (``x0``: the key tiles of this program's items before it), each
        slot once both consumers released it. Then publish the end record."""
        P: gl.constexpr = 16 * W // PAIR_HP
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        rec_lay: gl.constexpr = gl.BlockedLayout([INFO], [32], [1], [0])
        idx = gl.arange(0, INFO, layout=rec_lay)
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes
        q_bytes: gl.constexpr = q_desc.block_type.nbytes
        n_items = n_slots * heads
        x0 = gl.program_id(0) * 0
        n = x0
        i = _ticket(counter_ptr, lay)
        while i < n_items:
            valid, q_begin, pair, hgroup, nq, nk, kv_begin, q_start, n_tiles = _item(cu_ptr, num_seqs, seqk_ptr,
                                                                                     kv_rows, n_slots, heads, i)
            if valid:
                s = n % ITEM_SLOTS
                mbarrier.wait(item_empty.index(s), ((n // ITEM_SLOTS) & 1) ^ 1)
                rec = gl.where(idx == 0, q_begin, 0) + gl.where(idx == 1, pair, 0) + gl.where(idx == 2, hgroup, 0)
                rec += gl.where(idx == 3, nq, 0) + gl.where(idx == 4, nk, 0) + gl.where(idx == 5, q_start, 0)
                rec += gl.where(idx == 6, n_tiles, 0) + gl.where(idx == 7, 1, 0)
                info_smem.index(s).store(rec)
                cta_barrier()
                mbarrier.expect(item_ready.index(s), CONSUMERS * q_bytes)  # every tile: the last may lie past the rows
                for c in gl.static_range(CONSUMERS):
                    tma_load(q_desc, [q_begin + (CONSUMERS * pair + c) * P, hgroup * PAIR_HP, 0], item_ready.index(s),
                             q_smem.index(CONSUMERS * s + c))  # fmt: skip
                kv_col = (hgroup * PAIR_HP) // PAIR_GROUP * HEAD_D
                base = kv_begin - x0 * TILE_N  # ring tile r is key tile r - x0
                for r in range(x0, x0 + n_tiles):
                    phase = ((r // SLOTS) & 1) ^ 1  # a fresh barrier counts as released: the first pass does not wait
                    mbarrier.wait(k_empty.index(r % SLOTS), phase)
                    load_rows(k_desc, k_smem, k_ready, r, base, kv_col, SLOTS, TILE_N, kv_bytes)
                    mbarrier.wait(v_empty.index(r % SLOTS), phase)
                    load_rows(v_desc, v_smem, v_ready, r, base, kv_col, SLOTS, TILE_N, kv_bytes)
                x0 += n_tiles
                n += 1
            i = _ticket(counter_ptr, lay)
        _release_counter(counter_ptr, lay)
        s = n % ITEM_SLOTS
        mbarrier.wait(item_empty.index(s), ((n // ITEM_SLOTS) & 1) ^ 1)
        info_smem.index(s).store(gl.zeros([INFO], gl.int32, rec_lay))  # entry 7 zero: no item
        cta_barrier()
        mbarrier.arrive(item_ready.index(s), count=1)

    @gluon.jit
    def _add_column_sums(l_c, alpha, rsum, row_r: gl.constexpr):
        """A split's sums per row-sum column ``l_c`` rescaled by each row's ``alpha`` plus a key tile's row-sum
        product, column by column (:func:`~rlexact.ops.gluon_attention.add_row_sum`'s ``fma`` on every column)."""
        return gl.fma(l_c, gl.convert_layout(alpha, row_r)[:, None], rsum)

    @gluon.jit
    def _rows(o_ptr, lse_ptr, delta_ptr, o_desc, q_tile, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready,
              v_empty, tail_bars, q_begin, nq, nk, q_start, tile, hgroup, n_mine, x0, tail, zero_here, tail_phase,
              by_tma, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh, HP: gl.constexpr, SPLIT: gl.constexpr,
              BWD_PREP: gl.constexpr, dt: gl.constexpr):  # fmt: skip
        """Query tile ``tile`` (its Q in ``q_tile``, ``[positions, heads, head dim]``; query ``i`` at position
        ``q_start + i`` of ``nk`` keys) over key tiles ``0 .. n_mine - 1``, key tile ``j`` in ring slot
        ``(x0 + j) % SLOTS``: the library's pipelined loop, each K slot released once its scores are done and each V
        slot once its P @ V is. Key tile ``tail`` runs past the sequence: its V rows there are zeroed here
        (``zero_here``, then the slot's tail barrier is signalled) or by the other consumer (the barrier's phase
        ``tail_phase`` is waited for). With ``by_tma`` (the tile's rows all lie in the sequence) the output leaves
        through ``q_tile`` (its query no longer read) and one TMA store, which may still be reading ``q_tile`` when
        this returns; otherwise, and for the backward's preprocessing, it is stored from registers
        (:func:`~rlexact.ops.gluon_attention.store_rows`)."""
        D: gl.constexpr = HEAD_D
        BLOCK_M: gl.constexpr = 16 * W
        BLOCK_N: gl.constexpr = TILE_N
        P: gl.constexpr = BLOCK_M // HP
        TPS: gl.constexpr = SPLIT // BLOCK_N
        s_layout: gl.constexpr = wgmma_layout(W, BLOCK_N)
        o_layout: gl.constexpr = wgmma_layout(W, D)
        r_layout: gl.constexpr = wgmma_layout(W, ROW_SUM_N)
        r_op: gl.constexpr = gl.DotOperandLayout(0, r_layout, 2)
        pv_op: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        row_r: gl.constexpr = gl.SliceLayout(1, r_layout)
        q_smem = q_tile.reshape([BLOCK_M, D])

        n_full = (q_start + tile * P + 1) // BLOCK_N
        pos = q_start + tile * P + gl.arange(0, BLOCK_M, layout=row_s) // HP
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        r_zero = gl.zeros([BLOCK_M, ROW_SUM_N], gl.float32, layout=r_layout)
        for t0 in range(0, n_mine, TPS):
            t1 = gl.minimum(t0 + TPS, n_mine)
            m_s = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            l_c = r_zero  # the split's sum per row-sum column (PAIR_COLUMN_SUMS)
            acc_s = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
            r0 = x0 + t0
            mbarrier.wait(k_ready.index(r0 % SLOTS), (r0 // SLOTS) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(r0 % SLOTS).permute((1, 0)), s_zero, use_acc=False)
            mbarrier.arrive(k_empty.index(r0 % SLOTS), count=1)
            s = mask_scores(s, t0, n_full, pos, offs_n, nk, BLOCK_N, PAIR_ONE_BOUND)
            m_s, alpha, p = tile_softmax(s, m_s, qk_scale, dt, PAIR_TREE_MAX)
            if PAIR_SUM_WITH_PV:  # the tile's row sum is issued with its P @ V
                if not PAIR_ZERO_START:
                    acc_s = rescaled(acc_s, alpha, row_o)
                p_op = gl.convert_layout(p, pv_op)
                alpha_sum = alpha
            else:
                p_r, rsum = issue_row_sum(p, ones_smem, r_zero, r_op)
                acc_s, p_op, l_s = rescale_under_row_sum(acc_s, l_s, alpha, p, p_r, rsum, pv_op, row_o, row_s,
                                                         not PAIR_ZERO_START)  # fmt: skip
            for j in range(t0, t1 - 1):  # tile j's P @ V, tile j + 1's scores and softmax
                r = x0 + j
                nxt = (r + 1) % SLOTS
                mbarrier.wait(k_ready.index(nxt), ((r + 1) // SLOTS) & 1)
                s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(r % SLOTS), (r // SLOTS) & 1)
                acc_tok = warpgroup_mma(p_op, v_smem.index(r % SLOTS), acc_s, is_async=True)
                if PAIR_SUM_WITH_PV:  # the scores; P @ V and the row sum may run
                    r_tok = warpgroup_mma(p_op, ones_smem, r_zero, use_acc=False, is_async=True)
                    s, acc_s, r_tok, p_op = warpgroup_mma_wait(2, deps=(s_tok, acc_tok, r_tok, p_op))
                else:  # the scores; P @ V may run
                    s, acc_s, p_op = warpgroup_mma_wait(1, deps=(s_tok, acc_tok, p_op))
                mbarrier.arrive(k_empty.index(nxt), count=1)
                s = mask_scores(s, j + 1, n_full, pos, offs_n, nk, BLOCK_N, PAIR_ONE_BOUND)
                m_s, alpha, p = tile_softmax(s, m_s, qk_scale, dt, PAIR_TREE_MAX)
                if PAIR_SUM_WITH_PV:  # tile j's P @ V and row sum
                    acc_s, rsum, p_op = warpgroup_mma_wait(0, deps=(acc_s, r_tok, p_op))
                    mbarrier.arrive(v_empty.index(r % SLOTS), count=1)
                    if PAIR_COLUMN_SUMS:
                        l_c = _add_column_sums(l_c, alpha_sum, rsum, row_r)
                    else:
                        l_s = add_row_sum(l_s, alpha_sum, rsum, row_s)
                    alpha_sum = alpha
                    acc_s = rescaled(acc_s, alpha, row_o)
                    p_op = gl.convert_layout(p, pv_op)
                else:  # P @ V; tile j + 1's row sum runs while the sum is rescaled and P converted
                    p_r, rsum = issue_row_sum(p, ones_smem, r_zero, r_op)
                    acc_s, p_op = warpgroup_mma_wait(1, deps=(acc_s, p_op))
                    mbarrier.arrive(v_empty.index(r % SLOTS), count=1)
                    acc_s, p_op, l_s = rescale_under_row_sum(acc_s, l_s, alpha, p, p_r, rsum, pv_op, row_o, row_s)
            jl = t1 - 1  # the split's last tile: its P @ V, then the fold
            rl = (x0 + jl) % SLOTS
            mbarrier.wait(v_ready.index(rl), ((x0 + jl) // SLOTS) & 1)
            if jl == tail:  # V rows past the sequence: zeros, whatever the next sequence holds
                if CONSUMERS == 1:
                    zero_tail_rows(v_smem.index(rl), jl * BLOCK_N, nk, BLOCK_N, blk)
                elif zero_here:
                    zero_tail_rows(v_smem.index(rl), jl * BLOCK_N, nk, BLOCK_N, blk)
                    mbarrier.arrive(tail_bars.index(rl), count=1)
                else:
                    mbarrier.wait(tail_bars.index(rl), tail_phase)
            if PAIR_SUM_WITH_PV:
                acc_tok = warpgroup_mma(p_op, v_smem.index(rl), acc_s, is_async=True)
                r_tok = warpgroup_mma(p_op, ones_smem, r_zero, use_acc=False, is_async=True)
                acc_s, rsum, p_op = warpgroup_mma_wait(0, deps=(acc_tok, r_tok, p_op))
                if PAIR_COLUMN_SUMS:  # each column holds the row's sum: their maximum is that sum
                    l_c = _add_column_sums(l_c, alpha_sum, rsum, row_r)
                    l_s = gl.convert_layout(gl.max(l_c, 1), row_s)
                else:
                    l_s = add_row_sum(l_s, alpha_sum, rsum, row_s)
            else:
                acc_s = warpgroup_mma(p_op, v_smem.index(rl), acc_s)
            mbarrier.arrive(v_empty.index(rl), count=1)
            if PAIR_FIRST_FOLD and t0 == 0:  # the fold into the empty state: +0 plus each term, bit for bit
                m_i, l_i, acc = m_s, l_s + 0.0, acc_s + 0.0
            else:
                m_i, l_i, acc = fold(m_i, l_i, acc, m_s, l_s, acc_s, o_layout)
        if BWD_PREP or not by_tma:
            store_rows(o_ptr, lse_ptr, delta_ptr, acc, m_i, l_i, q_begin, nq, tile, hgroup, stride_ot, stride_oh,
                          stride_lt, stride_lh, HP, P, D, BLOCK_M, BWD_PREP, o_layout)  # fmt: skip
        else:
            q_smem.store(normalized(acc, l_i, o_layout).to(dt))
            fence_async_shared()
            cta_barrier()
            tma_store(o_desc, [q_begin + tile * P, hgroup * HP, 0], q_tile)

    @gluon.jit
    def _consume(o_ptr, lse_ptr, delta_ptr, o_desc, q_smem, ones_smem, k_smem, v_smem, info_smem, item_ready,
                 item_empty, k_ready, k_empty, v_ready, v_empty, tail_bars, qk_scale, stride_ot, stride_oh, stride_lt,
                 stride_lh, C: gl.constexpr):  # fmt: skip
        """Consumer ``C``: for each item the producer publishes, query tile ``2 * pair + C`` over the key tiles its
        rows need, then the release of those only the other consumer needs and of the previous item's slot, whose
        query tile the previous output's TMA store had until then to read (so the producer runs ``ITEM_SLOTS - 2``
        items ahead). ``tail_parity`` holds, per ring slot, the phase of its tail barrier's next completion (both
        consumers count every item's tail)."""
        HP: gl.constexpr = PAIR_HP
        BLOCK_M: gl.constexpr = 16 * W
        P: gl.constexpr = BLOCK_M // HP
        rec_lay: gl.constexpr = gl.BlockedLayout([INFO], [32], [W], [0])
        dt: gl.constexpr = k_smem.dtype
        x0 = gl.program_id(0) * 0
        tail_parity = x0
        n = x0
        mbarrier.wait(item_ready.index(0), 0)
        rec = info_smem.index(0).load(rec_lay)
        while _field(rec, 7, rec_lay) != 0:
            s = n % ITEM_SLOTS
            q_begin = _field(rec, 0, rec_lay)
            pair = _field(rec, 1, rec_lay)
            hgroup = _field(rec, 2, rec_lay)
            nq = _field(rec, 3, rec_lay)
            nk = _field(rec, 4, rec_lay)
            q_start = _field(rec, 5, rec_lay)
            n_tiles = _field(rec, 6, rec_lay)
            tile = CONSUMERS * pair + C
            n_mine = gl.where(tile * P < nq, (q_start + gl.minimum(tile * P + P, nq) - 1) // TILE_N + 1, 0)
            n_first = (q_start + gl.minimum(CONSUMERS * pair * P + P, nq) - 1) // TILE_N + 1  # consumer 0 has rows
            tail = gl.where(n_tiles * TILE_N > nk, n_tiles - 1, -1)  # the key tile past the sequence, if any
            zeroer = gl.where(n_first == n_tiles, 0, 1)  # consumer 0 when it reads that tile, else consumer 1
            tail_slot = (x0 + n_tiles - 1) % SLOTS
            by_tma = tile * P + P <= nq  # every row in the sequence: the output leaves by TMA
            if n_mine > 0:
                _rows(o_ptr, lse_ptr, delta_ptr, o_desc, q_smem.index(CONSUMERS * s + C), ones_smem, k_smem, v_smem,
                      k_ready, k_empty, v_ready, v_empty, tail_bars, q_begin, nq, nk, q_start, tile, hgroup, n_mine,
                      x0, tail, zeroer == C, (tail_parity >> tail_slot) & 1, by_tma, qk_scale, stride_ot, stride_oh,
                      stride_lt, stride_lh, HP, PAIR_SPLIT, PAIR_BWD_PREP, dt)  # fmt: skip
            if CONSUMERS == 2:  # one consumer reads every tile
                for r in range(x0 + n_mine, x0 + n_tiles):
                    mbarrier.wait(k_ready.index(r % SLOTS), (r // SLOTS) & 1)
                    mbarrier.arrive(k_empty.index(r % SLOTS), count=1)
                    mbarrier.wait(v_ready.index(r % SLOTS), (r // SLOTS) & 1)
                    mbarrier.arrive(v_empty.index(r % SLOTS), count=1)
            if n > 0:  # the previous item's output has left its query tile (this item's may still be leaving)
                if (n_mine > 0) & by_tma:
                    tma.store_wait(1)
                else:
                    tma.store_wait(0)
                cta_barrier()
                mbarrier.arrive(item_empty.index((n - 1) % ITEM_SLOTS), count=1)
            if tail >= 0:
                tail_parity = tail_parity ^ (1 << tail_slot)
            x0 += n_tiles
            n += 1
            mbarrier.wait(item_ready.index(n % ITEM_SLOTS), (n // ITEM_SLOTS) & 1)
            rec = info_smem.index(n % ITEM_SLOTS).load(rec_lay)
        tma.store_wait(0)  # shared memory outlives the last output's store

    @gluon.jit
    def _worker_consumer(o_ptr, lse_ptr, delta_ptr, q_desc, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem,
                         info_smem, item_ready, item_empty, k_ready, k_empty, v_ready, v_empty, tail_bars, cu_ptr,
                         num_seqs, seqk_ptr, kv_rows, n_slots, heads, counter_ptr, qk_scale, stride_ot, stride_oh,
                         stride_lt, stride_lh, o_desc):  # fmt: skip
        """Consumer 1 (the worker partitions share one argument list)."""
        _consume(o_ptr, lse_ptr, delta_ptr, o_desc, q_smem, ones_smem, k_smem, v_smem, info_smem, item_ready,
                 item_empty, k_ready, k_empty, v_ready, v_empty, tail_bars, qk_scale, stride_ot, stride_oh, stride_lt,
                 stride_lh, 1)  # fmt: skip

    @gluon.jit
    def _worker_producer(o_ptr, lse_ptr, delta_ptr, q_desc, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem,
                         info_smem, item_ready, item_empty, k_ready, k_empty, v_ready, v_empty, tail_bars, cu_ptr,
                         num_seqs, seqk_ptr, kv_rows, n_slots, heads, counter_ptr, qk_scale, stride_ot, stride_oh,
                         stride_lt, stride_lh, o_desc):  # fmt: skip
        """The producer (the worker partitions share one argument list)."""
        _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, info_smem, item_ready, item_empty, k_ready, k_empty,
                 v_ready, v_empty, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads, counter_ptr)  # fmt: skip

    @gluon.jit
    def _pair_kernel(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, cu_ptr, num_seqs, qk_scale, stride_qt,
                     stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, seqk_ptr, kv_rows, heads, q_desc,
                     counter_ptr, o_desc):  # fmt: skip
        """The packed launch's arguments (``q_ptr`` and its strides unread: Q arrives through ``q_desc``, boxes of a
        query tile's positions and heads), the head groups, the launch's item counter (two int32 zeros, advanced here
        and left zero: :func:`_release_counter`) and the output's descriptor (``out`` in ``q_desc``'s boxes)."""
        gl.static_assert(PAIR_HP > 0, "launch a specialization bound by rlexact.ops.gluon_attention_pair.kernel")
        P: gl.constexpr = 16 * W // PAIR_HP
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS * ITEM_SLOTS, P, PAIR_HP, HEAD_D], q_desc.layout)
        info_smem = gl.allocate_shared_memory(gl.int32, [ITEM_SLOTS, INFO], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_ready = gl.allocate_shared_memory(gl.int64, [ITEM_SLOTS, 1], mbarrier.MBarrierLayout())
        item_empty = gl.allocate_shared_memory(gl.int64, [ITEM_SLOTS, 1], mbarrier.MBarrierLayout())
        tail_bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(ITEM_SLOTS):
            mbarrier.init(item_ready.index(s), count=1)
            mbarrier.init(item_empty.index(s), count=CONSUMERS)
        for s in gl.static_range(SLOTS):
            mbarrier.init(tail_bars.index(s), count=1)
        ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = rings(k_desc, v_desc, SLOTS, TILE_N, W,
                                                                              CONSUMERS, ROW_SUM_N)  # fmt: skip
        n_slots = gl.load(cu_ptr + num_seqs) // (CONSUMERS * P) + num_seqs
        worker_args = (o_ptr, lse_ptr, delta_ptr, q_desc, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem,
                       info_smem, item_ready, item_empty, k_ready, k_empty, v_ready, v_empty, tail_bars, cu_ptr,
                       num_seqs, seqk_ptr, kv_rows, n_slots, heads, counter_ptr, qk_scale, stride_ot, stride_oh,
                       stride_lt, stride_lh, o_desc)  # fmt: skip
        consumer_args = (o_ptr, lse_ptr, delta_ptr, o_desc, q_smem, ones_smem, k_smem, v_smem, info_smem, item_ready,
                         item_empty, k_ready, k_empty, v_ready, v_empty, tail_bars, qk_scale, stride_ot, stride_oh,
                         stride_lt, stride_lh, 0)  # fmt: skip
        if CONSUMERS == 2:
            gl.warp_specialize([(_consume, consumer_args), (_worker_consumer, worker_args),
                                (_worker_producer, worker_args)], [W, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
        else:  # the program's warps are the consumer
            gl.warp_specialize([(_consume, consumer_args), (_worker_producer, worker_args)], [1], [PRODUCER_REGS])


@dataclasses.dataclass(frozen=True)
class Build:
    """How :func:`kernel` builds the pair: K/V rings of ``ring_depth`` tiles and ``item_depth`` item slots (any depths
    give the same bits; at least two item slots, since a slot is released an item late), key tiles of ``tile_n`` keys
    (the library's bits only at :data:`rlexact.ops.gluon_attention.BLOCK_N`), and seven schedules that keep the bits
    (off by default, so a probe turns each on alone): ``sum_with_pv`` issues each key tile's row-sum wgmma with its P @
    V, both waited for after the next tile's softmax in the kernel's source (``ptxas`` moves that wait above the
    softmax); ``first_fold`` takes a query tile's first KV split as its state by adding ``+0``, which is what folding
    it into the empty state computes; ``tree_max`` takes each row's maximum as a
    tree (:func:`~rlexact.ops.gluon_attention.tile_softmax`'s ``TREE``); ``zero_start`` leaves a KV split's sum unscaled
    at its first key tile, where the scaling multiplies ``+0`` by ``+0``; ``one_bound`` masks each score with one
    comparison (:func:`~rlexact.ops.gluon_attention.mask_scores`'s ``ONE_BOUND``). ``wide`` runs one consumer partition
    of ``2 * WARPS`` warps, the program's own, with both query tiles of an item as one tile (the same rows, so the same
    bits) in place of two partitions of ``WARPS`` warps, one per tile: both warp groups run one instruction stream.
    ``column_sums`` (with ``sum_with_pv``) keeps a split's sum per column of the row-sum product and reduces the columns
    once per split (``PAIR_COLUMN_SUMS``); ``row_sum_n`` is that product's width, the ones tile's columns (8 or 16: any
    column is the row sum)."""

    ring_depth: int = RING_DEPTH
    item_depth: int = ITEM_DEPTH
    tile_n: int = ga.BLOCK_N
    sum_with_pv: bool = False
    first_fold: bool = False
    tree_max: bool = False
    zero_start: bool = False
    one_bound: bool = False
    wide: bool = False
    column_sums: bool = False
    row_sum_n: int = 16

    @property
    def warps(self) -> int:
        """Warps of each consumer partition."""
        return 2 * WARPS if self.wide else WARPS

    @property
    def consumers(self) -> int:
        """Consumer partitions (each with one query tile of an item)."""
        return 1 if self.wide else 2

    def __post_init__(self) -> None:
        if self.ring_depth < 2 or self.item_depth < 2:
            raise ValueError(f"gluon_attention_pair.Build: ring_depth and item_depth must be >= 2 (an item slot is "
                             f"released an item late), got {self.ring_depth} and {self.item_depth}")  # fmt: skip
        if self.tile_n not in (64, 128):
            raise ValueError(f"gluon_attention_pair.Build: tile_n must be 64 or 128, got {self.tile_n}")
        if self.row_sum_n not in (8, 16):
            raise ValueError(f"gluon_attention_pair.Build: row_sum_n must be 8 or 16, got {self.row_sum_n}")
        if self.column_sums and not self.sum_with_pv:
            raise ValueError("gluon_attention_pair.Build: column_sums needs sum_with_pv (the row sum waited for "
                             "with P @ V)")


LIBRARY_BUILD = Build(sum_with_pv=True, first_fold=True, tree_max=True, zero_start=True, one_bound=True,
                      column_sums=True, row_sum_n=8)
"""The library's build: the schedules that keep the bits and run one instruction stream per consumer, with column
sums over an 8-column row-sum product (chosen by ``benchmarks/pair_depth_probe.py``; ``wide`` and the 16-column product
measured slower)."""


@functools.cache
def kernel(hp: int, split: int, bwd_prep: bool, group: int, gathered: bool, build: Build = LIBRARY_BUILD) -> object:
    """The kernel for ``hp`` query heads per tile, KV splits of ``split`` keys, with ``bwd_prep`` the backward's
    preprocessing, ``group`` query heads per KV head, with ``gathered`` gathered keys, built as ``build``: the call
    tree bound to these constants (built once per specialization and kept alive, since the cached launchers key on
    the kernel object)."""
    consts = dict(PAIR_HP=gl.constexpr(hp), PAIR_SPLIT=gl.constexpr(split), PAIR_BWD_PREP=gl.constexpr(bwd_prep),
                  PAIR_GROUP=gl.constexpr(group), PAIR_GATHERED=gl.constexpr(gathered),
                  SLOTS=gl.constexpr(build.ring_depth), ITEM_SLOTS=gl.constexpr(build.item_depth),
                  TILE_N=gl.constexpr(build.tile_n), PAIR_SUM_WITH_PV=gl.constexpr(build.sum_with_pv),
                  PAIR_FIRST_FOLD=gl.constexpr(build.first_fold), PAIR_TREE_MAX=gl.constexpr(build.tree_max),
                  PAIR_ZERO_START=gl.constexpr(build.zero_start), PAIR_ONE_BOUND=gl.constexpr(build.one_bound),
                  PAIR_COLUMN_SUMS=gl.constexpr(build.column_sums),
                  ROW_SUM_N=gl.constexpr(build.row_sum_n),
                  W=gl.constexpr(build.warps),
                  CONSUMERS=gl.constexpr(build.consumers))  # fmt: skip
    item = ga.rebind(_item, **consts)
    rows = ga.rebind(_rows, **consts)
    consume = ga.rebind(_consume, _rows=rows, **consts)
    produce = ga.rebind(_produce, _item=item, **consts)
    worker = ga.rebind(_worker_consumer, _consume=consume)
    producer = ga.rebind(_worker_producer, _produce=produce)
    return ga.rebind(_pair_kernel, _consume=consume, _worker_consumer=worker, _worker_producer=producer, **consts)


def chosen(num_tokens: int, num_seqs: int) -> bool:
    """Whether a packed launch of ``num_tokens`` query rows over ``num_seqs`` sequences takes this kernel (decided on
    the host, from sizes only: either kernel gives the same bits)."""
    return num_tokens >= MIN_MEAN_KEYS * num_seqs


def takes(*tensors: torch.Tensor) -> bool:
    """Whether TMA reads and writes query tiles of each of ``tensors`` (the queries and the output: positions and
    heads 16-byte aligned, head dim contiguous), which this kernel needs on top of
    :func:`rlexact.ops.gluon_attention.supported`."""
    return all(t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 and t.stride(2) == 1 and t.data_ptr() % 16 == 0
               for t in tensors)  # fmt: skip


@functools.cache
def q_layout(fp16: bool, positions: int, hp: int) -> object:
    """The shared-memory layout of a query tile, ``[positions, hp, head dim]`` (built once per shape)."""
    return gl.NVMMASharedLayout.get_default_for([positions, hp, ga.HEAD_DIM], gl.float16 if fp16 else gl.bfloat16)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, out: torch.Tensor,
            hp: int, split: int, lse_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
            gathered: tuple[torch.Tensor, int] | None = None, programs: int | None = None, *,
            build: Build = LIBRARY_BUILD) -> tuple[ga.PackedPlan, tuple]:  # fmt: skip
    """:func:`rlexact.ops.gluon_attention.forward` (same arguments, contract, bits and return) through the paired
    kernel, over at most ``programs`` programs (None: :data:`PROGRAMS_PER_SM` per SM), which draw the items in order
    from a counter, built as ``build``. Call only where :func:`rlexact.ops.gluon_attention.supported` and
    :func:`takes` of ``q`` and ``out`` hold."""
    if programs is None:
        programs = PROGRAMS_PER_SM * num_sms(q.device)
    fp16 = q.dtype == torch.float16
    pair = plan(hp, q.shape[1], k.shape[1], split, lse_delta is not None, gathered is not None, programs, fp16, build)
    return pair, ga.launch_plan(pair, q, k, v, cu, scale, out, lse_delta, gathered)


@functools.cache
def plan(hp: int, hq: int, hkv: int, split: int, bwd_prep: bool, gathered: bool, programs: int, fp16: bool,
         build: Build = LIBRARY_BUILD) -> ga.PackedPlan:  # fmt: skip
    """:func:`forward`'s plan for ``hq`` query heads over ``hkv`` KV heads, ``hp`` per tile, at most ``programs``
    programs, fp16 or bf16 inputs, built as ``build``: a descriptor kernel's plan whose tile slots hold both query
    tiles of an item."""
    positions = 16 * build.warps // hp
    bound = kernel(hp, split, bwd_prep, hq // hkv, gathered, build)
    options = MappingProxyType({"num_warps": build.warps, "maxnreg": MAXNREG})
    return ga.PackedPlan(bound, options, build.tile_n, (hq // hp,), build.consumers * positions, hq // hp,
                         [positions, hp, ga.HEAD_DIM], q_layout(fp16, positions, hp), programs)  # fmt: skip
