"""Probe: can a Gluon kernel run the exact attention forward faster than the library's ``tl`` kernel, with its bits?

    python benchmarks/gluon_attention_probe.py [--out benchmarks/results/gluon_attention_probe_h200.json]

The library's forward (``rlexact.ops.triton_attention``) cannot overlap a key tile's softmax with the next tile's
score MMAs: ``tl.dot`` waits for every wgmma right after issuing it (docs/design.md §2.4). Gluon exposes the
asynchronous wgmma (``warpgroup_mma(is_async=True)``, ``warpgroup_mma_wait``), TMA and mbarriers, so a kernel can
issue tile ``j + 1``'s score MMAs, run tile ``j``'s softmax under them, then wait. This probe is a reduced forward
for the shapes it times (equal-length packed causal sequences of a multiple of 64 tokens within one KV split,
bf16, head dim 128, GQA groups of 2 packed into 64-row tiles): the same per-row operations in the same order as the
library (scores, ``-inf`` mask, ``exp2(fma(s, scale, -m))``, the row sum as a dot with a ones tile, ``fma`` updates,
P @ V accumulated in the MMA's K chain), so its output must equal the library's bitwise.

For each shape (16 query / 8 KV heads) it records, as CUDA-graph replays: the library's forward, the probe
(:data:`VARIANTS`: synchronous, or with the next tile's scores in flight during the softmax; four or eight warps),
SDPA's default backend on the same shape, and whether each probe output is ``torch.equal`` to the library's.
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
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from common import ROOT, bench_graph, header
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
HP = HQ // HKV
BLOCK_N = 64
SCALE = 1 / math.sqrt(D)
VARIANTS = (
    ("probe_sync", False, 4),
    ("probe_async", True, 4),
    ("probe_sync_w8", False, 8),
    ("probe_async_w8", True, 8),
)
"""``(name, ASYNC, warps)``: 16 query rows per warp (64- or 128-row tiles, one or two warp groups)."""


@gluon.jit
def _probe_fwd(q_ptr, o_ptr, k_desc, v_desc, s_len, qk_scale, HQ: gl.constexpr, HP: gl.constexpr,
               D: gl.constexpr, BLOCK_N: gl.constexpr, ASYNC: gl.constexpr, W: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = 16 * W  # one m16 row block per warp
    P: gl.constexpr = BLOCK_M // HP
    pid = gl.program_id(0)
    kvh = gl.program_id(1)
    tiles_per_seq = s_len // P
    seq0 = (pid // tiles_per_seq) * s_len
    tile = pid % tiles_per_seq

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, 128, 16])
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, 16, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])

    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    qrow = (seq0 + tile * P + rows // HP).to(gl.int64) * (HQ * D) + (kvh * HP + rows % HP) * D
    q = gl.load(q_ptr + qrow[:, None] + cols[None, :])
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

    last_pos = tile * P + P - 1
    n_tiles = last_pos // BLOCK_N + 1
    n_full = (tile * P + 1) // BLOCK_N
    pos = tile * P + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) // HP
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    nbytes: gl.constexpr = 2 * BLOCK_N * D * 2

    mbarrier.expect(bars.index(0), nbytes)
    tma.async_copy_global_to_shared(k_desc, [seq0, kvh * D], bars.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [seq0, kvh * D], bars.index(0), v_smem.index(0))

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)

    mbarrier.wait(bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
    for j in range(n_tiles):
        buf = j % 2
        if j + 1 < n_tiles:  # the next tile's K/V into the other buffer (its MMAs of tile j - 1 are done)
            nb = 1 - buf
            mbarrier.expect(bars.index(nb), nbytes)
            tma.async_copy_global_to_shared(k_desc, [seq0 + (j + 1) * BLOCK_N, kvh * D], bars.index(nb),
                                            k_smem.index(nb))  # fmt: skip
            tma.async_copy_global_to_shared(v_desc, [seq0 + (j + 1) * BLOCK_N, kvh * D], bars.index(nb),
                                            v_smem.index(nb))  # fmt: skip
        if ASYNC:  # the next tile's scores (the last iteration recomputes its own) run under this softmax
            nxt = gl.minimum(j + 1, n_tiles - 1)
            if j + 1 < n_tiles:
                mbarrier.wait(bars.index(nxt % 2), (nxt // 2) & 1)
            s_next = warpgroup_mma(q_smem, k_smem.index(nxt % 2).permute((1, 0)), s_zero, use_acc=False,
                                   is_async=True)  # fmt: skip
        if j >= n_full:
            kpos = j * BLOCK_N + offs_n
            s = gl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        pv = gl.exp2(gl.fma(s, qk_scale, -m_use[:, None])).to(gl.bfloat16)
        rsum = warpgroup_mma(gl.convert_layout(pv, gl.DotOperandLayout(0, r_layout, 2)), ones_smem, r_zero,
                             use_acc=False)  # fmt: skip
        l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), gl.SliceLayout(1, s_layout)))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(pv, gl.DotOperandLayout(0, o_layout, 2)), v_smem.index(buf), acc)
        m_i = m_new
        if ASYNC:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
        elif j + 1 < n_tiles:
            mbarrier.wait(bars.index(1 - buf), ((j + 1) // 2) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(1 - buf).permute((1, 0)), s_zero, use_acc=False)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    orows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    ocols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    orow = (seq0 + tile * P + orows // HP).to(gl.int64) * (HQ * D) + (kvh * HP + orows % HP) * D
    gl.store(o_ptr + orow[:, None] + ocols[None, :], out.to(gl.bfloat16))


def probe(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_len: int, asynchronous: bool, warps: int
) -> torch.Tensor:
    t = q.shape[0]
    out = torch.empty_like(q)
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    k2, v2 = k.view(t, HKV * D), v.view(t, HKV * D)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], layout)
    grid = (t // (16 * warps // HP), HKV)
    _probe_fwd[grid](q, out, k_desc, v_desc, s_len, SCALE * math.log2(math.e), HQ=HQ, HP=HP, D=D, BLOCK_N=BLOCK_N,
                     ASYNC=asynchronous, W=warps, num_warps=warps)  # fmt: skip
    return out


def measure(b: int, s_len: int) -> dict:
    """One shape: the library's forward, both probes (bitwise check and time) and SDPA's default, in microseconds."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b * s_len, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (HQ, HKV, HKV))
    cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * s_len
    ref = ta.attention_varlen(q, k, v, cu, SCALE)
    row: dict = {"library_us": bench_graph(lambda: ta.attention_varlen(q, k, v, cu, SCALE)) * 1e3}
    for name, asyn, warps in VARIANTS:
        try:
            out = probe(q, k, v, s_len, asyn, warps)
            row[name] = {
                "bitwise_equal_library": bool(torch.equal(out, ref)),
                "max_abs_diff": float((out.float() - ref.float()).abs().max()),
                "us": bench_graph(lambda asyn=asyn, warps=warps: probe(q, k, v, s_len, asyn, warps)) * 1e3,
            }
        except Exception as e:  # noqa: BLE001 - a probe that fails to compile or run is recorded
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    qs, ks, vs = (x.view(b, s_len, -1, D).transpose(1, 2) for x in (q, k, v))
    ks, vs = ks.repeat_interleave(HP, 1), vs.repeat_interleave(HP, 1)
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE)  # noqa: E731
    row["sdpa_default_us"] = bench_graph(sdpa) * 1e3
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_attention_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["64x512", "16x1024"], help="BxS, S a multiple of 64, <= 1024")
    args = ap.parse_args()
    t0 = time.time()
    result: dict = header("gluon_attention_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "dtype": "bfloat16",
        "timing": "median of do_bench_cudagraph, microseconds",
        "shapes": {},
    }
    for shape in args.shapes:
        b, s_len = (int(x) for x in shape.split("x"))
        result["shapes"][shape] = row = measure(b, s_len)
        print("[gluon_attention_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
