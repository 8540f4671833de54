"""Probe: a persistent, warp-specialized exact decode attention (Gluon, sm_90) against the library's decode launch.

    timeout 300 python benchmarks/gluon_decode_probe.py [--out ...gluon_decode_probe_h200.json]

The library's decode launch (``triton_attention``, one query per sequence) runs one program per (sequence, KV head):
at batch 256 that is 2,048 programs, about five waves of them, and its time has a fixed part that grows with the
number of waves (``attention_decode_scaling_h200.json``: each program's dependent loads of the sequence length, the
block table and its first K/V tile are exposed once per program). Here a grid of a few programs per SM walks the
same (sequence, head group) items in turn: a producer warp reads each item's length and block-table row, and copies
its 64-key tiles page by page (TMA, 16-key boxes) through K and V rings that run ahead across item boundaries; a
4-warp consumer partition prefetches the next item's query rows and length while it computes the current one. The
per-row operations are the library's (one KV split: contexts up to ``SPLIT`` keys), so the bits must be its bits:
checked bitwise on mixed lengths with shuffled pages, with a perturbed-key negative control, and at every timing
shape. Timings are CUDA-graph replays of both launches on the same paged caches (pages in random order).
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
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from attention_configs import DT, HKV, HQ, PAGE, SCALE, D, decode_case, run
from common import ROOT, bench_graph, header
from rlexact.ops import gluon_attention as ga
from rlexact.ops import triton_attention as ta
from rlexact.ops.gluon_attention import store_rows, tile_softmax, zero_tail_rows
from rlexact.ops.triton_shared import COMPILE_OPTIONS, num_sms

W = gl.constexpr(4)
"""Consumer warps (one warp group: 64-row wgmma tiles, of which a decode item uses ``HP``)."""
SLOTS = gl.constexpr(3)
"""Depth of the K ring and of the V ring."""
TILE_N = gl.constexpr(ga.BLOCK_N)
PAGE_N = gl.constexpr(PAGE)
PAGES = gl.constexpr(ga.BLOCK_N // PAGE)
"""Pages per key tile (one TMA box each)."""
MAX_PAGES = gl.constexpr(ta.SPLIT_KEYS_16BIT // PAGE)
"""Block-table entries one item can use (one KV split)."""
PRODUCER_REGS = gl.constexpr(40)
MAXNREG = 128
"""Registers per thread of a 5-warp program with two programs per SM (65,536 / 320, rounded down to 8)."""


@gluon.jit
def _copy_tile(desc, dst, bar, rows0, rows1, rows2, rows3, col):
    """One key tile: four pages (16-key TMA boxes, first rows ``rows0 .. rows3``) into ``dst``, signalling ``bar``."""
    nbytes: gl.constexpr = TILE_N * desc.block_type.shape[1] * desc.dtype.primitive_bitwidth // 8
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(desc, [rows0, col], bar, dst.slice(0, PAGE_N))
    tma.async_copy_global_to_shared(desc, [rows1, col], bar, dst.slice(PAGE_N, PAGE_N))
    tma.async_copy_global_to_shared(desc, [rows2, col], bar, dst.slice(2 * PAGE_N, PAGE_N))
    tma.async_copy_global_to_shared(desc, [rows3, col], bar, dst.slice(3 * PAGE_N, PAGE_N))


@gluon.jit
def _producer(k_desc, v_desc, bt_ptr, seqlens_ptr, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items,
              n_groups, hp, group, stride_bt, width, n_rows):  # fmt: skip
    """Copy every item's key tiles (K, then V, page by page) into the rings, each slot once the consumer freed it."""
    lay: gl.constexpr = gl.BlockedLayout([MAX_PAGES // 32], [32], [1], [0])
    idx = gl.arange(0, MAX_PAGES, layout=lay)
    d: gl.constexpr = k_desc.block_type.shape[1]
    x = 0
    for it in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b = it // n_groups
        kv_col = ((it % n_groups) * hp) // group * d
        seqlen = gl.load(seqlens_ptr + b)
        blocks = gl.load(bt_ptr + b.to(gl.int64) * stride_bt + idx, mask=idx < width, other=0)
        for j in range(0, (seqlen + TILE_N - 1) // TILE_N):
            slot = x % SLOTS
            phase = ((x // SLOTS) & 1) ^ 1  # a fresh barrier counts as released: the first pass does not wait
            n_pg = gl.minimum((seqlen - j * TILE_N + PAGE_N - 1) // PAGE_N, PAGES)
            # pages past the sequence are read from past the cache's last row: TMA fills them with zeros and still
            # counts their bytes, so every slot expects a whole tile
            rows0 = gl.sum(gl.where(idx == j * PAGES, blocks, 0), axis=0) * PAGE_N
            rows1 = gl.where(n_pg > 1, gl.sum(gl.where(idx == j * PAGES + 1, blocks, 0), axis=0) * PAGE_N, n_rows)
            rows2 = gl.where(n_pg > 2, gl.sum(gl.where(idx == j * PAGES + 2, blocks, 0), axis=0) * PAGE_N, n_rows)
            rows3 = gl.where(n_pg > 3, gl.sum(gl.where(idx == j * PAGES + 3, blocks, 0), axis=0) * PAGE_N, n_rows)
            mbarrier.wait(k_empty.index(slot), phase)
            _copy_tile(k_desc, k_smem.index(slot), k_ready.index(slot), rows0, rows1, rows2, rows3, kv_col)
            mbarrier.wait(v_empty.index(slot), phase)
            _copy_tile(v_desc, v_smem.index(slot), v_ready.index(slot), rows0, rows1, rows2, rows3, kv_col)
            x += 1


@gluon.jit
def _query(q_ptr, seqlens_ptr, it, n_items, n_groups, stride_qt, stride_qh, HP: gl.constexpr, D: gl.constexpr,
           blk: gl.constexpr):  # fmt: skip
    """Item ``it``'s query rows (``HP`` heads of one sequence, zero rows after them) and its key count; an index past
    the last item reads the last item again (a prefetch nobody uses)."""
    it = gl.minimum(it, n_items - 1)
    b = it // n_groups
    rows = gl.arange(0, 16 * W, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q_rows = b.to(gl.int64) * stride_qt + ((it % n_groups) * HP + rows) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=(rows < HP)[:, None], other=0.0)
    return q, gl.load(seqlens_ptr + b)


@gluon.jit
def _consumer(q_ptr, o_ptr, seqlens_ptr, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items,
              n_groups, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, HP: gl.constexpr, D: gl.constexpr):
    BLOCK_M: gl.constexpr = 16 * W
    BLOCK_N: gl.constexpr = TILE_N
    dt: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                       instr_shape=[16, D, 16])  # fmt: skip
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                       instr_shape=[16, 16, 16])  # fmt: skip
    q_op: gl.constexpr = gl.DotOperandLayout(0, s_layout, 2)
    r_op: gl.constexpr = gl.DotOperandLayout(0, r_layout, 2)
    pv_op: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)
    step = gl.num_programs(0)
    q_next, len_next = _query(q_ptr, seqlens_ptr, gl.program_id(0), n_items, n_groups, stride_qt, stride_qh, HP, D,
                              blk)  # fmt: skip
    x = 0
    for it in range(gl.program_id(0), n_items, step):
        q = gl.convert_layout(q_next, q_op)
        seqlen = len_next
        q_next, len_next = _query(q_ptr, seqlens_ptr, it + step, n_items, n_groups, stride_qt, stride_qh, HP, D,
                                  blk)  # fmt: skip
        n_full = seqlen // BLOCK_N  # tiles below it are wholly inside the sequence
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        for j in range(0, (seqlen + BLOCK_N - 1) // BLOCK_N):
            slot = x % SLOTS
            phase = (x // SLOTS) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            mbarrier.arrive(k_empty.index(slot), count=1)
            if j >= n_full:
                s = gl.where((j * BLOCK_N + offs_n < seqlen)[None, :], s, float("-inf"))
            m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
            rsum = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False)
            l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.wait(v_ready.index(slot), phase)
            if j >= n_full:  # V rows past the sequence (stale or unloaded): zeros
                zero_tail_rows(v_smem.index(slot), j * BLOCK_N, seqlen, BLOCK_N, blk)
            acc = warpgroup_mma(gl.convert_layout(p, pv_op), v_smem.index(slot), acc)
            mbarrier.arrive(v_empty.index(slot), count=1)
            x += 1
        store_rows(o_ptr, o_ptr, o_ptr, acc, m_i, l_i, it // n_groups, 1, 0, it % n_groups, stride_ot, stride_oh, 0,
                   0, HP, BLOCK_M // HP, D, BLOCK_M, False, o_layout)  # fmt: skip


@gluon.jit
def _decode_kernel(q_ptr, o_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, n_items, n_groups, hp_rt, group, qk_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, width, n_rows, HP: gl.constexpr,
                   D: gl.constexpr):  # fmt: skip
    dt: gl.constexpr = q_ptr.dtype.element_ty
    ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [W, 1], [1, 0])
    ones_smem = gl.allocate_shared_memory(dt, [TILE_N, 16], gl.NVMMASharedLayout.get_default_for([TILE_N, 16], dt))
    ones_smem.store(gl.full([TILE_N, 16], 1.0, dt, layout=ones_layout))
    k_smem = gl.allocate_shared_memory(dt, [SLOTS, TILE_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [SLOTS, TILE_N, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize(
        [
            (_consumer, (q_ptr, o_ptr, seqlens_ptr, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                         n_items, n_groups, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, HP, D)),
            (_producer, (k_desc, v_desc, bt_ptr, seqlens_ptr, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                         n_items, n_groups, hp_rt, group, stride_bt, width, n_rows)),
        ],
        [1],
        [PRODUCER_REGS],
    )  # fmt: skip


def decode_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                   lens: torch.Tensor, scale: float, out: torch.Tensor, per_sm: int = 2) -> None:  # fmt: skip
    """One decode step (``q [B, Hq, 128]``, one query per sequence, every context at most ``SPLIT`` keys) over the
    paged caches ``[NB, PAGE, Hkv, 128]``, into ``out``; a grid of ``per_sm`` programs per SM."""
    b, hq, d = q.shape
    nb, page, hkv, _ = k_cache.shape
    hp = hq // hkv
    layout = ga._kv_layout(q.dtype == torch.float16)
    k_desc = GluonDescriptor(k_cache.view(nb * page, hkv * d), [nb * page, hkv * d], [hkv * d, 1], [PAGE, d], layout)
    v_desc = GluonDescriptor(v_cache.view(nb * page, hkv * d), [nb * page, hkv * d], [hkv * d, 1], [PAGE, d], layout)
    n_items = b * (hq // hp)
    grid = (min(n_items, per_sm * num_sms(q.device)),)
    _decode_kernel[grid](
        q, out, k_desc, v_desc, tables, lens, n_items, hq // hp, hp, hq // hkv, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), tables.shape[1], nb * page, HP=hp,
        D=d, num_warps=W.value, maxnreg=MAXNREG, **COMPILE_OPTIONS,
    )  # fmt: skip


CHECK_LENS = (
    [1, 2, 15, 16, 17, 63, 64, 65, 100, 128, 129, 1000, 1023, 1024],
    [7] * 300,
    list(range(1, 1025, 37)) * 3,
)


def mixed_case(lens: list[int]) -> tuple:
    """A decode case with the given context lengths, pages shuffled across sequences, and stale NaNs in every
    cache slot past a sequence (a read past the end would show)."""
    g = torch.Generator(device="cuda").manual_seed(len(lens))
    nblk = [math.ceil(n / PAGE) for n in lens]
    width = max(nblk)
    total = sum(nblk) + 1
    kc = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=DT, generator=g)
    vc = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=DT, generator=g)
    perm = torch.randperm(total, device="cuda", generator=g).to(torch.int32)
    tables = torch.full((len(lens), width), int(perm[-1]), device="cuda", dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        tables[i, : nblk[i]] = perm[used : used + nblk[i]]
        last = int(perm[used + nblk[i] - 1])
        kc[last, n - (nblk[i] - 1) * PAGE :] = float("nan")
        vc[last, n - (nblk[i] - 1) * PAGE :] = float("nan")
        used += nblk[i]
    kc[int(perm[-1])] = float("nan")
    vc[int(perm[-1])] = float("nan")
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=DT, generator=g)
    cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    return q, kc, vc, cu, torch.tensor(lens, device="cuda", dtype=torch.int32), tables


def probe(case: tuple, per_sm: int) -> torch.Tensor:
    q, k, v, _, lens, tables = case
    out = torch.empty_like(q)
    decode_forward(q, k, v, tables, lens, SCALE, out, per_sm)
    return out


def check(lens: list[int]) -> dict:
    case = mixed_case(lens)
    ref = run(case, None)
    row: dict = {"n": len(lens), "max_len": max(lens), "library_finite": bool(torch.isfinite(ref).all())}
    for per_sm in (1, 2):
        row[f"bitwise_equal_library_{per_sm}"] = bool(torch.equal(probe(case, per_sm), ref))
    q, k, v, cu, lens_t, tables = case
    k2 = k.clone()
    k2[int(tables[-1, 0]), 0, 0, 0] += 1.0  # the last sequence's first key
    row["negative_control_differs"] = not torch.equal(probe((q, k2, v, cu, lens_t, tables), 2), ref)
    return row


def measure(b: int, ctx: int) -> dict:
    case = decode_case(b, ctx)
    ref = run(case, None)
    row: dict = {"library_us": bench_graph(lambda: run(case, None)) * 1e3}
    for per_sm in (1, 2):
        row[f"probe{per_sm}_bitwise_equal_library"] = bool(torch.equal(probe(case, per_sm), ref))
        row[f"probe{per_sm}_us"] = bench_graph(lambda per_sm=per_sm: probe(case, per_sm)) * 1e3
    row["kv_roofline_us"] = 2 * b * ctx * HKV * D * DT.itemsize / 4.8e12 * 1e6
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_decode_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["256x160", "256x256", "256x384", "128x256", "64x256", "64x1024",
                                                    "32x1024", "512x256"])  # fmt: skip
    args = ap.parse_args()
    t0 = time.time()
    result: dict = header("gluon_decode_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "page": PAGE,
        "dtype": "bfloat16",
        "slots": SLOTS.value,
        "maxnreg": MAXNREG,
        "timing": "median of do_bench_cudagraph, microseconds; kv_roofline_us: K/V bytes at 4.8 TB/s",
        "checks": [check(lens) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_decode_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        b, ctx = (int(x) for x in shape.split("x"))
        result["shapes"][shape] = row = measure(b, ctx)
        print("[gluon_decode_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
