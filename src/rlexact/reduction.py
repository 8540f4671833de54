"""The one cross-rank reducer of rlexact: advantages, step metrics and RL callbacks all reduce through it.

Every data-parallel rank holds its own share of the rollout batch, so a global mean must be reduced as *sums and
counts* and divided afterwards; averaging per-rank means weights a rank with 3 tokens like a rank with 3,000.

* :func:`all_reduce` is the primitive: a float64 tensor summed (or max/min-ed) over the default process group, the
  identity without one. The REINFORCE whitening of :func:`rlexact.algorithms.reinforce_advantages` takes it, so one
  code path serves every world size.
* :class:`MetricReducer` collects named partial statistics (count-weighted means, sums, maxima, minima) and reduces
  them in at most two collectives. Without a process group the local values come back unchanged (a mean is not
  multiplied and divided again), so exact-mode zeros and ones stay bit-exact.
* :func:`gather_cat` gathers variable-length 1-D tensors (histogram values) in rank order.

Collectives must be entered by every rank in the same order: callers reduce unconditionally (a rank without data
contributes zero counts and ``None`` extrema, it never skips the call).

Lightning's ``self.log(..., sync_dist=True)`` is not used for these values (it averages per-rank values without
weights); torchmetrics serves the epoch-level validation means of :class:`rlexact.RLModule`, where per-update state
syncing fits.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "MetricReducer",
    "all_reduce",
    "collective_device",
    "dist_ready",
    "gather_cat",
    "global_rank",
    "world_size",
]

_OPS = ("sum", "max", "min")


def dist_ready() -> bool:
    """True when ``torch.distributed`` is initialized with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of processes of the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_rank() -> int:
    """Rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def collective_device(device: torch.device | str | None = None) -> torch.device:
    """The device a collective's tensors must live on: the current CUDA device under NCCL, else ``device`` or CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device) if device is not None else torch.device("cpu")


def all_reduce(values: Tensor, op: str = "sum") -> Tensor:
    """``values`` reduced element-wise over every rank (``op`` in sum / max / min), in float64, on ``values``'
    device; ``values`` itself (unchanged, any dtype) without a process group."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {list(_OPS)}, got {op!r}")
    if not dist_ready():
        return values
    buf = values.detach().to(collective_device(values.device), torch.float64).clone()
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(buf, op=red)
    return buf.to(values.device)


class MetricReducer:
    """Collect per-rank partial statistics under names, reduce them across ranks, return the global values.

    Usage::

        red = MetricReducer()
        red.add_mean("abs_diff_mean", local_mean, local_count)   # count-weighted global mean
        red.add_max("abs_diff_max", local_max if local_count else None)
        red.add_sum("num_tokens", local_count)
        values = red.reduce()                                     # the same dict on every rank

    ``add_mean`` takes the local mean and the count (tokens, sequences) it was taken over; the global value is
    ``sum_r mean_r * count_r / sum_r count_r`` (``empty`` when the global count is 0). ``add_max``/``add_min`` take
    ``None`` for a rank without data. The ``add_*`` methods return the reducer, so one-off reductions chain:
    ``MetricReducer().add_max("n", n).reduce()["n"]``.
    """

    def __init__(self) -> None:
        self._means: dict[str, tuple[float, float, float]] = {}
        self._sums: dict[str, float] = {}
        self._maxes: dict[str, tuple[float | None, float]] = {}
        self._mins: dict[str, tuple[float | None, float]] = {}

    def add_mean(self, name: str, mean: float, count: float, *, empty: float = 0.0) -> MetricReducer:
        self._means[name] = (float(mean), float(count), float(empty))
        return self

    def add_sum(self, name: str, value: float) -> MetricReducer:
        self._sums[name] = float(value)
        return self

    def add_max(self, name: str, value: float | None, *, empty: float = 0.0) -> MetricReducer:
        self._maxes[name] = (None if value is None else float(value), float(empty))
        return self

    def add_min(self, name: str, value: float | None, *, empty: float = 0.0) -> MetricReducer:
        self._mins[name] = (None if value is None else float(value), float(empty))
        return self

    def reduce(self, device: torch.device | str | None = None) -> dict[str, float]:
        """Reduce across ranks (two collectives at most) and return ``{name: value}``: means, sums, maxima, minima."""
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
        s = all_reduce(torch.tensor(sum_vals, dtype=torch.float64, device=dev), "sum").tolist() if sum_vals else []
        m = all_reduce(torch.tensor(max_vals, dtype=torch.float64, device=dev), "max").tolist() if max_vals else []
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
    counts = torch.cat(sizes).tolist()
    longest = max(counts)
    padded = torch.zeros(longest, dtype=local.dtype, device=dev)
    padded[: local.numel()] = local
    parts = [torch.zeros_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(values.device)
