"""segment_sum: float64-accurate, deterministic, order-fixed per-segment sums (no atomics)."""

from __future__ import annotations

import math

import pytest
import torch

from rlexact.algorithms import segment_ids, segment_sum


def _exact(values: torch.Tensor, seg: torch.Tensor, num: int) -> list[float]:
    """The exactly rounded float64 sum of every segment (math.fsum)."""
    return [math.fsum(values[seg == i].double().tolist()) for i in range(num)]


def _ulp32(x: float) -> float:
    """The float32 spacing at ``x``."""
    t = torch.tensor(abs(x), dtype=torch.float32)
    return float(torch.nextafter(t, torch.tensor(math.inf)) - t)


def _sequential_fp32(values: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """The old implementation: float32 terms added one by one (index_add on the CPU)."""
    return torch.zeros(num, dtype=torch.float32).index_add(0, seg, values)


def _long_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1854, 3, 0, 517, 1])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    values = torch.rand(int(cu[-1]), generator=g) * 3.0 + 0.1  # positive terms: the float32 rounding error piles up
    return values, segment_ids(cu), lengths.numel()


def test_float32_sums_are_within_one_rounding_of_the_exact_sum() -> None:
    values, seg, num = _long_batch()
    exact = _exact(values, seg, num)
    out = segment_sum(values, seg, num)
    assert out.dtype == torch.float32
    for i in range(num):
        assert abs(float(out[i]) - exact[i]) <= 0.5 * _ulp32(exact[i]), i
    # negative control: float32 terms added one by one miss the bound on the long segment
    seq = _sequential_fp32(values, seg, num)
    assert abs(float(seq[0]) - exact[0]) > 0.5 * _ulp32(exact[0])


def test_float64_matches_fsum() -> None:
    values, seg, num = _long_batch()
    values = values.double() * 1e3 - 1.5e3
    out = segment_sum(values, seg, num)
    assert out.dtype == torch.float64
    for got, want in zip(out.tolist(), _exact(values, seg, num)):
        assert abs(got - want) <= 1e-12 * max(abs(want), 1.0)


def test_deterministic_and_independent_of_other_segments() -> None:
    values, seg, num = _long_batch()
    first = segment_sum(values, seg, num)
    assert torch.equal(segment_sum(values, seg, num), first)
    # interleave the segments at random, each keeping its own token order: every sum stays bitwise the same
    g = torch.Generator().manual_seed(1)
    shuffled_seg = seg[torch.randperm(seg.numel(), generator=g)]
    shuffled_vals = torch.empty_like(values)
    for i in range(num):
        shuffled_vals[shuffled_seg == i] = values[seg == i]
    assert not torch.equal(shuffled_seg, seg)
    assert torch.equal(segment_sum(shuffled_vals, shuffled_seg, num), first)
    # a segment alone sums to the same value as inside the batch
    alone = segment_sum(values[seg == 3], torch.zeros(int((seg == 3).sum()), dtype=torch.long), 1)
    assert torch.equal(alone[0], first[3])


def test_empty_segments_gradient_and_errors() -> None:
    seg = torch.tensor([2, 0, 2, 2])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64, requires_grad=True)
    out = segment_sum(values, seg, 4)
    assert out.tolist() == [2.0, 0.0, 8.0, 0.0]
    torch.autograd.gradcheck(lambda v: segment_sum(v, seg, 4), (values,))
    assert torch.equal(segment_sum(torch.zeros(0), torch.zeros(0, dtype=torch.long), 3), torch.zeros(3))
    with pytest.raises(ValueError, match="floating-point"):
        segment_sum(torch.tensor([1, 2]), torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="seg has 1 elements"):
        segment_sum(torch.ones(2), torch.tensor([0]), 1)


@pytest.mark.gpu
def test_cuda_run_to_run_deterministic_under_deterministic_algorithms() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(2)
    seg = torch.randint(0, 64, (200_000,), generator=g).cuda()
    values = torch.randn(200_000, generator=g).cuda().requires_grad_(True)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [segment_sum(values, seg, 64) for _ in range(3)]
        runs[0].sum().backward()
    finally:
        torch.use_deterministic_algorithms(prev)
    assert all(torch.equal(r, runs[0]) for r in runs)
    exact = _exact(values.detach().cpu(), seg.cpu(), 64)
    for i in range(64):
        assert abs(float(runs[0][i]) - exact[i]) <= _ulp32(exact[i])
    assert torch.equal(values.grad, torch.ones_like(values))
