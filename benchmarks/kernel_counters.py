"""Hardware counters (Nsight Compute) of the decode step's kernels: where each one is bound, not only how long it takes.

    python benchmarks/kernel_counters.py [--cases attn_b256_ctx160 mm256_down ...] [--out ...]

Each case runs in its own process under ``ncu --clock-control none --profile-from-start off``: the process builds the
case's inputs (Qwen3-1.7B shapes, bf16), launches it three times to compile and warm up, and profiles one more call
between ``cudaProfilerStart`` and ``cudaProfilerStop``, so every kernel ncu reports belongs to that call. ncu replays
each kernel once per counter pass with the caches flushed before each pass (its default cache control), so the
weights and K/V come from HBM, as in a decode step; unlike a decode step, so do the activations.

Cases: ``attn_b{B}_ctx{C}``: exact paged decode attention (16 query / 8 KV heads, head dim 128, 16-token pages in a
shuffled order) of ``B`` sequences with ``C`` keys, as the library launches it (on sm_90 within one KV split: the
Gluon decode kernel), and ``attn_b{B}_ctx{C}_tl`` on the ``tl`` kernel; ``attn_prefill_{B}x{S}`` and
``sdpa_prefill_{B}x{S}`` (in the default list: ``64x512``): the exact packed causal forward of ``B`` sequences of
``S`` tokens and SDPA's default backend on the same shape; ``mm{M}_{shape}`` and ``mm{M}_{shape}_torch``: the
exact matmul (the library's tile for ``M``) and ``torch.mm`` (cuBLAS) of the projections as the exactified model
calls them; ``mm{M}_gate_up_gated``: the library's SiLU-gated gate/up launch on the concatenated weights (``[M,
6144]`` out; on sm_90 above 64 rows the warp-specialized Gluon kernel), whose ``--source`` samples split its time
between the wgmma chains and the SiLU epilogue; ``head256``: the exact lm head + log-softmax of 256 rows.

``--source`` collects per-instruction warp-stall samples instead (``SourceCounters``, ncu's ``source`` page with the
SASS): per kernel the instructions with the most samples, each with its address, SASS text and every stall column
ncu reports, plus the samples summed by opcode (output: ``benchmarks/results/kernel_sass_stalls_h200.json``).

Per kernel the JSON keeps the duration, DRAM and L2 bytes and throughputs (percent of peak), SM and tensor-pipe
throughput, achieved occupancy and its limits, registers and shared memory, and the five largest warp-stall reasons
(cycles per issued instruction); ``raw`` holds every counter of the sections collected. Output:
``benchmarks/results/kernel_counters_h200.json``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common import ROOT, header, require_cuda

HQ, HKV, D, PAGE = 16, 8, 128, 16
HIDDEN, VOCAB = 2048, 151936
MM_SHAPES = {"gate_up": (12288, 2048), "qkv": (4096, 2048), "o": (2048, 2048), "down": (2048, 6144)}
CASES = [
    "attn_b256_ctx160",
    "attn_b256_ctx160_tl",
    "attn_b256_ctx384",
    "attn_b256_ctx384_tl",
    "attn_b4_ctx8192",
    "attn_b32_ctx8192",
    "attn_prefill_64x512",
    "sdpa_prefill_64x512",
    *[f"mm256_{s}{t}" for s in MM_SHAPES for t in ("", "_torch")],
    "mm256_gate_up_gated",
    "mm4_down",
    "mm4_down_torch",
    "head256",
]
SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats"]
SUMMARY = {  # summary key -> ncu raw metrics, the first one present is taken (names differ between ncu versions)
    "duration_ns": ("gpu__time_duration.sum",),
    "dram_read_bytes": ("dram__bytes_read.sum",),
    "dram_write_bytes": ("dram__bytes_write.sum",),
    "dram_pct_of_peak": (
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    ),
    "l2_bytes": ("lts__t_bytes.sum",),
    "l2_pct_of_peak": ("lts__throughput.avg.pct_of_peak_sustained_elapsed",),
    "l1_pct_of_peak": ("l1tex__throughput.avg.pct_of_peak_sustained_active",),
    "sm_pct_of_peak": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct",),
    "occupancy_limit_registers": ("launch__occupancy_limit_registers",),
    "occupancy_limit_shared_mem": ("launch__occupancy_limit_shared_mem",),
    "occupancy_limit_warps": ("launch__occupancy_limit_warps",),
    "registers_per_thread": ("launch__registers_per_thread",),
    "shared_mem_per_block": ("launch__shared_mem_per_block",),
    "grid_size": ("launch__grid_size",),
    "block_size": ("launch__block_size",),
    "waves_per_sm": ("launch__waves_per_multiprocessor",),
}


def _ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    hits = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) + sorted(glob.glob("/usr/local/cuda*/bin/ncu"))
    return hits[-1] if hits else None


def build(case: str) -> Callable[[], object]:
    """The call a case profiles (inputs built once, outside the profiled window)."""
    import torch

    from rlexact.ops import triton_attention as ta
    from rlexact.ops.triton_logprob import token_logprobs
    from rlexact.ops.triton_matmul import gated_matmul, matmul

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    scale = 1.0 / math.sqrt(D)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g).to(dt)

    if case.startswith("attn_b"):
        b, ctx = (int(x) for x in case.removeprefix("attn_b").removesuffix("_tl").split("_ctx"))
        nblk = math.ceil(ctx / PAGE)
        kc, vc = randn(b * nblk, PAGE, HKV, D), randn(b * nblk, PAGE, HKV, D)
        tables = torch.randperm(b * nblk, device=dev, generator=g).to(torch.int32).view(b, nblk)
        q = randn(b, HQ, D)
        cu = torch.arange(b + 1, device=dev, dtype=torch.int32)
        lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
        counters = torch.zeros(b * HKV * 4, device=dev, dtype=torch.int32)
        if case.endswith("_tl"):
            out = torch.empty_like(q)
            return lambda: ta._forward(q, kc, vc, cu, lens, tables, scale, out, cfg={"GLUON": False}, max_seqlen_q=1,
                                       counters=counters)  # fmt: skip
        return lambda: ta.attention_paged(q, kc, vc, tables, cu, lens, scale, max_seqlen_q=1, split_counters=counters)
    if "_prefill_" in case:
        b, s = (int(x) for x in case.rsplit("_", 1)[1].split("x"))
        if case.startswith("sdpa"):
            import torch.nn.functional as F

            q, k, v = randn(b, HQ, s, D), randn(b, HQ, s, D), randn(b, HQ, s, D)
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        q, k, v = randn(b * s, HQ, D), randn(b * s, HKV, D), randn(b * s, HKV, D)
        cu = torch.arange(0, b * s + 1, s, device=dev, dtype=torch.int32)
        return lambda: ta.attention_varlen(q, k, v, cu, scale)
    if case.startswith("mm"):
        m_text, rest = case.removeprefix("mm").split("_", 1)
        name = rest.removesuffix("_torch").removesuffix("_gated")
        n, k = MM_SHAPES[name]
        x, w = randn(int(m_text), k), randn(n, k)
        if rest.endswith("_torch"):
            return lambda: torch.mm(x, w.T)
        if rest.endswith("_gated"):
            return lambda: gated_matmul(x, w)
        return lambda: matmul(x, w)
    if case == "head256":
        h, w = randn(256, HIDDEN), randn(VOCAB, HIDDEN)
        t = torch.randint(0, VOCAB, (256,), device=dev, generator=g)
        return lambda: token_logprobs(h, w, t, 1.0)
    raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def child(case: str) -> int:
    """Run one case: three unprofiled calls, then one between the profiler start and stop."""
    import torch

    fn = build(case)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def _number(text: str) -> float | str:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse(report: str) -> list[dict]:
    """Kernels of ncu's ``--csv --page raw --print-units base`` report: one dict of counters per kernel."""
    lines = report[report.index('"ID"') :].splitlines()
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    head, body = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]  # rows[1] holds the units
    kernels = []
    for row in body:
        raw = {k: _number(v) for k, v in zip(head, row) if v != ""}
        summary = {key: next(raw[m] for m in names if m in raw) for key, names in SUMMARY.items() if raw.keys() & names}
        tensor = {k: v for k, v in raw.items() if "pipe_tensor" in k and "pct" in k}
        stalls = {
            k.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio"): v
            for k, v in raw.items()
            if k.startswith("smsp__average_warps_issue_stalled_") and isinstance(v, float)
        }
        kernels.append(
            {
                "name": str(raw.get("Kernel Name", ""))[:160],
                "summary": summary,
                "tensor_pipes_pct": tensor,
                "top_stalls_per_issue": dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5]),
                "raw": {k: v for k, v in raw.items() if isinstance(v, float)},
            }
        )
    return kernels


SOURCE_TOP = 60
"""Instructions kept per kernel by ``--source`` (the most stall samples first)."""
HOT = 12
"""Instructions of the most stall samples whose neighbourhood ``--source`` keeps as text (``hot_regions``)."""
CONTEXT = (12, 4)
"""Instructions kept before and after each of the :data:`HOT` ones: enough to tell which loop or barrier wait holds
it, since the addresses of one build do not map onto another's listing."""


def hot_regions(rows: list[dict], samples: str) -> list[list[str]]:
    """The neighbourhoods of the :data:`HOT` instructions of ``rows`` (in address order) with the most ``samples``
    (none without samples), overlapping ones merged: one line per instruction, ``offset from the kernel's first
    instruction | samples | times executed | SASS``."""
    if not rows:
        return []
    base = int(rows[0]["Address"], 16)
    hot = [i for i in sorted(range(len(rows)), key=lambda i: -rows[i][samples])[:HOT] if rows[i][samples] > 0]
    spans: list[list[int]] = []
    for i in sorted(hot):
        lo, hi = max(0, i - CONTEXT[0]), min(len(rows), i + CONTEXT[1] + 1)
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    line = "{:#07x} | {:>7.0f} | {:>8} | {}"
    return [[line.format(int(r["Address"], 16) - base, r[samples], r.get("Instructions Executed", ""),
                         r["Source"].strip()) for r in rows[lo:hi]] for lo, hi in spans]  # fmt: skip


def parse_source(report: str) -> list[dict]:
    """Kernels of ncu's ``--csv --page source --print-source sass`` report: per kernel the :data:`SOURCE_TOP`
    instructions with the most warp-stall samples (every column ncu gives), the samples summed by opcode and the
    listing around the hottest instructions (:func:`hot_regions`)."""
    kernels, rows, head = [], [], None
    for row in csv.reader(io.StringIO(report)):
        if "Source" in row and "Address" in row:  # each kernel's table starts with its header row
            if head is not None:
                kernels.append((head, rows))
            head, rows = row, []
        elif head is not None and len(row) == len(head):
            rows.append(dict(zip(head, row)))
    if head is not None:
        kernels.append((head, rows))
    out = []
    for head, rows in kernels:
        samples = next((c for c in head if c.startswith("Warp Stall Sampling (All")), None)
        if samples is None:
            out.append({"columns": head, "error": "no warp-stall sampling column"})
            continue
        by_op: dict[str, float] = {}
        for r in rows:
            r[samples] = float(_number(r[samples])) if r[samples] else 0.0
            op = next((w for w in r["Source"].split() if not w.startswith("@")), "").split(".")[0]
            by_op[op] = by_op.get(op, 0.0) + r[samples]
        top = sorted(rows, key=lambda r: -r[samples])[:SOURCE_TOP]
        out.append(
            {
                "columns": head,
                "samples_column": samples,
                "total_samples": sum(r[samples] for r in rows),
                "instructions": len(rows),
                "samples_by_opcode": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
                "top_instructions": top,
                "hot_regions": hot_regions(rows, samples),
            }
        )
    return out


SOURCE_SECTIONS = ["SourceCounters", "WarpStateStats"]
"""What ``--source`` collects: per-instruction warp-stall samples and the stall reasons."""


def profile(ncu: str, case: str, timeout: float, source: bool = False) -> dict:
    """One case under ncu: its counters (``raw`` page, :func:`parse`) or, with ``source``, its per-instruction
    stall samples (``source`` page with the SASS, :func:`parse_source`)."""
    if source:
        page = ["--page", "source", "--print-source", "sass", *[a for s in SOURCE_SECTIONS for a in ("--section", s)]]
    else:
        page = ["--page", "raw", "--print-units", "base", *[a for s in SECTIONS for a in ("--section", s)]]
    cmd = [
        ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", *page,
        sys.executable, str(Path(__file__).resolve()), "--child", case,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parent)
    entry: dict = {"seconds": round(time.perf_counter() - t0, 1)}
    if source:
        entry["report_head"] = proc.stdout[:2000]
    ok = proc.returncode == 0 and (source or '"ID"' in proc.stdout)
    kernels = (parse_source if source else parse)(proc.stdout) if ok else []
    if not kernels:
        entry["error"] = f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
        return entry
    entry["kernels"] = kernels
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=CASES, help="cases to profile (default: all)")
    ap.add_argument("--out", default=None, help="output JSON (default kernel_counters_h200.json, with --source "
                    "kernel_sass_stalls_h200.json, in benchmarks/results)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per case")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--source", action="store_true", help="per-instruction stall samples (kernel_sass_stalls)")
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    require_cuda("kernel_counters.py")
    ncu = _ncu()
    if ncu is None:
        print("kernel_counters: ncu (Nsight Compute) not found on PATH or under /opt/nvidia/nsight-compute")
        return 1
    results = ROOT / "benchmarks" / "results"
    if args.source:
        return source_main(ncu, args, args.out or str(results / "kernel_sass_stalls_h200.json"))
    args.out = args.out or str(results / "kernel_counters_h200.json")
    result: dict = header("kernel_counters", "triton") | {
        "ncu": ncu,
        "sections": SECTIONS,
        "note": "one profiled call per case; ncu flushes the caches before each replay pass, so inputs come from HBM",
        "cases": {},
    }
    t0 = time.perf_counter()
    for case in args.cases:
        result["cases"][case] = entry = profile(ncu, case, args.timeout)
        for kern in entry.get("kernels", []):
            s = kern["summary"]
            print(
                f"[kernel_counters] {case:24s} {kern['name'][:40]:40s} {s.get('duration_ns', 0) / 1e3:8.1f} us "
                f"dram {s.get('dram_pct_of_peak', 0):5.1f}% l2 {s.get('l2_pct_of_peak', 0):5.1f}% "
                f"sm {s.get('sm_pct_of_peak', 0):5.1f}% occ {s.get('achieved_occupancy_pct', 0):5.1f}% "
                f"stalls {list(kern['top_stalls_per_issue'])[:3]}",
                flush=True,
            )
        if "error" in entry:
            print(f"[kernel_counters] {case}: {entry['error'][-600:]}", flush=True)
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # after every case: a timeout keeps the rest
    print(f"[kernel_counters] wrote {args.out} ({result['elapsed_s']} s)")
    return 0 if all("error" not in e for e in result["cases"].values()) else 1


def source_main(ncu: str, args: argparse.Namespace, out: str) -> int:
    """``--source``: per-instruction warp-stall samples of each case's kernels, written to ``out``."""
    result: dict = header("kernel_sass_stalls", "triton") | {
        "ncu": ncu,
        "sections": SOURCE_SECTIONS,
        "note": "warp-stall samples per SASS instruction of one profiled call per case",
        "cases": {},
    }
    rc = 0
    for case in args.cases:
        result["cases"][case] = entry = profile(ncu, case, args.timeout, source=True)
        for kern in entry.get("kernels", []):
            ops = list(kern.get("samples_by_opcode", {}).items())[:8]
            print(f"[kernel_counters --source] {case}: {kern.get('total_samples')} samples, top opcodes {ops}")
        if "error" in entry:
            rc = 1
            print(f"[kernel_counters --source] {case}: {entry['error'][-1500:]}", flush=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
