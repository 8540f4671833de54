"""Sweep of row-tile variants of the exact log-prob head (lm head + log-softmax + gather) for decode-sized calls.

    python benchmarks/head_variants.py [--out benchmarks/results/head_variants_h200.json]

Qwen3-1.7B head (hidden 2,048, vocabulary 151,936, bf16). For each row count T (``--ts``) every candidate
(``BM`` with its warps x stages x TMA or pointer loads, the chunk loop flattened into the K loop or not; the
vocabulary chunk ``BV``, the split ``VS`` and ``BK`` stay the library's) is (1) checked bitwise against the
library's configuration on the same rows computed inside a 4,096-row call (log-prob, entropy and log-sum-exp, and
the logits with ``--store-z``; a variant that changes any bit is marked ``bitwise: false`` and may not be used) and
(2) timed as a CUDA-graph replay, next to ``torch.mm`` of the same rows (the logits alone). The first candidate is
the library's large-call configuration (``library``); ``library_decode`` is what calls of at most ``DECODE_ROWS``
rows use. ``--lite`` times only those two and their flattened twins; ``--store-z`` times the generator's call (the
``[T, V]`` fp32 logits stored, :func:`rlexact.ops.triton_logprob.lm_head_logits`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import traceback
from pathlib import Path

import torch

from common import ROOT, bench_graph, header, require_cuda
from rlexact.ops import triton_logprob as tlp

H, V = 2048, 151936
TS = [4, 64, 256]


def candidates(base: tlp.HeadConfig, decode: tlp.HeadConfig, lite: bool) -> list[tlp.HeadConfig]:
    if lite:
        return [c for b in (base, decode) for c in (b, dataclasses.replace(b, flatten=not b.flatten))]
    out = [base]
    for (bm, warps), stages, tma, flatten in itertools.product(
        ((16, 1), (16, 4), (32, 2), (32, 4), (64, 4), (128, 8), (256, 16)), (3, 4, 6), (True, False), (False, True)
    ):
        if (bm + base.BV) * base.BK * 2 * stages <= 200_000:
            out.append(dataclasses.replace(base, BM=bm, num_warps=warps, num_stages=stages, tma=tma, flatten=flatten))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "head_variants_h200.json"))
    ap.add_argument("--ts", type=int, nargs="+", default=TS, help="row counts T to sweep")
    ap.add_argument("--lite", action="store_true", help="the library's two configurations and their flattened twins")
    ap.add_argument("--store-z", action="store_true", help="time the generator's call, which stores the logits")
    args = ap.parse_args()
    require_cuda("head_variants.py")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16()
    h_all = torch.randn(4096, H, device=dev, generator=g).bfloat16()
    t_all = torch.randint(0, V, (4096,), device=dev, generator=g)
    base = tlp.head_config(H, V, torch.bfloat16, dev)
    decode = tlp.decode_head_config(H, V, torch.bfloat16, dev)
    ref = tlp._run_head(h_all, w, t_all, 1.0, args.store_z, base)
    result: dict = header("head_variants", "triton") | {
        "timing": "median of triton.testing.do_bench_cudagraph (GPU time)",
        "shape": {"hidden": H, "vocab": V, "dtype": "bfloat16"},
        "library": repr(base),
        "library_decode": repr(decode),
        "store_z": args.store_z,
        "rows": {},
        "errors": {},
    }
    for t in args.ts:
        h, tgt = h_all[1000 : 1000 + t].contiguous(), t_all[1000 : 1000 + t].contiguous()
        want = [r[1000 : 1000 + t] for r in ref if r is not None]
        entry: dict = {"torch_mm_us": bench_graph(lambda h=h: torch.mm(h, w.T)) * 1e3, "candidates": []}
        for cfg in candidates(base, decode, args.lite):
            c: dict = {"config": repr(cfg)}
            try:
                got = [r for r in tlp._run_head(h, w, tgt, 1.0, args.store_z, cfg) if r is not None]
                c["bitwise"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

                def call(h: torch.Tensor = h, tgt: torch.Tensor = tgt, cfg: tlp.HeadConfig = cfg) -> object:
                    return tlp._run_head(h, w, tgt, 1.0, args.store_z, cfg)

                c["us"] = bench_graph(call) * 1e3
            except Exception:  # noqa: BLE001
                c["error"] = traceback.format_exc()[-400:]
            entry["candidates"].append(c)
        ok = [c for c in entry["candidates"] if c.get("bitwise") and "us" in c]
        entry["library_us"] = entry["candidates"][0].get("us")
        entry["best"] = min(ok, key=lambda c: c["us"]) if ok else None
        bad = [c for c in entry["candidates"] if c.get("bitwise") is False]
        entry["fastest_not_bitwise"] = min(bad, key=lambda c: c["us"]) if bad else None
        result["rows"][str(t)] = entry
        best = entry["best"] or {}
        line = f"T={t}: mm {entry['torch_mm_us']:.1f} us, library {entry['library_us']:.1f} us, best "
        print(f"[head_variants] {line}{best.get('us', float('nan')):.1f} us {best.get('config')}; {len(bad)} differ")
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
