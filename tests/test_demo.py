"""The embedded demo: reproducible SFT, the shipped checkpoint and data, the YAML recipe, and the GRPO reward rise."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from rlexact.char_tokenizer import EOS_ID, PAD_ID, VOCAB
from rlexact.demo import run, sft

REPO = Path(__file__).resolve().parents[1]
RESULT_JSON = REPO / "benchmarks" / "results" / "demo_cpu.json"


def _tiny_sft(**overrides) -> sft.SFTConfig:
    settings = dict(
        steps=3,
        batch_size=8,
        warmup_steps=1,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=48,
        max_position_embeddings=32,
        eval_size=4,
        threads=1,
    )
    settings.update(overrides)
    return sft.SFTConfig(**settings)


# ------------------------------------------------------------------------------------------------------------- SFT
def test_sft_is_reproducible_bitwise(tmp_path):
    from safetensors.torch import load_file

    args = ["--quiet", "--steps", "3", "--batch-size", "8", "--warmup-steps", "1", "--hidden-size", "32"]
    args += ["--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "16"]
    args += ["--intermediate-size", "48", "--max-position-embeddings", "32", "--eval-size", "4", "--threads", "1"]
    threads = torch.get_num_threads()
    reports = [sft.main(["--out", str(tmp_path / name), *args]) for name in ("a", "b")]
    assert torch.get_num_threads() == threads  # the SFT restores the thread count
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and a
    for key in a:
        assert a[key].dtype == torch.float32, key
        assert torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), key
    assert reports[0]["eval"] == reports[1]["eval"]
    report = json.loads((tmp_path / "a" / sft.SFT_JSON).read_text())
    assert report["settings"]["steps"] == 3 and report["settings"]["label_smoothing"] == sft.SFTConfig().label_smoothing
    assert {"greedy_accuracy", "sampled_accuracy"} <= set(report["eval"])
    # a different seed gives different weights (the comparison above can fail)
    model, _, _ = sft.train_sft(_tiny_sft(seed=1), verbose=False)
    other = {k: v.detach() for k, v in model.state_dict().items()}
    assert any(not torch.equal(other[k], a[k]) for k in a if k in other)


def test_sft_loss_is_on_the_completion_only():
    from transformers import AutoTokenizer  # noqa: F401  (the tokenizer is a transformers object)

    from rlexact.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    ids, plen = sft.encode_example(tok, "12+7=", "19")
    assert plen == 5 and ids[-1] == EOS_ID and tok.decode(ids[plen:-1]) == "19"
    input_ids, mask, labels = sft._collate([(ids, plen), sft.encode_example(tok, "1+1=", "2")])
    assert labels[0, :5].eq(-100).all() and labels[0, 5:].tolist() == ids[5:]
    assert input_ids[1, -2:].tolist() == [PAD_ID, PAD_ID] and mask[1].sum() == 6 and labels[1, -2:].eq(-100).all()


def test_sft_config_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        sft.SFTConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="label_smoothing"):
        sft.SFTConfig(label_smoothing=1.0)
    for kwargs, message in ((dict(grad_clip=-1.0), "grad_clip must be > 0"),  # flipped the gradient's sign
                            (dict(min_lr_ratio=-5.0), "min_lr_ratio must be >= 0"),
                            (dict(warmup_steps=-3), "warmup_steps must be >= 0"),
                            (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
                            (dict(intermediate_size=0), "intermediate_size must be a positive int"),
                            (dict(lr=float("inf")), "lr must be a finite number")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            sft.SFTConfig(**kwargs)


def test_demo_and_sft_commands_report_bad_flags_in_one_line(tmp_path, capsys):
    """Bad values end the commands with argparse's one-line error (exit 2) naming the flag, before anything is
    written or trained: an --out that is a file, a held-out evaluation larger than the checkpoint's held-out set
    (it would evaluate on training prompts)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [(run.main, ["--seed", "-5"], "--seed: seed must be >= 0"),
             (run.main, ["--clip", "0"], "--clip: clip must be > 0"),
             (run.main, ["--eval-prompts", "501"], "--eval-prompts: eval_prompts must be at most 500"),
             (run.main, ["--out", str(afile)], "is a file; give a folder"),
             (sft.main, ["--out", str(afile)], "is a file; give a folder"),
             (sft.main, ["--out", str(tmp_path / "x"), "--grad-clip", "-1"], "--grad-clip: grad_clip must be > 0")]
    for main, argv, message in cases:  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, (argv, err)
    assert not (tmp_path / "x").exists() and afile.read_text() == ""
    described = run.field_descriptions(run.DemoConfig)  # the --help texts
    assert set(described) == {f.name for f in dataclasses.fields(run.DemoConfig)}
    assert described["eval_prompts"] == "held-out prompts of the before/after evaluation."
    assert described["threads"].endswith("slow the demo down many times over.")  # continuation lines joined


# ------------------------------------------------------------------------------------------ shipped checkpoint/data
def test_shipped_checkpoint_loads_and_is_small():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = Path(run.checkpoint_path())
    assert ckpt.is_dir(), ckpt
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert size < 5 * 1024 * 1024, f"demo checkpoint is {size} bytes"
    assert (ckpt / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(VOCAB)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == PAD_ID
    assert tok("12+7=", add_special_tokens=False)["input_ids"] == [VOCAB[c] for c in "12+7="]
    report = json.loads((ckpt / sft.SFT_JSON).read_text())
    cfg = sft.SFTConfig(**report["settings"])  # the recorded settings are valid SFT settings
    assert cfg.hidden_size == model.config.hidden_size and cfg.num_layers == model.config.num_hidden_layers
    # partially competent: knows the task (greedy) but leaves room for RL when sampled at temperature 1
    assert report["eval"]["greedy_accuracy"] > 0.8
    assert 0.2 <= report["eval"]["sampled_accuracy"] <= 0.45
    assert run.resolve_model_path("demo") == run.resolve_model_path("rlexact://demo") == os.fspath(ckpt)


def test_shipped_prompt_files_match_the_task():
    from rlexact.demo.task import read_jsonl

    train = read_jsonl(run.data_path("train"))
    evaluation = read_jsonl(run.data_path("eval"))
    assert train == run.demo_rows("train", run.TRAIN_FILE_ROWS)
    assert evaluation == run.demo_rows("eval", run.EVAL_FILE_ROWS)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}  # held out
    # the demo's training rows are a prefix of the file (configs/demo.yaml uses `limit`)
    cfg = run.DemoConfig()
    assert run.demo_rows("train", cfg.steps * cfg.prompts_per_step) == train[: cfg.steps * cfg.prompts_per_step]


def test_demo_yaml_matches_the_demo_defaults(monkeypatch, tmp_path):
    from rlexact.cli import _packaged_configs, main

    monkeypatch.chdir(tmp_path)  # the packaged recipe and its packaged paths work outside the repository
    monkeypatch.setattr("sys.argv", ["rlexact"])
    args = _packaged_configs(["--config", "demo.yaml"])
    assert Path(args[1]).resolve() == (REPO / "configs" / "demo.yaml").resolve()
    cli = main(args, run=False)
    module, data, trainer = cli.model, cli.datamodule, cli.trainer
    cfg = run.DemoConfig()
    expected = run.build_module(cfg, run.checkpoint_path())
    assert module.rollout_cfg == expected.rollout_cfg
    assert module.algo == expected.algo
    assert module.optim_cfg == expected.optim_cfg
    assert module.model_path == "demo" and module.hparams["tokenizer"] == "demo"
    assert Path(run.resolve_model_path(module.model_path)).resolve() == Path(run.checkpoint_path()).resolve()
    assert data.batch_size == cfg.prompts_per_step and data.limit == cfg.steps * cfg.prompts_per_step
    assert data.use_chat_template is False and data.seed == cfg.seed
    assert trainer.max_steps == cfg.steps
    assert any(type(cb).__name__ == "MismatchProbe" for cb in trainer.callbacks)


# ----------------------------------------------------------------------------------------------------- the demo
def test_demo_config_validation():
    with pytest.raises(ValueError, match=r"n must be >= 2 \(a GRPO group\)"):
        run.DemoConfig(n=1)
    with pytest.raises(ValueError, match="unknown demo settings"):
        run.run_demo({"stepz": 3})


@pytest.mark.slow
def test_short_demo_is_exact_and_learns(tmp_path):
    """A shortened demo (fewer steps and held-out samples): 0 bitwise-differing tokens and a rising reward."""
    summary = run.run_demo(
        run.DemoConfig(out=str(tmp_path), steps=SHORT_STEPS, eval_prompts=100, eval_n=4, progress=False)
    )
    assert summary["threads"] == 1 and summary["rollout_steps"] == SHORT_STEPS
    assert summary["train_rollout_tokens"] > 0 and summary["eval_tokens"] > 0
    assert summary["train_rollout_tokens_differing"] == 0 and summary["train_bitwise_equal_frac"] == 1.0
    assert summary["eval_tokens_differing"] == 0
    assert summary["reward_rise"] >= SHORT_MIN_RISE, summary
    assert (tmp_path / "summary.json").is_file()
    assert list((tmp_path / "demo").rglob("events.out.tfevents.*")), "no TensorBoard event file"


SHORT_STEPS = 40
SHORT_MIN_RISE = 0.25


@pytest.mark.parametrize(
    "settings",
    [dict(kernels="native", dtype="bfloat16"), dict(inject=0.05)],
    ids=["native-bf16", "injection"],
)
def test_demo_probe_sees_mismatch(tmp_path, settings):
    """The demo's MismatchProbe reports a bitwise-equal fraction below 1 for the native bf16 engine and under
    injection (the exact run above reports exactly 1: 0 differing tokens)."""
    summary = run.run_demo(
        run.DemoConfig(
            out=str(tmp_path), steps=3, prompts_per_step=8, eval_prompts=8, eval_n=2, progress=False, **settings
        )
    )
    assert summary["train_rollout_tokens"] > 0
    assert summary["train_bitwise_equal_frac"] < 1.0
    assert summary["train_rollout_tokens_differing"] > 0


@pytest.mark.parametrize("name", [RESULT_JSON.name, "demo_cpu_xeon.json"])
def test_committed_demo_result(name: str):
    """benchmarks/results/demo_cpu*.json: the full demo as documented, written by
    ``python -m rlexact.demo --record benchmarks/results/<name>`` on 2 CPU cores (two hosts)."""
    result = json.loads((RESULT_JSON.parent / name).read_text())
    for key in RECORD_KEYS:
        assert key in result, key
    assert "--record" in result["command"] and result["commit"] not in ("", "unknown")
    assert result["reward_after"] - result["reward_before"] == pytest.approx(result["reward_rise"], abs=1e-3)
    assert result["reward_rise"] >= 0.3
    assert result["train_rollout_tokens"] > 0 and result["train_rollout_tokens_differing"] == 0
    assert result["eval_tokens_differing"] == 0
    assert result["wall_seconds"] <= 600


RECORD_KEYS = (
    "command", "commit", "date", "device", "host_cpu", "cpu_count", "versions", "reward_before", "reward_after",
    "reward_rise", "wall_seconds", "train_rollout_tokens_differing", "config", "notes",
)  # fmt: skip


def test_demo_record_writes_provenance(tmp_path, monkeypatch):
    """``--record FILE`` writes the summary with command, commit, date, device and versions (tiny setting)."""
    record = tmp_path / "results" / "demo.json"
    argv = ["--steps", "1", "--prompts-per-step", "2", "--n", "2", "--eval-prompts", "2", "--eval-n", "1",
            "--no-progress", "--out", str(tmp_path / "runs"), "--record", str(record)]  # fmt: skip
    monkeypatch.setattr("sys.argv", ["python -m rlexact.demo", *argv])
    summary = run.main(argv)
    result = json.loads(record.read_text())
    for key in RECORD_KEYS:
        assert key in result, key
    assert "--record" in result["command"] and result["commit"] != ""
    assert result["reward_before"] == summary["reward_before"] and result["config"]["steps"] == 1
    assert set(result["versions"]) >= {"python", "torch", "lightning", "transformers"}
