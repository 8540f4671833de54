"""RL callbacks as Lightning adapters: probes, corrections, guards, injection, aggregation, presets, logging, resume.

The formulas themselves are covered by the functional tests; here: exact mode reports exactly zero mismatch and
the corrections are exact no-ops, injected/native mismatch is seen and acted on, composition follows list order,
empty masks do not crash, state survives checkpoints, values land in TensorBoard event files, and cross-rank
aggregation divides global sums by global counts.

Part 1 drives the callbacks with a scripted LightningModule (a real ``lightning.Trainer``; hand-built
``RolloutBatch`` objects) that follows the protocol of ``rlexact.callbacks.base``. Part 2 (end to end) uses
``rlexact.RLModule`` when it is available.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from _callbacks_worker import make_batch
from models import tiny_rl_config
from rlexact.batch import RolloutBatch
from rlexact.callbacks import (
    ExactnessError,
    ExactnessGuard,
    MetricReducer,
    MismatchInjection,
    MismatchProbe,
    RejectionSampling,
    RLCallback,
    SampleLogger,
    TruncatedIS,
    UpdateDirectionProbe,
    correction_callbacks,
    functional,
    gather_cat,
    rl_callbacks,
)
from rlexact.callbacks._extra import first_bitwise_mismatch, perturb_logprobs

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "corrections"
PRESETS = sorted(functional.PRESETS)


# ------------------------------------------------------------------------------------------ scripted RL module
class ScriptedRLModule(pl.LightningModule):
    """Follows the RL-callback protocol of ``rlexact.callbacks.base`` on hand-built batches.

    The "policy" is one scalar ``shift``; the current log-probs of a mini-batch are ``old_logprobs + drift * k``
    for the k-th mini-step, so ratios move away from 1 during the PPO epochs. Records what the loss would see.
    """

    def __init__(self, mismatch: float = 0.0, epochs: int = 2, mini_batches: int = 2, drift: float = 0.01) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.shift = torch.nn.Parameter(torch.zeros(()))
        self.mismatch = mismatch
        self.epochs = epochs
        self.mini_batches = mini_batches
        self.drift = drift
        self.old_logprob_mode = "recompute"  # pi_old = the trainer's log-probs (== rollout ones when exact)
        self.seen: list[dict] = []
        self.skipped = 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def training_step(self, batch_idx_tensor, batch_idx):
        batch = make_batch(seed=batch_idx, mismatch=self.mismatch)
        callbacks = rl_callbacks(self.trainer)
        if not any(cb.needs_trainer_logprobs for cb in callbacks):
            batch.trainer_logprobs = None
        for cb in callbacks:
            cb.on_rl_batch(self.trainer, self, batch)
        record = {"batch": batch, "minibatches": []}
        opt = self.optimizers()
        k = 0
        for epoch in range(self.epochs):
            chunks = torch.arange(batch.num_seqs).chunk(self.mini_batches)
            for step, idx in enumerate(chunks):
                mb = batch.select(idx)
                logprobs = (mb.old_logprobs + self.drift * k * mb.response_mask).detach()
                for cb in callbacks:
                    cb.on_rl_minibatch(self.trainer, self, mb, logprobs, epoch, step)
                record["minibatches"].append(mb)
                k += 1
                if not bool(mb.loss_mask.any()):
                    warnings.warn("no token left in the loss; skipping the optimizer step", stacklevel=1)
                    self.skipped += 1
                    continue
                opt.zero_grad()
                loss = (self.shift - 1.0) ** 2 * (mb.token_weights * mb.loss_mask).sum()
                self.manual_backward(loss)
                opt.step()
        for cb in callbacks:
            cb.on_rl_update_end(self.trainer, self, batch)
        self.seen.append(record)

    def train_dataloader(self):
        data = torch.arange(100).reshape(-1, 1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=None)


def fit(callbacks, tmp_path, steps=2, module=None, ckpt_path=None, logger=True, **kwargs):
    module = module if module is not None else ScriptedRLModule()
    trainer = pl.Trainer(
        max_steps=-1,
        limit_train_batches=steps,
        max_epochs=1,
        callbacks=callbacks,
        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0) if logger else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
        **kwargs,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def read_events(tmp_path) -> EventAccumulator:
    acc = EventAccumulator(str(Path(tmp_path) / "tb" / "version_0"), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    return acc


def all_probes():
    return [TruncatedIS(), RejectionSampling(), MismatchProbe(argmax=False), ExactnessGuard()]


# ===================================================================================== part 1: adapters (scripted)
def test_exact_mode_reports_zero_and_corrections_are_noops(tmp_path):
    probe, tis, rs = MismatchProbe(argmax=False), TruncatedIS(), RejectionSampling(threshold=0.0)
    guard = ExactnessGuard()
    trainer, module = fit([tis, rs, probe, guard], tmp_path)
    m = probe.last_metrics
    assert m["mismatch/bitwise_equal_frac"] == 1.0
    for key in ("abs_diff_mean", "abs_diff_max", "prob_diff_max", "k1_mean", "k2_mean", "k3_mean", "chi2"):
        assert m[f"mismatch/{key}"] == 0.0, key
    assert m["mismatch/log_ppl_diff"] == 0.0
    assert m["mismatch/num_tokens"] > 0
    for rec in module.seen:
        batch = rec["batch"]
        assert torch.equal(batch.token_weights, torch.ones_like(batch.token_weights))
        assert torch.equal(batch.loss_mask, batch.response_mask)
    assert tis.last_metrics == {"tis/mean": 1.0, "tis/min": 1.0, "tis/max": 1.0, "tis/truncated_frac": 0.0}
    assert rs.last_metrics["rejection/rejected_token_frac"] == 0.0
    assert rs.last_metrics["rejection/rejected_seq_frac"] == 0.0
    assert guard.checks_passed == 2
    # first mini-step of each rollout step: pi_theta == pi_old^train == pi_old^rollout -> C == 0 on both sides
    first = probe.last_minibatch_metrics[0]
    for key in ("c_ppo_train_pos", "c_ppo_train_neg", "c_ppo_rollout_pos", "c_ppo_rollout_neg"):
        assert first[key] == 0.0
    # exact: trainer- and rollout-referenced contributions are identical at every mini-step
    for mb in probe.last_minibatch_metrics:
        assert mb["c_ppo_train_pos"] == mb["c_ppo_rollout_pos"] and mb["c_ppo_train_neg"] == mb["c_ppo_rollout_neg"]


def test_injection_is_seen_by_probes_and_corrections_act(tmp_path):
    inj = MismatchInjection(scale=0.3, seed=1)
    tis = TruncatedIS(cap=1.2)
    rs = RejectionSampling(granularity="sequence_sum", estimator="k3", threshold=0.001)
    probe = MismatchProbe(argmax=False)
    trainer, module = fit([inj, tis, rs, probe], tmp_path)
    m = probe.last_metrics
    assert m["mismatch/bitwise_equal_frac"] < 0.2
    assert m["mismatch/abs_diff_mean"] > 0.05 and m["mismatch/abs_diff_max"] > m["mismatch/abs_diff_mean"]
    assert m["mismatch/k3_mean"] > 0 and m["mismatch/k2_mean"] > 0 and m["mismatch/chi2"] != 0
    batch = module.seen[-1]["batch"]
    resp = batch.response_mask
    assert not torch.equal(batch.token_weights[resp], torch.ones(int(resp.sum())))
    assert bool(batch.token_weights.max() <= torch.tensor(1.2))
    assert tis.last_metrics["tis/truncated_frac"] > 0
    assert 0 < rs.last_metrics["rejection/rejected_seq_frac"] <= 1
    assert rs.rejected_tokens_total > 0
    # the contributions now differ between the trainer- and rollout-referenced ratios
    mb = probe.last_minibatch_metrics[0]
    assert mb["c_ppo_train_pos"] == 0.0 and mb["c_ppo_rollout_pos"] != 0.0


def test_injection_in_exact_mode_perturbs_old_logprobs_only_when_they_are_rollout(tmp_path):
    batch = make_batch()
    clean = batch.rollout_logprobs.clone()
    trainer_lp = batch.trainer_logprobs
    for policy, follows in (("follow", True), ("keep", False), ("auto", True)):
        b = make_batch()
        MismatchInjection(scale=0.1, old_logprobs=policy).on_rl_batch(None, None, b)
        assert torch.equal(b.old_logprobs, b.rollout_logprobs) is follows
        assert torch.equal(b.trainer_logprobs, trainer_lp)  # trainer side never touched
    b = make_batch()

    class Recompute:
        class algorithm:  # noqa: N801
            old_logprob_mode = "recompute"

    MismatchInjection(scale=0.1).on_rl_batch(None, Recompute(), b)
    assert torch.equal(b.old_logprobs, clean) and not torch.equal(b.rollout_logprobs, clean)
    # prompt tokens untouched, perturbed values stay log-probs
    assert torch.equal(b.rollout_logprobs[~b.response_mask], clean[~b.response_mask])
    assert float(b.rollout_logprobs.max()) <= 0.0


def test_injection_is_deterministic_per_seed_and_step():
    def run(seed, steps):
        inj = MismatchInjection(scale=0.2, seed=seed)
        outs = []
        for _ in range(steps):
            b = make_batch()
            inj.on_rl_batch(None, None, b)
            outs.append(b.rollout_logprobs)
        return outs, inj

    a, inj = run(0, 3)
    b, _ = run(0, 3)
    c, _ = run(1, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], a[1])
    resumed = MismatchInjection(scale=0.2, seed=0)
    resumed.load_state_dict(inj.state_dict() | {"rollout_step": 2})
    bb = make_batch()
    resumed.on_rl_batch(None, None, bb)
    assert torch.equal(bb.rollout_logprobs, a[2])


@pytest.mark.parametrize("target", ["logprobs", "logits"])
def test_perturb_logprobs_targets(target):
    lp = torch.tensor([0.0, -1e-6, -0.1, -0.7, -3.0, -20.0, -float("inf")])
    mask = torch.ones(7, dtype=torch.bool)
    noise = torch.full((7,), 0.5, dtype=torch.float64)
    out = perturb_logprobs(lp, noise, mask, target)
    assert out.dtype == lp.dtype and bool((out <= 0).all())
    assert torch.equal(perturb_logprobs(lp, torch.zeros(7, dtype=torch.float64), mask, target), lp)
    if target == "logits":
        shift = (out - lp)[1:6]
        assert out[0] == 0.0 and out[-1] == -float("inf")
        assert bool((shift[1:] >= shift[:-1]).all())  # confident tokens move least
        assert abs(float(shift[-1]) - 0.5) < 1e-6  # p -> 0: log-odds ~ log p
    with pytest.raises(ValueError, match="target"):
        perturb_logprobs(lp, noise, mask, "bad")


def test_injection_must_come_first(tmp_path):
    with pytest.raises(ValueError, match="MismatchInjection must come before"):
        fit([MismatchProbe(argmax=False), MismatchInjection()], tmp_path, steps=1)


def test_composition_tis_then_rejection_multiplies_and_ands(tmp_path):
    """[inj, TIS(cap), TIS(cap2), RS] == functional.apply_correction on the same batch; weights multiply."""
    inj = MismatchInjection(scale=0.3, seed=3)
    tis1, tis2 = TruncatedIS(cap=1.5), TruncatedIS(level="sequence", cap=3.0, prefix="tis_seq")
    rs = RejectionSampling(signal="corr", granularity="sequence_max", estimator="k2", threshold=0.02)
    trainer, module = fit([inj, tis1, tis2, rs], tmp_path, steps=1)
    batch = module.seen[0]["batch"]
    log_r = batch.trainer_logprobs - batch.rollout_logprobs
    w1, _ = functional.tis_weights(log_r, batch.cu_seqlens, batch.response_mask, level="token", cap=1.5)
    w2, _ = functional.tis_weights(log_r, batch.cu_seqlens, batch.response_mask, level="sequence", cap=3.0)
    assert torch.equal(batch.token_weights, w1 * w2)
    _, keep, _ = functional.apply_correction(
        None,
        functional.RejectionSpec("corr", "sequence_max", "k2", 0.02),
        rollout_logp=batch.rollout_logprobs,
        old_logp=batch.trainer_logprobs,
        cu_seqlens=batch.cu_seqlens,
        mask=batch.response_mask,
    )
    assert torch.equal(batch.loss_mask, keep)
    assert 0 < int(keep.sum()) < int(batch.response_mask.sum())
    # the opposite order gives the same result (both read raw ratios and the raw response mask)
    trainer2, module2 = fit(
        [MismatchInjection(scale=0.3, seed=3), rs.__class__(**_rs_args(rs)), TruncatedIS(cap=1.5)],
        tmp_path / "b",
        steps=1,
    )
    b2 = module2.seen[0]["batch"]
    assert torch.equal(b2.loss_mask, keep) and torch.equal(b2.token_weights, w1)


def _rs_args(rs: RejectionSampling) -> dict:
    s = rs.spec
    return {"signal": s.signal, "granularity": s.granularity, "estimator": s.estimator, "threshold": s.threshold}


def test_ppo_signal_rejection_acts_per_minibatch(tmp_path):
    rs = RejectionSampling(signal="ppo", granularity="token", estimator="k3", threshold=1e-5)
    module = ScriptedRLModule(epochs=2, mini_batches=2, drift=0.05)
    assert rs.needs_trainer_logprobs is False
    trainer, module = fit([rs], tmp_path, steps=1, module=module)
    mbs = module.seen[0]["minibatches"]
    # first mini-step: pi_theta == pi_old^rollout -> nothing rejected; later: drift > threshold -> all rejected
    assert torch.equal(mbs[0].loss_mask, mbs[0].response_mask)
    assert not bool(mbs[-1].loss_mask.any())
    assert rs.last_minibatch_metrics[0]["rejection/rejected_token_frac"] == 0.0
    assert rs.last_minibatch_metrics[-1]["rejection/rejected_token_frac"] == 1.0
    assert rs.last_minibatch_metrics[-1]["rejection/empty_loss_frac"] == 1.0
    assert 0 < rs.last_metrics["rejection/rejected_token_frac"] < 1
    assert module.skipped == 3


def test_all_rejected_step_is_skipped_without_crash(tmp_path):
    inj = MismatchInjection(scale=0.5, seed=0)
    rs = RejectionSampling(granularity="token", estimator="k2", threshold=0.0)
    probe = MismatchProbe(argmax=False)
    with pytest.warns(UserWarning, match="skipping"):
        trainer, module = fit([inj, rs, probe], tmp_path, steps=2)
    assert rs.last_metrics["rejection/rejected_token_frac"] == 1.0
    assert rs.last_metrics["rejection/empty_loss_frac"] == 1.0
    assert rs.empty_steps == 2
    assert module.skipped == 2 * 2 * 2 and trainer.global_step == 0
    assert float(module.shift) == 0.0


def test_callbacks_survive_empty_batches():
    """A rank can end up with no response tokens: every callback returns neutral values."""
    b = make_batch(num_seqs=2)
    b.response_mask = torch.zeros_like(b.response_mask)
    b.loss_mask = torch.zeros_like(b.loss_mask)
    for cb in [MismatchInjection(scale=0.2), TruncatedIS(), RejectionSampling(), MismatchProbe(argmax=False)]:
        cb.on_rl_batch(None, None, b)
        cb.on_rl_minibatch(None, None, b, b.old_logprobs, 0, 0)
        cb.on_rl_update_end(None, None, b)
    ExactnessGuard().on_rl_batch(None, None, b)
    assert torch.equal(b.token_weights, torch.ones_like(b.token_weights))


def test_missing_trainer_logprobs_is_a_clear_error():
    b = make_batch()
    b.trainer_logprobs = None
    for cb in (TruncatedIS(), RejectionSampling(), MismatchProbe(argmax=False), ExactnessGuard()):
        with pytest.raises(RuntimeError, match="needs batch.trainer_logprobs"):
            cb.on_rl_batch(None, None, b)


def test_exactness_guard_names_the_first_difference(tmp_path):
    b = make_batch(num_seqs=4, prompt_len=3)
    t = int(b.cu_seqlens[2]) + 3 + 1  # sequence 2, token position 4 = response token 1
    b.trainer_logprobs = b.trainer_logprobs.clone()
    b.trainer_logprobs[t] = torch.nextafter(b.trainer_logprobs[t], torch.tensor(0.0))  # one ulp
    with pytest.raises(ExactnessError) as info:
        ExactnessGuard().on_rl_batch(None, None, b)
    err = info.value
    assert (err.seq_index, err.position, err.response_position, err.num_mismatched) == (2, 4, 1, 1)
    assert err.rollout_value == float(b.rollout_logprobs[t]) and err.trainer_value == float(b.trainer_logprobs[t])
    msg = str(err)
    assert "sequence 2" in msg and "token position 4" in msg and "response token 1" in msg
    assert isinstance(err, RuntimeError)
    # -0.0 vs 0.0 on a response token is a difference (bits, not values); on a prompt token it is ignored
    b2 = make_batch()
    b2.trainer_logprobs = b2.trainer_logprobs.clone()
    b2.trainer_logprobs[0] = -0.0
    ExactnessGuard().on_rl_batch(None, None, b2)
    assert first_bitwise_mismatch(torch.tensor([0.0]), torch.tensor([-0.0]), torch.tensor([True])) == (1, 0)


def test_exactness_guard_raises_under_injection_in_training(tmp_path):
    with pytest.raises(ExactnessError, match=r"sequence \d+ of the batch, token position \d+"):
        fit([MismatchInjection(scale=1e-3), ExactnessGuard()], tmp_path, steps=1)


def test_exactness_guard_every_n_steps(tmp_path):
    guard = ExactnessGuard(every_n_steps=2)
    fit([guard], tmp_path, steps=3)
    assert (guard.steps_seen, guard.checks_passed) == (3, 2)
    with pytest.raises(ValueError):
        ExactnessGuard(every_n_steps=0)


# ------------------------------------------------------------------------------------- logging to TensorBoard
def test_scalars_and_histograms_in_tensorboard_event_files(tmp_path):
    inj = MismatchInjection(scale=0.2)
    tis, rs, probe = TruncatedIS(), RejectionSampling(), MismatchProbe(argmax=False)
    fit([inj, tis, rs, probe], tmp_path, steps=2)
    acc = read_events(tmp_path)
    scalars = set(acc.Tags()["scalars"])
    expected = {
        "mismatch/bitwise_equal_frac",
        "mismatch/abs_diff_mean",
        "mismatch/abs_diff_max",
        "mismatch/prob_diff_max",
        "mismatch/k1_mean",
        "mismatch/k2_mean",
        "mismatch/k3_mean",
        "mismatch/chi2",
        "mismatch/log_ppl_diff",
        "mismatch/c_ppo_train_pos",
        "mismatch/c_ppo_train_neg",
        "mismatch/c_ppo_rollout_pos",
        "mismatch/c_ppo_rollout_neg",
        "tis/mean",
        "tis/min",
        "tis/max",
        "tis/truncated_frac",
        "rejection/rejected_token_frac",
        "rejection/rejected_seq_frac",
        "injection/abs_shift_mean",
    }
    assert expected <= scalars, expected - scalars
    events = acc.Scalars("mismatch/abs_diff_mean")
    assert [e.step for e in events] == [0, 1]
    assert events[-1].value == pytest.approx(probe.last_metrics["mismatch/abs_diff_mean"], rel=1e-6)
    hists = set(acc.Tags()["histograms"])
    assert {"mismatch/delta_logp", "mismatch/r_corr", "mismatch/r_ppo_train", "mismatch/r_ppo_rollout"} <= hists
    h = acc.Histograms("mismatch/delta_logp")
    assert [e.step for e in h] == [0, 1]
    assert h[-1].histogram_value.num == probe.last_metrics["mismatch/num_tokens"]  # raw, before masking
    # r_ppo histograms hold every mini-step's ratios (2 epochs x all response tokens)
    assert acc.Histograms("mismatch/r_ppo_rollout")[-1].histogram_value.num == 2 * h[-1].histogram_value.num


def test_ministep_logging(tmp_path):
    probe = MismatchProbe(argmax=False, log_ministeps=True, histograms=False)
    fit([MismatchInjection(scale=0.2), probe], tmp_path, steps=1)
    acc = read_events(tmp_path)
    events = acc.Scalars("mismatch_ministep/c_ppo_rollout_neg")
    assert [e.step for e in events] == [0, 1, 2, 3]
    assert "mismatch/delta_logp" not in acc.Tags()["histograms"]


# ---------------------------------------------------------------------------------------------- resumable state
def test_state_dict_round_trip():
    cbs = [MismatchInjection(scale=0.0), TruncatedIS(), RejectionSampling(), MismatchProbe(argmax=False)]
    cbs += [ExactnessGuard()]
    for _ in range(2):
        b = make_batch(mismatch=0.0)
        for cb in cbs:
            cb.on_rl_batch(None, None, b)
    for cb in cbs:
        state = cb.state_dict()
        fresh = type(cb)()
        fresh.load_state_dict(state)
        assert fresh.state_dict() == state and state, type(cb).__name__
    keys = [cb.state_key for cb in [TruncatedIS(), TruncatedIS(prefix="x"), RejectionSampling()]]
    assert len(set(keys)) == 3
    partial = {k: v for k, v in TruncatedIS().state_dict().items() if k != "truncated_total"}
    with pytest.raises(KeyError, match=r"TruncatedIS: the checkpoint's state for it lacks \['truncated_total'\]"):
        TruncatedIS().load_state_dict(partial)


def test_truncated_is_refuses_bypass_and_warns_in_exact_mode():
    """TIS on top of a rollout-referenced ratio would correct twice (bypass: an error); in exact mode its weights
    are 1 unless the rollout is perturbed (a warning); recompute, what it is for, says nothing (control)."""
    from types import SimpleNamespace

    def module(mode: str) -> SimpleNamespace:
        return SimpleNamespace(algo=SimpleNamespace(old_logprob_mode=mode))

    with pytest.raises(ValueError, match="TruncatedIS with old_logprob_mode='bypass'.*'recompute'"):
        TruncatedIS().setup(None, module("bypass"), "fit")
    with pytest.warns(UserWarning, match="TruncatedIS: the rollout log-probs are the trainer's bit for bit.*exactly 1"):
        TruncatedIS().setup(None, module("exact"), "fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TruncatedIS().setup(None, module("recompute"), "fit")


def test_callback_arguments_of_the_wrong_type_are_named():
    for make, message in ((lambda: UpdateDirectionProbe(every_n_steps=1.5), "every_n_steps must be a positive int"),
                          (lambda: UpdateDirectionProbe(every_n_steps="2"), "every_n_steps must be a positive int"),
                          (lambda: MismatchProbe(histogram_every_n_steps=2.5), "histogram_every_n_steps must be"),
                          (lambda: SampleLogger(every_n_steps=0.5), "every_n_steps must be an int"),
                          (lambda: RejectionSampling(threshold="0.1"), "threshold must be a finite")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            make()


def test_lightning_resume_restores_callback_state(tmp_path):
    def callbacks():
        return [
            MismatchInjection(scale=0.2, seed=5),
            TruncatedIS(),
            RejectionSampling(),
            MismatchProbe(argmax=False),
        ]

    ckpt = tmp_path / "a.ckpt"

    class SaveAfterSecondStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                trainer.save_checkpoint(ckpt)

    first = callbacks()
    fit([*first, SaveAfterSecondStep()], tmp_path / "a", steps=3)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert saved[first[0].state_key] == {"rollout_step": 2}

    # uninterrupted 3-step run vs 2 steps + resume for the 3rd: same injection noise on step 3, same counters
    full = callbacks()
    _, m_full = fit(full, tmp_path / "full", steps=3)
    resumed = callbacks()
    _, m_res = fit(resumed, tmp_path / "res", steps=3, ckpt_path=str(ckpt))
    assert len(m_res.seen) == 1
    assert torch.equal(m_res.seen[0]["batch"].rollout_logprobs, m_full.seen[2]["batch"].rollout_logprobs)
    for a, b in zip(full, resumed):
        assert a.state_dict() == b.state_dict(), type(a).__name__


# ------------------------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name", PRESETS)
def test_preset_factory_matches_functional_presets(name):
    tis_spec, rs_spec = functional.PRESETS[name]
    cbs = correction_callbacks(name)
    if tis_spec is None:
        assert [type(c) for c in cbs] == [RejectionSampling]
    else:
        assert [type(c) for c in cbs] == [TruncatedIS, RejectionSampling]
        assert cbs[0].spec == tis_spec
    assert cbs[-1].spec == rs_spec
    assert cbs[-1].spec.threshold == 0.001 and (tis_spec is None or tis_spec.cap == 2.0)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_yaml_matches_factory(name):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import instantiate_class

    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    items = cfg["trainer"]["callbacks+"]
    cbs = [instantiate_class((), item) for item in items]
    ref = correction_callbacks(name)
    assert [type(c) for c in cbs] == [type(c) for c in ref]
    assert [c.spec for c in cbs] == [c.spec for c in ref]


def test_preset_yaml_appends_to_the_recipe_with_lightning_cli(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "trainer:\n  logger: false\n  callbacks:\n    - class_path: rlexact.callbacks.MismatchProbe\n"
        "      init_args: {argmax: false}\n"
    )
    cli = LightningCLI(
        ScriptedRLModule,
        run=False,
        args=["--config", str(recipe), "--config", str(CONFIGS / "tis-srs-k3-corr-ratio.yaml")],
        save_config_callback=None,
    )
    got = [c for c in cli.trainer.callbacks if isinstance(c, RLCallback)]
    assert [type(c) for c in got] == [MismatchProbe, TruncatedIS, RejectionSampling]
    assert got[2].spec == functional.PRESETS["tis-srs-k3-corr-ratio"][1]
    cli = LightningCLI(
        ScriptedRLModule,
        run=False,
        args=["--config", str(CONFIGS / "srs-k3-ppo-ratio.yaml"), "--trainer.logger=false"],
        save_config_callback=None,
    )
    assert [type(c) for c in cli.trainer.callbacks if isinstance(c, RLCallback)] == [RejectionSampling]


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown correction preset"):
        correction_callbacks("nope")


# -------------------------------------------------------------------------------------------------- aggregation
def test_metric_reducer_single_process_is_exact():
    red = MetricReducer()
    red.add_mean("m", 0.1 + 0.2, 3)
    red.add_mean("e", 0.5, 0, empty=1.0)
    red.add_max("mx", None, empty=-1.0)
    red.add_min("mn", 2.5)
    red.add_sum("s", 7)
    assert red.reduce() == {"m": 0.1 + 0.2, "e": 1.0, "s": 7.0, "mx": -1.0, "mn": 2.5}
    assert torch.equal(gather_cat(torch.arange(3.0)), torch.arange(3.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_gloo_aggregation(tmp_path):
    """Two gloo ranks (tests/_callbacks_worker.py): sums/counts reduce before dividing, MAX/MIN are global, empty
    ranks are neutral, histograms gather in rank order, and TIS / MismatchProbe over two halves of a batch report
    what one process reports for the whole batch."""
    port = _free_port()
    worker = Path(__file__).with_name("_callbacks_worker.py")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(r), str(tmp_path / f"rank{r}.pt")], env=env)
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        v = r["values"]
        assert v["mean"] == 2.5 and v["empty_on_0"] == 4.0 and v["max"] == 5.0 and v["min"] == -2.0
        assert v["sum"] == 3.0
        assert r["gathered"].tolist() == [0.0, 1.0, 10.0, 11.0, 12.0]
    assert res[0]["tis"] == res[1]["tis"] and res[0]["probe"] == res[1]["probe"]
    whole = make_batch(seed=11, mismatch=0.2)
    tis = TruncatedIS(cap=1.1)
    tis.on_rl_batch(None, None, whole)
    probe = MismatchProbe(argmax=False)
    probe.on_rl_batch(None, None, whole)
    for key, value in tis.last_metrics.items():
        assert res[0]["tis"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    for key, value in probe.last_metrics.items():
        assert res[0]["probe"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert math.isfinite(res[0]["probe"]["mismatch/chi2"])


def test_two_rank_fsdp_rl_module_metrics_are_global(tmp_path):
    """RLModule under FSDP2 on two CPU ranks with the exact engine: every callback reports the same (global) values
    on both ranks, token counts are the sum over ranks, and exact mode still reads exactly zero mismatch."""
    import json

    worker = Path(__file__).with_name("_callbacks_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(worker), "fsdp", str(tmp_path)], env=env, timeout=240)
    assert proc.returncode == 0
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["is_fsdp"] and res[1]["is_fsdp"]
    names = ["TruncatedIS", "RejectionSampling", "MismatchProbe", "UpdateDirectionProbe", "ExactnessGuard"]
    for name in names:
        assert res[0][name] == res[1][name], name
    probe = res[0]["MismatchProbe"]
    assert probe["mismatch/num_tokens"] == res[0]["local_tokens"][-1] + res[1]["local_tokens"][-1]
    assert probe["mismatch/bitwise_equal_frac"] == 1.0 and probe["mismatch/abs_diff_max"] == 0.0
    assert probe["mismatch/argmax_flip_rate"] == 0.0
    assert res[0]["TruncatedIS"] == {"tis/mean": 1.0, "tis/min": 1.0, "tis/max": 1.0, "tis/truncated_frac": 0.0}
    assert res[0]["ExactnessGuard"] == {"exactness/mismatched_tokens": 0.0}


def test_update_direction_probe_with_a_scripted_generator():
    """after - before is +A-aligned on half the tokens and misaligned on the rest; scores in both layouts."""
    b = make_batch(seed=4)
    resp, adv = b.response_mask, b.advantages
    active = resp & (adv != 0)
    flip = torch.zeros_like(resp)
    flip[torch.nonzero(active).squeeze(-1)[::2]] = True
    after = b.rollout_logprobs + 0.01 * torch.sign(adv) * torch.where(flip, -1.0, 1.0)

    class Gen:
        def score(self, sequences, temperature):
            cu = b.cu_seqlens.tolist()
            return [after[s + 1 : e] for s, e in zip(cu[:-1], cu[1:])]

    class Module:
        generator = Gen()

    probe = UpdateDirectionProbe()
    probe.on_rl_batch(None, Module(), b)
    probe.on_rl_update_end(None, Module(), b)
    m = probe.last_metrics
    assert m["update_direction/num_tokens"] == int(active.sum())
    assert m["update_direction/misaligned_count"] == int(flip.sum())
    assert m["update_direction/misaligned_frac"] == int(flip.sum()) / int(active.sum())
    assert m["update_direction/unchanged_frac"] == 0.0
    assert probe.state_dict()["tokens_total"] == int(active.sum())


# ========================================================================== part 2: end to end with rlexact.RLModule
def _reward(prompts, completions, answers):
    return [float(sum(map(ord, c)) % 7) for c in completions]  # varied within groups: nonzero advantages


def rl_module(kernels="exact", mode="exact", lr=1e-4, dtype="float32", n=4, rollout=None, **algo):
    from rlexact.char_tokenizer import build_char_tokenizer
    from rlexact.data import ResumableDataLoader, ResumableSampler
    from rlexact.module import RLModule

    tok = build_char_tokenizer()
    cfg = tiny_rl_config(len(tok))
    texts = [f"{i}+{i}=" for i in range(8)]
    data = [
        {"prompt_ids": tok(t)["input_ids"], "prompt_text": t, "answer": None, "index": i} for i, t in enumerate(texts)
    ]
    module = RLModule(
        model_config=cfg,
        tokenizer=tok,
        reward=_reward,
        dtype=dtype,
        rollout=dict(n=n, max_new_tokens=8, seed=1, kernels=kernels, **(rollout or {})),
        algorithm=dict(old_logprob_mode=mode, **algo),
        optim=dict(lr=lr),
    )
    sampler = ResumableSampler(len(data), shuffle=False)
    return module, ResumableDataLoader(data, batch_size=2, sampler=sampler, collate_fn=list)  # resumable order


def fit_rl(callbacks, tmp_path, steps=1, ckpt_path=None, logger=False, **module_kwargs):
    module, data = rl_module(**module_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=steps,
        callbacks=callbacks,
        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0) if logger else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module


def unprefixed(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with the prefix (the first component of each name) removed."""
    return {name.split("/", 1)[1]: value for name, value in metrics.items()}


class Capture(RLCallback):
    """Keeps the batch as the loss saw it (after every earlier callback) and the first mini-step's log-probs."""

    def __init__(self) -> None:
        self.batches: list[RolloutBatch] = []

    def on_rl_batch(self, trainer, pl_module, batch) -> None:
        self.batches.append(batch)


def test_e2e_exact_mode(tmp_path):
    """Exact kernels + exact pi_old: every probe reads exactly zero, the corrections are exact no-ops, the guard
    passes, and scalars + histograms reach TensorBoard."""
    tis, rs = TruncatedIS(), RejectionSampling(threshold=0.0)
    probe, guard, upd, cap = MismatchProbe(), ExactnessGuard(), UpdateDirectionProbe(), Capture()
    rescored = UpdateDirectionProbe(before="rescore", prefix="rescored")
    trainer, module = fit_rl([tis, rs, probe, guard, upd, rescored, cap], tmp_path, steps=2, logger=True)
    m = probe.last_metrics
    assert m["mismatch/bitwise_equal_frac"] == 1.0 and m["mismatch/argmax_flip_rate"] == 0.0
    for key in ("abs_diff_mean", "abs_diff_max", "prob_diff_max", "k1_mean", "k2_mean", "k3_mean", "chi2"):
        assert m[f"mismatch/{key}"] == 0.0, key
    for key in ("c_ppo_train_pos", "c_ppo_train_neg", "c_ppo_rollout_pos", "c_ppo_rollout_neg"):
        assert m[f"mismatch/{key}"] == 0.0, key  # one mini-step per rollout: pi_theta == pi_old exactly
    assert tis.last_metrics == {"tis/mean": 1.0, "tis/min": 1.0, "tis/max": 1.0, "tis/truncated_frac": 0.0}
    assert rs.last_metrics["rejection/rejected_token_frac"] == 0.0 and rs.rejected_tokens_total == 0
    for batch in cap.batches:
        assert torch.equal(batch.token_weights, torch.ones_like(batch.token_weights))
        assert torch.equal(batch.loss_mask, batch.response_mask)
    assert guard.checks_passed == 2 and trainer.global_step == 2
    # Update direction with the exact engine (AdamW lr 1e-4, one optimizer step per rollout step). Measured on this
    # tiny random model: about 14% of A != 0 tokens move against their advantage (17 of 124 over the two steps),
    # the same with SGD and at any lr -- gradient interference between tokens, not mismatch. What exactness
    # guarantees is that the generator's pre-update numbers are the rollout's: both "before" choices agree exactly.
    print("update_direction exact fp32 lr=1e-4:", upd.last_metrics, upd.misaligned_total, "/", upd.tokens_total)
    assert upd.tokens_total > 0 and upd.last_metrics["update_direction/unchanged_frac"] == 0.0
    assert unprefixed(rescored.last_metrics) == unprefixed(upd.last_metrics)
    assert rescored.state_dict()["misaligned_total"] == upd.misaligned_total
    acc = read_events(tmp_path)
    scalars = set(acc.Tags()["scalars"])
    assert {
        "mismatch/bitwise_equal_frac",
        "mismatch/argmax_flip_rate",
        "tis/mean",
        "rejection/rejected_seq_frac",
    } <= scalars
    assert {"update_direction/misaligned_frac", "exactness/mismatched_tokens", "mismatch/c_ppo_rollout_neg"} <= scalars
    assert [e.value for e in acc.Scalars("mismatch/bitwise_equal_frac")] == [1.0, 1.0]
    hist = acc.Histograms("mismatch/delta_logp")
    assert len(hist) == 2 and hist[-1].histogram_value.min == 0.0 and hist[-1].histogram_value.max == 0.0
    assert {"mismatch/r_corr", "mismatch/r_ppo_train", "mismatch/r_ppo_rollout"} <= set(acc.Tags()["histograms"])


def test_update_direction_probe_scores_the_sampled_distribution(tmp_path):
    """rollout.logprobs="sampled" with top-k / top-p: the rollout log-probs are of the truncated distribution, so the
    probe's re-scoring through the generator must be too. Exact engine, before the update: the probe's scores equal
    the rollout log-probs and the trainer's truncated log-probs bitwise on the response tokens, and both "before"
    choices give the same metrics. Negative control: the full-softmax log-probs of the same tokens differ."""
    from rlexact.callbacks.probes import policy_model, rollout_temperature
    from rlexact.callbacks.shadow import module_logprobs
    from rlexact.logprobs import Packed, packed_logprobs

    class Rescore(RLCallback):
        def __init__(self) -> None:
            self.seen: list[tuple[RolloutBatch, torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def on_rl_batch(self, trainer, pl_module, batch) -> None:
            model = policy_model(pl_module)
            with torch.no_grad():
                probe_lp = UpdateDirectionProbe().score(pl_module, batch)
                trainer_lp = module_logprobs(pl_module, model, batch)
                packed = Packed(batch.input_ids, batch.position_ids, batch.cu_seqlens)
                full_lp = packed_logprobs(model, packed, rollout_temperature(pl_module))[0]
            self.seen.append((batch, probe_lp, trainer_lp, full_lp))

    rescore, upd = Rescore(), UpdateDirectionProbe()
    rescored = UpdateDirectionProbe(before="rescore", prefix="rescored")
    truncation = {"top_k": 4, "top_p": 0.99, "logprobs": "sampled"}
    _, module = fit_rl([rescore, upd, rescored], tmp_path, steps=2, rollout=truncation)
    assert module.logprob_truncation == (4, 0.99) and len(rescore.seen) == 2
    for batch, probe_lp, trainer_lp, full_lp in rescore.seen:
        resp = batch.response_mask
        assert torch.equal(probe_lp[resp], batch.rollout_logprobs[resp])
        assert torch.equal(probe_lp[resp], trainer_lp[resp])
        assert not torch.equal(full_lp[resp], probe_lp[resp])  # negative control: the full softmax
    assert upd.tokens_total > 0 and unprefixed(rescored.last_metrics) == unprefixed(upd.last_metrics)
    assert rescored.state_dict()["misaligned_total"] == upd.misaligned_total


def test_e2e_native_generator(tmp_path):
    """The native (non-exact) generator in bf16 with recompute: the probe sees the kernel mismatch, TIS weights
    leave 1, a token-level rejection acts on the outliers, and the guard names the first differing token."""
    tis = TruncatedIS()
    rs = RejectionSampling(granularity="token", estimator="k3", threshold=1e-6)
    probe, upd, cap = MismatchProbe(), UpdateDirectionProbe(), Capture()
    trainer, module = fit_rl([tis, rs, probe, upd, cap], tmp_path, kernels="native", mode="recompute", dtype="bfloat16")
    m = probe.last_metrics
    print("native bf16 mismatch:", m)
    assert m["mismatch/bitwise_equal_frac"] < 0.5 and m["mismatch/abs_diff_max"] > 0 and m["mismatch/k3_mean"] > 0
    # recompute: pi_old = pi_old^train, so C(r_ppo^train) == 0 at the first mini-step while C(r_ppo^rollout) != 0
    assert m["mismatch/c_ppo_train_pos"] == 0.0 and m["mismatch/c_ppo_rollout_pos"] != 0.0
    batch = cap.batches[0]
    resp = batch.response_mask
    assert not torch.equal(batch.token_weights[resp], torch.ones(int(resp.sum())))
    assert 0.0 < rs.last_metrics["rejection/rejected_token_frac"] < 1.0
    print("update_direction native bf16 lr=1e-4:", upd.last_metrics)
    assert upd.last_metrics["update_direction/num_tokens"] > 0
    with pytest.raises(ExactnessError, match="sequence 0 of the batch"):
        ExactnessGuard().on_rl_batch(None, None, batch)


def test_e2e_injection_guard_and_update_direction(tmp_path):
    # the guard stops training at the first rollout step and names the position
    with pytest.raises(ExactnessError, match=r"token position \d+ in the sequence \(response token \d+"):
        fit_rl([MismatchInjection(scale=0.01), ExactnessGuard()], tmp_path / "guard")
    # update direction under injection: the noisy "before" values add misaligned tokens on top of the optimizer's
    # own (measured by re-scoring before the update through the clean generator)
    upd, rescored = UpdateDirectionProbe(), UpdateDirectionProbe(before="rescore", prefix="rescored")
    probe = MismatchProbe()
    fit_rl([MismatchInjection(scale=0.05), probe, upd, rescored], tmp_path / "upd")
    print("update_direction injection 0.05:", upd.last_metrics, "rescore:", rescored.last_metrics)
    noisy = upd.last_metrics["update_direction/misaligned_frac"]
    clean = rescored.last_metrics["rescored/misaligned_frac"]
    assert noisy > clean + 0.1
    assert probe.last_metrics["mismatch/argmax_flip_rate"] == 0.0  # injection perturbs log-probs only


def test_e2e_all_rejected_steps_are_skipped(tmp_path):
    inj = MismatchInjection(scale=0.1)
    rs = RejectionSampling(granularity="token", estimator="k2", threshold=0.0)
    probe = MismatchProbe(argmax=False)
    with pytest.warns(UserWarning, match="no token left in the loss"):
        trainer, module = fit_rl([inj, rs, probe], tmp_path, steps=2, ppo_epochs=2, mini_batch_size=4)
    assert rs.last_metrics["rejection/rejected_token_frac"] == 1.0 and rs.empty_steps == 2
    assert trainer.global_step == 0 and module.rollout_step == 2
    assert probe.steps == 2


def test_e2e_lightning_resume(tmp_path):
    """2 rollout steps straight == 1 step, checkpoint, resume for the 2nd: same callback state, same injected
    noise and the same batch on the resumed step (distinct dataset rows, so a replayed batch would sample other
    tokens: keys come from the row index)."""
    ckpt = tmp_path / "step1.ckpt"

    class SaveAfterFirst(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                trainer.save_checkpoint(ckpt)

    def callbacks():
        return [MismatchInjection(scale=0.05, seed=2), TruncatedIS(), RejectionSampling(), MismatchProbe(argmax=False)]

    full, cap_full = callbacks(), Capture()
    fit_rl([*full, cap_full, SaveAfterFirst()], tmp_path / "full", steps=2)
    resumed, cap_res = callbacks(), Capture()
    _, module = fit_rl([*resumed, cap_res], tmp_path / "res", steps=2, ckpt_path=str(ckpt))
    assert module.rollout_step == 2 and len(cap_res.batches) == 1
    a, b = cap_full.batches[1], cap_res.batches[0]
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert torch.equal(a.token_weights, b.token_weights) and torch.equal(a.loss_mask, b.loss_mask)
    for x, y in zip(full, resumed):
        assert x.state_dict() == y.state_dict(), type(x).__name__
    assert resumed[0].rollout_step == 2


def test_argmax_tokens_align_with_the_model_and_ignore_chunking():
    """The probe's top-1 tokens are those of the unmodified transformers forward, whatever the chunking."""
    import rlexact
    from models import tiny_model

    model = tiny_model(vocab=50)
    reference = tiny_model(vocab=50)
    rlexact.exactify(model)
    b = make_batch(seed=6, num_seqs=5)
    probe = MismatchProbe(argmax_chunk_tokens=3)
    mask = b.response_mask
    got = probe._argmax_tokens(model, b, mask, 2)
    assert torch.equal(got, probe._argmax_tokens(model, b, mask, 5))
    cu = b.cu_seqlens.tolist()
    with torch.no_grad():
        for s, e in zip(cu[:-1], cu[1:]):
            logits = reference(b.input_ids[s:e][None]).logits[0]
            want = logits.argmax(-1)[:-1]  # prediction for positions 1..L-1
            m = mask[s + 1 : e]
            assert torch.equal(got[s + 1 : e][m], want[m])
    assert bool((got[~mask] == 0).all())

    class Module:
        def __init__(self, kernels):
            self.model = model
            self.rollout_cfg = type("RolloutCfg", (), {"kernels": kernels})()

    assert probe._argmax_flip(Module("exact"), b) == 0.0  # same kernels: one forward serves both sides
    native = probe._argmax_flip(Module("native"), b)  # a second forward under the native kernels
    assert 0.0 <= native <= 1.0


def test_two_differently_configured_probes_attach_and_log(tmp_path):
    """Two ``MismatchProbe``s with different prefixes are distinct callbacks (state keys differ), both run, and each
    logs under its own prefix; two with the same settings are rejected by Lightning as duplicates."""
    a, b = MismatchProbe(), MismatchProbe(prefix="probe2", argmax=False, histograms=False)
    assert a.state_key != b.state_key
    trainer, _ = fit_rl([a, b], tmp_path, steps=1)
    assert a.last_metrics["mismatch/bitwise_equal_frac"] == 1.0
    assert b.last_metrics["probe2/bitwise_equal_frac"] == 1.0 and "probe2/argmax_flip_rate" not in b.last_metrics
    logged = set(trainer.callback_metrics)
    assert {"mismatch/bitwise_equal_frac", "probe2/bitwise_equal_frac"} <= logged
    with pytest.raises(RuntimeError, match="state_key"):
        fit_rl([MismatchProbe(), MismatchProbe()], tmp_path / "dup", steps=1)
