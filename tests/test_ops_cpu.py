"""Exact ops on the CPU backend: batch invariance (torch.equal), correctness vs float64, negative controls."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from rlexact import ops
from rlexact.ops import reference

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def assert_row_invariant(fn, x: torch.Tensor, max_batch: int = 64) -> None:
    """fn on every prefix-batch size 1..max_batch and at every row position equals fn on the single row."""
    singles = torch.stack([fn(x[i : i + 1])[0] for i in range(max_batch)])
    for m in range(1, max_batch + 1):
        out = fn(x[:m])
        assert torch.equal(out, singles[:m]), f"batch size {m} differs from single-row results"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(33, 48), (64, 64), (50, 128)])
def test_matmul_batch_invariant_and_correct(dtype: torch.dtype, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(64, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    assert_row_invariant(lambda a: ops.matmul(a, w), x)
    # rows at every position of a larger batch (one row replicated everywhere)
    row = x[5:6]
    big = ops.matmul(row.expand(150, -1).contiguous(), w)
    assert torch.equal(big, ops.matmul(row, w).expand(150, -1))
    assert rel_err(ops.matmul(x, w), x.double() @ w.double().T) < TOL[dtype]


def test_matmul_negative_control() -> None:
    """Plain torch.mm on CPU is not batch-invariant for small M, so the invariance test above can fail."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g)
    single = torch.stack([(x[i : i + 1] @ w.T)[0] for i in range(64)])
    assert any(not torch.equal(x[:m] @ w.T, single[:m]) for m in range(1, 65))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [48, 64, 200])
@pytest.mark.parametrize("round_normed", [True, False])
def test_rms_norm(dtype: torch.dtype, h: int, round_normed: bool) -> None:
    g = torch.Generator().manual_seed(h)
    x = (torch.randn(64, h, generator=g) * 3).to(dtype)
    w = torch.rand(h, generator=g).add(0.5).to(dtype)
    assert_row_invariant(lambda a: ops.rms_norm(a, w, 1e-6, round_normed=round_normed), x)
    ref = reference.rms_norm(x.double(), w.double(), 1e-6)
    assert rel_err(ops.rms_norm(x, w, 1e-6, round_normed=round_normed), ref) < TOL[dtype]


def rope_inputs(t: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int, norm: bool = True):
    """Random q, k, HF-style fp32 cos/sin (``cat(freqs, freqs)``) and (optionally) norm weights."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, hq, d, generator=g) * 2).to(dtype)
    k = (torch.randn(t, hk, d, generator=g) * 2).to(dtype)
    ang = torch.rand(t, d // 2, generator=g) * 100
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(dtype), torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    qw = torch.rand(d, generator=g).add(0.5).to(dtype) if norm else None
    kw = torch.rand(d, generator=g).add(0.5).to(dtype) if norm else None
    return q, k, cos, sin, qw, kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", [(4, 2, 16), (6, 2, 64), (3, 3, 24)])
def test_qk_norm_rope(dtype: torch.dtype, norm: bool, shape: tuple[int, int, int]) -> None:
    hq, hk, d = shape
    q, k, cos, sin, qw, kw = rope_inputs(64, hq, hk, d, dtype, sum(shape), norm)

    def both(i: slice | list[int]) -> torch.Tensor:
        qo, ko = ops.qk_norm_rope(q[i], k[i], cos[i], sin[i], qw, kw, 1e-6)
        return torch.cat([qo.flatten(1), ko.flatten(1)], 1)

    singles = torch.cat([both(slice(i, i + 1)) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(both(slice(0, m)), singles[:m]), f"batch size {m} differs from single-row results"
    qo, ko = ops.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    for x, w, out in ((q, qw, qo), (k, kw, ko)):
        ref = reference.norm_rope(x.double(), cos.double(), sin.double(), None if w is None else w.double(), 1e-6)
        assert out.dtype == dtype and out.shape == x.shape
        assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_gemma_norm(dtype: torch.dtype) -> None:
    """Gemma 3's q/k norm (round once, scale ``1 + w``) in the fused op: bitwise the exact norm op followed by the
    rotation alone, row-invariant, float64-close, not Llama's norm (negative control), and its gradients (through
    the fp32 scale) float64's."""
    q, k, cos, sin, qw, kw = rope_inputs(40, 4, 2, 32, dtype, 11)
    gemma = {"round_normed": False, "offset": True}
    qo, ko = ops.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, **gemma)
    for x, w, out in ((q, qw, qo), (k, kw, ko)):
        normed = ops.rms_norm(x, w, 1e-6, **gemma)
        assert torch.equal(out, ops.qk_norm_rope(normed, normed[:, :1], cos, sin)[0])
        ref = reference.norm_rope(x.double(), cos.double(), sin.double(), w.double(), 1e-6, offset=True)
        assert rel_err(out, ref) < TOL[dtype]
    for m in (1, 7, 40):
        got = ops.qk_norm_rope(q[-m:], k[-m:], cos[-m:], sin[-m:], qw, kw, 1e-6, **gemma)
        assert torch.equal(got[0], qo[-m:]) and torch.equal(got[1], ko[-m:])
    assert not torch.equal(ops.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)[0], qo)

    q, k, cos, sin, qw, kw = rope_inputs(9, 4, 2, 16, torch.float64, 5)
    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    qo, ko = ops.qk_norm_rope(leaves[0], leaves[1], cos, sin, leaves[2], leaves[3], 1e-6, **gemma, backend="torch")
    (qo.square().sum() + ko.sin().sum()).backward()
    refs = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    rq = reference.norm_rope(refs[0], cos, sin, refs[2], 1e-6, offset=True)
    rk = reference.norm_rope(refs[1], cos, sin, refs[3], 1e-6, offset=True)
    (rq.square().sum() + rk.sin().sum()).backward()
    for got, ref in zip(leaves, refs):
        assert rel_err(got.grad, ref.grad) < 1e-6


def test_qk_norm_rope_gradients_and_errors() -> None:
    q, k, cos, sin, qw, kw = rope_inputs(9, 4, 2, 16, torch.float64, 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    qo, ko = ops.qk_norm_rope(leaves[0], leaves[1], cos, sin, leaves[2], leaves[3], 1e-6, backend="torch")
    (qo.square().sum() + ko.sin().sum()).backward()
    refs = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    rq = reference.norm_rope(refs[0], cos.double(), sin.double(), refs[2], 1e-6)
    rk = reference.norm_rope(refs[1], cos.double(), sin.double(), refs[3], 1e-6)
    (rq.square().sum() + rk.sin().sum()).backward()
    for got, ref in zip(leaves, refs):
        assert rel_err(got.grad, ref.grad) < 1e-6
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        ops.qk_norm_rope(q, k, cos, sin, qw, None)
    with pytest.raises(ValueError, match="do not match"):
        ops.qk_norm_rope(q, k[:3], cos, sin)
    with pytest.raises(ValueError, match="head_dim"):
        ops.qk_norm_rope(q, k, cos[:, :8], sin[:, :8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_offset(dtype: torch.dtype) -> None:
    """Gemma 3's norm: scale ``1 + w`` added in fp32, one rounding; row invariant, float64 agreement of the values and
    of both gradients, the fused add equal to the separate ops; negative control: without the offset it differs."""
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(40, 72, generator=g)).to(dtype)
    w = (0.3 * torch.randn(72, generator=g)).to(dtype)
    y = ops.rms_norm(x, w, 1e-6, round_normed=False, offset=True)
    assert_row_invariant(lambda xb: ops.rms_norm(xb, w, 1e-6, round_normed=False, offset=True), x, 40)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = (1 + w64) * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(y, ref.detach()) < TOL[dtype]
    assert rel_err(ops.rms_norm(x, w, 1e-6, round_normed=False), ref.detach()) > 10 * TOL[dtype]  # negative control
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    dy = torch.randn(40, 72, generator=g)
    ops.rms_norm(x32, w32, 1e-6, round_normed=False, offset=True).backward(dy)
    ref.backward(dy.double())
    assert rel_err(x32.grad, x64.grad) < 1e-5 and rel_err(w32.grad, w64.grad) < 1e-5
    r = (3 * torch.randn(40, 72, generator=g)).to(dtype)
    normed, s = ops.add_rms_norm(x, r, w, 1e-6, round_normed=False, offset=True)
    assert torch.equal(s, x + r) and torch.equal(normed, ops.rms_norm(x + r, w, 1e-6, round_normed=False, offset=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [{}, {"round_normed": False, "offset": True}], ids=["llama", "gemma"])
def test_norm_add_rms_norm(dtype: torch.dtype, kind: dict) -> None:
    """A branch norm, the residual add and the norm after it: both outputs equal the separate ops bitwise (any leading
    shape), row invariant; with autograd the same values and the separate ops' gradients; a branch weight that would
    promote the rows takes the separate ops; bad shapes are errors. Negative control: a different branch eps."""
    g = torch.Generator().manual_seed(5)
    x, r = ((3 * torch.randn(6, 5, 72, generator=g)).to(dtype) for _ in range(2))
    wx, w = ((1 + 0.3 * torch.randn(72, generator=g)).to(dtype) for _ in range(2))
    normed, s = ops.norm_add_rms_norm(x, wx, 1e-6, r, w, 1e-5, **kind)
    sep_normed, sep_s = ops.add_rms_norm(ops.rms_norm(x, wx, 1e-6, **kind), r, w, 1e-5, **kind)
    assert torch.equal(normed, sep_normed) and torch.equal(s, sep_s)
    assert not torch.equal(ops.norm_add_rms_norm(x, wx, 1e-1, r, w, 1e-5, **kind)[1], s)
    x2, r2 = x.reshape(30, 72), r.reshape(30, 72)
    assert_row_invariant(lambda xb: ops.norm_add_rms_norm(xb, wx, 1e-6, xb * 0.5, w, 1e-5, **kind)[0], x2, 30)
    leaves = [t.detach().float().requires_grad_() for t in (x2, wx, r2, w)]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    out = ops.norm_add_rms_norm(leaves[0], leaves[1], 1e-6, leaves[2], leaves[3], 1e-5, **kind)
    ref = ops.add_rms_norm(ops.rms_norm(twins[0], twins[1], 1e-6, **kind), twins[2], twins[3], 1e-5, **kind)
    dy = [torch.randn(30, 72, generator=g) for _ in range(2)]
    torch.autograd.backward(out, dy)
    torch.autograd.backward(ref, dy)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, twins))
    if dtype != torch.float32 and kind == {}:  # an fp32 branch weight makes the rounded branch norm's rows fp32
        promoted = ops.norm_add_rms_norm(x, wx.float(), 1e-6, r, w, 1e-5)
        expect = ops.add_rms_norm(ops.rms_norm(x, wx.float(), 1e-6), r, w, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(promoted, expect))
    with pytest.raises(ValueError, match="x_weight"):
        ops.norm_add_rms_norm(x, wx[:8], 1e-6, r, w, 1e-5)
    with pytest.raises(ValueError, match="do not match"):
        ops.norm_add_rms_norm(x, wx, 1e-6, r[:2], w, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
def test_gated_mul(dtype: torch.dtype, op: str) -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = ((3 * torch.randn(64, 88, generator=g)).to(dtype) for _ in range(2))
    fn = getattr(ops, op)
    singles = torch.stack([fn(gate[i : i + 1], up[i : i + 1])[0] for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(fn(gate[:m], up[:m]), singles[:m])
    act = torch.nn.functional.silu if op == "silu_mul" else partial(torch.nn.functional.gelu, approximate="tanh")
    ref = act(gate.double()) * up.double()
    assert rel_err(fn(gate, up), ref) < TOL[dtype]
    other = ops.gelu_tanh_mul if op == "silu_mul" else ops.silu_mul
    assert rel_err(other(gate, up), ref) > 2 * TOL[dtype]  # negative control: the other gate
    gate32, up32 = (t.detach().float().requires_grad_() for t in (gate, up))
    fn(gate32, up32).backward(torch.ones_like(gate32))
    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    (act(gate64) * up64).sum().backward()
    assert rel_err(gate32.grad, gate64.grad) < 1e-5 and rel_err(up32.grad, up64.grad) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,h", [(37, 48), (1000, 64), (128, 64)])
def test_token_logprobs(dtype: torch.dtype, vocab: int, h: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    hid = torch.randn(64, h, generator=g).to(dtype)
    w = (torch.randn(vocab, h, generator=g) / h**0.5 * 4).to(dtype)
    tgt = torch.randint(0, vocab, (64,), generator=g)
    lp, ent = ops.token_logprobs(hid, w, tgt)
    singles = torch.stack([ops.token_logprobs(hid[i : i + 1], w, tgt[i : i + 1])[0][0] for i in range(64)])
    for m in (1, 2, 3, 17, 63, 64):
        assert torch.equal(ops.token_logprobs(hid[:m], w, tgt[:m])[0], singles[:m])
    ref_lp, ref_ent = reference.token_logprobs(hid.double(), w.double(), tgt, 1.0)
    assert (lp.double() - ref_lp).abs().max() < 1e-4
    assert (ent.double() - ref_ent).abs().max() < 1e-4
    # sampler/trainer contract: z[i, t] - lse[i] == token_logprobs bitwise
    z, lse = ops.lm_head_logits(hid, w, 0.7)
    lp_t, _ = ops.token_logprobs(hid, w, tgt, 0.7)
    assert torch.equal(z.gather(1, tgt[:, None])[:, 0] - lse, lp_t)


def test_token_logprobs_rejects_targets_outside_the_vocabulary() -> None:
    hid, w = torch.randn(3, 16), torch.randn(10, 16)
    with pytest.raises(ValueError, match=r"targets outside the vocabulary \[0, 10\): min 2, max 10"):
        ops.token_logprobs(hid, w, torch.tensor([2, 10, 4]))
    with pytest.raises(ValueError, match="min -1, max 4"):
        ops.token_logprobs(hid, w, torch.tensor([-1, 3, 4]))
    lp, _ = ops.token_logprobs(hid, w, torch.tensor([2, 9, 4]), check_targets=False)  # the caller checked them
    assert torch.equal(lp, ops.token_logprobs(hid, w, torch.tensor([2, 9, 4]))[0])


def test_token_logprobs_large_vocab() -> None:
    g = torch.Generator().manual_seed(3)
    vocab, h = 151_936, 32
    hid = torch.randn(5, h, generator=g)
    w = torch.randn(vocab, h, generator=g) / h**0.5
    tgt = torch.randint(0, vocab, (5,), generator=g)
    lp, _ = ops.token_logprobs(hid, w, tgt)
    for i in range(5):
        assert torch.equal(ops.token_logprobs(hid[i : i + 1], w, tgt[i : i + 1])[0][0], lp[i])
    ref, _ = reference.token_logprobs(hid.double(), w.double(), tgt, 1.0)
    assert (lp.double() - ref).abs().max() < 1e-4


def test_token_logprobs_gradient() -> None:
    g = torch.Generator().manual_seed(4)
    hid = torch.randn(300, 24, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(53, 24, generator=g) / 5).requires_grad_()
    tgt = torch.randint(0, 53, (300,), generator=g)
    lp, ent = ops.token_logprobs(hid, w, tgt)
    (lp.sum() + 0.3 * ent.sum()).backward()
    h64, w64 = hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rl, re = reference.token_logprobs(h64, w64, tgt, 1.0)
    (rl.sum() + 0.3 * re.sum()).backward()
    assert rel_err(hid.grad, h64.grad) < 1e-5 and rel_err(w.grad, w64.grad) < 1e-5


def test_matmul_norm_silu_gradients() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 40, generator=g, requires_grad=True)
    w = torch.randn(30, 40, generator=g, requires_grad=True)
    nw = torch.rand(30, generator=g).add(0.5).requires_grad_()
    y = ops.rms_norm(ops.matmul(x, w), nw, 1e-6)
    out = ops.silu_mul(y, y.flip(0))
    out.square().sum().backward()
    x64, w64, nw64 = (t.detach().double().requires_grad_() for t in (x, w, nw))
    y64 = reference.rms_norm(x64 @ w64.T, nw64, 1e-6)
    (torch.nn.functional.silu(y64) * y64.flip(0)).square().sum().backward()
    for a, b in ((x.grad, x64.grad), (w.grad, w64.grad), (nw.grad, nw64.grad)):
        assert rel_err(a, b) < 1e-5


def _rand_seqs(g: torch.Generator, lengths: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype):
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return q, k, v, cu


def _paged_cache(k: torch.Tensor, v: torch.Tensor, block_size: int, g: torch.Generator):
    """Write one sequence's k/v into a cache whose blocks are in shuffled order; return caches and block table."""
    n_blocks = -(-k.shape[0] // block_size)
    perm = torch.randperm(n_blocks + 3, generator=g)[:n_blocks].to(torch.int32)
    kc = torch.full((n_blocks + 3, block_size, *k.shape[1:]), float("nan"), dtype=k.dtype)
    vc = torch.full_like(kc, float("nan"))
    pos = torch.arange(k.shape[0])
    slots = perm[pos // block_size].long() * block_size + pos % block_size
    ops.write_kv(k, v, kc, vc, slots)
    return kc, vc, perm


@pytest.mark.parametrize("window", [None, 9, 40])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (4, 2, 16), (8, 2, 64)])
def test_attention_varlen_paged_decode_equal(dtype: torch.dtype, hq: int, hkv: int, d: int, window: int | None) -> None:
    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + d)
    lengths = [1, 5, 17, 70]
    q, k, v, cu = _rand_seqs(g, lengths, hq, hkv, d, dtype)
    scale = d**-0.5
    full = ops.attention_varlen(q, k, v, cu, scale, window=window)
    # correctness against float64
    ref = reference.attention_varlen(q.double(), k.double(), v.double(), cu, scale, window)
    assert rel_err(full, ref) < TOL[dtype]
    if window is not None:  # rows inside the window are the unwindowed rows; past it (negative control) not
        pos = torch.cat([torch.arange(n) for n in lengths])
        plain = ops.attention_varlen(q, k, v, cu, scale)
        assert torch.equal(full[pos < window], plain[pos < window])
        assert not torch.equal(full[pos >= window], plain[pos >= window])
    # batch invariance: each sequence alone
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        alone = ops.attention_varlen(
            q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], dtype=torch.int32), scale, window=window
        )
        assert torch.equal(alone, full[s:e])
    # paged: decode one token at a time, and chunked prefill, over shuffled pages with NaN in unused slots
    s, e = int(cu[-2]), int(cu[-1])
    kc, vc, table = _paged_cache(k[s:e], v[s:e], 8, g)
    n = e - s
    for chunk in (1, 7, 16, n):
        outs = []
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            outs.append(
                ops.attention_paged(
                    q[s + start : s + stop],
                    kc,
                    vc,
                    table[None],
                    torch.tensor([0, stop - start], dtype=torch.int32),
                    torch.tensor([stop], dtype=torch.int32),
                    scale,
                    max_seqlen_q=stop - start,
                    window=window,
                )
            )
        assert torch.equal(torch.cat(outs), full[s:e]), f"chunk size {chunk} differs from the training forward"
    one = (q[s : s + 2], kc, vc, table[None], torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2]), scale)
    with pytest.raises(ValueError, match="max_seqlen_q is 1"):
        ops.attention_paged(*one, max_seqlen_q=1)
    with pytest.raises(ValueError, match="max_seqlen_q must be >= 1"):
        ops.attention_paged(*one, max_seqlen_q=0)


def test_attention_negative_control() -> None:
    """SDPA over a prefix (decode-style) vs the full causal forward is not bitwise equal somewhere."""
    g = torch.Generator().manual_seed(7)
    q, k, v, _ = _rand_seqs(g, [96], 4, 2, 16, torch.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def native(qq, kk, vv, causal):
        return sdpa(qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=causal, enable_gqa=True)

    full = native(q, k, v, True).transpose(0, 1)
    diffs = 0
    for p in range(96):
        step = native(q[p : p + 1], k[: p + 1], v[: p + 1], False).transpose(0, 1)
        diffs += int(not torch.equal(step[0], full[p]))
    assert diffs > 0


@pytest.mark.parametrize("window", [None, 6])
def test_attention_gradient(window: int | None) -> None:
    g = torch.Generator().manual_seed(8)
    q, k, v, cu = _rand_seqs(g, [3, 20], 4, 2, 16, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ops.attention_varlen(q, k, v, cu, 0.25, window=window).square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.attention_varlen(q64, k64, v64, cu, 0.25, window).square().sum().backward()
    for a, b in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel_err(a, b) < 1e-5


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="does not match"):
        ops.matmul(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="vocabulary"):
        ops.token_logprobs(torch.randn(2, 4), torch.randn(7, 4), torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="temperature"):
        ops.token_logprobs(torch.randn(2, 4), torch.randn(7, 4), torch.tensor([0, 1]), 0.0)
    with pytest.raises(ValueError, match="kv heads"):
        ops.attention_varlen(
            torch.randn(4, 3, 8),
            torch.randn(4, 2, 8),
            torch.randn(4, 2, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            1.0,
        )
    one = (torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.tensor([0, 4], dtype=torch.int32))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            ops.attention_varlen(*one, 1.0, window=bad)
    with pytest.raises(ValueError, match="unknown backend"):
        ops.matmul(torch.randn(3, 4), torch.randn(5, 4), backend="cuda")


def test_unused_head_output_gets_no_gradient_work() -> None:
    """With only the log-probs (or only the entropy) used, the other output's gradient arrives as None (not
    materialized zeros) and the gradients still match float64."""
    g = torch.Generator().manual_seed(6)
    hid = torch.randn(40, 24, generator=g).requires_grad_()
    w = (torch.randn(53, 24, generator=g) / 5).requires_grad_()
    tgt = torch.randint(0, 53, (40,), generator=g)
    for which in (0, 1):
        hid.grad = w.grad = None
        out = ops.token_logprobs(hid, w, tgt, 0.9)
        (out[which] * torch.linspace(-1, 1, 40)).sum().backward()
        h64, w64 = hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        (reference.token_logprobs(h64, w64, tgt, 0.9)[which] * torch.linspace(-1, 1, 40).double()).sum().backward()
        assert rel_err(hid.grad, h64.grad) < 1e-5 and rel_err(w.grad, w64.grad) < 1e-5
