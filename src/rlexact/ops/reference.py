"""Dense, differentiable reference implementations of the exact ops.

They define the math the kernels must compute (checked against these in float64) and serve as the backward pass of
ops whose kernels are forward-only: autograd through the reference is deterministic and correct, and backward need
not match anything bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` (transformers semantics)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor | None, eps: float):
    """Per-head RMSNorm (when ``w`` is given) then rotary, all in the dtype of ``x`` (use float64 for a reference).
    ``x [T, H, D]``, ``cos, sin [T, D]``."""
    if w is not None:
        x = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None].to(x.dtype) + rot * sin[:, None].to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``(silu(gate32) * up32).to(gate.dtype)``."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def attention_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float) -> torch.Tensor:
    """Dense causal attention of one sequence in the dtype of the inputs (use float64 for a reference).

    ``q [nq, Hq, D]`` at absolute positions ``q_start ..``; ``k, v [Lk, Hkv, D]`` at ``0 .. Lk-1``.
    """
    nq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    kq = k.repeat_interleave(hq // hkv, dim=1)
    vq = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kq) * scale
    qpos = q_start + torch.arange(nq, device=q.device)
    kpos = torch.arange(lk, device=q.device)
    scores = scores.masked_fill((kpos[None, :] > qpos[:, None])[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vq)


def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense causal attention over packed sequences, computed in fp32 (float64 inputs stay float64)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = cu_seqlens.tolist()
    outs = [
        attention_sequence(q[s:e].to(dt), k[s:e].to(dt), v[s:e].to(dt), 0, scale)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=0).to(q.dtype)


def token_logprobs(
    hidden: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialized-logits reference: log-prob of ``targets`` and entropy under ``softmax(hidden @ w.T / T)``."""
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = (hidden.to(dt) @ w.to(dt).T) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), ent
