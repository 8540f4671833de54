"""Sweep of the SiLU-gated matmul (gate and up products and the SiLU gate in one launch) against the generator's
previous path, the fused gate|up matmul followed by ``silu_mul``, on one GPU.

    python benchmarks/matmul_gated.py [--out benchmarks/results/matmul_gated_h200.json]

Shape: the Qwen3-1.7B gated MLP (intermediate 6,144, hidden 2,048, bf16). For each M every candidate configuration is
(1) checked bitwise against ``silu_mul(matmul(x, w_gate), matmul(x, w_up))`` (the trainer's ops; a candidate that
changes any bit is marked ``bitwise: false`` and may not be used) and (2) timed as a CUDA-graph replay over weight
copies that together exceed the L2 cache (the weights come from HBM, as in a decode step). Next to it, in the same
run: the library's own gated path (``gate_up_silu``) and its one-launch kernel alone (Gluon where it runs), the
unfused path (one matmul on the concatenated weights, then ``silu_mul``; that matmul and ``torch.mm`` also alone)
and torch (``torch.mm`` and ``F.silu(g) * u``). TMA candidates run the gate and up tiles as two dots or, ``joint``,
as one ``[2, BN, BK]`` block and one dot of twice the width. The JSON records every candidate, the fastest
bitwise-equal one per M, and the library's choice. ``--current-only`` times the library's choice alone beside the
other paths (the unfused path's ``matmul`` runs ``torch.mm`` where cuBLAS was verified to give its bits, at most
``CUBLAS_MAX_M`` rows).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from common import (
    L2_BYTES,
    ROOT,
    best_summary,
    graph_ms_over,
    header,
    pick_best,
    require_cuda,
    try_candidate,
    weight_copies,
)
from rlexact import ops
from rlexact.ops import gluon_matmul
from rlexact.ops.triton_matmul import MatmulConfig, gated_config_for, gluon_gated_config, matmul_with_config

MS = [1, 16, 64, 128, 256, 2048, 8192]
INTER, HIDDEN = 6144, 2048


def candidates(m: int) -> list[MatmulConfig]:
    out = []
    if m <= 16:
        for bn, stages in itertools.product((32, 64), (3, 4)):
            out.append(MatmulConfig("ptr", 16, bn, 128, num_warps=4, num_stages=stages))
    if m <= 64:
        for bn, bk, stages in itertools.product((32, 64), (64, 128), (3, 5)):
            if bk * stages * (64 + 2 * bn) * 2 <= 200_000:
                out.append(MatmulConfig("ptr", 64, bn, bk, num_warps=4, num_stages=stages))
    if m >= 64:
        tiles = itertools.product(((64, 4), (128, 8)), (64, 128), (64, 128), (3, 4), (False, True))
        for (bm, warps), bn, bk, stages, joint in tiles:
            smem = bk * stages * (bm + 2 * bn) * 2 + bm * bn * 2
            if smem > 220_000 or 2 * bm * bn > 4096 * warps:  # pipeline + epilogue; two fp32 accumulators
                continue
            out.append(MatmulConfig("tma", bm, bn, bk, num_warps=warps, num_stages=stages, joint=joint))
    return out


def fused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The one-launch gated kernel ``gated_matmul`` runs at ``x``'s row count outside ``GATED_CUBLAS_ROWS``: the Gluon
    kernel where ``gluon_gated_config`` names one, else the ``tl`` tiles of ``gated_config_for``."""
    m = x.shape[0]
    cfg = gluon_gated_config(m, INTER, HIDDEN, x.dtype, x.device)
    if cfg is None:
        return matmul_with_config(x, w, gated_config_for(m, INTER, HIDDEN, x.dtype, x.device), gated=True)
    out = torch.empty(m, INTER, dtype=x.dtype, device=x.device)
    gluon_matmul.forward(x, w, out, cfg, gated=True)
    return out


def sweep(ms: list[int], current_only: bool = False) -> list[dict]:
    dev = torch.device("cuda")
    dt = torch.bfloat16
    w = (torch.randn(2 * INTER, HIDDEN, device=dev) * HIDDEN**-0.5).to(dt)
    ws = weight_copies(w)
    x_all = torch.randn(max(ms) + 1000, HIDDEN, device=dev, dtype=dt)
    rows = []
    for m in ms:
        x = x_all[1000 - min(m, 1000) :][:m].contiguous()
        ref = ops.silu_mul(ops.matmul(x, w[:INTER]), ops.matmul(x, w[INTER:]))
        t_unfused = graph_ms_over(lambda w, x=x: ops.silu_mul(*ops.matmul(x, w).split(INTER, dim=-1)), ws)
        t_torch = graph_ms_over(lambda w, x=x: (lambda h: F.silu(h[:, :INTER]) * h[:, INTER:])(torch.mm(x, w.T)), ws)
        current = gated_config_for(m, INTER, HIDDEN, dt, dev)
        entry: dict = {
            "M": m,
            "unfused_graph_ms": t_unfused,
            "torch_graph_ms": t_torch,
            "library_graph_ms": graph_ms_over(lambda w, x=x: ops.gate_up_silu(x, w), ws),
            "fused_graph_ms": graph_ms_over(lambda w, x=x: fused(x, w), ws),
            "fused_matmul_graph_ms": graph_ms_over(lambda w, x=x: ops.matmul(x, w), ws),
            "torch_mm_graph_ms": graph_ms_over(lambda w, x=x: torch.mm(x, w.T), ws),
            "current": repr(current),
            "candidates": [],
        }
        for cfg in ([] if current_only else candidates(m)) + [current]:
            c = try_candidate(cfg, lambda w, x=x, cfg=cfg: matmul_with_config(x, w, cfg, gated=True), ref, ws)
            if "graph_ms" in c:
                c["speedup_vs_unfused"] = t_unfused / c["graph_ms"]
                c["ratio_vs_torch"] = t_torch / c["graph_ms"]
            entry["candidates"].append(c)
        pick_best(entry)
        entry["library_gated_bitwise"] = bool(torch.equal(ops.gate_up_silu(x, w), ref))
        line = (
            f"library {entry['library_graph_ms'] * 1e3:.1f} us (fused kernel {entry['fused_graph_ms'] * 1e3:.1f}), "
            f"unfused {t_unfused * 1e3:.1f} us (its matmul "
            f"{entry['fused_matmul_graph_ms'] * 1e3:.1f}, torch.mm {entry['torch_mm_graph_ms'] * 1e3:.1f}), torch "
            f"{t_torch * 1e3:.1f} us, {best_summary(entry)}"
        )
        print(f"[matmul_gated] M={m}: {line}", flush=True)
        rows.append(entry)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "matmul_gated_h200.json"))
    ap.add_argument("--ms", type=int, nargs="+", default=MS, help="row counts M to sweep")
    ap.add_argument(
        "--current-only",
        action="store_true",
        help="time only the library's configuration beside the unfused and torch paths (no sweep)",
    )
    args = ap.parse_args()
    require_cuda("matmul_gated.py")
    timing = (
        "median of triton.testing.do_bench_cudagraph (GPU time, no host launch overhead); per call over weight "
        f"copies totalling >= {4 * L2_BYTES >> 20} MiB (weights read from HBM)"
    )
    result: dict = header("matmul_gated", "triton") | {
        "shape": {"intermediate": INTER, "hidden": HIDDEN, "dtype": "bfloat16"},
        "timing": timing,
        "rows": [],
        "errors": {},
    }
    result["rows"] = sweep(args.ms, args.current_only)  # the only case: a failure raises, leaving --out as it was
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
