"""Sweep of bitwise-equivalent row-tile variants of the exact matmul for small M (decode) on one GPU.

    python benchmarks/matmul_variants.py [--out benchmarks/results/matmul_variants_h200.json]

For each Qwen3-1.7B projection shape (as the model calls them, plus fused q|k|v and gate|up) and each M (default
1, 16, 64, 128, 256; ``--ms``; 16-row tiles are candidates up to M = 16), every candidate configuration is (1) checked
bitwise against the static large-M configuration on the same rows (a variant that changes any bit is marked
``bitwise: false`` and may not be used) and (2) timed as a CUDA-graph replay next to ``torch.mm``. The JSON records
every candidate, the fastest bitwise-equal one per (shape, M), and the configuration the library picks today.

``--cold``: each timed replay runs the matmul once on each of several copies of the weight that together exceed the
L2 cache, so the weights come from HBM as in a decode step (where every layer's weights differ) while the
activations stay in L2; times are per call. ``--shapes`` picks shapes by name; ``--lite`` keeps one warp count per
tile size and two pipeline depths (a quicker sweep for M > 64); ``--ws`` adds every TMA candidate again with Triton's
warp specialization of the K loop (``warp_specialized`` records whether that compile succeeded).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from common import (
    L2_BYTES,
    ROOT,
    best_summary,
    graph_ms_over,
    header,
    pick_best,
    require_cuda,
    run_cases,
    try_candidate,
    weight_copies,
)
from rlexact.ops.triton_matmul import MatmulConfig, config_for, matmul_with_config, static_config, warp_specialized

MS = [1, 16, 64, 128, 256]
SHAPES = {  # (N, K) of the Qwen3-1.7B projections as the exactified model calls them, and fused q|k|v, gate|up
    "q_o": (2048, 2048),
    "k_v": (1024, 2048),
    "gate_or_up": (6144, 2048),
    "down": (2048, 6144),
    "qkv_fused": (4096, 2048),
    "gate_up_fused": (12288, 2048),
}


def candidates(m: int, lite: bool = False, ws: bool = False) -> list[MatmulConfig]:
    out = []
    if m <= 16:  # 16-row tiles: one warp (one m16 MMA row block) or four side by side along N
        for bn, bk, stages, warps in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (1, 4)):
            if bk * stages * (16 + bn) * 2 <= 200_000:
                out.append(MatmulConfig("ptr", 16, bn, bk, num_warps=warps, num_stages=stages))
    if m <= 64:
        for bn, bk, stages, warps in itertools.product((16, 32, 64), (64, 128, 256), (4, 6), (4,)):
            if bk * stages * (64 + bn) * 2 > 200_000:  # shared memory of the pipeline (x and w tiles, bf16)
                continue
            out.append(MatmulConfig("ptr", 64, bn, bk, num_warps=warps, num_stages=stages))
        return out
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5)):
        if bk * stages * (bm + bn) * 2 + bm * bn * 2 > 220_000 or bm * bn > 4096 * warps:
            continue  # pipeline + epilogue shared memory; fp32 accumulator registers (<= 128 per thread)
        if lite and (warps != (4 if bm * bn <= 8192 else 8) or (stages == (3 if bk == 64 else 5) and bn < 256)):
            continue
        out.append(MatmulConfig("tma", bm, bn, bk, num_warps=warps, num_stages=stages, device_desc=True))
    if ws:  # the same tiles with Triton's warp specialization of the K loop (a producer warp feeding the MMA warps)
        out += [dataclasses.replace(c, warp_specialize=True) for c in out if c.kernel == "tma"]
    return out


def sweep_shape(n: int, k: int, ms: list[int], cold: bool = False, lite: bool = False, ws: bool = False) -> list[dict]:
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    ws = weight_copies(w, cold)
    x_all = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
    ref_all = matmul_with_config(x_all, w, static_config(n, k, torch.bfloat16, dev))
    rows = []
    for m in ms:
        x = x_all[1000 : 1000 + m].contiguous()
        ref = ref_all[1000 : 1000 + m]
        t_mm = graph_ms_over(lambda w, x=x: torch.mm(x, w.T), ws)
        current = config_for(m, n, k, torch.bfloat16, dev)
        entry: dict = {"M": m, "N": n, "K": k, "torch_mm_graph_ms": t_mm, "current": repr(current), "candidates": []}
        for cfg in candidates(m, lite, ws) + [current]:
            c = try_candidate(cfg, lambda w, x=x, cfg=cfg: matmul_with_config(x, w, cfg), ref, ws)
            if "graph_ms" in c:
                c["ratio_vs_mm"] = t_mm / c["graph_ms"]
                if cfg.warp_specialize:  # a failed warp-specialized compile runs the same tile without it
                    c["warp_specialized"] = warp_specialized(cfg)
            entry["candidates"].append(c)
        pick_best(entry)
        print(f"[matmul_variants] N={n} K={k} M={m}: mm {t_mm * 1e3:.1f} us, {best_summary(entry)}", flush=True)
        rows.append(entry)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "matmul_variants_h200.json"))
    ap.add_argument("--ms", type=int, nargs="+", default=MS, help="row counts M to sweep")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--cold", action="store_true", help="weights from HBM: rotate copies larger than the L2 cache")
    ap.add_argument("--lite", action="store_true", help="fewer M > 64 candidates (one warp count, two depths)")
    ap.add_argument("--ws", action="store_true", help="also every TMA candidate with warp specialization")
    args = ap.parse_args()
    require_cuda("matmul_variants.py")
    timing = "median of triton.testing.do_bench_cudagraph (GPU time, no host launch overhead)"
    if args.cold:
        timing += f"; per call over weight copies totalling >= {4 * L2_BYTES >> 20} MiB (weights read from HBM)"
    result: dict = header("matmul_variants", "triton") | {"timing": timing}

    def measure(name: str) -> dict:
        return sweep_shape(*SHAPES[name], args.ms, args.cold, args.lite, args.ws)

    return run_cases(result, "shapes", args.shapes, measure, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
