"""Fused lm-head + temperature + log-softmax + gather (+ entropy) in Triton, batch-invariant.

One kernel, :func:`_head_kernel`, computes for a tile of ``BM`` rows and a fixed slice of the vocabulary (a *split*
of ``VS`` columns, ``VS`` a multiple of the vocab chunk ``BV``):

* ``z = (hidden @ w.T) / temperature`` chunk by chunk (``BM x BV`` tiles, K loop over H in ``BK`` steps in ascending
  order, fp32 accumulation through ``tl.dot``'s accumulator, fp32 ``ieee`` for fp32 inputs, IEEE division by the
  temperature -- skipped when the temperature is exactly 1.0, where it is the identity);
* an online max / sum-exp / sum-exp-times-z over the split's chunks in ascending order;
* the target's ``z`` when the target falls in the split.

Partials ``(m, s, t)`` per (split, row) go to a small ``[3, n_split, T]`` buffer and :func:`_head_merge_kernel`
combines the splits of each row in ascending split order: ``lse = m + log(s)``, ``entropy = lse - t / s``,
``logp = z[target] - lse``. The split size, the vocabulary chunk and the K step depend only on ``(H, V, dtype,
device)`` (the split count is chosen from V and the device's SM count so that decode-sized calls still fill the GPU),
never on the number of rows, so every row's bits are independent of the batch. Calls of at most
:data:`DECODE_ROWS` rows may use other row tiles (:func:`decode_head_config`), only where a sweep showed every row
bitwise equal. Memory: ``[T, V]`` fp32 logits are never
materialized; the only extra storage is ``12 * n_split`` bytes per row.

``lm_head_logits`` runs the *same* kernel with ``STORE_Z`` set: it additionally stores the ``z`` tiles it computes and
returns the merged ``lse``. Since ``z`` and ``lse`` come from identical arithmetic,
``z[i, t] - lse[i] == token_logprobs(hidden, w, t)[0][i]`` bitwise for every ``t`` (tested).

Programs are ordered in groups of ``GROUP_M`` row tiles so that concurrently running programs share vocabulary
chunks in L2 (speed only; the order does not affect any value).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_entry, pdl_options
from .triton_shared import (
    COMPILE_OPTIONS,
    HAS_WS,
    TensorDescriptor,
    aligned,
    cuda_props,
    device_key,
    dot_flags,
    tile_coords,
)


@dataclass(frozen=True)
class HeadConfig:
    BM: int
    BV: int
    BK: int
    VS: int
    """Vocabulary columns per split (a multiple of BV)."""
    num_warps: int
    num_stages: int
    tma: bool
    group_m: int = 16
    flatten: bool = False
    """The vocabulary-chunk loop and its K loop software-pipelined as one loop (loads of the next chunk issued under
    this chunk's last products and epilogue); the same products and epilogue, so the same bits. On with TMA loads,
    off with pointer loads (``benchmarks/results/head_flatten_h200.json``)."""


@functools.cache
def _head_config(H: int, V: int, dtype: torch.dtype, device_key: tuple) -> HeadConfig:
    if device_key[0] == "interp":
        bm, bv, bk, warps, stages, tma, target = 16, 32, 32, 4, 1, False, 4
    else:
        major, sms = cuda_props(device_key[1])
        target = sms
        if dtype == torch.float32:
            bm, bv, bk, warps, stages, tma = 64, 64, 32, 4, 3, False
        else:
            tma = major >= 9 and TensorDescriptor is not None and HAS_WS and (H * dtype.itemsize) % 16 == 0
            bm, bv, bk, warps, stages = 128, 128, 64, 8, 4
    chunks = triton.cdiv(V, bv)
    vs = triton.cdiv(chunks, target) * bv
    return HeadConfig(bm, bv, bk, vs, warps, stages, tma, flatten=tma)


def head_config(H: int, V: int, dtype: torch.dtype, device: torch.device) -> HeadConfig:
    """The launch configuration of calls with more than :data:`DECODE_ROWS` rows: a function of ``(H, V, dtype,
    device)`` only."""
    return _head_config(H, V, dtype, device_key(device))


DECODE_ROWS = 64
"""Calls with at most this many rows (decode steps) use :func:`decode_head_config`."""


@functools.cache
def _decode_head_config(H: int, V: int, dtype: torch.dtype, device_key: tuple) -> HeadConfig:
    base = _head_config(H, V, dtype, device_key)
    if device_key[0] != "cuda" or dtype == torch.float32 or cuda_props(device_key[1])[0] < 9:
        return base
    return dataclasses.replace(base, BM=64, num_warps=4, num_stages=6, tma=False, flatten=False)


def decode_head_config(H: int, V: int, dtype: torch.dtype, device: torch.device) -> HeadConfig:
    """The launch configuration of calls with at most :data:`DECODE_ROWS` rows. On Hopper (16-bit) it differs from
    :func:`head_config` only in the rows per program, warps, stages, load path and loop flattening, never in ``BV``,
    ``BK`` or ``VS``: 64-row tiles over 4 warps keep 16 rows per warp, as the 128-row tiles over 8 warps do, and gave
    the same bits for the log-prob, entropy and log-sum-exp of every row (``benchmarks/head_variants.py``,
    ``benchmarks/results/head_variants_h200.json``; fewer rows per warp did not). Elsewhere it is
    :func:`head_config`."""
    return _decode_head_config(H, V, dtype, device_key(device))


@triton.jit
def logit_tile(h_ptr, w_ptr, h_desc, w_desc, rows64, r_ok, cols, c_ok, rk, desc_row, desc_col, k_tiles, H, stride_h,
               stride_w, BM: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
               IEEE: tl.constexpr):  # fmt: skip
    """The fp32 logits ``hidden[rows] @ w[cols].T`` of one ``[BM, BV]`` tile: ``k_tiles`` steps of ``BK`` columns of
    ``H`` in ascending order, the accumulator chained through ``tl.dot``. With ``TMA`` the operands come from ``h_desc``
    at row ``desc_row`` and ``w_desc`` at row ``desc_col``; otherwise from the pointers (row strides ``stride_h`` and
    ``stride_w``, ``cols`` rows of ``w``, masked by ``r_ok`` and ``c_ok``). The head's forward (:func:`_head_kernel`,
    whose logits the sampler takes too) and the recompute in its backward (``triton_backward._head_dz_kernel``) both
    take their logits from here."""
    acc = tl.zeros((BM, BV), dtype=tl.float32)
    for ki in range(k_tiles):  # ascending K, accumulator chained through tl.dot
        if TMA:
            a = h_desc.load([desc_row, ki * BK])
            b = w_desc.load([desc_col, ki * BK])
            acc = tl.dot(a, b.T, acc)
        else:
            k_ok = rk < H - ki * BK
            a = tl.load(
                h_ptr + rows64[:, None] * stride_h + (ki * BK + rk)[None, :],
                mask=r_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + cols.to(tl.int64)[None, :] * stride_w + (ki * BK + rk)[:, None],
                mask=c_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["T", "n_split"])
def _head_kernel(
    h_ptr,
    w_ptr,
    h_desc,
    w_desc,
    tgt_ptr,
    z_ptr,
    part_ptr,
    zt_ptr,
    T,
    V,
    H,
    stride_h,
    stride_w,
    stride_z,
    temperature,
    n_split,
    VS: tl.constexpr,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_TGT: tl.constexpr,
    STORE_Z: tl.constexpr,
    SCALE: tl.constexpr,
    TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    pdl_entry(PDL)
    pid_m, sid = tile_coords(tl.program_id(0), tl.cdiv(T, BM), n_split, GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    r_ok = rows < T
    rows64 = rows.to(tl.int64)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    if HAS_TGT:
        tgt = tl.load(tgt_ptr + rows64, mask=r_ok, other=-1)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    s_i = tl.zeros((BM,), tl.float32)
    t_i = tl.zeros((BM,), tl.float32)
    zt = tl.full((BM,), float("-inf"), tl.float32)
    v0 = sid * VS
    v_end = tl.minimum(v0 + VS, V)
    k_tiles = tl.cdiv(H, BK)
    for c0 in tl.range(v0, v_end, BV, flatten=FLATTEN):
        cols = c0 + rv
        c_ok = cols < V
        acc = logit_tile(h_ptr, w_ptr, h_desc, w_desc, rows64, r_ok, cols, c_ok, rk, pid_m * BM, c0, k_tiles, H,
                         stride_h, stride_w, BM, BV, BK, TMA, UPCAST, IEEE)  # fmt: skip
        if SCALE:
            z = tl.math.div_rn(acc, temperature)
        else:
            z = acc
        if STORE_Z:
            tl.store(z_ptr + rows64[:, None] * stride_z + cols[None, :], z, mask=r_ok[:, None] & c_ok[None, :])
        zm = tl.where(c_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(zm, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(zm - m_new[:, None])
        s_i = s_i * alpha + tl.sum(p, axis=1)
        t_i = t_i * alpha + tl.sum(p * tl.where(c_ok[None, :], z, 0.0), axis=1)
        m_i = m_new
        if HAS_TGT:
            zt = tl.maximum(zt, tl.max(tl.where(cols[None, :] == tgt[:, None], z, float("-inf")), axis=1))
    base = part_ptr + sid.to(tl.int64) * T + rows64
    stride_part = n_split.to(tl.int64) * T
    tl.store(base, m_i, mask=r_ok)
    tl.store(base + stride_part, s_i, mask=r_ok)
    tl.store(base + 2 * stride_part, t_i, mask=r_ok)
    if HAS_TGT:
        mine = r_ok & (tgt >= v0) & (tgt < v_end)
        tl.store(zt_ptr + rows64, zt, mask=mine)


@triton.jit
def _take(tile, sel):
    """Column ``sel`` of ``tile [BLOCK, U]`` as ``[BLOCK]``, exactly (a maximum over one value and ``-inf``)."""
    return tl.max(tl.where(sel[None, :], tile, float("-inf")), 1)


@triton.jit(do_not_specialize=["T", "n_split"])
def _head_merge_kernel(
    part_ptr,
    zt_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    T,
    n_split,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
    HAS_TGT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Fold each row's split partials ``(m, s, t)`` in ascending split order. The partials of ``UNROLL`` consecutive
    splits are loaded together (one memory round trip instead of ``UNROLL``) and then folded one split at a time,
    so the arithmetic and its order do not depend on ``UNROLL``."""
    pdl_entry(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < T
    rows64 = rows.to(tl.int64)
    stride_part = n_split.to(tl.int64) * T
    cols = tl.arange(0, UNROLL)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    t = tl.zeros((BLOCK,), tl.float32)
    for j0 in range(0, n_split, UNROLL):  # ascending split order
        base = part_ptr + (j0 + cols)[None, :].to(tl.int64) * T + rows64[:, None]
        live = ok[:, None] & ((j0 + cols) < n_split)[None, :]
        m_tile = tl.load(base, mask=live, other=0.0)
        s_tile = tl.load(base + stride_part, mask=live, other=1.0)
        t_tile = tl.load(base + 2 * stride_part, mask=live, other=0.0)
        for u in tl.static_range(UNROLL):
            if j0 + u < n_split:
                sel = cols == u
                mj = _take(m_tile, sel)
                sj = _take(s_tile, sel)
                tj = _take(t_tile, sel)
                m_new = tl.maximum(m, mj)
                a = tl.exp(m - m_new)
                b = tl.exp(mj - m_new)
                s = s * a + sj * b
                t = t * a + tj * b
                m = m_new
    lse = m + tl.log(s)
    tl.store(lse_ptr + rows64, lse, mask=ok)
    tl.store(ent_ptr + rows64, lse - tl.math.div_rn(t, s), mask=ok)
    if HAS_TGT:
        ztv = tl.load(zt_ptr + rows64, mask=ok, other=0.0)
        tl.store(logp_ptr + rows64, ztv - lse, mask=ok)


MERGE_BLOCK = 128
MERGE_UNROLL = 16
"""Splits whose partials :func:`_head_merge_kernel` loads together (speed only; the fastest of 1 ... 16 at 4, 64 and
256 rows in ``benchmarks/results/sampler_merge_h200.json``, which also checks that every value gives the same bits)."""


def _run_head(
    hidden: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor | None,
    temperature: float,
    store_z: bool,
    cfg: HeadConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(z or None, logp, entropy, lse)`` (logp is garbage when ``targets`` is None).

    ``cfg`` overrides :func:`head_config` / :func:`decode_head_config` (tests and benchmarks only: exactness needs
    the library's configurations).
    """
    if hidden.dim() != 2 or w.dim() != 2 or hidden.shape[1] != w.shape[1]:
        raise ValueError(f"lm head: bad shapes hidden {tuple(hidden.shape)}, w {tuple(w.shape)}")
    hidden = hidden.contiguous()
    w = w.contiguous()
    if hidden.dtype != w.dtype or hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        hidden, w = hidden.float(), w.float()
    T, H = hidden.shape
    V = w.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    z = torch.empty((T, V), **f32) if store_z else None
    logp, ent, lse = torch.empty(T, **f32), torch.empty(T, **f32), torch.empty(T, **f32)
    if T == 0:
        return z, logp, ent, lse
    if cfg is None:
        cfg = (decode_head_config if T <= DECODE_ROWS else head_config)(H, V, hidden.dtype, dev)
    n_split = triton.cdiv(V, cfg.VS)
    part = torch.empty((3, n_split, T), **f32)
    zt = torch.empty(T, **f32)
    if cfg.tma:
        hidden, w = aligned(hidden), aligned(w)
        h_desc = TensorDescriptor.from_tensor(hidden, [cfg.BM, cfg.BK])
        w_desc = TensorDescriptor.from_tensor(w, [cfg.BV, cfg.BK])
    else:
        h_desc, w_desc = hidden, w
    has_tgt = targets is not None
    tgt = targets.contiguous() if has_tgt else zt  # dummy pointer when absent
    grid = (triton.cdiv(T, cfg.BM) * n_split,)
    pdl = pdl_options(dev)
    _head_kernel[grid](
        hidden,
        w,
        h_desc,
        w_desc,
        tgt,
        z if store_z else zt,
        part,
        zt,
        T,
        V,
        H,
        hidden.stride(0),
        w.stride(0),
        V,
        float(temperature),
        n_split,
        VS=cfg.VS,
        BM=cfg.BM,
        BV=cfg.BV,
        BK=cfg.BK,
        GROUP_M=cfg.group_m,
        HAS_TGT=has_tgt,
        STORE_Z=store_z,
        SCALE=float(temperature) != 1.0,
        TMA=cfg.tma,
        FLATTEN=cfg.flatten,
        **dot_flags(hidden.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
        **COMPILE_OPTIONS,
    )
    merge_splits(part, zt, has_tgt, logp, ent, lse)
    return z, logp, ent, lse


def merge_splits(
    part: torch.Tensor,
    zt: torch.Tensor,
    has_tgt: bool,
    logp: torch.Tensor,
    ent: torch.Tensor,
    lse: torch.Tensor,
    unroll: int = MERGE_UNROLL,
) -> None:
    """Fold the head's split partials ``part [3, n_split, T]`` (max, sum of exponentials, sum of exponentials times
    ``z``) in ascending split order into ``lse``, ``ent`` and, with ``has_tgt``, ``logp = zt - lse`` (all ``[T]``
    fp32, written in place). ``unroll`` (benchmarks) only sets how many splits' partials one round trip loads."""
    n_split, T = part.shape[1], part.shape[2]
    _head_merge_kernel[(triton.cdiv(T, MERGE_BLOCK),)](
        part, zt, logp, ent, lse, T, n_split, BLOCK=MERGE_BLOCK, UNROLL=unroll, HAS_TGT=has_tgt, num_warps=4,
        **pdl_options(part.device),
        **COMPILE_OPTIONS,
    )  # fmt: skip


def token_logprobs(
    hidden: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [T, H]``, ``w [V, H]``, ``targets [T]`` int64 -> ``(logp [T], entropy [T])`` fp32."""
    logp, ent, _ = token_logprobs_lse(hidden, w, targets, temperature)
    return logp, ent


def token_logprobs_lse(
    hidden: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` plus the per-row ``logsumexp(z) [T]`` fp32 that it computed (saved for the backward);
    ``logp`` and ``entropy`` are the same launch's outputs, so their bits are those of :func:`token_logprobs`."""
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden rows {hidden.shape[0]}")
    _, logp, ent, lse = _run_head(hidden, w, targets.long(), temperature, store_z=False)
    return logp, ent, lse


def lm_head_logits(hidden: torch.Tensor, w: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [B, H]``, ``w [V, H]`` -> ``(z [B, V] fp32, lse [B] fp32)`` from the same kernel as token_logprobs."""
    z, _, _, lse = _run_head(hidden, w, None, temperature, store_z=True)
    return z, lse
