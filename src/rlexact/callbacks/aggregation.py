"""Logging helpers shared by the RL callbacks (the cross-rank reduction itself lives in :mod:`rlexact.reduction`).

Every RL callback runs on every data-parallel rank on that rank's share of the rollout batch, so its metrics are
reduced as sums and counts with :class:`rlexact.reduction.MetricReducer` (re-exported here) before they are logged.

:func:`log_scalars` and :func:`log_histograms` write the reduced values: scalars through ``pl_module.log_dict`` when
called inside ``training_step`` (where :class:`rlexact.RLModule` calls the RL hooks; ``sync_dist=False`` because
the values are already global), histograms through ``add_histogram`` of every ``TensorBoardLogger`` on global
rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlexact.reduction import MetricReducer, collective_device, dist_ready, gather_cat, global_rank, world_size

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = [
    "MetricReducer",
    "collective_device",
    "dist_ready",
    "gather_cat",
    "global_rank",
    "log_histograms",
    "log_scalars",
    "logging_step",
    "world_size",
]


def logging_step(trainer: Trainer | None) -> int:
    """The step Lightning uses for logger writes (the count of training batches that stepped), else ``global_step``."""
    if trainer is None:
        return 0
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step) if step is not None else int(trainer.global_step)


def _inside_training_step(trainer: Trainer | None, pl_module: LightningModule | None) -> bool:
    return (
        trainer is not None
        and pl_module is not None
        and getattr(pl_module, "_current_fx_name", None) == "training_step"
        and getattr(trainer, "_results", None) is not None
    )


def log_scalars(trainer: Trainer | None, pl_module: LightningModule | None, metrics: Mapping[str, float]) -> None:
    """Log already-reduced scalars.

    Inside ``training_step`` (where the RL hooks run) this is ``pl_module.log_dict(on_step=True, on_epoch=False,
    sync_dist=False)``, so the values reach ``trainer.callback_metrics`` and every logger at Lightning's cadence
    (``log_every_n_steps``). Elsewhere the values go straight to ``trainer.loggers`` at :func:`logging_step`.
    """
    if not metrics:
        return
    clean = {k: float(v) for k, v in metrics.items()}
    if _inside_training_step(trainer, pl_module):
        assert pl_module is not None
        pl_module.log_dict(clean, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)
    elif trainer is not None:
        for logger in trainer.loggers:
            logger.log_metrics(clean, step=logging_step(trainer))


def tensorboard_experiments(trainer: Trainer | None) -> list:
    """``SummaryWriter`` objects of the trainer's TensorBoard loggers (empty list without any)."""
    if trainer is None:
        return []
    from lightning.pytorch.loggers import TensorBoardLogger

    return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


def log_histograms(trainer: Trainer | None, histograms: Mapping[str, Tensor], *, step: int | None = None) -> int:
    """Gather each 1-D tensor from every rank and write it as a TensorBoard histogram on global rank 0.

    Non-finite values are dropped (TensorBoard's binning cannot place them); the number dropped per histogram goes
    to the scalar ``<name>/nonfinite`` when nonzero. Every rank must call this (the gather is a collective).
    Returns the number of histograms written on this rank.
    """
    gathered = {name: gather_cat(values.detach().float().reshape(-1)) for name, values in histograms.items()}
    if global_rank() != 0:
        return 0
    writers = tensorboard_experiments(trainer)
    if not writers:
        return 0
    at = logging_step(trainer) if step is None else step
    written = 0
    for name, values in gathered.items():
        finite = torch.isfinite(values)
        kept = values[finite].cpu()
        dropped = int((~finite).sum())
        for writer in writers:
            if kept.numel():
                writer.add_histogram(name, kept.numpy(), global_step=at)
            if dropped:
                writer.add_scalar(f"{name}/nonfinite", dropped, global_step=at)
        written += int(kept.numel() > 0)
    return written
