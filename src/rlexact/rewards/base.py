"""The reward interface, a per-sample base class, and validation of reward outputs.

A reward function scores a batch of (prompt, completion, answer) triples::

    rewards = reward_fn(prompts, completions, answers)   # list[float], len == len(prompts)

``prompts`` are the prompt texts as stored in the dataset (before any chat template), ``completions`` the decoded
generated texts (they may or may not contain the eos text, e.g. ``"<|im_end|>"``, depending on how they were decoded),
``answers`` the ground truths (``None`` where a row has none). The module validates the output with
:func:`check_rewards` before computing advantages.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "DEFAULT_STOP_TEXTS",
    "PerSampleReward",
    "RewardFn",
    "check_batch_lengths",
    "check_reward_signature",
    "check_rewards",
    "reward_name",
    "truncate_at_stop",
]

DEFAULT_STOP_TEXTS: tuple[str, ...] = ("\n", "<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")
"""Texts that end a short answer: a newline or a common eos token text."""


@runtime_checkable
class RewardFn(Protocol):
    """Batch reward: one finite float per sample."""

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]: ...


def check_batch_lengths(name: str, prompts: Sequence, completions: Sequence, answers: Sequence) -> None:
    """Raise ValueError (naming ``name`` and the three lengths) unless the batch's lists have one length."""
    if not (len(prompts) == len(completions) == len(answers)):
        raise ValueError(
            f"{name}: got {len(prompts)} prompts, {len(completions)} completions and {len(answers)} answers; they "
            "must have the same length"
        )


class PerSampleReward:
    """Base class for rewards defined per sample: override :meth:`score`; ``__call__`` maps it over the batch."""

    def score(self, prompt: str, completion: str, answer: str | None) -> float:
        raise NotImplementedError

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
        check_batch_lengths(type(self).__name__, prompts, completions, answers)
        return [float(self.score(p, c, a)) for p, c, a in zip(prompts, completions, answers)]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def truncate_at_stop(text: str, stop_texts: Sequence[str] = DEFAULT_STOP_TEXTS) -> str:
    """``text`` up to (excluding) the earliest occurrence of any of ``stop_texts``."""
    end = len(text)
    for stop in stop_texts:
        if stop:
            pos = text.find(stop)
            if 0 <= pos < end:
                end = pos
    return text[:end]


def check_reward_signature(reward: object) -> None:
    """Raise ``TypeError`` where ``reward`` cannot be called as ``reward(prompts, completions, answers)`` (a callable
    without a readable signature passes: its first call shows)."""
    try:
        signature = inspect.signature(reward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind([], [], [])
    except TypeError as e:
        raise TypeError(
            f"reward {reward_name(reward)} must take (prompts, completions, answers), three lists; its signature "
            f"{signature} does not ({e})"
        ) from None


def reward_name(reward: Any) -> str:
    """The name errors give ``reward``: its qualified name (a function or class), else its class's."""
    return getattr(reward, "__qualname__", None) or type(reward).__qualname__


def check_rewards(rewards: Sequence[float] | torch.Tensor, num_samples: int) -> torch.Tensor:
    """Validate a reward function's output and return it as a float32 CPU tensor ``[num_samples]``.

    Raises:
        ValueError: if the count differs from ``num_samples`` ("got X rewards for Y samples"), a value is not a real
            number, or any value is NaN/inf (the message names the first bad sample index).
    """
    if isinstance(rewards, torch.Tensor):
        if rewards.dim() != 1:
            raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
        values = rewards.detach().to("cpu", torch.float64).tolist()
    else:
        try:
            values = list(rewards)
        except TypeError as e:
            raise ValueError(f"rewards must be a sequence of floats, got {type(rewards).__name__}") from e
    if len(values) != num_samples:
        raise ValueError(f"got {len(values)} rewards for {num_samples} samples")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"reward for sample {i} is a tensor of shape {tuple(v.shape)}, expected a scalar")
            v = v.item()
        if isinstance(v, (str, bytes)):
            raise ValueError(f"reward for sample {i} is the string {v!r}, expected a number")
        try:
            f = float(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"reward for sample {i} is not a number: {v!r}") from e
        if not math.isfinite(f):
            raise ValueError(f"reward for sample {i} is not finite: {f}")
        out.append(f)
    t = torch.tensor(out, dtype=torch.float32)
    bad = (~torch.isfinite(t)).nonzero()
    if bad.numel():  # finite in float64 but overflows float32
        i = int(bad[0])
        raise ValueError(f"reward for sample {i} is not finite in float32: {out[i]}")
    return t
