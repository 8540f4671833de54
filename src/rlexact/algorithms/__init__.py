"""Advantage estimators, policy losses and loss aggregation: pure torch functions over packed token streams."""

from rlexact.algorithms.advantages import (
    broadcast_to_tokens,
    dynamic_sampling_keep,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)
from rlexact.algorithms.aggregation import LossAggMode, aggregate_loss, segment_ids, segment_sum
from rlexact.algorithms.losses import LOG_RATIO_CLAMP, gspo_loss, kl_penalty, ppo_clip_loss, reinforce_loss

__all__ = [
    "LOG_RATIO_CLAMP",
    "LossAggMode",
    "aggregate_loss",
    "broadcast_to_tokens",
    "dynamic_sampling_keep",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "ppo_clip_loss",
    "reinforce_advantages",
    "reinforce_loss",
    "rloo_advantages",
    "segment_ids",
    "segment_sum",
]
