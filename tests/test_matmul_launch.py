"""The eager launch path of the exact matmul: no-grad fast path, ``MatmulFn.run``, leading dimensions, the cached
launchers of :mod:`rlexact.ops.triton_matmul` (direct C launch, Triton's runner, the warning fallback) and the
allocator install.

CPU tests run the torch backend, the Triton interpreter (subprocess) and the launchers against a stand-in compiled
kernel (``benchmarks/matmul_launch.py``'s, which repeats Triton 3.6's per-launch Python). GPU tests
(``@pytest.mark.gpu``) check the direct launcher on real kernels: bits, CUDA-graph capture, launch hooks.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from interpreter_jobs import failure_report
from rlexact import ops
from rlexact.ops.autograd import MatmulFn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _pair(seed: int, m: int = 37, n: int = 29, k: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / 4


# ----------------------------------------------------------------------------------------------------------------------
# ops layer (torch backend)
# ----------------------------------------------------------------------------------------------------------------------


def test_no_grad_fast_path_matches_function_path() -> None:
    """Without grad the op skips ``MatmulFn``: same bits, no graph; a different input gives different bits."""
    x, w = _pair(1)
    ref = MatmulFn.apply(x, w, "torch")
    out = ops.matmul(x, w)
    assert torch.equal(out, ref) and out.grad_fn is None and not out.requires_grad
    assert torch.equal(ops.linear(x.view(1, 37, 48), w), ref.view(1, 37, 29))
    xr = x.clone().requires_grad_()
    with torch.no_grad():
        y = ops.matmul(xr, w)
    assert torch.equal(y, ref) and y.grad_fn is None and not y.requires_grad
    x2 = x.clone()
    x2[5, 7] += 1.0
    assert not torch.equal(ops.matmul(x2, w), ref), "negative control: a changed input must change the output"


def test_grad_path_matches_apply() -> None:
    """``MatmulFn.run`` (used with grad) gives ``MatmulFn.apply``'s output and gradients bitwise, for x, w or both."""
    x, w = _pair(2)
    g = torch.randn(37, 29, generator=torch.Generator().manual_seed(3))
    for want in ((True, False), (False, True), (True, True)):
        res = []
        for fn in (MatmulFn.apply, lambda a, b, be: ops.matmul(a, b)):
            a, b = x.clone().requires_grad_(want[0]), w.clone().requires_grad_(want[1])
            y = fn(a, b, "torch")
            assert type(y.grad_fn).__name__ == "MatmulFnBackward"
            (y * g).sum().backward()
            res.append((y.detach(), a.grad, b.grad))
        (y0, ga0, gb0), (y1, ga1, gb1) = res
        assert torch.equal(y0, y1)
        for g0, g1 in ((ga0, ga1), (gb0, gb1)):
            assert (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1)), want
    xr = x.clone().requires_grad_()
    y = ops.matmul(xr, w)
    (y * g).sum().backward()
    assert not torch.equal(xr.grad, (g @ (w + 1e-3)).float()), "negative control: another weight, another grad"


def test_matmul_backward_leading_dims() -> None:
    """``MatmulFn.backward`` with ``x [B, S, K]`` (the Triton backend's ``linear``) runs the GEMMs of the ``[B*S, K]``
    view: the same gradients bitwise as the 2-D call."""
    x, w = _pair(4, m=24)
    g = torch.randn(24, 29, generator=torch.Generator().manual_seed(5))

    class Leading(torch.autograd.Function):  # MatmulFn's backward on a 3-D saved x (forward through the CPU twin)
        @staticmethod
        def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            ctx.save_for_backward(a, b)
            return ops.matmul(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[0])

        backward = MatmulFn.backward

    a3, b3 = x.view(2, 12, 48).clone().requires_grad_(), w.clone().requires_grad_()
    y3 = Leading.apply(a3, b3)
    (y3 * g.view(2, 12, 29)).sum().backward()
    a2, b2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    (MatmulFn.apply(a2, b2, "torch") * g).sum().backward()
    assert a3.grad.shape == (2, 12, 48)
    assert torch.equal(a3.grad.view(24, 48), a2.grad) and torch.equal(b3.grad, b2.grad)
    assert not torch.equal(b3.grad, b2.grad * 1.0001), "negative control"


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="does not match"):
        ops.matmul(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="does not match"):
        ops.linear(torch.randn(2, 3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        ops.matmul(torch.randn(2, 3, 4), torch.randn(5, 4))


@needs_triton
def test_triton_matmul_shape_errors() -> None:
    from rlexact.ops import triton_matmul as tmm

    with pytest.raises(ValueError, match="do not match"):
        tmm.matmul(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="do not match"):
        tmm.matmul(torch.randn(3, 4), torch.randn(4))


@needs_triton
def test_matmul_config_errors_name_the_fix() -> None:
    """A K split that does not fit the config is an error naming the rule, not a silently different chain."""
    from rlexact.ops import triton_matmul as tmm

    with pytest.raises(ValueError, match="multiple of BK"):
        tmm.MatmulConfig("tma", 128, 128, 64, 8, 4, KS=1000)
    with pytest.raises(ValueError, match="set for 'split'"):
        tmm.MatmulConfig("split", 16, 64, 128, 4, 4)
    with pytest.raises(ValueError, match="0 for 'ptr'"):
        tmm.MatmulConfig("ptr", 16, 64, 128, 4, 4, KS=1536)
    with pytest.raises(ValueError, match="unknown kernel"):
        tmm.MatmulConfig("cublas", 16, 64, 128, 4, 4)
    assert tmm.MatmulConfig("split", 16, 64, 128, 4, 4, KS=1536).KS == 1536


@needs_triton
def test_split_keys_only_for_narrow_k_heavy_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """K splits are a function of (N, K, dtype, SM count) on TMA devices: K-heavy shapes split only where their
    16-column tiles are too few for the SMs (the Qwen3-1.7B down projection on a 132-SM GPU does not, on a 148-SM
    one it does); the K = 2,048 projections and fp32 never split, and without row-tile variants nothing splits (one
    static chain for every M)."""
    from rlexact.ops import triton_matmul as tmm

    bf16 = torch.bfloat16
    assert tmm.split_keys(1024, 4096, bf16, tma=True, sms=132) == tmm.SPLIT_K_KEYS
    assert tmm.split_keys(1024, 8192, torch.float16, tma=True, sms=132) == tmm.SPLIT_K_KEYS
    assert tmm.split_keys(2048, 6144, bf16, tma=True, sms=148) == tmm.SPLIT_K_KEYS
    assert tmm.split_keys(2048, 6144, bf16, tma=True, sms=132) == 0
    assert tmm.split_keys(4096, 12288, bf16, tma=True, sms=132) == 0
    for n, k in ((4096, 2048), (2048, 2048), (12288, 2048), (6144, 2048), (4096, 6144), (1024, 3072)):
        assert tmm.split_keys(n, k, bf16, tma=True, sms=148) == 0, (n, k)
    assert tmm.split_keys(1024, 4096, torch.float32, tma=True, sms=132) == 0
    assert tmm.split_keys(1024, 4096, bf16, tma=False, sms=132) == 0
    # every M of a split shape splits at the same columns: all its row-tile variants carry the static KS
    monkeypatch.setattr(tmm, "cuda_props", lambda idx: (9, 132))
    variants = tmm._variants(1024, 4096, bf16, ("cuda", 0), True)
    assert {cfg.KS for _, cfg in variants} == {tmm.SPLIT_K_KEYS}
    assert [cfg.kernel for _, cfg in variants[:2]] == ["split", "split"] and variants[-1][0] is None
    # a K-heavy shape without splits: one chain at every M, narrow column tiles at decode row counts
    unsplit = tmm._variants(2048, 6144, bf16, ("cuda", 0), True)
    assert {cfg.KS for _, cfg in unsplit} == {0} and unsplit[0][1].BN == tmm.NARROW_BN
    monkeypatch.setattr(tmm, "USE_ROW_TILE_VARIANTS", False)
    assert tmm.split_keys(1024, 4096, bf16, tma=True, sms=132) == 0
    tmm._variants.cache_clear()  # drop the entries built on the stand-in device properties
    tmm._static_config.cache_clear()


@needs_triton
def test_warp_specialized_tile_that_fails_to_compile_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile asking for warp specialization that fails to compile runs without it and says so (its bits may differ);
    a failure without warp specialization is raised as it is."""
    from rlexact.ops import triton_matmul as tmm

    calls: list[bool] = []

    class FakeKernel:
        """A kernel stand-in whose launches with ``WS`` (or every launch, with ``always``) fail to compile."""

        def __init__(self, always: bool) -> None:
            self.always = always

        def __getitem__(self, grid: tuple) -> object:
            def run(*args: object, **kwargs: object) -> object:
                calls.append(bool(kwargs["WS"]))
                if kwargs["WS"] or self.always:
                    raise RuntimeError("compilation failed")
                return object()

            return run

    monkeypatch.setattr(tmm, "_WS_BROKEN", set())
    cfg = tmm.MatmulConfig("ptr", 64, 64, 64, 4, 3, warp_specialize=True)
    x, w, out = torch.zeros(4, 64), torch.zeros(64, 64), torch.zeros(4, 64)
    with pytest.warns(UserWarning, match="failed to compile with warp specialization"):
        tmm._launch_kernel(tmm._Launch(cfg, FakeKernel(False), (1,), {"WS": True}, {}, (4, 64, 64), 0), x, w, out)
    assert calls == [True, False] and cfg in tmm._WS_BROKEN
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="compilation failed"):
            tmm._launch_kernel(tmm._Launch(cfg, FakeKernel(True), (1,), {"WS": False}, {}, (4, 64, 64), 0), x, w, out)


INTERP = r"""
import torch
from rlexact import ops
from rlexact.ops.autograd import MatmulFn
g = torch.Generator().manual_seed(0)
x, w = torch.randn(2, 9, 40, generator=g), torch.randn(24, 40, generator=g) / 4
gy = torch.randn(2, 9, 24, generator=g)
for leading in (True, False):
    res = []
    for grad in (False, True):
        a, b = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        y = ops.linear(a if leading else a.view(18, 40), b, backend="triton")
        assert (y.grad_fn is not None) == grad
        if grad:
            (y.reshape(2, 9, 24) * gy).sum().backward()
        res.append((y.detach().reshape(2, 9, 24), a.grad, b.grad))
    assert torch.equal(res[0][0], res[1][0]), "no-grad and grad forward differ"
    if leading:
        lead = res
    else:
        flat = res
assert torch.equal(lead[0][0], flat[0][0]), "[B, S, K] and [B*S, K] forward differ"
assert torch.equal(lead[1][1], flat[1][1]) and torch.equal(lead[1][2], flat[1][2]), "gradients differ"
x2 = x.clone()
x2[1, 3, 5] += 1.0
assert not torch.equal(ops.linear(x2, w, backend="triton"), lead[0][0]), "negative control"
print("launch ok")
"""


@pytest.mark.interpreter("-c", INTERP)
def test_interpreter_linear_leading_dims_and_grad(interpreter_run: subprocess.CompletedProcess) -> None:
    """Triton backend (interpreter): ``linear`` on ``[B, S, K]`` (no views, the kernel takes leading dimensions) gives
    the ``[B*S, K]`` bits; the no-grad fast path and the ``MatmulFn.run`` path give the same forward bits; the
    gradients of both layouts are equal."""
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert "launch ok" in interpreter_run.stdout


# ----------------------------------------------------------------------------------------------------------------------
# launchers against the stand-in compiled kernel
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """``(tmm, bench module, plan, x, w)`` with the CPU stand-ins of ``benchmarks/matmul_launch.py --host-only``."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import matmul_launch as ml
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from rlexact.ops import triton_matmul as tmm

    monkeypatch.setattr(tmm, "cuda_queries", lambda: (ml._stub_device, ml._stub_stream, ml._stub_capturing))
    monkeypatch.setattr(tmm, "direct_launch_ok", lambda launcher: True)
    monkeypatch.setattr(torch.cuda, "current_device", ml._stub_device)
    monkeypatch.setattr(tmm, "_RUNNER_BROKEN", [False])
    monkeypatch.setattr(tmm, "_INTERPRET", False)
    scratch = torch.empty(1 << 16, dtype=torch.int8)
    monkeypatch.setattr(tmm, "_scratch", lambda size, device, stream: scratch)
    m, n, k = 300, 64, 96
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    cfg = tmm.MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4)
    plan = tmm._plan(m, n, k, torch.bfloat16, x.device, cfg)
    return tmm, ml, plan, x, w, scratch


def _record(compiled) -> list:  # noqa: ANN001
    calls = []
    compiled.run.launch = lambda *a: calls.append(a)
    return calls


def test_direct_runner_arguments(stub) -> None:  # noqa: ANN001
    """The direct launcher passes Triton 3.6's C ``launch`` the grid, stream, function, scratch, metadata, no hooks,
    the pointers as integers and the integer + constexpr arguments in the kernel's order; the scratch buffer of a
    stream is reused."""
    tmm, ml, plan, x, w, scratch = stub
    compiled = ml._StubCompiled()
    calls = _record(compiled)
    out = torch.empty(300, 64, dtype=torch.bfloat16)
    tmm._keep_runner(plan, compiled, x, w, out)
    assert plan.runner.__qualname__.startswith("_direct_runner")
    for _ in range(2):
        tmm._launch(plan, x, w, out)
    assert len(calls) == 2 and calls[0] == calls[1]
    a = calls[0]
    names = list(plan.kernel.arg_names)
    constexprs = tuple(plan.constexprs[nm] for nm in names[6:])
    assert a[:5] == (plan.grid[0], 1, 1, 0, compiled.function)
    assert a[7] is scratch and a[8] is None and a[9] == compiled.packed_metadata and a[10:13] == (None, None, None)
    assert a[13:16] == (x.data_ptr(), w.data_ptr(), out.data_ptr())
    assert a[16:] == (300, 64, 96, *constexprs) and len(names) == len(a) - 13


def test_direct_runner_capture_scratch(stub, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """During CUDA-graph capture every launch asks :func:`_scratch` (the graph pool), never the cached buffer."""
    tmm, ml, plan, x, w, scratch = stub
    asked = []
    monkeypatch.setattr(tmm, "_scratch", lambda size, device, stream: asked.append(size) or scratch)
    capturing = [False]
    monkeypatch.setattr(tmm, "cuda_queries", lambda: (ml._stub_device, ml._stub_stream, lambda: capturing[0]))
    compiled = ml._StubCompiled()
    _record(compiled)
    out = torch.empty(300, 64, dtype=torch.bfloat16)
    tmm._keep_runner(plan, compiled, x, w, out)
    tmm._launch(plan, x, w, out)
    tmm._launch(plan, x, w, out)
    assert len(asked) == 1, "eager launches on one stream reuse the buffer"
    capturing[0] = True
    tmm._launch(plan, x, w, out)
    tmm._launch(plan, x, w, out)
    assert len(asked) == 3 and asked[-1] == plan.grid[0] * 384


def test_direct_runner_defers_to_hooks(stub) -> None:  # noqa: ANN001
    """With a launch hook installed the launch goes through Triton's runner, so the hook sees it."""
    import triton

    tmm, ml, plan, x, w, _ = stub
    seen = []
    compiled = ml._StubCompiled()
    calls = _record(compiled)

    def launch(*a: object) -> None:
        calls.append(a)
        if a[11] is not None:
            a[11](a[10])

    compiled.run.launch = launch
    out = torch.empty(300, 64, dtype=torch.bfloat16)
    tmm._keep_runner(plan, compiled, x, w, out)
    hook = seen.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        tmm._launch(plan, x, w, out)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1 and calls[0][11] is not None
    tmm._launch(plan, x, w, out)
    assert len(seen) == 1 and calls[1][11] is None, "without hooks the direct launch passes none"


def test_runner_failure_warns_and_falls_back(stub) -> None:  # noqa: ANN001
    """A cached launcher that rejects its arguments (another Triton's API) warns once and the JIT dispatch runs."""
    tmm, ml, plan, x, w, _ = stub
    dispatched = []

    class Kernel:
        arg_names = plan.kernel.arg_names

        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *a, **kw: dispatched.append(grid)

    def broken(*a: object) -> bool:
        raise TypeError("launch() takes 12 positional arguments")

    plan.kernel, plan.runner = Kernel(), broken
    out = torch.empty(300, 64, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="cached Triton launcher unusable"):
        tmm._launch(plan, x, w, out)
    assert dispatched == [plan.grid] and tmm._RUNNER_BROKEN[0] and plan.runner is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tmm._launch(plan, x, w, out)
    assert dispatched == [plan.grid, plan.grid]


def test_direct_runner_other_device(stub) -> None:  # noqa: ANN001
    """When the current device is not the plan's, the runner declines (the JIT dispatch decides)."""
    tmm, ml, plan, x, w, _ = stub
    compiled = ml._StubCompiled()
    calls = _record(compiled)
    out = torch.empty(300, 64, dtype=torch.bfloat16)
    runner = tmm._direct_runner(3, compiled, (plan.grid[0], 1, 1), ())
    assert runner(x, w, out, x.data_ptr(), w.data_ptr(), out.data_ptr()) is False and not calls


@needs_triton
def test_direct_layout_rejects_unknown_launchers() -> None:
    from rlexact.ops import triton_matmul as tmm

    assert not tmm.direct_launch_ok(object())


@needs_triton
def test_allocator_installed_once_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`ensure_allocator` installs the torch allocator once in a thread without one and never replaces an
    allocator the user set."""
    import triton
    from triton.runtime import _allocation

    from rlexact.ops import triton_matmul as tmm

    installs = []
    real = triton.set_allocator
    monkeypatch.setattr(triton, "set_allocator", lambda a: installs.append(a) or real(a))
    found = {}

    def fresh_thread() -> None:
        tmm.ensure_allocator()
        tmm.ensure_allocator()
        found["fresh"] = _allocation._allocator.get()

    def user_thread() -> None:
        def mine(size: int, align: int, stream: object) -> torch.Tensor:
            return torch.empty(size, dtype=torch.int8)

        real(mine)
        tmm.ensure_allocator()
        found["user"] = _allocation._allocator.get() is mine

    for target in (fresh_thread, user_thread):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert installs == [tmm._torch_alloc] and found["fresh"] is tmm._torch_alloc and found["user"]


# ----------------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("nk", [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (1000, 1000)])
def test_gpu_direct_launch_bitwise_and_graph(nk: tuple[int, int]) -> None:
    """The cached launcher (direct on Triton 3.6) gives the JIT-dispatched bits eagerly, on a side stream and in a
    CUDA graph; ``linear`` on ``[B, S, K]`` gives the ``[B*S, K]`` bits; the grad path gives the no-grad bits."""
    from rlexact.ops import triton_matmul as tm

    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(9)
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    for m in (64, 200, 1024, 4096):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        ref = tm.matmul_with_config(x, w, tm.config_for(m, n, k, torch.bfloat16, x.device))
        first, second = tm.matmul(x, w), tm.matmul(x, w)
        plan = tm._LAUNCHES[(m, n, k, torch.bfloat16, x.get_device())]
        assert plan.runner is not None and not tm._RUNNER_BROKEN[0]
        assert torch.equal(first, ref) and torch.equal(second, ref)
        assert torch.equal(ops.linear(x.view(2, m // 2, k) if m % 2 == 0 else x, w).reshape(m, n), ref)
        xg = x.clone().requires_grad_()
        assert torch.equal(ops.linear(xg, w).detach(), ref)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_side = tm.matmul(x, w)
        side.synchronize()
        assert torch.equal(on_side, ref)
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tm.matmul(static_x, w)
        x2 = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        static_x.copy_(x2)
        graph.replay()
        assert torch.equal(static_out, tm.matmul_with_config(x2, w, tm.config_for(m, n, k, torch.bfloat16, x.device)))
        assert not torch.equal(static_out, ref), "negative control: the replay read the new input"


@pytest.mark.gpu
def test_gpu_launch_hook_sees_direct_launches() -> None:
    """A Triton launch hook installed after the launcher was cached still sees every matmul launch."""
    import triton

    x = torch.randn(1024, 2048, device="cuda").bfloat16()
    w = torch.randn(2048, 2048, device="cuda").bfloat16()
    ref = ops.matmul(x, w)
    seen = []
    hook = seen.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = ops.matmul(x, w)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1 and torch.equal(out, ref)
