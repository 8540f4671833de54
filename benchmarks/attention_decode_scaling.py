"""How the exact decode attention launch's time splits into a fixed part and a per-key part, per batch size.

    python3 benchmarks/attention_decode_scaling.py [--out benchmarks/results/attention_decode_scaling_h200.json]

The library's paged decode launch (bf16, head_dim 128, 16 query / 8 KV heads, 16-token pages scattered at random) is
timed as CUDA-graph replays over a grid of batch sizes and context lengths (every sequence of a batch at the same
length). Per batch, a least-squares line ``time = fixed + per_key * keys`` over the contexts gives the fixed part
(``fixed_us``) and the bandwidth of the per-key part (``per_key_tb_s``: K/V bytes per key position over
``per_key``). A fixed part that grows with the batch is paid per program (or per wave of programs); one that does not
is paid per launch. ``empty_kernel_us``: a one-program Triton kernel replayed the same way, the floor of any launch.
``decode_kernel`` names the kernel the library's dispatch runs for these launches (``gluon_decode``: the persistent
Gluon kernel of :mod:`rlexact.ops.gluon_decode`, whose programs walk the (sequence, head group) items; ``tl``: the
``tl`` launch whose configuration ``library_decode_launch`` lists).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from attention_configs import DT, HKV, SHAPE, D, decode_case, run
from common import ROOT, bench_graph, header, require_cuda
from rlexact.ops import gluon_decode
from rlexact.ops import triton_attention as ta
from rlexact.ops.triton_shared import COMPILE_OPTIONS

BATCHES = (32, 64, 128, 256, 512)
CONTEXTS = (16, 64, 160, 256, 384, 512)


@triton.jit
def _empty_kernel(x_ptr):
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros([16], dtype=tl.float32))


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` over ``xs``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_decode_scaling_h200.json"))
    args = ap.parse_args()
    require_cuda("attention_decode_scaling.py")
    t0 = time.time()
    torch.manual_seed(0)
    library = ta._fwd_config(D, DT) | ta.DECODE_LAUNCH_16BIT
    buf = torch.empty(16, device="cuda")
    probe = decode_case(BATCHES[0], CONTEXTS[0])
    gluon = gluon_decode.supported(probe[0], probe[1], probe[2], library["BLOCK_N"], library["SPLIT"])
    del probe
    result: dict = header("attention_decode_scaling", "triton") | {
        "shape": SHAPE,
        "decode_kernel": "gluon_decode" if gluon else "tl",
        "library_decode_launch": dict(ta.DECODE_LAUNCH_16BIT),
        "timing": "median of do_bench_cudagraph (GPU time), microseconds",
        "empty_kernel_us": bench_graph(lambda: _empty_kernel[(1,)](buf, **COMPILE_OPTIONS)) * 1e3,
        "batches": {},
    }
    for b in BATCHES:
        times = {}
        for ctx in CONTEXTS:
            case = decode_case(b, ctx)
            times[ctx] = bench_graph(lambda case=case: run(case, library)) * 1e3
            del case
        fixed, per_key = fit_line([float(c) for c in CONTEXTS], [times[c] for c in CONTEXTS])
        key_bytes = 2 * b * HKV * D * DT.itemsize  # K and V of one key position over the batch
        result["batches"][str(b)] = {
            "us": {str(c): t for c, t in times.items()},
            "fixed_us": fixed,
            "per_key_us": per_key,
            "per_key_tb_s": key_bytes / per_key / 1e6,
            "programs": b * HKV,
        }
        print(
            f"[attention_decode_scaling] batch {b}: fixed {fixed:.1f} us, {key_bytes / per_key / 1e6:.2f} TB/s per key",
            times,
        )
    result["elapsed_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        "[attention_decode_scaling] empty kernel",
        f"{result['empty_kernel_us']:.2f} us",
        f"({result['elapsed_s']:.0f} s)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
