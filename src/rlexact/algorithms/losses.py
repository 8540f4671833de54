"""Per-token policy losses (pure torch, no Lightning).

Every loss returns the *unreduced* per-token loss ``[T]`` (float32) over the whole packed stream; reduce it with
:func:`rlexact.algorithms.aggregation.aggregate_loss`, which applies ``loss_mask`` and the token weights. Inputs are
1-D ``[T]`` tensors aligned token by token: ``logp`` (current policy, carries grad), ``old_logp`` (the behaviour /
proximal policy, treated as a constant) and ``advantages``. Log-ratios are formed in float32 and clamped to
``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` (verl's safety bound), which only matters for ratios beyond
``e**20`` and keeps ``0 * inf`` NaNs out of tokens with zero advantage. Diagnostics in the ``info`` dicts are
detached per-token tensors; reduce them with ``loss_mask`` for logging.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rlexact.algorithms.aggregation import require_aligned, require_bool_mask, segment_ids, segment_sum

__all__ = ["LOG_RATIO_CLAMP", "gspo_loss", "kl_penalty", "ppo_clip_loss", "reinforce_loss"]

LOG_RATIO_CLAMP = 20.0
"""Bound on ``|log r|`` before exponentiation (``e**20 ~ 4.9e8``), as verl's ``SAFETY_BOUND``."""


def _check_aligned(**tensors: Tensor) -> int:
    length = require_aligned(**tensors)
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {tensor.dtype}")
    return length


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))`` and which branch was active."""
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_loss > unclipped
    loss = torch.where(clipped, clipped_loss, unclipped)
    r = ratio.detach()
    info = {
        "ratio": r,
        "clipped": clipped,
        "clipped_low": clipped & (r < 1.0 - clip_low),
        "clipped_high": clipped & (r > 1.0 + clip_high),
    }
    return loss, info


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO / GRPO / DAPO clipped surrogate per token.

    ``r = exp(logp - old_logp)`` (float32), ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; DAPO's
    clip-higher is ``clip_high > clip_low``. With ``dual_clip = c > 1``, tokens with ``A < 0`` additionally get
    ``loss = min(loss, -A c)`` (dual-clip PPO, verl's ``clip_ratio_c``).

    Returns:
        ``(loss [T] float32, info)`` with detached per-token ``info``: ``ratio`` (float32), and bool ``clipped``
        (the clipped branch was strictly larger, so the token has no gradient from the surrogate),
        ``clipped_low`` (clipped with ``r < 1 - clip_low``, i.e. ``A < 0``), ``clipped_high`` (clipped with
        ``r > 1 + clip_high``, ``A > 0``) and ``dual_clipped`` (the dual-clip bound ``-A c`` was taken).
    """
    _check_aligned(logp=logp, old_logp=old_logp, advantages=advantages)
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    adv = advantages.float()
    log_ratio = (logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss, info = _clipped_surrogate(log_ratio.exp(), adv, clip_low, clip_high)
    if dual_clip is None:
        info["dual_clipped"] = torch.zeros_like(info["clipped"])
    else:
        bound = -adv * dual_clip
        dual_clipped = (adv < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
        info["dual_clipped"] = dual_clipped
    return loss, info


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al., 2025) sequence-ratio clipped surrogate, written per token.

    The sequence ratio is ``s_i = exp(mean_{t in i, mask_t} (logp_t - old_logp_t))`` (length-normalized; mean over
    the sequence's masked tokens, a sequence without masked tokens gets ``s_i = 1``). Each token uses
    ``s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])``, whose value is ``s_i`` and whose gradient is
    ``s_i * grad logp_t``; the loss is ``max(-A_t s_i,t, -A_t clip(s_i,t, 1 - clip_low, 1 + clip_high))``, so a
    sequence is clipped as a whole. The GSPO paper uses ``clip_low = 3e-4``, ``clip_high = 4e-4``; aggregate with
    ``seq-mean-token-mean`` as in the paper.

    Args:
        logp, old_logp, advantages: floating ``[T]``.
        cu_seqlens: int ``[B + 1]`` sequence boundaries.
        mask: bool ``[T]``, the tokens that enter the sequence ratio (the loss mask).

    Returns:
        ``(loss [T] float32, info)``; ``info`` has detached ``ratio`` (``s_i`` broadcast to its tokens, float32) and
        bool ``clipped`` / ``clipped_low`` / ``clipped_high`` as in :func:`ppo_clip_loss`.
    """
    num_tokens = _check_aligned(logp=logp, old_logp=old_logp, advantages=advantages)
    require_bool_mask("mask", mask, num_tokens)
    _check_clip(clip_low, clip_high)
    seg = segment_ids(cu_seqlens, num_tokens)
    num_seqs = cu_seqlens.numel() - 1
    lp = logp.float()
    log_ratio = torch.where(mask, lp - old_logp.float(), 0.0).detach()
    count = segment_sum(mask.float(), seg, num_seqs).clamp(min=1)
    seq_log_ratio = segment_sum(log_ratio, seg, num_seqs) / count
    token_log_ratio = seq_log_ratio[seg] + lp - lp.detach()
    ratio = token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return _clipped_surrogate(ratio, advantages.float(), clip_low, clip_high)


def reinforce_loss(logp: Tensor, advantages: Tensor) -> Tensor:
    """REINFORCE per-token loss ``-A_t * logp_t`` ``[T]`` (float32); one update per rollout batch."""
    _check_aligned(logp=logp, advantages=advantages)
    return -advantages.float() * logp.float()


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: Literal["k1", "k3"] = "k1") -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate ``[T]`` (float32) on tokens sampled from pi_theta.

    ``k1 = logp - ref_logp`` (unbiased, can be negative); ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's
    low-variance, non-negative estimator; verl's ``low_var_kl`` without its clamp). Gradients flow into ``logp``.
    """
    _check_aligned(logp=logp, ref_logp=ref_logp)
    diff = ref_logp.float() - logp.float()
    if kind == "k1":
        return -diff
    if kind == "k3":
        return torch.expm1(diff) - diff
    raise ValueError(f"kind must be 'k1' or 'k3', got {kind!r}")
