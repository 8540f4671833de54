"""Batch-invariant Triton RMSNorm and SiLU-gate kernels.

``rms_norm``: one program per row; the reduction block ``BLOCK`` and the warp count are functions of the hidden size
H only, so a row's sum of squares is reduced with the same tree whatever the number of rows (the "RMSNorm changes
block size at 256 tokens" trap of other stacks cannot happen). Semantics are transformers' (and
:func:`rlexact.ops.cpu.rms_norm`'s): ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` with the product in
``promote(w.dtype, x.dtype)``.

``silu_mul``: elementwise, ``(silu(gate32) * up32).to(gate.dtype)`` with ``silu(g) = g / (1 + exp(-g))``; an element's
result depends on that element only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_matmul import _TL_DTYPE, _rne_fix, cast_out

MAX_NORM_BLOCK = 8192
"""Rows longer than this are reduced in fixed ``MAX_NORM_BLOCK`` chunks (two passes)."""
SILU_BLOCK = 1024
"""Columns per program of ``silu_mul``."""


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    o_ptr,
    H,
    H_f,
    stride_x,
    stride_o,
    eps,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
    X_DTYPE: tl.constexpr,
    O_DTYPE: tl.constexpr,
    RNE_X: tl.constexpr,
    RNE_O: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = o_ptr + row * stride_o
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.math.div_rn(tl.sum(x * x, axis=0), H_f)
        r = tl.math.rsqrt(var + eps)
        y = cast_out(x * r, X_DTYPE, RNE_X).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + cols, cast_out(w * y, O_DTYPE, RNE_O), mask=mask)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for off in range(0, H, BLOCK):
            mask = off + cols < H
            x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        var = tl.math.div_rn(tl.sum(acc, axis=0), H_f)
        r = tl.math.rsqrt(var + eps)
        for off in range(0, H, BLOCK):
            mask = off + cols < H
            x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
            y = cast_out(x * r, X_DTYPE, RNE_X).to(tl.float32)
            w = tl.load(w_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_row + off + cols, cast_out(w * y, O_DTYPE, RNE_O), mask=mask)


@triton.jit
def _silu_mul_kernel(
    g_ptr,
    u_ptr,
    o_ptr,
    ncols,
    stride_g,
    stride_u,
    stride_o,
    BLOCK: tl.constexpr,
    O_DTYPE: tl.constexpr,
    RNE_O: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ncols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    tl.store(o_ptr + row * stride_o + cols, cast_out(silu * u, O_DTYPE, RNE_O), mask=mask)


def _norm_launch_params(H: int) -> tuple[int, bool, int]:
    """``(BLOCK, single_pass, num_warps)`` from the hidden size only."""
    block = min(triton.next_power_of_2(max(H, 1)), MAX_NORM_BLOCK)
    warps = 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1
    return block, block >= H, warps


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [M, H]``, ``w [H]`` -> ``[M, H]`` in ``promote(w.dtype, x.dtype)``; one row per program."""
    if x.dim() != 2 or w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: bad shapes x {tuple(x.shape)}, w {tuple(w.shape)}")
    M, H = x.shape
    x = x.contiguous()
    w = w.contiguous()
    out_dtype = torch.promote_types(w.dtype, x.dtype)
    out = torch.empty((M, H), dtype=out_dtype, device=x.device)
    if M == 0 or H == 0:
        return out
    block, single, warps = _norm_launch_params(H)
    _rms_norm_kernel[(M,)](
        x,
        w,
        out,
        H,
        float(H),
        x.stride(0),
        out.stride(0),
        float(eps),
        BLOCK=block,
        SINGLE=single,
        X_DTYPE=_TL_DTYPE[x.dtype],
        O_DTYPE=_TL_DTYPE[out_dtype],
        RNE_X=_rne_fix(x.dtype),
        RNE_O=_rne_fix(out_dtype),
        num_warps=warps,
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up [M, I]`` -> ``(silu(gate32) * up32).to(gate.dtype)`` ``[M, I]``."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"silu_mul: bad shapes gate {tuple(gate.shape)}, up {tuple(up.shape)}")
    M, n = gate.shape
    gate = gate.contiguous()
    up = up.contiguous()
    out = torch.empty((M, n), dtype=gate.dtype, device=gate.device)
    if M == 0 or n == 0:
        return out
    grid = (M, triton.cdiv(n, SILU_BLOCK))
    _silu_mul_kernel[grid](
        gate,
        up,
        out,
        n,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        BLOCK=SILU_BLOCK,
        O_DTYPE=_TL_DTYPE[gate.dtype],
        RNE_O=_rne_fix(gate.dtype),
        num_warps=4,
    )
    return out
