"""Per-rollout-step diagnostics an RL user reads first: advantage and reward ranges, the share of groups without a
learning signal, and where the step's time went.

Every value is reduced over ranks (means weighted by sample counts, extremes by min / max, times by max: the
slowest rank bounds the step) with :class:`rlexact.reduction.MetricReducer`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlexact import algorithms as alg
from rlexact.reduction import MetricReducer

__all__ = ["StageTimer", "advantage_metrics"]


def advantage_metrics(rewards: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """``advantage/{mean,std,min,max}`` and ``reward/{min,max}`` over the step's sequences, and
    ``groups/zero_variance_frac``: the fraction of prompts whose samples all got the same reward (zero GRPO / RLOO
    advantage: no gradient from that prompt)."""
    a = advantages.detach().double().cpu()
    r = rewards.detach().double().cpu()
    g = group_ids.detach().cpu()
    n = a.numel()
    groups = torch.unique(g)
    constant = torch.unique(g[~alg.dynamic_sampling_keep(r, g)]).numel()  # groups whose rewards are all equal
    red = MetricReducer()
    red.add_mean("advantage/mean", float(a.mean()) if n else 0.0, n)
    red.add_mean("advantage_sq", float((a * a).mean()) if n else 0.0, n)
    red.add_min("advantage/min", float(a.min()) if n else None)
    red.add_max("advantage/max", float(a.max()) if n else None)
    red.add_min("reward/min", float(r.min()) if n else None)
    red.add_max("reward/max", float(r.max()) if n else None)
    red.add_mean("groups/zero_variance_frac", constant / max(len(groups), 1), len(groups))
    out = red.reduce(advantages.device)
    mean_sq = out.pop("advantage_sq")
    out["advantage/std"] = max(mean_sq - out["advantage/mean"] ** 2, 0.0) ** 0.5
    return out


class StageTimer:
    """Wall time of the named stages of one rollout step: ``with timer("scoring"): ...`` accumulates, and
    :meth:`metrics` returns ``timing/<stage>_s`` (max over ranks) plus ``timing/step_s`` since construction."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0

    def metrics(self, device: torch.device | str | None = None) -> dict[str, float]:
        red = MetricReducer()
        for stage, s in self.seconds.items():
            red.add_max(f"timing/{stage}_s", s)
        red.add_max("timing/step_s", time.perf_counter() - self.start)
        return red.reduce(device)
