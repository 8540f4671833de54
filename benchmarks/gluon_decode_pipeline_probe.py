"""Probe: the Gluon decode attention with its consumer pipelined across key tiles, against the library's and ``tl``.

    timeout 300 python benchmarks/gluon_decode_pipeline_probe.py [--out ...gluon_decode_pipeline_probe_h200.json]

The library's Gluon decode kernel (``rlexact.ops.gluon_decode``) runs each key tile's three wgmmas one after the
other (scores, row-sum dot, P @ V), each waited for, with the softmax between them. It beats the ``tl`` launch where
that launch's per-program start-up dominates (short contexts at large batches) and falls behind it on long streams
of tiles (``gluon_decode_splits_probe_h200.json``), and one program per SM is slower than two, so the consumer's
chain per tile is the suspect. Here the consumer runs the prefill kernel's pipelined loop: tile ``j + 1``'s score
wgmma is issued together with tile ``j``'s P @ V, and tile ``j + 1``'s softmax and row-sum dot run while that P @ V
is in flight; no wgmma is in flight across an item. The producer, the rings and the per-row operations are the
library's, so the bits must be the ``tl`` launch's: checked on mixed lengths 1-1,024 with shuffled pages and NaN in
every cache slot past a sequence, with a perturbed-key negative control, and at every timing shape.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from attention_configs import DT, HKV, HQ, PAGE, SCALE, D, decode_case, run
from common import ROOT, bench_graph, header
from gluon_decode_probe import CHECK_LENS, mixed_case
from rlexact.ops import gluon_decode as gd
from rlexact.ops import triton_attention as ta
from rlexact.ops.gluon_attention import launch, store_rows, tile_softmax, wgmma_layout, zero_tail_rows

TL = {"GLUON": False}


@gluon.jit
def _consumer(q_ptr, o_ptr, seqlens_ptr, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, n_items,
              n_groups, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, HP: gl.constexpr,
              D: gl.constexpr):  # fmt: skip
    """Every item of this program, one at a time, its key tiles in the pipelined loop."""
    BLOCK_M: gl.constexpr = 16 * gd.W
    BLOCK_N: gl.constexpr = gd.TILE_N
    SLOTS: gl.constexpr = gd.SLOTS
    dt: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = wgmma_layout(gd.W, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(gd.W, D)
    r_layout: gl.constexpr = wgmma_layout(gd.W, 16)
    q_op: gl.constexpr = gl.DotOperandLayout(0, s_layout, 2)
    r_op: gl.constexpr = gl.DotOperandLayout(0, r_layout, 2)
    pv_op: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gd.W, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)
    step = gl.num_programs(0)
    q_next, len_next = gd.query_rows(q_ptr, seqlens_ptr, gl.program_id(0), n_items, n_groups, stride_qt, stride_qh,
                                     HP, D, blk)  # fmt: skip
    x = 0
    for it in range(gl.program_id(0), n_items, step):
        q = gl.convert_layout(q_next, q_op)
        seqlen = len_next
        q_next, len_next = gd.query_rows(q_ptr, seqlens_ptr, it + step, n_items, n_groups, stride_qt, stride_qh, HP,
                                         D, blk)  # fmt: skip
        n_tiles = (seqlen + BLOCK_N - 1) // BLOCK_N
        n_full = seqlen // BLOCK_N  # tiles below it are wholly inside the sequence
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        slot = x % SLOTS
        phase = (x // SLOTS) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
        mbarrier.arrive(k_empty.index(slot), count=1)
        if n_full == 0:
            s = gl.where((offs_n < seqlen)[None, :], s, float("-inf"))
        m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
        rsum = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False)
        l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
        p_op = gl.convert_layout(p, pv_op)
        for j in range(0, n_tiles - 1):  # tile j's P @ V under tile j + 1's scores and softmax
            nxt = (x + 1) % SLOTS
            nphase = ((x + 1) // SLOTS) & 1
            mbarrier.wait(k_ready.index(nxt), nphase)
            s_tok = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.wait(v_ready.index(slot), phase)
            acc_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            s, acc, p_op = warpgroup_mma_wait(1, deps=(s_tok, acc_tok, p_op))  # the scores; P @ V may run
            mbarrier.arrive(k_empty.index(nxt), count=1)
            if j + 1 >= n_full:
                s = gl.where(((j + 1) * BLOCK_N + offs_n < seqlen)[None, :], s, float("-inf"))
            m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
            r_tok = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False, is_async=True)
            rsum, acc, p_op = warpgroup_mma_wait(0, deps=(r_tok, acc, p_op))
            mbarrier.arrive(v_empty.index(slot), count=1)
            l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
            p_op = gl.convert_layout(p, pv_op)
            x += 1
            slot = nxt
            phase = nphase
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]  # the last tile's P @ V
        mbarrier.wait(v_ready.index(slot), phase)
        if n_full < n_tiles:  # V rows past the sequence (stale cache rows or zero fill): zeros
            zero_tail_rows(v_smem.index(slot), (n_tiles - 1) * BLOCK_N, seqlen, BLOCK_N, blk)
        acc = warpgroup_mma(p_op, v_smem.index(slot), acc)
        mbarrier.arrive(v_empty.index(slot), count=1)
        x += 1
        store_rows(o_ptr, o_ptr, o_ptr, acc, m_i, l_i, it // n_groups, 1, 0, it % n_groups, stride_ot, stride_oh, 0,
                   0, HP, BLOCK_M // HP, D, BLOCK_M, False, o_layout)  # fmt: skip


@gluon.jit
def _pipelined_kernel(q_ptr, o_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, n_items, n_groups, hp, group, qk_scale,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, width, n_rows, HP: gl.constexpr,
                      D: gl.constexpr):  # fmt: skip
    ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = gd.rings(k_desc, v_desc)
    gl.warp_specialize(
        [
            (_consumer, (q_ptr, o_ptr, seqlens_ptr, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                         n_items, n_groups, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, HP, D)),
            (gd.producer, (k_desc, v_desc, bt_ptr, seqlens_ptr, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                           n_items, n_groups, hp, group, stride_bt, width, n_rows)),
        ],
        [1],
        [gd.PRODUCER_REGS],
    )  # fmt: skip


def pipelined(case: tuple, per_sm: int = gd.PROGRAMS_PER_SM) -> torch.Tensor:
    """One decode step of ``case`` (contexts within one KV split) through the pipelined kernel."""
    q, k_cache, v_cache, _, lens, tables = case
    out = torch.empty_like(q)
    plan = gd.launch_plan(q, k_cache, v_cache, tables, lens, SCALE, out, HQ // HKV, per_sm)
    launch(_pipelined_kernel, *plan, gd.LAUNCH_OPTIONS)
    return out


def check(lens: list[int]) -> dict:
    case = mixed_case(lens)
    q, k, v, cu, lens_t, tables = case
    if not gd.supported(q, k, v, 64, ta.SPLIT_KEYS_16BIT):
        raise SystemExit("gluon_decode_pipeline_probe: needs an sm_90 GPU and a Triton with Gluon")
    ref = run(case, TL)
    k2 = k.clone()
    k2[int(tables[-1, 0]), 0, 0, 0] += 1.0  # the last sequence's first key
    return {
        "n": len(lens),
        "max_len": max(lens),
        "bitwise_equal_tl": bool(torch.equal(pipelined(case), ref)),
        "bitwise_equal_tl_one_per_sm": bool(torch.equal(pipelined(case, 1), ref)),
        "negative_control_differs": not torch.equal(pipelined((q, k2, v, cu, lens_t, tables)), ref),
    }


def measure(b: int, ctx: int) -> dict:
    case = decode_case(b, ctx)
    ref = run(case, TL)
    return {
        "tl_us": bench_graph(lambda: run(case, TL)) * 1e3,
        "library_bitwise_equal_tl": bool(torch.equal(run(case, None), ref)),
        "library_us": bench_graph(lambda: run(case, None)) * 1e3,
        "pipelined_bitwise_equal_tl": bool(torch.equal(pipelined(case), ref)),
        "pipelined_us": bench_graph(lambda: pipelined(case)) * 1e3,
        "pipelined_one_per_sm_us": bench_graph(lambda: pipelined(case, 1)) * 1e3,
        "kv_roofline_us": 2 * b * ctx * HKV * D * DT.itemsize / 4.8e12 * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_decode_pipeline_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["256x160", "256x256", "256x384", "128x256", "64x1024", "32x1024",
                                                    "512x256", "256x1024"])  # fmt: skip
    args = ap.parse_args()
    t0 = time.time()
    result: dict = header("gluon_decode_pipeline_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "page": PAGE,
        "dtype": "bfloat16",
        "programs_per_sm": gd.PROGRAMS_PER_SM,
        "timing": "median of do_bench_cudagraph, microseconds; kv_roofline_us: K/V bytes at 4.8 TB/s",
        "checks": [check(lens) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_decode_pipeline_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        b, ctx = (int(x) for x in shape.split("x"))
        result["shapes"][shape] = row = measure(b, ctx)
        print("[gluon_decode_pipeline_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
