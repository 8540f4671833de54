"""Two rollout steps of RLModule on two CPU ranks under Lightning's ``DDPStrategy`` (gloo), for tests/test_ddp.py.

Each rank writes ``<out>/rank<r>.pt``: its parameters after the run, the dataset rows it sampled at each rollout
step, how far its parameters moved, and the gradient all-reduces: the buckets DDP reduced, each with the number of
times (a mini-batch of four micro-batches reduces once). ``sync=False`` is the negative control: a communication hook
returns each rank's own gradients instead of reducing them, so each rank steps on its own.

Usage: ``python tests/_ddp_worker.py OUT_DIR sync|nosync`` (Lightning's launcher re-runs the script for rank 1).
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _world_size_worker import NUM_PROMPTS, reward, rows  # noqa: E402
from models import tiny_rl_config  # noqa: E402
from rlexact import PromptDataModule, RLModule  # noqa: E402
from rlexact.callbacks.base import RLCallback  # noqa: E402
from rlexact.char_tokenizer import build_char_tokenizer  # noqa: E402


class Record(RLCallback):
    """The dataset rows each rank samples, its parameters at the start and at the end, optionally without the DDP
    gradient synchronization."""

    gathers_params = False

    def __init__(self, out_dir: str, sync: bool) -> None:
        self.out_dir, self.sync = out_dir, sync
        self.rows: list[list[int]] = []
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        self.reduces: dict[int, int] = {}

        def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects the string annotations of this module
            self.reduces[bucket.index()] = self.reduces.get(bucket.index(), 0) + 1
            if self.sync:
                return default_hooks.allreduce_hook(None, bucket)
            local: torch.futures.Future = torch.futures.Future()
            local.set_result(bucket.buffer())
            return local

        trainer.strategy.model.register_comm_hook(None, hook)

    def on_rl_batch(self, trainer, pl_module, batch) -> None:
        ds = trainer.datamodule.train_dataset
        row_of = {tuple(ds.prompt_ids[k]): ds.indices[k] for k in range(len(ds))}
        bounds = batch.cu_seqlens.tolist()
        prompts = [batch.input_ids[s:e][~batch.response_mask[s:e]] for s, e in zip(bounds[:-1], bounds[1:])]
        self.rows.append(sorted({row_of[tuple(p.tolist())] for p in prompts}))

    def on_train_end(self, trainer, pl_module) -> None:
        end = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        moved = max((end[k].double() - self.start[k].double()).abs().max().item() for k in end)
        record = {"params": end, "rows": self.rows, "moved": moved, "reduces": self.reduces}
        torch.save(record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def run(out_dir: str, sync: bool) -> None:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    module = RLModule(
        model_config=tiny_rl_config(len(build_char_tokenizer())),
        tokenizer="demo-char",
        reward=reward,
        reward_config={"workers": 0},
        rollout={"n": 2, "max_new_tokens": 6, "seed": 5},
        algorithm={"objective": "grpo", "micro_batch_size": 2},  # 8 sequences per rank: four micro-batches
        optim={"lr": 1e-2, "warmup_steps": 0},
    )
    data = PromptDataModule(rows(), tokenizer="demo-char", batch_size=NUM_PROMPTS // 2, seed=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
        callbacks=[Record(out_dir, sync)],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    run(sys.argv[1], {"sync": True, "nosync": False}[sys.argv[2]])
