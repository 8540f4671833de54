"""Hand-computed checks of the mismatch probes and TIM corrections in rlexact.callbacks.functional."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

from models import ids, mask, t
from rlexact.callbacks.functional import (
    PRESETS,
    RejectionSpec,
    TISSpec,
    apply_correction,
    argmax_flip_rate,
    correction_preset,
    k1,
    k2,
    k3,
    mismatch_stats,
    rejection_mask,
    signal_log_ratio,
    split_by_advantage_sign,
    surrogate_contribution,
    tis_weights,
    update_direction_stats,
)

NAN = float("nan")
GRANULARITIES = ("token", "sequence_sum", "sequence_mean", "sequence_max")
ESTIMATORS = ("k1", "k2", "k3")


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------------------------------- estimators
def test_kl_estimators_hand_values() -> None:
    log_r = t(math.log(2.0), 0.0, math.log(0.5))
    ln2 = math.log(2.0)
    assert_close(k1(log_r), t(-ln2, 0.0, ln2))
    assert_close(k2(log_r), t(0.5 * ln2**2, 0.0, 0.5 * ln2**2))
    assert_close(k3(log_r), t(1.0 - ln2, 0.0, -0.5 + ln2))


def test_kl_estimators_exact_zero_at_ratio_one() -> None:
    zeros = torch.zeros(5)
    for fn in (k1, k2, k3):
        assert (fn(zeros) == 0).all()
    assert k1(t(0.1)).dtype == torch.float32 and k3(torch.zeros(1, dtype=torch.bfloat16)).dtype == torch.float32


def test_surrogate_contribution_value_and_gradient() -> None:
    log_r = t(math.log(2.0), 0.0, math.log(0.5)).requires_grad_()
    adv = t(1.0, 5.0, -2.0)
    c = surrogate_contribution(log_r, adv)
    assert_close(c, t(-1.0, 0.0, -1.0))
    c.sum().backward()
    assert_close(log_r.grad, t(-2.0, -5.0, 1.0))  # same as d(-r A)/dlog r = -r A


def test_split_by_advantage_sign() -> None:
    out = split_by_advantage_sign(t(1, 2, 3, 4, 5), t(1, -1, 0, 2, -3), mask(1, 1, 1, 1, 0))
    assert out == {"pos": 2.5, "neg": 2.0, "pos_count": 2, "neg_count": 1}
    empty = split_by_advantage_sign(t(1, 2), t(0, 0), mask(1, 1))
    assert empty == {"pos": 0.0, "neg": 0.0, "pos_count": 0, "neg_count": 0}
    assert split_by_advantage_sign(t(1, 2), t(1, NAN), mask(1, 0))["pos"] == 1.0  # NaN outside the mask is ignored
    with pytest.raises(ValueError, match=r"advantages\[1\]"):
        split_by_advantage_sign(t(1, 2), t(1, NAN), mask(1, 1))


# -------------------------------------------------------------------------------------------------------- probes
def test_mismatch_stats_hand_values() -> None:
    rollout = t(-1.0, -2.0, -0.5, NAN)
    trainer = t(-1.0, -2.5, -0.75, 3.0)  # the NaN / garbage at the unmasked last token must not leak
    m = mask(1, 1, 1, 0)
    cu = ids(0, 2, 4)
    s = mismatch_stats(rollout, trainer, m, cu)
    d = [0.0, -0.5, -0.25]  # trainer - rollout on the masked tokens
    assert s["num_tokens"] == 3
    assert s["bitwise_equal_frac"] == approx(1 / 3)
    assert s["abs_diff_mean"] == approx(0.75 / 3)
    assert s["abs_diff_max"] == approx(0.5)
    assert s["prob_diff_max"] == approx(
        max(abs(math.exp(-2.5) - math.exp(-2.0)), abs(math.exp(-0.75) - math.exp(-0.5)))
    )
    assert s["k1_mean"] == approx(sum(-x for x in d) / 3)
    assert s["k2_mean"] == approx(sum(0.5 * x * x for x in d) / 3)
    assert s["k3_mean"] == approx(sum(math.expm1(x) - x for x in d) / 3)
    assert s["chi2"] == approx(sum(math.exp(x) ** 2 for x in d) / 3 - 1)
    # seq0: mean rollout -1.5, mean trainer -1.75 -> 0.25; seq1 (one masked token): -0.5 - (-0.75) = 0.25
    assert s["log_ppl_diff"] == approx(0.25)


def test_mismatch_stats_log_ppl_diff_sign_and_sequence_mean() -> None:
    # seq0 trainer less confident by 1 nat/token, seq1 more confident by 0.5 nat on its single token.
    s = mismatch_stats(t(-1.0, -1.0, -2.0), t(-2.0, -2.0, -1.5), mask(1, 1, 1), ids(0, 2, 3))
    assert s["log_ppl_diff"] == approx((1.0 - 0.5) / 2)


def test_mismatch_stats_zero_mismatch_is_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, generator=gen) * 5
    m = torch.rand(64, generator=gen) < 0.8
    s = mismatch_stats(logp, logp.clone(), m, ids(0, 10, 40, 64))
    assert s["bitwise_equal_frac"] == 1.0
    for key in ("abs_diff_mean", "abs_diff_max", "prob_diff_max", "k1_mean", "k2_mean", "k3_mean", "chi2"):
        assert s[key] == 0.0, key
    assert s["log_ppl_diff"] == 0.0
    assert s["num_tokens"] == int(m.sum())


def test_mismatch_stats_bitwise_semantics() -> None:
    nan_bits = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    s = mismatch_stats(torch.cat([t(0.0), nan_bits]), torch.cat([t(-0.0), nan_bits.clone()]), mask(1, 1), ids(0, 2))
    assert s["bitwise_equal_frac"] == 0.5  # -0.0 vs 0.0 differ bitwise; identical NaNs match bitwise
    s = mismatch_stats(t(0.0), t(-0.0), mask(1), ids(0, 1))
    assert s["bitwise_equal_frac"] == 0.0 and s["abs_diff_max"] == 0.0
    bf = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    assert mismatch_stats(bf, bf.clone(), mask(1, 1), ids(0, 2))["bitwise_equal_frac"] == 1.0


def test_mismatch_stats_empty_and_errors() -> None:
    s = mismatch_stats(t(-1.0, -2.0), t(-3.0, 0.0), mask(0, 0), ids(0, 2))
    assert s["num_tokens"] == 0 and s["bitwise_equal_frac"] == 1.0 and s["abs_diff_max"] == 0.0 and s["chi2"] == 0.0
    with pytest.raises(ValueError, match="dtype mismatch"):
        mismatch_stats(t(-1.0), torch.tensor([-1.0], dtype=torch.float64), mask(1), ids(0, 1))
    with pytest.raises(ValueError, match="shape mismatch"):
        mismatch_stats(t(-1.0, -2.0), t(-1.0), mask(1, 1), ids(0, 2))
    with pytest.raises(ValueError, match="bool"):
        mismatch_stats(t(-1.0), t(-1.0), t(1.0), ids(0, 1))


def test_argmax_flip_rate() -> None:
    assert argmax_flip_rate(ids(1, 2, 3, 4), ids(1, 5, 3, 6), mask(1, 1, 1, 0)) == approx(1 / 3)
    assert argmax_flip_rate(ids(1, 2), ids(3, 4), mask(0, 0)) == 0.0
    with pytest.raises(ValueError, match="integer"):
        argmax_flip_rate(t(1.0), t(1.0), mask(1))


def test_update_direction_stats() -> None:
    out = update_direction_stats(
        torch.zeros(5), t(0.1, -0.1, 0.0, 0.2, -0.3), t(1.0, 1.0, 1.0, -1.0, 0.0), mask(1, 1, 1, 1, 1)
    )
    # t0 aligned, t1 wrong sign, t2 unchanged (misaligned), t3 wrong sign, t4 has A == 0 (ignored)
    assert out == {"misaligned_frac": 0.75, "unchanged_frac": 0.25, "num_tokens": 4}


# --------------------------------------------------------------------------------------------------- corrections
def test_tis_token_level() -> None:
    log_r = t(math.log(3.0), math.log(0.5), 0.0, math.log(1.5), NAN).requires_grad_()
    w, info = tis_weights(log_r, ids(0, 2, 5), mask(1, 1, 1, 1, 0), level="token", cap=2.0)
    assert_close(w, t(2.0, 0.5, 1.0, 1.5, 1.0))
    assert w.dtype == torch.float32 and not w.requires_grad
    assert info["mean"] == approx(1.25) and info["min"] == approx(0.5) and info["max"] == approx(2.0)
    assert info["truncated_frac"] == approx(0.25)


def test_tis_sequence_level() -> None:
    log_r = t(math.log(3.0), math.log(0.5), 0.0, math.log(4.0), NAN)
    w, info = tis_weights(log_r, ids(0, 2, 5), mask(1, 1, 1, 1, 0), level="sequence", cap=2.0)
    # seq0: 3 * 0.5 = 1.5; seq1: 1 * 4 = 4 -> 2 (the unmasked NaN token keeps the neutral weight 1)
    assert_close(w, t(1.5, 1.5, 2.0, 2.0, 1.0))
    assert info["mean"] == approx(1.75) and info["min"] == approx(1.5) and info["max"] == approx(2.0)
    assert info["truncated_frac"] == approx(0.5)  # one of two sequences


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_zero_mismatch_weights_exactly_one(level: str) -> None:
    w, info = tis_weights(torch.zeros(9), ids(0, 4, 9), torch.ones(9, dtype=torch.bool), level=level, cap=2.0)
    assert (w == 1.0).all()
    assert info == {"mean": 1.0, "min": 1.0, "max": 1.0, "truncated_frac": 0.0}


def test_tis_validation() -> None:
    with pytest.raises(ValueError, match="cap"):
        tis_weights(torch.zeros(2), ids(0, 2), mask(1, 1), cap=0.5)
    with pytest.raises(ValueError, match="level"):
        tis_weights(torch.zeros(2), ids(0, 2), mask(1, 1), level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"log_r_corr\[1\]"):
        tis_weights(t(0.0, NAN), ids(0, 2), mask(1, 1))


# Three sequences: [0.1, -0.2, 0.05], [0.3, 0.3], [-0.5, (unmasked 0.0)]
REJ_LOG_R = t(0.1, -0.2, 0.05, 0.3, 0.3, -0.5, 0.0)
REJ_CU = ids(0, 3, 5, 7)
REJ_MASK = mask(1, 1, 1, 1, 1, 1, 0)


def _k3(x: float) -> float:
    return math.expm1(x) - x


@pytest.mark.parametrize(
    ("granularity", "estimator", "threshold", "keep", "token_frac", "seq_frac"),
    [
        # token k3: K3 = [.00517, .01873, .00127, .04986, .04986, .10653]
        ("token", "k3", 0.03, [1, 1, 1, 0, 0, 0, 0], 3 / 6, 2 / 3),
        # token k1 (signed): K1 = [-.1, .2, -.05, -.3, -.3, .5]
        ("token", "k1", 0.1, [1, 0, 1, 1, 1, 0, 0], 2 / 6, 2 / 3),
        # token k2: K2 = [.005, .02, .00125, .045, .045, .125]
        ("token", "k2", 0.01, [1, 0, 1, 0, 0, 0, 0], 4 / 6, 3 / 3),
        # sequence sums of K3: .02517, .09972, .10653
        ("sequence_sum", "k3", 0.1, [1, 1, 1, 1, 1, 0, 0], 1 / 6, 1 / 3),
        ("sequence_sum", "k3", 0.05, [1, 1, 1, 0, 0, 0, 0], 3 / 6, 2 / 3),
        # sequence sums of K1: .05, -.6, .5 -> the large but "trainer-favoured" seq1 is kept
        ("sequence_sum", "k1", 0.001, [0, 0, 0, 1, 1, 0, 0], 4 / 6, 2 / 3),
        # sequence means of K3: .00839, .04986, .10653
        ("sequence_mean", "k3", 0.05, [1, 1, 1, 1, 1, 0, 0], 1 / 6, 1 / 3),
        ("sequence_mean", "k3", 0.04, [1, 1, 1, 0, 0, 0, 0], 3 / 6, 2 / 3),
        # sequence max of K2: .02, .045, .125
        ("sequence_max", "k2", 0.03, [1, 1, 1, 0, 0, 0, 0], 3 / 6, 2 / 3),
        ("sequence_max", "k1", 0.15, [0, 0, 0, 1, 1, 0, 0], 4 / 6, 2 / 3),
    ],
)
def test_rejection_mask_hand_cases(
    granularity: str, estimator: str, threshold: float, keep: list[int], token_frac: float, seq_frac: float
) -> None:
    kept, info = rejection_mask(
        REJ_LOG_R, REJ_CU, REJ_MASK, granularity=granularity, estimator=estimator, threshold=threshold
    )
    assert kept.tolist() == [bool(x) for x in keep]
    assert info["rejected_token_frac"] == approx(token_frac)
    assert info["rejected_seq_frac"] == approx(seq_frac)
    assert info["num_kept_tokens"] == sum(keep)


def test_rejection_hand_values_match_k3_sums() -> None:
    assert _k3(0.1) + _k3(-0.2) + _k3(0.05) == pytest.approx(0.02517, abs=1e-5)
    assert 2 * _k3(0.3) == pytest.approx(0.09972, abs=1e-5)
    assert _k3(-0.5) == pytest.approx(0.10653, abs=1e-5)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("threshold", [0.0, 0.001, 5.0])
def test_rejection_zero_mismatch_rejects_nothing(granularity: str, estimator: str, threshold: float) -> None:
    m = mask(0, 1, 1, 1, 0, 1, 1)
    kept, info = rejection_mask(
        torch.zeros(7), ids(0, 3, 4, 7), m, granularity=granularity, estimator=estimator, threshold=threshold
    )
    assert torch.equal(kept, m)
    assert info == {"rejected_token_frac": 0.0, "rejected_seq_frac": 0.0, "num_kept_tokens": 5}


def test_rejection_ignores_unmasked_and_validates() -> None:
    log_r = t(5.0, 0.0, NAN)
    kept, _ = rejection_mask(log_r, ids(0, 3), mask(0, 1, 0), granularity="sequence_sum", estimator="k3", threshold=0)
    assert kept.tolist() == [False, True, False]
    with pytest.raises(ValueError, match=r"log_r\[2\]"):
        rejection_mask(log_r, ids(0, 3), mask(0, 1, 1), granularity="token", estimator="k3", threshold=0.1)
    with pytest.raises(ValueError, match="non-negative estimator"):
        rejection_mask(log_r, ids(0, 3), mask(0, 1, 0), granularity="token", estimator="k3", threshold=-0.1)
    with pytest.raises(ValueError, match="granularity"):
        rejection_mask(log_r, ids(0, 3), mask(0, 1, 0), granularity="seq", estimator="k3", threshold=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="estimator"):
        rejection_mask(log_r, ids(0, 3), mask(0, 1, 0), granularity="token", estimator="k4", threshold=0.1)  # type: ignore[arg-type]
    kept, _ = rejection_mask(t(0.0), ids(0, 1), mask(1), granularity="token", estimator="k1", threshold=-0.1)
    assert kept.tolist() == [False]  # negative thresholds are legal for the signed K1


def test_signal_log_ratio() -> None:
    rollout, old, logp = t(-1.0, -2.0), t(-1.5, -2.0), t(-0.5, -3.0)
    assert_close(signal_log_ratio("corr", rollout_logp=rollout, old_logp=old), t(-0.5, 0.0))
    assert_close(signal_log_ratio("ppo", rollout_logp=rollout, logp=logp.requires_grad_()), t(0.5, -1.0))
    assert not signal_log_ratio("ppo", rollout_logp=rollout, logp=logp).requires_grad
    with pytest.raises(ValueError, match="needs logp"):
        signal_log_ratio("ppo", rollout_logp=rollout, old_logp=old)
    with pytest.raises(ValueError, match="signal"):
        signal_log_ratio("train", rollout_logp=rollout, old_logp=old)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------- presets
def test_preset_definitions() -> None:
    assert set(PRESETS) == {"srs-k3-corr-ratio", "srs-k3-ppo-ratio", "tis-srs-k3-corr-ratio", "tis-srs-k1-corr-ratio"}
    assert correction_preset("srs-k3-corr-ratio") == (None, RejectionSpec("corr", "sequence_sum", "k3", 0.001))
    assert correction_preset("srs-k3-ppo-ratio") == (None, RejectionSpec("ppo", "sequence_sum", "k3", 0.001))
    assert correction_preset("tis-srs-k3-corr-ratio") == (
        TISSpec("token", 2.0),
        RejectionSpec("corr", "sequence_sum", "k3", 0.001),
    )
    assert correction_preset("tis-srs-k1-corr-ratio") == (
        TISSpec("token", 2.0),
        RejectionSpec("corr", "sequence_sum", "k1", 0.001),
    )
    with pytest.raises(ValueError, match="unknown correction preset"):
        correction_preset("tis")


def test_spec_validation_and_frozen() -> None:
    with pytest.raises(ValueError, match="signal"):
        RejectionSpec("rollout", "sequence_sum", "k3", 0.001)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="granularity"):
        RejectionSpec("corr", "geometric", "k3", 0.001)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        RejectionSpec("corr", "token", "k1", float("nan"))
    with pytest.raises(ValueError, match="cap"):
        TISSpec("token", 0.9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TISSpec().cap = 3.0  # type: ignore[misc]


# Two sequences of 3 tokens, first token of each is prompt (unmasked).
# seq0: r_corr = 1 (exact), the policy moved: log r_ppo^rollout = 0.5 per token.
# seq1: mismatched, log r_corr = [1.0, -0.2], the policy did not move relative to the rollout.
P_CU = ids(0, 3, 6)
P_MASK = mask(0, 1, 1, 0, 1, 1)
P_ROLLOUT = t(0.0, -1.0, -2.0, 0.0, -1.5, -0.7)
P_OLD = P_ROLLOUT + t(NAN, 0.0, 0.0, NAN, 1.0, -0.2)
P_LOGP = P_ROLLOUT + t(NAN, 0.5, 0.5, NAN, 0.0, 0.0)
TIS_W = [1.0, 1.0, 1.0, 1.0, 2.0, math.exp(-0.2)]

PRESET_CASES = {
    # S_seq(K3, r_corr): seq0 = 0, seq1 = K3(1) + K3(-0.2) = 0.737 > 0.001 -> drop seq1
    "srs-k3-corr-ratio": ([1.0] * 6, [0, 1, 1, 0, 0, 0]),
    # S_seq(K3, r_ppo^rollout): seq0 = 2 K3(0.5) = 0.297 -> drop seq0; seq1 = 0
    "srs-k3-ppo-ratio": ([1.0] * 6, [0, 0, 0, 0, 1, 1]),
    "tis-srs-k3-corr-ratio": (TIS_W, [0, 1, 1, 0, 0, 0]),
    # S_seq(K1, r_corr): seq1 = -1.0 + 0.2 = -0.8 < 0.001 -> kept; only TIS acts
    "tis-srs-k1-corr-ratio": (TIS_W, [0, 1, 1, 0, 1, 1]),
}


@pytest.mark.parametrize("name", list(PRESET_CASES))
def test_apply_each_preset(name: str) -> None:
    weights, keep = PRESET_CASES[name]
    tis, rejection = correction_preset(name)
    w, kept, info = apply_correction(
        tis, rejection, rollout_logp=P_ROLLOUT, old_logp=P_OLD, logp=P_LOGP, cu_seqlens=P_CU, mask=P_MASK
    )
    assert_close(w, torch.tensor(weights))
    assert kept.tolist() == [bool(x) for x in keep]
    assert ("tis/mean" in info) == (tis is not None)
    assert info["rs/num_kept_tokens"] == sum(keep)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_identity_without_mismatch_or_movement(name: str) -> None:
    tis, rejection = correction_preset(name)
    rollout = torch.randn(6)
    w, kept, info = apply_correction(
        tis,
        rejection,
        rollout_logp=rollout,
        old_logp=rollout.clone(),
        logp=rollout.clone(),
        cu_seqlens=P_CU,
        mask=P_MASK,
    )
    assert (w == 1.0).all()
    assert torch.equal(kept, P_MASK)
    assert info["rs/rejected_token_frac"] == 0.0


def test_apply_correction_ppo_signal_needs_logp() -> None:
    with pytest.raises(ValueError, match="needs logp"):
        apply_correction(
            *correction_preset("srs-k3-ppo-ratio"),
            rollout_logp=P_ROLLOUT,
            old_logp=P_OLD,
            cu_seqlens=P_CU,
            mask=P_MASK,
        )
