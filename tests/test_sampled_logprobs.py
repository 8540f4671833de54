"""Log-probs under top-p / top-k: with ``logprobs="sampled"`` the generator reports, and the trainer computes, the
log-prob under the truncated, renormalized distribution that was sampled, bitwise equal (torch.equal)."""

from __future__ import annotations

import subprocess

import pytest
import torch

import rlexact
from interpreter_jobs import failure_report
from models import prompts_for, tiny_model
from rlexact.models.truncation import kept_logsumexp, top_k_top_p_threshold, truncated_logprobs
from rlexact.rollout import Generator, SamplingParams

VOCAB = 97


def _rollout_vs_trainer(model: torch.nn.Module, top_k: int, top_p: float, **gen_kwargs: object) -> tuple[int, int, int]:
    """``(equal_sampled, equal_full, total)`` completions whose rollout log-probs equal the trainer's bitwise, under
    the truncated distribution and under the full one."""
    outs = Generator(model, kernels="exact", **gen_kwargs).generate(
        prompts_for(5, VOCAB, seed=1),
        SamplingParams(max_new_tokens=10, temperature=0.8, top_k=top_k, top_p=top_p, n=2, seed=5, logprobs="sampled"),
    )
    seqs = [o.sequence for o in outs]
    with torch.no_grad():
        sampled = rlexact.sequence_logprobs(model, seqs, 0.8, top_k=top_k, top_p=top_p)
        full = rlexact.sequence_logprobs(model, seqs, 0.8)
    tail = [o.logprobs.to(lp.device) for o, lp in zip(outs, full)]
    eq_s = sum(bool(torch.equal(lp[-len(t) :], t)) for lp, t in zip(sampled, tail))
    eq_f = sum(bool(torch.equal(lp[-len(t) :], t)) for lp, t in zip(full, tail))
    return eq_s, eq_f, len(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,top_p", [(20, 0.9), (0, 0.7)])
def test_rollout_equals_trainer_sampled(dtype, top_k, top_p) -> None:
    model = rlexact.exactify(tiny_model("qwen3", dtype=dtype))
    eq_s, eq_f, total = _rollout_vs_trainer(model, top_k, top_p)
    assert eq_s == total
    assert eq_f == 0  # negative control: the full-distribution log-probs are different numbers


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_equals_trainer_sampled_gpu(dtype) -> None:
    model = rlexact.exactify(tiny_model("qwen3", dtype=dtype, hidden=128, heads=4, kv_heads=2, head_dim=32).cuda())
    for top_k, top_p in ((20, 0.9), (0, 0.7), (5, 1.0)):
        eq_s, eq_f, total = _rollout_vs_trainer(model, top_k, top_p, max_num_seqs=4)
        assert eq_s == total and eq_f == 0


def test_truncation_is_row_invariant() -> None:
    z = torch.randn(37, 301) * 3
    thr = top_k_top_p_threshold(z, 40, 0.8)
    lse = kept_logsumexp(z, thr)
    for i in (0, 5, 36):
        assert torch.equal(top_k_top_p_threshold(z[i : i + 1], 40, 0.8), thr[i : i + 1])
        assert torch.equal(kept_logsumexp(z[i : i + 1], thr[i : i + 1]), lse[i : i + 1])
    assert top_k_top_p_threshold(z, 0, 1.0) is None and top_k_top_p_threshold(z, 301, 1.0) is None
    empty = top_k_top_p_threshold(z[:0], 40, 0.8)
    assert empty.shape == (0, 1) and kept_logsumexp(z[:0], empty).shape == (0,)


@pytest.mark.interpreter("tests/_interp_truncation.py")
def test_truncation_kernel_under_interpreter(interpreter_run: subprocess.CompletedProcess) -> None:
    """Both launch plans of the Triton threshold search (one program per row for top-k candidates, the segmented plan
    for full rows, at several programs per row) equal the float64 sort-based thresholds (top-k, top-p, both, a tie
    group cut by top-k, masked tokens, a constant row, the widest key interval narrowed to one key) and are
    row-invariant; a raised boundary logit moves the threshold. The kept-token logsumexp kernel agrees with float64,
    is row-invariant and moves with a kept token only."""
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert "ok" in interpreter_run.stdout


@pytest.mark.gpu
def test_truncation_kernel_gpu_vocab_scale() -> None:
    """At a real vocabulary on the GPU: CUDA dispatches to the kernel (equal to calling it); its thresholds are the
    float64 thresholds up to fp32 rounding of the kept mass (equal on most rows; on flat rows of 151,936 tokens one
    token's mass is within that rounding) and each row gets the same bits alone and in a batch of 256; a raised
    boundary logit moves the threshold."""
    from rlexact.ops import reference
    from rlexact.ops.triton_truncation import truncation_thresholds

    torch.manual_seed(0)
    z = torch.randn(256, 151936, device="cuda") * torch.linspace(0.3, 6.0, 256, device="cuda")[:, None]
    z[7, :5000] = 1.25
    rows = list(range(0, 256, 16)) + [7]
    for k, p in ((50, 1.0), (0, 0.95), (50, 0.9), (0, 0.6), (1000, 0.99)):
        thr = top_k_top_p_threshold(z, k, p)
        assert torch.equal(thr, truncation_thresholds(z, k, p))
        assert within_rounding(z[rows], thr[rows], k, p, 1e-5).all(), (k, p)
        equal = (thr[rows] == reference.truncation_thresholds(z[rows], k, p)).float().mean().item()
        assert equal >= (1.0 if p == 1.0 else 0.5), (k, p, equal)
        for i in (0, 7, 100, 255):
            assert torch.equal(top_k_top_p_threshold(z[i : i + 1], k, p), thr[i : i + 1]), (k, p, i)
    y = z[:1].clone()
    y[0, int(torch.argmax((y[0] == thr[0]).int()))] += 0.5
    assert not torch.equal(top_k_top_p_threshold(y, 1000, 0.99), thr[:1])  # negative control


@pytest.mark.gpu
def test_kept_logsumexp_kernel_gpu_vocab_scale() -> None:
    """At a real vocabulary on the GPU: CUDA dispatches ``kept_logsumexp`` to the kernel (equal to calling it); it
    agrees with float64 within fp32 rounding, gives each row the same bits alone and in a batch of 256 and in the
    trainer's 128-row chunks; a kept token moves it, a dropped one does not."""
    from rlexact.ops import triton_truncation

    torch.manual_seed(0)
    z = torch.randn(256, 151936, device="cuda") * torch.linspace(0.3, 6.0, 256, device="cuda")[:, None]
    thr = top_k_top_p_threshold(z, 0, 0.9)
    lse = kept_logsumexp(z, thr)
    assert torch.equal(lse, triton_truncation.kept_logsumexp(z, thr))
    want = torch.logsumexp(z.double().masked_fill(z < thr, float("-inf")), dim=-1)
    assert torch.allclose(lse.double(), want, rtol=0, atol=1e-4), (lse.double() - want).abs().max()
    assert torch.equal(torch.cat([kept_logsumexp(z[s : s + 128], thr[s : s + 128]) for s in (0, 128)]), lse)
    for i in (0, 7, 100, 255):
        assert torch.equal(kept_logsumexp(z[i : i + 1], thr[i : i + 1]), lse[i : i + 1]), i
    y = z[:1].clone()
    y[0, int(torch.argmin(y[0]))] += 0.5  # still below the threshold
    assert torch.equal(kept_logsumexp(y, thr[:1]), lse[:1])
    y[0, int(torch.argmax(y[0]))] += 0.5
    assert not torch.equal(kept_logsumexp(y, thr[:1]), lse[:1])  # negative control


def within_rounding(z: torch.Tensor, thr: torch.Tensor, top_k: int, top_p: float, tol: float) -> torch.Tensor:
    """``[B]`` bool: ``thr`` is a kept set's threshold in float64 up to ``tol`` of mass: a candidate value whose first
    sorted position has mass before it below ``top_p + tol``, while the next lower value's has at least
    ``top_p - tol`` (a boundary that fp32 sums in another order may place one token either way)."""
    from rlexact.ops import reference

    ok = []
    for row, t in zip(z.cpu(), thr.double().cpu().flatten()):
        cand, before = reference.truncation_candidates(row, top_k)
        first, nxt = int((cand > t).sum()), int((cand >= t).sum())
        lower_dropped = nxt == cand.numel() or bool(before[nxt] >= top_p - tol)
        ok.append(first < nxt and bool(before[first] < top_p + tol) and lower_dropped)
    return torch.tensor(ok)


def _reference(hidden: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, top_k: int, top_p: float, temp: float):
    """float64 top-k -> top-p truncation by explicit sorting: ``(logp, entropy)``."""
    z = (hidden.double() @ w.double().T) / temp
    keep = torch.zeros_like(z, dtype=torch.bool)
    for r in range(z.shape[0]):
        order = torch.argsort(z[r], descending=True, stable=True)
        k = top_k if 0 < top_k < z.shape[1] else z.shape[1]
        p = torch.softmax(z[r, order[:k]], -1)
        n = max(1, int(((torch.cumsum(p, 0) - p) < top_p).sum()))
        keep[r, order[:n]] = True
    logq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    ent = -(logq.exp() * logq.masked_fill(~keep, 0.0)).sum(-1)
    return logq.gather(-1, targets[:, None]).squeeze(-1), ent


def test_truncated_logprobs_match_float64_reference_and_gradient() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(9, 16, dtype=torch.float64)
    w = torch.randn(50, 16, dtype=torch.float64) * 0.7
    h32 = hidden.float().requires_grad_(True)
    w32 = w.float().requires_grad_(True)
    z = (h32.detach() @ w32.detach().T) / 0.9
    targets = z.argmax(-1)  # kept in every truncation

    def logits_fn(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        zz = (h.float() @ w32.detach().T) / 0.9
        return zz, torch.logsumexp(zz, -1)

    logp, ent = truncated_logprobs(h32, w32, targets, 0.9, 10, 0.8, logits_fn)
    ref_h = hidden.clone().requires_grad_(True)
    ref_w = w.clone().requires_grad_(True)
    ref_logp, ref_ent = _reference(ref_h, ref_w, targets, 10, 0.8, 0.9)
    assert (logp.double() - ref_logp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5
    g = torch.randn(9, dtype=torch.float64)
    ((logp.double() * g).sum() + 0.3 * ent.double().sum()).backward()
    ((ref_logp * g).sum() + 0.3 * ref_ent.sum()).backward()
    assert (h32.grad.double() - ref_h.grad).abs().max() < 1e-4
    assert (w32.grad.double() - ref_w.grad).abs().max() < 1e-4


def test_sampling_params_logprobs_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="logprobs must be one of"):
        SamplingParams(logprobs="truncated")
