"""Synthetic training-inference mismatch: perturb the rollout log-probs so TIM can be studied (and the probes and
corrections tested and calibrated) on CPU with an exact engine.

**Order.** :class:`MismatchInjection` must come before every RL callback in ``trainer.callbacks`` that reads or
writes the batch's log-probs, token weights or loss mask (:attr:`~rlexact.callbacks.RLCallback.reads_logprobs`,
True by default; False for :class:`~rlexact.callbacks.SampleLogger`): the hooks run in list order, and
probes/corrections/guards placed before it would see the unperturbed batch. :meth:`MismatchInjection.check` (run by
``setup`` and by :meth:`rlexact.RLModule.check_trainer`) raises a ``ValueError`` when one precedes it. On the
command line, ``--trainer.callbacks+=...`` appends after the recipe's callbacks, so list the injection first in the
YAML's ``trainer.callbacks`` instead.

What it changes, in ``on_rl_batch`` (never in place -- new tensors are assigned, so aliases of the old tensors, such
as a ``trainer_logprobs`` that *is* ``rollout_logprobs``, keep the clean values):

- ``batch.rollout_logprobs`` on response tokens (the "engine" side of the mismatch);
- ``batch.old_logprobs`` the same way **when pi_old is the rollout log-prob**, i.e. ``old_logprob_mode`` ``"exact"``
  or ``"bypass"`` (an engine that reports perturbed numbers would hand those to the loss); in ``"recompute"`` mode
  pi_old is the trainer's and stays clean. The mode is read from ``pl_module.algo.old_logprob_mode`` (``RLModule``;
  also ``pl_module.algorithm.old_logprob_mode`` or ``pl_module.old_logprob_mode``); if the module does not say,
  ``old_logprobs="auto"`` lets pi_old follow when it was bitwise equal to the clean rollout log-probs. Force either
  with ``old_logprobs="follow"`` / ``"keep"``.
- never ``batch.trainer_logprobs`` (the trainer is the reference) and never the generator: a later re-scoring
  through the generator (e.g. :class:`~rlexact.callbacks.probes.UpdateDirectionProbe` after the update) is clean.

The noise is ``scale * N(0, 1)`` per response token from a private generator keyed by ``(seed, rollout step,
global rank)`` (the rollout step is this callback's own counter, saved in ``state_dict``), so a run, and a resumed
run, perturb the same tokens by the same amounts; the global RNG is never touched. ``target`` decides how the noise
acts (see :func:`rlexact.callbacks._extra.perturb_logprobs`):

- ``"logprobs"``: ``logp + scale * z`` (clamped to ``<= 0``): additive error on the reported log-prob.
- ``"logits"``: emulated logit noise: the sampled token's log-odds against the rest of the vocabulary move by
  ``scale * z`` (``logp' = logsigmoid(logit(p) + scale * z)``), so near-certain tokens barely move and uncertain
  ones move most, like real kernel mismatch. It needs no logits, only the log-prob.

Logs ``injection/abs_shift_mean`` and ``injection/abs_shift_max`` (``|logp' - logp|`` over response tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from typing_extensions import override

from rlexact.callbacks._extra import InjectionTarget, keyed_normal, perturb_logprobs
from rlexact.callbacks.aggregation import MetricReducer, global_rank, log_scalars
from rlexact.callbacks.base import RLCallback, old_logprob_mode, rl_callbacks
from rlexact.checks import choice, finite, integer

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from rlexact.batch import RolloutBatch

__all__ = ["MismatchInjection", "old_logprob_mode"]

OldFollow = Literal["auto", "follow", "keep"]


class MismatchInjection(RLCallback):
    """Perturb the rollout log-probs with seeded noise of a set size to emulate a non-exact engine (first in list).

    Args:
        target: ``"logprobs"`` (additive log-prob noise) or ``"logits"`` (emulated logit noise; see module doc).
        scale: standard deviation of the noise (nats of log-prob or of log-odds); ``0`` injects nothing.
        seed: base seed; the draw depends only on ``(seed, rollout step, global rank)``.
        old_logprobs: ``"auto"`` (follow the module's pi_old mode), ``"follow"`` or ``"keep"``.
    """

    state_fields = (("rollout_step", int),)

    def __init__(
        self, target: InjectionTarget = "logprobs", scale: float = 0.05, seed: int = 0, old_logprobs: OldFollow = "auto"
    ) -> None:
        who = type(self).__name__
        choice(f"{who}: target", target, ("logprobs", "logits"))
        finite(f"{who}: scale", scale, low=0.0)
        integer(f"{who}: seed", seed)
        choice(f"{who}: old_logprobs", old_logprobs, ("auto", "follow", "keep"))
        self.target = target
        self.scale = float(scale)
        self.seed = seed
        self.old_logprobs = old_logprobs
        self.rollout_step = 0
        """Rollout batches perturbed so far; keys the noise (resumable)."""
        self.last_metrics: dict[str, float] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(target=self.target, scale=self.scale, seed=self.seed)

    @property
    def perturbs_logprobs(self) -> bool:
        """Whether it perturbs anything (``scale > 0``)."""
        return self.scale > 0

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return ("injection",)

    @override
    def check(self, trainer: Trainer | None, pl_module: Any) -> None:
        """Also refuses an RL callback that reads the batch's log-probs, weights or masks
        (:attr:`~rlexact.callbacks.RLCallback.reads_logprobs`) placed before this one."""
        super().check(trainer, pl_module)
        callbacks = rl_callbacks(trainer) if trainer is not None else []
        if self not in callbacks:
            return
        before = [
            type(cb).__name__
            for cb in callbacks[: callbacks.index(self)]
            if cb.reads_logprobs and not isinstance(cb, MismatchInjection)
        ]
        if before:
            raise ValueError(
                f"{type(self).__name__} must come before every RL callback that reads the batch's log-probs, "
                f"weights or masks in trainer.callbacks (hooks run in list order); found {before} before it. On the "
                "command line --trainer.callbacks+=... appends after the recipe's callbacks: list MismatchInjection "
                "first in the YAML's trainer.callbacks"
            )

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        mask = batch.response_mask
        noise = self.scale * keyed_normal(batch.num_tokens, self.seed, self.rollout_step, global_rank())
        clean = batch.rollout_logprobs
        perturbed = perturb_logprobs(clean, noise.to(clean.device), mask, self.target)
        batch.old_logprobs = self._new_old(pl_module, batch.old_logprobs, clean, perturbed)
        batch.rollout_logprobs = perturbed
        self.rollout_step += 1

        shift = torch.where(mask, (perturbed.double() - clean.double()).abs(), 0.0)
        n = int(mask.sum())
        red = MetricReducer()
        red.add_mean("injection/abs_shift_mean", float(shift.sum()) / n if n else 0.0, n)
        red.add_max("injection/abs_shift_max", float(shift.max()) if n else None)
        self.last_metrics = red.reduce(clean.device)
        log_scalars(trainer, pl_module, self.last_metrics)

    def _new_old(self, pl_module: Any, old: torch.Tensor, clean: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
        policy = self.old_logprobs
        if policy == "auto":
            mode = old_logprob_mode(pl_module)
            if mode in ("exact", "bypass"):
                policy = "follow"
            elif mode == "recompute":
                policy = "keep"
        if policy == "keep":
            return old
        if policy == "follow":
            return perturbed.to(old.dtype)
        # unknown mode: pi_old came from the rollout iff it is the rollout tensor's values, bit for bit
        if old.dtype == clean.dtype and torch.equal(old.view(-1), clean.view(-1)):
            return perturbed.clone()
        return old
