"""Shadow mode: calibrate TIM corrections against the exact gradient, on the same batch, without applying them.

During an exact run (rollout log-probs equal to the trainer's bit for bit), :class:`ShadowCorrection` takes each
probed PPO mini-batch, pretends that the rollout engine had reported *mismatched* log-probs ``mu`` for the same
tokens, and computes the policy-gradient each chosen correction would produce from them. It compares each with the
exact gradient of the same mini-batch (the one the module applies) and logs the cosine similarity, the norm ratio and
the fraction of tokens the correction masks or clips. Nothing it computes reaches the optimizer.

What it measures, precisely. The tokens were sampled from the exact policy ``pi``; only the reported ``mu`` changes.
A correction's gradient on this batch is its distortion of the exact update caused by the mismatch signal it reads
(weights ``min(pi / mu, tau)``, masks from ``K(pi / mu)``, a PPO ratio ``pi_theta / mu`` in bypass mode). The
other effect of a real mismatch, samples drawn from ``mu`` instead of ``pi``, is not in the same batch and is not
measured here; run the arms of :mod:`rlexact.study` for it.

Mismatch sources (``mismatch``):

- ``"inject"``: ``mu = perturb(pi)`` with seeded noise of ``scale`` (:func:`rlexact.callbacks._extra.perturb_logprobs`,
  the same model as :class:`~rlexact.callbacks.injection.MismatchInjection`: ``target="logits"`` or ``"logprobs"``);
- ``"native"``: ``mu`` = the packed forward of the policy under the stock (native) kernels, i.e. the log-probs a
  non-exact engine computes for the same tokens (a prefill, not the decode-time values);
- a callable ``(pl_module, minibatch) -> [T] fp32``: any other engine (e.g. a lower-precision copy of the weights).

Corrections (names of :data:`SHADOW_CORRECTIONS`): ``"none"`` (recompute, no correction), ``"bypass"``
(``pi_old = mu``), ``"tis"`` (token TIS, ``tau = 2``, recompute) and the paper's four presets
(``functional.PRESETS``, recompute). Each one is a :class:`ShadowSpec`; pass specs for other settings.

Every log-prob the shadow computes is the trainer's (:func:`module_logprobs`): the rollout temperature and, with
``rollout.logprobs="sampled"``, the sampling's top-k / top-p truncation, so its exact gradient is the one the module
applies and a ``"native"`` ``mu`` describes the same (truncated) distribution as the rollout log-probs.

Exactness of the comparison: with no mismatch (``mu`` bitwise equal to ``pi``) every correction leaves the loss
unchanged bit for bit (weights exactly 1, no token masked, ``pi_old`` unchanged), so its gradient equals the exact
gradient bit for bit and :func:`gradient_agreement` returns a cosine and a norm ratio of exactly 1.0. The one
exception is a rejection on the ``"ppo"`` signal after the first mini-step of a rollout step: ``pi_theta / mu`` then
also measures the policy's own movement, so it drops sequences without any mismatch.

Scope: the policy-gradient term only (KL and entropy terms are the same for every correction and left out); one
process (the dot products are not reduced across data-parallel ranks: a clear error under ``torch.distributed``).
``mu`` is computed once per probed rollout step, in ``on_rl_batch`` at the rollout weights (for ``"native"`` and
callables one no-grad scoring pass of the batch), and gathered for each mini-batch by matching its sequences. Cost per
probed mini-step: one forward with grad and ``1 + len(corrections)`` backward passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from rlexact.algorithms.aggregation import aggregate_loss
from rlexact.callbacks import functional as F
from rlexact.callbacks._extra import InjectionTarget, keyed_normal, perturb_logprobs
from rlexact.callbacks.aggregation import dist_ready, log_scalars
from rlexact.callbacks.base import RLCallback, require_trainer_logprobs
from rlexact.callbacks.probes import logprob_truncation, policy_model, rollout_temperature
from rlexact.checks import boolean, choice, finite, integer, metric_prefix, positive_int
from rlexact.logprobs import Packed, packed_logprobs

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from rlexact.batch import RolloutBatch

__all__ = [
    "SHADOW_CORRECTIONS",
    "MismatchSource",
    "ShadowCorrection",
    "ShadowSpec",
    "corrected_batch",
    "flat_grad",
    "gradient_agreement",
    "logprob_truncation",
    "module_logprobs",
    "policy_gradient_loss",
    "shadow_spec",
]

MismatchSource = Literal["inject", "native"] | Callable[[Any, "RolloutBatch"], Tensor]


@dataclass(frozen=True)
class ShadowSpec:
    """One correction as the shadow computes it: which ``pi_old`` the PPO ratio uses, and the TIS / rejection specs.

    ``mode="recompute"``: ``pi_old = pi_old^train`` (the batch's trainer log-probs); ``"bypass"``: ``pi_old = mu``
    (the mismatched rollout log-probs). ``tis`` / ``rejection`` read ``r_corr = pi_old^train / mu`` (and
    ``r_ppo^rollout = pi_theta / mu`` for a ``"ppo"`` rejection signal), as the callbacks of
    :mod:`rlexact.callbacks.corrections` do.
    """

    mode: Literal["recompute", "bypass"] = "recompute"
    tis: F.TISSpec | None = None
    rejection: F.RejectionSpec | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("recompute", "bypass"):
            raise ValueError(f"ShadowSpec.mode must be 'recompute' or 'bypass', got {self.mode!r}")


SHADOW_CORRECTIONS: dict[str, ShadowSpec] = {
    "none": ShadowSpec("recompute"),
    "bypass": ShadowSpec("bypass"),
    "tis": ShadowSpec("recompute", tis=F.TISSpec("token", 2.0)),
    **{name: ShadowSpec("recompute", tis=tis, rejection=rs) for name, (tis, rs) in F.PRESETS.items()},
}
"""Named corrections: no correction (recompute), bypass, token TIS (``tau = 2``) and the paper's four presets."""


def shadow_spec(name: str) -> ShadowSpec:
    """The :class:`ShadowSpec` of a name in :data:`SHADOW_CORRECTIONS`; ``ValueError`` listing the names if unknown."""
    try:
        return SHADOW_CORRECTIONS[name]
    except KeyError:
        raise ValueError(f"unknown shadow correction {name!r}; expected one of {sorted(SHADOW_CORRECTIONS)}") from None


# ------------------------------------------------------------------------------------------------ pure functions
def flat_grad(grads: Sequence[Tensor | None], params: Sequence[Tensor]) -> Tensor:
    """Concatenate per-parameter gradients into one float32 vector (``None`` -> zeros of the parameter's size)."""
    if len(grads) != len(params):
        raise ValueError(f"got {len(grads)} gradients for {len(params)} parameters")
    parts = [
        (torch.zeros(p.numel(), dtype=torch.float32, device=p.device) if g is None else g.detach().reshape(-1).float())
        for g, p in zip(grads, params)
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


def gradient_agreement(grad: Tensor, ref: Tensor) -> dict[str, float]:
    """Cosine similarity and norm ratio of a gradient vector to a reference gradient vector (float64 arithmetic).

    ``cosine = <g, r> / sqrt(<g, g> <r, r>)`` and ``norm_ratio = sqrt(<g, g> / <r, r>)``. For ``grad`` bitwise equal
    to ``ref`` both are exactly 1.0 (the three dot products are one computation, and ``sqrt(x * x) == x`` in IEEE
    arithmetic). A zero vector has no direction: its cosine is 0.0 (1.0 if both are zero), and its norm ratio is 0.0
    (``inf`` for a zero ``ref`` and a non-zero ``grad``, 1.0 if both are zero).
    """
    if grad.shape != ref.shape or grad.dim() != 1:
        raise ValueError(f"need two 1-D vectors of one shape, got {tuple(grad.shape)} and {tuple(ref.shape)}")
    g, r = grad.double(), ref.double()
    gg, rr, gr = float(g @ g), float(r @ r), float(g @ r)
    if gg == 0.0 or rr == 0.0:
        both = gg == 0.0 and rr == 0.0
        return {"cosine": 1.0 if both else 0.0, "norm_ratio": 1.0 if both else (0.0 if gg == 0.0 else float("inf"))}
    return {"cosine": gr / (gg * rr) ** 0.5, "norm_ratio": (gg / rr) ** 0.5}


def corrected_batch(
    spec: ShadowSpec, batch: RolloutBatch, mismatched_logp: Tensor, logp: Tensor | None = None
) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch the loss would see under ``spec`` if the engine had reported ``mismatched_logp`` (``mu``).

    ``batch`` must carry ``trainer_logprobs`` (pi_old^train). Returns a new batch (``batch`` is not modified) whose
    ``rollout_logprobs`` is ``mu``, ``old_logprobs`` is pi_old^train (recompute) or ``mu`` (bypass),
    ``token_weights`` are multiplied by the TIS weights and ``loss_mask`` is ANDed with the rejection's keep-mask,
    plus ``{"masked_frac", "tis_truncated_frac", "tis_weight_mean"}`` over the response tokens. ``logp`` (current
    pi_theta, detached) is needed by a ``"ppo"`` rejection signal only.
    """
    trainer_lp = require_trainer_logprobs(batch, "corrected_batch")
    mask = batch.response_mask
    mu = mismatched_logp.detach().to(batch.rollout_logprobs.dtype)
    weights, keep, info = F.apply_correction(
        spec.tis,
        spec.rejection,
        rollout_logp=mu,
        old_logp=trainer_lp,
        cu_seqlens=batch.cu_seqlens,
        mask=mask,
        logp=logp,
    )
    n = int(mask.sum())
    kept = batch.loss_mask & keep
    out = replace(
        batch,
        rollout_logprobs=mu,
        old_logprobs=(trainer_lp if spec.mode == "recompute" else mu).clone(),
        token_weights=batch.token_weights * weights.to(batch.token_weights.dtype),
        loss_mask=kept,
    )
    w = weights.double()
    stats = {
        "masked_frac": float((mask & ~keep).sum()) / n if n else 0.0,
        "tis_truncated_frac": float(info.get("tis/truncated_frac", 0.0)),
        "tis_weight_mean": float(w[mask].mean()) if n else 1.0,
    }
    return out, stats


def policy_gradient_loss(pl_module: Any, batch: RolloutBatch, logp: Tensor) -> tuple[Tensor, Tensor]:
    """The module's policy-gradient loss of ``batch`` at log-probs ``logp`` (with grad) and its ``[T]`` bool mask of
    PPO-clipped tokens: ``pl_module.policy_loss`` aggregated by ``pl_module.algo.loss_agg_mode`` over
    ``batch.loss_mask`` with ``batch.token_weights``, as :class:`rlexact.RLModule` forms it (KL and entropy terms
    excluded)."""
    policy_loss = getattr(pl_module, "policy_loss", None)
    algo = getattr(pl_module, "algo", None)
    if policy_loss is None or algo is None:
        raise TypeError(
            f"ShadowCorrection needs an rlexact.RLModule (policy_loss and algo); got {type(pl_module).__name__}"
        )
    tok, info = policy_loss(batch, logp)
    loss = aggregate_loss(
        tok,
        batch.loss_mask,
        batch.cu_seqlens,
        algo.loss_agg_mode,
        token_weights=batch.token_weights,
        norm_length=int(pl_module.rollout_cfg.max_new_tokens),
    )
    return loss, info["clipped"].bool()


# -------------------------------------------------------------------------------------------------- the callback
class ShadowCorrection(RLCallback):
    """Per probed mini-step of an exact run: the gradient each correction would give under a mismatch, vs exact.

    Logs, for every correction ``<name>`` (``<prefix>`` = ``shadow``): ``<prefix>/<name>/cosine`` and
    ``norm_ratio`` (to the exact gradient of the same mini-batch), ``masked_frac`` (response tokens its rejection
    drops), ``tis_truncated_frac``, ``tis_weight_mean`` and ``ppo_clipped_frac`` (loss tokens whose PPO ratio is
    clipped); once per probe ``<prefix>/exact_grad_norm`` and the mismatch itself, ``<prefix>/mismatch_k3_mean`` and
    ``<prefix>/mismatch_abs_diff_mean`` (of ``pi_old^train`` vs ``mu``). :attr:`history` keeps every probe's values.

    Args:
        corrections: names of :data:`SHADOW_CORRECTIONS` or a ``{name: ShadowSpec}`` mapping.
        mismatch: ``"inject"``, ``"native"`` or a callable (see the module docstring).
        scale: ``"inject"``: noise standard deviation; ``target``: ``"logits"`` or ``"logprobs"``; ``seed``: its
            base seed (draws keyed by ``(seed, probe index)``).
        every_n_steps: probe one rollout step in ``n``.
        all_ministeps: probe every PPO mini-step of a probed rollout step (default: only the first, where
            ``pi_theta == pi_old`` and the comparison is cleanest).
        prefix: metric prefix (a non-empty string not ending with ``/``).

    Arguments of the wrong type or out of range raise ``ValueError`` naming them (``TypeError`` for a mapping value
    that is not a :class:`ShadowSpec`). :meth:`check` refuses a Trainer of more than one process.
    """

    state_fields = (("steps_seen", int), ("probes", int))

    needs_trainer_logprobs = True

    def __init__(
        self,
        corrections: Sequence[str] | Mapping[str, ShadowSpec] = tuple(SHADOW_CORRECTIONS),
        mismatch: MismatchSource = "inject",
        scale: float = 0.1,
        target: InjectionTarget = "logits",
        seed: int = 0,
        every_n_steps: int = 1,
        all_ministeps: bool = False,
        prefix: str = "shadow",
    ) -> None:
        who = type(self).__name__
        if isinstance(corrections, str):
            raise ValueError(f"{who}: corrections must be a list of names, got the string {corrections!r}")
        if isinstance(corrections, Mapping):
            self.specs = dict(corrections)
        else:
            try:
                self.specs = {name: shadow_spec(name) for name in corrections}
            except ValueError as e:
                raise ValueError(f"{who}: {e}") from None
        if not self.specs:
            raise ValueError(f"{who}: corrections must name at least one correction")
        for name, spec in self.specs.items():
            if not isinstance(spec, ShadowSpec):
                raise TypeError(f"{who}: correction {name!r} must be a ShadowSpec, got {type(spec).__name__}")
        if not (callable(mismatch) or mismatch in ("inject", "native")):
            raise ValueError(f"{who}: mismatch must be 'inject', 'native' or a callable, got {mismatch!r}")
        choice(f"{who}: target", target, ("logits", "logprobs"))
        finite(f"{who}: scale", scale, low=0.0)
        integer(f"{who}: seed", seed)
        positive_int(f"{who}: every_n_steps", every_n_steps)
        boolean(f"{who}: all_ministeps", all_ministeps)
        metric_prefix(f"{who}: prefix", prefix)
        self.mismatch = mismatch
        self.scale = float(scale)
        self.target = target
        self.seed = seed
        self.every_n_steps = every_n_steps
        self.all_ministeps = all_ministeps
        self.prefix = prefix
        self.steps_seen = 0
        """Rollout steps seen so far; keys the injected noise (resumable)."""
        self.probes = 0
        """Mini-steps probed so far."""
        self.history: list[dict[str, float]] = []
        self.last_metrics: dict[str, float] = {}
        self.last_mismatched_logprobs: Tensor | None = None
        """``mu`` of the last probed mini-batch (for inspection and tests)."""
        self._active = False
        self._warned = False
        self._mu: Tensor | None = None
        self._index: dict[tuple[int, ...], list[int]] = {}

    @property
    def state_key(self) -> str:
        mismatch = self.mismatch if isinstance(self.mismatch, str) else getattr(self.mismatch, "__name__", "callable")
        return self._generate_state_key(mismatch=mismatch, scale=self.scale, seed=self.seed, prefix=self.prefix)

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return (self.prefix,)

    @override
    def check(self, trainer: Trainer | None, pl_module: Any) -> None:
        """Also refuses a Trainer of more than one process (the gradient dot products are not reduced across
        ranks)."""
        super().check(trainer, pl_module)
        if trainer is not None and trainer.world_size > 1:
            raise ValueError(
                f"ShadowCorrection runs in one process (its gradient dot products are not reduced across ranks), "
                f"and this Trainer has {trainer.world_size}: calibrate on a single device"
            )

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        if dist_ready():
            raise RuntimeError(
                "ShadowCorrection runs in one process (its gradient dot products are not reduced across ranks); "
                "calibrate on a single device"
            )
        self._active = self.steps_seen % self.every_n_steps == 0
        self._mu, self._index = None, {}
        if self._active:  # mu at the rollout weights, before any optimizer step of this rollout
            self._mu = self.mismatched_logprobs(pl_module, batch, key=self.steps_seen)
            self._index = _sequence_index(batch)
        self.steps_seen += 1
        trainer_lp = require_trainer_logprobs(batch, type(self).__name__)
        mask = batch.response_mask
        if self._active and not self._warned and not torch.equal(trainer_lp[mask], batch.rollout_logprobs[mask]):
            self._warned = True
            rank_zero_warn(
                "ShadowCorrection: the rollout log-probs differ from the trainer's in this run, so its reference "
                "gradient is this run's, not the exact one; run the calibration with exact kernels and no injection"
            )

    def on_rl_minibatch(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        minibatch: RolloutBatch,
        logprobs: Tensor,
        epoch: int,
        step: int,
    ) -> None:
        if not self._active or (not self.all_ministeps and (epoch, step) != (0, 0)):
            return
        if not bool(minibatch.response_mask.any()):
            return
        metrics = self.probe(pl_module, minibatch, logprobs, self._minibatch_mu(minibatch))
        self.last_metrics = metrics
        self.history.append(
            {"rollout_step": float(self.steps_seen - 1), "epoch": float(epoch), "ministep": float(step), **metrics}
        )
        log_scalars(trainer, pl_module, metrics)

    # ----------------------------------------------------------------------------------------------------- probe
    def mismatched_logprobs(self, pl_module: Any, batch: RolloutBatch, key: int = 0) -> Tensor:
        """``mu [T]`` fp32 for ``batch`` from the configured source, with the policy's *current* weights (the callback
        calls it in ``on_rl_batch``, at the rollout weights). ``key`` keys the ``"inject"`` noise with the seed."""
        trainer_lp = require_trainer_logprobs(batch, type(self).__name__)
        if self.mismatch == "inject":
            noise = self.scale * keyed_normal(batch.num_tokens, self.seed, key)
            return perturb_logprobs(trainer_lp, noise.to(trainer_lp.device), batch.response_mask, self.target)
        if self.mismatch == "native":
            from rlexact.models import use_kernels

            model = self._model(pl_module)
            with torch.no_grad(), use_kernels(model, "native"):
                return module_logprobs(pl_module, model, batch)
        mu = self.mismatch(pl_module, batch)
        if not isinstance(mu, Tensor) or mu.shape != (batch.num_tokens,):
            shape = tuple(mu.shape) if isinstance(mu, Tensor) else type(mu).__name__
            raise ValueError(f"the mismatch callable returned {shape}, expected a [{batch.num_tokens}] tensor")
        return mu.detach().float().to(trainer_lp.device)

    def _minibatch_mu(self, minibatch: RolloutBatch) -> Tensor:
        """The rollout step's ``mu`` gathered for the mini-batch's sequences (matched by their tokens; identical
        sequences take the batch's copies in order)."""
        if self._mu is None:
            raise RuntimeError("ShadowCorrection: on_rl_minibatch before on_rl_batch of the rollout step")
        queues = {key: list(starts) for key, starts in self._index.items()}
        out = torch.zeros(minibatch.num_tokens, dtype=torch.float32, device=self._mu.device)
        cu = minibatch.cu_seqlens.tolist()
        ids = minibatch.input_ids.tolist()  # one device-to-host copy for the whole mini-batch
        for s, e in zip(cu[:-1], cu[1:]):
            starts = queues.get(tuple(ids[s:e]))
            if not starts:
                raise RuntimeError("ShadowCorrection: a mini-batch sequence is not in the rollout batch")
            start = starts.pop(0)
            out[s:e] = self._mu[start : start + e - s]
        return out

    def probe(
        self, pl_module: Any, batch: RolloutBatch, logprobs: Tensor, mu: Tensor | None = None
    ) -> dict[str, float]:
        """Compute every correction's gradient on ``batch`` under the mismatch ``mu`` (default: computed now with
        the current weights, key 0) and compare each with the exact gradient of the same batch."""
        model = self._model(pl_module)
        params = [p for p in model.parameters() if p.requires_grad]
        mu = self.mismatched_logprobs(pl_module, batch) if mu is None else mu
        self.probes += 1
        self.last_mismatched_logprobs = mu
        mask = batch.response_mask
        log_r = (require_trainer_logprobs(batch, type(self).__name__).float() - mu.float())[mask]
        p = self.prefix
        metrics = {
            f"{p}/mismatch_k3_mean": float(F.k3(log_r).double().mean()) if log_r.numel() else 0.0,
            f"{p}/mismatch_abs_diff_mean": float(log_r.double().abs().mean()) if log_r.numel() else 0.0,
        }
        variants = {name: corrected_batch(spec, batch, mu, logprobs) for name, spec in self.specs.items()}
        with torch.enable_grad():
            logp = module_logprobs(pl_module, model, batch)
            ref_loss, _ = policy_gradient_loss(pl_module, batch, logp)
            ref = flat_grad(torch.autograd.grad(ref_loss, params, retain_graph=True, allow_unused=True), params)
            metrics[f"{p}/exact_grad_norm"] = float(ref.double().norm())
            names = list(variants)
            for i, name in enumerate(names):
                shadow_batch, stats = variants[name]
                loss, clipped = policy_gradient_loss(pl_module, shadow_batch, logp)
                keep = i < len(names) - 1
                grad = flat_grad(torch.autograd.grad(loss, params, retain_graph=keep, allow_unused=True), params)
                agreement = gradient_agreement(grad, ref)
                n_loss = int(shadow_batch.loss_mask.sum())
                metrics.update({f"{p}/{name}/{key}": value for key, value in {**agreement, **stats}.items()})
                metrics[f"{p}/{name}/ppo_clipped_frac"] = (
                    float((clipped & shadow_batch.loss_mask).sum()) / n_loss if n_loss else 0.0
                )
        return metrics

    @staticmethod
    def _model(pl_module: Any) -> torch.nn.Module:
        model = policy_model(pl_module)
        if model is None:
            raise RuntimeError("ShadowCorrection needs the policy model on the module (pl_module.model)")
        return model


def module_logprobs(pl_module: Any, model: torch.nn.Module, batch: RolloutBatch) -> Tensor:
    """``[T]`` fp32 log-probs of ``batch``'s response tokens under ``model`` as the module's trainer computes them
    (prompt entries 0): one packed forward at the rollout temperature
    (:func:`~rlexact.callbacks.probes.rollout_temperature`) and the module's truncation (:func:`logprob_truncation`).
    Differentiable when grad is enabled."""
    packed = Packed(batch.input_ids, batch.position_ids, batch.cu_seqlens)
    top_k, top_p = logprob_truncation(pl_module)
    temperature = rollout_temperature(pl_module)
    return packed_logprobs(model, packed, temperature, top_k=top_k, top_p=top_p, mask=batch.response_mask)[0]


def _sequence_index(batch: RolloutBatch) -> dict[tuple[int, ...], list[int]]:
    """``{token tuple: [start offsets in the packed batch]}`` of every sequence of ``batch``, in batch order."""
    index: dict[tuple[int, ...], list[int]] = {}
    cu = batch.cu_seqlens.tolist()
    ids = batch.input_ids.tolist()  # one device-to-host copy for the whole batch
    for s, e in zip(cu[:-1], cu[1:]):
        index.setdefault(tuple(ids[s:e]), []).append(s)
    return index
