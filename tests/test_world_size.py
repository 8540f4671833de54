"""World-size invariance of data-keyed sampling at the RLModule level (CPU, gloo).

The same 8 prompts, one rollout step: on 1 rank (8 prompts) and on 2 ranks (FSDP2 via ``ModelParallelStrategy``, 4
prompts each, sharded by the library's ``ResumableSampler``). Every (dataset row, sample j) samples the same tokens
with bitwise-equal rollout log-probs, although rows sit at other slots of other batches. Negative control: items
without a dataset ``index`` fall back to slot ids and a rank-mixed seed, and the two runs differ.

The runs are ``tests/_world_size_worker.py`` (the 2-rank runs as subprocesses: Lightning's launcher re-runs the
script for rank 1, which it cannot do for a pytest process; the 1-rank runs in this process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _world_size_worker as worker

TESTS = Path(__file__).resolve().parent


def spawn(out_dir: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)  # Lightning picks a free port for each run
    return subprocess.Popen(
        [sys.executable, str(TESTS / "_world_size_worker.py"), str(out_dir), "2", mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def two_rank_records(proc: subprocess.Popen, out_dir: Path) -> tuple[dict, dict]:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return tuple(torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1))


def same_samples(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k]["tokens"], b[k]["tokens"]) and torch.equal(a[k]["logprobs"], b[k]["logprobs"]) for k in a
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("world_size")
    procs = {mode: spawn(root / f"{mode}2", mode) for mode in ("keyed", "unkeyed")}
    out = {"keyed1": worker.run(str(root / "keyed1"), 1, keyed=True)}
    with pytest.warns(UserWarning, match="carry no integer 'index'"):
        out["unkeyed1"] = worker.run(str(root / "unkeyed1"), 1, keyed=False)
    for mode, proc in procs.items():
        rank0, rank1 = two_rank_records(proc, root / f"{mode}2")
        assert not rank0.keys() & rank1.keys()  # each rank sampled its own rows
        out[f"{mode}2"] = rank0 | rank1
        out[f"{mode}2_rank1"] = rank1
    return out


def test_one_and_two_ranks_sample_the_same_tokens_and_logprobs(runs: dict[str, dict]) -> None:
    one, two = runs["keyed1"], runs["keyed2"]
    expected = {f"{row}:{j}" for row in range(worker.NUM_PROMPTS) for j in range(worker.SAMPLES)}
    assert one.keys() == two.keys() == expected  # every row's every sample, once
    assert {v["rank"] for v in runs["keyed2_rank1"].values()} == {1}
    assert any(one[k]["slot"] != two[k]["slot"] for k in one)  # rows moved to other slots of other batches
    assert same_samples(one, two)
    assert len({tuple(v["tokens"].tolist()) for v in one.values()}) > 1  # not one sequence everywhere


def test_without_row_keys_world_size_changes_the_samples(runs: dict[str, dict]) -> None:
    one, two = runs["unkeyed1"], runs["unkeyed2"]
    assert one.keys() == two.keys() == runs["keyed1"].keys()
    assert not same_samples(one, two)
