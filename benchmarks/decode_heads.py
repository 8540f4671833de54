"""Split-parallel decode with a GQA group's query heads packed into each program (``HP`` = the group) against one
query head per program (``HP = 1``), Qwen3-1.7B heads (16 query / 8 KV, head_dim 128, bf16), on one GPU.

For each batch and context: both launches timed as CUDA-graph replays in alternation (``common.interleaved``; the
K/V caches exceed the L2 cache at every long shape, so the keys come from HBM), their outputs compared bitwise, and
the ``HP`` the library's launch takes (``library_hp``). Then, at one query head per program, decode of a sequence's
last position against the training forward of the whole sequence (``torch.equal``), with a perturbed key as the
negative control.

    python benchmarks/decode_heads.py [--out benchmarks/results/decode_heads_h200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from common import ROOT, bench_graph, header, interleaved, paged_decode_inputs, require_cuda, swapped
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
CASES = ((1, 8192), (2, 8192), (4, 8192), (8, 8192), (16, 8192), (1, 32768), (4, 32768))


def paged_step(hp: int | None, qd, kc, vc, tables, cu, lens, scale: float):  # noqa: ANN001 - torch.Tensors
    """One decode launch with ``HP = hp`` (``None``: the library's choice)."""
    out = torch.empty_like(qd)
    ta._forward(qd, kc, vc, cu, lens, tables, scale, out, cfg=None if hp is None else {"HP": hp}, max_seqlen_q=1)
    return out


def timed_case(b: int, ctx: int, scale: float) -> dict:
    qd, kc, vc, tables, cu, lens = paged_decode_inputs(b, ctx, HQ, HKV, D)
    group = HQ // HKV
    packed = paged_step(group, qd, kc, vc, tables, cu, lens, scale)
    one = paged_step(1, qd, kc, vc, tables, cu, lens, scale)
    rounds = interleaved(
        ("packed", lambda: paged_step(group, qd, kc, vc, tables, cu, lens, scale)),
        ("one_head", lambda: paged_step(1, qd, kc, vc, tables, cu, lens, scale)),
        bench_graph,
    )
    calls: list[dict] = []
    with swapped(ta, "_attn_fwd_kernel", _Recorder(calls)):
        paged_step(None, qd, kc, vc, tables, cu, lens, scale)
    packed_us, one_us = (statistics.median(rounds[f"{n}_ms"]) * 1e3 for n in ("packed", "one_head"))
    return {
        "kv_bytes": 2 * b * ctx * HKV * D * 2,
        "packed_us": packed_us,
        "one_head_us": one_us,
        "speedup": packed_us / one_us,
        "round_ratios": [rounds["ratio_min"], rounds["ratio_median"], rounds["ratio_max"]],
        "bitwise_equal": bool(torch.equal(packed, one)),
        "library_hp": calls[-1]["HP"],
    }


class _Recorder:
    """Stands in for the forward kernel and records each launch's meta-parameters (nothing runs)."""

    def __init__(self, calls: list[dict]) -> None:
        self.calls = calls

    def __getitem__(self, grid: tuple):
        return lambda *args, **meta: self.calls.append(meta)


def exactness(scale: float) -> dict:
    """Decode of the last position of a ``2 * SPLIT + 37``-token sequence at ``HP = 1`` against the training forward,
    and the same after one key of the first split is perturbed in the cache only (the control must differ)."""
    split = ta.split_keys(D, torch.bfloat16)
    n, page = 2 * split + 37, 16
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(n, h, D, device="cuda", generator=g).bfloat16() for h in (HQ, HKV, HKV))
    full = ta.attention_varlen(q, k, v, torch.tensor([0, n], dtype=torch.int32, device="cuda"), scale)
    blocks = -(-n // page)
    perm = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32)
    kc, vc = (torch.full((blocks, page, HKV, D), float("nan"), device="cuda").bfloat16() for _ in range(2))
    slots = perm.long()[torch.arange(n, device="cuda") // page] * page + torch.arange(n, device="cuda") % page
    kc.view(-1, HKV, D)[slots], vc.view(-1, HKV, D)[slots] = k, v
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    dec = paged_step(1, q[-1:].contiguous(), kc, vc, perm[None], cu, lens, scale)
    kc.view(-1, HKV, D)[slots[5]] += 1.0
    perturbed = paged_step(1, q[-1:].contiguous(), kc, vc, perm[None], cu, lens, scale)
    return {"keys": n, "decode_equals_training": bool(torch.equal(dec, full[-1:])),
            "perturbed_key_differs": not torch.equal(perturbed, full[-1:])}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_heads_h200.json"))
    args = ap.parse_args()
    require_cuda("decode_heads.py")
    scale = D**-0.5
    result: dict = header("decode_heads", "triton") | {"exactness": exactness(scale), "cases": {}}
    print("[decode_heads]", json.dumps(result["exactness"]), flush=True)
    for b, ctx in CASES:
        row = timed_case(b, ctx, scale)
        result["cases"][f"{b}x{ctx}"] = row
        print(f"[decode_heads] {b}x{ctx}", json.dumps(row), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
