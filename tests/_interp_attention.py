"""Checks for the Triton attention kernels; run as a script (asserts, exits non-zero on failure) or imported.

CPU: ``TRITON_INTERPRET=1 python tests/_interp_attention.py SECTION`` (the environment variable must be set before
``triton`` is imported, hence a subprocess). GPU: ``tests/test_triton_attention.py`` imports the ``check_*`` functions
and calls them with ``device="cuda"``.

Every exactness check is ``torch.equal``; every correctness check compares with float64 through
:mod:`rlexact.ops.reference`.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from _interp_dot import use_row_invariant_interpreter_dot
from rlexact.ops import reference
from rlexact.ops import triton_attention as ta


def _cu(lens: list[int], device: str) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_inputs(lens, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype=dtype, device=device) for h in (hq, hkv, hkv))
    return q, k, v, _cu(lens, device)


def _tol(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2


class PagedCache:
    """A paged KV cache with shuffled block order; unwritten slots and unused blocks hold NaN."""

    def __init__(self, lens, hkv, d, dtype, device, block_size, seed=0):
        g = torch.Generator().manual_seed(seed + 1)
        self.block_size = block_size
        need = [math.ceil(n / block_size) for n in lens]
        total = sum(need) + 3  # a few spare blocks that stay NaN
        perm = torch.randperm(total, generator=g).tolist()
        width = max(need) + 2
        # padding entries are garbage ids far out of range: they must never be dereferenced
        self.block_tables = torch.full((len(lens), width), 10**8, dtype=torch.int32)
        it = iter(perm)
        for b, nb in enumerate(need):
            for j in range(nb):
                self.block_tables[b, j] = next(it)
        self.block_tables = self.block_tables.to(device)
        self.k = torch.full((total, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
        self.v = torch.full_like(self.k, float("nan"))

    def write(self, b: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pos = torch.arange(start, start + k.shape[0], device=k.device)
        slots = self.block_tables[b].long()[pos // self.block_size] * self.block_size + pos % self.block_size
        self.k.view(-1, *self.k.shape[2:])[slots] = k
        self.v.view(-1, *self.v.shape[2:])[slots] = v


def run_schedule(q, k, v, lens, schedule, block_size, paged_fn=ta.attention_paged, seed=0, bound=False):
    """Feed sequences through the paged kernel in steps; ``schedule[s][b]`` = queries of sequence ``b`` at step ``s``.

    K/V of the step's tokens are written to the cache before the launch. ``bound``: pass each step's largest query
    count as ``max_seqlen_q`` (decode steps then launch one program per sequence). Returns outputs in packed
    (varlen) order.
    """
    device = q.device
    starts = _cu(lens, "cpu").tolist()
    cache = PagedCache(lens, k.shape[1], k.shape[2], k.dtype, device, block_size, seed)
    out = torch.full_like(q, float("nan"))
    done = [0] * len(lens)
    scale = q.shape[-1] ** -0.5
    for step in schedule:
        qs, nqs, seqk = [], [], []
        for b, n in enumerate(step):
            n = min(n, lens[b] - done[b])
            s = starts[b] + done[b]
            if n:
                cache.write(b, done[b], k[s : s + n], v[s : s + n])
            qs.append(q[s : s + n])
            nqs.append(n)
            done[b] += n
            seqk.append(done[b])
        o = paged_fn(
            torch.cat(qs),
            cache.k,
            cache.v,
            cache.block_tables,
            _cu(nqs, device),
            torch.tensor(seqk, dtype=torch.int32, device=device),
            scale,
            **({"max_seqlen_q": max(nqs)} if bound else {}),
        )
        off = 0
        for b, n in enumerate(nqs):
            s = starts[b] + done[b] - n
            out[s : s + n] = o[off : off + n]
            off += n
    assert done == list(lens), (done, lens)
    return out


def chunk_schedule(lens, chunk):
    steps = []
    left = list(lens)
    while any(left):
        step = [min(chunk, n) for n in left]
        left = [n - c for n, c in zip(left, step)]
        steps.append(step)
    return steps


def decode_schedule(lens, prompt_lens):
    """Prefill ``prompt_lens`` in one chunk, then one token per step (finished sequences stay with 0 queries)."""
    steps = [list(prompt_lens)]
    left = [n - p for n, p in zip(lens, prompt_lens)]
    while any(left):
        steps.append([1 if n else 0 for n in left])
        left = [max(n - 1, 0) for n in left]
    return steps


def reference64(q, k, v, cu):
    return reference.attention_varlen(q.double(), k.double(), v.double(), cu, q.shape[-1] ** -0.5)


# ---------------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------------


def check_correctness(lens, hq, hkv, d, dtype=torch.float32, device="cpu"):
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device)
    o = ta.attention_varlen(q, k, v, cu, d**-0.5)
    assert o.dtype == dtype and o.shape == q.shape
    err = (o.double() - reference64(q, k, v, cu)).abs().max().item()
    assert err < _tol(dtype), f"varlen vs float64: max err {err} (lens {lens}, hq {hq}, hkv {hkv}, d {d})"
    return o


def check_exactness(lens, hq, hkv, d, dtype=torch.float32, device="cpu", chunks=(3, 7, 16), block_sizes=(4, 16)):
    """varlen == paged full prefill == chunked prefill (each chunk size) == decode, for each block size."""
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device)
    full = ta.attention_varlen(q, k, v, cu, d**-0.5)
    assert not full.isnan().any()
    prompts = [max(1, n // 3) for n in lens]
    for bs in block_sizes:
        runs = {"paged-full": ([list(lens)], False), "decode": (decode_schedule(lens, prompts), False)}
        # decode steps with max_seqlen_q = 1: one program per sequence (the CUDA-graph decode launch)
        runs["decode (max_seqlen_q given)"] = (decode_schedule(lens, prompts), True)
        runs.update({f"chunk{c}": (chunk_schedule(lens, c), False) for c in chunks})
        for name, (sched, bound) in runs.items():
            out = run_schedule(q, k, v, lens, sched, bs, bound=bound)
            if not torch.equal(out, full):
                bad = (out != full).any(-1).any(-1).nonzero().flatten().tolist()
                raise AssertionError(f"{name} (block {bs}) != varlen at tokens {bad[:10]} (lens {lens}, hq {hq})")


def check_batch_invariance(lens, hq, hkv, d, dtype=torch.float32, device="cpu"):
    """A sequence computed alone, or packed at another offset with other sequences, gives the same rows."""
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device)
    full = ta.attention_varlen(q, k, v, cu, d**-0.5)
    starts = cu.tolist()
    for b in range(len(lens)):
        s, e = starts[b], starts[b + 1]
        alone = ta.attention_varlen(q[s:e], k[s:e], v[s:e], _cu([e - s], device), d**-0.5)
        assert torch.equal(alone, full[s:e]), f"sequence {b} alone != in batch"
    order = list(reversed(range(len(lens))))
    idx = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in order]).to(device)
    rev = ta.attention_varlen(q[idx], k[idx], v[idx], _cu([lens[b] for b in order], device), d**-0.5)
    assert torch.equal(rev, full[idx]), "reordered batch != original batch"
    # decode of one sequence alone vs in a batch of many
    sched_alone = decode_schedule([lens[-1]], [1])
    out_alone = run_schedule(q[starts[-2] :], k[starts[-2] :], v[starts[-2] :], [lens[-1]], sched_alone, 4)
    assert torch.equal(out_alone, full[starts[-2] :]), "decode alone != varlen"


def check_negative_control(lens, hq, hkv, d, dtype=torch.float32, device="cpu"):
    """The equalities above can fail: re-anchoring the key tiles (another BLOCK_N) or a dense softmax over a prefix
    changes bits somewhere, while staying correct."""
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device)
    scale = d**-0.5
    full = ta.attention_varlen(q, k, v, cu, scale)
    orig = ta._fwd_config
    try:

        def other(head_dim, dt):
            cfg = dict(orig(head_dim, dt))
            cfg["BLOCK_N"] //= 2
            return cfg

        ta._fwd_config = other
        halved = ta.attention_varlen(q, k, v, cu, scale)
    finally:
        ta._fwd_config = orig
    assert (halved.double() - full.double()).abs().max().item() < _tol(dtype)
    assert not torch.equal(halved, full), "negative control: another key-tile size gave identical bits"
    # dense fp32 softmax of the last sequence's queries over a prefix vs over the full sequence
    s = cu.tolist()[-2]
    n = lens[-1]
    qs, ks, vs = (x[s:].float() for x in (q, k, v))
    dense_full = reference.attention_sequence(qs, ks, vs, 0, scale)
    diffs = 0
    for p in range(1, n):
        dense_prefix = reference.attention_sequence(qs[p - 1 : p], ks[:p], vs[:p], p - 1, scale)
        diffs += int(not torch.equal(dense_prefix[0], dense_full[p - 1]))
    return diffs


class small_splits:
    """Context manager: KV splits of ``tiles`` key tiles (tests only: several splits on short sequences); with
    ``parallel=False`` paged launches loop over their splits in one program instead of the split-parallel pass."""

    def __init__(self, tiles: int = 2, parallel: bool = True) -> None:
        self.tiles, self.parallel = tiles, parallel

    def __enter__(self) -> None:
        self.orig, self.orig_bytes = ta._fwd_config, ta._SPLIT_PAR_BYTES
        ta._fwd_config = lambda hd, dt: (lambda c: c | {"SPLIT": self.tiles * c["BLOCK_N"]})(self.orig(hd, dt))
        if not self.parallel:
            ta._SPLIT_PAR_BYTES = 0

    def __exit__(self, *exc) -> None:
        ta._fwd_config, ta._SPLIT_PAR_BYTES = self.orig, self.orig_bytes


def check_shared_split_counters(lens, hq, hkv, d, dtype=torch.float32, device="cpu"):
    """Split-parallel launches that share one ticket buffer (a decode graph's, across its layers and steps) give the
    bits of launches with their own counters and of the training forward, and leave the buffer zeroed."""
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device, seed=7)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)

    def shared(*args, **kwargs):
        return ta.attention_paged(*args, split_counters=counters, **kwargs)

    schedule = decode_schedule(lens, [max(1, n // 3) for n in lens])
    own = run_schedule(q, k, v, lens, schedule, 4, bound=True)
    for _ in range(2):  # a second pass finds the counters zero again
        out = run_schedule(q, k, v, lens, schedule, 4, paged_fn=shared, bound=True)
        assert torch.equal(out, own), "a shared ticket buffer changed bits"
        assert int(counters.abs().sum()) == 0, "the launches left tickets behind"
    assert torch.equal(own, ta.attention_varlen(q, k, v, cu, d**-0.5)), "decode != training forward"


def check_split_negative_control(lens, hq, hkv, d, dtype=torch.float32, device="cpu"):
    """Another split size (the whole sequence in one split vs splits of two key tiles) stays correct but changes bits
    of rows past the first split: training, prefill and decode must use the same splits."""
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device)
    scale = d**-0.5
    whole = ta.attention_varlen(q, k, v, cu, scale)
    with small_splits(2):
        split = ta.attention_varlen(q, k, v, cu, scale)
        first = 2 * ta._fwd_config(d, dtype)["BLOCK_N"]
    assert (split.double() - whole.double()).abs().max().item() < _tol(dtype)
    starts = cu.tolist()
    inside = torch.cat([torch.arange(s, min(e, s + first)) for s, e in zip(starts[:-1], starts[1:])]).to(device)
    assert torch.equal(split[inside], whole[inside]), "rows within the first split must not change"
    assert not torch.equal(split, whole), "negative control: another split size gave identical bits"


def check_backward(lens, hq, hkv, d, dtype=torch.float32, device="cpu"):
    from rlexact import ops

    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(dtype=dtype, device=device)
    scale = d**-0.5
    qr, kr, vr = (x.double().requires_grad_(True) for x in (q, k, v))
    ref = torch.autograd.grad(reference.attention_varlen(qr, kr, vr, cu, scale), (qr, kr, vr), do.double())
    grads = ta.attention_varlen_backward(do, q, k, v, cu, scale)
    again = ta.attention_varlen_backward(do, q, k, v, cu, scale)
    for name, g, r, g2 in zip(("dq", "dk", "dv"), grads, ref, again):
        assert g.dtype == dtype and g.shape == r.shape
        assert torch.equal(g, g2), f"{name} not deterministic"
        err = (g.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
        assert err < 5 * _tol(dtype), f"{name} vs float64: rel err {err} (lens {lens}, hq {hq}, hkv {hkv}, d {d})"
    # through the public autograd wrapper (which calls attention_varlen_backward)
    qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = ops.attention_varlen(qa, ka, va, cu, scale, backend="triton")
    assert torch.equal(out.detach(), ta.attention_varlen(q, k, v, cu, scale))
    out.backward(do)
    for name, a, g in zip(("dq", "dk", "dv"), (qa.grad, ka.grad, va.grad), grads):
        assert torch.equal(a, g), f"autograd wrapper {name} differs from attention_varlen_backward"


def check_public_api(lens, hq, hkv, d, dtype=torch.float32, device="cpu"):
    """``rlexact.ops.attention_paged(..., backend='triton')`` routes to this kernel."""
    from rlexact import ops

    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device)
    full = ops.attention_varlen(q, k, v, cu, d**-0.5, backend="triton")

    def paged(*args, **kwargs):
        return ops.attention_paged(*args, backend="triton", **kwargs)

    out = run_schedule(q, k, v, lens, chunk_schedule(lens, 5), 4, paged_fn=paged)
    assert torch.equal(out, full)
    out = run_schedule(q, k, v, lens, decode_schedule(lens, [1] * len(lens)), 4, paged_fn=paged, bound=True)
    assert torch.equal(out, full)


def check_window(lens, hq, hkv, d, window, dtype=torch.float32, device="cpu", chunks=(7,), block_sizes=(4,)):
    """A sliding window: the forward and the backward against float64; varlen == paged full prefill == chunked
    prefill == decode (with and without ``max_seqlen_q``), bitwise; rows inside the window equal the unwindowed
    launch's bitwise, and (negative control) rows past it differ."""
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, device, seed=3)
    scale = d**-0.5
    full = ta.attention_varlen(q, k, v, cu, scale, window=window)
    ref = reference.attention_varlen(q.double(), k.double(), v.double(), cu, scale, window)
    err = (full.double() - ref).abs().max().item()
    assert err < _tol(dtype), f"windowed varlen vs float64: max err {err} (lens {lens}, window {window})"
    paged = functools.partial(ta.attention_paged, window=window)
    prompts = [max(1, n // 3) for n in lens]
    for bs in block_sizes:
        runs = {"paged-full": ([list(lens)], False), "decode": (decode_schedule(lens, prompts), True)}
        runs.update({f"chunk{c}": (chunk_schedule(lens, c), False) for c in chunks})
        for name, (sched, bound) in runs.items():
            out = run_schedule(q, k, v, lens, sched, bs, paged_fn=paged, bound=bound)
            assert torch.equal(out, full), f"window {window}: {name} (block {bs}) != varlen (lens {lens})"
    plain = ta.attention_varlen(q, k, v, cu, scale)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    assert torch.equal(full[pos < window], plain[pos < window]), "rows inside the window changed"
    assert not torch.equal(full[pos >= window], plain[pos >= window]), "negative control: the window hid nothing"
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(dtype=dtype, device=device)
    qr, kr, vr = (x.double().requires_grad_(True) for x in (q, k, v))
    want = torch.autograd.grad(reference.attention_varlen(qr, kr, vr, cu, scale, window), (qr, kr, vr), do.double())
    grads = ta.attention_varlen_backward(do, q, k, v, cu, scale, window)
    for name, g, r, g2 in zip(("dq", "dk", "dv"), grads, want, ta.attention_varlen_backward(do, q, k, v, cu, scale,
                                                                                          window)):  # fmt: skip
        assert torch.equal(g, g2), f"windowed {name} not deterministic"
        err = (g.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
        assert err < 5 * _tol(dtype), f"windowed {name} vs float64: rel err {err} (lens {lens}, window {window})"


# ---------------------------------------------------------------------------------------------------------------------
# CPU sections (interpreter)
# ---------------------------------------------------------------------------------------------------------------------

LENS = [1, 5, 17, 40]


def section_forward() -> None:
    for hq, hkv in ((2, 2), (4, 2), (4, 1), (3, 1)):
        check_correctness(LENS, hq, hkv, 16)
    check_correctness([9, 33], 2, 1, 64)
    check_correctness([7, 20], 2, 2, 24)  # head_dim not a power of two
    check_correctness([70], 2, 1, 16)
    check_public_api(LENS, 4, 2, 16)
    # bf16 through the interpreter (dots upcast in-kernel; P and dS still rounded to bf16 as on the GPU)
    check_correctness(LENS, 4, 2, 16, dtype=torch.bfloat16)
    check_exactness(LENS, 4, 2, 16, dtype=torch.bfloat16, chunks=(7,), block_sizes=(4,))


def section_exact() -> None:
    check_exactness(LENS, 4, 2, 16)  # GQA 2: chunks 3/7/16, block sizes 4/16, full prefill, decode
    for hq, hkv in ((2, 2), (4, 1)):  # GQA 1 and 4: a lighter matrix
        check_exactness(LENS, hq, hkv, 16, chunks=(7,), block_sizes=(4,))
    check_exactness([3, 33], 4, 2, 64, chunks=(5,), block_sizes=(16,))
    check_batch_invariance(LENS, 4, 2, 16)
    diffs = check_negative_control(LENS, 4, 2, 16)
    print(f"negative control: dense fp32 prefix != full in {diffs} of {LENS[-1] - 1} rows")


def section_backward() -> None:
    for hq, hkv in ((2, 2), (4, 2), (4, 1)):
        check_backward(LENS, hq, hkv, 16)
    check_backward([9, 33], 2, 1, 64)
    check_backward([70, 3], 2, 2, 24)
    check_backward(LENS, 4, 2, 16, dtype=torch.bfloat16)


def section_split() -> None:
    """Several KV splits on short sequences (splits of two key tiles): exactness of every schedule with the
    split-parallel decode pass and with in-program split loops, correctness, backward, negative control."""
    lens = LENS
    with small_splits(2):
        check_correctness(lens, 4, 2, 16)
        check_exactness(lens, 4, 2, 16, chunks=(7, 33), block_sizes=(4,))
        check_exactness([5, 90], 2, 1, 64, chunks=(17,), block_sizes=(16,))
        check_exactness(lens, 4, 2, 16, dtype=torch.bfloat16, chunks=(9,), block_sizes=(4,))
        check_batch_invariance(lens, 4, 2, 16)
        check_backward(lens, 4, 2, 16)
    with small_splits(2, parallel=False):
        check_exactness(lens, 4, 2, 16, chunks=(7,), block_sizes=(4,))
    with small_splits(1):  # up to six splits: the last split program's fold of four partials and a partial group
        check_exactness([3, 90], 2, 1, 16, chunks=(33,), block_sizes=(16,))
        check_shared_split_counters([5, 70, 33], 4, 2, 16)
    check_split_negative_control(lens, 4, 2, 16)


def section_window() -> None:
    """Sliding windows: within one key tile and across tiles, GQA, bf16, several KV splits (whole splits before the
    window are skipped), the split-parallel decode pass and in-program split loops."""
    check_window(LENS, 4, 2, 16, window=6)
    check_window(LENS, 2, 1, 16, window=23, chunks=(5, 16), block_sizes=(4, 16))
    check_window([9, 33], 2, 1, 64, window=17)
    check_window(LENS, 4, 2, 16, window=11, dtype=torch.bfloat16)
    with small_splits(1):
        check_window([3, 90], 2, 1, 16, window=20, chunks=(33,), block_sizes=(16,))
    with small_splits(1, parallel=False):
        check_window([3, 90], 2, 1, 16, window=37, chunks=(9,), block_sizes=(4,))


SECTIONS = {
    "forward": section_forward, "exact": section_exact, "backward": section_backward, "split": section_split,
    "window": section_window,
}  # fmt: skip


def main(argv: list[str]) -> int:
    use_row_invariant_interpreter_dot()
    for name in argv or ["forward", "exact", "backward"]:
        SECTIONS[name]()
        print(f"{name}: ok")
    return 0


QWEN3_SHAPE = (16, 8, 128)


def _bench_prefill(b: int, n: int, dtype: torch.dtype, backward: bool = True) -> str:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    hq, hkv, d = QWEN3_SHAPE
    scale = d**-0.5
    q, k, v, cu = make_inputs([n] * b, hq, hkv, d, dtype, "cuda")
    qd, kd, vd = (x.view(b, n, -1, d).transpose(1, 2) for x in (q, k, v))
    kd, vd = (x.repeat_interleave(hq // hkv, dim=1).contiguous() for x in (kd, vd))
    qd = qd.contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_ref = do_bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale))
    t_ours = do_bench(lambda: ta.attention_varlen(q, k, v, cu, scale))
    line = f"prefill B={b} L={n}: ours {t_ours:.3f} ms, sdpa-flash {t_ref:.3f} ms, sdpa/ours {t_ref / t_ours:.2f}"
    if backward:
        do = torch.randn_like(q)
        qd.requires_grad_(True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o_ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            dod = torch.randn_like(o_ref)
            t_ref_b = do_bench(lambda: torch.autograd.grad(o_ref, qd, dod, retain_graph=True))
        t_ours_b = do_bench(lambda: ta.attention_varlen_backward(do, q, k, v, cu, scale))
        line += f" | bwd(+fwd recompute) ours {t_ours_b:.3f} ms, sdpa-flash bwd {t_ref_b:.3f} ms, "
        line += f"sdpa/ours {t_ref_b / t_ours_b:.2f}"
    return line


def _bench_decode(b: int, ctx: int, dtype: torch.dtype, page: int = 16) -> str:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    hq, hkv, d = QWEN3_SHAPE
    scale = d**-0.5
    lens = [ctx] * b
    _, k, v, cu = make_inputs(lens, hq, hkv, d, dtype, "cuda")
    cache = PagedCache(lens, hkv, d, dtype, "cuda", page)
    starts = cu.tolist()
    for i in range(b):
        cache.write(i, 0, k[starts[i] : starts[i + 1]], v[starts[i] : starts[i + 1]])
    qdec = torch.randn(b, hq, d, dtype=dtype, device="cuda")
    cuq = _cu([1] * b, "cuda")
    seqk = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    t_ours = do_bench(lambda: ta.attention_paged(qdec, cache.k, cache.v, cache.block_tables, cuq, seqk, scale))
    kd, vd = (x.view(b, ctx, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    qd = qdec.view(b, hq, 1, d)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_ref = do_bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale))
    return (
        f"decode B={b} ctx={ctx} page={page}: ours(paged) {t_ours * 1e3:.1f} us, "
        f"sdpa-flash(dense) {t_ref * 1e3:.1f} us, "
        f"sdpa/ours {t_ref / t_ours:.2f}"
    )


def bench(dtype: torch.dtype = torch.bfloat16) -> None:
    """GPU timing vs SDPA (flash) at Qwen3-1.7B shapes: ``python tests/_interp_attention.py bench``."""
    print(f"config {ta._fwd_config(QWEN3_SHAPE[2], dtype)} bwd {ta._bwd_config(QWEN3_SHAPE[2], dtype)}")
    for b, n in ((1, 8192), (4, 4096), (16, 1024), (64, 256)):
        print(_bench_prefill(b, n, dtype), flush=True)
    for b, ctx in ((64, 512), (128, 512), (256, 512), (256, 2048)):
        print(_bench_decode(b, ctx, dtype), flush=True)


def tune() -> None:
    """Forward timings of candidate (BLOCK_M, BLOCK_N, warps, stages) for head_dim 128 bf16."""
    orig = ta._fwd_config
    cands = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 3)]
    try:
        for bm, bn, w, st in cands:
            ta._fwd_config = lambda _d, _t, c=(bm, bn, w, st): dict(
                zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), c)
            )
            print((bm, bn, w, st), _bench_prefill(4, 4096, torch.bfloat16, backward=False), flush=True)
            print((bm, bn, w, st), _bench_decode(256, 512, torch.bfloat16), flush=True)
    finally:
        ta._fwd_config = orig


def tune_bwd() -> None:
    """Backward timings of candidate (dkdv, dq) tiles for head_dim 128 bf16."""
    orig = ta._bwd_config
    cands = [
        ((64, 64, 4, 2), (64, 64, 4, 2)),
        ((64, 64, 4, 3), (64, 64, 4, 3)),
        ((32, 64, 4, 2), (64, 64, 4, 2)),
        ((64, 64, 8, 2), (128, 64, 8, 2)),
        ((64, 64, 4, 2), (128, 32, 8, 2)),
        ((64, 64, 4, 2), (64, 32, 4, 2)),
        ((128, 64, 8, 2), (128, 64, 8, 3)),
    ]
    try:
        for dkdv, dq in cands:
            ta._bwd_config = lambda _d, _t, c=(dkdv, dq): {"dkdv": c[0], "dq": c[1]}
            print(dkdv, dq, _bench_prefill(4, 4096, torch.bfloat16), flush=True)
            print(dkdv, dq, _bench_prefill(16, 1024, torch.bfloat16), flush=True)
    finally:
        ta._bwd_config = orig


def bench_pages() -> None:
    for page in (16, 64, 256):
        print(_bench_decode(256, 512, torch.bfloat16, page), flush=True)


SECTIONS["bench_pages"] = bench_pages
SECTIONS["bench"] = bench
SECTIONS["tune_bwd"] = tune_bwd
SECTIONS["tune"] = tune


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
