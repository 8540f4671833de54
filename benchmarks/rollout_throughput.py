"""Rollout throughput: rlexact exact vs native vs transformers ``generate`` on one randomly initialized model.

Default: a Qwen3-1.7B-shaped bf16 model (random weights), batches 64 and 256, 128 random prompt tokens, 256 new
tokens, EOS ignored, sampling at temperature 1 (top-k/top-p off unless ``--top-k``/``--top-p``; ``--logprobs sampled``
reports the truncated distribution's log-probs, and the spot check scores them the same way). Every section is
timed after a short warm-up call (Triton JIT, cuBLAS handles); a failing section is recorded and the others still
run. Writes ``benchmarks/results/rollout_h200.json`` with the command, hardware, versions, date, tokens/s per engine
and batch, ratios exact/native and exact/hf_generate, generator stats, and an exactness spot check.

    python benchmarks/rollout_throughput.py                 # the H200 benchmark (~4-6 min)
    python benchmarks/rollout_throughput.py --tiny          # CPU smoke run with a tiny config (< 1 min)
    python benchmarks/rollout_throughput.py --profile 32    # also profile 32 exact decode steps per batch
    python benchmarks/rollout_throughput.py --prompt-len 8192 --new-tokens 128 --batches 4 32 --engines exact \
        --name rollout_long_h200                            # long contexts: decode step time per batch
    python benchmarks/rollout_throughput.py --grpo          # 64 prompts x n=8, 512-token prompts, sharing on/off

Transformers' ``generate`` is host-bound and varies from call to call, so ``hf_generate`` is the median of
``--hf-calls`` timed calls after the warm-up (each call's wall under ``walls_s``, the median per decode step under
``ms_per_step``); since its speed follows the host's, ``host_python_loop_ms`` records the time of a fixed pure-Python
loop on the run's host.

Every exact run also times ``generate`` with half the new tokens (same prompts, same warm engine); the difference of
the median walls (``--step-reps`` calls of each, walls kept under ``decode_step_walls_s``) divided by the difference
in new tokens is ``results[batch]["exact"]["decode_step_ms"]``, the wall time of one decode step with prefill and
warm-up removed. Medians, because a call's prefill varies by tens of milliseconds, which a single pair of calls
spreads over the steps. ``kept_engine`` times the same call on a generator that keeps its KV cache and CUDA graphs
between calls (``keep_kv_cache=True``), which leaves out the per-call setup; ``prefill_overlap_off`` times it with
``overlap_prefill=False`` (each eager step read back before the next is launched), beside the default's timed walls
and their ``eager_s_timed_calls``; on CUDA ``empty_cache_each_call`` times it followed by ``torch.cuda.empty_cache()``
(what the generator itself did after every call before it stopped emptying the allocator's cache). On a GPU listed
in ``roofline.PEAKS`` the result also holds ``roofline``, the bound of a decode step at the run's mean context (every
weight and the whole K/V cache read once from HBM, or the step's FLOPs at peak, whichever is longer;
:func:`roofline.decode_step_bound`) and ``decode_step_over_bound``.

``--compare-gather`` adds ``paged_gather_off``: the same call with prefill chunks after earlier keys on the ``tl``
paged kernel instead of gathered into the packed Gluon forward (:mod:`rlexact.ops.kv_gather`), bitwise compared.

``--profile N`` profiles two more exact ``generate`` calls per batch (S and S + N new tokens, S = ``--profile-start``,
default 4, so the profiled steps attend to prompt + S ... prompt + S + N keys) under ``torch.profiler``
and stores their difference per decode step (GPU time per kernel and category, launches, wall time) under
``results[batch]["exact"]["profile"]``. ``profile.host_ms_per_decode_step`` splits the host side of a CUDA-graph
decode step by part (the generator's ``stats["decode_host_s"]``: schedule, prepare, launch, wait, collect,
postprocess, and ``host_total`` = all but ``wait``, the read-back that waits for the device), from the same two
profiled calls; ``host_ms_per_decode_step_unprofiled`` is the same split from the two timed calls without the profiler.
``profile.prefill_call`` holds the kernel time per category of the shorter profiled call, which is mostly prefill.

``--grpo`` runs the GRPO-shaped load instead (``--grpo-prompts`` prompts of ``--prompt-len`` tokens (default 512),
``n = --grpo-n`` samples each, ``--new-tokens`` new tokens): exact generation with the prompt blocks shared by the
``n`` samples and prefix caching, their decode tiles read once per group of samples (``shared``), the same with them
read once per sample (``shared_prefix_decode_off``), and with neither sharing nor prefix caching (``unshared``), each
with tokens/s, decode step time, prompt tokens requested / prefilled / shared by siblings / taken from the prefix
cache, and a bitwise check that all three give the same completions. ``--shared-prefix N`` makes the first N tokens
of every prompt the same (a system prompt). Default output ``benchmarks/results/rollout_grpo_h200.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

import rlexact
from common import ROOT, header, require_cuda
from rlexact.models.truncation import LOGPROB_MODES
from rlexact.ops import kv_gather, triton_matmul
from rlexact.rollout import Generator, GeneratorConfig, SamplingParams
from roofline import DecoderShape, decode_step_bound, device_peaks

GEMMA3_1B = dict(
    vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
)  # fmt: skip
"""Gemma 3 1B's text config (``--arch gemma3``): five sliding-window layers to one full-attention layer."""
MODEL_NAMES = {"qwen3": "Qwen3-1.7B shape (random init)", "gemma3": "Gemma 3 1B shape (random init)"}


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

    if getattr(args, "arch", "qwen3") == "gemma3":  # other scripts build with their own arguments
        layers = args.layers or GEMMA3_1B["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        cfg = Gemma3TextConfig(**(GEMMA3_1B | {"num_hidden_layers": layers, "layer_types": types}))
        cls = Gemma3ForCausalLM
    elif args.tiny:
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(
            vocab_size=1003, hidden_size=64, intermediate_size=160, num_hidden_layers=args.layers or 2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            tie_word_embeddings=True,
        )  # fmt: skip
    else:
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=args.layers or 28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


KERNEL_CATEGORIES = (  # (category, substrings of the lower-cased kernel name), first match wins
    ("matmul", ("_mm_", "_grouped_", "_split_sum_", "gemm", "sm90_xmma", "cutlass", "nvjet")),
    ("attention", ("attn", "flash", "fmha", "_pair_kernel", "_fwd_kernel")),  # the Gluon prefill kernels last two
    ("lm_head_logprob", ("logprob", "lm_head", "_lse", "_head_")),
    ("sampler", ("sample", "gumbel", "argmax", "_top_p_", "_segment_kernel", "_select_kernel")),
    ("rotary_kv_write", ("rotary", "rope", "write_kv", "_kv_")),  # before "norm": _qk_norm_rope_kernel
    ("norm", ("norm",)),
    ("gated_mul", ("silu", "gated_mul", "gelu")),
    ("moe_routing", ("_router_", "_combine_")),
    ("backward_reduction", ("_column_sum_",)),
)
"""Every kernel the library defines falls in a category other than ``"other"``
(``tests/test_benchmark_scripts.py::test_every_library_kernel_has_a_profile_category``)."""


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def host_snapshot(gen: Generator) -> tuple[dict[str, float], int]:
    """The generator's per-part host seconds of CUDA-graph decode steps and their count, after its last call."""
    return dict(gen.stats.get("decode_host_s") or {}), int(gen.stats.get("graph_steps") or 0)


def host_per_step(long: tuple[dict[str, float], int], short: tuple[dict[str, float], int]) -> dict | None:
    """Milliseconds per graph decode step and part: the difference of two calls that differ only in new tokens."""
    steps = long[1] - short[1]
    if steps <= 0:
        return None
    per = {k: (v - short[0].get(k, 0.0)) / steps * 1e3 for k, v in long[0].items()}
    per["host_total"] = sum(v for k, v in per.items() if k != "wait")
    per["graph_steps"] = steps
    return per


def sampling(args, new_tokens: int, seed: int, n: int = 1) -> SamplingParams:
    """The timed calls' sampling: temperature 1, EOS ignored, ``--top-k`` / ``--top-p`` (off by default),
    ``--logprobs``."""
    return SamplingParams(
        max_new_tokens=new_tokens,
        temperature=1.0,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=seed,
        ignore_eos=True,
        n=n,
        logprobs=args.logprobs,
    )


def _kernel_times(gen: Generator, prompts, new_tokens: int, args, device) -> tuple[dict[str, list[float]], float]:
    """``({kernel: [gpu_ms, calls]}, wall_s)`` of one profiled exact ``generate`` with ``new_tokens`` new tokens;
    ``wall_s`` leaves out the call's CUDA-graph captures (``stats["capture_s"]``), which vary from call to call."""
    from torch.profiler import ProfilerActivity, profile

    params = sampling(args, new_tokens, seed=2)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        gen.generate(prompts, params)
        sync(device)
        wall = time.perf_counter() - t0 - float(gen.stats.get("capture_s") or 0.0)
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(ev.name, [0.0, 0])
            entry[0] += ev.device_time_total / 1e3
            entry[1] += 1
    return kernels, wall


def profile_decode(gen: Generator, prompts, args, device) -> dict:
    """GPU time per decode step and kernel: two profiled exact ``generate`` calls with ``S = args.profile_start`` and
    ``S + args.profile`` new tokens (same prompts, so the same prefill and graph captures); their difference divided
    by ``args.profile`` is the cost of one decode step, with the prefill and warm-up removed. Both lengths run once
    unmeasured first: the first profiled call pays the profiler's own start-up, and a length's first call captures
    its decode graph after an eager warm-up step (its block-table width is new to the generator), which later calls
    skip; the measured calls' warm-up steps are recorded (``warm_up_steps``, expected zero)."""
    start = args.profile_start
    for new_tokens in (start, start + args.profile):
        _kernel_times(gen, prompts, new_tokens, args, device)
    short, wall_short = _kernel_times(gen, prompts, start, args, device)
    host_short = host_snapshot(gen)
    warm_short = int(gen.stats.get("graph_captures_warmed") or 0)
    long, wall_long = _kernel_times(gen, prompts, start + args.profile, args, device)
    host_long = host_snapshot(gen)
    warm_long = int(gen.stats.get("graph_captures_warmed") or 0)
    steps = args.profile
    per_step = {n: ((long[n][0] - short.get(n, [0.0, 0])[0]) / steps, (long[n][1] - short.get(n, [0, 0])[1]) / steps)
                for n in long}  # fmt: skip
    cats: dict[str, float] = {}
    for name, (ms, _) in per_step.items():
        cat = kernel_category(name)
        cats[cat] = cats.get(cat, 0.0) + ms
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:30]
    gpu_ms = sum(v[0] for v in per_step.values())
    wall_ms = (wall_long - wall_short) / steps * 1e3
    prefill_cats: dict[str, float] = {}
    for name, (ms, _) in short.items():
        prefill_cats[kernel_category(name)] = prefill_cats.get(kernel_category(name), 0.0) + ms
    return {
        "decode_steps": steps,
        "first_step_keys": args.prompt_len + start,
        "warm_up_steps": {"short": warm_short, "long": warm_long},
        "wall_ms_per_decode_step": wall_ms,
        "gpu_kernel_ms_per_decode_step": gpu_ms,
        "gpu_busy_fraction": gpu_ms / wall_ms if wall_ms > 0 else None,
        "kernel_launches_per_decode_step": sum(v[1] for v in per_step.values()),
        "category_ms_per_decode_step": {k: v for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels_per_decode_step": [
            {"name": n[:160], "ms": ms, "calls": c, "category": kernel_category(n)} for n, (ms, c) in top
        ],
        "host_ms_per_decode_step": host_per_step(host_long, host_short),
        "prefill_call": {
            "new_tokens": start,
            "wall_ms": wall_short * 1e3,
            "gpu_kernel_ms": sum(v[0] for v in short.values()),
            "category_ms": {k: v for k, v in sorted(prefill_cats.items(), key=lambda kv: -kv[1])},
            "note": "the shorter profiled call: the prefill of every prompt and its first decode steps",
        },
        "note": "profiler-on timings; kernel durations from CUPTI (CUDA-graph replays included)",
    }


def make_generator(
    model, kernels: str, batch: int, args, *, share: bool = True, keep: bool = False, overlap_prefill: bool = True,
    prefix_decode: bool = True,
) -> Generator:  # fmt: skip
    return Generator(
        model,
        kernels=kernels,
        max_num_seqs=batch,
        max_num_batched_tokens=args.batched_tokens or max(GeneratorConfig.max_num_batched_tokens, 2 * batch),
        cuda_graphs=not args.no_graphs,
        share_prompt_blocks=share,
        prefix_caching=share,
        keep_kv_cache=keep,
        overlap_prefill=overlap_prefill,
        shared_prefix_decode=prefix_decode,
    )


def timed_generate(
    gen: Generator, prompts, params: SamplingParams, device, after: Callable[[], None] | None = None
) -> tuple[float, list]:
    """``(wall seconds, completions)`` of one synchronized ``generate`` call (and ``after()``, timed with it)."""
    sync(device)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, params)
    if after is not None:
        after()
    sync(device)
    return time.perf_counter() - t0, outs


def same_completions(a: list, b: list) -> bool:
    """Whether two ``generate`` results have the same tokens and bitwise the same log-probs."""
    return len(a) == len(b) and all(
        x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b)
    )


def repeated_calls(
    gen: Generator, prompts, args, device, reference: list, n: int, after: Callable[[], None] | None = None
) -> dict:
    """``1 + --step-reps`` timed ``generate`` calls of ``--new-tokens`` on ``gen`` (each followed by ``after()`` in
    its wall): the median of the calls after the first (which may allocate, compile and capture), every call's wall
    (``walls_s``) and eager seconds (``eager_s``), and whether the last call's completions equal ``reference``
    (``same_as_default``)."""
    params = sampling(args, args.new_tokens, seed=0, n=n)
    walls, eager = [], []
    for _ in range(1 + args.step_reps):
        wall, outs = timed_generate(gen, prompts, params, device, after)
        walls.append(wall)
        eager.append(gen.stats.get("eager_s"))
    tokens = sum(len(o.token_ids) for o in outs)
    seconds = statistics.median(walls[1:])
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "walls_s": walls,
        "eager_s": eager,
        "same_as_default": same_completions(outs, reference),
    }


def kept_engine(model, kernels: str, prompts, args, device, reference: list, *, n: int, share: bool) -> dict:
    """The same ``generate`` call on a generator that keeps its KV cache, CUDA graphs and fused weights between calls
    (``keep_kv_cache=True``): the steady state without the per-call setup (cache allocation, graph capture).
    ``same_as_default``: its last call's completions (tokens and log-probs) equal ``reference`` exactly."""
    gen = make_generator(model, kernels, len(prompts) * n, args, share=share, keep=True)
    res = repeated_calls(gen, prompts, args, device, reference, n)
    gen.release()
    del res["eager_s"]
    return res | {
        "capture_s_last_call": gen.stats.get("capture_s"),
        "note": "keep_kv_cache=True; median of the calls after the first",
    }


def prefill_overlap_off(model, prompts, args, device, reference: list, *, n: int, share: bool) -> dict:
    """The same ``generate`` call with ``overlap_prefill=False`` (every eager step read back before the next is
    launched), side by side with the default's ``decode_step_walls_s["long"]``: one warm-up call, then
    ``--step-reps`` timed calls. ``same_as_default``: the last call's completions equal ``reference`` exactly."""
    gen = make_generator(model, "exact", len(prompts) * n, args, share=share, overlap_prefill=False)
    return timed_calls_only(gen, prompts, args, device, reference, n, "overlap_prefill=False")


def empty_cache_each_call(model, prompts, args, device, reference: list, *, n: int, share: bool) -> dict:
    """The default ``generate`` call followed by ``torch.cuda.empty_cache()`` in each call's wall (what every call
    did before the generator stopped emptying the allocator's cache): one warm-up call, then ``--step-reps`` timed
    calls, side by side with the default's ``decode_step_walls_s["long"]``."""
    gen = make_generator(model, "exact", len(prompts) * n, args, share=share)
    res = timed_calls_only(gen, prompts, args, device, reference, n, "torch.cuda.empty_cache() after each call",
                           after=torch.cuda.empty_cache)  # fmt: skip
    return res | {"release_s_last_call": gen.stats.get("release_s")}


def timed_calls_only(gen: Generator, prompts, args, device, reference: list, n: int, setting: str,
                     after: Callable[[], None] | None = None) -> dict:  # fmt: skip
    """:func:`repeated_calls` on a side-by-side variant's generator, keeping only the timed calls' walls and eager
    seconds, with a note naming the ``setting`` that differs from the default."""
    res = repeated_calls(gen, prompts, args, device, reference, n, after)
    res["walls_s"], res["eager_s"] = res["walls_s"][1:], res["eager_s"][1:]
    return res | {"note": f"{setting}; median of the timed calls"}


def paged_gather_off(model, prompts, args, device, reference: list, *, n: int, share: bool) -> dict:
    """The same ``generate`` call with no paged launch gathered (:mod:`rlexact.ops.kv_gather`: prefill chunks after
    earlier keys run the ``tl`` paged kernel), side by side with the default's timed walls: one warm-up call, then
    ``--step-reps`` timed calls. ``same_as_default``: the last call's completions equal ``reference`` exactly."""
    with mock.patch.object(kv_gather, "MIN_MEAN_QUERIES", sys.maxsize):
        gen = make_generator(model, "exact", len(prompts) * n, args, share=share)
        setting = "kv_gather.MIN_MEAN_QUERIES patched to sys.maxsize"
        return timed_calls_only(gen, prompts, args, device, reference, n, setting)


def run_rlexact(
    model, kernels: str, prompts, args, device, *, n: int = 1, share: bool = True, decode_step: bool = True,
    prefix_decode: bool = True,
) -> tuple[dict, list]:  # fmt: skip
    gen = make_generator(model, kernels, len(prompts) * n, args, share=share, prefix_decode=prefix_decode)

    def timed(new_tokens: int, seed: int) -> tuple[float, list]:
        params = sampling(args, new_tokens, seed=seed, n=n)
        return timed_generate(gen, prompts, params, device)

    timed(args.new_tokens, 0)  # warm-up: the timed call itself (Triton JIT, KV cache of the same size, graphs)
    elapsed, outs = timed(args.new_tokens, 0)
    host_long = host_snapshot(gen)
    tokens = sum(len(o.token_ids) for o in outs)
    stats = {k: v for k, v in gen.stats.items() if isinstance(v, (int, float, str, bool)) or v is None}
    res = {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "stats": stats}
    res["eager_host_s"] = gen.stats.get("eager_host_s")
    half = args.new_tokens // 2
    host_short = None
    eager_walls = [gen.stats.get("eager_s")]
    if decode_step and half >= 1 and kernels == "exact":
        longs = [elapsed]
        for _ in range(args.step_reps - 1):
            longs.append(timed(args.new_tokens, 0)[0])
            eager_walls.append(gen.stats.get("eager_s"))
        timed(half, 0)  # its own warm-up: a narrower block table can specialize (compile) kernels anew
        shorts = [timed(half, 0)[0] for _ in range(args.step_reps)]
        host_short = host_snapshot(gen)
        res["decode_step_ms"] = (statistics.median(longs) - statistics.median(shorts)) / (args.new_tokens - half) * 1e3
        res["decode_step_note"] = (
            f"(median wall({args.new_tokens} new) - median wall({half} new)) / {args.new_tokens - half}, "
            f"{args.step_reps} calls each"
        )
        res["decode_step_walls_s"] = {"long": longs, "short": shorts}
        peaks = device_peaks()
        if peaks is not None:
            elem = next(model.parameters()).element_size()
            mean_ctx = args.prompt_len + args.new_tokens / 2
            bound = decode_step_bound(DecoderShape.of(model.config), len(prompts) * n, mean_ctx, elem, peaks)
            res["roofline"] = bound
            res["decode_step_over_bound"] = res["decode_step_ms"] / bound["decode_step_bound_ms"]
    if decode_step and kernels == "exact":
        res["eager_s_timed_calls"] = eager_walls
        try:
            res["prefill_overlap_off"] = prefill_overlap_off(model, prompts, args, device, outs, n=n, share=share)
        except Exception:  # noqa: BLE001
            res["prefill_overlap_off_error"] = traceback.format_exc()
        try:
            res["kept_engine"] = kept_engine(model, kernels, prompts, args, device, outs, n=n, share=share)
        except Exception:  # noqa: BLE001
            res["kept_engine_error"] = traceback.format_exc()
        if device.type == "cuda":
            try:
                res["empty_cache_each_call"] = empty_cache_each_call(model, prompts, args, device, outs, n=n,
                                                                     share=share)  # fmt: skip
            except Exception:  # noqa: BLE001
                res["empty_cache_each_call_error"] = traceback.format_exc()
        if args.compare_gather:
            try:
                res["paged_gather_off"] = paged_gather_off(model, prompts, args, device, outs, n=n, share=share)
            except Exception:  # noqa: BLE001
                res["paged_gather_off_error"] = traceback.format_exc()
    if args.profile and kernels == "exact":
        try:
            res["profile"] = profile_decode(gen, prompts, args, device)
            if host_short is not None:
                res["profile"]["host_ms_per_decode_step_unprofiled"] = host_per_step(host_long, host_short)
        except Exception:  # noqa: BLE001
            res["profile_error"] = traceback.format_exc()
    return res, outs


def run_grpo(model, args, device, result: dict) -> None:
    """The GRPO-shaped load with shared prompt blocks (their decode tiles read once per group of samples), with
    shared blocks read once per sample (``shared_prefix_decode=False``), and with neither sharing nor prefix caching:
    the same completions, bitwise."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.grpo_prompts, args.prompt_len), generator=g).tolist()
    prefix = prompts[0][: args.shared_prefix]
    prompts = [prefix + p[len(prefix) :] for p in prompts]
    grpo: dict = {"prompts": args.grpo_prompts, "n": args.grpo_n, "shared_prefix_tokens": len(prefix)}
    result["results"]["grpo"] = grpo
    outs = {}
    for name, share, prefix_decode in (("shared", True, True), ("shared_prefix_decode_off", True, False),
                                       ("unshared", False, False)):  # fmt: skip
        print(f"[rollout_throughput] grpo {name} ...", flush=True)
        r, outs[name] = run_rlexact(model, "exact", prompts, args, device, n=args.grpo_n, share=share,
                                    prefix_decode=prefix_decode)  # fmt: skip
        st = r["stats"]
        r["prompt_tokens_requested"] = st["prompt_tokens"]
        r["prompt_tokens_prefilled"] = st["prefill_tokens"]
        r["prompt_tokens_shared"] = st["shared_prompt_tokens"]
        r["prompt_tokens_prefix_cached"] = st["prefix_cached_tokens"]
        grpo[name] = r
        print(f"[rollout_throughput] grpo {name}: {r['tokens_per_s']:,.0f} tok/s, prompt tokens prefilled "
              f"{r['prompt_tokens_prefilled']:,} of {r['prompt_tokens_requested']:,}", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    grpo["speedup_shared_over_unshared"] = grpo["shared"]["tokens_per_s"] / grpo["unshared"]["tokens_per_s"]
    grpo["speedup_prefix_decode"] = (
        grpo["shared"]["tokens_per_s"] / grpo["shared_prefix_decode_off"]["tokens_per_s"]
    )
    grpo["same_completions_bitwise"] = same_completions(outs["shared"], outs["unshared"]) and same_completions(
        outs["shared"], outs["shared_prefix_decode_off"]
    )
    grpo["exactness_spot_check"] = spot_check(model, outs["shared"], args)


def run_hf(model, prompts, args, device) -> dict:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=None,
        pad_token_id=0,
    )
    rlexact.exactify(model, enabled=False)  # the stock transformers model (sdpa), same weights
    try:
        with torch.no_grad():
            warm = min(8, args.new_tokens)
            model.generate(ids, max_new_tokens=warm, min_new_tokens=warm, **kw)
            sync(device)
            walls = []
            for _ in range(args.hf_calls):
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kw)
                sync(device)
                walls.append(time.perf_counter() - t0)
    finally:
        rlexact.exactify(model)
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    elapsed = statistics.median(walls)
    return {"tokens": int(tokens), "seconds": elapsed, "tokens_per_s": tokens / elapsed, "walls_s": walls,
            "ms_per_step": elapsed * 1e3 / args.new_tokens}  # fmt: skip


def host_loop_ms(reps: int = 5) -> float:
    """The median time of a fixed pure-Python loop: the host's single-thread speed, which bounds ``generate``'s
    per-step Python work (compare runs on different hosts by it)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sum(i * i for i in range(200_000))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


SPOT_CHECK_TOKENS = 65536
"""Most tokens the exactness spot check scores in one trainer forward (at least one completion is checked)."""


def spot_check(model, outs, args, k: int = 4) -> dict:
    """Up to ``k`` completions' log-probs against the trainer's (under truncation with ``--logprobs sampled``); each
    unequal completion is listed with its first mismatched positions, tokens and both log-probs."""
    sub = outs[: max(1, min(k, SPOT_CHECK_TOKENS // len(outs[0].sequence)))]
    trunc = dict(top_k=args.top_k, top_p=args.top_p) if args.logprobs == "sampled" else {}
    ref = rlexact.sequence_logprobs(model, [o.sequence for o in sub], **trunc)
    mismatches, diffs = [], []
    for i, (o, r) in enumerate(zip(sub, ref)):
        trainer = r[-len(o.token_ids) :].cpu()
        diffs.append((o.logprobs - trainer).abs().max().item())
        if not torch.equal(o.logprobs, trainer):
            unequal = o.logprobs != trainer
            pos = unequal.nonzero().flatten().tolist()[:16]
            mismatches.append({
                "completion": i, "positions": pos, "mismatched": int(unequal.sum()),
                "tokens": [o.token_ids[p] for p in pos], "rollout": o.logprobs[pos].tolist(),
                "trainer": trainer[pos].tolist(),
            })  # fmt: skip
    return {"completions": len(sub), "all_bitwise_equal": not mismatches, "max_abs_diff": max(diffs),
            "mismatches": mismatches}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 64 256; tiny: 4 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens per sequence (default 256)")
    ap.add_argument("--prompt-len", type=int, default=None, help="random prompt tokens (default 128)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke run)")
    ap.add_argument("--arch", choices=["qwen3", "gemma3"], default="qwen3",
                    help="qwen3: Qwen3-1.7B's shape (default; --tiny: a tiny Qwen3); gemma3: Gemma 3 1B's")  # fmt: skip
    ap.add_argument("--engines", nargs="+", default=["exact", "native", "hf_generate"])
    ap.add_argument("--no-graphs", action="store_true", help="disable CUDA graphs in the rlexact engines")
    ap.add_argument("--hf-calls", type=int, default=3,
                    help="timed transformers generate calls per batch; the median is reported (default 3)")  # fmt: skip
    ap.add_argument(
        "--step-reps", type=int, default=3, help="timed calls of each length for decode_step_ms (median, default 3)"
    )
    ap.add_argument("--profile", type=int, default=0, help="profile an exact generate of N new tokens per batch")
    ap.add_argument("--profile-start", type=int, default=4, help="new tokens of the shorter profiled call (default 4)")
    ap.add_argument(
        "--batched-tokens", type=int, default=0, help="max_num_batched_tokens (default: the library's or 2 * batch)"
    )
    ap.add_argument(
        "--compare-gather", action="store_true", help="also time the exact call with no paged launch gathered"
    )
    ap.add_argument("--top-k", type=int, default=0, help="sampling top-k of every engine (default 0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampling top-p of every engine (default 1: off)")
    ap.add_argument("--logprobs", choices=LOGPROB_MODES, default="full", help="log-probs the rlexact engines report")
    ap.add_argument("--note", default=None, help="free-text note stored in the JSON (e.g. local patches)")
    ap.add_argument("--grpo", action="store_true", help="the GRPO-shaped load with and without prompt sharing")
    ap.add_argument("--grpo-prompts", type=int, default=64, help="prompts of the GRPO load (default 64)")
    ap.add_argument("--grpo-n", type=int, default=8, help="samples per prompt of the GRPO load (default 8)")
    ap.add_argument(
        "--shared-prefix", type=int, default=0, help="GRPO load: the first N prompt tokens are the same in every prompt"
    )
    ap.add_argument(
        "--gated-cublas-rows", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"),
        help="row counts at which gated_matmul takes its cuBLAS route (default: the library's GATED_CUBLAS_ROWS; "
        "1 0: never), for a side-by-side of the route",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="output JSON (default benchmarks/results/rollout_h200.json)")
    ap.add_argument("--name", default=None, help="output benchmarks/results/NAME.json (when --out is not given)")
    args = ap.parse_args()
    if args.step_reps < 1:
        ap.error(f"--step-reps must be at least 1, got {args.step_reps}")
    if args.profile_start < 1:
        ap.error(f"--profile-start must be at least 1, got {args.profile_start}")
    if args.hf_calls < 1:
        ap.error(f"--hf-calls must be at least 1, got {args.hf_calls}")
    if args.gated_cublas_rows is not None and min(args.gated_cublas_rows) < 0:
        ap.error(f"--gated-cublas-rows takes row counts >= 0 (1 0 for never), got {args.gated_cublas_rows}")
    if args.tiny and args.arch != "qwen3":
        ap.error("--tiny builds a tiny Qwen3; leave --arch at qwen3 with it")
    if not args.tiny:
        require_cuda("rollout_throughput.py", "--tiny")
    args.batches = args.batches or ([4, 16] if args.tiny else [64, 256])
    args.new_tokens = args.new_tokens or (16 if args.tiny else 256)
    args.prompt_len = args.prompt_len or (16 if args.tiny else (512 if args.grpo else 128))
    default = "rollout_tiny" if args.tiny else ("rollout_grpo_h200" if args.grpo else "rollout_h200")
    out_path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"{args.name or default}.json"

    if args.gated_cublas_rows is not None:
        triton_matmul.GATED_CUBLAS_ROWS = tuple(args.gated_cublas_rows)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict = header("rollout_throughput", "triton", "transformers") | {
        "setup": {
            "model": "tiny Qwen3" if args.tiny else MODEL_NAMES[args.arch],
            "dtype": str(dtype).replace("torch.", ""),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "batches": "grpo" if args.grpo else args.batches,
            "sampling": (
                f"temperature 1, top_k {args.top_k}, top_p {args.top_p:g}, logprobs {args.logprobs}, EOS ignored"
            ),
            "cuda_graphs": not args.no_graphs,
            "max_num_batched_tokens": args.batched_tokens or "max(GeneratorConfig default, 2 * batch)",
            "profile_new_tokens": args.profile,
            "profile_start": args.profile_start,
            "compare_gather": args.compare_gather,
            "gated_cublas_rows": list(triton_matmul.GATED_CUBLAS_ROWS),
        },
        "results": {},
        "errors": {},
    }
    if args.note:
        result["note"] = args.note
    result["host_python_loop_ms"] = host_loop_ms()
    t_start = time.perf_counter()
    try:
        model = build_model(args, device, dtype)
        result["setup"]["layers"] = model.config.num_hidden_layers
        result["setup"]["params"] = sum(p.numel() for p in model.parameters())
        rlexact.exactify(model)
    except Exception:  # noqa: BLE001
        result["errors"]["build_model"] = traceback.format_exc()
        write(out_path, result)
        return 1

    vocab = model.config.vocab_size
    if args.grpo:
        try:
            run_grpo(model, args, device, result)
        except Exception:  # noqa: BLE001
            result["errors"]["grpo"] = traceback.format_exc()
            print(f"[rollout_throughput] grpo FAILED\n{result['errors']['grpo']}", flush=True)
        args.batches = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g).tolist()
        res: dict = {}
        result["results"][str(batch)] = res
        exact_outs = native_outs = None
        for engine in args.engines:
            key = f"{engine}@{batch}"
            print(f"[rollout_throughput] {key} ...", flush=True)
            try:
                if engine in ("exact", "native"):
                    r, outs = run_rlexact(model, engine, prompts, args, device)
                    if engine == "exact":
                        exact_outs = outs
                    else:
                        native_outs = outs
                else:
                    r = run_hf(model, prompts, args, device)
                res[engine] = r
                print(f"[rollout_throughput] {key}: {r['tokens_per_s']:,.0f} tok/s ({r['seconds']:.2f} s)", flush=True)
            except Exception:  # noqa: BLE001
                result["errors"][key] = traceback.format_exc()
                print(f"[rollout_throughput] {key} FAILED\n{result['errors'][key]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        tps = {k: v["tokens_per_s"] for k, v in res.items()}
        if "exact" in tps and "native" in tps:
            res["ratio_exact_over_native"] = tps["exact"] / tps["native"]
        if "exact" in tps and "hf_generate" in tps:
            res["ratio_exact_over_hf_generate"] = tps["exact"] / tps["hf_generate"]
        for name, outs in (("exactness_spot_check", exact_outs), ("native_spot_check", native_outs)):
            if outs is None:
                continue
            try:
                res[name] = spot_check(model, outs, args)
            except Exception:  # noqa: BLE001
                result["errors"][f"{name}@{batch}"] = traceback.format_exc()
        write(out_path, result)  # partial results survive a later crash
    result["total_seconds"] = time.perf_counter() - t_start
    write(out_path, result)
    summary = {
        b: {k: (v.get("tokens_per_s", v) if isinstance(v, dict) else v) for k, v in r.items()}
        for b, r in result["results"].items()
    }
    print(json.dumps(summary, indent=1, default=str))
    return 0 if not result["errors"] else 1


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
