"""The update stage and the one reducer on two gloo ranks (CPU): FSDP2 gradient sync only on the last micro-batch,
activation checkpointing under FSDP2, token-weighted metrics, REINFORCE whitening over ranks.

The ranks run tests/_update_worker.py (subprocesses with a timeout); the checks are here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlexact import algorithms as alg

WORKER = Path(__file__).with_name("_update_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("update")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), str(out)], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-4000:] for e in errors)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_grads_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_sync_once_and_match_one_big_batch(ranks: list[dict]) -> None:
    for res in ranks:
        # 3 micro-batches: reduce-scatter off for the first two, on for the last (and left on)
        assert res["sync_calls"] == [False, False, True, True]
        _assert_grads_close(res["grads"]["micro"], res["grads"]["whole"])
    # FSDP averages the ranks' gradients: both ranks hold the mean of the per-rank (unsharded) gradients ...
    for name, g in ranks[0]["grads"]["micro"].items():
        torch.testing.assert_close(g, ranks[1]["grads"]["micro"][name], rtol=0, atol=0)
        mean = (ranks[0]["local"][name] + ranks[1]["local"][name]) / 2
        torch.testing.assert_close(g, mean, rtol=1e-5, atol=1e-7, msg=name)
    # ... which is not either rank's own gradient (negative control: a missing reduction would pass the checks above
    # only if this failed)
    differs = [not torch.allclose(ranks[0]["grads"]["micro"][n], ranks[0]["local"][n]) for n in ranks[0]["local"]]
    assert sum(differs) > len(differs) // 2


def test_activation_checkpointing_under_fsdp(ranks: list[dict]) -> None:
    for res in ranks:
        assert res["lp_equal"], "activation checkpointing changed the forward's log-probs"
        assert res["recomputed"] == 2.0, "each micro-batch's layer forward should run twice (forward + recompute)"
        _assert_grads_close(res["grads"]["micro_ckpt"], res["grads"]["micro"])


def test_update_metrics_are_token_weighted_over_ranks(ranks: list[dict]) -> None:
    pg = [r["local_pg"] for r in ranks]
    tokens = [r["local_tokens"] for r in ranks]
    assert tokens[0] != tokens[1] and pg[0] != pg[1]
    weighted = (pg[0] * tokens[0] + pg[1] * tokens[1]) / (tokens[0] + tokens[1])
    for res in ranks:
        got = res["metrics"]["loss/pg_loss"]
        assert got == pytest.approx(weighted, rel=1e-5, abs=1e-7)
        assert got != pytest.approx((pg[0] + pg[1]) / 2, rel=1e-4)  # the unweighted mean is something else
    assert ranks[0]["metrics"] == ranks[1]["metrics"]


def test_reinforce_whitening_over_ranks_equals_one_batch(ranks: list[dict]) -> None:
    both = torch.cat([r["adv"] for r in ranks])
    whole = torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, -1.0, 0.25], dtype=torch.float64)
    torch.testing.assert_close(both, alg.reinforce_advantages(whole, eps=0.0), rtol=1e-12, atol=1e-12)
    # negative control: whitening each rank's half alone gives different advantages
    alone = alg.reinforce_advantages(whole[:3], eps=0.0)
    assert not torch.allclose(alone, both[:3])
