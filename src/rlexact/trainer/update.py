"""Update stage: ``ppo_epochs`` x mini-batches of the policy loss, with micro-batch gradient accumulation, and the
statistics of the update.

:class:`PPOUpdate` runs the update of one rollout step for a host LightningModule (:class:`rlexact.RLModule`): it
uses the host's manual-optimization API (``manual_backward``, ``optimizers``, ``clip_gradients``, ``lr_schedulers``)
and its overridable ``policy_loss``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from rlexact import algorithms as alg
from rlexact.batch import RolloutBatch
from rlexact.callbacks.base import RLCallback
from rlexact.config import AlgorithmConfig, OptimConfig, RolloutConfig
from rlexact.distributed import ddp_wrapper, fsdp_call, set_gradient_sync
from rlexact.ops.keyed_hash import request_key
from rlexact.reduction import MetricReducer
from rlexact.trainer.batching import batch_logprobs, chunks, score_chunks, seq_valid
from rlexact.trainer.hooks import overrides

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
    """Accumulates the update metrics of one rollout step over mini-batches and micro-batches.

    Loss values are recorded per mini-step with the weight ``share`` = this rank's loss normalizer (tokens for
    ``token-mean``, sequences with a token in the loss otherwise) over the global one, so that their sum over ranks
    is the normalizer-weighted mean over ranks, not the plain mean of per-rank values. Values and token statistics
    accumulate as device tensors (no host synchronization per micro-batch); :meth:`finish` reads them once.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.share = 1.0
        self.steps = 0
        self.skipped = 0
        self.grad_norms: list[float] = []
        # per micro-batch, float64 [9]: ratio sum, tokens, clipped, clipped and total with A > 0, clipped and total
        # with A < 0, ratio min, ratio max
        self._token_rows: list[torch.Tensor] = []

    def add(self, key: str, value: float | torch.Tensor) -> None:
        """Add ``value`` (a local value of the current mini-step; a float or a 0-dim tensor) times the mini-step's
        ``share`` to ``key``."""
        self.sums[key] = self.sums.get(key, 0.0) + value * self.share

    def token_stats(self, ratio: torch.Tensor, clipped: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> None:
        """Ratio sum / min / max and clip counts over the tokens in ``mask`` (all ``[T]``)."""
        if not ratio.numel():
            return
        r = ratio.float()
        c = clipped & mask
        pos, neg = mask & (adv > 0), mask & (adv < 0)
        parts = (torch.where(mask, r.double(), 0.0).sum(), mask.sum(), c.sum(), (c & pos).sum(), pos.sum(),
                 (c & neg).sum(), neg.sum(), torch.where(mask, r, math.inf).min(),
                 torch.where(mask, r, -math.inf).max())  # fmt: skip
        self._token_rows.append(torch.stack([x.double() for x in parts]))

    def finish(self, lr: float | None) -> dict[str, float]:
        """The update metrics over every rank (one reduction); ``lr`` is logged when given."""
        steps = max(self.steps, 1)
        nan = math.nan
        red = MetricReducer()
        for key, value in self.sums.items():
            red.add_sum(f"loss/{key}" if key in ("pg_loss", "kl") else key, float(value))
        rows = torch.stack(self._token_rows) if self._token_rows else torch.zeros(1, 9, dtype=torch.float64)
        ratio_sum, tokens, clipped, pos_c, pos_n, neg_c, neg_n = rows[:, :7].sum(0).tolist()
        ratio_lo, ratio_hi = float(rows[:, 7].min()), float(rows[:, 8].max())
        tokens, pos_n, neg_n = int(tokens), int(pos_n), int(neg_n)
        red.add_mean("ratio/mean", ratio_sum / tokens if tokens else 0.0, tokens, empty=nan)
        red.add_mean("clipfrac", clipped / tokens if tokens else 0.0, tokens, empty=nan)
        red.add_mean("clipfrac/pos", pos_c / pos_n if pos_n else 0.0, pos_n, empty=nan)
        red.add_mean("clipfrac/neg", neg_c / neg_n if neg_n else 0.0, neg_n, empty=nan)
        red.add_min("ratio/min", ratio_lo if tokens else None, empty=nan)
        red.add_max("ratio/max", ratio_hi if tokens else None, empty=nan)
        out = red.reduce()
        for key in self.sums:
            out[f"loss/{key}" if key in ("pg_loss", "kl") else key] /= steps
        out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else nan
        out["update/optimizer_steps"] = float(self.steps)
        out["update/skipped_steps"] = float(self.skipped)
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

    def __init__(self, host: UpdateHost, trainer: Any | None) -> None:
        self.host = host
        self.trainer = trainer
        self.stats = UpdateStats()

    def run(self, batch: RolloutBatch, callbacks: list[RLCallback]) -> dict[str, float]:
        """Run every epoch and mini-batch on ``batch``; returns the update metrics (reduced over ranks)."""
        host, algo = self.host, self.host.algo
        g = torch.Generator()
        g.manual_seed(request_key(algo.shuffle_seed, host.rollout_step, host.global_rank))
        n_seq = batch.num_seqs
        size = algo.mini_batch_size or n_seq
        # mini-batches per epoch: this rank's count is the same every epoch; every rank runs the largest one
        num_minis = int(MetricReducer().add_max("n", len(range(0, n_seq, size))).reduce()["n"])
        for epoch in range(algo.ppo_epochs):
            order = torch.randperm(n_seq, generator=g).tolist() if algo.shuffle else list(range(n_seq))
            minis = [order[i : i + size] for i in range(0, n_seq, size)]
            # fewer sequences on this rank: no-loss placeholders keep the ranks' collectives aligned
            mini_batches = batch.split(minis + [[0]] * (num_minis - len(minis)))
            for step, mb in enumerate(mini_batches):
                if step >= len(minis):
                    mb.loss_mask = torch.zeros_like(mb.loss_mask)
                self.mini_step(mb, callbacks, epoch, step)
        lr = None
        if self.trainer is not None and self.trainer.optimizers:
            lr = float(self.trainer.optimizers[0].param_groups[0]["lr"])
        return self.stats.finish(lr)

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
        num_micros = int(MetricReducer().add_max("n", len(micros)).reduce()["n"])
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
        local_seqs = int(seq_valid(mb).sum())
        totals = MetricReducer().add_sum("tokens", local_tokens).add_sum("seqs", local_seqs).reduce()
        if totals["tokens"] == 0:
            rank_zero_warn(
                f"rollout step {host.rollout_step}, epoch {epoch}, mini-batch {step}: no token left in the loss "
                "(every token masked or rejected); skipping this optimizer step",
            )
            stats.skipped += 1
            if single:  # release the graph (FSDP: run the backward so the hooks complete) without a step
                host.manual_backward(logp.sum() * 0.0 + ent.sum() * 0.0)
                host.model.zero_grad(set_to_none=True)
            return
        if algo.loss_agg_mode == "token-mean":
            stats.share = local_tokens / totals["tokens"]
        else:
            stats.share = local_seqs / totals["seqs"] if totals["seqs"] else 0.0
        opt = host.optimizers()
        loss_sum = 0.0
        # every micro-batch gathered up front: one host synchronization per mini-batch
        micro_batches = [mb] if single else mb.split(micros + [[0]] * (num_micros - len(micros)))
        ddp = ddp_wrapper(getattr(self.trainer, "strategy", None))
        try:
            for k, micro in enumerate(micro_batches):
                if single:
                    lp, en = logp, ent
                else:
                    if k >= len(micros):  # a no-loss placeholder (fewer micro-batches on this rank)
                        micro.loss_mask = torch.zeros_like(micro.loss_mask)
                    # FSDP2 / DDP: accumulate gradients locally, reduce once after the last micro-batch
                    set_gradient_sync(host.model, k == num_micros - 1, ddp)
                # the stream's validation (a host synchronization) before the forward is queued, not after it
                seg = alg.segment_ids(micro.cu_seqlens, micro.num_tokens)
                if not single:
                    lp, en = self._logprobs(micro)
                loss = self.micro_loss(micro, lp, en, local_tokens, local_seqs, seg)
                host.manual_backward(loss)
                loss_sum = loss_sum + loss.detach().double()
        finally:
            set_gradient_sync(host.model, True, ddp)
        stats.add("loss", loss_sum)
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
        self,
        micro: RolloutBatch,
        logp: torch.Tensor,
        ent: torch.Tensor,
        mini_tokens: int,
        mini_seqs: int,
        seg: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of one micro-batch, scaled by its share of the mini-batch normalizer (so the micro-batch losses
        of a mini-batch sum to the mini-batch loss); records its statistics. ``seg``: the micro-batch's
        ``segment_ids`` (computed here, once for every aggregate, without it)."""
        host, algo, stats = self.host, self.host.algo, self.stats
        if seg is None:
            seg = alg.segment_ids(micro.cu_seqlens, micro.num_tokens)
        mask = micro.loss_mask
        mode = algo.loss_agg_mode
        norm = host.rollout_cfg.max_new_tokens
        # share of this micro-batch in the mini-batch normalizer (1 without micro-batching), a device scalar (fp64 for
        # the statistics, rounded once to fp32 for the loss)
        if mode == "token-mean":
            scale = mask.sum().double() / max(mini_tokens, 1)
        else:
            scale = seq_valid(micro).sum().double() / max(mini_seqs, 1)

        def agg(values: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
            return alg.aggregate_loss(
                values, mask, micro.cu_seqlens, mode, token_weights=weights, norm_length=norm, seg=seg
            )

        tok, info = host.policy_loss(micro, logp)
        pg = agg(tok, micro.token_weights)
        loss = pg
        if algo.kl_coef > 0:
            kl = agg(alg.kl_penalty(logp, micro.ref_logprobs, algo.kl_estimator))
            loss = loss + algo.kl_coef * kl
            stats.add("kl", kl.detach().double() * scale)
        ent_agg = agg(ent)
        if algo.entropy_coef != 0:
            loss = loss - algo.entropy_coef * ent_agg
        stats.add("pg_loss", pg.detach().double() * scale)
        stats.add("entropy", ent_agg.detach().double() * scale)
        stats.token_stats(info["ratio"], info["clipped"], micro.advantages, mask)
        return loss * scale.to(loss.dtype)
