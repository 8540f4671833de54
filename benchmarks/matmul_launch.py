"""Host overhead of eager exact-matmul launches; writes ``benchmarks/results/matmul_launch_h200.json``.

    python benchmarks/matmul_launch.py [--out PATH]

* ``eager_vs_graph``: bf16 Qwen3-1.7B projections at M = 1,024 and 4,096: :func:`rlexact.ops.matmul` eager
  (``do_bench``) vs CUDA-graph replay, ``graph_over_eager`` (1.0 = no visible host overhead), ``torch.mm`` eager, and
  the host microseconds per call (300 calls without synchronization, GPU queue not full).
* ``host_us``: host microseconds per call of each layer of the call stack for the o-projection at M = 1,024: the
  public op (autograd Function included), the Triton-module function, the cached launcher alone, ``torch.empty`` of
  the output, ``torch.mm``.
* ``cprofile``: the functions with the most own time over 300 calls of the public op.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import ROOT, bench, bench_graph, header

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Host microseconds per call of ``fn`` (no synchronization inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def main() -> None:
    from rlexact.ops import matmul
    from rlexact.ops import triton_matmul as tmm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "matmul_launch_h200.json"))
    args = ap.parse_args()
    res = header("matmul_launch", "triton")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            eager = bench(lambda x=x, w=w: matmul(x, w))
            graph = bench_graph(lambda x=x, w=w: matmul(x, w))
            rows.append(
                dict(
                    name=name, M=m, N=n, K=k, eager_us=eager * 1e3, graph_us=graph * 1e3,
                    graph_over_eager=graph / eager,
                    torch_mm_us=bench(lambda x=x, w=w: torch.mm(x, w.T)) * 1e3,
                    host_us=host_us(lambda x=x, w=w: matmul(x, w)),
                    config=repr(tmm.config_for(m, n, k, torch.bfloat16, x.device)),
                )
            )  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    res["eager_vs_graph"] = rows

    n, k = SHAPES["o"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, k, device="cuda", dtype=torch.bfloat16)
    out = tmm.matmul(x, w)
    plan = tmm._LAUNCHES[(1024, n, k, torch.bfloat16, x.get_device())]
    layers = {
        "ops.matmul": lambda: matmul(x, w),
        "triton_matmul.matmul": lambda: tmm.matmul(x, w),
        "torch.empty(out)": lambda: torch.empty((1024, n), dtype=torch.bfloat16, device="cuda"),
        "torch.mm": lambda: torch.mm(x, w.T),
    }
    if plan.runner is not None:
        layers["cached launcher only"] = lambda: plan.runner(x, w, out, 1024, n, k, *plan.tail)
    res["host_us"] = {name: host_us(fn) for name, fn in layers.items()}
    print(json.dumps(res["host_us"]), flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        matmul(x, w)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:20]
    res["cprofile"] = [
        {"function": f"{fn[0].split('/')[-1]}:{fn[1]}:{fn[2]}", "calls": v[1], "own_us_per_call": v[2] / 300 * 1e6}
        for fn, v in top
    ]
    for r in res["cprofile"]:
        print(r, flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
