"""Batch-invariant Triton kernels for Mixture-of-Experts layers: the router's softmax + top-k, the grouped GEMM.

Router (:func:`moe_router`)
---------------------------
One program per token row. The fp32 softmax reduces the row's ``E`` logits in one block of ``next_pow2(E)`` lanes
(the reduction tree is a function of ``E`` only), then top-k runs as ``k`` rounds of "largest probability, lowest
expert index among equals", so ties always go to the lowest expert index. With ``norm_topk_prob`` the ``k`` selected
probabilities are summed left to right in selection order and divided. Weights are cast once to the logits' dtype
(transformers' semantics).

Grouped GEMM (:func:`grouped_matmul`)
-------------------------------------
``out[r] = a[gather[r]] @ w[e(r)].T`` for the expert-sorted rows ``r``. The rows of one expert are contiguous; they are
cut into row tiles of ``BM`` rows that never straddle two experts. The launch grid is a *worst-case* number of row
tiles (:func:`num_row_tiles`: a function of the number of rows, experts and the row tile, known on the host from shapes
alone) times the ``N`` tiles; each program finds its expert and row range from the per-expert row counts (a cumulative
sum over the ``E`` counts, on the device) and idle programs exit at once. Nothing is synchronized to the host, so the
layer is capturable in a CUDA graph at a static token count.

Why a row's result does not depend on the other rows: every output element is the dense matmul's recurrence
(:mod:`rlexact.ops.triton_matmul`) -- ``acc = 0; for k-tile ascending: acc = dot(a_tile, w_tile^T, acc)`` in fp32, one
program per output tile, no split-K, no atomics, ``input_precision="ieee"`` for fp32; padding rows are zero-filled and
never stored, padding columns are never stored, the K tail is zero-filled. ``K``, ``N`` and the dtype fix the
reduction; a row's position inside its tile does not change its arithmetic.

Configurations (:func:`grouped_config`). The launch configuration is a function of ``(N, K, dtype, device)`` and the
call's *row class* (:data:`ROW_CLASSES`: rows per expert, from shapes alone), like the dense matmul's row-tile
variants: decode-sized calls keep 64-row tiles, large ones may use taller and wider tiles, another program order
(``group_m``), unmasked K loops (``even_k``) and TMA weight loads. These change which rows and columns one program
computes and how operands reach shared memory, not the per-element chain of K-16 tensor-core steps, so every member
of the table must give the same bits as every other -- verified, not assumed: ``benchmarks/moe_bench.py --sweep``
compares each candidate (:func:`grouped_candidates`) bitwise on the GPU, and the interpreter tests compare them on CPU.
With ``RLEXACT_MATMUL_SINGLE_TILE=1`` (or off Hopper) every call uses the decode entry.

Under the Triton interpreter ``tl.dot`` is a NumPy BLAS call whose result for a row can depend on the row's position
in the tile (OpenBLAS' Haswell kernels, for one), so there the kernel reduces with :func:`_rowwise_dot` instead
(``ROWWISE``): a sequential sum per K-16 slice added to the accumulator slice by slice, a function of ``K`` alone (not
of BM, BN or BK); the tiling, gather/scatter, tile-table and TMA logic are the same.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .backend import interpreter_enabled
from .triton_matmul import USE_ROW_TILE_VARIANTS, ensure_allocator
from .triton_norm import silu_mul
from .triton_shared import (
    COMPILE_OPTIONS,
    TL_DTYPE,
    cast_out,
    cuda_props,
    device_key,
    dot_flags,
    rne_fix,
    tile_coords,
    tma_ok,
)

_INTERPRET = interpreter_enabled()

_W_LOADS = {"ptr": 0, "tma_host": 1, "tma_device": 2}
"""``GroupedConfig.w_load`` -> the kernel's ``W_DESC``."""


@dataclass(frozen=True)
class GroupedConfig:
    """Launch configuration of the grouped GEMM.

    ``BM x BN`` output tiles, ``BK`` K tiles; ``group_m`` row tiles per program group (program order only);
    ``even_k``: drop the K-tail masks when ``K % BK == 0``; ``w_load``: ``"ptr"`` (masked pointer loads),
    ``"tma_host"`` / ``"tma_device"`` (TMA tensor descriptor over the ``[E * N, K]`` view of the weights, built on the
    host / on the device; Hopper and 16-byte-aligned rows only, otherwise pointer loads are used)."""

    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    group_m: int = 1
    even_k: bool = True
    w_load: str = "ptr"

    def __post_init__(self) -> None:
        if self.w_load not in _W_LOADS:
            raise ValueError(f"GroupedConfig.w_load must be one of {sorted(_W_LOADS)}, got {self.w_load!r}")
        if self.BK % 16 or self.BM % 16 or self.BN % 16:
            raise ValueError(f"GroupedConfig: BM, BN and BK must be multiples of 16, got {self}")


ROW_CLASSES: tuple[tuple[str, int | None], ...] = (("decode", 16), ("mid", 256), ("large", None))
"""``(name, most rows per expert)``, ascending: a call with ``S`` rows over ``E`` experts belongs to the first class
whose bound admits ``cdiv(S, E)`` (a function of shapes alone, so a CUDA graph at a static token count keeps one)."""

_HOPPER_16BIT: dict[str, GroupedConfig] = {
    "decode": GroupedConfig(BM=64, BN=128, BK=64, num_warps=4, num_stages=4),
    "mid": GroupedConfig(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, group_m=1, even_k=True, w_load="tma_host"),
    "large": GroupedConfig(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, group_m=1, even_k=True, w_load="tma_host"),
}
"""bf16 / fp16 on Hopper, per row class. Every entry must give the same bits as every other (``python
benchmarks/moe_bench.py --sweep`` times the candidates of :func:`grouped_candidates` and checks them bitwise); decode
keeps 64-row tiles, since decode steps give most experts one row."""


def row_class(rows: int, num_experts: int) -> str:
    """The :data:`ROW_CLASSES` name of a call with ``rows`` expert-sorted rows over ``num_experts`` experts."""
    per_expert = -(-rows // max(num_experts, 1))
    return next(name for name, bound in ROW_CLASSES if bound is None or per_expert <= bound)


@functools.cache
def _grouped_config(N: int, K: int, dtype: torch.dtype, device_key: tuple, klass: str, tma: bool) -> GroupedConfig:
    if device_key[0] == "interp":
        return GroupedConfig(BM=16, BN=32, BK=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # FMA path (ieee): tiles only affect speed
        return GroupedConfig(BM=64, BN=64, BK=32, num_warps=4, num_stages=3)
    hopper = cuda_props(device_key[1])[0] >= 9
    cfg = _HOPPER_16BIT[klass if hopper and USE_ROW_TILE_VARIANTS else "decode"]
    return cfg if cfg.w_load == "ptr" or tma else replace(cfg, w_load="ptr")


def grouped_config(
    N: int, K: int, dtype: torch.dtype, device: torch.device, rows: int, num_experts: int
) -> GroupedConfig:
    """The configuration of every call with these ``(N, K, dtype, device)`` and row class (:func:`row_class`). The
    members of one ``(N, K, dtype, device)`` differ only in tile shape, program order and load path, which do not
    change any row's bits (checked bitwise by the sweep and the interpreter tests)."""
    klass = row_class(rows, num_experts)
    return _grouped_config(N, K, dtype, device_key(device), klass, tma_ok(N, K, dtype, device))


def grouped_candidates() -> tuple[GroupedConfig, ...]:
    """bf16 / fp16 launch configurations the sweep times (``benchmarks/moe_bench.py --sweep``) and the interpreter
    tests compare bitwise; the first is the kernel as it was before row classes (64-row tiles, masked K tail, pointer
    loads) and is the bitwise reference."""
    g = GroupedConfig
    return (
        g(64, 128, 64, 4, 4, even_k=False),
        g(64, 128, 64, 4, 4),
        g(64, 128, 64, 4, 4, group_m=8),
        g(64, 128, 64, 4, 4, w_load="tma_host"),
        g(64, 128, 128, 4, 3),
        g(64, 256, 64, 4, 3),
        g(64, 256, 64, 8, 3),
        g(128, 64, 64, 4, 4),
        g(128, 128, 64, 4, 4),
        g(128, 128, 64, 8, 4),
        g(128, 128, 64, 8, 4, group_m=4),
        g(128, 128, 64, 8, 4, w_load="tma_host"),
        g(128, 128, 64, 8, 4, w_load="tma_device"),
        g(128, 128, 64, 8, 4, group_m=8, w_load="tma_host"),
        g(128, 128, 128, 8, 3),
        g(128, 256, 64, 8, 3),
        g(128, 256, 64, 8, 3, w_load="tma_host"),
        g(128, 256, 64, 8, 3, group_m=8, w_load="tma_host"),
        g(128, 256, 64, 8, 4, w_load="tma_host"),
    )


# ----------------------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _router_kernel(
    z_ptr,
    w_ptr,
    id_ptr,
    E,
    stride_z,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    RNE_FIX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    z = tl.load(z_ptr + row * stride_z + offs, mask=ok, other=float("-inf")).to(tl.float32)
    ex = tl.where(ok, tl.exp(z - tl.max(z, axis=0)), 0.0)
    p = tl.where(ok, ex / tl.sum(ex, axis=0), -1.0)  # padding lanes rank below every probability
    kk = tl.arange(0, BLOCK_K)
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    sel = tl.zeros((BLOCK_K,), dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(TOP_K):
        v = tl.max(p, axis=0)
        i = tl.min(tl.where(p == v, offs, BLOCK_E), axis=0)  # lowest expert index among equal probabilities
        i = tl.minimum(i, E - 1)  # a NaN row matches nothing: keep its ids in range (the NaN stays in that row)
        top = tl.where(kk == j, v, top)
        sel = tl.where(kk == j, i.to(tl.int64), sel)
        total = total + v
        p = tl.where(offs == i, -2.0, p)
    if NORM:
        top = top / total
    k_ok = kk < TOP_K
    tl.store(w_ptr + row * TOP_K + kk, cast_out(top, OUT_DTYPE, RNE_FIX), mask=k_ok)
    tl.store(id_ptr + row * TOP_K + kk, sel, mask=k_ok)


_ROWWISE_CHUNK = tl.constexpr(16)
"""K width of one step of the interpreter's reduction (:func:`_rowwise_dot`): a Hopper tensor-core instruction's K."""


@triton.jit
def _rowwise_dot(a, b, acc, BK: tl.constexpr):
    """``acc`` plus ``a [BM, BK] @ b [BK, BN]`` as the interpreter's stand-in for ``tl.dot``: per ``_ROWWISE_CHUNK``
    slice of K, in ascending order, the sequential fp32 sum of that slice's products is added to ``acc``. Each
    element uses its own row and column only, and the sequence of additions is the same for every ``BK`` that is a
    multiple of the slice, like the hardware's chain of K-16 instructions. (A slice is picked out of the tile by a
    sum with zeros, which is exact.)"""
    NC: tl.constexpr = BK // _ROWWISE_CHUNK
    a3 = tl.reshape(a, (a.shape[0], NC, _ROWWISE_CHUNK))
    b3 = tl.reshape(b, (NC, _ROWWISE_CHUNK, b.shape[1]))
    idx = tl.arange(0, NC)
    for j in tl.static_range(NC):
        aj = tl.sum(tl.where((idx == j)[None, :, None], a3, 0.0), axis=1)
        bj = tl.sum(tl.where((idx == j)[:, None, None], b3, 0.0), axis=0)
        acc = acc + tl.sum(aj[:, :, None] * bj[None, :, :], axis=1)
    return acc


@triton.jit
def _grouped_mm_kernel(
    a_ptr,
    w_ptr,
    o_ptr,
    gather_ptr,
    scatter_ptr,
    counts_ptr,
    E,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    tiles_m,
    tiles_n,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_DESC: tl.constexpr,
    GATHER: tl.constexpr,
    GATHER_DIV: tl.constexpr,
    SCATTER: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    RNE_FIX: tl.constexpr,
    ROWWISE: tl.constexpr,
):
    """One ``BM x BN`` output tile of one expert: rows ``[row0, row1)`` of the sorted rows, columns ``pid_n * BN``.

    Row tile ``pid_m`` is found from the per-expert row counts alone: expert ``e`` owns tiles
    ``[tile_end[e-1], tile_end[e])`` with ``tile_end = cumsum(cdiv(counts, BM))``; tiles past the last are idle.
    ``GROUP_M`` orders the programs in groups of that many row tiles (one weight tile serves consecutive programs).
    ``EVEN_K`` (``K % BK == 0``): no K-tail masks. ``W_DESC``: ``w`` tiles come from a TMA descriptor over the
    ``[E * N, K]`` view of ``w`` (0: pointer loads, 1: ``w_ptr`` is a host descriptor, 2: built on the device);
    columns past ``N`` read the next expert's rows (or TMA's zero fill) and are never stored."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    cnt = tl.load(counts_ptr + offs_e, mask=e_ok, other=0).to(tl.int32)
    ends = tl.cumsum(cnt, axis=0)
    tile_end = tl.cumsum((cnt + BM - 1) // BM, axis=0)
    e = tl.sum(((tile_end <= pid_m) & e_ok).to(tl.int32), axis=0)
    if e < E:  # idle tiles of the worst-case grid do nothing
        sel = offs_e == e
        cnt_e = tl.sum(tl.where(sel, cnt, 0), axis=0)
        end_e = tl.sum(tl.where(sel, ends, 0), axis=0)
        first_tile = tl.sum(tl.where(sel, tile_end, 0), axis=0) - (cnt_e + BM - 1) // BM
        row0 = end_e - cnt_e + (pid_m - first_tile) * BM
        rm = row0 + tl.arange(0, BM)
        m_ok = rm < end_e
        if GATHER:
            src = (tl.load(gather_ptr + rm, mask=m_ok, other=0) // GATHER_DIV).to(tl.int64)
        else:
            src = rm.to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        rk = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * stride_am + rk[None, :]
        if W_DESC == 2:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BN, BK])
        elif W_DESC == 1:
            w_desc = w_ptr
        if W_DESC == 0:
            w_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # w[e]^T
        else:
            w_row = e * N + pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):  # ascending K, accumulator chained through tl.dot
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=m_ok[:, None] & (rk < K - ki * BK)[None, :], other=0.0)
            if W_DESC != 0:
                b = tl.trans(w_desc.load([w_row, ki * BK]))
            elif EVEN_K:
                b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                b = tl.load(w_ptrs, mask=n_ok[None, :] & (rk < K - ki * BK)[:, None], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if ROWWISE:
                acc = _rowwise_dot(a, b, acc, BK)
            elif IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BK
            if W_DESC == 0:
                w_ptrs += BK
        if SCATTER:
            dst = tl.load(scatter_ptr + rm, mask=m_ok, other=0).to(tl.int64)
        else:
            dst = rm.to(tl.int64)
        o_ptrs = o_ptr + dst[:, None] * stride_om + rn[None, :]
        tl.store(o_ptrs, cast_out(acc, o_ptr.dtype.element_ty, RNE_FIX), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    g_ptr,
    a_ptr,
    o_ptr,
    gather_ptr,
    counts_ptr,
    E,
    N,
    K,
    stride_gm,
    stride_am,
    tiles_k,
    BR: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GATHER: tl.constexpr,
    GATHER_DIV: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    RNE_FIX: tl.constexpr,
):
    """``o[e] = g[rows_e]^T @ a[src(rows_e)]`` for one ``BN x BK`` tile of expert ``e = program_id(0)``: the expert's
    sorted rows are reduced in ``BR``-row chunks in ascending order into one fp32 accumulator (no atomics, no
    split over rows), so the result is deterministic."""
    e = tl.program_id(0)
    pid = tl.program_id(1)
    pid_n = pid // tiles_k
    pid_k = pid % tiles_k
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int32)
    sel = offs_e == e
    end = tl.sum(tl.where(sel, tl.cumsum(cnt, axis=0), 0), axis=0)
    start = end - tl.sum(tl.where(sel, cnt, 0), axis=0)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    n_ok = rn < N
    k_ok = rk < K
    rr = tl.arange(0, BR)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + rr
        r_ok = rows < end
        if GATHER:
            src = (tl.load(gather_ptr + rows, mask=r_ok, other=0) // GATHER_DIV).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * stride_gm + rn[None, :], mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0)  # fmt: skip
        a = tl.load(a_ptr + src[:, None] * stride_am + rk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            g = g.to(tl.float32)
            a = a.to(tl.float32)
        if IEEE:
            acc = tl.dot(tl.trans(g), a, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(g), a, acc)
    o_ptrs = o_ptr + e.to(tl.int64) * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :]
    tl.store(o_ptrs, cast_out(acc, o_ptr.dtype.element_ty, RNE_FIX), mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def _combine_kernel(
    y_ptr,
    w_ptr,
    o_ptr,
    H,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    RNE_FIX: tl.constexpr,
):
    """``out[t] = sum_j w[t, j] * y[t * k + j]`` in fp32, ``j`` ascending, cast once; one program per token and
    column block (an element's operation sequence does not depend on the number of tokens)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        yj = tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc + wj * yj
    tl.store(o_ptr + t * H + cols, cast_out(acc, OUT_DTYPE, RNE_FIX), mask=ok)


# ----------------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------------


def moe_router(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in logits.dtype, expert ids [T, k] int64)`` from router logits ``[T, E]``; see module doc."""
    t, e = logits.shape
    weights = torch.empty((t, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    _router_kernel[(t,)](
        z, weights, ids, e, z.stride(0),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k), NORM=norm_topk_prob,
        OUT_DTYPE=TL_DTYPE[weights.dtype], RNE_FIX=rne_fix(weights.dtype),
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return weights, ids


def num_row_tiles(rows: int, num_experts: int, bm: int) -> int:
    """Worst-case number of ``bm``-row tiles for ``rows`` expert-sorted rows over ``num_experts`` experts (each
    non-empty expert wastes at most ``bm - 1`` rows): the launch grid, from shapes alone (no host synchronization)."""
    return (rows + min(num_experts, rows) * (bm - 1)) // bm


def grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor,
    gather: torch.Tensor | None,
    scatter: torch.Tensor | None,
    gather_div: int = 1,
    cfg: GroupedConfig | None = None,
) -> torch.Tensor:
    """Write the expert-grouped ``a @ w[e].T`` into ``out [S, N]`` (fp32 accumulation, cast to ``out.dtype``).

    ``a [Ma, K]`` and ``w [E, N, K]`` of one dtype (fp32, bf16 or fp16) with unit last stride; ``counts [E]`` (any
    integer dtype, on the device) are the rows per expert of the ``S`` expert-sorted rows; sorted row ``r`` reads
    ``a[gather[r] // gather_div]`` (``a[r]`` if None) and writes ``out[scatter[r]]`` (``out[r]`` if None). ``cfg``
    overrides the configuration (benchmark sweeps, tests; the default is :func:`grouped_config`).
    """
    n, k = w.shape[1], w.shape[2]
    e = w.shape[0]
    cfg = cfg or grouped_config(n, k, a.dtype, a.device, out.shape[0], e)
    tiles_m = num_row_tiles(out.shape[0], e, cfg.BM)
    if tiles_m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    w_load = cfg.w_load
    if w_load != "ptr" and not (w.is_contiguous() and w.data_ptr() % 16 == 0 and (k * w.element_size()) % 16 == 0):
        w_load = "ptr"  # same arithmetic; TMA needs a contiguous, 16-byte-aligned [E * N, K] view
    w_arg = w
    if w_load == "tma_host":
        w_arg = TensorDescriptor.from_tensor(w.view(e * n, k), [cfg.BN, cfg.BK])
    elif w_load == "tma_device":
        ensure_allocator()
    tiles_n = triton.cdiv(n, cfg.BN)
    _grouped_mm_kernel[(tiles_m * tiles_n,)](
        a, w_arg, out,
        gather if gather is not None else counts, scatter if scatter is not None else counts,  # unread if absent
        counts, e, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), tiles_m, tiles_n,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, BLOCK_E=triton.next_power_of_2(e), GROUP_M=cfg.group_m,
        EVEN_K=cfg.even_k and k % cfg.BK == 0, W_DESC=_W_LOADS[w_load], GATHER=gather is not None,
        GATHER_DIV=gather_div, SCATTER=scatter is not None,
        RNE_FIX=rne_fix(out.dtype), ROWWISE=_INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dot_flags(a.dtype),
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


def silu_mul_halves(h: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu_mul(h[:, :inter], h[:, inter:])`` of a gate/up activation ``h [S, 2 * inter]`` without copying the
    halves (:func:`rlexact.ops.triton_norm.silu_mul` takes their row stride)."""
    return silu_mul(h[:, :inter], h[:, inter:])


COMBINE_BLOCK = 1024
"""Columns per program of :func:`combine`."""


def combine(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]`` in ``out_dtype``: the fp32 top-k combine of ``y [T * k, H]`` (pair-major rows) with
    ``weights [T, k]``."""
    t, k = weights.shape
    h = y.shape[1]
    out = torch.empty((t, h), dtype=out_dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    block = min(COMBINE_BLOCK, triton.next_power_of_2(h))
    _combine_kernel[(t, triton.cdiv(h, block))](
        y.contiguous(), weights.contiguous(), out, h, TOP_K=k, BLOCK_H=block, OUT_DTYPE=TL_DTYPE[out_dtype],
        RNE_FIX=rne_fix(out_dtype),
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


def grouped_wgrad(
    g: torch.Tensor,
    a: torch.Tensor,
    counts: torch.Tensor,
    gather: torch.Tensor | None,
    gather_div: int = 1,
) -> torch.Tensor:
    """Per-expert weight gradient ``out[e] = g[rows_e]^T @ a[src(rows_e)]`` -> ``[E, N, K]`` in ``g.dtype``.

    ``g [S, N]`` expert-sorted rows (``counts [E]`` rows per expert, in expert order), ``a [Ma, K]`` read at
    ``gather[r] // gather_div`` (row ``r`` if None); same dtype. fp32 accumulation over each expert's rows in
    ascending order, one program per output tile: deterministic, no atomics. Experts without rows get zeros.
    """
    e = counts.numel()
    n, k = g.shape[1], a.shape[1]
    out = torch.empty((e, n, k), dtype=g.dtype, device=g.device)
    if out.numel() == 0:
        return out
    interp = g.device.type != "cuda"
    bn, bk, br = (32, 32, 16) if interp else (128, 128, 64)
    tiles_k = triton.cdiv(k, bk)
    g = g if g.stride(-1) == 1 else g.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    _grouped_wgrad_kernel[(e, triton.cdiv(n, bn) * tiles_k)](
        g, a, out, gather if gather is not None else counts, counts, e, n, k, g.stride(0), a.stride(0), tiles_k,
        BR=br, BN=bn, BK=bk, BLOCK_E=triton.next_power_of_2(e), GATHER=gather is not None, GATHER_DIV=gather_div,
        RNE_FIX=rne_fix(out.dtype), num_warps=8 if not interp else 4, num_stages=3 if not interp else 1,
        **dot_flags(g.dtype),
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return out
