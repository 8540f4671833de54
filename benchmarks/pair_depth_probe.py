"""The paired prefill attention's lookahead: its K/V ring depth against its item slots, per prefill shape.

    timeout 300 python benchmarks/pair_depth_probe.py [--variants 4x2 3x3 2x4 3x2] [--out ...pair_depth_probe_h200.json]

The persistent pair (:mod:`rlexact.ops.gluon_attention_pair`) runs ``R``-deep K and V rings and publishes up to ``I``
items (their records and query tiles) ahead of its consumers; the shared memory holds about ``R = 4, I = 2``. At
short sequences an item needs few key tiles (4.5 on average at 64 × 512), so two items are all the producer can run
ahead however deep the rings are, and the next item's lookup and query copy are exposed between items. This builds
the kernel at other depths ``RxI`` (:func:`rlexact.ops.gluon_attention_pair.kernel`) and times the packed forward
at each of ``ops_bench.py``'s prefill shapes (Qwen3-1.7B's heads, the same timer as that file's ``gluon_kernels``),
after checking on packed mixed lengths (with NaN in a sequence's keys, which no other sequence's row may read) that
every depth gives the library kernel's bits and that a perturbed key changes them.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from common import ROOT, bench, header, packed_attention_inputs, swapped, variant_pair
from ops_bench import PREFILL_CASES
from rlexact.ops import gluon_attention, gluon_attention_pair
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
PAIR = {"PAIR": True}
CHECK_LENS = [1, 37, 200, 333, 64, 65, 1100, 2500, 1024, 1025, 9]


def parse(spec: str) -> tuple[int, int]:
    """``RxI`` -> ``(ring depth, item depth)``."""
    return variant_pair(spec, "pair_depth_probe", "RxI with R >= 2 and I >= 1, e.g. 3x3", (2, 1))


@functools.cache
def builder(spec: str) -> functools.partial:
    """:func:`rlexact.ops.gluon_attention_pair.kernel` at depths ``spec`` (parsed once per variant)."""
    ring, items = parse(spec)
    return functools.partial(gluon_attention_pair.kernel, ring_depth=ring, item_depth=items)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, spec: str) -> torch.Tensor:
    """The library's packed forward through the pair built at depths ``spec``."""
    out = torch.empty_like(q)
    with swapped(gluon_attention_pair, "kernel", builder(spec)):
        ta._forward(q, k, v, cu, None, None, D**-0.5, out, cfg=PAIR)
    return out


def check(specs: list[str]) -> dict:
    q, k, v, cu = packed_attention_inputs(CHECK_LENS, HQ, HKV, D)
    k, v = k.clone(), v.clone()
    one = slice(CHECK_LENS[0], CHECK_LENS[0] + CHECK_LENS[1])
    k[one], v[one] = float("nan"), float("nan")
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    keep[one] = False
    ref = torch.empty_like(q)
    ta._forward(q, k, v, cu, None, None, D**-0.5, ref, cfg=PAIR)
    k2 = k.clone()
    k2[-1, 0, 0] += 1.0  # the last sequence's last key
    row: dict = {"lens": CHECK_LENS, "reference_finite_outside_nan_sequence": bool(torch.isfinite(ref[keep]).all())}
    for spec in specs:
        row[f"{spec}_bitwise_equal_library"] = bool(torch.equal(forward(q, k, v, cu, spec)[keep], ref[keep]))
        row[f"{spec}_negative_control_differs"] = not torch.equal(forward(q, k2, v, cu, spec)[keep], ref[keep])
    return row


def measure(b: int, s: int, specs: list[str]) -> dict:
    q, k, v, cu = packed_attention_inputs([s] * b, HQ, HKV, D)
    ref = torch.empty_like(q)
    ta._forward(q, k, v, cu, None, None, D**-0.5, ref, cfg=PAIR)
    row: dict = {}
    for spec in specs:
        row[f"{spec}_bitwise_equal_library"] = bool(torch.equal(forward(q, k, v, cu, spec), ref))
        row[f"{spec}_ms"] = bench(lambda spec=spec: forward(q, k, v, cu, spec))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = f"{gluon_attention_pair.RING_DEPTH}x{gluon_attention_pair.ITEM_DEPTH}"
    ap.add_argument("--variants", nargs="+", default=[default, "3x3", "2x4", "3x2"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pair_depth_probe_h200.json"))
    args = ap.parse_args()
    for spec in args.variants:
        parse(spec)
    if not torch.cuda.is_available():
        raise SystemExit("pair_depth_probe: needs an sm_90 GPU and a Triton with Gluon (no CUDA device here)")
    q, k, v, cu = packed_attention_inputs([64], HQ, HKV, D)
    if not (gluon_attention.supported(q, k, v, gluon_attention.BLOCK_N) and gluon_attention_pair.takes(q)):
        raise SystemExit("pair_depth_probe: needs an sm_90 GPU and a Triton with Gluon")
    result: dict = header("pair_depth_probe", "triton") | {
        "library_depths": default,
        "heads": [HQ, HKV, D],
        "timing": "bench (triton.testing.do_bench, median ms, L2 flushed), as ops_bench.py's gluon_kernels",
        "checks": check(args.variants),
        "shapes": {},
    }
    print("[pair_depth_probe] checks", json.dumps(result["checks"]), flush=True)
    for b, s in PREFILL_CASES:
        result["shapes"][f"{b}x{s}"] = row = measure(b, s, args.variants)
        print("[pair_depth_probe]", f"{b}x{s}", json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = all(v for k, v in result["checks"].items() if k != "lens") and all(
        v for row in result["shapes"].values() for k, v in row.items() if k.endswith("_equal_library"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
