"""Helpers shared by tests/test_callbacks.py, and its two-process gloo worker.

``python tests/_callbacks_worker.py RANK OUT`` (with ``MASTER_ADDR`` / ``MASTER_PORT`` set) joins a 2-rank gloo
group, reduces known per-rank statistics with :class:`rlexact.callbacks.MetricReducer`, gathers tensors with
``gather_cat``, runs ``TruncatedIS`` and ``MismatchProbe`` on this rank's half of a batch, and saves the results.
Kept free of pytest / tensorboard imports so the two processes start quickly.
"""

from __future__ import annotations

import sys

import torch

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


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
