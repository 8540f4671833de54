"""Would a batch-256 decode step run faster as two half-batches on two CUDA streams? A probe of its main launches.

    timeout 300 python benchmarks/overlap_probe.py [--out ...overlap_probe_h200.json]

A decode step at batch 256 spends its time in two kinds of launches: the projections, compute-bound but with few
output tiles at 256 rows (so part of the SMs idle), and the paged decode attention, bound by HBM. Split the rows into
two halves with no dependency between them and the GPU can run one half's attention beside the other half's
products. The exactness contract allows it (a row's bits do not depend on the rows beside it); whether it pays is
what this measures. Per layer of Qwen3-1.7B's shape (28 layers, each with its own weights and paged K/V cache, so
neither stays in L2): the fused q/k/v product, the paged decode attention over ``--context`` keys, the o product,
the gated MLP product and the down product, through the library's exact ops (norms, rotary, residuals and the head
left out). CUDA-graph replays of: the 256 rows on one stream; the two halves one after the other on one stream; the
two halves on two streams (forked from the capturing stream and joined at the end), with the decode attention at its
default programs per SM and at one. The halves' rows must equal the whole batch's bitwise (checked; a perturbed
weight is the negative control). Also each launch's time alone at both row counts, for the sums.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from common import ROOT, bench_graph, header, require_cuda, swapped
from rlexact import ops
from rlexact.ops import gluon_decode

LAYERS, H, HQ, HKV, D, INTER, PAGE = 28, 2048, 16, 8, 128, 6144, 16
DT = torch.bfloat16


class Step:
    """The probe's decode step: per layer ``x -> down(gate_up(o(attention(qkv(x)))))`` for a slice of the rows."""

    def __init__(self, batch: int, context: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(DT)

        self.batch = batch
        self.w = [(w((HQ + 2 * HKV) * D, H), w(H, HQ * D), w(2 * INTER, H), w(H, INTER)) for _ in range(LAYERS)]
        nblk = math.ceil(context / PAGE)
        shape = (batch * nblk, PAGE, HKV, D)
        self.kv = [(torch.randn(shape, device="cuda", generator=g).to(DT),
                    torch.randn(shape, device="cuda", generator=g).to(DT)) for _ in range(LAYERS)]  # fmt: skip
        self.tables = torch.randperm(batch * nblk, device="cuda", generator=g).to(torch.int32).view(batch, nblk)
        self.lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        self.cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        self.x = torch.randn(batch, H, device="cuda", generator=g).to(DT)

    def launches(self, layer: int, rows: slice) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The layer's five launches for ``rows``, each a function of the previous one's output."""
        wqkv, wo, wgu, wd = self.w[layer]
        kc, vc = self.kv[layer]
        m = len(range(*rows.indices(self.batch)))
        tables, lens, cu = self.tables[rows], self.lens[rows], self.cu[: m + 1]

        def attention(qkv: torch.Tensor) -> torch.Tensor:
            q = qkv[:, : HQ * D].view(m, HQ, D)
            return ops.attention_paged(q, kc, vc, tables, cu, lens, D**-0.5, max_seqlen_q=1).view(m, HQ * D)

        return {"qkv": lambda x: ops.matmul(x, wqkv), "attention": attention, "o": lambda a: ops.matmul(a, wo),
                "gate_up": lambda o: ops.gate_up_silu(o, wgu), "down": lambda h: ops.matmul(h, wd)}  # fmt: skip

    def rows(self, rows: slice) -> torch.Tensor:
        """The step's launches for ``rows`` on the current stream; the last layer's output."""
        x = self.x[rows]
        for layer in range(LAYERS):
            for fn in self.launches(layer, rows).values():
                x = fn(x)
        return x

    def halves(self, streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None) -> torch.Tensor:
        """Both halves, on ``streams`` (forked from the current stream and joined back) or one after the other."""
        half = self.batch // 2
        parts = (slice(0, half), slice(half, self.batch))
        if streams is None:
            return torch.cat([self.rows(p) for p in parts])
        here = torch.cuda.current_stream()
        outs = []
        for s, p in zip(streams, parts, strict=True):
            s.wait_stream(here)
            with torch.cuda.stream(s):
                outs.append(self.rows(p))
        for s in streams:
            here.wait_stream(s)
        return torch.cat(outs)


def launch_times(step: Step, rows: slice) -> dict[str, float]:
    """Milliseconds of each launch kind over the 28 layers, alone (CUDA-graph replays)."""
    first = step.x[rows]
    inputs, times = {}, {}
    for name, fn in step.launches(0, rows).items():
        inputs[name] = first
        first = fn(first)
    for name in inputs:
        def run(name: str = name) -> None:
            for layer in range(LAYERS):
                step.launches(layer, rows)[name](inputs[name])

        times[name] = bench_graph(run)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overlap_probe_h200.json"))
    args = ap.parse_args()
    require_cuda("overlap_probe.py")
    step = Step(args.batch, args.context)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    whole = step.rows(slice(None))
    checks = {"halves_serial_equal_whole": torch.equal(step.halves(None), whole),
              "halves_two_streams_equal_whole": torch.equal(step.halves(streams), whole)}  # fmt: skip
    torch.cuda.synchronize()
    wqkv = step.w[0][0]
    wqkv[0, 0] += 1.0
    checks["perturbed_weight_changes_rows"] = not torch.equal(step.rows(slice(None)), whole)
    wqkv[0, 0] -= 1.0
    times = {"one_stream_whole_ms": bench_graph(lambda: step.rows(slice(None))),
             "one_stream_halves_ms": bench_graph(lambda: step.halves(None)),
             "two_streams_halves_ms": bench_graph(lambda: step.halves(streams))}  # fmt: skip
    with swapped(gluon_decode, "PROGRAMS_PER_SM", 1):
        times["two_streams_halves_attention_one_program_per_sm_ms"] = bench_graph(lambda: step.halves(streams))
        times["one_stream_whole_attention_one_program_per_sm_ms"] = bench_graph(lambda: step.rows(slice(None)))
    half = args.batch // 2
    result: dict = header("overlap_probe", "triton") | {
        "shape": {"layers": LAYERS, "hidden": H, "heads": [HQ, HKV, D], "intermediate": INTER, "batch": args.batch,
                  "context": args.context, "page": PAGE},  # fmt: skip
        "checks": checks,
        "times": times,
        "launches_alone_ms": {str(args.batch): launch_times(step, slice(None)),
                              str(half): launch_times(step, slice(0, half))},  # fmt: skip
        "default_decode_programs_per_sm": gluon_decode.PROGRAMS_PER_SM,
        "timing": "CUDA-graph replays (bench_graph): median ms per replay of the whole 28-layer sequence",
    }
    result["ratio_whole_over_two_streams"] = times["one_stream_whole_ms"] / times["two_streams_halves_ms"]
    print("[overlap_probe]", json.dumps({k: result[k] for k in ("checks", "times", "launches_alone_ms")}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
