"""``torch.autograd.Function`` wrappers: exact forward kernels, deterministic backward passes.

On the Triton backend the backward passes of RMSNorm, the fused q/k-norm + rotary op, SiLU-gate and the log-prob
head are the deterministic kernels of :mod:`rlexact.ops.triton_backward`; the matmul backward is cuBLAS (see
:class:`MatmulFn`) and attention has its own backward kernel. On the torch (CPU) backend they are autograd through
:mod:`rlexact.ops.reference` or plain torch math. All are deterministic for a fixed input shape and correct against
float64; none is required to be batch-invariant.
"""

from __future__ import annotations

import importlib
import math

import torch

from . import cpu, reference
from .backend import Backend

ROW_CHUNK_BACKWARD = 256
"""Rows per chunk when the torch backend recomputes logits in the log-prob backward (``[256, V]`` fp32 at most)."""


_TRITON_MODULES = {
    "matmul": ".triton_matmul",
    "rms_norm": ".triton_norm",
    "add_rms_norm": ".triton_norm",
    "norm_add_rms_norm": ".triton_norm",
    "write_kv": ".triton_kv",
    "silu_mul": ".triton_norm",
    "gelu_tanh_mul": ".triton_norm",
    "qk_norm_rope": ".triton_rope",
    "qk_norm_rope_write_kv": ".triton_rope",
    "token_logprobs": ".triton_logprob",
    "lm_head_logits": ".triton_logprob",
    "attention_varlen": ".triton_attention",
    "attention_paged": ".triton_attention",
    "attention_varlen_backward": ".triton_attention",
    "token_logprobs_lse": ".triton_logprob",
    "rms_norm_backward": ".triton_backward",
    "qk_norm_rope_backward": ".triton_backward",
    "silu_mul_backward": ".triton_backward",
    "gelu_tanh_mul_backward": ".triton_backward",
    "head_backward": ".triton_backward",
    "rms_norm_supported": ".triton_backward",
}
"""Op name -> the module of its Triton kernel, imported on first use (``triton`` is an optional dependency)."""


_TRITON_IMPLS: dict = {}
"""Op name -> its resolved Triton function (the import runs once)."""


def kernel_impl(backend: Backend, name: str):  # noqa: ANN202 - returns a kernel function
    """The function ``name`` of ``backend``: the torch twin in :mod:`rlexact.ops.cpu`, or the Triton kernel's launcher
    (its module imported on first use)."""
    if backend == "torch":
        return getattr(cpu, name)
    fn = _TRITON_IMPLS.get(name)
    if fn is None:
        fn = _TRITON_IMPLS[name] = getattr(importlib.import_module(_TRITON_MODULES[name], __package__), name)
    return fn


_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


class MatmulFn(torch.autograd.Function):
    """``x [..., K] @ w[N, K].T`` (the Triton backend takes leading dimensions; the torch backend ``[M, K]``).

    Forward: the exact (batch-invariant) matmul. Backward: cuBLAS, ``dx = grad @ w`` and ``dw = grad.T @ x``.

    The backward need not be batch-invariant, only deterministic and correct, and cuBLAS is the fastest such GEMM
    here (the exact kernel's fixed tiles and fixed K splits buy batch invariance, which a gradient does not need).
    It is deterministic: cuBLAS documents bitwise-identical results run to run for a given toolkit version, GPU
    architecture and SM count; for fixed shapes, dtypes and strides its heuristic returns the same algorithm, any
    split-K reduction runs in a fixed order, and atomics are off by default (``cublasSetAtomicsMode``). The documented
    exception, several streams sharing one cuBLAS workspace, is what ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (required by
    ``torch.use_deterministic_algorithms(True)``) rules out; the trainer issues its GEMMs on one stream. 16-bit
    operands accumulate in fp32 on tensor cores and round once to the parameter dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, backend: Backend) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)
        return kernel_impl(backend, "matmul")(x, w)

    @staticmethod
    def run(x: torch.Tensor, w: torch.Tensor, backend: Backend) -> torch.Tensor:
        """``MatmulFn.apply(x, w, backend)`` with less host work: with no functorch transform active and outside
        ``torch.compile`` tracing, ``Function.apply`` only unwraps dead functorch wrappers and calls the C
        ``apply``; this does the same without the generic Python wrapper. Otherwise it is ``apply`` itself."""
        if _functorch_active() or torch.compiler.is_compiling():
            return MatmulFn.apply(x, w, backend)
        return _matmul_c_apply(_unwrap_if_dead(x), _unwrap_if_dead(w), backend)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        lead = x.dim() != 2  # leading dimensions (the Triton backend's linear): the same GEMMs on [M, *] views
        x2 = x.reshape(-1, x.shape[-1]) if lead else x
        if lead:
            grad = grad.reshape(-1, grad.shape[-1])
        gx = grad.to(w.dtype) @ w if ctx.needs_input_grad[0] else None
        gw = grad.to(x.dtype).T @ x2 if ctx.needs_input_grad[1] else None
        return (gx.view(x.shape) if lead and gx is not None else gx), gw, None


_matmul_c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, MatmulFn)
"""The C ``apply`` of ``torch.autograd.Function`` bound to :class:`MatmulFn` (where ``Function.apply`` ends)."""


class RMSNormFn(torch.autograd.Function):
    """The exact norm; with ``offset`` the scale is ``1 + w`` in fp32, and the backward (which takes a scale) runs on
    that fp32 scale (:func:`rlexact.ops.cpu.offset_scale`), whose gradient is ``w``'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float, backend: Backend,  # noqa: ANN001
                round_normed: bool, offset: bool) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, w)
        ctx.eps, ctx.backend, ctx.round_normed, ctx.offset = eps, backend, round_normed, offset
        return kernel_impl(backend, "rms_norm")(x, w, eps, round_normed, offset)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        scale = cpu.offset_scale(w, ctx.offset)
        want = ctx.needs_input_grad
        # the Triton backward where it takes this hidden size, else the reference autograd
        if ctx.backend == "triton" and kernel_impl("triton", "rms_norm_supported")(x.shape[-1]):
            dx, dw = kernel_impl("triton", "rms_norm_backward")(x, scale, grad, ctx.eps, ctx.round_normed)
            return (dx if want[0] else None), (dw.to(w.dtype) if want[1] else None), None, None, None, None
        with torch.enable_grad():
            xr = x.detach().requires_grad_(want[0])
            wr = scale.detach().requires_grad_(want[1])
            out = reference.rms_norm(xr, wr, ctx.eps, ctx.round_normed)
            inputs = [t for t in (xr, wr) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad))
        gx = next(grads) if xr.requires_grad else None
        return gx, (next(grads).to(w.dtype) if wr.requires_grad else None), None, None, None, None


class QKNormRopeFn(torch.autograd.Function):
    """Forward: the fused kernel (``kind``: the norm's ``(round_normed, offset)``). Backward:
    :func:`rlexact.ops.triton_backward.qk_norm_rope_backward` on the Triton backend, autograd through
    :func:`reference.norm_rope` in fp32 on the torch backend; both run on the norms' fp32 scales (``1 + w`` with
    ``offset``), whose gradients are the weights'."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, qw, kw, eps: float, backend: Backend, kind: tuple[bool, bool]):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, cos, sin, qw, kw)
        ctx.eps, ctx.backend, ctx.kind = eps, backend, kind
        ctx.set_materialize_grads(False)
        return kernel_impl(backend, "qk_norm_rope")(q, k, cos, sin, qw, kw, eps, *kind)

    @staticmethod
    def backward(ctx, gq: torch.Tensor | None, gk: torch.Tensor | None):  # noqa: ANN001, ANN205
        q, k, cos, sin, qw, kw = ctx.saved_tensors
        round_normed, offset = ctx.kind
        scales = [None if w is None else cpu.offset_scale(w, offset) for w in (qw, kw)]
        want = ctx.needs_input_grad
        grads: list[torch.Tensor | None] = [None] * 9
        if ctx.backend == "triton":
            gq = torch.zeros_like(q) if gq is None else gq
            gk = torch.zeros_like(k) if gk is None else gk
            out = kernel_impl("triton", "qk_norm_rope_backward")(q, k, cos, sin, *scales, gq, gk, ctx.eps, round_normed)
            for j, d, src in zip((0, 1, 4, 5), out, (q, k, qw, kw)):
                grads[j] = d.to(src.dtype) if want[j] else None
            return tuple(grads)
        with torch.enable_grad():
            for i, (x, w, g) in enumerate(((q, scales[0], gq), (k, scales[1], gk))):
                xr = x.detach().float().requires_grad_(want[i])
                wr = None if w is None else w.detach().float().requires_grad_(want[4 + i])
                pairs = ((i, xr, x), (4 + i, wr, (qw, kw)[i]))
                leaves = [(j, t, src) for j, t, src in pairs if t is not None and t.requires_grad]
                if not leaves or g is None:
                    continue
                out = reference.norm_rope(xr, cos.float(), sin.float(), wr, ctx.eps)
                for (j, _, src), d in zip(leaves, torch.autograd.grad(out, [t for _, t, _ in leaves], g.float())):
                    grads[j] = d.to(src.dtype)
        return tuple(grads)


GATED_OPS: tuple[str, ...] = ("silu_mul", "gelu_tanh_mul")
"""The gated activations ``act(gate) * up`` of :class:`GatedMulFn`."""


class GatedMulFn(torch.autograd.Function):
    """``op(gate, up)`` for ``op`` in :data:`GATED_OPS`; the backward is the Triton kernel or :func:`gated_mul_grad`."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, backend: Backend, op: str) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(gate, up)
        ctx.backend, ctx.op = backend, op
        return kernel_impl(backend, op)(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        gate, up = ctx.saved_tensors
        if ctx.backend == "triton":
            d_gate, d_up = kernel_impl("triton", f"{ctx.op}_backward")(gate, up, grad)
            return d_gate, d_up, None, None
        d_gate, d_up = gated_mul_grad(gate.float(), up.float(), grad.float(), gelu=ctx.op == "gelu_tanh_mul")
        return d_gate.to(gate.dtype), d_up.to(up.dtype), None, None


def gated_mul_grad(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, gelu: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_gate, d_up)`` of ``gate * sigmoid(z) * up`` given the output gradient ``dy``, elementwise in the inputs'
    dtype (callers pass fp32), with ``z = gate`` (SiLU) or, with ``gelu``, ``z = c (gate + a gate^3)``,
    ``c = 2 sqrt(2 / pi)``, ``a = 0.044715`` (GELU-tanh): ``d_gate = dy * up * s * (1 + gate * (1 - s) * z')`` and
    ``d_up = dy * gate * s`` with ``s = sigmoid(z)``."""
    c = 2.0 * math.sqrt(2.0 / math.pi)
    z, dz = (c * (gate + 0.044715 * gate**3), c * (1 + 3 * 0.044715 * gate**2)) if gelu else (gate, 1.0)
    sig = torch.sigmoid(z)
    return dy * up * sig * (1 + gate * (1 - sig) * dz), dy * gate * sig


class TokenLogprobsFn(torch.autograd.Function):
    """Returns ``(logp [T] fp32, entropy [T] fp32)``; gradients flow to ``hidden`` and ``w`` from both outputs.

    Triton backend: the forward also returns the rows' ``logsumexp`` (same launch, same bits) and the backward is
    :func:`rlexact.ops.triton_backward.head_backward` (vocabulary chunks, tensor-core GEMMs, fixed order). Torch
    backend: ``[ROW_CHUNK_BACKWARD, V]`` fp32 logits are recomputed per row chunk.
    """

    @staticmethod
    def forward(ctx, hidden, w, targets, temperature: float, backend: Backend):  # noqa: ANN001, ANN205
        ctx.temperature = temperature
        ctx.backend = backend
        ctx.set_materialize_grads(False)  # an unused output (usually the entropy) costs nothing in the backward
        if backend == "triton":
            logp, ent, lse = kernel_impl(backend, "token_logprobs_lse")(hidden, w, targets, temperature)
            ctx.save_for_backward(hidden, w, targets, lse, ent)
        else:
            logp, ent = kernel_impl(backend, "token_logprobs")(hidden, w, targets, temperature)
            ctx.save_for_backward(hidden, w, targets)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):  # noqa: ANN205
        hidden, w, targets, *lse_ent = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        if ctx.backend == "triton":
            h2, w2 = (hidden, w) if hidden.dtype == w.dtype else (hidden.float(), w.float())
            gh, gw = kernel_impl("triton", "head_backward")(
                h2, w2, targets, *lse_ent, g_logp, g_ent, ctx.temperature, want_h, want_w
            )
        else:
            gh, gw = head_backward_torch(hidden, w, targets, ctx.temperature, g_logp, g_ent, want_h, want_w)
        return (
            gh.to(hidden.dtype) if gh is not None else None,
            gw.to(w.dtype) if gw is not None else None,
            None,
            None,
            None,
        )


def head_backward_torch(
    hidden: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    t: float,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    want_h: bool,
    want_w: bool,
    *,
    thresholds: torch.Tensor | None = None,
    chunk_rows: int = ROW_CHUNK_BACKWARD,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The torch head backward of per-token ``(log q[target], entropy(q))`` with ``q = softmax(hidden @ w.T / t)``:
    fp32 logits recomputed ``chunk_rows`` rows at a time; fp32 ``(d_hidden, d_w)``, ``None`` where not wanted.
    ``thresholds`` (``[rows, 1]`` fp32): ``q`` is the softmax of the logits at or above each row's threshold (the
    truncated distribution of top-k / top-p sampling); ``None``: the full softmax."""
    wf = w.float()
    gh = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
    for s in range(0, hidden.shape[0], chunk_rows):
        h = hidden[s : s + chunk_rows].float()
        z = (h @ wf.T) / t
        if thresholds is not None:
            z = z.masked_fill(z < thresholds[s : s + chunk_rows], float("-inf"))
        logq = torch.log_softmax(z, dim=-1)
        q = logq.exp()
        dz = torch.zeros_like(z)
        if g_logp is not None:
            gl = g_logp[s : s + chunk_rows].float()
            dz -= q * gl[:, None]
            dz.scatter_add_(-1, targets[s : s + chunk_rows, None], gl[:, None])
        if g_ent is not None:
            ge = g_ent[s : s + chunk_rows].float()
            kept = q > 0  # masked logits: q = 0 and log q = -inf, which contribute nothing
            ent = -torch.where(kept, q * logq, 0.0).sum(-1, keepdim=True)
            dz -= torch.where(kept, q * (logq + ent), 0.0) * ge[:, None]
        dz /= t
        if gh is not None:
            gh[s : s + chunk_rows] = dz @ wf
        if gw is not None:
            gw += dz.T @ h
    return gh, gw


class AttentionVarlenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale: float, window: int | None, backend: Backend):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        ctx.window = window
        ctx.backend = backend
        return kernel_impl(backend, "attention_varlen")(q, k, v, cu_seqlens, scale, window)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, cu = ctx.saved_tensors
        if ctx.backend == "triton":
            dq, dk, dv = kernel_impl("triton", "attention_varlen_backward")(grad, q, k, v, cu, ctx.scale, ctx.window)
            return dq, dk, dv, None, None, None, None
        with torch.enable_grad():
            qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = reference.attention_varlen(qr, kr, vr, cu, ctx.scale, ctx.window)
            dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), grad)
        return dq, dk, dv, None, None, None, None
