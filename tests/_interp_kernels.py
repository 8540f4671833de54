"""Triton-interpreter checks of the exact kernels (run by tests/test_triton_kernels.py in a subprocess).

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, so this runs as its own process:
``TRITON_INTERPRET=1 python tests/_interp_kernels.py [matmul|norm|logprob|rope ...]``. Every check asserts; any failure
exits non-zero. Shapes are tiny (the interpreter executes every program in Python).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from _interp_dot import use_row_invariant_interpreter_dot  # noqa: E402
from rlexact import ops  # noqa: E402
from rlexact.ops import cpu, reference  # noqa: E402
from rlexact.ops import triton_backward as tbw  # noqa: E402
from rlexact.ops import triton_logprob as tlp  # noqa: E402
from rlexact.ops import triton_matmul as tmm  # noqa: E402
from rlexact.ops import triton_norm as tnorm  # noqa: E402
from rlexact.ops import triton_rope as trope  # noqa: E402

torch.manual_seed(1234)


def _rel_err(got: torch.Tensor, ref64: torch.Tensor, scale: torch.Tensor) -> float:
    return ((got.double() - ref64).abs() / scale.clamp_min(1e-30)).max().item()


def _check_invariant(fn, pool: torch.Tensor, max_rows: int, what: str) -> None:
    """``fn(batch)`` rows must equal ``fn(row)`` bitwise for every batch size 1..max_rows and several positions."""
    singles = [fn(pool[i : i + 1]) for i in range(pool.shape[0])]
    n = pool.shape[0]
    for m in range(1, max_rows + 1):
        for shift in (0, 5):
            idx = [(shift + 3 * j) % n for j in range(m)]
            out = fn(pool[idx])
            for pos, i in enumerate(idx):
                got = out[pos : pos + 1]
                assert torch.equal(got, singles[i]), f"{what}: row {i} at position {pos} of batch {m} differs"


# ----------------------------------------------------------------------------------------------------------------------


def check_matmul() -> None:
    # correctness vs float64: odd N and K, power-of-two K, several row tiles
    for m, n, k in [(5, 37, 40), (33, 64, 64), (17, 96, 96), (3, 1, 7), (40, 50, 128)]:
        x, w = torch.randn(m, k), torch.randn(n, k)
        y = tmm.matmul(x, w)
        ref = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert _rel_err(y, ref, scale) < 1e-5, (m, n, k, _rel_err(y, ref, scale))
    # bf16 in, bf16 out (fp32 accumulation, one rounding): equals the fp32-accumulated result rounded once
    xb, wb = torch.randn(9, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    yb = tmm.matmul(xb, wb)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), (xb.double() @ wb.double().T).float(), rtol=2**-8 + 1e-6, atol=1e-6)
    # matches the CPU twin semantically
    x, w = torch.randn(11, 40), torch.randn(37, 40)
    torch.testing.assert_close(tmm.matmul(x, w), cpu.matmul(x, w), rtol=1e-5, atol=1e-5)

    # batch invariance (portable kernel, the interpreter's static config; 16-row tiles -> up to 3 row tiles)
    for n, k, dtype in [(37, 40, torch.float32), (64, 64, torch.float32), (24, 48, torch.bfloat16)]:
        w = torch.randn(n, k).to(dtype)
        pool = torch.randn(26, k).to(dtype)
        _check_invariant(lambda xb, w=w: tmm.matmul(xb, w), pool, 26 if dtype == torch.float32 else 12, f"mm{n}x{k}")

    # the persistent TMA kernel (tensor descriptors) under the interpreter: correctness + invariance
    for cfg in [
        tmm.MatmulConfig("tma", 16, 32, 32, 4, 1),
        tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, subtile=True),
        tmm.MatmulConfig("tma", 32, 16, 16, 4, 1),
        tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, subtile=True, device_desc=False),  # host descriptors
    ]:
        x, w = torch.randn(37, 68), torch.randn(44, 68)
        y = tmm.matmul_with_config(x, w, cfg)
        ref = x.double() @ w.double().T
        assert _rel_err(y, ref, x.double().abs() @ w.double().abs().T) < 1e-5, cfg
    w = torch.randn(44, 68)
    cfg = tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, subtile=True)
    _check_invariant(lambda xb: tmm.matmul_with_config(xb, w, cfg), torch.randn(20, 68), 20, "tma")

    # fixed K splits: the in-register sum ("tma" with KS) and the split launch ("split") give the same bits at every M
    w = torch.randn(44, 200)
    seq = tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, KS=64)
    par = tmm.MatmulConfig("split", 16, 32, 32, 4, 1, KS=64)
    pool = torch.randn(20, 200)
    full = tmm.matmul_with_config(pool, w, seq)
    assert _rel_err(full, pool.double() @ w.double().T, pool.double().abs() @ w.double().abs().T) < 1e-5
    for m in (1, 7, 20):
        assert torch.equal(tmm.matmul_with_config(pool[:m], w, par), full[:m]), f"split launch differs at M={m}"
    _check_invariant(lambda xb: tmm.matmul_with_config(xb, w, par), pool, 12, "split")
    # negative control: the splits are taken (the unsplit chain rounds differently)
    assert not torch.equal(full, tmm.matmul_with_config(pool, w, tmm.MatmulConfig("tma", 16, 32, 32, 4, 1)))

    # the gated products (w = [gate rows; up rows]): bitwise the two products under the same tiles and the gate's op
    # (silu_mul, gelu_tanh_mul), in both kernels, with N not a multiple of BN (the last gate tile reads up rows; their
    # columns are clipped)
    n, k = 40, 72
    gates = {
        False: (tnorm.silu_mul, torch.nn.functional.silu),
        True: (tnorm.gelu_tanh_mul, functools.partial(torch.nn.functional.gelu, approximate="tanh")),
    }
    for cfg in [
        tmm.MatmulConfig("ptr", 16, 32, 32, 4, 1),
        tmm.MatmulConfig("tma", 16, 32, 32, 4, 1),
        tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, subtile=True),
        tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, joint=True),
        tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, subtile=True, joint=True),
    ]:
        for (gelu, (gate_op, act64)), dtype in itertools.product(gates.items(), (torch.float32, torch.bfloat16)):
            x, w = torch.randn(21, k).to(dtype), (torch.randn(2 * n, k) * 0.3).to(dtype)
            got = tmm.matmul_with_config(x, w, cfg, gated=True, gelu=gelu)
            plain = dataclasses.replace(cfg, joint=False)
            g, u = tmm.matmul_with_config(x, w[:n], plain), tmm.matmul_with_config(x, w[n:], plain)
            assert torch.equal(got, gate_op(g, u)), (cfg, dtype, gelu)
            xd, gd, ud = x.double(), w[:n].double(), w[n:].double()
            ref = act64(xd @ gd.T) * (xd @ ud.T)
            scale = (xd.abs() @ gd.abs().T) * (xd.abs() @ ud.abs().T)  # bounds |g| |u|: the product's error scale
            assert _rel_err(got, ref, scale) < (1e-6 if dtype == torch.float32 else 1e-2), (cfg, dtype, gelu)
            # negative controls: the halves swapped, the other gate, and (bf16) the gate applied to the unrounded
            # fp32 products
            assert not torch.equal(got, gate_op(u, g)), cfg
            assert not torch.equal(got, gates[not gelu][0](g, u)), cfg
            if dtype == torch.bfloat16:
                g32 = tmm.matmul_with_config(x.float(), w[:n].float(), plain)
                u32 = tmm.matmul_with_config(x.float(), w[n:].float(), plain)
                assert not torch.equal(got, gate_op(g32, u32).to(dtype)), cfg
        _check_invariant(
            lambda xb, w=w, cfg=cfg: tmm.matmul_with_config(xb, w, cfg, gated=True, gelu=True),
            torch.randn(14, k).bfloat16(), 14, f"gated {cfg.kernel}",
        )  # fmt: skip
    for cfg, gated, msg in [
        (tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, KS=32), True, "splits K"),
        (tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, joint=True), False, "joint gate/up tiles"),
        (tmm.MatmulConfig("tma", 16, 32, 32, 4, 1, device_desc=False), True, "device descriptors"),
    ]:
        try:
            tmm.matmul_with_config(x, w, cfg, gated=gated)
        except ValueError as e:
            assert msg in str(e), e
        else:
            raise AssertionError(f"{cfg} (gated={gated}) was not refused")

    # NEGATIVE CONTROLS. (1) native CPU torch matmul is not batch-invariant here.
    x, w = torch.randn(32, 96), torch.randn(64, 96)
    singles = torch.cat([x[i : i + 1] @ w.T for i in range(32)])
    assert any(not torch.equal(x[:m] @ w.T, singles[:m]) for m in range(1, 33)), "negative control: torch CPU mm"
    # (2) the checker catches a kernel whose K tile depends on M (what the static config forbids).
    bad = lambda xb: tmm.matmul_with_config(  # noqa: E731
        xb, w, tmm.MatmulConfig("ptr", 16, 32, 32 if xb.shape[0] == 1 else 16, 4, 1)
    )
    try:
        _check_invariant(bad, x, 8, "bad")
    except AssertionError:
        pass
    else:
        raise AssertionError("negative control: an M-dependent BK was not detected")
    print("matmul ok")


def check_norm_round_once() -> None:
    """``round_normed=False`` (OLMo-2): bitwise the CPU twin in bf16 (one rounding of the fp32 product on both), in
    x's dtype, batch invariant, in the two-pass path too; the default's extra rounding differs (negative control)."""
    old = tnorm.MAX_NORM_BLOCK
    for block in (old, 32):
        tnorm.MAX_NORM_BLOCK = block
        try:
            x, w = (torch.randn(9, 100) * 3).bfloat16(), (1 + 0.1 * torch.randn(100)).bfloat16()
            y = tnorm.rms_norm(x, w, 1e-6, round_normed=False)
            assert y.dtype == torch.bfloat16
            assert torch.equal(y, cpu.rms_norm(x, w, 1e-6, round_normed=False)), block
            assert not torch.equal(y, tnorm.rms_norm(x, w, 1e-6)), "negative control"
            wf = w.float()  # an fp32 weight still gives x's dtype
            assert tnorm.rms_norm(x, wf, 1e-6, round_normed=False).dtype == torch.bfloat16
        finally:
            tnorm.MAX_NORM_BLOCK = old
    _check_invariant(lambda xb: tnorm.rms_norm(xb, w, 1e-6, round_normed=False), x.float() * 2, 9, "rms_norm once")
    # offset (Gemma 3): the scale 1 + w added in fp32 in the kernel, bitwise an fp32 weight 1 + w and the CPU twin
    y = tnorm.rms_norm(x, w, 1e-6, round_normed=False, offset=True)
    assert torch.equal(y, tnorm.rms_norm(x, 1.0 + w.float(), 1e-6, round_normed=False))
    assert torch.equal(y, cpu.rms_norm(x, w, 1e-6, round_normed=False, offset=True))
    assert not torch.equal(y, tnorm.rms_norm(x, w, 1e-6, round_normed=False)), "negative control: no offset"
    r = (torch.randn(9, 100) * 3).bfloat16()
    normed, summed = tnorm.add_rms_norm(x, r, w, 1e-6, round_normed=False, offset=True)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, tnorm.rms_norm(x + r, w, 1e-6, round_normed=False, offset=True))


def check_norm_add_norm() -> None:
    """``norm_add_rms_norm``: bitwise the norm kernel then the add-norm kernel for each norm kind and dtype, at a row
    that fits one block and (``MAX_NORM_BLOCK`` lowered) at one that takes the separate launches; a different branch
    ``eps`` changes the bits (negative control); a branch norm that would promote the rows is refused."""
    kinds = ({}, {"round_normed": False}, {"round_normed": False, "offset": True})
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for kind in kinds:
            x, r = (torch.randn(9, 100) * 3).to(dtype), torch.randn(9, 100).to(dtype)
            wx, w = (1 + 0.1 * torch.randn(100)).to(dtype), (1 + 0.1 * torch.randn(100)).to(dtype)
            separate = tnorm.add_rms_norm(tnorm.rms_norm(x, wx, 1e-6, **kind), r, w, 1e-5, **kind)
            fused = tnorm.norm_add_rms_norm(x, wx, 1e-6, r, w, 1e-5, **kind)
            assert all(torch.equal(a, b) for a, b in zip(fused, separate)), (dtype, kind)
            other = tnorm.norm_add_rms_norm(x, wx, 1e-1, r, w, 1e-5, **kind)
            assert not torch.equal(other[1], fused[1]), "negative control: the branch eps"
    old = tnorm.MAX_NORM_BLOCK
    tnorm.MAX_NORM_BLOCK = 32
    try:
        x, r = torch.randn(5, 100).bfloat16(), torch.randn(5, 100).bfloat16()
        wx, w = torch.randn(100).bfloat16(), torch.randn(100).bfloat16()
        fused = tnorm.norm_add_rms_norm(x, wx, 1e-6, r, w, 1e-5)
        separate = tnorm.add_rms_norm(tnorm.rms_norm(x, wx, 1e-6), r, w, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(fused, separate))
    finally:
        tnorm.MAX_NORM_BLOCK = old
    try:
        tnorm.norm_add_rms_norm(x, wx.float(), 1e-6, r, w, 1e-5)
    except ValueError as e:
        assert "apart" in str(e)
    else:
        raise AssertionError("an fp32 branch weight would promote the branch norm's rows")
    _check_invariant(lambda xb: tnorm.norm_add_rms_norm(xb, wx.float(), 1e-6, xb * 0.5, w.float(), 1e-5)[0],
                     torch.randn(20, 100), 20, "norm_add_rms_norm")  # fmt: skip


def check_norm() -> None:
    for h in (1, 40, 64, 100):
        for xd, wd in [
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
            (torch.bfloat16, torch.float32),
        ]:
            x = (torch.randn(7, h) * 3).to(xd)
            w = (1 + 0.1 * torch.randn(h)).to(wd)
            y = tnorm.rms_norm(x, w, 1e-6)
            assert y.dtype == torch.promote_types(wd, xd)
            xf = x.double()
            y64 = w.double() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
            if xd == torch.float32:
                assert _rel_err(y, y64, y64.abs() + 1e-3) < 1e-5, h
            else:  # one bf16 rounding of the normalized value (+ one of the product): compare with the CPU twin
                torch.testing.assert_close(y, cpu.rms_norm(x, w, 1e-6), rtol=1e-2, atol=1e-2)
                assert (y.double() - cpu.rms_norm(x, w, 1e-6).double()).ne(0).float().mean() < 0.05
    # the chunked (two-pass) path
    old = tnorm.MAX_NORM_BLOCK
    tnorm.MAX_NORM_BLOCK = 32
    try:
        x, w = torch.randn(5, 100), torch.randn(100)
        torch.testing.assert_close(tnorm.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    finally:
        tnorm.MAX_NORM_BLOCK = old
    w = 1 + 0.1 * torch.randn(100)
    _check_invariant(lambda xb: tnorm.rms_norm(xb, w, 1e-6), torch.randn(20, 100), 20, "rms_norm")
    check_norm_round_once()
    check_norm_add_norm()

    for dtype in (torch.float32, torch.bfloat16):
        g, u = (torch.randn(6, 1500) * 4).to(dtype), torch.randn(6, 1500).to(dtype)
        y = tnorm.silu_mul(g, u)
        assert y.dtype == dtype
        ref = torch.nn.functional.silu(g.double()) * u.double()
        if dtype == torch.float32:
            assert _rel_err(y, ref, ref.abs() + 1e-6) < 1e-5
        else:
            torch.testing.assert_close(y, reference.silu_mul(g, u), rtol=1e-2, atol=1e-2)
    _check_invariant(lambda gb: tnorm.silu_mul(gb, gb * 0.5 + 1), torch.randn(20, 1100), 20, "silu_mul")
    for dtype in (torch.float32, torch.bfloat16):
        g, u = (torch.randn(6, 1500) * 4).to(dtype), torch.randn(6, 1500).to(dtype)
        y = tnorm.gelu_tanh_mul(g, u)
        ref = torch.nn.functional.gelu(g.double(), approximate="tanh") * u.double()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert _rel_err(y, ref, ref.abs() + 1e-6) < tol, dtype
        assert not torch.equal(y, tnorm.silu_mul(g, u))  # negative control: the SiLU gate
    _check_invariant(lambda gb: tnorm.gelu_tanh_mul(gb, gb * 0.5 + 1), torch.randn(20, 1100), 20, "gelu_tanh_mul")
    print("norm ok")


ROPE_NORMS = (None, (True, False), (False, True))
"""The fused rotary kernel's q/k norms: none, Llama's, Gemma 3's round-once ``1 + w`` (``(round_normed, offset)``)."""


def check_rope() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ROPE_NORMS:
            for hq, hk, d in ((4, 2, 16), (3, 3, 24)):
                t, norm, flags = 12, kind is not None, kind or (True, False)
                q, k = (torch.randn(t, hq, d) * 2).to(dtype), (torch.randn(t, hk, d) * 2).to(dtype)
                ang = torch.rand(t, d // 2) * 50
                cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
                qw = torch.rand(d).add(0.5).to(dtype) if norm else None
                kw = torch.rand(d).add(0.5).to(dtype) if norm else None
                qo, ko = trope.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, *flags)
                cq, ck = cpu.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, *flags)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                for got, twin, x, w in ((qo, cq, q, qw), (ko, ck, k, kw)):
                    w64 = None if w is None else w.double()
                    ref = reference.norm_rope(x.double(), cos.double(), sin.double(), w64, 1e-6, offset=flags[1])
                    assert (got.double() - ref).norm() / ref.norm() < tol, (dtype, kind, hq, d)
                    torch.testing.assert_close(got.float(), twin.float(), rtol=tol, atol=tol)
                if kind == (False, True):  # negative control: Gemma's norm is not Llama's
                    assert not torch.equal(trope.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)[0], qo)
                for i in range(t):
                    r = slice(i, i + 1)
                    q1, k1 = trope.qk_norm_rope(q[r], k[r], cos[r], sin[r], qw, kw, 1e-6, *flags)
                    assert torch.equal(q1, qo[r]) and torch.equal(k1, ko[r]), f"rope row {i} differs"
    print("rope ok")


def check_logprob() -> None:
    cases = [(6, 40, 37, 1.0), (9, 64, 300, 0.7), (5, 24, 1000, 1.3)]  # tiny vocab, several splits, larger vocab
    for t, h, v, temp in cases:
        hid, w = torch.randn(t, h), torch.randn(v, h) * 0.3
        tgt = torch.randint(0, v, (t,))
        lp, ent = tlp.token_logprobs(hid, w, tgt, temp)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (t,)
        rl, re = reference.token_logprobs(hid.double(), w.double(), tgt, temp)
        assert (lp.double() - rl).abs().max().item() < 1e-5 * max(1.0, rl.abs().max().item()), (t, h, v)
        assert (ent.double() - re).abs().max().item() < 1e-5 * max(1.0, re.abs().max().item()), (t, h, v)
        # the bitwise sampler/trainer contract: z[i, t] - lse[i] == token_logprobs(..., t)[0][i] for every t
        z, lse = tlp.lm_head_logits(hid, w, temp)
        assert z.shape == (t, v) and lse.shape == (t,)
        zr = (hid.double() @ w.double().T) / temp
        assert (z.double() - zr).abs().max().item() < 1e-5 * max(1.0, zr.abs().max().item())
        for tok in sorted({0, v - 1, v // 2, *range(0, v, max(1, v // 5))}):
            lp_t, _ = tlp.token_logprobs(hid, w, torch.full((t,), tok), temp)
            assert torch.equal(z[:, tok] - lse, lp_t), f"lm_head_logits/token_logprobs contract broken at token {tok}"
        assert torch.equal(z.gather(1, tgt[:, None]).squeeze(1) - lse, lp)

    # batch invariance of logp and entropy (BM=16 in the interpreter -> batches span two row tiles)
    h, v = 40, 300
    w = torch.randn(v, h) * 0.3
    pool = torch.randn(20, h)
    tgts = torch.randint(0, v, (20,))
    rowmap = {pool[i].numpy().tobytes(): i for i in range(20)}

    def both(hb: torch.Tensor) -> torch.Tensor:
        tb = torch.stack([tgts[rowmap[r.numpy().tobytes()]] for r in hb])
        return torch.stack(tlp.token_logprobs(hb, w, tb, 0.8), dim=1)

    _check_invariant(both, pool, 18, "token_logprobs")
    _check_invariant(lambda hb: torch.cat(tlp.lm_head_logits(hb, w, 0.8)[0:1], 1), pool, 6, "lm_head_logits")

    # the TMA (tensor descriptor) variant of the head kernel under the interpreter
    cfg = tlp.HeadConfig(BM=16, BV=32, BK=16, VS=64, num_warps=4, num_stages=1, tma=True)
    hid, w = torch.randn(7, 48), torch.randn(150, 48) * 0.3
    tgt = torch.randint(0, 150, (7,))
    _, lp, ent, lse = tlp._run_head(hid, w, tgt, 0.9, store_z=False, cfg=cfg)
    rl, re = reference.token_logprobs(hid.double(), w.double(), tgt, 0.9)
    assert (lp.double() - rl).abs().max().item() < 1e-5 and (ent.double() - re).abs().max().item() < 1e-5
    z, _, _, lse2 = tlp._run_head(hid, w, None, 0.9, store_z=True, cfg=cfg)
    assert torch.equal(lse, lse2) and torch.equal(z.gather(1, tgt[:, None]).squeeze(1) - lse2, lp)

    # the merge folds the same splits in the same order however many splits' partials it loads at once
    cfg = tlp.HeadConfig(BM=16, BV=32, BK=16, VS=32, num_warps=4, num_stages=1, tma=False)
    hid, w = torch.randn(7, 48), torch.randn(300, 48) * 0.3  # 10 splits: not a multiple of 4 or 8
    tgt = torch.randint(0, 300, (7,))
    saved, runs = tlp.MERGE_UNROLL, []
    try:
        for unroll in (1, 4, 8):
            tlp.MERGE_UNROLL = unroll
            runs.append(tlp._run_head(hid, w, tgt, 0.9, store_z=False, cfg=cfg)[1:])
    finally:
        tlp.MERGE_UNROLL = saved
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0])), "merge bits depend on UNROLL"
    rl, _ = reference.token_logprobs(hid.double(), w.double(), tgt, 0.9)
    assert (runs[0][0].double() - rl).abs().max().item() < 1e-5

    # bf16 inputs (upcast inside the kernel under the interpreter)
    hid, w = torch.randn(4, 32).bfloat16(), (torch.randn(100, 32) * 0.3).bfloat16()
    tgt = torch.randint(0, 100, (4,))
    lp, ent = tlp.token_logprobs(hid, w, tgt, 1.0)
    rl, re = reference.token_logprobs(hid.double(), w.double(), tgt, 1.0)
    assert (lp.double() - rl).abs().max().item() < 1e-5 and (ent.double() - re).abs().max().item() < 1e-5
    print("logprob ok")


def _grads64(fn, inputs: list[torch.Tensor], grads_out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float64 autograd gradients of ``fn(*inputs)`` (one output or a tuple) with output gradients ``grads_out``."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return list(torch.autograd.grad(outs, leaves, [g.double() for g in grads_out]))


def _assert_grad(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


def check_backward() -> None:
    # RMSNorm: 37 rows -> 13 programs of 3 rows (the last one partly empty) under the interpreter's 4 "SMs"
    for xd, wd, tol in [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2)]:
        x, w = (torch.randn(37, 40) * 2).to(xd), (1 + 0.1 * torch.randn(40)).to(wd)
        dy = torch.randn(37, 40).to(torch.promote_types(xd, wd))
        dx, dw = tbw.rms_norm_backward(x, w, dy, 1e-6)
        assert dx.dtype == xd and dw.dtype == wd and dx.shape == x.shape and dw.shape == w.shape
        rx, rw = _grads64(lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w], [dy])
        _assert_grad(dx, rx, tol, f"rms_norm dx {xd}")
        _assert_grad(dw, rw, tol, f"rms_norm dw {xd}")
        dx2, dw2 = tbw.rms_norm_backward(x, w, dy, 1e-6)
        assert torch.equal(dx, dx2) and torch.equal(dw, dw2), "rms_norm backward not deterministic"
        dx1, dw1 = tbw.rms_norm_backward(x, w, dy, 1e-6, round_normed=False)  # OLMo-2's norm: dw from unrounded n
        rx, rw = _grads64(lambda a, b: reference.rms_norm(a, b, 1e-6, round_normed=False), [x, w], [dy])
        _assert_grad(dx1, rx, tol, f"rms_norm once dx {xd}")
        _assert_grad(dw1, rw, tol, f"rms_norm once dw {xd}")
        assert torch.equal(dx1, dx)  # dx does not see where the rounding is
    # the fixed-order column sum, and a negative control: another summation order changes the bits
    part = torch.randn(300, 70) * torch.logspace(-4, 4, 300)[:, None]
    colsum = tbw._column_sum(part)
    assert torch.equal(colsum, tbw._column_sum(part.clone()))
    assert ((colsum.double() - part.double().sum(0)).abs() <= 1e-5 * part.double().abs().sum(0)).all()
    assert not torch.equal(colsum, tbw._column_sum(part.flip(0).contiguous())), "negative control: order-blind sum"

    # q/k norm + rotary: fp32 (tight) and bf16, with and without the norm
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for kind in ROPE_NORMS:
            t, hq, hk, d = 13, 4, 2, 16
            norm, (round_normed, offset) = kind is not None, kind or (True, False)
            q, k = (torch.randn(t, hq, d) * 2).to(dtype), (torch.randn(t, hk, d) * 2).to(dtype)
            ang = torch.rand(t, d // 2) * 50
            cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
            qw = torch.rand(d).add(0.5).to(dtype) if norm else None
            kw = torch.rand(d).add(0.5).to(dtype) if norm else None
            scales = [None if w is None else (1.0 + w.float() if offset else w) for w in (qw, kw)]
            gq, gk = torch.randn(t, hq, d).to(dtype), torch.randn(t, hk, d).to(dtype)
            dq, dk, dqw, dkw = tbw.qk_norm_rope_backward(q, k, cos, sin, *scales, gq, gk, 1e-6, round_normed)
            c64, s64 = cos.double(), sin.double()
            for got, x, w, g, dwg, name in ((dq, q, qw, gq, dqw, "q"), (dk, k, kw, gk, dkw, "k")):
                if norm:
                    def fn(a, b, c=c64, s=s64, o=offset):  # noqa: ANN001, ANN202
                        return reference.norm_rope(a, c, s, b, 1e-6, offset=o)

                    rx, rw = _grads64(fn, [x, w], [g])
                    _assert_grad(dwg, rw, tol, f"rope d{name}_weight {dtype} {kind}")
                else:
                    (rx,) = _grads64(lambda a, c=c64, s=s64: reference.norm_rope(a, c, s, None, 1e-6), [x], [g])
                    assert dwg is None
                _assert_grad(got, rx, tol, f"rope d{name} {dtype} {kind}")

    # SiLU and GELU-tanh gates
    gelu = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        g, u, dy = (torch.randn(5, 1500) * 4).to(dtype), torch.randn(5, 1500).to(dtype), torch.randn(5, 1500).to(dtype)
        for name, backward, act in (("silu", tbw.silu_mul_backward, torch.nn.functional.silu),
                                    ("gelu_tanh", tbw.gelu_tanh_mul_backward, gelu)):  # fmt: skip
            dg, du = backward(g, u, dy)
            rg, ru = _grads64(lambda a, b, act=act: act(a) * b, [g, u], [dy])
            _assert_grad(dg, rg, tol, f"{name} d_gate {dtype}")
            _assert_grad(du, ru, tol, f"{name} d_up {dtype}")

    # log-prob head: 4 vocabulary chunks (the last one partial), both output gradients or one, pointer and TMA tiles
    t, h, v = 9, 40, 100
    hid, w = torch.randn(t, h), torch.randn(v, h) * 0.3
    tgt = torch.randint(0, v, (t,))
    gl, ge = torch.randn(t), torch.randn(t)
    tma = dict(BM=16, BV=32, BK=16, TMA=True, num_warps=4, num_stages=1)
    for temp, g_l, g_e, cfg in ((0.7, gl, ge, None), (1.0, gl, None, None), (1.3, None, ge, tma), (1.0, gl, ge, tma)):
        _, _, ent, lse = tlp._run_head(hid, w, tgt, temp, store_z=False)
        gh, gw = tbw.head_backward(hid, w, tgt, lse, ent, g_l, g_e, temp, chunk=32, config=cfg)
        outs = [o for o, g in ((0, g_l), (1, g_e)) if g is not None]
        rh, rw = _grads64(
            lambda a, b, tp=temp, os=outs: tuple(reference.token_logprobs(a, b, tgt, tp)[o] for o in os),
            [hid, w],
            [g for g in (g_l, g_e) if g is not None],
        )
        _assert_grad(gh, rh, 1e-5, f"head dh T={temp}")
        _assert_grad(gw, rw, 1e-5, f"head dw T={temp}")
    # through the autograd Function (backend="triton"): forward bits unchanged, entropy gradient optional
    hl, wl = hid.clone().requires_grad_(), w.clone().requires_grad_()
    lp, en = ops.token_logprobs(hl, wl, tgt, 0.8, backend="triton")
    lp0, en0 = tlp.token_logprobs(hid, w, tgt, 0.8)
    assert torch.equal(lp.detach(), lp0) and torch.equal(en.detach(), en0), "forward bits changed under autograd"
    (lp * gl).sum().backward()
    rh, rw = _grads64(lambda a, b: reference.token_logprobs(a, b, tgt, 0.8)[0], [hid, w], [gl])
    _assert_grad(hl.grad, rh, 1e-5, "head dh via autograd")
    _assert_grad(wl.grad, rw, 1e-5, "head dw via autograd")
    # bf16 operands: dz rounded to bf16 before the GEMMs
    hb, wb = hid.bfloat16(), w.bfloat16()
    _, _, ent, lse = tlp._run_head(hb, wb, tgt, 1.0, store_z=False)
    gh, gw = tbw.head_backward(hb, wb, tgt, lse, ent, gl, ge, 1.0, chunk=32)
    assert gh.dtype == gw.dtype == torch.bfloat16
    rh, rw = _grads64(lambda a, b: reference.token_logprobs(a, b, tgt, 1.0), [hb, wb], [gl, ge])
    _assert_grad(gh, rh, 2e-2, "head dh bf16")
    _assert_grad(gw, rw, 2e-2, "head dw bf16")
    print("backward ok")


CHECKS = {
    "matmul": check_matmul,
    "norm": check_norm,
    "logprob": check_logprob,
    "rope": check_rope,
    "backward": check_backward,
}

if __name__ == "__main__":
    use_row_invariant_interpreter_dot()
    names = sys.argv[1:] or list(CHECKS)
    for name in names:
        t0 = time.time()
        CHECKS[name]()
        print(f"{name}: {time.time() - t0:.1f}s", flush=True)
