"""The decode step's two small kernels after the lm head: the keyed sampler and the head's split merge.

    python3 benchmarks/sampler_merge.py [--out benchmarks/results/sampler_merge_h200.json]

* ``sampler``: ``gumbel_argmax_triton`` on ``[B, V]`` fp32 logits (V = 151,936, the Qwen3 vocabulary) at
  B = 4, 64, 256, with the noise's logarithms from libdevice (``fast_log=False``) and from the GPU's ``lg2.approx``
  (``fast_log=True``, the library's choice). Each is timed as CUDA-graph replays; ``tokens_equal_fraction`` is the
  share of rows whose draw is the same in both, ``torch_equal_fraction`` the share equal to the torch sampler's
  (``-log(-log u)``), and ``rows_alone_equal`` whether rows drawn alone equal the same rows of the batch (batch
  invariance). ``logits_read_us`` is the time to read the logits once at the datasheet bandwidth.
* ``merge``: ``merge_splits`` (the head's merge launch) over the split partials of that vocabulary (``VS`` = 1,152:
  132 splits) at T = 4, 64, 256, 16,384 rows for ``UNROLL`` in 1 ... 16 (splits whose partials are loaded together),
  each checked bitwise against ``UNROLL`` = 1 (the one-split-per-iteration loop) and timed as CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from common import ROOT, bench_graph, header, require_cuda
from rlexact.ops import triton_logprob as tlp
from rlexact.ops.triton_sampler import gumbel_argmax_triton
from rlexact.rollout import sampler as S

V = 151936
VS = 1152
HBM_BYTES_PER_S = 4.8e12
SAMPLER_ROWS = (4, 64, 256)
MERGE_ROWS = (4, 64, 256, 16384)
UNROLLS = (1, 2, 4, 8, 16)


def sampler_part() -> dict:
    out: dict = {}
    for b in SAMPLER_ROWS:
        z = torch.randn(b, V, device="cuda") * 3
        lse = torch.logsumexp(z, -1)
        rid = torch.arange(b, device="cuda") * 7 + 11
        pos = torch.arange(b, device="cuda") + 129
        row: dict = {"logits_read_us": b * V * 4 / HBM_BYTES_PER_S * 1e6}
        toks = {}
        for fast in (False, True):

            def draw(fast: bool = fast, z=z, rid=rid, pos=pos, lse=lse) -> torch.Tensor:  # noqa: ANN001
                return gumbel_argmax_triton(z, None, 5, rid, pos, lse, fast_log=fast)[0]

            toks[fast] = draw()
            row["fast_log" if fast else "libdevice_log"] = {"us": bench_graph(draw) * 1e3}
        row["tokens_equal_fraction"] = (toks[True] == toks[False]).float().mean().item()
        row["torch_equal_fraction"] = (toks[True] == S._gumbel_argmax_torch(z, None, 5, rid, pos)).float().mean().item()
        alone = [gumbel_argmax_triton(z[i : i + 1], None, 5, rid[i : i + 1], pos[i : i + 1])[0] for i in (0, b - 1)]
        row["rows_alone_equal"] = all(bool(a.item() == toks[True][i].item()) for a, i in zip(alone, (0, b - 1)))
        row["speedup"] = row["libdevice_log"]["us"] / row["fast_log"]["us"]
        print(f"[sampler_merge] sampler B={b}: {json.dumps(row)}")
        out[str(b)] = row
    return out


def merge_part() -> dict:
    n_split = triton.cdiv(V, VS)
    out: dict = {"n_split": n_split}
    for t in MERGE_ROWS:
        g = torch.Generator(device="cuda").manual_seed(t)
        part = torch.empty((3, n_split, t), device="cuda")
        part[0] = torch.randn(n_split, t, device="cuda", generator=g) * 3
        part[1] = torch.rand(n_split, t, device="cuda", generator=g) * 99 + 1
        part[2] = torch.randn(n_split, t, device="cuda", generator=g) * 50
        zt = torch.randn(t, device="cuda", generator=g)

        def run(unroll: int, part=part, zt=zt, t=t) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
            logp, ent, lse = (torch.empty(t, device="cuda") for _ in range(3))
            tlp.merge_splits(part, zt, True, logp, ent, lse, unroll=unroll)
            return logp, ent, lse

        ref = run(1)
        row: dict = {}
        for u in UNROLLS:
            same = all(torch.equal(a, b) for a, b in zip(run(u), ref))
            row[str(u)] = {"us": bench_graph(lambda u=u: run(u)) * 1e3, "bitwise": same}
        print(f"[sampler_merge] merge T={t}: {json.dumps(row)}")
        out[str(t)] = row
    out["library_unroll"] = tlp.MERGE_UNROLL
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampler_merge_h200.json"))
    args = ap.parse_args()
    require_cuda("sampler_merge.py")
    t0 = time.time()
    result: dict = header("sampler_merge", "triton") | {
        "timing": "median of do_bench_cudagraph (GPU time), microseconds",
        "vocab": V,
        "sampler": sampler_part(),
        "merge": merge_part(),
    }
    result["elapsed_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
