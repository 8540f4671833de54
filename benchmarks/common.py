"""What every benchmark script shares: the ``src`` import path, the header of its result JSON, and the GPU timers.

Importing this module puts ``<repo>/src`` first on ``sys.path``, so the scripts run from a plain checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlexact.envinfo import result_header as header  # noqa: E402, F401 - re-exported: the result provenance block


def require_cuda(script: str, cpu_mode: str | None = None) -> None:
    """Return when torch sees a CUDA device; else exit (``SystemExit``: status 1, a one-line message on stderr, no
    traceback) saying that ``script`` needs a CUDA GPU, and naming ``cpu_mode`` (the flags of the script's CPU mode)
    where it has one. A GPU-only script calls it first in ``main``, after parsing its arguments (``--help`` works
    anywhere) and before anything is computed or written, so a run without a GPU leaves every result file as it is."""
    import torch

    if torch.cuda.is_available():
        return
    hint = f"; without one, run it with {cpu_mode}" if cpu_mode else ""
    raise SystemExit(f"{script} needs a CUDA GPU (torch sees none){hint}")


def bench(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``triton.testing.do_bench``: one eager call at a time, each after the L2 cache was
    overwritten (its inputs come from HBM), timed by events around that call alone."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn: Callable[[], object], rep: int = 50) -> float:
    """Median milliseconds of CUDA-graph replays (GPU time without Python/launch overhead): back-to-back calls, no
    cache flush between them."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def bench_stream(fn: Callable[[], object], calls: int = 200, rounds: int = 10) -> float:
    """Median milliseconds per call of ``calls`` back-to-back eager calls timed by two events (the median over
    ``rounds``): what :func:`bench_graph` measures for a CUDA graph, with every launch made by the host, so any host
    or launch cost the GPU cannot hide shows. No cache flush, as in :func:`bench_graph`."""
    import torch

    for _ in range(calls // 4 + 1):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return float(sorted(times)[len(times) // 2])


def host_us(fn: Callable[[], object], calls: int = 50, rounds: int = 5,
            sync: Callable[[], None] | None = None) -> float:  # fmt: skip
    """Median host microseconds per call of ``fn`` issued ``calls`` times back to back without synchronizing (the
    host's own cost of the launches while the GPU queue has room), over ``rounds``; ``sync`` waits for the device
    between rounds (None: ``torch.cuda.synchronize``; a no-op for CPU tensors)."""
    import time

    import torch

    wait = torch.cuda.synchronize if sync is None else sync
    times = []
    for _ in range(rounds):
        wait()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    wait()
    return float(sorted(times)[len(times) // 2])


def launch_cli(description: str, stem: str, gpu: Callable[[], dict], host_only: Callable[[], dict]) -> None:
    """The command line of the launch benchmark ``<stem>.py``, which has a CPU mode: ``--host-only`` runs
    ``host_only`` and writes ``benchmarks/results/<stem>_host_cpu.json``, else ``gpu`` writes ``<stem>_h200.json``
    (without a CUDA device: :func:`require_cuda` exits, pointing at ``--host-only``); ``--out`` names another path."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--host-only", action="store_true", help="CPU: time the Python layers with the launch stubbed")
    ap.add_argument("--out", default=None, help=f"result JSON (default: benchmarks/results/{stem}_*.json)")
    args = ap.parse_args()
    if not args.host_only:
        require_cuda(f"{stem}.py", "--host-only")
    name = f"{stem}_host_cpu.json" if args.host_only else f"{stem}_h200.json"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / name
    res = host_only() if args.host_only else gpu()
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


def host_profile(call: Callable[[], object], calls: int = 300, top: int = 12) -> list[dict[str, object]]:
    """The ``top`` functions by own host time over ``calls`` calls of ``call`` (``cProfile``): per call, each one's
    own and cumulative microseconds and how many times it ran."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {"function": f"{Path(f).name}:{line}:{fn}", "own_us_per_call": own / calls * 1e6,
         "cumulative_us_per_call": cum / calls * 1e6, "calls_per_call": n / calls}
        for (f, line, fn), (_, n, own, cum, _) in rows
    ]  # fmt: skip


def rotated(arms: dict[str, Callable[[], object]], timer: Callable[[Callable[[], object]], float],
            rounds: int) -> dict[str, list[float]]:  # fmt: skip
    """Each call of ``arms`` (name -> fn) timed once per round by ``timer``; round ``r`` starts at arm
    ``r % len(arms)`` and goes on in order, so every arm runs at every place of a round equally often over
    ``len(arms)`` rounds. Returns each arm's series, in rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(arms)
    series: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            series[name].append(timer(arms[name]))
    return series


def medians(series: dict[str, list[float]]) -> dict[str, float]:
    """Each arm's median time over its rounds (a :func:`rotated` result)."""
    return {n: statistics.median(ts) for n, ts in series.items()}


def rounds_args(doc: str, script: str, rounds: int, arms: int, result: str) -> argparse.Namespace:
    """The command line of a GPU probe timed in :func:`rotated` rounds: ``--rounds`` (default ``rounds``; a multiple
    of ``arms`` rotates fully) and ``--out`` (default ``benchmarks/results/<result>``); then :func:`require_cuda`.
    ``--rounds`` below one exits with a message naming ``script``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=rounds, help=f"rounds per table (a multiple of {arms} rotates fully)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / result))
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"{script}: --rounds must be >= 1, got {args.rounds}")
    require_cuda(script)
    return args


def interleaved(a: tuple[str, Callable[[], object]], b: tuple[str, Callable[[], object]],
                timer: Callable[[Callable[[], object]], float], rounds: int = 5,
                others: dict[str, Callable[[], object]] | None = None) -> dict[str, object]:  # fmt: skip
    """The calls of ``a = (name, fn)``, ``b`` and any ``others`` (name -> fn) timed in rotated rounds by ``timer``
    (:func:`rotated`: with ``a`` and ``b`` alone, ``b`` first in odd rounds, so neither always runs second),
    ``rounds`` times each: every series (``<name>_ms``), and the median, least and greatest of the per-round ratios of
    ``b``'s time to ``a``'s. Clocks and other GPU work drift over a run; a ratio taken within one round sees both calls
    under the same conditions, and the ratios' spread is the timer's resolution for them."""
    (a_name, a_fn), (b_name, b_fn), others = a, b, others or {}
    arms = {a_name: a_fn, b_name: b_fn, **others}
    if len(arms) != 2 + len(others):
        raise ValueError(f"arm names must differ, got {a_name!r}, {b_name!r} and {sorted(others)}")
    series = rotated(arms, timer, rounds)
    ratios = [y / x for x, y in zip(series[a_name], series[b_name])]
    return {"rounds": rounds, **{f"{n}_ms": t for n, t in series.items()}, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}  # fmt: skip


def packed_attention_inputs(lens: list[int], hq: int, hkv: int, d: int) -> tuple:
    """``(q [T, hq, d], k, v [T, hkv, d], cu [B + 1] int32)``: seeded bf16 CUDA tensors for sequences of ``lens``
    tokens packed back to back, k and v strided views of one q|k|v buffer as a fused projection gives them."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(sum(lens), hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return qkv[:, :hq].contiguous(), qkv[:, hq : hq + hkv], qkv[:, hq + hkv :], cu


def paged_decode_inputs(b: int, ctx: int, hq: int, hkv: int, d: int, page: int = 16) -> tuple:
    """``(q [b, hq, d], k_cache, v_cache [blocks, page, hkv, d], block tables [b, blocks], cu_q, seqlens_k)``: one
    decode query per sequence over ``ctx`` keys each, seeded bf16 CUDA tensors, pages shuffled across sequences."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(b * 7 + ctx)
    nblk = math.ceil(ctx / page)
    kc, vc = (torch.randn(b * nblk, page, hkv, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    tables = torch.randperm(b * nblk, device="cuda", generator=g).to(torch.int32).view(b, nblk)
    q = torch.randn(b, hq, d, device="cuda", generator=g).bfloat16()
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    return q, kc, vc, tables, cu, lens


def sdpa_causal_us(q, k, v, b: int, s_len: int, scale: float) -> float:  # noqa: ANN001 - torch.Tensors
    """Microseconds (CUDA-graph replays) of SDPA's default backend on ``b`` sequences of ``s_len`` tokens packed as
    :func:`packed_attention_inputs` gives them, K/V expanded to every query head."""
    import torch.nn.functional as F

    d = q.shape[-1]
    qs, ks, vs = (x.reshape(b, s_len, -1, d).transpose(1, 2) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
    return bench_graph(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)) * 1e3


L2_BYTES = 50 * 2**20
"""L2 cache of an H100 / H200."""


def weight_copies(w, cold: bool = True) -> list:  # noqa: ANN001 - a torch.Tensor
    """``[w]``, and with ``cold`` clones of it that together exceed four times the L2 cache, so a replay over them
    reads the weights from HBM, as the layers of a decode step do."""
    if not cold:
        return [w]
    return [w] + [w.clone() for _ in range(-(-4 * L2_BYTES // (w.numel() * w.element_size())) - 1)]


def graph_ms_over(fn: Callable[[object], object], ws: list) -> float:
    """Milliseconds per call of ``fn(w)`` over the weight copies ``ws``: one CUDA-graph replay for all of them."""

    def run() -> None:
        for w in ws:
            fn(w)

    return bench_graph(run) / len(ws)


def pick_best(entry: dict) -> None:
    """Record in a sweep ``entry`` its fastest bitwise-equal candidate (``best``, where one ran) and the last candidate
    (``current_result``: the sweeps append the library's own choice last)."""
    ok = [c for c in entry["candidates"] if c.get("bitwise") and "graph_ms" in c]
    if ok:
        entry["best"] = min(ok, key=lambda c: c["graph_ms"])
    entry["current_result"] = entry["candidates"][-1]


def try_candidate(cfg: object, run: Callable[[object], object], ref: object, ws: list) -> dict:
    """One sweep candidate ``cfg``: whether ``run(ws[0])`` equals ``ref`` bitwise (``bitwise``) and its per-call
    graph time over the weight copies ``ws`` (``graph_ms``), or the ``error`` it raised."""
    import torch

    c: dict = {"config": repr(cfg)}
    try:
        c["bitwise"] = bool(torch.equal(run(ws[0]), ref))
        c["graph_ms"] = graph_ms_over(run, ws)
    except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or run is recorded, not fatal
        c["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return c


def best_summary(entry: dict) -> str:
    """``current .. us, best .. us <config>`` of a sweep entry after :func:`pick_best` (the progress lines)."""
    best = entry.get("best", {})
    current_us = entry["current_result"].get("graph_ms", float("nan")) * 1e3
    return f"current {current_us:.1f} us, best {best.get('graph_ms', float('nan')) * 1e3:.1f} us {best.get('config')}"


def run_cases(result: dict, section: str, names: Iterable[str], measure: Callable[[str], object], out: str) -> int:
    """``result[section][name] = measure(name)`` for each name, a failing case's traceback going to
    ``result["errors"][name]`` instead; once a case has succeeded, ``out`` is rewritten after every case, so a crash
    keeps the cases before it. Returns the exit code: 0 when no case failed. When every case failed, ``out`` is never
    written (a result of errors alone must not replace a measured one): raises ``RuntimeError`` with the first
    failure's traceback instead."""
    result.setdefault(section, {})
    result.setdefault("errors", {})
    measured = False
    for name in names:
        try:
            result[section][name] = measure(name)
            measured = True
        except Exception:  # noqa: BLE001 - a failing case is recorded in the result, and fails the exit code
            result["errors"][name] = traceback.format_exc()
        if measured:
            Path(out).write_text(json.dumps(result, indent=1) + "\n")
    if result["errors"] and not measured:
        first, tb = next(iter(result["errors"].items()))
        raise RuntimeError(
            f"every case failed ({', '.join(result['errors'])}); {out} not written. First failure, {first}:\n{tb}"
        )
    return 0 if not result["errors"] else 1


@contextlib.contextmanager
def swapped(owner: object, name: str, value: object) -> Iterator[None]:
    """``owner.name`` set to ``value`` while the block runs (a probe's kernel variant in the library's launch path)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def variant_ints(spec: str, script: str, form: str, minimum: tuple[int, ...]) -> tuple[int, ...]:
    """A probe's ``AxB...`` variant as ``len(minimum)`` integers, each at least its ``minimum``; else exits naming
    ``script`` and ``form``."""
    try:
        values = tuple(int(x) for x in spec.split("x"))
    except ValueError:
        values = ()
    if len(values) != len(minimum) or any(v < m for v, m in zip(values, minimum)):
        raise SystemExit(f"{script}: bad variant {spec!r}; expected {form}")
    return values
