"""Exact ops vs native torch on one GPU; writes ``benchmarks/results/ops_h200.json``.

    python benchmarks/ops_bench.py [--out benchmarks/results/ops_h200.json] [--quick]

Sections (each one is independent: a failure is recorded in the JSON and the run continues):

* ``matmul``: :func:`rlexact.ops.matmul` vs ``torch.mm`` (cuBLAS), bf16, Qwen3-1.7B projection shapes, M = 1 .. 16384:
  TFLOP/s of both and the ratio native_ms / exact_ms (> 1 means the exact kernel is faster), eager (``do_bench``)
  and as CUDA-graph replays (``graph_ratio``: GPU time without host launch overhead).
* ``matmul_invariance``: the exact matmul's row computed at M = 1 vs the same row inside M = 4096 (``torch.equal``),
  and the same check for ``torch.mm`` (the negative control).
* ``attention``: :func:`rlexact.ops.attention_varlen` (:data:`PREFILL_CASES`: 64 x 512, 8 x 4,096, 1 x 8,192,
  16 x 1,024 and 4 x 2,048 tokens, 16 q / 8 kv heads, head_dim 128) vs SDPA causal on the padded batch, SDPA's
  default choice and each of its flash / cuDNN / memory-efficient backends forced, and on sm_90 the forward through
  each Gluon kernel (single and paired query tiles; ``gluon_kernels``, into preallocated outputs, timed in the
  same rounds as the exact call and SDPA); the generator's prefill steps from position 0
  (:data:`FRESH_PREFILL_CASES`), paged against packed; prefill chunks after cached keys (:data:`PAGED_CHUNK_CASES`),
  the ``tl`` paged launch against the gathered packed Gluon launches; :func:`rlexact.ops.attention_paged` decode
  (:data:`DECODE_CASES`: short contexts at batch 64 / 256, 8k-token contexts at batch 4 / 32) vs SDPA decode on
  contiguous caches, with and without the ``max_seqlen_q = 1`` bound the generator passes; each prefill case also
  as CUDA-graph replays (``exact_graph_ms``, ``sdpa_graph_ms``, ``graph_ratio``: GPU time alone, which the short
  cases' eager calls hide behind the host's launch cost), both ways with the exact call, SDPA's and the Gluon kernels
  timed in rotated rounds (``interleaved``: the series, whose medians are those times, and the per-round ratios' median
  and range of SDPA's time to the exact call's, the timer's resolution for the pair); and the launch of the packed
  forward at the GRPO update's micro-batch shape (:data:`LAUNCH_CASE`), the sm_90 Gluon kernel against the ``tl``
  kernel side by side: GPU time (graph replays), eager back-to-back time (``common.bench_stream``: the host's launch
  cost shows once it exceeds the kernel's) and host time per call.
* ``window``: sliding-window attention (:data:`WINDOW_PREFILL_CASES`, :data:`WINDOW_DECODE_CASES`), which runs the
  ``tl`` kernels (no Gluon path takes a window): the windowed exact call against the unwindowed exact call at the same
  shape, and against SDPA given only the work the window leaves (prefill: a boolean window mask, SDPA's choice of
  backend; decode: the window's last keys, contiguous); a window as long as the sequences must give the unwindowed
  call's bits (``full_window_equal``).
* ``logprob``: :func:`rlexact.ops.token_logprobs` vs ``log_softmax((h @ W.T).float()).gather`` at T = 4096 / 16384,
  V = 151936, H = 2048, bf16: time and peak-memory delta.
* ``norm``: rms_norm and silu_mul vs their torch expressions (memory-bound sanity check).
* ``rope``: the fused q/k RMSNorm + rotary kernel vs the stock transformers chain (decode T = 256, prefill 16384).

Timings are medians of ``triton.testing.do_bench`` (warm-up included) on fresh random inputs (never zeros), except
attention decode: CUDA-graph replays (``common.bench_graph``), the way the generator runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from common import ROOT, bench, bench_graph, bench_stream, header, host_profile, host_us, interleaved, require_cuda

QWEN_SHAPES = {  # name: (N, K) of w [N, K]
    "qkv": (2048 + 2 * 1024, 2048),
    "o": (2048, 2048),
    "gate_up": (2 * 6144, 2048),
    "down": (2048, 6144),
}
MS = [1, 16, 64, 256, 1024, 4096, 16384]
DECODE_CASES = [(64, 512), (256, 256), (256, 512), (4, 8192), (32, 8192)]
"""``(batch, context)`` of the attention decode cases."""


def bench_matmul(quick: bool) -> dict:
    from rlexact.ops import matmul

    res = {}
    for name, (n, k) in QWEN_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        rows = []
        for m in MS if not quick else [1, 64, 4096]:
            entry = {"M": m, "N": n, "K": k}
            try:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                flop = 2.0 * m * n * k
                t_exact = bench(lambda x=x, w=w: matmul(x, w))
                t_native = bench(lambda x=x, w=w: torch.mm(x, w.T))
                entry.update(
                    exact_ms=t_exact,
                    native_ms=t_native,
                    exact_tflops=flop / t_exact / 1e9,
                    native_tflops=flop / t_native / 1e9,
                    ratio=t_native / t_exact,
                )
                try:  # GPU time without host launch overhead (CUDA-graph replay), as the rollout runs decode
                    g_exact = bench_graph(lambda x=x, w=w: matmul(x, w))
                    g_native = bench_graph(lambda x=x, w=w: torch.mm(x, w.T))
                    entry.update(exact_graph_ms=g_exact, native_graph_ms=g_native, graph_ratio=g_native / g_exact)
                except Exception as e:  # noqa: BLE001
                    entry["graph_error"] = f"{type(e).__name__}: {e}"
                try:
                    from rlexact.ops.triton_matmul import config_for

                    entry["config"] = repr(config_for(m, n, k, torch.bfloat16, x.device))
                except Exception as e:  # noqa: BLE001
                    entry["config"] = f"unavailable: {e!r}"
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
                entry["traceback"] = traceback.format_exc(limit=3)
            rows.append(entry)
        res[name] = rows
    return res


def check_invariance() -> dict:
    from rlexact.ops import matmul

    out = {}
    for name, (n, k) in QWEN_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        r = 1234
        out[name] = {
            "exact_row_M1_eq_M4096": bool(torch.equal(matmul(x[r : r + 1], w), matmul(x, w)[r : r + 1])),
            "native_row_M1_eq_M4096": bool(torch.equal(x[r : r + 1] @ w.T, (x @ w.T)[r : r + 1])),
        }
    return out


PREFILL_CASES = ((64, 512), (8, 4096), (1, 8192), (16, 1024), (4, 2048), (32, 256), (128, 128))
"""Packed causal prefill shapes ``(sequences, tokens each)`` of the attention section; the first is the issue's, the
last two are short enough for an eager call's host work to matter."""
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def _prefill_case(b: int, s: int, hq: int, hkv: int, d: int, scale: float) -> dict:
    """Exact packed prefill of ``b`` sequences of ``s`` tokens vs SDPA (its default choice, then each backend of
    :data:`SDPA_BACKENDS` forced; a backend that refuses the inputs is recorded as such): the exact call, SDPA's
    default and on sm_90 each Gluon kernel timed in rotated rounds, eager and as CUDA-graph replays
    (``common.interleaved``; each time recorded is the median of its series), and each call's host microseconds (an
    eager call whose host time exceeds its graph time is bound by its launch)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlexact import ops
    from rlexact.ops import gluon_attention

    q = torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    qp = q.view(b, s, hq, d).transpose(1, 2)
    kp = k.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vp = v.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)

    def exact() -> torch.Tensor:
        return ops.attention_varlen(q, k, v, cu, scale)

    flop = 4.0 * b * hq * d * s * s / 2  # causal
    kernels = _gluon_kernels(q, k, v, cu, scale) if gluon_attention.supported(q, k, v, gluon_attention.BLOCK_N) else {}
    arms = {name: call for name, (call, _) in kernels.items()}
    rounds = {"eager": interleaved(("exact", exact), ("sdpa", sdpa), bench, others=arms),
              "graph": interleaved(("exact", exact), ("sdpa", sdpa), bench_graph, others=arms)}  # fmt: skip
    t_exact, t_sdpa = (statistics.median(rounds["eager"][f"{n}_ms"]) for n in ("exact", "sdpa"))
    g_exact, g_sdpa = (statistics.median(rounds["graph"][f"{n}_ms"]) for n in ("exact", "sdpa"))
    h_exact, h_sdpa = host_us(exact), host_us(sdpa)
    backends: dict[str, object] = {}
    for backend in SDPA_BACKENDS:
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                ms = bench(sdpa)
            backends[backend.lower()] = {"ms": ms, "tflops": flop / ms / 1e9, "exact_over_it": ms / t_exact}
        except RuntimeError as e:  # the backend does not take these inputs on this GPU
            backends[backend.lower()] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    timed = {n: r["ms"] for n, r in backends.items() if isinstance(r, dict) and "ms" in r}
    return {
        "batch": b,
        "seqlen": s,
        "exact_ms": t_exact,
        "sdpa_ms": t_sdpa,
        "exact_tflops": flop / t_exact / 1e9,
        "sdpa_tflops": flop / t_sdpa / 1e9,
        "ratio": t_sdpa / t_exact,
        "exact_graph_ms": g_exact,
        "sdpa_graph_ms": g_sdpa,
        "graph_ratio": g_sdpa / g_exact,
        "exact_host_us": h_exact,
        "sdpa_host_us": h_sdpa,
        "interleaved": rounds,
        "gluon_kernels": _gluon_summary(kernels, rounds, q.shape[0], cu.shape[0] - 1) if kernels else {},
        "sdpa_backends": backends,
        "sdpa_default_closest_backend": min(timed, key=lambda n: abs(timed[n] - t_sdpa)) if timed else None,
    }


def _gluon_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                   scale: float) -> dict[str, tuple[Callable[[], None], torch.Tensor]]:  # fmt: skip
    """The packed forward through each sm_90 Gluon kernel (``ta._forward``'s ``PAIR`` override; the pair persistent,
    as by default, and with a program per item), each as ``name -> (call, its preallocated output)``."""
    from rlexact.ops import triton_attention as ta

    per_item = {"PAIR": True, "PROGRAMS": 1 << 30}
    kernels = {}
    for name, cfg in (("single", {"PAIR": False}), ("pair", {"PAIR": True}), ("pair_per_item", per_item)):
        out = torch.empty_like(q)
        kernels[name] = (lambda out=out, cfg=cfg: ta._forward(q, k, v, cu, None, None, scale, out, cfg=cfg), out)
    return kernels


def _gluon_summary(kernels: dict[str, tuple[Callable[[], None], torch.Tensor]], rounds: dict, tokens: int,
                   seqs: int) -> dict:  # fmt: skip
    """Each Gluon kernel's median time over the rounds it ran in beside the exact call and SDPA, eager (``*_ms``) and
    as CUDA-graph replays (``*_graph_ms``: the kernel's GPU time without the host's launch cost), which the launch's
    default picks, and whether each pair launch gives the single kernel's bits (its outputs as the rounds left them)."""
    from rlexact.ops import gluon_attention_pair

    res: dict[str, object] = {}
    for name in kernels:
        res[f"{name}_ms"] = statistics.median(rounds["eager"][f"{name}_ms"])
        res[f"{name}_graph_ms"] = statistics.median(rounds["graph"][f"{name}_ms"])
    single = kernels["single"][1]
    res["pair_bitwise_equal_single"] = bool(torch.equal(single, kernels["pair"][1]))
    res["pair_per_item_bitwise_equal_single"] = bool(torch.equal(single, kernels["pair_per_item"][1]))
    res["default"] = "pair" if gluon_attention_pair.chosen(tokens, seqs) else "single"
    return res


FRESH_PREFILL_CASES = ((2, 8192), (32, 512), (128, 128))
"""``(prompts, tokens each)`` of the generator's prefill steps whose prompts start at position 0 (16,384 tokens, the
default step budget: the 8k-prompt rollout, the GRPO-shaped one, the batch-256 one)."""


def _fresh_prefill_case(b: int, s: int, hq: int, hkv: int, d: int, scale: float) -> dict:
    """A prefill step of ``b`` prompts of ``s`` tokens from position 0: the paged launch over the cache the step
    writes (pages shuffled) against the packed launch over the step's own keys, which the generator runs for such
    steps; both must give the same bits."""
    from rlexact import ops

    bs = 16
    q = torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    nblk = b * s // bs
    kc = torch.empty(nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    tables = torch.randperm(nblk, device="cuda").to(torch.int32).view(b, s // bs)
    pos = torch.arange(s, device="cuda")
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    ops.write_kv(k, v, kc, vc, slots)
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
    paged_out = ops.attention_paged(q, kc, vc, tables, cu, lens, scale, max_seqlen_q=s)
    packed_out = ops.attention_varlen(q, k, v, cu, scale)
    t_paged = bench(lambda: ops.attention_paged(q, kc, vc, tables, cu, lens, scale, max_seqlen_q=s))
    t_packed = bench(lambda: ops.attention_varlen(q, k, v, cu, scale))
    return {
        "prompts": b,
        "tokens_each": s,
        "paged_ms": t_paged,
        "packed_ms": t_packed,
        "paged_over_packed": t_paged / t_packed,
        "bitwise_equal": bool(torch.equal(paged_out, packed_out)),
    }


PAGED_CHUNK_CASES = (
    (2, 8192, 8192),
    (1, 16384, 8192),
    (4, 4096, 2048),
    *((64, 1024, n) for n in (16, 32, 64, 128, 256, 512)),
)
"""``(sequences, cached keys each, new queries each)`` of :func:`_paged_chunk_case`: the second chunk of two 16k-token
prompts at the generator's default token budget, a third chunk, and a sweep of the queries per sequence at a fixed
context (where :data:`rlexact.ops.kv_gather.MIN_MEAN_QUERIES` comes from)."""


def _paged_chunk_case(b: int, past: int, new: int, hq: int, hkv: int, d: int, scale: float) -> dict:
    """A prefill chunk of ``new`` queries per sequence after ``past`` cached keys (pages shuffled, the chunk's own
    keys in the cache too): the ``tl`` paged launch against the gathered packed Gluon launches (single and paired
    query tiles, the gather included) and the library's default choice, each compared bitwise with the ``tl``
    launch; and the gather alone."""
    from rlexact.ops import kv_gather
    from rlexact.ops import triton_attention as ta

    bs = 16
    ctx = past + new
    nblk = -(-ctx // bs)
    kc = torch.randn(b * nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(b * nblk, device="cuda").to(torch.int32).view(b, nblk)
    q = torch.randn(b * new, hq, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * new, new, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    res: dict = {"sequences": b, "cached_keys": past, "new_queries": new}
    outs = {}
    for name, cfg in (("tl", {"GLUON": False}), ("gathered_single", {"GATHER": True, "PAIR": False}),
                      ("gathered_pair", {"GATHER": True, "PAIR": True}), ("default", {})):  # fmt: skip
        out = torch.empty_like(q)

        def call(out: torch.Tensor = out, cfg: dict = cfg) -> None:
            ta._forward(q, kc, vc, cu, lens, tables, scale, out, cfg=cfg, max_seqlen_q=new)

        call()
        outs[name] = out
        res[f"{name}_ms"] = bench(call)
        if name != "tl":
            res[f"{name}_bitwise_equal"] = bool(torch.equal(out, outs["tl"]))
            res[f"tl_over_{name}"] = res["tl_ms"] / res[f"{name}_ms"]
    res["gather_ms"] = bench(lambda: kv_gather.gather(kc, vc, tables, lens, nblk * bs))
    res["default_gathers"] = kv_gather.chosen(b * new, b, nblk * bs, hkv * d * 2)
    return res


LAUNCH_CASE = (16, 384)
"""``(sequences, tokens each)`` of the launch comparison: one micro-batch of the GRPO update in ``train_step.py``."""


def _launch_case(hq: int, hkv: int, d: int, scale: float) -> dict:
    """The packed forward at :data:`LAUNCH_CASE` through the library's default launch (the Gluon kernel on sm_90) and
    through the ``tl`` kernel: graph-replay and eager milliseconds per call, host microseconds per call (calls
    issued without synchronizing, so the host's own cost) with the functions that take it (``cProfile``), and whether
    the two outputs are equal bitwise."""
    from rlexact.ops import triton_attention as ta

    b, s = LAUNCH_CASE
    q = torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    res: dict = {"batch": b, "seqlen": s}
    outs = {}
    for name, cfg in (("default", None), ("tl", {"GLUON": False})):
        out = torch.empty_like(q)

        def call(out: torch.Tensor = out, cfg: dict | None = cfg) -> None:
            ta._forward(q, k, v, cu, None, None, scale, out, cfg=cfg)

        call()
        outs[name] = out
        res[name] = {
            "graph_ms": bench_graph(call),
            "eager_ms": bench_stream(call),
            "host_us": host_us(call),
            "host_top_us": host_profile(call, calls=200),
        }
        torch.cuda.synchronize()
    res["bitwise_equal"] = bool(torch.equal(outs["default"], outs["tl"]))
    return res


def _case(fn: Callable[..., dict], *args: object) -> dict:
    """``fn(*args)``, or the error it raised with a short traceback: one failing case is recorded and the section
    goes on."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)}


def bench_attention(quick: bool) -> dict:
    import torch.nn.functional as F

    from rlexact import ops

    res = {}
    hq, hkv, d = 16, 8, 128
    scale = 1.0 / math.sqrt(d)
    # prefill / training: packed causal sequences vs SDPA on the padded batch, SDPA's default choice and each
    # backend forced (the default on Hopper may be cuDNN's kernel, not the flash one)
    for b, s in PREFILL_CASES[:1] if quick else PREFILL_CASES:
        name = "prefill" if (b, s) == PREFILL_CASES[0] else f"prefill_{b}x{s}"
        res[name] = _case(_prefill_case, 16 if quick and b == 64 else b, s, hq, hkv, d, scale)
    for b, s in FRESH_PREFILL_CASES[:1] if quick else FRESH_PREFILL_CASES:
        res[f"fresh_prefill_{b}x{s}"] = _case(_fresh_prefill_case, b, s, hq, hkv, d, scale)
    for b, past, new in PAGED_CHUNK_CASES[:1] if quick else PAGED_CHUNK_CASES:
        res[f"paged_chunk_{b}x{past}+{new}"] = _case(_paged_chunk_case, b, past, new, hq, hkv, d, scale)
    res["launch_microbatch"] = _case(_launch_case, hq, hkv, d, scale)
    # decode over a paged cache: one new query per sequence
    for b, ctx in DECODE_CASES:
        name = f"decode_b{b}" if ctx == 512 else f"decode_b{b}_ctx{ctx}"
        try:
            bs = 16
            nblk = ctx // bs
            kc = torch.randn(b * nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn(b * nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
            perm = torch.randperm(b * nblk, device="cuda").to(torch.int32)  # scattered pages
            tables = perm.view(b, nblk)
            q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
            cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
            lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            kcont = kc[tables.long()].reshape(b, ctx, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            vcont = vc[tables.long()].reshape(b, ctx, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            qd = q.view(b, hq, 1, d)
            args = (q, kc, vc, tables, cu_q, lens, scale)
            # CUDA-graph replays, as the generator runs decode (eager timing of this two-kernel op measures host
            # launch gaps). The generator passes max_seqlen_q = 1 (one program per sequence); without the bound
            # programs look their sequence up in cu_seqlens first.
            t_exact = bench_graph(lambda args=args: ops.attention_paged(*args, max_seqlen_q=1))
            t_lookup = bench_graph(lambda args=args: ops.attention_paged(*args))
            sargs = (qd, kcont, vcont)
            t_sdpa = bench_graph(lambda sargs=sargs: F.scaled_dot_product_attention(*sargs, scale=scale))
            kv_bytes = 2 * b * ctx * hkv * d * 2
            res[name] = {
                "batch": b,
                "context": ctx,
                "exact_ms": t_exact,
                "exact_without_max_seqlen_q_ms": t_lookup,
                "sdpa_ms": t_sdpa,
                "exact_kv_gbps": kv_bytes / t_exact / 1e6,
                "ratio": t_sdpa / t_exact,
                "timing": "CUDA-graph replays (bench_graph)",
                "note": "SDPA reads contiguous, GQA-expanded caches (no paging)",
            }
            del kc, vc, kcont, vcont
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)}
    return res


WINDOW_PREFILL_CASES = ((8, 4096, 1024), (8, 4096, 4096))
"""``(sequences, tokens each, window)`` of the windowed prefill cases."""
WINDOW_DECODE_CASES = ((4, 8192, 4096), (32, 8192, 4096), (256, 512, 128))
"""``(batch, context, window)`` of the windowed decode cases (CUDA-graph replays)."""


def _window_prefill_case(b: int, s: int, w: int, hq: int, hkv: int, d: int, scale: float) -> dict:
    import torch.nn.functional as F

    from rlexact import ops

    q = torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    pos = torch.arange(s, device="cuda")
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w)
    qp = q.view(b, s, hq, d).transpose(1, 2)
    kp = k.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vp = v.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)

    def windowed() -> torch.Tensor:
        return ops.attention_varlen(q, k, v, cu, scale, window=w)

    def full() -> torch.Tensor:
        return ops.attention_varlen(q, k, v, cu, scale)

    equal = bool(torch.equal(windowed(), full())) if w >= s else None
    t_win, t_full = bench(windowed), bench(full)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale))
    return {
        "exact_window_ms": t_win,
        "exact_full_ms": t_full,
        "sdpa_window_mask_ms": t_sdpa,
        "window_over_full": t_win / t_full,
        "ratio_vs_sdpa": t_sdpa / t_win,
        "full_window_equal": equal,
    }


def _window_decode_case(b: int, ctx: int, w: int, hq: int, hkv: int, d: int, scale: float) -> dict:
    import torch.nn.functional as F

    from rlexact import ops

    bs = 16
    nblk = ctx // bs
    kc = torch.randn(b * nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(b * nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(b * nblk, device="cuda").to(torch.int32).view(b, nblk)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)

    def last_keys(cache: torch.Tensor) -> torch.Tensor:
        x = cache[tables.long()].reshape(b, ctx, hkv, d)[:, -w:]
        return x.transpose(1, 2).repeat_interleave(hq // hkv, 1).contiguous()

    kw, vw, qd = last_keys(kc), last_keys(vc), q.view(b, hq, 1, d)
    args = (q, kc, vc, tables, cu_q, lens, scale)
    t_win = bench_graph(lambda: ops.attention_paged(*args, max_seqlen_q=1, window=w))
    t_full = bench_graph(lambda: ops.attention_paged(*args, max_seqlen_q=1))
    t_sdpa = bench_graph(lambda: F.scaled_dot_product_attention(qd, kw, vw, scale=scale))
    return {
        "exact_window_ms": t_win,
        "exact_full_ms": t_full,
        "sdpa_window_keys_ms": t_sdpa,
        "window_over_full": t_win / t_full,
        "ratio_vs_sdpa": t_sdpa / t_win,
        "exact_window_kv_gbps": 2 * b * w * hkv * d * 2 / t_win / 1e6,
    }


def bench_window() -> dict:
    res: dict = {}
    hq, hkv, d = 16, 8, 128
    scale = 1.0 / math.sqrt(d)
    for b, s, w in WINDOW_PREFILL_CASES:
        res[f"prefill_{b}x{s}_w{w}"] = _case(_window_prefill_case, b, s, w, hq, hkv, d, scale)
    for b, ctx, w in WINDOW_DECODE_CASES:
        res[f"decode_b{b}_ctx{ctx}_w{w}"] = _case(_window_decode_case, b, ctx, w, hq, hkv, d, scale)
        torch.cuda.empty_cache()
    return res


def _peak_delta(fn) -> float:
    """Peak extra bytes allocated while running ``fn`` once (relative to memory in use before)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return float(peak)


def bench_logprob(quick: bool) -> dict:
    from rlexact.ops import token_logprobs

    res = {}
    h, v = 2048, 151936
    w = (torch.randn(v, h, device="cuda") / math.sqrt(h)).to(torch.bfloat16)
    for t in (4096,) if quick else (4096, 16384):
        entry = {"T": t, "V": v, "H": h}
        try:
            hid = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            tgt = torch.randint(0, v, (t,), device="cuda")

            def native(hid=hid, tgt=tgt):
                return torch.log_softmax((hid @ w.T).float(), dim=-1).gather(1, tgt[:, None]).squeeze(1)

            def exact(hid=hid, tgt=tgt):
                return token_logprobs(hid, w, tgt, 1.0)

            lp_e = exact()[0]
            lp_n = native()
            entry["max_abs_diff_vs_native"] = float((lp_e - lp_n).abs().max())
            del lp_n
            entry["exact_peak_bytes"] = _peak_delta(exact)
            entry["native_peak_bytes"] = _peak_delta(native)
            entry["exact_ms"] = bench(exact, warmup=5, rep=20)
            entry["native_ms"] = bench(native, warmup=5, rep=20)
            entry["ratio"] = entry["native_ms"] / entry["exact_ms"]
            flop = 2.0 * t * v * h
            entry["exact_tflops"] = flop / entry["exact_ms"] / 1e9
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc(limit=3)
        torch.cuda.empty_cache()
        res[f"T{t}"] = entry
    return res


def bench_norm() -> dict:
    from rlexact.ops import rms_norm, silu_mul

    res = {}
    try:
        x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)

        def native_norm():
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

        te, tn = bench(lambda: rms_norm(x, w, 1e-6)), bench(native_norm)
        res["rms_norm_16384x2048"] = {"exact_ms": te, "native_ms": tn, "ratio": tn / te}
        g = torch.randn(16384, 6144, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(16384, 6144, device="cuda", dtype=torch.bfloat16)
        te = bench(lambda: silu_mul(g, u))
        tn = bench(lambda: (torch.nn.functional.silu(g.float()) * u.float()).to(g.dtype))
        res["silu_mul_16384x6144"] = {"exact_ms": te, "native_ms": tn, "ratio": tn / te}
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def _rope_case(t: int) -> dict:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from rlexact.ops import qk_norm_rope

    q = torch.randn(1, t, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, t, 8, 128, device="cuda", dtype=torch.bfloat16)
    qw, kw = torch.rand(128, device="cuda").bfloat16(), torch.rand(128, device="cuda").bfloat16()
    ang = torch.rand(1, t, 64, device="cuda") * 1000
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def native():
        return apply_rotary_pos_emb(norm(q, qw).transpose(1, 2), norm(k, kw).transpose(1, 2), cos, sin)

    def exact():
        return qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)

    te, tn = bench(exact), bench(native)
    ge, gn = bench_graph(exact), bench_graph(native)
    return {
        "exact_ms": te, "native_ms": tn, "ratio": tn / te,
        "exact_graph_ms": ge, "native_graph_ms": gn, "graph_ratio": gn / ge,
    }  # fmt: skip


def bench_rope() -> dict:
    """Fused q/k RMSNorm + rotary (one launch) vs the stock transformers chain (q_norm, k_norm,
    ``apply_rotary_pos_emb``), Qwen3-1.7B heads, bf16 cos/sin as transformers passes them; eager and graph replay."""
    res = {}
    for t in (256, 16384):
        try:
            res[f"qk_norm_rope_T{t}"] = _rope_case(t)
        except Exception as e:  # noqa: BLE001
            err = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)}
            res[f"qk_norm_rope_T{t}"] = err
    return res


def _table(results: dict) -> str:
    lines = [
        "section            case                          exact      native     ratio(native/exact)  [graph ratio]"
    ]
    for name, rows in results.get("matmul", {}).items():
        if not isinstance(rows, list):
            continue
        for r in rows:
            if "error" in r:
                lines.append(f"matmul             {name:6s} M={r['M']:<6d}            ERROR {r['error'][:60]}")
            else:
                lines.append(
                    f"matmul             {name:6s} M={r['M']:<6d}  {r['exact_tflops']:8.1f}TF "
                    f"{r['native_tflops']:8.1f}TF  {r['ratio']:6.2f}  [{r.get('graph_ratio', float('nan')):5.2f}]"
                )
    for sec in ("attention", "logprob", "norm", "rope"):
        for case, r in results.get(sec, {}).items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                lines.append(f"{sec:18s} {case:28s}  ERROR {str(r['error'])[:60]}")
            elif "exact_ms" in r:
                native = r.get("native_ms", r.get("sdpa_ms", float("nan")))
                lines.append(
                    f"{sec:18s} {case:28s}  {r['exact_ms']:8.3f}ms {native:8.3f}ms  {r.get('ratio', float('nan')):6.2f}"
                )
            if "default" in r and "tl" in r:
                for kind in ("default", "tl"):
                    t = r[kind]
                    lines.append(
                        f"{sec:18s} {case + ' ' + kind:28s}  graph {t['graph_ms']:.3f}ms eager {t['eager_ms']:.3f}ms "
                        f"host {t['host_us']:.0f}us"
                    )
            if "paged_ms" in r:
                lines.append(
                    f"{sec:18s} {case:28s}  paged {r['paged_ms']:.3f}ms packed {r['packed_ms']:.3f}ms "
                    f"bitwise {r['bitwise_equal']}"
                )
            if "exact_peak_bytes" in r:
                lines.append(
                    f"{'':18s} {'  peak mem':28s}  {r['exact_peak_bytes'] / 2**20:8.0f}MB "
                    f"{r['native_peak_bytes'] / 2**20:8.0f}MB"
                )
    for case, r in results.get("window", {}).items():
        if isinstance(r, dict) and "exact_window_ms" in r:
            lines.append(
                f"window             {case:28s}  {r['exact_window_ms']:8.3f}ms full {r['exact_full_ms']:8.3f}ms  "
                f"sdpa/exact {r['ratio_vs_sdpa']:5.2f}"
            )
    inv = results.get("matmul_invariance", {})
    for name, r in inv.items():
        if isinstance(r, dict):
            exact, native = r.get("exact_row_M1_eq_M4096"), r.get("native_row_M1_eq_M4096")
            lines.append(f"invariance         {name:6s} exact={exact}  native={native}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ops_h200.json"))
    ap.add_argument("--quick", action="store_true", help="fewer sizes (smoke run)")
    ap.add_argument("--sections", default="matmul,invariance,attention,logprob,norm,rope,window")
    args = ap.parse_args()
    require_cuda("ops_bench.py")
    torch.manual_seed(0)
    results: dict = header("ops_bench", "triton", "transformers")
    results["versions"]["cuda"] = torch.version.cuda
    results |= {
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "notes": "ratio = native_ms / exact_ms (> 1: exact faster). do_bench medians; bf16 unless stated.",
    }
    sections = {
        "matmul": lambda: bench_matmul(args.quick),
        "invariance": check_invariance,
        "attention": lambda: bench_attention(args.quick),
        "logprob": lambda: bench_logprob(args.quick),
        "norm": bench_norm,
        "rope": bench_rope,
        "window": bench_window,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for name in args.sections.split(","):
        key = "matmul_invariance" if name == "invariance" else name
        try:
            results[key] = sections[name]()
        except Exception as e:  # noqa: BLE001
            results[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        torch.cuda.empty_cache()
        results["total_seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(results, indent=2))  # partial results survive a later crash or timeout
        print(f"[ops_bench] {name} done", flush=True)
    print(_table(results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
