"""Probe: the exact Gluon attention forward with tile j's P @ V in flight under tile j + 1's softmax, against the
library's forward and SDPA.

    python benchmarks/gluon_pipeline_probe.py [--out benchmarks/results/gluon_pipeline_probe_h200.json]

``pipelined`` (``rlexact.ops.gluon_attention.forward(..., pipelined=True)``) runs the same per-row operations in the
same order; inside a KV split it issues tile j + 1's score wgmma and tile j's P @ V asynchronously and computes tile
j + 1's softmax while the P @ V runs. It is checked bitwise against the library's forward on packed sequences of
mixed lengths (partial tiles, several splits) and at every timing shape, with and without the backward's
preprocessing (``lse`` and ``delta``); a negative control perturbs one key and must change the output. Timings are
CUDA-graph replays at the ``ops_bench`` attention shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import ROOT, bench_graph, header
from rlexact.ops import gluon_attention as ga
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
SCALE = 1 / math.sqrt(D)
SPLIT = ta.SPLIT_KEYS_16BIT
VARIANTS = {"pipelined": {"pipelined": True}}
CHECK_LENS = (
    [1, 37, 200, 333, 64, 65],
    [1024, 1000, 17, 513],
    [1100, 300, 37, 9],
    [2500, 31, 1024, 1025, 2049],
    [5000, 3, 70] * 3,
    [7] * 300,
)


def _inputs(lens: list[int]) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(sum(lens), HQ + 2 * HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return qkv[:, :HQ].contiguous(), qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :], cu


def _run(variant: str | None, q, k, v, cu) -> torch.Tensor:  # noqa: ANN001
    out = torch.empty_like(q)
    if variant is None:
        ta._forward(q, k, v, cu, None, None, SCALE, out)
    else:
        ga.forward(q, k, v, cu, SCALE, out, HQ // HKV, SPLIT, **VARIANTS[variant])
    return out


def _bwd_prep(variant: str | None, q, k, v, cu, do) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    lse = torch.empty(q.shape[0], HQ, device="cuda", dtype=torch.float32)
    delta = torch.empty_like(lse)
    ga.forward(q, k, v, cu, SCALE, do, HQ // HKV, SPLIT, (lse, delta), **(VARIANTS[variant] if variant else {}))
    return lse, delta


def check(lens: list[int]) -> dict:
    q, k, v, cu = _inputs(lens)
    ref = _run(None, q, k, v, cu)
    row: dict = {"lens": lens}
    for name in VARIANTS:
        row[name] = bool(torch.equal(_run(name, q, k, v, cu), ref))
        do = torch.randn_like(q)
        row[f"{name}_bwd_prep"] = all(
            torch.equal(a, b) for a, b in zip(_bwd_prep(name, q, k, v, cu, do), _bwd_prep(None, q, k, v, cu, do))
        )
        k2 = k.clone()
        k2[-1, 0, 0] += 1.0  # the last sequence's last key: its last query row must change
        row[f"{name}_negative_control_differs"] = not torch.equal(_run(name, q, k2, v, cu), ref)
    return row


def measure(b: int, s_len: int) -> dict:
    q, k, v, cu = _inputs([s_len] * b)
    ref = _run(None, q, k, v, cu)
    row: dict = {"library_us": bench_graph(lambda: _run(None, q, k, v, cu)) * 1e3}
    for name in VARIANTS:
        row[f"{name}_bitwise_equal_library"] = bool(torch.equal(_run(name, q, k, v, cu), ref))
        row[f"{name}_us"] = bench_graph(lambda name=name: _run(name, q, k, v, cu)) * 1e3
    qs, ks, vs = (x.reshape(b, s_len, -1, D).transpose(1, 2) for x in (q, k, v))
    ks, vs = ks.repeat_interleave(HQ // HKV, 1), vs.repeat_interleave(HQ // HKV, 1)
    row["sdpa_default_us"] = bench_graph(
        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE)
    ) * 1e3  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_pipeline_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["64x512", "8x4096", "1x8192", "128x256", "16x1024"])
    args = ap.parse_args()
    t0 = time.time()
    result: dict = header("gluon_pipeline_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "dtype": "bfloat16",
        "split": SPLIT,
        "variants": VARIANTS,
        "timing": "median of do_bench_cudagraph, microseconds",
        "checks": [check(lens) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_pipeline_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        b, s_len = (int(x) for x in shape.split("x"))
        result["shapes"][shape] = row = measure(b, s_len)
        print("[gluon_pipeline_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
