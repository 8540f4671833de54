"""Two-process FSDP2 run of RLModule on CPU (gloo), launched by tests/test_fsdp.py.

Lightning's ``ModelParallelStrategy`` supports CPU: its device mesh takes the root device's type ("cpu") and the
process group backend defaults to gloo for CPU devices; the strategy's subprocess launcher re-runs this script for
rank 1. Each rank generates for its own shard of the prompts. Every prompt at an odd dataset index gets a constant
reward, so with dynamic sampling rank 1 (which holds the odd indices) drops all of its groups and must keep its
collectives aligned with rank 0 through placeholder mini-batches.

Checks on every rank, written to ``<out>/rank<r>.json``:
  - rollout log-probs == trainer log-probs bitwise (``batch.trainer_logprobs`` through the sharded model),
  - first mini-step of each rollout: current log-probs == old log-probs bitwise (ratio exactly 1),
  - after the update: the generator's scoring path == the trainer path bitwise (fresh weights),
  - the parameters are identical on both ranks after training (gathered full state dict hash),
and rank 0 exports a transformers checkpoint with ``rlexact.export.save_pretrained``.

Usage: python tests/_fsdp_worker.py OUT_DIR [float32|bfloat16|bf16-mixed] [exact|recompute|bypass]
[dense|moe|mixtral|gemma3] (``moe``: the tiny model is a Qwen3-MoE with 8 experts, top-2, and a dense second layer;
``mixtral``: a Mixtral of 8 experts, top-2, every layer sparse; ``gemma3``: a Gemma 3 whose first layer's sliding
window is shorter than the sequences)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from models import image_text_config, tiny_moe_rl_config, tiny_rl_config
from rlexact.callbacks.base import RLCallback
from rlexact.char_tokenizer import build_char_tokenizer
from rlexact.export import save_pretrained
from rlexact.module import RLModule

# Lightning's notices about this setup (no validation loader; a deprecated pytree check inside Lightning): every other
# warning, the library's included, reaches the output the calling test prints on failure
warnings.filterwarnings("ignore", message=".*val_dataloader.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class Check(RLCallback):
    needs_trainer_logprobs = True

    def __init__(self) -> None:
        self.rollout_equal: list[bool] = []
        self.first_ratio_one: list[bool] = []
        self.post_update_equal: list[bool] = []
        self.batch_sizes: list[int] = []
        self.loss_tokens: list[int] = []

    def on_rl_batch(self, trainer, pl_module, batch) -> None:
        m = batch.response_mask
        self.rollout_equal.append(torch.equal(batch.trainer_logprobs[m], batch.rollout_logprobs[m]))
        self.batch_sizes.append(batch.num_seqs)
        self.loss_tokens.append(int(batch.loss_mask.sum()))

    def on_rl_minibatch(self, trainer, pl_module, minibatch, logprobs, epoch, step) -> None:
        if epoch == 0 and step == 0:
            m = minibatch.response_mask
            self.first_ratio_one.append(torch.equal(logprobs[m], minibatch.old_logprobs[m]))

    def on_rl_update_end(self, trainer, pl_module, batch) -> None:
        seqs = [batch.input_ids[s:e].tolist() for s, e in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])]
        gen = pl_module.generator.score(seqs, pl_module.logprob_temperature)
        trainer_lp = pl_module.score_batch(batch)
        ok = True
        for i, (s, e) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())):
            resp = batch.response_mask[s + 1 : e]  # the trainer scores response tokens (prompt entries are 0)
            ok &= bool(resp.any()) and torch.equal(gen[i].to(trainer_lp.device)[resp], trainer_lp[s + 1 : e][resp])
        self.post_update_equal.append(bool(ok))


def reward(prompts, completions, answers):
    return [0.0 if p.startswith("const") else float(len(c) % 3) for p, c in zip(prompts, completions)]


def main() -> None:
    out = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    mode = sys.argv[3] if len(sys.argv) > 3 else "exact"
    tok = build_char_tokenizer()
    kind = sys.argv[4] if len(sys.argv) > 4 else "dense"
    if kind not in ("dense", "moe", "mixtral", "gemma3", "gemma3_vl"):
        raise ValueError(f"model kind must be dense, moe, mixtral, gemma3 or gemma3_vl, got {kind!r}")
    if kind in ("dense", "gemma3", "gemma3_vl"):
        cfg = tiny_rl_config(len(tok))
        if kind != "dense":
            cfg |= {"model_type": "gemma3_text", "sliding_window": 4, "query_pre_attn_scalar": cfg["head_dim"],
                    "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
        if kind == "gemma3_vl":  # the same text decoder in the image-text model (Gemma 3 4B and up)
            cfg = image_text_config("gemma3", cfg)
    else:
        cfg = tiny_moe_rl_config(len(tok), arch="mixtral" if kind == "mixtral" else "qwen3_moe")
    texts = [("const " if i % 2 else "") + f"{i}+{i}=" for i in range(8)]
    data = [
        {"prompt_ids": tok(t)["input_ids"], "prompt_text": t, "answer": None, "index": i} for i, t in enumerate(texts)
    ]
    fsdp = None
    if dtype == "bf16-mixed":  # fp32 sharded master weights, bf16 gathered parameters for compute
        dtype, fsdp = "float32", dict(param_dtype="bfloat16", reduce_dtype="float32")
    module = RLModule(
        model_config=cfg,
        tokenizer=tok,
        reward=reward,
        dtype=dtype,
        fsdp=fsdp,
        rollout=dict(n=3, max_new_tokens=6, seed=1),
        algorithm=dict(
            old_logprob_mode=mode,
            mini_batch_size=4,
            micro_batch_size=2,
            ppo_epochs=2,
            dynamic_sampling=True,
        ),
        optim=dict(lr=1e-3),
    )
    check = Check()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=6,
        callbacks=[check],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=2, collate_fn=list))
    rank = trainer.global_rank
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for k in sorted(full):
        h.update(k.encode())
        h.update(full[k].float().numpy().tobytes())
    export_dir = os.path.join(out, "export")
    save_pretrained(module, export_dir)
    if rank == 0:
        torch.save(full, os.path.join(out, "full_state.pt"))
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "rollout_equal": check.rollout_equal,
        "first_ratio_one": check.first_ratio_one,
        "post_update_equal": check.post_update_equal,
        "batch_sizes": check.batch_sizes,
        "loss_tokens": check.loss_tokens,
        "rollout_step": module.rollout_step,
        "global_step": trainer.global_step,
        "param_hash": h.hexdigest(),
        "is_fsdp": type(module.model).__name__.startswith("FSDP"),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
