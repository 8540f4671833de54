"""Sweep of the KV split size ``SPLIT`` of the exact attention kernel (bf16, head_dim 128, Qwen3-1.7B heads).

For each candidate split size, times paged decode (CUDA-graph replays, so launch overhead is excluded) at long and
short contexts and the packed training forward at long sequences, and checks that decode equals the training
forward bitwise at that split size. The library's ``SPLIT`` (:data:`rlexact.ops.triton_attention.SPLIT_KEYS_16BIT`)
is chosen from this table.

    python benchmarks/split_kv_sweep.py [--out benchmarks/results/split_kv_sweep_h200.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from common import ROOT, bench, header, require_cuda
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
SPLITS = (512, 1024, 2048, 4096, 8192, 1 << 20)
DECODE = ((1, 8192), (4, 8192), (32, 8192), (4, 32768), (256, 512), (64, 2048))
PREFILL = ((1, 8192), (4, 4096))


def decode_case(b: int, ctx: int, page: int = 16):
    g = torch.Generator(device="cuda").manual_seed(b * 7 + ctx)
    nblk = math.ceil(ctx / page)
    kc, vc = (torch.randn(b * nblk, page, HKV, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    tables = torch.randperm(b * nblk, device="cuda", generator=g).to(torch.int32).view(b, nblk)
    q = torch.randn(b, HQ, D, device="cuda", generator=g).bfloat16()
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    return q, kc, vc, tables, cu, lens


def graph_us(fn, reps: int = 200) -> float:
    """Mean microseconds of one CUDA-graph replay of ``fn`` (one call captured; launch overhead excluded)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def run(split: int, fn):
    orig = ta._fwd_config
    ta._fwd_config = lambda hd, dt: orig(hd, dt) | {"SPLIT": split}
    try:
        return fn()
    finally:
        ta._fwd_config = orig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "split_kv_sweep_h200.json"))
    args = ap.parse_args()
    require_cuda("split_kv_sweep.py")
    scale = D**-0.5
    result: dict = header("split_kv_sweep", "triton") | {"library_split": ta.SPLIT_KEYS_16BIT, "rows": []}
    # exactness at each split: decode of the last position == training forward of a 2 * 8192 + 5 token sequence
    n = 2 * 8192 + 5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, D, device="cuda", generator=g).bfloat16() for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    table = torch.arange(n // 16 + 1, dtype=torch.int32, device="cuda")[None]
    kc, vc = (torch.zeros(n // 16 + 1, 16, HKV, D, device="cuda").bfloat16() for _ in range(2))
    kc.view(-1, HKV, D)[:n], vc.view(-1, HKV, D)[:n] = k, v
    last = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    for split in SPLITS:
        row: dict = {"split": split}
        full = run(split, lambda: ta.attention_varlen(q, k, v, cu, scale))
        dec = run(split, lambda: ta.attention_paged(q[-1:], kc, vc, table, last, cu[1:], scale, max_seqlen_q=1))
        row["decode_equals_training"] = bool(torch.equal(dec, full[-1:]))
        print(f"[split_kv_sweep] split {split} exact {row['decode_equals_training']}", flush=True)
        for b, ctx in DECODE:
            args_ = decode_case(b, ctx)
            qd, kcd, vcd, tbl, cud, lens = args_

            def step(qd=qd, kcd=kcd, vcd=vcd, tbl=tbl, cud=cud, lens=lens):
                return ta.attention_paged(qd, kcd, vcd, tbl, cud, lens, scale, max_seqlen_q=1)

            print(f"[split_kv_sweep] split {split} decode b={b} ctx={ctx}", flush=True)
            row[f"decode_b{b}_ctx{ctx}_us"] = run(split, lambda step=step: graph_us(step))
        for b, s in PREFILL:
            qp, kp, vp = (torch.randn(b * s, h, D, device="cuda").bfloat16() for h in (HQ, HKV, HKV))
            cup = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
            row[f"prefill_b{b}_len{s}_ms"] = run(
                split, lambda qp=qp, kp=kp, vp=vp, cup=cup: bench(lambda: ta.attention_varlen(qp, kp, vp, cup, scale))
            )
        result["rows"].append(row)
        print("[split_kv_sweep]", json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
