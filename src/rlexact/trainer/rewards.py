"""Reward stage: decode the completions, score them with the reward function, and the step's reward metrics."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlexact.reduction import MetricReducer
from rlexact.rewards import check_rewards
from rlexact.rollout import Completion

__all__ = ["reward_metrics", "score_completions"]


def score_completions(
    reward_fn: Callable,
    tokenizer: Any,
    items: Sequence[dict],
    completions: list[Completion],
    n: int,
    *,
    skip_special_tokens: bool,
) -> torch.Tensor:
    """Decode ``completions`` (``n`` per item, prompt-major) and score them with
    ``reward_fn(prompt_texts, completion_texts, answers)``: float32 ``[len(completions)]``, validated by
    :func:`rlexact.rewards.check_rewards`."""
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=skip_special_tokens) for c in completions]
    prompts = [str(items[k // n].get("prompt_text", "")) for k in range(len(completions))]
    answers = [items[k // n].get("answer") for k in range(len(completions))]
    rewards = reward_fn(prompts, texts, answers)
    return check_rewards(rewards, len(completions))


def reward_metrics(rewards: torch.Tensor, lengths: list[int], completions: list[Completion]) -> dict[str, float]:
    """Reward mean/std and response-length mean/max/clip fraction of one rollout step over every rank (each rank's
    statistics weighted by its number of samples)."""
    r = rewards.double()
    n = r.numel()
    red = MetricReducer()
    red.add_mean("reward/mean", float(r.mean()) if n else 0.0, n)
    red.add_mean("reward_sq", float((r * r).mean()) if n else 0.0, n)
    red.add_mean("response_length/mean", sum(lengths) / n if n else 0.0, n)
    red.add_mean(
        "response_length/clip_frac", sum(c.finish_reason == "length" for c in completions) / n if n else 0.0, n
    )
    red.add_max("response_length/max", float(max(lengths)) if lengths else None)
    out = red.reduce(rewards.device)
    mean_sq = out.pop("reward_sq")
    out["reward/std"] = math.sqrt(max(mean_sq - out["reward/mean"] ** 2, 0.0))
    return out
