"""Host cost of the packed exact-attention launch, with and without kept launch plans; writes
``benchmarks/results/attention_launch_h200.json`` (GPU) or ``attention_launch_host_cpu.json`` (``--host-only``).

    python benchmarks/attention_launch.py [--out PATH]              # on an sm_90 GPU
    python benchmarks/attention_launch.py --host-only [--out PATH]  # on CPU, launch stubbed

For each packed prefill shape of :data:`SHAPES` (bf16, Qwen3-1.7B heads), the forward called through each layer of
the call stack:

* ``ops``: ``rlexact.ops.attention_varlen`` (no grad), the library's entry, through a kept plan;
* ``planned``: ``triton_attention._forward``, through a kept plan (``_planned_launch``);
* ``unplanned``: the same call with ``cfg={}`` (the library's configuration, every decision made again: configs,
  Gluon support, kernel choice, plan, launch key);
* ``unplanned_checked``: ``unplanned`` with Triton's checking descriptor constructor (the launch path before the
  plans and the unchecked descriptors);
* ``ops_fresh_counter``: ``ops`` with a new zeroed item counter per launch (``torch.zeros``: the paired kernel's
  launch before its counter was kept per stream and left zero by the kernel).

GPU mode records per layer the host microseconds per call (calls issued back to back without synchronizing), and for
``ops``, ``ops_fresh_counter``, ``unplanned_checked`` and SDPA on the padded batch the eager back-to-back time
(``common.bench_stream``: the host's cost shows once it exceeds the kernel's) and the CUDA-graph replay time, with
``eager_ratio`` (SDPA's eager time over exact's) and whether each call is bound by its launch (host time above graph
time). The prefill rows of ``ops_bench.py --sections attention`` time the same shapes against SDPA in alternating
rounds.

``--host-only`` times the same Python layers on CPU tensors, but the ``ops`` layers (whose output allocation would be
the CPU allocator's, not the CUDA caching allocator's), and profiles ``planned``. Gluon's GPU checks are taken as
passed, and the compiled kernel is a stand-in whose launcher runs Triton's own per-launch Python
(``CudaLauncher.__call__`` and its tensor-descriptor unpacking) around a no-op C launch, with the host TMA descriptor
encoding stubbed. The C launch (argument parsing, ``cuLaunchKernelEx``), TMA descriptor encoding and the CUDA caching
allocator are not in these numbers; the GPU mode has them.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from common import bench_graph, bench_stream, header, host_profile, host_us, launch_cli, swapped

SHAPES = ((32, 256), (16, 384), (64, 512), (128, 128))
"""Packed prefill shapes ``(sequences, tokens each)``: the short ones are where an eager launch's host work can
exceed its kernel."""
HQ, HKV, D = 16, 8, 128


def _inputs(b: int, s: int, device: str) -> tuple[torch.Tensor, ...]:
    """``q, k, v, cu, out`` of ``b`` sequences of ``s`` tokens (bf16, seeded)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b * s, h, D, device=device, generator=g).bfloat16() for h in (HQ, HKV, HKV))
    cu = torch.arange(0, (b + 1) * s, s, device=device, dtype=torch.int32)
    return q, k, v, cu, torch.empty_like(q)


def _layers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
            out: torch.Tensor) -> dict[str, Callable[[], object]]:  # fmt: skip
    """The forward through each layer of the call stack (module docstring)."""
    from rlexact import ops
    from rlexact.ops import gluon_attention as ga
    from rlexact.ops import triton_attention as ta

    scale = D**-0.5

    def unplanned_checked() -> None:
        with swapped(ga, "DESCRIPTOR_DEFAULTS", None):
            ta._forward(q, k, v, cu, None, None, scale, out, cfg={})

    def ops_fresh_counter() -> None:
        with swapped(ga, "item_counter", lambda device: torch.zeros(2, dtype=torch.int32, device=device)):
            ops.attention_varlen(q, k, v, cu, scale, backend="triton")

    return {
        "ops": lambda: ops.attention_varlen(q, k, v, cu, scale, backend="triton"),
        "ops_fresh_counter": ops_fresh_counter,
        "planned": lambda: ta._forward(q, k, v, cu, None, None, scale, out),
        "unplanned": lambda: ta._forward(q, k, v, cu, None, None, scale, out, cfg={}),
        "unplanned_checked": unplanned_checked,
    }


def gpu() -> dict:
    import torch.nn.functional as F

    res = header("attention_launch", "triton")
    res["shapes"] = {}
    for b, s in SHAPES:
        q, k, v, cu, out = _inputs(b, s, "cuda")
        fns = _layers(q, k, v, cu, out)
        qp = q.view(b, s, HQ, D).transpose(1, 2)
        kp, vp = (x.view(b, s, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1) for x in (k, v))
        fns["sdpa"] = lambda qp=qp, kp=kp, vp=vp: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        row: dict[str, object] = {"host_us": {name: host_us(fn, calls=200) for name, fn in fns.items()}}
        for name in ("ops", "ops_fresh_counter", "unplanned_checked", "sdpa"):
            eager, graph = bench_stream(fns[name]), bench_graph(fns[name])
            row[name] = {"eager_ms": eager, "graph_ms": graph,
                         "launch_bound": row["host_us"][name] / 1e3 > graph}  # fmt: skip
        row["eager_ratio"] = {n: row["sdpa"]["eager_ms"] / row[n]["eager_ms"]
                              for n in ("ops", "ops_fresh_counter", "unplanned_checked")}  # fmt: skip
        row["cprofile_ops"] = host_profile(fns["ops"])
        res["shapes"][f"{b}x{s}"] = row
        print(f"[attention_launch] {b}x{s}", json.dumps({k: row[k] for k in ("host_us", "eager_ratio")}), flush=True)
    return res


class _StubDriver:
    """Triton's active driver with the host TMA descriptor encoding stubbed (CPU: no CUDA driver)."""

    class utils:  # noqa: N801 - the attribute Triton reads
        @staticmethod
        def fill_tma_descriptor(*args: object) -> bytes:
            return bytes(128)


def _stub_compiled(args: tuple) -> object:
    """A compiled kernel for a launch of ``args`` whose ``run`` is Triton 3.6's ``CudaLauncher.__call__`` around a
    no-op C launch, with its tensor-descriptor unpacking (one bf16 128-byte-swizzled descriptor per descriptor
    argument)."""
    from triton.backends.nvidia import driver as nv

    from rlexact.ops import gluon_attention as ga

    desc = [i for i, a in enumerate(args) if isinstance(a, ga.GluonDescriptor)]
    signature = {i: ("tensordesc" if i in desc else "i32") for i in range(len(args))}
    meta = [{"swizzle": 128, "elem_size": 2, "elem_type": 9, "block_size": list(args[i].block_shape),
             "fp4_padded": False} for i in desc]  # fmt: skip
    run = object.__new__(nv.CudaLauncher)
    run.launch = nv.wrap_handle_tensordesc(lambda *a: None, signature, meta)
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    return type("Compiled", (), {"run": run, "function": 0, "packed_metadata": None})


def host_only() -> dict:
    import triton

    import rlexact.ops
    from rlexact.ops import gluon_attention as ga

    triton.runtime.driver.set_active(_StubDriver())
    ga.supported = lambda q, k, v, block_n: block_n == ga.BLOCK_N
    ga.jit_launch = lambda kernel, grid, args, kwargs: _stub_compiled(args)
    ga.cuda_queries = lambda: ((lambda: -1), (lambda device: 0), (lambda: False))
    rlexact.ops.resolve_backend = lambda t, backend: backend

    res = header("attention_launch_host", "triton")
    res["launch_stubbed"] = True
    res["shapes"] = {}
    for b, s in SHAPES:
        fns = _layers(*_inputs(b, s, "cpu"))
        for name in ("ops", "ops_fresh_counter"):  # their output allocation would be the CPU allocator's (page
            del fns[name]  # faults), not CUDA's caching one
        for fn in fns.values():
            fn()
        times = {name: host_us(fn, calls=5000, sync=lambda: None) for name, fn in fns.items()}
        row: dict[str, object] = {"host_us": times}
        row["cprofile_planned"] = host_profile(fns["planned"])
        res["shapes"][f"{b}x{s}"] = row
        print(f"[attention_launch --host-only] {b}x{s}", json.dumps(row["host_us"]), flush=True)
    return res


def main() -> None:
    launch_cli(__doc__.split("\n\n")[0], "attention_launch", gpu, host_only)


if __name__ == "__main__":
    main()
