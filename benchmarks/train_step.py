"""Trainer speed: stock transformers vs the exact path, forward + backward and a whole GRPO step; writes
``benchmarks/results/train_h200.json``.

    python benchmarks/train_step.py [--section fwd_bwd grpo_step] [--profile] [--host-profile] [--out PATH] [--small]

Sections (each independent: a failure is recorded in the JSON and the run continues):

* ``fwd_bwd``: one Qwen3-1.7B-shaped model (a transformers ``Qwen3Config``, random init, bf16, no download), the same
  random tokens for both paths. (a) stock: padded ``[B, L]`` batch, SDPA attention, bf16 logits materialized, fp32
  ``log_softmax``, gather, sum, backward (what TRL-style trainers do); (b) exact: the same model exactified,
  :func:`rlexact.packed_logprobs` on the packed stream, sum, backward. Median CUDA-event time of several runs after
  warm-up, and ``torch.cuda.max_memory_allocated`` with the peak reset per path (parameters and their gradients
  included in both). Cases: 16 x 1,024 tokens, and 4 x 8,192 tokens with activation checkpointing per decoder layer
  on for both paths (transformers' ``gradient_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint`` around
  every decoder layer; the exactified layers run inside the same wrapper).
* ``grpo_step``: a whole :class:`rlexact.RLModule` GRPO step through a Lightning ``Trainer`` (32 prompts x n = 8 =
  256 sequences of 128 prompt + 256 new tokens, mini-batch 128, micro-batch 16), exact mode (exact rollout,
  ``old_logprob_mode="exact"``) vs native rollout + ``old_logprob_mode="recompute"``. Stage times are measured from
  outside by wrapping ``RLModule.generate`` (rollout), ``RLModule.score_batch`` (scoring) and
  ``rlexact.trainer.update.PPOUpdate.run`` (update) with synchronized timers; the reported step is the second one
  (the first compiles kernels and captures CUDA graphs). The data loader holds exactly one rollout batch per step and
  the ``Trainer`` runs one epoch (``max_steps`` would count optimizer steps: two per rollout step here). With
  ``--profile`` a third step runs its update under the CUDA profiler (``update_profile``: wall time, summed kernel
  time, GPU busy fraction, top kernels) and with ``--host-profile`` one more exact step runs its update under
  ``cProfile`` (``update_host_profile``: the functions with the most own host time, and the library's functions with
  the most cumulative host time); the reported times stay the second step's.

``--small`` runs tiny shapes (a 2-layer model, a few short sequences) on the CPU or GPU to check that the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from common import ROOT, header, require_cuda
from roofline import DecoderShape, device_peaks, update_flops

QWEN3_1_7B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMALL = dict(QWEN3_1_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)  # fmt: skip


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(cfg: dict, seed: int = 0) -> torch.nn.Module:
    """A randomly initialized Qwen3 causal LM in bf16 (fp32 on the CPU), SDPA attention, train mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    config = Qwen3Config(**cfg, attn_implementation="sdpa")
    with torch.device(dev):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.train()


def time_ms(fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` calls (CUDA events on the GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _peak_gb(fn: Callable[[], object]) -> float | None:
    if not torch.cuda.is_available():
        return None
    _sync()
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync()
    return torch.cuda.max_memory_allocated() / 2**30


def stock_step(model: torch.nn.Module, ids: torch.Tensor, grad: bool = True) -> None:
    """Stock transformers: padded batch (all rows full here), SDPA, fp32 log_softmax over the materialized logits."""
    mask = torch.ones_like(ids)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = logp.sum()
        if grad:
            loss.backward()
    model.zero_grad(set_to_none=True)


def exact_step(model: torch.nn.Module, packed, grad: bool = True) -> None:  # noqa: ANN001
    """Exact: packed forward, fused log-prob head, sum, backward."""
    from rlexact import packed_logprobs

    with torch.set_grad_enabled(grad):
        logp, _ = packed_logprobs(model, packed)
        loss = logp.sum()
        if grad:
            loss.backward()
    model.zero_grad(set_to_none=True)


def _fwd_bwd_case(model: torch.nn.Module, ids: torch.Tensor, exact: bool, reps: int) -> dict:
    from rlexact import pack

    packed = pack(list(ids), ids.device)
    step = (lambda g=True: exact_step(model, packed, g)) if exact else (lambda g=True: stock_step(model, ids, g))
    res: dict = {}
    try:
        fwd = time_ms(lambda: step(False), warmup=1, reps=reps)
        res["fwd_nograd_ms"] = statistics.median(fwd)
        times = time_ms(step, warmup=2, reps=reps)
        res.update(fwd_bwd_ms=statistics.median(times), fwd_bwd_all_ms=times, peak_gb=_peak_gb(step))
    except torch.OutOfMemoryError as e:
        res["error"] = f"OutOfMemoryError: {str(e).splitlines()[0]}"
    finally:
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def _set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """transformers' per-decoder-layer activation checkpointing, non-reentrant (``gradient_checkpointing_enable``
    exists in every transformers version this project supports; newer ones also call it activation_checkpointing)."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def bench_fwd_bwd(small: bool, reps: int, cases: list[str], profile: bool = False) -> dict:
    from rlexact import exactify

    cfg = SMALL if small else QWEN3_1_7B
    model = build_model(cfg)
    shapes = {"16x1024": (16, 1024, False), "4x8192_ckpt": (4, 8192, True)}
    if small:
        shapes = {"16x1024": (4, 64, False), "4x8192_ckpt": (2, 256, True)}
    g = torch.Generator().manual_seed(0)
    tokens = {
        k: torch.randint(0, cfg["vocab_size"], (b, s), generator=g).to(_device()) for k, (b, s, _) in shapes.items()
    }
    out: dict = {"model": "Qwen3-1.7B shape, random init" if not small else "tiny Qwen3", "config": cfg}
    # stock first on the unpatched model, then the same model exactified (one copy of the weights)
    results: dict = {k: {"batch": shapes[k][0], "seq_len": shapes[k][1], "checkpointing": shapes[k][2]} for k in cases}
    for exact in (False, True):
        if exact:
            exactify(model)
        for k in cases:
            _set_checkpointing(model, shapes[k][2])
            results[k]["exact" if exact else "stock"] = _fwd_bwd_case(model, tokens[k], exact, reps)
    for r in results.values():
        s, e = r.get("stock", {}), r.get("exact", {})
        if "fwd_bwd_ms" in s and "fwd_bwd_ms" in e:
            r["exact_over_stock_speed"] = s["fwd_bwd_ms"] / e["fwd_bwd_ms"]
            r["exact_over_stock_fwd_nograd_speed"] = s["fwd_nograd_ms"] / e["fwd_nograd_ms"]
        if s.get("peak_gb") and e.get("peak_gb"):
            r["exact_peak_over_stock_peak"] = e["peak_gb"] / s["peak_gb"]
    if any(shapes[k][2] for k in cases):
        out["checkpointing_note"] = (
            "activation checkpointing via transformers' gradient_checkpointing_enable(use_reentrant=False) for both"
            " paths (non-reentrant torch.utils.checkpoint around each decoder layer), enabled by this benchmark"
        )
    out["cases"] = results
    if profile and torch.cuda.is_available():
        from rlexact import pack

        k = cases[0]
        _set_checkpointing(model, shapes[k][2])
        packed = pack(list(tokens[k]), tokens[k].device)
        try:
            out["exact_profile"] = {"case": k, "top_kernels": profile_top(partial(exact_step, model, packed))}
        except Exception as e:  # noqa: BLE001 - the timings above are kept
            out["exact_profile"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def profile_top(fn: Callable[[], object], n: int = 25) -> list[dict]:
    """The ``n`` CUDA kernels with the most total GPU time in one call of ``fn`` (after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    return _top_rows(prof, n)[0]


def _top_rows(prof, n: int) -> tuple[list[dict], float]:  # noqa: ANN001
    """The ``n`` CUDA kernels of a finished profile with the most total GPU time, and the total over all (ms)."""
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in rows) or 1.0
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    top = [
        {"kernel": e.key[:120], "calls": e.count, "ms": e.device_time_total / 1e3, "share": e.device_time_total / total}
        for e in rows[:n]
    ]
    return top, total / 1e3


def profiled_call(fn: Callable, call_index: int, sink: dict) -> Callable:
    """``fn`` with its ``call_index``-th call (0-based) run under the CUDA profiler: ``sink`` gets that call's wall
    time, summed kernel time, their ratio (GPU busy fraction) and top kernels. Other calls run unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    calls = [0]

    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        index, calls[0] = calls[0], calls[0] + 1
        if index != call_index:
            return fn(*args, **kwargs)
        _sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync()
            wall = time.perf_counter() - t0
        top, kernel_ms = _top_rows(prof, 30)
        busy = kernel_ms / 1e3 / wall
        sink.update(wall_s=wall, gpu_kernel_s=kernel_ms / 1e3, gpu_busy_fraction=busy, top_kernels=top)
        sink["idle_gaps"] = idle_gaps(prof)
        return out

    return run


def host_profiled_call(fn: Callable, call_index: int, sink: dict, top: int = 30) -> Callable:
    """``fn`` with its ``call_index``-th call (0-based) run under ``cProfile``: ``sink`` gets that call's wall time
    (inflated by the profiler), the host synchronizations it made (torch's sync debug mode, counted by call site), the
    functions with the most own host time and, among the library's own, the most cumulative host time. The profiled
    call runs its backward passes on the calling thread. Other calls run unprofiled."""
    import cProfile
    import pstats

    calls = [0]

    def rows(stats: dict, key: int, keep: Callable) -> list:
        picked = sorted(((k, v) for k, v in stats.items() if keep(k[0])), key=lambda kv: -kv[1][key])[:top]
        return [
            {"function": f"{'/'.join(Path(f).parts[-2:])}:{line}:{name}", "calls": n, "own_s": own, "cumulative_s": cum}
            for (f, line, name), (_, n, own, cum, _) in picked
        ]

    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        index, calls[0] = calls[0], calls[0] + 1
        if index != call_index:
            return fn(*args, **kwargs)
        _sync()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        # backward on the calling thread (CUDA backward runs on autograd's device thread, which cProfile misses);
        # every synchronizing CUDA call warns (torch's sync debug mode) and is counted by where it was made
        syncs = torch.cuda.is_available()
        with torch.autograd.set_multithreading_enabled(False), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if syncs:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                prof.enable()
                out = fn(*args, **kwargs)
                prof.disable()
            finally:
                if syncs:
                    torch.cuda.set_sync_debug_mode("default")
        _sync()
        stats = pstats.Stats(prof).stats
        sites: dict[str, int] = {}
        for w in caught:
            if "synchronizing" in str(w.message):
                site = f"{'/'.join(Path(w.filename).parts[-2:])}:{w.lineno}"
                sites[site] = sites.get(site, 0) + 1
        sink.update(
            wall_s=time.perf_counter() - t0,
            host_syncs=sum(sites.values()),
            host_sync_sites=dict(sorted(sites.items(), key=lambda kv: -kv[1])),
            top_own=rows(stats, 2, lambda f: True),
            top_cumulative_rlexact=rows(stats, 3, lambda f: "rlexact" in f),
        )
        return out

    return run


def idle_gaps(prof, min_ms: float = 0.2, n: int = 15) -> dict:  # noqa: ANN001
    """Where the GPU sat idle between the first and the last kernel of a finished profile: the total idle time, the
    idle time in gaps of at least ``min_ms``, and the ``n`` longest gaps with the kernels on either side (which tell
    the phase: forward, backward, optimizer) and their offset from the first kernel."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not spans:
        return {}
    gaps, end, last = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append(((start - end) / 1e3, (end - spans[0][0]) / 1e3, last[:60], name[:60]))
        if stop > end:
            end, last = stop, name
    big = [g for g in gaps if g[0] >= min_ms]
    return {
        "window_ms": (end - spans[0][0]) / 1e3,
        "idle_ms": sum(g[0] for g in gaps),
        f"idle_ms_in_gaps_over_{min_ms}ms": sum(g[0] for g in big),
        "gaps_over_min": len(big),
        "longest": [
            {"ms": ms, "at_ms": at, "after": prev, "before": nxt}
            for ms, at, prev, nxt in sorted(gaps, reverse=True)[:n]
        ],
    }


# ----------------------------------------------------------------------------------------------------------------------
# grpo_step
# ----------------------------------------------------------------------------------------------------------------------


REPORTED_STEP = 1
"""The GRPO step whose times are reported (0-based): the first compiles kernels and captures CUDA graphs."""


class IdTokenizer:
    """Decodes token ids as their decimal strings (the reward only needs some text; no download)."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return " ".join(str(int(i)) for i in ids)


def digit_reward(prompts, completions, answers) -> list[float]:  # noqa: ANN001
    """Deterministic, varied rewards (so GRPO advantages are non-zero)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


class StageTimer:
    """Wraps callables with synchronized wall-clock timers; ``times[name]`` lists the seconds of each call."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                self.times.setdefault(name, []).append(time.perf_counter() - t0)

        return timed


def _grpo_run(small: bool, exact: bool, steps: int, profile: bool, host: bool = False) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from rlexact import RLModule
    from rlexact.trainer import update as update_stage

    cfg = SMALL if small else QWEN3_1_7B
    prompts, n, prompt_len, new = (4, 2, 8, 8) if small else (32, 8, 128, 256)
    mini, micro = (4, 2) if small else (128, 16)
    g = torch.Generator().manual_seed(1)
    items = [
        {"prompt_ids": torch.randint(10, cfg["vocab_size"], (prompt_len,), generator=g).tolist(), "answer": "",
         "prompt_text": "", "index": i}
        for i in range(prompts * steps)
    ]  # fmt: skip
    module = RLModule(
        model=build_model(cfg),
        tokenizer=IdTokenizer(),
        reward=digit_reward,
        rollout={"n": n, "max_new_tokens": new, "kernels": "exact" if exact else "native", "stop_token_ids": []},
        algorithm={"objective": "grpo", "mini_batch_size": mini, "micro_batch_size": micro,
                   "old_logprob_mode": "exact" if exact else "recompute"},
        optim={"lr": 1e-6},
    )  # fmt: skip
    timer = StageTimer()
    module.generate = timer.wrap("rollout", module.generate)
    module.score_batch = timer.wrap("scoring", module.score_batch)
    step_times: list[float] = []

    class StepTimer(L.Callback):
        def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
            _sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            _sync()
            step_times.append(time.perf_counter() - self.t0)

    orig_run = update_stage.PPOUpdate.run
    update_profile: dict = {}
    host_profile: dict = {}
    # the steps after the reported one run their update under the CUDA profiler, then under cProfile
    profile = profile and torch.cuda.is_available()
    run = profiled_call(orig_run, REPORTED_STEP + 1, update_profile) if profile else orig_run
    if host:
        run = host_profiled_call(run, REPORTED_STEP + 1 + profile, host_profile)
    update_stage.PPOUpdate.run = timer.wrap("update", run)
    try:
        trainer = L.Trainer(
            max_epochs=1, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[StepTimer()],
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*val_dataloader.*")
            trainer.fit(module, DataLoader(items, batch_size=prompts, collate_fn=list))
    finally:
        update_stage.PPOUpdate.run = orig_run
    reported = {name: ts[REPORTED_STEP] for name, ts in timer.times.items()}
    res = {
        "step_s": step_times[REPORTED_STEP],
        "stages_s": reported,
        "all_steps_s": step_times,
        "all_stages_s": timer.times,
        "sequences": prompts * n,
        "prompt_tokens": prompt_len,
        "new_tokens": new,
        "mini_batch_size": mini,
        "micro_batch_size": micro,
    }
    if update_profile:
        res["update_profile"] = {"step": REPORTED_STEP + 1, **update_profile}
    if host_profile:
        res["update_host_profile"] = {"step": REPORTED_STEP + 1 + profile, **host_profile}
    del module, trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def bench_grpo_step(small: bool, profile: bool, host: bool = False) -> dict:
    out: dict = {"note": "stage times wrap RLModule.generate / score_batch and PPOUpdate.run from outside the module"}
    for name, exact in (("exact", True), ("native_recompute", False)):
        try:
            steps = REPORTED_STEP + 1 + profile + (host and exact)
            out[name] = _grpo_run(small, exact, steps=steps, profile=profile, host=host and exact)
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    if "step_s" in out["exact"] and "step_s" in out["native_recompute"]:
        out["native_recompute_over_exact_time"] = out["native_recompute"]["step_s"] / out["exact"]["step_s"]
        peaks = device_peaks()
        if peaks is not None:
            out["update_bound"] = update_bound(out, SMALL if small else QWEN3_1_7B, peaks)
    return out


GRPO_TARGET_RATIO = 2.5
"""The ``native_recompute_over_exact_time`` that issue 9 asks for; :func:`update_bound` reports the update time it
needs."""


def update_bound(out: dict, cfg: dict, peaks: dict) -> dict:
    """The update's compute bound (:func:`roofline.update_flops` at the peak bf16 throughput) and what it implies for
    ``native_recompute_over_exact_time``: both arms run the same trainer, so with the measured rollout and scoring
    times and an update at the bound, the ratio can be at most ``ratio_at_update_bound``; ``update_s_for_ratio``
    is the update time (the same in both arms) at which the ratio would reach ``target_ratio``."""
    ex, nat = out["exact"], out["native_recompute"]
    seqs, seq_len = ex["sequences"], ex["prompt_tokens"] + ex["new_tokens"]
    flops = update_flops(DecoderShape.of(cfg), [seq_len] * seqs, head_rows=seqs * ex["new_tokens"])
    bound_s = flops / peaks["bf16_dense_flops_per_s"]
    rollout_e = ex["stages_s"]["rollout"]
    rest_n = nat["stages_s"]["rollout"] + nat["stages_s"].get("scoring", 0.0)
    target = GRPO_TARGET_RATIO
    return {
        "model_flops": flops,
        "compute_bound_s": bound_s,
        "exact_update_s": ex["stages_s"]["update"],
        "exact_update_mfu": flops / ex["stages_s"]["update"] / peaks["bf16_dense_flops_per_s"],
        "ratio_at_update_bound": (rest_n + bound_s) / (rollout_e + bound_s),
        "target_ratio": target,
        "update_s_for_ratio": (rest_n - target * rollout_e) / (target - 1.0),
        "note": "model FLOPs of the update (forward + backward, head on the response rows, no recomputation); the"
        " exact rollout and the native rollout + scoring as measured in this run",
        "peaks": peaks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", nargs="*", default=["fwd_bwd", "grpo_step"], choices=["fwd_bwd", "grpo_step"])
    ap.add_argument("--case", nargs="*", default=["16x1024", "4x8192_ckpt"], choices=["16x1024", "4x8192_ckpt"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="fwd_bwd: also record the top GPU kernels of one exact step; grpo_step: run one more step and profile its"
        " update (wall time, GPU busy fraction, top kernels)",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="grpo_step: run one more exact step with its update under cProfile (top host functions)",
    )
    ap.add_argument("--small", action="store_true", help="tiny shapes (smoke test; writes /tmp/train_small.json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.small:
        require_cuda("train_step.py", "--small")
    default = Path("/tmp/train_small.json") if args.small else ROOT / "benchmarks" / "results" / "train_h200.json"
    out_path = Path(args.out) if args.out else default
    res = header("train_step", "triton", "transformers", "lightning")
    for section in args.section:
        t0 = time.perf_counter()
        try:
            if section == "fwd_bwd":
                res[section] = bench_fwd_bwd(args.small, args.reps, args.case, args.profile)
            else:
                res[section] = bench_grpo_step(args.small, args.profile, args.host_profile)
        except Exception as e:  # noqa: BLE001
            res[section] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
        res[section]["seconds"] = time.perf_counter() - t0
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps(_summary(res[section]), default=str), flush=True)
    print(f"wrote {out_path}")


def _summary(section: dict) -> dict:
    """The headline numbers of a section (for the log)."""
    keep = ("exact_over_stock_speed", "exact_peak_over_stock_peak", "native_recompute_over_exact_time", "error")
    out = {k: v for k, v in section.items() if k in keep}
    for k, v in section.get("cases", {}).items():
        out[k] = {kk: vv for kk, vv in v.items() if kk in keep}
        for path in ("stock", "exact"):
            p = v.get(path, {})
            out[k][path] = {kk: p.get(kk) for kk in ("fwd_nograd_ms", "fwd_bwd_ms", "peak_gb", "error") if kk in p}
    for k in ("exact", "native_recompute"):
        if k in section:
            out[k] = {kk: section[k].get(kk) for kk in ("step_s", "stages_s", "error") if kk in section[k]}
    return out


if __name__ == "__main__":
    main()
