"""Probe: the library's warp-specialized Gluon matmul (sm_90) against its ``tl`` matmul and ``torch.mm``.

    timeout 300 python benchmarks/gluon_matmul_probe.py [--out ...gluon_matmul_probe_h200.json]

At the decode step's 256 rows the library's ``tl`` matmul runs at about 0.8x cuBLAS on the Qwen3-1.7B projections
(``matmul_variants_m256_cold_h200.json``). :mod:`rlexact.ops.gluon_matmul` splits producer and consumer explicitly
(a TMA producer warp, a four-deep ring, ``BM / 16`` consumer warps chaining asynchronous wgmmas in ascending K), plain
or SiLU-gated. Its rows must equal the library's bitwise (plain: ``matmul``, gated: ``gated_matmul``, which the
decode step runs for the MLP's gate and up projections): checked at several row counts for every tile shape before
it is timed. Timings: CUDA-graph replays over weight copies that exceed L2 four times (weights from HBM, as in a
decode step), at the given row counts.

``--epilogues`` also times the gated launch with its SiLU formula swapped (``div_rn``: a correctly rounded division in
place of the library's fast one, the formula before; ``product``: ``gate * up``, no SiLU), to measure what the
epilogue's arithmetic costs; those rows are not the library's bits and say so. The operands are of unit variance
unless ``--unit-products`` scales the weights by ``1 / sqrt(K)``: the default's products are large enough that
``exp(-gate)`` overflows for a few percent of the gates, which sends a correctly rounded division down its slow path.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from common import ROOT, graph_ms_over, header, require_cuda, swapped, weight_copies
from rlexact.ops import gluon_matmul
from rlexact.ops.gluon_attention import rebind
from rlexact.ops.gluon_matmul import GluonMatmulConfig, forward
from rlexact.ops.triton_matmul import gated_matmul, matmul

SHAPES = {"gate_up_fused": (12288, 2048), "qkv_fused": (4096, 2048), "o": (2048, 2048)}
"""Plain products ``[N, K]`` (none with fixed K splits); ``gate_up_fused`` also runs gated (``[2N, K]`` gate rows then
up rows)."""
CONFIGS = (
    GluonMatmulConfig(128, 256),
    GluonMatmulConfig(128, 128),
    GluonMatmulConfig(64, 128, per_sm=2),
    GluonMatmulConfig(64, 64, per_sm=2),
)
GATED_CONFIGS = (
    GluonMatmulConfig(128, 128),
    GluonMatmulConfig(128, 64),
    GluonMatmulConfig(64, 128),
    GluonMatmulConfig(64, 64, per_sm=2),
)
CHECK_ROWS = (37, 256, 1000)


@gluon.jit
def _silu_div_rn(gate, up):
    return gl.div_rn(gate, 1.0 + gl.exp(-gate)) * up


@gluon.jit
def _product(gate, up):
    return gate * up


EPILOGUES = {"div_rn": _silu_div_rn, "product": _product}
"""Swapped SiLU formulas of ``--epilogues`` (diagnostic: not the library's bits)."""


@functools.cache
def epilogue_kernel(formula: str) -> object:
    """The library's matmul kernel with its SiLU formula replaced by ``EPILOGUES[formula]`` (built once per formula,
    so it compiles once and its id stays valid for the launcher cache)."""
    store = rebind(gluon_matmul._store, _silu_times=EPILOGUES[formula])
    return rebind(gluon_matmul._mm_kernel, _consumer=rebind(gluon_matmul._consumer, _store=store))


def run(x: torch.Tensor, w: torch.Tensor, cfg: GluonMatmulConfig, gated: bool) -> torch.Tensor:
    """One launch of the library's Gluon matmul in ``cfg``'s tiles."""
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    forward(x, w, out, cfg, gated)
    return out


def candidate(x: torch.Tensor, w: torch.Tensor, ws: list, cfg: GluonMatmulConfig, gated: bool, checks: dict,
              refs: dict, ref: torch.Tensor) -> dict:  # fmt: skip
    """Bitwise check of one tile shape at every check row count and the timed rows, then its time."""
    c: dict = {"BM": cfg.BM, "BN": cfg.BN, "per_sm": cfg.per_sm}
    try:
        c["bitwise_equal_library"] = bool(torch.equal(run(x, w, cfg, gated), ref)) and all(
            torch.equal(run(xc, w, cfg, gated), refs[mc]) for mc, xc in checks.items()
        )
        c["us"] = graph_ms_over(lambda ww: run(x, ww, cfg, gated), ws) * 1e3
    except Exception as e:  # noqa: BLE001 - a configuration that fails is recorded, not fatal
        c["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return c


def measure(name: str, rows: tuple[int, ...], gated: bool, epilogues: tuple[str, ...] = (),
            unit_products: bool = False) -> dict:  # fmt: skip
    n, k = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w_std = k**-0.5 if unit_products else 1.0
    w = (w_std * torch.randn(n, k, device="cuda", generator=g)).to(torch.bfloat16)
    ws = weight_copies(w)
    lib = gated_matmul if gated else matmul
    entry: dict = {"N": n // 2 if gated else n, "K": k, "gated": gated, "weight_std": w_std, "rows": {}}
    checks = {m: torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for m in CHECK_ROWS}
    refs = {m: lib(x, w) for m, x in checks.items()}
    for m in rows:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        row: dict = {"library_us": graph_ms_over(lambda ww, x=x: lib(x, ww), ws) * 1e3}
        if not gated:
            row["torch_mm_us"] = graph_ms_over(lambda ww, x=x: torch.mm(x, ww.T), ws) * 1e3
        ref = lib(x, w)
        row["candidates"] = [candidate(x, w, ws, cfg, gated, checks, refs, ref)
                             for cfg in (GATED_CONFIGS if gated else CONFIGS)]  # fmt: skip
        for formula in epilogues:
            with swapped(gluon_matmul, "_mm_kernel", epilogue_kernel(formula)):
                row[f"epilogue_{formula}"] = [candidate(x, w, ws, cfg, gated, checks, refs, ref)
                                              for cfg in GATED_CONFIGS]  # fmt: skip
        entry["rows"][str(m)] = row
        print("[gluon_matmul_probe]", name, "gated" if gated else "plain", m, json.dumps(row), flush=True)
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_matmul_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[256, 4096])
    ap.add_argument("--gated-rows", nargs="*", type=int, default=[64, 128, 256, 4096], help="none: no gated runs")
    ap.add_argument("--epilogues", nargs="*", default=[], choices=list(EPILOGUES))
    ap.add_argument("--unit-products", action="store_true",
                    help="weights of std 1 / sqrt(K), so the products have unit variance as in a model; by default "
                         "std 1, products of std sqrt(K), where exp(-gate) overflows for a few percent of the gates "
                         "and a correctly rounded division takes its slow path")  # fmt: skip
    args = ap.parse_args()
    require_cuda("gluon_matmul_probe.py")
    t0 = time.time()
    result: dict = header("gluon_matmul_probe", "triton") | {
        "dtype": "bfloat16",
        "timing": "microseconds per call, CUDA-graph replays over weight copies exceeding L2 four times",
        "shapes": {name: measure(name, tuple(args.rows), False, unit_products=args.unit_products)
                   for name in args.shapes},
    }
    if args.gated_rows:
        result["epilogues"] = args.epilogues
        result["gated"] = measure("gate_up_fused", tuple(args.gated_rows), True, tuple(args.epilogues),
                                  args.unit_products)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
