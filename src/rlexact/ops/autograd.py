"""``torch.autograd.Function`` wrappers: exact forward kernels, deterministic backward passes.

Backward passes use either dedicated kernels or autograd through :mod:`rlexact.ops.reference` /
plain torch matmuls, all deterministic for a fixed input shape. They are correct (checked against float64) but are not
required to be batch-invariant.
"""

from __future__ import annotations

import importlib

import torch

from . import cpu, reference
from .backend import Backend

ROW_CHUNK_BACKWARD = 256
"""Rows per chunk when recomputing logits in the log-prob backward (bounds memory to ``[256, V]`` fp32)."""


_TRITON_MODULES = {
    "matmul": ".triton_matmul",
    "rms_norm": ".triton_norm",
    "silu_mul": ".triton_norm",
    "qk_norm_rope": ".triton_rope",
    "token_logprobs": ".triton_logprob",
    "lm_head_logits": ".triton_logprob",
    "attention_varlen": ".triton_attention",
    "attention_paged": ".triton_attention",
    "attention_varlen_backward": ".triton_attention",
}
"""Op name -> the module of its Triton kernel, imported on first use (``triton`` is an optional dependency)."""


def _impl(backend: Backend, name: str):  # noqa: ANN202 - returns a kernel function
    if backend == "torch":
        return getattr(cpu, name)
    return getattr(importlib.import_module(_TRITON_MODULES[name], __package__), name)


class MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, backend: Backend) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)
        return _impl(backend, "matmul")(x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        gx = grad.to(w.dtype) @ w if ctx.needs_input_grad[0] else None
        gw = grad.to(x.dtype).T @ x if ctx.needs_input_grad[1] else None
        return gx, gw, None


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float, backend: Backend) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return _impl(backend, "rms_norm")(x, w, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xr = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wr = w.detach().requires_grad_(ctx.needs_input_grad[1])
            out = reference.rms_norm(xr, wr, ctx.eps)
            inputs = [t for t in (xr, wr) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad))
        return (next(grads) if xr.requires_grad else None, next(grads) if wr.requires_grad else None, None, None)


class QKNormRopeFn(torch.autograd.Function):
    """Forward: the fused kernel. Backward: autograd through :func:`reference.norm_rope` in fp32."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, qw, kw, eps: float, backend: Backend):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, cos, sin, qw, kw)
        ctx.eps = eps
        return _impl(backend, "qk_norm_rope")(q, k, cos, sin, qw, kw, eps)

    @staticmethod
    def backward(ctx, gq: torch.Tensor, gk: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, cos, sin, qw, kw = ctx.saved_tensors
        want = ctx.needs_input_grad
        grads: list[torch.Tensor | None] = [None] * 8
        with torch.enable_grad():
            for i, (x, w, g) in enumerate(((q, qw, gq), (k, kw, gk))):
                xr = x.detach().float().requires_grad_(want[i])
                wr = None if w is None else w.detach().float().requires_grad_(want[4 + i])
                pairs = ((i, xr, x), (4 + i, wr, w))
                leaves = [(j, t, src) for j, t, src in pairs if t is not None and t.requires_grad]
                if not leaves or g is None:
                    continue
                out = reference.norm_rope(xr, cos.float(), sin.float(), wr, ctx.eps)
                for (j, _, src), d in zip(leaves, torch.autograd.grad(out, [t for _, t, _ in leaves], g.float())):
                    grads[j] = d.to(src.dtype)
        return tuple(grads)


class SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, backend: Backend) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(gate, up)
        return _impl(backend, "silu_mul")(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        gate, up = ctx.saved_tensors
        g, u, dy = gate.float(), up.float(), grad.float()
        sig = torch.sigmoid(g)
        d_gate = dy * u * sig * (1 + g * (1 - sig))
        d_up = dy * g * sig
        return d_gate.to(gate.dtype), d_up.to(up.dtype), None


class TokenLogprobsFn(torch.autograd.Function):
    """Returns ``(logp [T] fp32, entropy [T] fp32)``; gradients flow to ``hidden`` and ``w`` from both outputs."""

    @staticmethod
    def forward(ctx, hidden, w, targets, temperature: float, backend: Backend):  # noqa: ANN001, ANN205
        logp, ent = _impl(backend, "token_logprobs")(hidden, w, targets, temperature)
        ctx.save_for_backward(hidden, w, targets)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):  # noqa: ANN205
        hidden, w, targets = ctx.saved_tensors
        t = ctx.temperature
        wf = w.float()
        gh = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ROW_CHUNK_BACKWARD):
            h = hidden[s : s + ROW_CHUNK_BACKWARD].float()
            z = (h @ wf.T) / t
            logp_all = torch.log_softmax(z, dim=-1)
            p = logp_all.exp()
            dz = torch.zeros_like(z)
            if g_logp is not None:
                gl = g_logp[s : s + ROW_CHUNK_BACKWARD].float()
                dz -= p * gl[:, None]
                dz.scatter_add_(-1, targets[s : s + ROW_CHUNK_BACKWARD, None], gl[:, None])
            if g_ent is not None:
                ge = g_ent[s : s + ROW_CHUNK_BACKWARD].float()
                ent = -(p * logp_all).sum(-1, keepdim=True)
                dz -= p * (logp_all + ent) * ge[:, None]
            dz /= t
            if gh is not None:
                gh[s : s + ROW_CHUNK_BACKWARD] = dz @ wf
            if gw is not None:
                gw += dz.T @ h
        return (
            gh.to(hidden.dtype) if gh is not None else None,
            gw.to(w.dtype) if gw is not None else None,
            None,
            None,
            None,
        )


class AttentionVarlenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale: float, backend: Backend):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        ctx.backend = backend
        return _impl(backend, "attention_varlen")(q, k, v, cu_seqlens, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, cu = ctx.saved_tensors
        if ctx.backend == "triton":
            dq, dk, dv = _impl("triton", "attention_varlen_backward")(grad, q, k, v, cu, ctx.scale)
            return dq, dk, dv, None, None, None
        with torch.enable_grad():
            qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = reference.attention_varlen(qr, kr, vr, cu, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), grad)
        return dq, dk, dv, None, None, None
