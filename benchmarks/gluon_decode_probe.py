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
and with two programs per SM (``gluon_decode.PROGRAMS_PER_SM``).

``--variants`` adds launches of the same kernel in other shapes, each ``PxS[-page]``: ``P`` programs per SM, ``S``-deep
K and V rings (``gluon_decode.SLOTS``; three programs fit the SM's shared memory and registers with two-deep rings),
and with ``-page`` the V rows past a sequence zeroed only in its last, partial page (pages past it arrive
zero-filled), skipped where the sequence ends on a page boundary. A shape ``BxCm`` has mixed lengths
``C - 16 .. C + 15`` (each sequence's last page partial in 15 of 16 cases, as in a decode step) with NaN in the stale
slots, instead of ``C`` keys everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from attention_configs import DT, HKV, HQ, PAGE, D, decode_case, run
from common import ROOT, bench_graph, header
from rlexact.ops import gluon_decode
from rlexact.ops.gluon_attention import cta_barrier, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

    PG = gl.constexpr(gluon_decode.PAGE)
    PW = gl.constexpr(gluon_decode.WARPS)

    @gluon.jit
    def _zero_stale_page(v_buf, row0, n, BLOCK_N: gl.constexpr, blk: gl.constexpr):
        """Zero the rows of the V tile in ``v_buf`` (first key ``row0``) at keys ``>= n`` inside key ``n``'s page; the
        tile's later pages were read from past the cache (TMA's zero fill)."""
        if n % PG != 0:
            r = n - row0
            page_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PW, 1], [1, 0])
            rows = gl.arange(0, PG, layout=gl.SliceLayout(1, page_layout))
            for pg in gl.static_range(BLOCK_N // PG):
                if r // PG == pg:
                    buf = v_buf.slice(pg * PG, PG)
                    v = buf.load(page_layout)
                    buf.store(gl.where((pg * PG + rows < r)[:, None], v, 0.0))
            fence_async_shared()
            cta_barrier()

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


def _rebind(jit_fn: object, **names: object) -> object:
    """A copy of a Gluon function whose global ``names`` resolve to other objects (its constexpr annotations kept)."""
    f = jit_fn.fn
    copy = types.FunctionType(f.__code__, dict(f.__globals__, **names), f.__name__, f.__defaults__, f.__closure__)
    copy.__annotations__ = dict(f.__annotations__)
    return gluon.jit(copy)


_KERNELS: dict[tuple[int, bool], object] = {}
"""``(slots, page tail)`` -> the rebound decode kernel (kept alive: the launcher cache keys on its id)."""


@contextlib.contextmanager
def kernel_shape(slots: int, page_tail: bool) -> Iterator[None]:
    """The library's decode kernel with ``slots``-deep rings and, with ``page_tail``, :func:`_zero_stale_page`."""
    key = (slots, page_tail)
    if key not in _KERNELS:
        g = gluon_decode
        depth = {"SLOTS": gl.constexpr(slots)}
        consumer = _rebind(g._consumer, **depth, **({"zero_tail_rows": _zero_stale_page} if page_tail else {}))
        _KERNELS[key] = _rebind(g._attn_decode_kernel, _consumer=consumer, _producer=_rebind(g._producer, **depth),
                                _rings=_rebind(g._rings, **depth))  # fmt: skip
    saved = gluon_decode._attn_decode_kernel
    gluon_decode._attn_decode_kernel = _KERNELS[key]
    try:
        yield
    finally:
        gluon_decode._attn_decode_kernel = saved


def parse_variant(spec: str) -> tuple[int, int, bool]:
    """``PxS[-page]`` -> ``(programs per SM, ring depth, page tail)``."""
    shape, _, tail = spec.partition("-")
    per_sm, slots = (int(x) for x in shape.split("x"))
    if tail not in ("", "page") or per_sm < 1 or slots < 1:
        raise SystemExit(f"gluon_decode_probe: bad variant {spec!r}; expected PxS or PxS-page, e.g. 3x2-page")
    return per_sm, slots, tail == "page"


def variant_run(case: tuple, spec: str) -> torch.Tensor:
    per_sm, slots, page_tail = parse_variant(spec)
    with kernel_shape(slots, page_tail):
        return probe(case, per_sm)


def probe(case: tuple, per_sm: int) -> torch.Tensor:
    """The library's launch of ``case`` (the Gluon kernel) with ``per_sm`` programs per SM."""
    saved = gluon_decode.PROGRAMS_PER_SM
    gluon_decode.PROGRAMS_PER_SM = per_sm
    try:
        return run(case, None)
    finally:
        gluon_decode.PROGRAMS_PER_SM = saved


def check(lens: list[int], variants: list[str]) -> dict:
    case = mixed_case(lens)
    q, k, v, cu, lens_t, tables = case
    if not gluon_decode.supported(q, k, v, 64, 1024):
        raise SystemExit("gluon_decode_probe: needs an sm_90 GPU and a Triton with Gluon")
    ref = run(case, TL)
    row: dict = {"n": len(lens), "max_len": max(lens), "tl_finite": bool(torch.isfinite(ref).all())}
    for per_sm in (1, 2):
        row[f"bitwise_equal_tl_{per_sm}"] = bool(torch.equal(probe(case, per_sm), ref))
    k2 = k.clone()
    k2[int(tables[-1, 0]), 0, 0, 0] += 1.0  # the last sequence's first key
    row["negative_control_differs"] = not torch.equal(probe((q, k2, v, cu, lens_t, tables), 2), ref)
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
    for per_sm in (1, 2):
        row[f"gluon{per_sm}_bitwise_equal_tl"] = bool(torch.equal(probe(case, per_sm), ref))
        row[f"gluon{per_sm}_us"] = bench_graph(lambda per_sm=per_sm: probe(case, per_sm)) * 1e3
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
    ap.add_argument("--variants", nargs="*", default=[], help="PxS[-page]: programs per SM, ring depth, page tail")
    args = ap.parse_args()
    for spec in args.variants:
        parse_variant(spec)
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
