"""Helpers shared by tests/test_callbacks.py, and its two-process workers (kept free of pytest imports so the
processes start quickly).

- ``python tests/_callbacks_worker.py RANK OUT`` (``MASTER_ADDR`` / ``MASTER_PORT`` set): joins a 2-rank gloo group,
  reduces known per-rank statistics with :class:`rlexact.callbacks.MetricReducer`, gathers tensors with
  ``gather_cat``, runs ``TruncatedIS`` and ``MismatchProbe`` on this rank's half of a batch, saves the results.
- ``python tests/_callbacks_worker.py fsdp OUT``: ``rlexact.RLModule`` under Lightning's ``ModelParallelStrategy``
  (FSDP2, 2 CPU ranks, gloo; the strategy re-launches this script for rank 1) with the exact engine and the RL
  callbacks; writes every callback's last metrics and the local response-token counts to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import sys

import torch

from models import tiny_rl_config
from rlexact.batch import RolloutBatch


def make_batch(
    seed: int = 0,
    num_seqs: int = 6,
    prompt_len: int = 3,
    max_resp: int = 7,
    mismatch: float = 0.0,
) -> RolloutBatch:
    """A packed batch of ``num_seqs`` sequences (prompt + response), random log-probs; trainer log-probs equal the
    rollout ones bitwise when ``mismatch == 0`` (exact mode: the module sets old = rollout)."""
    g = torch.Generator().manual_seed(seed)
    resp_lens = torch.randint(2, max_resp + 1, (num_seqs,), generator=g)
    lens = resp_lens + prompt_len
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    t = int(cu[-1])
    ids = torch.randint(0, 50, (t,), generator=g)
    pos = torch.cat([torch.arange(int(n)) for n in lens])
    resp = pos >= prompt_len
    rollout = torch.where(resp, -torch.rand(t, generator=g) * 3 - 0.01, 0.0)
    trainer = rollout.clone()
    if mismatch:
        trainer = torch.where(resp, rollout + mismatch * torch.randn(t, generator=g), 0.0).clamp(max=0.0)
    seq_adv = torch.randn(num_seqs, generator=g)
    seq_adv[0] = 0.0
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lens)
    adv = torch.where(resp, seq_adv[seq_ids], 0.0)
    return RolloutBatch(
        input_ids=ids,
        position_ids=pos,
        cu_seqlens=cu,
        response_mask=resp,
        rollout_logprobs=rollout,
        old_logprobs=rollout.clone(),
        advantages=adv,
        token_weights=torch.ones(t),
        loss_mask=resp.clone(),
        rewards=torch.randn(num_seqs, generator=g),
        group_ids=torch.arange(num_seqs) // 2,
        seq_advantages=seq_adv,
        trainer_logprobs=trainer,
    )


def main(rank: int, out: str) -> None:
    import torch.distributed as dist

    from rlexact.callbacks import MetricReducer, MismatchProbe, TruncatedIS, gather_cat

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        red = MetricReducer()
        # rank 0: 1 token with mean 1.0; rank 1: 3 tokens with mean 3.0 -> global mean 2.5 (not (1 + 3) / 2)
        red.add_mean("mean", [1.0, 3.0][rank], [1, 3][rank])
        red.add_mean("empty_on_0", [0.0, 4.0][rank], [0, 2][rank])
        red.add_max("max", [5.0, None][rank])
        red.add_min("min", [None, -2.0][rank], empty=9.0)
        red.add_sum("sum", rank + 1)
        values = red.reduce()
        gathered = gather_cat(torch.arange(rank + 2, dtype=torch.float32) + 10 * rank)
        half = make_batch(seed=11, mismatch=0.2).select(list(range(rank * 3, rank * 3 + 3)))
        tis = TruncatedIS(cap=1.1)
        tis.on_rl_batch(None, None, half)
        probe = MismatchProbe(argmax=False)
        probe.on_rl_batch(None, None, half)
        torch.save({"values": values, "gathered": gathered, "tis": tis.last_metrics, "probe": probe.last_metrics}, out)
    finally:
        dist.destroy_process_group()


def fsdp_main(out: str) -> None:
    import json
    import os

    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from rlexact.callbacks import (
        ExactnessGuard,
        MismatchProbe,
        RejectionSampling,
        RLCallback,
        TruncatedIS,
        UpdateDirectionProbe,
    )
    from rlexact.char_tokenizer import build_char_tokenizer
    from rlexact.module import RLModule

    class LocalTokens(RLCallback):
        def __init__(self) -> None:
            self.counts: list[int] = []

        def on_rl_batch(self, trainer, pl_module, batch) -> None:
            self.counts.append(int(batch.response_mask.sum()))

    tok = build_char_tokenizer()
    cfg = tiny_rl_config(len(tok))
    texts = [f"{i}+{i}=" for i in range(8)]
    data = [
        {"prompt_ids": tok(t)["input_ids"], "prompt_text": t, "answer": None, "index": i} for i, t in enumerate(texts)
    ]
    module = RLModule(
        model_config=cfg,
        tokenizer=tok,
        reward=lambda prompts, completions, answers: [float(sum(map(ord, c)) % 7) for c in completions],
        rollout=dict(n=3, max_new_tokens=6, seed=1),
        algorithm=dict(mini_batch_size=4, ppo_epochs=2),
        optim=dict(lr=1e-4),
    )
    local = LocalTokens()
    cbs = [TruncatedIS(), RejectionSampling(), MismatchProbe(), UpdateDirectionProbe(), ExactnessGuard(), local]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=1,
        limit_train_batches=2,
        callbacks=cbs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2, collate_fn=list))
    result = {type(c).__name__: c.last_metrics for c in cbs if hasattr(c, "last_metrics")}
    result["local_tokens"] = local.counts
    result["is_fsdp"] = type(module.model).__name__.startswith("FSDP")
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        fsdp_main(sys.argv[2])
    else:
        main(int(sys.argv[1]), sys.argv[2])
