"""Triton-interpreter checks of the MoE kernels (run by tests/test_moe.py in a subprocess).

``TRITON_INTERPRET=1 python tests/_interp_moe.py``: the router kernel (ties, agreement with the torch twin), the
grouped GEMM (float64 reference, batch invariance over 1..24 rows with skewed expert loads, fp32 and bf16) and the
whole expert MLP against a float64 reference. Tiny shapes: the interpreter runs every program in Python.
"""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rlexact import ops  # noqa: E402
from rlexact.ops import cpu_moe  # noqa: E402

torch.manual_seed(0)
T = "triton"


def check_router() -> None:
    ties = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 1.0, 3.0], [-1.0, 5.0, -1.0, 5.0, 2.0]])
    w, ids = ops.moe_router(ties, 2, True, backend=T)
    assert ids.tolist() == [[0, 1], [1, 2], [1, 3]], ids.tolist()
    assert torch.equal(w[0], torch.tensor([0.5, 0.5]))
    nan_row = torch.randn(3, 6)
    nan_row[1] = float("nan")
    w, ids = ops.moe_router(nan_row, 2, True, backend=T)
    assert ids.min() >= 0 and ids.max() < 6  # whatever a NaN row selects, it is a valid expert
    assert torch.equal(w[[0, 2]], ops.moe_router(nan_row[[0, 2]], 2, True, backend=T)[0])
    cases = [(8, 2, True, torch.float32), (12, 3, False, torch.float32), (16, 4, True, torch.bfloat16)]
    for e, k, norm, dtype in cases:
        z = torch.randn(10, e).to(dtype)
        w, ids = ops.moe_router(z, k, norm, backend=T)
        w_ref, ids_ref = cpu_moe.moe_router(z, k, norm)
        assert torch.equal(ids, ids_ref), (ids, ids_ref)
        assert w.dtype == dtype
        torch.testing.assert_close(w.float(), w_ref.float(), atol=1e-6, rtol=2**-7 if dtype != torch.float32 else 1e-6)
        singles = torch.cat([ops.moe_router(z[i : i + 1], k, norm, backend=T)[0] for i in range(10)])
        assert torch.equal(singles, w)


def check_grouped() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(5, 37, 40).to(dtype)
        pool = torch.randn(24, 40).to(dtype)
        eids = torch.randint(0, 5, (24,))
        eids[:20] = 3  # skewed: expert 3 spans two 16-row tiles, the others share the rest
        full = ops.grouped_matmul(pool, w, eids, backend=T)
        ref = torch.einsum("mk,mnk->mn", pool.double(), w[eids].double())
        rtol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(full.double(), ref, atol=1e-4, rtol=rtol)
        singles = [ops.grouped_matmul(pool[i : i + 1], w, eids[i : i + 1], backend=T) for i in range(24)]
        for m in (1, 2, 5, 17, 24):
            idx = [(3 + 5 * j) % 24 for j in range(m)]
            out = ops.grouped_matmul(pool[idx], w, eids[idx], backend=T)
            for pos, i in enumerate(idx):
                assert torch.equal(out[pos : pos + 1], singles[i]), (dtype, m, pos, i)


def check_tiles() -> None:
    """Every row computed once by the worst-case grid: 64 experts, most empty, one with 3 tiles; idle tiles write
    nothing (the output is pre-filled with NaN)."""
    from rlexact.ops import triton_moe

    w = torch.randn(64, 20, 24)
    eids = torch.tensor([5] * 40 + [63] * 3 + [0] * 2 + [17])
    x = torch.randn(eids.numel(), 24)
    counts = torch.bincount(eids, minlength=64)
    order = torch.sort(eids, stable=True).indices
    out = torch.full((eids.numel(), 20), float("nan"))
    triton_moe.grouped_matmul(x, w, out, counts, order, order)
    ref = torch.einsum("mk,mnk->mn", x.double(), w[eids].double())
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)
    assert triton_moe.num_row_tiles(46, 64, 16) == (46 + 46 * 15) // 16


def check_experts() -> None:
    t, h, e, inter, k = 19, 32, 6, 20, 3
    x = torch.randn(t, h)
    gu, down = torch.randn(e, 2 * inter, h) * 0.3, torch.randn(e, h, inter) * 0.3
    wts, ids = ops.moe_router(torch.randn(t, e), k, True, backend=T)
    out = ops.moe_experts(x, ids, wts, gu, down, backend=T)
    hh = torch.einsum("tkoh,th->tko", gu[ids].double(), x.double())
    y = torch.einsum("tkhi,tki->tkh", down[ids].double(), F.silu(hh[..., :inter]) * hh[..., inter:])
    ref = (wts.double()[..., None] * y).sum(1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    singles = torch.cat([ops.moe_experts(x[i : i + 1], ids[i : i + 1], wts[i : i + 1], gu, down, backend=T)
                         for i in range(t)])  # fmt: skip
    assert torch.equal(singles, out)


def check_backward() -> None:
    """Triton backward (grouped input-gradient GEMMs, per-expert weight-gradient kernel) vs float64 autograd, twice
    bitwise; experts 0 and 5 receive no rows."""
    t, h, e, inter, k = 17, 24, 7, 12, 2
    x = torch.randn(t, h)
    gu, down = torch.randn(e, 2 * inter, h) * 0.3, torch.randn(e, h, inter) * 0.3
    ids = torch.stack([torch.randint(1, 5, (t,)), torch.full((t,), 6)], dim=1)
    wts = torch.rand(t, k)
    g_out = torch.randn(t, h)

    def run(dtype: torch.dtype, exact: bool) -> list[torch.Tensor]:
        leaves = [p.detach().to(dtype).clone().requires_grad_(True) for p in (x, wts, gu, down)]
        xx, ww, gg, dd = leaves
        if exact:
            out = ops.moe_experts(xx, ids, ww, gg, dd, backend=T)
        else:
            hh = torch.einsum("tkoh,th->tko", gg[ids], xx)
            y = torch.einsum("tkhi,tki->tkh", dd[ids], F.silu(hh[..., :inter]) * hh[..., inter:])
            out = (ww[..., None] * y).sum(1)
        out.backward(g_out.to(dtype))
        return [p.grad for p in leaves]

    got, ref = run(torch.float32, True), run(torch.float64, False)
    for name, a, b in zip(["x", "weights", "gate_up", "down"], got, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)
    assert got[2][0].abs().max() == 0 and got[2][5].abs().max() == 0
    assert all(torch.equal(a, b) for a, b in zip(got, run(torch.float32, True)))


if __name__ == "__main__":
    check_router()
    check_grouped()
    check_tiles()
    check_experts()
    check_backward()
    print("moe ok")
