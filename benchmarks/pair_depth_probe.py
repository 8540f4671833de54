"""The paired prefill attention's build: its K/V ring depth, item slots, key tile and schedules, per prefill shape.

    timeout 300 python benchmarks/pair_depth_probe.py [--variants 3x3SFTZM 3x3 3x3S 3x3W 4x3SFTZM 2x2x128] [--out ...]

The persistent pair (:mod:`rlexact.ops.gluon_attention_pair`) runs ``R``-deep K and V rings and ``I`` item slots
(records and query tiles); a consumer releases a slot one item late, while the item's output store still reads its query
tile, so the producer runs ``I - 2`` items ahead. At short sequences an item needs few key tiles, so the item slots, not
the rings, bound how far the producer runs ahead, and an item's lookup and query copy not started early are exposed;
shared memory bounds both depths together.

This builds the kernel (:class:`rlexact.ops.gluon_attention_pair.Build`) at other depths ``RxI`` and, as ``RxIxN``, with
key tiles of ``N`` keys, then with any of the schedules that keep the bits, one letter each in this order: ``S`` issues
each key tile's row-sum wgmma with its P @ V, ``F`` takes a query tile's first KV split as its state without the fold,
``T`` takes each row's maximum as a tree, ``Z`` leaves a KV split's sum unscaled at its first key tile, ``M`` masks each
score with one comparison, ``W`` runs one consumer partition of twice the warps for both query tiles of an item,
``C`` (with ``S``) keeps a split's sum per column of an 8-column row-sum product, reduced once per split (``C16``: of
a 16-column product). It
times the packed forward at each of ``ops_bench.py``'s prefill shapes (Qwen3-1.7B's heads, the same timer as that file's
``gluon_kernels``). Checks first, on packed mixed lengths with NaN in one sequence's keys (which no other sequence's row
may read): a variant at the library's key tile must give the library kernel's bits; one at another key tile changes the
bit contract (the online softmax runs per tile), so it must instead be deterministic and as close to a float32 reference
as the library; and a perturbed key must change every variant's output.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from common import ROOT, bench, header, packed_attention_inputs, require_cuda, variant_ints
from ops_bench import PREFILL_CASES
from rlexact.ops import gluon_attention, gluon_attention_pair
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
PAIR = {"PAIR": True}
CHECK_LENS = [1, 37, 200, 333, 64, 65, 1100, 2500, 1024, 1025, 9]
LIBRARY = gluon_attention_pair.LIBRARY_BUILD
FORM = "RxI or RxIxN, then any of S, F, T, Z, M, W, C (or C16) in this order (R >= 2, I >= 2, N 64 or 128)"


@functools.cache
def parse(spec: str) -> gluon_attention_pair.Build:
    """``RxI[xN][S][F][T][Z][M][W][C[16]]`` -> the build; exits on a malformed spec."""
    m = re.fullmatch(r"([0-9x]+)(S?)(F?)(T?)(Z?)(M?)(W?)(C?)(16)?", spec)
    if m is None:
        raise SystemExit(f"pair_depth_probe: bad variant {spec!r}; expected {FORM}")
    minimum = (2, 2) if m[1].count("x") == 1 else (2, 2, 64)
    ring, items, *tile = variant_ints(m[1], "pair_depth_probe", FORM, minimum)
    try:
        return gluon_attention_pair.Build(ring, items, tile[0] if tile else LIBRARY.tile_n, m[2] == "S", m[3] == "F",
                                          m[4] == "T", m[5] == "Z",
                                          m[6] == "M", m[7] == "W", m[8] == "C",
                                          8 if m[8] == "C" and m[9] is None else 16)  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"pair_depth_probe: bad variant {spec!r}: {e}") from None


def name(build: gluon_attention_pair.Build) -> str:
    """The spec of ``build`` (:func:`parse`'s inverse, the key tile always written)."""
    on = (build.sum_with_pv, build.first_fold, build.tree_max, build.zero_start, build.one_bound, build.wide,
          build.column_sums)  # fmt: skip
    flags = "".join(c for c, o in zip("SFTZMWC", on) if o)
    if build.column_sums and build.row_sum_n == 16:
        flags += "16"
    return f"{build.ring_depth}x{build.item_depth}x{build.tile_n}{flags}"


@functools.cache
def geometry(dtype: torch.dtype) -> tuple[int, int]:
    """The library's ``(query heads per tile, KV split)`` for these heads in ``dtype`` (outside the timed calls)."""
    return ta.heads_per_tile(HQ, HKV, 16 * gluon_attention.WARPS), ta._launch_config(D, dtype, False)["SPLIT"]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, spec: str) -> torch.Tensor:
    """The packed forward through the pair built as ``spec``, with the library's heads per tile and KV split."""
    out = torch.empty_like(q)
    hp, split = geometry(q.dtype)
    gluon_attention_pair.forward(q, k, v, cu, D**-0.5, out, hp, split, build=parse(spec))
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Float32 causal attention per sequence (the correctness reference)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(HQ // HKV, 0) for x in (ks, vs))
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


def check(specs: list[str], save: Callable[[dict], None]) -> dict:
    """The checks of each variant (the module docstring's), ``save``d with those before it after each variant."""
    q, k, v, cu = packed_attention_inputs(CHECK_LENS, HQ, HKV, D)
    k, v = k.clone(), v.clone()
    one = slice(CHECK_LENS[0], CHECK_LENS[0] + CHECK_LENS[1])
    k[one], v[one] = float("nan"), float("nan")
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    keep[one] = False
    lib = torch.empty_like(q)
    ta._forward(q, k, v, cu, None, None, D**-0.5, lib, cfg=PAIR)
    exact = reference(q, k, v, cu)[keep]
    lib_err = (lib[keep].float() - exact).abs().max().item()
    k2 = k.clone()
    k2[-1, 0, 0] += 1.0  # the last sequence's last key
    row: dict = {"lens": CHECK_LENS, "library_finite_outside_nan_sequence": bool(torch.isfinite(lib[keep]).all()),
                 "library_max_abs_err_vs_fp32": lib_err}  # fmt: skip
    for spec in specs:
        out = forward(q, k, v, cu, spec)[keep]
        if parse(spec).tile_n == gluon_attention.BLOCK_N:
            row[f"{spec}_bitwise_equal_library"] = bool(torch.equal(out, lib[keep]))
        else:
            err = (out.float() - exact).abs().max().item()
            row[f"{spec}_max_abs_err_vs_fp32"] = err
            row[f"{spec}_as_close_as_library"] = bool(torch.isfinite(out).all()) and err <= 2 * lib_err
            row[f"{spec}_deterministic"] = bool(torch.equal(out, forward(q, k, v, cu, spec)[keep]))
        row[f"{spec}_negative_control_differs"] = not torch.equal(forward(q, k2, v, cu, spec)[keep], out)
        save(row)
    return row


def measure(b: int, s: int, specs: list[str]) -> dict:
    q, k, v, cu = packed_attention_inputs([s] * b, HQ, HKV, D)
    lib = torch.empty_like(q)
    ta._forward(q, k, v, cu, None, None, D**-0.5, lib, cfg=PAIR)
    row: dict = {}
    for spec in specs:
        if parse(spec).tile_n == gluon_attention.BLOCK_N:
            row[f"{spec}_bitwise_equal_library"] = bool(torch.equal(forward(q, k, v, cu, spec), lib))
        row[f"{spec}_ms"] = bench(lambda spec=spec: forward(q, k, v, cu, spec))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    others = ["3x3", "3x3SFTZM", "3x3SFTZMC16", "3x3S", "3x3SC", "3x3W", "3x3SFTZMW"]
    variants: list[str] = []  # the library first, then each other build once
    for spec in [name(LIBRARY), *others]:
        if all(parse(spec) != parse(v) for v in variants):
            variants.append(spec)
    ap.add_argument("--variants", nargs="+", default=variants)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pair_depth_probe_h200.json"))
    args = ap.parse_args()
    builds = [name(parse(spec)) for spec in args.variants]
    repeated = sorted({b for b in builds if builds.count(b) > 1})
    if repeated:  # results are keyed by spec: a build given twice would overwrite its own row
        raise SystemExit(f"pair_depth_probe: {', '.join(repeated)} given more than once in --variants; give each "
                         "build once (run the script again to repeat a measurement)")  # fmt: skip
    require_cuda("pair_depth_probe.py")
    q, k, v, cu = packed_attention_inputs([64], HQ, HKV, D)
    if not (gluon_attention.supported(q, k, v, gluon_attention.BLOCK_N) and gluon_attention_pair.takes(q)):
        raise SystemExit("pair_depth_probe: needs an sm_90 GPU and a Triton with Gluon")
    result: dict = header("pair_depth_probe", "triton") | {
        "library_build": name(LIBRARY),
        "heads": [HQ, HKV, D],
        "timing": "bench (triton.testing.do_bench, median ms, L2 flushed), as ops_bench.py's gluon_kernels",
        "checks": {},
        "shapes": {},
    }

    def save(checks: dict | None = None) -> None:  # after each variant's checks and each shape: a hang keeps these
        if checks is not None:
            result["checks"] = checks
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    check(args.variants, save)
    print("[pair_depth_probe] checks", json.dumps(result["checks"]), flush=True)
    for b, s in PREFILL_CASES:
        result["shapes"][f"{b}x{s}"] = row = measure(b, s, args.variants)
        print("[pair_depth_probe]", f"{b}x{s}", json.dumps(row), flush=True)
        save()
    flags = [v for k, v in result["checks"].items() if isinstance(v, bool)]
    flags += [v for row in result["shapes"].values() for k, v in row.items() if k.endswith("_equal_library")]
    return 0 if all(flags) else 1


if __name__ == "__main__":
    raise SystemExit(main())
