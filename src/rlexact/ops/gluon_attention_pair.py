"""The exact packed attention forward for long sequences: :mod:`rlexact.ops.gluon_attention`'s rows, warp-specialized.

One program holds two adjacent query tiles of one sequence and head group, each in its own 4-warp consumer partition
(the default partition and a worker), beside a one-warp producer partition that streams K and V tiles through
four-deep TMA rings. Every K/V tile is copied once for both query tiles, and the consumers issue no copies; a slot is
released once both consumers are done with it (a consumer whose rows need fewer tiles releases the rest unread). Each
consumer runs the library kernel's pipelined loop over its own key tiles, with the same key tiles, KV splits, per-row
operations and fold order, so its rows are the library's bits (docs/design.md §2.4): the dispatch between the two
kernels changes the speed only. The V tile that runs past the sequence is zeroed past it by the consumer that reads
it last in tile order (consumer 0 when it needs that tile), which then signals the other.

The program uses most of an SM's shared memory, so one runs per SM: long sequences gain from the shared copies,
short ones lose the overlap of two resident programs' prologues and epilogues (:data:`MIN_MEAN_KEYS`).

Triton 3.6's Gluon passes a worker partition's arguments without their constexpr-ness, so the worker consumer's
compile-time parameters (query heads per tile, the backward's preprocessing) are module globals bound per
specialization (:func:`kernel`); only the bound copies are launched.
"""

from __future__ import annotations

import functools

import torch

from . import gluon_attention as ga
from .triton_shared import cuda_props

if ga.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_attention import (
        cta_barrier,
        fold,
        key_rows,
        load_rows,
        locate,
        mask_scores,
        rings,
        store_rows,
        tile_softmax,
        wgmma_layout,
        zero_tail_rows,
    )

__all__ = ["MIN_MEAN_KEYS", "chosen", "forward", "kernel"]

MIN_MEAN_KEYS = 4096
"""Mean keys per sequence from which a packed launch takes this kernel (``benchmarks/results/ops_attention_h200.json``,
each prefill case's ``gluon_kernels``: faster at this mean and, in most runs, at twice it; equal at half it; slower
below)."""
WARPS = 4
"""Warps of each consumer partition (16 query rows per warp), as the library kernel's program."""
PROGRAMS_PER_SM = 1
"""Programs launched per SM, each looping over its share of the items (one fits: the rings take most of the shared
memory); more items than programs makes the kernel persistent."""
MAXNREG = 168
"""Registers per thread at launch over the program's nine warps; the partitions then take :data:`CONSUMER_REGS` and
:data:`PRODUCER_REGS`."""

if ga.gluon is not None:
    SLOTS = gl.constexpr(4)
    """Depth of the K ring and of the V ring."""
    TILE_N = gl.constexpr(ga.BLOCK_N)
    HEAD_D = gl.constexpr(ga.HEAD_DIM)
    W = gl.constexpr(WARPS)
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

    @gluon.jit
    def _item(cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads, i, LANES: gl.constexpr):
        """Work item ``i`` of a launch over ``n_slots`` pair slots and ``heads`` head groups, the costliest first:
        ``(has rows, first query row, pair, head group, queries, keys, first key row, first query's position, key
        tiles)`` of pair slot ``n_slots - 1 - i // heads`` and head group ``i % heads`` (``LANES``: the warps that
        look it up)."""
        P: gl.constexpr = 16 * W // PAIR_HP
        hgroup = i % heads
        b, q_begin, pair = locate(cu_ptr, num_seqs, n_slots - 1 - i // heads, 2 * P, PAIR_SCAN, LANES)
        nq = gl.load(cu_ptr + b + 1) - q_begin
        nk, kv_begin, q_start = key_rows(seqk_ptr, kv_rows, b, q_begin, nq, PAIR_GATHERED)
        n_tiles = (q_start + gl.minimum(pair * 2 * P + 2 * P, nq) - 1) // TILE_N + 1
        return pair * 2 * P < nq, q_begin, pair, hgroup, nq, nk, kv_begin, q_start, n_tiles

    @gluon.jit
    def _produce(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, cu_ptr, num_seqs, seqk_ptr,
                 kv_rows, n_slots, heads):  # fmt: skip
        """For each item of this program, copy its K tile x and then V tile x into ring slot ``(x0 + x) % SLOTS``
        (``x0``: the tiles of the program's items before it), each once both consumers released it."""
        nbytes: gl.constexpr = k_desc.block_type.nbytes
        x0 = gl.program_id(0) * 0
        for i in range(gl.program_id(0), n_slots * heads, gl.num_programs(0)):
            valid, q_begin, pair, hgroup, nq, nk, kv_begin, q_start, n_tiles = _item(cu_ptr, num_seqs, seqk_ptr,
                                                                                     kv_rows, n_slots, heads, i, 1)
            if valid:
                kv_col = (hgroup * PAIR_HP) // PAIR_GROUP * HEAD_D
                base = kv_begin - x0 * TILE_N  # ring tile r is key tile r - x0
                for r in range(x0, x0 + n_tiles):
                    phase = ((r // SLOTS) & 1) ^ 1  # a fresh barrier counts as released: the first pass does not wait
                    mbarrier.wait(k_empty.index(r % SLOTS), phase)
                    load_rows(k_desc, k_smem, k_ready, r, base, kv_col, SLOTS, TILE_N, nbytes)
                    mbarrier.wait(v_empty.index(r % SLOTS), phase)
                    load_rows(v_desc, v_smem, v_ready, r, base, kv_col, SLOTS, TILE_N, nbytes)
                x0 += n_tiles

    @gluon.jit
    def _rows(o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
              tail_bars, q_begin, nq, nk, q_start, tile, hgroup, n_mine, x0, tail, zero_here, tail_phase, qk_scale,
              stride_ot, stride_oh, stride_lt, stride_lh, HP: gl.constexpr, SPLIT: gl.constexpr,
              BWD_PREP: gl.constexpr, dt: gl.constexpr):  # fmt: skip
        """Query tile ``tile`` (its Q in ``q_smem``; query ``i`` at position ``q_start + i`` of ``nk`` keys) over key
        tiles ``0 .. n_mine - 1``, key tile ``j`` in ring slot ``(x0 + j) % SLOTS``: the library's pipelined loop,
        each K slot released once its scores are done and each V slot once its P @ V is. Key tile ``tail`` runs past
        the sequence: its V rows there are zeroed here (``zero_here``, then the slot's tail barrier is signalled) or
        by the other consumer (the barrier's phase ``tail_phase`` is waited for)."""
        D: gl.constexpr = HEAD_D
        BLOCK_M: gl.constexpr = 16 * W
        BLOCK_N: gl.constexpr = TILE_N
        P: gl.constexpr = BLOCK_M // HP
        TPS: gl.constexpr = SPLIT // BLOCK_N
        s_layout: gl.constexpr = wgmma_layout(W, BLOCK_N)
        o_layout: gl.constexpr = wgmma_layout(W, D)
        r_layout: gl.constexpr = wgmma_layout(W, 16)
        r_op: gl.constexpr = gl.DotOperandLayout(0, r_layout, 2)
        pv_op: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        n_full = (q_start + tile * P + 1) // BLOCK_N
        pos = q_start + tile * P + gl.arange(0, BLOCK_M, layout=row_s) // HP
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)
        for t0 in range(0, n_mine, TPS):
            t1 = gl.minimum(t0 + TPS, n_mine)
            m_s = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc_s = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
            r0 = x0 + t0
            mbarrier.wait(k_ready.index(r0 % SLOTS), (r0 // SLOTS) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(r0 % SLOTS).permute((1, 0)), s_zero, use_acc=False)
            mbarrier.arrive(k_empty.index(r0 % SLOTS), count=1)
            m_s, alpha, p = tile_softmax(mask_scores(s, t0, n_full, pos, offs_n, nk, BLOCK_N), m_s, qk_scale,
                                            dt)  # fmt: skip
            rsum = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False)
            l_s = gl.fma(l_s, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
            p_op = gl.convert_layout(p, pv_op)
            for j in range(t0, t1 - 1):  # tile j's P @ V, tile j + 1's scores and softmax
                r = x0 + j
                nxt = (r + 1) % SLOTS
                mbarrier.wait(k_ready.index(nxt), ((r + 1) // SLOTS) & 1)
                s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
                mbarrier.wait(v_ready.index(r % SLOTS), (r // SLOTS) & 1)
                acc_tok = warpgroup_mma(p_op, v_smem.index(r % SLOTS), acc_s, is_async=True)
                s, acc_s, p_op = warpgroup_mma_wait(1, deps=(s_tok, acc_tok, p_op))  # the scores; P @ V may run
                mbarrier.arrive(k_empty.index(nxt), count=1)
                m_s, alpha, p = tile_softmax(mask_scores(s, j + 1, n_full, pos, offs_n, nk, BLOCK_N), m_s,
                                                qk_scale, dt)  # fmt: skip
                r_tok = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False, is_async=True)
                rsum, acc_s, p_op = warpgroup_mma_wait(0, deps=(r_tok, acc_s, p_op))
                mbarrier.arrive(v_empty.index(r % SLOTS), count=1)
                l_s = gl.fma(l_s, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
                p_op = gl.convert_layout(p, pv_op)
            jl = t1 - 1  # the split's last tile: its P @ V, then the fold
            rl = (x0 + jl) % SLOTS
            acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.wait(v_ready.index(rl), ((x0 + jl) // SLOTS) & 1)
            if jl == tail:  # V rows past the sequence: zeros, whatever the next sequence holds
                if zero_here:
                    zero_tail_rows(v_smem.index(rl), jl * BLOCK_N, nk, BLOCK_N, blk)
                    mbarrier.arrive(tail_bars.index(rl), count=1)
                else:
                    mbarrier.wait(tail_bars.index(rl), tail_phase)
            acc_s = warpgroup_mma(p_op, v_smem.index(rl), acc_s)
            mbarrier.arrive(v_empty.index(rl), count=1)
            m_i, l_i, acc = fold(m_i, l_i, acc, m_s, l_s, acc_s, o_layout)
        store_rows(o_ptr, lse_ptr, delta_ptr, acc, m_i, l_i, q_begin, nq, tile, hgroup, stride_ot, stride_oh,
                      stride_lt, stride_lh, HP, P, D, BLOCK_M, BWD_PREP, o_layout)  # fmt: skip

    @gluon.jit
    def _consume(q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready,
                 v_empty, tail_bars, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads, qk_scale, stride_qt,
                 stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, C: gl.constexpr):  # fmt: skip
        """Consumer ``C``: for each item of this program, query tile ``2 * pair + C`` (its Q loaded here), the key
        tiles its rows need, then the release of those only the other consumer needs. ``tail_parity`` holds, per
        ring slot, the phase of its tail barrier's next completion (both consumers count every item's tail)."""
        HP: gl.constexpr = PAIR_HP
        D: gl.constexpr = HEAD_D
        BLOCK_M: gl.constexpr = 16 * W
        P: gl.constexpr = BLOCK_M // HP
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        dt: gl.constexpr = k_smem.dtype
        x0 = gl.program_id(0) * 0
        tail_parity = x0
        for i in range(gl.program_id(0), n_slots * heads, gl.num_programs(0)):
            valid, q_begin, pair, hgroup, nq, nk, kv_begin, q_start, n_tiles = _item(cu_ptr, num_seqs, seqk_ptr,
                                                                                     kv_rows, n_slots, heads, i, W)
            if valid:
                tile = 2 * pair + C
                n_mine = gl.where(tile * P < nq, (q_start + gl.minimum(tile * P + P, nq) - 1) // TILE_N + 1, 0)
                n_first = (q_start + gl.minimum(2 * pair * P + P, nq) - 1) // TILE_N + 1  # consumer 0 has rows
                tail = gl.where(n_tiles * TILE_N > nk, n_tiles - 1, -1)  # the key tile past the sequence, if any
                zeroer = gl.where(n_first == n_tiles, 0, 1)  # consumer 0 when it reads that tile, else consumer 1
                tail_slot = (x0 + n_tiles - 1) % SLOTS
                if n_mine > 0:
                    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
                    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
                    qi = tile * P + rows // HP
                    q_rows = (q_begin + qi).to(gl.int64) * stride_qt + (hgroup * HP + rows % HP) * stride_qh
                    q = gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=(qi < nq)[:, None], other=0.0)
                    cta_barrier()  # the last item's wgmmas read q_smem in every warp
                    q_smem.store(q)
                    fence_async_shared()
                    cta_barrier()
                    _rows(o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready,
                          v_empty, tail_bars, q_begin, nq, nk, q_start, tile, hgroup, n_mine, x0, tail, zeroer == C,
                          (tail_parity >> tail_slot) & 1, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh, HP,
                          PAIR_SPLIT, PAIR_BWD_PREP, dt)  # fmt: skip
                for r in range(x0 + n_mine, x0 + n_tiles):
                    mbarrier.wait(k_ready.index(r % SLOTS), (r // SLOTS) & 1)
                    mbarrier.arrive(k_empty.index(r % SLOTS), count=1)
                    mbarrier.wait(v_ready.index(r % SLOTS), (r // SLOTS) & 1)
                    mbarrier.arrive(v_empty.index(r % SLOTS), count=1)
                if tail >= 0:
                    tail_parity = tail_parity ^ (1 << tail_slot)
                x0 += n_tiles

    @gluon.jit
    def _worker_consumer(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem,
                         k_ready, k_empty, v_ready, v_empty, tail_bars, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots,
                         heads, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                         stride_lh):  # fmt: skip
        """Consumer 1 (the worker partitions share one argument list)."""
        _consume(q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem.index(1), ones_smem, k_smem, v_smem, k_ready, k_empty,
                 v_ready, v_empty, tail_bars, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads, qk_scale,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, 1)  # fmt: skip

    @gluon.jit
    def _worker_producer(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem,
                         k_ready, k_empty, v_ready, v_empty, tail_bars, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots,
                         heads, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                         stride_lh):  # fmt: skip
        """The producer (the worker partitions share one argument list)."""
        _produce(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, cu_ptr, num_seqs, seqk_ptr,
                 kv_rows, n_slots, heads)  # fmt: skip

    @gluon.jit
    def _pair_kernel(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, cu_ptr, num_seqs, qk_scale, stride_qt,
                     stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, seqk_ptr, kv_rows, heads):  # fmt: skip
        gl.static_assert(PAIR_HP > 0, "launch a specialization bound by rlexact.ops.gluon_attention_pair.kernel")
        D: gl.constexpr = HEAD_D
        BLOCK_M: gl.constexpr = 16 * W
        P: gl.constexpr = BLOCK_M // PAIR_HP
        dt: gl.constexpr = q_ptr.dtype.element_ty
        q_smem = gl.allocate_shared_memory(dt, [2, BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt))
        tail_bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(SLOTS):
            mbarrier.init(tail_bars.index(s), count=1)
        ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = rings(k_desc, v_desc, SLOTS, TILE_N, W, 2)
        n_slots = gl.load(cu_ptr + num_seqs) // (2 * P) + num_seqs
        worker_args = (q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem, k_ready,
                       k_empty, v_ready, v_empty, tail_bars, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads,
                       qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh)  # fmt: skip
        gl.warp_specialize(
            [
                (_consume, (q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem.index(0), ones_smem, k_smem, v_smem, k_ready,
                            k_empty, v_ready, v_empty, tail_bars, cu_ptr, num_seqs, seqk_ptr, kv_rows, n_slots, heads,
                            qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, 0)),
                (_worker_consumer, worker_args),
                (_worker_producer, worker_args),
            ],
            [W, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


@functools.cache
def kernel(hp: int, split: int, bwd_prep: bool, group: int, gathered: bool) -> object:
    """The kernel for ``hp`` query heads per tile, KV splits of ``split`` keys, with ``bwd_prep`` the backward's
    preprocessing, ``group`` query heads per KV head and, with ``gathered``, gathered keys: the call tree bound to
    these constants (built once per specialization and kept alive, since the cached launchers key on the kernel
    object)."""
    consts = dict(PAIR_HP=gl.constexpr(hp), PAIR_SPLIT=gl.constexpr(split), PAIR_BWD_PREP=gl.constexpr(bwd_prep),
                  PAIR_GROUP=gl.constexpr(group), PAIR_GATHERED=gl.constexpr(gathered))  # fmt: skip
    item = ga.rebind(_item, **consts)
    consume = ga.rebind(_consume, _item=item, **consts)
    produce = ga.rebind(_produce, _item=item, **consts)
    worker = ga.rebind(_worker_consumer, _consume=consume)
    producer = ga.rebind(_worker_producer, _produce=produce)
    return ga.rebind(_pair_kernel, _consume=consume, _worker_consumer=worker, _worker_producer=producer, **consts)


def chosen(num_tokens: int, num_seqs: int) -> bool:
    """Whether a packed launch of ``num_tokens`` query rows over ``num_seqs`` sequences takes this kernel (decided on
    the host, from sizes only: either kernel gives the same bits)."""
    return num_tokens >= MIN_MEAN_KEYS * num_seqs


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, out: torch.Tensor,
            hp: int, split: int, lse_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
            gathered: tuple[torch.Tensor, int] | None = None, programs: int | None = None) -> None:  # fmt: skip
    """:func:`rlexact.ops.gluon_attention.forward` (same arguments, contract and bits) through the paired kernel, over
    at most ``programs`` programs (None: :data:`PROGRAMS_PER_SM` per SM; each takes every ``programs``-th item).
    Call only where :func:`rlexact.ops.gluon_attention.supported` holds."""
    if programs is None:
        programs = PROGRAMS_PER_SM * cuda_props(q.get_device())[1]
    bound = kernel(hp, split, lse_delta is not None, q.shape[1] // k.shape[1], gathered is not None)
    ga.launch_packed(bound, q, k, v, cu, scale, out, hp, 2 * 16 * WARPS, lse_delta, (),
                     {"num_warps": WARPS, "maxnreg": MAXNREG}, gathered, programs)  # fmt: skip
