"""A decode step's lm head and draw: the draw taken in the head's launch against the head storing the logits and the
keyed sampler reading them back.

    python3 benchmarks/head_sample.py [--out benchmarks/results/head_sample_h200.json]

At B = 1, 4, 64, 65, 256 rows of bf16 hidden states (H = 2,048) against a bf16 lm-head weight (V = 151,936, the
Qwen3-1.7B shapes), temperature 1 and 0.7, timed as CUDA-graph replays:

* ``separate_us``: ``lm_head_logits`` (the head storing fp32 ``z``) then ``gumbel_argmax_triton`` on ``z`` (the
  sampler's two launches), what the generator ran for every draw before the fused path;
* ``fused_us``: ``lm_head_sample`` (the draw in the head's epilogue, ``z`` never stored);
* ``tokens_equal`` / ``logprobs_equal``: the fused draw's tokens and log-probs against the separate path's
  (``torch.equal``); ``rows_alone_equal``: the first and last rows drawn alone equal the batch's;
  ``other_seed_differs``: another seed changes the draw (the negative control).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common import ROOT, bench_graph, header
from rlexact.ops import triton_logprob as tlp
from rlexact.ops.triton_sampler import gumbel_argmax_triton

V, H = 151936, 2048
ROWS = (1, 4, 64, 65, 256)
SEED = 1234


def separate(hidden: torch.Tensor, w: torch.Tensor, temp: float, rid: torch.Tensor, pos: torch.Tensor, seed: int):
    z, lse = tlp.lm_head_logits(hidden, w, temp)
    return gumbel_argmax_triton(z, None, seed, rid, pos, lse)


def case(w: torch.Tensor, b: int, temp: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b)
    hidden = torch.randn(b, H, device="cuda", generator=g).to(torch.bfloat16)
    rid = torch.arange(b, device="cuda") * 7 + 11
    pos = torch.arange(b, device="cuda") + 129
    ref_tok, ref_lp = separate(hidden, w, temp, rid, pos, SEED)
    tok, lp = tlp.lm_head_sample(hidden, w, temp, SEED, rid, pos)
    alone = [tlp.lm_head_sample(hidden[i : i + 1], w, temp, SEED, rid[i : i + 1], pos[i : i + 1]) for i in (0, b - 1)]
    row = {
        "separate_us": bench_graph(lambda: separate(hidden, w, temp, rid, pos, SEED)) * 1e3,
        "fused_us": bench_graph(lambda: tlp.lm_head_sample(hidden, w, temp, SEED, rid, pos)) * 1e3,
        "tokens_equal": torch.equal(tok, ref_tok),
        "logprobs_equal": torch.equal(lp, ref_lp),
        "rows_alone_equal": all(
            torch.equal(t, tok[i : i + 1]) and torch.equal(p, lp[i : i + 1]) for (t, p), i in zip(alone, (0, b - 1))
        ),
    }
    other = tlp.lm_head_sample(hidden, w, temp, SEED + 1, rid, pos)[0]
    row["other_seed_differs"] = None if b < 4 else not torch.equal(other, tok)
    row["speedup"] = row["separate_us"] / row["fused_us"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "head_sample_h200.json"))
    args = ap.parse_args()
    t0 = time.time()
    w = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    cases: dict = {}
    for temp in (1.0, 0.7):
        for b in ROWS:
            key = f"T={temp:g} B={b}"
            cases[key] = case(w, b, temp)
            print(f"[head_sample] {key}: {json.dumps(cases[key])}", flush=True)
    result: dict = header("head_sample", "triton") | {
        "timing": "median of do_bench_cudagraph (GPU time), microseconds",
        "shape": {"V": V, "H": H, "dtype": "bfloat16"},
        "cases": cases,
        "elapsed_s": time.time() - t0,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
