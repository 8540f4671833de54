"""Probe: the exact attention forward as a persistent Gluon kernel, against the library's (one program per tile).

    python benchmarks/gluon_persistent_probe.py [--out benchmarks/results/gluon_persistent_probe_h200.json]

The library's packed forward on sm_90 (``rlexact.ops.gluon_attention``) launches one program per (query tile, head
group); each program's first K/V tile and its query tile are a DRAM round trip nobody hides but the SM's other
resident program. This probe is the same kernel (same per-row operations in the same order, so the same bits)
made persistent: ``PROGRAMS_PER_SM`` programs per SM take work items in ticket order from a counter, start the next
item's query tile (``cp.async``) and first K/V tiles during the current one, and run tile ``j``'s P @ V as an
asynchronous wgmma under tile ``j + 1``'s softmax (K tiles two ahead, V tiles one ahead, separate mbarrier rings).

It records bitwise checks against the library on packed sequences of mixed lengths (:data:`CHECK_LENS`), and per
timing shape the library's forward, the ``tl`` kernel (``{"GLUON": False}``), the probe and SDPA's default backend
as CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from common import ROOT, bench_graph, header, packed_attention_inputs, require_cuda, sdpa_causal_us
from rlexact.ops import triton_attention as ta
from rlexact.ops.gluon_attention import (
    cta_barrier,
    fold,
    locate,
    store_rows,
    tile_softmax,
    tma_load,
    wgmma_layout,
    zero_tail_rows,
)
from rlexact.ops.triton_shared import COMPILE_OPTIONS, num_sms

HQ, HKV, D = 16, 8, 128
HP = HQ // HKV
BLOCK_N = 64
WARPS = 4
SCAN = 128
PROGRAMS_PER_SM = 2
SCALE = 1 / math.sqrt(D)
CHECK_LENS = ([1, 37, 200, 333, 64, 65], [1100, 300, 37, 9], [2500, 31, 1024, 1025, 2049], [5000, 3, 70] * 3,
              [7] * 300)  # fmt: skip
"""Packed sequence lengths of the bitwise checks: partial tiles, several sequences per tile slot, KV splits, empty
tile slots between work items."""



@gluon.jit
def _item(cu_ptr, num_seqs, w, n_work, n_slots, NHG: gl.constexpr, P: gl.constexpr, SCAN: gl.constexpr,
          W: gl.constexpr):  # fmt: skip
    """Work item ``w`` (tile slots from the last, head groups fastest): ``(valid, first token, queries,
    query tile, head group)``. Sequence ``b`` owns the slots from ``cu[b] // P + b``, as in the ``tl`` kernel; a
    slot past its sequence's queries, or ``w >= n_work``, is not valid."""
    wc = gl.minimum(w, n_work - 1)
    b, q_begin, tile = locate(cu_ptr, num_seqs, n_slots - 1 - wc // NHG, P, SCAN, W)
    nq = gl.load(cu_ptr + b + 1) - q_begin
    return (w < n_work) & (tile * P < nq), q_begin, nq, tile, wc % NHG

@gluon.jit
def _load_q(q_ptr, q_smem, valid, q_begin, nq, tile, hgroup, stride_qt, stride_qh, HP: gl.constexpr,
            P: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr):  # fmt: skip
    """Start the copy of a work item's query tile into ``q_smem`` (rows ``(position, head)``, zeros past the
    sequence) as one ``cp.async`` group."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    qi = tile * P + rows // HP
    q_rows = gl.multiple_of((q_begin + qi).to(gl.int64) * stride_qt + (hgroup * HP + rows % HP) * stride_qh, 8)
    ok = (qi < nq) & valid
    async_copy.async_copy_global_to_shared(q_smem, q_ptr + q_rows[:, None] + cols[None, :], mask=ok[:, None])
    async_copy.commit_group()

@gluon.jit
def _tiles(tile, nq, P: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key tiles a query tile reads: through its last position."""
    return (gl.minimum(tile * P + P, nq) - 1) // BLOCK_N + 1

@gluon.jit
def _issue(desc, smem, bars, x, go, base, n_a, a_begin, a_col, b_ok, n_b, b_begin, b_col, BLOCK_N: gl.constexpr,
           NBYTES: gl.constexpr):  # fmt: skip
    """Start the TMA copy of stream tile ``x`` (this item's tile ``x - base`` while below ``n_a``, then the next
    item's) into ring slot ``x % 2`` when ``go`` and the tile exists; returns how many copies started."""
    t = x - base
    in_a = (t < n_a).to(gl.int32)
    ok = go & ((t < n_a) | (b_ok & (t - n_a < n_b)))
    if ok:
        row = in_a * (a_begin + t * BLOCK_N) + (1 - in_a) * (b_begin + (t - n_a) * BLOCK_N)
        col = in_a * a_col + (1 - in_a) * b_col
        mbarrier.expect(bars.index(x % 2), NBYTES)
        tma_load(desc, [row, col], bars.index(x % 2), smem.index(x % 2))
    return ok.to(gl.int32)

@gluon.jit
def _persistent_fwd(q_ptr, o_ptr, lse_ptr, delta_ptr, k_desc, v_desc, cu_ptr, ticket_ptr, num_seqs, n_slots, qk_scale,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, HP: gl.constexpr,
                GROUP: gl.constexpr, NHG: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                SPLIT: gl.constexpr, BWD_PREP: gl.constexpr, SCAN: gl.constexpr, W: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = 16 * W
    P: gl.constexpr = BLOCK_M // HP
    TPS: gl.constexpr = SPLIT // BLOCK_N
    dt: gl.constexpr = q_ptr.dtype.element_ty
    NBYTES: gl.constexpr = BLOCK_N * D * dt.primitive_bitwidth // 8
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_work = n_slots * NHG

    s_layout: gl.constexpr = wgmma_layout(W, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(W, D)
    r_layout: gl.constexpr = wgmma_layout(W, 16)
    pv_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dt, [2, BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D],
                                                                                                 dt))  # fmt: skip
    ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [W, 1], [1, 0])
    ones_smem = gl.allocate_shared_memory(dt, [BLOCK_N, 16], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 16],
                                                                                                  dt))  # fmt: skip
    ones_smem.store(gl.full([BLOCK_N, 16], 1.0, dt, layout=ones_layout))
    k_smem = gl.allocate_shared_memory(dt, [2, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [2, BLOCK_N, D], v_desc.layout)
    k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)

    # Work items in ticket order: the first one per program, then one ticket per item from the counter, taken an
    # item ahead of its use. One stream of K tiles and one of V tiles run through two-deep rings across items:
    # K tile x + 2 and V tile x + 1 are copied while tile x is computed (x counts this program's tiles).
    valid, q_begin, nq, tile, hgroup = _item(cu_ptr, num_seqs, pid, n_work, n_slots, NHG, P, SCAN, W)
    _load_q(q_ptr, q_smem.index(0), valid, q_begin, nq, tile, hgroup, stride_qt, stride_qh, HP, P, D, BLOCK_M, W)
    nxt = nprog + gl.atomic_add(ticket_ptr, 1, sem="relaxed")
    it = 0  # tiles consumed: K and V tile x sit in ring slot x % 2, phase (x // 2) & 1
    kk = 0  # K tiles whose copies started
    vv = 0  # V tiles whose copies started
    n_items = 0
    w = pid
    while w < n_work:
        qb = n_items % 2
        async_copy.wait_group(0)  # this item's query tile; after the barrier no warp reads the other buffer
        fence_async_shared()
        cta_barrier()
        after = nprog + gl.atomic_add(ticket_ptr, 1, sem="relaxed")
        n_valid, n_begin, n_nq, n_tile, n_hgroup = _item(cu_ptr, num_seqs, nxt, n_work, n_slots, NHG, P, SCAN, W)
        _load_q(q_ptr, q_smem.index(1 - qb), n_valid, n_begin, n_nq, n_tile, n_hgroup, stride_qt, stride_qh, HP,
                P, D, BLOCK_M, W)  # fmt: skip
        kv_col = (hgroup * HP) // GROUP * D
        n_kv_col = (n_hgroup * HP) // GROUP * D
        n_tiles = _tiles(tile, nq, P, BLOCK_N) * valid.to(gl.int32)
        n_ntiles = _tiles(n_tile, n_nq, P, BLOCK_N)
        base = it
        # no MMA is in flight here: both K slots and both V slots are free
        kk += _issue(k_desc, k_smem, k_bars, kk, kk <= base, base, n_tiles, q_begin, kv_col, n_valid, n_ntiles,
                     n_begin, n_kv_col, BLOCK_N, NBYTES)  # fmt: skip
        kk += _issue(k_desc, k_smem, k_bars, kk, kk <= base + 1, base, n_tiles, q_begin, kv_col, n_valid,
                     n_ntiles, n_begin, n_kv_col, BLOCK_N, NBYTES)  # fmt: skip
        vv += _issue(v_desc, v_smem, v_bars, vv, vv <= base, base, n_tiles, q_begin, kv_col, n_valid, n_ntiles,
                     n_begin, n_kv_col, BLOCK_N, NBYTES)  # fmt: skip
        if valid:
            n_full = (tile * P + 1) // BLOCK_N  # tiles below it are seen by every row, wholly inside the sequence
            pos = tile * P + gl.arange(0, BLOCK_M, layout=row_s) // HP
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)  # the folded splits so far
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
            m_s = m_i  # the current split's partial
            l_s = l_i
            acc_s = acc
            pv_o = gl.zeros([BLOCK_M, BLOCK_N], dt, layout=pv_layout)  # P of the P @ V in flight (kept alive)
            mbarrier.wait(k_bars.index(base % 2), (base // 2) & 1)
            s = warpgroup_mma(q_smem.index(qb), k_smem.index(base % 2).permute((1, 0)), s_zero, use_acc=False)
            for j in range(n_tiles):
                x = base + j
                buf = x % 2
                # S(j) is done, so K slot buf is free; P @ V of tile j - 1 may still run (it reads the other V)
                kk += _issue(k_desc, k_smem, k_bars, kk, kk <= x + 2, base, n_tiles, q_begin, kv_col, n_valid,
                             n_ntiles, n_begin, n_kv_col, BLOCK_N, NBYTES)  # fmt: skip
                if j % TPS == 0:  # a split starts from the empty state (the last split's P @ V was waited for)
                    m_s = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
                    l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
                    acc_s = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
                if j >= n_full:
                    kpos = j * BLOCK_N + offs_n
                    s = gl.where((kpos[None, :] <= pos[:, None]) & (kpos < nq)[None, :], s, float("-inf"))
                m_new, alpha, pv = tile_softmax(s, m_s, qk_scale, dt)
                rsum = warpgroup_mma(gl.convert_layout(pv, gl.DotOperandLayout(0, r_layout, 2)), ones_smem, r_zero,
                                     use_acc=False, is_async=True)  # fmt: skip
                rsum, acc_s, pv_o = warpgroup_mma_wait(0, deps=(rsum, acc_s, pv_o))  # P @ V of tile j - 1 too
                vv += _issue(v_desc, v_smem, v_bars, vv, vv <= x + 1, base, n_tiles, q_begin, kv_col, n_valid,
                             n_ntiles, n_begin, n_kv_col, BLOCK_N, NBYTES)  # fmt: skip
                l_s = gl.fma(l_s, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
                mbarrier.wait(v_bars.index(buf), (x // 2) & 1)
                if (j + 1) * BLOCK_N > nq:  # V rows past the sequence: zeros, whatever the next one holds
                    zero_tail_rows(v_smem.index(buf), j * BLOCK_N, nq, BLOCK_N, blk)
                pv_o = gl.convert_layout(pv, pv_layout)
                m_s = m_new
                if (j + 1 < n_tiles) & (j % TPS != TPS - 1):  # S(j + 1) and P @ V(j) in flight, wait for S only
                    mbarrier.wait(k_bars.index(1 - buf), ((x + 1) // 2) & 1)
                    s_next = warpgroup_mma(q_smem.index(qb), k_smem.index(1 - buf).permute((1, 0)), s_zero,
                                           use_acc=False, is_async=True)  # fmt: skip
                    acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
                    acc_s = warpgroup_mma(pv_o, v_smem.index(buf), acc_s, is_async=True)
                    s, acc_s, pv_o = warpgroup_mma_wait(1, deps=(s_next, acc_s, pv_o))
                else:  # the split ends: P @ V(j) synchronous, fold (the tl kernel's merge), then S(j + 1)
                    acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
                    acc_s = warpgroup_mma(pv_o, v_smem.index(buf), acc_s)
                    m_i, l_i, acc = fold(m_i, l_i, acc, m_s, l_s, acc_s, o_layout)
                    if j + 1 < n_tiles:
                        mbarrier.wait(k_bars.index(1 - buf), ((x + 1) // 2) & 1)
                        s = warpgroup_mma(q_smem.index(qb), k_smem.index(1 - buf).permute((1, 0)), s_zero,
                                          use_acc=False)  # fmt: skip
            it += n_tiles
            store_rows(o_ptr, lse_ptr, delta_ptr, acc, m_i, l_i, q_begin, nq, tile, hgroup, stride_ot, stride_oh,
                       stride_lt, stride_lh, HP, P, D, BLOCK_M, BWD_PREP, o_layout)  # fmt: skip
        valid, q_begin, nq, tile, hgroup = n_valid, n_begin, n_nq, n_tile, n_hgroup
        w = nxt
        nxt = after
        n_items += 1
    async_copy.wait_group(0)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))


def persistent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, out: torch.Tensor,
            hp: int, split: int, lse_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
            programs: int | None = None) -> None:  # fmt: skip
    """The packed causal forward of ``q [T, Hq, 128]``, ``k, v [T, Hkv, 128]`` (dense), ``cu [B + 1]`` int32 into
    ``out``, ``hp`` query heads per tile, KV splits of ``split`` keys; with ``lse_delta`` the backward's preprocessing
    (``out`` holds dO). ``programs``: persistent programs (default :data:`PROGRAMS_PER_SM` per SM, at most one per
    work item); each takes the next work item from a ticket counter when it starts its current one. K/V as
    :func:`rlexact.ops.gluon_attention.supported` requires, query rows 16-byte aligned."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    num_seqs = cu.shape[0] - 1
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gl.float16 if q.dtype == torch.float16 else
                                                  gl.bfloat16)  # fmt: skip
    k_desc = GluonDescriptor(k, [t, hkv * d], [k.stride(0), 1], [BLOCK_N, d], layout)
    v_desc = GluonDescriptor(v, [t, hkv * d], [v.stride(0), 1], [BLOCK_N, d], layout)
    lse, delta = lse_delta if lse_delta is not None else (out, out)  # unread without BWD_PREP
    n_slots = t // (16 * WARPS // hp) + num_seqs
    grid = (min(n_slots * (hq // hp), programs or PROGRAMS_PER_SM * num_sms(q.device)),)
    ticket = torch.zeros(1, dtype=torch.int32, device=q.device)
    _persistent_fwd[grid](
        q, out, lse, delta, k_desc, v_desc, cu, ticket, num_seqs, n_slots, scale * math.log2(math.e), q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), HP=hp, GROUP=hq // hkv, NHG=hq // hp,
        D=d, BLOCK_N=BLOCK_N, SPLIT=split, BWD_PREP=lse_delta is not None, SCAN=SCAN, W=WARPS, num_warps=WARPS,
        **COMPILE_OPTIONS,
    )  # fmt: skip


def _inputs(lens: list[int]) -> tuple:
    return packed_attention_inputs(lens, HQ, HKV, D)


def _run(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
         programs: int | None = None) -> torch.Tensor:  # fmt: skip
    out = torch.empty_like(q)
    if kind == "probe":
        split = ta._launch_config(D, q.dtype, False)["SPLIT"]
        persistent(q, k, v, cu, SCALE, out, HP, split, programs=programs)
    else:
        ta._forward(q, k, v, cu, None, None, SCALE, out, cfg={"GLUON": False} if kind == "tl" else None)
    return out


def check(lens: list[int]) -> dict:
    """Bitwise comparison with the library's forward on packed sequences of lengths ``lens`` (the default grid and
    three programs, so that each program runs many work items)."""
    q, k, v, cu = _inputs(lens)
    ref = _run("library", q, k, v, cu)
    return {"lens": lens, "bitwise_equal_library": bool(torch.equal(_run("probe", q, k, v, cu), ref)),
            "bitwise_equal_library_3_programs": bool(torch.equal(_run("probe", q, k, v, cu, 3), ref))}  # fmt: skip


def measure(b: int, s_len: int) -> dict:
    """One timing shape (``b`` sequences of ``s_len`` tokens), microseconds."""
    q, k, v, cu = _inputs([s_len] * b)
    ref = _run("library", q, k, v, cu)
    row: dict = {"probe_bitwise_equal_library": bool(torch.equal(_run("probe", q, k, v, cu), ref))}
    for kind in ("library", "tl", "probe"):
        row[f"{kind}_us"] = bench_graph(lambda kind=kind: _run(kind, q, k, v, cu)) * 1e3
    row["sdpa_default_us"] = sdpa_causal_us(q, k, v, b, s_len, SCALE)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_persistent_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["64x512", "8x4096", "1x8192", "128x256", "16x1024"])
    args = ap.parse_args()
    require_cuda("gluon_persistent_probe.py")
    t0 = time.time()
    result: dict = header("gluon_persistent_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "dtype": "bfloat16",
        "programs_per_sm": PROGRAMS_PER_SM,
        "timing": "median of do_bench_cudagraph, microseconds",
        "checks": [check(lens) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_persistent_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        b, s_len = (int(x) for x in shape.split("x"))
        result["shapes"][shape] = row = measure(b, s_len)
        print("[gluon_persistent_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
