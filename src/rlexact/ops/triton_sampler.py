"""Fused keyed Gumbel-argmax in Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``).

Two launches per sampling step, no ``[B, V]`` temporaries, no host synchronization:

* ``_gumbel_argmax_kernel``, grid ``(B, S)``: program ``(r, s)`` derives row ``r``'s keys (the integer function of
  :func:`rlexact.ops.keyed_hash.row_keys`) and streams vocabulary slice ``s`` of its logits once: 32-bit hash
  (uint32 arithmetic, the same integer function as :func:`rlexact.ops.keyed_hash.token_hash`), Gumbel noise
  (:func:`_gumbel`: a series near ``u = 1``, hardware base-2 logarithms elsewhere), optional threshold mask, running
  maximum. It stores the slice's maximum score and the first index attaining it.
* ``_argmax_merge_kernel``, grid ``(B,)``: the largest of the ``S`` slice maxima and, among the slices attaining it,
  the smallest index; optionally the token's log-prob ``z[token] - lse``.

The sampled token is the first index of the row's maximum score whatever ``S`` is: a maximum and the smallest index
attaining it are exact and do not depend on how the row is cut. ``S`` (:func:`vocab_splits`) therefore follows the
batch size, so that a few rows still occupy every SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlexact.ops.backend import interpreter_enabled
from rlexact.ops.keyed_hash import C1, C2, MASK32, ROW_SALT
from rlexact.ops.triton_pdl import pdl_entry, pdl_options
from rlexact.ops.triton_shared import COMPILE_OPTIONS, num_sms

__all__ = ["gumbel_argmax_triton", "vocab_splits"]

_BLOCK_V = 2048
"""Vocabulary entries per loop iteration of a program (and the granularity of a slice)."""
_PROGRAMS_PER_SM = 2
"""Target programs per SM when choosing the number of vocabulary slices."""


@triton.jit
def _mix32(x, c1, c2):
    """lowbias32 on uint32 tensors (``c1, c2``: the multipliers as uint32 tensors broadcastable to ``x``)."""
    x = x ^ (x >> 16)
    x = x * c1
    x = x ^ (x >> 15)
    x = x * c2
    return x ^ (x >> 16)


_LN2 = tl.constexpr(0.6931471805599453)
_U_STEP = tl.constexpr(2.0**-23)
"""Spacing of the uniform grid ``u = (k + 0.5) * _U_STEP`` that the hash's 23 high bits ``k`` index."""
_SERIES_MAX = tl.constexpr(2.0**-6)
"""Below this distance of ``u`` from 1, ``-ln(u)`` is summed as the series ``d + d**2/2 + ... + d**5/5`` of
``d = 1 - u`` (its first omitted term is under one fp32 ulp of the sum); above it, a logarithm of ``u`` keeps
enough relative accuracy."""


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """``log2(x)`` of positive normal fp32 ``x``: the GPU's ``lg2.approx.f32`` (one special-function instruction,
    absolute error below ``2**-22``) when ``FAST``, else ``tl.log2`` (libdevice on the GPU, exact under the
    interpreter)."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return tl.log2(x)


@triton.jit
def _gumbel(h, FAST: tl.constexpr):
    """Standard Gumbel noise ``-ln(-ln u)`` from uint32 hashes ``h``, ``u = ((h >> 9) + 0.5) * 2**-23``.

    ``-ln u`` near ``u = 1`` (the largest noise values, the ones that win draws) comes from the series in
    ``d = 1 - u``, which is exact in fp32 there, so an approximate logarithm's absolute error never reaches it; the
    two logarithms left are base-2 and need no more than absolute accuracy (:func:`_log2`)."""
    k = (h >> 9).to(tl.float32)  # < 2**23: exact, and so are u and d
    u = (k + 0.5) * _U_STEP
    d = ((8388607.0 - k) + 0.5) * _U_STEP
    series = d + d * d * (0.5 + d * (0.3333333432674408 + d * (0.25 + d * 0.20000000298023224)))
    e = tl.where(d <= _SERIES_MAX, series, -_LN2 * _log2(u, FAST))
    return -_LN2 * _log2(e, FAST)


@triton.jit
def _row_keys(seed_lo_salted, seed_hi, rid, pos, C1: tl.constexpr, C2: tl.constexpr, SALT: tl.constexpr):
    """The row keys ``(ka, kb)`` (uint32, ``rid``'s shape) of :func:`rlexact.ops.keyed_hash.row_keys`, from int64
    request ids ``rid`` and positions ``pos`` and the seed's halves (``seed_lo_salted`` is the low half xor
    ``SALT``)."""
    k1 = tl.full(rid.shape, C1, tl.uint32)
    k2 = tl.full(rid.shape, C2, tl.uint32)
    k = _mix32(tl.full(rid.shape, seed_lo_salted, tl.int64).to(tl.uint32), k1, k2)
    k = _mix32(k ^ tl.full(rid.shape, seed_hi, tl.int64).to(tl.uint32), k1, k2)
    k = _mix32(k ^ rid.to(tl.uint32), k1, k2)
    k = _mix32(k ^ (rid >> 32).to(tl.uint32), k1, k2)
    k = _mix32(k ^ pos.to(tl.uint32), k1, k2)
    ka = _mix32(k ^ (pos >> 32).to(tl.uint32), k1, k2)
    kb = _mix32(ka ^ tl.full(rid.shape, SALT, tl.int64).to(tl.uint32), k1, k2)
    return ka, kb


@triton.jit
def _token_gumbel(ka, kb, cols, C1: tl.constexpr, C2: tl.constexpr, FAST: tl.constexpr):
    """The keyed Gumbel noise of vocabulary ids ``cols`` (int32) under row keys ``ka, kb`` (broadcast against
    ``cols``): :func:`_gumbel` of the hash ``mix32(mix32(ka ^ v) ^ kb)`` of
    :func:`rlexact.ops.keyed_hash.token_hash`."""
    c1 = tl.full(cols.shape, C1, tl.uint32)
    c2 = tl.full(cols.shape, C2, tl.uint32)
    return _gumbel(_mix32(_mix32(ka ^ cols.to(tl.uint32), c1, c2) ^ kb, c1, c2), FAST)


@triton.jit(do_not_specialize=["seed_lo_salted", "seed_hi"])  # a new seed never compiles a new kernel
def _gumbel_argmax_kernel(
    z_ptr,
    thr_ptr,
    rid_ptr,
    pos_ptr,
    best_ptr,
    idx_ptr,
    seed_lo_salted,
    seed_hi,
    V,
    stride_z,
    SLICE_V,
    HAS_THR: tl.constexpr,
    BLOCK_V: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    SALT: tl.constexpr,
    FAST_LOG: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    row = tl.program_id(0)
    sl = tl.program_id(1)
    one = tl.arange(0, 1)
    rid = tl.load(rid_ptr + row + one)
    pos = tl.load(pos_ptr + row + one)
    ka, kb = _row_keys(seed_lo_salted, seed_hi, rid, pos, C1, C2, SALT)
    lo = sl * SLICE_V
    hi = tl.minimum(V, lo + SLICE_V)
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], dtype=tl.int32) + lo
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    base = z_ptr + row.to(tl.int64) * stride_z
    for start in range(lo, hi, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < hi
        z = tl.load(base + offs, mask=mask, other=float("-inf"))
        s = z + _token_gumbel(ka, kb, offs, C1, C2, FAST_LOG)
        if HAS_THR:
            s = tl.where(z >= thr, s, float("-inf"))
        s = tl.where(mask, s, float("-inf"))
        upd = s > best_val
        best_val = tl.where(upd, s, best_val)
        best_idx = tl.where(upd, offs, best_idx)
    m = tl.max(best_val, 0)
    idx = tl.min(tl.where(best_val == m, best_idx, V), 0)
    out = row * tl.num_programs(1) + sl
    tl.store(best_ptr + out, m)
    tl.store(idx_ptr + out, idx)


@triton.jit
def _argmax_merge_kernel(
    best_ptr,
    idx_ptr,
    tok_ptr,
    z_ptr,
    lse_ptr,
    lp_ptr,
    V,
    stride_z,
    S,
    BLOCK_S: tl.constexpr,
    LOGP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    ok = offs < S
    best = tl.load(best_ptr + row * S + offs, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * S + offs, mask=ok, other=V)
    m = tl.max(best, 0)
    tok = tl.minimum(tl.min(tl.where(best == m, idx, V), 0), V - 1)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    if LOGP:
        zt = tl.load(z_ptr + row.to(tl.int64) * stride_z + tok)
        tl.store(lp_ptr + row, zt - tl.load(lse_ptr + row))


def vocab_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary slices per row: enough for about :data:`_PROGRAMS_PER_SM` programs per SM, at most one slice per
    :data:`_BLOCK_V` entries. The sampled tokens do not depend on it."""
    return max(1, min(triton.cdiv(vocab, _BLOCK_V), triton.cdiv(_PROGRAMS_PER_SM * num_sms(device), max(rows, 1))))


def gumbel_argmax_triton(
    z: torch.Tensor,
    threshold: torch.Tensor | None,
    seed: int,
    request_ids: torch.Tensor,
    positions: torch.Tensor,
    lse: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    fast_log: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``argmax(z + keyed noise)`` over ``z >= threshold`` (first index on ties): ``z [B, V]`` fp32,
    ``request_ids, positions`` int64 ``[B]`` (non-negative), ``seed`` a Python int.

    Returns ``(tokens [B] int64, z[tokens] - lse [B] fp32)``, the second None when ``lse`` is None. ``splits``
    overrides :func:`vocab_splits` (tests); it never changes the result. ``fast_log`` (tests and benchmarks; default:
    on for CUDA tensors outside the interpreter) picks the noise's logarithms (:func:`_log2`); a draw may differ
    between the two only where two scores are within the approximation's error."""
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(-1) != 1:
        raise ValueError(f"gumbel_argmax_triton: z must be a row-major fp32 [B, V] tensor, got {z.dtype} {z.shape}")
    b, v = z.shape
    out = torch.empty(b, dtype=torch.int64, device=z.device)
    logp = torch.empty(b, dtype=torch.float32, device=z.device) if lse is not None else None
    if b == 0:
        return out, logp
    if splits is None:
        splits = vocab_splits(b, v, z.device)
    if splits < 1:
        raise ValueError(f"gumbel_argmax_triton: splits must be >= 1, got {splits}")
    slice_v = triton.cdiv(triton.cdiv(v, splits), _BLOCK_V) * _BLOCK_V
    splits = triton.cdiv(v, slice_v)
    best = torch.empty((b, splits), dtype=torch.float32, device=z.device)
    idx = torch.empty((b, splits), dtype=torch.int32, device=z.device)
    thr = threshold.reshape(b).contiguous().float() if threshold is not None else z
    seed &= (1 << 64) - 1
    pdl = pdl_options(z.device)
    _gumbel_argmax_kernel[(b, splits)](
        z,
        thr,
        request_ids.long().contiguous(),
        positions.long().contiguous(),
        best,
        idx,
        (seed & MASK32) ^ ROW_SALT,
        seed >> 32,
        v,
        z.stride(0),
        slice_v,
        HAS_THR=threshold is not None,
        BLOCK_V=_BLOCK_V,
        C1=C1,
        C2=C2,
        SALT=ROW_SALT,
        FAST_LOG=(z.is_cuda and not interpreter_enabled()) if fast_log is None else fast_log,
        num_warps=8,
        **pdl,
        **COMPILE_OPTIONS,
    )
    lse_arg = lse.reshape(b).contiguous().float() if lse is not None else best
    _argmax_merge_kernel[(b,)](
        best,
        idx,
        out,
        z,
        lse_arg,
        logp if logp is not None else best,
        v,
        z.stride(0),
        splits,
        BLOCK_S=max(16, triton.next_power_of_2(splits)),
        LOGP=lse is not None,
        num_warps=1,
        **pdl,
        **COMPILE_OPTIONS,
    )
    return out, logp
