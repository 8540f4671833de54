"""RLModule under Lightning's ``DDPStrategy`` (two CPU ranks, gloo): the ranks sample disjoint prompts and end with
bitwise-equal parameters. Gradients accumulate locally over a mini-batch's micro-batches and are all-reduced once, by
its last backward (``rlexact.distributed.set_gradient_sync``): each bucket once per optimizer step. Negative control:
with a communication hook that keeps each rank's own gradients, the same run ends with different parameters.

The runs are ``tests/_ddp_worker.py`` subprocesses (Lightning's launcher re-runs the script for rank 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ranks import ranks_report, run_ranks

TESTS = Path(__file__).resolve().parent


def run_two_ranks(out_dir: Path, mode: str) -> tuple[dict, dict]:
    proc = run_ranks(TESTS / "_ddp_worker.py", str(out_dir), mode)
    assert proc.returncode == 0, ranks_report(proc)
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
