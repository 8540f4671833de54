"""Sample prompts and completions as TensorBoard text, with each completion's reward and advantage.

:class:`SampleLogger` is on by default: :meth:`rlexact.RLModule.configure_callbacks` adds one (every 10 rollout steps,
4 samples) unless the trainer already has a ``SampleLogger``; pass ``SampleLogger(every_n_steps=0)`` to turn it off.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from rlexact.batch import RolloutBatch
from rlexact.callbacks.aggregation import logging_step, tensorboard_experiments
from rlexact.callbacks.base import RLCallback
from rlexact.checks import integer, positive_int

__all__ = ["SampleLogger"]


def _cell(text: str) -> str:
    """A markdown table cell: pipes escaped, newlines shown as ``⏎``."""
    return text.replace("|", "\\|").replace("\n", "⏎")


class SampleLogger(RLCallback):
    """Every ``every_n_steps`` rollout steps (the first included), write the first ``num_samples`` sequences of the
    step on rank 0 as a markdown table (prompt, completion, reward, advantage) to the text tab ``samples`` of every
    TensorBoard logger, at the same step as the scalars.

    Args:
        every_n_steps: rollout-step interval; 0 turns the logger off.
        num_samples: sequences per table (in batch order: the first prompts' samples).
        max_chars: longer prompts / completions are cut to their last ``max_chars`` characters (prompt) and first
            ``max_chars`` characters (completion).
    """

    gathers_params = False
    """It runs no forward: its hook does not make the module gather FSDP2-sharded parameters."""

    reads_logprobs = False
    """It reads text, rewards and advantages only, so it may come before a MismatchInjection."""

    def __init__(self, every_n_steps: int = 10, num_samples: int = 4, max_chars: int = 500) -> None:
        who = type(self).__name__
        integer(f"{who}: every_n_steps", every_n_steps, low=0)
        positive_int(f"{who}: num_samples", num_samples)
        positive_int(f"{who}: max_chars", max_chars)
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.max_chars = max_chars

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return ("samples",)

    def table(self, tokenizer: Any, batch: RolloutBatch) -> str:
        """The markdown table of the first ``num_samples`` sequences of ``batch``."""
        cu = batch.cu_seqlens.tolist()
        rows = ["| prompt | completion | reward | advantage |", "|---|---|---|---|"]
        for i in range(min(self.num_samples, batch.num_seqs)):
            ids = batch.input_ids[cu[i] : cu[i + 1]].tolist()
            resp = batch.response_mask[cu[i] : cu[i + 1]].tolist()
            prompt = tokenizer.decode([t for t, r in zip(ids, resp) if not r])[-self.max_chars :]
            completion = tokenizer.decode([t for t, r in zip(ids, resp) if r])[: self.max_chars]
            reward = float(batch.rewards[i])
            advantage = float(batch.seq_advantages[i])
            rows.append(f"| {_cell(prompt)} | {_cell(completion)} | {reward:.4g} | {advantage:.4g} |")
        return "\n".join(rows)

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        if self.every_n_steps == 0 or trainer.global_rank != 0 or pl_module.rollout_step % self.every_n_steps:
            return
        writers = tensorboard_experiments(trainer)
        if not writers:
            return
        text = self.table(pl_module.tokenizer, batch)
        step = logging_step(trainer)
        for writer in writers:
            writer.add_text("samples", text, global_step=step)
