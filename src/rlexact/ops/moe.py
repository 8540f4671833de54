"""Exact Mixture-of-Experts ops: router, grouped expert GEMM, the expert MLP with its deterministic backward.

Semantics (transformers' Qwen3-MoE / Qwen2-MoE, fused-expert layout ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``):

* :func:`moe_router`: ``probs = softmax(logits.float())``; the ``k`` largest probabilities, **ties to the lowest expert
  index**, in descending order; with ``norm_topk_prob`` divided by their sum (summed in selection order); weights cast
  to the logits' dtype.
* :func:`moe_experts`: for token ``t`` and its ``j``-th expert ``e = ids[t, j]``:
  ``y[t, j] = down[e] @ silu_mul(gate_up[e] @ x[t])`` (each matmul with fp32 accumulation and one rounding to
  ``x.dtype``, :func:`rlexact.ops.silu_mul` in between), and ``out[t] = sum_j weights[t, j] * y[t, j]`` accumulated
  in fp32 for ``j = 0, 1, ..., k-1`` (top-k order, never expert order), cast once to ``x.dtype``.

Batch invariance: the (token, slot) pairs are grouped by expert with a *stable* sort (:func:`moe_plan`), so each
expert sees its rows in token order; each row goes through the grouped GEMM whose tile shape is fixed per
``(N, K, dtype, device)`` (:mod:`rlexact.ops.triton_moe`, :mod:`rlexact.ops.cpu_moe`); the combine accumulates a
token's ``k`` slots in fp32 in top-k order (one Triton program per token and column block, or a chain of exactly
rounded torch multiplies and adds). So a token's output depends only on that token and the weights -- not on how many
tokens its experts received, nor on which other tokens are in the call.

Backward (:class:`MoeExpertsFn`): the input gradients go through grouped GEMMs over the expert-sorted rows; each
weight gradient ``dW[e] = g_e^T @ a_e`` reduces expert ``e``'s rows in a fixed order -- one fp32 accumulator per
output tile walking the rows in ascending order (Triton), or one torch GEMM of a fixed shape per expert (CPU) -- with
no atomics; a token's input gradient sums its ``k`` slots in top-k order. Two identical backward calls give identical
bits. It is not batch-invariant (it need not be).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from . import cpu_moe
from .autograd import GatedMulFn, gated_mul_grad
from .backend import Backend, resolve_backend

__all__ = ["MoePlan", "grouped_matmul", "moe_experts", "moe_plan", "moe_router", "sigmoid_gate"]


def _triton():  # noqa: ANN202 - the kernel module (triton is an optional dependency)
    return importlib.import_module(".triton_moe", __package__)


@dataclass(frozen=True)
class MoePlan:
    """Expert grouping of ``S = T * k`` (token, slot) pairs; built on the device without host synchronization.

    Attributes:
        top_k: slots per token ``k``; pair ``p = t * k + j`` is slot ``j`` of token ``t``.
        order: ``[S]`` int64, the pair of each expert-sorted row (stable: ascending pair index within an expert), so
            the rows of expert ``e`` are ``[sum(counts[:e]), sum(counts[:e + 1]))``.
        counts: ``[E]`` int64, rows per expert (the grouped GEMMs derive their row tiles from it on the device).
    """

    top_k: int
    order: torch.Tensor
    counts: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.order.numel()


def moe_plan(ids: torch.Tensor, num_experts: int) -> MoePlan:
    """Group the pairs of ``ids [T, k]`` (expert ids in ``[0, num_experts)``) by expert. Device-side ops only:
    CUDA-graph capturable at a static ``T``."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # integer adds: exact in any order
    return MoePlan(top_k=ids.shape[-1], order=order, counts=counts)


def _grouped(
    a: torch.Tensor,
    w: torch.Tensor,
    plan: MoePlan,
    gather: torch.Tensor | None,
    scatter: torch.Tensor | None,
    backend: Backend,
    gather_div: int = 1,
) -> torch.Tensor:
    """Dispatch of the grouped GEMM (no autograd): sorted row ``r`` reads ``a[gather[r] // gather_div]`` and writes
    output row ``scatter[r]``; ``[S, N]`` in ``a.dtype``."""
    if backend == "torch":
        rows = gather if gather is None or gather_div == 1 else torch.div(gather, gather_div, rounding_mode="floor")
        return cpu_moe.grouped_matmul(a, w, plan.counts.tolist(), rows, scatter)
    out_dtype = a.dtype
    if a.dtype != w.dtype or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        a, w = a.float(), w.float()
    a = a if a.stride(-1) == 1 else a.contiguous()
    w = w if w.is_contiguous() else w.contiguous()
    out = torch.empty((plan.num_rows, w.shape[1]), dtype=a.dtype, device=a.device)
    _triton().grouped_matmul(a, w, out, plan.counts, gather, scatter, gather_div)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _silu_mul(h: torch.Tensor, inter: int, backend: Backend) -> torch.Tensor:
    """The exact ``silu_mul`` (:func:`rlexact.ops.silu_mul`'s kernels) of the gate and up halves of ``h [S, 2I]``."""
    if backend == "triton":
        return _triton().silu_mul_halves(h, inter)
    return GatedMulFn.apply(h[:, :inter].contiguous(), h[:, inter:].contiguous(), backend, "silu_mul")


def _combine(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype, backend: Backend) -> torch.Tensor:
    """``sum_j weights[:, j] * y[:, j]`` in fp32, ``j`` ascending, cast once. ``y [T, k, H]``, ``weights [T, k]``.
    Torch backend: a chain of exactly rounded elementwise multiplies and adds (row-local on any device)."""
    if backend == "triton":
        return _triton().combine(y.reshape(-1, y.shape[-1]), weights, out_dtype)
    w = weights.float()
    acc = y[:, 0].float() * w[:, 0, None]
    for j in range(1, y.shape[1]):
        acc = acc + y[:, j].float() * w[:, j, None]
    return acc.to(out_dtype)


def _check_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"moe_experts: x must be [T, H], ids and weights [T, k]; got x {tuple(x.shape)}, ids {tuple(ids.shape)}, "
            f"weights {tuple(weights.shape)}"
        )
    h = x.shape[1]
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[2] != h or w2.shape[1] != h or w1.shape[0] != w2.shape[0]:
        raise ValueError(
            f"moe_experts: expected gate_up_proj [E, 2I, {h}] and down_proj [E, {h}, I], got {tuple(w1.shape)} and "
            f"{tuple(w2.shape)}"
        )
    if w1.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"moe_experts: gate_up_proj rows {w1.shape[1]} != 2 * down_proj columns {w2.shape[2]}")
    if ids.dtype not in (torch.int32, torch.int64) or not 1 <= ids.shape[1] <= w1.shape[0]:
        raise ValueError(
            f"moe_experts: ids must be int32/int64 [T, k] with 1 <= k <= {w1.shape[0]} experts, got {ids.dtype} "
            f"{tuple(ids.shape)}"
        )


class MoeRouterFn(torch.autograd.Function):
    """Forward: the router kernel. Backward: autograd of the fp32 softmax / gather / renormalization at the saved
    expert ids (deterministic: each selected probability is scattered to a distinct logit)."""

    @staticmethod
    def forward(ctx, logits, top_k: int, norm: bool, backend: Backend):  # noqa: ANN001, ANN205
        if backend == "torch":
            weights, ids = cpu_moe.moe_router(logits, top_k, norm)
        else:
            weights, ids = _triton().moe_router(logits, top_k, norm)
        ctx.save_for_backward(logits, ids)
        ctx.norm = norm
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, g_weights: torch.Tensor, _g_ids: torch.Tensor):  # noqa: ANN205
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            z = logits.detach().float().requires_grad_(True)
            sel = torch.softmax(z, dim=-1).gather(-1, ids)
            if ctx.norm:
                sel = sel / sel.sum(-1, keepdim=True)
            (gz,) = torch.autograd.grad(sel, z, g_weights.float())
        return gz.to(logits.dtype), None, None, None


class MoeExpertsFn(torch.autograd.Function):
    """The routed expert MLP (see module doc). Saves ``x``, the plan and the gate/up activations ``[S, 2I]``."""

    @staticmethod
    def forward(ctx, x, ids, weights, w1, w2, backend: Backend):  # noqa: ANN001, ANN205
        t, k = ids.shape
        inter = w2.shape[2]
        plan = moe_plan(ids.long(), w1.shape[0])
        h = _grouped(x, w1, plan, plan.order, None, backend, gather_div=k)  # [S, 2I], expert-sorted rows
        act = _silu_mul(h, inter, backend)
        y = _grouped(act, w2, plan, None, plan.order, backend)  # [S, H], pair order t * k + j
        ctx.save_for_backward(x, weights, w1, w2, plan.order, plan.counts, h)
        ctx.backend = backend
        return _combine(y.view(t, k, -1), weights, x.dtype, backend)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        x, weights, w1, w2, order, counts, h = ctx.saved_tensors
        t, k = weights.shape
        inter = w2.shape[2]
        dt = w1.dtype
        plan = MoePlan(top_k=k, order=order, counts=counts)
        grads = _ExpertGrads(plan, ctx.backend)
        rw = weights.reshape(-1)[order].float()[:, None]  # routing weight of each sorted row
        grad = grad.to(dt).contiguous()
        act = _silu_mul(h, inter, ctx.backend)
        # d(out)/d(weight[t, j]) = <g_t, y_tj> = <g_t @ down[e], act_tj>; d(act) = weight * (g_t @ down[e])
        u = grads.input_grad(grad, w2, gather_tokens=True)  # [S, I]
        d_rw = torch.zeros(order.numel(), dtype=torch.float32, device=x.device)
        d_rw[order] = (u.float() * act.float()).sum(-1)
        d_act = u.float() * rw
        d_h = torch.cat(gated_mul_grad(h[:, :inter].float(), h[:, inter:].float(), d_act), dim=-1).to(dt)
        dw2 = dw1 = None
        if ctx.needs_input_grad[4]:
            gw = (grad[torch.div(order, k, rounding_mode="floor")].float() * rw).to(dt)
            dw2 = grads.weight_grad(gw, act.to(dt), gather_tokens=False)
        if ctx.needs_input_grad[3]:
            dw1 = grads.weight_grad(d_h, x.to(dt), gather_tokens=True)
        dxs = grads.input_grad(d_h, w1, gather_tokens=False)  # [S, H]
        dx_pairs = torch.empty_like(dxs)
        dx_pairs[order] = dxs
        dx_pairs = dx_pairs.view(t, k, -1).float()
        dx = dx_pairs[:, 0]
        for j in range(1, k):  # a token's slots summed in top-k order
            dx = dx + dx_pairs[:, j]
        return dx.to(x.dtype), None, d_rw.view(t, k).to(weights.dtype), dw1, dw2, None


class _ExpertGrads:
    """The backward GEMMs over expert-sorted rows; deterministic on both backends.

    * Triton: input gradients through the grouped GEMM on transposed expert weights, weight gradients through
      :func:`rlexact.ops.triton_moe.grouped_wgrad` (each expert's rows reduced in ascending order into one fp32
      accumulator per output tile, no atomics); no host synchronization.
    * torch: one GEMM per non-empty expert over its contiguous row range, experts in ascending order (a GEMM of a
      fixed shape reduces in a fixed order; the row counts are read to the host once).
    """

    def __init__(self, plan: MoePlan, backend: Backend) -> None:
        self.plan = plan
        self.backend = backend
        self.tokens = torch.div(plan.order, plan.top_k, rounding_mode="floor")
        self.ranges: list[tuple[int, int, int]] = []
        if backend == "torch":
            start = 0
            for e, c in enumerate(plan.counts.tolist()):
                if c:
                    self.ranges.append((e, start, start + c))
                start += c

    def input_grad(self, a: torch.Tensor, w: torch.Tensor, gather_tokens: bool) -> torch.Tensor:
        """Row ``r``: ``a[src(r)] @ w[e(r)]`` -> ``[S, K]`` for ``w [E, N, K]``; ``src(r)`` is the row's token when
        ``gather_tokens``, else ``r``."""
        if self.backend == "triton":
            gather = self.plan.order if gather_tokens else None
            return _grouped(a, w.transpose(1, 2), self.plan, gather, None, "triton", gather_div=self.plan.top_k)
        rows = a[self.tokens] if gather_tokens else a
        out = torch.empty((self.plan.num_rows, w.shape[2]), dtype=a.dtype, device=a.device)
        for e, s0, s1 in self.ranges:
            out[s0:s1] = rows[s0:s1] @ w[e]
        return out

    def weight_grad(self, g: torch.Tensor, a: torch.Tensor, gather_tokens: bool) -> torch.Tensor:
        """``[E, N, K]``: expert ``e``'s ``g[rows_e]^T @ a[src(rows_e)]`` for ``g [S, N]``; zeros for empty experts."""
        if self.backend == "triton":
            gather = self.plan.order if gather_tokens else None
            return _triton().grouped_wgrad(g, a, self.plan.counts, gather, self.plan.top_k)
        rows = a[self.tokens] if gather_tokens else a
        out = torch.zeros((self.plan.counts.numel(), g.shape[1], a.shape[1]), dtype=g.dtype, device=g.device)
        for e, s0, s1 in self.ranges:
            out[e] = g[s0:s1].T @ rows[s0:s1]
        return out


def moe_router(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic softmax + top-k routing: ``logits [T, E]`` -> ``(weights [T, k] in logits.dtype, ids [T, k]
    int64)``; ties go to the lowest expert index. Differentiable in ``logits`` (through ``weights``)."""
    if logits.dim() != 2:
        raise ValueError(f"moe_router: logits must be [T, E], got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_router: top_k={top_k} must be in [1, num_experts={logits.shape[1]}]")
    return MoeRouterFn.apply(logits, int(top_k), bool(norm_topk_prob), resolve_backend(logits, backend))


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """The routed expert MLP (module doc): ``x [T, H]``, ``ids [T, k]`` in ``[0, E)``, ``weights [T, k]``,
    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` -> ``[T, H]`` in ``x.dtype``. Differentiable in ``x``,
    ``weights`` and both expert weights; expert ids are not range-checked on the device (that would synchronize)."""
    _check_experts(x, ids, weights, gate_up_proj, down_proj)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    return MoeExpertsFn.apply(x.contiguous(), ids, weights, gate_up_proj, down_proj, resolve_backend(x, backend))


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """``out[m] = x[m] @ w[expert_ids[m]].T`` with the batch-invariant grouped GEMM (inference; no autograd).

    ``x [M, K]``, ``w [E, N, K]``, ``expert_ids [M]`` -> ``[M, N]`` in ``x.dtype``, fp32 accumulation. Row ``m``'s
    result depends only on ``x[m]`` and ``w[expert_ids[m]]``.
    """
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or expert_ids.shape != x.shape[:1]:
        raise ValueError(
            f"grouped_matmul: expected x [M, K], w [E, N, K], expert_ids [M]; got {tuple(x.shape)}, {tuple(w.shape)}, "
            f"{tuple(expert_ids.shape)}"
        )
    b = resolve_backend(x, backend)
    plan = moe_plan(expert_ids.long()[:, None], w.shape[0])
    with torch.no_grad():
        return _grouped(x.contiguous(), w, plan, plan.order, plan.order, b)


def sigmoid_gate(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's shared-expert mix ``routed + sigmoid(gate_logit) * shared`` in fp32, cast once to
    ``routed.dtype``. ``routed, shared [T, H]``, ``gate_logit [T, 1]``; differentiable. Row-local on every device:
    CPU tensors go through fixed row blocks (:func:`rlexact.ops.cpu_moe.sigmoid_gate`); CUDA elementwise kernels
    apply one per-element function whatever the tensor size."""
    if routed.shape != shared.shape or gate_logit.shape != (*routed.shape[:-1], 1):
        raise ValueError(
            f"sigmoid_gate: routed {tuple(routed.shape)}, shared {tuple(shared.shape)}, gate {tuple(gate_logit.shape)}"
        )
    if not routed.is_cuda:
        return cpu_moe.sigmoid_gate(routed, shared, gate_logit)
    return (routed.float() + torch.sigmoid(gate_logit.float()) * shared.float()).to(routed.dtype)
