"""Triton KV-cache write: the K and V rows of all new tokens go into the paged caches in one launch.

Program ``(t, j)`` copies head group ``j`` of token ``t``'s key and value rows to slot ``slot_mapping[t]``
(``block * block_size + offset``) of the caches. A copy moves bits unchanged; when the cache dtype differs from the
input dtype an element is converted through fp32 with one round-to-nearest-even (torch's ``Tensor.to``). No host
synchronization, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_entry, pdl_options
from .triton_shared import COMPILE_OPTIONS, TL_DTYPE, cast_out, rne_fix

MAX_KV_TILE = 4096
"""Elements of a ``[heads, head_dim]`` tile one program copies (heads are split across programs beyond it)."""


@triton.jit
def _copy_row(src, dst, s_h, s_d, d_h, d_d, hs, ds, mask, CAST: tl.constexpr, C_DTYPE: tl.constexpr,
              RNE: tl.constexpr):  # fmt: skip
    x = tl.load(src + hs * s_h + ds * s_d, mask=mask)
    if CAST:
        x = cast_out(x.to(tl.float32), C_DTYPE, RNE)
    tl.store(dst + hs * d_h + ds * d_d, x, mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    block_size,
    HKV,
    D,
    s_kt,
    s_kh,
    s_kd,
    s_vt,
    s_vh,
    s_vd,
    c_kb,
    c_ko,
    c_kh,
    c_kd,
    c_vb,
    c_vo,
    c_vh,
    c_vd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAST: tl.constexpr,
    C_DTYPE: tl.constexpr,
    RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    t = tl.program_id(0).to(tl.int64)
    hs = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
    ds = tl.arange(0, BLOCK_D)[None, :]
    mask = (hs < HKV) & (ds < D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    k_dst = kc_ptr + blk * c_kb + off * c_ko
    v_dst = vc_ptr + blk * c_vb + off * c_vo
    _copy_row(k_ptr + t * s_kt, k_dst, s_kh, s_kd, c_kh, c_kd, hs, ds, mask, CAST, C_DTYPE, RNE)
    _copy_row(v_ptr + t * s_vt, v_dst, s_vh, s_vd, c_vh, c_vd, hs, ds, mask, CAST, C_DTYPE, RNE)


def check_kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, op: str
) -> None:
    """Raise ``ValueError`` (naming ``op``) unless ``k, v [T, Hkv, D]`` and ``slot_mapping [T]`` fit the caches
    ``[num_blocks, block_size, Hkv, D]`` of one supported dtype."""
    t, hkv, d = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"{op}: k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} do not match")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(f"{op}: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit k {k.shape}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: cache dtypes {k_cache.dtype} and {v_cache.dtype} differ")
    if k.dtype not in TL_DTYPE or k_cache.dtype not in TL_DTYPE:
        raise ValueError(f"{op}: dtypes {k.dtype} -> {k_cache.dtype}; supported: {sorted(map(str, TL_DTYPE))}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"{op}: slot_mapping {tuple(slot_mapping.shape)} must be [{t}]")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k, v [T, Hkv, D]`` (any strides) into slots ``slot_mapping [T]`` of ``k_cache, v_cache
    [num_blocks, block_size, Hkv, D]`` (any strides, one dtype), converted to the cache dtype; one launch.

    Equals ``cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k.to(cache.dtype))`` for K and V bitwise. Slots
    must be distinct and inside the caches: they are not checked (a check would synchronize with the host)."""
    check_kv_write(k, v, k_cache, v_cache, slot_mapping, "write_kv")
    t, hkv, d = k.shape
    if t == 0 or hkv == 0 or d == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hkv), MAX_KV_TILE // block_d))
    cast = k.dtype != k_cache.dtype
    _write_kv_kernel[(t, triton.cdiv(hkv, block_h))](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[1],
        hkv,
        d,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        CAST=cast,
        C_DTYPE=TL_DTYPE[k_cache.dtype],
        RNE=cast and rne_fix(k_cache.dtype),
        num_warps=4 if block_h * block_d >= 1024 else 1,
        **pdl_options(k.device),
        **COMPILE_OPTIONS,
    )
