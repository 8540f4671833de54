"""Sweep of forward-attention launch configurations (bf16, head_dim 128, Qwen3-1.7B heads) on one GPU.

    python benchmarks/attention_configs.py [--out benchmarks/results/attention_configs_h200.json]

For each candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: the time of paged decode (batch 256 at contexts
148 and 512, scattered 16-token pages) and of packed prefill (64 x 512 tokens), as CUDA-graph replays, and whether
its outputs are bitwise equal to the library's configuration (:func:`rlexact.ops.triton_attention._fwd_config`) on
the same inputs. Only ``num_warps``/``num_stages`` changes keep the tile arithmetic; the ``BLOCK_M`` rows are
recorded as evidence for a possible decode variant, which would also have to match bitwise.
"""

from __future__ import annotations

import argparse
import json
import math
import traceback
from pathlib import Path

import torch

from common import ROOT, bench_graph, header
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
CANDIDATES = [
    {"BLOCK_M": bm, "BLOCK_N": 64, "num_warps": w, "num_stages": st}
    for bm in (64, 16)
    for w in (4, 8)
    for st in (1, 2, 3, 4)
    if not (bm == 16 and w == 8)
]


def decode_case(b: int, ctx: int) -> tuple:
    bs = 16
    nblk = math.ceil(ctx / bs)
    kc = torch.randn(b * nblk, bs, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(b * nblk, bs, HKV, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(b * nblk, device="cuda").to(torch.int32).view(b, nblk)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    return q, kc, vc, cu, lens, tables


def prefill_case(b: int, s: int) -> tuple:
    q = torch.randn(b * s, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * s, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b * s, HKV, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    return q, k, v, cu, None, None


def run(case: tuple, cfg: dict | None) -> torch.Tensor:
    q, k, v, cu, lens, tables = case
    out = torch.empty_like(q)
    ta._forward(q, k, v, cu, lens, tables, 1 / math.sqrt(D), out, cfg=cfg)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_configs_h200.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = {
        "decode_b256_ctx148": decode_case(256, 148),
        "decode_b256_ctx512": decode_case(256, 512),
        "prefill_64x512": prefill_case(64, 512),
    }
    result: dict = header("attention_configs", "triton") | {
        "library_config": ta._fwd_config(D, torch.bfloat16),
        "timing": "median of triton.testing.do_bench_cudagraph (GPU time)",
        "rows": [],
    }
    refs = {name: run(case, None) for name, case in cases.items()}
    for cfg in CANDIDATES:
        row: dict = {"config": cfg}
        for name, case in cases.items():
            try:
                row[f"{name}_bitwise"] = bool(torch.equal(run(case, cfg), refs[name]))
                row[f"{name}_us"] = bench_graph(lambda case=case, cfg=cfg: run(case, cfg)) * 1e3
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["traceback"] = traceback.format_exc(limit=2)
        print("[attention_configs]", json.dumps(row), flush=True)
        result["rows"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
