"""Sweep that picks the query-side launch of the exact prefill/training attention forward (bf16, head_dim 128,
Qwen3-1.7B heads: 16 query / 8 KV heads) on one GPU.

    python3 benchmarks/attention_configs.py [--out benchmarks/results/attention_configs_h200.json]

Candidates are ``BLOCK_M`` in (64, 128) x ``num_warps`` in (4, 8) x ``num_stages`` in (2, 3, 4); the key-side
partition (``BLOCK_N``, ``SPLIT``) stays the library's. For each candidate, as CUDA-graph replays
(``do_bench_cudagraph``, median GPU time):

* packed causal prefill at 64 x 512, 8 x 4,096 and 1 x 8,192 tokens, with TFLOP/s and ``sdpa_over_ours`` (SDPA's time
  over ours, > 1 = faster than SDPA; SDPA = the flash backend on the same shapes, causal, contiguous
  ``[B, H, S, D]`` with GQA-expanded K/V, timed once);
* paged decode (batch 256 x 512-token and batch 64 x 2,048-token contexts, scattered 16-token pages) with the
  candidate as the decode launch too (only relevant if one config were to serve both roles);
* ``bitwise``: every output above is ``torch.equal`` to the output of the library's decode launch
  (:func:`rlexact.ops.triton_attention._fwd_config`) on the same inputs;
* ``decode_eq_prefill``: with the candidate installed as ``PREFILL_LAUNCH_16BIT``, the training forward equals a
  paged chunked prefill (chunks of 256, several sequences per launch, one sequence past a KV split) followed by
  one-token decode steps (library decode launch), bitwise.

``choice.prefill_launch`` is the candidate with every check true that minimizes the mean of ``ours / sdpa`` over the
prefill shapes: copy it into ``rlexact.ops.triton_attention.PREFILL_LAUNCH_16BIT``. ``choice.single_config`` is the
best candidate whose decode times stay within 2 % of the library's, for the case that no candidate passes the
bitwise checks (then it would have to replace the query-side entries of ``_fwd_config`` itself, for both roles).

``--decode`` sweeps the decode launch instead (``DECODE_CANDIDATES``) on paged decode at batch 256 x 160 and x 384,
64 x 2,048, 32 x 8,192 and 4 x 8,192 keys (the last two split-parallel), each checked bitwise against the library's
decode launch and, installed as ``DECODE_LAUNCH_16BIT``, for decode == training forward; ``choice.decode_launch``
(the fastest total among those) goes into ``rlexact.ops.triton_attention.DECODE_LAUNCH_16BIT``.
Output: ``attention_decode_configs_h200.json``. ``--shape gemma3`` runs the decode sweep at Gemma 3 1B's heads (4
query / 1 KV head, head_dim 256), installing each candidate in ``DECODE_LAUNCH_BY_HEAD_DIM[256]``; its choice goes
there. Output: ``attention_decode_configs_gemma3_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path

import torch

from common import ROOT, bench_graph, header, require_cuda
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
HEADS = {"qwen3": (HQ, HKV, D), "gemma3": (4, 1, 256)}
"""``--shape`` -> ``(query heads, KV heads, head_dim)`` of the decode sweep."""
DT = torch.bfloat16
DEV = "cuda"
SCALE = 1 / math.sqrt(D)
PAGE = 16
SHAPE = {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16", "page": PAGE}
PREFILL_SHAPES = ((64, 512), (8, 4096), (1, 8192))
DECODE_SHAPES = ((256, 512), (64, 2048))
CANDIDATES = [{"BLOCK_M": bm, "num_warps": w, "num_stages": st} for bm in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
DECODE_SWEEP_SHAPES = ((256, 160), (256, 384), (64, 2048), (32, 8192), (4, 8192))
DECODE_CANDIDATES = [
    {"BLOCK_M": 16, "num_warps": w, "num_stages": st} for w in (1, 2, 4) for st in (1, 2, 3, 5)
]
"""Decode launches swept. Narrowed from the c2c7cb9 sweep (8 warps, and 64-row tiles over fewer than four warps, lost
everywhere) and the 23cc05a one (``attention_decode_configs_h200.json`` at that commit: 32- and 64-row tiles lost
everywhere, six stages equal to five). One stage added: the short contexts of a large batch (three key tiles per
program) are bound by each program's fixed latency, and a single K/V buffer lets more programs share an SM."""


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)


def prefill_case(b: int, s: int) -> tuple:
    q = torch.randn(b * s, HQ, D, device=DEV, dtype=DT)
    k = torch.randn(b * s, HKV, D, device=DEV, dtype=DT)
    v = torch.randn(b * s, HKV, D, device=DEV, dtype=DT)
    return q, k, v, _cu([s] * b), None, None


def decode_case(b: int, ctx: int, heads: tuple[int, int, int] = HEADS["qwen3"]) -> tuple:
    hq, hkv, d = heads
    nblk = math.ceil(ctx / PAGE)
    kc = torch.randn(b * nblk, PAGE, hkv, d, device=DEV, dtype=DT)
    vc = torch.randn(b * nblk, PAGE, hkv, d, device=DEV, dtype=DT)
    tables = torch.randperm(b * nblk, device=DEV).to(torch.int32).view(b, nblk)
    q = torch.randn(b, hq, d, device=DEV, dtype=DT)
    lens = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
    return q, kc, vc, _cu([1] * b), lens, tables


def run(case: tuple, cfg: dict | None) -> torch.Tensor:
    q, k, v, cu, lens, tables = case
    out = torch.empty_like(q)
    decode = tables is not None and q.shape[0] == lens.shape[0]  # one query per sequence: the generator's bound
    scale = 1 / math.sqrt(q.shape[-1])
    ta._forward(q, k, v, cu, lens, tables, scale, out, cfg=cfg, max_seqlen_q=1 if decode else None)
    return out


def bitwise_times(cases: dict, refs: dict, cfg: dict) -> tuple[bool, dict[str, float]]:
    """Whether every case's output under ``cfg`` equals its reference bitwise, and each case's CUDA-graph time (us)."""
    same, times = True, {}
    for name, case in cases.items():
        same &= bool(torch.equal(run(case, cfg), refs[name]))
        times[name] = bench_graph(lambda case=case, cfg=cfg: run(case, cfg)) * 1e3
    return same, times


def sdpa_ms(b: int, s: int) -> float:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, HQ, s, D, device=DEV, dtype=DT)
    k = torch.randn(b, HQ, s, D, device=DEV, dtype=DT)
    v = torch.randn(b, HQ, s, D, device=DEV, dtype=DT)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return bench_graph(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE))


def decode_eq_prefill(
    launch: dict,
    decode_launch: dict | None = None,
    lens: tuple[int, ...] = (1100, 300, 37, 9),
    chunk: int = 256,
    n_decode: int = 8,
    heads: tuple[int, int, int] = HEADS["qwen3"],
) -> bool:
    """Training forward == chunked paged prefill (prefill launch) + decode steps (decode launch), bitwise, with
    ``launch`` installed as the library's prefill launch and ``decode_launch`` (default: the library's) as its
    decode launch (:data:`rlexact.ops.triton_attention.DECODE_LAUNCH_BY_HEAD_DIM` at a head_dim the 16-bit
    launches do not cover)."""
    hq, hkv, d = heads
    scale = 1 / math.sqrt(d)
    lens = list(lens)
    g = torch.Generator(device=DEV).manual_seed(1)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, device=DEV, dtype=DT, generator=g) for h in (hq, hkv, hkv))
    cu = _cu(lens)
    width = 16 * math.ceil(max(math.ceil(n / PAGE) for n in lens) / 16)
    n_blocks = len(lens) * width
    perm = torch.randperm(n_blocks, device=DEV, generator=g).to(torch.int32)
    tables = perm.view(len(lens), width)
    kc = torch.full((n_blocks, PAGE, hkv, d), float("nan"), device=DEV, dtype=DT)
    vc = torch.full_like(kc, float("nan"))
    starts = cu.tolist()
    saved = ta.PREFILL_LAUNCH_16BIT, ta.DECODE_LAUNCH_16BIT, dict(ta.DECODE_LAUNCH_BY_HEAD_DIM)
    ta.PREFILL_LAUNCH_16BIT = dict(launch)
    if ta._block_d(d) in ta.PREFILL_LAUNCH_HEAD_DIMS:
        ta.DECODE_LAUNCH_16BIT = dict(decode_launch or saved[1])
    elif decode_launch is not None:
        ta.DECODE_LAUNCH_BY_HEAD_DIM[ta._block_d(d)] = dict(decode_launch)
    try:
        full = ta.attention_varlen(q, k, v, cu, scale)
        out = torch.full_like(q, float("nan"))
        done = [0] * len(lens)
        goal = [n - n_decode for n in lens]
        while done != lens:
            step = [min(chunk, goal[b] - done[b]) for b in range(len(lens))]
            if not any(step):  # decode: one query per sequence, every sequence
                step, goal = [1] * len(lens), [d + 1 for d in done]
            rows = torch.cat([torch.arange(starts[b] + done[b], starts[b] + done[b] + n) for b, n in enumerate(step)])
            pos = torch.cat([torch.arange(done[b], done[b] + n) for b, n in enumerate(step)])
            seq = torch.cat([torch.full((n,), b) for b, n in enumerate(step)])
            rows, pos, seq = rows.to(DEV), pos.to(DEV), seq.to(DEV)
            slots = tables[seq, pos // PAGE].long() * PAGE + pos % PAGE
            kc.view(-1, hkv, d)[slots] = k[rows]
            vc.view(-1, hkv, d)[slots] = v[rows]
            done = [d + n for d, n in zip(done, step)]
            seqk = torch.tensor(done, device=DEV, dtype=torch.int32)
            out[rows] = ta.attention_paged(q[rows], kc, vc, tables, _cu(step), seqk, scale)
    finally:
        ta.PREFILL_LAUNCH_16BIT, ta.DECODE_LAUNCH_16BIT = saved[:2]
        ta.DECODE_LAUNCH_BY_HEAD_DIM.clear()
        ta.DECODE_LAUNCH_BY_HEAD_DIM.update(saved[2])
    return bool(torch.equal(out, full))


def decode_sweep(out: str, shape: str = "qwen3") -> int:
    """``--decode``: pick :data:`rlexact.ops.triton_attention.DECODE_LAUNCH_16BIT` (at ``shape``'s head_dim
    outside the swept ones: its :data:`~rlexact.ops.triton_attention.DECODE_LAUNCH_BY_HEAD_DIM` entry) from
    :data:`DECODE_CANDIDATES`."""
    t0 = time.time()
    torch.manual_seed(0)
    heads = HEADS[shape]
    hkv, d = heads[1:]
    library = ta._launch_config(d, DT, decode=True)
    prefill_launch = dict(ta.PREFILL_LAUNCH_16BIT)
    cases = {f"decode_b{b}_ctx{c}": decode_case(b, c, heads) for b, c in DECODE_SWEEP_SHAPES}
    kv_bytes = {f"decode_b{b}_ctx{c}": 2 * b * c * hkv * d * DT.itemsize for b, c in DECODE_SWEEP_SHAPES}
    refs = {name: run(case, library) for name, case in cases.items()}
    library_launch = {key: library[key] for key in ("BLOCK_M", "num_warps", "num_stages")}
    candidates = DECODE_CANDIDATES + ([] if library_launch in DECODE_CANDIDATES else [library_launch])
    result: dict = header("attention_decode_configs", "triton") | {
        "shape": SHAPE | dict(zip(("q_heads", "kv_heads", "head_dim"), heads)) | {"name": shape},
        "library_decode_launch": library_launch,
        "library_prefill_launch": prefill_launch,
        "timing": "median of do_bench_cudagraph (GPU time), microseconds; kv_tb_s = K/V bytes read / time",
        "rows": [],
    }
    for launch in candidates:
        row: dict = {"launch": launch}
        cfg = library | launch
        try:
            row["bitwise"], times = bitwise_times(cases, refs, cfg)
            for name, us in times.items():
                row[name] = {"us": us, "kv_tb_s": kv_bytes[name] / us / 1e6}
            row["decode_eq_prefill"] = decode_eq_prefill(prefill_launch, launch, heads=heads)
            row["total_us"] = sum(row[n]["us"] for n in cases)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        summary = {n: round(row[n]["us"], 1) for n in cases if n in row}
        print(
            "[attention_configs --decode]", launch, summary, {k: row.get(k) for k in ("bitwise", "decode_eq_prefill")}
        )
        result["rows"].append(row)
    exact = [r for r in result["rows"] if "error" not in r and r["bitwise"] and r["decode_eq_prefill"]]
    choice: dict = {"rule": "min total decode time over the shapes among bitwise-equal candidates"}
    if exact:
        best = min(exact, key=lambda r: r["total_us"])
        lib = next((r for r in exact if r["launch"] == library_launch), None)
        choice["decode_launch"] = best["launch"]
        choice["total_us"] = best["total_us"]
        choice["library_total_us"] = lib["total_us"] if lib is not None else None
    result["choice"] = choice
    result["elapsed_s"] = time.time() - t0
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print("[attention_configs --decode] choice", json.dumps(choice), f"({result['elapsed_s']:.0f} s)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default=None, help="output JSON (default benchmarks/results/attention_[decode_]configs_h200.json)"
    )
    ap.add_argument("--decode", action="store_true", help="sweep the decode launch instead of the prefill launch")
    ap.add_argument("--shape", choices=list(HEADS), default="qwen3", help="heads of the decode sweep")
    args = ap.parse_args()
    require_cuda("attention_configs.py")
    results = ROOT / "benchmarks" / "results"
    if args.shape != "qwen3" and not args.decode:
        ap.error("--shape applies to the decode sweep (--decode)")
    if args.decode:
        name = "attention_decode_configs" + ("" if args.shape == "qwen3" else f"_{args.shape}") + "_h200.json"
        return decode_sweep(args.out or str(results / name), args.shape)
    args.out = args.out or str(results / "attention_configs_h200.json")
    t0 = time.time()
    torch.manual_seed(0)
    library = ta._fwd_config(D, DT)
    decode_launch = {key: library[key] for key in ("BLOCK_M", "num_warps", "num_stages")}
    prefill = {f"prefill_{b}x{s}": prefill_case(b, s) for b, s in PREFILL_SHAPES}
    decode = {f"decode_b{b}_ctx{c}": decode_case(b, c) for b, c in DECODE_SHAPES}
    flop = {f"prefill_{b}x{s}": 4.0 * b * HQ * D * s * s / 2 for b, s in PREFILL_SHAPES}
    sdpa = {f"prefill_{b}x{s}": sdpa_ms(b, s) * 1e3 for b, s in PREFILL_SHAPES}
    refs = {name: run(case, library) for name, case in (prefill | decode).items()}
    result: dict = header("attention_configs", "triton") | {
        "shape": SHAPE,
        "library_config": library,
        "library_prefill_launch": ta.PREFILL_LAUNCH_16BIT,
        "timing": "median of triton.testing.do_bench_cudagraph (GPU time), microseconds",
        "sdpa_flash_us": sdpa,
        "sdpa_flash_tflops": {n: flop[n] / us / 1e6 for n, us in sdpa.items()},
        "rows": [],
    }
    for launch in CANDIDATES:
        row: dict = {"launch": launch}
        cfg = library | launch
        try:
            same_prefill, times = bitwise_times(prefill, refs, cfg)
            for name, us in times.items():
                row[name] = {"us": us, "tflops": flop[name] / us / 1e6, "sdpa_over_ours": sdpa[name] / us}
            same_decode, times = bitwise_times(decode, refs, cfg)
            row.update({name: {"us": us} for name, us in times.items()})
            row["bitwise"] = same_prefill and same_decode
            row["decode_eq_prefill"] = decode_eq_prefill(launch)
            row["mean_ours_over_sdpa"] = sum(row[n]["us"] / sdpa[n] for n in prefill) / len(prefill)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["traceback"] = traceback.format_exc(limit=3)
        summary = {n: round(row[n]["us"], 1) for n in (*prefill, *decode) if n in row}
        print("[attention_configs]", launch, summary, {k: row.get(k) for k in ("bitwise", "decode_eq_prefill")})
        result["rows"].append(row)
    ok = [r for r in result["rows"] if "error" not in r]
    lib_row = next(r for r in ok if r["launch"] == decode_launch) if decode_launch in CANDIDATES else None
    exact = [r for r in ok if r["bitwise"] and r["decode_eq_prefill"]]
    choice: dict = {"rule": "min mean(ours/sdpa) over the prefill shapes"}
    if exact:
        best = min(exact, key=lambda r: r["mean_ours_over_sdpa"])
        choice["prefill_launch"] = best["launch"]
        choice["prefill_launch_mean_ours_over_sdpa"] = best["mean_ours_over_sdpa"]
    if lib_row is not None:
        choice["library_decode_launch_mean_ours_over_sdpa"] = lib_row["mean_ours_over_sdpa"]
        fast_decode = [r for r in ok if all(r[n]["us"] <= 1.02 * lib_row[n]["us"] for n in decode)]
        if fast_decode:
            single = min(fast_decode, key=lambda r: r["mean_ours_over_sdpa"])
            choice["single_config"] = single["launch"]
            choice["single_config_mean_ours_over_sdpa"] = single["mean_ours_over_sdpa"]
    result["choice"] = choice
    result["elapsed_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("[attention_configs] sdpa_flash_us", {n: round(us, 1) for n, us in sdpa.items()})
    print("[attention_configs] choice", json.dumps(choice), f"({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
