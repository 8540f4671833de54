"""Host cost of the exact ops' kernel launches, through the cached launchers (``rlexact.ops.triton_launch``) and
through Triton's JIT dispatch, side by side; writes ``benchmarks/results/launch_host_h200.json``.

    python benchmarks/launch_host.py [--out PATH]

At the GRPO update's micro-batch shape (16 sequences x 384 tokens = 6,144 tokens, Qwen3-1.7B widths, bf16), for
each op: host microseconds per call (calls issued back to back without synchronizing, median of five rounds of 50),
milliseconds per call back to back on the GPU (``common.bench_stream``: the host cost shows where it exceeds the
kernel's) and CUDA-graph milliseconds (the kernel alone). The dispatch arm runs in a child process with
``RLEXACT_JIT_LAUNCH=1`` (the switch is read at import); both arms' outputs are compared bitwise through a saved file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import ROOT, bench_graph, bench_stream, header, host_us

T, HQ, HKV, D, H, INTER = 6144, 16, 8, 128, 2048, 6144
SEQS = 16


def _ops() -> dict:
    """name -> a no-argument callable running one library op on fixed random inputs (seeded: both processes build
    the same inputs)."""
    from rlexact import ops
    from rlexact.ops.autograd import kernel_impl

    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    x, w, dy = rnd(T, H), 1 + 0.1 * rnd(H), rnd(T, H)
    gate, up = rnd(T, INTER), rnd(T, INTER)
    q, k, v = rnd(1, T, HQ, D), rnd(1, T, HKV, D), rnd(T, HKV, D)
    pos = torch.arange(T // SEQS, device="cuda").repeat(SEQS)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None], torch.cat([ang.sin()] * 2, -1)[None]
    qw, kw = 1 + 0.1 * rnd(D), 1 + 0.1 * rnd(D)
    cu = torch.arange(0, T + 1, T // SEQS, device="cuda", dtype=torch.int32)
    qa, ka = rnd(T, HQ, D), rnd(T, HKV, D)
    norm_backward = kernel_impl("triton", "rms_norm_backward")  # the kernel itself: autograd's engine would run
    # it on the forward's stream, outside a CUDA-graph capture
    return {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
        "rms_norm_backward": lambda: norm_backward(x, w, dy, 1e-6)[0],
        "silu_mul": lambda: ops.silu_mul(gate, up),
        "qk_norm_rope": lambda: ops.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)[0],
        "attention_varlen": lambda: ops.attention_varlen(qa, ka, v, cu, D**-0.5),
    }


def measure(out_file: str | None) -> dict:
    """This process's timings of every op; with ``out_file``, the ops' outputs are saved there."""
    res, outs = {}, {}
    for name, fn in _ops().items():
        outs[name] = fn().detach().cpu()
        res[name] = {"host_us": host_us(fn), "eager_ms": bench_stream(fn), "graph_ms": bench_graph(fn)}
    if out_file:
        torch.save(outs, out_file)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "launch_host_h200.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the dispatch arm: write timings + outputs
    args = ap.parse_args()
    if args.child:
        Path(args.child).write_text(json.dumps(measure(args.child + ".pt")))
        return
    res = header("launch_host", "triton")
    res["setup"] = {"tokens": T, "sequences": SEQS, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "hidden": H,
                    "intermediate": INTER, "dtype": "bfloat16"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        child = os.path.join(tmp, "dispatch.json")
        env = {**os.environ, "RLEXACT_JIT_LAUNCH": "1"}
        subprocess.run([sys.executable, __file__, "--child", child], env=env, check=True)
        dispatch = json.loads(Path(child).read_text())
        cached = measure(os.path.join(tmp, "cached.pt"))
        a, b = torch.load(child + ".pt"), torch.load(os.path.join(tmp, "cached.pt"))
    res["ops"] = {
        name: {"cached": cached[name], "dispatch": dispatch[name], "bitwise_equal": bool(torch.equal(a[name], b[name])),
               "host_ratio": dispatch[name]["host_us"] / cached[name]["host_us"]}  # fmt: skip
        for name in cached
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for name, r in res["ops"].items():
        print(f"{name:20s} host {r['cached']['host_us']:7.1f} vs {r['dispatch']['host_us']:7.1f} us  "
              f"eager {r['cached']['eager_ms']:.4f} vs {r['dispatch']['eager_ms']:.4f} ms  equal {r['bitwise_equal']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
