"""The mismatch study (rlexact.study) and shadow mode (rlexact.callbacks.ShadowCorrection), on CPU.

- shadow mode against a direct float64 computation of each correction's gradient on the packaged demo model, and a
  correction with no mismatch giving cosine and norm ratio exactly 1 (negative control: a mismatch does not);
- the perturbed rollout engine (its generator reports the perturbed copy's log-probs bit for bit, the trainer's
  differ, the copy follows the optimizer);
- config validation;
- the CPU smoke run of every experiment (configs/study/smoke.yaml): one run of the harness, checked per experiment.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from rlexact.callbacks import RLCallback, ShadowCorrection
from rlexact.callbacks.shadow import SHADOW_CORRECTIONS, flat_grad, gradient_agreement
from rlexact.study.config import Arm, Scale, load_config, parse_engine, parse_shadow_source
from rlexact.study.engine import PerturbedCopy, perturb_weight, perturbed_parameter_names
from rlexact.study.runner import build_module

ROOT = Path(__file__).resolve().parents[1]
TINY = Scale(steps=1, prompts_per_step=4, n=4, mini_batches=2, eval_prompts=0, device="cpu", threads=1)


def _fit(arm: Arm, callbacks: list, scale: Scale = TINY, steps: int = 1, rollout: dict | None = None):
    """Train ``arm`` on the demo checkpoint for ``steps`` rollout steps (``rollout``: RolloutConfig fields to
    override) and return the module."""
    from dataclasses import replace

    from rlexact.data import PromptDataModule
    from rlexact.demo.run import checkpoint_path, demo_rows

    ckpt = checkpoint_path()
    module = build_module(arm, scale, ckpt)
    if rollout:
        module.rollout_cfg = replace(module.rollout_cfg, **rollout)
    data = PromptDataModule(
        demo_rows("train", 64, ckpt), tokenizer=ckpt, batch_size=scale.prompts_per_step, use_chat_template=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    return module


class _Snapshot(RLCallback):
    """Keeps the first mini-batch, the trainer's log-probs of it and the weights the shadow probe sees (placed before
    it in the list)."""

    def __init__(self) -> None:
        self.minibatch = None
        self.logprobs = None
        self.state = None

    def on_rl_minibatch(self, trainer, pl_module, minibatch, logprobs, epoch, step) -> None:
        if self.minibatch is None:
            self.minibatch = minibatch
            self.logprobs = logprobs.clone()
            self.state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


# ------------------------------------------------------------------------------------------------- shadow: pure
def test_gradient_agreement_is_exactly_one_for_equal_vectors_and_less_otherwise():
    g = torch.randn(10_001, generator=torch.Generator().manual_seed(0))
    same = gradient_agreement(g, g.clone())
    assert same == {"cosine": 1.0, "norm_ratio": 1.0}
    other = g.clone()
    other[5] += 1e-3  # negative control: one changed entry is visible
    agreement = gradient_agreement(other, g)
    assert agreement["cosine"] < 1.0 and agreement["norm_ratio"] != 1.0
    assert math.isclose(gradient_agreement(-g, g)["cosine"], -1.0, rel_tol=1e-12)
    assert math.isclose(gradient_agreement(2 * g, g)["norm_ratio"], 2.0, rel_tol=1e-12)
    assert gradient_agreement(torch.zeros(3), torch.zeros(3)) == {"cosine": 1.0, "norm_ratio": 1.0}
    assert gradient_agreement(torch.zeros(3), torch.ones(3)) == {"cosine": 0.0, "norm_ratio": 0.0}
    with pytest.raises(ValueError, match="1-D vectors of one shape"):
        gradient_agreement(torch.zeros(3), torch.zeros(4))
    p = [torch.zeros(2, 2), torch.zeros(3)]
    assert torch.equal(flat_grad([None, torch.ones(3)], p), torch.tensor([0.0, 0, 0, 0, 1, 1, 1]))


def test_shadow_arguments_are_validated():
    with pytest.raises(ValueError, match="unknown shadow correction 'nope'"):
        ShadowCorrection(corrections=["nope"])
    with pytest.raises(ValueError, match="mismatch must be"):
        ShadowCorrection(mismatch="weights")
    with pytest.raises(TypeError, match="must be a ShadowSpec"):
        ShadowCorrection(corrections={"x": "tis"})
    with pytest.raises(ValueError, match="every_n_steps"):
        ShadowCorrection(every_n_steps=0)


def test_shadow_mu_sources_on_a_packed_batch():
    from _callbacks_worker import make_batch
    from rlexact.callbacks.shadow import corrected_batch, shadow_spec

    batch = make_batch(seed=1, num_seqs=5)
    bad = ShadowCorrection(mismatch=lambda m, b: torch.zeros(3))
    with pytest.raises(ValueError, match=r"returned \(3,\), expected a \[\d+\] tensor"):
        bad.mismatched_logprobs(None, batch)
    inject = ShadowCorrection(mismatch="inject", scale=0.2, seed=5)
    a, b = inject.mismatched_logprobs(None, batch, key=1), inject.mismatched_logprobs(None, batch, key=1)
    assert torch.equal(a, b) and not torch.equal(a, inject.mismatched_logprobs(None, batch, key=2))  # keyed draws
    assert torch.equal(a[~batch.response_mask], batch.trainer_logprobs[~batch.response_mask])  # prompts untouched
    # a mini-batch (shuffled subset) gets the batch's mu of its own sequences
    inject.on_rl_batch(None, None, batch)
    mini = batch.select([3, 0])
    mu = inject._minibatch_mu(mini)
    assert mu.shape == (mini.num_tokens,)
    full = inject._mu
    assert torch.equal(mu[: int(mini.cu_seqlens[1])], full[int(batch.cu_seqlens[3]) : int(batch.cu_seqlens[4])])
    # corrected_batch: bypass sets pi_old = mu, recompute keeps pi_old^train, the input batch is not modified
    old = batch.old_logprobs.clone()
    by, _ = corrected_batch(shadow_spec("bypass"), batch, full)
    re, stats = corrected_batch(shadow_spec("srs-k3-corr-ratio"), batch, full)
    assert torch.equal(by.old_logprobs, full) and torch.equal(re.old_logprobs, batch.trainer_logprobs)
    assert torch.equal(batch.old_logprobs, old) and torch.equal(batch.loss_mask, batch.response_mask)
    assert stats["masked_frac"] == float((batch.response_mask & ~re.loss_mask).sum() / batch.response_mask.sum())


# ------------------------------------------------------------------------------------------- shadow: on a model
def test_shadow_without_mismatch_gives_cosine_exactly_one_and_with_mismatch_does_not():
    clean = ShadowCorrection(mismatch="inject", scale=0.0, prefix="clean")
    same = ShadowCorrection(mismatch=lambda m, b: b.trainer_logprobs.clone(), prefix="same")
    # an exact re-scoring source, probed on both mini-steps: mu must be taken at the rollout weights, not after the
    # first optimizer step (the second mini-step would then see the policy's movement as a mismatch)
    rescored = ShadowCorrection(mismatch=lambda m, b: m.score_batch(b), all_ministeps=True, prefix="rescored")
    noisy = ShadowCorrection(mismatch="inject", scale=0.5, prefix="noisy")
    _fit(Arm("exact"), [clean, same, rescored, noisy])
    assert [row["ministep"] for row in rescored.history] == [0.0, 1.0]
    for cb in (clean, same, rescored):
        for m in cb.history:
            assert m[f"{cb.prefix}/mismatch_k3_mean"] == 0.0
            for name in SHADOW_CORRECTIONS:
                if name == "srs-k3-ppo-ratio" and m["ministep"] > 0:
                    continue  # its signal pi_theta / mu also measures the policy's movement (below)
                assert m[f"{cb.prefix}/{name}/cosine"] == 1.0, name
                assert m[f"{cb.prefix}/{name}/norm_ratio"] == 1.0, name
                assert m[f"{cb.prefix}/{name}/masked_frac"] == 0.0, name
    # after the first optimizer step, r_ppo^rollout = pi_theta / pi_old != 1 without any mismatch: the ppo-ratio
    # rejection drops sequences for the policy's own movement, so it departs from the exact gradient
    later = rescored.history[1]
    assert later["rescored/srs-k3-ppo-ratio/masked_frac"] > 0.0 and later["rescored/srs-k3-ppo-ratio/cosine"] < 1.0
    m = noisy.last_metrics
    assert m["noisy/none/cosine"] == 1.0  # recompute without correction ignores the reported numbers
    assert m["noisy/tis/cosine"] < 1.0 and m["noisy/bypass/cosine"] < 1.0
    assert m["noisy/srs-k3-corr-ratio/masked_frac"] > 0.0


def test_shadow_uses_the_module_truncation_with_sampled_logprobs():
    """rollout.logprobs="sampled" with top-k / top-p: the trainer's log-probs are of the truncated distribution, so
    the shadow's must be too. Its exact gradient then is the module's (bitwise), and with no mismatch every correction
    gives cosine and norm ratio exactly 1. Negative controls: the full-softmax log-probs and gradient of the same
    mini-batch differ, and a mismatch moves the cosine."""
    from rlexact.callbacks.shadow import flat_grad, module_logprobs, policy_gradient_loss
    from rlexact.trainer.batching import batch_logprobs

    snap = _Snapshot()
    clean = ShadowCorrection(mismatch="inject", scale=0.0, prefix="clean")
    noisy = ShadowCorrection(mismatch="inject", scale=0.5, prefix="noisy")
    truncation = {"top_k": 4, "top_p": 0.99, "logprobs": "sampled"}
    module = _fit(Arm("exact"), [snap, clean, noisy], rollout=truncation)
    assert module.logprob_truncation == (4, 0.99)
    m = clean.history[0]
    assert m["clean/mismatch_k3_mean"] == 0.0
    for name in SHADOW_CORRECTIONS:
        assert m[f"clean/{name}/cosine"] == 1.0 and m[f"clean/{name}/norm_ratio"] == 1.0, name
        assert m[f"clean/{name}/masked_frac"] == 0.0 and m[f"clean/{name}/ppo_clipped_frac"] == 0.0, name
    assert noisy.history[0]["noisy/tis/cosine"] < 1.0

    module.model.load_state_dict(snap.state)  # the weights of the probed mini-step
    mb, resp = snap.minibatch, snap.minibatch.response_mask
    assert torch.equal(module_logprobs(module, module.model, mb), snap.logprobs)  # the trainer's log-probs, bitwise

    def exact_grad_norm(truncation: tuple[int, float]) -> tuple[float, torch.Tensor]:
        params = [p for p in module.model.parameters() if p.requires_grad]
        logp = batch_logprobs(module.model, mb, 1.0, with_entropy=False, truncation=truncation)[0]
        loss, _ = policy_gradient_loss(module, mb, logp)
        grad = flat_grad(torch.autograd.grad(loss, params, allow_unused=True), params)
        return float(grad.double().norm()), logp.detach()

    norm, logp = exact_grad_norm(module.logprob_truncation)
    assert m["clean/exact_grad_norm"] == norm  # the module's gradient, bitwise
    full_norm, full_logp = exact_grad_norm((0, 1.0))
    assert not torch.equal(full_logp[resp], logp[resp]) and full_norm != norm  # negative control: the full softmax


def _reference_logprobs(state: dict, batch) -> torch.Tensor:
    """float64 log-probs of the batch's tokens from a fresh (not exactified) copy of the demo model, one sequence
    at a time: an implementation independent of the packed exact path."""
    from transformers import AutoModelForCausalLM

    from rlexact.demo.run import checkpoint_path

    model = AutoModelForCausalLM.from_pretrained(checkpoint_path(), dtype=torch.float64)
    model.load_state_dict({k: v.double() for k, v in state.items()})
    out = torch.zeros(batch.num_tokens, dtype=torch.float64)
    cu = batch.cu_seqlens.tolist()
    parts = []
    for s, e in zip(cu[:-1], cu[1:]):
        ids = batch.input_ids[s:e].unsqueeze(0)
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        parts.append((s, logp.gather(-1, ids[0, 1:, None])[:, 0]))
    for s, lp in parts:
        out = out.index_put((torch.arange(s + 1, s + 1 + lp.numel()),), lp)
    return out, [p for p in model.parameters()]


def test_shadow_gradients_match_a_direct_float64_computation():
    names = ["tis", "bypass", "srs-k3-corr-ratio", "tis-srs-k1-corr-ratio"]
    snap = _Snapshot()
    shadow = ShadowCorrection(corrections=names, mismatch="inject", scale=0.08, seed=3)
    _fit(Arm("exact"), [snap, shadow])
    mb, mu = snap.minibatch, shadow.last_mismatched_logprobs.double()
    logp, params = _reference_logprobs(snap.state, mb)
    train = mb.trainer_logprobs.double()
    resp, adv = mb.response_mask, mb.advantages.double()
    seq = torch.repeat_interleave(torch.arange(mb.num_seqs), (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long())

    def grad(old, weights, keep):
        r = torch.exp(logp - old)
        tok = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
        loss = torch.where(keep, weights * tok, 0.0).sum() / keep.sum()
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])

    def keep_seqs(score_tok):
        score = torch.zeros(mb.num_seqs, dtype=torch.float64).index_add_(0, seq, torch.where(resp, score_tok, 0.0))
        return resp & (score <= 1e-3)[seq]

    ones = torch.ones_like(logp)
    ref = grad(train, ones, resp)
    log_r = train - mu
    tis_w = torch.exp(log_r).clamp(max=2.0)
    k3 = torch.expm1(log_r) - log_r
    direct = {
        "tis": grad(train, tis_w, resp),
        "bypass": grad(mu, ones, resp),
        "srs-k3-corr-ratio": grad(train, ones, keep_seqs(k3)),
        "tis-srs-k1-corr-ratio": grad(train, tis_w, keep_seqs(-log_r)),
    }
    m = shadow.last_metrics
    assert m["shadow/exact_grad_norm"] == pytest.approx(float(ref.norm()), rel=1e-4)
    for name, g in direct.items():
        cos = float(g @ ref / (g.norm() * ref.norm()))
        ratio = float(g.norm() / ref.norm())
        assert m[f"shadow/{name}/cosine"] == pytest.approx(cos, abs=1e-5), name
        assert m[f"shadow/{name}/norm_ratio"] == pytest.approx(ratio, rel=1e-4), name
    masked = float((resp & ~keep_seqs(k3)).sum() / resp.sum())
    assert 0.0 < masked < 1.0  # the rejection acts on some sequences but not all
    assert m["shadow/srs-k3-corr-ratio/masked_frac"] == pytest.approx(masked)
    assert m["shadow/tis/cosine"] < 1.0  # a real mismatch changes the gradient


# -------------------------------------------------------------------------------------------- perturbed engine
def test_perturb_weight_kinds():
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    assert torch.equal(perturb_weight(w, "bf16"), w.to(torch.bfloat16).float())
    q = perturb_weight(w, "fp8_e4m3")
    assert q.dtype == w.dtype and not torch.equal(q, w)
    assert float((q - w).abs().max()) <= float(w.abs().max()) / 448 * 16  # within the coarsest e4m3 step
    assert float(q.abs().max()) == pytest.approx(float(w.abs().max()), rel=1e-6)  # amax maps to the format max
    noise = torch.full_like(w, 0.01)
    assert torch.allclose(perturb_weight(w, "noise", noise), w * 1.01)
    assert torch.equal(perturb_weight(torch.zeros(3, 3), "fp8_e5m2"), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="unknown weight perturbation"):
        perturb_weight(w, "int4")
    with pytest.raises(ValueError, match="noise tensor"):
        perturb_weight(w, "noise")


def test_perturbed_engine_samples_from_the_copy_and_follows_the_optimizer():
    from rlexact.logprobs import sequence_logprobs

    def response(batch, values):
        """Response-token entries of a packed ``[T]`` tensor, or of per-sequence ``[L - 1]`` tensors."""
        cu = batch.cu_seqlens.tolist()
        if isinstance(values, torch.Tensor):
            return values[batch.response_mask]
        return torch.cat([lp[batch.response_mask[s + 1 : e]] for lp, s, e in zip(values, cu[:-1], cu[1:])])

    class Check(RLCallback):
        def __init__(self) -> None:
            self.rows = []

        def on_rl_batch(self, trainer, pl_module, batch) -> None:
            copy = pl_module.rollout_copy.model
            cu = batch.cu_seqlens.tolist()
            engine = sequence_logprobs(copy, [batch.input_ids[s:e] for s, e in zip(cu[:-1], cu[1:])])
            rollout = response(batch, batch.rollout_logprobs)
            self.rows.append(
                {
                    "engine_equal": torch.equal(response(batch, engine), rollout),
                    "trainer_equal": torch.equal(response(batch, batch.trainer_logprobs), rollout),
                    "copy": {k: v.clone() for k, v in copy.state_dict().items()},
                }
            )

    check = Check()
    module = _fit(Arm("fp8", mode="recompute", engine="fp8_e4m3"), [check], steps=2)
    assert all(r["engine_equal"] for r in check.rows)  # the reported log-probs are the copy's, bit for bit
    assert not any(r["trainer_equal"] for r in check.rows)  # negative control: not the trainer's
    name = sorted(perturbed_parameter_names(module.model, "fp8_e4m3"))[0]
    assert not torch.equal(check.rows[0]["copy"][name], check.rows[1]["copy"][name])  # re-synced after the step
    synced = module.rollout_copy.sync().state_dict()[name]
    assert torch.equal(synced, perturb_weight(module.model.state_dict()[name], "fp8_e4m3"))
    assert module.rollout_copy.weight_rel_diff > 0


def test_perturbed_copy_parameters_and_errors():
    from transformers import AutoModelForCausalLM

    from rlexact.demo.run import checkpoint_path
    from rlexact.study.engine import PerturbedRolloutModule

    model = AutoModelForCausalLM.from_pretrained(checkpoint_path())
    names = perturbed_parameter_names(model, "fp8_e4m3")
    assert names and all(n.endswith(".weight") for n in names)
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names  # tied LM head kept
    assert not any("norm" in n for n in names)
    copy = PerturbedCopy(model, "noise", 0.05, seed=1)
    a = {k: v.clone() for k, v in copy.sync().state_dict().items()}
    b = copy.sync().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the noise is fixed per element
    assert copy.weight_rel_diff == pytest.approx(0.05, rel=0.1)
    with pytest.raises(ValueError, match="finite scale > 0"):
        PerturbedCopy(model, "noise", 0.0)
    with pytest.raises(ValueError, match="'recompute' or 'bypass'"):
        PerturbedRolloutModule(model=model, tokenizer="demo-char", rollout_weights="bf16")


# ------------------------------------------------------------------------------------------ start checkpoint
def test_sft_batched_encoding_and_device_option():
    from rlexact.char_tokenizer import build_char_tokenizer
    from rlexact.demo import sft
    from rlexact.demo.task import ArithmeticTask

    tok = build_char_tokenizer()
    rows = ArithmeticTask(max_operand=999, ops=("+", "-")).generate(64)
    assert sft.encode_examples(tok, rows) == [sft.encode_example(tok, r["prompt"], r["answer"]) for r in rows]
    assert sft.encode_examples(tok, []) == []
    assert sft.SFTConfig().device == "cpu" and sft.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        sft.SFTConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device is visible; use --device cpu or auto"):
            sft.resolve_device("cuda")
        assert sft.resolve_device("auto") == torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- config
def test_config_validation(tmp_path):
    assert parse_engine("noise:0.1") == ("noise", 0.1) and parse_engine("bf16") == ("bf16", 0.0)
    assert parse_shadow_source("engine:fp8_e5m2") == ("engine", "fp8_e5m2", 0.0)
    assert parse_shadow_source("inject:0.2") == ("inject", None, 0.2)
    for bad, match in (("noise", "noise:<std>"), ("bf16:1", "only 'noise'"), ("int4", "unknown engine")):
        with pytest.raises(ValueError, match=match):
            parse_engine(bad)
    with pytest.raises(ValueError, match="mode 'exact' needs exact kernels"):
        Arm("x", kernels="native")
    with pytest.raises(ValueError, match="shadow mode calibrates"):
        Arm("x", mode="recompute", engine="bf16", shadow=("native",))
    with pytest.raises(ValueError, match="correction must be one of"):
        Arm("x", correction="icepop")
    assert Arm("a", engine=None).key() == Arm("b").key() != Arm("a", seed=1).key()
    with pytest.raises(ValueError, match="mini_batches=3 must divide"):
        Scale(prompts_per_step=4, n=4, mini_batches=3)
    path = tmp_path / "s.yaml"
    path.write_text("scale: {steps: 3, stepz: 1}\n")
    with pytest.raises(ValueError, match=r"unknown keys \['stepz'\]"):
        load_config(path)
    path.write_text("experiments: {grpo: {engine: bf16}}\n")
    from rlexact.study.experiments import experiment_arms

    with pytest.raises(ValueError, match=r"experiments.grpo: unknown keys \['engine'\]"):
        experiment_arms(load_config(path), "grpo")
    with pytest.raises(ValueError, match="unknown experiment 'fig9'"):
        experiment_arms(load_config(None), "fig9")
    for name in ("cpu.yaml", "h200.yaml", "smoke.yaml"):
        load_config(ROOT / "configs" / "study" / name)


# ------------------------------------------------------------------------------------------ runner: scheduling
def test_run_arms_reports_every_run_and_survives_failures(tmp_path):
    from rlexact.study.runner import FailedRuns, run_arms, run_threads

    arms = [Arm("exact", objective="reinforce"), Arm("exact bf16", objective="reinforce", dtype="bfloat16")]
    scale = Scale(steps=1, prompts_per_step=2, n=2, mini_batches=1, eval_prompts=0, device="cpu", threads=1)
    seen: list[int] = []
    results = run_arms(
        [(a, 1) for a in arms], scale, tmp_path, log=lambda m: None, on_result=lambda r: seen.append(len(r))
    )
    assert seen == [1, 2] and set(results) == {(a.key(), 0) for a in arms}  # called after every finished run
    seen.clear()
    cached = run_arms([(a, 1) for a in arms], scale, tmp_path, log=lambda m: None, on_result=seen.append)
    assert seen == [] and all(cached[k]["history"] == results[k]["history"] for k in results)  # cached: none ran
    bad = Scale(**{**scale.__dict__, "checkpoint": str(tmp_path / "missing")})
    logged: list[str] = []
    with pytest.raises(FailedRuns, match="2 run") as info:
        run_arms([(a, 1) for a in arms], bad, tmp_path / "other", log=logged.append)
    assert [arm.label for arm, _ in info.value.failures] == ["exact", "exact bf16"]  # every run was tried
    assert info.value.results == {} and "FileNotFoundError" in info.value.failures[0][1]
    assert sum("FAILED" in line for line in logged) == 2
    assert run_threads(Scale(threads=3, workers=4)) == 3 and run_threads(Scale(threads=0, workers=10_000)) == 1


# -------------------------------------------------------------------------------------------- CPU smoke study
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from rlexact.study.__main__ import run_study

    tmp = tmp_path_factory.mktemp("study")
    doc = run_study(
        ["all"],
        str(ROOT / "configs" / "study" / "smoke.yaml"),
        json_path=str(tmp / "study_cpu.json"),
        out=str(tmp / "runs"),
        docs=str(tmp / "report"),
    )
    return doc, tmp


def _arms(doc, name):
    return {a["label"]: a for a in doc["experiments"][name]["arms"]}


def test_smoke_result_file_and_report(smoke):
    doc, tmp = smoke
    on_disk = json.loads((tmp / "study_cpu.json").read_text())
    assert on_disk["experiments"].keys() == doc["experiments"].keys()
    assert set(doc["experiments"]) == {"reinforce", "grpo", "c_ratio", "misalignment", "corrections", "shadow"}
    for key in ("command", "commit", "date", "device", "versions"):
        assert key in doc and key in doc["experiments"]["grpo"], key
    assert doc["command"].startswith(("python", "pytest")) or doc["command"]
    from rlexact.study.report import fill_page

    page = tmp / "page.md"
    stale = "STALE-TABLE"  # matches nothing the report writes (the command line holds the interpreter's path)
    page.write_text(
        f"intro\n<!-- study:grpo -->\n{stale}\n<!-- /study:grpo -->\n<!-- study:nope -->\nkeep\n<!-- /study:nope -->\n"
    )
    assert fill_page(doc, page) == ["grpo"]
    text = page.read_text()
    assert stale not in text and "| arm | reward_first5 |" in text and "keep" in text and text.startswith("intro\n")
    tables = (tmp / "report" / "tables.md").read_text()
    assert "### corrections" in tables and "Shadow source `shadow_inject`" in tables
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not list((tmp / "report").glob("*.png"))
    else:
        assert {p.stem for p in (tmp / "report").glob("*.png")} == set(doc["experiments"])


@pytest.mark.parametrize("name", ["reinforce", "grpo", "c_ratio", "misalignment", "corrections"])
def test_smoke_exact_arms_are_exact_and_mismatched_arms_are_not(smoke, name):
    doc, _ = smoke
    for label, arm in _arms(doc, name).items():
        m = arm["metrics"]
        exact = arm["arm"]["kernels"] == "exact" and arm["arm"]["engine"] is None
        if exact:
            assert m["bitwise_equal_frac"] == 1.0 and m["k3_mean"] == 0.0, label
            assert m["sign_disagreement_frac"] == 0.0, label  # engine and trainer move every token alike
        else:
            assert m["bitwise_equal_frac"] < 1.0 and m["k3_mean"] > 0.0, label
        assert m["reward_first5"] is not None and m["grad_norm_mean"] > 0, label


def test_smoke_c_ratio_coincides_only_when_exact(smoke):
    doc, _ = smoke
    for label, arm in _arms(doc, "c_ratio").items():
        m = arm["metrics"]
        same = m["c_ppo_train_pos"] == m["c_ppo_rollout_pos"] and m["c_ppo_train_neg"] == m["c_ppo_rollout_neg"]
        assert same == (arm["arm"]["kernels"] == "exact" and arm["arm"]["engine"] is None), label


def test_smoke_partial_results_are_summarized_and_reported(smoke):
    """A study cut short: the runs it finished are summarized, the missing ones listed, no findings."""
    from rlexact.study.experiments import experiment_arms, summarize
    from rlexact.study.report import experiment_markdown
    from rlexact.study.runner import load_result

    doc, tmp = smoke
    cfg = load_config(ROOT / "configs" / "study" / "smoke.yaml")
    arms, steps, _ = experiment_arms(cfg, "corrections")
    results = {(a.key(), a.seed): load_result(tmp / "runs", a, steps) for a in arms}
    header = {k: doc["experiments"]["corrections"][k] for k in ("command", "commit", "date")}
    full = summarize(cfg, "corrections", results, header)
    assert full["complete"] and full["missing_runs"] == [] and full["findings"] is not None
    dropped = next(a for a in arms if a.correction == "tis")
    del results[(dropped.key(), dropped.seed)]
    part = summarize(cfg, "corrections", results, header)
    assert not part["complete"] and part["missing_runs"] == [{"label": "tis", "seed": 0}]
    assert part["findings"] is None and [a["label"] for a in part["arms"]] == [
        a["label"] for a in full["arms"] if a["label"] != "tis"
    ]
    assert part["arms"][0]["metrics"] == full["arms"][0]["metrics"]  # the finished runs are summarized as before
    text = experiment_markdown("corrections", part)
    assert "**Incomplete:** 1 run(s) did not finish: tis (seed 0)." in text and "Ranked by" not in text


def test_study_gpu_script_runs_the_chain_on_cpu(tmp_path):
    """scripts/study_gpu.sh with CPU overrides: SFT, one experiment, and its four outputs (no checkpoint packed)."""
    import os
    import subprocess
    import tarfile

    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "STUDY_CONFIG": "configs/study/smoke.yaml",
        "STUDY_EXPERIMENTS": "shadow",
        "STUDY_ARGS": "--device cpu",
        "STUDY_RUNS": str(tmp_path / "runs"),
        "STUDY_JSON": str(tmp_path / "study.json"),
        "STUDY_DOCS": str(tmp_path / "docs"),
        "SFT_OUT": str(tmp_path / "ckpt"),
        "SFT_DEVICE": "cpu",
        "SFT_ARGS": "--steps 2 --batch-size 4 --hidden-size 32 --num-layers 1 --num-heads 2 --num-kv-heads 1 "
        "--head-dim 16 --intermediate-size 48 --eval-size 4",
        "RLEXACT_COMMIT": "0123abc",
    }
    proc = subprocess.run(["bash", "scripts/study_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    out = tmp_path / "out"
    assert proc.returncode == 0, (out / "study_gpu.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == [
        "study_gpu.log",
        "study_gpu_summary.txt",
        "study_h200.json",
        "study_h200_runs.tgz",
    ]
    doc = json.loads((out / "study_h200.json").read_text())
    assert doc["commit"] == "0123abc" and doc["experiments"]["shadow"]["complete"]
    assert "shadow: complete" in (out / "study_gpu_summary.txt").read_text()
    with tarfile.open(out / "study_h200_runs.tgz") as tar:
        names = tar.getnames()
    assert any("events.out.tfevents" in n for n in names) and any(n.endswith("sft.json") for n in names)
    assert any(n.endswith("tables.md") for n in names) and not any(n.endswith(".safetensors") for n in names)


def test_smoke_corrections_and_shadow(smoke):
    doc, _ = smoke
    ranked = doc["experiments"]["corrections"]["findings"]["ranking_by_reward_curve_distance"]
    assert {r["label"] for r in ranked} == {"no correction", "tis", *SHADOW_CORRECTIONS} - {"none", "bypass"}
    shadow = _arms(doc, "shadow")["exact fp32"]["shadow"]
    assert set(shadow) == {"shadow_inject", "shadow_engine_fp8_e4m3", "shadow_native"}
    for stats in shadow.values():
        assert stats["none/cosine"] == 1.0 and stats["probes"] >= 1
        assert "tis-srs-k3-corr-ratio@0.01/cosine" in stats  # the threshold calibration knob
    assert shadow["shadow_inject"]["tis/cosine"] < 1.0


def test_study_command_reports_bad_arguments_in_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """Usage errors (exit 2, one line, no traceback, nothing run): an unknown experiment, 'report' with names, a
    missing config or result JSON, and a 0 that was dropped as if not given; a packaged config resolves by its name
    from any directory (control: it reaches the step check)."""
    from rlexact.study.__main__ import main
    from rlexact.study.config import study_config_file

    cases = {
        ("nosuch",): "unknown experiment 'nosuch'",
        ("report", "grpo"): "'report' stands alone",
        ("grpo", "--config", str(tmp_path / "missing.yaml")): "study config .*missing.yaml' not found .*smoke.yaml",
        ("report", "--json", str(tmp_path / "missing.json")): "no result JSON",
        ("misalignment", "--config", "smoke.yaml", "--steps", "0"): r"scale.steps must be >= 1, got 0",
        ("misalignment", "--workers", "0"): r"workers",
    }
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err, (argv, err)
        assert re.search(message, err.splitlines()[-1]), (argv, err)
    packaged = Path(study_config_file("study/smoke")).resolve()
    assert packaged == Path(study_config_file("configs/study/smoke.yaml")).resolve() and packaged.is_file()
