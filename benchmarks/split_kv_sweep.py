"""Sweep of the KV split size ``SPLIT`` of the exact attention kernel (bf16, head_dim 128, Qwen3-1.7B heads).

For each candidate split size, times paged decode (CUDA-graph replays, so launch overhead is excluded) at long and
short contexts and the packed training forward at the prefill shapes of ``ops_bench.py``, each prefill timed in
alternation with SDPA's default kernel on the same inputs (eager and as graph replays, ``common.interleaved``), and
checks that decode equals the training forward bitwise at that split size. The library's ``SPLIT``
(:data:`rlexact.ops.triton_attention.SPLIT_KEYS_16BIT`) is chosen from this table.

    python benchmarks/split_kv_sweep.py [--splits 1024 2048] [--out benchmarks/results/split_kv_sweep_h200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from common import ROOT, bench, bench_graph, header, interleaved, paged_decode_inputs, require_cuda
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
SPLITS = (512, 1024, 2048, 4096, 8192, 1 << 20)
DECODE = ((1, 8192), (4, 8192), (32, 8192), (4, 32768), (256, 512), (64, 2048))
PREFILL = ((64, 512), (8, 4096), (1, 8192), (4, 2048))


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


def prefill_vs_sdpa(split: int, b: int, s: int, scale: float) -> dict:
    """Packed causal prefill of ``b`` sequences of ``s`` tokens at ``split`` against SDPA's default on the same
    inputs (K/V expanded to the query heads for SDPA): medians of the alternating rounds, eager and as graph replays,
    and SDPA's time over the exact call's (``> 1``: exact faster)."""
    q = torch.randn(b * s, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b * s, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    qs = q.view(b, s, HQ, D).transpose(1, 2)
    ks, vs = (x.view(b, s, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1) for x in (k, v))

    def exact() -> torch.Tensor:
        return run(split, lambda: ta.attention_varlen(q, k, v, cu, scale))

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    row: dict = {}
    for mode, timer in (("eager", bench), ("graph", bench_graph)):
        rounds = interleaved(("exact", exact), ("sdpa", sdpa), timer)
        t_exact, t_sdpa = (statistics.median(rounds[f"{n}_ms"]) for n in ("exact", "sdpa"))
        row[mode] = {"exact_ms": t_exact, "sdpa_ms": t_sdpa, "ratio": t_sdpa / t_exact,
                     "round_ratios": [rounds["ratio_min"], rounds["ratio_median"], rounds["ratio_max"]]}  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", type=int, nargs="+", default=list(SPLITS), help="KV split sizes to time")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "split_kv_sweep_h200.json"))
    args = ap.parse_args()
    require_cuda("split_kv_sweep.py")
    scale = D**-0.5
    tile = ta._fwd_config(D, torch.bfloat16)["BLOCK_N"]
    bad = [split for split in args.splits if split <= 0 or split % tile]
    if bad:
        raise SystemExit(f"split_kv_sweep.py: --splits takes positive multiples of {tile} keys, got {bad}")
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
    full_library = ta.attention_varlen(q, k, v, cu, scale)
    for split in args.splits:
        row: dict = {"split": split}
        full = run(split, lambda: ta.attention_varlen(q, k, v, cu, scale))
        dec = run(split, lambda: ta.attention_paged(q[-1:], kc, vc, table, last, cu[1:], scale, max_seqlen_q=1))
        row["decode_equals_training"] = bool(torch.equal(dec, full[-1:]))
        # negative control: another split is another reduction, so its rows differ from the library split's
        row["equals_library_split"] = bool(torch.equal(full, full_library))
        print(f"[split_kv_sweep] split {split} exact {row['decode_equals_training']}", flush=True)
        for b, ctx in DECODE:
            args_ = paged_decode_inputs(b, ctx, HQ, HKV, D)
            qd, kcd, vcd, tbl, cud, lens = args_

            def step(qd=qd, kcd=kcd, vcd=vcd, tbl=tbl, cud=cud, lens=lens):
                return ta.attention_paged(qd, kcd, vcd, tbl, cud, lens, scale, max_seqlen_q=1)

            print(f"[split_kv_sweep] split {split} decode b={b} ctx={ctx}", flush=True)
            row[f"decode_b{b}_ctx{ctx}_us"] = run(split, lambda step=step: graph_us(step))
        for b, s in PREFILL:
            print(f"[split_kv_sweep] split {split} prefill {b}x{s}", flush=True)
            row[f"prefill_b{b}_len{s}"] = prefill_vs_sdpa(split, b, s, scale)
        result["rows"].append(row)
        print("[split_kv_sweep]", json.dumps(row), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # after every row: a timeout keeps the rest
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
