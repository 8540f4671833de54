"""Run-to-run reproducibility on the GPU: two same-seed RL runs of a small Qwen3-shaped bf16 model (random init from
a config, 3 layers) end with bitwise-equal weights; a different rollout seed ends with other weights.

Each run is 3 rollout steps of RLModule (2 optimizer steps of 2 micro-batches each per rollout step) on one CUDA
device, in this process, through the exact Triton path: every exact op resolves to the ``"triton"`` backend (checked
by a spy on :func:`rlexact.ops.resolve_backend`), the sampler is the fused Triton one (``RLEXACT_SAMPLER`` unset)
and the rollout log-probs equal the trainer's bitwise at every step. The CPU counterpart (same-seed runs, in-process
and in a new process) is ``tests/test_resume.py::test_same_seed_runs_are_bitwise_equal``.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import pytest
import torch

import rlexact.ops
from rlexact import PromptDataModule, RLModule
from rlexact.callbacks.base import RLCallback
from rlexact.char_tokenizer import build_char_tokenizer

STEPS = 3  # rollout steps per run
OPT_STEPS_PER_ROLLOUT = 2  # 4 prompts x 4 samples = 16 sequences, mini-batches of 8


def qwen3_config(vocab_size: int) -> dict:
    """A small Qwen3-shaped config (GQA 8/4 heads, head_dim 64, untied embeddings, Qwen3's RoPE theta and eps)."""
    return dict(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def varied_reward(prompts: list[str], completions: list[str], answers: list) -> list[float]:
    """Rewards that differ within groups, so every step moves the weights."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


class RolloutEqualsTrainer(RLCallback):
    """Per rollout step: rollout log-probs == trainer log-probs bitwise (the exact contract on this device)."""

    needs_trainer_logprobs = True

    def __init__(self) -> None:
        self.equal: list[bool] = []

    def on_rl_batch(self, trainer, pl_module, batch) -> None:
        m = batch.response_mask
        self.equal.append(torch.equal(batch.trainer_logprobs[m], batch.rollout_logprobs[m]))


def train(seed: int, accelerator: str) -> tuple[dict[str, torch.Tensor], set[str], list[bool]]:
    """One run: ``(final weights on the CPU, backends the exact ops resolved to, rollout == trainer per step)``."""
    backends: set[str] = set()
    resolve: Callable = rlexact.ops.resolve_backend

    def spy(t: torch.Tensor, backend: str | None) -> str:
        out = resolve(t, backend)
        backends.add(out)
        return out

    tok = build_char_tokenizer()
    module = RLModule(
        model_config=qwen3_config(len(tok)),
        tokenizer="demo-char",
        reward=varied_reward,
        reward_config={"workers": 0},
        dtype="bfloat16",
        init_seed=0,
        rollout={"n": 4, "max_new_tokens": 24, "seed": seed, "top_p": 0.95, "logprobs": "sampled"},
        algorithm={"objective": "grpo", "mini_batch_size": 8, "micro_batch_size": 4},
        optim={"lr": 1e-3},
    )
    rows = [{"prompt": f"{i}*{2 * i + 3}=", "answer": str(i * (2 * i + 3))} for i in range(8)]
    data = PromptDataModule(rows, tokenizer="demo-char", batch_size=4, seed=1)
    check = RolloutEqualsTrainer()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=STEPS * OPT_STEPS_PER_ROLLOUT,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[check],
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rlexact.ops, "resolve_backend", spy)
        trainer.fit(module, datamodule=data)
    assert module.rollout_step == STEPS
    assert {p.dtype for p in module.model.parameters()} == {torch.bfloat16}
    weights = {k: v.detach().cpu().clone() for k, v in module.model.state_dict().items()}
    return weights, backends, check.equal


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
def test_gpu_same_seed_runs_end_bitwise_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLEXACT_SAMPLER", raising=False)  # the fused Triton sampler
    first, backends, exact = train(7, "gpu")
    assert backends == {"triton"}  # every exact op ran its Triton kernel
    assert exact == [True] * STEPS
    second, _, _ = train(7, "gpu")
    assert bitwise_equal(first, second)
    # negative control: another rollout seed samples other tokens and ends with other weights
    other, _, _ = train(8, "gpu")
    assert not bitwise_equal(first, other)
