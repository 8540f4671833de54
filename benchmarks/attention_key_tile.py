"""Sweep of the exact attention's key tile (``BLOCK_N``, part of the bit contract) on one GPU: prefill and decode
time at each key tile, and whether decode == chunked prefill == training still holds within it.

    python3 benchmarks/attention_key_tile.py [--out benchmarks/results/attention_key_tile_h200.json]

``BLOCK_N`` fixes which keys one online-softmax update sees, so changing it changes every row's bits; within one
``BLOCK_N`` all launches agree. For each key tile in :data:`KEY_TILES` (bf16, head_dim 128, Qwen3-1.7B heads), with
``rlexact.ops.triton_attention._fwd_config`` patched to it:

* prefill (packed causal, 64 x 512, 8 x 4,096 and 1 x 8,192 tokens) under each launch of :data:`PREFILL_LAUNCHES`,
  as CUDA-graph replays, next to SDPA's default backend on the same shapes (GQA-expanded ``[B, H, S, D]``); the
  largest deviation from an fp32 SDPA reference on the first shape;
* paged decode (the ``attention_configs.py --decode`` shapes) under each launch of :data:`DECODE_LAUNCHES`;
* ``decode_eq_prefill``: the training forward equals chunked paged prefill plus one-token decode steps bitwise, with
  the fastest prefill and decode launches of that key tile installed.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from attention_configs import (
    DECODE_SWEEP_SHAPES,
    DEV,
    DT,
    HKV,
    HQ,
    PREFILL_SHAPES,
    SCALE,
    SHAPE,
    D,
    decode_case,
    decode_eq_prefill,
    prefill_case,
    run,
)
from common import ROOT, bench_graph, header, require_cuda
from rlexact.ops import triton_attention as ta

KEY_TILES = (64, 128)
PREFILL_LAUNCHES = [
    {"BLOCK_M": bm, "num_warps": w, "num_stages": st} for bm in (64, 128) for w in (4, 8) for st in (2, 3)
]
DECODE_LAUNCHES = [{"BLOCK_M": 16, "num_warps": w, "num_stages": st} for w in (2, 4) for st in (2, 3)]


def sdpa_default_us(b: int, s: int) -> tuple[float, tuple]:
    """SDPA's default backend on the shape (CUDA-graph time, us), and its inputs."""
    q = torch.randn(b, HQ, s, D, device=DEV, dtype=DT)
    k = torch.randn(b, HKV, s, D, device=DEV, dtype=DT).repeat_interleave(HQ // HKV, 1)
    v = torch.randn(b, HKV, s, D, device=DEV, dtype=DT).repeat_interleave(HQ // HKV, 1)
    us = bench_graph(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)) * 1e3
    return us, (q, k, v)


def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``[B, H, S, D]`` (K/V expanded) -> the packed ``[B * S, H, D]`` case of ``attention_configs``."""
    b, _, s, _ = q.shape
    cu = torch.arange(0, (b + 1) * s, s, device=DEV, dtype=torch.int32)
    flat = [
        t.transpose(1, 2).reshape(b * s, t.shape[1], D).contiguous()
        for t in (q, k[:, :: HQ // HKV], v[:, :: HQ // HKV])
    ]
    return (*flat, cu, None, None)


def time_launches(cases: dict, library: dict, launches: list[dict], label: str) -> list[dict]:
    """One row per launch: each case's CUDA-graph time (us) under ``library | launch`` and their total, or the error
    of a launch that does not compile or run."""
    rows = []
    for launch in launches:
        row: dict = {"launch": launch}
        try:
            for name, case in cases.items():
                row[name] = bench_graph(lambda case=case, cfg=library | launch: run(case, cfg)) * 1e3
            row["total_us"] = sum(row[n] for n in cases)
        except Exception as e:  # noqa: BLE001 - a launch that does not compile is recorded
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(f"[attention_key_tile] {label}", row, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_key_tile_h200.json"))
    args = ap.parse_args()
    require_cuda("attention_key_tile.py")
    t0 = time.time()
    torch.manual_seed(0)
    prefill = {f"prefill_{b}x{s}": prefill_case(b, s) for b, s in PREFILL_SHAPES}
    decode = {f"decode_b{b}_ctx{c}": decode_case(b, c) for b, c in DECODE_SWEEP_SHAPES}
    result: dict = header("attention_key_tile", "triton") | {
        "shape": SHAPE,
        "timing": "median of do_bench_cudagraph (GPU time), microseconds",
        "sdpa_default_us": {},
        "key_tiles": {},
    }
    ref_case = None
    for b, s in PREFILL_SHAPES:
        us, (q, k, v) = sdpa_default_us(b, s)
        result["sdpa_default_us"][f"prefill_{b}x{s}"] = us
        if ref_case is None:  # the first shape's fp32 reference
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=SCALE)
            ref_case = (packed(q, k, v), ref.transpose(1, 2).reshape(b * s, HQ, D))
    orig = ta._fwd_config
    for bn in KEY_TILES:
        ta._fwd_config = lambda hd, dt, bn=bn: orig(hd, dt) | {"BLOCK_N": bn}
        entry: dict = {"prefill": [], "decode": []}
        try:
            library = ta._fwd_config(D, DT)
            entry["max_abs_err_vs_fp32_sdpa"] = (run(ref_case[0], library).float() - ref_case[1]).abs().max().item()
            entry["prefill"] = time_launches(prefill, library, PREFILL_LAUNCHES, f"BLOCK_N {bn} prefill")
            entry["decode"] = time_launches(decode, library, DECODE_LAUNCHES, f"BLOCK_N {bn} decode")
            best_p = min((r for r in entry["prefill"] if "error" not in r), key=lambda r: r["total_us"])
            best_d = min((r for r in entry["decode"] if "error" not in r), key=lambda r: r["total_us"])
            entry["best_prefill"], entry["best_decode"] = best_p, best_d
            entry["decode_eq_prefill"] = decode_eq_prefill(best_p["launch"], best_d["launch"])
        except Exception as e:  # noqa: BLE001 - one key tile failing still records the other
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        finally:
            ta._fwd_config = orig
        result["key_tiles"][str(bn)] = entry
    result["elapsed_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    summary = {
        bn: {k: e.get(k, {}).get("total_us") for k in ("best_prefill", "best_decode")}
        | {"eq": e.get("decode_eq_prefill")}
        for bn, e in result["key_tiles"].items()
    }
    print(
        "[attention_key_tile]", json.dumps(summary), "sdpa", result["sdpa_default_us"], f"({result['elapsed_s']:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
