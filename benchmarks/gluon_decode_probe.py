"""The persistent Gluon decode attention (``rlexact.ops.gluon_decode``) against the ``tl`` decode launch it replaces.

    timeout 300 python benchmarks/gluon_decode_probe.py [--out ...gluon_decode_probe_h200.json]

The ``tl`` decode launch (one query per sequence) runs one program per (sequence, KV head): at batch 256 that is
2,048 programs, about five waves of them, and its time has a fixed part that grows with the number of waves
(``attention_decode_scaling_h200.json``: each program's dependent loads of the sequence length, the block table and
its first K/V tile are exposed once per program). The Gluon kernel walks the same items with a few persistent
programs per SM, a producer warp streaming their pages through K/V rings that run ahead across items. Its rows must
be the ``tl`` kernel's bits: checked on mixed lengths with shuffled pages and NaN in every cache slot past a
sequence, with a perturbed-key negative control, and at every timing shape. Timings are CUDA-graph replays of both
launches (``{"GLUON": False}`` selects the ``tl`` one) on the same paged caches (pages in random order), with one
and with two programs per SM (``gluon_decode.PROGRAMS_PER_SM``).

``--variants`` adds launches of the same kernel in other shapes, each ``PxS[-page][-ahead][-overlap][-qop]``: ``P``
programs per SM, ``S``-deep K and V rings (``gluon_decode.SLOTS``; three programs fit the SM's shared memory and
registers with two-deep rings); with ``-page`` the V rows past a sequence zeroed only in its last, partial page (pages
past it arrive zero-filled), skipped where the sequence ends on a page boundary; with ``-ahead`` a producer that loads
the next item's length and block-table row while it copies this item's tiles; with ``-overlap`` a consumer that
issues the next item's first score wgmma under this item's last P @ V and stores this item's rows while it runs; with
``-qop`` query rows loaded straight into the score wgmma's operand layout. A shape ``BxCm`` has mixed lengths
``C - 16 .. C + 15`` (each sequence's last page partial in 15 of 16 cases, as in a decode step) with NaN in the stale
slots, instead of ``C`` keys everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from attention_configs import DT, HKV, HQ, PAGE, D, decode_case, run
from common import ROOT, bench_graph, header
from rlexact.ops import gluon_decode
from rlexact.ops.gluon_attention import cta_barrier, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from rlexact.ops.gluon_attention import store_rows, tile_softmax, wgmma_layout, zero_tail_rows
    from rlexact.ops.gluon_decode import PAGE_N, PAGES, SLOTS, TILE_N, W, _copy_tile, _page_row, _query_rows

    PG = gl.constexpr(gluon_decode.PAGE)
    PW = gl.constexpr(gluon_decode.WARPS)

    @gluon.jit
    def _zero_stale_page(v_buf, row0, n, BLOCK_N: gl.constexpr, blk: gl.constexpr):
        """Zero the rows of the V tile in ``v_buf`` (first key ``row0``) at keys ``>= n`` inside key ``n``'s page; the
        tile's later pages were read from past the cache (TMA's zero fill)."""
        if n % PG != 0:
            r = n - row0
            page_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PW, 1], [1, 0])
            rows = gl.arange(0, PG, layout=gl.SliceLayout(1, page_layout))
            for pg in gl.static_range(BLOCK_N // PG):
                if r // PG == pg:
                    buf = v_buf.slice(pg * PG, PG)
                    v = buf.load(page_layout)
                    buf.store(gl.where((pg * PG + rows < r)[:, None], v, 0.0))
            fence_async_shared()
            cta_barrier()

    @gluon.jit
    def _query_op(q_ptr, seqlens_ptr, it, n_items, n_groups, stride_qt, stride_qh, HP: gl.constexpr, D: gl.constexpr,
                  blk: gl.constexpr):  # fmt: skip
        """:func:`_query_rows` loaded straight into the score wgmma's operand layout (no layout change through shared
        memory; ``blk`` is ignored)."""
        q_op: gl.constexpr = gl.DotOperandLayout(0, wgmma_layout(W, TILE_N), 2)
        it = gl.minimum(it, n_items - 1)
        b = it // n_groups
        rows = gl.arange(0, 16 * W, layout=gl.SliceLayout(1, q_op))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, q_op))
        q_rows = b.to(gl.int64) * stride_qt + ((it % n_groups) * HP + rows) * stride_qh
        q = gl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=(rows < HP)[:, None], other=0.0)
        return q, gl.load(seqlens_ptr + b)

    @gluon.jit
    def _consumer_overlap(q_ptr, o_ptr, seqlens_ptr, ones_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                          n_items, n_groups, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, HP: gl.constexpr,
                          D: gl.constexpr):  # fmt: skip
        """The library's consumer with the next item's first score wgmma issued under this item's last P @ V, and
        this item's rows stored while those scores run (the same operations per row, in the same order)."""
        BLOCK_M: gl.constexpr = 16 * W
        dt: gl.constexpr = q_ptr.dtype.element_ty
        s_layout: gl.constexpr = wgmma_layout(W, TILE_N)
        o_layout: gl.constexpr = wgmma_layout(W, D)
        r_layout: gl.constexpr = wgmma_layout(W, 16)
        q_op: gl.constexpr = gl.DotOperandLayout(0, s_layout, 2)
        r_op: gl.constexpr = gl.DotOperandLayout(0, r_layout, 2)
        pv_op: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        offs_n = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, TILE_N], gl.float32, layout=s_layout)
        r_zero = gl.zeros([BLOCK_M, 16], gl.float32, layout=r_layout)
        step = gl.num_programs(0)
        q_raw, seqlen = _query_rows(q_ptr, seqlens_ptr, gl.program_id(0), n_items, n_groups, stride_qt, stride_qh, HP,
                                    D, blk)  # fmt: skip
        q = gl.convert_layout(q_raw, q_op)
        q_next, len_next = _query_rows(q_ptr, seqlens_ptr, gl.program_id(0) + step, n_items, n_groups, stride_qt,
                                       stride_qh, HP, D, blk)  # fmt: skip
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
        mbarrier.arrive(k_empty.index(0), count=1)
        x = 0
        for it in range(gl.program_id(0), n_items, step):
            n_tiles = gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1)
            n_full = seqlen // TILE_N
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
            slot = x % SLOTS
            phase = (x // SLOTS) & 1
            if n_full == 0:
                s = gl.where((offs_n < seqlen)[None, :], s, float("-inf"))
            m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
            rsum = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False)
            l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
            p_op = gl.convert_layout(p, pv_op)
            for j in range(0, n_tiles - 1):
                nxt = (x + 1) % SLOTS
                nphase = ((x + 1) // SLOTS) & 1
                mbarrier.wait(k_ready.index(nxt), nphase)
                s_tok = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                mbarrier.wait(v_ready.index(slot), phase)
                acc_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
                s, acc, p_op = warpgroup_mma_wait(1, deps=(s_tok, acc_tok, p_op))
                mbarrier.arrive(k_empty.index(nxt), count=1)
                if j + 1 >= n_full:
                    s = gl.where(((j + 1) * TILE_N + offs_n < seqlen)[None, :], s, float("-inf"))
                m_i, alpha, p = tile_softmax(s, m_i, qk_scale, dt)
                r_tok = warpgroup_mma(gl.convert_layout(p, r_op), ones_smem, r_zero, use_acc=False, is_async=True)
                rsum, acc, p_op = warpgroup_mma_wait(0, deps=(r_tok, acc, p_op))
                mbarrier.arrive(v_empty.index(slot), count=1)
                l_i = gl.fma(l_i, alpha, gl.convert_layout(gl.max(rsum, 1), row_s))
                p_op = gl.convert_layout(p, pv_op)
                x += 1
                slot = nxt
                phase = nphase
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.wait(v_ready.index(slot), phase)
            if n_full < n_tiles:
                zero_tail_rows(v_smem.index(slot), (n_tiles - 1) * TILE_N, seqlen, TILE_N, blk)
            acc_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            x += 1
            # the next item's first scores (after the last item: a discarded product of a slot nobody writes now)
            has_next = it + step < n_items
            nslot = x % SLOTS
            if has_next:
                mbarrier.wait(k_ready.index(nslot), (x // SLOTS) & 1)
            q = gl.convert_layout(q_next, q_op)
            s_tok = warpgroup_mma(q, k_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc, p_op = warpgroup_mma_wait(1, deps=(acc_tok, p_op))
            mbarrier.arrive(v_empty.index(slot), count=1)
            store_rows(o_ptr, o_ptr, o_ptr, acc, m_i, l_i, it // n_groups, 1, 0, it % n_groups, stride_ot, stride_oh, 0,
                       0, HP, BLOCK_M // HP, D, BLOCK_M, False, o_layout)  # fmt: skip
            s, q = warpgroup_mma_wait(0, deps=(s_tok, q))
            if has_next:
                mbarrier.arrive(k_empty.index(nslot), count=1)
            seqlen = len_next
            q_next, len_next = _query_rows(q_ptr, seqlens_ptr, it + 2 * step, n_items, n_groups, stride_qt, stride_qh,
                                           HP, D, blk)  # fmt: skip

    @gluon.jit
    def _item_pages(bt_ptr, seqlens_ptr, it, n_items, n_groups, stride_bt, width, idx):
        """Item ``it``'s key count and block-table row (an index past the last item reads the last one again)."""
        b = gl.minimum(it, n_items - 1) // n_groups
        return gl.load(seqlens_ptr + b), gl.load(bt_ptr + b.to(gl.int64) * stride_bt + idx, mask=idx < width, other=0)

    @gluon.jit
    def _producer_ahead(k_desc, v_desc, bt_ptr, seqlens_ptr, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                        n_items, n_groups, hp, group, stride_bt, width, n_rows):  # fmt: skip
        """The library's producer with the next item's length and block-table row loaded while this item's tiles are
        copied, so no item waits on its own."""
        lay: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        idx = gl.arange(0, 64, layout=lay)
        d: gl.constexpr = k_desc.block_type.shape[1]
        step = gl.num_programs(0)
        seq_next, blocks_next = _item_pages(bt_ptr, seqlens_ptr, gl.program_id(0), n_items, n_groups, stride_bt, width,
                                            idx)  # fmt: skip
        x = 0
        for it in range(gl.program_id(0), n_items, step):
            kv_col = ((it % n_groups) * hp) // group * d
            seqlen = seq_next
            blocks = blocks_next
            seq_next, blocks_next = _item_pages(bt_ptr, seqlens_ptr, it + step, n_items, n_groups, stride_bt, width,
                                                idx)  # fmt: skip
            for j in range(0, gl.maximum((seqlen + TILE_N - 1) // TILE_N, 1)):
                slot = x % SLOTS
                phase = ((x // SLOTS) & 1) ^ 1
                n_pg = gl.minimum((seqlen - j * TILE_N + PAGE_N - 1) // PAGE_N, PAGES)
                p0 = j * PAGES
                rows0 = _page_row(blocks, idx, gl.where(n_pg > 0, p0, -1), n_rows)
                rows1 = _page_row(blocks, idx, gl.where(n_pg > 1, p0 + 1, -1), n_rows)
                rows2 = _page_row(blocks, idx, gl.where(n_pg > 2, p0 + 2, -1), n_rows)
                rows3 = _page_row(blocks, idx, gl.where(n_pg > 3, p0 + 3, -1), n_rows)
                mbarrier.wait(k_empty.index(slot), phase)
                _copy_tile(k_desc, k_smem.index(slot), k_ready.index(slot), rows0, rows1, rows2, rows3, kv_col)
                mbarrier.wait(v_empty.index(slot), phase)
                _copy_tile(v_desc, v_smem.index(slot), v_ready.index(slot), rows0, rows1, rows2, rows3, kv_col)
                x += 1

TL = {"GLUON": False}

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


def _rebind(jit_fn: object, **names: object) -> object:
    """A copy of a Gluon function whose global ``names`` resolve to other objects (its constexpr annotations kept)."""
    f = jit_fn.fn
    copy = types.FunctionType(f.__code__, dict(f.__globals__, **names), f.__name__, f.__defaults__, f.__closure__)
    copy.__annotations__ = dict(f.__annotations__)
    return gluon.jit(copy)


_KERNELS: dict[tuple[int, bool, bool, bool, bool], object] = {}
"""``(slots, page tail, producer ahead, overlap, q operand)`` -> the rebound decode kernel (kept alive: the launcher
cache keys on its id)."""


@contextlib.contextmanager
def kernel_shape(slots: int, page_tail: bool, ahead: bool = False, overlap: bool = False,
                 qop: bool = False) -> Iterator[None]:  # fmt: skip
    """The library's decode kernel with ``slots``-deep rings, with ``page_tail`` :func:`_zero_stale_page`, with
    ``ahead`` :func:`_producer_ahead`, with ``overlap`` :func:`_consumer_overlap`, with ``qop`` :func:`_query_op`."""
    key = (slots, page_tail, ahead, overlap, qop)
    if key not in _KERNELS:
        g = gluon_decode
        depth = {"SLOTS": gl.constexpr(slots)}
        tail = {"zero_tail_rows": _zero_stale_page} if page_tail else {}
        query = {"_query_rows": _query_op} if qop else {}
        consumer = _rebind(_consumer_overlap if overlap else g._consumer, **depth, **tail, **query)
        producer = _rebind(_producer_ahead if ahead else g._producer, **depth)
        _KERNELS[key] = _rebind(g._attn_decode_kernel, _consumer=consumer, _producer=producer,
                                _rings=_rebind(g._rings, **depth))  # fmt: skip
    saved = gluon_decode._attn_decode_kernel
    gluon_decode._attn_decode_kernel = _KERNELS[key]
    try:
        yield
    finally:
        gluon_decode._attn_decode_kernel = saved


TAGS = ("page", "ahead", "overlap", "qop")


def parse_variant(spec: str) -> tuple[int, int, bool, bool, bool, bool]:
    """``PxS[-tag]...`` -> ``(programs per SM, ring depth, page tail, producer ahead, overlap, q operand)``."""
    shape, *tags = spec.split("-")
    per_sm, slots = (int(x) for x in shape.split("x"))
    if not set(tags) <= set(TAGS) or per_sm < 1 or slots < 1:
        raise SystemExit(f"gluon_decode_probe: bad variant {spec!r}; expected PxS[-page][-ahead][-overlap][-qop]")
    return per_sm, slots, *(t in tags for t in TAGS)


def variant_run(case: tuple, spec: str) -> torch.Tensor:
    per_sm, slots, *tags = parse_variant(spec)
    with kernel_shape(slots, *tags):
        return probe(case, per_sm)


def probe(case: tuple, per_sm: int) -> torch.Tensor:
    """The library's launch of ``case`` (the Gluon kernel) with ``per_sm`` programs per SM."""
    saved = gluon_decode.PROGRAMS_PER_SM
    gluon_decode.PROGRAMS_PER_SM = per_sm
    try:
        return run(case, None)
    finally:
        gluon_decode.PROGRAMS_PER_SM = saved


def check(lens: list[int], variants: list[str]) -> dict:
    case = mixed_case(lens)
    q, k, v, cu, lens_t, tables = case
    if not gluon_decode.supported(q, k, v, 64, 1024):
        raise SystemExit("gluon_decode_probe: needs an sm_90 GPU and a Triton with Gluon")
    ref = run(case, TL)
    row: dict = {"n": len(lens), "max_len": max(lens), "tl_finite": bool(torch.isfinite(ref).all())}
    for per_sm in (1, 2):
        row[f"bitwise_equal_tl_{per_sm}"] = bool(torch.equal(probe(case, per_sm), ref))
    k2 = k.clone()
    k2[int(tables[-1, 0]), 0, 0, 0] += 1.0  # the last sequence's first key
    row["negative_control_differs"] = not torch.equal(probe((q, k2, v, cu, lens_t, tables), 2), ref)
    for spec in variants:
        row[f"bitwise_equal_tl_{spec}"] = bool(torch.equal(variant_run(case, spec), ref))
        row[f"negative_control_differs_{spec}"] = not torch.equal(variant_run((q, k2, v, cu, lens_t, tables), spec),
                                                                  ref)  # fmt: skip
    return row


def measure(shape: str, variants: list[str]) -> dict:
    mixed = shape.endswith("m")
    b, ctx = (int(x) for x in shape.rstrip("m").split("x"))
    lens = [ctx - 16 + i % 32 for i in range(b)] if mixed else [ctx] * b
    case = mixed_case(lens) if mixed else decode_case(b, ctx)
    ref = run(case, TL)
    row: dict = {"tl_us": bench_graph(lambda: run(case, TL)) * 1e3}
    for per_sm in (1, 2):
        row[f"gluon{per_sm}_bitwise_equal_tl"] = bool(torch.equal(probe(case, per_sm), ref))
        row[f"gluon{per_sm}_us"] = bench_graph(lambda per_sm=per_sm: probe(case, per_sm)) * 1e3
    for spec in variants:
        row[f"{spec}_bitwise_equal_tl"] = bool(torch.equal(variant_run(case, spec), ref))
        row[f"{spec}_us"] = bench_graph(lambda spec=spec: variant_run(case, spec)) * 1e3
    row["kv_roofline_us"] = 2 * sum(lens) * HKV * D * DT.itemsize / 4.8e12 * 1e6
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gluon_decode_probe_h200.json"))
    ap.add_argument("--shapes", nargs="+", default=["256x160", "256x256", "256x384", "128x256", "64x256", "64x1024",
                                                    "32x1024", "512x256"])  # fmt: skip
    ap.add_argument("--variants", nargs="*", default=[], help="PxS[-page][-ahead][-overlap][-qop], see above")
    args = ap.parse_args()
    for spec in args.variants:
        parse_variant(spec)
    t0 = time.time()
    result: dict = header("gluon_decode_probe", "triton") | {
        "heads": [HQ, HKV, D],
        "page": PAGE,
        "dtype": "bfloat16",
        "slots": gluon_decode.SLOTS.value,
        "library_programs_per_sm": gluon_decode.PROGRAMS_PER_SM,
        "timing": "median of do_bench_cudagraph, microseconds; kv_roofline_us: K/V bytes at 4.8 TB/s",
        "variants": args.variants,
        "checks": [check(lens, args.variants) for lens in CHECK_LENS],
        "shapes": {},
    }
    print("[gluon_decode_probe] checks", json.dumps(result["checks"]), flush=True)
    for shape in args.shapes:
        result["shapes"][shape] = row = measure(shape, args.variants)
        print("[gluon_decode_probe]", shape, json.dumps(row), flush=True)
    result["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
