"""The CPU twin's attention (``rlexact.ops.cpu``) timed at this checkout and at another revision of the same file.

    python benchmarks/cpu_attention.py [--against REV] [--reps 20] [--out benchmarks/results/cpu_attention_cpu.json]

``--against`` (default ``HEAD~1``) names a git revision whose ``src/rlexact/ops/cpu.py`` is loaded beside the
checkout's; both modules run the same calls on the same inputs, one torch thread (the demo's setting): packed prefill
(``attention_varlen``), prefill chunks over a shuffled paged cache and decode of 256 sequences (``attention_paged``),
each with and without a sliding window, at the demo model's heads (4 query / 2 KV heads, head dim 32) and at
Qwen3-1.7B's (16 / 8, 128). Every output must equal the other revision's bitwise (``torch.equal``): the file's
arithmetic is its bit contract, so a faster layout that changed a bit would change every CPU rollout. Per case the
median wall time per call over ``--reps`` rounds that alternate the two revisions, after a warm-up call of each.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from common import ROOT, header
from rlexact.envinfo import commit_sources
from rlexact.ops import cpu

CPU_FILE = "src/rlexact/ops/cpu.py"
HEADS = {"demo": (4, 2, 32), "qwen3": (16, 8, 128)}


def load_revision(rev: str) -> ModuleType:
    """``rlexact.ops.cpu`` as it was at git revision ``rev``, loaded as a module of its own."""
    path = Path(tempfile.mkdtemp()) / "cpu_at_revision.py"
    path.write_bytes(commit_sources(rev, ROOT)[CPU_FILE])
    spec = importlib.util.spec_from_file_location("cpu_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def varlen_case(lens: list[int], heads: tuple[int, int, int], window: int | None) -> Callable[[ModuleType], object]:
    hq, hkv, d = heads
    t = sum(lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cu = torch.tensor([0, *itertools.accumulate(lens)])
    return lambda m: m.attention_varlen(q, k, v, cu, d**-0.5, window)


def paged_case(lens_k: list[int], new: list[int], heads: tuple[int, int, int], window: int | None,
               block: int = 16) -> Callable[[ModuleType], object]:  # fmt: skip
    hq, hkv, d = heads
    width = -(-max(lens_k) // block)
    kc, vc = (torch.randn(len(lens_k) * width, block, hkv, d) for _ in range(2))
    table = torch.randperm(len(lens_k) * width).to(torch.int32).view(len(lens_k), width)  # shuffled pages
    cu = torch.tensor([0, *itertools.accumulate(new)])
    q = torch.randn(int(cu[-1]), hq, d)
    seqlens = torch.tensor(lens_k, dtype=torch.int32)
    return lambda m: m.attention_paged(q, kc, vc, table, cu, seqlens, d**-0.5, window=window)


def cases() -> dict[str, Callable[[ModuleType], object]]:
    """The timed calls by name (inputs drawn once, seeded)."""
    torch.manual_seed(0)
    out: dict[str, Callable[[ModuleType], object]] = {}
    for name, heads in HEADS.items():
        for window in (None, 64):
            tag = f"{name}_w{window}" if window else name
            out[f"varlen_8x96_{tag}"] = varlen_case([96] * 8, heads, window)
            out[f"varlen_mixed_{tag}"] = varlen_case([5, 40, 130, 300, 17, 64, 1, 250], heads, window)
            out[f"paged_chunks_{tag}"] = paged_case([300, 1100, 80, 64], [40, 100, 80, 16], heads, window)
            out[f"decode_256x20_{tag}"] = paged_case([20] * 256, [1] * 256, heads, window)
            out[f"decode_64x300_{tag}"] = paged_case([300] * 64, [1] * 64, heads, window)
    return out


def alternating_ms(calls: tuple[Callable[[], object], ...], reps: int) -> list[float]:
    """Median wall ms per call of each of ``calls``, timed in ``reps`` rounds that call each once in turn."""
    for call in calls:
        call()
    walls: list[list[float]] = [[] for _ in calls]
    for _ in range(reps):
        for call, w in zip(calls, walls):
            t0 = time.perf_counter()
            call()
            w.append(time.perf_counter() - t0)
    return [statistics.median(w) * 1e3 for w in walls]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD~1", help="git revision of src/rlexact/ops/cpu.py to compare with")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_attention_cpu.json"))
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit(f"cpu_attention: --reps must be >= 1, got {args.reps}")
    other = load_revision(args.against)
    against = subprocess.run(["git", "rev-parse", args.against], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=60).stdout.strip()  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    result = header("cpu_attention", "torch") | {"against": against, "threads": 1, "reps": args.reps, "cases": {}}
    try:
        for name, case in cases().items():
            ms, ms_against = alternating_ms((lambda case=case: case(cpu), lambda case=case: case(other)), args.reps)
            row = {"bitwise_equal": bool(torch.equal(case(cpu), case(other))), "ms": ms, "ms_against": ms_against,
                   "speedup": ms_against / ms}  # fmt: skip
            result["cases"][name] = row
            print(f"[cpu_attention] {name:28s} {row['ms']:9.2f} ms vs {row['ms_against']:9.2f} ms "
                  f"({row['speedup']:.2f}x) bitwise {row['bitwise_equal']}", flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"[cpu_attention] wrote {args.out}")
    return 0 if all(r["bitwise_equal"] for r in result["cases"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
