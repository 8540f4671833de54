"""Dense, differentiable reference implementations of the exact ops.

They define the math the kernels must compute (checked against these in float64) and serve as the backward pass of
ops whose kernels are forward-only: autograd through the reference is deterministic and correct, and backward need
not match anything bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, round_normed: bool = True) -> torch.Tensor:
    """``w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` (transformers' Llama / Qwen semantics); with
    ``round_normed=False`` ``(w * x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` (OLMo-2's: one rounding)."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * n.to(x.dtype) if round_normed else (w * n).to(x.dtype)


def norm_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor | None, eps: float, offset: bool = False
):  # fmt: skip
    """Per-head RMSNorm (when ``w`` is given; with ``offset`` its scale is ``1 + w``) then rotary, all in the dtype
    of ``x`` (use float64 for a reference). ``x [T, H, D]``, ``cos, sin [T, D]``."""
    if w is not None:
        x = (1 + w if offset else w) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None].to(x.dtype) + rot * sin[:, None].to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``(silu(gate32) * up32).to(gate.dtype)``."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``(gelu_tanh(gate32) * up32).to(gate.dtype)``."""
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(gate.dtype)


def hidden_keys(kpos: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[..., nq, nk]`` (``kpos [..., nk]`` and ``qpos [..., nq]`` broadcast) True where query position ``qpos[i]``
    does not see key position ``kpos[j]``: a later key, or (with a sliding ``window``, transformers' convention) a
    key ``window`` or more positions back. The one mask rule of every attention path (the CPU twin, the native
    baseline, transformers' masks checked by :mod:`rlexact.models.attention`)."""
    k, q = kpos[..., None, :], qpos[..., :, None]
    hidden = k > q
    if window is not None:
        hidden = hidden | (k <= q - window)
    return hidden


def attention_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """Dense causal attention of one sequence in the dtype of the inputs (use float64 for a reference).

    ``q [nq, Hq, D]`` at absolute positions ``q_start ..``; ``k, v [Lk, Hkv, D]`` at ``0 .. Lk-1``; ``window``: a
    query at position ``p`` sees keys ``p - window + 1 .. p`` only.
    """
    nq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    kq = k.repeat_interleave(hq // hkv, dim=1)
    vq = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kq) * scale
    qpos = q_start + torch.arange(nq, device=q.device)
    kpos = torch.arange(lk, device=q.device)
    scores = scores.masked_fill(hidden_keys(kpos, qpos, window)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vq)


def attention_sequence_split(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float, split: int
) -> torch.Tensor:
    """:func:`attention_sequence` computed the way the exact kernels decompose it: keys cut into splits of ``split``
    keys anchored at position 0, one ``(max, sum, acc)`` partial per split, folded in ascending split order
    (``m = max(m, m_s)``, ``sum = sum * exp(m_old - m) + sum_s * exp(m_s - m)``, likewise ``acc``), then
    ``acc / sum``. Equal to the dense softmax in exact arithmetic; in the dtype of the inputs (use float64)."""
    nq, hq, d = q.shape
    lk, hkv, _ = k.shape
    kq = k.repeat_interleave(hq // hkv, dim=1)
    vq = v.repeat_interleave(hq // hkv, dim=1)
    qpos = q_start + torch.arange(nq, device=q.device)
    m = torch.full((hq, nq), float("-inf"), dtype=q.dtype, device=q.device)
    total = torch.zeros((hq, nq), dtype=q.dtype, device=q.device)
    acc = torch.zeros((hq, nq, d), dtype=q.dtype, device=q.device)
    for lo in range(0, lk, split):
        kpos = torch.arange(lo, min(lk, lo + split), device=q.device)
        scores = torch.einsum("qhd,khd->hqk", q, kq[kpos]) * scale
        scores = scores.masked_fill((kpos[None, :] > qpos[:, None])[None], float("-inf"))
        m_s = scores.amax(-1)
        m_new = torch.maximum(m, m_s)
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - torch.where(torch.isinf(m_s), torch.zeros_like(m_s), m_s)[..., None])
        a, b = torch.exp(m - m_use), torch.exp(m_s - m_use)
        total = total * a + p.sum(-1) * b
        acc = acc * a[..., None] + torch.einsum("hqk,khd->hqd", p, vq[kpos]) * b[..., None]
        m = m_new
    return (acc / total[..., None]).transpose(0, 1)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Dense causal attention over packed sequences (a sliding ``window``: :func:`attention_sequence`), computed in
    fp32 (float64 inputs stay float64)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = cu_seqlens.tolist()
    outs = [
        attention_sequence(q[s:e].to(dt), k[s:e].to(dt), v[s:e].to(dt), 0, scale, window)
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


def truncation_candidates(row: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's top-k candidates in float64, sorted descending (every value without top-k), and the mass before
    each under their renormalized softmax (``cumsum(p) - p``)."""
    vals = torch.sort(row.double(), descending=True).values
    cand = vals[: top_k if 0 < top_k < row.numel() else row.numel()]
    p = torch.softmax(cand, -1)
    return cand, torch.cumsum(p, 0) - p


def truncation_thresholds(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``[B, 1]`` fp32: per row, the smallest kept value under top-k (the k-th largest, ties kept) then top-p (the
    shortest prefix of the sorted top-k values whose renormalized mass reaches ``top_p``; the top one always), in
    float64."""
    out = []
    for row in z.cpu():
        cand, before = truncation_candidates(row, top_k)
        keep = max(1, int((before < top_p).sum())) if top_p < 1.0 else cand.numel()
        out.append(cand[keep - 1].item())
    return torch.tensor(out, dtype=torch.float32, device=z.device)[:, None]
