"""Dispatch of the RL-callback hooks (:class:`rlexact.callbacks.base.RLCallback`) from inside ``training_step``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from rlexact.callbacks.base import RLCallback
from rlexact.distributed import gathered_params, is_fsdp

__all__ = ["call_rl_hook", "overrides"]


def overrides(cb: RLCallback, hook: str) -> bool:
    """True when ``cb``'s class implements ``hook`` (the base class's is a no-op)."""
    return getattr(type(cb), hook, None) is not getattr(RLCallback, hook)


@contextlib.contextmanager
def _gathered_if(model: nn.Module, callbacks: list[RLCallback], hook: str) -> Iterator[None]:
    # a callback that runs no forward sets ``gathers_params = False`` (e.g. SampleLogger): no gather for it
    if is_fsdp(model) and any(overrides(cb, hook) and getattr(cb, "gathers_params", True) for cb in callbacks):
        with gathered_params(model):
            yield
    else:
        yield


def call_rl_hook(
    hook: str, callbacks: list[RLCallback], trainer: Any, module: Any, model: nn.Module, *args: Any
) -> None:
    """Call ``hook(trainer, module, *args)`` on every callback in list order. Under FSDP2 the parameters of ``model``
    are gathered around the calls when any callback implements the hook (such callbacks may run no-grad forwards,
    which would otherwise issue per-layer collectives on some ranks only)."""
    with _gathered_if(model, callbacks, hook):
        for cb in callbacks:
            getattr(cb, hook)(trainer, module, *args)
