"""Reward stage: decode the completions, score them with the reward executor, and the step's reward metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rlexact.reduction import MetricReducer
from rlexact.rewards import RewardExecutor, RewardResult, check_rewards, reward_name
from rlexact.rollout import Completion

__all__ = ["DECODE_CHUNK", "execution_metrics", "log_reward_examples", "reward_metrics", "score_completions"]

DECODE_CHUNK = 256
"""Completions decoded per reward submission: the workers score one chunk while the next is decoded."""


def score_completions(
    executor: RewardExecutor,
    tokenizer: Any,
    items: Sequence[dict],
    completions: list[Completion],
    n: int,
    *,
    skip_special_tokens: bool,
) -> tuple[torch.Tensor, RewardResult]:
    """Decode ``completions`` (``n`` per item, prompt-major) and score them with the executor's reward
    ``(prompt_texts, completion_texts, answers)``: float32 ``[len(completions)]`` validated by
    :func:`rlexact.rewards.check_rewards`, and the :class:`~rlexact.rewards.RewardResult` (timeouts, errors).

    With worker processes the completions are decoded and submitted :data:`DECODE_CHUNK` at a time, so this process
    decodes while the workers score; the rewards are in sample order whatever the timing. In process the reward gets
    the whole batch in one call."""
    prompts = [str(items[k // n].get("prompt_text", "")) for k in range(len(completions))]
    answers = [items[k // n].get("answer") for k in range(len(completions))]

    def decode(lo: int, hi: int) -> list[str]:
        return [tokenizer.decode(c.token_ids, skip_special_tokens=skip_special_tokens) for c in completions[lo:hi]]

    if executor.in_process:
        result = executor.run(prompts, decode(0, len(completions)), answers)
    else:
        spans = [(lo, lo + DECODE_CHUNK) for lo in range(0, len(completions), DECODE_CHUNK)]
        futures = [executor.submit(prompts[lo:hi], decode(lo, hi), answers[lo:hi]) for lo, hi in spans]
        result = RewardResult.concat([f.result() for f in futures])
    try:
        return check_rewards(result.rewards, len(completions)), result
    except ValueError as e:
        raise ValueError(
            f"reward {reward_name(executor.reward)} returned unusable rewards for {len(items)} prompts x {n} samples: "
            f"{e} (a reward returns one finite number per completion, in the order given)"
        ) from e


def execution_metrics(result: RewardResult, device: torch.device | str | None = None) -> dict[str, float]:
    """``reward/timeouts`` and ``reward/errors`` summed over the ranks, ``reward/timeout_frac`` and
    ``reward/error_frac`` over all their samples."""
    n = len(result.rewards)
    local = result.metrics()
    red = MetricReducer()
    red.add_sum("reward/timeouts", local["reward/timeouts"]).add_sum("reward/errors", local["reward/errors"])
    red.add_mean("reward/timeout_frac", local["reward/timeout_frac"], n)
    red.add_mean("reward/error_frac", local["reward/error_frac"], n)
    return red.reduce(device)


def log_reward_examples(loggers: Sequence[Any], result: RewardResult, step: int) -> None:
    """Write the batch's first timed-out and first failed sample as text (``reward/timeout_example``,
    ``reward/error_example``) to each TensorBoard logger; nothing without one (or without such a sample)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    examples = {"reward/timeout_example": result.timeout_example, "reward/error_example": result.error_example}
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            for tag, text in examples.items():
                if text:
                    logger.experiment.add_text(tag, text, global_step=step)


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
