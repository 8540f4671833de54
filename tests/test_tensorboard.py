"""What a 3-step run writes to TensorBoard: scalars every rollout step (reward and advantage ranges, the
zero-variance-group fraction, per-stage timing), the MismatchProbe histograms and sample text with reward and
advantage; no 'validation_step but no val_dataloader' warning and no hparams clash between module and data."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from models import tiny_rl_config
from rlexact import PromptDataModule, RLModule
from rlexact.callbacks import MismatchProbe, SampleLogger
from rlexact.char_tokenizer import build_char_tokenizer

STEPS = 3
SCALARS = [
    "reward/mean", "reward/std", "reward/min", "reward/max",
    "advantage/mean", "advantage/std", "advantage/min", "advantage/max", "groups/zero_variance_frac",
    "timing/rollout_s", "timing/scoring_s", "timing/update_s", "timing/callbacks_s", "timing/step_s",
    "rollout_step", "loss", "entropy",
]  # fmt: skip


def varied_reward(prompts, completions, answers):
    return [float(len(c) % 3) for c in completions]


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = tmp_path_factory.mktemp("tb")
    module = RLModule(
        model_config=tiny_rl_config(len(build_char_tokenizer())),
        tokenizer="demo-char",
        reward=varied_reward,
        rollout={"n": 2, "max_new_tokens": 4},
        optim={"lr": 1e-3},
    )
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]
    data = PromptDataModule(rows, tokenizer="demo-char", batch_size=2)
    logger = TensorBoardLogger(save_dir=str(root), name="run")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[MismatchProbe(argmax=False, histogram_every_n_steps=1)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    messages = [str(w.message) for w in caught]
    logger.experiment.flush()
    (event_file,) = Path(logger.log_dir).glob("events.out.tfevents.*")
    acc = EventAccumulator(str(event_file), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc, messages, trainer


def test_scalars_every_rollout_step(events) -> None:
    acc, _, _ = events
    tags = set(acc.Tags()["scalars"])
    missing = [t for t in SCALARS if t not in tags]
    assert not missing, (missing, sorted(tags))
    for tag in SCALARS:
        assert [e.step for e in acc.Scalars(tag)] == list(range(STEPS)), tag  # x-axis: rollout steps, 0-based
    assert [e.value for e in acc.Scalars("rollout_step")] == [1.0, 2.0, 3.0]  # rollout steps completed
    for e_min, e_max in zip(acc.Scalars("advantage/min"), acc.Scalars("advantage/max")):
        assert e_min.value <= e_max.value
    for e in acc.Scalars("groups/zero_variance_frac"):
        assert 0.0 <= e.value <= 1.0
    for e_step, e_update in zip(acc.Scalars("timing/step_s"), acc.Scalars("timing/update_s")):
        assert 0.0 < e_update.value <= e_step.value


def documented_names() -> set[str]:
    """Every backticked metric name of the README and docs/metrics.md, ``a/{b,c}`` expanded to ``a/b`` and ``a/c``."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text() + (root / "docs" / "metrics.md").read_text()
    names = set()
    for quoted in re.findall(r"`([^`\s]+)`", text):
        braces = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", quoted)
        parts = braces.group(2).split(",") if braces else [""]
        names |= {f"{braces.group(1)}{part}{braces.group(3)}" if braces else quoted for part in parts}
    return names


def test_every_logged_scalar_is_documented(events) -> None:
    """No undocumented metric: each scalar tag of the run (the module's and MismatchProbe's) is named in the README's
    "Logging and TensorBoard" list or in docs/metrics.md (negative control: a made-up tag is not)."""
    acc, _, _ = events
    documented = documented_names()
    lightning_own = {"hp_metric"}  # TensorBoardLogger's placeholder for hyperparameter search
    missing = sorted(t for t in acc.Tags()["scalars"] if t not in documented | lightning_own)
    assert not missing, missing
    assert "reward/made_up" not in documented and "reward/mean" in documented


def test_histograms_and_sample_text(events) -> None:
    acc, _, _ = events
    assert acc.Tags()["histograms"], "no histograms"
    texts = [t for t in acc.Tags()["tensors"] if t.startswith("samples")]
    assert texts, acc.Tags()
    (event,) = acc.Tensors(texts[0])  # every 10 rollout steps: step 0 only in a 3-step run
    table = event.tensor_proto.string_val[0].decode()
    assert event.step == 0
    assert table.startswith("| prompt | completion | reward | advantage |")
    assert table.count("\n") == 2 + 4 - 1  # header, separator, 4 samples


def test_no_validation_warning_and_no_hparams_clash(events) -> None:
    _, messages, trainer = events
    assert not [m for m in messages if "validation_step" in m], messages
    assert trainer.lightning_module.hparams["tokenizer"] == "demo-char"
    assert "validation_step" not in trainer.lightning_module.__dict__  # restored at teardown


def test_hparams_yaml_is_plain(events) -> None:
    import yaml

    _, _, trainer = events
    hparams = yaml.safe_load((Path(trainer.logger.log_dir) / "hparams.yaml").read_text())  # no python objects
    assert hparams["rollout"]["n"] == 2 and hparams["optim"]["betas"] == [0.9, 0.999]
    assert hparams["tokenizer"] == "demo-char"


def test_log_cadence_warning(tmp_path: Path) -> None:
    module = RLModule(model_config=tiny_rl_config(len(build_char_tokenizer())), tokenizer="demo-char",
                      reward=varied_reward, rollout={"n": 2, "max_new_tokens": 2})  # fmt: skip
    data = PromptDataModule([{"prompt": "1+1="}, {"prompt": "2+2="}], tokenizer="demo-char", batch_size=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=TensorBoardLogger(str(tmp_path)),
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    message = r"log_every_n_steps=50\) writes every 50th .* set Trainer\(log_every_n_steps=1"
    with pytest.warns(UserWarning, match=message):
        trainer.fit(module, datamodule=data)


def test_sample_logger_validation() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be >= 0, got -1"):
        SampleLogger(every_n_steps=-1)
