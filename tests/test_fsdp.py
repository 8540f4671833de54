"""FSDP2 (ModelParallelStrategy, 2 CPU processes, gloo): exactness on every rank, aligned collectives, export.

The run itself is ``tests/_fsdp_worker.py`` (Lightning's launcher re-runs that script for rank 1, which it cannot do
for a pytest process), started here as a subprocess with a timeout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ranks import ranks_report, run_ranks

WORKER = Path(__file__).with_name("_fsdp_worker.py")


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_fsdp2_two_ranks_exact(tmp_path: Path, precision: str) -> None:
    proc = run_ranks(WORKER, str(tmp_path), precision)
    assert proc.returncode == 0, ranks_report(proc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["world_size"] == 2 and res["is_fsdp"]
        assert res["rollout_step"] == 3
        # rollout log-probs == trainer log-probs bitwise through the sharded model, on every rank
        assert res["rollout_equal"] == [True] * 3
        # first mini-step of every rollout: ratio exactly 1
        assert res["first_ratio_one"] == [True] * 3
        # after the update: the generator's scoring path still equals the trainer bitwise
        assert res["post_update_equal"] == [True] * 3
    # both ranks took the same optimizer steps and hold the same parameters ...
    assert results[0]["global_step"] == results[1]["global_step"] > 0
    assert results[0]["param_hash"] == results[1]["param_hash"]
    # ... although they trained on different numbers of sequences (dynamic sampling dropped all of a rank's groups
    # at least once: a placeholder with an empty loss mask kept the collectives aligned)
    sizes = [r["batch_sizes"] for r in results]
    assert sizes[0] != sizes[1]
    assert any(t == 0 for r in results for t in r["loss_tokens"])

    # the exported checkpoint reloads with the trained weights
    from transformers import AutoModelForCausalLM

    full = torch.load(tmp_path / "full_state.pt")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    sd = reloaded.state_dict()
    for k, v in full.items():
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k
    assert reloaded.config._attn_implementation != "rlexact"


@pytest.mark.parametrize(("kind", "exported"), [("gemma3", "Gemma3ForCausalLM"),
                                                 ("gemma3_vl", "Gemma3ForConditionalGeneration")])  # fmt: skip
def test_fsdp2_two_ranks_gemma3(tmp_path: Path, kind: str, exported: str) -> None:
    """FSDP2 on a Gemma 3 (bf16 compute over fp32 master weights): its ``1 + w`` norms, GELU gate, sliding-window
    layer and per-layer-type rotary tables keep rollout == trainer and ratio exactly 1 on every rank, and the
    generator's scoring == the trainer after updates; identical parameters on both ranks; the export reloads as
    the model it was (``gemma3_vl``: the image-text model of Gemma 3 4B and up, its text decoder sharded per
    layer)."""
    from transformers import AutoModelForCausalLM

    proc = run_ranks(WORKER, str(tmp_path), "bf16-mixed", "exact", kind)
    assert proc.returncode == 0, ranks_report(proc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["is_fsdp"] and len(res["rollout_equal"]) >= 2
        for key in ("rollout_equal", "first_ratio_one", "post_update_equal"):
            assert res[key] == [True] * len(res[key]), key
    assert results[0]["param_hash"] == results[1]["param_hash"]
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "export")).__name__ == exported
