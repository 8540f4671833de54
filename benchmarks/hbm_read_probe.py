"""Achievable HBM read rate on this GPU against the long-context decode step's two streams, in one run.

The decode step at batch 32 x 8,192 keys (issue 10's ``rollout_long`` case) reads every layer's K/V (attention)
and every projection's weights at 32 rows (the matmuls). Its roofline takes the datasheet's bandwidth; this probe
measures what a plain streaming read reaches on the card, and the library's two streams against it:

- ``read``: a Triton kernel that sums a bf16 buffer as large as one layer's K/V at batch 32 x 8,192 (a
  grid-strided loop, fp32 partial sums, one store per program), over a sweep of block sizes, warps and programs
  per SM (``read_sweep``); the fastest configuration is the achievable read rate.
- ``copy``: ``Tensor.copy_`` of the same buffer (bytes read plus bytes written).
- ``attention``: :func:`rlexact.ops.attention_paged` decode, one query per sequence at batch 32 over 8,192 keys in
  scattered 16-token pages (``ops_bench.py``'s ``decode_b32_ctx8192``).
- ``matmul_m32``: :func:`rlexact.ops.matmul` of 32 rows against each Qwen3-1.7B projection
  (``ops_bench.QWEN_SHAPES``) and ``torch.mm`` on the same operands, over weight copies that together exceed the L2
  (the weights come from HBM, as in a decode step), and the read kernel over the same copies (the read rate a tensor
  of that size allows).

Everything is timed as CUDA-graph replays (``common.bench_graph``), the arms of each table in rotated rounds
(``common.rotated``), each time the median over its rounds. ``step`` sums one layer's attention and matmul times
over the layers and sets them beside the step's memory bound (``roofline.decode_step_bound``) at the datasheet's
bandwidth and at the measured read rate.

    python benchmarks/hbm_read_probe.py [--rounds 3] [--out benchmarks/results/hbm_read_probe_h100.json]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from common import bench_graph, graph_ms_over, header, medians, paged_decode_inputs, rotated, rounds_args, weight_copies
from ops_bench import QWEN_SHAPES
from rlexact.ops.triton_shared import COMPILE_OPTIONS
from roofline import DecoderShape, decode_step_bound, device_peaks

SHAPE = DecoderShape(hidden=2048, intermediate=6144, layers=28, q_heads=16, kv_heads=8, head_dim=128, vocab=151936)
"""Qwen3-1.7B, as ``rollout_throughput.py`` builds it."""
BATCH, CONTEXT, ROWS = 32, 8192, 32
READ_CONFIGS = [(block, warps, per_sm) for block in (2048, 4096, 8192) for warps in (4, 8) for per_sm in (1, 2, 4, 8)]
"""``(BLOCK, num_warps, programs per SM)`` of the read kernel's sweep."""


@triton.jit
def _read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Program ``p`` sums blocks ``p, p + programs, ...`` of ``x`` in fp32 and stores one partial sum."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def reader(x: torch.Tensor, block: int, warps: int, per_sm: int) -> tuple[Callable[[], None], torch.Tensor]:
    """``(call, partials)``: a launch of :func:`_read_sum` over ``x`` and the buffer it stores into."""
    programs = per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count
    partials = torch.empty(programs, device=x.device, dtype=torch.float32)
    flat = x.view(-1)

    def call() -> None:
        _read_sum[(programs,)](flat, partials, flat.numel(), BLOCK=block, num_warps=warps, **COMPILE_OPTIONS)

    return call, partials


def big_streams(rounds: int) -> dict:
    """The read sweep over one layer's K/V bytes, then the fastest read, the copy and the decode attention in rounds."""
    from rlexact import ops

    q, kc, vc, tables, cu, lens = paged_decode_inputs(BATCH, CONTEXT, SHAPE.q_heads, SHAPE.kv_heads, SHAPE.head_dim)
    kv_bytes = kc.numel() * kc.element_size() + vc.numel() * vc.element_size()
    buf = torch.randn(kv_bytes // 2, device="cuda").bfloat16()
    dst = torch.empty_like(buf)
    ref = buf.double().sum().item()
    sweep = []
    for block, warps, per_sm in READ_CONFIGS:
        call, partials = reader(buf, block, warps, per_sm)
        call()
        total = partials.double().sum().item()
        ms = bench_graph(call)
        sweep.append({"block": block, "num_warps": warps, "programs_per_sm": per_sm, "ms": ms,
                      "gbps": kv_bytes / ms / 1e6, "sum_rel_err": abs(total - ref) / max(abs(ref), 1.0)})  # fmt: skip
    best = min(sweep, key=lambda r: r["ms"])
    read, _ = reader(buf, best["block"], best["num_warps"], best["programs_per_sm"])
    scale = SHAPE.head_dim**-0.5
    arms = {
        "read": read,
        "copy": lambda: dst.copy_(buf),
        "attention": lambda: ops.attention_paged(q, kc, vc, tables, cu, lens, scale, max_seqlen_q=1),
    }
    for call in arms.values():
        call()
    series = rotated(arms, bench_graph, rounds)
    ms = medians(series)
    moved = {"read": kv_bytes, "copy": 2 * kv_bytes, "attention": kv_bytes}
    return {
        "bytes": kv_bytes,
        "read_sweep": sweep,
        "read_best": best,
        "series_ms": series,
        "ms": ms,
        "gbps": {n: moved[n] / t / 1e6 for n, t in ms.items()},
        "attention_over_read": ms["read"] / ms["attention"],
    }


def weight_streams(rounds: int, read_cfg: dict) -> dict:
    """Per projection: the library's product of ``ROWS`` rows, ``torch.mm`` and the read kernel over cold weights."""
    from rlexact import ops

    cfg = (read_cfg["block"], read_cfg["num_warps"], read_cfg["programs_per_sm"])
    res = {}
    for name, (n, k) in QWEN_SHAPES.items():
        w = torch.randn(n, k, device="cuda").bfloat16()
        ws = weight_copies(w)
        x = torch.randn(ROWS, k, device="cuda").bfloat16()
        readers = {id(copy): reader(copy, *cfg)[0] for copy in ws}
        arms = {
            "library": lambda x=x, ws=ws: graph_ms_over(lambda wc, x=x: ops.matmul(x, wc), ws),
            "torch_mm": lambda x=x, ws=ws: graph_ms_over(lambda wc, x=x: torch.mm(x, wc.T), ws),
            "read": lambda ws=ws, readers=readers: graph_ms_over(lambda wc, r=readers: r[id(wc)](), ws),
        }
        ops.matmul(x, w)  # the first call of a row count verifies cuBLAS's bits, outside any capture
        series = rotated(arms, lambda timed: timed(), rounds)
        ms = medians(series)
        nbytes = n * k * w.element_size()
        res[name] = {"N": n, "K": k, "M": ROWS, "weight_bytes": nbytes, "copies": len(ws), "series_ms": series,
                     "ms": ms, "gbps": {a: nbytes / t / 1e6 for a, t in ms.items()}}  # fmt: skip
        del ws, readers
    return res


def main() -> int:
    args = rounds_args(__doc__, "hbm_read_probe.py", 3, 3, "hbm_read_probe_h100.json")
    peaks = device_peaks()
    result: dict = header("hbm_read_probe", "triton") | {"peaks": peaks, "batch": BATCH, "context": CONTEXT}
    big = big_streams(args.rounds)
    result["kv_layer"] = big
    print(f"[hbm_read_probe] one layer's K/V ({big['bytes'] / 1e9:.3f} GB): "
          f"{ {n: round(g) for n, g in big['gbps'].items()} } GB/s", flush=True)  # fmt: skip
    weights = weight_streams(args.rounds, big["read_best"])
    result["matmul_m32"] = weights
    for name, row in weights.items():
        print(f"[hbm_read_probe] {name} {row['N']}x{row['K']}: { {a: round(g) for a, g in row['gbps'].items()} } GB/s")
    attention_ms = SHAPE.layers * big["ms"]["attention"]
    matmuls_ms = SHAPE.layers * sum(r["ms"]["library"] for r in weights.values())
    step: dict = {"layers": SHAPE.layers, "attention_ms": attention_ms, "matmuls_ms": matmuls_ms,
                  "layers_ms": attention_ms + matmuls_ms}  # fmt: skip
    if peaks is not None:
        read_rate = big["bytes"] / big["ms"]["read"] * 1e3
        measured = {**peaks, "hbm_bytes_per_s": read_rate, "source": "this probe's fastest read"}
        step["bound_datasheet"] = decode_step_bound(SHAPE, BATCH, CONTEXT, 2, peaks)
        step["bound_measured_read"] = decode_step_bound(SHAPE, BATCH, CONTEXT, 2, measured)
        step["read_over_datasheet"] = read_rate / peaks["hbm_bytes_per_s"]
    result["step"] = step
    print(f"[hbm_read_probe] step: {json.dumps({k: v for k, v in step.items() if not isinstance(v, dict)})}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
