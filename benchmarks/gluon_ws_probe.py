"""Probe: the exact Gluon attention forward warp-specialized (a TMA producer warp beside 128-row consumer warps),
against the library's forward and SDPA.

    timeout 300 python benchmarks/gluon_ws_probe.py [--kinds ws pair] [--out ...gluon_ws_probe_h200.json]

The library's forward (``rlexact.ops.gluon_attention``) runs two 64-row programs per SM, each issuing its own K/V
copies between its MMAs. Here one program per SM holds 128 query rows in an 8-warp default partition (two warp
groups, each its own wgmmas, the library's pipelined loop: tile j + 1's scores and softmax under tile j's P @ V) and
one producer warp (``gl.warp_specialize``) that streams K and V tiles through four-deep rings, each slot released by
the consumers once the MMAs that read it are done. The K/V tiles are copied once for 128 rows instead of twice for
64, and the consumers issue no copies. The per-row operations and their order are the library's, so the rows are
its bits: checked bitwise on packed sequences of mixed lengths (partial tiles, KV splits), with and without the
backward's preprocessing, and at every timing shape; a perturbed key must change the output (negative control).

``pair`` is the same with the two warp groups in two partitions (the default one and a worker, 64 rows each, two
adjacent query tiles of one sequence), so neither waits for the other at a barrier and their softmax and MMAs can
interleave; K/V slots are released once both consumers are done with them, and the V tile that ends a sequence is
zeroed past it by one consumer, which signals the other. Gluon in Triton 3.6 drops the constexpr-ness of a worker
partition's arguments, and its worker partitions take the same argument list, so the worker consumer's shape
parameters are module-level constexprs (:data:`PAIR_HP`: the 16 / 8 heads of the timing shapes) and both workers
receive one tuple. ``pingpong`` is ``pair`` with the two consumers' MMA rounds alternating (FlashAttention-3's
ping-pong schedule, with two mbarriers in place of named barriers, which Triton 3.6's Gluon lacks): each round
(tile ``j + 1``'s scores and tile ``j``'s P @ V) waits until the other consumer has issued its previous one, so one
consumer's softmax runs under the other's MMAs (:func:`_rows`). Timings are CUDA-graph replays at the ``ops_bench``
attention shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from common import ROOT, bench_graph, header, packed_attention_inputs, sdpa_causal_us
from rlexact.ops import gluon_attention as ga
from rlexact.ops import triton_attention as ta
from rlexact.ops.gluon_attention import (
    cta_barrier,
    fold,
    load_rows,
    locate,
    mask_scores,
    store_rows,
    tile_softmax,
    wgmma_layout,
    zero_tail_rows,
)
from rlexact.ops.triton_shared import COMPILE_OPTIONS

HQ, HKV, D = 16, 8, 128
SCALE = 1 / math.sqrt(D)
SPLIT = ta.SPLIT_KEYS_16BIT
WARPS = 8
"""Consumer warps (two warp groups, 16 query rows per warp: 128-row tiles)."""
MAXNREG = 168
"""Registers per thread over the program's three warp groups (65,536 / 384, rounded down to a multiple of 8); the
producer group keeps :data:`PRODUCER_REGS` and the consumers get the rest."""
PRODUCER_REGS = gl.constexpr(24)
PAIR_REGS = gl.constexpr(240)
"""Registers per thread of the ``pair`` kernel's worker consumer (the default consumer gets the same)."""
SLOTS = gl.constexpr(4)
"""Depth of the K ring and of the V ring."""
TILE_N = gl.constexpr(ga.BLOCK_N)
PAIR_HP = gl.constexpr(HQ // HKV)
"""Query heads per tile of the ``pair`` kernel (a worker partition cannot take it as a constexpr argument)."""
PAIR_D = gl.constexpr(D)
PAIR_SPLIT = gl.constexpr(SPLIT)
PAIR_W = gl.constexpr(4)
PAIR_DT = gl.constexpr(gl.bfloat16)
CHECK_LENS = (
    [1, 37, 200, 333, 64, 65],
    [1024, 1000, 17, 513],
    [1100, 300, 37, 9],
    [2500, 31, 1024, 1025, 2049],
    [5000, 3, 70] * 3,
    [7] * 300,
)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_tiles, q_begin, kv_col):
    """Copy K tile x and then V tile x into slot x % SLOTS of their rings, each once the consumers released it."""
    for x in range(n_tiles):
        slot = x % SLOTS
        phase = ((x // SLOTS) & 1) ^ 1  # a fresh barrier counts as released: the first pass does not wait
        mbarrier.wait(k_empty.index(slot), phase)
        load_rows(k_desc, k_smem, k_ready, x, q_begin, kv_col, SLOTS, TILE_N, k_desc.block_type.nbytes)
        mbarrier.wait(v_empty.index(slot), phase)
        load_rows(v_desc, v_smem, v_ready, x, q_begin, kv_col, SLOTS, TILE_N, v_desc.block_type.nbytes)


@gluon.jit
def _await_turn(turn_bar, r, rounds_other, C: gl.constexpr):
    """Ping-pong: before consumer ``C`` issues round ``r``, wait until the other consumer issued the round before
    it in the alternation (if the other has that round)."""
    if C == 0:
        if (r > 0) & (r - 1 < rounds_other):
            mbarrier.wait(turn_bar.index(0), (r - 1) & 1)
    else:
        if r < rounds_other:
            mbarrier.wait(turn_bar.index(1), r & 1)


@gluon.jit
def _pass_turn(turn_bar, r, rounds_other, C: gl.constexpr):
    """Ping-pong: once consumer ``C`` issued round ``r``, let the other issue its next round (if it has one)."""
    if C == 0:
        if r < rounds_other:
            mbarrier.arrive(turn_bar.index(1), count=1)
    else:
        if r + 1 < rounds_other:
            mbarrier.arrive(turn_bar.index(0), count=1)


@gluon.jit
def _rounds(n_mine):
    """The pipelined loop's rounds over ``n_mine`` key tiles: one per tile but the last of each KV split."""
    TPS: gl.constexpr = PAIR_SPLIT // TILE_N
    return n_mine - (n_mine + TPS - 1) // TPS


@gluon.jit
def _rows(o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, tail_bar,
          turn_bar, q_begin, nq, tile, hgroup, n_mine, tail, zero_here, rounds_other, qk_scale, stride_ot, stride_oh,
          stride_lt, stride_lh, HP: gl.constexpr, D: gl.constexpr, SPLIT: gl.constexpr, BWD_PREP: gl.constexpr,
          W: gl.constexpr, dt: gl.constexpr, C: gl.constexpr, PP: gl.constexpr):  # fmt: skip
    """Query tile ``tile`` (its Q in ``q_smem``) over key tiles ``0 .. n_mine - 1`` from the producer's rings: the
    library's pipelined loop, each K slot released once its scores are done and each V slot once its P @ V is. Key
    tile ``tail`` runs past the sequence: its V rows there are zeroed here (``zero_here``, then ``tail_bar`` is
    signalled) or by the other consumer (``tail_bar`` is waited for).

    ``PP`` (ping-pong, consumer ``C`` of a pair): the loop's rounds (each one issuing tile ``j + 1``'s scores and
    tile ``j``'s P @ V) alternate between the consumers, consumer 0 first, so one's softmax runs under the other's
    MMAs: round ``r`` of consumer 1 waits on ``turn_bar[1]`` for consumer 0's round ``r`` to be issued, round ``r``
    of consumer 0 on ``turn_bar[0]`` for consumer 1's round ``r - 1``; a consumer waits only for rounds the other
    has (``rounds_other``) and signals only rounds the other waits for, so each barrier completes once per wait."""
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

    n_full = (tile * P + 1) // BLOCK_N
    pos = tile * P + gl.arange(0, BLOCK_M, layout=row_s) // HP
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)
    r = 0
    for t0 in range(0, n_mine, TPS):
        t1 = gl.minimum(t0 + TPS, n_mine)
        m_s = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc_s = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        mbarrier.wait(k_ready.index(t0 % SLOTS), (t0 // SLOTS) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(t0 % SLOTS).permute((1, 0)), s_zero, use_acc=False)
        mbarrier.arrive(k_empty.index(t0 % SLOTS), count=1)
        m_s, alpha, p = tile_softmax(mask_scores(s, t0, n_full, pos, offs_n, nq, BLOCK_N), m_s, qk_scale, dt)
        rsum = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False)
        l_s = gl.fma(l_s, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
        p_op = gl.convert_layout(p, pv_op)
        for j in range(t0, t1 - 1):
            nxt = (j + 1) % SLOTS
            mbarrier.wait(k_ready.index(nxt), ((j + 1) // SLOTS) & 1)
            if PP:
                _await_turn(turn_bar, r, rounds_other, C)
            s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.wait(v_ready.index(j % SLOTS), (j // SLOTS) & 1)
            acc_tok = warpgroup_mma(p_op, v_smem.index(j % SLOTS), acc_s, is_async=True)
            if PP:
                _pass_turn(turn_bar, r, rounds_other, C)
            r += 1
            s, acc_s, p_op = warpgroup_mma_wait(1, deps=(s_tok, acc_tok, p_op))
            mbarrier.arrive(k_empty.index(nxt), count=1)
            m_s, alpha, p = tile_softmax(mask_scores(s, j + 1, n_full, pos, offs_n, nq, BLOCK_N), m_s, qk_scale,
                                         dt)  # fmt: skip
            r_tok = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False, is_async=True)
            rsum, acc_s, p_op = warpgroup_mma_wait(0, deps=(r_tok, acc_s, p_op))
            mbarrier.arrive(v_empty.index(j % SLOTS), count=1)
            l_s = gl.fma(l_s, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
            p_op = gl.convert_layout(p, pv_op)
        jl = t1 - 1
        acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_ready.index(jl % SLOTS), (jl // SLOTS) & 1)
        if jl == tail:
            if zero_here:
                zero_tail_rows(v_smem.index(jl % SLOTS), jl * BLOCK_N, nq, BLOCK_N, blk)
                mbarrier.arrive(tail_bar, count=1)
            else:
                mbarrier.wait(tail_bar, 0)
        acc_s = warpgroup_mma(p_op, v_smem.index(jl % SLOTS), acc_s)
        mbarrier.arrive(v_empty.index(jl % SLOTS), count=1)
        m_i, l_i, acc = fold(m_i, l_i, acc, m_s, l_s, acc_s, o_layout)
    store_rows(o_ptr, lse_ptr, delta_ptr, acc, m_i, l_i, q_begin, nq, tile, hgroup, stride_ot, stride_oh, stride_lt,
               stride_lh, HP, P, D, BLOCK_M, BWD_PREP, o_layout)  # fmt: skip


@gluon.jit
def _ws_consumer(o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                 tail_bar, q_begin, nq, tile, hgroup, n_tiles, qk_scale, stride_ot, stride_oh, stride_lt, stride_lh,
                 HP: gl.constexpr, D: gl.constexpr, SPLIT: gl.constexpr, BWD_PREP: gl.constexpr, W: gl.constexpr,
                 dt: gl.constexpr):  # fmt: skip
    """The ``ws`` kernel's one consumer partition (all of the program's query rows)."""
    tail = gl.where(n_tiles * TILE_N > nq, n_tiles - 1, -1)
    _rows(o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, tail_bar,
          tail_bar, q_begin, nq, tile, hgroup, n_tiles, tail, True, 0, qk_scale, stride_ot, stride_oh, stride_lt,
          stride_lh, HP, D, SPLIT, BWD_PREP, W, dt, 0, False)  # fmt: skip


@gluon.jit
def _rings(k_desc, v_desc, CONSUMERS: gl.constexpr, W: gl.constexpr):
    """The ones tile of the row-sum dot, the K and V rings with their ready / empty barriers (each slot released by
    ``CONSUMERS`` consumer partitions), the tail barrier and the ping-pong turn barriers."""
    dt: gl.constexpr = k_desc.dtype
    ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [W, 1], [1, 0])
    ones_smem = gl.allocate_shared_memory(dt, [TILE_N, 16], gl.NVMMASharedLayout.get_default_for([TILE_N, 16],
                                                                                                 dt))  # fmt: skip
    ones_smem.store(gl.full([TILE_N, 16], 1.0, dt, layout=ones_layout))
    k_smem = gl.allocate_shared_memory(dt, [SLOTS, TILE_N, k_desc.block_type.shape[1]], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [SLOTS, TILE_N, v_desc.block_type.shape[1]], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    tail_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn_bar.index(0), count=1)
    mbarrier.init(turn_bar.index(1), count=1)
    for i in gl.static_range(SLOTS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    mbarrier.init(tail_bar, count=1)
    return ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, tail_bar, turn_bar


@gluon.jit
def _ws_fwd_kernel(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, cu_ptr, num_seqs, qk_scale, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, HP: gl.constexpr, GROUP: gl.constexpr,
                   D: gl.constexpr, SPLIT: gl.constexpr, BWD_PREP: gl.constexpr, SCAN: gl.constexpr,
                   W: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = 16 * W
    BLOCK_N: gl.constexpr = TILE_N
    P: gl.constexpr = BLOCK_M // HP
    dt: gl.constexpr = q_ptr.dtype.element_ty
    hgroup = gl.program_id(1)
    kv_col = (hgroup * HP) // GROUP * D
    b, q_begin, tile = locate(cu_ptr, num_seqs, gl.num_programs(0) - 1 - gl.program_id(0), P, SCAN, W)
    nq = gl.load(cu_ptr + b + 1) - q_begin
    if tile * P >= nq:
        return
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    qi = tile * P + rows // HP
    q_rows = (q_begin + qi).to(gl.int64) * stride_qt + (hgroup * HP + rows % HP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=(qi < nq)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dt, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt))
    q_smem.store(q)
    ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, tail_bar, _ = _rings(k_desc, v_desc, 1, W)
    fence_async_shared()
    cta_barrier()
    n_tiles = (gl.minimum(tile * P + P, nq) - 1) // BLOCK_N + 1
    gl.warp_specialize(
        [
            (_ws_consumer, (o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready,
                            v_empty, tail_bar, q_begin, nq, tile, hgroup, n_tiles, qk_scale, stride_ot, stride_oh,
                            stride_lt, stride_lh, HP, D, SPLIT, BWD_PREP, W, dt)),  # fmt: skip
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_tiles, q_begin,
                         kv_col)),  # fmt: skip
        ],
        [1],
        [PRODUCER_REGS],
    )


@gluon.jit
def _release(k_ready, k_empty, v_ready, v_empty, first, n_tiles):
    """Release K/V tiles ``first .. n_tiles - 1`` without reading them (a consumer whose rows need fewer tiles)."""
    for x in range(first, n_tiles):
        mbarrier.wait(k_ready.index(x % SLOTS), (x // SLOTS) & 1)
        mbarrier.arrive(k_empty.index(x % SLOTS), count=1)
        mbarrier.wait(v_ready.index(x % SLOTS), (x // SLOTS) & 1)
        mbarrier.arrive(v_empty.index(x % SLOTS), count=1)


@gluon.jit
def _pair_consumer(q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready,
                   v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, n_tiles, qk_scale, stride_qt, stride_qh,
                   stride_ot, stride_oh, stride_lt, stride_lh, C: gl.constexpr, BWD_PREP: gl.constexpr,
                   PP: gl.constexpr):  # fmt: skip
    """Consumer ``C`` of a pair: query tile ``2 * pair + C`` (its Q loaded here), then the key tiles its rows need
    (with ``PP`` in ping-pong with the other consumer, :func:`_rows`), then the release of the ones only the other
    consumer needs."""
    HP: gl.constexpr = PAIR_HP
    D: gl.constexpr = PAIR_D
    W: gl.constexpr = PAIR_W
    BLOCK_M: gl.constexpr = 16 * W
    P: gl.constexpr = BLOCK_M // HP
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    tile = 2 * pair + C
    n_mine = gl.where(tile * P < nq, (gl.minimum(tile * P + P, nq) - 1) // TILE_N + 1, 0)
    n_first = (gl.minimum(2 * pair * P + P, nq) - 1) // TILE_N + 1  # consumer 0 always has rows (the kernel checks)
    n_second = gl.where((2 * pair + 1) * P < nq, (gl.minimum((2 * pair + 1) * P + P, nq) - 1) // TILE_N + 1, 0)
    rounds_other = _rounds(n_second) if C == 0 else _rounds(n_first)
    tail = gl.where(n_tiles * TILE_N > nq, n_tiles - 1, -1)  # the key tile that runs past the sequence, if any
    zeroer = gl.where(n_first == n_tiles, 0, 1)  # consumer 0 when it reads that tile, else consumer 1
    if n_mine > 0:
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
        qi = tile * P + rows // HP
        q_rows = (q_begin + qi).to(gl.int64) * stride_qt + (hgroup * HP + rows % HP) * stride_qh
        q_smem.store(gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=(qi < nq)[:, None], other=0.0))
        fence_async_shared()
        cta_barrier()
        _rows(o_ptr, lse_ptr, delta_ptr, q_smem, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
              tail_bar, turn_bar, q_begin, nq, tile, hgroup, n_mine, tail, zeroer == C, rounds_other, qk_scale,
              stride_ot, stride_oh, stride_lt, stride_lh, HP, D, PAIR_SPLIT, BWD_PREP, W, PAIR_DT, C, PP)  # fmt: skip
    _release(k_ready, k_empty, v_ready, v_empty, n_mine, n_tiles)


@gluon.jit
def _pair_worker(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem, k_ready,
                 k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, kv_col, n_tiles, qk_scale,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, bwd_prep, pingpong):  # fmt: skip
    """Consumer 1 (worker partition); ``bwd_prep`` and ``pingpong`` are runtime flags here, since workers get no
    constexprs: each combination calls the consumer with literal constants."""
    if pingpong:
        if bwd_prep:
            _pair_consumer(q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem.index(1), ones_smem, k_smem, v_smem, k_ready,
                           k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, n_tiles,
                           qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, 1, True, True)
        else:
            _pair_consumer(q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem.index(1), ones_smem, k_smem, v_smem, k_ready,
                           k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, n_tiles,
                           qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, 1, False, True)
    else:
        if bwd_prep:
            _pair_consumer(q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem.index(1), ones_smem, k_smem, v_smem, k_ready,
                           k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, n_tiles,
                           qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, 1, True, False)
        else:
            _pair_consumer(q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem.index(1), ones_smem, k_smem, v_smem, k_ready,
                           k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, n_tiles,
                           qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, 1, False, False)


@gluon.jit
def _pair_producer(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem, k_ready,
                   k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, kv_col, n_tiles, qk_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, bwd_prep, pingpong):  # fmt: skip
    """The producer with the worker consumer's argument list (Triton 3.6's workers share one)."""
    _producer(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_tiles, q_begin, kv_col)


@gluon.jit
def _pair_fwd_kernel(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, cu_ptr, num_seqs, qk_scale, stride_qt,
                     stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, HP: gl.constexpr, GROUP: gl.constexpr,
                     BWD_PREP: gl.constexpr, SCAN: gl.constexpr, PINGPONG: gl.constexpr):  # fmt: skip
    gl.static_assert(HP == PAIR_HP, "the pair kernel is built for PAIR_HP query heads per tile")
    BLOCK_M: gl.constexpr = 16 * PAIR_W
    BLOCK_N: gl.constexpr = TILE_N
    P: gl.constexpr = BLOCK_M // HP
    D: gl.constexpr = PAIR_D
    dt: gl.constexpr = q_ptr.dtype.element_ty
    hgroup = gl.program_id(1)
    kv_col = (hgroup * HP) // GROUP * D
    b, q_begin, pair = locate(cu_ptr, num_seqs, gl.num_programs(0) - 1 - gl.program_id(0), 2 * P, SCAN, PAIR_W)
    nq = gl.load(cu_ptr + b + 1) - q_begin
    if pair * 2 * P >= nq:
        return
    q_smem = gl.allocate_shared_memory(dt, [2, BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt))
    ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, tail_bar, turn_bar = _rings(k_desc, v_desc, 2,
                                                                                                PAIR_W)  # fmt: skip
    fence_async_shared()
    cta_barrier()
    n_tiles = (gl.minimum(pair * 2 * P + 2 * P, nq) - 1) // BLOCK_N + 1
    worker_args = (q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, q_smem, ones_smem, k_smem, v_smem, k_ready,
                   k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, kv_col, n_tiles, qk_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, BWD_PREP, PINGPONG)  # fmt: skip
    gl.warp_specialize(
        [
            (_pair_consumer, (q_ptr, o_ptr, lse_ptr, delta_ptr, q_smem.index(0), ones_smem, k_smem, v_smem, k_ready,
                              k_empty, v_ready, v_empty, tail_bar, turn_bar, q_begin, nq, pair, hgroup, n_tiles,
                              qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, 0, BWD_PREP,
                              PINGPONG)),
            (_pair_worker, worker_args),
            (_pair_producer, worker_args),
        ],
        [PAIR_W, 1],
        [PAIR_REGS, PRODUCER_REGS],
    )  # fmt: skip


def ws_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, out: torch.Tensor,
               lse_delta: tuple[torch.Tensor, torch.Tensor] | None = None, kind: str = "ws") -> None:  # fmt: skip
    """The packed causal forward (as :func:`rlexact.ops.gluon_attention.forward`) through a warp-specialized kernel
    (``kind``: ``"ws"``, ``"pair"`` or ``"pingpong"``); ``lse_delta``: the backward's preprocessing (``out`` holds
    dO)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    hp = hq // hkv
    num_seqs = cu.shape[0] - 1
    layout = ga.kv_layout(q.dtype == torch.float16)
    k_desc = GluonDescriptor(k, [t, hkv * d], [k.stride(0), 1], [ga.BLOCK_N, d], layout)
    v_desc = GluonDescriptor(v, [t, hkv * d], [v.stride(0), 1], [ga.BLOCK_N, d], layout)
    lse, delta = lse_delta if lse_delta is not None else (out, out)
    if kind in ("pair", "pingpong"):
        grid = (t // (2 * 16 * PAIR_W.value // hp) + num_seqs, hq // hp)
        _pair_fwd_kernel[grid](
            q, out, lse, delta, k_desc, v_desc, cu, num_seqs, scale * math.log2(math.e), q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), HP=hp, GROUP=hq // hkv,
            BWD_PREP=lse_delta is not None, SCAN=ga.SCAN, PINGPONG=kind == "pingpong", num_warps=PAIR_W.value,
            maxnreg=MAXNREG, **COMPILE_OPTIONS,
        )  # fmt: skip
        return
    grid = (t // (16 * WARPS // hp) + num_seqs, hq // hp)
    _ws_fwd_kernel[grid](
        q, out, lse, delta, k_desc, v_desc, cu, num_seqs, scale * math.log2(math.e), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), HP=hp, GROUP=hq // hkv, D=d, SPLIT=SPLIT,
        BWD_PREP=lse_delta is not None, SCAN=ga.SCAN, W=WARPS, num_warps=WARPS, maxnreg=MAXNREG, **COMPILE_OPTIONS,
    )  # fmt: skip


def _inputs(lens: list[int]) -> tuple:
    return packed_attention_inputs(lens, HQ, HKV, D)


KINDS = ("ws", "pair", "pingpong")
"""The kernels (``--kinds``)."""


def _run(kind: str | None, q, k, v, cu) -> torch.Tensor:  # noqa: ANN001
    out = torch.empty_like(q)
    if kind is None:
        ga.forward(q, k, v, cu, SCALE, out, HQ // HKV, SPLIT)
    else:
        ws_forward(q, k, v, cu, SCALE, out, kind=kind)
    return out


def _bwd_prep(kind: str | None, q, k, v, cu, do) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    lse = torch.empty(q.shape[0], HQ, device="cuda", dtype=torch.float32)
    delta = torch.empty_like(lse)
    if kind is None:
        ga.forward(q, k, v, cu, SCALE, do, HQ // HKV, SPLIT, (lse, delta))
    else:
        ws_forward(q, k, v, cu, SCALE, do, (lse, delta), kind=kind)
    return lse, delta


def check(lens: list[int], kinds: list[str]) -> dict:
    q, k, v, cu = _inputs(lens)
    ref = _run(None, q, k, v, cu)
    do = torch.randn_like(q)
    ref_prep = _bwd_prep(None, q, k, v, cu, do)
    k2 = k.clone()
    k2[-1, 0, 0] += 1.0  # the last sequence's last key: its last query row must change
    row: dict = {"lens": lens}
    for kind in kinds:
        row[kind] = {
            "bitwise_equal_library": bool(torch.equal(_run(kind, q, k, v, cu), ref)),
            "bwd_prep_bitwise_equal_library": all(
                torch.equal(a, b) for a, b in zip(_bwd_prep(kind, q, k, v, cu, do), ref_prep)
            ),
            "negative_control_differs": not torch.equal(_run(kind, q, k2, v, cu), ref),
        }
    return row


def measure(b: int, s_len: int, kinds: list[str]) -> dict:
    q, k, v, cu = _inputs([s_len] * b)
    ref = _run(None, q, k, v, cu)
    row: dict = {"library_us": bench_graph(lambda: _run(None, q, k, v, cu)) * 1e3}
    for kind in kinds:
        row[f"{kind}_bitwise_equal_library"] = bool(torch.equal(_run(kind, q, k, v, cu), ref))
        row[f"{kind}_us"] = bench_graph(lambda kind=kind: _run(kind, q, k, v, cu)) * 1e3
    row["sdpa_default_us"] = sdpa_causal_us(q, k, v, b, s_len, SCALE)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_ws_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["64x512", "8x4096", "1x8192", "128x256", "16x1024"])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    args = ap.parse_args()
    t0 = time.time()
    result: dict = header("gluon_ws_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "dtype": "bfloat16",
        "split": SPLIT,
        "kinds": args.kinds,
        "consumer_warps": {"ws": WARPS, "pair": 2 * PAIR_W.value, "pingpong": 2 * PAIR_W.value},
        "slots": SLOTS.value,
        "maxnreg": MAXNREG,
        "timing": "median of do_bench_cudagraph, microseconds",
        "checks": [check(lens, args.kinds) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_ws_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        b, s_len = (int(x) for x in shape.split("x"))
        result["shapes"][shape] = row = measure(b, s_len, args.kinds)
        print("[gluon_ws_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
