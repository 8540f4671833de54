"""Host (CPU) time of one generator decode step with the device work removed.

The real engine loop runs (scheduler, block manager, the CUDA-graph decode path's table sync, input staging and
read-back, appending tokens, stop checks, finishing sequences) while prefill steps skip the forward and the
"captured graph" only writes a fixed token into the output buffer. The stub lives here, never in the library. Runs
on a CPU-only machine.

    python benchmarks/rollout_host.py                    # batches 64 and 256, 128 prompt + 256 new tokens
    python benchmarks/rollout_host.py --cprofile 256     # also print the top functions of batch 256 under cProfile

Per decode step and batch it writes (``--out``, default ``benchmarks/results/rollout_host_cpu.json``) ``step_us``:
the wall time of two calls that differ only in new tokens, divided by the difference; ``parts_us``: the generator's
own ``stats["decode_host_s"]`` split; and the Python garbage collections that ran during the decode steps
(``gc_per_step``: count and microseconds per generation), measured through ``gc.callbacks``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time
from pathlib import Path

import torch

import rlexact
from common import ROOT, header
from rlexact.rollout import Generator, SamplingParams
from rlexact.rollout import engine as engine_mod
from rlexact.rollout.runner import EagerLaunch, GraphState, GraphVariant, ModelRunner
from rlexact.rollout.scheduler import ScheduledBatch

STUB_TOKEN = 5
STUB_LOGPROB = -1.0


class _StubGraph:
    """Stands in for a captured decode graph: ``replay`` writes the stub token and log-prob for every row."""

    def __init__(self, gs: GraphState, bucket: int) -> None:
        self.out = gs.out[:, :bucket]

    def replay(self) -> None:
        self.out[0].fill_(STUB_TOKEN)
        self.out[1].fill_(STUB_LOGPROB)


class StubRunner(ModelRunner):
    """The real runner's host path with the device work stubbed out, running the CUDA-graph decode path on CPU."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.use_graphs = True
        self.bm.record_updates = True
        self._signature = self.signature()

    def _capture(self, gs: GraphState, bucket: int, var: GraphVariant, ahead: bool = False) -> _StubGraph:
        self.stats["graph_captures"] += 1
        self.stats["graph_captures_ahead"] += int(ahead)
        self.warmed.add(self._warm_key(bucket, var))  # as a real capture: later calls capture ahead
        return _StubGraph(gs, bucket)

    def launch_eager(self, batch: ScheduledBatch, decode_rows: int = 0) -> EagerLaunch:
        sampled = []
        for s, n in zip(batch.seqs, batch.num_new):
            s.num_computed += n
            if s.num_computed == len(s.tokens):
                sampled.append(s)
        out = torch.tensor([[STUB_TOKEN] * len(sampled), [STUB_LOGPROB] * len(sampled)], dtype=torch.float64)
        return EagerLaunch(batch, sampled, out if sampled else None, None, decode_rows)


class GcClock:
    """Count and time of the garbage collections per generation while it is installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._start


def timed_call(gen: Generator, prompts: list[list[int]], new_tokens: int) -> tuple[float, GcClock]:
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        t0 = time.perf_counter()
        outs = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True))
        wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(clock)
    assert all(o.token_ids == [STUB_TOKEN] * new_tokens for o in outs)
    return wall, clock


def measure(batch: int, prompt_len: int, new_tokens: int, profiler: cProfile.Profile | None) -> dict:
    """Per-decode-step host times of stubbed ``generate`` calls of ``batch`` prompts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
    )  # fmt: skip
    model = rlexact.exactify(Qwen3ForCausalLM(cfg).eval())
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 1000, (batch, prompt_len), generator=g).tolist()
    short_tokens = new_tokens // 2
    engine_mod.ModelRunner = StubRunner
    try:
        gen = Generator(model, max_num_seqs=batch, max_num_batched_tokens=max(8192, 2 * batch), block_size=16)
        timed_call(gen, prompts, 4)  # warm-up
        short, gc_short = timed_call(gen, prompts, short_tokens)
        if profiler is not None:
            profiler.enable()
        long, gc_long = timed_call(gen, prompts, new_tokens)
        if profiler is not None:
            profiler.disable()
    finally:
        engine_mod.ModelRunner = ModelRunner
    steps = new_tokens - short_tokens
    parts = gen.stats["decode_host_s"]
    graph_steps = gen.stats["graph_steps"]
    return {
        "decode_steps": steps,
        "step_us": (long - short) / steps * 1e6,
        "parts_us": {k: v / graph_steps * 1e6 for k, v in parts.items()},
        "gc_per_step": {
            f"gen{i}": {
                "collections": (gc_long.count[i] - gc_short.count[i]) / steps,
                "us": (gc_long.seconds[i] - gc_short.seconds[i]) / steps * 1e6,
            }
            for i in range(3)
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per batch; the fastest is reported")
    ap.add_argument("--cprofile", type=int, default=None, help="print cProfile's top functions for this batch")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rollout_host_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = header("rollout_host") | {
        "setup": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "stub": "fixed token, no forward"},
        "results": {},
    }
    for batch in args.batches:
        runs = [measure(batch, args.prompt_len, args.new_tokens, None) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["step_us"])
        result["results"][str(batch)] = best
        print(f"batch {batch}: " + json.dumps(best, default=lambda x: round(x, 1)), flush=True)
    if args.cprofile:
        prof = cProfile.Profile()
        measure(args.cprofile, args.prompt_len, args.new_tokens, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
