"""Triton-interpreter check that every grouped-GEMM launch configuration the sweep may choose gives the same bits.

``TRITON_INTERPRET=1 python tests/_interp_moe_configs.py`` (run by ``tests/test_moe.py`` in a subprocess): each member
of :func:`rlexact.ops.triton_moe.grouped_candidates` (row tile, column tile, K tile, program order, masked or unmasked
K, pointer or TMA weight loads) is run on small shapes -- K a multiple of every BK and not, N not a multiple of BN,
gathered and scattered rows, skewed expert loads, fp32 and bf16 -- and compared with ``torch.equal`` to the reference
(the first candidate) and to a float64 reference within rounding. Negative control: the same products reduced in
another order (K reversed in both operands) give different fp32 bits, so the comparison can fail.
"""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from rlexact.ops import triton_moe  # noqa: E402
from rlexact.ops.moe import moe_plan  # noqa: E402

E, N, TOKENS, TOP_K = 4, 96, 12, 2


def run(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, cfg: triton_moe.GroupedConfig, gather: bool):
    """Expert-sorted rows ``x[order // k] @ w[e].T`` (gate_up-like, ``gather``) or ``x`` sorted rows scattered back
    to pair order (down-like); NaN-prefilled output so unwritten rows show."""
    plan = moe_plan(ids, E)
    rows = plan.num_rows
    out = torch.full((rows, w.shape[1]), float("nan"), dtype=x.dtype)
    if gather:
        triton_moe.grouped_matmul(x, w, out, plan.counts, plan.order, None, TOP_K, cfg)
    else:
        triton_moe.grouped_matmul(x, w, out, plan.counts, None, plan.order, 1, cfg)
    return out


def check_candidates() -> None:
    gen = torch.Generator().manual_seed(0)
    cands = triton_moe.grouped_candidates()
    ids = torch.randint(0, E, (TOKENS, TOP_K), generator=gen)
    ids[:7, 0] = 1  # skewed: expert 1 gets most rows
    for dtype in (torch.float32, torch.bfloat16):
        for k in (128, 80):  # every BK divides 128 (unmasked K loop); 80 leaves a K tail
            w = torch.randn(E, N, k, generator=gen).to(dtype)
            for gather in (True, False):
                x = torch.randn(TOKENS if gather else TOKENS * TOP_K, k, generator=gen).to(dtype)
                ref = run(x, w, ids, cands[0], gather)
                plan = moe_plan(ids, E)
                src = plan.order // TOP_K if gather else torch.arange(plan.num_rows)
                eid = ids.reshape(-1)[plan.order]
                exp = torch.einsum("mk,mnk->mn", x[src].double(), w[eid].double())
                if not gather:
                    exp = torch.empty_like(exp).index_copy_(0, plan.order, exp)
                rtol = 1e-5 if dtype == torch.float32 else 2**-7
                torch.testing.assert_close(ref.double(), exp, atol=1e-4, rtol=rtol)
                for cfg in cands[1:]:
                    out = run(x, w, ids, cfg, gather)
                    assert torch.equal(out, ref), f"{cfg} differs bitwise from {cands[0]} ({dtype}, K={k})"


def check_negative_control() -> None:
    """Reversing K in both operands keeps the math and changes the reduction order: the fp32 bits change."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, E, (TOKENS, TOP_K), generator=gen)
    w = torch.randn(E, N, 128, generator=gen)
    x = torch.randn(TOKENS, 128, generator=gen)
    cfg = triton_moe.grouped_candidates()[0]
    fwd = run(x, w, ids, cfg, True)
    rev = run(x.flip(1).contiguous(), w.flip(2).contiguous(), ids, cfg, True)
    torch.testing.assert_close(fwd, rev, atol=1e-4, rtol=1e-5)
    assert not torch.equal(fwd, rev), "a different reduction order gave the same bits: the check cannot fail"


if __name__ == "__main__":
    check_negative_control()
    check_candidates()
    print("moe configs ok")
