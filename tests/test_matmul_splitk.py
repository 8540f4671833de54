"""The K-split contract of the exact matmul (:mod:`rlexact.ops.triton_matmul`): fixed splits of ``SPLIT_K`` elements
anchored at ``k = 0``, each an fp32 chain from zero, merged in ascending split order -- in every kernel.

* CPU: the kernels run under the Triton interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before triton
  is imported): this file is also that script, ``TRITON_INTERPRET=1 python tests/test_matmul_splitk.py CHECK...``.
  Correctness against float64 for K below, at and past the split size; bitwise equality of the split-parallel decode
  kernel, the pointer kernel and the persistent TMA kernel (same K tile, the interpreter's dot rounds per K tile);
  the arrival counters back at zero after every launch; negative controls (the no-split chain gives other bits, and
  the bitwise check catches it).
* GPU (``@pytest.mark.gpu``): the split-parallel decode rows of the Qwen3-1.7B projections equal the same rows of a
  training-sized call through the library's own configurations, and a CUDA graph of the split path replays twice
  with the eager bits.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON


# ----------------------------------------------------------------------------------------------------------------------
# interpreter checks (run in a subprocess by the CPU tests below)
# ----------------------------------------------------------------------------------------------------------------------


def _interp_configs(tmm, bk: int) -> dict:  # noqa: ANN001
    """One configuration of each kernel with K tile ``bk`` (the interpreter's dot rounds per K tile, so only the K tile
    must agree; rows and columns per tile differ)."""
    return {
        "split": tmm.MatmulConfig("split", 16, 32, bk, 4, 1),
        "split_narrow": tmm.MatmulConfig("split", 32, 16, bk, 4, 1),
        "ptr": tmm.MatmulConfig("ptr", 16, 32, bk, 4, 1),
        "tma": tmm.MatmulConfig("tma", 32, 16, bk, 4, 1),
        "tma_subtile": tmm.MatmulConfig("tma", 16, 32, bk, 4, 1, subtile=True),
    }


def check_correct() -> None:
    """Every kernel against float64 for K < SPLIT_K, K = SPLIT_K and K = 3 * SPLIT_K + a tail, bf16 and fp32."""
    from rlexact.ops import triton_matmul as tmm

    split = tmm.SPLIT_K[torch.float32]
    assert split == tmm.SPLIT_K[torch.bfloat16] > 0, "the checks assume the default split"
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for k in (split // 4 + 8, split, 3 * split + 40):
            assert tmm.num_splits(k, dtype) == -(-k // split)
            x = torch.randn(7, k, generator=g).to(dtype)
            w = torch.randn(24, k, generator=g).to(dtype)
            ref = x.double() @ w.double().T
            scale = x.double().abs() @ w.double().abs().T
            for name, cfg in _interp_configs(tmm, 32).items():
                if dtype == torch.float32 and cfg.kernel == "tma":
                    continue  # fp32 never runs the TMA kernel
                y = tmm.matmul_with_config(x, w, cfg)
                assert y.dtype == dtype and y.shape == (7, 24)
                err = ((y.double() - ref).abs() / scale).max().item()
                tol = 1e-5 if dtype == torch.float32 else 2**-8 + 1e-5  # one bf16 rounding of the fp32 result
                assert err < tol, (name, dtype, k, err)
    print("correct ok")


def check_bitwise() -> None:
    """Rows of the split-parallel kernel at M = 1..max equal the same rows of a large-M call through the pointer and
    TMA kernels (bf16, as on Hopper; fp32 through the pointer kernels), K = 3 * SPLIT_K + a tail."""
    from rlexact.ops import triton_matmul as tmm

    split = tmm.SPLIT_K[torch.bfloat16]
    g = torch.Generator().manual_seed(1)
    k, n = 3 * split + 40, 40
    for dtype, kernels in ((torch.bfloat16, ("ptr", "tma", "tma_subtile")), (torch.float32, ("ptr",))):
        cfgs = _interp_configs(tmm, 32)
        w = torch.randn(n, k, generator=g).to(dtype)
        big = torch.randn(70, k, generator=g).to(dtype)
        refs = {name: tmm.matmul_with_config(big, w, cfgs[name]) for name in kernels}
        for name in kernels[1:]:
            assert torch.equal(refs[name], refs[kernels[0]]), f"{name} differs from {kernels[0]} ({dtype})"
        ref = refs[kernels[0]]
        for m in (1, 5, 17, 64):
            for start in (0, 70 - m):
                rows = big[start : start + m]
                for name in ("split", "split_narrow"):
                    got = tmm.matmul_with_config(rows, w, cfgs[name])
                    assert torch.equal(got, ref[start : start + m]), f"{name} M={m} at {start} ({dtype})"
    print("bitwise ok")


def check_counters() -> None:
    """Two consecutive split-parallel launches give identical bits and leave every arrival counter at zero; the plan
    keeps its counter slice; a changed input changes the output (negative control)."""
    from rlexact.ops import triton_matmul as tmm

    split = tmm.SPLIT_K[torch.bfloat16]
    g = torch.Generator().manual_seed(2)
    k = 2 * split + 16
    x, w = torch.randn(9, k, generator=g).bfloat16(), torch.randn(50, k, generator=g).bfloat16()
    cfg = tmm.MatmulConfig("split", 16, 32, 32, 4, 1)
    first = tmm.matmul_with_config(x, w, cfg)
    plan = tmm._plan(9, 50, k, torch.bfloat16, x.device, cfg)
    assert plan.grid == (2, 3) and plan.counters.numel() == 2 and plan.ws_numel == 3 * 9 * 50
    assert plan.counters.data_ptr() % 16 == 0
    assert torch.count_nonzero(plan.counters) == 0, "counters not reset by the first launch"
    second = tmm.matmul_with_config(x, w, cfg)
    assert torch.equal(first, second)
    assert tmm._plan(9, 50, k, torch.bfloat16, x.device, cfg).counters.data_ptr() == plan.counters.data_ptr()
    assert all(torch.count_nonzero(a[0]) == 0 for a in tmm._ARENAS.values())
    x2 = x.clone()
    x2[3, k - 5] += 1.0  # in the last split
    assert not torch.equal(tmm.matmul_with_config(x2, w, cfg)[3], first[3]), "negative control"
    # negative control of the reset check: a counter that starts non-zero (as without the reset) is not zero after
    # the launch (its tile merged early, at the wrong arrival), so the check above would catch a missing reset
    plan.counters[0] = 1
    tmm.matmul_with_config(x, w, cfg)
    assert plan.counters[0].item() == 1 and plan.counters[1].item() == 0, "negative control: stale counter"
    plan.counters.zero_()
    print("counters ok")


def cancel_inputs(k: int, split: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [1, k]``, ``w [n, k]`` (``k > 3 * split``) whose output column 0 is ``2 * split * 0.5 = split`` exactly with
    the split merge and ``0`` without it: ``x`` holds ``2**29`` at ``k = 0``, ``0.5`` over splits 1 and 2 and
    ``-2**29`` at the start of split 3, ``w[0]`` is all ones. A single chain rounds every small K-tile sum away
    against ``2**29`` (well below half its ulp) before the big terms cancel; the split chains keep them."""
    x = torch.zeros(1, k)
    x[0, 0] = 2.0**29
    x[0, split : 3 * split] = 0.5
    x[0, 3 * split] = -(2.0**29)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    w[0] = 1.0
    return x.to(dtype), w.to(dtype)


def check_negative() -> None:
    """The no-split chain (``SPLIT_K = 0``, the old contract) gives other bits than the split contract for K past the
    split size -- deterministically on :func:`cancel_inputs`, where only the split result is the exact answer -- so the
    bitwise checks can fail; for K within one split both are the same chain."""
    from rlexact.ops import triton_matmul as tmm

    split = tmm.SPLIT_K[torch.bfloat16]
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        short_x, short_w = torch.randn(8, split, generator=g).to(dtype), torch.randn(32, split, generator=g).to(dtype)
        x, w = cancel_inputs(3 * split + 40, split, 24, dtype)
        runs = {}
        for mode in ("split", "none"):
            saved = dict(tmm.SPLIT_K)
            if mode == "none":
                tmm.SPLIT_K[dtype] = 0
            try:
                runs[mode] = [
                    tmm.matmul_with_config(a, b, tmm.MatmulConfig(kernel, 16, 32, 32, 4, 1))
                    for kernel in ("ptr", "split")
                    for a, b in ((x, w), (short_x, short_w))
                ]
            finally:
                tmm.SPLIT_K.update(saved)
        (ptr, ptr_short, par, par_short), (ptr0, ptr0_short, par0, par0_short) = runs["split"], runs["none"]
        assert torch.equal(ptr, par) and torch.equal(ptr0, par0), "both kernels implement either contract"
        assert ptr[0, 0].item() == split and ptr0[0, 0].item() == 0, (ptr[0, 0].item(), ptr0[0, 0].item())
        assert not torch.equal(ptr, ptr0), "negative control: the split merge changed no bit"
        assert torch.equal(ptr_short, ptr0_short) and torch.equal(par_short, ptr0_short), "one split is the chain"
        assert torch.equal(par0_short, ptr0_short)
    print("negative ok")


CHECKS = {"correct": check_correct, "bitwise": check_bitwise, "counters": check_counters, "negative": check_negative}


# ----------------------------------------------------------------------------------------------------------------------
# CPU tests
# ----------------------------------------------------------------------------------------------------------------------


def _run_interp(*checks: str, split_env: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("RLEXACT_MATMUL_SPLIT_K", None)
    if split_env is not None:
        env["RLEXACT_MATMUL_SPLIT_K"] = split_env
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, str(HERE), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *checks], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_interpreter_split_contract() -> None:
    proc = _run_interp(*CHECKS)
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stdout}\n{proc.stderr}"
    for name in CHECKS:
        assert f"{name} ok" in proc.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_split_k_env_switch() -> None:
    """``RLEXACT_MATMUL_SPLIT_K`` sets the split of every dtype at import; a value that is not a multiple of
    ``SPLIT_K_MULTIPLE`` is refused with an error naming the fix."""
    code = (
        "import torch; from rlexact.ops import triton_matmul as t; "
        "print(sorted(set(t.SPLIT_K.values())), t.num_splits(5000, torch.bfloat16))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for value, want in (("0", "[0] 1"), ("512", "[512] 10"), (None, "[1024] 5")):
        run_env = dict(env)
        run_env.pop("RLEXACT_MATMUL_SPLIT_K", None)
        if value is not None:
            run_env["RLEXACT_MATMUL_SPLIT_K"] = value
        proc = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == want, (value, proc.stdout, proc.stderr)
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**env, "RLEXACT_MATMUL_SPLIT_K": "100"}, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "RLEXACT_MATMUL_SPLIT_K='100'" in proc.stderr


# ----------------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------------

QWEN_SHAPES = [(2048, 2048), (1024, 2048), (6144, 2048), (12288, 2048), (4096, 2048), (2048, 6144)]
"""(N, K) of the Qwen3-1.7B projections: q/o, k/v, gate/up, fused gate|up, fused q|k|v, down."""
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")


def _split_cfg(tmm, n: int, k: int) -> object:  # noqa: ANN001
    """The library's decode configuration, which must be the split-parallel kernel for these shapes on Hopper."""
    cfg = tmm.config_for(1, n, k, torch.bfloat16, torch.device("cuda"))
    if torch.cuda.get_device_capability()[0] >= 9 and tmm.num_splits(k, torch.bfloat16) > 1:
        assert cfg.kernel == "split", cfg
    return cfg


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("nk", QWEN_SHAPES)
def test_gpu_split_decode_equals_training_rows(nk: tuple[int, int]) -> None:
    """Rows at M = 1, 4, 16, 64 through ``matmul`` (the split-parallel decode variant) equal the same rows of an
    M = 4096 call (the persistent TMA training variant) bitwise, and the split kernel itself gives those bits."""
    from rlexact.ops import triton_matmul as tmm

    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    big = torch.randn(4096, k, device="cuda", generator=g).bfloat16()
    ref = tmm.matmul(big, w)
    assert tmm.config_for(4096, n, k, torch.bfloat16, big.device).kernel == "tma" or not tmm._tma_ok(
        n, k, torch.bfloat16, big.device
    )
    torch.testing.assert_close(ref.float(), (big.float() @ w.float().T), rtol=2e-2, atol=2e-2)
    cfg = _split_cfg(tmm, n, k)
    for m in (1, 4, 16, 64):
        for start in (0, 1000, 4096 - m):
            rows = big[start : start + m]
            assert torch.equal(tmm.matmul(rows, w), ref[start : start + m]), f"matmul M={m} at {start}"
            assert torch.equal(tmm.matmul_with_config(rows, w, cfg), ref[start : start + m]), f"{cfg} M={m}"
    if tmm.num_splits(k, torch.bfloat16) > 3:  # negative control: inputs where the no-split chain differs
        split = tmm.SPLIT_K[torch.bfloat16]
        cx, cw = (t.cuda() for t in cancel_inputs(k, split, n, torch.bfloat16))
        got = tmm.matmul(cx, cw)
        saved = dict(tmm.SPLIT_K)
        tmm.SPLIT_K[torch.bfloat16] = 0
        try:
            plain = tmm.matmul_with_config(cx, cw, tmm.static_config(n, k, torch.bfloat16, big.device))
        finally:
            tmm.SPLIT_K.update(saved)
        assert got[0, 0].item() == split and plain[0, 0].item() == 0, "negative control: the split merge shows"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("nk", [(2048, 2048), (2048, 6144)])
def test_gpu_split_decode_cuda_graph(nk: tuple[int, int]) -> None:
    """A CUDA graph of the split-parallel path replayed twice gives the eager bits both times (the counters are back
    at zero after every replay); a replay on new inputs gives their eager bits."""
    from rlexact.ops import triton_matmul as tmm

    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(12)
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    for m in (1, 4, 64):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        eager = tmm.matmul(x, w)  # creates the plan and its counters outside the capture
        plan = tmm._LAUNCHES[(m, n, k, torch.bfloat16, x.get_device())]
        assert plan.cfg.kernel == "split" or tmm.num_splits(k, torch.bfloat16) == 1
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tmm.matmul(static_x, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tmm.matmul(static_x, w)
        for _ in range(2):
            static_out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, eager), f"replay M={m}"
            if plan.counters is not None:
                assert torch.count_nonzero(plan.counters) == 0
        x2 = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        static_x.copy_(x2)
        graph.replay()
        assert torch.equal(static_out, tmm.matmul(x2, w)) and not torch.equal(static_out, eager)


# ----------------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from _interp_dot import use_row_invariant_interpreter_dot

    use_row_invariant_interpreter_dot()
    for check in sys.argv[1:] or list(CHECKS):
        CHECKS[check]()
