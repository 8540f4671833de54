"""The exact packed attention forward in Triton's Gluon dialect, for Hopper (bf16/fp16, head dim 128).

Bitwise the rows of :func:`rlexact.ops.triton_attention.attention_varlen`'s ``tl`` kernel (docs/design.md §2.4): the
same key tiles (``BLOCK_N`` anchored at 0) and KV splits (``SPLIT`` keys, partials folded in ascending order from the
empty state), the same per-row operations in the same order (scores, ``-inf`` mask, ``exp2(fma(s, scale, -m))``, the
row sum as a dot with a ones tile, ``fma`` updates, P @ V in the MMA's K chain, the fold's explicit FMAs), so a row
does not depend on which kernel computed it; paged launches keep the ``tl`` kernel or, for a decode step within one KV
split, :mod:`rlexact.ops.gluon_decode`. What differs is only how the work is
carried: Q in shared memory, K tiles through a three-deep and V tiles through a two-deep TMA ring with mbarriers,
the three wgmmas per key tile explicit, the ones tile stored once per program, 16 query rows per warp. Inside a KV
split the wgmmas of neighbouring tiles overlap: tile ``j + 1``'s scores and tile ``j``'s P @ V are issued together,
tile ``j + 1``'s softmax runs while that P @ V is in flight, and its row-sum wgmma while the split's sum is
rescaled and P converted for its P @ V; no wgmma is in flight across a loop edge (``ptxas`` would serialize them).
Keys past a sequence arrive through TMA (the next sequence's rows or zero fill): their scores are masked and their V
rows zeroed, so nothing of another sequence enters a row.

``BWD_PREP`` is the backward's preprocessing, as in the ``tl`` kernel: ``o_ptr`` holds dO; the base-2 log-sum-exp
and ``delta = rowsum(dO * O)`` (fp32 ``O``) are stored instead of the output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import warnings
from collections.abc import Mapping
from types import MappingProxyType

import torch

try:  # triton >= 3.5 with Gluon's Hopper language
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    """The barrier of every thread of a program (Gluon's ``thread_barrier`` up to Triton 3.6, ``barrier`` since)."""
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    """A TMA copy of one box into shared memory, signalling an mbarrier (``async_copy_global_to_shared`` up to Triton
    3.6, ``async_load`` since; the same positional arguments)."""
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    """A TMA copy of one box from shared memory to global memory (``async_copy_shared_to_global`` up to Triton 3.6,
    ``async_store`` since; the same positional arguments)."""
except ImportError:  # pragma: no cover - old triton
    gluon = None

from .backend import interpreter_enabled
from .triton_shared import (
    COMPILE_OPTIONS,
    LAUNCHER_ERRORS,
    cuda_props,
    cuda_queries,
    direct_launch_ok,
    launch_hooks_installed,
    stream_buffer,
)

__all__ = [
    "add_row_sum",
    "DESCRIPTOR_DEFAULTS",
    "cta_barrier",
    "descriptor",
    "forward",
    "halve_max",
    "issue_row_sum",
    "key_rows",
    "kv_layout",
    "jit_launch",
    "launch",
    "launch_key",
    "launch_plan",
    "normalized",
    "PackedPlan",
    "packed_args",
    "rebind",
    "rescale_under_row_sum",
    "rescaled",
    "rings",
    "run_cached",
    "single_plan",
    "sm90",
    "supported",
    "tile_slots",
    "tma_load",
    "tma_store",
    "wgmma_layout",
]

BLOCK_N = 64
"""Keys per tile: the library's 16-bit ``BLOCK_N`` (checked by :func:`supported`)."""
HEAD_DIM = 128
WARPS = 4
"""Warps per program, 16 query rows each (``benchmarks/results/gluon_attention_probe_h200.json``: faster than 8)."""
SCAN = 128
"""Sequences examined per step when a program looks up which sequence its tile slot belongs to."""
_INTERPRET = interpreter_enabled()


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int) -> bool:
    """Whether :func:`forward` runs this packed launch: a Triton with Gluon's Hopper language (not the interpreter),
    an sm_90 GPU, 16-bit inputs of head dim 128 with key tiles of :data:`BLOCK_N`, K and V laid out as TMA reads
    them (heads and dims dense, rows 16-byte aligned). Checked on every packed launch, so it reads each tensor
    attribute once."""
    if gluon is None or _INTERPRET or block_n != BLOCK_N or not q.is_cuda:
        return False
    dt = q.dtype
    if (dt is not torch.bfloat16 and dt is not torch.float16) or k.dtype is not dt or q.shape[-1] != HEAD_DIM:
        return False
    ks = k.stride()
    if q.stride(2) != 1 or ks[2] != 1 or ks[1] != HEAD_DIM or ks[0] % 8:
        return False  # TMA reads K/V rows as [T, Hkv * D] with a 16-byte-aligned row stride (8 16-bit elements)
    if v.stride() != ks or k.data_ptr() % 16 or v.data_ptr() % 16:
        return False
    return sm90(q.get_device())


@functools.cache
def sm90(index: int) -> bool:
    """Whether CUDA device ``index`` is an sm_90 (Hopper) GPU."""
    return cuda_props(index)[0] == 9


if gluon is not None:
    K_SLOTS = gl.constexpr(3)
    """Depth of the K tile ring: K tile ``x + 3`` is copied once tile ``x``'s scores are done."""
    V_SLOTS = gl.constexpr(2)
    """Depth of the V tile ring: V tile ``x + 2`` is copied once tile ``x``'s P @ V is done."""

    @gluon.constexpr_function
    def wgmma_layout(warps: int, n: int) -> object:
        """The accumulator layout of a ``warps``-warp wgmma with ``n`` columns (16 rows per warp)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def locate(cu_ptr, num_seqs, slot, P: gl.constexpr, SCAN: gl.constexpr, W: gl.constexpr):
        """``(sequence, tile within it)`` of tile slot ``slot``: sequence ``b`` owns slots from ``cu[b] // P + b``, as
        in the ``tl`` kernel."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        count = slot * 0
        for c in range(0, num_seqs, SCAN):
            offs = c + gl.arange(0, SCAN, layout=lay)
            inside = offs < num_seqs
            start = gl.load(cu_ptr + offs, mask=inside, other=0)
            count += gl.sum(((start // P + offs <= slot) & inside).to(gl.int32), axis=0)
        b = count - 1
        q_begin = gl.load(cu_ptr + b)
        return b, q_begin, slot - (q_begin // P + b)

    @gluon.jit
    def key_rows(seqk_ptr, kv_rows, b, q_begin, nq, GATHERED: gl.constexpr):
        """``(key count, first key row, position of the first query)`` of sequence ``b``: in a packed launch its
        queries are its keys; in a gathered one (:mod:`rlexact.ops.kv_gather`) its keys are rows
        ``b * kv_rows ..`` of the gathered K/V, ``seqk[b]`` of them, and its ``nq`` queries are the last positions."""
        if GATHERED:
            nk = gl.load(seqk_ptr + b)
            kv_begin = b * kv_rows
            q_start = nk - nq
        else:
            nk = nq
            kv_begin = q_begin
            q_start = 0
        return nk, kv_begin, q_start

    @gluon.jit
    def halve_max(x):
        """``maximum(x[:, c], x[:, c + n / 2])`` of ``x [m, n]``: in each thread's registers where both columns lie in
        one thread, as in a wgmma accumulator's rows."""
        M: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        a, b = gl.split(x.reshape([M, 2, N // 2]).permute((0, 2, 1)))
        return gl.maximum(a, b)

    @gluon.jit
    def tile_softmax(s, m_s, qk_scale, dt: gl.constexpr, TREE: gl.constexpr = False):
        """One key tile's step of the running softmax (the ``tl`` kernel's operations): ``(m_new, alpha, p)`` with
        ``p = exp2(fma(s, scale, -m))`` in ``dt`` and ``alpha`` the rescale of the state so far. With ``TREE`` each
        row's maximum is taken as a tree of three halvings before the reduction instead of one chain (the maximum of
        the same values, so the same bits)."""
        if TREE:
            row_max = gl.convert_layout(gl.max(halve_max(halve_max(halve_max(s))), 1), m_s.type.layout)
        else:
            row_max = gl.max(s, 1)
        m_new = gl.maximum(m_s, row_max * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, gl.exp2(m_s - m_use), gl.exp2(gl.fma(s, qk_scale, -m_use[:, None])).to(dt)

    @gluon.jit
    def mask_scores(s, j, n_full, pos, offs_n, nk, BLOCK_N: gl.constexpr, ONE_BOUND: gl.constexpr = False):
        """Key tile ``j``'s scores with keys past a row's position or past the sequence at ``-inf`` (tiles below
        ``n_full`` are visible to every row and returned as they are). With ``ONE_BOUND`` each score takes one
        comparison, against the smaller of its row's position and the sequence's last key (the same keys)."""
        if j >= n_full:
            if ONE_BOUND:  # the tile's columns against each row's last visible key, relative to the tile
                s = gl.where(offs_n[None, :] <= (gl.minimum(pos, nk - 1) - j * BLOCK_N)[:, None], s, float("-inf"))
            else:
                kpos = j * BLOCK_N + offs_n
                s = gl.where((kpos[None, :] <= pos[:, None]) & (kpos < nk)[None, :], s, float("-inf"))
        return s

    @gluon.jit
    def zero_tail_rows(v_buf, row0, n, BLOCK_N: gl.constexpr, blk: gl.constexpr):
        """Zero the rows of the V tile in ``v_buf`` (first key ``row0``) at keys ``>= n``, visible to the next wgmma."""
        vrows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
        v = v_buf.load(blk)
        v_buf.store(gl.where((row0 + vrows < n)[:, None], v, 0.0))
        fence_async_shared()
        cta_barrier()

    @gluon.jit
    def fold(m_i, l_i, acc, m_s, l_s, acc_s, o_layout: gl.constexpr):
        """A finished KV split ``(m_s, l_s, acc_s)`` folded into the splits before it (the ``tl`` kernel's merge)."""
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_new = gl.maximum(m_i, m_s)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        fa = gl.exp2(m_i - m_use)
        fb = gl.exp2(m_s - m_use)
        acc = gl.fma(acc, gl.convert_layout(fa, row_o)[:, None], acc_s * gl.convert_layout(fb, row_o)[:, None])
        return m_new, gl.fma(l_i, fa, l_s * fb), acc

    @gluon.jit
    def rescaled(acc, alpha, row_o: gl.constexpr):
        """The sum ``acc`` (``[rows, head dim]``) times each row's ``alpha``."""
        return acc * gl.convert_layout(alpha, row_o)[:, None]

    @gluon.jit
    def add_row_sum(l_sum, alpha, rsum, row_s: gl.constexpr):
        """The rows' running sum ``l_sum`` rescaled by ``alpha`` plus a key tile's row sum (any column of the ones
        tile's product; the ``tl`` kernel's ``fma``)."""
        return gl.fma(l_sum, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))

    @gluon.jit
    def issue_row_sum(p, ones_smem, r_zero, r_op: gl.constexpr):
        """Start a key tile's row sum, P against the ones tile: ``(P as that wgmma's operand, its token)``."""
        p_r = gl.convert_layout(p, r_op)
        return p_r, warpgroup_mma(p_r, ones_smem, r_zero, use_acc=False, is_async=True)

    @gluon.jit
    def rescale_under_row_sum(acc_s, l_s, alpha, p, p_r, rsum, pv_op: gl.constexpr, row_o: gl.constexpr,
                              row_s: gl.constexpr, RESCALE: gl.constexpr = True):  # fmt: skip
        """While the row sum started by :func:`issue_row_sum` runs, rescale the split's sum by ``alpha`` and convert P
        for its P @ V; then add the row sum into ``l`` (the ``tl`` kernel's ``fma``): ``(acc_s, P's P @ V operand,
        l_s)``. Without ``RESCALE`` the sum is returned as it is: for a split's first tile, whose sum is ``+0`` and
        ``alpha`` is ``exp2(-inf) = +0``, that is the product's bits."""
        # rescaled() and add_row_sum() written out: called from here they reorder the pair's integer address code
        if RESCALE:
            acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p, pv_op)
        rsum, p_r = warpgroup_mma_wait(0, deps=(rsum, p_r))
        return acc_s, p_op, gl.fma(l_s, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))

    @gluon.jit
    def normalized(acc, l_i, o_layout: gl.constexpr):
        """A query tile's output rows, ``acc / l`` in fp32 (whichever way they are then stored), as ``acc * (1 / l)``:
        the same bits in fewer instructions. Triton divides fp32 by ``div.full.f32``, which ``ptxas`` expands per
        element to ``x' * rcp(l')``, ``x', l'`` scaled by a power of two only when ``|l|`` lies outside
        ``[2^-126, 2^126]``; per row the reciprocal is ``1 * rcp(l)``, then one multiply per element. A row sum is
        ``0`` (no visible key: ``0 * inf`` either way), NaN, or at least the ``~1`` of its largest score's term and at
        most about one per key, so it never lies in the scaled ranges with a nonzero finite ``l``."""
        return acc * gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))[:, None]

    @gluon.jit
    def store_rows(o_ptr, lse_ptr, delta_ptr, acc, m_i, l_i, q_begin, nq, tile, hgroup, stride_ot, stride_oh,
                   stride_lt, stride_lh, HP: gl.constexpr, P: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                   BWD_PREP: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
        """Store a query tile's rows ``acc / l`` into ``o_ptr``; with ``BWD_PREP``, read dO from ``o_ptr`` and store
        the base-2 log-sum-exp and ``delta = rowsum(dO * O)`` instead."""
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        out = normalized(acc, l_i, o_layout)
        orows = gl.arange(0, BLOCK_M, layout=row_o)
        ocols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        oqi = tile * P + orows // HP
        ohead = hgroup * HP + orows % HP
        o_ok = oqi < nq
        orow = (q_begin + oqi).to(gl.int64) * stride_ot + ohead * stride_oh
        o_ptrs = o_ptr + orow[:, None] + ocols[None, :]
        if BWD_PREP:
            do = gl.load(o_ptrs, mask=o_ok[:, None], other=0.0).to(gl.float32)
            lrow = (q_begin + oqi).to(gl.int64) * stride_lt + ohead * stride_lh
            gl.store(lse_ptr + lrow, gl.convert_layout(m_i + gl.log2(l_i), row_o), mask=o_ok)
            gl.store(delta_ptr + lrow, gl.sum(out * do, 1), mask=o_ok)
        else:
            gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_ok[:, None])

    @gluon.jit
    def load_rows(desc, smem, bars, x, q_begin, kv_col, SLOTS: gl.constexpr, BLOCK_N: gl.constexpr,
                  nbytes: gl.constexpr):  # fmt: skip
        """Start the TMA copy of key tile ``x``'s rows of ``desc`` into ring slot ``x % SLOTS``."""
        slot = x % SLOTS
        mbarrier.expect(bars.index(slot), nbytes)
        tma_load(desc, [q_begin + x * BLOCK_N, kv_col], bars.index(slot), smem.index(slot))

    @gluon.jit
    def rings(k_desc, v_desc, SLOTS: gl.constexpr, n: gl.constexpr, W: gl.constexpr, RELEASERS: gl.constexpr,
              ONES_N: gl.constexpr = 16):
        """For warp-specialized kernels: the ones tile of the row-sum dot (``ONES_N`` columns; ``W`` warps store it) and
        ``SLOTS``-deep rings of ``n``-key K and V tiles with their ready barriers (one arrival: the copy) and empty
        barriers (``RELEASERS`` arrivals: the consumers), initialized and visible to every partition (barriers
        initialized before the call are too)."""
        dt: gl.constexpr = k_desc.dtype
        d: gl.constexpr = k_desc.block_type.shape[1]
        ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // ONES_N, ONES_N // 8], [W, 1], [1, 0])
        ones_smem = gl.allocate_shared_memory(dt, [n, ONES_N], gl.NVMMASharedLayout.get_default_for([n, ONES_N], dt))
        ones_smem.store(gl.full([n, ONES_N], 1.0, dt, layout=ones_layout))
        k_smem = gl.allocate_shared_memory(dt, [SLOTS, n, d], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dt, [SLOTS, n, d], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SLOTS):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=RELEASERS)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=RELEASERS)
        fence_async_shared()
        cta_barrier()
        return ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty

    @gluon.jit
    def _fwd_kernel(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, cu_ptr, num_seqs, qk_scale, stride_qt,
                    stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, seqk_ptr, kv_rows, HP: gl.constexpr,
                    GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr,
                    BWD_PREP: gl.constexpr, SCAN: gl.constexpr, W: gl.constexpr, GATHERED: gl.constexpr):  # fmt: skip
        KS: gl.constexpr = K_SLOTS
        VS: gl.constexpr = V_SLOTS
        BLOCK_M: gl.constexpr = 16 * W
        P: gl.constexpr = BLOCK_M // HP
        TPS: gl.constexpr = SPLIT // BLOCK_N
        dt: gl.constexpr = q_ptr.dtype.element_ty
        hgroup = gl.program_id(1)
        kv_col = (hgroup * HP) // GROUP * D
        b, q_begin, tile = locate(cu_ptr, num_seqs, gl.num_programs(0) - 1 - gl.program_id(0), P, SCAN, W)
        nq = gl.load(cu_ptr + b + 1) - q_begin
        if tile * P >= nq:
            return
        nk, kv_begin, q_start = key_rows(seqk_ptr, kv_rows, b, q_begin, nq, GATHERED)

        s_layout: gl.constexpr = wgmma_layout(W, BLOCK_N)
        o_layout: gl.constexpr = wgmma_layout(W, D)
        r_layout: gl.constexpr = wgmma_layout(W, 16)
        r_op: gl.constexpr = gl.DotOperandLayout(0, r_layout, 2)
        pv_op: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        k_smem = gl.allocate_shared_memory(dt, [KS, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dt, [VS, BLOCK_N, D], v_desc.layout)
        k_bars = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [VS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(KS):
            mbarrier.init(k_bars.index(i), count=1)
        for i in gl.static_range(VS):
            mbarrier.init(v_bars.index(i), count=1)

        # the first K and V copies are in flight while this program loads its query tile
        last_pos = q_start + gl.minimum(tile * P + P, nq) - 1
        n_tiles = last_pos // BLOCK_N + 1
        nbytes: gl.constexpr = BLOCK_N * D * dt.primitive_bitwidth // 8
        for x in gl.static_range(KS):
            if x < n_tiles:
                load_rows(k_desc, k_smem, k_bars, x, kv_begin, kv_col, KS, BLOCK_N, nbytes)
        for x in gl.static_range(VS):
            if x < n_tiles:
                load_rows(v_desc, v_smem, v_bars, x, kv_begin, kv_col, VS, BLOCK_N, nbytes)

        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
        qi = tile * P + rows // HP
        q_rows = (q_begin + qi).to(gl.int64) * stride_qt + (hgroup * HP + rows % HP) * stride_qh
        q = gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=(qi < nq)[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(dt, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt))
        q_smem.store(q)
        ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [W, 1], [1, 0])
        ones_smem = gl.allocate_shared_memory(dt, [BLOCK_N, 16], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 16],
                                                                                                      dt))
        ones_smem.store(gl.full([BLOCK_N, 16], 1.0, dt, layout=ones_layout))
        fence_async_shared()
        cta_barrier()

        n_full = (q_start + tile * P + 1) // BLOCK_N  # tiles below it: visible to every row, wholly inside the sequence
        pos = q_start + tile * P + gl.arange(0, BLOCK_M, layout=row_s) // HP
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)  # the folded splits so far
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)

        # K tile x sits in slot x % KS of its ring (K tile x + KS is copied once tile x's scores are done), V tile x
        # in slot x % VS of its ring (V tile x + VS is copied once tile x's P @ V is done). Inside a split, tile
        # j + 1's scores are computed and its softmax runs while tile j's P @ V is in flight, its row sum while the
        # sum is rescaled and P converted; no MMA is in flight across a loop edge. Every row sees the operations of
        # the library kernel in its order.
        for t0 in range(0, n_tiles, TPS):
            t1 = gl.minimum(t0 + TPS, n_tiles)
            m_s = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)  # the split's partial
            l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc_s = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
            mbarrier.wait(k_bars.index(t0 % KS), (t0 // KS) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(t0 % KS).permute((1, 0)), s_zero, use_acc=False)
            if t0 + KS < n_tiles:
                load_rows(k_desc, k_smem, k_bars, t0 + KS, kv_begin, kv_col, KS, BLOCK_N, nbytes)
            m_s, alpha, p = tile_softmax(mask_scores(s, t0, n_full, pos, offs_n, nk, BLOCK_N), m_s, qk_scale, dt)
            p_r, rsum = issue_row_sum(p, ones_smem, r_zero, r_op)
            acc_s, p_op, l_s = rescale_under_row_sum(acc_s, l_s, alpha, p, p_r, rsum, pv_op, row_o, row_s)
            for j in range(t0, t1 - 1):  # tile j's P @ V, tile j + 1's scores and softmax
                mbarrier.wait(k_bars.index((j + 1) % KS), ((j + 1) // KS) & 1)
                s_tok = warpgroup_mma(q_smem, k_smem.index((j + 1) % KS).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)  # fmt: skip
                mbarrier.wait(v_bars.index(j % VS), (j // VS) & 1)
                acc_tok = warpgroup_mma(p_op, v_smem.index(j % VS), acc_s, is_async=True)
                s, acc_s, p_op = warpgroup_mma_wait(1, deps=(s_tok, acc_tok, p_op))  # the scores; P @ V may run
                if j + 1 + KS < n_tiles:
                    load_rows(k_desc, k_smem, k_bars, j + 1 + KS, kv_begin, kv_col, KS, BLOCK_N, nbytes)
                m_s, alpha, p = tile_softmax(mask_scores(s, j + 1, n_full, pos, offs_n, nk, BLOCK_N), m_s, qk_scale,
                                             dt)  # fmt: skip
                p_r, rsum = issue_row_sum(p, ones_smem, r_zero, r_op)
                acc_s, p_op = warpgroup_mma_wait(1, deps=(acc_s, p_op))  # P @ V; the row sum may run
                if j + VS < n_tiles:
                    load_rows(v_desc, v_smem, v_bars, j + VS, kv_begin, kv_col, VS, BLOCK_N, nbytes)
                acc_s, p_op, l_s = rescale_under_row_sum(acc_s, l_s, alpha, p, p_r, rsum, pv_op, row_o, row_s)
            jl = t1 - 1  # the split's last tile: its P @ V, then the fold
            mbarrier.wait(v_bars.index(jl % VS), (jl // VS) & 1)
            if (jl + 1) * BLOCK_N > nk:  # V rows past the sequence: zeros, whatever the next rows hold
                zero_tail_rows(v_smem.index(jl % VS), jl * BLOCK_N, nk, BLOCK_N, blk)
            acc_s = warpgroup_mma(p_op, v_smem.index(jl % VS), acc_s)
            m_i, l_i, acc = fold(m_i, l_i, acc, m_s, l_s, acc_s, o_layout)
            if jl + VS < n_tiles:
                load_rows(v_desc, v_smem, v_bars, jl + VS, kv_begin, kv_col, VS, BLOCK_N, nbytes)
        for i in gl.static_range(KS):
            mbarrier.invalidate(k_bars.index(i))
        for i in gl.static_range(VS):
            mbarrier.invalidate(v_bars.index(i))

        store_rows(o_ptr, lse_ptr, delta_ptr, acc, m_i, l_i, q_begin, nq, tile, hgroup, stride_ot, stride_oh, stride_lt,
                   stride_lh, HP, P, D, BLOCK_M, BWD_PREP, o_layout)  # fmt: skip


def rebind(jit_fn: object, **names: object) -> object:
    """A copy of the Gluon function ``jit_fn`` whose globals ``names`` resolve to the given objects (its constexpr
    annotations kept), compiled and cached as a kernel of its own: a specialization whose constants a worker
    partition cannot take as constexpr arguments. Keep the copy alive while it is launched: :func:`launch`'s cache
    keys on the kernel object's id."""
    f = jit_fn.fn
    copy = types.FunctionType(f.__code__, dict(f.__globals__, **names), f.__name__, f.__defaults__, f.__closure__)
    copy.__annotations__ = dict(f.__annotations__)
    copy.__doc__ = f.__doc__
    return gluon.jit(copy)


def descriptor(base: torch.Tensor, shape: list[int], strides: list[int], block_shape: list[int],
               layout: object) -> object:  # fmt: skip
    """A Gluon ``TensorDescriptor`` of ``base``, built without its constructor's checks when this Triton's descriptor
    has no other field without a default (:data:`DESCRIPTOR_DEFAULTS`): the checks cost more host time than the rest
    of a launch's Python. Call only where the launch's own preconditions imply them (a 16-byte-aligned base and
    rows, a contiguous last dimension, positive sizes, the module's block shapes and ``NVMMASharedLayout``s). Triton
    reads the same fields of it as of a checked one."""
    if DESCRIPTOR_DEFAULTS is None:
        return GluonDescriptor(base, shape, strides, block_shape, layout)
    desc = object.__new__(GluonDescriptor)
    desc.__dict__.update(DESCRIPTOR_DEFAULTS, base=base, shape=shape, strides=strides, block_shape=block_shape,
                         layout=layout)  # fmt: skip
    return desc


def _descriptor_defaults() -> dict[str, object] | None:
    """The defaults of the Gluon descriptor's fields past :func:`descriptor`'s five, or None when it is not a
    dataclass or one of them has no plain default."""
    if gluon is None or not dataclasses.is_dataclass(GluonDescriptor):
        return None
    given = ("base", "shape", "strides", "block_shape", "layout")
    fields = {f.name: f.default for f in dataclasses.fields(GluonDescriptor)}
    rest = {name: value for name, value in fields.items() if name not in given}
    if not set(given) <= set(fields) or any(value is dataclasses.MISSING for value in rest.values()):
        return None
    return rest


DESCRIPTOR_DEFAULTS = _descriptor_defaults()
"""Values of the Gluon descriptor's fields that :func:`descriptor` does not take (``padding="zero"`` in Triton
3.6), or None when they cannot be filled in without its constructor."""


@functools.cache
def kv_layout(fp16: bool) -> object:
    """The shared-memory layout of a K/V tile (built once: the launch is on the host's critical path)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16 if fp16 else gl.bfloat16)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, out: torch.Tensor,
            hp: int, split: int, lse_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
            gathered: tuple[torch.Tensor, int] | None = None) -> tuple[PackedPlan, tuple]:  # fmt: skip
    """The packed causal forward of ``q [T, Hq, 128]``, ``k, v [T, Hkv, 128]`` (dense), ``cu [B + 1]`` int32 into
    ``out``, ``hp`` query heads per tile, KV splits of ``split`` keys; with ``lse_delta`` the backward's preprocessing
    (``out`` holds dO). With ``gathered = (seqlens_k, rows)`` the keys are not the queries: sequence ``b``'s keys are
    rows ``b * rows ..`` of ``k, v`` (``[B * rows, Hkv, 128]``, :func:`rlexact.ops.kv_gather.gather`),
    ``seqlens_k[b]`` (int32) of them, and its queries are its last positions. Call only where :func:`supported`
    holds.

    The first launch of each specialization goes through Triton's JIT dispatch; later ones call the compiled
    kernel's launcher directly (:func:`launch`). Returns the plan launched and its launch key."""
    plan = single_plan(hp, q.shape[1], k.shape[1], split, lse_delta is not None, gathered is not None)
    return plan, launch_plan(plan, q, k, v, cu, scale, out, lse_delta, gathered)


@functools.cache
def single_plan(hp: int, hq: int, hkv: int, split: int, bwd_prep: bool, gathered: bool) -> PackedPlan:
    """:func:`forward`'s plan for ``hq`` query heads over ``hkv`` KV heads, ``hp`` per tile (one tile of
    ``16 * WARPS`` query rows per program)."""
    consts = (hp, hq // hkv, HEAD_DIM, BLOCK_N, split, bwd_prep, SCAN, WARPS, gathered)
    return PackedPlan(_fwd_kernel, MappingProxyType({"num_warps": WARPS}), BLOCK_N, consts, 16 * WARPS // hp, hq // hp)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedPlan:
    """The part of a packed forward launch that follows from its inputs' sizes, strides, dtypes and device, not from
    their data or token and sequence counts: ``kernel`` with its compile ``options``, K/V boxes of ``block_n`` keys,
    ``tail`` (the arguments after :func:`packed_args`'s: constexprs, or a descriptor kernel's head groups), and
    tile slots of ``slot_positions`` query positions over ``heads`` head groups.

    A plan with a ``q_layout`` is a descriptor kernel's: it reads Q and writes O through descriptors of ``q_box``
    boxes in that layout, its arguments end with the Q descriptor, the item counter (:func:`item_counter`) and the O
    descriptor, and it runs at most ``programs`` programs on a 1-D grid, which draw the items from the counter and
    leave it zero. Any other plan has one program per tile slot and head group."""

    kernel: object
    options: Mapping[str, int]
    block_n: int
    tail: tuple
    slot_positions: int
    heads: int
    q_box: list[int] | None = None
    q_layout: object = None
    programs: int = 0

    def grid(self, tokens: int, num_seqs: int) -> tuple[int, int]:
        """The grid of a launch of ``tokens`` query rows over ``num_seqs`` sequences."""
        slots = tile_slots(tokens, num_seqs, self.slot_positions)
        return (min(self.programs, slots * self.heads), 1) if self.q_layout is not None else (slots, self.heads)

    def arguments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float,
                  out: torch.Tensor, lse_delta: tuple[torch.Tensor, torch.Tensor] | None,
                  gathered: tuple[torch.Tensor, int] | None) -> tuple[tuple, tuple, tuple]:  # fmt: skip
        """``(args, tensors, ints)`` of this plan's launch (:func:`forward`'s arguments; :func:`launch`'s
        meaning)."""
        args, tensors, ints = packed_args(q, k, v, cu, scale, out, lse_delta, gathered, self.block_n)
        if self.q_layout is None:
            return (*args, *self.tail), tensors, ints
        t, hq, d = q.shape
        counter = item_counter(q.device)
        q_desc = descriptor(q, [t, hq, d], list(q.stride()), self.q_box, self.q_layout)  # the caller checked q, out
        o_desc = descriptor(out, [t, hq, d], list(out.stride()), self.q_box, self.q_layout)
        return (*args, *self.tail, q_desc, counter, o_desc), (*tensors, counter), (*ints, *self.tail, t, hq)


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
"""``(device index, raw stream)`` -> the item counter of the persistent launches on that stream."""


def item_counter(device: torch.device) -> torch.Tensor:
    """The item counter of a persistent launch on ``device``'s current stream: two int32 zeros (the items drawn, the
    programs done drawing), which the kernel leaves zero, so the launches on one stream share them
    (:func:`~rlexact.ops.triton_shared.stream_buffer`); new zeros on a device other than CUDA (host-only timing)."""
    if device.type != "cuda":
        return _zero_counter(2, device)
    _, raw_stream, _ = cuda_queries()
    return stream_buffer(_COUNTERS, device.index, raw_stream(device.index), 2, _zero_counter)


def _zero_counter(numel: int, device: torch.device) -> torch.Tensor:
    """``numel`` new int32 zeros on ``device``."""
    return torch.zeros(numel, dtype=torch.int32, device=device)


def launch_plan(plan: PackedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float,
                out: torch.Tensor, lse_delta: tuple[torch.Tensor, torch.Tensor] | None,
                gathered: tuple[torch.Tensor, int] | None) -> tuple:  # fmt: skip
    """Launch ``plan`` on :func:`forward`'s arguments; returns the launch's :func:`launch_key`."""
    args, tensors, ints = plan.arguments(q, k, v, cu, scale, out, lse_delta, gathered)
    return launch(plan.kernel, plan.grid(q.shape[0], cu.shape[0] - 1), args, tensors, ints, plan.options)


def tile_slots(tokens: int, num_seqs: int, positions: int) -> int:
    """Tile slots of a packed launch of ``tokens`` query rows over ``num_seqs`` sequences, ``positions`` per tile:
    sequence ``b`` owns the slots from ``cu[b] // positions + b`` (:func:`locate`), so these cover every sequence's
    tiles (a slot past a sequence's last tile is empty)."""
    return tokens // positions + num_seqs


def packed_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, out: torch.Tensor,
                lse_delta: tuple[torch.Tensor, torch.Tensor] | None, gathered: tuple[torch.Tensor, int] | None,
                block_n: int = BLOCK_N) -> tuple[tuple, tuple, tuple]:  # fmt: skip
    """``(args, tensors, ints)`` of a packed forward launch (:func:`forward`'s arguments; :func:`launch`'s meaning):
    ``q, out, lse, delta``, the K and V descriptors (boxes of ``block_n`` keys), ``cu``, the sequence count, the
    base-2 scale, the q / out / lse strides, the key counts and rows per sequence of a gathered launch."""
    tk, hkv, d = k.shape
    num_seqs = cu.shape[0] - 1
    layout = kv_layout(q.dtype == torch.float16)
    k_desc = descriptor(k, [tk, hkv * d], [k.stride(0), 1], [block_n, d], layout)  # supported() checked K and V
    v_desc = descriptor(v, [tk, hkv * d], [v.stride(0), 1], [block_n, d], layout)
    lse, delta = lse_delta if lse_delta is not None else (out, out)  # unread without the preprocessing
    seqk, kv_rows = gathered if gathered is not None else (cu, 0)  # unread in a packed launch
    sq, so, sl = q.stride(), out.stride(), lse.stride()
    args = (q, out, lse, delta, k_desc, v_desc, cu, num_seqs, scale * math.log2(math.e), sq[0], sq[1], so[0], so[1],
            sl[0], sl[1], seqk, kv_rows)  # fmt: skip
    # the integer arguments, and the descriptors' row count and row strides
    ints = (num_seqs, sq[0], sq[1], so[0], so[1], sl[0], sl[1], kv_rows, tk, k.stride(0), v.stride(0))
    return args, (q, out, lse, delta, cu, seqk, k, v), ints


_LAUNCHERS: dict = {}
"""Specialization key (:func:`launch`) -> ``(CompiledKernel.run, function, packed metadata)``."""

_DIRECT = [os.environ.get("RLEXACT_GLUON_JIT_LAUNCH", "0") != "1"]
"""False: every launch goes through Triton's JIT dispatch (``RLEXACT_GLUON_JIT_LAUNCH=1``, or set when a cached
launcher raised, i.e. a Triton whose launcher API is not the one :func:`direct_launch_ok` recognises)."""


@functools.cache
def _constexpr_count(kernel: object) -> int:
    """How many of ``kernel``'s parameters (the trailing ones) are constexprs."""
    return sum(p.is_constexpr for p in kernel.params)


def launch(kernel: object, grid: tuple[int, int], args: tuple, tensors: tuple[torch.Tensor, ...],
           ints: tuple[int, ...], options: Mapping[str, int]) -> tuple:  # fmt: skip
    """Launch the Gluon ``kernel`` with ``args`` (every parameter, constexprs included, in signature order) and the
    compile ``options`` it always gets (``num_warps``, ...): through the cached launcher of its :func:`launch_key`
    (:func:`run_cached`) when there is one, else through Triton's JIT dispatch, whose compiled launcher is then
    cached under that key. Returns the key."""
    key = launch_key(kernel, args, tensors, ints)
    if run_cached(key, grid, args):
        return key
    n_args = len(args) - _constexpr_count(kernel)
    constexprs = dict(zip(kernel.arg_names[n_args:], args[n_args:]))
    compiled = jit_launch(kernel, grid, args[:n_args], constexprs | dict(options))
    if _DIRECT[0] and direct_launch_ok(getattr(compiled, "run", None)) and not compiled.run.global_scratch_size:
        _LAUNCHERS[key] = (compiled.run, compiled.function, compiled.packed_metadata)
    return key


def launch_key(kernel: object, args: tuple, tensors: tuple[torch.Tensor, ...], ints: tuple[int, ...]) -> tuple:
    """The cached-launcher key of a :func:`launch` of ``kernel`` with ``args``, at least as fine as Triton's
    specialization of them: the kernel, the device, every constexpr, the dtype and 16-byte alignment of each tensor
    (``tensors``: the pointer arguments and the descriptors' bases; the descriptors' block shapes and layouts follow
    from the dtype), and for each of ``ints`` (the integer arguments and the descriptors' shapes and strides) whether
    it is 1, divisible by 16 and inside int32. Equal keys therefore select the same compiled kernel."""
    return (
        id(kernel),
        tensors[0].get_device(),
        args[len(args) - _constexpr_count(kernel) :],
        tuple((x.dtype, x.data_ptr() % 16 == 0) for x in tensors),
        tuple((i == 1, i % 16 == 0, -(2**31) <= i < 2**31) for i in ints),
    )


def run_cached(key: tuple, grid: tuple[int, int], args: tuple) -> bool:
    """Launch ``args`` on ``grid`` through the launcher cached under ``key`` (:func:`launch_key` of the same launch)
    and return True; False, launching nothing, when there is none, launch hooks are installed (e.g. a profiler: the
    dispatch calls them) or the current device is not the key's. A cached launch does what Triton's dispatch does
    last for the same arguments: ``CompiledKernel.run`` on the current stream."""
    entry = _LAUNCHERS.get(key) if _DIRECT[0] else None
    if entry is None or launch_hooks_installed():
        return False
    get_device, raw_stream, _ = cuda_queries()
    dev = key[1]
    if get_device() != dev:
        return False
    run, function, meta = entry
    try:
        run(grid[0], grid[1], 1, raw_stream(dev), function, meta, None, None, None, *args)
    except LAUNCHER_ERRORS as e:
        _DIRECT[0] = False
        warnings.warn(f"cached Gluon launcher unusable ({e!r}); using Triton's JIT dispatch", stacklevel=3)
        return False
    return True


def jit_launch(kernel: object, grid: tuple[int, int], args: tuple, kwargs: Mapping[str, object]) -> object:
    """Triton's JIT dispatch of ``kernel[grid](*args, **kwargs)`` with the library's compile options (compiling on a
    new specialization); returns the ``CompiledKernel``."""
    return kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)
