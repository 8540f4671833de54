"""The sampled distribution under top-k / top-p truncation: one implementation for the sampler and the trainer.

Order (the sampler's): temperature (already in the logits ``z``) -> top-k -> top-p. top-k keeps the tokens whose logit
is at least the k-th largest (ties at the boundary are all kept); top-p then keeps the smallest prefix of the top-k
tokens sorted by logit whose renormalized mass reaches ``top_p`` (again extended to boundary ties; the top token is
always kept). The kept set of a row is ``{v : z[v] >= threshold}``, and the log-prob of token ``t`` under the
truncated, renormalized distribution is ``z[t] - lse_K`` with ``lse_K = logsumexp(z[v] for v kept)``.

Row invariance: torch reductions (softmax, cumsum, logsumexp, sum) pick thread splits and tiles from the tensor
shape on the CPU and on CUDA, so every torch function here runs on fixed-shape blocks of :data:`TRUNC_ROWS` rows (the
input zero-padded). A row's threshold and ``lse_K`` then depend on that row alone: the generator (a few rows per
decode step) and the trainer (row chunks of a packed batch) compute them bitwise equal from bitwise equal ``z`` rows,
which :func:`rlexact.ops.lm_head_logits` guarantees (it is row-invariant).

On CUDA the threshold and ``lse_K`` come from :mod:`rlexact.ops.triton_truncation` (no sort of the vocabulary; the
same kept set in exact arithmetic, its masses summed in its own order), for the generator and the trainer alike;
``RLEXACT_TRUNCATION=torch`` forces the torch blocks (benchmarks compare the two).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

import torch

from rlexact.ops.autograd import head_backward_torch

LogprobMode = Literal["full", "sampled"]
"""Which distribution reported log-probs describe: the full tempered softmax, or the truncated one sampled from."""
LOGPROB_MODES: tuple[str, ...] = ("full", "sampled")

TRUNC_ROWS = 16
"""Rows per fixed-shape block of the truncation functions."""
TRAIN_CHUNK_ROWS = 128
"""Rows of ``[rows, V]`` fp32 logits the trainer-side function materializes at a time (forward and backward)."""

LogitsFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``hidden [R, H] -> (z [R, V] fp32, lse [R] fp32)``: the generator's logits function (``head_logits``)."""


def truncates(vocab: int, top_k: int, top_p: float) -> bool:
    """Whether ``(top_k, top_p)`` restricts ``vocab`` tokens: ``0 < top_k < vocab`` or ``top_p < 1``."""
    return 0 < top_k < vocab or top_p < 1.0


def _blocks(z: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``z`` zero-padded to a positive multiple of :data:`TRUNC_ROWS` rows, and its original row count."""
    rows = z.shape[0]
    pad = (-rows) % TRUNC_ROWS or (TRUNC_ROWS if rows == 0 else 0)
    if pad:
        z = torch.cat([z, z.new_zeros((pad, z.shape[1]))])
    return z, rows


def _threshold_block(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    vocab = z.shape[-1]
    use_k = 0 < top_k < vocab
    if use_k and not top_p < 1.0:
        return torch.topk(z, top_k, dim=-1).values[:, -1:]
    cand = torch.topk(z, top_k, dim=-1).values if use_k else torch.sort(z, dim=-1, descending=True).values
    probs = torch.softmax(cand, dim=-1)  # renormalized over the top-k candidates
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = (mass_before < top_p).sum(-1, keepdim=True).clamp_(min=1)  # >= 1: the top token is always kept
    return cand.gather(-1, keep - 1)


def _use_kernels(z: torch.Tensor) -> bool:
    """Whether the truncation functions run :mod:`rlexact.ops.triton_truncation` on ``z``: CUDA with Triton, unless
    ``RLEXACT_TRUNCATION=torch``."""
    if not z.is_cuda or os.environ.get("RLEXACT_TRUNCATION", "") == "torch":
        return False
    from rlexact.ops.backend import triton_available

    return triton_available()


def top_k_top_p_threshold(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """Per-row logit threshold ``[B, 1]`` of ``z [B, V]`` fp32: tokens with ``z < threshold`` are excluded; ``None``
    when ``(top_k, top_p)`` does not truncate. Row-invariant (fixed-shape blocks); no host synchronization."""
    if not truncates(z.shape[-1], top_k, top_p):
        return None
    if _use_kernels(z):
        from rlexact.ops.triton_truncation import truncation_thresholds

        return truncation_thresholds(z.float().contiguous(), top_k, top_p)
    zp, rows = _blocks(z)
    out = torch.cat([_threshold_block(zp[s : s + TRUNC_ROWS], top_k, top_p) for s in range(0, zp.shape[0], TRUNC_ROWS)])
    return out[:rows]


def kept_logsumexp(z: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``lse_K [B]`` fp32: logsumexp of ``z [B, V]`` over the kept tokens ``z >= threshold [B, 1]``. Row-invariant."""
    if _use_kernels(z):
        from rlexact.ops.triton_truncation import kept_logsumexp as kernel

        return kernel(z.float().contiguous(), threshold)
    zp, rows = _blocks(z)
    tp, _ = _blocks(threshold)
    out = []
    for s in range(0, zp.shape[0], TRUNC_ROWS):
        zb = zp[s : s + TRUNC_ROWS]
        zm = zb.masked_fill(zb < tp[s : s + TRUNC_ROWS], float("-inf"))
        mx = zm.amax(-1, keepdim=True)
        out.append((mx + torch.log(torch.exp(zm - mx).sum(-1, keepdim=True))).squeeze(-1))
    return torch.cat(out)[:rows]


class _TruncatedLogprobsFn(torch.autograd.Function):
    """``(logp [T], entropy [T])`` under the truncated distribution; gradients to ``hidden`` and ``w``.

    Forward: the generator's logits function on row chunks, then :func:`top_k_top_p_threshold` and
    :func:`kept_logsumexp` (bitwise the generator's numbers). Backward: fp32 logits recomputed per row chunk, the kept
    set taken as fixed (``z >= threshold`` with the forward's thresholds; it is piecewise constant in the weights).
    """

    @staticmethod
    def forward(ctx, hidden, w, targets, temperature: float, top_k: int, top_p: float, logits_fn: LogitsFn):  # noqa: ANN001, ANN205
        rows = hidden.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(logp)
        thr = torch.empty((rows, 1), dtype=torch.float32, device=hidden.device)
        for s in range(0, rows, TRAIN_CHUNK_ROWS):
            z, _ = logits_fn(hidden[s : s + TRAIN_CHUNK_ROWS])
            t = top_k_top_p_threshold(z, top_k, top_p)
            lse = kept_logsumexp(z, t)
            logp[s : s + TRAIN_CHUNK_ROWS] = z.gather(-1, targets[s : s + TRAIN_CHUNK_ROWS, None]).squeeze(-1) - lse
            q = torch.exp(z.masked_fill(z < t, float("-inf")) - lse[:, None])
            ent[s : s + TRAIN_CHUNK_ROWS] = lse - (q * z).sum(-1)
            thr[s : s + TRAIN_CHUNK_ROWS] = t
        ctx.save_for_backward(hidden, w, targets, thr)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):  # noqa: ANN205
        hidden, w, targets, thr = ctx.saved_tensors
        gh, gw = head_backward_torch(
            hidden,
            w,
            targets,
            ctx.temperature,
            g_logp,
            g_ent,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            thresholds=thr,
            chunk_rows=TRAIN_CHUNK_ROWS,
        )
        return (
            gh.to(hidden.dtype) if gh is not None else None,
            gw.to(w.dtype) if gw is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def truncated_logprobs(
    hidden: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    logits_fn: LogitsFn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer-side log-probs under the truncated distribution that the sampler draws from.

    ``hidden [T, H]``, ``w [V, H]`` (the lm-head weight), ``targets [T]`` int64 -> ``(logp [T], entropy [T])`` fp32:
    ``logp = z[t] - lse_K`` and the entropy of the renormalized kept distribution, where ``z`` comes from
    ``logits_fn`` (the generator's logits function, row-invariant) on chunks of :data:`TRAIN_CHUNK_ROWS` rows. For a
    sampled token this equals the generator's reported log-prob bitwise (same ``z`` row, same threshold, same
    ``lse_K``). A target outside the kept set (e.g. a prompt token) gets the finite ``z[t] - lse_K``, not ``-inf``.
    Differentiable in ``hidden`` and ``w``.
    """
    return _TruncatedLogprobsFn.apply(
        hidden, w, targets.long().contiguous(), float(temperature), int(top_k), float(top_p), logits_fn
    )
