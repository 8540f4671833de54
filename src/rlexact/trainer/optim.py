"""Optimizer stage: the optimizer and LR scheduler of :class:`rlexact.RLModule`.

Without a choice, AdamW with the :class:`rlexact.config.OptimConfig` settings and, when ``warmup_steps > 0``, a
linear warmup. A choice is a callable ``params -> Optimizer`` / ``optimizer -> scheduler`` (Lightning's
``OptimizerCallable`` / ``LRSchedulerCallable``); LightningCLI builds them from its top-level ``optimizer:`` /
``lr_scheduler:`` sections (``class_path`` + ``init_args``), which :class:`rlexact.cli.RLExactCLI` links into the
module's ``optimizer`` / ``lr_scheduler`` arguments. The optimizer is built in ``configure_optimizers``, after
``configure_model`` has created (and sharded) the parameters.

The update steps the scheduler once per optimizer step (manual optimization: Lightning's ``interval`` /
``frequency`` do not apply), so schedules are in optimizer steps.

A choice replaces settings of :class:`~rlexact.config.OptimConfig`: an ``optimizer`` all of them but ``grad_clip``
(which applies either way), an ``lr_scheduler`` the warmup. :func:`check_ignored_settings` refuses such a setting
when it differs from its default instead of ignoring it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from rlexact.config import OptimConfig

__all__ = ["build_optimizer", "check_ignored_settings", "check_spec"]

_OPTIMIZER_SETTINGS = tuple(f.name for f in fields(OptimConfig) if f.name != "grad_clip")
"""The :class:`~rlexact.config.OptimConfig` fields that an ``optimizer`` callable replaces (AdamW's and the warmup)."""
_SCHEDULER_SETTINGS = ("warmup_steps",)
"""The :class:`~rlexact.config.OptimConfig` fields that an ``lr_scheduler`` callable replaces."""


def check_spec(name: str, spec: Any) -> None:
    """Raise ``TypeError`` unless ``spec`` is None or callable."""
    if spec is not None and not callable(spec):
        raise TypeError(
            f"{name} must be a callable ({'params -> Optimizer' if name == 'optimizer' else 'optimizer -> scheduler'},"
            f" e.g. functools.partial(torch.optim.SGD, lr=0.1)) or None; got {spec!r}. On the command line use the "
            f"top-level '{name}:' section with class_path / init_args"
        )


def check_ignored_settings(
    cfg: OptimConfig, optimizer: OptimizerCallable | None, lr_scheduler: LRSchedulerCallable | None
) -> None:
    """Raise ``ValueError`` when a field of ``cfg`` that the ``optimizer`` / ``lr_scheduler`` choice replaces differs
    from its default (it would be ignored), naming the fields, where to set them instead and their defaults."""
    default = OptimConfig()
    replaced = _OPTIMIZER_SETTINGS if optimizer is not None else _SCHEDULER_SETTINGS if lr_scheduler is not None else ()
    changed = [k for k in replaced if getattr(cfg, k) != getattr(default, k)]
    if not changed:
        return
    ignored = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in changed)
    defaults = ", ".join(f"{k}={getattr(default, k)!r}" for k in changed)
    if optimizer is not None:
        raise ValueError(
            f"RLModule(optimizer=...) builds the optimizer, so optim's {ignored} would be ignored (with optimizer=, "
            "only optim.grad_clip applies): set the optimizer's settings on the callable (e.g. "
            "functools.partial(torch.optim.AdamW, lr=...); --optimizer.lr on the command line) and a warmup with "
            f"lr_scheduler=, and leave these optim fields at their defaults ({defaults})"
        )
    raise ValueError(
        f"RLModule(lr_scheduler=...) replaces optim's warmup, so optim's {ignored} would be ignored: make the warmup "
        "part of the scheduler (e.g. torch.optim.lr_scheduler.LinearLR(start_factor=...)), and leave "
        f"optim.warmup_steps at its default ({defaults})"
    )


def build_optimizer(
    params: list[torch.nn.Parameter],
    cfg: OptimConfig,
    optimizer: OptimizerCallable | None,
    lr_scheduler: LRSchedulerCallable | None,
) -> Any:
    """The ``configure_optimizers`` result for ``params`` (the trainable parameters)."""
    if optimizer is None:
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        opt = optimizer(params)
    if lr_scheduler is not None:
        sched = lr_scheduler(opt)
    elif optimizer is None and cfg.warmup_steps > 0:
        warm = cfg.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    else:
        return opt
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "ReduceLROnPlateau needs a monitored metric, which the RL update does not provide; use a schedule in "
            "optimizer steps (e.g. torch.optim.lr_scheduler.LinearLR, CosineAnnealingLR)"
        )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
