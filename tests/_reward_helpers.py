"""Rewards for tests/test_rewards_executor.py, defined at module level so worker processes can import them."""

from __future__ import annotations

import os
import time

from rlexact.rewards import PerSampleReward, inside_reward_executor

HANG = "hang forever"
RAISE = "please raise"
DIE = "please die"


class SleepyReward(PerSampleReward):
    """Length of the completion mod 5, but sleeps (practically) forever on a completion containing ``HANG``."""

    def score(self, prompt: str, completion: str, answer: str | None) -> float:
        if HANG in completion:
            time.sleep(10**6)
        return float(len(completion) % 5)


class FailingReward(PerSampleReward):
    """1.0, but raises ValueError on a completion containing ``RAISE`` and kills its process on ``DIE``."""

    def score(self, prompt: str, completion: str, answer: str | None) -> float:
        if RAISE in completion:
            raise ValueError(f"cannot score {completion!r}")
        if DIE in completion:
            os._exit(3)
        return 1.0


def count_reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
    """A plain batch function (element-wise): the number of '1' characters in each completion."""
    return [float(c.count("1")) for c in completions]


def scalar_reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> float:
    """Wrong: one float for the whole batch instead of one per sample."""
    return 1.0


def text_reward(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[str]:
    """Wrong: the scores as strings."""
    return ["1" for _ in completions]


def two_argument_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """Wrong: no ``answers`` parameter."""
    return [1.0 for _ in completions]


class UnloadableReward(PerSampleReward):
    """Pickles in the main process but refuses to load in a reward worker (like a notebook's ``__main__`` function)."""

    def __init__(self) -> None:
        self.scale = 1.0  # a non-empty state, so unpickling calls __setstate__

    def __setstate__(self, state: dict) -> None:
        if inside_reward_executor():
            raise RuntimeError("this reward cannot be loaded in a worker")
        self.__dict__.update(state)

    def score(self, prompt: str, completion: str, answer: str | None) -> float:
        return self.scale * len(completion)
