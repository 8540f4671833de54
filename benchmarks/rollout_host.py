"""Host (CPU) time of one generator decode step with the device work removed.

The real engine loop runs (scheduler, block manager, the CUDA-graph decode path's input staging and table sync,
collecting the sampled tokens, appending them, stop checks, finishing sequences) while the model forward, lm head and
sampler are replaced by a stub that returns a fixed token: prefill steps skip the forward, and the "captured graph"
only writes that token into the output buffer. The stub lives here, never in the library. Runs on a CPU-only machine.

    python benchmarks/rollout_host.py                    # batches 64 and 256, 128 prompt + 256 new tokens
    python benchmarks/rollout_host.py --cprofile 256     # also print the top functions of batch 256 under cProfile

Per decode step and batch it prints (and writes to ``--out``, default ``benchmarks/results/rollout_host_cpu.json``):
``loop_us`` (wall time from one step's schedule to the next's), its split ``schedule_us`` / ``runner_us`` /
``engine_other_us`` (measured by wrapping ``Scheduler.schedule`` and ``ModelRunner.step``), and ``parts_us``, the
generator's own ``stats["decode_host_s"]`` breakdown.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

import rlexact
from common import ROOT, header
from rlexact.rollout import Generator, SamplingParams
from rlexact.rollout import engine as engine_mod
from rlexact.rollout.runner import GraphState, ModelRunner
from rlexact.rollout.scheduler import ScheduledBatch, Scheduler
from rlexact.rollout.sequence import Sequence

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

    def _capture(self, gs: GraphState, bucket: int, kv_len: int | None) -> _StubGraph:
        self.stats["graph_captures"] += 1
        return _StubGraph(gs, bucket)

    def _eager_step(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, float]]:
        out = []
        for s, n in zip(batch.seqs, batch.num_new):
            s.num_computed += n
            if s.num_computed == len(s.tokens):
                out.append((s, STUB_TOKEN, STUB_LOGPROB))
        return out


def measure(batch: int, prompt_len: int, new_tokens: int, profiler: cProfile.Profile | None) -> dict:
    """Per-decode-step host times of one stubbed ``generate`` of ``batch`` prompts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
    )  # fmt: skip
    model = rlexact.exactify(Qwen3ForCausalLM(cfg).eval())
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 1000, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True)
    times = {"schedule": 0.0, "runner": 0.0, "loop": 0.0}
    state = {"decode": False, "last_end": None, "steps": 0}
    orig_schedule, orig_step = Scheduler.schedule, StubRunner.step

    def schedule(self: Scheduler) -> ScheduledBatch:
        t0 = time.perf_counter()
        if state["decode"] and state["last_end"] is not None:
            times["loop"] += t0 - state["last_start"]
        out = orig_schedule(self)
        times["schedule_pending"] = time.perf_counter() - t0
        state["last_start"] = t0
        state["decode"] = out.is_decode
        return out

    def step(self: ModelRunner, b: ScheduledBatch) -> list:
        t0 = time.perf_counter()
        out = orig_step(self, b)
        t1 = time.perf_counter()
        if b.is_decode:
            times["runner"] += t1 - t0
            times["schedule"] += times["schedule_pending"]
            state["steps"] += 1
        state["last_end"] = t1
        return out

    engine_mod.ModelRunner = StubRunner
    Scheduler.schedule, StubRunner.step = schedule, step
    try:
        gen = Generator(model, max_num_seqs=batch, max_num_batched_tokens=max(8192, 2 * batch), block_size=16)
        gen.generate(prompts, SamplingParams(max_new_tokens=4, seed=0, ignore_eos=True))  # warm-up
        times.update(schedule=0.0, runner=0.0, loop=0.0)
        state.update(decode=False, last_end=None, steps=0)
        if profiler is not None:
            profiler.enable()
        outs = gen.generate(prompts, params)
        if profiler is not None:
            profiler.disable()
        if state["decode"]:  # the last decode step ends with the loop
            times["loop"] += state["last_end"] - state["last_start"]
    finally:
        engine_mod.ModelRunner = ModelRunner
        Scheduler.schedule, StubRunner.step = orig_schedule, orig_step
    assert all(o.token_ids == [STUB_TOKEN] * new_tokens for o in outs)
    steps = state["steps"]
    us = {k: v / steps * 1e6 for k, v in times.items() if k != "schedule_pending"}
    res = {
        "decode_steps": steps,
        "loop_us": us["loop"],
        "schedule_us": us["schedule"],
        "runner_us": us["runner"],
        "engine_other_us": us["loop"] - us["schedule"] - us["runner"],
    }
    parts = gen.stats.get("decode_host_s")
    if isinstance(parts, dict) and gen.stats.get("graph_steps"):
        res["parts_us"] = {k: v / gen.stats["graph_steps"] * 1e6 for k, v in parts.items()}
    return res


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
        best = min(runs, key=lambda r: r["loop_us"])
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
