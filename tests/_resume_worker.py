"""One tiny CPU RL run for tests/test_resume.py: train to ``steps`` rollout steps (optionally resuming from a
checkpoint), checkpoint every step, and write the prompt indices consumed per step and the final weights.

Run in-process (:func:`run`) or as a new process: ``python tests/_resume_worker.py '<json kwargs>'``. With
``"ranks": 2`` it is an FSDP2 run on 2 CPU processes (gloo, ``ModelParallelStrategy``; Lightning's launcher re-runs
this script for rank 1): checkpoints are ``torch.distributed.checkpoint`` folders, each rank records its own
prompts (``result_rank<r>.json``) and rank 0 writes the gathered full weights.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import tiny_rl_config  # noqa: E402
from rlexact import PromptDataModule, RLModule  # noqa: E402
from rlexact.char_tokenizer import build_char_tokenizer  # noqa: E402

NUM_PROMPTS = 8
BATCH_SIZE = 2  # 4 batches per epoch: 6 steps cross an epoch boundary


def varied_reward(prompts: list[str], completions: list[str], answers: list) -> list[float]:
    """Deterministic rewards that differ within groups, so every step changes the weights."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def rows() -> list[dict[str, str]]:
    """Distinct prompts, so the consumed order identifies the data position."""
    return [{"prompt": f"{i}+{2 * i + 1}=", "answer": str(3 * i + 1)} for i in range(NUM_PROMPTS)]


class Consumed(Callback):
    """The dataset row indices of every training batch, in order."""

    def __init__(self) -> None:
        self.indices: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.indices.append([int(item["index"]) for item in batch])


def run(out_dir: str, steps: int, resume: str | None = None, ranks: int = 1) -> dict:
    """Train to ``steps`` rollout steps; returns ``{"consumed", "weights", "rollout_step"}`` (``weights`` is a file
    holding the final full state dict)."""
    torch.set_num_threads(1)
    strategy: Any = "auto"
    if ranks > 1:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    module = RLModule(
        model_config=tiny_rl_config(len(build_char_tokenizer())),
        tokenizer="demo-char",
        reward="_resume_worker:varied_reward",
        rollout={"n": 2, "max_new_tokens": 3, "seed": 3},
        algorithm={"objective": "grpo", "mini_batch_size": 2},
        optim={"lr": 1e-2, "warmup_steps": 2},
    )
    data = PromptDataModule(rows(), tokenizer="demo-char", batch_size=BATCH_SIZE, seed=1)
    consumed = Consumed()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy=strategy,
        max_steps=steps * 2,  # 2 mini-batches of 2 sequences per rollout step: 2 optimizer steps each
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=2, save_top_k=-1),
            consumed,
        ],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        trainer.fit(module, datamodule=data, ckpt_path=resume)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    weights = os.path.join(out_dir, "weights.pt")
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, weights)
    return {
        "consumed": consumed.indices,
        "weights": weights,
        "rollout_step": int(module.rollout_step),
        "rank": trainer.global_rank,
    }


if __name__ == "__main__":
    kwargs = json.loads(sys.argv[1])
    result = run(**kwargs)
    name = "result.json" if kwargs.get("ranks", 1) == 1 else f"result_rank{result['rank']}.json"
    with open(os.path.join(kwargs["out_dir"], name), "w", encoding="utf-8") as f:
        json.dump(result, f)
