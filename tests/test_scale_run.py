"""``benchmarks/scale_run.py`` on the CPU: 2 gloo ranks under ``ModelParallelStrategy``, a tiny Qwen3-MoE (meta-device
init, FSDP2 with bf16 compute over fp32 masters), the paper's MoE GRPO recipe; 2 rollout steps, a distributed
checkpoint, a third step, and that third step again resumed from the checkpoint in a new process group.

- every step on every rank has rollout and trainer log-probs with identical bits (``bitwise_equal_frac == 1.0``),
  and the resumed step's token ids and rollout log-probs, and the weights after it, equal the uninterrupted run's;
- negative controls: the comparison rejects another step of the same run, one flipped log-prob bit and one changed
  token, and the last step changed the weights (so the weight comparison can fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import scale_run  # noqa: E402

K = 2  # rollout steps before the checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("scale")
    out = work / "scale_cpu.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "scale_run.py"), "--accelerator", "cpu", "--devices", "2",
           "--tiny", "--steps", str(K), "--kind", "cpu", "--lr", "1e-3", "--work-dir", str(work), "--keep-checkpoint",
           "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return work, json.loads(out.read_text())


@pytest.mark.slow
def test_every_rank_is_bitwise_equal_and_the_resume_matches(run: tuple[Path, dict]) -> None:
    work, res = run
    assert res["world_size"] == 2 and res["model"]["model_type"] == "qwen3_moe"
    assert res["settings"]["fsdp"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert res["settings"]["algorithm"]["clip_high"] == 0.28  # the GRPO recipe's settings
    assert [s["step"] for s in res["steps"]] == [1, 2, 3] and res["resumed_step"]["step"] == 3
    for step in [*res["steps"], res["resumed_step"]]:
        assert step["mismatch/bitwise_equal_frac_per_rank"] == [1.0, 1.0]
        assert step["mismatch/bitwise_equal_frac"] == 1.0
        assert step["response_tokens"] == 2 * 2 * 4 * 8  # ranks x prompts x n x max_new_tokens (no stop tokens)
        assert step["rollout_tokens_per_s"] > 0 and step["trainer_tokens_per_s"] > 0
        assert all(step["stages_s"][k] > 0 for k in ("rollout", "rewards", "scoring", "update"))
        assert len(step["peak_host_rss_gb_per_rank"]) == 2
    assert res["all_bitwise_equal"] is True
    assert res["resume_rollouts_equal_per_rank"] == [True, True]
    assert res["resume_weights_equal_per_rank"] == [True, True]
    assert res["resume_matches_uninterrupted"] is True
    assert (work / "ckpt").is_dir() and (work / "ckpt" / "meta.pt").is_file()  # a distributed-checkpoint folder


@pytest.mark.slow
def test_the_resume_comparison_can_fail(run: tuple[Path, dict]) -> None:
    work, res = run
    assert res["weights_changed_after_checkpoint_per_rank"] == [True, True]
    for rank in (0, 1):
        full = torch.load(work / "train" / f"rank{rank}.pt", weights_only=True)
        resumed = torch.load(work / "resume" / f"rank{rank}.pt", weights_only=True)
        assert scale_run.rollouts_equal(resumed[K + 1], full[K + 1])
        assert not scale_run.rollouts_equal(resumed[K + 1], full[K])  # another step of the same run
        flipped = dict(resumed[K + 1])
        bits = flipped["rollout_logprobs"].clone().view(torch.int32)
        last = int(flipped["cu_seqlens"][-1]) - 1  # a response token
        bits[last] ^= 1  # the lowest mantissa bit of one log-prob
        flipped["rollout_logprobs"] = bits.view(torch.float32)
        assert not scale_run.rollouts_equal(flipped, full[K + 1])
        changed = dict(resumed[K + 1])
        changed["input_ids"] = changed["input_ids"].clone()
        changed["input_ids"][last] += 1
        assert not scale_run.rollouts_equal(changed, full[K + 1])
