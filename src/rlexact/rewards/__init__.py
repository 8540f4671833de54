"""Reward functions: the :class:`RewardFn` interface, built-in rewards, a name resolver and output validation.

Built-in names for :func:`resolve_reward`:

- ``"math"`` → :class:`MathReward` (last ``\\boxed{}`` or last number, checked with ``math_verify``; 0/1)
- ``"exact_match"`` → :class:`ExactMatchReward` (stripped string equality up to the first newline/eos; 0/1)
- ``"arithmetic"`` → :class:`ArithmeticReward` (integer equality; ``partial_credit=True`` for graded credit)

:class:`RewardExecutor` runs any of them (or a user reward) in worker processes with a time limit per sample; see
:mod:`rlexact.rewards.executor`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlexact.rewards.base import (
    DEFAULT_STOP_TEXTS,
    PerSampleReward,
    RewardFn,
    check_batch_lengths,
    check_reward_signature,
    check_rewards,
    reward_name,
    truncate_at_stop,
)
from rlexact.rewards.executor import (
    RewardConfig,
    RewardError,
    RewardExecutor,
    RewardResult,
    close_shared_executors,
    default_workers,
    inside_reward_executor,
    shared_executor,
)
from rlexact.rewards.math import MathReward, explosion_reason, extract_final_answer
from rlexact.rewards.synthetic import ArithmeticReward, ExactMatchReward

__all__ = [
    "DEFAULT_STOP_TEXTS",
    "REWARDS",
    "ArithmeticReward",
    "ExactMatchReward",
    "MathReward",
    "PerSampleReward",
    "RewardConfig",
    "RewardError",
    "RewardExecutor",
    "RewardFn",
    "RewardResult",
    "check_batch_lengths",
    "check_reward_signature",
    "check_rewards",
    "close_shared_executors",
    "default_workers",
    "explosion_reason",
    "extract_final_answer",
    "inside_reward_executor",
    "resolve_reward",
    "reward_name",
    "shared_executor",
    "truncate_at_stop",
]

REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math": MathReward,
    "exact_match": ExactMatchReward,
    "arithmetic": ArithmeticReward,
}
"""Built-in reward names → constructors."""


def resolve_reward(name_or_obj: str | RewardFn, **kwargs: Any) -> RewardFn:
    """Turn a reward name, import path or callable into a reward function that takes ``(prompts, completions,
    answers)``.

    Args:
        name_or_obj: a built-in name (``"math"``, ``"exact_match"``, ``"arithmetic"``; ``-`` and ``_`` are
            interchangeable, case-insensitive), an import path ``"pkg.module:Name"`` or ``"pkg.module.Name"``
            (a class is instantiated with ``kwargs``; any other callable is returned as is), or a callable.
        **kwargs: constructor arguments for a named reward (e.g. ``partial_credit=True``).

    Raises:
        ValueError: unknown name. TypeError: not a string or callable, kwargs given with a callable object, or a
            callable that does not take the three arguments.
    """
    reward = _resolved(name_or_obj, **kwargs)
    check_reward_signature(reward)
    return reward


def _resolved(name_or_obj: str | RewardFn, **kwargs: Any) -> RewardFn:
    if isinstance(name_or_obj, str):
        key = name_or_obj.strip().lower().replace("-", "_")
        if key in REWARDS:
            return REWARDS[key](**kwargs)
        if ":" in name_or_obj or "." in name_or_obj:
            obj = _import(name_or_obj.strip())
            if isinstance(obj, type):
                return obj(**kwargs)
            if kwargs:
                raise TypeError(f"reward {name_or_obj!r} is not a class; cannot pass arguments {sorted(kwargs)}")
            if not callable(obj):
                raise TypeError(f"reward {name_or_obj!r} is not callable")
            return obj
        raise ValueError(f"unknown reward {name_or_obj!r}; built-in rewards: {sorted(REWARDS)} (or 'module:Name')")
    if isinstance(name_or_obj, type):
        return name_or_obj(**kwargs)
    if callable(name_or_obj):
        if kwargs:
            raise TypeError(f"cannot pass arguments {sorted(kwargs)} to an already constructed reward")
        return name_or_obj
    raise TypeError(f"reward must be a name or a callable, got {type(name_or_obj).__name__}")


def _import(path: str) -> Any:
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    try:
        mod = importlib.import_module(module)
        obj = mod
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import reward {path!r}: {e}") from e
    return obj
