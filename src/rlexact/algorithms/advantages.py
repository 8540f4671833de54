"""Outcome-reward advantage estimators (pure torch, no Lightning).

Shared contracts:

- ``rewards``: floating ``[N]``, one scalar reward per completed sample; every value must be finite (a NaN or
  +-inf raises ``ValueError`` naming the first bad sample index).
- ``group_ids``: integer ``[N]``; samples with equal id are completions of the same prompt. Ids need not be sorted
  or contiguous.
- Outputs are detached ``[N]`` tensors of ``rewards``' dtype and device. Statistics are accumulated in float64 and
  cast back. A group (for REINFORCE: the batch) whose rewards are all equal gets advantages of exactly 0.

Formulas (paper notation, docs/design.md §6):

- GRPO: ``A_i = (R_i - mean_g) / (std_g + eps)`` with the *unbiased* (sample, ``n - 1``) standard deviation, as
  verl's ``compute_grpo_outcome_advantage`` (``torch.std`` default). ``normalize_std=False`` is Dr. GRPO:
  ``A_i = R_i - mean_g``.
- RLOO: ``A_i = n / (n - 1) * (R_i - mean_g)``, which equals ``R_i`` minus the mean of the other ``n - 1`` rewards.
- REINFORCE (batch whitening): ``A_i = (R_i - mean) / (std + eps)`` over the whole batch (all data-parallel ranks
  when given an ``all_reduce``), unbiased std.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from rlexact.algorithms.aggregation import require_1d, require_finite, segment_ids, segment_sum

__all__ = [
    "broadcast_to_tokens",
    "dynamic_sampling_keep",
    "grpo_advantages",
    "reinforce_advantages",
    "rloo_advantages",
]


class _Groups(NamedTuple):
    index: Tensor
    """int64 ``[N]``: dense group index in ``[0, G)`` of every sample."""
    ids: Tensor
    """``[G]`` the distinct group ids (sorted)."""
    counts: Tensor
    """int64 ``[G]`` samples per group."""
    mean: Tensor
    """float64 ``[G]`` mean reward per group."""
    constant: Tensor
    """bool ``[G]``: every reward of the group is equal."""


def _rewards64(rewards: Tensor) -> Tensor:
    require_1d("rewards", rewards)
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be floating point, got {rewards.dtype}")
    require_finite("rewards", rewards)
    return rewards.detach().to(torch.float64)


def _groups(rewards64: Tensor, group_ids: Tensor) -> _Groups:
    require_1d("group_ids", group_ids, rewards64.shape[0])
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if group_ids.device != rewards64.device:
        raise ValueError(f"group_ids is on {group_ids.device} but rewards on {rewards64.device}")
    ids, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = ids.numel()
    mean = segment_sum(rewards64, index, num_groups) / counts
    high = torch.full_like(mean, -torch.inf).scatter_reduce(0, index, rewards64, reduce="amax")
    low = torch.full_like(mean, torch.inf).scatter_reduce(0, index, rewards64, reduce="amin")
    return _Groups(index=index, ids=ids, counts=counts, mean=mean, constant=high == low)


def _require_pairs(groups: _Groups, estimator: str) -> None:
    small = groups.counts < 2
    if bool(small.any()):
        first = int(small.nonzero()[0, 0])
        raise ValueError(
            f"{estimator} needs n >= 2 samples per prompt; group id {int(groups.ids[first])} has "
            f"{int(groups.counts[first])} sample"
        )


def _centered(rewards64: Tensor, groups: _Groups) -> Tensor:
    """``R - mean_g``, exactly 0 in constant groups (plain subtraction can leave rounding residue there)."""
    centered = rewards64 - groups.mean[groups.index]
    return torch.where(groups.constant[groups.index], 0.0, centered)


def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantages ``[N]`` (Dr. GRPO when ``normalize_std=False``).

    ``std_g`` is the unbiased sample standard deviation (verl's choice). Every group needs ``n >= 2`` samples,
    otherwise ``ValueError`` ("GRPO needs n >= 2 samples per prompt ...").
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _rewards64(rewards)
    groups = _groups(r, group_ids)
    _require_pairs(groups, "GRPO")
    centered = _centered(r, groups)
    if normalize_std:
        sq = segment_sum(centered**2, groups.index, groups.ids.numel())
        std = (sq / (groups.counts - 1)).sqrt()
        scaled = centered / (std[groups.index] + eps)
        centered = torch.where(groups.constant[groups.index], 0.0, scaled)
    return centered.to(rewards.dtype)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantages ``[N]``: ``n / (n - 1) * (R - mean_g)`` = ``R`` minus the mean of the group's others.

    Every group needs ``n >= 2`` samples, otherwise ``ValueError``.
    """
    r = _rewards64(rewards)
    groups = _groups(r, group_ids)
    _require_pairs(groups, "RLOO")
    n = groups.counts[groups.index].to(torch.float64)
    return (n / (n - 1) * _centered(r, groups)).to(rewards.dtype)


def reinforce_advantages(
    rewards: Tensor, *, eps: float = 1e-6, all_reduce: Callable[[Tensor, str], Tensor] | None = None
) -> Tensor:
    """Batch-whitened REINFORCE advantages ``[N]``: ``(R - mean) / (std + eps)``, unbiased std, ``N >= 2``.

    ``all_reduce(t, op)`` (``op`` in sum / max / min) reduces a float64 tensor over the data-parallel ranks, so the
    mean and std are those of the global batch; the default (None) is the identity, the batch is ``rewards`` alone.
    Two passes: the mean from the reduced sum and count, then the reduced sum of squared deviations from it. A global
    batch whose rewards are all equal gets exactly 0.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _rewards64(rewards)
    reduce = all_reduce if all_reduce is not None else (lambda t, op: t)
    total, count = reduce(torch.stack([r.sum(), r.new_tensor(float(r.numel()))]), "sum").tolist()
    if count < 2:
        raise ValueError(f"REINFORCE whitening needs a batch of N >= 2 rewards, got {int(count)}")
    extrema = torch.stack([r.max(), -r.min()]) if r.numel() else r.new_full((2,), -torch.inf)
    high, neg_low = reduce(extrema, "max").tolist()
    if high == -neg_low:
        return torch.zeros_like(rewards)
    mean = total / count
    sq_dev = float(reduce(((r - mean) ** 2).sum(), "sum"))
    std = math.sqrt(sq_dev / (count - 1))
    return ((r - mean) / (std + eps)).to(rewards.dtype)


def dynamic_sampling_keep(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO dynamic sampling: bool ``[N]``, False for every sample of a group whose rewards are all equal.

    Such groups carry zero group-relative advantage. A group with a single sample counts as all-equal.
    """
    r = _rewards64(rewards)
    groups = _groups(r, group_ids)
    return ~groups.constant[groups.index]


def broadcast_to_tokens(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Repeat per-sequence ``values [B]`` over the packed stream: ``out[t] = values[i]`` for tokens of sequence ``i``.

    Returns ``[T]`` with ``T = cu_seqlens[-1]``, same dtype and device as ``values`` (differentiable).
    """
    require_1d("values", values)
    require_1d("cu_seqlens", cu_seqlens, values.shape[0] + 1)
    return values[segment_ids(cu_seqlens)]
