"""Fused per-head RMSNorm (optional) + rotary embedding of the queries and keys of one attention layer, in Triton.

One launch per layer replaces the ~12 small kernels of the stock path (two norms, and ``q * cos + rotate_half(q) *
sin`` for q and k). Grid ``(T, 2)``: program ``(t, 0)`` rotates the ``Hq`` query heads of token ``t``, ``(t, 1)`` its
``Hkv`` key heads, so a row's result depends on that row, its position's ``cos``/``sin`` and the weights only. In a
generator step (:func:`qk_norm_rope_write_kv`) program ``(t, 1)`` also stores the rotated key heads it returns and
token ``t``'s value heads in the paged caches at ``slot_mapping[t]``: the K/V write of the step, without its own launch.

Semantics (:func:`rlexact.ops.cpu.qk_norm_rope` is the CPU twin, :func:`rlexact.ops.reference.norm_rope` the float64
reference), per head row ``x [D]`` with halves ``x1, x2``:

* norm (when weights are given): ``y = (w32 * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)).to(dtype)``
  (transformers RMSNorm when ``w`` has the input dtype), with ``round_normed=False`` the product rounded once,
  ``y = (s32 * x32 * rsqrt(...)).to(dtype)``, and with ``offset`` the scale ``s32 = 1 + w32`` (Gemma 3's q/k norms:
  both), else ``y = x``;
* rotary in fp32, cast once: ``out = (y32 * cos + rotate_half(y32) * sin).to(dtype)`` with
  ``rotate_half(y) = [-y2, y1]`` and ``cos, sin [D]`` of the row's position (upcast to fp32; transformers' rotary
  modules return them in the model dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kv import check_kv_write, write_kv
from .triton_pdl import pdl_entry, pdl_options
from .triton_shared import COMPILE_OPTIONS, TL_DTYPE, cast_out, norm_scale, normed_row, rne_fix


@triton.jit
def _norm_rope_rows(
    x_ptr,
    o_ptr,
    w_ptr,
    c_ptr,
    s_ptr,
    t,
    stride_x,
    H,
    HALF,
    eps,
    D_f,
    o2_ptr,
    o2_h,
    BH: tl.constexpr,
    BHALF: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    OFFSET: tl.constexpr,
    DTYPE: tl.constexpr,
    RNE: tl.constexpr,
    WRITE2: tl.constexpr,
):
    """Rows ``x[t, 0:H, :]`` (``[T, H, 2 * HALF]``, heads contiguous, row stride ``stride_x``) -> ``o`` (contiguous),
    and with ``WRITE2`` the same values to ``o2_ptr + head * o2_h + column`` (a KV-cache slot)."""
    h = tl.arange(0, BH)[:, None]
    c = tl.arange(0, BHALF)[None, :]
    c_ok = c < HALF
    m = (h < H) & c_ok
    head = h * (2 * HALF) + c
    base = t * H * (2 * HALF) + head
    x1 = tl.load(x_ptr + t * stride_x + head, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + t * stride_x + head + HALF, mask=m, other=0.0).to(tl.float32)
    if NORM:
        var = tl.math.div_rn(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), D_f)
        r = tl.math.rsqrt(var + eps)[:, None]
        w1 = norm_scale(w_ptr, c, c_ok, OFFSET)
        w2 = norm_scale(w_ptr, HALF + c, c_ok, OFFSET)
        x1 = cast_out(w1 * normed_row(x1, r, DTYPE, RNE, ROUND_NORMED), DTYPE, RNE).to(tl.float32)
        x2 = cast_out(w2 * normed_row(x2, r, DTYPE, RNE, ROUND_NORMED), DTYPE, RNE).to(tl.float32)
    cs = t * (2 * HALF) + c
    c1 = tl.load(c_ptr + cs, mask=c_ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + cs + HALF, mask=c_ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + cs, mask=c_ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + cs + HALF, mask=c_ok, other=0.0).to(tl.float32)
    y1 = cast_out(x1 * c1 - x2 * s1, DTYPE, RNE)
    y2 = cast_out(x2 * c2 + x1 * s2, DTYPE, RNE)
    tl.store(o_ptr + base, y1, mask=m)
    tl.store(o_ptr + base + HALF, y2, mask=m)
    if WRITE2:
        tl.store(o2_ptr + h * o2_h + c, y1, mask=m)
        tl.store(o2_ptr + h * o2_h + c + HALF, y2, mask=m)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    qw_ptr,
    kw_ptr,
    c_ptr,
    s_ptr,
    stride_q,
    stride_k,
    HQ,
    HKV,
    HALF,
    eps,
    D_f,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    block_size,
    s_vt,
    s_vh,
    c_kb,
    c_ko,
    c_kh,
    c_vb,
    c_vo,
    c_vh,
    BHQ: tl.constexpr,
    BHK: tl.constexpr,
    BHALF: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    OFFSET: tl.constexpr,
    DTYPE: tl.constexpr,
    RNE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _norm_rope_rows(
            q_ptr, qo_ptr, qw_ptr, c_ptr, s_ptr, t, stride_q, HQ, HALF, eps, D_f, qo_ptr, 0, BHQ, BHALF, NORM,
            ROUND_NORMED, OFFSET, DTYPE, RNE, False,
        )  # fmt: skip
    else:
        kc_row = kc_ptr
        if WRITE_KV:  # token t's slot: its rotated key and its value row go into the caches too
            slot = tl.load(slot_ptr + t).to(tl.int64)
            blk = slot // block_size
            off = slot % block_size
            kc_row = kc_ptr + blk * c_kb + off * c_ko
            h = tl.arange(0, BHK)[:, None]
            d = tl.arange(0, 2 * BHALF)[None, :]
            vm = (h < HKV) & (d < 2 * HALF)
            v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=vm)
            tl.store(vc_ptr + blk * c_vb + off * c_vo + h * c_vh + d, v, mask=vm)
        _norm_rope_rows(
            k_ptr, ko_ptr, kw_ptr, c_ptr, s_ptr, t, stride_k, HKV, HALF, eps, D_f, kc_row, c_kh, BHK, BHALF, NORM,
            ROUND_NORMED, OFFSET, DTYPE, RNE, WRITE_KV,
        )  # fmt: skip


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` as is when each row's ``H x D`` block is contiguous (any row stride), else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    round_normed: bool = True,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D]``, ``k [T, Hkv, D]`` (same dtype), ``cos, sin [T, D]`` (any float dtype, upcast to fp32 in the
    kernel), optional weights ``[D]`` (both or neither) -> rotated ``(q, k)`` in the input dtype, contiguous. ``q`` and
    ``k`` may be row-strided views (e.g. column blocks of a fused q/k/v projection) whose heads are contiguous.
    ``round_normed``, ``offset``: the norm's kind, as in :func:`rlexact.ops.triton_norm.rms_norm`."""
    return _launch(q, k, cos, sin, q_weight, k_weight, eps, (round_normed, offset), None)


def qk_norm_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    round_normed: bool = True,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rope`, and the rotated keys and ``v [T, Hkv, D]`` (any strides) written to slots
    ``slot_mapping [T]`` of ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` in the same launch, bitwise what
    :func:`rlexact.ops.triton_kv.write_kv` stores. Caches of another dtype, or whose head rows are not contiguous, go
    through ``write_kv`` after the rotation (a second launch, the same bits)."""
    same = k_cache.dtype == q.dtype and v_cache.dtype == v.dtype == q.dtype
    if not (same and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and v.stride(-1) == 1):
        qo, ko = qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, round_normed, offset)
        write_kv(ko, v, k_cache, v_cache, slot_mapping)
        return qo, ko
    return _launch(q, k, cos, sin, q_weight, k_weight, eps, (round_normed, offset), (v, k_cache, v_cache, slot_mapping))


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kind: tuple[bool, bool],
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, hq, d = q.shape
    q, k = _heads_contiguous(q), _heads_contiguous(k)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return qo, ko
    norm = q_weight is not None
    qw = q_weight.contiguous() if norm else q
    kw = k_weight.contiguous() if norm else k
    _qk_norm_rope_kernel[(T, 2)](
        q,
        k,
        qo,
        ko,
        qw,
        kw,
        cos.contiguous(),
        sin.contiguous(),
        q.stride(0),
        k.stride(0),
        hq,
        k.shape[1],
        d // 2,
        float(eps),
        float(d),
        *_kv_args(kv, k),
        BHQ=triton.next_power_of_2(hq),
        BHK=triton.next_power_of_2(k.shape[1]),
        BHALF=triton.next_power_of_2(d // 2),
        NORM=norm,
        ROUND_NORMED=kind[0],
        OFFSET=kind[1],
        DTYPE=TL_DTYPE[q.dtype],
        RNE=rne_fix(q.dtype),
        WRITE_KV=kv is not None,
        num_warps=4,
        **pdl_options(q.device),
        **COMPILE_OPTIONS,
    )
    return qo, ko


def _kv_args(kv: tuple[torch.Tensor, ...] | None, k: torch.Tensor) -> tuple:
    """The kernel's cache arguments (``v, k_cache, v_cache, slot_mapping``, block size and strides); placeholders
    when no cache is written."""
    if kv is None:
        return (k, k, k, k, 1, *(0,) * 8)
    v, kc, vc, slots = kv
    check_kv_write(k, v, kc, vc, slots, "qk_norm_rope_write_kv")
    return (v, kc, vc, slots, kc.shape[1], *v.stride()[:2], *kc.stride()[:3], *vc.stride()[:3])
