"""Triton attention: correctness vs float64 and bitwise equality of training, chunked prefill and decode.

CPU: the kernels run under the Triton interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before
``triton`` is imported) on tiny fp32 shapes; see ``tests/_interp_attention.py`` for the checks. GPU (marked ``gpu``):
the same checks in bf16 and fp32 at head_dim 64/128 and Qwen3-1.7B shapes (16 query heads, 8 KV heads, head_dim 128).
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch

from interpreter_jobs import failure_report

HELPER = "tests/_interp_attention.py"

triton_missing = importlib.util.find_spec("triton") is None
HAS_NVIDIA_BACKEND = not triton_missing and importlib.util.find_spec("triton.backends.nvidia") is not None


SECTIONS = ["forward", "exact", "backward", "split", "window"]


@pytest.mark.parametrize(
    "section", [pytest.param(s, marks=pytest.mark.interpreter(HELPER, s)) for s in SECTIONS]
)
def test_interpreter(section: str, interpreter_run: subprocess.CompletedProcess) -> None:
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert f"{section}: ok" in interpreter_run.stdout


@pytest.mark.interpreter("tests/_interp_attention_configs.py")
def test_interpreter_sweep_candidates(interpreter_run: subprocess.CompletedProcess) -> None:
    """Every launch candidate of ``benchmarks/attention_configs.py`` gives the library config's bits (training, paged
    prefill, chunked prefill, decode), and another ``BLOCK_N`` does not (``tests/_interp_attention_configs.py``)."""
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert "configs: ok" in interpreter_run.stdout


class _LaunchRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **meta)`` records ``(grid, meta)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple):
        return lambda *args, **meta: self.calls.append((grid, meta))

    def paged(self, hq: int, hkv: int, num_seqs: int, keys: int, queries: int = 1,
              cfg: dict | None = None) -> tuple[tuple, dict]:  # fmt: skip
        """``(grid, meta)`` of a bf16 paged launch (head_dim 128, 16-token pages) of ``num_seqs`` sequences of
        ``keys`` keys and ``queries`` new queries each, with this recorder as the forward kernel."""
        from rlexact.ops import triton_attention as ta

        d, page = 128, 16
        blocks = keys // page
        kc = torch.zeros(num_seqs * blocks, page, hkv, d, dtype=torch.bfloat16)
        tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
        q = torch.zeros(num_seqs * queries, hq, d, dtype=torch.bfloat16)
        cu = torch.arange(0, num_seqs * queries + 1, queries, dtype=torch.int32)
        lens = torch.full((num_seqs,), keys, dtype=torch.int32)
        ta._forward(q, kc, kc, cu, lens, tables, 1.0, torch.empty_like(q), cfg=cfg, max_seqlen_q=queries)
        return self.calls[-1]


@pytest.mark.skipif(triton_missing, reason="needs triton")
def test_decode_pipeline_stages_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five stages only for split-parallel decode launches with at most four programs per SM (the interpreter
    counts four SMs); single-split decode launches, big grids and prefill keep their swept launches; an explicit
    ``num_stages`` wins."""
    from rlexact.ops import triton_attention as ta

    fwd = _LaunchRecorder()
    monkeypatch.setattr(ta, "_attn_fwd_kernel", fwd)
    split = ta._fwd_config(128, torch.bfloat16)["SPLIT"]

    def stages(num_seqs: int, keys: int, queries: int = 1, cfg: dict | None = None) -> int:
        meta = fwd.paged(2, 1, num_seqs, keys, queries, cfg)[1]
        assert meta["enable_fp_fusion"] is True  # triton_shared.COMPILE_OPTIONS reaches the launch
        return meta["num_stages"]

    swept = ta.DECODE_LAUNCH_16BIT["num_stages"]
    assert ta.DECODE_DEEP_STAGES != swept, "the rule must change something for the checks below to mean anything"
    assert stages(1, 2 * split) == ta.DECODE_DEEP_STAGES  # 2 split programs on 4 SMs
    assert stages(8, 2 * split) == ta.DECODE_DEEP_STAGES  # 16 programs: four per SM
    assert stages(9, 2 * split) == swept  # 18 programs
    assert stages(1, split) == swept  # one split: no split-parallel pass
    assert stages(1, 2 * split, queries=8) == ta.PREFILL_LAUNCH_16BIT["num_stages"]  # a prefill chunk
    assert stages(1, 2 * split, cfg={"num_stages": 3}) == 3


@pytest.mark.skipif(triton_missing, reason="needs triton")
def test_decode_heads_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch packs as many of a GQA group's query heads into a tile as fit (a grid axis of ``hq / group``
    head groups), split-parallel decode of one sequence included; ``{"HP": n}`` overrides it, and an ``HP`` that does
    not divide the group is refused."""
    from rlexact.ops import triton_attention as ta

    fwd = _LaunchRecorder()
    monkeypatch.setattr(ta, "_attn_fwd_kernel", fwd)
    hq, hkv = 4, 2
    split = ta._fwd_config(128, torch.bfloat16)["SPLIT"]

    def launch(num_seqs: int, keys: int, queries: int = 1, cfg: dict | None = None) -> tuple[tuple, int]:
        grid, meta = fwd.paged(hq, hkv, num_seqs, keys, queries, cfg)
        return grid, meta["HP"]

    assert launch(1, 2 * split) == ((1, hq // 2, 2), 2)
    assert launch(1, split) == ((1, hq // 2, 1), 2)
    assert launch(1, 2 * split, queries=8)[1] == 2  # a prefill chunk
    assert launch(1, 2 * split, cfg={"HP": 1}) == ((1, hq, 2), 1)
    with pytest.raises(ValueError, match="HP 3 must be a positive divisor of the GQA group 2"):
        launch(1, 2 * split, cfg={"HP": 3})


@pytest.mark.skipif(triton_missing, reason="needs triton")
def test_decode_launch_by_head_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure decode launch at head_dim 256 (Gemma 3) in bf16 takes ``DECODE_LAUNCH_BY_HEAD_DIM[256]``'s query-side
    entries; its prefill chunks, fp32 launches and head_dim 128 keep theirs, and the key-side entries (the bits'
    ``BLOCK_N``, ``SPLIT``) are never replaced."""
    from rlexact.ops import triton_attention as ta

    fwd = _LaunchRecorder()
    monkeypatch.setattr(ta, "_attn_fwd_kernel", fwd)
    wide = ta.DECODE_LAUNCH_BY_HEAD_DIM[256]
    assert wide != {k: ta._fwd_config(256, torch.bfloat16)[k] for k in wide}, "the entry must change the launch"

    def launch(d: int, dtype: torch.dtype, queries: int) -> dict:
        page, blocks, hkv = 16, 4, 1
        kc = torch.zeros(2 * blocks, page, hkv, d, dtype=dtype)
        tables = torch.arange(2 * blocks, dtype=torch.int32).view(2, blocks)
        q = torch.zeros(2 * queries, 4, d, dtype=dtype)
        cu = torch.arange(0, 2 * queries + 1, queries, dtype=torch.int32)
        lens = torch.full((2,), page * blocks, dtype=torch.int32)
        ta._forward(q, kc, kc, cu, lens, tables, 1.0, torch.empty_like(q), max_seqlen_q=queries)
        return fwd.calls[-1][1]

    decode = launch(256, torch.bfloat16, 1)
    assert all(decode[k] == v for k, v in wide.items())
    base = ta._fwd_config(256, torch.bfloat16)
    assert (decode["BLOCK_N"], decode["SPLIT"]) == (base["BLOCK_N"], base["SPLIT"])
    prefill = launch(256, torch.bfloat16, 8)
    assert all(prefill[k] == base[k] for k in wide)
    fp32 = launch(256, torch.float32, 1)
    assert all(fp32[k] == ta._fwd_config(256, torch.float32)[k] for k in wide)
    assert launch(128, torch.bfloat16, 1)["BLOCK_M"] == ta.DECODE_LAUNCH_16BIT["BLOCK_M"]


def _arg_types(kernel, const: dict) -> dict[str, str]:  # noqa: ANN001 - a Triton JITFunction
    """Runtime argument types of an attention kernel for a bf16 launch: tensors bf16 (the log-sum-exp, delta and
    split partials fp32; index tables int32), scales fp32, other scalars int32."""
    fp32 = {"LSE", "DELTA", "PACC", "PML", "qk_scale", "sm_scale"}
    ints = {"cu", "cu_q", "seqlens_k", "block_tables", "CNT"}
    types = {}
    for name in kernel.arg_names:
        if name in const:
            continue
        if name in ints:
            types[name] = "*i32"
        elif name in fp32:
            types[name] = "fp32" if name.endswith("scale") else "*fp32"
        else:
            types[name] = "*bf16" if name[0].isupper() else "i32"
    return types


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="needs triton's CUDA backend")
def test_attention_kernels_compile_for_hopper_with_and_without_a_window() -> None:
    """The forward (decode with and without the split-parallel pass, packed prefill, the backward's preprocessing)
    and both backward kernels compile for sm_90 on the host with ``HAS_WINDOW`` off and on (the interpreter does not
    type-check the compiled path); the windowed code differs from the unwindowed (the mask is compiled in)."""
    from hopper_compile import compile_for_hopper
    from rlexact.ops import triton_attention as ta

    fwd = dict(
        HEAD_DIM=128, BLOCK_D=128, EVEN_D=True, BLOCK_M=16, BLOCK_N=64, HP=2, GROUP=2, PAGED=True, PAGE_SIZE=16,
        BWD_PREP=False, SCAN=128, SPLIT=ta.SPLIT_KEYS_16BIT, SPLIT_PAR=False, DIRECT=True, ONE_Q=True, FP32_DOT=False,
        UPCAST=False, PDL=False,
    )  # fmt: skip
    prefill = dict(BLOCK_M=64, PAGED=False, PAGE_SIZE=1, DIRECT=False, ONE_Q=False)
    cases = [
        (ta._attn_fwd_kernel, fwd),
        (ta._attn_fwd_kernel, fwd | dict(SPLIT_PAR=True)),
        (ta._attn_fwd_kernel, fwd | prefill),
        (ta._attn_fwd_kernel, fwd | prefill | dict(BWD_PREP=True)),
    ]
    bwd = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, GROUP=2, FP32_DOT=False, UPCAST=False, SCAN=128)
    cases += [(ta._attn_bwd_dkdv_kernel, bwd), (ta._attn_bwd_dq_kernel, bwd)]
    for kernel, const in cases:
        ptx = {}
        for window in (False, True):
            flags = const | {"HAS_WINDOW": window}
            ptx[window] = compile_for_hopper(kernel, _arg_types(kernel, flags), flags, num_warps=4).asm["ptx"]
        assert ptx[True] != ptx[False], f"{kernel.fn.__name__}: the window changed no code"


@pytest.mark.skipif(triton_missing, reason="needs triton")
def test_pair_kernel_takes_only_tiles_tma_moves() -> None:
    """The persistent pair reads query tiles and writes output tiles by TMA, so it takes only 16-byte aligned queries
    and outputs with contiguous heads (a fused projection's strided view qualifies); others stay on the single
    kernel, whose bits are the same."""
    from rlexact.ops import gluon_attention_pair as gp

    t, hq, d = 10, 16, 128
    good = torch.zeros(t, hq, d, dtype=torch.bfloat16)
    assert gp.takes(good) and gp.takes(good, torch.empty_like(good))
    assert not gp.takes(good, torch.zeros(t, d, hq, dtype=torch.bfloat16).transpose(1, 2))  # head dim strided
    assert not gp.takes(good, torch.zeros(t * hq * d + 1, dtype=torch.bfloat16)[1:].view(t, hq, d))
    assert gp.takes(torch.zeros(t, hq + 16, d, dtype=torch.bfloat16)[:, :hq])
    assert not gp.takes(torch.zeros(t * hq * d + 1, dtype=torch.bfloat16)[1:].view(t, hq, d))  # base off by 2 bytes
    assert not gp.takes(torch.zeros(t, hq, d + 4, dtype=torch.bfloat16)[:, :, :d])  # head stride of 264 bytes
    assert not gp.takes(torch.zeros(t, hq * d + 4, dtype=torch.bfloat16)[:, : hq * d].view(t, hq, d))  # row stride


# ---------------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available() or triton_missing, reason="needs a CUDA GPU and triton")


@pytest.fixture(scope="module")
def checks():
    spec = importlib.util.spec_from_file_location("_interp_attention", HELPER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GPU_LENS = [1, 37, 64, 300, 1025]
DTYPES = [torch.bfloat16, torch.float32]
QWEN3 = (16, 8, 128)  # Qwen3-1.7B: query heads, kv heads, head_dim


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [QWEN3, (8, 8, 64), (8, 2, 64), (16, 4, 128)], ids=str)
def test_gpu_correctness(checks, dtype, shape) -> None:
    checks.check_correctness(GPU_LENS, *shape, dtype=dtype, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [QWEN3, (8, 2, 64)], ids=str)
def test_gpu_exactness(checks, dtype, shape) -> None:
    kw = {"dtype": dtype, "device": "cuda"}
    checks.check_exactness([1, 37, 200, 333], *shape, chunks=(1, 64, 100), block_sizes=(16,), **kw)
    checks.check_exactness([5, 129, 700], *shape, chunks=(256, 333), block_sizes=(16, 64, 256), **kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_batch_invariance(checks, dtype) -> None:
    checks.check_batch_invariance(GPU_LENS, *QWEN3, dtype=dtype, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 100, 4096])
def test_gpu_window(checks, dtype, window) -> None:
    """Sliding windows on the tl kernel at the library's tiles and splits: against float64, every schedule bitwise
    the training rows (decode with several KV splits included), the backward; rows past the window differ from the
    unwindowed launch."""
    lens = [1, 37, 300, 1025] if window < 1025 else [1, 37, 300, 5000]
    checks.check_window(lens, *QWEN3, window, dtype=dtype, device="cuda", chunks=(64, 333), block_sizes=(16,))


@pytest.mark.gpu
@gpu
def test_gpu_decode_large_batch(checks) -> None:
    """Decode at batch 64 with 512-token contexts equals the training rows (Qwen3-1.7B shapes, bf16)."""
    lens = [500 + (7 * i) % 24 for i in range(64)]
    checks.check_exactness(
        lens, *QWEN3, dtype=torch.bfloat16, device="cuda", chunks=(), block_sizes=(16,)
    )  # paged-full + decode schedule


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [QWEN3, (16, 4, 128), (32, 4, 128)], ids=str)
def test_gpu_gluon_decode_shared_prefix(heads) -> None:
    """A decode step whose sequences hold their prompts' first tiles in the same blocks reads those tiles once per
    group (``rlexact.ops.shared_prefix``): its rows equal the launch without the plan bitwise, with groups of one to
    eight tiles, members at and past tile edges, more members than one group holds, a row alone, pages shuffled and
    NaN past every sequence. Negative controls: a perturbed shared key changes every member's rows and no other; a
    plan that starts a row which holds other blocks from the group's state changes that row (the state is read)."""
    from rlexact.ops import SharedPrefix, gluon_decode, group_capacity
    from rlexact.ops import triton_attention as ta
    from rlexact.rollout.prefix_plan import plan_shared_prefix

    hq, hkv, d = heads
    page, cap = gluon_decode.PAGE, group_capacity(hq, hkv)
    prompts = [520] * 8 + [64] * 3 + [300] + [200] * (cap + 1)  # 8 tiles; 1 tile; alone; one group and one row
    lens = [521, 540, 583, 584, 585, 600, 521, 700] + [65, 100, 128] + [301] + list(range(201, 202 + cap))
    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc, tables = nan_paged_caches(lens, hkv, d, page, g)
    for first, n, p in ((0, 8, 520), (8, 3, 64), (12, cap + 1, 200)):  # members hold the first member's full pages
        tables[first : first + n, : p // page] = tables[first, : p // page]
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if not gluon_decode.supported(q, kc, vc, 64, ta.SPLIT_KEYS_16BIT):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    blocks = [tables[i, : -(-n // page)].tolist() for i, n in enumerate(lens)]
    plan = plan_shared_prefix(blocks, [n - 1 for n in lens], prompts, page, cap)
    assert [len(m) for m in plan.groups] == [8, 3, cap] and plan.tiles == [8, 1, 3]
    assert plan.start[11] == 0 and plan.start[-1] == 0 and plan.start[-2] == 3

    def shared(start: list[int]) -> SharedPrefix:
        members = torch.full((len(lens) // 2, cap), -1, dtype=torch.int32)
        for i, rows in enumerate(plan.groups):
            members[i, : len(rows)] = torch.tensor(rows)
        tiles = torch.zeros(len(lens) // 2, dtype=torch.int32)
        tiles[: len(plan.tiles)] = torch.tensor(plan.tiles)
        parts = (torch.tensor(start), members, tiles, torch.tensor([len(plan.groups)]))
        return SharedPrefix(*(t.to("cuda", torch.int32) for t in parts))

    cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)

    def run(prefix: SharedPrefix | None, k: torch.Tensor = kc) -> torch.Tensor:
        out = torch.empty_like(q)
        ta._forward(q, k, vc, cu, seqlens, tables, d**-0.5, out, max_seqlen_q=1, prefix=prefix)
        return out

    ref = run(None)
    assert torch.isfinite(ref).all()
    assert torch.equal(run(shared(plan.start)), ref)
    k2 = kc.clone()
    k2[int(tables[0, 3]), 5] += 1.0  # a key of the first group's fourth page: read once, for every member
    out = run(shared(plan.start), k=k2)
    members = torch.zeros(len(lens), dtype=torch.bool, device="cuda")
    members[:8] = True
    assert all(not torch.equal(out[i], ref[i]) for i in range(8))
    assert torch.equal(out[~members], ref[~members]) and torch.equal(out, run(None, k=k2))
    wrong = list(plan.start)
    wrong[11] = 1  # row 11 holds its own blocks: started from a state it never had, its row changes
    plan.groups[1].append(11)
    out = run(shared(wrong))
    assert not torch.equal(out[11], ref[11])
    assert torch.equal(out[:11], ref[:11]) and torch.equal(out[12:], ref[12:])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gl_cfg", [{"PAIR": False}, {"PAIR": True}, {"PAIR": True, "PROGRAMS": 3},
                                    {"PAIR": True, "PROGRAMS": 1 << 20}], ids=["single", "pair", "pair-3", "pair-all"])
@pytest.mark.parametrize("heads", [QWEN3, (16, 4, 128), (8, 8, 128)], ids=str)
def test_gpu_gluon_forward_equals_tl(heads, gl_cfg) -> None:
    """On sm_90 the packed forward runs a Gluon kernel (``rlexact.ops.gluon_attention``, or with ``PAIR`` its
    warp-specialized pair of query tiles, ``rlexact.ops.gluon_attention_pair``, persistent by default, over three
    programs each looping over many items, or with a program per item): its rows equal the ``tl`` kernel's bitwise
    (mixed lengths, partial tiles, several sequences per tile slot, KV splits, NaN in another sequence's keys), a
    non-contiguous K/V view gives the same rows, and the backward's preprocessing gives the ``tl`` kernel's
    log-sum-exp. Negative control: another key tile changes bits."""
    from rlexact.ops import gluon_attention
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = heads
    q = torch.randn(6, hq, d, device="cuda", dtype=torch.bfloat16)
    if not gluon_attention.supported(q, q[:, :hkv], q[:, :hkv], 64):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    lens = [1, 37, 200, 333, 64, 65, 1100, 2500, 1024, 1025, 9]
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(t, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # strided views, as a fused projection gives

    def run(cfg: dict | None, kk: torch.Tensor = k, vv: torch.Tensor = v) -> torch.Tensor:
        out = torch.empty_like(q)
        ta._forward(q, kk, vv, cu, None, None, d**-0.5, out, cfg=cfg)
        return out

    ref = run({"GLUON": False})
    assert torch.equal(run(gl_cfg), ref)
    assert torch.equal(run(gl_cfg, k.contiguous(), v.contiguous()), ref)
    k_nan, v_nan = k.clone(), v.clone()
    one = slice(lens[0], lens[0] + lens[1])  # sequence 1, whose keys sequence 0's only key tile also covers
    k_nan[one] = float("nan")
    v_nan[one] = float("nan")
    out, keep = run(gl_cfg, k_nan, v_nan), torch.ones(t, dtype=torch.bool, device="cuda")
    keep[one] = False
    assert torch.equal(out[keep], ref[keep])
    lse = [torch.empty(t, hq, device="cuda", dtype=torch.float32) for _ in range(4)]
    do = torch.randn_like(q)
    ta._forward(q, k, v, cu, None, None, d**-0.5, do, lse_delta=(lse[0], lse[1]), cfg={"GLUON": False})
    ta._forward(q, k, v, cu, None, None, d**-0.5, do, lse_delta=(lse[2], lse[3]), cfg=gl_cfg)
    assert torch.equal(lse[0], lse[2])
    torch.testing.assert_close(lse[1], lse[3], rtol=1e-5, atol=1e-5)  # delta: a row sum, another reduction tree
    assert not torch.equal(run({"GLUON": False, "BLOCK_N": 32, "SPLIT": 1024}), ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_gluon_pair_dispatch(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed launches whose sequences average ``MIN_MEAN_KEYS`` keys or more take the paired Gluon kernel, shorter
    ones the single one (the plan each launch keeps says which); both give the ``tl`` kernel's rows bitwise, in both
    16-bit dtypes."""
    from rlexact.ops import gluon_attention, gluon_attention_pair
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = QWEN3
    probe = torch.empty(1, hq, d, device="cuda", dtype=dtype)
    if not gluon_attention.supported(probe, probe[:, :hkv], probe[:, :hkv], 64):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    monkeypatch.setattr(ta, "_PLANS", {})
    n = gluon_attention_pair.MIN_MEAN_KEYS
    g = torch.Generator(device="cuda").manual_seed(1)
    for lens, paired in (([2 * n - 3, 3], True), ([n - 1] * 2, False), ([n + n // 2, n - n // 2], True)):
        t = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(t, h, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))
        outs = [torch.empty_like(q) for _ in range(2)]
        ta._forward(q, k, v, cu, None, None, d**-0.5, outs[0])
        plan, _ = ta._PLANS[ta._plan_key(q, k, v, cu, outs[0], None)]
        assert (plan.q_layout is not None) == paired, lens
        ta._forward(q, k, v, cu, None, None, d**-0.5, outs[1], cfg={"GLUON": False})
        assert torch.equal(outs[0], outs[1]), lens


@pytest.mark.gpu
@gpu
def test_gpu_gluon_pair_counter_left_zero() -> None:
    """The paired kernel's item counter is one buffer per stream, which every launch leaves zero: launches of several
    sizes (so grids of several program counts) on one stream, on a second stream and replays of a CUDA graph captured
    on a third all give the ``tl`` kernel's rows bitwise, with the counters zero after each. Negative control: a
    counter left non-zero makes the next launch skip items."""
    from rlexact.ops import gluon_attention
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = QWEN3
    probe = torch.empty(1, hq, d, device="cuda", dtype=torch.bfloat16)
    if not gluon_attention.supported(probe, probe[:, :hkv], probe[:, :hkv], 64):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    g = torch.Generator(device="cuda").manual_seed(3)
    dev = torch.device("cuda", torch.cuda.current_device())

    def case(lens: list[int]) -> tuple:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        t = sum(lens)
        q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
        tl = torch.empty_like(q)
        ta._forward(q, k, v, cu, None, None, d**-0.5, tl, cfg={"GLUON": False})
        return q, k, v, cu, tl

    def paired(q, k, v, cu, programs: int | None = None) -> torch.Tensor:  # noqa: ANN001
        out = torch.zeros_like(q)
        ta._forward(q, k, v, cu, None, None, d**-0.5, out, cfg={"PAIR": True, "PROGRAMS": programs})
        return out

    cases = [case(lens) for lens in ([300, 200], [4096, 1000, 3000], [256] * 40, [700])]
    counter = gluon_attention.item_counter(dev)
    for (q, k, v, cu, tl), programs in zip(cases, (None, 3, None, 1)):
        assert torch.equal(paired(q, k, v, cu, programs), tl)
        torch.cuda.synchronize()
        assert gluon_attention.item_counter(dev) is counter and not counter.any()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q, k, v, cu, tl = cases[1]
        out = paired(q, k, v, cu)
        side_counter = gluon_attention.item_counter(dev)
    side.synchronize()
    assert side_counter is not counter and not side_counter.any() and torch.equal(out, tl)
    q, k, v, cu, tl = cases[2]
    paired(q, k, v, cu)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paired(q, k, v, cu)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, tl) and not counter.any()
    counter[0] = 1 << 20  # as if a launch had not zeroed it: every item drawn from it lies past the launch's items
    assert not torch.equal(paired(q, k, v, cu), tl)
    torch.cuda.synchronize()
    assert not counter.any()


@pytest.mark.gpu
@gpu
def test_gpu_gluon_planned_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches through kept plans (token counts that share one, and the backward's preprocessing) give the rows
    and gradients of the launches that keep them, which equal the ``tl`` kernel's bitwise. Negative control: a
    narrower KV split changes the rows of sequences longer than it."""
    from rlexact import ops
    from rlexact.ops import gluon_attention
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = QWEN3
    probe = torch.empty(1, hq, d, device="cuda", dtype=torch.bfloat16)
    if not gluon_attention.supported(probe, probe[:, :hkv], probe[:, :hkv], 64):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    monkeypatch.setattr(ta, "_PLANS", {})
    g = torch.Generator(device="cuda").manual_seed(2)
    kept = []
    for lens in ([1500, 700], [900, 1700], [1200, 300, 640]):
        t = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
        dout = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        runs = []
        for _ in range(2):  # the first run keeps the plans the second launches through
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = ops.attention_varlen(*leaves, cu, d**-0.5)
            out.backward(dout)
            runs.append((out.detach(), *(x.grad for x in leaves)))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), lens
        tl = torch.empty_like(q)
        ta._forward(q, k, v, cu, None, None, d**-0.5, tl, cfg={"GLUON": False})
        assert torch.equal(runs[1][0], tl), lens
        narrow = torch.empty_like(q)
        ta._forward(q, k, v, cu, None, None, d**-0.5, narrow, cfg={"SPLIT": 128})
        assert not torch.equal(narrow, tl), lens
        kept.append(len(ta._PLANS))
    assert kept[0] >= 2 and kept == [kept[0]] * 3  # forward and preprocessing plans, shared by the token counts


@pytest.mark.gpu
@gpu
def test_gpu_gluon_cached_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon forward's second launch of a specialization goes through its cached launcher and gives the first
    launch's bits; another specialization (a query buffer that is not 16-byte aligned, one sequence) gets its own
    compiled kernel and still the ``tl`` kernel's rows. With the cached launchers off (``RLEXACT_GLUON_JIT_LAUNCH``)
    none is kept."""
    from rlexact.ops import gluon_attention
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = QWEN3
    lens = [5, 300, 70]
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    buf = torch.randn(t * hq * d + 1, device="cuda", dtype=torch.bfloat16)
    q_aligned, q_odd = buf[: t * hq * d].view(t, hq, d), buf[1:].view(t, hq, d)
    k, v = (torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if not gluon_attention.supported(q_aligned, k, v, 64):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")

    def run(q: torch.Tensor, cu: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
        out = torch.empty(q.shape, device="cuda", dtype=q.dtype)
        ta._forward(q, k, v, cu, None, None, d**-0.5, out, cfg=cfg)
        return out

    monkeypatch.setattr(gluon_attention, "_LAUNCHERS", {})
    first = run(q_aligned, cu)
    assert len(gluon_attention._LAUNCHERS) == 1
    assert torch.equal(run(q_aligned, cu), first) and len(gluon_attention._LAUNCHERS) == 1
    assert torch.equal(first, run(q_aligned, cu, {"GLUON": False}))
    odd = run(q_odd, cu)
    assert len(gluon_attention._LAUNCHERS) == 2 and torch.equal(run(q_odd, cu), odd)
    assert torch.equal(odd, run(q_odd, cu, {"GLUON": False}))
    one = cu[[0, 1]]  # num_seqs == 1: Triton specializes the integer
    assert torch.equal(run(q_aligned[:5], one), run(q_aligned[:5], one, {"GLUON": False}))
    assert len(gluon_attention._LAUNCHERS) == 3
    monkeypatch.setattr(gluon_attention, "_LAUNCHERS", {})
    monkeypatch.setattr(gluon_attention, "_DIRECT", [False])
    assert torch.equal(run(q_aligned, cu), first) and not gluon_attention._LAUNCHERS


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [QWEN3, (16, 4, 128), (8, 8, 128), (64, 2, 128)], ids=str)
def test_gpu_gluon_decode_equals_tl(heads, monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 a decode step whose contexts fit one KV split runs the persistent Gluon kernel
    (``rlexact.ops.gluon_decode``): its rows equal the ``tl`` decode launch's bitwise, with pages shuffled across
    sequences, lengths at and around every page and tile edge up to the split, NaN in every cache slot past a
    sequence and in the table entries past it, one to three programs per SM, in transposed tiles (query heads per
    item up to ``TRANSPOSED_MAX_HP``) and in the wide 64-row tile. A table wider than one split keeps the
    ``tl`` launch; a sequence of no keys leaves the others' rows unchanged. Negative control: a perturbed key changes
    its sequence's rows and no other."""
    from rlexact.ops import gluon_decode
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = heads
    page, split = gluon_decode.PAGE, ta.SPLIT_KEYS_16BIT
    lens = [1, 2, 15, 16, 17, 63, 64, 65, 100, 129, 1000, 1023, split, *range(3, split, 97)]
    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, tables = nan_paged_caches(lens, hkv, d, page, g)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if not gluon_decode.supported(q, kc, vc, 64, split):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    calls = []
    real = gluon_decode.forward
    monkeypatch.setattr(gluon_decode, "forward", lambda *a: calls.append(1) or real(*a))

    def run(cfg: dict | None, k: torch.Tensor = kc, bt: torch.Tensor = tables,
            lens_k: torch.Tensor = seqlens) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(q)
        ta._forward(q, k, vc, cu, lens_k, bt, d**-0.5, out, cfg=cfg, max_seqlen_q=1)
        return out

    ref = run({"GLUON": False})
    assert torch.isfinite(ref).all() and not calls
    assert torch.equal(run(None), ref) and len(calls) == 1
    with monkeypatch.context() as m:
        m.setattr(gluon_decode, "TRANSPOSED_MAX_HP", 0)
        assert torch.equal(run(None), ref) and len(calls) == 2
    monkeypatch.setattr(gluon_decode, "PROGRAMS_PER_SM", 3)
    assert torch.equal(run(None), ref) and len(calls) == 3
    monkeypatch.setattr(gluon_decode, "PROGRAMS_PER_SM", 1)
    assert torch.equal(run(None), ref) and len(calls) == 4
    wide = torch.cat([tables, tables[:, :1]], dim=1)  # one entry past a split: the tl launch
    assert torch.equal(run(None, bt=wide), ref) and len(calls) == 4
    k2 = kc.clone()
    k2[int(tables[5, 0]), 0] += 1.0  # sequence 5's first key
    out = run(None, k=k2)
    assert not torch.equal(out[5], ref[5])
    others = torch.arange(len(lens), device="cuda") != 5
    assert torch.equal(out[others], ref[others])
    empty = seqlens.clone()
    empty[2] = 0  # a sequence of no keys gets one masked padding tile: the launch ends, the other rows are unchanged
    out = run(None, lens_k=empty)
    others = torch.arange(len(lens), device="cuda") != 2
    assert torch.equal(out[others], ref[others]) and len(calls) == 6


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gl_cfg", [{"PAIR": False}, {"PAIR": True}, {"PAIR": True, "PROGRAMS": 3}],
                         ids=["single", "pair", "pair-3"])
@pytest.mark.parametrize("heads", [QWEN3, (16, 4, 128)], ids=str)
def test_gpu_gathered_paged_equals_tl(heads, gl_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paged launch with many queries per sequence gathers its keys out of the caches and runs the packed Gluon
    kernel (``rlexact.ops.kv_gather``): its rows equal the ``tl`` paged launch's bitwise, for prefill chunks after
    earlier keys (across KV splits and tile edges), a fresh prompt and decode rows in the same launch, with pages
    shuffled across sequences and NaN in every cache slot past a sequence and in the table entries past it. The
    default dispatch takes the gathered path only from ``MIN_MEAN_QUERIES`` queries per sequence. Negative control:
    a perturbed visible key changes its sequence's rows and no other."""
    from rlexact.ops import kv_gather
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = heads
    page = 16
    past = [1000, 0, 37, 2048, 5000, 63, 64, 4095, 1]
    new = [200, 300, 1, 700, 1500, 65, 64, 1, 129]
    lens = [p + n for p, n in zip(past, new)]
    g = torch.Generator(device="cuda").manual_seed(3)
    kc, vc, tables = nan_paged_caches(lens, hkv, d, page, g)
    q = torch.randn(sum(new), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if not gluon_attention_supported(q, kc):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    calls = []
    real = kv_gather.gather
    monkeypatch.setattr(kv_gather, "gather", lambda *a: calls.append(1) or real(*a))

    every = slice(0, len(lens))

    def run(cfg: dict | None, k: torch.Tensor = kc, seqs: slice = every) -> torch.Tensor:
        a, b = seqs.start, seqs.stop
        qq = q[int(cu[a]) : int(cu[b])]
        out = torch.empty_like(qq)
        ta._forward(qq, k, vc, cu[a : b + 1] - cu[a], seqlens[seqs], tables[seqs], d**-0.5, out, cfg=cfg)
        return out

    ref = run({"GLUON": False})
    assert torch.isfinite(ref).all() and not calls
    assert torch.equal(run({"GATHER": True, **gl_cfg}), ref) and len(calls) == 1
    assert torch.equal(run(None), ref) and len(calls) == 2  # 2,960 queries over 9 sequences: gathered by default
    tail = slice(5, 9)  # 259 queries over 4 sequences: below MIN_MEAN_QUERIES, the tl launch
    assert kv_gather.MIN_MEAN_QUERIES * 4 > 259
    assert torch.equal(run(None, seqs=tail), ref[int(cu[5]) :]) and len(calls) == 2
    one_each = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)  # a decode step: never gathered
    outs = [torch.empty(len(lens), hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for out, cfg in zip(outs, (None, {"GLUON": False})):
        ta._forward(q[: len(lens)], kc, vc, one_each, seqlens, tables, d**-0.5, out, cfg=cfg, max_seqlen_q=1)
    assert torch.equal(outs[0], outs[1]) and len(calls) == 2
    k2 = kc.clone()
    k2[int(tables[3, 100 // page]), 100 % page] += 1.0  # sequence 3's key at position 100, visible to all its queries
    out = run({"GATHER": True, **gl_cfg}, k=k2)
    rows3 = slice(int(cu[3]), int(cu[4]))
    assert not torch.equal(out[rows3], ref[rows3])
    others = torch.ones(sum(new), dtype=torch.bool, device="cuda")
    others[rows3] = False
    assert torch.equal(out[others], ref[others])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [QWEN3, (16, 4, 128)], ids=str)
def test_gpu_heads_per_program_keep_bits(heads) -> None:
    """The ``tl`` kernel's rows do not depend on how many of a GQA group's query heads share a program (``{"HP": n}``,
    every divisor of the group): split-parallel decode over up to three KV splits and a paged prefill chunk, pages
    shuffled, NaN past every sequence. Negative control: a perturbed key changes its sequence's rows."""
    from rlexact.ops import triton_attention as ta

    hq, hkv, d = heads
    group, split = hq // hkv, ta.split_keys(d, torch.bfloat16)
    lens = [1, 65, split + 1, 2 * split + 37, 3 * split]
    g = torch.Generator(device="cuda").manual_seed(3)
    kc, vc, tables = nan_paged_caches(lens, hkv, d, 16, g)
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    for queries in (1, 7):  # decode, then the last seven positions of each sequence as one chunk
        nq = [min(queries, n) for n in lens]
        q = torch.randn(sum(nq), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, *torch.tensor(nq).cumsum(0).tolist()], device="cuda", dtype=torch.int32)

        def run(hp: int, k: torch.Tensor = kc, q=q, cu=cu, queries=queries) -> torch.Tensor:  # noqa: ANN001
            out = torch.empty_like(q)
            ta._forward(q, k, vc, cu, seqlens, tables, d**-0.5, out, cfg={"GLUON": False, "HP": hp},
                        max_seqlen_q=queries)  # fmt: skip
            return out

        ref = run(group)
        assert torch.isfinite(ref).all()
        for hp in (n for n in range(1, group) if group % n == 0):
            assert torch.equal(run(hp), ref), (queries, hp)
        k2 = kc.clone()
        k2[int(tables[3, 0]), 0] += 1.0  # sequence 3's first key
        rows = slice(int(cu[3]), int(cu[4]))
        assert not torch.equal(run(1, k=k2)[rows], ref[rows])


def nan_paged_caches(
    lens: list[int], hkv: int, d: int, page: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 caches ``[NB, page, hkv, d]`` and block tables for sequences of ``lens`` keys: pages shuffled across
    sequences, NaN in every slot past a sequence, and the table entries past a sequence pointing at a NaN page."""
    nblk = [-(-n // page) for n in lens]
    kc, vc = (torch.randn(sum(nblk) + 1, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    perm = torch.randperm(sum(nblk) + 1, device="cuda", generator=g).to(torch.int32)
    tables = torch.full((len(lens), max(nblk)), int(perm[-1]), device="cuda", dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        tables[i, : nblk[i]] = perm[used : used + nblk[i]]
        for cache in (kc, vc):
            cache[int(perm[used + nblk[i] - 1]), n - (nblk[i] - 1) * page :] = float("nan")
        used += nblk[i]
    kc[int(perm[-1])] = vc[int(perm[-1])] = float("nan")
    return kc, vc, tables


def gluon_attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    from rlexact.ops import gluon_attention

    rows = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    return gluon_attention.supported(q, rows, rows, 64)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_negative_control(checks, dtype) -> None:
    checks.check_negative_control(GPU_LENS, *QWEN3, dtype=dtype, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [QWEN3, (8, 2, 64)], ids=str)
def test_gpu_backward(checks, dtype, shape) -> None:
    checks.check_backward(GPU_LENS, *shape, dtype=dtype, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_split_kv_production_size(checks, dtype) -> None:
    """Sequences spanning up to three splits of the production size: training == paged full prefill == chunked
    prefill (chunks straddling split boundaries) == decode, bitwise."""
    from rlexact.ops import triton_attention as ta

    split = ta._fwd_config(QWEN3[2], dtype)["SPLIT"]
    lens = [2 * split + 37, 5, split + 1]
    checks.check_exactness(lens, *QWEN3, dtype=dtype, device="cuda", chunks=(split // 2 + 3,), block_sizes=(16,))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_split_kv_small_splits(checks, dtype) -> None:
    """Splits of two key tiles (many splits on short sequences): exactness with split-parallel decode and with
    in-program split loops, correctness, backward, and the negative control (another split size changes bits)."""
    kw = {"dtype": dtype, "device": "cuda"}
    with checks.small_splits(2):
        checks.check_correctness(GPU_LENS, *QWEN3, **kw)
        checks.check_exactness([1, 37, 200, 333], *QWEN3, chunks=(1, 100), block_sizes=(16,), **kw)
        checks.check_exactness([5, 129, 700], 8, 2, 64, chunks=(333,), block_sizes=(64,), **kw)
        checks.check_backward(GPU_LENS, *QWEN3, **kw)
    with checks.small_splits(2, parallel=False):
        checks.check_exactness([1, 37, 200, 333], *QWEN3, chunks=(100,), block_sizes=(16,), **kw)
    checks.check_split_negative_control([300, 700], *QWEN3, **kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("splits", [None, 2], ids=["production", "small-splits"])
def test_gpu_cuda_graph_decode(checks, splits) -> None:
    """attention_paged needs no host sync: it captures into a CUDA graph (the split-parallel pass and its workspace
    too), and replays track in-place input updates."""
    import contextlib

    from rlexact.ops import triton_attention as ta

    with checks.small_splits(splits) if splits else contextlib.nullcontext():
        _graph_decode_check(checks, ta)


def _graph_decode_check(checks, ta) -> None:
    hq, hkv, d = QWEN3
    lens = [100, 200, 37, 1]
    q, k, v, cu = checks.make_inputs(lens, hq, hkv, d, torch.bfloat16, "cuda")
    cache = checks.PagedCache(lens, hkv, d, torch.bfloat16, "cuda", 16)
    starts = cu.tolist()
    for b in range(len(lens)):
        cache.write(b, 0, k[starts[b] : starts[b + 1]], v[starts[b] : starts[b + 1]])
    full = ta.attention_varlen(q, k, v, cu, d**-0.5)
    last = torch.tensor(starts[1:], device="cuda") - 1
    qd = q[last].clone()
    cuq = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    seqk = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def step():
        return ta.attention_paged(qd, cache.k, cache.v, cache.block_tables, cuq, seqk, d**-0.5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    assert torch.equal(out, full[last])
    # one step earlier for every sequence (length >= 2), updated in place
    earlier = torch.tensor([n - 2 if n > 1 else 0 for n in lens], device="cuda") + cu[:-1].long()
    qd.copy_(q[earlier])
    seqk.copy_(torch.tensor([max(n - 1, 1) for n in lens], dtype=torch.int32, device="cuda"))
    graph.replay()
    assert torch.equal(out, full[earlier])
