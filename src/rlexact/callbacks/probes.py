"""Mismatch and update-direction probes (paper §4.1, docs/design.md §6): thin adapters over ``callbacks.functional``.

:class:`MismatchProbe` measures training-inference mismatch on every rollout step (``on_rl_batch``) and the
surrogate contributions ``C(r_ppo^train)`` / ``C(r_ppo^rollout)`` on every PPO mini-step (``on_rl_minibatch``).
:class:`UpdateDirectionProbe` re-scores the trained batch through the generator after the update
(``on_rl_update_end``) and counts tokens whose log-prob moved against their advantage.

All statistics are taken over the raw response tokens (``batch.response_mask``), before any rejection, so the
probes see what the corrections act on; they never modify the batch. Values are reduced across data-parallel ranks
(sums and counts, then divided; maxima by ``MAX``) -- see :mod:`rlexact.callbacks.aggregation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from rlexact.callbacks import functional as F
from rlexact.callbacks.aggregation import MetricReducer, log_histograms, log_scalars
from rlexact.callbacks.base import RLCallback, require_trainer_logprobs, seqs_with_tokens
from rlexact.callbacks.routing import RouterDisagreement, RouterRecorder, router_disagreement
from rlexact.checks import boolean, choice, metric_prefix, positive_int

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from rlexact.batch import RolloutBatch

__all__ = ["MismatchProbe", "UpdateDirectionProbe", "policy_model", "rollout_kernels", "rollout_temperature"]


# ----------------------------------------------------------------------------------------------- module plumbing
def policy_model(pl_module: Any) -> torch.nn.Module | None:
    """The trained causal LM of an RL module (``.model``, ``.policy`` or the generator's ``.model``), else ``None``."""
    for owner, name in ((pl_module, "model"), (pl_module, "policy"), (getattr(pl_module, "generator", None), "model")):
        model = getattr(owner, name, None) if owner is not None else None
        if isinstance(model, torch.nn.Module):
            return model
    return None


def logprob_truncation(pl_module: Any) -> tuple[int, float]:
    """``(top_k, top_p)`` of the distribution the module's trainer-side log-probs describe:
    ``pl_module.logprob_truncation`` (:class:`rlexact.RLModule`: the sampling truncation with
    ``rollout.logprobs="sampled"``), else the same rule applied to ``pl_module.rollout_cfg``; ``(0, 1.0)`` (the full
    tempered softmax) when the module says neither."""
    value = getattr(pl_module, "logprob_truncation", None)
    if value is not None:
        top_k, top_p = value
        return int(top_k), float(top_p)
    cfg = getattr(pl_module, "rollout_cfg", None)
    if cfg is not None and getattr(cfg, "logprobs", "full") == "sampled":
        return int(cfg.top_k), float(cfg.top_p)
    return 0, 1.0


def rollout_temperature(pl_module: Any) -> float:
    """The temperature of the rollout's reported log-probs: ``pl_module.logprob_temperature`` (``RLModule``), else
    ``pl_module.rollout_cfg.temperature``; 1.0 if the module says neither."""
    value = getattr(pl_module, "logprob_temperature", None)
    if value is None:
        value = getattr(getattr(pl_module, "rollout_cfg", None), "temperature", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return 1.0


def rollout_kernels(pl_module: Any) -> str | None:
    """The generator's kernels (``"exact"``/``"native"``): ``pl_module.rollout_cfg.kernels``, else the existing
    generator's ``config.kernels``; ``None`` if unknown (the generator is never created just to ask)."""
    kernels = getattr(getattr(pl_module, "rollout_cfg", None), "kernels", None)
    if kernels is None and pl_module is not None:
        generator = pl_module.__dict__.get("_generator") if hasattr(pl_module, "__dict__") else None
        kernels = getattr(getattr(generator, "config", None), "kernels", None)
    return kernels if isinstance(kernels, str) else None


def _score_chunk(pl_module: Any) -> int | None:
    """Sequences per no-grad forward, as ``RLModule.score_batch`` chunks them (micro, else mini-batch size)."""
    algo = getattr(pl_module, "algo", None)
    for name in ("micro_batch_size", "mini_batch_size"):
        value = getattr(algo, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _module_call(model: torch.nn.Module, fn: Any) -> Any:
    """Run ``fn()`` as a forward of ``model`` the way the module does (an FSDP2 root call; a plain call otherwise).

    ``RLModule`` already keeps the parameters gathered around ``on_rl_batch`` / ``on_rl_update_end`` of callbacks
    that override them, and the generator gathers them itself, so no extra gathering here."""
    from rlexact.distributed import fsdp_call

    return fsdp_call(model, fn)


def _sequences(batch: RolloutBatch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens.tolist()
    return [batch.input_ids[s:e] for s, e in zip(cu[:-1], cu[1:])]


def _unpack_scores(scores: Sequence[torch.Tensor] | torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """Generator scores -> ``[T]`` fp32 aligned with ``batch.input_ids`` (0 on each sequence's first token).

    Accepts a packed ``[T]`` tensor or one tensor per sequence of length ``L`` (aligned) or ``L - 1`` (tokens 1..L-1,
    the :func:`rlexact.sequence_logprobs` convention)."""
    if isinstance(scores, torch.Tensor):
        if scores.shape != (batch.num_tokens,):
            raise ValueError(f"generator.score returned shape {tuple(scores.shape)}, expected ({batch.num_tokens},)")
        return scores.float()
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
    cu = batch.cu_seqlens.tolist()
    if len(scores) != len(cu) - 1:
        raise ValueError(f"generator.score returned {len(scores)} sequences, expected {len(cu) - 1}")
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        lp = torch.as_tensor(scores[i]).to(out.device, torch.float32).reshape(-1)
        if lp.numel() == e - s - 1:
            out[s + 1 : e] = lp
        elif lp.numel() == e - s:
            out[s:e] = lp
        else:
            raise ValueError(f"generator.score: sequence {i} has {e - s} tokens but {lp.numel()} log-probs")
    return out


# -------------------------------------------------------------------------------------------------- MismatchProbe
class MismatchProbe(RLCallback):
    """Per-rollout-step training-inference mismatch and per-mini-step surrogate contributions.

    ``on_rl_batch`` (needs ``batch.trainer_logprobs`` = pi_old^train; ``d = trainer - rollout = log r_corr`` over
    response tokens), metrics under ``<prefix>/`` (default ``mismatch/``):

    - ``bitwise_equal_frac``: fraction of response tokens whose two log-probs have identical bits (1.0 exact);
    - ``abs_diff_mean``, ``abs_diff_max``: of ``|d|``; ``prob_diff_max``: ``max |p_train - p_rollout|``;
    - ``argmax_flip_rate``: fraction of response positions whose top-1 token differs between the trainer and the
      generator numeric paths (``argmax=True``; see below);
    - ``k1_mean``, ``k2_mean``, ``k3_mean``: mean ``K(r_corr)``; ``chi2``: ``E[r_corr^2] - 1``;
      ``log_ppl_diff``: mean over sequences of ``log PPL_train - log PPL_rollout``; ``num_tokens``;
    - histograms ``delta_logp`` (``d``) and ``r_corr`` (``exp d``), raw, before any masking.

    ``on_rl_minibatch`` (``logprobs`` = pi_theta): ``C(r) = -(r - 1) A`` for ``r_ppo^train = pi_theta /
    pi_old^train`` and ``r_ppo^rollout = pi_theta / pi_old^rollout``, averaged over response tokens with ``A > 0`` and
    with ``A < 0`` (paper Fig. 5). Summed over every mini-step of the rollout step and logged in
    ``on_rl_update_end`` as ``c_ppo_train_pos``, ``c_ppo_train_neg``, ``c_ppo_rollout_pos``, ``c_ppo_rollout_neg``,
    with histograms ``r_ppo_train`` and ``r_ppo_rollout`` of all mini-steps' ratios. ``log_ministeps=True`` also
    writes each mini-step's four values to the loggers under ``<prefix>_ministep/`` at ``trainer.global_step`` (one
    optimizer step each); :attr:`last_minibatch_metrics` keeps them for the last rollout step.

    **Argmax flip rate.** The batch carries only the sampled tokens' log-probs, so the top-1 tokens are recomputed:
    trainer side by packed no-grad forwards of the policy (``rlexact.models.forward_hidden`` + ``head_logits``;
    sequences in chunks of the module's micro/mini-batch size, logits in row chunks of ``argmax_chunk_tokens``)
    with the model's current (trainer) kernels; rollout
    side by the same packed forward under the generator's kernels (``pl_module.rollout_cfg.kernels``), i.e. the
    generator's numeric path for a prefill of the sequence rather than the value seen at decode time (equal bit for
    bit in exact mode by the contract; under native kernels this captures the kernel difference, not
    decode-vs-prefill differences). When both paths use the same kernels one forward serves both and the rate is 0
    by construction. :class:`~rlexact.callbacks.injection.MismatchInjection` perturbs log-probs only, so it leaves
    the flip rate at 0. Without a policy model on the module the metric is skipped with a one-time warning.

    **Router mismatch** (Mixture-of-Experts policies, ``router=True``; silently skipped for dense models). The same
    forwards (one per kernel set, shared with the argmax when both are on) record, through forward hooks on every MoE
    router (:class:`~rlexact.callbacks.routing.RouterRecorder`), the experts selected for the row that scores each
    response token (the previous position, as for the argmax). A token disagrees in a layer when its expert *set*
    differs between the generator-kernel and trainer-kernel forwards:

    - ``router_token_disagree_frac``: fraction of those tokens that disagree in at least one MoE layer;
    - ``router_layer_disagree/<i>``: per MoE layer (``i`` = decoder layer index), the fraction that disagree there.

    Both are 0 by construction when the two sides use the same kernels (one forward serves both).

    Args:
        argmax: compute ``argmax_flip_rate`` (one or two extra no-grad forwards per rollout step).
        histograms: write TensorBoard histograms (when a ``TensorBoardLogger`` is attached).
        histogram_every_n_steps: histograms on one rollout step in ``n``.
        log_ministeps: also log each mini-step's contributions (under ``<prefix>_ministep/``).
        argmax_chunk_tokens: rows of ``[rows, V]`` logits materialized at once for the argmax.
        prefix: metric prefix (a non-empty string not ending with ``/``); two probes need different ones.
        router: compute the router mismatch metrics when the policy has MoE layers.

    The flags are bools and the counts positive ints; anything else is a ``ValueError`` naming the argument.
    """

    state_fields = (
        ("steps", int),
        ("tokens_total", float),
        ("unequal_tokens_total", float),
        ("abs_diff_max_seen", float),
    )

    needs_trainer_logprobs = True

    def __init__(
        self,
        argmax: bool = True,
        histograms: bool = True,
        histogram_every_n_steps: int = 1,
        log_ministeps: bool = False,
        argmax_chunk_tokens: int = 1024,
        prefix: str = "mismatch",
        router: bool = True,
    ) -> None:
        who = type(self).__name__
        flags = {"argmax": argmax, "histograms": histograms, "log_ministeps": log_ministeps, "router": router}
        for name, flag in flags.items():
            boolean(f"{who}: {name}", flag)
        positive_int(f"{who}: histogram_every_n_steps", histogram_every_n_steps)
        positive_int(f"{who}: argmax_chunk_tokens", argmax_chunk_tokens)
        metric_prefix(f"{who}: prefix", prefix)
        self.argmax = argmax
        self.histograms = histograms
        self.histogram_every_n_steps = histogram_every_n_steps
        self.log_ministeps = log_ministeps
        self.argmax_chunk_tokens = argmax_chunk_tokens
        self.prefix = prefix
        self.router = router
        self.steps = 0
        """Rollout steps probed (resumable)."""
        self.tokens_total = 0.0
        self.unequal_tokens_total = 0.0
        self.abs_diff_max_seen = 0.0
        self.last_metrics: dict[str, float] = {}
        self.last_minibatch_metrics: list[dict[str, float]] = []
        self._acc: dict[str, float] = {}
        self._ratios: dict[str, list[torch.Tensor]] = {}
        self._hist_now = False
        self._warned: set[str] = set()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return (self.prefix, f"{self.prefix}_ministep") if self.log_ministeps else (self.prefix,)

    # ---------------------------------------------------------------------------------------------- rollout step
    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        trainer_lp = require_trainer_logprobs(batch, type(self).__name__)
        rollout_lp = batch.rollout_logprobs
        mask = batch.response_mask
        p = self.prefix
        stats = F.mismatch_stats(rollout_lp, trainer_lp, mask, batch.cu_seqlens)
        n = stats["num_tokens"]
        n_seq = seqs_with_tokens(batch, mask)
        red = MetricReducer()
        red.add_mean(f"{p}/bitwise_equal_frac", stats["bitwise_equal_frac"], n, empty=1.0)
        red.add_mean(f"{p}/abs_diff_mean", stats["abs_diff_mean"], n)
        red.add_max(f"{p}/abs_diff_max", stats["abs_diff_max"] if n else None)
        red.add_max(f"{p}/prob_diff_max", stats["prob_diff_max"] if n else None)
        flips, routing = self._kernel_paths(pl_module, batch)
        if flips is not None:
            red.add_mean(f"{p}/argmax_flip_rate", flips, n)
        if routing is not None:
            dis, labels = routing
            red.add_mean(f"{p}/router_token_disagree_frac", dis.token_disagree_frac, dis.num_tokens)
            for label, frac in zip(labels, dis.layer_disagree_frac):
                red.add_mean(f"{p}/router_layer_disagree/{label}", frac, dis.num_tokens)
        for key in ("k1_mean", "k2_mean", "k3_mean"):
            red.add_mean(f"{p}/{key}", stats[key], n)
        red.add_mean(f"{p}/chi2", stats["chi2"], n)
        red.add_mean(f"{p}/log_ppl_diff", stats["log_ppl_diff"], n_seq)
        red.add_sum(f"{p}/num_tokens", n)
        metrics = red.reduce(rollout_lp.device)

        self.tokens_total += metrics[f"{p}/num_tokens"]
        self.unequal_tokens_total += round((1.0 - metrics[f"{p}/bitwise_equal_frac"]) * metrics[f"{p}/num_tokens"])
        self.abs_diff_max_seen = max(self.abs_diff_max_seen, metrics[f"{p}/abs_diff_max"])
        self.last_metrics = dict(metrics)
        log_scalars(trainer, pl_module, metrics)

        self._hist_now = self.histograms and self.steps % self.histogram_every_n_steps == 0
        if self._hist_now:
            d = F.signal_log_ratio("corr", rollout_logp=rollout_lp, old_logp=trainer_lp)[mask]
            log_histograms(trainer, {f"{p}/delta_logp": d, f"{p}/r_corr": d.exp()})
        self.steps += 1
        self._acc = {}
        self._ratios = {"r_ppo_train": [], "r_ppo_rollout": []}
        self.last_minibatch_metrics = []

    # ------------------------------------------------------------------------------------------------- mini-steps
    def on_rl_minibatch(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        minibatch: RolloutBatch,
        logprobs: torch.Tensor,
        epoch: int,
        step: int,
    ) -> None:
        mask = minibatch.response_mask
        adv = minibatch.advantages
        logp = logprobs.detach().float()
        refs = {"rollout": minibatch.rollout_logprobs}
        if minibatch.trainer_logprobs is not None:
            refs = {"train": minibatch.trainer_logprobs, **refs}
        red = MetricReducer()
        local: dict[str, float] = {}
        for side, ref in refs.items():
            log_r = logp - ref.detach().float()
            contrib = F.surrogate_contribution(log_r, adv)
            split = F.split_by_advantage_sign(contrib, adv, mask)
            for sign in ("pos", "neg"):
                key = f"c_ppo_{side}_{sign}"
                count = split[f"{sign}_count"]
                red.add_mean(key, split[sign], count)
                local[f"{key}/sum"] = split[sign] * count
                local[f"{key}/count"] = float(count)
            if self._hist_now:
                self._ratios.setdefault(f"r_ppo_{side}", []).append(log_r[mask].exp())
        for key, value in local.items():
            self._acc[key] = self._acc.get(key, 0.0) + value
        values = red.reduce(logp.device)
        self.last_minibatch_metrics.append({"epoch": float(epoch), "step": float(step), **values})
        if self.log_ministeps and trainer is not None:
            named = {f"{self.prefix}_ministep/{k}": v for k, v in values.items()}
            for logger in trainer.loggers:
                logger.log_metrics(named, step=int(trainer.global_step))

    def on_rl_update_end(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        if not self._acc:
            return
        red = MetricReducer()
        keys = sorted({k.rsplit("/", 1)[0] for k in self._acc})
        for key in keys:
            total, count = self._acc[f"{key}/sum"], self._acc[f"{key}/count"]
            red.add_mean(f"{self.prefix}/{key}", total / count if count else 0.0, count)
        metrics = red.reduce(batch.rollout_logprobs.device)
        self.last_metrics.update(metrics)
        log_scalars(trainer, pl_module, metrics)
        if self._hist_now:
            hist = {}
            for name in ("r_ppo_train", "r_ppo_rollout"):
                parts = self._ratios.get(name) or []
                values = torch.cat(parts) if parts else batch.rollout_logprobs.new_zeros(0)
                hist[f"{self.prefix}/{name}"] = values
            log_histograms(trainer, hist)
        self._acc = {}
        self._ratios = {}

    # ----------------------------------------------------------------------------------------------------- argmax
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, stacklevel=5)

    def _argmax_flip(self, pl_module: Any, batch: RolloutBatch) -> float | None:
        """Local argmax flip rate over response tokens (``None`` when the module has no exactified policy model)."""
        return self._kernel_paths(pl_module, batch, router=False)[0]

    def _kernel_paths(
        self, pl_module: Any, batch: RolloutBatch, router: bool | None = None
    ) -> tuple[float | None, tuple[RouterDisagreement, tuple[str, ...]] | None]:
        """Local argmax flip rate and router disagreement (with the MoE layer labels) between the generator-kernel
        and trainer-kernel forwards; ``None`` for what is off or not computable (no exactified policy model: a
        one-time warning when the argmax is on; a dense model: no router metrics). ``router`` overrides
        ``self.router``."""
        from rlexact.models import get_state, use_kernels
        from rlexact.models.moe import is_moe

        router = self.router if router is None else router
        if not (self.argmax or router):
            return None, None
        model = policy_model(pl_module)
        if model is None or get_state(model) is None:
            if self.argmax:
                self._warn_once(
                    "model", "MismatchProbe: no exactified policy model on the module; argmax_flip_rate is skipped"
                )
            return None, None
        router = router and is_moe(model)
        if not (self.argmax or router):
            return None, None
        # a response token that starts its sequence has no prediction row; it never happens with non-empty prompts
        mask = batch.response_mask & (batch.position_ids > 0)
        trainer_kernels = get_state(model).kernels
        gen_kernels = rollout_kernels(pl_module) or trainer_kernels
        chunk = _score_chunk(pl_module) or batch.num_seqs

        def side() -> tuple[torch.Tensor, RouterRecorder | None]:
            recorder = RouterRecorder(model) if router else None
            with recorder or nullcontext():
                tokens = self._argmax_tokens(model, batch, mask, chunk, recorder=recorder, head=self.argmax)
            return tokens, recorder

        trainer_side = _module_call(model, side)
        if gen_kernels == trainer_kernels:
            rollout_side = trainer_side
        else:
            with use_kernels(model, gen_kernels):
                rollout_side = _module_call(model, side)
        flips = F.argmax_flip_rate(rollout_side[0], trainer_side[0], mask) if self.argmax else None
        routing = None
        if rollout_side[1] is not None and trainer_side[1] is not None:
            dis = router_disagreement(rollout_side[1].ids, trainer_side[1].ids)
            routing = (dis, trainer_side[1].labels)
        return flips, routing

    @torch.no_grad()
    def _argmax_tokens(
        self,
        model: torch.nn.Module,
        batch: RolloutBatch,
        mask: torch.Tensor,
        chunk_seqs: int,
        recorder: RouterRecorder | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """``[T]`` int64: the top-1 next token predicted for every ``mask`` position (from the hidden state of the
        previous token), 0 elsewhere. Packed forwards over ``chunk_seqs`` sequences at a time, ``[rows, V]`` logits
        over ``argmax_chunk_tokens`` rows at a time. ``recorder`` (entered by the caller) records the MoE routing of
        those previous-token rows, in ``mask`` order; ``head=False`` skips the logits (all zeros returned)."""
        from rlexact.models import AttnMetadata, forward_hidden, head_logits

        out = torch.zeros_like(batch.input_ids)
        cu = batch.cu_seqlens.long().tolist()
        for first in range(0, batch.num_seqs, max(chunk_seqs, 1)):
            last = min(first + chunk_seqs, batch.num_seqs)
            lo, hi = cu[first], cu[last]
            if hi == lo or not bool(mask[lo:hi].any()):
                continue
            sub_cu = batch.cu_seqlens[first : last + 1] - batch.cu_seqlens[first]
            targets = torch.nonzero(mask[lo:hi]).squeeze(-1)
            if recorder is not None:
                recorder.select(targets - 1)
            hidden = forward_hidden(model, batch.input_ids[lo:hi], batch.position_ids[lo:hi], AttnMetadata(sub_cu))
            for rows in targets.split(self.argmax_chunk_tokens) if head else ():
                logits, _ = head_logits(model, hidden[rows - 1], 1.0)
                out[lo + rows] = logits.argmax(dim=-1)
        return out


# ------------------------------------------------------------------------------------------- UpdateDirectionProbe
class UpdateDirectionProbe(RLCallback):
    """Did the update move each token's generator log-prob in the direction of its advantage? (paper §4.1)

    In ``on_rl_update_end`` the trained batch's sequences are scored through the generator's numeric path with the
    *new* weights (``pl_module.generator.score(sequences, temperature)``, plus ``top_k=`` / ``top_p=`` when the
    module's log-probs describe a truncated distribution, see :meth:`score`) and compared with the log-probs before
    the update. Over response tokens with ``A != 0``, ``delta = logp_after - logp_before``; a token is misaligned when
    ``sign(delta) != sign(A)`` (an unchanged token counts as misaligned). The paper measures 17.3% misaligned with a
    non-exact engine and 0% with the exact one.

    ``before="rollout"`` (default) uses ``batch.rollout_logprobs``, what the generator reported while sampling (same
    numeric path, pre-update weights). ``before="rescore"`` instead scores the batch through the generator in
    ``on_rl_batch``, before any optimizer step (one more scoring pass; useful when the rollout log-probs were
    perturbed by :class:`~rlexact.callbacks.injection.MismatchInjection`, which the generator's re-scoring does
    not see). Note that with MismatchInjection and ``before="rollout"`` the measured misalignment includes the
    injected noise, as it would for an engine whose reported numbers are noisy but whose re-scoring is not.

    Logs ``<prefix>/misaligned_frac``, ``unchanged_frac``, ``misaligned_count``, ``num_tokens`` (``<prefix>`` =
    ``update_direction``; reduced across ranks) and keeps lifetime counts (``misaligned_total``, ``tokens_total``)
    in its state.

    Args:
        before: ``"rollout"`` or ``"rescore"``.
        every_n_steps: probe one rollout step in ``n`` (each costs a generator scoring pass).
        prefix: metric prefix (a non-empty string not ending with ``/``); two probes on one Trainer (e.g. both
            ``before`` choices) need different ones.
    """

    state_fields = (("steps_seen", int), ("misaligned_total", float), ("tokens_total", float))

    def __init__(self, before: str = "rollout", every_n_steps: int = 1, prefix: str = "update_direction") -> None:
        who = type(self).__name__
        choice(f"{who}: before", before, ("rollout", "rescore"))
        positive_int(f"{who}: every_n_steps", every_n_steps)
        metric_prefix(f"{who}: prefix", prefix)
        self.before = before
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.steps_seen = 0
        self.misaligned_total = 0.0
        self.tokens_total = 0.0
        self.last_metrics: dict[str, float] = {}
        self._before_lp: torch.Tensor | None = None
        self._active = False

    @property
    def state_key(self) -> str:
        """The checkpoint key; the prefix enters it only where it is not the default, so checkpoints written before
        the probe took a prefix restore its counters."""
        extra = {} if self.prefix == "update_direction" else {"prefix": self.prefix}
        return self._generate_state_key(before=self.before, every_n_steps=self.every_n_steps, **extra)

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return (self.prefix,)

    def score(self, pl_module: Any, batch: RolloutBatch) -> torch.Tensor:
        """``[T]`` fp32 log-probs of ``batch``'s tokens through the generator's numeric path (current weights), at
        the rollout temperature and with the module's truncation
        (:func:`logprob_truncation`: the sampling's top-k / top-p with
        ``rollout.logprobs="sampled"``), i.e. of the same distribution as ``batch.rollout_logprobs``."""

        generator = getattr(pl_module, "generator", None)
        if generator is None or not hasattr(generator, "score"):
            raise RuntimeError("UpdateDirectionProbe needs pl_module.generator with a score(sequences, temperature)")
        model = policy_model(pl_module)
        sequences = [seq.tolist() for seq in _sequences(batch)]
        temperature = rollout_temperature(pl_module)
        top_k, top_p = logprob_truncation(pl_module)
        truncation = {"top_k": top_k, "top_p": top_p} if (top_k, top_p) != (0, 1.0) else {}
        was_training = model.training if model is not None else False
        try:
            if model is not None:
                model.eval()  # as the module does around generate (no dropout: the numerics do not change)
            with torch.no_grad():
                if model is None:
                    scores = generator.score(sequences, temperature, **truncation)
                else:
                    scores = _module_call(model, lambda: generator.score(sequences, temperature, **truncation))
        finally:
            if model is not None:
                model.train(was_training)
        return _unpack_scores(scores, batch).to(batch.rollout_logprobs.device)

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        self._active = self.steps_seen % self.every_n_steps == 0
        self.steps_seen += 1
        self._before_lp = None
        if self._active and self.before == "rescore":
            self._before_lp = self.score(pl_module, batch)

    def on_rl_update_end(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        if not self._active:
            return
        before = self._before_lp if self._before_lp is not None else batch.rollout_logprobs
        after = self.score(pl_module, batch)
        stats = F.update_direction_stats(before, after, batch.advantages, batch.response_mask)
        n = stats["num_tokens"]
        p = self.prefix
        red = MetricReducer()
        red.add_mean(f"{p}/misaligned_frac", stats["misaligned_frac"], n)
        red.add_mean(f"{p}/unchanged_frac", stats["unchanged_frac"], n)
        red.add_sum(f"{p}/misaligned_count", round(stats["misaligned_frac"] * n))
        red.add_sum(f"{p}/num_tokens", n)
        metrics = red.reduce(after.device)
        self.misaligned_total += metrics[f"{p}/misaligned_count"]
        self.tokens_total += metrics[f"{p}/num_tokens"]
        self.last_metrics = metrics
        self._before_lp = None
        log_scalars(trainer, pl_module, metrics)
