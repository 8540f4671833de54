"""Top-k / top-p thresholds of a decode step: the Triton kernel against the torch blocks it replaced on CUDA.

    python3 benchmarks/truncation_bench.py [--out benchmarks/results/truncation_h200.json]

``top_k_top_p_threshold`` on ``[B, V]`` fp32 logits (V = 151,936, the Qwen3 vocabulary) at B = 1, 4, 16, 64, 256,
for flat logits (standard deviation 1, about what the randomly initialized benchmark model gives) and peaked ones
(standard deviation 4), under top-k 50, top-p 0.95, both (50, 0.9) and top-p 0.7. ``triton_us`` is the library's
CUDA path (:mod:`rlexact.ops.triton_truncation`: full rows run the segmented plan), ``one_program_us`` the same
search with one program per row for every row length (the plan before the segmented one; top-k candidates use it
in both), ``torch_us`` the torch blocks (``RLEXACT_TRUNCATION=torch``), all timed as CUDA-graph replays. Per case:
the share of rows where the library and the torch blocks give the same threshold (``torch_equal_fraction``; the kept
set is the same in exact arithmetic, the masses are summed in different orders), whether the first rows equal the
float64 sort-based reference (``float64_equal_rows``), and whether rows computed alone equal the same rows of the
batch (``rows_alone_equal``). ``logits_read_us``: one read of the logits at the datasheet bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from common import ROOT, bench_graph, header, require_cuda
from rlexact.models.truncation import kept_logsumexp, top_k_top_p_threshold
from rlexact.ops import reference
from rlexact.ops import triton_truncation as tt

V = 151936
HBM_BYTES_PER_S = 4.8e12
ROWS = (1, 4, 16, 64, 256)
IMPLS = ("triton", "one_program", "torch")
SCALES = {"flat": 1.0, "peaked": 4.0}
SETTINGS = ((50, 1.0), (0, 0.95), (50, 0.9), (0, 0.7))
REFERENCE_ROWS = 4


@contextlib.contextmanager
def implementation(impl: str, vocab: int) -> Iterator[None]:
    """Inside the block the truncation functions run the CUDA path (``impl="triton"``), the top-p search's
    one-program plan for every row (``"one_program"``) or the torch blocks (``"torch"``)."""
    segment = tt.SEGMENT
    if impl == "torch":
        os.environ["RLEXACT_TRUNCATION"] = "torch"
    if impl == "one_program":
        tt.SEGMENT = vocab
    try:
        yield
    finally:
        os.environ.pop("RLEXACT_TRUNCATION", None)
        tt.SEGMENT = segment


def threshold(z: torch.Tensor, k: int, p: float, impl: str) -> torch.Tensor:
    """The library's threshold under :func:`implementation` ``impl``."""
    with implementation(impl, z.shape[1]):
        return top_k_top_p_threshold(z, k, p)


def case(b: int, scale: float, k: int, p: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b)
    z = torch.randn(b, V, device="cuda", generator=g) * scale
    row: dict = {"logits_read_us": b * V * 4 / HBM_BYTES_PER_S * 1e6}
    thr = {impl: threshold(z, k, p, impl) for impl in IMPLS}
    for impl in thr:
        row[f"{impl}_us"] = bench_graph(lambda impl=impl: threshold(z, k, p, impl)) * 1e3
    row["speedup"] = row["torch_us"] / row["triton_us"]
    row["speedup_over_one_program"] = row["one_program_us"] / row["triton_us"]
    row["torch_equal_fraction"] = (thr["triton"] == thr["torch"]).float().mean().item()
    n = min(REFERENCE_ROWS, b)
    row["float64_equal_rows"] = f"{int((thr['triton'][:n] == reference.truncation_thresholds(z[:n], k, p)).sum())}/{n}"
    alone = [threshold(z[i : i + 1], k, p, "triton") for i in (0, b - 1)]
    row["rows_alone_equal"] = all(torch.equal(a, thr["triton"][i : i + 1]) for a, i in zip(alone, (0, b - 1)))
    row |= kept_lse_case(z, thr["triton"])
    return row


def kept_lse(z: torch.Tensor, t: torch.Tensor, impl: str) -> torch.Tensor:
    """``kept_logsumexp`` under :func:`implementation` ``impl`` (``"triton"`` or ``"torch"``)."""
    with implementation(impl, z.shape[1]):
        return kept_logsumexp(z, t)


def kept_lse_case(z: torch.Tensor, t: torch.Tensor) -> dict:
    b = z.shape[0]
    out = kept_lse(z, t, "triton")
    z64 = z.double().masked_fill(z < t, float("-inf"))
    row = {impl_key: bench_graph(lambda impl=impl: kept_lse(z, t, impl)) * 1e3
           for impl, impl_key in (("triton", "kept_lse_us"), ("torch", "kept_lse_torch_us"))}  # fmt: skip
    row["kept_lse_max_abs_err_vs_float64"] = (out.double() - torch.logsumexp(z64, -1)).abs().max().item()
    alone = [kept_lse(z[i : i + 1], t[i : i + 1], "triton") for i in (0, b - 1)]
    row["kept_lse_rows_alone_equal"] = all(torch.equal(a, out[i : i + 1]) for a, i in zip(alone, (0, b - 1)))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "truncation_h200.json"))
    args = ap.parse_args()
    require_cuda("truncation_bench.py")
    t0 = time.time()
    cases: dict = {}
    for name, scale in SCALES.items():
        for k, p in SETTINGS:
            for b in ROWS:
                key = f"{name} top_k={k} top_p={p:g} B={b}"
                cases[key] = case(b, scale, k, p)
                print(f"[truncation_bench] {key}: {json.dumps(cases[key])}", flush=True)
    result: dict = header("truncation_bench", "triton") | {
        "timing": "median of do_bench_cudagraph (GPU time), microseconds",
        "vocab": V,
        "cases": cases,
        "elapsed_s": time.time() - t0,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
