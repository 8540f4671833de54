"""Eager prefill at batch 256: the token budget per packed forward (``max_num_batched_tokens``) side by side, and
where the host time of the eager steps goes.

For each budget the exact generator runs the ``rollout_throughput`` call (batch 256, 128 random prompt tokens, 256
new tokens, EOS ignored) once to warm up and ``--reps`` times timed: walls, ``eager_s`` (the eager steps' wall) and
``eager_host_s`` (their host time by part) per call, and whether the completions equal the first budget's (tokens
and log-probs bitwise: a row's bits must not depend on how prompts are chunked). One more call per budget runs under
``cProfile``; the functions with the most own time are stored.

    python benchmarks/prefill_chunks.py --out benchmarks/results/prefill_chunks_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
import traceback
from pathlib import Path

import torch

import rlexact
from common import ROOT, header, require_cuda
from rlexact.rollout import SamplingParams
from rollout_throughput import build_model, make_generator, same_completions, sync, timed_generate


def profile_call(gen, prompts, params, device, top: int) -> list[dict]:  # noqa: ANN001
    """The ``top`` functions by own time in one ``generate`` call under ``cProfile``."""
    prof = cProfile.Profile()
    sync(device)
    prof.enable()
    gen.generate(prompts, params)
    sync(device)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": nc, "own_s": tt, "cumulative_s": ct})
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill_chunks_h200.json"))
    args = ap.parse_args()
    if not args.tiny:
        require_cuda("prefill_chunks.py", "--tiny")
    device = torch.device("cpu" if args.tiny else "cuda")
    ns = argparse.Namespace(tiny=args.tiny, layers=None, no_graphs=False, batched_tokens=0)
    result: dict = header("prefill_chunks", "triton", "transformers") | {
        "setup": {"model": "Qwen3-1.7B shape (random init)", "dtype": "bfloat16", "batch": args.batch,
                  "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps},
        "budgets": {},
        "errors": {},
    }  # fmt: skip
    t0 = time.perf_counter()
    model = build_model(ns, device, torch.float32 if args.tiny else torch.bfloat16)
    rlexact.exactify(model)
    g = torch.Generator().manual_seed(args.batch)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    reference = None
    for budget in args.budgets:
        try:
            ns.batched_tokens = budget
            gen = make_generator(model, "exact", args.batch, ns)
            timed_generate(gen, prompts, params, device)
            walls, eager, host = [], [], []
            for _ in range(args.reps):
                wall, outs = timed_generate(gen, prompts, params, device)
                walls.append(wall)
                eager.append(gen.stats.get("eager_s"))
                host.append(dict(gen.stats.get("eager_host_s") or {}))
            reference = reference if reference is not None else outs
            tokens = sum(len(o.token_ids) for o in outs)
            result["budgets"][str(budget)] = {
                "tokens_per_s_median": tokens / statistics.median(walls),
                "walls_s": walls,
                "eager_s": eager,
                "eager_host_s": host,
                "eager_steps": gen.stats.get("eager_steps"),
                "same_as_first_budget": same_completions(outs, reference),
                "cprofile_top_own_time": profile_call(gen, prompts, params, device, args.top),
            }
            gen.release()
        except Exception:  # noqa: BLE001
            result["errors"][str(budget)] = traceback.format_exc()
        print(json.dumps({k: v for k, v in result["budgets"].get(str(budget), {}).items()
                          if k != "cprofile_top_own_time"}), flush=True)  # fmt: skip
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
