"""Where a decode step's GPU time goes between kernels: the device timeline of profiled exact ``generate`` calls.

``rollout_throughput.py --profile`` sums kernel durations per step; this script looks at *when* they ran. It profiles
one exact ``generate`` per batch (Qwen3-1.7B's shape, or with ``--arch gemma3`` Gemma 3 1B's; bf16, ``--prompt-len``
random prompt tokens, ``--new-tokens`` new tokens, EOS ignored) after two warm-up calls, and over the decode steps
(from the ``--skip``-th CUDA-graph launch to the end) reports:

- ``busy_ms_per_step`` / ``idle_ms_per_step`` / ``busy_fraction``: the union of the device intervals (kernels,
  copies, memsets) and the rest;
- ``gaps_over_min``: every idle interval longer than ``--min-gap-us``, summed by the (previous, next) device event
  names, and ``gap_histogram`` of all gaps;
- ``host_calls_per_step``: the host's runtime calls (``cudaGraphLaunch``, copies, syncs, host allocations) with
  their count and host time;
- ``launches_inside_a_gap`` and ``device_wait_for_launch_ms_per_step`` / ``_median_ms``: launches (graphs or
  kernels) that began after the device had run out of queued work, and how long the device had waited by then.

``eager`` holds the same for the call's eager window (its prefill steps: from the first device event to the first
graph launch) as one step. ``--host-profile N`` also runs one more call under ``cProfile`` and lists the ``N``
functions with the most own host time (``host_profile``). ``--phases`` runs one more call unprofiled with the
engine's steps timed on the host (``phases``): every call of the methods in ``PHASES`` until the third graph launch,
with its host start and duration and the time at which the device reached it (a CUDA event recorded at its start),
both from the call's start, so a phase that begins with the device already there left the device waiting.

    python benchmarks/decode_timeline.py                        # batches 64 and 256
    python benchmarks/decode_timeline.py --trace /tmp/traces    # also write the Chrome traces there

Writes ``benchmarks/results/decode_timeline_h200.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gzip
import json
import pstats
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

import rlexact
from common import ROOT, header, require_cuda
from rlexact.rollout import Generator, SamplingParams
from rlexact.rollout.runner import ModelRunner
from rlexact.rollout.scheduler import Scheduler
from rollout_throughput import MODEL_NAMES, build_model

HOST_CALLS = ("cudaGraphLaunch", "cudaMemcpy", "cudaEventSynchronize", "cudaStreamSynchronize", "cudaHostAlloc",
              "cudaLaunchKernel", "cuLaunchKernel", "cudaMalloc", "cudaFree", "cudaEventRecord")  # fmt: skip
LAUNCH_CALLS = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel")
GAP_BUCKETS_US = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, float("inf"))


def device_intervals(prof) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every device event, sorted by start."""
    out = [
        (ev.time_range.start, ev.time_range.end, ev.name)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    ]
    return sorted(out)


def host_calls(prof) -> list[tuple[float, float, str]]:
    out = [
        (ev.time_range.start, ev.time_range.end, ev.name)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith(HOST_CALLS)
    ]
    return sorted(out)


def analyse(dev: list[tuple[float, float, str]], host: list[tuple[float, float, str]], args) -> dict:
    """The decode window: from the ``--skip``-th graph launch to the end, per graph step."""
    launches = [h for h in host if h[2] == "cudaGraphLaunch"]
    if len(launches) <= args.skip + 2:
        raise RuntimeError(f"only {len(launches)} graph launches were profiled; lower --skip or raise --new-tokens")
    t0 = launches[args.skip][0]
    res = timeline(dev, host, t0, float("inf"), len(launches) - args.skip, args)
    return {"graph_steps": res.pop("steps")} | res


def analyse_eager(dev: list[tuple[float, float, str]], host: list[tuple[float, float, str]], args) -> dict:
    """The eager window: from the call's first device event to its first graph launch (the prefill steps), as one
    step; ``device_ms`` is the window's length on the device."""
    launches = [h for h in host if h[2] == "cudaGraphLaunch"]
    t1 = launches[0][0] if launches else float("inf")
    t0 = dev[0][0]
    res = timeline(dev, host, t0, t1, 1, args)
    res.pop("steps")
    return res


def timeline(
    dev: list[tuple[float, float, str]], host: list[tuple[float, float, str]], t0: float, t1: float, steps: int, args
) -> dict:
    """Busy and idle device time of the device events starting in ``[t0, t1)``, per step, with the idle gaps by the
    (previous, next) event names and the host runtime calls in the window."""
    window = [d for d in dev if t0 <= d[0] < t1]
    cur_end = window[0][1]
    prev_name = window[0][2]
    busy, idle = window[0][1] - window[0][0], 0.0
    pairs: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    hist: Counter[str] = Counter()
    gaps: list[tuple[float, float]] = []
    for start, end, name in window[1:]:
        if start > cur_end:
            gap = start - cur_end
            idle += gap
            bucket = next(b for b in GAP_BUCKETS_US if gap <= b)
            hist[f"<={bucket}us"] += 1
            gaps.append((cur_end, start))
            if gap > args.min_gap_us:
                entry = pairs[(prev_name[:80], name[:80])]
                entry[0] += 1
                entry[1] += gap
        busy += max(0.0, end - max(start, cur_end))
        if end > cur_end:
            cur_end, prev_name = end, name
    top = sorted(pairs.items(), key=lambda kv: -kv[1][1])[: args.top]
    in_window = [h for h in host if t0 <= h[0] < t1]
    # the device's queue ran dry at a gap's start; a launch (graph or kernel) that began inside the gap kept the
    # device waiting
    waited_ms = []
    for launch_start, _, _ in (h for h in in_window[1:] if h[2].startswith(LAUNCH_CALLS)):
        gap = next(((gs, ge) for gs, ge in gaps if gs <= launch_start <= ge), None)
        if gap is not None:
            waited_ms.append((launch_start - gap[0]) / 1e3)
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for s, e, name in in_window:
        calls[name][0] += 1
        calls[name][1] += e - s
    return {
        "steps": steps,
        "busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": idle / steps / 1e3,
        "busy_fraction": busy / (busy + idle),
        "gap_histogram": {f"<={b}us": hist[f"<={b}us"] for b in GAP_BUCKETS_US if hist[f"<={b}us"]},
        "gaps_over_min": [
            {"prev": p, "next": n, "count": c, "ms_per_step": us / steps / 1e3} for (p, n), (c, us) in top
        ],
        "host_calls_per_step": {
            name: {"calls": c / steps, "host_ms": us / steps / 1e3}
            for name, (c, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])
        },
        "launches_inside_a_gap": len(waited_ms),
        "device_wait_for_launch_ms_per_step": sum(waited_ms) / steps,
        "device_wait_for_launch_median_ms": statistics.median(waited_ms) if waited_ms else 0.0,
    }


def host_profile(call: Callable[[], object], top: int) -> list[dict]:
    """The ``top`` functions by own host time (``tottime``) of one ``call()`` under ``cProfile``."""
    prof = cProfile.Profile()
    prof.enable()
    call()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {"function": f"{Path(f).name}:{line}:{name}", "calls": n, "tottime_ms": tt * 1e3, "cumtime_ms": ct * 1e3}
        for (f, line, name), (_, n, tt, ct, _) in rows
    ]


PHASES: dict[type, tuple[str, ...]] = {
    Generator: ("_check_tokens", "_run", "_fused_projections", "_cache_plan", "_get_cache", "_finish_step"),
    Scheduler: ("schedule", "chain", "chain_prefill"),
    ModelRunner: ("__init__", "launch", "launch_eager", "collect", "collect_eager", "capture_ahead", "_prepare",
                  "_upload", "_eager_forward", "_head_sample", "_read_back", "_sync_table"),
}  # fmt: skip


def phases(call: Callable[[], object], graph_launches: int = 3) -> list[dict]:
    """Run ``call()`` with the methods of ``PHASES`` timed: ``(name, depth, host_start_ms, host_ms, device_ms)`` per
    call until the ``graph_launches``-th ``ModelRunner.launch`` that replays a graph, ``device_ms`` being when the
    device reached the phase's start (``None`` inside a graph capture, where no event can be recorded)."""
    records: list[dict] = []
    depth = [0]
    launches = [0]
    base = torch.cuda.Event(enable_timing=True)
    t_base = [0.0]

    def wrap(fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def timed(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            if launches[0] >= graph_launches:
                return fn(*a, **kw)
            ev = None
            if not torch.cuda.is_current_stream_capturing():
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
            rec = {"name": name, "depth": depth[0], "host_start_ms": (time.perf_counter() - t_base[0]) * 1e3}
            records.append(rec)
            depth[0] += 1
            try:
                out = fn(*a, **kw)
            finally:
                depth[0] -= 1
                rec["host_ms"] = (time.perf_counter() - t_base[0]) * 1e3 - rec["host_start_ms"]
                rec["event"] = ev
            if name == "ModelRunner.launch" and out is not None:
                launches[0] += 1
            return out

        return timed

    saved = [(cls, m, cls.__dict__[m]) for cls, names in PHASES.items() for m in names]
    for cls, m, fn in saved:
        name = f"{cls.__name__}.{m}"
        setattr(cls, m, staticmethod(wrap(fn.__func__, name)) if isinstance(fn, staticmethod) else wrap(fn, name))
    try:
        torch.cuda.synchronize()
        t_base[0] = time.perf_counter()
        base.record()
        call()
        torch.cuda.synchronize()
    finally:
        for cls, m, fn in saved:
            setattr(cls, m, fn)
    for rec in records:
        ev = rec.pop("event")
        rec["device_ms"] = base.elapsed_time(ev) if ev is not None else None
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--skip", type=int, default=8, help="graph launches left out at the start of the window")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--arch", choices=sorted(MODEL_NAMES), default="qwen3", help="the model's shape (random weights)")
    ap.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens (at least 2 * batch)")
    ap.add_argument("--host-profile", type=int, default=0, help="functions listed from a cProfile'd call (0: none)")
    ap.add_argument("--phases", action="store_true", help="host phases of one unprofiled call (``phases``)")
    ap.add_argument("--trace", default=None, help="directory for gzipped Chrome traces")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_timeline_h200.json"))
    args = ap.parse_args()
    require_cuda("decode_timeline.py")
    args.tiny = False
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    model = rlexact.exactify(build_model(args, device, torch.bfloat16))
    result = header("decode_timeline", "triton", "transformers") | {
        "setup": {"model": MODEL_NAMES[args.arch], "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                  "skip": args.skip},
        "results": {},
    }
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        gen = Generator(model, max_num_seqs=batch, max_num_batched_tokens=max(args.batched_tokens, 2 * batch))
        params = SamplingParams(max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
        for _ in range(2):
            gen.generate(prompts, params)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen.generate(prompts, params)
            torch.cuda.synchronize()
        dev, host = device_intervals(prof), host_calls(prof)
        res = analyse(dev, host, args)
        res["decode_host_s"] = gen.stats.get("decode_host_s")
        res["eager"] = analyse_eager(dev, host, args)
        res["eager_host_s"] = gen.stats.get("eager_host_s")
        if args.host_profile:
            res["host_profile"] = host_profile(functools.partial(gen.generate, prompts, params), args.host_profile)
        if args.phases:
            res["phases"] = phases(functools.partial(gen.generate, prompts, params))
            res["phases_stats"] = {k: gen.stats.get(k) for k in ("setup_s", "eager_s", "graph_s", "elapsed_s")}
        result["results"][str(batch)] = res
        print(f"batch {batch}: " + json.dumps(res, default=str)[:3000], flush=True)
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            raw = Path(args.trace) / f"decode_b{batch}.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
                dst.write(src.read())
            raw.unlink()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
