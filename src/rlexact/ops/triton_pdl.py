"""Programmatic dependent launch (PDL) of the exact kernels on Hopper and newer GPUs.

With PDL a kernel may be launched while the kernel before it on the stream is still running, so the launch latency
and the new kernel's start-up overlap the tail of the previous one. Every kernel that takes part calls
:func:`pdl_entry` before it touches global memory: it waits until the previous kernel has finished and its writes
are visible (``griddepcontrol.wait``), then lets the next kernel launch (``griddepcontrol.launch_dependents``), so at
most one launch waits ahead of the running kernel (releasing before waiting let chains of waiting kernels crowd the
GPU: decode got slower, ``benchmarks/results/rollout_*pdl_release_first_*_h200.json``). Since each kernel waits for
the full completion of its predecessor before any load or store, reads after writes and writes after reads (scratch
buffers, in-place caches) are ordered as with plain launches, and no value changes: PDL only moves launch work,
never arithmetic.

PDL is opt-in: ``RLEXACT_PDL=1`` turns it on for CUDA tensors of compute capability 9.0 or newer when Triton supports
it. It is off by default because it did not pay on the H200: CUDA-graph decode steps with PDL were no faster at
batch 64 and slower at batch 4 with 8k-token contexts (``benchmarks/results/rollout_pdl_{on,off}_h200.json``,
``rollout_long_pdl_{on,off}_h200.json``). Prefetching each matmul's first weight columns into L2 before the wait
(built at 0e9c657) did not make it pay either (``rollout_pdl_pf_{off,on,nopf}_h200.json``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .backend import interpreter_enabled

try:  # triton >= 3.4: grid dependency control
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old triton
    gdc_launch_dependents = gdc_wait = None

__all__ = ["pdl_entry", "pdl_options", "pdl_supported"]

PDL_ENV = "RLEXACT_PDL"
"""Environment variable: ``1`` launches the kernels with a ``PDL`` constexpr with PDL (read when a launch is made; the
matmul keeps the choice in its cached launch plans)."""


def _triton_has_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - no CUDA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_OFF: Mapping[str, bool] = MappingProxyType({"PDL": False})
_ON: Mapping[str, bool] = MappingProxyType({"PDL": True, "launch_pdl": True})


@functools.cache
def _options(index: int, enabled: bool) -> Mapping[str, bool]:
    on = enabled and not interpreter_enabled() and _triton_has_pdl() and torch.cuda.get_device_capability(index)[0] >= 9
    return _ON if on else _OFF


def pdl_options(device: torch.device) -> Mapping[str, bool]:
    """Keyword arguments of a launch, on ``device``, of a kernel with a ``PDL`` constexpr: ``{"PDL": True,
    "launch_pdl": True}`` with ``RLEXACT_PDL=1`` on a CUDA device of compute capability 9.0 or newer with a Triton
    that has grid dependency control (not the interpreter); else ``{"PDL": False}``. Read-only."""
    if device.type != "cuda":
        return _OFF
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _options(index, os.environ.get(PDL_ENV, "0") == "1")


def pdl_supported(device: torch.device) -> bool:
    """True when kernels on ``device`` are launched with PDL (:func:`pdl_options`)."""
    return pdl_options(device)["PDL"]


@triton.jit
def pdl_entry(PDL: tl.constexpr):
    """First statement of a kernel launched with :func:`pdl_options`: wait for the previous kernel's completion and
    memory, then release the next kernel's launch. A no-op when ``PDL`` is false."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
