"""The warp-specialized Gluon matmul (``rlexact.ops.gluon_matmul``) gives the library's ``tl`` matmul rows bitwise."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")

ROWS = (1, 37, 128, 256, 1000)


def _configs():  # noqa: ANN202 - the module imports Triton's Gluon, only on a GPU run
    from rlexact.ops.gluon_matmul import GluonMatmulConfig

    return (
        GluonMatmulConfig(128, 256),
        GluonMatmulConfig(128, 128),
        GluonMatmulConfig(128, 64),
        GluonMatmulConfig(64, 128, per_sm=2, maxnreg=128),
        GluonMatmulConfig(64, 64, per_sm=2, maxnreg=128),
    )


def test_config_rejects_unsupported_tiles() -> None:
    from rlexact.ops.gluon_matmul import GluonMatmulConfig

    with pytest.raises(ValueError, match="BM=96"):
        GluonMatmulConfig(96, 128)
    with pytest.raises(ValueError, match="per_sm=3"):
        GluonMatmulConfig(64, 64, per_sm=3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("nk", [(2048, 2048), (300, 2048), (6144, 2048), (200, 72)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_gluon_matmul_equals_library(nk: tuple[int, int], gated: bool, dtype: torch.dtype) -> None:
    """Every tile shape, at row counts around and across its tiles and for column counts that end mid-tile, gives
    the rows of the library's ``matmul`` (plain) or ``gated_matmul`` (``w [2N, K]``) bitwise, and agrees with an fp32
    reference. Negative control: a perturbed ``x`` row changes that row and no other."""
    from rlexact.ops import gluon_matmul
    from rlexact.ops import triton_matmul as tmm

    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    if not gluon_matmul.supported(torch.empty(1, k, device="cuda", dtype=dtype), w):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    if gated and tmm.gated_config_for(256, n, k, dtype, w.device) is None:
        pytest.skip("the library runs no gated kernel for this shape")
    lib = tmm.gated_matmul if gated else tmm.matmul
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        ref = lib(x, w)
        full = x.float() @ w.float().T
        if gated:
            full = torch.nn.functional.silu(full[:, :n]) * full[:, n:]
        torch.testing.assert_close(ref.float(), full, atol=3e-2, rtol=3e-2)
        for cfg in _configs():
            out = torch.full_like(ref, float("nan"))
            gluon_matmul.forward(x, w, out, cfg, gated)
            assert torch.equal(out, ref), (m, cfg)
    x2 = x.clone()
    x2[3, 0] += 1.0
    out = torch.empty_like(ref)
    gluon_matmul.forward(x2, w, out, _configs()[0], gated)
    assert not torch.equal(out[3], ref[3])
    others = torch.arange(x.shape[0], device="cuda") != 3
    assert torch.equal(out[others], ref[others])
