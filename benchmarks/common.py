"""What every benchmark script shares: the ``src`` import path, the header of its result JSON, and the GPU timers.

Importing this module puts ``<repo>/src`` first on ``sys.path``, so the scripts run from a plain checkout.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlexact.envinfo import result_header as header  # noqa: E402, F401 - re-exported: the result provenance block


def bench(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``triton.testing.do_bench`` (eager launches, host overhead included)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn: Callable[[], object], rep: int = 50) -> float:
    """Median milliseconds of CUDA-graph replays (GPU time without Python/launch overhead)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
