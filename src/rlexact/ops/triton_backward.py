"""Deterministic Triton backward passes: the lm-head log-prob/entropy head, RMSNorm, q/k-norm + rotary, SiLU-gate.

Backward passes must be deterministic (two runs on the same inputs give identical gradient bits) and correct against
float64; they need not be batch-invariant nor match any forward bitwise. Every kernel here is deterministic by
construction: no atomics, every reduction runs in a fixed order that depends only on the tensor shapes.

**Log-prob head** (:func:`head_backward`). With ``z = hidden @ w.T / temperature``, ``p = softmax(z)``, the forward's
saved ``lse`` and entropy ``Ent``, the gradient with respect to ``z`` is
``dz_j = g_logp * ([j == target] - p_j) - g_ent * p_j * (z_j - lse + Ent)``. The vocabulary is processed in
fixed-width chunks of :data:`HEAD_CHUNK` columns in ascending order. For each chunk one Triton kernel recomputes the
``z`` tile on tensor cores (input-dtype operands, fp32 accumulation, ascending K), forms ``dz / temperature`` in fp32
and writes it in the input dtype into a ``[T, HEAD_CHUNK]`` buffer; then two cuBLAS GEMMs accumulate in fp32:
``dW[chunk] = dz.T @ hidden`` (each vocabulary row of ``dW`` belongs to exactly one chunk, so it is written once) and
``dH += dz @ w[chunk]`` (fp32 ``[T, H]`` accumulator, chunks added in ascending order). cuBLAS GEMMs with fixed shapes
pick a fixed algorithm and do not use atomics, so the whole pass is run-to-run deterministic. No ``[T, V]`` tensor
exists; the extra memory is the ``[T, HEAD_CHUNK]`` ``dz`` buffer plus the fp32 ``[T, H]`` accumulator.

**RMSNorm and q/k-norm + rotary**. One program owns a fixed contiguous block of rows (tokens) and walks it one row
at a time: it writes that row's input gradient and adds the row's weight-gradient contribution to a register
accumulator; at the end it writes its partial weight gradient to row ``program_id`` of an fp32 ``[P, D]`` buffer.
:func:`_column_sum_kernel` then adds the ``P`` partials of each column in ascending program order. ``P`` and the rows
per program depend only on the number of rows and the device, so the summation tree is fixed for a given shape.

**SiLU-gate**: elementwise; each element's gradient depends on that element only.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .triton_logprob import logit_tile
from .triton_matmul import ensure_allocator
from .triton_shared import (
    COMPILE_OPTIONS,
    HAS_WS,
    TL_DTYPE,
    aligned,
    cast_out,
    cuda_props,
    device_key,
    dot_flags,
    gelu_tanh_arg,
    gelu_tanh_arg_grad,
    normed_row,
    num_sms,
    rne_fix,
    tile_coords,
)

HEAD_CHUNK = 8192
"""Vocabulary columns per chunk of the head backward (bounds the ``dz`` buffer to ``[T, HEAD_CHUNK]``)."""
COLUMN_BLOCK = 256
"""Columns per program of :func:`_column_sum_kernel`."""
SILU_BWD_BLOCK = 1024
"""Columns per program of the SiLU-gate backward."""
MAX_ROW_BLOCK = 8192
"""Longest row (hidden size) the RMSNorm backward keeps in registers; longer rows use the reference backward."""


# ----------------------------------------------------------------------------------------------------------------------
# shared: fixed-order column sum of per-program partials
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _column_sum_kernel(part_ptr, out_ptr, P, D, BLOCK: tl.constexpr):
    """``out[d] = sum_{p = 0, 1, ..., P-1} part[p, d]`` in ascending ``p`` (fp32, one column block per program)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    acc = tl.zeros((BLOCK,), tl.float32)
    for p in range(P):
        acc += tl.load(part_ptr + p * D + cols, mask=ok, other=0.0)
    tl.store(out_ptr + cols, acc, mask=ok)


def _column_sum(part: torch.Tensor) -> torch.Tensor:
    """``part [..., P, D]`` fp32 contiguous -> ``[..., D]`` fp32, each column summed in ascending ``P`` order."""
    *lead, p, d = part.shape
    flat = part.reshape(-1, p, d)
    out = torch.empty((flat.shape[0], d), dtype=torch.float32, device=part.device)
    for i in range(flat.shape[0]):
        _column_sum_kernel[(triton.cdiv(d, COLUMN_BLOCK),)](
            flat[i], out[i], p, d, BLOCK=COLUMN_BLOCK, num_warps=4, **COMPILE_OPTIONS
        )
    return out.reshape(*lead, d)


def _row_blocks(rows: int, device: torch.device) -> tuple[int, int]:
    """``(programs, rows_per_program)`` for the row-blocked kernels: a function of the row count and device only."""
    per = triton.cdiv(rows, min(rows, 4 * num_sms(device)))
    return triton.cdiv(rows, per), per


# ----------------------------------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "ROWS"])
def _rms_norm_bwd_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    dx_ptr,
    dwp_ptr,
    M,
    H,
    H_f,
    eps,
    ROWS,
    BLOCK: tl.constexpr,
    X_DTYPE: tl.constexpr,
    RNE: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
):
    """Rows ``[pid * ROWS, (pid + 1) * ROWS)``. ``y = w * cast(x * r)``, ``r = rsqrt(mean(x^2) + eps)``:
    ``dx = r * (dy*w - n * mean(dy*w * n))`` with ``n = x * r``; ``dw += dy * cast(n)`` (partial per program), or
    ``dw += dy * n`` for ``y = cast(w * x * r)`` (not ``ROUND_NORMED``)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < M:
            off = row.to(tl.int64) * H + cols
            x = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off, mask=ok, other=0.0).to(tl.float32)
            r = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=0), H_f) + eps)
            n = x * r
            dn = dy * w
            c = tl.math.div_rn(tl.sum(dn * n, axis=0), H_f)
            tl.store(dx_ptr + off, cast_out(r * (dn - n * c), X_DTYPE, RNE), mask=ok)
            dw += dy * normed_row(x, r, X_DTYPE, RNE, ROUND_NORMED)
    tl.store(dwp_ptr + pid * H + cols, dw, mask=ok)


def rms_norm_supported(H: int) -> bool:
    """Whether :func:`rms_norm_backward` handles hidden size ``H`` (one row in registers)."""
    return 0 < H <= MAX_ROW_BLOCK


def rms_norm_backward(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float, round_normed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rlexact.ops.triton_norm.rms_norm` (with the same ``round_normed``): ``x [M, H]``,
    ``w [H]``, ``dy [M, H]`` -> ``(dx [M, H] in x.dtype, dw [H] in w.dtype)``, fp32 arithmetic, deterministic."""
    M, H = x.shape
    if not rms_norm_supported(H):
        raise ValueError(f"rms_norm_backward: hidden size {H} outside (0, {MAX_ROW_BLOCK}]")
    x, dy, w = x.contiguous(), dy.contiguous(), w.contiguous()
    dx = torch.empty_like(x)
    if M == 0:
        return dx, torch.zeros_like(w)
    progs, per = _row_blocks(M, x.device)
    part = torch.empty((progs, H), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(H)
    _rms_norm_bwd_kernel[(progs,)](
        x, w, dy, dx, part, M, H, float(H), float(eps), per,
        BLOCK=block, X_DTYPE=TL_DTYPE[x.dtype], RNE=rne_fix(x.dtype), ROUND_NORMED=round_normed,
        num_warps=8 if block >= 4096 else 4 if block >= 1024 else 2,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return dx, _column_sum(part).to(w.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# q/k RMSNorm + rotary
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope_rows_bwd(
    x_ptr,
    g_ptr,
    dx_ptr,
    w_ptr,
    c_ptr,
    s_ptr,
    dwp_ptr,
    pid,
    T,
    ROWS,
    H,
    HALF,
    eps,
    D_f,
    BH: tl.constexpr,
    BHALF: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    DTYPE: tl.constexpr,
    RNE: tl.constexpr,
):
    """Tokens ``[pid * ROWS, (pid + 1) * ROWS)`` of one of q / k (``[T, H, 2 * HALF]``): input gradients, and the
    program's partial weight gradient ``[2 * HALF]`` to ``dwp_ptr + pid * 2 * HALF``."""
    h = tl.arange(0, BH)[:, None]
    c = tl.arange(0, BHALF)[None, :]
    c_ok = c < HALF
    m = (h < H) & c_ok
    if NORM:
        w1 = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + c, mask=c_ok, other=0.0).to(tl.float32)
    dw1 = tl.zeros((1, BHALF), tl.float32)
    dw2 = tl.zeros((1, BHALF), tl.float32)
    for i in range(ROWS):
        t = (pid * ROWS + i).to(tl.int64)
        if t < T:
            base = t * H * (2 * HALF) + h * (2 * HALF) + c
            cs = t * (2 * HALF) + c
            c1 = tl.load(c_ptr + cs, mask=c_ok, other=0.0).to(tl.float32)
            c2 = tl.load(c_ptr + cs + HALF, mask=c_ok, other=0.0).to(tl.float32)
            s1 = tl.load(s_ptr + cs, mask=c_ok, other=0.0).to(tl.float32)
            s2 = tl.load(s_ptr + cs + HALF, mask=c_ok, other=0.0).to(tl.float32)
            g1 = tl.load(g_ptr + base, mask=m, other=0.0).to(tl.float32)
            g2 = tl.load(g_ptr + base + HALF, mask=m, other=0.0).to(tl.float32)
            # forward: out1 = y1 c1 - y2 s1, out2 = y2 c2 + y1 s2
            dy1 = g1 * c1 + g2 * s2
            dy2 = g2 * c2 - g1 * s1
            if NORM:
                x1 = tl.load(x_ptr + base, mask=m, other=0.0).to(tl.float32)
                x2 = tl.load(x_ptr + base + HALF, mask=m, other=0.0).to(tl.float32)
                r = tl.math.rsqrt(tl.math.div_rn(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), D_f) + eps)
                r = r[:, None]
                n1 = x1 * r
                n2 = x2 * r
                dw1 += tl.sum(dy1 * normed_row(x1, r, DTYPE, RNE, ROUND_NORMED), axis=0)[None, :]
                dw2 += tl.sum(dy2 * normed_row(x2, r, DTYPE, RNE, ROUND_NORMED), axis=0)[None, :]
                dn1 = dy1 * w1
                dn2 = dy2 * w2
                dot = tl.math.div_rn(tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1), D_f)[:, None]
                dy1 = r * (dn1 - n1 * dot)
                dy2 = r * (dn2 - n2 * dot)
            tl.store(dx_ptr + base, cast_out(dy1, DTYPE, RNE), mask=m)
            tl.store(dx_ptr + base + HALF, cast_out(dy2, DTYPE, RNE), mask=m)
    if NORM:
        tl.store(dwp_ptr + pid * (2 * HALF) + c, dw1, mask=c_ok)
        tl.store(dwp_ptr + pid * (2 * HALF) + HALF + c, dw2, mask=c_ok)


@triton.jit(do_not_specialize=["T", "ROWS"])
def _qk_norm_rope_bwd_kernel(
    q_ptr,
    k_ptr,
    gq_ptr,
    gk_ptr,
    dq_ptr,
    dk_ptr,
    qw_ptr,
    kw_ptr,
    c_ptr,
    s_ptr,
    dwp_ptr,
    T,
    ROWS,
    P,
    HQ,
    HKV,
    HALF,
    eps,
    D_f,
    BHQ: tl.constexpr,
    BHK: tl.constexpr,
    BHALF: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    DTYPE: tl.constexpr,
    RNE: tl.constexpr,
):
    """Grid ``(P, 2)``: axis 1 picks q (0) or k (1); partial weight gradients go to ``dwp [2, P, D]``."""
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _norm_rope_rows_bwd(
            q_ptr, gq_ptr, dq_ptr, qw_ptr, c_ptr, s_ptr, dwp_ptr, pid, T, ROWS, HQ, HALF, eps, D_f,
            BHQ, BHALF, NORM, ROUND_NORMED, DTYPE, RNE,
        )  # fmt: skip
    else:
        _norm_rope_rows_bwd(
            k_ptr, gk_ptr, dk_ptr, kw_ptr, c_ptr, s_ptr, dwp_ptr + P * 2 * HALF, pid, T, ROWS, HKV, HALF, eps, D_f,
            BHK, BHALF, NORM, ROUND_NORMED, DTYPE, RNE,
        )  # fmt: skip


def qk_norm_rope_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    gq: torch.Tensor,
    gk: torch.Tensor,
    eps: float,
    round_normed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`rlexact.ops.triton_rope.qk_norm_rope` (same argument layout; ``gq, gk`` are the output
    gradients) -> ``(dq, dk, dq_weight, dk_weight)`` in the input dtypes (weights ``None`` without norm).

    Semantics as :func:`rlexact.ops.reference.norm_rope` in fp32, with the weight gradient taken against the
    normalized value the forward multiplies by the weight: rounded to the input dtype, or with ``round_normed=False``
    the fp32 one. The weights are the norms' scales (for an ``offset`` norm pass ``1 + w`` in fp32; its gradient is
    ``w``'s)."""
    T, hq, d = q.shape
    q, k, gq, gk = q.contiguous(), k.contiguous(), gq.contiguous(), gk.contiguous()
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    norm = q_weight is not None
    if T == 0:
        zw = (torch.zeros_like(q_weight), torch.zeros_like(k_weight)) if norm else (None, None)
        return dq, dk, *zw
    progs, per = _row_blocks(T, q.device)
    part = torch.empty((2, progs, d), dtype=torch.float32, device=q.device)
    qw = q_weight.contiguous() if norm else q
    kw = k_weight.contiguous() if norm else k
    _qk_norm_rope_bwd_kernel[(progs, 2)](
        q, k, gq, gk, dq, dk, qw, kw, cos.contiguous(), sin.contiguous(), part,
        T, per, progs, hq, k.shape[1], d // 2, float(eps), float(d),
        BHQ=triton.next_power_of_2(hq), BHK=triton.next_power_of_2(k.shape[1]), BHALF=triton.next_power_of_2(d // 2),
        NORM=norm, ROUND_NORMED=round_normed, DTYPE=TL_DTYPE[q.dtype], RNE=rne_fix(q.dtype), num_warps=4,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    if not norm:
        return dq, dk, None, None
    dw = _column_sum(part)
    return dq, dk, dw[0].to(q_weight.dtype), dw[1].to(k_weight.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# SiLU-gate
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _gated_mul_bwd_kernel(
    g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, ncols, BLOCK: tl.constexpr, DTYPE: tl.constexpr, RNE: tl.constexpr,
    GELU: tl.constexpr,
):  # fmt: skip
    """``y = g * sigmoid(z) * u`` with ``z = g`` (SiLU) or, with ``GELU``, ``z = c (g + a g^3)``
    (``c = 2 sqrt(2 / pi)``, ``a = 0.044715``: GELU-tanh): ``dg = dy * u * s * (1 + g * (1 - s) * z')``,
    ``du = dy * g * s`` with ``s = sigmoid(z)`` and ``z' = 1`` or ``c (1 + 3 a g^2)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < ncols
    off = row * ncols + cols
    g = tl.load(g_ptr + off, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + off, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        z = gelu_tanh_arg(g)
        dz = gelu_tanh_arg_grad(g)
    else:
        z = g
        dz = 1.0
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-z))
    tl.store(dg_ptr + off, cast_out(dy * u * s * (1.0 + g * (1.0 - s) * dz), DTYPE, RNE), mask=ok)
    tl.store(du_ptr + off, cast_out(dy * g * s, DTYPE, RNE), mask=ok)


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rlexact.ops.triton_norm.silu_mul`: ``gate, up, dy [M, I]`` -> ``(d_gate, d_up)`` in
    ``gate.dtype``, computed in fp32 elementwise."""
    return _gated_mul_backward(gate, up, dy, gelu=False)


def gelu_tanh_mul_backward(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rlexact.ops.triton_norm.gelu_tanh_mul`, as :func:`silu_mul_backward`."""
    return _gated_mul_backward(gate, up, dy, gelu=True)


def _gated_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, gelu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    M, n = gate.shape
    gate, up, dy = gate.contiguous(), up.contiguous(), dy.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(gate)
    if M and n:
        _gated_mul_bwd_kernel[(M, triton.cdiv(n, SILU_BWD_BLOCK))](
            gate, up, dy, dg, du, n, BLOCK=SILU_BWD_BLOCK, DTYPE=TL_DTYPE[gate.dtype], RNE=rne_fix(gate.dtype),
            GELU=gelu, num_warps=4,
            **COMPILE_OPTIONS,
        )  # fmt: skip
    return dg, du


# ----------------------------------------------------------------------------------------------------------------------
# log-prob head
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T", "c0", "CW"])
def _head_dz_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    lse_ptr,
    ent_ptr,
    gl_ptr,
    ge_ptr,
    dz_ptr,
    T,
    H,
    c0,
    CW,
    stride_dz,
    temperature,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_GL: tl.constexpr,
    HAS_GE: tl.constexpr,
    SCALE: tl.constexpr,
    TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    DZ_DTYPE: tl.constexpr,
    RNE: tl.constexpr,
):
    """``dz[:, 0:CW]`` for vocabulary columns ``c0 .. c0 + CW - 1``: ``hidden [T, H]`` and ``w [V, H]`` contiguous,
    ``dz [T, >= CW]`` with row stride ``stride_dz``. ``TMA``: tensor descriptors built on the device."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(T, BM), tl.cdiv(CW, BV), GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    r_ok = rows < T
    rows64 = rows.to(tl.int64)
    lc = pid_n * BV + tl.arange(0, BV)  # chunk-local columns
    c_ok = lc < CW
    rk = tl.arange(0, BK)
    h_desc, w_desc = h_ptr, w_ptr  # unread without TMA
    if TMA:
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[T, H], strides=[H, 1], block_shape=[BM, BK])
        w_chunk = w_ptr + c0.to(tl.int64) * H
        w_desc = tl.make_tensor_descriptor(w_chunk, shape=[CW, H], strides=[H, 1], block_shape=[BV, BK])
    acc = logit_tile(h_ptr, w_ptr, h_desc, w_desc, rows64, r_ok, c0 + lc, c_ok, rk, pid_m * BM, pid_n * BV,
                     tl.cdiv(H, BK), H, H, H, BM, BV, BK, TMA, UPCAST, IEEE)  # fmt: skip
    if SCALE:
        z = tl.math.div_rn(acc, temperature)
    else:
        z = acc
    lse = tl.load(lse_ptr + rows64, mask=r_ok, other=0.0)[:, None]
    logp = z - lse
    p = tl.exp(logp)
    g = tl.zeros((BM, BV), dtype=tl.float32)
    if HAS_GL:
        gl = tl.load(gl_ptr + rows64, mask=r_ok, other=0.0)[:, None]
        tgt = tl.load(tgt_ptr + rows64, mask=r_ok, other=-1)[:, None]
        g = tl.where((c0 + lc)[None, :] == tgt, gl, 0.0) - p * gl
    if HAS_GE:
        ge = tl.load(ge_ptr + rows64, mask=r_ok, other=0.0)[:, None]
        ent = tl.load(ent_ptr + rows64, mask=r_ok, other=0.0)[:, None]
        g = g - ge * p * (logp + ent)
    if SCALE:
        g = tl.math.div_rn(g, temperature)
    ptrs = dz_ptr + rows64[:, None] * stride_dz + lc[None, :]
    tl.store(ptrs, cast_out(g, DZ_DTYPE, RNE), mask=r_ok[:, None] & c_ok[None, :])


def _head_bwd_config(H: int, dtype: torch.dtype, device: torch.device) -> dict:
    key = device_key(device)
    if key[0] == "interp":
        return dict(BM=16, BV=32, BK=32, TMA=False, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BM=64, BV=64, BK=32, TMA=False, num_warps=4, num_stages=3)
    tma = cuda_props(key[1])[0] >= 9 and HAS_WS and (H * dtype.itemsize) % 16 == 0
    return dict(BM=128, BV=128, BK=64, TMA=tma, num_warps=8, num_stages=4 if tma else 3)


_MM_OUT_DTYPE = [True]
"""Whether ``torch.mm(..., out_dtype=torch.float32)`` works here (cleared, with a warning, the first time it fails)."""


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 output and fp32 accumulation (16-bit operands stay 16-bit on CUDA: tensor cores).
    Where torch lacks the bf16/fp16 -> fp32 GEMM, the operands are upcast (same math, slower)."""
    if a.is_cuda and a.dtype != torch.float32 and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as e:
            _MM_OUT_DTYPE[0] = False
            warnings.warn(f"torch.mm(out_dtype=float32) unavailable ({e}); the head backward upcasts to fp32 GEMMs",
                          stacklevel=2)  # fmt: skip
    return torch.mm(a.float(), b.float())


def head_backward(
    hidden: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    temperature: float,
    need_hidden: bool = True,
    need_w: bool = True,
    chunk: int = HEAD_CHUNK,
    config: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``(logp, entropy) = token_logprobs(hidden, w, targets, temperature)`` given the forward's saved
    ``lse`` and ``entropy`` (fp32 ``[T]``) and the output gradients (either may be ``None``).

    ``hidden [T, H]`` and ``w [V, H]`` of one dtype (fp32, bf16 or fp16). Returns ``(d_hidden, d_w)`` in the input
    dtypes (``None`` where not requested). ``dz`` is rounded to the input dtype before the two GEMMs (as a stock
    16-bit model's logits gradient is); both GEMMs accumulate in fp32. See the module docstring for the order.
    ``chunk`` and ``config`` (the kernel's tiles) override the defaults in tests.
    """
    T, H = hidden.shape
    V = w.shape[0]
    hidden, w = hidden.contiguous(), w.contiguous()
    if hidden.dtype != w.dtype:
        raise ValueError(f"head_backward: hidden {hidden.dtype} and w {w.dtype} must have one dtype")
    gh = torch.zeros((T, H), dtype=torch.float32, device=hidden.device) if need_hidden else None
    gw = torch.empty_like(w) if need_w else None
    if T == 0 or (g_logp is None and g_ent is None):
        return (None if gh is None else gh.to(hidden.dtype)), (None if gw is None else gw.zero_())
    cfg = config or _head_bwd_config(H, hidden.dtype, hidden.device)
    if cfg["TMA"]:
        ensure_allocator()
        hidden, w = aligned(hidden), aligned(w)
    cw_max = min(chunk, V)
    dz = torch.empty((T, cw_max), dtype=hidden.dtype, device=hidden.device)
    gl = g_logp.float().contiguous() if g_logp is not None else lse
    ge = g_ent.float().contiguous() if g_ent is not None else lse
    flags = dot_flags(hidden.dtype)
    for c0 in range(0, V, cw_max):  # fixed chunk width, ascending chunk order
        cw = min(cw_max, V - c0)
        grid = (triton.cdiv(T, cfg["BM"]) * triton.cdiv(cw, cfg["BV"]),)
        _head_dz_kernel[grid](
            hidden, w, targets, lse, ent, gl, ge, dz, T, H, c0, cw, dz.stride(0), float(temperature),
            BM=cfg["BM"], BV=cfg["BV"], BK=cfg["BK"], GROUP_M=8, HAS_GL=g_logp is not None, HAS_GE=g_ent is not None,
            SCALE=float(temperature) != 1.0, TMA=cfg["TMA"], **flags, DZ_DTYPE=TL_DTYPE[hidden.dtype],
            RNE=rne_fix(hidden.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **COMPILE_OPTIONS,
        )  # fmt: skip
        dzc = dz[:, :cw]
        if gw is not None:
            gw[c0 : c0 + cw] = _mm_f32(dzc.T, hidden)
        if gh is not None:
            gh += _mm_f32(dzc, w[c0 : c0 + cw])
    return (None if gh is None else gh.to(hidden.dtype)), gw
