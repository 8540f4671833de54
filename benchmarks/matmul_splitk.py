"""Fixed K splits of the exact matmul (``MatmulConfig.KS``): the split-size sweep and the library against no split.

    python benchmarks/matmul_splitk.py [--out benchmarks/results/matmul_splitk_h200.json]

A K split whose boundaries depend only on K (every ``KS`` columns from 0), with the split chains summed in ascending
order from zero, keeps a row's bits a function of the row alone (``rlexact.ops.triton_matmul``). The parts, on the
Qwen3-1.7B ``down`` projection (N = 2,048, K = 6,144; the only K-heavy shape of that model):

* ``sweep``: for M = 4, 64, 256 and each ``KS`` in 512 ... 3,072, ``"split"`` launches (one program per tile and
  split) of several tiles, each checked bitwise against the in-register sum (``"tma"`` with the same ``KS``) of the
  same rows inside a 4,096-row call, and timed with the weights from HBM (CUDA-graph replays over weight copies that
  together exceed four times L2), next to ``torch.mm``;
* ``large``: in-register-sum candidates (``"tma"`` tiles with ``SPLIT_K_KEYS``) at M = 4,096 and 16,384, each
  checked bitwise against the first of them and timed next to the tile used before K splits (two 128 x 256 accumulators
  do not fit in registers, so the split shapes need another large-M tile);
* ``library``: for M from 1 to 16,384, the library's matmul against the configuration it used for the same M before
  K splits (``UNSPLIT``) and ``torch.mm``, and whether the library's rows equal the same rows
  of another call (``rows_equal_other_call``: a 4,096-row call, or for M = 4,096 a 16,384-row one). M <= 256 with
  the weights from HBM, larger M with one weight (compute-bound);
* ``unsplit`` (not in the default parts): for M from 1 to 256, tiles of one chain over all of K (``KS = 0``), each
  checked bitwise against the same rows inside a 4,096-row call of the unsplit large-M tile and timed with the weights
  from HBM, next to the library and ``torch.mm`` (and whether each gives the unsplit chain's bits): the sweep behind
  the library's decode tiles for K-heavy shapes without splits (``triton_matmul.split_keys``);
* ``bytes`` (not in the default parts): at M = 1, 4, 16, 64, shapes of the down projection's weight size whose K
  chains are 1 to 6 times shorter (N x K = 2,048 x 6,144 ... 12,288 x 1,024), each through the tile the library
  configures for it (its own kernel, not cuBLAS) and ``torch.mm``, with the weights from HBM, beside a plain read of
  the same weights (``w.sum(dtype=float32)``): whether a decode-sized product's time follows its chain length or its
  bytes.

The ``sweep``, ``large`` and ``library`` parts predate that rule: they ran while the down projection split K on the
H200 (``matmul_splitk_h200.json``); ``library`` compares whatever the library runs now.
"""

from __future__ import annotations

import argparse
import itertools
import json
import traceback
from pathlib import Path

import torch

from common import ROOT, graph_ms_over, header, require_cuda, weight_copies
from rlexact.ops.triton_matmul import SPLIT_K_KEYS, MatmulConfig, config_for, matmul, matmul_with_config

N, K = 2048, 6144
MS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096, 16384]
KS_SWEEP = [512, 1024, 1536, 2048, 3072]
UNSPLIT = (  # (max M, config) of the down projection before K splits (triton_matmul._variants at 91f122b)
    (16, MatmulConfig("ptr", 16, 16, 128, num_warps=4, num_stages=4)),
    (64, MatmulConfig("ptr", 64, 16, 64, num_warps=4, num_stages=4)),
    (256, MatmulConfig("tma", 64, 64, 128, num_warps=4, num_stages=5)),
    (2048, MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4)),
    (None, MatmulConfig("tma", 128, 256, 64, num_warps=8, num_stages=3, subtile=True)),
)


def unsplit(m: int) -> MatmulConfig:
    return next(cfg for max_m, cfg in UNSPLIT if max_m is None or m <= max_m)


def timed(fn, ws: list[torch.Tensor]) -> float:  # noqa: ANN001
    """Microseconds per call of ``fn(w)`` over the weight copies ``ws`` (:func:`common.graph_ms_over`)."""
    return graph_ms_over(fn, ws) * 1e3


def split_candidates(m: int, ks: int) -> list[MatmulConfig]:
    bms = (16,) if m <= 16 else (64, 128)
    return [
        MatmulConfig("split", bm, bn, bk, num_warps=4 if bm * bn <= 64 * 128 else 8, num_stages=4, KS=ks)
        for bm, bn, bk in itertools.product(bms, (64, 128), (64, 128))
        if ks % bk == 0
    ]


def sweep(w: torch.Tensor, wcopies: list[torch.Tensor], x_all: torch.Tensor) -> list[dict]:
    rows = []
    for ks in KS_SWEEP:
        seq = matmul_with_config(x_all, w, MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4, KS=ks))
        for m in (4, 64, 256):
            x = x_all[1000 : 1000 + m].contiguous()
            for cfg in split_candidates(m, ks):
                row: dict = {"M": m, "KS": ks, "config": repr(cfg)}
                try:
                    row["bitwise"] = bool(torch.equal(matmul_with_config(x, w, cfg), seq[1000 : 1000 + m]))
                    row["us"] = timed(lambda w, x=x, c=cfg: matmul_with_config(x, w, c), wcopies)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
        best = {
            m: min((r["us"] for r in rows if r["KS"] == ks and r["M"] == m and r.get("bitwise")), default=None)
            for m in (4, 64, 256)
        }
        print(f"[matmul_splitk] KS={ks}: best split launch (us) per M {best}", flush=True)
    return rows


def large_candidates() -> list[MatmulConfig]:
    tiles = [
        (128, 128, 64, 8, 4, False), (128, 128, 64, 8, 3, False), (128, 128, 64, 8, 5, False),
        (128, 128, 128, 8, 3, False), (128, 128, 64, 8, 4, True), (128, 256, 64, 8, 3, False),
        (256, 128, 64, 8, 3, False), (128, 64, 64, 4, 4, False),
    ]  # fmt: skip
    return [
        MatmulConfig("tma", bm, bn, bk, num_warps=wp, num_stages=st, warp_specialize=ws, KS=SPLIT_K_KEYS)
        for bm, bn, bk, wp, st, ws in tiles
    ]


def large(w: torch.Tensor, wcopies: list[torch.Tensor], x_all: torch.Tensor) -> list[dict]:
    rows = []
    for m in (4096, 16384):
        x = torch.randn(m, K, device=w.device, dtype=torch.bfloat16)
        ref = matmul_with_config(x, w, large_candidates()[0])
        old = unsplit(m)
        base_us = timed(lambda w, x=x, c=old: matmul_with_config(x, w, c), [w])
        for cfg in large_candidates():
            row: dict = {"M": m, "config": repr(cfg), "unsplit_us": base_us}
            try:
                row["bitwise"] = bool(torch.equal(matmul_with_config(x, w, cfg), ref))
                row["us"] = timed(lambda w, x=x, c=cfg: matmul_with_config(x, w, c), [w])
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(f"[matmul_splitk] large M={m} {cfg}: {row.get('us', float('nan')):.1f} us (unsplit {base_us:.1f}) "
                  f"bitwise {row.get('bitwise')}", flush=True)  # fmt: skip
    return rows


def library(w: torch.Tensor, wcopies: list[torch.Tensor], x_all: torch.Tensor) -> list[dict]:
    dev = w.device
    big = torch.randn(16384, K, device=dev, dtype=torch.bfloat16)
    big[:4096] = x_all
    ref, ref_big = matmul(x_all, w), matmul(big, w)
    rows = []
    for m in MS:
        lo = 1000 if m <= 3000 else 0  # small calls take rows from the middle of the 4,096-row call
        x = big[lo : lo + m].contiguous()
        ws = wcopies if m <= 256 else wcopies[:1]
        cfg = config_for(m, N, K, torch.bfloat16, dev)
        row: dict = {"M": m, "config": repr(cfg), "unsplit_config": repr(unsplit(m))}
        got = matmul(x, w)
        other = ref_big[:4096] if m == 4096 else ref[lo : lo + m] if m < 4096 else ref
        row["rows_equal_other_call"] = bool(torch.equal(got[: other.shape[0]], other))
        row["library_us"] = timed(lambda w, x=x: matmul(x, w), ws)
        old = unsplit(m)
        row["unsplit_us"] = timed(lambda w, x=x, c=old: matmul_with_config(x, w, c), ws)
        row["torch_mm_us"] = timed(lambda w, x=x: torch.mm(x, w.T), ws)
        row["library_over_unsplit"] = row["unsplit_us"] / row["library_us"]
        row["library_over_torch_mm"] = row["torch_mm_us"] / row["library_us"]
        print(
            f"[matmul_splitk] M={m}: library {row['library_us']:.1f} us, unsplit {row['unsplit_us']:.1f}, "
            f"torch.mm {row['torch_mm_us']:.1f}, rows equal {row['rows_equal_other_call']}",
            flush=True,
        )
        rows.append(row)
    return rows


def unsplit_candidates(m: int) -> list[MatmulConfig]:
    tiles = [("ptr", 16, bn, bk, 4, st) for bn in (16, 32) for bk in (128, 256) for st in (4, 6)]
    if m > 16:
        tiles = [("ptr", bm, bn, bk, 4, st) for bm in (32, 64) for bn in (16, 32) for bk in (64, 128, 256)
                 for st in (3, 4, 6)]  # fmt: skip
        tiles += [("tma", 64, bn, 128, 4, st) for bn in (32, 64) for st in (4, 5)]
    return [MatmulConfig(kern, bm, bn, bk, num_warps=wp, num_stages=st) for kern, bm, bn, bk, wp, st in tiles]


def unsplit_small(w: torch.Tensor, wcopies: list[torch.Tensor], x_all: torch.Tensor) -> list[dict]:
    ref = matmul_with_config(x_all, w, unsplit(4096))
    rows = []
    for m in (1, 4, 16, 32, 64, 128, 256):
        x = x_all[1000 : 1000 + m].contiguous()
        want = ref[1000 : 1000 + m]
        entry: dict = {
            "M": m,
            "library_us": timed(lambda w, x=x: matmul(x, w), wcopies),
            "library_equal_unsplit": bool(torch.equal(matmul(x, w), want)),
            "torch_mm_us": timed(lambda w, x=x: torch.mm(x, w.T), wcopies),
            "torch_mm_equal_unsplit": bool(torch.equal(torch.mm(x, w.T), want)),
            "candidates": [],
        }
        for cfg in unsplit_candidates(m):
            row: dict = {"config": repr(cfg)}
            try:
                row["bitwise"] = bool(torch.equal(matmul_with_config(x, w, cfg), want))
                row["us"] = timed(lambda w, x=x, c=cfg: matmul_with_config(x, w, c), wcopies)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            entry["candidates"].append(row)
        ok = [r for r in entry["candidates"] if r.get("bitwise")]
        entry["best"] = min(ok, key=lambda r: r["us"]) if ok else None
        best_us = entry["best"]["us"] if ok else float("nan")
        print(f"[matmul_splitk] unsplit M={m}: best {best_us:.1f} us {entry['best'] and entry['best']['config']}, "
              f"library {entry['library_us']:.1f}, torch.mm {entry['torch_mm_us']:.1f} "
              f"(equal unsplit {entry['torch_mm_equal_unsplit']})", flush=True)  # fmt: skip
        rows.append(entry)
    return rows


BYTES_SHAPES = ((2048, 6144), (4096, 3072), (8192, 1536), (12288, 1024))
"""``(N, K)`` of one weight size (the down projection's), the K chain 1 to 6 times shorter."""


def equal_bytes(w: torch.Tensor, wcopies: list[torch.Tensor], x_all: torch.Tensor) -> list[dict]:
    rows = []
    read_us = timed(lambda w: w.sum(dtype=torch.float32), wcopies)  # every shape below views these same bytes
    for n, k in BYTES_SHAPES:
        ws = [c.view(n, k) for c in wcopies]
        for m in (1, 4, 16, 64):
            x = x_all.view(-1)[: m * k].view(m, k)
            cfg = config_for(m, n, k, torch.bfloat16, w.device)
            row = {"N": n, "K": k, "M": m, "chain_k16_steps": k // 16, "config": repr(cfg), "read_us": read_us,
                   "library_kernel_us": timed(lambda w, x=x, c=cfg: matmul_with_config(x, w, c), ws),
                   "torch_mm_us": timed(lambda w, x=x: torch.mm(x, w.T), ws)}  # fmt: skip
            row["weight_tb_per_s"] = n * k * 2 / row["library_kernel_us"] / 1e6
            print(f"[matmul_splitk] bytes N={n} K={k} M={m}: library kernel {row['library_kernel_us']:.1f} us, "
                  f"torch.mm {row['torch_mm_us']:.1f}, read {read_us:.1f} ({cfg})", flush=True)  # fmt: skip
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "matmul_splitk_h200.json"))
    ap.add_argument("--parts", nargs="+", default=["sweep", "large", "library"], help="parts to run (default: all)")
    args = ap.parse_args()
    require_cuda("matmul_splitk.py")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(N, K, device=dev, generator=g).bfloat16()
    wcopies = weight_copies(w)
    x_all = torch.randn(4096, K, device=dev, generator=g).bfloat16()
    result: dict = header("matmul_splitk", "triton") | {
        "shape": {"N": N, "K": K, "dtype": "bfloat16"},
        "split_k_keys": SPLIT_K_KEYS,
        "timing": "microseconds per call, median of CUDA-graph replays; M <= 256 (and the sweep) over weight copies "
        "that together exceed four times L2, so the weights come from HBM",
        "errors": {},
    }
    for part, fn in (
        ("sweep", sweep),
        ("large", large),
        ("library", library),
        ("unsplit", unsplit_small),
        ("bytes", equal_bytes),
    ):
        if part not in args.parts:
            continue
        try:
            result[part] = fn(w, wcopies, x_all)
        except Exception:  # noqa: BLE001
            result["errors"][part] = traceback.format_exc()[-2000:]
            print(f"[matmul_splitk] {part} failed:\n{result['errors'][part]}", flush=True)
    if result["errors"] and not any(part in result for part in args.parts):  # errors alone must not replace a result
        raise RuntimeError(f"matmul_splitk: every part failed ({', '.join(result['errors'])}); {args.out} not written")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"[matmul_splitk] wrote {args.out}; errors: {list(result['errors'])}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
