"""Advantage stage: per-sequence advantages by the configured estimator (REINFORCE whitening over the global batch)
and dynamic sampling's keep mask."""

from __future__ import annotations

import math

import torch

from rlexact import algorithms as alg
from rlexact.config import AlgorithmConfig
from rlexact.trainer.rewards import Reduce

__all__ = ["dynamic_sampling", "sequence_advantages"]


def sequence_advantages(
    algo: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor, reduce: Reduce, distributed: bool
) -> torch.Tensor:
    """Per-sequence advantages ``[N]``: GRPO / RLOO within each prompt's group (groups never span ranks), REINFORCE
    whitened with the statistics of the global batch."""
    est, eps = algo.estimator, algo.adv_eps
    if est == "grpo":
        return alg.grpo_advantages(rewards, group_ids, normalize_std=algo.normalize_std, eps=eps)
    if est == "rloo":
        return alg.rloo_advantages(rewards, group_ids)
    if not distributed:
        return alg.reinforce_advantages(rewards, eps=eps)
    r = rewards.double()
    s, sq, cnt = reduce([r.sum().item(), (r * r).sum().item(), float(r.numel())], "sum")
    hi = reduce([r.max().item()], "max")[0]
    lo = reduce([r.min().item()], "min")[0]
    if cnt < 2:
        raise ValueError(f"REINFORCE whitening needs a batch of N >= 2 rewards, got {int(cnt)}")
    if hi == lo:
        return torch.zeros_like(rewards)
    mean = s / cnt
    std = math.sqrt(max(sq - cnt * mean * mean, 0.0) / (cnt - 1))
    return ((r - mean) / (std + eps)).to(rewards.dtype)


def dynamic_sampling(rewards: torch.Tensor, group_ids: torch.Tensor, reduce: Reduce) -> tuple[torch.Tensor, int, float]:
    """Dynamic sampling: the keep mask ``[N]`` (groups whose rewards are not all equal), the number of sequences kept
    over all ranks, and the kept fraction over all ranks."""
    keep = alg.dynamic_sampling_keep(rewards, group_ids)
    kept, total = reduce([float(keep.sum()), float(keep.numel())], "sum")
    return keep, int(kept), kept / max(total, 1.0)
