"""One rollout step of RLModule on ``D`` CPU ranks for tests/test_world_size.py: record every sampled sequence.

The 8 distinct prompts go through :class:`rlexact.PromptDataModule` (the library's :class:`ResumableSampler` shards
the global permutation over the ranks), 8 prompts per rollout step in all: one rank holds all 8, two ranks hold 4
each (``ModelParallelStrategy``, FSDP2 on gloo; Lightning's launcher re-runs this script for rank 1). An RL callback
records, for each sequence of the rollout batch, its dataset row, its sample number ``j`` within the row's group,
its slot (the prompt's position in this rank's batch), its response tokens and its rollout log-probs, and writes
them to ``<out>/rank<r>.pt`` as ``{"<row>:<j>": {"tokens", "logprobs", "slot", "rank"}}``.

``keyed=False`` removes the items' ``"index"`` in the loader's collate, so sampling falls back to slot ids and a
rank-mixed seed (:func:`rlexact.trainer.sampling.prompt_keys`): the negative control.

Usage: ``python tests/_world_size_worker.py OUT_DIR D keyed|unkeyed`` or :func:`run` in-process (``D=1``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import tiny_rl_config  # noqa: E402
from rlexact import PromptDataModule, RLModule  # noqa: E402
from rlexact.callbacks.base import RLCallback  # noqa: E402
from rlexact.char_tokenizer import build_char_tokenizer  # noqa: E402

NUM_PROMPTS = 8
SAMPLES = 2


def rows() -> list[dict[str, str]]:
    """Distinct prompts of different lengths (a prompt's tokens identify its row)."""
    return [{"prompt": f"{i}*{3 * i + 7}=" + "?" * (i % 3), "answer": str(i)} for i in range(NUM_PROMPTS)]


def reward(prompts: list[str], completions: list[str], answers: list) -> list[float]:
    """Rewards that vary within a group (the step runs a real update)."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


def drop_index(items: list[dict]) -> list[dict]:
    """Collate of the negative control: the items lose their dataset row ``index``."""
    return [{k: v for k, v in item.items() if k != "index"} for item in items]


class UnkeyedData(PromptDataModule):
    """The same sharded loader, but its batches' items carry no ``index`` (the negative control)."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        loader.collate_fn = drop_index
        return loader


class Record(RLCallback):
    """Each sequence of the rollout batch keyed by ``"<dataset row>:<sample j>"``."""

    gathers_params = False  # no forward here

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}

    def on_rl_batch(self, trainer, pl_module, batch) -> None:
        ds = trainer.datamodule.train_dataset
        row_of = {tuple(ds.prompt_ids[k]): ds.indices[k] for k in range(len(ds))}
        seen: dict[int, int] = {}
        bounds = batch.cu_seqlens.tolist()
        for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            resp = batch.response_mask[s:e]
            slot = int(batch.group_ids[b])
            j = seen.get(slot, 0)
            seen[slot] = j + 1
            row = row_of[tuple(batch.input_ids[s:e][~resp].tolist())]
            self.records[f"{row}:{j}"] = {
                "tokens": batch.input_ids[s:e][resp].clone(),
                "logprobs": batch.rollout_logprobs[s:e][resp].clone(),
                "slot": slot,
                "rank": trainer.global_rank,
            }


def run(out_dir: str, world: int, keyed: bool) -> dict[str, dict[str, Any]]:
    """One rollout step (one optimizer step) on ``world`` ranks; returns this rank's records (also saved)."""
    torch.set_num_threads(1)
    strategy: Any = "auto"
    if world == 2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif world != 1:
        raise ValueError(f"world must be 1 or 2, got {world}")
    module = RLModule(
        model_config=tiny_rl_config(len(build_char_tokenizer())),
        tokenizer="demo-char",
        reward=reward,
        reward_config={"workers": 0},
        rollout={"n": SAMPLES, "max_new_tokens": 6, "seed": 5, "top_p": 0.9, "logprobs": "sampled"},
        algorithm={"objective": "grpo"},
        optim={"lr": 1e-2},
    )
    data = (PromptDataModule if keyed else UnkeyedData)(
        rows(), tokenizer="demo-char", batch_size=NUM_PROMPTS // world, seed=2
    )
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=1,  # one mini-batch per rollout step: one rollout step
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
        callbacks=[record],
    )
    trainer.fit(module, datamodule=data)
    if module.rollout_step != 1:
        raise RuntimeError(f"expected one rollout step, ran {module.rollout_step}")
    os.makedirs(out_dir, exist_ok=True)
    torch.save(record.records, os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))
    return record.records


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), {"keyed": True, "unkeyed": False}[sys.argv[3]])
