"""Hand-computed checks of the advantage estimators, policy losses and loss aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from models import ids, mask, t
from rlexact.algorithms import (
    LossAggMode,
    aggregate_loss,
    broadcast_to_tokens,
    dynamic_sampling_keep,
    grpo_advantages,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
    reinforce_advantages,
    reinforce_loss,
    rloo_advantages,
    segment_ids,
)


# ---------------------------------------------------------------------------------------------------- advantages
def test_grpo_matches_hand_computed_unbiased_std() -> None:
    # group 7: [1, 0, 0, 1] mean 0.5, unbiased std sqrt(1/3); group 3: [3, 1] mean 2, unbiased std sqrt(2).
    rewards = t(1.0, 3.0, 0.0, 1.0, 0.0, 1.0)
    groups = ids(7, 3, 7, 3, 7, 7)
    adv = grpo_advantages(rewards, groups, eps=0.0)
    a7 = 0.5 / math.sqrt(1.0 / 3.0)
    a3 = 1.0 / math.sqrt(2.0)
    assert_close(adv, t(a7, a3, -a7, -a3, -a7, a7))
    assert adv.dtype == torch.float32


def test_grpo_uses_sample_not_population_std() -> None:
    adv = grpo_advantages(t(0.0, 1.0), ids(0, 0), eps=0.0)
    assert_close(adv, t(-math.sqrt(0.5), math.sqrt(0.5)))  # population std would give -1, +1


def test_grpo_eps_and_dr_grpo() -> None:
    rewards, groups = t(3.0, 1.0), ids(0, 0)
    assert_close(grpo_advantages(rewards, groups, eps=1.0), t(1 / (math.sqrt(2) + 1), -1 / (math.sqrt(2) + 1)))
    assert_close(grpo_advantages(rewards, groups, normalize_std=False), t(1.0, -1.0))


def test_constant_groups_get_exact_zero() -> None:
    rewards = t(0.1, 0.1, 0.1, 1.0, 0.0)
    groups = ids(0, 0, 0, 1, 1)
    for adv in (
        grpo_advantages(rewards, groups),
        grpo_advantages(rewards, groups, normalize_std=False),
        rloo_advantages(rewards, groups),
    ):
        assert (adv[:3] == 0).all()
        assert (adv[3:] != 0).all()
    assert (reinforce_advantages(t(0.1, 0.1, 0.1)) == 0).all()


def test_grpo_single_sample_group_raises() -> None:
    with pytest.raises(ValueError, match="GRPO needs n >= 2 samples per prompt"):
        grpo_advantages(t(1.0, 0.0, 1.0), ids(0, 0, 5))
    with pytest.raises(ValueError, match="RLOO needs n >= 2"):
        rloo_advantages(t(1.0), ids(0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_names_first_index(bad: float) -> None:
    rewards = t(0.0, 1.0, bad, bad)
    for fn in (
        lambda: grpo_advantages(rewards, ids(0, 0, 1, 1)),
        lambda: rloo_advantages(rewards, ids(0, 0, 1, 1)),
        lambda: reinforce_advantages(rewards),
        lambda: dynamic_sampling_keep(rewards, ids(0, 0, 1, 1)),
    ):
        with pytest.raises(ValueError, match=r"rewards\[2\]"):
            fn()


def test_advantage_shape_and_dtype_errors() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_advantages(t(1.0, 0.0), ids(0, 0, 0))
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), ids(0, 0))
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(t(1.0, 0.0), t(0.0, 0.0))
    with pytest.raises(ValueError, match="N >= 2"):
        reinforce_advantages(t(1.0))


def test_rloo_is_reward_minus_mean_of_others() -> None:
    rewards = t(3.0, 1.0, 2.0, 5.0, 1.0)
    adv = rloo_advantages(rewards, ids(0, 0, 0, 1, 1))
    assert_close(adv, t(3 - 1.5, 1 - 2.5, 2 - 2.0, 5 - 1.0, 1 - 5.0))


def test_reinforce_whitening() -> None:
    adv = reinforce_advantages(t(1.0, 2.0, 3.0, 4.0), eps=0.0)
    std = math.sqrt(5.0 / 3.0)
    assert_close(adv, t(-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std))


def test_advantages_are_detached() -> None:
    rewards = t(1.0, 0.0, 2.0, 2.5).requires_grad_()
    assert not grpo_advantages(rewards, ids(0, 0, 1, 1)).requires_grad
    assert not reinforce_advantages(rewards).requires_grad


def test_dynamic_sampling_keep() -> None:
    keep = dynamic_sampling_keep(t(1.0, 1.0, 0.0, 1.0, 5.0), ids(0, 0, 1, 1, 2))
    assert keep.tolist() == [False, False, True, True, False]


def test_broadcast_to_tokens_and_segment_ids() -> None:
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert segment_ids(cu).tolist() == [0, 0, 2, 2, 2]
    assert broadcast_to_tokens(t(10.0, 20.0, 30.0), cu).tolist() == [10.0, 10.0, 30.0, 30.0, 30.0]
    with pytest.raises(ValueError, match="shape mismatch"):
        broadcast_to_tokens(t(10.0, 20.0), cu)
    with pytest.raises(ValueError, match="cu_seqlens\\[0\\]"):
        segment_ids(ids(1, 3))
    with pytest.raises(ValueError, match="non-decreasing"):
        segment_ids(ids(0, 3, 2))
    with pytest.raises(ValueError, match="does not match"):
        segment_ids(ids(0, 3), 4)
    with pytest.raises(ValueError, match="int32 or int64"):
        segment_ids(t(0.0, 3.0))


# -------------------------------------------------------------------------------------------------------- losses
def test_ppo_clip_loss_branches_and_gradient() -> None:
    r = t(1.0, 1.5, 0.5, 1.5, 0.5, 1.1)
    adv = t(1.0, 1.0, 1.0, -1.0, -1.0, 2.0)
    logp = r.log().requires_grad_()
    loss, info = ppo_clip_loss(logp, torch.zeros(6), adv)
    # t1: A>0, r above 1.2 -> -1.2 (clipped high); t4: A<0, r below 0.8 -> 0.8 (clipped low); others unclipped.
    assert_close(loss, t(-1.0, -1.2, -0.5, 1.5, 0.8, -2.2))
    assert info["clipped"].tolist() == [False, True, False, False, True, False]
    assert info["clipped_high"].tolist() == [False, True, False, False, False, False]
    assert info["clipped_low"].tolist() == [False, False, False, False, True, False]
    assert not info["dual_clipped"].any()
    assert_close(info["ratio"], r)
    loss.sum().backward()
    assert_close(logp.grad, t(-1.0, 0.0, -0.5, 1.5, 0.0, -2.2))  # d(-A r)/dlogp = -A r, zero when clipped


def test_ppo_clip_higher_dapo() -> None:
    logp = t(1.25, 1.3).log()
    loss, info = ppo_clip_loss(logp, torch.zeros(2), t(1.0, 1.0), clip_low=0.2, clip_high=0.28)
    assert_close(loss, t(-1.25, -1.28))
    assert info["clipped_high"].tolist() == [False, True]


def test_ppo_dual_clip() -> None:
    logp = t(5.0, 2.0, 5.0).log().requires_grad_()
    adv = t(-1.0, -1.0, 1.0)
    loss, info = ppo_clip_loss(logp, torch.zeros(3), adv, dual_clip=3.0)
    assert_close(loss, t(3.0, 2.0, -1.2))
    assert info["dual_clipped"].tolist() == [True, False, False]
    loss.sum().backward()
    assert_close(logp.grad, t(0.0, 2.0, 0.0))
    plain, _ = ppo_clip_loss(logp.detach(), torch.zeros(3), adv)
    assert_close(plain, t(5.0, 2.0, -1.2))


def test_ppo_validation() -> None:
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(z, z, z, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_clip_loss(z, z, z, clip_low=1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo_clip_loss(z, torch.zeros(3), z)


def test_ppo_identical_logps_give_ratio_exactly_one() -> None:
    logp = torch.randn(16)
    loss, info = ppo_clip_loss(logp, logp.clone(), torch.randn(16))
    assert (info["ratio"] == 1.0).all()
    assert not info["clipped"].any()


def test_gspo_sequence_ratio_clipping_and_gradient() -> None:
    cu = ids(0, 3, 5)
    m = mask(0, 1, 1, 1, 1)
    old = t(float("nan"), 0.0, 0.0, 0.0, 0.0)  # NaN at the unmasked prompt token must not leak
    delta = t(7.0, 0.2, 0.4, -0.1, -0.3)  # seq0 mean over masked = 0.3, seq1 mean = -0.2
    adv = t(1.0, 1.0, 1.0, -1.0, -1.0)
    logp = delta.clone().requires_grad_()
    loss, info = gspo_loss(logp, old, adv, cu, m, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(0.3), math.exp(-0.2)
    assert_close(info["ratio"], t(s0, s0, s0, s1, s1))
    # seq0: A > 0 and s0 = 1.35 > 1.2 -> clipped to -1.2; seq1: A < 0, s1 = 0.82 inside [0.8, 1.2] -> A-weighted s1.
    assert_close(loss, t(-1.2, -1.2, -1.2, s1, s1))
    assert info["clipped_high"].tolist() == [True, True, True, False, False]
    loss.sum().backward()
    assert_close(logp.grad, t(0.0, 0.0, 0.0, s1, s1))  # grad of s_i,t is s_i * grad logp_t

    loss, info = gspo_loss(delta, old, adv, cu, m, clip_low=0.1, clip_high=0.5)
    assert_close(loss, t(-s0, -s0, -s0, 0.9, 0.9))
    assert info["clipped_low"].tolist() == [False, False, False, True, True]


def test_gspo_rejects_non_bool_mask() -> None:
    z = torch.zeros(3)
    with pytest.raises(ValueError, match="bool"):
        gspo_loss(z, z, z, ids(0, 3), torch.ones(3), clip_low=3e-4, clip_high=4e-4)


def test_reinforce_loss() -> None:
    logp = t(-1.0, -2.0).requires_grad_()
    loss = reinforce_loss(logp, t(0.5, -2.0))
    assert_close(loss, t(0.5, -4.0))
    loss.sum().backward()
    assert_close(logp.grad, t(-0.5, 2.0))


def test_kl_penalty() -> None:
    logp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    assert_close(kl_penalty(logp, ref, "k1"), t(0.5, -1.0))
    assert_close(kl_penalty(logp, ref, "k3"), t(math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1))
    assert (kl_penalty(logp, logp, "k3") == 0).all()
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k2")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------- aggregation
CU = ids(0, 3, 6, 8)
LOSS = t(1, 2, 3, 4, 5, 6, 7, 8)
MASK = mask(0, 1, 1, 1, 1, 1, 0, 0)  # seq0 -> [2, 3], seq1 -> [4, 5, 6], seq2 fully masked out

EXPECTED = {
    "token-mean": (2 + 3 + 4 + 5 + 6) / 5,
    "seq-mean-token-sum": (5 + 15) / 2,
    "seq-mean-token-mean": (2.5 + 5.0) / 2,
    "seq-mean-token-sum-norm": (5 / 10 + 15 / 10) / 2,
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregate_loss_modes(mode: str) -> None:
    out = aggregate_loss(LOSS, MASK, CU, mode, norm_length=10)
    assert_close(out, torch.tensor(EXPECTED[mode]))
    assert torch.equal(aggregate_loss(LOSS, MASK, CU, LossAggMode(mode), norm_length=10), out)


def test_aggregate_token_weights_multiply_first() -> None:
    weights = t(9, 0.5, 2, 1, 1, 0, 9, 9)
    out = aggregate_loss(LOSS, MASK, CU, "token-mean", token_weights=weights)
    assert_close(out, torch.tensor((1.0 + 6.0 + 4.0 + 5.0 + 0.0) / 5))


def test_aggregate_gradient_and_nan_isolation() -> None:
    loss = LOSS.clone()
    loss[6] = float("nan")  # unmasked
    loss.requires_grad_()
    out = aggregate_loss(loss, MASK, CU, "seq-mean-token-mean")
    assert torch.isfinite(out)
    out.backward()
    assert_close(loss.grad, t(0, 1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6, 0, 0))


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregate_with_precomputed_segments(mode: str) -> None:
    seg = segment_ids(CU, 8)
    out = aggregate_loss(LOSS, MASK, CU, mode, norm_length=10, seg=seg)
    assert torch.equal(out, aggregate_loss(LOSS, MASK, CU, mode, norm_length=10))
    with pytest.raises(ValueError, match=r"seg has shape \(7,\), expected \(8,\)"):
        aggregate_loss(LOSS, MASK, CU, mode, norm_length=10, seg=seg[:-1])


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregate_all_masked_is_connected_zero(mode: str) -> None:
    loss = LOSS.clone().requires_grad_()
    out = aggregate_loss(loss, torch.zeros(8, dtype=torch.bool), CU, mode, norm_length=10)
    assert out.item() == 0.0
    assert out.grad_fn is not None
    out.backward()
    assert (loss.grad == 0).all()


def _verl_agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, norm: int) -> torch.Tensor:
    """verl's padded ``agg_loss`` (newest semantics) as the reference for batches without empty sequences."""
    m = loss_mask.float()
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    seq_sum = (loss_mat * m).sum(-1)
    if mode == "seq-mean-token-mean":
        return (seq_sum / m.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return (seq_sum / norm).mean()
    return seq_sum.mean()


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregate_matches_verl_padded_reference(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 4]
    width = max(lengths)
    loss_mat = torch.randn(len(lengths), width, generator=gen)
    pad_mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        pad_mask[i, :n] = torch.rand(n, generator=gen) < 0.7
        pad_mask[i, 0] = True
    packed = torch.cat([loss_mat[i, :n] for i, n in enumerate(lengths)])
    packed_mask = torch.cat([pad_mask[i, :n] for i, n in enumerate(lengths)])
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    out = aggregate_loss(packed, packed_mask, cu, mode, norm_length=width)
    assert_close(out, _verl_agg_loss(loss_mat, pad_mask, mode, width))


def test_aggregate_validation() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate_loss(LOSS, MASK, CU, "sum")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(LOSS, MASK, CU, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="bool"):
        aggregate_loss(LOSS, MASK.float(), CU, "token-mean")
    with pytest.raises(ValueError, match="shape mismatch"):
        aggregate_loss(LOSS, MASK[:-1], CU, "token-mean")
    with pytest.raises(ValueError, match="does not match"):
        aggregate_loss(LOSS, MASK, ids(0, 3, 6), "token-mean")


def test_update_stats_match_a_direct_computation() -> None:
    """The device-side accumulation of :class:`UpdateStats` gives the ratio and clip statistics of the masked tokens
    of all micro-batches, computed directly; a micro-batch with no token in the mask changes nothing."""
    from rlexact.trainer.update import UpdateStats

    g = torch.Generator().manual_seed(4)
    stats, seen = UpdateStats(), []
    for n, frac in ((50, 0.6), (30, 0.0), (70, 0.3)):
        ratio = torch.rand(n, generator=g) * 2
        clipped = torch.rand(n, generator=g) < 0.3
        adv = torch.randn(n, generator=g)
        keep = torch.rand(n, generator=g) < frac
        stats.token_stats(ratio, clipped, adv, keep)
        seen.append((ratio[keep], clipped[keep], adv[keep]))
    r, c, a = (torch.cat(x) for x in zip(*seen))
    m = stats.finish(None)
    assert m["ratio/mean"] == pytest.approx(float(r.double().mean()), rel=1e-12)
    assert m["ratio/min"] == float(r.min()) and m["ratio/max"] == float(r.max())
    assert m["clipfrac"] == pytest.approx(float(c.double().mean()), rel=1e-12)
    assert m["clipfrac/pos"] == pytest.approx(float(c[a > 0].double().mean()), rel=1e-12)
    assert m["clipfrac/neg"] == pytest.approx(float(c[a < 0].double().mean()), rel=1e-12)
    assert UpdateStats().finish(None)["ratio/mean"] != UpdateStats().finish(None)["ratio/mean"]  # NaN without tokens
