"""Two gloo ranks on CPU, launched by tests/test_update_distributed.py: the update stage and the reducer.

Each rank holds a different rollout batch. Written to ``<out>/rank<r>.pt``:
  - ``grads``: full gradients after one mini-step under FSDP2, one big batch / micro-batches of 2 sequences (gradient
    sync only on the last micro-batch) / micro-batches with activation checkpointing;
  - ``local``: this rank's gradients of the same mini-step without FSDP (not averaged over ranks);
  - ``sync_calls``: the ``set_requires_gradient_sync`` arguments of the micro-batched run;
  - ``lp_equal``: no-grad log-probs with activation checkpointing equal those without, bitwise;
  - ``recomputed``: attention forwards per layer in one forward+backward with checkpointing (2 = recomputed);
  - ``metrics`` (micro-batched run) and ``local_pg`` / ``local_tokens``: the update metrics and this rank's own
    policy loss and token count, to check the token-weighted reduction;
  - ``adv``: REINFORCE advantages of this rank's rewards whitened over both ranks.

Usage: python tests/_update_worker.py RANK OUT_DIR (MASTER_ADDR / MASTER_PORT set by the caller)
"""

from __future__ import annotations

import copy
import gc
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from _callbacks_worker import make_batch
from models import tiny_model
from rlexact import algorithms as alg
from rlexact.config import AlgorithmConfig, OptimConfig, RolloutConfig
from rlexact.distributed import apply_fsdp, fsdp_call
from rlexact.models import exactify
from rlexact.reduction import all_reduce
from rlexact.trainer.batching import batch_logprobs
from rlexact.trainer.policy import enable_activation_checkpointing
from rlexact.trainer.update import PPOUpdate, policy_loss


class Recorder:
    """Optimizer stand-in: ``step`` records the full gradients, nothing is updated."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        for name, p in self.model.named_parameters():
            g = p.grad
            self.grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


class Host:
    """The part of RLModule that PPOUpdate uses."""

    def __init__(self, model: torch.nn.Module, micro_batch_size: int | None) -> None:
        self.algo = AlgorithmConfig(micro_batch_size=micro_batch_size, shuffle=False)
        self.rollout_cfg = RolloutConfig(n=2, max_new_tokens=8)
        self.optim_cfg = OptimConfig(grad_clip=None)
        self.model = model
        self.rollout_step = 0
        self.global_rank = dist.get_rank()
        self.logprob_temperature = 1.0
        self.logprob_truncation = (0, 1.0)
        self.opt = Recorder(model)

    def policy_loss(self, micro: Any, logp: torch.Tensor) -> Any:
        return policy_loss(self.algo, micro, logp)

    def manual_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizers(self) -> Recorder:
        return self.opt

    def lr_schedulers(self) -> None:
        return None

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("grad_clip is None")


def update_grads(model: torch.nn.Module, batch: Any, micro: int | None) -> tuple[dict, dict]:
    host = Host(model, micro)
    update = PPOUpdate(host, None)
    update.mini_step(batch, [], 0, 0)
    return host.opt.grads, update.stats.finish(None)


def run(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = tiny_model("qwen3", vocab=97)
    batch = make_batch(seed=5 + rank, num_seqs=5 + rank)  # different data and sizes per rank
    # old log-probs away from the current ones: ratios differ from 1 and some tokens clip
    batch.old_logprobs = torch.where(batch.response_mask, batch.rollout_logprobs * 0.3, 0.0)
    mesh = init_device_mesh("cpu", (2,))

    local = exactify(copy.deepcopy(base)).train()
    local_grads, _ = update_grads(local, batch, None)
    lp, _ = batch_logprobs(local, batch, 1.0, with_entropy=False)
    tok, _ = policy_loss(AlgorithmConfig(), batch, lp.detach())
    local_pg = float(alg.aggregate_loss(tok, batch.loss_mask, batch.cu_seqlens, "token-mean"))

    sharded = apply_fsdp(exactify(copy.deepcopy(base)).train(), mesh)
    whole, _ = update_grads(sharded, batch, None)
    calls: list[bool] = []
    inner = sharded.set_requires_gradient_sync
    sharded.set_requires_gradient_sync = lambda flag, **kw: (calls.append(flag), inner(flag, **kw))[1]
    micro, metrics = update_grads(sharded, batch, 2)

    ckpt = exactify(copy.deepcopy(base)).train()
    enable_activation_checkpointing(ckpt)
    ckpt = apply_fsdp(ckpt, mesh)
    with torch.no_grad():
        lp_plain = fsdp_call(sharded, lambda: batch_logprobs(sharded, batch, 1.0, with_entropy=True))
        lp_ckpt = fsdp_call(ckpt, lambda: batch_logprobs(ckpt, batch, 1.0, with_entropy=True))
    attn_calls = SimpleNamespace(n=0)
    ckpt.model.layers[0].self_attn.register_forward_hook(lambda *a: setattr(attn_calls, "n", attn_calls.n + 1))
    micro_ckpt, _ = update_grads(ckpt, batch, 2)

    rewards = torch.tensor([[0.0, 1.0, 0.5], [2.0, 2.0, -1.0, 0.25]][rank], dtype=torch.float64)
    adv = alg.reinforce_advantages(rewards, eps=0.0, all_reduce=all_reduce)
    torch.save(
        {
            "grads": {"whole": whole, "micro": micro, "micro_ckpt": micro_ckpt},
            "local": local_grads,
            "sync_calls": calls,
            "lp_equal": all(torch.equal(a, b) for a, b in zip(lp_plain, lp_ckpt)),
            "recomputed": attn_calls.n / 3,  # 3 micro-batches of at most 2 sequences on each rank
            "metrics": metrics,
            "local_pg": local_pg,
            "local_tokens": int(batch.loss_mask.sum()),
            "adv": adv,
        },
        f"{out}/rank{rank}.pt",
    )


def main(rank: int, out: str) -> None:
    """:func:`run` inside the process group. Its frame is gone and reference cycles are collected before the group is
    destroyed, so no FSDP2 state holding gloo work outlives it: gloo work freed during interpreter finalization
    aborts the process ("terminate called without an active exception")."""
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        run(rank, out)
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
