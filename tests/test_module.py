"""RLModule on CPU with a tiny Qwen3: exactness of the first mini-step, the old-log-prob modes with the exact and
native generators, loss integration, checkpoints, export and the bad-input errors."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from models import IMAGE_TEXT_TYPES, image_text_config, tiny_model, tiny_rl_config
from rlexact import algorithms as alg
from rlexact import sequence_logprobs
from rlexact.callbacks.base import RLCallback
from rlexact.char_tokenizer import build_char_tokenizer
from rlexact.config import AlgorithmConfig, RolloutConfig
from rlexact.data import ResumableDataLoader, ResumableSampler
from rlexact.module import RLModule
from rlexact.trainer.batching import batch_logprobs, chunks, seq_valid
from rlexact.trainer.update import PPOUpdate

TOK = build_char_tokenizer()


def tiny_config(max_pos: int = 64) -> dict:
    return tiny_rl_config(len(TOK), max_pos)


def length_reward(prompts, completions, answers):
    """Deterministic, varied rewards so GRPO groups have non-zero advantages."""
    return [float(len(c) % 3) + 0.25 * (c.count("1")) for c in completions]


def prompt_items(k: int = 4) -> list[dict]:
    texts = [f"{i}+{2 * i}=" for i in range(k)]
    return [
        {"prompt_ids": TOK(t)["input_ids"], "prompt_text": t, "answer": str(3 * i), "index": i}
        for i, t in enumerate(texts)
    ]


def loader(k: int = 4, batch_size: int = 2) -> DataLoader:
    """Items in order through rlexact's resumable loader (a resumed fit continues at the next unseen batch)."""
    sampler = ResumableSampler(k, shuffle=False)
    return ResumableDataLoader(prompt_items(k), batch_size=batch_size, sampler=sampler, collate_fn=list)


def make_module(
    dtype: str | None = "float32", rollout: dict | None = None, algorithm: dict | None = None, **kw
) -> RLModule:
    return RLModule(
        model_config=kw.pop("model_config", tiny_config()),
        tokenizer=TOK,
        reward=kw.pop("reward", length_reward),
        dtype=dtype,
        rollout={"n": 3, "max_new_tokens": 5, **(rollout or {})},
        algorithm=algorithm,
        optim=kw.pop("optim", {"lr": 1e-3}),
        **kw,
    )


class Recorder(Callback):
    """Keeps the logged metrics of every training step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


class Inspect(RLCallback):
    """Records bitwise comparisons of the log-prob tensors the module hands to RL callbacks."""

    needs_trainer_logprobs = True

    def __init__(self) -> None:
        self.trainer_eq_rollout: list[bool] = []
        self.first_eq_old: list[bool] = []
        self.first_eq_rollout: list[bool] = []
        self.first_ratio_one_all: list[bool] = []
        self.calls: list[str] = []

    def on_rl_batch(self, trainer, pl_module, batch) -> None:
        self.calls.append("batch")
        m = batch.response_mask
        assert torch.equal(batch.loss_mask, batch.response_mask)
        assert torch.equal(batch.token_weights, torch.ones_like(batch.token_weights))
        self.trainer_eq_rollout.append(torch.equal(batch.trainer_logprobs[m], batch.rollout_logprobs[m]))

    def on_rl_minibatch(self, trainer, pl_module, minibatch, logprobs, epoch, step) -> None:
        self.calls.append(f"mini{epoch}.{step}")
        assert not logprobs.requires_grad
        if epoch == 0 and step == 0:
            m = minibatch.response_mask
            self.first_eq_old.append(torch.equal(logprobs[m], minibatch.old_logprobs[m]))
            self.first_eq_rollout.append(torch.equal(logprobs[m], minibatch.rollout_logprobs[m]))
            ratio = torch.exp(logprobs[m] - minibatch.old_logprobs[m])
            self.first_ratio_one_all.append(bool((ratio == 1.0).all()))

    def on_rl_update_end(self, trainer, pl_module, batch) -> None:
        self.calls.append("end")


def fit(module: RLModule, steps: int, callbacks: list | None = None, data: DataLoader | None = None, **kw):
    rec = Recorder()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator=kw.pop("accelerator", "cpu"),
        logger=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*(callbacks or []), rec],
        **kw,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*val_dataloader.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        trainer.fit(module, data if data is not None else loader())
    return trainer, rec


# ---------------------------------------------------------------------------------------------------------------------
# exactness
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "precision"), [("float32", "32-true"), ("bfloat16", "32-true"), (None, "bf16-true")]
)  # bf16-true with no dtype asked for: the Trainer converts the model (with another dtype asked for it is refused)
def test_exact_mode_first_ministep_ratio_is_one(dtype: str | None, precision: str) -> None:
    module = make_module(dtype, algorithm={"old_logprob_mode": "exact", "clip_low": 0.2, "clip_high": 0.28})
    probe = Inspect()
    trainer, rec = fit(module, 2, [probe], precision=precision)
    assert module.model.dtype == (torch.bfloat16 if precision == "bf16-true" else getattr(torch, dtype))
    assert module.model.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE tables stay fp32
    assert probe.trainer_eq_rollout == [True, True]  # trainer forward == rollout, bitwise
    assert probe.first_eq_old == [True, True]  # train-mode forward with grad == pi_old (the rollout), bitwise
    assert probe.first_ratio_one_all == [True, True]
    for m in rec.steps:  # one mini-step per rollout: the logged ratio stats are the first mini-step's
        assert m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0 and m["ratio/mean"] == 1.0
        assert m["clipfrac"] == 0.0
        assert m["clipfrac/pos"] == 0.0 and m["clipfrac/neg"] == 0.0
    assert probe.calls == ["batch", "mini0.0", "end"] * 2
    assert module.rollout_step == 2 and trainer.global_step == 2


@pytest.mark.parametrize(
    "model_type",
    ["llama", "mistral", "ministral3", "mistral3", "olmo2", "olmo3", "phi3", "smollm3", "granite", "gemma3_text",
     "gemma3"],
)  # fmt: skip
def test_exact_first_ministep_per_architecture(model_type: str) -> None:
    """The exact first mini-step (trainer == rollout, ratio exactly 1) for the dense architectures besides Qwen3,
    built from ``model_config`` (bf16; the backward of OLMo-2's whole-projection q/k norms included). ``gemma3``,
    ``mistral3``: the image-text models (Gemma 3 4B and up; Ministral 3, Mistral Small 3.x), trained on their text
    decoders."""
    text_type = IMAGE_TEXT_TYPES.get(model_type, model_type)
    cfg = tiny_config() | {"model_type": text_type}
    if text_type in ("olmo2", "olmo3", "phi3", "smollm3"):  # default special-token ids past the tiny vocabulary
        cfg |= {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if text_type == "smollm3":
        cfg |= {"no_rope_layer_interval": 2}  # its second layer without rotary
    if text_type == "granite":  # the scaled branches and logits
        cfg |= {"embedding_multiplier": 6.0, "attention_multiplier": 0.3, "residual_multiplier": 0.5,
                "logits_scaling": 4.0}  # fmt: skip
    if text_type in ("gemma3_text", "olmo3"):  # a sliding-window layer shorter than the sequences, then a full one
        cfg |= {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    if text_type == "gemma3_text":
        cfg |= {"query_pre_attn_scalar": cfg["head_dim"]}
    if text_type == "ministral3":  # queries scaled by position past every 4 tokens
        cfg |= {"rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10_000.0, "factor": cfg["max_position_embeddings"] / 4,
            "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.1}}  # fmt: skip
    if model_type != text_type:
        cfg = image_text_config(model_type, cfg)
    module = make_module("bfloat16", model_config=cfg, algorithm={"old_logprob_mode": "exact"})
    probe = Inspect()
    fit(module, 2, [probe])
    assert module.model.config.model_type == model_type
    assert probe.trainer_eq_rollout == [True, True] and probe.first_ratio_one_all == [True, True]


def test_exact_first_ministep_past_a_sliding_window() -> None:
    """A Mistral whose 4-token window is shorter than its sequences (prompts of 4+ tokens, 8 new ones): the exact
    first mini-step holds through RLModule (the trainer's forward and backward mask by the window as the rollout's
    decode does); the negative control is the native generator, whose rollout differs from the trainer."""
    cfg = tiny_config() | {"model_type": "mistral", "sliding_window": 4}
    module = make_module("bfloat16", model_config=cfg, rollout={"max_new_tokens": 8},
                         algorithm={"old_logprob_mode": "exact"})  # fmt: skip
    probe = Inspect()
    fit(module, 2, [probe])
    assert module.model.config.sliding_window == 4
    assert probe.trainer_eq_rollout == [True, True] and probe.first_ratio_one_all == [True, True]
    native = make_module("bfloat16", model_config=cfg, rollout={"kernels": "native", "max_new_tokens": 8},
                         algorithm={"old_logprob_mode": "recompute"})  # fmt: skip
    probe = Inspect()
    fit(native, 2, [probe])
    assert probe.trainer_eq_rollout == [False, False]


def test_recompute_native_bf16_is_not_exact() -> None:
    """Negative control: the native generator in bf16 disagrees with the trainer somewhere."""
    module = make_module(
        "bfloat16",
        rollout={"kernels": "native", "n": 4, "max_new_tokens": 8},
        algorithm={"old_logprob_mode": "recompute"},
    )
    probe = Inspect()
    fit(module, 2, [probe])
    assert probe.trainer_eq_rollout == [False, False]
    # recompute: pi_old is the trainer's own forward, so the first ratio to pi_old is 1 ...
    assert probe.first_eq_old == [True, True]
    # ... but the ratio to the behaviour policy (what bypass would use) is not exactly 1
    assert probe.first_eq_rollout == [False, False]


def test_bypass_native_bf16_first_ratio_not_one() -> None:
    module = make_module(
        "bfloat16", rollout={"kernels": "native", "n": 4, "max_new_tokens": 8}, algorithm={"old_logprob_mode": "bypass"}
    )
    probe = Inspect()
    _, rec = fit(module, 1, [probe])
    assert probe.first_ratio_one_all == [False]
    m = rec.steps[0]
    assert (m["ratio/min"], m["ratio/max"]) != (1.0, 1.0)


@pytest.mark.parametrize(
    ("mode", "kernels"),
    [("exact", "exact"), ("recompute", "exact"), ("recompute", "native"), ("bypass", "exact"), ("bypass", "native")],
)
def test_short_runs_per_mode(mode: str, kernels: str) -> None:
    module = make_module(
        rollout={"kernels": kernels},
        algorithm={
            "old_logprob_mode": mode,
            "ppo_epochs": 2,
            "mini_batch_size": 3,
            "objective": "dapo",
            "clip_high": 0.28,
        },
    )
    module.configure_model()
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer, rec = fit(module, 4)
    # 2 prompts x 3 samples = 6 sequences -> 2 mini-batches x 2 epochs = 4 optimizer steps per rollout step
    assert module.rollout_step == 1 and trainer.global_step == 4
    m = rec.steps[-1]
    for key in (
        "reward/mean",
        "loss",
        "grad_norm",
        "entropy",
        "ratio/mean",
        "clipfrac/pos",
        "clipfrac/neg",
        "response_length/mean",
        "response_length/max",
        "rollout/tokens_per_s",
        "rollout/prompt_tokens",
        "rollout/prefill_tokens",
        "rollout/shared_prompt_tokens",
        "rollout/prefix_cached_tokens",
        "rollout/decode_shared_prefix_keys",
        "rollout/preemptions",
        "rollout_step",
    ):
        assert key in m and math.isfinite(m[key]), key
    # the 3 samples of each prompt share its prompt blocks: requested 3x, prefilled about once
    assert m["rollout/shared_prompt_tokens"] > 0
    assert m["rollout/prefill_tokens"] < m["rollout/prompt_tokens"]
    assert m["update/optimizer_steps"] == 4.0
    after = module.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_reinforce_one_update_per_rollout() -> None:
    module = make_module(algorithm={"objective": "reinforce"})
    assert module.algo.estimator == "reinforce"
    probe = Inspect()
    trainer, rec = fit(module, 2, [probe])
    assert module.rollout_step == 2 and trainer.global_step == 2
    assert probe.first_eq_old == [True, True]
    assert all(m["update/optimizer_steps"] == 1.0 for m in rec.steps)


def test_kl_and_entropy_terms() -> None:
    module = make_module(algorithm={"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01})
    module.configure_model()
    assert module.ref_model is not None
    assert all(not p.requires_grad for p in module.ref_model.parameters())
    assert "ref_model" not in dict(module.named_children())
    _, rec = fit(module, 2)
    # the reference is the initial policy: at the first step the KL is exactly 0 (exact kernels, same weights)
    assert rec.steps[0]["loss/kl"] == 0.0
    assert rec.steps[1]["loss/kl"] > 0.0
    assert all(math.isfinite(m["entropy"]) and m["entropy"] > 0 for m in rec.steps)


# ---------------------------------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------------------------------


def _rollout_batch(module: RLModule):
    items = prompt_items(2)
    prompts = module._check_prompts(items)
    comps = module.generate(prompts, module.sampling_params())
    rewards = module.compute_rewards(items, comps, module.rollout_cfg.n)
    groups = torch.tensor([c.prompt_index for c in comps])
    adv = module.compute_advantages(rewards, groups)
    return module.build_batch(comps, rewards, adv, groups), comps, rewards, adv


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_integrates_over_micro_batches(agg: str) -> None:
    """The mini-batch loss equals the sum of the micro-batch losses, and matches the formula at ratio 1."""
    module = make_module(rollout={"n": 4}, algorithm={"loss_agg_mode": agg, "micro_batch_size": 3})
    module.configure_model()
    batch, comps, rewards, adv = _rollout_batch(module)
    # the batch is built right: prompt+response packed, advantages on response tokens, rollout log-probs there
    assert batch.num_seqs == 8
    for i, c in enumerate(comps):
        s, e = batch.cu_seqlens[i].item(), batch.cu_seqlens[i + 1].item()
        assert batch.input_ids[s:e].tolist() == c.prompt_token_ids + c.token_ids
        assert batch.response_mask[s:e].sum().item() == len(c.token_ids)
        assert torch.equal(batch.rollout_logprobs[s:e][-len(c.token_ids) :], c.logprobs)
        assert torch.all(batch.advantages[s:e][batch.response_mask[s:e]] == adv[i])
    assert torch.equal(adv, alg.grpo_advantages(rewards, torch.tensor([0] * 4 + [1] * 4)))
    # weights multiply the per-token loss; unequal weights keep the GRPO advantages (zero-sum per group) from
    # cancelling to a zero loss, which would make the comparisons below vacuous
    n_resp = int(batch.response_mask.sum())
    batch.token_weights[batch.response_mask] = torch.linspace(0.25, 1.0, n_resp)

    update = PPOUpdate(module, None)
    tokens, seqs = int(batch.loss_mask.sum()), int(seq_valid(batch).sum())
    temp = module.logprob_temperature
    logp, ent = batch_logprobs(module.model, batch, temp, with_entropy=True)
    whole = update.micro_loss(batch, logp, ent, tokens, seqs)
    parts = []
    for idx in chunks(batch.num_seqs, 3):
        micro = batch.select(idx)
        lp, en = batch_logprobs(module.model, micro, temp, with_entropy=True)
        parts.append(update.micro_loss(micro, lp, en, tokens, seqs))
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-7)
    # exact mode at the rollout weights: r = 1, so the clipped surrogate is -A per token, times its weight
    a, mask, w = batch.advantages, batch.loss_mask, batch.token_weights
    assert whole.abs() > 1e-3, "the test data must give a non-zero loss"
    lengths = alg.segment_sum(mask.float(), batch.seq_ids, batch.num_seqs)
    per_seq = alg.segment_sum(torch.where(mask, -a * w, 0.0), batch.seq_ids, batch.num_seqs)
    expected = {
        "token-mean": per_seq.sum() / mask.sum(),
        "seq-mean-token-sum": per_seq.mean(),
        "seq-mean-token-mean": (per_seq / lengths).mean(),
        "seq-mean-token-sum-norm": (per_seq / module.rollout_cfg.max_new_tokens).mean(),
    }[agg]
    torch.testing.assert_close(whole.detach(), expected, rtol=1e-5, atol=1e-6)


def test_token_weights_and_masks_from_callbacks() -> None:
    """A callback that rejects every token makes the module skip the optimizer step with a warning."""

    class RejectAll(RLCallback):
        def on_rl_minibatch(self, trainer, pl_module, minibatch, logprobs, epoch, step) -> None:
            minibatch.loss_mask &= False

    module = make_module()
    with pytest.warns(UserWarning, match="no token left in the loss"):
        trainer, rec = fit(module, 1, [RejectAll()], max_epochs=1, limit_train_batches=1)
    assert trainer.global_step == 0 and module.rollout_step == 1
    assert rec.steps[0]["update/skipped_steps"] == 1.0
    assert all(p.grad is None for p in module.model.parameters())


def test_dynamic_sampling_drops_constant_groups() -> None:
    module = make_module(reward=lambda p, c, a: [1.0] * len(c), algorithm={"dynamic_sampling": True})
    with pytest.warns(UserWarning, match="dynamic sampling dropped every group"):
        trainer, rec = fit(module, 5, max_epochs=1, limit_train_batches=1)
    assert trainer.global_step == 0 and module.rollout_step == 1
    assert rec.steps[0]["dynamic_sampling/kept_frac"] == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# checkpoints and export
# ---------------------------------------------------------------------------------------------------------------------


class Counter(Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_train_batch_end(self, *args) -> None:
        self.calls += 1

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


@pytest.mark.filterwarnings("error:.*dataloader is not resumable")
def test_resume_from_lightning_checkpoint(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    module = make_module(optim={"lr": 1e-3, "warmup_steps": 10})
    fit(module, 2, [ckpt, Counter()], enable_checkpointing=True, data=loader(8))
    path = tmp_path / "last.ckpt"
    assert path.exists()
    saved = torch.load(path, weights_only=True)
    assert saved["rlexact"]["rollout_step"] == 2
    assert "ref_model" not in "".join(saved["state_dict"])

    resumed = make_module(optim={"lr": 1e-3, "warmup_steps": 10})
    counter = Counter()
    seen: list[int] = []

    class StepSpy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append(pl_module.rollout_step)

    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[counter, StepSpy()],
    )
    trainer.fit(resumed, loader(8), ckpt_path=path)
    assert seen == [2, 3]  # the rollout counter continues
    assert resumed.rollout_step == 4 and trainer.global_step == 4
    assert counter.calls == 4  # callback state restored (2 before + 2 after)
    opt = trainer.optimizers[0]
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {4}  # AdamW state continued from the checkpoint
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 4
    assert math.isclose(opt.param_groups[0]["lr"], 1e-3 * 5 / 10, rel_tol=1e-6)


def test_save_pretrained_roundtrip(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlexact import exactify, is_exactified
    from rlexact.export import save_pretrained

    module = make_module("bfloat16")
    fit(module, 1)
    out = save_pretrained(module, tmp_path / "hf", tokenizer=TOK)
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert "rlexact" not in json.dumps(cfg)
    assert is_exactified(module.model) and module.model.config._attn_implementation == "rlexact"

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config._attn_implementation != "rlexact"
    assert reloaded.dtype == torch.bfloat16
    a, b = module.model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    exactify(reloaded)
    seqs = [
        c.prompt_token_ids + c.token_ids
        for c in module.generate(module._check_prompts(prompt_items(2)), module.sampling_params())
    ]
    lp_a = sequence_logprobs(module.model, seqs)
    lp_b = sequence_logprobs(reloaded, seqs)
    assert all(torch.equal(x, y) for x, y in zip(lp_a, lp_b))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("1+2=")["input_ids"] == TOK("1+2=")["input_ids"]


# ---------------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------------


def test_nan_reward_names_the_sample() -> None:
    module = make_module(reward=lambda p, c, a: [0.0, 1.0, float("nan"), 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="sample 2 is not finite"):
        fit(module, 1)


def test_inf_reward_names_the_sample() -> None:
    module = make_module(reward=lambda p, c, a: [0.0] * 4 + [float("inf"), 1.0])
    with pytest.raises(ValueError, match="sample 4 is not finite"):
        fit(module, 1)


def two_rewards(prompts: list[str], completions: list[str], answers: list) -> list[float]:
    return [1.0, 0.0]


def test_reward_count_mismatch() -> None:
    """The error names the reward and the batch (in this process, where the reward gets the whole batch)."""
    module = make_module(reward=two_rewards, reward_config={"workers": 0})
    match = r"reward two_rewards returned unusable rewards for 2 prompts x 3 samples: got 2 rewards for 6 samples"
    with pytest.raises(ValueError, match=match):
        fit(module, 1)


def test_grpo_with_one_sample_per_prompt() -> None:
    with pytest.raises(ValueError, match="GRPO advantages need n >= 2"):
        make_module(rollout={"n": 1})
    with pytest.raises(ValueError, match="RLOO advantages need n >= 2"):
        make_module(rollout={"n": 1}, algorithm={"estimator": "rloo"})
    make_module(rollout={"n": 1}, algorithm={"objective": "reinforce"})  # fine: batch whitening


def test_prompt_longer_than_context() -> None:
    module = make_module(model_config=tiny_config(max_pos=16), rollout={"max_new_tokens": 8})
    long = "1234567890+1="
    items = [{"prompt_ids": TOK(long)["input_ids"], "prompt_text": long, "answer": None, "index": 7}]
    with pytest.raises(ValueError, match=r"prompt 0 \(dataset index 7\) has 13 tokens.*context of 16"):
        fit(module, 1, data=DataLoader(items, batch_size=1, collate_fn=list))


def test_empty_inputs() -> None:
    module = make_module()
    module.configure_model()
    with pytest.raises(ValueError, match="empty batch"):
        module.training_step([], 0)


def test_empty_dataset() -> None:
    pytest.importorskip("datasets")
    from rlexact.data import PromptDataModule

    with pytest.raises(ValueError, match="is empty"):
        PromptDataModule([], tokenizer=TOK).setup("fit")


def test_config_validation() -> None:
    from rlexact.config import OptimConfig

    with pytest.raises(ValueError, match="old_logprob_mode='exact' needs rollout.kernels='exact'"):
        make_module(rollout={"kernels": "native"})
    with pytest.raises(ValueError, match="objective must be one of"):
        AlgorithmConfig(objective="sac")
    with pytest.raises(ValueError, match="ppo_epochs must be 1"):
        AlgorithmConfig(objective="reinforce", ppo_epochs=2)
    with pytest.raises(ValueError, match="clip_low must be in"):
        AlgorithmConfig(clip_low=1.5)
    with pytest.raises(ValueError, match=r"micro_batch_size \(8\) exceeds mini_batch_size \(4\)"):
        AlgorithmConfig(mini_batch_size=4, micro_batch_size=8)
    AlgorithmConfig(mini_batch_size=4, micro_batch_size=4)
    AlgorithmConfig(micro_batch_size=8)
    with pytest.raises(ValueError, match="temperature"):
        RolloutConfig(temperature=0.0)
    with pytest.raises(ValueError, match="unknown rollout.generator keys"):
        RolloutConfig(generator={"bogus": 1})
    with pytest.raises(ValueError, match="betas"):
        OptimConfig(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match=r"optim.betas must be two numbers in \[0, 1\), e.g. \[0.9, 0.95\]; got 0.9$"):
        OptimConfig(betas=0.9)
    assert OptimConfig(betas=[0.9, 0.95]).betas == (0.9, 0.95)
    for ids, message in (([2.7], r"stop_token_ids\[0\] must be a non-negative integer token id, got 2.7"),
                         ("<|im_end|>", "stop_token_ids is text, not token ids"),
                         (3, r"must be a list of token ids, got 3; for one write \[3\]")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            RolloutConfig(stop_token_ids=ids)
    assert RolloutConfig(stop_token_ids=(torch.tensor(4), 5)).stop_token_ids == [4, 5]
    with pytest.raises(ValueError, match="unknown AlgorithmConfig keys"):
        make_module(algorithm={"clip_hgih": 0.3})
    with pytest.raises(FileNotFoundError, match="model_path '/no/such/ckpt' does not exist"):
        RLModule("/no/such/ckpt", reward=length_reward)
    with pytest.raises(ValueError, match=r"exactly one of model_path, .*load_from_checkpoint\(path, model=model\)"):
        RLModule(tokenizer=TOK, reward=length_reward)
    with pytest.raises(ValueError, match="unknown reward"):
        make_module(reward="no-such-reward")


def test_unsupported_strategies_are_rejected() -> None:
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

    from rlexact.trainer.policy import check_strategy

    for ok in (SingleDeviceStrategy(device=torch.device("cpu")), DDPStrategy()):  # negative controls
        check_strategy(ok)
    # DeepSpeed needs its package to be built; the check reads its class only
    for strategy in (FSDPStrategy(), object.__new__(DeepSpeedStrategy)):
        with pytest.raises(ValueError, match=f"strategy={type(strategy).__name__}.*ModelParallelStrategy"):
            check_strategy(strategy)
    # spawned workers hand back only the weights that exist before configure_model: the trained model was lost
    for start, name in (("spawn", "ddp_spawn"), ("fork", "ddp_notebook"), ("forkserver", "ddp_forkserver")):
        with pytest.raises(ValueError, match=f"strategy='{name}'.*would be lost; use strategy='ddp'"):
            check_strategy(DDPStrategy(start_method=start))


def test_fsdp_settings_without_model_parallel_strategy_are_refused() -> None:
    """A non-default ``fsdp`` under a strategy that ignores it (a bf16 param_dtype would train in fp32) raises
    in setup, before any step; the defaults pass (control)."""
    module = make_module(fsdp={"param_dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"RLModule\(fsdp=FSDPConfig\(param_dtype='bfloat16'.*ModelParallelStrategy"):
        fit(module, 1)
    assert module.rollout_step == 0
    fit(make_module(fsdp={}), 1)


def test_autocast_precision_is_rejected() -> None:
    module = make_module()
    with pytest.raises(ValueError, match="autocast"):
        fit(module, 1, precision="bf16-mixed")


@pytest.mark.parametrize(
    ("option", "fix"),
    [
        ({"gradient_clip_val": 0.5}, r"OptimConfig\(grad_clip=0.5\)"),
        ({"accumulate_grad_batches": 2}, "micro_batch_size"),
    ],
)
def test_trainer_clipping_and_accumulation_name_the_module_setting(option: dict, fix: str) -> None:
    """Lightning's own error for these options tells a manual-optimization module to switch to automatic
    optimization; RLModule's names its own setting. Negative control: the defaults and a zero clip pass."""
    from types import SimpleNamespace

    from rlexact.trainer.policy import check_trainer_options

    with pytest.raises(ValueError, match=fix):
        fit(make_module(), 1, **option)
    check_trainer_options(SimpleNamespace(gradient_clip_val=None, accumulate_grad_batches=1))
    check_trainer_options(SimpleNamespace(gradient_clip_val=0.0, accumulate_grad_batches=1))


def test_minibatch_mismatch_names_the_optimizer_steps() -> None:
    from rlexact.trainer.data_checks import minibatch_mismatch

    assert minibatch_mismatch(8, None) is None
    assert minibatch_mismatch(8, 4) is None
    assert minibatch_mismatch(8, 8) is None
    assert "3 optimizer steps of 3, 3, 2 sequences" in minibatch_mismatch(8, 3)
    assert "every optimizer step takes all 8" in minibatch_mismatch(8, 64)


@pytest.mark.parametrize(("mini", "warned"), [(3, True), (4, False)])
def test_fit_warns_when_mini_batches_do_not_tile_the_rollout(mini: int, warned: bool) -> None:
    """A datamodule's ``batch_size`` x ``rollout.n`` sequences per rollout step against ``mini_batch_size``; the
    divisible setting is the negative control."""
    from rlexact import PromptDataModule
    from rlexact.demo.run import checkpoint_path

    path = checkpoint_path()
    module = RLModule(
        model_path=path,
        reward="arithmetic",
        rollout=RolloutConfig(n=2, max_new_tokens=2),
        algorithm=AlgorithmConfig(mini_batch_size=mini),
    )
    data = PromptDataModule("rlexact://demo/data/train.jsonl", tokenizer=path, batch_size=4)
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    messages = [str(w.message) for w in caught if "does not divide the 8 sequences" in str(w.message)]
    assert bool(messages) == warned, messages


def test_model_object_and_path(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlexact import is_exactified

    cfg = tiny_config()
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    module = RLModule(model=hf, tokenizer=TOK, reward=length_reward, rollout={"n": 2, "max_new_tokens": 3})
    assert module.model is hf and is_exactified(hf)
    assert module.generator.model is hf  # the generator shares the module's model object
    hf.save_pretrained(tmp_path / "m")
    TOK.save_pretrained(tmp_path / "m")
    from_path = RLModule(str(tmp_path / "m"), reward=length_reward, rollout={"n": 2, "max_new_tokens": 3})
    assert from_path.model is None
    from_path.configure_model()
    assert is_exactified(from_path.model)
    assert from_path.tokenizer("1+1=")["input_ids"] == TOK("1+1=")["input_ids"]
    sd = hf.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in from_path.model.state_dict().items())


def test_image_text_checkpoint_loads_from_path(tmp_path: Path) -> None:
    """A saved Mistral 3 image-text checkpoint (which ``AutoModelForCausalLM`` does not map) loads through
    ``model_path`` as that model, exactified on its text decoder, with every weight as saved."""
    from rlexact import is_exactified

    saved = tiny_model("mistral3_vl", vocab=len(TOK))
    saved.save_pretrained(tmp_path / "m")
    TOK.save_pretrained(tmp_path / "m")
    module = RLModule(str(tmp_path / "m"), reward=length_reward, rollout={"n": 2, "max_new_tokens": 3})
    module.configure_model()
    assert type(module.model) is type(saved) and is_exactified(module.model)
    sd = saved.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in module.model.state_dict().items())


def test_validation_between_training_steps() -> None:
    """Validation (under Lightning's inference mode) between rollout steps must not break later training steps."""
    module = make_module()
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=1,
        num_sanity_val_steps=0,
        limit_val_batches=1,
    )
    trainer.fit(module, loader(), val_dataloaders=loader(2))
    assert module.rollout_step == 2 and trainer.global_step == 2
    assert "val/reward" in trainer.callback_metrics


# ---------------------------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): the same invariants through the Triton kernels, single device and FSDP2 (1 rank)
# ---------------------------------------------------------------------------------------------------------------------


def gpu_config() -> dict:
    return {
        **tiny_config(max_pos=128),
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
    }


@pytest.mark.gpu
@pytest.mark.parametrize("setup", ["bf16", "fsdp-bf16-mixed"])
def test_gpu_exact_first_ministep(setup: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    kw: dict = {"accelerator": "gpu", "devices": 1}
    if setup == "fsdp-bf16-mixed":
        module = make_module(
            "float32",
            model_config=gpu_config(),
            rollout={"n": 4, "max_new_tokens": 24},
            fsdp={"param_dtype": "bfloat16"},
            algorithm={"micro_batch_size": 3},
        )
        kw["strategy"] = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    else:
        module = make_module("bfloat16", model_config=gpu_config(), rollout={"n": 4, "max_new_tokens": 24})
    probe = Inspect()
    _, rec = fit(module, 3, [probe], data=loader(8, 4), **kw)
    assert probe.trainer_eq_rollout == [True] * 3
    assert probe.first_eq_old == [True] * 3
    for m in rec.steps:
        assert m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0 and m["clipfrac"] == 0.0


@pytest.mark.gpu
def test_gpu_native_recompute_is_not_exact() -> None:
    module = make_module(
        "bfloat16",
        model_config=gpu_config(),
        rollout={"kernels": "native", "n": 4, "max_new_tokens": 24},
        algorithm={"old_logprob_mode": "recompute"},
    )
    probe = Inspect()
    fit(module, 2, [probe], data=loader(8, 4), accelerator="gpu", devices=1)
    assert probe.trainer_eq_rollout == [False, False]
    assert probe.first_eq_old == [True, True]
    assert probe.first_eq_rollout == [False, False]
