"""Advantage stage: per-sequence advantages by the configured estimator (REINFORCE whitening over the global batch)
and dynamic sampling's keep mask."""

from __future__ import annotations

import torch

from rlexact import algorithms as alg
from rlexact.config import AlgorithmConfig
from rlexact.reduction import MetricReducer, all_reduce

__all__ = ["dynamic_sampling", "sequence_advantages"]


def sequence_advantages(algo: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages ``[N]``: GRPO / RLOO within each prompt's group (groups never span ranks), REINFORCE
    whitened with the statistics of the global batch (the same code for any world size)."""
    est, eps = algo.estimator, algo.adv_eps
    if est == "grpo":
        return alg.grpo_advantages(rewards, group_ids, normalize_std=algo.normalize_std, eps=eps)
    if est == "rloo":
        return alg.rloo_advantages(rewards, group_ids)
    return alg.reinforce_advantages(rewards, eps=eps, all_reduce=all_reduce)


def dynamic_sampling(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """Dynamic sampling: the keep mask ``[N]`` (groups whose rewards are not all equal), the number of sequences kept
    over all ranks, and the kept fraction over all ranks."""
    keep = alg.dynamic_sampling_keep(rewards, group_ids)
    totals = MetricReducer().add_sum("kept", float(keep.sum())).add_sum("total", float(keep.numel())).reduce()
    return keep, int(totals["kept"]), totals["kept"] / max(totals["total"], 1.0)
