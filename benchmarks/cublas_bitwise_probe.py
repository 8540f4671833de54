"""Whether cuBLAS (``torch.mm``) computes the exact matmul's bits for the Qwen3-1.7B projections, per row count.

For each projection and row count ``M`` the probe compares ``x @ w.T`` from ``torch.mm`` with
:func:`rlexact.ops.matmul` (bitwise, and how many elements differ), checks whether ``torch.mm``'s rows at ``M`` equal
the same rows inside a 4,096-row call (batch invariance), and times both as CUDA-graph replays over weight copies
that exceed the L2 cache four times (weights from HBM, as in a decode step). It runs once with PyTorch's default
``allow_bf16_reduced_precision_reduction`` and once with it off. A cuBLAS path could serve the generator's decode
rows only where it is bitwise the library's chain at that row count; this measures whether any is, and records the
library's own check (:func:`rlexact.ops.cublas_verify.same_bits`, probes with cancelling column pairs) next to the
comparison on plain random operands. The script sets ``RLEXACT_MATMUL_CUBLAS=0``, so ``rlexact.ops.matmul`` is the
library's kernel here at every row count; with ``--single-tile`` it also sets ``RLEXACT_MATMUL_SINGLE_TILE=1``,
whose one chain over all of K tells whether cuBLAS's down projection is the unsplit chain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["RLEXACT_MATMUL_CUBLAS"] = "0"  # before rlexact is imported: matmul is the library's kernel at every M
if "--single-tile" in sys.argv:  # before rlexact is imported: one static tile and one chain over all of K
    os.environ["RLEXACT_MATMUL_SINGLE_TILE"] = "1"

from common import ROOT, graph_ms_over, header, require_cuda, weight_copies  # noqa: E402

SHAPES = {"qkv_fused": (4096, 2048), "o": (2048, 2048), "gate_up_fused": (12288, 2048), "down": (2048, 6144)}
ROWS = (1, 16, 64, 128, 256, 512, 4096)


def probe_shape(n: int, k: int, rows: tuple[int, ...]) -> dict:
    import torch

    from rlexact.ops import cublas_verify, matmul

    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    x_all = torch.randn(max(rows), k, device="cuda", generator=gen).to(torch.bfloat16)
    ws = weight_copies(w)
    mm_all = torch.mm(x_all, w.t())
    out: dict = {"N": n, "K": k, "rows": {}}
    for m in rows:
        x = x_all[:m].contiguous()
        mm = torch.mm(x, w.t())
        ours = matmul(x, w)
        r = {
            "mm_equal_exact": bool(torch.equal(mm, ours)),
            "mm_elements_differing": int((mm != ours).sum()),
            "mm_rows_equal_inside_max_rows": bool(torch.equal(mm, mm_all[:m])),
            "library_check_same_bits": cublas_verify.same_bits(matmul, m, n, k, torch.bfloat16, x.device),
            "exact_rows_equal_inside_max_rows": bool(torch.equal(ours, matmul(x_all, w)[:m])),
            "exact_us": graph_ms_over(lambda wi, x=x: matmul(x, wi), ws) * 1e3,
            "torch_mm_us": graph_ms_over(lambda wi, x=x: torch.mm(x, wi.t()), ws) * 1e3,
        }
        out["rows"][str(m)] = r
        print(f"N={n} K={k} M={m}: {r}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cublas_bitwise_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    ap.add_argument("--single-tile", action="store_true",
                    help="compare with the library's static tile (RLEXACT_MATMUL_SINGLE_TILE=1): no row-tile variants "
                         "and no fixed K splits, so the down projection's chain runs over all of K")  # fmt: skip
    args = ap.parse_args()
    require_cuda("cublas_bitwise_probe.py")
    import torch

    result = header("cublas_bitwise_probe", "torch", "triton")
    result["dtype"] = "bfloat16"
    result["timing"] = "microseconds per call, CUDA-graph replays over weight copies exceeding L2 four times"
    result["cuda"] = torch.version.cuda
    result["results"] = {}
    for reduced in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
        part = result["results"][f"allow_bf16_reduced_precision_reduction={reduced}"] = {}
        for name in args.shapes:
            n, k = SHAPES[name]
            part[name] = probe_shape(n, k, tuple(args.rows))
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
