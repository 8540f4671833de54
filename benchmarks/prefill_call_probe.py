"""The packed prefill attention as the library calls it against its kernel launched alone, and SDPA, in rotated rounds.

``ops_bench.py`` once timed the Gluon kernels alone (``gluon_kernels``: a preallocated output, the launch
configuration overridden) before its rounds of the library's call (``ops.attention_varlen``: output allocation, launch
plan) against SDPA, and their times were lower; it times them inside those rounds since. This script times four arms
in the same rounds, each round in another order (``common.rotated``), so that a difference between the library's call
and its kernel is measured under the same clocks:

- ``library``: ``triton_attention.attention_varlen`` (allocates the output, launches through its kept plan);
- ``preallocated``: ``triton_attention._forward`` into a preallocated output with the library's configuration;
- ``pair_override``: the same with the configuration overridden to the paired kernel (``gluon_kernels``' ``pair``);
- ``sdpa``: SDPA's default on the same inputs (K/V expanded to the query heads).

Eager (``common.bench``: ``do_bench``, the L2 overwritten before each call) and as CUDA-graph replays
(``common.bench_graph``); per arm the median over rounds, and per round each exact arm's time over ``library``'s.
The three exact arms must give the same bits.

    python benchmarks/prefill_call_probe.py [--rounds 8] [--out benchmarks/results/prefill_call_probe_h100.json]
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from common import bench, bench_graph, header, medians, rotated, rounds_args
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
SHAPES = ((8, 4096), (1, 8192), (64, 512))


def case(b: int, s: int, rounds: int) -> dict:
    scale = D**-0.5
    q = torch.randn(b * s, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b * s, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    qs = q.view(b, s, HQ, D).transpose(1, 2)
    ks, vs = (x.view(b, s, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1) for x in (k, v))
    out_pre, out_pair = torch.empty_like(q), torch.empty_like(q)
    arms: dict[str, Callable[[], object]] = {
        "library": lambda: ta.attention_varlen(q, k, v, cu, scale),
        "preallocated": lambda: ta._forward(q, k, v, cu, None, None, scale, out_pre),
        "pair_override": lambda: ta._forward(q, k, v, cu, None, None, scale, out_pair, cfg={"PAIR": True}),
        "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale),
    }
    lib = arms["library"]()
    arms["preallocated"]()
    arms["pair_override"]()
    row: dict = {"batch": b, "seqlen": s, "rounds": rounds,
                 "preallocated_equal": bool(torch.equal(lib, out_pre)),
                 "pair_override_equal": bool(torch.equal(lib, out_pair))}  # fmt: skip
    for mode, timer in (("eager", bench), ("graph", bench_graph)):
        series = rotated(arms, timer, rounds)
        per_round = {n: [t / base for t, base in zip(series[n], series["library"])] for n in series if n != "library"}
        row[mode] = {
            "ms": series,
            "median_ms": medians(series),
            "over_library_median": {n: statistics.median(r) for n, r in per_round.items()},
            "over_library_range": {n: [min(r), max(r)] for n, r in per_round.items()},
        }
    return row


def main() -> int:
    args = rounds_args(__doc__, "prefill_call_probe.py", 8, 4, "prefill_call_probe_h100.json")
    result: dict = header("prefill_call_probe", "triton") | {"rows": []}
    for b, s in SHAPES:
        row = case(b, s, args.rounds)
        result["rows"].append(row)
        summary = {m: {n: round(t, 4) for n, t in row[m]["median_ms"].items()} for m in ("eager", "graph")}
        print(f"[prefill_call_probe] {b}x{s} equal {row['preallocated_equal']} {row['pair_override_equal']} {summary}",
              flush=True)  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
