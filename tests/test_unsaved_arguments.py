"""Arguments a checkpoint cannot hold, and runs that would never end.

- A reward, tokenizer, ``optimizer`` or ``lr_scheduler`` given as an object is recorded as a plain marker: the
  checkpoint loads (``weights_only=True``), each use of the missing object raises naming the argument and the fix,
  and passing the object to ``load_from_checkpoint`` works as before. LightningCLI's ``optimizer:`` /
  ``lr_scheduler:`` sections are recorded as their plain configuration, which ``load_from_checkpoint`` rebuilds.
- ``optimizer=`` / ``lr_scheduler=`` refuse the ``OptimConfig`` settings they would ignore.
- ``algorithm.max_rollout_steps_without_update`` stops a run in which no optimizer step happens.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from rlexact.callbacks import MismatchInjection, RejectionSampling
from rlexact.callbacks.base import RLCallback
from rlexact.config import AlgorithmConfig
from rlexact.data import PromptDataModule, load_tokenizer
from rlexact.module import RLModule
from rlexact.rewards import ArithmeticReward
from rlexact.trainer.hparams import UNSAVED_KEY, Unsaved
from test_cli import tiny_yaml
from test_module import TOK, fit, length_reward, loader, prompt_items, tiny_config

SGD = functools.partial(torch.optim.SGD, lr=0.1)
LINEAR = functools.partial(torch.optim.lr_scheduler.LinearLR, start_factor=0.5, total_iters=4)
FIX = r"RLModule.load_from_checkpoint\(path, {}=\.\.\.\)"


def make_module(**kw: object) -> RLModule:
    """A tiny Qwen3 with the character tokenizer (as an object unless given) and a reward function scored in this
    process."""
    kw = {"tokenizer": TOK, "reward": length_reward, "rollout": {"n": 3, "max_new_tokens": 5}, **kw}
    kw.setdefault("reward_config", {"workers": 0})
    return RLModule(model_config=tiny_config(), **kw)


def trainer(steps: int, callbacks: list | None = None, **kw: object) -> L.Trainer:
    kw = {"logger": False, "enable_checkpointing": False, **kw}
    return L.Trainer(max_steps=steps, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, **kw)  # fmt: skip


def fit_and_save(module: RLModule, path: Path) -> None:
    """One rollout step of ``module``, then a checkpoint at ``path``."""
    fitted, _ = fit(module, 1)
    fitted.save_checkpoint(path)


def object_arguments(**kw: object) -> dict:
    return {"reward": ArithmeticReward(), "tokenizer": TOK, "optimizer": SGD, "lr_scheduler": LINEAR, **kw}


@pytest.fixture(scope="module")
def object_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A module fitted with a reward object, a tokenizer object and optimizer / scheduler callables (the data is a
    plain DataLoader: no tokenizer name to record)."""
    path = tmp_path_factory.mktemp("objects") / "objects.ckpt"
    module = make_module(reward_config={"workers": 0, "on_error": "score"}, **object_arguments())
    fit_and_save(module, path)
    return path


def test_objects_are_recorded_as_plain_markers(object_checkpoint: Path) -> None:
    hparams = torch.load(object_checkpoint, weights_only=True)["hyper_parameters"]  # torch's default reader
    assert hparams["reward"][UNSAVED_KEY] == "rlexact.rewards.synthetic.ArithmeticReward"
    assert hparams["reward"]["repr"].startswith("ArithmeticReward(")
    assert hparams["tokenizer"][UNSAVED_KEY] == f"{type(TOK).__module__}.{type(TOK).__qualname__}"
    assert hparams["tokenizer"]["repr"].endswith("...") and len(hparams["tokenizer"]["repr"]) < len(repr(TOK))
    assert hparams["optimizer"] == {UNSAVED_KEY: "functools.partial", "repr": repr(SGD)}
    assert hparams["lr_scheduler"][UNSAVED_KEY] == "functools.partial"


def test_loading_without_the_objects_raises_at_each_use(object_checkpoint: Path) -> None:
    module = RLModule.load_from_checkpoint(object_checkpoint)  # loads: export and evaluation need no optimizer
    assert isinstance(module.reward_fn, Unsaved)
    described = r"ArithmeticReward\(.*\(rlexact.rewards.synthetic.ArithmeticReward\)"
    with pytest.raises(RuntimeError, match=rf"does not hold RLModule's reward argument: it was an object, {described}"):
        module.compute_rewards(prompt_items(1), [], 1)  # on_error="score" does not swallow it: raised before scoring
    with pytest.raises(RuntimeError, match=FIX.format("reward")):
        module.reward_fn(["1+1="], ["2"], ["2"])
    with pytest.raises(RuntimeError, match="does not hold RLModule's tokenizer argument: .*" + FIX.format("tokenizer")):
        module.tokenizer  # noqa: B018
    module.configure_model()
    with pytest.raises(RuntimeError, match="does not hold RLModule's optimizer argument: .*" + FIX.format("optimizer")):
        module.configure_optimizers()
    with pytest.raises(RuntimeError, match="RLModule's optimizer argument"):
        fit(module, 2)  # a fit stops at the same use
    module = RLModule.load_from_checkpoint(object_checkpoint, optimizer=SGD)
    module.configure_model()
    with pytest.raises(RuntimeError, match="RLModule's lr_scheduler argument: .*" + FIX.format("lr_scheduler")):
        module.configure_optimizers()


def test_loading_with_the_objects_works(object_checkpoint: Path) -> None:
    reward = ArithmeticReward(partial_credit=True)
    module = RLModule.load_from_checkpoint(object_checkpoint, **object_arguments(reward=reward))
    assert module.reward_fn is reward and module.tokenizer is TOK
    saved = torch.load(object_checkpoint, weights_only=True)["state_dict"]
    assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())
    run, _ = fit(module, 2)
    assert run.global_step == 2 and type(run.optimizers[0]) is torch.optim.SGD
    assert isinstance(run.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.LinearLR)


def test_export_needs_only_the_tokenizer(object_checkpoint: Path, tmp_path: Path) -> None:
    """Export loads the checkpoint without its reward and optimizer; the missing tokenizer is named."""
    from rlexact.export import ExportError, export_checkpoint

    with pytest.raises(ExportError, match="RLModule's tokenizer argument: .*" + FIX.format("tokenizer")):
        export_checkpoint(object_checkpoint, tmp_path / "out")
    export_checkpoint(object_checkpoint, tmp_path / "out", tokenizer=TOK)
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "tokenizer_config.json").exists()


def test_named_arguments_round_trip_unchanged(tmp_path: Path) -> None:
    """Negative control: a reward and a tokenizer given by name are recorded as they are, and load as such."""
    path = tmp_path / "named.ckpt"
    fit_and_save(make_module(reward="arithmetic", tokenizer="demo-char"), path)
    hparams = torch.load(path, weights_only=True)["hyper_parameters"]
    assert (hparams["reward"], hparams["tokenizer"], hparams["optimizer"]) == ("arithmetic", "demo-char", None)
    module = RLModule.load_from_checkpoint(path)
    assert type(module.reward_fn) is ArithmeticReward and module.tokenizer.get_vocab() == TOK.get_vocab()
    module.configure_model()
    assert type(module.configure_optimizers()) is torch.optim.AdamW


def test_a_tokenizer_object_named_by_the_data_is_recorded_by_that_name(tmp_path: Path) -> None:
    """Module and datamodule hyperparameters merge without a clash in the logger (the module's tokenizer object is
    the data's "demo"), and the checkpoint loads that tokenizer."""
    module = RLModule(model_path="demo", tokenizer=load_tokenizer("demo"), reward="arithmetic",
                      rollout={"n": 2, "max_new_tokens": 4}, reward_config={"workers": 0})  # fmt: skip
    data = PromptDataModule("rlexact://demo/data/train.jsonl", tokenizer="demo", batch_size=2, limit=4)
    path = tmp_path / "demo.ckpt"
    run = trainer(1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    run.fit(module, datamodule=data)
    run.save_checkpoint(path)
    logged = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert logged["tokenizer"] == "demo"
    assert torch.load(path, weights_only=True)["hyper_parameters"]["tokenizer"] == "demo"
    assert RLModule.load_from_checkpoint(path).tokenizer.get_vocab() == module.tokenizer.get_vocab()


def test_cli_optimizer_sections_are_rebuilt_on_load(tmp_path: Path) -> None:
    """LightningCLI records its optimizer: / lr_scheduler: sections as plain configuration: --ckpt_path last resumes
    with them, and load_from_checkpoint rebuilds them."""
    from rlexact.cli import main

    cfg = yaml.safe_load(tiny_yaml(tmp_path).read_text())
    cfg["model"]["init_args"].update(optim={"grad_clip": 0.5}, reward_config={"workers": 0})
    cfg["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05}}
    cfg["lr_scheduler"] = {"class_path": "torch.optim.lr_scheduler.LinearLR", "init_args": {"start_factor": 0.5}}
    cfg["trainer"].update(max_steps=1, enable_checkpointing=True)
    cfg["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                    "init_args": {"save_last": True}}]  # fmt: skip
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    cfg["trainer"]["logger"] = logger
    path = tmp_path / "optimizer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    main(["fit", "--config", str(path)])
    resumed = main(["fit", "--config", str(path), "--ckpt_path", "last", "--trainer.max_steps", "2"])
    assert resumed.model.rollout_step == 2 and type(resumed.trainer.optimizers[0]) is torch.optim.SGD
    last = tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    hparams = torch.load(last, weights_only=True)["hyper_parameters"]
    assert hparams["optimizer"]["class_path"] == "torch.optim.SGD" and hparams["optimizer"]["init_args"]["lr"] == 0.05
    module = RLModule.load_from_checkpoint(last)
    module.configure_model()
    out = module.configure_optimizers()
    assert type(out["optimizer"]) is torch.optim.SGD and out["optimizer"].defaults["lr"] == 0.05
    assert isinstance(out["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.LinearLR)


# ---------------------------------------------------------------------------------------------------------------------
# optimizer= / lr_scheduler= and the OptimConfig settings they replace
# ---------------------------------------------------------------------------------------------------------------------


def test_optimizer_refuses_the_optim_settings_it_would_ignore() -> None:
    with pytest.raises(ValueError, match=r"optim's lr=0.001, warmup_steps=10 would be ignored .*set the optimizer's"):
        make_module(optimizer=SGD, optim={"lr": 1e-3, "warmup_steps": 10})
    with pytest.raises(ValueError, match=r"optim's betas=\(0.9, 0.95\), eps=1e-06, weight_decay=0.0 would be ignored"):
        make_module(optimizer=SGD, optim={"betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.0})
    with pytest.raises(ValueError, match=r"lr_scheduler=\.\.\.\) replaces optim's warmup, so optim's warmup_steps=10"):
        make_module(lr_scheduler=LINEAR, optim={"lr": 1e-3, "warmup_steps": 10})
    module = make_module(optimizer=SGD, lr_scheduler=LINEAR, optim={"grad_clip": 0.5})  # grad_clip applies either way
    assert module.optim_cfg.grad_clip == 0.5
    assert make_module(lr_scheduler=LINEAR, optim={"lr": 1e-3}).optim_cfg.lr == 1e-3  # AdamW's lr is used


def test_cli_optimizer_with_optim_settings_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from rlexact.cli import entry

    with pytest.raises(SystemExit) as exc:
        entry(["fit", "--config", str(tiny_yaml(tmp_path)), "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert "rlexact: error: ValueError: RLModule(optimizer=...) builds the optimizer, so optim's lr=0.001" in err, err


# ---------------------------------------------------------------------------------------------------------------------
# rollout steps without an optimizer step
# ---------------------------------------------------------------------------------------------------------------------


class StopAfter(Callback):
    """Stops the fit from outside after ``steps`` rollout steps, keeping the count of each step."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts.append(pl_module.rollout_steps_without_update)
        trainer.should_stop = pl_module.rollout_step >= self.steps


class RejectAt(RLCallback):
    """Rejects every token at the given rollout steps."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_rl_batch(self, trainer, pl_module, batch) -> None:
        if pl_module.rollout_step in self.steps:
            batch.loss_mask &= False


def reject_all() -> list[RLCallback]:
    return [MismatchInjection(scale=0.5), RejectionSampling(threshold=0.0)]


def small_module(limit: int | None, **algorithm: object) -> RLModule:
    """Short rollouts (the section's runs take many rollout steps) with ``limit`` rollout steps without an update."""
    algorithm = {"max_rollout_steps_without_update": limit, **algorithm}
    return make_module(rollout={"n": 2, "max_new_tokens": 3}, algorithm=algorithm)


def small_fit(module: RLModule, callbacks: list, steps: int = 2, **kw: object) -> L.Trainer:
    """Fit ``module`` on one prompt per rollout step, up to ``steps`` optimizer steps."""
    run = trainer(steps, callbacks, **kw)
    run.fit(module, loader(2, batch_size=1))
    return run


def test_a_run_without_optimizer_steps_stops_after_the_limit() -> None:
    module = small_module(2)
    with pytest.raises(RuntimeError, match=r"the last 3 rollout steps \(of 3\) made no optimizer step") as exc:
        small_fit(module, reject_all())
    assert "RejectionSampling" in str(exc.value) and "dynamic sampling" in str(exc.value)
    assert "algorithm.max_rollout_steps_without_update=2; raise it, or set it to None" in str(exc.value)
    assert module.rollout_step == 3 and module.trainer.global_step == 0


def test_dynamic_sampling_dropping_every_group_counts() -> None:
    module = small_module(1, dynamic_sampling=True)
    module.reward_fn = lambda prompts, completions, answers: [1.0] * len(completions)
    with pytest.raises(RuntimeError, match=r"the last 2 rollout steps \(of 2\)"):
        small_fit(module, [])


def test_no_limit_runs_to_an_outside_stop() -> None:
    module = small_module(None)
    stop = StopAfter(AlgorithmConfig().max_rollout_steps_without_update + 2)  # past the default limit
    run = small_fit(module, [*reject_all(), stop])
    assert module.rollout_step == stop.steps and run.global_step == 0
    assert stop.counts == list(range(1, stop.steps + 1))


def test_the_count_restarts_after_an_optimizer_step() -> None:
    module = small_module(2)
    stop = StopAfter(6)
    run = small_fit(module, [RejectAt({0, 1, 3, 4}), stop], steps=10)
    assert stop.counts == [1, 2, 0, 1, 2, 0] and run.global_step == 2


def test_the_count_is_saved_and_resumed(tmp_path: Path) -> None:
    path = tmp_path / "idle.ckpt"
    small_fit(small_module(3), [*reject_all(), StopAfter(2)]).save_checkpoint(path)
    assert torch.load(path, weights_only=True)["rlexact"] == {"rollout_step": 2, "rollout_steps_without_update": 2}
    resumed = small_module(3)
    with pytest.raises(RuntimeError, match=r"the last 4 rollout steps \(of 4\)"):
        trainer(2, reject_all()).fit(resumed, loader(2, batch_size=1), ckpt_path=path)
    resumed.on_load_checkpoint({"rlexact": {"rollout_step": 5}})  # a checkpoint from before the count
    assert (resumed.rollout_step, resumed.rollout_steps_without_update) == (5, 0)


def test_the_limit_is_validated() -> None:
    with pytest.raises(ValueError, match="max_rollout_steps_without_update must be a positive int or None, got 0"):
        AlgorithmConfig(max_rollout_steps_without_update=0)
    assert AlgorithmConfig(max_rollout_steps_without_update=None).max_rollout_steps_without_update is None
