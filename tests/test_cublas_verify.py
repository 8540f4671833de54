"""The cuBLAS check of the exact matmul (:mod:`rlexact.ops.cublas_verify`): it accepts a product computed in the
exact chain's order and rejects one computed in another order (CPU), and on a GPU the library's matmul runs cuBLAS
only where it gave the exact kernel's bits (rows equal to the same rows of a product too large for cuBLAS), while the
check rejects the library's fixed K splits, which cuBLAS does not compute."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlexact.ops import cublas_verify

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _weights(n: int, k: int, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(n + k)
    return (torch.randn(n, k, device=device, generator=g) / k**0.5).to(dtype)


def _check(exact) -> bool:  # noqa: ANN001 - a product (x, w) -> x @ w.T
    return cublas_verify.same_bits(exact, 8, 64, 256, torch.bfloat16, torch.device("cpu"))


def test_same_bits_accepts_the_same_order() -> None:
    assert _check(lambda x, w: torch.mm(x, w.t()))


def test_same_bits_rejects_another_order() -> None:
    """Negative control: the same products summed over K in reverse order."""
    assert not _check(lambda x, w: torch.mm(x.flip(-1), w.flip(-1).t()))


def test_same_bits_rejects_split_k() -> None:
    """Negative control: two chains over halves of K, summed in fp32 (what a split-K kernel does)."""
    def split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.shape[1] // 2
        return (torch.mm(x[:, :h].float(), w[:, :h].float().t()) + torch.mm(x[:, h:].float(), w[:, h:].float().t()))

    assert not _check(lambda x, w: split(x, w).to(x.dtype))


def test_same_bits_rejects_a_wider_accumulator() -> None:
    """Negative control: the same order with an fp64 accumulator."""
    assert not _check(lambda x, w: torch.mm(x.double(), w.double().t()).to(x.dtype))


def test_aligned_like_probe() -> None:
    x = torch.zeros(1024, dtype=torch.bfloat16)
    assert cublas_verify.aligned_like_probe(x) == (x.data_ptr() % cublas_verify.ALIGNMENT == 0)
    assert not cublas_verify.aligned_like_probe(x[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")
def test_gpu_matmul_cublas_rows_equal_library_kernel() -> None:
    """At decode row counts of the fused q/k/v and o projections the library's matmul runs cuBLAS where the check
    passed; either way its rows equal the same rows inside a product above :data:`CUBLAS_MAX_M` rows (the library's
    own kernel), so the dispatch cannot change a row."""
    from rlexact.ops import triton_matmul as tm

    shapes = [(4096, 2048), (2048, 2048)]
    if not tm.chain_splits(2048, 6144, torch.bfloat16, torch.device("cuda")):
        shapes.append((2048, 6144))  # the Qwen3-1.7B down projection, one chain over all of K on this GPU
    for n, k in shapes:
        w = _weights(n, k, "cuda")
        big = torch.randn(tm.CUBLAS_MAX_M * 2, k, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
        big = big.to(torch.bfloat16)
        ref = tm.matmul(big, w)
        for m in (1, 7, 64, 256, tm.CUBLAS_MAX_M):
            x = big[:m].clone()
            assert torch.equal(tm.matmul(x, w), ref[:m]), f"{n}x{k} M={m}"
            plan = tm._LAUNCHES[(m, n, k, torch.bfloat16, 0)]
            assert plan.cublas is not None and cublas_verify.settings() in plan.cublas


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")
def test_gpu_check_rejects_fixed_k_splits() -> None:
    """Negative control on the GPU: a narrow K-heavy product's chain restarts every ``KS`` columns; cuBLAS's does
    not, and the check says so (its plans are not offered to cuBLAS at all)."""
    from rlexact.ops import triton_matmul as tm

    n, k = 1024, 8192
    if not tm.chain_splits(n, k, torch.bfloat16, torch.device("cuda")):
        pytest.skip("this GPU's matmul does not split K for a 1,024 x 8,192 product")
    w = _weights(n, k, "cuda")
    assert not cublas_verify.same_bits(tm.matmul, 256, n, k, torch.bfloat16, w.device)
    tm.matmul(torch.randn(256, k, device="cuda").to(torch.bfloat16), w)
    assert tm._LAUNCHES[(256, n, k, torch.bfloat16, 0)].cublas is None


def test_settings_follow_the_switches() -> None:
    """A verdict is keyed by the settings: changing a switch that changes cuBLAS's kernel changes the key."""
    before = cublas_verify.settings()
    m = torch.backends.cuda.matmul
    for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
        old = getattr(m, name)
        try:
            setattr(m, name, not old)
            assert cublas_verify.settings() != before, name
        finally:
            setattr(m, name, old)
    assert cublas_verify.settings() == before
