"""RLModule under Lightning's ``DDPStrategy`` (two CPU ranks, gloo): the ranks sample disjoint prompts and end with
bitwise-equal parameters. Gradients accumulate locally over a mini-batch's micro-batches and are all-reduced once, by
its last backward (``rlexact.distributed.set_gradient_sync``): each bucket once per optimizer step. Negative control:
with a communication hook that keeps each rank's own gradients, the same run ends with different parameters.

The runs are ``tests/_ddp_worker.py`` subprocesses (Lightning's launcher re-runs the script for rank 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent


def run_two_ranks(out_dir: Path, mode: str) -> tuple[dict, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)  # Lightning picks a free port
    proc = subprocess.run([sys.executable, str(TESTS / "_ddp_worker.py"), str(out_dir), mode], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tuple(torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1))


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["sync", "nosync"])
def test_ddp_ranks_end_with_the_same_parameters(tmp_path: Path, mode: str) -> None:
    rank0, rank1 = run_two_ranks(tmp_path, mode)
    assert len(rank0["rows"]) == len(rank1["rows"]) == 2  # two rollout steps
    for own, other in zip(rank0["rows"], rank1["rows"]):  # at each step, each rank its own prompts
        assert own and other and not set(own) & set(other)
    assert rank0["moved"] > 0 and rank1["moved"] > 0  # the runs trained
    assert same_params(rank0["params"], rank1["params"]) == (mode == "sync")
    for rank in (rank0, rank1):  # two optimizer steps of four micro-batches: every bucket reduced twice
        assert rank["reduces"] and set(rank["reduces"].values()) == {2}, rank["reduces"]
