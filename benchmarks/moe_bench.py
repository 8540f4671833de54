"""Exact Mixture-of-Experts vs stock paths at Qwen3-30B-A3B shapes; writes ``benchmarks/results/moe_h200.json``.

    python benchmarks/moe_bench.py                 # the H200 benchmark
    python benchmarks/moe_bench.py --small         # CPU smoke run: tiny shapes, a few tokens (< 1 min)
    python benchmarks/moe_bench.py --sweep         # grouped-GEMM configuration sweep (H200, about 3 min)
    TRITON_INTERPRET=1 python benchmarks/moe_bench.py --sweep --small   # its CPU smoke run

Sections (independent: a failure is recorded in the JSON and the run continues):

* ``gemm``: the expert GEMMs alone on expert-sorted rows (gate_up ``[E, 2I, H]`` and down ``[E, H, I]``):
  the exact grouped GEMM (:func:`rlexact.ops.grouped_matmul`, its routing plan included) vs
  ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` (whichever the torch build provides; recorded as
  ``stock_grouped_mm``), a torch per-expert loop of ``mm`` calls, and a dense ``bmm`` over
  experts padded to the largest expert load.
* ``layer``: the whole MoE layer (router + experts + combine), T = 1, 64, 1024, 16384 tokens, bf16: exact
  (:func:`rlexact.ops.moe_router` + :func:`rlexact.ops.moe_experts`) vs transformers' block with
  ``config._experts_implementation = "grouped_mm"`` (its default, built on the stock grouped GEMM) vs ``"eager"``
  (its per-expert loop); forward, and forward + backward at the largest T. ``exact_over_grouped_mm_speed`` =
  grouped_mm time / exact time (> 1: exact is faster). Also a bitwise spot check: rows of the largest T equal the
  same rows computed alone.
* ``rollout``: generator throughput (tokens/s), exact vs native, on a model with Qwen3-30B-A3B layers and fewer of
  them (``--rollout-layers``), batch ``--batch``, ``--prompt-len`` random prompt tokens, ``--new-tokens`` new tokens;
  plus a bitwise rollout == trainer spot check of the exact run.
* ``sweep`` (only with ``--sweep``, alone; writes ``moe_sweep_h200.json``): the grouped-GEMM launch configurations of
  :func:`rlexact.ops.triton_moe.grouped_candidates` (BM, BN, BK, warps, stages, program order, TMA weight loads) for
  gate_up and down at T = 1024 and 16384 (``--tokens``): CUDA-graph time, speed vs the stock grouped GEMM, and
  bitwise equality with the reference candidate; a ranked table per T and the line to put in the row-class table.
* ``train_step``: one REINFORCE-style step on packed rollouts of the same model (forward with grad, backward, AdamW):
  exact vs native seconds.

Layer timings are medians of ``triton.testing.do_bench`` on GPU (perf_counter medians on CPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import rlexact
from common import ROOT, header, require_cuda
from rlexact import ops
from rlexact.rollout import Generator, SamplingParams

A3B = dict(hidden=2048, experts=128, top_k=8, moe_inter=768, heads=32, kv_heads=4, head_dim=128, vocab=151936)
SMALL = dict(hidden=64, experts=16, top_k=4, moe_inter=32, heads=4, kv_heads=2, head_dim=16, vocab=512)


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of ``fn``: ``do_bench`` on GPU, wall clock on CPU."""
    if device.type == "cuda":
        from common import bench

        return bench

    def cpu_bench(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_bench


def stock_grouped_mm() -> tuple[str, Callable] | None:
    """The stock grouped GEMM of this torch build (``a [S, K] @ b[e] [K, N]`` over row groups ending at ``offs``)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is not None:
        return "torch.nn.functional.grouped_mm", fn
    fn = getattr(torch, "_grouped_mm", None)
    return ("torch._grouped_mm", fn) if fn is not None else None


def moe_config(shape: dict, layers: int, impl: str):  # noqa: ANN201 - a Qwen3MoeConfig
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=6144 if shape is A3B else 96,
        moe_intermediate_size=shape["moe_inter"], num_hidden_layers=layers, num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], norm_topk_prob=True, max_position_embeddings=4096,
        tie_word_embeddings=False, rope_theta=1000000.0,
    )  # fmt: skip
    cfg._experts_implementation = impl
    return cfg


def _sorted_rows(t: int, shape: dict, device: torch.device, dtype: torch.dtype, k_dim: int):
    """Random expert-sorted rows for ``t`` tokens routed uniformly at random to ``top_k`` distinct experts."""
    e, k = shape["experts"], shape["top_k"]
    ids = torch.rand(t, e, device=device).topk(k, dim=-1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    x = torch.randn(t * k, k_dim, device=device, dtype=dtype)
    return x, ids.reshape(-1).sort(stable=True).values, counts


def _gemm_entry(tm: Callable, stock: tuple[str, Callable] | None, x, w, eids, counts) -> dict:  # noqa: ANN001
    """Timings of one expert GEMM shape: exact grouped GEMM vs stock grouped GEMM vs per-expert loop vs padded bmm."""
    e = w.shape[0]
    entry: dict = {"exact_ms": tm(lambda: ops.grouped_matmul(x, w, eids))}  # routing plan included
    if stock is not None:
        wt, ends = w.transpose(1, 2), torch.cumsum(counts, 0).to(torch.int32)  # [E, K, N], group ends
        try:
            entry["stock_grouped_mm_ms"] = tm(lambda: stock[1](x, wt, offs=ends))
        except Exception as exc:  # noqa: BLE001
            entry["stock_grouped_mm_error"] = f"{type(exc).__name__}: {exc}"
    bounds = [0, *torch.cumsum(counts, 0).tolist()]

    def loop() -> None:
        for ex in range(e):
            if bounds[ex + 1] > bounds[ex]:
                torch.mm(x[bounds[ex] : bounds[ex + 1]], w[ex].T)

    entry["torch_loop_ms"] = tm(loop)
    xp = torch.zeros(e, int(counts.max()), x.shape[1], device=x.device, dtype=x.dtype)
    entry["dense_bmm_ms"] = tm(lambda: torch.bmm(xp, w.transpose(1, 2)))
    entry["exact_tflops"] = 2.0 * x.shape[0] * w.shape[1] * w.shape[2] / entry["exact_ms"] / 1e9
    for key in ("stock_grouped_mm", "torch_loop", "dense_bmm"):
        if f"{key}_ms" in entry:
            entry[f"exact_over_{key}_speed"] = entry[f"{key}_ms"] / entry["exact_ms"]
    return entry


def bench_gemm(args: argparse.Namespace, shape: dict, device: torch.device, dtype: torch.dtype) -> dict:
    tm = timer(device)
    stock = stock_grouped_mm()
    res: dict = {"stock_grouped_mm": stock[0] if stock else "unavailable", "rows": []}
    e, h, inter = shape["experts"], shape["hidden"], shape["moe_inter"]
    for name, (n, k) in {"gate_up": (2 * inter, h), "down": (h, inter)}.items():
        w = torch.randn(e, n, k, device=device, dtype=dtype) * 0.02
        for t in args.tokens:
            entry: dict = {"proj": name, "T": t, "N": n, "K": k}
            try:
                x, eids, counts = _sorted_rows(t, shape, device, dtype, k)
                entry.update(_gemm_entry(tm, stock, x, w, eids, counts))
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc(limit=4)
            res["rows"].append(entry)
            print(json.dumps(entry), flush=True)
    return res


def _sweep_inputs(t: int, shape: dict, dev: torch.device, dtype: torch.dtype) -> dict:
    """The two expert GEMMs of one MoE layer call at ``t`` tokens, as :func:`rlexact.ops.moe_experts` launches them:
    gate_up gathers token rows (``order // k``) into expert-sorted rows, down scatters sorted rows back to pair
    order. Also the stock grouped GEMM's inputs: the same rows already sorted, ``w`` transposed, group ends."""
    from rlexact.ops.moe import moe_plan

    e, h, inter, k = shape["experts"], shape["hidden"], shape["moe_inter"], shape["top_k"]
    ids = torch.rand(t, e, device=dev).topk(k, dim=-1).indices
    plan = moe_plan(ids, e)
    ends = torch.cumsum(plan.counts, 0).to(torch.int32)
    x = torch.randn(t, h, device=dev, dtype=dtype)
    act = torch.randn(plan.num_rows, inter, device=dev, dtype=dtype)
    projs = {}
    for name, (n, kk, a) in {"gate_up": (2 * inter, h, x), "down": (h, inter, act)}.items():
        w = torch.randn(e, n, kk, device=dev, dtype=dtype) * 0.02
        gather = name == "gate_up"
        projs[name] = dict(
            w=w, a=a, gather=plan.order if gather else None, scatter=None if gather else plan.order,
            div=k if gather else 1, sorted_a=x[plan.order // k] if gather else act, wt=w.transpose(1, 2),
            counts=plan.counts, ends=ends,
        )  # fmt: skip
    return dict(rows=plan.num_rows, projs=projs)


def bench_sweep(args: argparse.Namespace, shape: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Grouped-GEMM launch configurations (:func:`rlexact.ops.triton_moe.grouped_candidates`) for gate_up and down at
    every ``--tokens`` count: CUDA-graph time, speed vs the stock grouped GEMM, and whether the output equals the
    reference candidate's bitwise. Prints a table per T ranked by gate_up + down time; only bitwise-equal candidates
    are ranked, and the fastest one's line for the row-class table (``triton_moe._HOPPER_16BIT``) is printed.
    On CPU (``--small`` under ``TRITON_INTERPRET=1``) it is a smoke run of the same logic with wall-clock times."""
    from rlexact.ops import triton_moe as tm

    dev = device
    if dev.type == "cuda":
        from common import bench_graph

        def tm_graph(fn: Callable[[], object]) -> float:
            return bench_graph(fn, rep=30)
    else:
        tm_graph = timer(dev)
    stock = stock_grouped_mm()
    cands = tm.grouped_candidates()
    e = shape["experts"]
    res: dict = {"stock_grouped_mm": stock[0] if stock else "unavailable", "rows": [], "ranking": {}, "choice": {}}
    for t in args.tokens:
        torch.manual_seed(t)
        inp = _sweep_inputs(t, shape, dev, dtype)
        rows_s = inp["rows"]
        klass = tm.row_class(rows_s, e)
        lib = {}
        stock_ms = {}
        for name, pr in inp["projs"].items():
            n, kk = pr["w"].shape[1], pr["w"].shape[2]
            lib[name] = tm.grouped_config(n, kk, dtype, dev, rows_s, e)
            if stock is not None:
                stock_ms[name] = tm_graph(lambda pr=pr: stock[1](pr["sorted_a"], pr["wt"], offs=pr["ends"]))
        per_cfg: dict = {}
        refs: dict = {}
        for ci, cfg in enumerate(cands):
            entry: dict = {"T": t, "row_class": klass, "candidate": ci, **vars(cfg)}
            entry["library"] = [name for name in lib if lib[name] == cfg]
            for name, pr in inp["projs"].items():
                out = torch.empty(rows_s, pr["w"].shape[1], device=dev, dtype=dtype)

                def run(pr=pr, out=out, cfg=cfg) -> None:  # noqa: ANN001
                    tm.grouped_matmul(pr["a"], pr["w"], out, pr["counts"], pr["gather"], pr["scatter"],
                                      pr["div"], cfg)  # fmt: skip

                try:
                    run()
                    sync(dev)
                    if ci == 0:
                        refs[name] = out.clone()
                    entry[f"{name}_bitwise_equal"] = bool(name in refs and torch.equal(out, refs[name]))
                    entry[f"{name}_ms"] = tm_graph(run)
                    if name in stock_ms:
                        entry[f"{name}_speed_vs_grouped_mm"] = stock_ms[name] / entry[f"{name}_ms"]
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: recorded, the sweep goes on
                    entry[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if "gate_up_ms" in entry and "down_ms" in entry:
                entry["total_ms"] = entry["gate_up_ms"] + entry["down_ms"]
                entry["bitwise_equal"] = entry["gate_up_bitwise_equal"] and entry["down_bitwise_equal"]
                if len(stock_ms) == 2:
                    entry["speed_vs_grouped_mm"] = sum(stock_ms.values()) / entry["total_ms"]
            per_cfg[ci] = entry
            res["rows"].append(entry)
        ranked = sorted((r for r in per_cfg.values() if r.get("bitwise_equal")), key=lambda r: r["total_ms"])
        res["ranking"][str(t)] = [r["candidate"] for r in ranked]
        _print_ranking(t, klass, stock_ms, ranked, [r for r in per_cfg.values() if not r.get("bitwise_equal")])
        if ranked:
            best = cands[ranked[0]["candidate"]]
            res["choice"][klass] = {"T": t, "candidate": ranked[0]["candidate"], "config": vars(best),
                                    "table_line": f"    {klass!r}: {best!r},".replace("'", '"')}  # fmt: skip
            print(
                f"fastest bitwise-equal config for row class {klass!r} (T = {t}):\n{res['choice'][klass]['table_line']}"
            )
    return res


def _print_ranking(t: int, klass: str, stock_ms: dict, ranked: list, rejected: list) -> None:
    """The ranked table of one T (bitwise-equal candidates, fastest first), then the candidates that were not."""
    stock = " ".join(f"{k} {v:.3f} ms" for k, v in stock_ms.items())
    print(f"\n== T = {t} (row class {klass}); stock grouped_mm: {stock or 'unavailable'}")
    print(f"{'rank':>4} {'cand':>4} {'BM':>4} {'BN':>4} {'BK':>4} {'wrp':>3} {'stg':>3} {'grp':>3} {'evenK':>5} "
          f"{'w_load':>10} {'gate_up':>8} {'down':>8} {'total':>8} {'x_gmm':>6} lib")  # fmt: skip
    for i, r in enumerate(ranked):
        print(f"{i + 1:>4} {r['candidate']:>4} {r['BM']:>4} {r['BN']:>4} {r['BK']:>4} {r['num_warps']:>3} "
              f"{r['num_stages']:>3} {r['group_m']:>3} {r['even_k']!s:>5} {r['w_load']:>10} {r['gate_up_ms']:8.3f} "
              f"{r['down_ms']:8.3f} {r['total_ms']:8.3f} {r.get('speed_vs_grouped_mm', float('nan')):6.2f} "
              f"{','.join(r['library'])}")  # fmt: skip
    for r in rejected:
        why = "; ".join(f"{k}={v}" for k, v in r.items() if k.endswith(("_error", "_bitwise_equal")) and v is not True)
        print(f"  not ranked: candidate {r['candidate']} ({r['BM']}x{r['BN']}x{r['BK']}, {r['w_load']}): {why}")


def bench_layer(args: argparse.Namespace, shape: dict, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    tm = timer(device)
    torch.manual_seed(0)
    cfg = moe_config(shape, 1, "grouped_mm")
    block = Qwen3MoeSparseMoeBlock(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    eager = copy.copy(block)
    eager.experts = copy.copy(block.experts)
    eager_cfg = copy.copy(cfg)
    eager_cfg._experts_implementation = "eager"
    eager.experts.config = eager_cfg

    def exact(x: torch.Tensor) -> torch.Tensor:
        logits = ops.matmul(x, block.gate.weight)
        weights, ids = ops.moe_router(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return ops.moe_experts(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj)

    engines = {"exact": exact, "grouped_mm": lambda x: block(x[None])[0], "eager": lambda x: eager(x[None])[0]}
    stock = stock_grouped_mm()
    res: dict = {"rows": [], "engines": {
        "grouped_mm": "transformers Qwen3MoeSparseMoeBlock, grouped_mm experts (on "
                      f"{stock[0] if stock else 'its fallback loop'} when the device supports it)",
        "eager": "transformers Qwen3MoeSparseMoeBlock, eager per-expert loop"}}  # fmt: skip
    big = max(args.tokens)
    for t in args.tokens:
        entry: dict = {"T": t}
        x = torch.randn(t, shape["hidden"], device=device, dtype=dtype)
        with torch.no_grad():
            for name, fn in engines.items():
                try:
                    entry[f"{name}_ms"] = tm(lambda fn=fn, x=x: fn(x))
                except Exception as exc:  # noqa: BLE001
                    entry[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            try:
                ref = engines["grouped_mm"](x).float()
                entry["max_abs_diff_vs_grouped_mm"] = float((exact(x).float() - ref).abs().max())
                if t == big:
                    n = min(t, 64)
                    singles = torch.cat([exact(x[i : i + 1]) for i in range(n)])
                    entry["rows_alone_equal_rows_in_batch"] = bool(torch.equal(singles, exact(x)[:n]))
            except Exception as exc:  # noqa: BLE001
                entry["check_error"] = f"{type(exc).__name__}: {exc}"
        for name in ("grouped_mm", "eager"):
            if f"{name}_ms" in entry and "exact_ms" in entry:
                entry[f"exact_over_{name}_speed"] = entry[f"{name}_ms"] / entry["exact_ms"]
        if t == big:
            for name in ("exact", "grouped_mm"):
                try:
                    xg = x.clone().requires_grad_(True)
                    fn = engines[name]
                    entry[f"{name}_fwd_bwd_ms"] = tm(lambda fn=fn, xg=xg: fn(xg).float().square().sum().backward())
                except Exception as exc:  # noqa: BLE001
                    entry[f"{name}_fwd_bwd_error"] = f"{type(exc).__name__}: {exc}"
            if "exact_fwd_bwd_ms" in entry and "grouped_mm_fwd_bwd_ms" in entry:
                speed = entry["grouped_mm_fwd_bwd_ms"] / entry["exact_fwd_bwd_ms"]
                entry["exact_over_grouped_mm_fwd_bwd_speed"] = speed
            block.zero_grad(set_to_none=True)
        res["rows"].append(entry)
        print(json.dumps(entry), flush=True)
    last = res["rows"][-1]
    if "exact_over_grouped_mm_speed" in last:
        res["exact_over_grouped_mm_speed"] = last["exact_over_grouped_mm_speed"]
        res["exact_over_grouped_mm_speed_T"] = last["T"]
    return res


def build_model(shape: dict, layers: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(moe_config(shape, layers, "grouped_mm"), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    return rlexact.exactify(model.eval())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_rollout(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    res: dict = {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    for kernels in ("exact", "native"):
        try:
            gen = Generator(model, kernels=kernels, max_num_seqs=args.batch, max_num_batched_tokens=16384)
            gen.generate(prompts, params)  # warm-up: the timed call itself (same KV-cache size, same graphs)
            sync(device)
            t0 = time.perf_counter()
            outs = gen.generate(prompts, params)
            sync(device)
            dt = time.perf_counter() - t0
            n_tok = sum(len(o.token_ids) for o in outs)
            res[kernels] = {"seconds": dt, "tokens": n_tok, "tokens_per_s": n_tok / dt, "stats": {
                k: v for k, v in gen.stats.items() if isinstance(v, (int, float, str)) or v is None}}  # fmt: skip
            if kernels == "exact":
                k = min(4, len(outs))
                ref = rlexact.sequence_logprobs(model, [o.sequence for o in outs[:k]])
                res["exact_rollout_equals_trainer"] = all(
                    torch.equal(o.logprobs.to(r.device), r[-len(o.token_ids) :]) for o, r in zip(outs[:k], ref)
                )
                res["_outs"] = outs
        except Exception as exc:  # noqa: BLE001
            res[f"{kernels}_error"] = f"{type(exc).__name__}: {exc}"
            res[f"{kernels}_traceback"] = traceback.format_exc(limit=4)
        print(json.dumps({k: v for k, v in res.items() if k != "_outs"}, default=str), flush=True)
    if "tokens_per_s" in res.get("exact", {}) and "tokens_per_s" in res.get("native", {}):
        res["exact_over_native_speed"] = res["exact"]["tokens_per_s"] / res["native"]["tokens_per_s"]
    return res


def bench_train_step(model: torch.nn.Module, outs: list, device: torch.device) -> dict:
    from rlexact.logprobs import pack, packed_logprobs

    packed = pack([o.sequence for o in outs], device)
    adv = torch.randn(packed.input_ids.numel(), device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-7)
    res: dict = {"sequences": len(outs), "tokens": int(packed.input_ids.numel())}
    model.train()
    try:
        for kernels in ("exact", "native"):
            try:
                with rlexact.use_kernels(model, kernels):
                    times = []
                    for _ in range(2):  # the first step allocates the optimizer state and compiles kernels
                        sync(device)
                        t0 = time.perf_counter()
                        logp, _ = packed_logprobs(model, packed)
                        (-(adv * logp).sum() / adv.numel()).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        sync(device)
                        times.append(time.perf_counter() - t0)
                res[f"{kernels}_s"] = times[-1]
            except Exception as exc:  # noqa: BLE001
                res[f"{kernels}_error"] = f"{type(exc).__name__}: {exc}"
                res[f"{kernels}_traceback"] = traceback.format_exc(limit=4)
    finally:
        model.eval()
    if "exact_s" in res and "native_s" in res:
        res["exact_over_native_speed"] = res["native_s"] / res["exact_s"]
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on CPU (smoke run)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="layer token counts (default 1 64 1024 16384)")
    ap.add_argument("--sections", nargs="+", default=["gemm", "layer", "rollout", "train_step"])
    ap.add_argument("--sweep", action="store_true",
                    help="only the grouped-GEMM configuration sweep (GPU; default T 1024 16384)")  # fmt: skip
    ap.add_argument("--rollout-layers", type=int, default=None, help="decoder layers of the rollout model (default 8)")
    ap.add_argument("--batch", type=int, default=None, help="rollout batch (default 64)")
    ap.add_argument("--prompt-len", type=int, default=None, help="random prompt tokens (default 128)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence (default 128)")
    ap.add_argument("--out", default=None, help="output JSON (default benchmarks/results/moe_h200.json)")
    args = ap.parse_args()
    if not args.small:
        require_cuda("moe_bench.py", "--small")
    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    shape = SMALL if args.small else A3B
    dtype = torch.bfloat16
    if args.sweep:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--sweep runs the Triton kernels: use a CUDA GPU, or TRITON_INTERPRET=1 with --small on CPU")
        args.sections = ["sweep"]
        args.tokens = args.tokens or ([16, 256] if args.small else [1024, 16384])
    args.tokens = args.tokens or ([1, 16, 64] if args.small else [1, 64, 1024, 16384])
    args.rollout_layers = args.rollout_layers or (2 if args.small else 8)
    args.batch = args.batch or (4 if args.small else 64)
    args.prompt_len = args.prompt_len or (8 if args.small else 128)
    args.new_tokens = args.new_tokens or (4 if args.small else 128)
    default_out = f"moe{'_sweep' if args.sweep else ''}_{'small' if args.small else 'h200'}.json"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / default_out
    result = {**header("moe_bench", "transformers", "triton"), "shape": shape, "dtype": str(dtype), "results": {}}
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    sections = result["results"]
    if "gemm" in args.sections:
        sections["gemm"] = _guard(lambda: bench_gemm(args, shape, device, dtype))
    if "sweep" in args.sections:
        sections["sweep"] = _guard(lambda: bench_sweep(args, shape, device, dtype))
    if "layer" in args.sections:
        sections["layer"] = _guard(lambda: bench_layer(args, shape, device, dtype))
    if {"rollout", "train_step"} & set(args.sections):
        model = build_model(shape, args.rollout_layers, device, dtype)
        n_params = sum(p.numel() for p in model.parameters())
        result["rollout_model"] = {"layers": args.rollout_layers, "parameters": n_params}
        roll = _guard(lambda: bench_rollout(args, model, device))
        outs = roll.pop("_outs", None)
        sections["rollout"] = roll
        if "train_step" in args.sections and outs:
            sections["train_step"] = _guard(lambda: bench_train_step(model, outs, device))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


def _guard(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - one failing section must not lose the others
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}


if __name__ == "__main__":
    raise SystemExit(main())
