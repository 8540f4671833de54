"""Update stage: ``ppo_epochs`` x mini-batches of the policy loss, with micro-batch gradient accumulation, and the
statistics of the update.

:class:`PPOUpdate` runs the update of one rollout step for a host LightningModule (:class:`rlexact.RLModule`): it
uses the host's manual-optimization API (``manual_backward``, ``optimizers``, ``clip_gradients``, ``lr_schedulers``)
and its overridable ``policy_loss``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Protocol

import torch
from torch import nn

from rlexact import algorithms as alg
from rlexact.batch import RolloutBatch
from rlexact.callbacks.base import RLCallback
from rlexact.config import AlgorithmConfig, OptimConfig, RolloutConfig
from rlexact.distributed import fsdp_call
from rlexact.trainer.batching import batch_logprobs, chunks, score_chunks, seq_valid
from rlexact.trainer.hooks import overrides
from rlexact.trainer.rewards import Reduce
from rlexact.trainer.sampling import mix_seed

__all__ = ["PPOUpdate", "UpdateHost", "UpdateStats", "grad_norm", "policy_loss"]


class UpdateHost(Protocol):
    """What :class:`PPOUpdate` needs from its LightningModule (:class:`rlexact.RLModule` provides it)."""

    algo: AlgorithmConfig
    rollout_cfg: RolloutConfig
    optim_cfg: OptimConfig
    model: nn.Module
    rollout_step: int
    global_rank: int
    logprob_temperature: float
    logprob_truncation: tuple[int, float]

    def policy_loss(self, micro: RolloutBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def manual_backward(self, loss: torch.Tensor) -> None: ...

    def optimizers(self) -> Any: ...

    def lr_schedulers(self) -> Any: ...

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float, gradient_clip_algorithm: str) -> None: ...


def policy_loss(
    algo: AlgorithmConfig, micro: RolloutBatch, logp: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss ``[T]`` of ``algo.objective`` and its detached diagnostics (``ratio``, ``clipped``)."""
    if algo.objective == "reinforce":
        tok = alg.reinforce_loss(logp, micro.advantages)
        ratio = (logp.detach() - micro.old_logprobs).clamp(-alg.LOG_RATIO_CLAMP, alg.LOG_RATIO_CLAMP).exp()
        zero = torch.zeros_like(micro.loss_mask)
        return tok, {"ratio": ratio, "clipped": zero}
    if algo.objective == "gspo":
        return alg.gspo_loss(
            logp,
            micro.old_logprobs,
            micro.advantages,
            micro.cu_seqlens,
            micro.loss_mask,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
        )
    return alg.ppo_clip_loss(
        logp,
        micro.old_logprobs,
        micro.advantages,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
    )


class UpdateStats:
    """Accumulates the update metrics of one rollout step over mini-batches and micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.loss = 0.0
        self.steps = 0
        self.skipped = 0
        self.grad_norms: list[float] = []
        self.ratio_sum = 0.0
        self.ratio_min = math.inf
        self.ratio_max = -math.inf
        self.tokens = 0
        self.pos = [0, 0]  # clipped, total among A > 0 tokens
        self.neg = [0, 0]
        self.clipped = 0

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def token_stats(self, ratio: torch.Tensor, clipped: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> None:
        if not bool(mask.any()):
            return
        r = ratio[mask].float()
        c = clipped[mask]
        a = adv[mask]
        self.ratio_sum += float(r.double().sum())
        self.ratio_min = min(self.ratio_min, float(r.min()))
        self.ratio_max = max(self.ratio_max, float(r.max()))
        self.tokens += int(r.numel())
        self.clipped += int(c.sum())
        self.pos[0] += int((c & (a > 0)).sum())
        self.pos[1] += int((a > 0).sum())
        self.neg[0] += int((c & (a < 0)).sum())
        self.neg[1] += int((a < 0).sum())

    def finish(self, reduce: Reduce, lr: float | None) -> dict[str, float]:
        """The update metrics, with counts and extrema reduced over ranks; ``lr`` is logged when given."""
        steps = max(self.steps, 1)
        red = reduce(
            [self.ratio_sum, float(self.tokens), float(self.clipped), *map(float, self.pos), *map(float, self.neg)],
            "sum",
        )
        rsum, tokens, clipped, pc, pt, nc, nt = red
        rmin = reduce([self.ratio_min], "min")[0]
        rmax = reduce([self.ratio_max], "max")[0]
        out = {
            "loss": self.loss / steps,
            "grad_norm": sum(self.grad_norms) / max(len(self.grad_norms), 1) if self.grad_norms else math.nan,
            "update/optimizer_steps": float(self.steps),
            "update/skipped_steps": float(self.skipped),
            "clipfrac": clipped / tokens if tokens else math.nan,
            "clipfrac/pos": pc / pt if pt else math.nan,
            "clipfrac/neg": nc / nt if nt else math.nan,
            "ratio/mean": rsum / tokens if tokens else math.nan,
            "ratio/min": rmin if tokens else math.nan,
            "ratio/max": rmax if tokens else math.nan,
        }
        for k, v in self.sums.items():
            out[f"loss/{k}" if k in ("pg_loss", "kl") else k] = v / steps
        if lr is not None:
            out["lr"] = lr
        return out


def grad_norm(model: nn.Module) -> float:
    """Total L2 norm of ``model``'s gradients (a full-tensor norm under FSDP2); 0.0 without gradients."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


class PPOUpdate:
    """The update of one rollout step: ``ppo_epochs`` x mini-batches, each one optimizer step (see
    :class:`rlexact.RLModule` for the counters and the cross-rank padding of mini- and micro-batches)."""

    def __init__(self, host: UpdateHost, trainer: Any | None, reduce: Reduce, distributed: bool) -> None:
        self.host = host
        self.trainer = trainer
        self.reduce = reduce
        self.distributed = distributed
        self.stats = UpdateStats()

    def run(self, batch: RolloutBatch, callbacks: list[RLCallback]) -> dict[str, float]:
        """Run every epoch and mini-batch on ``batch``; returns the update metrics (reduced over ranks)."""
        host, algo = self.host, self.host.algo
        g = torch.Generator()
        g.manual_seed(mix_seed(algo.shuffle_seed, host.rollout_step, host.global_rank))
        n_seq = batch.num_seqs
        for epoch in range(algo.ppo_epochs):
            order = torch.randperm(n_seq, generator=g).tolist() if algo.shuffle else list(range(n_seq))
            size = algo.mini_batch_size or n_seq
            minis = [order[i : i + size] for i in range(0, n_seq, size)]
            num_minis = int(self.reduce([float(len(minis))], "max")[0])
            for step in range(num_minis):
                if step < len(minis):
                    mb = batch.select(minis[step])
                else:  # fewer sequences on this rank: a no-loss placeholder keeps the ranks' collectives aligned
                    mb = batch.select([0])
                    mb.loss_mask = torch.zeros_like(mb.loss_mask)
                self.mini_step(mb, callbacks, epoch, step)
        lr = None
        if self.trainer is not None and self.trainer.optimizers:
            lr = float(self.trainer.optimizers[0].param_groups[0]["lr"])
        return self.stats.finish(self.reduce, lr)

    def _logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.host.model
        host = self.host
        return fsdp_call(
            model,
            lambda: batch_logprobs(
                model, batch, host.logprob_temperature, with_entropy=True, truncation=host.logprob_truncation
            ),
        )

    def mini_step(self, mb: RolloutBatch, callbacks: list[RLCallback], epoch: int, step: int) -> None:
        """One optimizer step on mini-batch ``mb`` (micro-batch gradient accumulation; skipped with a warning when no
        token is left in the loss on any rank)."""
        host, algo, stats = self.host, self.host.algo, self.stats
        micro_size = algo.micro_batch_size
        single = micro_size is None or micro_size >= mb.num_seqs
        micros = [list(range(mb.num_seqs))] if single else chunks(mb.num_seqs, micro_size)
        num_micros = int(self.reduce([float(len(micros))], "max")[0]) if not single or self.distributed else 1
        single = single and num_micros == 1
        hooks = [cb for cb in callbacks if overrides(cb, "on_rl_minibatch")]

        if single:
            logp, ent = self._logprobs(mb)
            for cb in hooks:
                cb.on_rl_minibatch(self.trainer, host, mb, logp.detach(), epoch, step)
        elif hooks:
            detached = score_chunks(mb, host.model, micros, host.logprob_temperature, host.logprob_truncation)
            for cb in hooks:
                cb.on_rl_minibatch(self.trainer, host, mb, detached, epoch, step)

        local_tokens = int(mb.loss_mask.sum())
        total_tokens = self.reduce([float(local_tokens)], "sum")[0]
        if total_tokens == 0:
            warnings.warn(
                f"rollout step {host.rollout_step}, epoch {epoch}, mini-batch {step}: no token left in the loss "
                "(every token masked or rejected); skipping this optimizer step",
                stacklevel=2,
            )
            stats.skipped += 1
            if single:  # release the graph (FSDP: run the backward so the hooks complete) without a step
                host.manual_backward(logp.sum() * 0.0 + ent.sum() * 0.0)
                host.model.zero_grad(set_to_none=True)
            return
        local_seqs = int(seq_valid(mb).sum())
        opt = host.optimizers()
        loss_sum = 0.0
        for k in range(num_micros):
            if single:
                micro, lp, en = mb, logp, ent
            else:
                if k < len(micros):
                    micro = mb.select(micros[k])
                else:
                    micro = mb.select([0])
                    micro.loss_mask = torch.zeros_like(micro.loss_mask)
                lp, en = self._logprobs(micro)
            loss = self.micro_loss(micro, lp, en, local_tokens, local_seqs)
            host.manual_backward(loss)
            loss_sum += float(loss.detach())
        stats.loss += loss_sum
        stats.steps += 1
        norm = grad_norm(host.model)
        if host.optim_cfg.grad_clip is not None:
            host.clip_gradients(opt, gradient_clip_val=host.optim_cfg.grad_clip, gradient_clip_algorithm="norm")
        stats.grad_norms.append(norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched = host.lr_schedulers()
        if sched is not None:
            (sched[0] if isinstance(sched, list) else sched).step()

    def micro_loss(
        self, micro: RolloutBatch, logp: torch.Tensor, ent: torch.Tensor, mini_tokens: int, mini_seqs: int
    ) -> torch.Tensor:
        """The loss of one micro-batch, scaled by its share of the mini-batch normalizer (so the micro-batch losses
        of a mini-batch sum to the mini-batch loss); records its statistics."""
        host, algo, stats = self.host, self.host.algo, self.stats
        mask = micro.loss_mask
        mode = algo.loss_agg_mode
        norm = host.rollout_cfg.max_new_tokens
        # share of this micro-batch in the mini-batch normalizer (1 without micro-batching)
        if mode == "token-mean":
            scale = float(mask.sum()) / max(mini_tokens, 1)
        else:
            scale = float(seq_valid(micro).sum()) / max(mini_seqs, 1)

        def agg(values: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
            return alg.aggregate_loss(values, mask, micro.cu_seqlens, mode, token_weights=weights, norm_length=norm)

        tok, info = host.policy_loss(micro, logp)
        pg = agg(tok, micro.token_weights)
        loss = pg
        if algo.kl_coef > 0:
            kl = agg(alg.kl_penalty(logp, micro.ref_logprobs, algo.kl_estimator))
            loss = loss + algo.kl_coef * kl
            stats.add("kl", float(kl.detach()) * scale)
        ent_agg = agg(ent)
        if algo.entropy_coef != 0:
            loss = loss - algo.entropy_coef * ent_agg
        stats.add("pg_loss", float(pg.detach()) * scale)
        stats.add("entropy", float(ent_agg.detach()) * scale)
        stats.token_stats(info["ratio"], info["clipped"], micro.advantages, mask)
        return loss * scale
