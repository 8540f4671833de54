"""The warp-specialized Gluon matmul (``rlexact.ops.gluon_matmul``) gives the library's ``tl`` matmul rows bitwise."""

from __future__ import annotations

import functools

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")

ROWS = (100, 256, 1000)
"""Row counts of the bitwise checks: the library runs the kernel above 64 rows; one and several row tiles, with and
without the row count's divisibility by 16 (each a compiled specialization)."""


def _configs():  # noqa: ANN202 - the module imports Triton's Gluon, only on a GPU run
    from rlexact.ops.gluon_matmul import GluonMatmulConfig

    return (
        GluonMatmulConfig(128, 256),
        GluonMatmulConfig(128, 128),
        GluonMatmulConfig(128, 64),
        GluonMatmulConfig(64, 128, per_sm=2),
        GluonMatmulConfig(64, 64, per_sm=2),
    )


def test_config_rejects_unsupported_tiles() -> None:
    from rlexact.ops.gluon_matmul import SMEM_LIMIT, GluonMatmulConfig

    with pytest.raises(ValueError, match="BM=96"):
        GluonMatmulConfig(96, 128)
    with pytest.raises(ValueError, match="per_sm=3"):
        GluonMatmulConfig(64, 64, per_sm=3)
    assert GluonMatmulConfig(128, 256).ring_bytes(gated=False) <= SMEM_LIMIT
    assert GluonMatmulConfig(128, 256).ring_bytes(gated=True) > SMEM_LIMIT
    assert GluonMatmulConfig(128, 128).ring_bytes(gated=True) <= SMEM_LIMIT


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["plain", "silu", "gelu"])
@pytest.mark.parametrize("nk", [(2048, 2048), (300, 2048), (6144, 2048), (200, 72)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_gluon_matmul_equals_library(nk: tuple[int, int], kind: str, dtype: torch.dtype) -> None:
    """Every tile shape, at row counts around and across its tiles and for column counts that end mid-tile, gives
    the rows of the library's ``matmul`` (plain) or ``gated_matmul`` (``w [2N, K]``: a gate chain and an up chain,
    SiLU or GELU gate) bitwise, and agrees with an fp32 reference. Negative control: a perturbed ``x`` row changes
    that row and no other."""
    from rlexact.ops import gluon_matmul
    from rlexact.ops import triton_matmul as tmm

    n, k = nk
    gated, gelu = kind != "plain", kind == "gelu"
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    if not gluon_matmul.supported(w.device):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    if gated and tmm.gated_config_for(256, n, k, dtype, w.device) is None:
        pytest.skip("the library runs no gated kernel for this shape")
    lib = functools.partial(tmm.gated_matmul, gelu=gelu) if gated else tmm.matmul
    assert not tmm.chain_splits(n, k, dtype, w.device)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        ref = lib(x, w)
        full = x.float() @ w.float().T
        if gated:
            act = functools.partial(torch.nn.functional.gelu, approximate="tanh") if gelu else torch.nn.functional.silu
            full = act(full[:, :n]) * full[:, n:]
        torch.testing.assert_close(ref.float(), full, atol=3e-2, rtol=3e-2)
        for cfg in _configs() if dtype == torch.bfloat16 else _configs()[1::3]:  # fp16: two tile shapes
            if cfg.ring_bytes(gated) > gluon_matmul.SMEM_LIMIT:
                with pytest.raises(ValueError, match="shared memory"):
                    gluon_matmul.forward(x, w, torch.empty_like(ref), cfg, gated, gelu)
                continue
            out = torch.full_like(ref, float("nan"))
            gluon_matmul.forward(x, w, out, cfg, gated, gelu)
            assert torch.equal(out, ref), (m, cfg)
    x2 = x.clone()
    x2[3, 0] += 1.0
    out = torch.empty_like(ref)
    gluon_matmul.forward(x2, w, out, _configs()[1], gated, gelu)
    assert not torch.equal(out[3], ref[3])
    others = torch.arange(x.shape[0], device="cuda") != 3
    assert torch.equal(out[others], ref[others])


@pytest.mark.gpu
@gpu
def test_gpu_gated_matmul_dispatches_gluon(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 ``gated_matmul`` runs the Gluon kernel at the row counts ``GLUON_GATED_VARIANTS`` gives it and the
    ``tl`` tiles elsewhere; both give the ``tl`` tiles' rows bitwise (the Qwen3-1.7B MLP's gate and up)."""
    from rlexact.ops import gluon_matmul
    from rlexact.ops import triton_matmul as tmm

    n, k = 6144, 2048
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(2 * n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    if not gluon_matmul.supported(w.device):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    calls: list = []
    real = gluon_matmul.forward
    monkeypatch.setattr(tmm, "GATED_CUBLAS_ROWS", (1, 0))  # the fused kernels at every M
    monkeypatch.setattr(gluon_matmul, "forward", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    for m in (1, 64, 65, 128, 200, 256, 2048):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        tl_cfg = tmm.gated_config_for(m, n, k, x.dtype, x.device)
        ref = tmm.matmul_with_config(x, w, tl_cfg, gated=True)
        before = len(calls)
        out = tmm.gated_matmul(x.view(1, m, k), w)
        assert out.shape == (1, m, n) and torch.equal(out[0], ref), m
        want = tmm.gluon_gated_config(m, n, k, x.dtype, x.device)
        assert (want is None) == (m <= 64)
        assert calls[before:] == ([want] if want is not None else []), m


@pytest.mark.gpu
@gpu
def test_gpu_gluon_gated_matmul_misaligned_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that start off a 16-byte boundary (a contiguous view into a larger buffer) go through the Gluon kernel
    like aligned ones: the same bits as their aligned copy (a TMA descriptor cannot start there, so it copies)."""
    from rlexact.ops import gluon_matmul
    from rlexact.ops import triton_matmul as tmm

    n, k, m = 6144, 2048, 256
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(2 * n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    if not gluon_matmul.supported(w.device):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    monkeypatch.setattr(tmm, "GATED_CUBLAS_ROWS", (1, 0))  # the fused kernels at every M
    buf = torch.randn(m * k + 1, device="cuda", generator=g).to(torch.bfloat16)
    x = buf[1:].view(m, k)
    assert x.data_ptr() % 16 and tmm.gluon_gated_config(m, n, k, x.dtype, x.device) is not None
    assert torch.equal(tmm.gated_matmul(x, w), tmm.gated_matmul(x.clone(), w))
