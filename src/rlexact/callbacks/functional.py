"""The math behind the mismatch probes and the TIM corrections (pure torch; callbacks are thin adapters over it).

Notation (paper §2 and §4, docs/design.md §6). Per response token ``t`` of sequence ``i``: ``pi_theta`` is the current
policy (trainer), ``pi_old^rollout`` the behaviour policy that sampled the token (generator) and ``pi_old^train`` the
trainer at the rollout weights. Ratios, always handled as float32 *log* ratios:

- ``log r_corr = trainer_logp - rollout_logp`` (``r_corr = pi_old^train / pi_old^rollout``; 1 under exactness),
- ``log r_ppo^rollout = logp - rollout_logp`` (``pi_theta / pi_old^rollout``).

KL estimators of a ratio ``r``: ``K1 = -log r``, ``K2 = (log r)^2 / 2``, ``K3 = (r - 1) - log r``; for
``r = r_corr`` their means estimate KL(pi_rollout || pi_train). ``K2, K3 >= 0``; ``K1`` is signed.

Tensors are packed token streams: per-token ``[T]``, ``cu_seqlens`` int ``[B + 1]``, ``mask`` bool ``[T]`` (True =
token is measured / corrected, normally the response tokens). Values at unmasked positions are never read (they
are selected away with ``torch.where``), so they may hold anything, NaN included. Scalar statistics come back as
Python floats/ints (one host sync per call) and are NaN-free: an empty selection yields the neutral value each
function documents. Functions whose masks or weights would be silently wrong on NaN (a NaN comparison is False)
raise ``ValueError`` naming the first bad index instead.

Names of the same quantities elsewhere (mismatch_stats keys): verl ``rollout_corr/kl`` = ``k1_mean``,
``rollout_corr/k3_kl`` = ``k3_mean``, ``rollout_corr/chi2_token`` = ``chi2``, ``rollout_corr/log_ppl_diff`` =
``log_ppl_diff``, ``training/rollout_probs_diff_max`` = ``prob_diff_max``; TRL
``sampling/sampling_logp_difference/mean|max`` = ``abs_diff_mean|abs_diff_max`` and
``sampling/importance_sampling_ratio/*`` ~ :func:`tis_weights` info; slime ``train_rollout_logprob_abs_diff`` =
``abs_diff_mean``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlexact.algorithms.aggregation import (
    require_aligned,
    require_bool_mask,
    require_finite,
    segment_ids,
    segment_sum,
)
from rlexact.algorithms.losses import LOG_RATIO_CLAMP
from rlexact.checks import finite

__all__ = [
    "BIT_VIEWS",
    "ESTIMATORS",
    "PRESETS",
    "Estimator",
    "Granularity",
    "RejectionSpec",
    "Signal",
    "TISLevel",
    "TISSpec",
    "apply_correction",
    "argmax_flip_rate",
    "correction_preset",
    "k1",
    "k2",
    "k3",
    "mismatch_stats",
    "rejection_mask",
    "signal_log_ratio",
    "split_by_advantage_sign",
    "surrogate_contribution",
    "tis_weights",
    "update_direction_stats",
]

Estimator = Literal["k1", "k2", "k3"]
Granularity = Literal["token", "sequence_sum", "sequence_mean", "sequence_max"]
TISLevel = Literal["token", "sequence"]
Signal = Literal["corr", "ppo"]

BIT_VIEWS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
"""The signed integer dtype of the same width as each float dtype: ``t.view(BIT_VIEWS[t.dtype])`` exposes its bits."""


# --------------------------------------------------------------------------------------------------- estimators
def k1(log_r: Tensor) -> Tensor:
    """``K1(r) = -log r`` elementwise, float32 (signed)."""
    return -log_r.float()


def k2(log_r: Tensor) -> Tensor:
    """``K2(r) = (log r)^2 / 2`` elementwise, float32 (>= 0)."""
    lr = log_r.float()
    return 0.5 * lr * lr


def k3(log_r: Tensor) -> Tensor:
    """``K3(r) = (r - 1) - log r`` elementwise, float32 (>= 0; ``r - 1`` as ``expm1(log r)``)."""
    lr = log_r.float()
    return torch.expm1(lr) - lr


ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3}
"""Estimator name -> function of a log ratio."""


def surrogate_contribution(log_r: Tensor, advantages: Tensor) -> Tensor:
    """Per-token surrogate contribution ``C(r) = -(r - 1) * A`` ``[T]`` float32 (paper §4.1, Fig. 5).

    Same gradient as the ``-r A`` objective but zero at ``r = 1``; the probe evaluates it for ``r_ppo^train`` and
    ``r_ppo^rollout`` and splits it by advantage sign with :func:`split_by_advantage_sign`.
    """
    require_aligned(log_r=log_r, advantages=advantages)
    return -torch.expm1(log_r.float()) * advantages.float()


# ------------------------------------------------------------------------------------------------------ helpers
def _sum(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, 0.0).sum()


def _check_estimator(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ESTIMATORS)}, got {estimator!r}")


def _check_rejection(granularity: str, estimator: str, threshold: float) -> None:
    valid = ("token", "sequence_sum", "sequence_mean", "sequence_max")
    if granularity not in valid:
        raise ValueError(f"granularity must be one of {list(valid)}, got {granularity!r}")
    _check_estimator(estimator)
    finite("threshold", threshold)
    if estimator != "k1" and threshold < 0:
        raise ValueError(
            f"threshold {threshold} < 0 with non-negative estimator {estimator!r} would reject every token"
        )


def _check_tis(level: str, cap: float) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"TIS level must be 'token' or 'sequence', got {level!r}")
    if not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(f"TIS cap must be finite and >= 1 (a cap below 1 truncates matched tokens), got {cap}")


# ------------------------------------------------------------------------------------------------------- probes
def split_by_advantage_sign(values: Tensor, advantages: Tensor, mask: Tensor) -> dict[str, float | int]:
    """Mean of ``values`` over masked tokens with ``A > 0`` and with ``A < 0`` (``A == 0`` is in neither).

    Returns ``{"pos": float, "neg": float, "pos_count": int, "neg_count": int}``; an empty side has mean 0.0.
    Raises ``ValueError`` on a non-finite advantage or value at a masked token.
    """
    num_tokens = require_aligned(values=values, advantages=advantages)
    require_bool_mask("mask", mask, num_tokens)
    require_finite("advantages", advantages, mask)
    pos = mask & (advantages > 0)
    neg = mask & (advantages < 0)
    require_finite("values", values, pos | neg)
    v = values.detach().float()
    pos_sum, pos_n, neg_sum, neg_n = torch.stack([_sum(v, pos), pos.sum(), _sum(v, neg), neg.sum()]).tolist()
    return {
        "pos": pos_sum / pos_n if pos_n else 0.0,
        "neg": neg_sum / neg_n if neg_n else 0.0,
        "pos_count": int(pos_n),
        "neg_count": int(neg_n),
    }


def mismatch_stats(
    rollout_logp: Tensor, trainer_logp: Tensor, mask: Tensor, cu_seqlens: Tensor
) -> dict[str, float | int]:
    """Training-inference mismatch of the sampled tokens' log-probs, over the masked tokens.

    Args:
        rollout_logp: ``[T]`` log pi_rollout reported by the generator.
        trainer_logp: ``[T]`` log pi_train of the same tokens, same dtype as ``rollout_logp``.
        mask: bool ``[T]`` tokens to measure (the raw response mask, before any rejection).
        cu_seqlens: int ``[B + 1]``.

    Returns (with ``d = trainer_logp - rollout_logp = log r_corr`` in float32, means over masked tokens):
        ``bitwise_equal_frac``: fraction of tokens whose two values have identical bit patterns (compared through
        an integer view, so ``-0.0 != 0.0`` and equal NaN payloads match); ``abs_diff_mean``, ``abs_diff_max``:
        of ``|d|``; ``prob_diff_max``: ``max |exp(trainer) - exp(rollout)|``; ``k1_mean``, ``k2_mean``,
        ``k3_mean``: of ``K(r_corr)``; ``chi2``: verl's ``chi2_token = E[r_corr^2] - 1`` (``log r_corr`` clamped to
        ``+-LOG_RATIO_CLAMP`` = +-20 first; equals ``E[(r_corr - 1)^2]`` in expectation under pi_rollout, where
        ``E[r_corr] = 1``);
        ``log_ppl_diff``: mean over sequences with masked tokens of
        ``mean_t(logp_rollout) - mean_t(logp_trainer)`` = ``log PPL_train - log PPL_rollout`` (verl's sign;
        positive when the trainer assigns lower probability than the generator); ``num_tokens``.
        With ``rollout_logp`` and ``trainer_logp`` bitwise equal and finite, every difference statistic is
        exactly 0.0 and ``bitwise_equal_frac`` exactly 1.0. With no masked token all statistics are 0.0 except
        ``bitwise_equal_frac = 1.0`` (vacuous). NaN inputs are not rejected: they show up as NaN statistics.
    """
    num_tokens = require_aligned(rollout_logp=rollout_logp, trainer_logp=trainer_logp)
    require_bool_mask("mask", mask, num_tokens)
    if rollout_logp.dtype != trainer_logp.dtype:
        raise ValueError(f"dtype mismatch: rollout_logp {rollout_logp.dtype} vs trainer_logp {trainer_logp.dtype}")
    if rollout_logp.dtype not in BIT_VIEWS:
        raise ValueError(f"log-probs must be float16/bfloat16/float32/float64, got {rollout_logp.dtype}")
    seg = segment_ids(cu_seqlens, num_tokens)
    num_seqs = cu_seqlens.numel() - 1
    bits = BIT_VIEWS[rollout_logp.dtype]
    rollout, trainer = rollout_logp.detach(), trainer_logp.detach()
    same_bits = rollout.view(bits) == trainer.view(bits)
    a, b = rollout.float(), trainer.float()
    d = torch.where(mask, b - a, 0.0)
    n = mask.sum()
    denom = n.clamp(min=1).float()
    abs_d = d.abs()
    prob_diff = torch.where(mask, (b.exp() - a.exp()).abs(), 0.0)
    rho_sq = torch.where(mask, d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().square(), 0.0)
    seq_count = segment_sum(mask.float(), seg, num_seqs)
    seq_gap = segment_sum(-d, seg, num_seqs) / seq_count.clamp(min=1)
    stats = torch.stack(
        [
            _sum(same_bits.float(), mask) / denom,
            abs_d.sum() / denom,
            abs_d.max() if num_tokens else d.new_zeros(()),
            prob_diff.max() if num_tokens else d.new_zeros(()),
            k1(d).sum() / denom,
            k2(d).sum() / denom,
            k3(d).sum() / denom,
            rho_sq.sum() / denom - 1.0,
            seq_gap.sum() / (seq_count > 0).sum().clamp(min=1),
            n.float(),
        ]
    ).tolist()
    keys = (
        "bitwise_equal_frac",
        "abs_diff_mean",
        "abs_diff_max",
        "prob_diff_max",
        "k1_mean",
        "k2_mean",
        "k3_mean",
        "chi2",
        "log_ppl_diff",
    )
    out: dict[str, float | int] = {key: value + 0.0 for key, value in zip(keys, stats)}  # + 0.0 maps -0.0 to 0.0
    out["num_tokens"] = int(stats[-1])
    if out["num_tokens"] == 0:
        out.update({key: 0.0 for key in keys})
        out["bitwise_equal_frac"] = 1.0
    return out


def argmax_flip_rate(rollout_argmax: Tensor, trainer_argmax: Tensor, mask: Tensor) -> float:
    """Fraction of masked positions whose top-1 token differs between generator and trainer (0.0 when empty)."""
    num_tokens = require_aligned(rollout_argmax=rollout_argmax, trainer_argmax=trainer_argmax)
    require_bool_mask("mask", mask, num_tokens)
    for name, tensor in (("rollout_argmax", rollout_argmax), ("trainer_argmax", trainer_argmax)):
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got {tensor.dtype}")
    flips, n = torch.stack([(mask & (rollout_argmax != trainer_argmax)).sum(), mask.sum()]).tolist()
    return flips / n if n else 0.0


def update_direction_stats(
    logp_before: Tensor, logp_after: Tensor, advantages: Tensor, mask: Tensor
) -> dict[str, float | int]:
    """Did an update move each token's log-prob in its advantage's direction? (paper §4.1, docs/design.md §6)

    Over masked tokens with ``A != 0``, ``delta = logp_after - logp_before`` (both from the generator's numeric
    path, before and after the update). Returns ``misaligned_frac = mean[sign(delta) != sign(A)]`` (an unchanged
    token, ``delta == 0``, counts as misaligned), ``unchanged_frac = mean[delta == 0]`` and ``num_tokens``;
    fractions are 0.0 when no token qualifies. Non-finite values at masked tokens raise ``ValueError``.
    """
    num_tokens = require_aligned(logp_before=logp_before, logp_after=logp_after, advantages=advantages)
    require_bool_mask("mask", mask, num_tokens)
    require_finite("advantages", advantages, mask)
    active = mask & (advantages != 0)
    require_finite("logp_before", logp_before, active)
    require_finite("logp_after", logp_after, active)
    delta = logp_after.detach().float() - logp_before.detach().float()
    misaligned = active & (torch.sign(delta) != torch.sign(advantages.detach().float()))
    unchanged = active & (delta == 0)
    bad, same, n = torch.stack([misaligned.sum(), unchanged.sum(), active.sum()]).tolist()
    return {
        "misaligned_frac": bad / n if n else 0.0,
        "unchanged_frac": same / n if n else 0.0,
        "num_tokens": int(n),
    }


# -------------------------------------------------------------------------------------------------- corrections
def tis_weights(
    log_r_corr: Tensor, cu_seqlens: Tensor, mask: Tensor, *, level: TISLevel = "token", cap: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance-sampling weights (Yao et al., 2025) that multiply the per-token loss.

    ``level="token"``: ``w_t = min(r_corr,t, cap)``. ``level="sequence"``: ``w_i = min(prod_t r_corr,t, cap)`` with
    the product over the sequence's masked tokens (``exp`` of the summed log ratios), broadcast to its tokens.
    Multiplying the PPO loss by ``w`` turns ``r_ppo^train`` into (the truncated) ``r_ppo^rollout``.

    Args:
        log_r_corr: floating ``[T]``, ``log pi_old^train - log pi_old^rollout``; must be finite at masked tokens.
        cu_seqlens: int ``[B + 1]``.
        mask: bool ``[T]``, the tokens to weight.
        level: ``"token"`` or ``"sequence"``.
        cap: truncation ``tau``, finite and ``>= 1`` (paper: ``tau_tok = 2``).

    Returns:
        ``(weights, info)``: ``weights`` float32 ``[T]``, detached, exactly 1.0 at unmasked tokens (and everywhere
        when ``log_r_corr == 0``). ``info``: ``mean``, ``min``, ``max`` of the weights over masked tokens (1.0 when
        there is none) and ``truncated_frac``, the fraction of weights whose untruncated value exceeded ``cap``,
        counted over masked tokens (token level) or over sequences with masked tokens (sequence level).
    """
    _check_tis(level, cap)
    num_tokens = require_aligned(log_r_corr=log_r_corr)
    require_bool_mask("mask", mask, num_tokens)
    require_finite("log_r_corr", log_r_corr, mask)
    lr = torch.where(mask, log_r_corr.detach().float(), 0.0)
    if level == "token":
        raw = lr.exp()
        truncated, units = mask & (raw > cap), mask
    else:
        seg = segment_ids(cu_seqlens, num_tokens)
        num_seqs = cu_seqlens.numel() - 1
        seq_raw = segment_sum(lr, seg, num_seqs).exp()
        has_tokens = segment_sum(mask.float(), seg, num_seqs) > 0
        raw = seq_raw[seg]
        truncated, units = has_tokens & (seq_raw > cap), has_tokens
    weights = torch.where(mask, raw.clamp(max=cap), 1.0)
    stats = torch.stack(
        [
            _sum(weights, mask),
            mask.sum().float(),
            torch.where(mask, weights, torch.inf).min() if num_tokens else weights.new_ones(()),
            torch.where(mask, weights, -torch.inf).max() if num_tokens else weights.new_ones(()),
            truncated.sum().float(),
            units.sum().float(),
        ]
    ).tolist()
    total, n, w_min, w_max, n_trunc, n_units = stats
    info = {
        "mean": total / n if n else 1.0,
        "min": w_min if n else 1.0,
        "max": w_max if n else 1.0,
        "truncated_frac": n_trunc / n_units if n_units else 0.0,
    }
    return weights, info


def rejection_mask(
    log_r: Tensor,
    cu_seqlens: Tensor,
    mask: Tensor,
    *,
    granularity: Granularity,
    estimator: Estimator,
    threshold: float,
) -> tuple[Tensor, dict[str, float | int]]:
    """Masked importance sampling / rejection of tokens or whole sequences whose mismatch score is too large.

    Per masked token ``K_t = K(q_t)`` with ``K`` the chosen estimator and ``log q_t = log_r[t]``. Then

    - ``token``: drop token ``t`` when ``K_t > threshold``;
    - ``sequence_sum``: ``S_i = sum_t K_t`` over the sequence's masked tokens (paper's ``S_seq``), drop the whole
      sequence when ``S_i > threshold``;
    - ``sequence_mean``: the same with the mean (length-normalized, "geometric" in verl's terms);
    - ``sequence_max``: the same with the max (trust-region masking, Li et al., 2026).

    The comparison is strict and on the *signed* score: ``K1`` can be negative, so with ``k1`` a sequence the
    trainer finds more likely than the generator did (``sum log r > 0``) scores below 0 and is never dropped by a
    non-negative threshold. With ``log_r == 0`` nothing is rejected for any ``threshold >= 0``.

    Args:
        log_r: floating ``[T]`` log of the masking signal ``q`` (see :func:`signal_log_ratio`); must be finite at
            masked tokens.
        cu_seqlens: int ``[B + 1]``.
        mask: bool ``[T]``, the candidate tokens (normally the current loss mask).
        granularity, estimator, threshold: as above; ``threshold`` finite, and ``>= 0`` for ``k2``/``k3``.

    Returns:
        ``(keep_mask, info)``: ``keep_mask`` bool ``[T]``, a subset of ``mask`` (use it as the new loss mask).
        ``info``: ``rejected_token_frac`` (over masked tokens), ``rejected_seq_frac`` (sequences that lost at least
        one token, over sequences with masked tokens), ``num_kept_tokens``.
    """
    _check_rejection(granularity, estimator, threshold)
    num_tokens = require_aligned(log_r=log_r)
    require_bool_mask("mask", mask, num_tokens)
    require_finite("log_r", log_r, mask)
    seg = segment_ids(cu_seqlens, num_tokens)
    num_seqs = cu_seqlens.numel() - 1
    score = ESTIMATORS[estimator](torch.where(mask, log_r.detach().float(), 0.0))
    seq_count = segment_sum(mask.float(), seg, num_seqs)
    if granularity == "token":
        rejected = mask & (score > threshold)
    else:
        if granularity == "sequence_max":
            seq_score = torch.full((num_seqs,), -torch.inf, device=score.device)
            seq_score = seq_score.scatter_reduce(0, seg, torch.where(mask, score, -torch.inf), reduce="amax")
        else:
            seq_score = segment_sum(torch.where(mask, score, 0.0), seg, num_seqs)
            if granularity == "sequence_mean":
                seq_score = seq_score / seq_count.clamp(min=1)
        rejected = mask & (seq_score > threshold)[seg]
    keep = mask & ~rejected
    seq_hit = segment_sum(rejected.float(), seg, num_seqs) > 0
    n_rej, n_tok, s_rej, s_tok, n_keep = torch.stack(
        [rejected.sum(), mask.sum(), seq_hit.sum(), (seq_count > 0).sum(), keep.sum()]
    ).tolist()
    info: dict[str, float | int] = {
        "rejected_token_frac": n_rej / n_tok if n_tok else 0.0,
        "rejected_seq_frac": s_rej / s_tok if s_tok else 0.0,
        "num_kept_tokens": int(n_keep),
    }
    return keep, info


def signal_log_ratio(
    signal: Signal, *, rollout_logp: Tensor, old_logp: Tensor | None = None, logp: Tensor | None = None
) -> Tensor:
    """The masking signal ``log q`` ``[T]`` (float32, detached) of a :class:`RejectionSpec`.

    ``"corr"``: ``log r_corr = old_logp - rollout_logp`` (``old_logp`` = pi_old^train, required).
    ``"ppo"``: ``log r_ppo^rollout = logp - rollout_logp`` (``logp`` = current pi_theta, required; this signal
    changes with every optimizer step, so it is evaluated per mini-batch inside the PPO epochs).
    """
    if signal == "corr":
        other, name = old_logp, "old_logp"
    elif signal == "ppo":
        other, name = logp, "logp"
    else:
        raise ValueError(f"signal must be 'corr' or 'ppo', got {signal!r}")
    if other is None:
        raise ValueError(f"signal {signal!r} needs {name}")
    require_aligned(rollout_logp=rollout_logp, **{name: other})
    return other.detach().float() - rollout_logp.detach().float()


# ------------------------------------------------------------------------------------------------------ presets
@dataclass(frozen=True)
class TISSpec:
    """Truncated importance sampling on ``r_corr`` (see :func:`tis_weights`)."""

    level: TISLevel = "token"
    """``"token"`` (``w_t = min(r_corr,t, cap)``) or ``"sequence"`` (``w_i = min(prod_t r_corr,t, cap)``)."""
    cap: float = 2.0
    """Truncation ``tau``; finite, ``>= 1``."""

    def __post_init__(self) -> None:
        _check_tis(self.level, self.cap)


@dataclass(frozen=True)
class RejectionSpec:
    """Rejection (masking) of tokens or sequences by a KL-estimator score (see :func:`rejection_mask`)."""

    signal: Signal
    """``"corr"``: ``q = r_corr``; ``"ppo"``: ``q = r_ppo^rollout = pi_theta / pi_old^rollout``."""
    granularity: Granularity
    """``"token"``, ``"sequence_sum"`` (paper's ``S_seq``), ``"sequence_mean"`` or ``"sequence_max"``."""
    estimator: Estimator
    """``"k1"`` (signed), ``"k2"`` or ``"k3"``."""
    threshold: float
    """Drop when the score is strictly greater; finite, ``>= 0`` for ``k2``/``k3`` (paper: ``tau_seq = 0.001``)."""

    def __post_init__(self) -> None:
        if self.signal not in ("corr", "ppo"):
            raise ValueError(f"signal must be 'corr' or 'ppo', got {self.signal!r}")
        _check_rejection(self.granularity, self.estimator, self.threshold)


PRESETS: dict[str, tuple[TISSpec | None, RejectionSpec]] = {
    "srs-k3-corr-ratio": (None, RejectionSpec("corr", "sequence_sum", "k3", 0.001)),
    "srs-k3-ppo-ratio": (None, RejectionSpec("ppo", "sequence_sum", "k3", 0.001)),
    "tis-srs-k3-corr-ratio": (TISSpec("token", 2.0), RejectionSpec("corr", "sequence_sum", "k3", 0.001)),
    "tis-srs-k1-corr-ratio": (TISSpec("token", 2.0), RejectionSpec("corr", "sequence_sum", "k1", 0.001)),
}
"""The paper's four post-hoc corrections (appendix A.4; ``tau_tok = 2``, ``tau_seq = 0.001``): optional token TIS
on ``r_corr``, then sequence-level rejection ``S_seq(q) = sum_t K(q_t) > tau_seq``."""


def correction_preset(name: str) -> tuple[TISSpec | None, RejectionSpec]:
    """The ``(TIS or None, rejection)`` pair of a paper preset; ``ValueError`` listing the names if unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown correction preset {name!r}; expected one of {sorted(PRESETS)}") from None


def apply_correction(
    tis: TISSpec | None,
    rejection: RejectionSpec | None,
    *,
    rollout_logp: Tensor,
    old_logp: Tensor,
    cu_seqlens: Tensor,
    mask: Tensor,
    logp: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float | int]]:
    """Apply a TIS spec and a rejection spec (e.g. a preset) to one packed batch.

    The objective becomes ``keep_t * w_t * loss_t``: TIS weights come from ``r_corr = exp(old_logp - rollout_logp)``
    and rejection from the spec's signal (``logp`` is needed for the ``"ppo"`` signal only). Both read the raw
    ratios, so their order does not change the result.

    Returns:
        ``(weights [T] float32 detached, keep_mask [T] bool subset of mask, info)``; ``weights`` is all ones without
        TIS and ``keep_mask == mask`` without rejection. ``info`` keys are prefixed ``"tis/"`` and ``"rs/"``.
    """
    num_tokens = require_aligned(rollout_logp=rollout_logp, old_logp=old_logp)
    require_bool_mask("mask", mask, num_tokens)
    weights = torch.ones(num_tokens, dtype=torch.float32, device=rollout_logp.device)
    keep = mask.clone()
    info: dict[str, float | int] = {}
    if tis is not None:
        log_r_corr = signal_log_ratio("corr", rollout_logp=rollout_logp, old_logp=old_logp)
        weights, tis_info = tis_weights(log_r_corr, cu_seqlens, mask, level=tis.level, cap=tis.cap)
        info.update({f"tis/{key}": value for key, value in tis_info.items()})
    if rejection is not None:
        log_q = signal_log_ratio(rejection.signal, rollout_logp=rollout_logp, old_logp=old_logp, logp=logp)
        keep, rs_info = rejection_mask(
            log_q,
            cu_seqlens,
            mask,
            granularity=rejection.granularity,
            estimator=rejection.estimator,
            threshold=rejection.threshold,
        )
        info.update({f"rs/{key}": value for key, value in rs_info.items()})
    return weights, keep, info
