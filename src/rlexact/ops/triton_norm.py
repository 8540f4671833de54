"""Batch-invariant Triton RMSNorm and SiLU-gate kernels.

``rms_norm``: one program per row; the reduction block ``BLOCK`` and the warp count are functions of the hidden size
H only, so a row's sum of squares is reduced with the same tree whatever the number of rows (the "RMSNorm changes
block size at 256 tokens" trap of other stacks cannot happen). Semantics are transformers' (and
:func:`rlexact.ops.cpu.rms_norm`'s): ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` with the product in
``promote(w.dtype, x.dtype)`` (Llama, Qwen), or with ``round_normed=False`` ``(w * x32 * rsqrt(...)).to(x.dtype)``,
the product in fp32 and rounded once (OLMo-2); with ``offset`` the scale is ``1 + w``, added in fp32 (Gemma 3, which
also rounds once).

``add_rms_norm``: the same kernel with a residual input: the row ``s = x + r`` is added in fp32, rounded once to the
input dtype and stored, and the norm runs on the rounded ``s`` with the arithmetic above (so it equals ``rms_norm(s)``
bitwise); the decoder layer's residual add and the norm that follows become one launch. ``norm_add_rms_norm``: the
same with the added branch normalized first in the same program (Gemma 3's norms after each branch), by the code of
``rms_norm`` and rounded as it stores.

``silu_mul``: elementwise, ``(silu(gate32) * up32).to(gate.dtype)`` with ``silu(g) = g / (1 + exp(-g))``; an element's
result depends on that element only. ``gelu_tanh_mul``: the same kernel with transformers' ``gelu_pytorch_tanh`` gate
(Gemma), ``g / (1 + exp(-2 sqrt(2 / pi) (g + 0.044715 g^3)))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_entry, pdl_options
from .triton_shared import COMPILE_OPTIONS, TL_DTYPE, cast_out, gate_times, norm_scale, normed_row, rne_fix

MAX_NORM_BLOCK = 8192
"""Rows longer than this are reduced in fixed ``MAX_NORM_BLOCK`` chunks (two passes)."""
SILU_BLOCK = 1024
"""Columns per program of ``silu_mul``."""
FUSED_BRANCH_NORM_DTYPES = (torch.bfloat16, torch.float16)
"""Row dtypes for which :func:`norm_add_rms_norm` of a norm that rounds once is one launch: the rounding to 16 bits
between the branch norm's product and the add keeps the compiler from contracting them."""


@triton.jit
def _norm_input(x_row, r_row, s_row, idx, mask, xw_ptr, x_eps, H_f, HAS_RES: tl.constexpr, STORE: tl.constexpr,
                X_DTYPE: tl.constexpr, RNE_X: tl.constexpr, X_NORM: tl.constexpr, ROUND_NORMED: tl.constexpr,
                OFFSET: tl.constexpr):  # fmt: skip
    """fp32 elements ``idx`` of the row to normalize: ``x``, or with ``HAS_RES`` the sum ``x + r`` added in fp32 and
    rounded once to ``X_DTYPE`` (torch's elementwise add), stored to the sum row when ``STORE``. With ``X_NORM``
    (``idx`` the whole row) ``x`` is first normalized by the scale at ``xw_ptr`` and ``x_eps`` with the kernel's
    arithmetic, rounded to ``X_DTYPE``: the norm's output as the kernel stores it."""
    x = tl.load(x_row + idx, mask=mask, other=0.0).to(tl.float32)
    if X_NORM:
        r = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=0), H_f) + x_eps)
        y = normed_row(x, r, X_DTYPE, RNE_X, ROUND_NORMED)
        x = cast_out(norm_scale(xw_ptr, idx, mask, OFFSET) * y, X_DTYPE, RNE_X).to(tl.float32)
    if HAS_RES:
        s = cast_out(x + tl.load(r_row + idx, mask=mask, other=0.0).to(tl.float32), X_DTYPE, RNE_X)
        if STORE:
            tl.store(s_row + idx, s, mask=mask)
        x = s.to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    o_ptr,
    s_ptr,
    xw_ptr,
    H,
    H_f,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    eps,
    x_eps,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
    HAS_RES: tl.constexpr,
    X_NORM: tl.constexpr,
    X_DTYPE: tl.constexpr,
    O_DTYPE: tl.constexpr,
    RNE_X: tl.constexpr,
    RNE_O: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):
    tl.static_assert(SINGLE or not X_NORM, "a normalized x needs the whole row in one block")
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    s_row = s_ptr + row * stride_s
    o_row = o_ptr + row * stride_o
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < H
        x = _norm_input(x_row, r_row, s_row, cols, mask, xw_ptr, x_eps, H_f, HAS_RES, True, X_DTYPE, RNE_X, X_NORM,
                        ROUND_NORMED, OFFSET)  # fmt: skip
        var = tl.math.div_rn(tl.sum(x * x, axis=0), H_f)
        r = tl.math.rsqrt(var + eps)
        y = normed_row(x, r, X_DTYPE, RNE_X, ROUND_NORMED)
        w = norm_scale(w_ptr, cols, mask, OFFSET)
        tl.store(o_row + cols, cast_out(w * y, O_DTYPE, RNE_O), mask=mask)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for off in range(0, H, BLOCK):
            mask = off + cols < H
            x = _norm_input(x_row, r_row, s_row, off + cols, mask, xw_ptr, x_eps, H_f, HAS_RES, True, X_DTYPE, RNE_X,
                            False, ROUND_NORMED, OFFSET)  # fmt: skip
            acc += x * x
        var = tl.math.div_rn(tl.sum(acc, axis=0), H_f)
        r = tl.math.rsqrt(var + eps)
        for off in range(0, H, BLOCK):
            mask = off + cols < H
            x = _norm_input(x_row, r_row, s_row, off + cols, mask, xw_ptr, x_eps, H_f, HAS_RES, False, X_DTYPE,
                            RNE_X, False, ROUND_NORMED, OFFSET)  # fmt: skip
            y = normed_row(x, r, X_DTYPE, RNE_X, ROUND_NORMED)
            w = norm_scale(w_ptr, off + cols, mask, OFFSET)
            tl.store(o_row + off + cols, cast_out(w * y, O_DTYPE, RNE_O), mask=mask)


@triton.jit
def _gated_mul_kernel(
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
    GELU: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ncols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, cast_out(gate_times(g, u, GELU), O_DTYPE, RNE_O), mask=mask)


def _norm_launch_params(H: int) -> tuple[int, bool, int]:
    """``(BLOCK, single_pass, num_warps)`` from the hidden size only."""
    block = min(triton.next_power_of_2(max(H, 1)), MAX_NORM_BLOCK)
    warps = 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1
    return block, block >= H, warps


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float, round_normed: bool, offset: bool,
    x_norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The one launcher of :func:`_rms_norm_kernel`: ``(normed, summed)``, ``summed`` ``None`` without a residual;
    ``x_norm``: ``(weight, eps)`` of a norm that ``x`` goes through first (with a residual, in one block)."""
    M, H = x.shape
    x = x.contiguous()
    w = w.contiguous()
    out_dtype = torch.promote_types(w.dtype, x.dtype) if round_normed else x.dtype
    out = torch.empty((M, H), dtype=out_dtype, device=x.device)
    summed = None
    if residual is not None:
        residual = residual.contiguous()
        summed = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if M == 0 or H == 0:
        return out, summed
    block, single, warps = _norm_launch_params(H)
    r, s = (x, out) if residual is None else (residual, summed)  # unused pointers when there is no residual
    xw, x_eps = (w, 0.0) if x_norm is None else (x_norm[0].contiguous(), x_norm[1])  # xw unread without x_norm
    _rms_norm_kernel[(M,)](
        x,
        r,
        w,
        out,
        s,
        xw,
        H,
        float(H),
        x.stride(0),
        r.stride(0),
        out.stride(0),
        s.stride(0),
        float(eps),
        float(x_eps),
        BLOCK=block,
        SINGLE=single,
        HAS_RES=residual is not None,
        X_NORM=x_norm is not None,
        X_DTYPE=TL_DTYPE[x.dtype],
        O_DTYPE=TL_DTYPE[out_dtype],
        RNE_X=rne_fix(x.dtype),
        RNE_O=rne_fix(out_dtype),
        ROUND_NORMED=round_normed,
        OFFSET=offset,
        num_warps=warps,
        **pdl_options(x.device),
        **COMPILE_OPTIONS,
    )
    return out, summed


def rms_norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, round_normed: bool = True, offset: bool = False
) -> torch.Tensor:
    """``x [M, H]``, ``w [H]`` -> ``[M, H]`` in ``promote(w.dtype, x.dtype)`` (``x.dtype`` without
    ``round_normed``: module doc); one row per program. ``offset``: the scale is ``1 + w`` (added in fp32)."""
    if x.dim() != 2 or w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: bad shapes x {tuple(x.shape)}, w {tuple(w.shape)}")
    return _launch_norm(x, None, w, eps, round_normed, offset)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, round_normed: bool = True,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``x, residual [M, H]`` (one dtype), ``w [H]`` -> ``(rms_norm(s, w, eps), s)`` with ``s = x + residual``.

    One launch. ``s`` is added in fp32 and rounded once to ``x.dtype`` (torch's elementwise add); the norm of a row
    is computed from the rounded ``s`` by the very code of :func:`rms_norm`, so both outputs equal the separate ops
    bitwise."""
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or w.shape != (x.shape[1],):
        shapes = f"x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype}, w {tuple(w.shape)}"
        raise ValueError(f"add_rms_norm: bad shapes or dtypes {shapes}")
    normed, summed = _launch_norm(x, residual, w, eps, round_normed, offset)
    assert summed is not None
    return normed, summed


def norm_add_rms_norm(
    x: torch.Tensor, x_weight: torch.Tensor, x_eps: float, residual: torch.Tensor, w: torch.Tensor, eps: float,
    round_normed: bool = True, offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``x, residual [M, H]`` (one dtype), ``x_weight, w [H]`` -> ``(rms_norm(s, w, eps), s)`` with ``s =
    rms_norm(x, x_weight, x_eps) + residual``, both norms of one kind whose output dtype is ``x.dtype``.

    One launch for :data:`FUSED_BRANCH_NORM_DTYPES` rows of a norm that rounds once (Gemma 3's) where a row fits one
    block (:func:`_norm_launch_params`); else the norm and :func:`add_rms_norm`. The branch norm is computed by the
    code of :func:`rms_norm` and rounded as it stores, then added and normalized as in :func:`add_rms_norm`, so both
    outputs equal the separate ops bitwise. Elsewhere the compiler contracts the branch norm's last product into the
    add: with an fp32 row nothing rounds between them, and a norm that rounds the normalized row first makes that
    product one of two 16-bit values, which LLVM narrows to a 16-bit multiply and fuses with the (likewise narrowed)
    add into one 16-bit FMA (``tests/test_triton_kernels.py``'s sm_90 compile check)."""
    same = residual.shape == x.shape and residual.dtype == x.dtype and w.shape == x_weight.shape == (x.shape[-1],)
    if x.dim() != 2 or not same:
        shapes = f"x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype}, x_weight "
        raise ValueError(f"norm_add_rms_norm: bad shapes or dtypes {shapes}{tuple(x_weight.shape)}, w {tuple(w.shape)}")
    if round_normed and torch.promote_types(x_weight.dtype, x.dtype) != x.dtype:
        promoted = torch.promote_types(x_weight.dtype, x.dtype)
        raise ValueError(f"norm_add_rms_norm: a {x_weight.dtype} x_weight makes the branch norm of {x.dtype} rows "
                         f"{promoted}; run rms_norm and add_rms_norm apart")  # fmt: skip
    if round_normed or x.dtype not in FUSED_BRANCH_NORM_DTYPES or not _norm_launch_params(x.shape[1])[1]:
        return add_rms_norm(rms_norm(x, x_weight, x_eps, round_normed, offset), residual, w, eps, round_normed, offset)
    normed, summed = _launch_norm(x, residual, w, eps, round_normed, offset, (x_weight, x_eps))
    assert summed is not None
    return normed, summed


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up [M, I]`` (rows contiguous, any row stride) -> ``(silu(gate32) * up32).to(gate.dtype)`` ``[M, I]``."""
    return _gated_mul(gate, up, gelu=False)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up [M, I]`` (rows contiguous, any row stride) -> ``(gelu_tanh(gate32) * up32).to(gate.dtype)``."""
    return _gated_mul(gate, up, gelu=True)


def _gated_mul(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    if gate.dim() != 2 or gate.shape != up.shape:
        name = "gelu_tanh_mul" if gelu else "silu_mul"
        raise ValueError(f"{name}: bad shapes gate {tuple(gate.shape)}, up {tuple(up.shape)}")
    M, n = gate.shape
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    out = torch.empty((M, n), dtype=gate.dtype, device=gate.device)
    if M == 0 or n == 0:
        return out
    grid = (M, triton.cdiv(n, SILU_BLOCK))
    _gated_mul_kernel[grid](
        gate,
        up,
        out,
        n,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        BLOCK=SILU_BLOCK,
        O_DTYPE=TL_DTYPE[gate.dtype],
        RNE_O=rne_fix(gate.dtype),
        GELU=gelu,
        num_warps=4,
        **pdl_options(gate.device),
        **COMPILE_OPTIONS,
    )
    return out
