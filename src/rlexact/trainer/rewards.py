"""Reward stage: decode the completions, score them with the reward function, and the step's reward metrics."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlexact.rewards import check_rewards
from rlexact.rollout import Completion

__all__ = ["Reduce", "reward_metrics", "score_completions"]

Reduce = Callable[[list[float], str], list[float]]
"""A cross-rank reduction of a few Python scalars: ``reduce(values, op)`` with ``op`` in sum / max / min."""


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


def reward_metrics(
    rewards: torch.Tensor, lengths: list[int], completions: list[Completion], reduce: Reduce
) -> dict[str, float]:
    """Global reward mean/std and response-length mean/max/clip fraction of one rollout step."""
    r = rewards.double()
    truncated = float(sum(c.finish_reason == "length" for c in completions))
    s, sq, cnt, lsum, truncated = reduce(
        [r.sum().item(), (r * r).sum().item(), float(r.numel()), float(sum(lengths)), truncated], "sum"
    )
    lmax = reduce([float(max(lengths))], "max")[0]
    mean = s / cnt
    var = max(sq / cnt - mean * mean, 0.0)
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(var),
        "response_length/mean": lsum / cnt,
        "response_length/max": lmax,
        "response_length/clip_frac": truncated / cnt,
    }
