"""Programmatic dependent launch (``rlexact.ops.triton_pdl``): when it is on, every PDL kernel waits for its
predecessor before its first memory access and only then releases its successor (generated code, CPU), and it
changes no bit (GPU)."""

from __future__ import annotations

import importlib.util
import itertools
import re

import pytest
import torch

from rlexact.ops.triton_pdl import pdl_options, pdl_supported

HAS_NVIDIA_BACKEND = importlib.util.find_spec("triton") is not None and (
    importlib.util.find_spec("triton.backends.nvidia") is not None
)


def test_pdl_off_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLEXACT_PDL", "1")
    assert dict(pdl_options(torch.device("cpu"))) == {"PDL": False}
    assert not pdl_supported(torch.device("cpu"))
    with pytest.raises(TypeError):
        pdl_options(torch.device("cpu"))["PDL"] = True  # shared, read-only


def _first_global_access(ptx: str) -> int:
    hits = [m.start() for m in re.finditer(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)", ptx)]
    return min(hits) if hits else len(ptx)


def _check_order(kernel, args: dict, const: dict, **options: object) -> None:  # noqa: ANN001
    from hopper_compile import compile_for_hopper

    on = compile_for_hopper(kernel, args, {**const, "PDL": True}, launch_pdl=True, **options)
    ptx = on.asm["ptx"]
    assert on.metadata.launch_pdl, "compiled without the PDL launch attribute"
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < release and wait < _first_global_access(ptx), f"{kernel.fn.__name__}: wait is not first"
    off = compile_for_hopper(kernel, args, {**const, "PDL": False}, **options)
    assert "griddepcontrol" not in off.asm["ptx"] and not off.metadata.launch_pdl  # negative control


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="needs triton's CUDA backend")
def test_pdl_kernels_wait_before_memory() -> None:
    """Compiled for sm_90 on the host: each decode-path kernel with ``PDL`` waits for the previous kernel before its
    first global load or store (the device-descriptor matmul before it writes its descriptor scratch, which the
    previous launch may still read) and releases the next launch after that wait; without ``PDL`` there is no grid
    dependency control at all."""
    import triton.language as tl

    from rlexact.ops import triton_kv, triton_matmul, triton_norm, triton_rope

    p, i = "*bf16", "i32"
    mm = dict(BM=128, BN=128, BK=64, GROUP_M=8, NUM_PROGS=132, WS=False, SUBTILE=False, OUT_DTYPE=tl.bfloat16,
              UPCAST=False, RNE_FIX=False, DEV_DESC=True, KS=0, GATED=0, GELU=False)  # fmt: skip
    tma = dict(x_desc=p, w_desc=p, o_desc=p, M=i, N=i, K=i)
    _check_order(triton_matmul._mm_tma_kernel, tma, mm, num_warps=8)
    _check_order(triton_matmul._mm_tma_kernel, tma, mm | dict(BM=64, BN=64, BK=128, KS=1536), num_warps=4)
    for gated, gelu in itertools.product((1, 2), (False, True)):  # gated: two dots, or one joint [2, BN, BK] block
        _check_order(triton_matmul._mm_tma_kernel, tma, mm | dict(GATED=gated, GELU=gelu), num_warps=8)
    split = dict(x_ptr=p, w_ptr=p, ws_ptr="*fp32", M=i, N=i, K=i)
    const = dict(BM=16, BN=64, BK=128, KS=1536, UPCAST=False)
    _check_order(triton_matmul._mm_split_kernel, split, const, num_warps=4, num_stages=4)
    const = dict(BLOCK=1024, RNE_FIX=False)
    _check_order(triton_matmul._split_sum_kernel, dict(ws_ptr="*fp32", o_ptr=p, numel=i, splits=i), const)
    ptr = dict(x_ptr=p, w_ptr=p, o_ptr=p, M=i, N=i, K=i, stride_xm=i, stride_wn=i, stride_om=i)
    const = dict(BM=16, BN=16, BK=128, GROUP_M=8, UPCAST=False, IEEE=False, RNE_FIX=False)
    for gated, gelu in ((False, False), (True, False), (True, True)):
        _check_order(triton_matmul._mm_ptr_kernel, ptr, const | dict(GATED=gated, GELU=gelu), num_warps=4,
                     num_stages=4)  # fmt: skip
    norm = dict(x_ptr=p, r_ptr=p, w_ptr=p, o_ptr=p, s_ptr=p, xw_ptr=p, H=i, H_f="fp32", stride_x=i, stride_r=i,
                stride_o=i, stride_s=i, eps="fp32", x_eps="fp32")  # fmt: skip
    const = dict(BLOCK=2048, SINGLE=True, HAS_RES=True, X_NORM=False, X_DTYPE=tl.bfloat16, O_DTYPE=tl.bfloat16,
                 RNE_X=False, RNE_O=False)  # fmt: skip
    for round_normed, offset in ((True, False), (False, False), (False, True)):
        kind = dict(ROUND_NORMED=round_normed, OFFSET=offset)
        _check_order(triton_norm._rms_norm_kernel, norm, const | kind, num_warps=4)
    gemma = dict(ROUND_NORMED=False, OFFSET=True, X_NORM=True)  # the branch norm, add and norm of Gemma 3's layers
    _check_order(triton_norm._rms_norm_kernel, norm, const | gemma, num_warps=4)
    kv = dict(k_ptr=p, v_ptr=p, kc_ptr=p, vc_ptr=p, slot_ptr="*i64", block_size=i, HKV=i, D=i,
              **dict.fromkeys(["s_kt", "s_kh", "s_kd", "s_vt", "s_vh", "s_vd"], i),
              **dict.fromkeys(["c_kb", "c_ko", "c_kh", "c_kd", "c_vb", "c_vo", "c_vh", "c_vd"], i))  # fmt: skip
    const = dict(BLOCK_H=8, BLOCK_D=128, CAST=False, C_DTYPE=tl.bfloat16, RNE=False)
    _check_order(triton_kv._write_kv_kernel, kv, const, num_warps=4)
    rope = dict(**dict.fromkeys(["q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "qw_ptr", "kw_ptr", "c_ptr", "s_ptr"], p),
                stride_q=i, stride_k=i, HQ=i, HKV=i, HALF=i, eps="fp32", D_f="fp32", v_ptr=p, kc_ptr=p, vc_ptr=p,
                slot_ptr="*i64", block_size=i,
                **dict.fromkeys(["s_vt", "s_vh", "c_kb", "c_ko", "c_kh", "c_vb", "c_vo", "c_vh"], i))  # fmt: skip
    const = dict(BHQ=4, BHK=1, BHALF=128, NORM=True, DTYPE=tl.bfloat16, RNE=False, WRITE_KV=True)
    for round_normed, offset in ((True, False), (False, True)):  # Qwen3's q/k norm, Gemma 3's
        kind = dict(ROUND_NORMED=round_normed, OFFSET=offset)
        _check_order(triton_rope._qk_norm_rope_kernel, rope, const | kind, num_warps=4)


# ----------------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_pdl_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same generation (CUDA graphs, overlapped decode, split-KV decode past one split) and the same training
    log-probs and eager matmul chain with PDL on and off: bitwise equal, and equal to the trainer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("RLEXACT_PDL", "1")
    if not pdl_supported(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("PDL needs compute capability 9.0+ and a Triton with grid dependency control")
    import rlexact
    from models import prompts_for, tiny_model
    from rlexact.ops import triton_matmul
    from rlexact.rollout import Generator, SamplingParams
    from test_rollout_gpu import assert_exact, same

    model = tiny_model("qwen3", vocab=1003, hidden=256, layers=3, heads=4, kv_heads=2, head_dim=128, intermediate=704,
                       max_pos=2048, tie_embeddings=True, random_norms=False, weight_scale=3.0)  # fmt: skip
    model = rlexact.exactify(model.to(device="cuda", dtype=torch.bfloat16))
    prompts = prompts_for(24, 1003, lo=5, hi=1100, seed=5)
    params = SamplingParams(max_new_tokens=32, seed=3, n=2)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2048, 2048, device="cuda", generator=g).bfloat16()
    x = torch.randn(1024, 2048, device="cuda", generator=g).bfloat16()

    def run() -> tuple:
        triton_matmul._LAUNCHES.clear()  # launch plans keep the PDL choice of when they were made
        y = x
        for _ in range(8):
            y = triton_matmul.matmul(y, w) * 0.02
        outs = Generator(model, max_num_seqs=48, block_size=16).generate(prompts, params)
        return outs, y

    outs_on, y_on = run()
    monkeypatch.setenv("RLEXACT_PDL", "0")
    assert not pdl_supported(torch.device("cuda", torch.cuda.current_device()))
    outs_off, y_off = run()
    assert torch.equal(y_on, y_off)
    assert same(outs_on, outs_off)
    assert_exact(model, outs_on)
