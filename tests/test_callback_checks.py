"""What the RL callbacks refuse and warn about before a run: metric-prefix collisions, the Trainer / module /
callback-list combinations ``RLCallback.check`` refuses (also through ``RLModule.check_trainer`` and the ``rlexact``
command's one-line error), the constructors' argument checks, and the warnings for corrections that cannot act
(the rollout log-probs are the trainer's bit for bit)."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from _callbacks_worker import make_batch
from models import tiny_rl_config
from rlexact.callbacks import (
    ExactnessGuard,
    MismatchInjection,
    MismatchProbe,
    RejectionSampling,
    RLCallback,
    SampleLogger,
    ShadowCorrection,
    TruncatedIS,
    UpdateDirectionProbe,
    correction_callbacks,
    functional,
)
from rlexact.char_tokenizer import build_char_tokenizer
from rlexact.cli import entry
from rlexact.module import RLModule
from rlexact.study.engine import PerturbedRolloutModule
from rlexact.study.probes import DirectionAgreementProbe


def module(kernels: str = "exact", mode: str = "recompute", cls: type[RLModule] = RLModule, **kwargs) -> RLModule:
    """A tiny RLModule (its model is not built) with these rollout kernels and pi_old mode."""
    return cls(
        model_config=tiny_rl_config(len(build_char_tokenizer())),
        tokenizer="demo-char",
        reward="arithmetic",
        rollout={"kernels": kernels},
        algorithm={"old_logprob_mode": mode},
        **kwargs,
    )


def trainer(callbacks: list, tmp_path: Path | None = None, logger=False, **kwargs) -> pl.Trainer:
    """An unfitted CPU Trainer with these callbacks."""
    return pl.Trainer(
        accelerator="cpu",
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path) if tmp_path is not None else None,
        **kwargs,
    )


def no_warning(fn, *args) -> None:
    """``fn(*args)``, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(*args)


# ------------------------------------------------------------------------------------------------ metric prefixes
COLLISIONS = {  # name: (the callbacks, the refusal)
    "update_direction": (
        lambda: [UpdateDirectionProbe(), UpdateDirectionProbe(before="rescore")],
        r"UpdateDirectionProbe: trainer\.callbacks\[0\] UpdateDirectionProbe\(prefix='update_direction'\) and "
        r"trainer\.callbacks\[1\] UpdateDirectionProbe\(prefix='update_direction'\) would both log metrics under "
        r"'update_direction/'.*give one of them another prefix=",
    ),
    "tis": (lambda: [TruncatedIS(), TruncatedIS(level="sequence")], r"^TruncatedIS: .*under 'tis/'"),
    "rejection": (
        lambda: [RejectionSampling(), RejectionSampling(signal="ppo")],
        r"^RejectionSampling: .*under 'rejection/'",
    ),
    "ministep": (
        lambda: [MismatchProbe(log_ministeps=True), MismatchProbe(prefix="mismatch_ministep", argmax=False)],
        r"^MismatchProbe: .*MismatchProbe\(prefix='mismatch'\) and .*MismatchProbe\(prefix='mismatch_ministep'\) "
        r"would both log metrics under 'mismatch_ministep/'",
    ),
    "injection": (
        lambda: [MismatchInjection(), ShadowCorrection(prefix="injection")],
        r"^MismatchInjection: .*MismatchInjection \(logging under \['injection'\]\) and .*"
        r"ShadowCorrection\(prefix='injection'\).*give the ShadowCorrection another prefix=",
    ),
    "guard": (
        lambda: [ExactnessGuard(), ExactnessGuard(every_n_steps=2)],
        r"^ExactnessGuard: .*'exactness/'.*keep one",
    ),
    "samples": (lambda: [SampleLogger(), TruncatedIS(prefix="samples")], r"^SampleLogger: .*'samples/'"),
    "direction": (
        lambda: [DirectionAgreementProbe(), MismatchProbe(prefix="direction")],
        r"^DirectionAgreementProbe: .*'direction/'",
    ),
}


@pytest.mark.parametrize("name", sorted(COLLISIONS))
def test_two_callbacks_with_one_metric_prefix_are_refused(name):
    make, message = COLLISIONS[name]
    with pytest.raises(ValueError, match=message):
        module().check_trainer(trainer(make()), fitting=True)


def test_distinct_prefixes_are_allowed():
    """Negative control: the same classes with different prefixes (and a ministep prefix that is not used)."""
    callbacks = [
        UpdateDirectionProbe(),
        UpdateDirectionProbe(before="rescore", prefix="update_direction_rescore"),
        TruncatedIS(),
        TruncatedIS(level="sequence", prefix="tis_seq"),
        RejectionSampling(),
        RejectionSampling(signal="ppo", prefix="rejection_ppo"),
        MismatchProbe(),
        MismatchProbe(prefix="mismatch_ministep", argmax=False),
        ExactnessGuard(),
        SampleLogger(),
    ]
    t = trainer(callbacks)
    module().check_trainer(t, fitting=True)
    prefixes = [p for cb in callbacks for p in cb.metric_prefixes()]
    assert len(prefixes) == len(set(prefixes)) and "samples" in prefixes
    assert RLCallback().metric_prefixes() == ()


def test_a_prefix_collision_stops_fit_in_setup(tmp_path):
    """Without the CLI, Lightning's setup hook refuses the run (the callbacks' ``setup`` calls ``check``)."""
    t = trainer([UpdateDirectionProbe(), UpdateDirectionProbe(before="rescore")], tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="^UpdateDirectionProbe: .*'update_direction/'"):
        t.fit(module(), torch.utils.data.DataLoader([{"prompt_ids": [1]}], collate_fn=list))


def test_update_direction_prefixes_log_distinct_names(tmp_path):
    b = make_batch(seed=4)
    after = b.rollout_logprobs + 0.01 * torch.sign(b.advantages)

    class Gen:
        def score(self, sequences, temperature):
            return after

    class Module:
        generator = Gen()

    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    a, c = UpdateDirectionProbe(), UpdateDirectionProbe(before="rescore", prefix="rescored")
    assert a.state_key != UpdateDirectionProbe(prefix="rescored").state_key
    assert a.state_key == "UpdateDirectionProbe{'before': 'rollout', 'every_n_steps': 1}"  # the key before prefixes
    t = trainer([a, c], tmp_path, logger=logger)
    for probe in (a, c):
        probe.on_rl_batch(t, Module(), b)
        probe.on_rl_update_end(t, Module(), b)
    logger.experiment.flush()
    keys = ("misaligned_frac", "unchanged_frac", "misaligned_count", "num_tokens")
    assert set(a.last_metrics) == {f"update_direction/{k}" for k in keys}
    assert set(c.last_metrics) == {f"rescored/{k}" for k in keys}
    assert c.last_metrics["rescored/unchanged_frac"] == 1.0  # the scripted generator scores "after" both times
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    acc.Reload()
    assert {"update_direction/misaligned_frac", "rescored/misaligned_frac"} <= set(acc.Tags()["scalars"])


# ----------------------------------------------------------------------------------- refusals before the run
@pytest.mark.parametrize(
    "callbacks,mode,message",
    [
        ([TruncatedIS()], "bypass", r"^TruncatedIS with old_logprob_mode='bypass'.*'recompute'"),
        (
            [MismatchProbe(argmax=False), MismatchInjection()],
            "recompute",
            r"^MismatchInjection must come before every RL callback that reads .*found \['MismatchProbe'\].*first in "
            r"the YAML",
        ),
        ([TruncatedIS(), TruncatedIS(cap=3.0)], "recompute", r"^TruncatedIS: .*'tis/'"),
    ],
    ids=["tis-bypass", "injection-not-first", "collision"],
)
def test_check_trainer_refuses_what_the_callbacks_cannot_run_under(callbacks, mode, message):
    t = trainer(callbacks)
    with pytest.raises(ValueError, match=message):
        module(mode=mode).check_trainer(t, fitting=True)
    with pytest.raises(ValueError, match=message):  # validate too: Lightning's setup would refuse it as well
        module(mode=mode).check_trainer(t, fitting=False)


def test_sample_logger_may_precede_the_injection():
    """SampleLogger reads no log-probs (``reads_logprobs = False``), so it does not count as coming before."""
    t = trainer([SampleLogger(), MismatchInjection(), MismatchProbe(argmax=False)])
    module().check_trainer(t, fitting=True)
    assert not SampleLogger.reads_logprobs and MismatchProbe.reads_logprobs


def test_shadow_correction_refuses_several_processes():
    t = trainer([ShadowCorrection()], devices=2, strategy="ddp")
    with pytest.raises(ValueError, match="^ShadowCorrection runs in one process.*has 2"):
        module().check_trainer(t, fitting=True)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            [
                "--trainer.callbacks+=rlexact.callbacks.TruncatedIS",
                "--model.init_args.algorithm.old_logprob_mode=bypass",
            ],
            "ValueError: TruncatedIS with old_logprob_mode='bypass'",
        ),
        (
            ["--trainer.callbacks+=rlexact.callbacks.MismatchInjection"],  # appended after the recipe's MismatchProbe
            "ValueError: MismatchInjection must come before every RL callback",
        ),
    ],
    ids=["tis-bypass", "injection-appended"],
)
def test_the_command_refuses_in_one_line_before_writing(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)  # the demo recipe logs to ./runs
    with pytest.raises(SystemExit) as exc:
        entry(["fit", "--config", "demo.yaml", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"rlexact: error: {message}"), err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ constructor checks
BAD_ARGUMENTS = [
    (lambda: MismatchInjection(scale="0.1"), "MismatchInjection: scale must be a finite number, got '0.1'"),
    (lambda: MismatchInjection(scale=-1.0), "MismatchInjection: scale must be >= 0.0"),
    (lambda: MismatchInjection(seed="a"), "MismatchInjection: seed must be an int, got 'a'"),
    (lambda: MismatchInjection(seed=1.7), "MismatchInjection: seed must be an int, got 1.7"),
    (lambda: MismatchInjection(target="noise"), "MismatchInjection: target must be one of"),
    (lambda: MismatchInjection(old_logprobs="yes"), "MismatchInjection: old_logprobs must be one of"),
    (lambda: ShadowCorrection(scale="0.1"), "ShadowCorrection: scale must be a finite number, got '0.1'"),
    (lambda: ShadowCorrection(seed=1.5), "ShadowCorrection: seed must be an int"),
    (lambda: ShadowCorrection(all_ministeps=1), "ShadowCorrection: all_ministeps must be a bool"),
    (lambda: ShadowCorrection(prefix=None), "ShadowCorrection: prefix must be a non-empty str"),
    (lambda: ShadowCorrection(target="x"), "ShadowCorrection: target must be one of"),
    (lambda: ShadowCorrection(corrections="tis"), "ShadowCorrection: corrections must be a list of names"),
    (lambda: ShadowCorrection(corrections=["nope"]), "ShadowCorrection: unknown shadow correction 'nope'"),
    (lambda: ShadowCorrection(every_n_steps=0), "ShadowCorrection: every_n_steps must be a positive int"),
    (lambda: TruncatedIS(cap="2"), "TruncatedIS: cap must be a finite number, got '2'"),
    (lambda: TruncatedIS(cap=True), "TruncatedIS: cap must be a finite number, got True"),
    (lambda: TruncatedIS(cap=0.5), "TruncatedIS: cap must be >= 1.0"),
    (lambda: TruncatedIS(level="seq"), "TruncatedIS: level must be one of"),
    (lambda: TruncatedIS(prefix=None), "TruncatedIS: prefix must be a non-empty str not ending with '/', got None"),
    (lambda: RejectionSampling(threshold="0.001"), "RejectionSampling: threshold must be a finite number"),
    (lambda: RejectionSampling(threshold=True), "RejectionSampling: threshold must be a finite number, got True"),
    (lambda: RejectionSampling(signal="rollout"), "RejectionSampling: signal must be one of"),
    (lambda: RejectionSampling(granularity="geometric"), "RejectionSampling: granularity must be one of"),
    (lambda: RejectionSampling(estimator="k4"), "RejectionSampling: estimator must be one of"),
    (lambda: RejectionSampling(prefix=""), "RejectionSampling: prefix must be a non-empty str"),
    (lambda: MismatchProbe(argmax="no"), "MismatchProbe: argmax must be a bool"),
    (lambda: MismatchProbe(histograms=1), "MismatchProbe: histograms must be a bool"),
    (lambda: MismatchProbe(log_ministeps="yes"), "MismatchProbe: log_ministeps must be a bool"),
    (lambda: MismatchProbe(router=None), "MismatchProbe: router must be a bool"),
    (lambda: MismatchProbe(histogram_every_n_steps=2.5), "MismatchProbe: histogram_every_n_steps must be a positive"),
    (lambda: MismatchProbe(argmax_chunk_tokens=0), "MismatchProbe: argmax_chunk_tokens must be a positive int"),
    (lambda: MismatchProbe(prefix=None), "MismatchProbe: prefix must be a non-empty str"),
    (
        lambda: UpdateDirectionProbe(every_n_steps=0),
        "UpdateDirectionProbe: every_n_steps must be a positive int, got 0",
    ),
    (lambda: UpdateDirectionProbe(before="after"), "UpdateDirectionProbe: before must be one of"),
    (lambda: UpdateDirectionProbe(prefix="a/"), "UpdateDirectionProbe: prefix must be a non-empty str not ending"),
    (lambda: ExactnessGuard(every_n_steps=1.0), "ExactnessGuard: every_n_steps must be a positive int"),
    (lambda: SampleLogger(every_n_steps=True), "SampleLogger: every_n_steps must be an int"),
    (lambda: SampleLogger(num_samples=0), "SampleLogger: num_samples must be a positive int"),
    (lambda: SampleLogger(max_chars="10"), "SampleLogger: max_chars must be a positive int"),
]


@pytest.mark.parametrize("make,message", BAD_ARGUMENTS, ids=[m.split(" must")[0] for _, m in BAD_ARGUMENTS])
def test_constructor_arguments_are_checked(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


def test_accepted_constructor_arguments_still_work():
    """Negative control: ints where floats are asked for, zero scales and thresholds, the paper's presets."""
    assert TruncatedIS(cap=2).spec.cap == 2.0
    assert RejectionSampling(threshold=0).spec.threshold == 0
    assert MismatchInjection(scale=0).perturbs_logprobs is False and MismatchInjection(scale=1).perturbs_logprobs
    assert ShadowCorrection(scale=1, corrections=["tis"]).scale == 1.0
    assert MismatchProbe(argmax=False, router=False, prefix="a/b").prefix == "a/b"
    for name in functional.PRESETS:
        assert correction_callbacks(name)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_a_negative_rejection_threshold_is_refused_for_every_estimator(estimator):
    message = r"^RejectionSampling: threshold must be >= 0, got -0\.1: .*every token of an exact rollout"
    with pytest.raises(ValueError, match=message):
        RejectionSampling(estimator=estimator, threshold=-0.1)


# ----------------------------------------------------------------------------------- corrections that cannot act
TIS_EXACT = "TruncatedIS: the rollout log-probs are the trainer's bit for bit.*weights are exactly 1"
RS_EXACT = r"RejectionSampling\(signal='corr'\): the rollout log-probs are the trainer's bit for bit.*rejects nothing"


@pytest.mark.parametrize(
    "make,kwargs,message",
    [
        (TruncatedIS, {}, TIS_EXACT),
        (TruncatedIS, {"mode": "exact"}, TIS_EXACT),
        (lambda: RejectionSampling(signal="corr"), {}, RS_EXACT),
    ],
    ids=["tis-recompute", "tis-exact-mode", "rejection-corr"],
)
def test_corrections_warn_when_the_rollout_is_the_trainers(make, kwargs, message):
    """Exact kernels and no injection: r_corr is exactly 1. Lightning's setup warns once; check (which the module
    and the CLI run as well) does not."""
    callback, m = make(), module(**kwargs)
    t = trainer([callback])
    no_warning(m.check_trainer, t, True)
    with pytest.warns(UserWarning, match=message):
        callback.setup(t, m, "fit")


@pytest.mark.parametrize(
    "callbacks,kwargs",
    [
        ([MismatchInjection(scale=0.05), TruncatedIS()], {}),
        ([MismatchInjection(scale=0.05), RejectionSampling()], {"mode": "exact"}),
        ([TruncatedIS(), RejectionSampling()], {"kernels": "native"}),
        ([TruncatedIS(), RejectionSampling()], {"cls": PerturbedRolloutModule, "rollout_weights": "bf16"}),
        ([RejectionSampling(signal="ppo")], {}),
    ],
    ids=["tis-injection", "rejection-injection", "native", "perturbed-engine", "rejection-ppo"],
)
def test_corrections_do_not_warn_where_they_can_act(callbacks, kwargs):
    m = module(**kwargs)
    t = trainer(callbacks)
    for callback in callbacks:
        no_warning(callback.setup, t, m, "fit")
