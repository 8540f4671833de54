"""Math-reward throughput: 4,096 MathReward samples scored in process, with 1 worker process, and with all cores.

    python benchmarks/reward_throughput.py [--samples 4096] [--out benchmarks/results/reward_throughput_cpu.json]

Each mode scores the same deterministic batch (boxed fractions, plain numbers, symbolic expressions; about half of the
answers right) once after a warm-up batch; worker start-up is measured separately and not counted in the throughput.
The rewards of every mode must be identical (the script fails otherwise). The JSON records the commit, command,
date, versions, CPU count and the load average, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import subprocess
import time

from common import ROOT, header
from rlexact.rewards import MathReward, RewardExecutor, default_workers


def make_batch(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """``n`` (prompt, completion, answer) triples in the styles a math policy writes; about half are right."""
    rng = random.Random(seed)
    prompts, completions, answers = [], [], []
    for k in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        right = rng.random() < 0.5
        style = k % 4
        if style == 0:
            completions.append(f"... so the result is \\boxed{{\\frac{{{a}}}{{{b}}}}}.")
            answers.append(f"{a / b:.6f}" if right else f"{(a + 1) / b:.6f}")
        elif style == 1:
            completions.append(f"Adding {a} and {b} gives {a + b}.")
            answers.append(str(a + b if right else a + b + 1))
        elif style == 2:
            completions.append(f"Expanding: \\boxed{{(x+{a})^2}}")
            answers.append(f"x^2 + {2 * a}x + {a * a}" if right else f"x^2 + {a}x + {a * a}")
        else:
            completions.append(f"The answer is $\\boxed{{\\sqrt{{{a * a * b}}}}}$")
            answers.append(f"{a}\\sqrt{{{b}}}" if right else f"{a + 1}\\sqrt{{{b}}}")
        prompts.append(f"problem {k}")
    return prompts, completions, answers


def time_mode(workers: int, batch: tuple[list, list, list]) -> tuple[dict, list[float]]:
    """Score ``batch`` with ``workers`` worker processes (0 = in this process); start-up and warm-up excluded."""
    reward = MathReward(time_limit_s=None)
    t0 = time.perf_counter()
    with RewardExecutor(reward, workers=workers, timeout_s=60.0) as ex:
        warm = [part[:64] for part in batch]
        ex.run(*warm)
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        result = ex.run(*batch)
        seconds = time.perf_counter() - t1
    n = len(batch[0])
    stats = {
        "workers": workers,
        "seconds": round(seconds, 3),
        "samples_per_s": round(n / seconds, 1),
        "startup_and_warmup_s": round(startup, 3),
        "timeouts": len(result.timeouts),
    }
    return stats, result.rewards


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--", "src/rlexact/rewards", "benchmarks/reward_throughput.py")
    return commit + ("-dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reward_throughput_cpu.json"))
    args = parser.parse_args()

    batch = make_batch(args.samples)
    all_cores = default_workers()
    modes, rewards = [], []
    for workers in (0, 1, all_cores):
        stats, values = time_mode(workers, batch)
        modes.append(stats)
        rewards.append(values)
        print(json.dumps(stats), flush=True)
    if any(r != rewards[0] for r in rewards):
        raise SystemExit("the rewards differ between modes")

    out = header("MathReward throughput: in process vs 1 worker vs all cores", "math_verify", "sympy")
    out.update(
        {
            "commit": git_commit(),
            "math_verify_version": importlib.metadata.version("math-verify"),
            "samples": args.samples,
            "cpus": all_cores,
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "mean_reward": round(sum(rewards[0]) / len(rewards[0]), 4),
            "rewards_identical_across_modes": True,
            "modes": modes,
            "speedup_all_cores_vs_1_worker": round(modes[1]["seconds"] / modes[2]["seconds"], 2),
        }
    )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
