"""Probe: can a Gluon kernel run the exact attention forward faster than the library's ``tl`` kernel, with its bits?

    python benchmarks/gluon_attention_probe.py [--out benchmarks/results/gluon_attention_probe_h200.json]

The library's forward (``rlexact.ops.triton_attention``) is a ``tl`` kernel; Triton's Gluon dialect gives explicit
layouts, TMA, mbarriers and wgmma. This probe is the training forward (packed causal sequences of any lengths, bf16,
head dim 128, GQA groups of 2 packed into 64-row tiles, KV splits merged in ascending order) written in Gluon: Q in
shared memory, K/V tiles through a two-deep TMA ring, the three wgmmas per key tile explicit, the ones tile of the
row-sum dot stored once per program, the same per-row operations in the same order as the library. Its output must
equal the library's bitwise. It reads the keys past a sequence (the next sequence's, or TMA's zero fill) and masks
their scores, so it assumes finite inputs, where the library's masked loads read 0.

It records the bitwise checks on packed sequences of mixed lengths (:data:`CHECK_LENS`) and, per timing shape, the
library's forward, the probe and SDPA's default backend as CUDA-graph replays (the dd52daf version of this file also
timed variants that issue the next tile's scores under the softmax, and eight warps: both slower).
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
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from common import ROOT, bench_graph, header
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
HP = HQ // HKV
BLOCK_N = 64
SCALE = 1 / math.sqrt(D)
CHECK_LENS = ([1, 37, 200, 333, 64, 65], [1100, 300, 37, 9], [2500, 31, 1024, 1025, 2049])
"""Packed sequence lengths of the bitwise checks: partial tiles, several sequences per tile slot, up to three KV
splits and lengths at split and tile boundaries."""


@gluon.jit
def _locate(cu_ptr, num_seqs, slot, P: gl.constexpr, SCAN: gl.constexpr, W: gl.constexpr):
    """``(sequence, tile within it)`` of tile slot ``slot``, as the library's ``_locate_tile`` maps them."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    count = slot * 0
    for c in range(0, num_seqs, SCAN):
        offs = c + gl.arange(0, SCAN, layout=lay)
        inside = offs < num_seqs
        start = gl.load(cu_ptr + offs, mask=inside, other=0)
        count += gl.sum(((start // P + offs <= slot) & inside).to(gl.int32), axis=0)
    b = count - 1
    return b, slot - (gl.load(cu_ptr + b) // P + b)


@gluon.jit
def _probe_fwd(q_ptr, o_ptr, k_desc, v_desc, cu_ptr, num_seqs, qk_scale, HQ: gl.constexpr, HP: gl.constexpr,
               D: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, SCAN: gl.constexpr,
               W: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = 16 * W  # one m16 row block per warp
    P: gl.constexpr = BLOCK_M // HP
    TPS: gl.constexpr = SPLIT // BLOCK_N
    kvh = gl.program_id(1)
    b, tile = _locate(cu_ptr, num_seqs, gl.num_programs(0) - 1 - gl.program_id(0), P, SCAN, W)
    q_begin = gl.load(cu_ptr + b)
    nq = gl.load(cu_ptr + b + 1) - q_begin
    if tile * P >= nq:
        return

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, 128, 16])
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, 16, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    qi = tile * P + rows // HP
    qrow = (q_begin + qi).to(gl.int64) * (HQ * D) + (kvh * HP + rows % HP) * D
    q = gl.load(q_ptr + qrow[:, None] + cols[None, :], mask=(qi < nq)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D],
                                                                                                      gl.bfloat16))
    q_smem.store(q)
    ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [W, 1], [1, 0])
    ones_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 16], gl.NVMMASharedLayout.get_default_for(
        [BLOCK_N, 16], gl.bfloat16))  # fmt: skip
    ones_smem.store(gl.full([BLOCK_N, 16], 1.0, gl.bfloat16, layout=ones_layout))
    fence_async_shared()

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    last_pos = gl.minimum(tile * P + P, nq) - 1
    n_tiles = last_pos // BLOCK_N + 1
    n_full = (tile * P + 1) // BLOCK_N
    pos = tile * P + gl.arange(0, BLOCK_M, layout=row_s) // HP
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    nbytes: gl.constexpr = 2 * BLOCK_N * D * 2

    mbarrier.expect(bars.index(0), nbytes)
    tma.async_copy_global_to_shared(k_desc, [q_begin, kvh * D], bars.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [q_begin, kvh * D], bars.index(0), v_smem.index(0))

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)  # the merged state of the splits so far
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    m_s = m_i  # the current split's partial
    l_s = l_i
    acc_s = acc
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)

    mbarrier.wait(bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
    for j in range(n_tiles):
        buf = j % 2
        if j + 1 < n_tiles:  # the next tile's K/V into the other buffer (tile j - 1's MMAs are done)
            mbarrier.expect(bars.index(1 - buf), nbytes)
            tma.async_copy_global_to_shared(k_desc, [q_begin + (j + 1) * BLOCK_N, kvh * D], bars.index(1 - buf),
                                            k_smem.index(1 - buf))  # fmt: skip
            tma.async_copy_global_to_shared(v_desc, [q_begin + (j + 1) * BLOCK_N, kvh * D], bars.index(1 - buf),
                                            v_smem.index(1 - buf))  # fmt: skip
        if j % TPS == 0:  # a split starts from the empty state
            m_s = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc_s = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        if j >= n_full:
            kpos = j * BLOCK_N + offs_n
            s = gl.where((kpos[None, :] <= pos[:, None]) & (kpos < nq)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_s, gl.max(s, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_s - m_use)
        pv = gl.exp2(gl.fma(s, qk_scale, -m_use[:, None])).to(gl.bfloat16)
        rsum = warpgroup_mma(gl.convert_layout(pv, gl.DotOperandLayout(0, r_layout, 2)), ones_smem, r_zero,
                             use_acc=False)  # fmt: skip
        l_s = gl.fma(l_s, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
        acc_s = acc_s * gl.convert_layout(alpha, row_o)[:, None]
        acc_s = warpgroup_mma(gl.convert_layout(pv, gl.DotOperandLayout(0, o_layout, 2)), v_smem.index(buf), acc_s)
        m_s = m_new
        if (j % TPS == TPS - 1) | (j == n_tiles - 1):  # fold the split into the merged state (library order)
            m_new = gl.maximum(m_i, m_s)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            a = gl.exp2(m_i - m_use)
            c = gl.exp2(m_s - m_use)
            l_i = gl.fma(l_i, a, l_s * c)
            acc = gl.fma(acc, gl.convert_layout(a, row_o)[:, None], acc_s * gl.convert_layout(c, row_o)[:, None])
            m_i = m_new
        if j + 1 < n_tiles:
            mbarrier.wait(bars.index(1 - buf), ((j + 1) // 2) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(1 - buf).permute((1, 0)), s_zero, use_acc=False)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    orows = gl.arange(0, BLOCK_M, layout=row_o)
    ocols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    oqi = tile * P + orows // HP
    orow = (q_begin + oqi).to(gl.int64) * (HQ * D) + (kvh * HP + orows % HP) * D
    gl.store(o_ptr + orow[:, None] + ocols[None, :], out.to(gl.bfloat16), mask=(oqi < nq)[:, None])


def probe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, warps: int = 4) -> torch.Tensor:
    """The probe's forward of packed sequences ``cu`` (int32 offsets), ``warps`` warps per program."""
    t = q.shape[0]
    out = torch.empty_like(q)
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    k2, v2 = k.view(t, HKV * D), v.view(t, HKV * D)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], layout)
    num_seqs = cu.shape[0] - 1
    grid = (t // (16 * warps // HP) + num_seqs, HKV)
    _probe_fwd[grid](q, out, k_desc, v_desc, cu, num_seqs, SCALE * math.log2(math.e), HQ=HQ, HP=HP, D=D,
                     BLOCK_N=BLOCK_N, SPLIT=ta.SPLIT_KEYS_16BIT, SCAN=128, W=warps, num_warps=warps)  # fmt: skip
    return out


def _inputs(lens: list[int]) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return q, k, v, cu


def check(lens: list[int]) -> dict:
    """Bitwise comparison with the library's forward on packed sequences of lengths ``lens``."""
    q, k, v, cu = _inputs(lens)
    ref = ta.attention_varlen(q, k, v, cu, SCALE)
    out = probe(q, k, v, cu)
    return {"lens": lens, "bitwise_equal_library": bool(torch.equal(out, ref)),
            "max_abs_diff": float((out.float() - ref.float()).abs().max())}  # fmt: skip


def measure(b: int, s_len: int) -> dict:
    """One timing shape (``b`` sequences of ``s_len`` tokens): the library's forward, the probe (bitwise check and
    time) and SDPA's default, in microseconds."""
    import torch.nn.functional as F

    q, k, v, cu = _inputs([s_len] * b)
    ref = ta.attention_varlen(q, k, v, cu, SCALE)
    out = probe(q, k, v, cu)
    row: dict = {
        "library_us": bench_graph(lambda: ta.attention_varlen(q, k, v, cu, SCALE)) * 1e3,
        "probe": {
            "bitwise_equal_library": bool(torch.equal(out, ref)),
            "us": bench_graph(lambda: probe(q, k, v, cu)) * 1e3,
        },
    }
    qs, ks, vs = (x.view(b, s_len, -1, D).transpose(1, 2) for x in (q, k, v))
    ks, vs = ks.repeat_interleave(HP, 1), vs.repeat_interleave(HP, 1)
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE)  # noqa: E731
    row["sdpa_default_us"] = bench_graph(sdpa) * 1e3
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_attention_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["64x512", "8x4096", "1x8192", "128x256"], help="BxS timings")
    args = ap.parse_args()
    t0 = time.time()
    result: dict = header("gluon_attention_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "dtype": "bfloat16",
        "timing": "median of do_bench_cudagraph, microseconds",
        "checks": [check(lens) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_attention_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        b, s_len = (int(x) for x in shape.split("x"))
        result["shapes"][shape] = row = measure(b, s_len)
        print("[gluon_attention_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
