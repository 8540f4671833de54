"""Post-hoc TIM corrections as RL callbacks: truncated importance sampling and rejection sampling (paper §4.2).

Thin adapters over :func:`~rlexact.callbacks.functional.tis_weights` and
:func:`~rlexact.callbacks.functional.rejection_mask`:

- :class:`TruncatedIS` *multiplies* ``batch.token_weights`` by ``w = min(r_corr, cap)`` (detached) in
  ``on_rl_batch``;
- :class:`RejectionSampling` *ANDs* its keep-mask into ``loss_mask``: on the whole rollout batch in ``on_rl_batch``
  for ``signal="corr"`` (``r_corr = pi_old^train / pi_old^rollout``), on every PPO mini-batch in
  ``on_rl_minibatch`` for ``signal="ppo"`` (``r_ppo^rollout = pi_theta / pi_old^rollout``, which moves with every
  optimizer step).

Both score the *raw* response tokens (``batch.response_mask``), never the loss mask left by earlier callbacks, so
stacked corrections commute and give exactly :func:`~rlexact.callbacks.functional.apply_correction`'s
``keep * w``. In list order ``[TruncatedIS, RejectionSampling]`` the objective becomes
``loss_mask_t * w_t * loss_t``. A step whose loss mask ends empty is skipped by the module (with a warning); the
callbacks themselves never fail on empty masks.

:func:`correction_callbacks` builds the paper's four presets (``functional.PRESETS``); the YAML files in
``configs/corrections/`` are the same lists as LightningCLI ``trainer.callbacks`` fragments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from rlexact.callbacks import functional as F
from rlexact.callbacks.aggregation import MetricReducer, log_scalars
from rlexact.callbacks.base import (
    RLCallback,
    old_logprob_mode,
    require_trainer_logprobs,
    rollout_equals_trainer,
    seqs_with_tokens,
)
from rlexact.checks import choice, finite, metric_prefix

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from rlexact.batch import RolloutBatch

__all__ = ["RejectionSampling", "TruncatedIS", "correction_callbacks", "require_trainer_logprobs"]

_EXACT_ROLLOUT = (
    "the rollout log-probs are the trainer's bit for bit in this run (exact rollout kernels or "
    "old_logprob_mode='exact', and no MismatchInjection)"
)
"""The reason of the corrections' warning where :func:`~rlexact.callbacks.base.rollout_equals_trainer` holds."""

_COUNTS = ("rej_tok", "tok", "rej_seq", "seq", "kept", "n")
"""Keys of :class:`RejectionSampling`'s per-rank counts: rejected and response tokens, rejected sequences and
sequences with response tokens, tokens left in the loss, and the number of masks applied."""


class TruncatedIS(RLCallback):
    """Truncated importance sampling on ``r_corr``: ``token_weights *= min(r_corr, cap)`` (Yao et al., 2025).

    Turns the trainer-referenced PPO ratio ``r_ppo^train`` into (the truncated) ``r_ppo^rollout`` in effect, which
    is what it is for: ``old_logprob_mode="recompute"`` (pi_old = pi_old^train) with a non-exact rollout. In
    ``bypass`` mode the ratio is already rollout-referenced and TIS would reweight by ``r_corr`` a second time:
    :meth:`check` refuses it. Where the rollout log-probs are the trainer's bit for bit (exact kernels and no
    :class:`~rlexact.callbacks.MismatchInjection`, :func:`~rlexact.callbacks.base.rollout_equals_trainer`) the
    weights are exactly 1 and ``setup`` warns.
    ``level="token"``: ``w_t = min(r_corr,t, cap)``; ``level="sequence"``: ``w_i = min(prod_t r_corr,t, cap)`` over the
    sequence's response tokens. Weights are detached and *multiply* the existing ``token_weights``.
    Exactly 1.0 everywhere when the rollout and trainer log-probs are bitwise equal.

    Logs (``<prefix>`` = ``tis``): ``mean``, ``min``, ``max`` of the weights over response tokens and
    ``truncated_frac`` (weights whose untruncated value exceeded ``cap``; over tokens, or over sequences at sequence
    level), all reduced across data-parallel ranks.

    Args:
        level: ``"token"`` or ``"sequence"``.
        cap: the truncation ``tau``, a finite number ``>= 1`` (paper ``tau_tok = 2``).
        prefix: metric prefix (a non-empty string not ending with ``/``); stacked instances need different ones.
    """

    state_fields = (("steps", int), ("truncated_total", float), ("units_total", float))

    needs_trainer_logprobs = True

    def __init__(self, level: F.TISLevel = "token", cap: float = 2.0, prefix: str = "tis") -> None:
        who = type(self).__name__
        choice(f"{who}: level", level, ("token", "sequence"))
        finite(f"{who}: cap", cap, low=1.0)
        metric_prefix(f"{who}: prefix", prefix)
        self.spec = F.TISSpec(level=level, cap=float(cap))
        self.prefix = prefix
        self.steps = 0
        """Rollout steps corrected so far (resumable)."""
        self.truncated_total = 0.0
        self.units_total = 0.0
        self.last_metrics: dict[str, float] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(level=self.spec.level, cap=self.spec.cap, prefix=self.prefix)

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return (self.prefix,)

    @override
    def check(self, trainer: Trainer | None, pl_module: Any) -> None:
        """Also refuses ``old_logprob_mode='bypass'`` (the ratio would be corrected twice)."""
        super().check(trainer, pl_module)
        if old_logprob_mode(pl_module) == "bypass":
            raise ValueError(
                "TruncatedIS with old_logprob_mode='bypass': the PPO ratio is already referenced to the rollout's "
                "log-probs, and TIS would reweight by r_corr a second time. Use old_logprob_mode='recompute' with it"
            )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if rollout_equals_trainer(trainer, pl_module):
            rank_zero_warn(
                f"TruncatedIS: {_EXACT_ROLLOUT}, so its weights are exactly 1, at the cost of a trainer forward per "
                "step. TIS corrects a non-exact rollout: rollout.kernels='native' with old_logprob_mode='recompute'"
            )

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        trainer_lp = require_trainer_logprobs(batch, type(self).__name__)
        log_r = F.signal_log_ratio("corr", rollout_logp=batch.rollout_logprobs, old_logp=trainer_lp)
        mask = batch.response_mask
        weights, info = F.tis_weights(log_r, batch.cu_seqlens, mask, level=self.spec.level, cap=self.spec.cap)
        batch.token_weights = batch.token_weights * weights.to(batch.token_weights.dtype)

        n_tok = int(mask.sum())
        units = n_tok if self.spec.level == "token" else seqs_with_tokens(batch, mask)
        p = self.prefix
        red = MetricReducer()
        red.add_mean(f"{p}/mean", info["mean"], n_tok, empty=1.0)
        red.add_min(f"{p}/min", info["min"] if n_tok else None, empty=1.0)
        red.add_max(f"{p}/max", info["max"] if n_tok else None, empty=1.0)
        red.add_mean(f"{p}/truncated_frac", info["truncated_frac"], units)
        red.add_sum(f"{p}/truncated_count", info["truncated_frac"] * units)
        red.add_sum(f"{p}/units", units)
        metrics = red.reduce(batch.token_weights.device)
        self.truncated_total += metrics.pop(f"{p}/truncated_count")
        self.units_total += metrics.pop(f"{p}/units")
        self.steps += 1
        self.last_metrics = metrics
        log_scalars(trainer, pl_module, metrics)


class RejectionSampling(RLCallback):
    """Reject tokens or whole sequences whose mismatch score exceeds a threshold (ANDed into ``loss_mask``).

    Per response token ``K_t = K(q_t)`` with ``K`` in ``{k1, k2, k3}`` and ``q`` the signal; the granularity decides
    what is dropped (see :func:`rlexact.callbacks.functional.rejection_mask`): ``token`` (``K_t > threshold``),
    ``sequence_sum`` (the paper's ``S_seq = sum_t K_t > tau_seq``), ``sequence_mean`` or ``sequence_max``.

    - ``signal="corr"``: ``q = r_corr = pi_old^train / pi_old^rollout``, once per rollout batch in ``on_rl_batch``
      (needs ``batch.trainer_logprobs``).
    - ``signal="ppo"``: ``q = r_ppo^rollout = pi_theta / pi_old^rollout``, on every mini-batch in
      ``on_rl_minibatch`` with the current policy's log-probs.

    Logs (``<prefix>`` = ``rejection``): ``rejected_token_frac`` (rejected over scored response tokens),
    ``rejected_seq_frac`` (sequences that lost a token, over sequences with response tokens) and ``empty_loss_frac``
    (1.0 when no token is left in the loss after this callback; the module then skips the update). Reduced across
    ranks. What they count depends on the signal:

    - ``signal="corr"``: each response token and sequence of the rollout step once (one decision per rollout step).
    - ``signal="ppo"``: token and sequence *visits*: every PPO epoch's mini-batch decides anew (the ratio moves with
      every optimizer step), so with ``ppo_epochs=3`` each token is scored three times and counts three times in
      ``rejected_token_frac`` and in the lifetime ``tokens_total`` / ``rejected_tokens_total``, and
      ``rejected_seq_frac`` is over sequence visits. They are logged once per rollout step, in
      ``on_rl_update_end``; :attr:`last_minibatch_metrics` keeps each mini-batch's own fractions.

    Where the rollout log-probs are the trainer's bit for bit (exact kernels, no
    :class:`~rlexact.callbacks.MismatchInjection`), ``signal="corr"`` rejects nothing at the cost of a trainer
    forward per step, and ``setup`` warns.

    Args:
        signal: ``"corr"`` or ``"ppo"``.
        granularity: ``"token"``, ``"sequence_sum"``, ``"sequence_mean"`` or ``"sequence_max"``.
        estimator: ``"k1"`` (signed), ``"k2"`` or ``"k3"``.
        threshold: drop when the score is strictly greater; a finite number ``>= 0`` for every estimator (a
            negative one would reject every token whose score is 0, i.e. every token of an exact rollout; paper
            ``tau_seq = 0.001``).
        prefix: metric prefix (a non-empty string not ending with ``/``); stacked instances need different ones.
    """

    state_fields = (("steps", int), ("rejected_tokens_total", float), ("tokens_total", float), ("empty_steps", int))

    def __init__(
        self,
        signal: F.Signal = "corr",
        granularity: F.Granularity = "sequence_sum",
        estimator: F.Estimator = "k3",
        threshold: float = 0.001,
        prefix: str = "rejection",
    ) -> None:
        who = type(self).__name__
        choice(f"{who}: signal", signal, ("corr", "ppo"))
        choice(f"{who}: granularity", granularity, ("token", "sequence_sum", "sequence_mean", "sequence_max"))
        choice(f"{who}: estimator", estimator, ("k1", "k2", "k3"))
        finite(f"{who}: threshold", threshold)
        if threshold < 0:
            raise ValueError(
                f"{who}: threshold must be >= 0, got {threshold!r}: a negative threshold rejects every token whose "
                "score is 0, i.e. every token of an exact rollout"
            )
        metric_prefix(f"{who}: prefix", prefix)
        self.spec = F.RejectionSpec(signal=signal, granularity=granularity, estimator=estimator, threshold=threshold)
        self.prefix = prefix
        self.needs_trainer_logprobs = signal == "corr"
        self.steps = 0
        self.rejected_tokens_total = 0.0
        self.tokens_total = 0.0
        self.empty_steps = 0
        """Rollout steps that ended with an empty loss mask (``ppo``: empty in every mini-batch of the step)."""
        self.last_metrics: dict[str, float] = {}
        self.last_minibatch_metrics: list[dict[str, float]] = []
        self._acc = dict.fromkeys(_COUNTS, 0.0)
        """Local counts summed over the mini-batches of the current rollout step (``signal="ppo"``)."""

    @property
    def state_key(self) -> str:
        s = self.spec
        return self._generate_state_key(
            signal=s.signal, granularity=s.granularity, estimator=s.estimator, threshold=s.threshold, prefix=self.prefix
        )

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return (self.prefix,)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.spec.signal == "corr" and rollout_equals_trainer(trainer, pl_module):
            rank_zero_warn(
                f"RejectionSampling(signal='corr'): {_EXACT_ROLLOUT}, so r_corr is exactly 1 and it rejects nothing, "
                "at the cost of a trainer forward per step. It corrects a non-exact rollout: rollout.kernels='native' "
                "with old_logprob_mode='recompute'"
            )

    # ------------------------------------------------------------------------------------------------------ hooks
    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        self._acc = dict.fromkeys(_COUNTS, 0.0)
        self.last_minibatch_metrics = []
        if self.spec.signal != "corr":
            return
        trainer_lp = require_trainer_logprobs(batch, type(self).__name__)
        log_q = F.signal_log_ratio("corr", rollout_logp=batch.rollout_logprobs, old_logp=trainer_lp)
        counts = self._apply(batch, log_q)
        self._finish_step(trainer, pl_module, self._reduce(counts, batch.loss_mask.device))

    def on_rl_minibatch(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        minibatch: RolloutBatch,
        logprobs: torch.Tensor,
        epoch: int,
        step: int,
    ) -> None:
        if self.spec.signal != "ppo":
            return
        log_q = F.signal_log_ratio("ppo", rollout_logp=minibatch.rollout_logprobs, logp=logprobs)
        counts = self._apply(minibatch, log_q)
        for key, value in counts.items():
            self._acc[key] += value
        metrics = self._metrics(self._reduce(counts, minibatch.loss_mask.device))
        self.last_minibatch_metrics.append({"epoch": float(epoch), "step": float(step), **metrics})

    def on_rl_update_end(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        if self.spec.signal != "ppo" or not self._acc["n"]:
            return
        self._finish_step(trainer, pl_module, self._reduce(self._acc, batch.loss_mask.device))

    # ---------------------------------------------------------------------------------------------------- helpers
    def _apply(self, batch: RolloutBatch, log_q: torch.Tensor) -> dict[str, float]:
        """AND the keep-mask into ``batch.loss_mask``; return this rank's counts (keys :data:`_COUNTS`)."""
        s = self.spec
        mask = batch.response_mask
        keep, info = F.rejection_mask(
            log_q, batch.cu_seqlens, mask, granularity=s.granularity, estimator=s.estimator, threshold=s.threshold
        )
        batch.loss_mask = batch.loss_mask & keep
        n_tok = int(mask.sum())
        n_seq = seqs_with_tokens(batch, mask)
        return {
            "rej_tok": info["rejected_token_frac"] * n_tok,
            "tok": float(n_tok),
            "rej_seq": info["rejected_seq_frac"] * n_seq,
            "seq": float(n_seq),
            "kept": float(batch.loss_mask.sum()),
            "n": 1.0,
        }

    @staticmethod
    def _reduce(counts: dict[str, float], device: torch.device) -> dict[str, float]:
        """Sums of the counts over data-parallel ranks (the rejected counts rounded to whole tokens/sequences)."""
        red = MetricReducer()
        red.add_sum("rej_tok", round(counts["rej_tok"]))
        red.add_sum("tok", counts["tok"])
        red.add_sum("rej_seq", round(counts["rej_seq"]))
        red.add_sum("seq", counts["seq"])
        red.add_sum("kept", counts["kept"])
        return red.reduce(device)

    def _metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The logged fractions of global totals from :meth:`_reduce`."""
        p = self.prefix
        return {
            f"{p}/rejected_token_frac": totals["rej_tok"] / totals["tok"] if totals["tok"] else 0.0,
            f"{p}/rejected_seq_frac": totals["rej_seq"] / totals["seq"] if totals["seq"] else 0.0,
            f"{p}/empty_loss_frac": 1.0 if totals["kept"] == 0 else 0.0,
        }

    def _finish_step(self, trainer: Trainer, pl_module: LightningModule, totals: dict[str, float]) -> None:
        metrics = self._metrics(totals)
        self.rejected_tokens_total += totals["rej_tok"]
        self.tokens_total += totals["tok"]
        self.empty_steps += int(totals["kept"] == 0)
        self.steps += 1
        self.last_metrics = metrics
        log_scalars(trainer, pl_module, metrics)


def correction_callbacks(preset_name: str) -> list[RLCallback]:
    """The callbacks of a paper preset (appendix A.4), in the order they must run: optional token TIS, then
    sequence rejection. Names: ``srs-k3-corr-ratio``, ``srs-k3-ppo-ratio``, ``tis-srs-k3-corr-ratio``,
    ``tis-srs-k1-corr-ratio`` (``tau_tok = 2``, ``tau_seq = 0.001``; see ``functional.PRESETS``).
    ``configs/corrections/<name>.yaml`` holds the same list for LightningCLI."""
    tis, rejection = F.correction_preset(preset_name)
    callbacks: list[RLCallback] = []
    if tis is not None:
        callbacks.append(TruncatedIS(level=tis.level, cap=tis.cap))
    callbacks.append(
        RejectionSampling(
            signal=rejection.signal,
            granularity=rejection.granularity,
            estimator=rejection.estimator,
            threshold=rejection.threshold,
        )
    )
    return callbacks
