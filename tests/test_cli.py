"""The ``rlexact`` LightningCLI: the paper recipes parse (nothing loaded), unknown keys and bad values error, a
placeholder model path errors clearly, and a tiny end-to-end ``fit`` / ``validate`` with class_path callbacks;
``rlexact export``'s user errors in one line (status 2) while internal errors keep their tracebacks, and
``save_pretrained`` of a module whose model is not built yet."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

pytest.importorskip("jsonargparse")  # LightningCLI's parser (absent from some GPU images)

from rlexact import RLModule  # noqa: E402
from rlexact.cli import ConfigError, RLExactCLI, entry, main, previous_last_checkpoint  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = ["grpo_qwen3_1p7b.yaml", "reinforce_qwen3_1p7b.yaml"]


def print_config(capsys: pytest.CaptureFixture, *args: str) -> dict:
    with pytest.raises(SystemExit) as exc:
        main(["fit", *args, "--print_config"])
    assert exc.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_parse(recipe: str, capsys: pytest.CaptureFixture) -> None:
    cfg = print_config(capsys, "--config", str(CONFIGS / recipe))
    init = cfg["model"]["init_args"]
    assert cfg["model"]["class_path"] == "rlexact.module.RLModule"
    assert init["model_path"] == "/path/to/Qwen3-1.7B"
    assert init["rollout"]["n"] == 8 and init["rollout"]["max_new_tokens"] == 8192
    assert init["optim"]["lr"] == 1e-6 and init["optim"]["betas"] == [0.9, 0.95]
    assert cfg["data"]["init_args"]["batch_size"] == 64
    assert cfg["trainer"]["strategy"]["init_args"]["tensor_parallel_size"] == 1
    algo = init["algorithm"]
    if recipe.startswith("grpo"):
        assert algo["objective"] == "grpo" and algo["estimator"] == "grpo"
        assert (algo["clip_low"], algo["clip_high"]) == (0.2, 0.28)
        assert algo["loss_agg_mode"] == "seq-mean-token-sum-norm"
        assert algo["mini_batch_size"] == 16 * 8  # 16 prompts x 8 samples, in sequences
    else:
        assert algo["objective"] == "reinforce" and algo["estimator"] == "reinforce"
        assert algo["ppo_epochs"] == 1 and algo["mini_batch_size"] is None
    # the nested values build valid config dataclasses
    from rlexact.config import AlgorithmConfig, OptimConfig, RolloutConfig

    AlgorithmConfig(**algo)
    RolloutConfig(**init["rollout"])
    OptimConfig(**{**init["optim"], "betas": tuple(init["optim"]["betas"])})


def test_cli_override(capsys: pytest.CaptureFixture) -> None:
    cfg = print_config(
        capsys,
        "--config",
        str(CONFIGS / RECIPES[0]),
        "--model.init_args.algorithm.old_logprob_mode",
        "recompute",
        "--model.init_args.rollout.kernels",
        "native",
    )
    assert cfg["model"]["init_args"]["algorithm"]["old_logprob_mode"] == "recompute"
    assert cfg["model"]["init_args"]["rollout"]["kernels"] == "native"


@pytest.mark.parametrize(
    "args",
    [
        ["--model.init_args.algorithm.bogus", "1"],
        ["--model.init_args.no_such_arg", "1"],
        ["--trainer.no_such_arg", "1"],
        ["--model.init_args.algorithm.old_logprob_mode", "fast"],
        ["--model.init_args.algorithm.loss_agg_mode", "sum"],
    ],
)
def test_unknown_key_or_bad_value_errors(args: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(CONFIGS / RECIPES[0]), *args, "--print_config"])
    assert exc.value.code not in (0, None)


def test_unknown_key_in_yaml_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = yaml.safe_load((CONFIGS / RECIPES[0]).read_text())
    cfg["model"]["init_args"]["algorithm"]["clip_hgih"] = 0.3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(path), "--print_config"])
    assert exc.value.code not in (0, None)
    assert "clip_hgih" in capsys.readouterr().err


def test_command_reports_a_rejected_configuration_in_one_line(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        entry(["fit", "--config", str(CONFIGS / RECIPES[0]), "--trainer.accelerator", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "rlexact: error: FileNotFoundError: model_path '/path/to/Qwen3-1.7B' does not exist" in err, err
    assert "Traceback" not in err, err
    with pytest.raises(ConfigError, match="FileNotFoundError: model_path"):  # the Python entry point raises
        main(["--config", str(CONFIGS / RECIPES[0]), "--trainer.accelerator", "cpu"], run=False)


def test_placeholder_model_path_errors_clearly() -> None:
    with pytest.raises(Exception) as exc:  # noqa: PT011 - jsonargparse wraps the module's FileNotFoundError
        main(["--config", str(CONFIGS / RECIPES[0]), "--trainer.accelerator", "cpu"], run=False)
    chain, e = [], exc.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(x, FileNotFoundError) and "set model.init_args.model_path" in str(x) for x in chain), [
        type(x).__name__ for x in chain
    ]


def test_console_script_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from rlexact.cli import main; main()", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "fit" in proc.stdout and "validate" in proc.stdout
    assert "predict" not in proc.stdout.split("Available subcommands", 1)[-1][:400]


def test_console_script_demo_subcommand_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from rlexact.cli import entry; entry()", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--kernels" in proc.stdout and "--steps" in proc.stdout


def tiny_yaml(tmp_path: Path) -> Path:
    from rlexact.char_tokenizer import build_char_tokenizer
    from rlexact.demo.task import make_dataset, write_jsonl

    write_jsonl(tmp_path / "train.jsonl", make_dataset(8, seed=0, max_operand=9))
    write_jsonl(tmp_path / "val.jsonl", make_dataset(4, seed=1, max_operand=9))
    vocab = len(build_char_tokenizer())
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "default_root_dir": str(tmp_path),  # LightningCLI saves config.yaml there
            "max_steps": 2,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 1,
            "callbacks": [
                {"class_path": "rlexact.callbacks.MismatchProbe", "init_args": {"argmax": False, "histograms": False}},
                {"class_path": "rlexact.callbacks.ExactnessGuard"},
            ],
        },
        "model": {
            "class_path": "rlexact.module.RLModule",
            "init_args": {
                "model_config": {
                    "model_type": "qwen3",
                    "vocab_size": vocab,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 16,
                    "max_position_embeddings": 32,
                },
                "tokenizer": "demo-char",
                "reward": "arithmetic",
                "reward_kwargs": {"partial_credit": True},
                "rollout": {"n": 2, "max_new_tokens": 4},
                "algorithm": {"objective": "grpo", "clip_high": 0.28},
                "optim": {"lr": 1e-3},
            },
        },
        "data": {
            "class_path": "rlexact.data.PromptDataModule",
            "init_args": {
                "path": str(tmp_path / "train.jsonl"),
                "tokenizer": "demo-char",
                "batch_size": 2,
                "val_path": str(tmp_path / "val.jsonl"),
            },
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_tiny_fit_and_validate(tmp_path: Path) -> None:
    path = tiny_yaml(tmp_path)
    cli = main(["fit", "--config", str(path)])
    trainer, module = cli.trainer, cli.model
    assert module.rollout_step == 2 and trainer.global_step == 2
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["mismatch/bitwise_equal_frac"] == 1.0  # exact rollout, seen by a class_path callback
    assert metrics["clipfrac"] == 0.0
    assert (tmp_path / "config.yaml").exists()
    cli = main(["validate", "--config", str(path)])
    assert "val/reward" in cli.trainer.callback_metrics


def test_ckpt_path_last_resumes_the_newest_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = yaml.safe_load(tiny_yaml(tmp_path).read_text())
    cfg["trainer"].update(max_steps=1, enable_checkpointing=True)
    cfg["trainer"]["logger"] = {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                "init_args": {"save_dir": str(tmp_path), "name": "runs"}}  # fmt: skip
    cfg["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                    "init_args": {"save_last": True}}]  # fmt: skip
    path = tmp_path / "versioned.yaml"
    path.write_text(yaml.safe_dump(cfg))
    fresh = main(["fit", "--config", str(path), "--ckpt_path", "last"])  # negative control: nothing to resume yet
    assert fresh.trainer.ckpt_path is None and fresh.model.rollout_step == 1
    with monkeypatch.context() as m:  # negative control: Lightning's own "last" looks in the new version's folder
        m.setattr(RLExactCLI, "before_fit", lambda self: None)
        assert main(["fit", "--config", str(path), "--ckpt_path", "last"]).trainer.ckpt_path is None
    resumed = main(["fit", "--config", str(path), "--ckpt_path", "last", "--trainer.max_steps", "2"])
    assert resumed.trainer.ckpt_path == str(tmp_path / "runs" / "version_1" / "checkpoints" / "last.ckpt")
    assert resumed.trainer.logger.version == 2 and resumed.model.rollout_step == 2
    cfg["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "own")
    path.write_text(yaml.safe_dump(cfg))
    with_dirpath = main(["--config", str(path)], run=False)
    assert previous_last_checkpoint(with_dirpath.trainer) is None  # Lightning's own "last" looks there


def test_command_line_has_no_args_warning(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from rlexact.cli import entry

    monkeypatch.setattr(sys, "argv", ["rlexact", "fit", "--help"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exc:
        warnings.simplefilter("always")
        entry()
    assert exc.value.code in (0, None)
    assert not [w for w in caught if "args parameter" in str(w.message)], [str(w.message) for w in caught]


def test_model_argument_help_text(capsys: pytest.CaptureFixture) -> None:
    from rlexact.cli import entry

    with pytest.raises(SystemExit):
        entry(["fit", "--model.help", "rlexact.RLModule"])
    out = capsys.readouterr().out
    help_of_model = out.rsplit("--model.model MODEL", 1)[1].split("--model.", 1)[0]
    assert "a transformers causal LM object" in " ".join(help_of_model.split())


def test_packaged_recipe_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlexact.cli import _packaged_configs

    monkeypatch.chdir(tmp_path)
    resolved = _packaged_configs(["fit", "--config", "grpo_qwen3_1p7b.yaml", "-c", "corrections/srs-k3-ppo-ratio"])
    assert Path(resolved[2]).resolve() == (CONFIGS / "grpo_qwen3_1p7b.yaml").resolve()
    assert Path(resolved[4]).resolve() == (CONFIGS / "corrections" / "srs-k3-ppo-ratio.yaml").resolve()
    (tmp_path / "grpo_qwen3_1p7b.yaml").write_text("{}")  # a file in the working directory wins
    assert _packaged_configs(["--config=grpo_qwen3_1p7b.yaml"]) == ["--config=grpo_qwen3_1p7b.yaml"]


def test_help_names_the_other_commands(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        entry(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    assert exc.value.code == 0 and "'rlexact demo [--help]'" in out and "'rlexact export CKPT DIR'" in out, out


def test_a_missing_checkpoint_is_reported_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--ckpt_path`` to no file: the one-line error, before training (Lightning's own check raised from inside
    ``fit``); ``last`` with nothing to resume still starts fresh (test_ckpt_path_last_resumes_the_newest_run)."""
    missing = tmp_path / "missing.ckpt"
    with pytest.raises(SystemExit) as exc:
        entry(["fit", "--config", str(tiny_yaml(tmp_path)), "--ckpt_path", str(missing)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert f"rlexact: error: FileNotFoundError: ckpt_path '{missing}' does not exist" in err, err


def test_validate_without_val_path_names_it(tmp_path: Path) -> None:
    cfg = yaml.safe_load(tiny_yaml(tmp_path).read_text())
    del cfg["data"]["init_args"]["val_path"]
    path = tmp_path / "no_val.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=r"validation needs evaluation prompts.*data.init_args.val_path"):
        main(["validate", "--config", str(path)])


def tiny_config() -> dict:
    from models import tiny_rl_config
    from rlexact.char_tokenizer import build_char_tokenizer

    return tiny_rl_config(len(build_char_tokenizer()))


def tiny_module(**source: object) -> RLModule:
    """A tiny RLModule from ``model_config`` (or the model source given); its model is not built yet."""
    return RLModule(**(source or {"model_config": tiny_config()}), tokenizer="demo-char", reward="arithmetic")


def tiny_checkpoint(path: Path, module: RLModule) -> Path:
    """``module`` (built) as a Lightning checkpoint file: the entries ``load_from_checkpoint`` reads."""
    import lightning
    import torch

    module.configure_model()
    state = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    torch.save({**state, "pytorch-lightning_version": lightning.__version__}, path)
    return path


def export_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """``rlexact export ARGS``'s one-line error (status 2, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        entry(["export", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("rlexact: error: "), err
    return err


def test_export_reports_a_bad_path_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "out")
    missing = tmp_path / "missing.ckpt"
    err = export_error(capsys, str(missing), out)
    assert f"FileNotFoundError: checkpoint '{missing}' does not exist; pass a .ckpt file or sharded" in err, err
    text = tmp_path / "notes.ckpt"
    text.write_text("Some notes, not a checkpoint\n")
    err = export_error(capsys, str(text), out)
    assert f"'{text}' is not a Lightning checkpoint that torch.load(weights_only=True) reads (" in err, err
    folder = tmp_path / "folder.ckpt"
    folder.mkdir()
    err = export_error(capsys, str(folder), out)
    assert f"'{folder}' is a folder but not a sharded Lightning checkpoint: it has no meta.pt and no .metadata" in err
    err = export_error(capsys, "--module-class", "no_such_pkg.mod:Name", str(text), out)
    assert "--module-class 'no_such_pkg.mod:Name' does not import (ModuleNotFoundError" in err, err
    assert not (tmp_path / "out").exists()


def test_export_of_a_model_object_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A module built from a model object: the checkpoint has no model source; the error says how to export it, and
    that way works."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlexact.export import export_checkpoint

    def model() -> torch.nn.Module:
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config()))

    ckpt = tiny_checkpoint(tmp_path / "object.ckpt", tiny_module(model=model()))
    err = export_error(capsys, str(ckpt), str(tmp_path / "out"))
    assert f"'{ckpt}' holds no model source: its module was built from a model object (RLModule(model=...))" in err
    assert f"rlexact.export.export_checkpoint('{ckpt}', DIR, model=<the model>)" in err, err
    assert "init_args" not in err  # the fit command's advice does not apply
    out = export_checkpoint(ckpt, tmp_path / "out", model=model())  # the advice works
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, value in torch.load(ckpt, weights_only=True)["state_dict"].items():
        assert torch.equal(exported[key.removeprefix("model.")], value), key


def test_export_keeps_the_traceback_of_an_internal_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RuntimeError raised by rlexact while the module is rebuilt (e.g. a placeholder for an unsaved object) is a
    user error; one from elsewhere (torch, a bug) keeps its traceback."""
    from types import SimpleNamespace

    from rlexact.export import save_pretrained

    ckpt = tiny_checkpoint(tmp_path / "tiny.ckpt", tiny_module())
    unbuilt = SimpleNamespace(model=None, configure_model=None)
    with monkeypatch.context() as m:
        m.setattr(RLModule, "tokenizer", property(lambda self: save_pretrained(unbuilt, "-")))  # raises in rlexact
        err = export_error(capsys, str(ckpt), str(tmp_path / "out"))
    assert f"cannot load RLModule from '{ckpt}': RuntimeError: the model of this SimpleNamespace is not built" in err

    def internal(self: RLModule) -> None:
        raise RuntimeError("an internal error")

    monkeypatch.setattr(RLModule, "configure_model", internal)
    with pytest.raises(RuntimeError, match="an internal error"):
        entry(["export", str(ckpt), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_save_pretrained_before_the_model_is_built(tmp_path: Path) -> None:
    from rlexact.export import save_pretrained

    module = tiny_module()
    with pytest.raises(
        RuntimeError, match=r"the model of this RLModule is not built yet: call module\.configure_model"
    ):
        save_pretrained(module, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="expected an rlexact.RLModule or a transformers PreTrainedModel, got object"):
        save_pretrained(object(), tmp_path / "out")
    module.configure_model()  # the advice works
    assert (Path(save_pretrained(module, tmp_path / "out")) / "config.json").is_file()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--trainer.strategy", "ddp_spawn"], "Trainer(strategy='ddp_spawn') trains in processes it starts"),
        (["--trainer.gradient_clip_val", "0.5"], "Trainer(gradient_clip_val=0.5) is not applied by RLModule"),
    ],
)
def test_a_refused_trainer_is_reported_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    """RLModule.check_trainer runs before Lightning starts: one line, status 2, and no config.yaml (Lightning's
    SaveConfigCallback writes it, and the logger's version folder, before the module's own setup check raised)."""
    config = tiny_yaml(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as exc:
        entry(["fit", "--config", str(config), *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert f"rlexact: error: ValueError: {message}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
