"""The persistent Gluon decode attention (``rlexact.ops.gluon_decode``) against the ``tl`` decode launch it replaces.

    timeout 300 python benchmarks/gluon_decode_probe.py [--out ...gluon_decode_probe_h200.json]

The ``tl`` decode launch (one query per sequence) runs one program per (sequence, KV head): at batch 256 that is
2,048 programs, about five waves of them, and its time has a fixed part that grows with the number of waves
(``attention_decode_scaling_h200.json``: each program's dependent loads of the sequence length, the block table and
its first K/V tile are exposed once per program). The Gluon kernel walks the same items with a few persistent
programs per SM, a producer warp streaming their pages through K/V rings that run ahead across items. Its rows must
be the ``tl`` kernel's bits: checked on mixed lengths with shuffled pages and NaN in every cache slot past a
sequence, with a perturbed-key negative control, and at every timing shape. Timings are CUDA-graph replays of both
launches (``{"GLUON": False}`` selects the ``tl`` one) on the same paged caches (pages in random order), with one
to three programs per SM (``gluon_decode.PROGRAMS_PER_SM``), and with two in the wide 64-row tile instead of the
transposed one (``gluon_decode.TRANSPOSED_MAX_HP`` 0: ``gluon2_wide``).

``--variants`` adds launches of the same kernel in other shapes, each ``PxS``: ``P`` programs per SM and ``S``-deep K
and V rings (``gluon_decode.SLOTS``; three programs fit the SM's shared memory and registers with two-deep rings). A
shape ``BxCm`` has mixed lengths ``C - 16 .. C + 15`` (each sequence's last page partial in 15 of 16 cases, as in a
decode step) with NaN in the stale slots, instead of ``C`` keys everywhere. Variants that changed the kernel's code
(a producer loading the next item's metadata early, a consumer overlapping items, the query loaded in the wgmma
operand layout, a page-only V tail) were measured at the commits their result files record and removed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import torch

from attention_configs import DT, HKV, HQ, PAGE, D, decode_case, run
from common import ROOT, bench_graph, header, require_cuda, swapped, variant_ints
from rlexact.ops import gluon_decode
from rlexact.ops.gluon_attention import gluon, rebind

if gluon is not None:
    from triton.experimental.gluon import language as gl

TL = {"GLUON": False}

CHECK_LENS = (
    [1, 2, 15, 16, 17, 63, 64, 65, 100, 128, 129, 1000, 1023, 1024],
    [7] * 300,
    list(range(1, 1025, 37)) * 3,
)


def mixed_case(lens: list[int]) -> tuple:
    """A decode case with the given context lengths, pages shuffled across sequences, and stale NaNs in every
    cache slot past a sequence (a read past the end would show)."""
    g = torch.Generator(device="cuda").manual_seed(len(lens))
    nblk = [math.ceil(n / PAGE) for n in lens]
    width = max(nblk)
    total = sum(nblk) + 1
    kc = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=DT, generator=g)
    vc = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=DT, generator=g)
    perm = torch.randperm(total, device="cuda", generator=g).to(torch.int32)
    tables = torch.full((len(lens), width), int(perm[-1]), device="cuda", dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        tables[i, : nblk[i]] = perm[used : used + nblk[i]]
        last = int(perm[used + nblk[i] - 1])
        kc[last, n - (nblk[i] - 1) * PAGE :] = float("nan")
        vc[last, n - (nblk[i] - 1) * PAGE :] = float("nan")
        used += nblk[i]
    kc[int(perm[-1])] = float("nan")
    vc[int(perm[-1])] = float("nan")
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=DT, generator=g)
    cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    return q, kc, vc, cu, torch.tensor(lens, device="cuda", dtype=torch.int32), tables


@functools.cache
def ring_kernel(slots: int) -> object:
    """The library's decode kernel with ``slots``-deep K and V rings (built once per depth, so it compiles once and
    its id stays valid for the launcher cache)."""
    g = gluon_decode
    depth = {"SLOTS": gl.constexpr(slots)}
    parts = {name: rebind(getattr(g, name), **depth) for name in ("_consumer", "_producer", "_rings")}
    return rebind(g._attn_decode_kernel, **parts)


def parse_variant(spec: str) -> tuple[int, int]:
    """``PxS`` -> ``(programs per SM, ring depth)``."""
    per_sm, slots = variant_ints(spec, "gluon_decode_probe", "PxS, e.g. 2x3", (1, 1))
    return per_sm, slots


def variant_run(case: tuple, spec: str) -> torch.Tensor:
    per_sm, slots = parse_variant(spec)
    with swapped(gluon_decode, "_attn_decode_kernel", ring_kernel(slots)):
        return probe(case, per_sm)


def probe(case: tuple, per_sm: int, wide: bool = False) -> torch.Tensor:
    """The library's launch of ``case`` (the Gluon kernel) with ``per_sm`` programs per SM; ``wide`` keeps every item
    in the 64-row tile (no transposed consumer)."""
    with swapped(gluon_decode, "PROGRAMS_PER_SM", per_sm), swapped(gluon_decode, "TRANSPOSED_MAX_HP",
                                                                    0 if wide else gluon_decode.TRANSPOSED_MAX_HP):
        return run(case, None)


LAUNCHES = ((1, False), (2, False), (3, False), (2, True))
"""``(programs per SM, wide)`` of the library kernel's launches each check and shape runs."""


def launch_name(per_sm: int, wide: bool) -> str:
    return f"gluon{per_sm}" + ("_wide" if wide else "")


def check(lens: list[int], variants: list[str]) -> dict:
    case = mixed_case(lens)
    q, k, v, cu, lens_t, tables = case
    if not gluon_decode.supported(q, k, v, 64, 1024):
        raise SystemExit("gluon_decode_probe: needs an sm_90 GPU and a Triton with Gluon")
    ref = run(case, TL)
    row: dict = {"n": len(lens), "max_len": max(lens), "tl_finite": bool(torch.isfinite(ref).all())}
    k2 = k.clone()
    k2[int(tables[-1, 0]), 0, 0, 0] += 1.0  # the last sequence's first key
    for per_sm, wide in LAUNCHES:
        name = launch_name(per_sm, wide)
        row[f"bitwise_equal_tl_{name}"] = bool(torch.equal(probe(case, per_sm, wide), ref))
        row[f"negative_control_differs_{name}"] = not torch.equal(probe((q, k2, v, cu, lens_t, tables), per_sm, wide),
                                                                  ref)  # fmt: skip
    for spec in variants:
        row[f"bitwise_equal_tl_{spec}"] = bool(torch.equal(variant_run(case, spec), ref))
        row[f"negative_control_differs_{spec}"] = not torch.equal(variant_run((q, k2, v, cu, lens_t, tables), spec),
                                                                  ref)  # fmt: skip
    return row


def measure(shape: str, variants: list[str]) -> dict:
    mixed = shape.endswith("m")
    b, ctx = (int(x) for x in shape.rstrip("m").split("x"))
    lens = [ctx - 16 + i % 32 for i in range(b)] if mixed else [ctx] * b
    case = mixed_case(lens) if mixed else decode_case(b, ctx)
    ref = run(case, TL)
    row: dict = {"tl_us": bench_graph(lambda: run(case, TL)) * 1e3}
    for per_sm, wide in LAUNCHES:
        name = launch_name(per_sm, wide)
        row[f"{name}_bitwise_equal_tl"] = bool(torch.equal(probe(case, per_sm, wide), ref))
        row[f"{name}_us"] = bench_graph(lambda per_sm=per_sm, wide=wide: probe(case, per_sm, wide)) * 1e3
    for spec in variants:
        row[f"{spec}_bitwise_equal_tl"] = bool(torch.equal(variant_run(case, spec), ref))
        row[f"{spec}_us"] = bench_graph(lambda spec=spec: variant_run(case, spec)) * 1e3
    row["kv_roofline_us"] = 2 * sum(lens) * HKV * D * DT.itemsize / 4.8e12 * 1e6
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_decode_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["256x160", "256x256", "256x384", "128x256", "64x256", "64x1024",
                                                    "32x1024", "512x256"])  # fmt: skip
    ap.add_argument("--variants", nargs="*", default=[], help="PxS: programs per SM x ring depth")
    args = ap.parse_args()
    for spec in args.variants:
        parse_variant(spec)
    require_cuda("gluon_decode_probe.py")
    t0 = time.time()
    result: dict = header("gluon_decode_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "page": PAGE,
        "dtype": "bfloat16",
        "slots": gluon_decode.SLOTS.value,
        "library_programs_per_sm": gluon_decode.PROGRAMS_PER_SM,
        "timing": "median of do_bench_cudagraph, microseconds; kv_roofline_us: K/V bytes at 4.8 TB/s",
        "variants": args.variants,
        "checks": [check(lens, args.variants) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_decode_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        result["shapes"][shape] = row = measure(shape, args.variants)
        print("[gluon_decode_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
