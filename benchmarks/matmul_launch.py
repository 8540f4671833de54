"""Host overhead of eager exact-matmul launches; writes ``benchmarks/results/matmul_launch_h200.json``.

    python benchmarks/matmul_launch.py [--out PATH]          # on a GPU
    python benchmarks/matmul_launch.py --host-only [--out PATH]  # on CPU, launch stubbed

GPU mode (bf16 Qwen3-1.7B projections qkv / o / gate_up / down):

* ``eager_vs_graph``: per projection at M = 1,024 and 4,096, :func:`rlexact.ops.linear` called eagerly back to back
  (``eager_us``, no grad, and ``eager_grad_us`` with ``x.requires_grad`` as in the trainer; ``common.bench_stream``)
  vs the same calls replayed from a CUDA graph (``graph_us``, ``common.bench_graph``), ``torch.mm`` called the same
  eager way, ``graph_over_eager`` (1.0 = no visible host or launch overhead), ``target_met`` (eager within 10% of
  graph: ``eager_us <= 1.1 * graph_us``; ``target_met_grad`` the same for the grad path) and the host microseconds
  per call (300 calls without synchronization, GPU queue not full). Both timings run calls back to back with no
  cache flush, so they differ only in who launches. ``eager_flushed_us`` / ``torch_mm_flushed_us`` are one call at a
  time after the L2 cache was overwritten (``triton.testing.do_bench``, how earlier versions of this script timed
  the eager side): they show what cold inputs cost, which is not launch overhead.
* ``host_us``: host microseconds per call of each layer of the call stack for the o-projection at M = 1,024.
* ``cprofile``: the functions with the most own time over 300 calls of ``ops.linear`` (no grad, and grad).

``--host-only`` times the same Python layers on CPU tensors with the kernel launch stubbed: the compiled kernel is
a stand-in whose ``CompiledKernel[grid]`` runner and ``CudaLauncher.__call__`` repeat Triton 3.6's per-launch Python
(stream query, launch metadata, scratch allocation through the thread's allocator, launch hooks) and whose C
``launch`` is a no-op; torch's CUDA device/stream/capture queries are constants. It writes
``benchmarks/results/matmul_launch_host_cpu.json``. The real C launch (argument parsing, ``cuLaunchKernel``) and
the CUDA caching allocator are not in these numbers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from common import bench, bench_graph, bench_stream, header, host_profile, launch_cli

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}
TARGET = 1.10
"""Eager time at most this multiple of the CUDA-graph replay time."""


def host_us(fn: Callable[[], object], calls: int = 300, sync: Callable[[], None] = torch.cuda.synchronize) -> float:
    """Host microseconds per call of ``fn`` (no synchronization inside the loop; the best of 5 rounds)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        sync()
    return best / calls * 1e6


def runner_tail(tmm, plan) -> tuple:  # noqa: ANN001
    """The integer and constexpr arguments a cached launcher of ``plan`` passes after the three tensors."""
    names = list(plan.kernel.arg_names)[3 + len(plan.ints) :]
    return (*plan.ints, *(plan.constexprs[n] for n in names))


def layers(tmm, plan, compiled, x: torch.Tensor, w: torch.Tensor, backend: str | None) -> dict:  # noqa: ANN001
    """Callables for each layer of the call stack of the o-projection at M = 1,024."""
    from rlexact import ops

    m, k = x.shape
    n = w.shape[0]
    xg = x.detach().clone().requires_grad_()
    x3, x3g = x.view(1, m, k), xg.view(1, m, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid, tail = (*plan.grid, 1, 1)[:3], runner_tail(tmm, plan)
    direct = tmm._direct_runner(plan.device, compiled, grid, tail)
    triton_runner = tmm._triton_runner(plan.device, compiled, grid, tail)
    ptrs = (x.data_ptr(), w.data_ptr(), out.data_ptr())
    fns = {
        "ops.linear [1, M, K] x": lambda: ops.linear(x3, w, backend=backend),
        "ops.linear [1, M, K] x, requires grad": lambda: ops.linear(x3g, w, backend=backend),
        "ops.linear": lambda: ops.linear(x, w, backend=backend),
        "ops.matmul": lambda: ops.matmul(x, w, backend=backend),
        "ops.matmul, requires grad": lambda: ops.matmul(xg, w, backend=backend),
        "triton_matmul.matmul": lambda: tmm.matmul(x, w),
        "triton_matmul._launch": lambda: tmm._launch(plan, x, w, out),
        "Triton runner (CompiledKernel[grid])": lambda: triton_runner(x, w, out, *ptrs),
        "torch.empty(out)": lambda: torch.empty((m, n), dtype=x.dtype, device=x.device),
    }
    if direct is not None:
        fns["direct runner"] = lambda: direct(x, w, out, *ptrs)
    return fns


def gpu() -> dict:
    from rlexact import ops
    from rlexact.ops import triton_matmul as tmm
    from rlexact.ops.triton_shared import COMPILE_OPTIONS

    res = header("matmul_launch", "triton")
    res["target"] = f"eager_us <= {TARGET} * graph_us"
    res["timing"] = (
        "eager_us: median per call of 200 back-to-back eager calls between two CUDA events; graph_us: the same calls "
        "replayed from a CUDA graph (do_bench_cudagraph); neither flushes the cache. *_flushed_us: do_bench, one call "
        "per timing after overwriting the L2 cache"
    )
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xg = x.clone().requires_grad_()
            eager = bench_stream(lambda x=x, w=w: ops.linear(x, w)) * 1e3
            eager_grad = bench_stream(lambda x=xg, w=w: ops.linear(x, w)) * 1e3
            graph = bench_graph(lambda x=x, w=w: ops.linear(x, w)) * 1e3
            rows.append(
                dict(
                    name=name, M=m, N=n, K=k, eager_us=eager, eager_grad_us=eager_grad, graph_us=graph,
                    graph_over_eager=graph / eager, graph_over_eager_grad=graph / eager_grad,
                    target_met=eager <= TARGET * graph, target_met_grad=eager_grad <= TARGET * graph,
                    torch_mm_us=bench_stream(lambda x=x, w=w: torch.mm(x, w.T)) * 1e3,
                    eager_flushed_us=bench(lambda x=x, w=w: ops.linear(x, w)) * 1e3,
                    torch_mm_flushed_us=bench(lambda x=x, w=w: torch.mm(x, w.T)) * 1e3,
                    host_us=host_us(lambda x=x, w=w: ops.linear(x, w)),
                    host_us_grad=host_us(lambda x=xg, w=w: ops.linear(x, w)),
                    config=repr(tmm.config_for(m, n, k, torch.bfloat16, x.device)),
                )
            )  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    res["eager_vs_graph"] = rows
    res["all_targets_met"] = all(r["target_met"] for r in rows)

    n, k = SHAPES["o"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, k, device="cuda", dtype=torch.bfloat16)
    tmm.matmul(x, w)
    plan = tmm._LAUNCHES[(1024, n, k, torch.bfloat16, x.get_device())]
    out = torch.empty((1024, n), dtype=x.dtype, device=x.device)
    tmm.ensure_allocator()
    compiled = plan.kernel[plan.grid](x, w, out, *plan.ints, **plan.constexprs, **plan.options, **COMPILE_OPTIONS)
    fns = layers(tmm, plan, compiled, x, w, None)
    fns["torch.mm"] = lambda: torch.mm(x, w.T)
    res["launcher"] = "direct" if "direct runner" in fns else "Triton runner"
    res["host_us"] = {name: host_us(fn) for name, fn in fns.items()}
    print(json.dumps(res["host_us"], indent=1), flush=True)
    xg = x.clone().requires_grad_()
    res["cprofile"] = host_profile(lambda: ops.linear(x, w), top=15)
    res["cprofile_grad"] = host_profile(lambda: ops.linear(xg, w), top=15)
    torch.cuda.synchronize()
    print(*res["cprofile"][:10], sep="\n", flush=True)
    return res


class _StubLauncher:
    """Triton 3.6 ``CudaLauncher.__call__``'s Python, with a no-op C ``launch`` that calls the hooks as C does."""

    num_ctas, global_scratch_size, global_scratch_align = 1, 384, 128
    profile_scratch_size, profile_scratch_align, launch_cooperative_grid, launch_pdl = 0, 1, False, False

    def __init__(self) -> None:
        self.launch = self._c_launch

    @staticmethod
    def _c_launch(*a: object) -> None:
        if a[11] is not None:
            a[11](a[10])
        if a[12] is not None:
            a[12](a[10])

    def __call__(self, gridX, gridY, gridZ, stream, function, *args) -> None:  # noqa: ANN001, N803
        from triton.runtime import _allocation

        def allocate_scratch(size, align, allocator):  # noqa: ANN001, ANN202
            if size > 0:
                return allocator.get()(gridX * gridY * gridZ * self.num_ctas * size, align, stream)
            return None

        global_scratch = allocate_scratch(self.global_scratch_size, self.global_scratch_align, _allocation._allocator)
        profile_scratch = allocate_scratch(
            self.profile_scratch_size, self.profile_scratch_align, _allocation._profile_allocator
        )
        self.launch(
            gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, global_scratch,
            profile_scratch, *args,
        )  # fmt: skip


class _StubCompiled:
    """Triton 3.6 ``CompiledKernel``'s launch path (``__getitem__`` runner, ``launch_metadata``, ``run``)."""

    function, packed_metadata, name = 1, (8, 1, 1024), "stub"

    def __init__(self) -> None:
        self.run = _StubLauncher()

    def launch_metadata(self, grid, stream, *args):  # noqa: ANN001, ANN201
        import triton
        from triton.compiler.compiler import LazyDict

        if triton.knobs.runtime.launch_enter_hook is None:
            return None
        return LazyDict({"name": self.name, "function": self.function, "stream": stream})

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        import triton

        knobs = triton.knobs

        def runner(*args, stream=None):  # noqa: ANN001, ANN202
            if stream is None:
                stream = _stub_stream(_stub_device())
            launch_metadata = self.launch_metadata(grid, stream, *args)
            self.run(
                grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata,
                knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args,
            )  # fmt: skip

        return runner


def _stub_device() -> int:
    return -1


def _stub_stream(device: int) -> int:
    return 0


def _stub_capturing() -> bool:
    return False


def host_only() -> dict:
    import rlexact.ops
    from rlexact.ops import triton_matmul as tmm

    # CPU stand-ins: the CPU build of torch has no CUDA queries, the installed Triton is not 3.6, and a CPU tensor
    # would resolve to the torch backend.
    torch.cuda.is_current_stream_capturing = _stub_capturing
    torch.cuda.current_device = _stub_device
    tmm.cuda_queries = lambda: (_stub_device, _stub_stream, _stub_capturing)
    tmm.direct_launch_ok = lambda launcher: True
    rlexact.ops.resolve_backend = lambda t, backend: backend
    tmm._SCRATCH[(-1, 0)] = torch.empty(1 << 16, dtype=torch.int8)

    res = header("matmul_launch_host", "triton")
    res["launch_stubbed"] = True
    n, k = SHAPES["o"]
    m = 1024
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    cfg = tmm.MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4)
    plan = tmm._LAUNCHES[(m, n, k, torch.bfloat16, -1)] = tmm._plan(m, n, k, torch.bfloat16, x.device, cfg)
    compiled = _StubCompiled()
    tmm._keep_runner(plan, compiled, x, w, torch.empty((m, n), dtype=torch.bfloat16))
    assert plan.runner is not None, "the stubbed launcher was not kept"
    fns = layers(tmm, plan, compiled, x, w, "triton")
    fns["python call (lambda: None)"] = lambda: None
    res["host_us"] = {name: host_us(fn, calls=5000, sync=lambda: None) for name, fn in fns.items()}
    print(json.dumps(res["host_us"], indent=1), flush=True)
    res["cprofile"] = host_profile(lambda: rlexact.ops.linear(x, w, backend="triton"), top=15)
    print(*res["cprofile"][:10], sep="\n", flush=True)
    return res


def main() -> None:
    launch_cli(__doc__.splitlines()[0], "matmul_launch", gpu, host_only)


if __name__ == "__main__":
    main()
