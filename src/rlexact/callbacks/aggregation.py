"""Cross-rank aggregation and logging helpers shared by the RL callbacks.

Every RL callback runs on every data-parallel rank on that rank's share of the rollout batch. A metric that is a
ratio (a mean, a fraction) must therefore be reduced as *sums and counts* across ranks before dividing -- averaging
per-rank means (what ``self.log(..., sync_dist=True)`` does) weights a rank with 3 tokens like a rank with 3,000.
:class:`MetricReducer` collects each rank's partial statistics and reduces them in two collectives (one ``SUM`` for
the sums and counts, one ``MAX`` for maxima and negated minima); :func:`gather_cat` gathers variable-length tensors
(histogram values) on every rank. Without ``torch.distributed`` (or with one process) both are local and exact: a
mean comes back bit-for-bit as the callback computed it.

Collectives must be entered by every rank in the same order, so callbacks call these helpers unconditionally (a rank
with no tokens contributes zero counts, never skips the call).

:func:`log_scalars` and :func:`log_histograms` write the reduced values: scalars through ``pl_module.log_dict`` when
called inside ``training_step`` (where :class:`rlexact.RLModule` calls the RL hooks; ``sync_dist=False`` because
the values are already global), histograms through ``add_histogram`` of every ``TensorBoardLogger`` on global
rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

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


def dist_ready() -> bool:
    """True when ``torch.distributed`` is initialized with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def collective_device(device: torch.device | str | None = None) -> torch.device:
    """The device a collective's tensors must live on: the current CUDA device under NCCL, else ``device`` or CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device) if device is not None else torch.device("cpu")


class MetricReducer:
    """Collect per-rank partial statistics under names, reduce them across ranks, return the global values.

    Usage::

        red = MetricReducer()
        red.add_mean("abs_diff_mean", local_mean, local_count)   # token-weighted global mean
        red.add_max("abs_diff_max", local_max if local_count else None)
        red.add_sum("num_tokens", local_count)
        values = red.reduce()                                     # same dict on every rank

    ``add_mean`` takes the local mean and the count it was taken over; the global value is
    ``sum_r mean_r * count_r / sum_r count_r`` (``empty`` when the global count is 0). ``add_max``/``add_min`` take
    ``None`` for a rank with no data. Without a process group the local values come back unchanged (a mean is not
    multiplied and divided again), so exact-mode zeros and ones stay bit-exact.
    """

    def __init__(self) -> None:
        self._means: dict[str, tuple[float, float, float]] = {}
        self._sums: dict[str, float] = {}
        self._maxes: dict[str, tuple[float | None, float]] = {}
        self._mins: dict[str, tuple[float | None, float]] = {}

    def add_mean(self, name: str, mean: float, count: float, *, empty: float = 0.0) -> None:
        self._means[name] = (float(mean), float(count), float(empty))

    def add_sum(self, name: str, value: float) -> None:
        self._sums[name] = float(value)

    def add_max(self, name: str, value: float | None, *, empty: float = 0.0) -> None:
        self._maxes[name] = (None if value is None else float(value), float(empty))

    def add_min(self, name: str, value: float | None, *, empty: float = 0.0) -> None:
        self._mins[name] = (None if value is None else float(value), float(empty))

    def reduce(self, device: torch.device | str | None = None) -> dict[str, float]:
        """Reduce across ranks (two collectives at most) and return ``{name: value}`` in insertion order."""
        if not dist_ready():
            out: dict[str, float] = {}
            for name, (mean, count, empty) in self._means.items():
                out[name] = mean if count > 0 else empty
            out.update(self._sums)
            for table in (self._maxes, self._mins):
                for name, (value, empty) in table.items():
                    out[name] = empty if value is None else value
            return out
        dev = collective_device(device)
        sum_vals: list[float] = []
        for mean, count, _ in self._means.values():
            sum_vals += [mean * count if count > 0 else 0.0, count]
        sum_vals += list(self._sums.values())
        max_vals = [-math.inf if v is None else v for v, _ in self._maxes.values()]
        max_vals += [-math.inf if v is None else -v for v, _ in self._mins.values()]
        sums = torch.tensor(sum_vals, dtype=torch.float64, device=dev)
        maxes = torch.tensor(max_vals, dtype=torch.float64, device=dev)
        if sums.numel():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        if maxes.numel():
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        s, m = sums.tolist(), maxes.tolist()
        out = {}
        i = 0
        for name, (_, _, empty) in self._means.items():
            total, count = s[i], s[i + 1]
            out[name] = total / count if count > 0 else empty
            i += 2
        for name in self._sums:
            out[name] = s[i]
            i += 1
        j = 0
        for name, (_, empty) in self._maxes.items():
            out[name] = m[j] if m[j] != -math.inf else empty
            j += 1
        for name, (_, empty) in self._mins.items():
            out[name] = -m[j] if m[j] != -math.inf else empty
            j += 1
        return out


def gather_cat(values: Tensor, device: torch.device | str | None = None) -> Tensor:
    """Concatenate a 1-D tensor of any length from every rank, in rank order; every rank receives the result.

    Returns ``values`` itself without a process group. The result is on ``values.device``.
    """
    if values.dim() != 1:
        raise ValueError(f"gather_cat expects a 1-D tensor, got shape {tuple(values.shape)}")
    if not dist_ready():
        return values
    dev = collective_device(device if device is not None else values.device)
    n = world_size()
    local = values.detach().to(dev)
    size = torch.tensor([local.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    padded = torch.zeros(longest, dtype=local.dtype, device=dev)
    padded[: local.numel()] = local
    parts = [torch.zeros_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(values.device)


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
