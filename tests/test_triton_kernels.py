"""Triton kernels: correctness vs float64, bitwise batch invariance, the lm-head contract, negative controls.

* CPU: the kernels run under the Triton interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before triton
  is imported), see ``tests/_interp_kernels.py``.
* GPU (``@pytest.mark.gpu``, skipped without CUDA): the same properties at real shapes (Qwen3-1.7B: hidden 2048,
  intermediate 6144, q 2048, kv 1024, vocab 151936), bf16 and fp32, every M in 1..64 at every position and M up to
  16384.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from interpreter_jobs import failure_report

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_NVIDIA_BACKEND = HAS_TRITON and importlib.util.find_spec("triton.backends.nvidia") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")


# ----------------------------------------------------------------------------------------------------------------------
# CPU: Triton interpreter (subprocess)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which",
    [
        pytest.param(w, marks=pytest.mark.interpreter("tests/_interp_kernels.py", w))
        for w in ("matmul", "norm", "logprob", "rope", "backward")
    ],
)
def test_interpreter_kernels(which: str, interpreter_run: subprocess.CompletedProcess) -> None:
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert f"{which} ok" in interpreter_run.stdout


# ----------------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------------

QWEN_LINEARS = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144)]  # (N, K): qkv, o, gate_up, down
ODD_LINEARS = [(1000, 1000), (37, 200), (96, 999), (256, 64)]


def _dev() -> torch.device:
    return torch.device("cuda")


def _tm():
    from rlexact.ops import triton_matmul

    return triton_matmul


def _rows_match_singles(fn, pool: torch.Tensor, batches, what: str) -> None:
    """For each batch (a list of pool indices), every output row equals ``fn(pool[i:i+1])`` bitwise."""
    singles = {}
    for idx in batches:
        out = fn(pool[idx])
        for pos, i in enumerate(idx):
            if i not in singles:
                singles[i] = fn(pool[i : i + 1])
            assert torch.equal(out[pos : pos + 1], singles[i]), f"{what}: row {i} at position {pos} of M={len(idx)}"


def _small_batches(n_pool: int, max_m: int = 64) -> list[list[int]]:
    """Every M in 1..max_m, rows placed at shifted positions so each row is seen at many positions."""
    out = []
    for m in range(1, max_m + 1):
        out.append([(m * 7 + 3 * j) % n_pool for j in range(m)])
    return out


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nk", QWEN_LINEARS + ODD_LINEARS)
def test_gpu_matmul_correct(dtype: torch.dtype, nk: tuple[int, int]) -> None:
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 7, 64, 300):
        x = torch.randn(m, k, device=_dev(), generator=g).to(dtype)
        w = torch.randn(n, k, device=_dev(), generator=g).to(dtype)
        y = _tm().matmul(x, w)
        assert y.dtype == dtype and y.shape == (m, n)
        ref = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T
        err = ((y.double() - ref).abs() / scale).max().item()
        tol = 1e-5 if dtype == torch.float32 else 2**-8 + 1e-4  # one bf16 rounding of the fp32 accumulator
        assert err < tol, (m, n, k, dtype, err)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nk", [(4096, 2048), (2048, 6144), (1000, 1000), (96, 999)])
def test_gpu_matmul_invariant_small_m(dtype: torch.dtype, nk: tuple[int, int]) -> None:
    """Every M in 1..64 and rows at many positions: bitwise equal to the single-row result."""
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(n, k, device=_dev(), generator=g).to(dtype)
    pool = torch.randn(80, k, device=_dev(), generator=g).to(dtype)
    _rows_match_singles(lambda xb: _tm().matmul(xb, w), pool, _small_batches(80), f"mm {n}x{k} {dtype}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nk", QWEN_LINEARS + [(1000, 1000)])
def test_gpu_matmul_invariant_large_m(dtype: torch.dtype, nk: tuple[int, int]) -> None:
    """Rows inside M = 65 .. 16384 (every row-tile variant) equal the same rows computed alone and at M = 64."""
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(n, k, device=_dev(), generator=g).to(dtype)
    probe = torch.randn(16, k, device=_dev(), generator=g).to(dtype)
    singles = torch.cat([_tm().matmul(probe[i : i + 1], w) for i in range(16)])
    assert torch.equal(_tm().matmul(probe, w), singles)
    ms = (65, 129, 1000, 1025, 4096, 16384) if dtype == torch.bfloat16 else (65, 1000, 4096)
    for m in ms:
        x = torch.randn(m, k, device=_dev(), generator=g).to(dtype)
        pos = torch.randperm(m, generator=torch.Generator().manual_seed(m))[:16].to(_dev())
        pos[0], pos[-1] = 0, m - 1  # first and last row (a partial last tile) included
        x[pos] = probe
        y = _tm().matmul(x, w)
        assert torch.equal(y[pos], singles), f"M={m}: rows differ from their single-row results"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "nk", [(4096, 2048), (2048, 6144), (1024, 8192), (6144, 2048), (1024, 2048), (12288, 2048), (256, 64), (1000, 1000)]
)
def test_gpu_matmul_row_tile_variants_bitwise(nk: tuple[int, int]) -> None:
    """All row-tile variants (decode / mid / large) give identical bits (the premise of M-bucketed dispatch)."""
    n, k = nk
    tm = _tm()
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(n, k, device=_dev(), generator=g).bfloat16()
    x = torch.randn(300, k, device=_dev(), generator=g).bfloat16()
    variants = [cfg for _, cfg in tm.row_tile_variants(n, k, torch.bfloat16, _dev())]
    outs = [tm.matmul_with_config(x, w, cfg) for cfg in variants]
    for cfg, out in zip(variants[1:], outs[1:]):
        assert torch.equal(out, outs[0]), f"variant {cfg} differs from {variants[0]}"


@gpu
@pytest.mark.gpu
def test_gpu_matmul_k_splits_taken() -> None:
    """A narrow K-heavy product (N = 1,024, K = 8,192: too few 16-column tiles for the H200's SMs) splits K at fixed
    columns: decode-sized M runs the split launches, and the library's rows equal the in-register sum of the same
    splits and differ from one unsplit chain (so the invariance tests above compare split launches with in-register
    sums, not two unsplit paths)."""
    tm = _tm()
    n, k = 1024, 8192
    assert tm.chain_splits(n, k, torch.bfloat16, _dev()) == tm.SPLIT_K_KEYS
    assert [tm.config_for(m, n, k, torch.bfloat16, _dev()).kernel for m in (4, 64, 300)] == ["split", "split", "tma"]
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(n, k, device=_dev(), generator=g).bfloat16()
    x = torch.randn(300, k, device=_dev(), generator=g).bfloat16()
    seq = tm.MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4, KS=tm.SPLIT_K_KEYS)
    unsplit = tm.MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4)
    lib = tm.matmul(x, w)
    assert torch.equal(lib, tm.matmul_with_config(x, w, seq))
    assert torch.equal(tm.matmul(x[:40], w), lib[:40])
    assert not torch.equal(lib, tm.matmul_with_config(x, w, unsplit)), "negative control: the split changed no bit"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("nk", [(6144, 2048), (1000, 1000), (6912, 1152)])
@pytest.mark.parametrize("gate", ["silu_mul", "gelu_tanh_mul"])
def test_gpu_gated_matmul_equals_products_and_gate(nk: tuple[int, int], gate: str) -> None:
    """The gated matmul (one launch; SiLU or GELU gate) equals the trainer's ops, the gate's op of the two exact
    products, bitwise at every M of its variants and of the products' variants (M = 1 .. 64, and up to 8,192 with
    rows at many positions), and it is the library's path for these shapes (Qwen3-1.7B's and Gemma 3 1B's MLPs).
    Negative controls: the gate applied to the unrounded fp32 products, and the other gate, differ."""
    from rlexact import ops
    from rlexact.ops import triton_norm

    tm = _tm()
    n, k = nk
    gelu = gate == "gelu_tanh_mul"
    gate_op, other = getattr(triton_norm, gate), triton_norm.silu_mul if gelu else triton_norm.gelu_tanh_mul
    gate_up = ops.gate_up_gelu_tanh if gelu else ops.gate_up_silu
    assert tm.gated_config_for(64, n, k, torch.bfloat16, _dev()) is not None
    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(2 * n, k, device=_dev(), generator=g) * k**-0.5).bfloat16()
    pool = torch.randn(80, k, device=_dev(), generator=g).bfloat16()

    def trainer(x: torch.Tensor) -> torch.Tensor:
        return gate_op(tm.matmul(x, w[:n]), tm.matmul(x, w[n:]))

    def fused(x: torch.Tensor) -> torch.Tensor:
        return tm.gated_matmul(x, w, gelu=gelu)

    _rows_match_singles(fused, pool, _small_batches(80), f"gated {n}x{k}")
    assert torch.equal(fused(pool), trainer(pool))
    for m in (65, 200, 256, 300, 1000, 2048, 8192):
        x = torch.randn(m, k, device=_dev(), generator=g).bfloat16()
        x[-16:] = pool[:16]
        y = gate_up(x, w)
        assert torch.equal(y, trainer(x)), f"M={m}: gated != {gate} of the products"
        assert torch.equal(y[-16:], fused(pool[:16])), f"M={m}: rows depend on the batch"
    g32, u32 = tm.matmul(pool.float(), w[:n].float()), tm.matmul(pool.float(), w[n:].float())
    assert not torch.equal(fused(pool), gate_op(g32, u32).bfloat16()), "negative control: unrounded products"
    assert not torch.equal(fused(pool), other(tm.matmul(pool, w[:n]), tm.matmul(pool, w[n:]))), "the other gate"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["silu_mul", "gelu_tanh_mul"])
def test_gpu_gated_matmul_cublas_route(monkeypatch: pytest.MonkeyPatch, gate: str) -> None:
    """At the row counts of ``GATED_CUBLAS_ROWS`` ``gated_matmul`` runs ``torch.mm`` over the ``2N`` weight rows and
    the gate's kernel where cuBLAS was verified for that product, with the fused kernel's bits (the Qwen3-1.7B MLP);
    where the check fails (here forced) it runs the fused kernel. Negative control: the same route with the K chain
    reversed changes bits."""
    from rlexact.ops import cublas_verify, triton_norm

    tm = _tm()
    n, k = 6144, 2048
    gelu = gate == "gelu_tanh_mul"
    first, last = tm.GATED_CUBLAS_ROWS
    if first > last:
        pytest.skip("the cuBLAS route is off (GATED_CUBLAS_ROWS is empty)")
    g = torch.Generator(device="cuda").manual_seed(11)
    w = (torch.randn(2 * n, k, device=_dev(), generator=g) * k**-0.5).bfloat16()
    routed: list = []
    real = tm._gated_through_cublas
    monkeypatch.setattr(tm, "_gated_through_cublas", lambda *a: routed.append(r := real(*a)) or r)
    for m in sorted({first, (first + last) // 2, last}):
        x = torch.randn(m, k, device=_dev(), generator=g).bfloat16()
        out = tm.gated_matmul(x, w, gelu=gelu)
        assert routed and routed.pop() is not None, f"M={m}: cuBLAS was not verified for [{m}, {k}] @ [{2 * n}, {k}].T"
        with monkeypatch.context() as mp:
            mp.setattr(tm, "GATED_CUBLAS_ROWS", (1, 0))
            fused = tm.gated_matmul(x, w, gelu=gelu)
        assert torch.equal(out, fused), f"M={m}: the cuBLAS route changed bits"
        gate_op = getattr(triton_norm, gate)
        reversed_k = torch.mm(x.flip(1), w.flip(1).t())
        assert not torch.equal(out, gate_op(*reversed_k.split(n, dim=1))), "negative control: reversed K chain"
    monkeypatch.setattr(cublas_verify, "same_bits", lambda *a, **kw: False)
    m = last - 1
    x = torch.randn(m, k, device=_dev(), generator=g).bfloat16()
    out = tm.gated_matmul(x, w, gelu=gelu)
    assert routed.pop() is None, "the route ran although the check failed"
    with monkeypatch.context() as mp:
        mp.setattr(tm, "GATED_CUBLAS_ROWS", (1, 0))
        assert torch.equal(out, tm.gated_matmul(x, w, gelu=gelu))


@gpu
@pytest.mark.gpu
def test_gpu_matmul_negative_control() -> None:
    """cuBLAS bf16 (torch.mm) is not batch-invariant: some row differs between M=1 and a larger M."""
    g = torch.Generator(device="cuda").manual_seed(4)
    w = torch.randn(2048, 6144, device=_dev(), generator=g).bfloat16()
    probe = torch.randn(8, 6144, device=_dev(), generator=g).bfloat16()
    singles = torch.cat([probe[i : i + 1] @ w.T for i in range(8)])
    differs = False
    for m in (8, 64, 256, 4096, 16384):
        x = torch.randn(m, 6144, device=_dev(), generator=g).bfloat16()
        x[:8] = probe
        differs |= not torch.equal((x @ w.T)[:8], singles)
    assert differs, "negative control: torch.mm happened to be batch-invariant for every M tried"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [2048, 1000, 6144, 40])
@pytest.mark.parametrize("round_normed", [True, False])
def test_gpu_rms_norm(dtype: torch.dtype, h: int, round_normed: bool) -> None:
    from rlexact.ops import cpu, triton_norm

    def norm(x: torch.Tensor) -> torch.Tensor:
        return triton_norm.rms_norm(x, w, 1e-6, round_normed)

    g = torch.Generator(device="cuda").manual_seed(5)
    w = (1 + 0.1 * torch.randn(h, device=_dev(), generator=g)).to(dtype)
    pool = (3 * torch.randn(80, h, device=_dev(), generator=g)).to(dtype)
    ref = cpu.rms_norm(pool.cpu(), w.cpu(), 1e-6, round_normed)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(norm(pool).cpu(), ref, rtol=tol, atol=tol)
    _rows_match_singles(norm, pool, _small_batches(80), "rms_norm")
    big = torch.randn(5000, h, device=_dev(), generator=g).to(dtype)
    big[1234] = pool[3]
    assert torch.equal(norm(big)[1234], norm(pool[3:4])[0])


def _fma_counts(dtype: str, round_normed: bool, offset: bool, x_norm: bool) -> dict[str, int]:
    """FMAs by type in the sm_90 code of the norm kernel with a residual (and with ``x_norm`` the branch norm first)
    for ``dtype`` rows of a norm of that kind: every FMA of the kernels is the compiler's contraction."""
    import triton.language as tl

    from hopper_compile import compile_for_hopper
    from rlexact.ops import triton_norm

    p, i = f"*{dtype}", "i32"
    args = dict(x_ptr=p, r_ptr=p, w_ptr=p, o_ptr=p, s_ptr=p, xw_ptr=p, H=i, H_f="fp32", stride_x=i, stride_r=i,
                stride_o=i, stride_s=i, eps="fp32", x_eps="fp32")  # fmt: skip
    tdt = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    const = dict(BLOCK=2048, SINGLE=True, HAS_RES=True, X_NORM=x_norm, X_DTYPE=tdt, O_DTYPE=tdt, RNE_X=False,
                 RNE_O=False, ROUND_NORMED=round_normed, OFFSET=offset, PDL=False)  # fmt: skip
    ptx = compile_for_hopper(triton_norm._rms_norm_kernel, args, const, num_warps=4).asm["ptx"]
    types = ("f32", "bf16x2", "bf16", "f16x2", "f16")
    return dict(zip(types, _op_counts(ptx, [f"fma.rn.{t}" for t in types]).values()))


def _op_counts(ptx: str, ops: list[str]) -> dict[str, int]:
    """How often each of the PTX instructions ``ops`` (whole names) occurs in ``ptx``."""
    return {op: len(re.findall(rf"\b{re.escape(op)}\b", ptx)) for op in ops}


def _float_ops_per_element(ptx: str) -> dict[str, float]:
    """The fp32 operations of a gate's formula in ``ptx``, per gated element (each evaluates one ``ex2``)."""
    counts = _op_counts(ptx, ["fma.rn.f32", "mul.f32", "add.f32", "ex2.approx.f32", "div.full.f32"])
    return {op: n / counts["ex2.approx.f32"] for op, n in counts.items()}


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="needs triton's CUDA backend")
def test_gated_matmul_epilogues_compute_the_gate_kernels_operations() -> None:
    """Compiled for sm_90 on the host: the gated matmuls' epilogues (the pointer and TMA ``tl`` kernels, two dots or
    one joint block, and the Gluon kernel where this Triton has Gluon) evaluate each gate with the fp32 operations
    of the separate gate kernel (``silu_mul`` / ``gelu_tanh_mul``), contractions included, so no FMA joins
    operations that the separate kernels keep apart (docs/design.md §2.3). The GPU tests check the bits. Negative
    control: the two gates' operations differ."""
    import triton.language as tl

    from hopper_compile import compile_for_hopper
    from rlexact.ops import gluon_attention, triton_matmul, triton_norm

    p, i = "*bf16", "i32"
    per_gate = {}
    for gelu in (False, True):
        args = dict(g_ptr=p, u_ptr=p, o_ptr=p, ncols=i, stride_g=i, stride_u=i, stride_o=i)
        const = dict(BLOCK=1024, O_DTYPE=tl.bfloat16, RNE_O=False, GELU=gelu, PDL=False)
        sep = compile_for_hopper(triton_norm._gated_mul_kernel, args, const, num_warps=4)
        want = per_gate[gelu] = _float_ops_per_element(sep.asm["ptx"])
        # the GELU gate contracts into FMAs (how many depends on Triton's LLVM), the SiLU gate into none
        assert want["div.full.f32"] == 1 and (want["fma.rn.f32"] > 0) == gelu, want
        ptr = dict(x_ptr=p, w_ptr=p, o_ptr=p, M=i, N=i, K=i, stride_xm=i, stride_wn=i, stride_om=i)
        const = dict(BM=16, BN=32, BK=64, GROUP_M=8, UPCAST=False, IEEE=False, RNE_FIX=False, PDL=False, GATED=True,
                     GELU=gelu)  # fmt: skip
        kernels = [compile_for_hopper(triton_matmul._mm_ptr_kernel, ptr, const, num_warps=4, num_stages=4)]
        tma = dict(x_desc=p, w_desc=p, o_desc=p, M=i, N=i, K=i)
        const = dict(BM=128, BN=128, BK=64, GROUP_M=8, NUM_PROGS=132, WS=False, SUBTILE=False, OUT_DTYPE=tl.bfloat16,
                     UPCAST=False, RNE_FIX=False, DEV_DESC=True, KS=0, PDL=False, GELU=gelu)  # fmt: skip
        for gated in (1, 2):
            kernels.append(compile_for_hopper(triton_matmul._mm_tma_kernel, tma, const | dict(GATED=gated),
                                              num_warps=8, num_stages=3))  # fmt: skip
        if gluon_attention.gluon is not None:
            from hopper_compile import compile_gluon_for_hopper, gluon_matmul_types
            from rlexact.ops import gluon_matmul as gm

            options = gm.options_for(gm.GluonMatmulConfig(128, 128))
            const = dict(BM=128, BN=128, GATED=2 if gelu else 1)
            kernels.append(compile_gluon_for_hopper(gm._mm_kernel, gluon_matmul_types(), const, **options))
        for k in kernels:
            assert _float_ops_per_element(k.asm["ptx"]) == want, (k.name, gelu)
    assert per_gate[False] != per_gate[True]


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="needs triton's CUDA backend")
def test_norm_add_rms_norm_launches_only_what_keeps_the_roundings() -> None:
    """Compiled for sm_90 on the host: the one-launch branch norm, add and norm of the configurations
    ``triton_norm.norm_add_rms_norm`` launches (16-bit rows of a norm that rounds once) has the FMAs of two add-norm
    reductions and nothing else, so the branch norm's product is rounded before the add as the separate kernels round
    it. The configurations it leaves to the separate kernels show why (negative controls): a norm that rounds the
    normalized row first gets a 16-bit FMA of that product and the add, an fp32 row an fp32 one."""
    from rlexact.ops import triton_norm

    for dtype in ("bf16", "fp16"):
        base = _fma_counts(dtype, False, True, x_norm=False)
        assert base["f32"] > 0 and sum(base.values()) == base["f32"]
        for offset in (True, False):
            fused = _fma_counts(dtype, False, offset, x_norm=True)
            assert fused == {k: 2 * v for k, v in base.items()}, (dtype, offset)
        llama = _fma_counts(dtype, True, False, x_norm=True)
        assert llama[f"{'bf' if dtype == 'bf16' else 'f'}16x2"] > 0, dtype
    fp32 = _fma_counts("fp32", False, True, x_norm=True)
    assert fp32["f32"] > 2 * _fma_counts("fp32", False, True, x_norm=False)["f32"]
    assert triton_norm.FUSED_BRANCH_NORM_DTYPES == (torch.bfloat16, torch.float16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h", [1152, 2560, 5376, 8192, 12288, 40])
@pytest.mark.parametrize("norm", ["llama", "gemma"])
def test_gpu_norm_add_rms_norm(dtype: torch.dtype, h: int, norm: str) -> None:
    """The branch norm, add and norm: both outputs bitwise the norm kernel then the add-norm kernel (at Gemma 3's
    hidden sizes, the largest one-block row, a row that takes the separate launches), row invariant. The one-launch
    kernel runs for Gemma's norm in 16 bits; the other cases check that the op leaves them to the separate kernels
    (at f9e5e7c, which launched them at once, they differed: ``gpu_tests_norm_add_h200.log``). Negative control: a
    different branch eps."""
    from rlexact.ops import triton_norm

    round_normed, offset = ROPE_NORMS[norm]
    g = torch.Generator(device="cuda").manual_seed(7)
    x, r = ((3 * torch.randn(300, h, device=_dev(), generator=g)).to(dtype) for _ in range(2))
    wx, w = ((0.3 * torch.randn(h, device=_dev(), generator=g)).to(dtype) for _ in range(2))

    def fused(xb: torch.Tensor, rb: torch.Tensor, x_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_norm.norm_add_rms_norm(xb, wx, x_eps, rb, w, 1e-5, round_normed, offset)

    out = fused(x, r)
    separate = triton_norm.add_rms_norm(triton_norm.rms_norm(x, wx, 1e-6, round_normed, offset), r, w, 1e-5,
                                        round_normed, offset)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(out, separate))
    assert all(torch.equal(a[0], b[41]) for a, b in zip(fused(x[41:42], r[41:42]), out))
    assert not torch.equal(fused(x, r, 1e-1)[1], out[1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
def test_gpu_gated_mul(dtype: torch.dtype, op: str) -> None:
    from rlexact.ops import reference, triton_norm

    g = torch.Generator(device="cuda").manual_seed(6)
    gate = (4 * torch.randn(300, 6144, device=_dev(), generator=g)).to(dtype)
    up = torch.randn(300, 6144, device=_dev(), generator=g).to(dtype)
    fn = getattr(triton_norm, op)
    y = fn(gate, up)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, getattr(reference, op)(gate, up), rtol=tol, atol=tol)
    assert torch.equal(fn(gate[7:8], up[7:8])[0], y[7])
    other = triton_norm.gelu_tanh_mul if op == "silu_mul" else triton_norm.silu_mul
    assert not torch.equal(other(gate, up), y)  # negative control: the other gate


def _qk_rope_inputs(t: int, d: int, dtype: torch.dtype, norm: bool, seed: int) -> tuple:
    """Qwen3-1.7B-shaped q (16 heads) / k (8 heads), transformers-layout cos/sin of large angles, and the q/k norm
    weights (``None`` without ``norm``), on the GPU in ``dtype``."""
    torch.manual_seed(seed)
    q = (torch.randn(t, 16, d, device=_dev()) * 2).to(dtype)
    k = (torch.randn(t, 8, d, device=_dev()) * 2).to(dtype)
    ang = torch.rand(t, d // 2, device=_dev()) * 4000
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)  # as transformers
    qw = torch.rand(d, device=_dev()).add(0.5).to(dtype) if norm else None
    kw = torch.rand(d, device=_dev()).add(0.5).to(dtype) if norm else None
    return q, k, cos, sin, qw, kw


ROPE_NORMS = {"none": None, "llama": (True, False), "gemma": (False, True)}
"""The q/k norm of the fused rotary kernel: none, Llama's (Qwen3), Gemma 3's round-once ``1 + w`` norm (its
``(round_normed, offset)``)."""


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", list(ROPE_NORMS))
def test_gpu_qk_norm_rope(dtype: torch.dtype, norm: str) -> None:
    """Qwen3-1.7B heads (16 q / 8 kv, head_dim 128): float64 reference and bitwise row invariance, 1..64 rows; the
    Gemma norm differs from Llama's (negative control)."""
    from rlexact.ops import reference, triton_rope

    t, d = 300, 128
    kind = ROPE_NORMS[norm] or (True, False)
    q, k, cos, sin, qw, kw = _qk_rope_inputs(t, d, dtype, norm != "none", seed=5)
    qo, ko = triton_rope.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, *kind)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, x, w in ((qo, q, qw), (ko, k, kw)):
        w64 = None if w is None else w.double()
        ref = reference.norm_rope(x.double(), cos.double(), sin.double(), w64, 1e-6, offset=kind[1])
        assert ((got.double() - ref).norm() / ref.norm()).item() < tol
    for m in (1, 2, 7, 64):
        for start in (0, 100, t - m):
            rows = slice(start, start + m)
            qs, ks = triton_rope.qk_norm_rope(q[rows], k[rows], cos[rows], sin[rows], qw, kw, 1e-6, *kind)
            assert torch.equal(qs, qo[rows]) and torch.equal(ks, ko[rows])
    if norm == "gemma":
        assert not torch.equal(triton_rope.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)[0], qo)


def _head_inputs(t: int, h: int, v: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = torch.randn(t, h, device=_dev(), generator=g).to(dtype)
    w = (torch.randn(v, h, device=_dev(), generator=g) / h**0.5 * 4).to(dtype)
    tgt = torch.randint(0, v, (t,), device=_dev(), generator=g)
    return hid, w, tgt


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hv", [(2048, 151936), (1000, 37), (64, 5000)])
def test_gpu_token_logprobs_correct_and_contract(dtype: torch.dtype, hv: tuple[int, int]) -> None:
    from rlexact.ops import reference
    from rlexact.ops import triton_logprob as tlp

    h, v = hv
    hid, w, tgt = _head_inputs(24, h, v, dtype, 7)
    for temp in (1.0, 0.7):
        lp, ent = tlp.token_logprobs(hid, w, tgt, temp)
        rl, re = reference.token_logprobs(hid.double(), w.double(), tgt, temp)
        assert (lp.double() - rl).abs().max().item() < 2e-5 * max(1.0, rl.abs().max().item())
        assert (ent.double() - re).abs().max().item() < 2e-5 * max(1.0, re.abs().max().item())
        z, lse = tlp.lm_head_logits(hid, w, temp)
        for tok in sorted({0, 1, v // 3, v - 1, *tgt.tolist()}):
            lp_t, _ = tlp.token_logprobs(hid, w, torch.full_like(tgt, tok), temp)
            assert torch.equal(z[:, tok] - lse, lp_t), f"contract broken at token {tok}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_token_logprobs_invariant(dtype: torch.dtype) -> None:
    from rlexact.ops import triton_logprob as tlp

    h, v = 2048, 151936
    hid, w, tgt = _head_inputs(80, h, v, dtype, 8)
    fn = lambda idx: torch.stack(tlp.token_logprobs(hid[idx], w, tgt[idx], 0.9), 1)  # noqa: E731
    singles = torch.cat([fn([i]) for i in range(80)])
    for m in range(1, 65):
        idx = [(m * 7 + 3 * j) % 80 for j in range(m)]
        assert torch.equal(fn(idx), singles[idx]), f"M={m}"
    big_t = 4096 if dtype == torch.bfloat16 else 1024
    hb, _, tb = _head_inputs(big_t, h, v, dtype, 9)
    pos = torch.randperm(big_t, generator=torch.Generator().manual_seed(0))[:80].to(_dev())
    hb[pos], tb[pos] = hid, tgt
    assert torch.equal(torch.stack(tlp.token_logprobs(hb, w, tb, 0.9), 1)[pos], singles)
    z1, l1 = tlp.lm_head_logits(hid[:5], w, 0.9)
    z2, l2 = tlp.lm_head_logits(hid, w, 0.9)
    assert torch.equal(z1, z2[:5]) and torch.equal(l1, l2[:5])


@gpu
@pytest.mark.gpu
def test_gpu_logprob_negative_control() -> None:
    """The materialized torch path (cuBLAS bf16 + log_softmax) is not batch-invariant for some lm-head shape.

    (On an H200 cuBLAS happened to be row-invariant for H=2048, V=151936 at M <= 2048; a long-K head is not.)
    """

    def native(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax((x @ w.T).float(), -1).gather(1, t[:, None]).squeeze(1)

    differs = False
    for h, v in ((2048, 151936), (6144, 2048)):
        hid, w, tgt = _head_inputs(8, h, v, torch.bfloat16, 10)
        singles = torch.cat([native(hid[i : i + 1], w, tgt[i : i + 1]) for i in range(8)])
        for m in (8, 64, 512, 4096):
            hb, _, tb = _head_inputs(m, h, v, torch.bfloat16, 11 + m)
            hb[:8], tb[:8] = hid, tgt
            differs |= not torch.equal(native(hb, w, tb)[:8], singles)
    assert differs, "negative control: the native lm head was batch-invariant for every shape and M tried"


# ----------------------------------------------------------------------------------------------------------------------
# GPU: backward kernels (deterministic, correct vs float64) and the matmul launch path
# ----------------------------------------------------------------------------------------------------------------------


def _grads64(fn, inputs: list[torch.Tensor], grads_out: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return list(torch.autograd.grad(outs, leaves, [g.double() for g in grads_out]))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [2048, 1000, 128])
@pytest.mark.parametrize("round_normed", [True, False])
def test_gpu_rms_norm_backward(dtype: torch.dtype, h: int, round_normed: bool) -> None:
    """vs float64 autograd through the reference, and bitwise identical gradients on a second run."""
    from rlexact.ops import reference, triton_backward

    g = torch.Generator(device="cuda").manual_seed(20)
    x = (3 * torch.randn(3000, h, device=_dev(), generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(h, device=_dev(), generator=g)).to(dtype)
    dy = torch.randn(3000, h, device=_dev(), generator=g).to(dtype)
    dx, dw = triton_backward.rms_norm_backward(x, w, dy, 1e-6, round_normed)
    rx, rw = _grads64(lambda a, b: reference.rms_norm(a, b, 1e-6, round_normed), [x, w], [dy])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(dx, rx) < tol and _rel(dw, rw) < tol, (_rel(dx, rx), _rel(dw, rw))
    dx2, dw2 = triton_backward.rms_norm_backward(x, w, dy, 1e-6, round_normed)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)


@gpu
@pytest.mark.gpu
def test_gpu_column_sum_order_negative_control() -> None:
    """The determinism checks can fail: summing the same partials in another order changes the bits."""
    from rlexact.ops import triton_backward

    g = torch.Generator(device="cuda").manual_seed(21)
    part = torch.randn(528, 2048, device=_dev(), generator=g) * torch.logspace(-3, 3, 528, device=_dev())[:, None]
    a = triton_backward._column_sum(part)
    assert torch.equal(a, triton_backward._column_sum(part.clone()))
    assert not torch.equal(a, triton_backward._column_sum(part.flip(0).contiguous()))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", list(ROPE_NORMS))
def test_gpu_qk_norm_rope_backward(dtype: torch.dtype, norm: str) -> None:
    """Float64 gradients; the Gemma norm's backward runs on its fp32 scale ``1 + w``, whose gradient is ``w``'s."""
    from rlexact.ops import reference, triton_backward

    t, d = 2000, 128
    round_normed, offset = ROPE_NORMS[norm] or (True, False)
    q, k, cos, sin, qw, kw = _qk_rope_inputs(t, d, dtype, norm != "none", seed=22)
    scales = [None if w is None else (1.0 + w.float() if offset else w) for w in (qw, kw)]
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    out = triton_backward.qk_norm_rope_backward(q, k, cos, sin, *scales, gq, gk, 1e-6, round_normed)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    c64, s64 = cos.double(), sin.double()
    for got, gw, x, w, gx in ((out[0], out[2], q, qw, gq), (out[1], out[3], k, kw, gk)):
        if w is not None:
            rx, rw = _grads64(lambda a, b: reference.norm_rope(a, c64, s64, b, 1e-6, offset=offset), [x, w], [gx])
            assert _rel(gw, rw) < tol
        else:
            (rx,) = _grads64(lambda a: reference.norm_rope(a, c64, s64, None, 1e-6), [x], [gx])
            assert gw is None
        assert _rel(got, rx) < tol
    again = triton_backward.qk_norm_rope_backward(q, k, cos, sin, *scales, gq, gk, 1e-6, round_normed)
    for a, b in zip(out, again):
        assert (a is None and b is None) or torch.equal(a, b)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
def test_gpu_gated_mul_backward(dtype: torch.dtype, op: str) -> None:
    from rlexact.ops import triton_backward

    g = torch.Generator(device="cuda").manual_seed(23)
    gate, up, dy = ((4 * torch.randn(300, 6144, device=_dev(), generator=g)).to(dtype) for _ in range(3))
    backward = getattr(triton_backward, f"{op}_backward")
    dg, du = backward(gate, up, dy)
    act = torch.nn.functional.silu if op == "silu_mul" else partial(torch.nn.functional.gelu, approximate="tanh")
    rg, ru = _grads64(lambda a, b: act(a) * b, [gate, up], [dy])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(dg, rg) < tol and _rel(du, ru) < tol
    dg2, du2 = backward(gate, up, dy)
    assert torch.equal(dg, dg2) and torch.equal(du, du2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hv", [(2048, 151936), (64, 5000)])
def test_gpu_token_logprobs_backward(dtype: torch.dtype, hv: tuple[int, int]) -> None:
    """Head gradients through the autograd Function: vs float64, run-to-run bitwise, forward bits unchanged."""
    from rlexact import ops
    from rlexact.ops import reference
    from rlexact.ops import triton_logprob as tlp

    h, v = hv
    hid, w, tgt = _head_inputs(300, h, v, dtype, 24)
    g = torch.Generator(device="cuda").manual_seed(25)
    gl, ge = torch.randn(300, device=_dev(), generator=g), torch.randn(300, device=_dev(), generator=g)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for temp, use_ent in ((1.0, False), (0.7, True)):
        grads = []
        for _ in range(2):
            hl, wl = hid.clone().requires_grad_(), w.clone().requires_grad_()
            lp, ent = ops.token_logprobs(hl, wl, tgt, temp)
            lp0, ent0 = tlp.token_logprobs(hid, w, tgt, temp)
            assert torch.equal(lp.detach(), lp0) and torch.equal(ent.detach(), ent0), "forward bits changed"
            loss = (lp * gl).sum() + ((ent * ge).sum() if use_ent else 0.0)
            loss.backward()
            grads.append((hl.grad, wl.grad))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1]), "not deterministic"
        outs = (0, 1) if use_ent else (0,)
        rh, rw = _grads64(
            lambda a, b, tp=temp, os=outs: tuple(reference.token_logprobs(a, b, tgt, tp)[o] for o in os),
            [hid, w],
            [gl, ge][: len(outs)],
        )
        assert _rel(grads[0][0], rh) < tol and _rel(grads[0][1], rw) < tol, (_rel(grads[0][0], rh), temp)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("nk", QWEN_LINEARS)
def test_gpu_matmul_cached_launcher_bitwise(nk: tuple[int, int]) -> None:
    """The cached-launcher path of ``matmul`` gives the bits of the JIT-dispatched launch of the same config, also
    for an unaligned (sliced) input that must take the JIT path (split plans: their partials launch is cached)."""
    tm = _tm()
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(26)
    w = torch.randn(n, k, device=_dev(), generator=g).bfloat16()
    for m in (64, 200, 1024, 4096):
        x = torch.randn(m + 1, k, device=_dev(), generator=g).bfloat16()
        ref = tm.matmul_with_config(x[:m], w, tm.config_for(m, n, k, torch.bfloat16, x.device))
        first, second = tm.matmul(x[:m], w), tm.matmul(x[:m], w)  # the second call uses the cached launcher
        assert torch.equal(first, ref) and torch.equal(second, ref)
        plan = tm._LAUNCHES[(m, n, k, torch.bfloat16, x.get_device())]
        assert plan.runner is not None and not tm._RUNNER_BROKEN[0], "the cached launcher was not used"
        xs = torch.empty(m * k + 1, device=_dev(), dtype=torch.bfloat16)[1:].view(m, k)
        xs.copy_(x[:m])
        assert torch.equal(tm.matmul(xs, w), ref)
