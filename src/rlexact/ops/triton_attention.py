"""Exact causal attention in Triton: one kernel body for training (packed varlen), chunked prefill and decode (paged).

Exactness (docs/design.md, exactness contract). A query at absolute position ``p`` reduces over keys ``[0, p]``,
cut into KV splits of ``SPLIT`` keys anchored at absolute position 0 (split ``s`` = keys
``[s * SPLIT, (s + 1) * SPLIT)``; ``SPLIT`` is a multiple of ``BLOCK_N``). Within a split, key tiles of ``BLOCK_N``
(tile ``j`` = keys ``[j * BLOCK_N, (j + 1) * BLOCK_N)``) are visited in ascending order with one online-softmax
update, starting from the empty state; each split yields an fp32 partial ``(max, sum, acc)``, and the partials are
folded in ascending split order by :func:`_merge_split` (explicit FMAs), starting from the empty state too. Masked
keys get a ``-inf`` score and are loaded as 0 (so garbage or NaN in unwritten cache slots never enters), which makes
them contribute exactly zero; a fully masked tile is an exact no-op (``alpha = exp2(0) = 1``, ``p = 0``) and so is a
split wholly past a query (an empty partial), so a query tile may visit tiles and splits up to its largest position.
Key tiles wholly at or before a query tile's first position are visible to all its rows and skip the bounds and
score masks; the mask only turns hidden scores into ``-inf`` ahead of the same operations, whose roundings are all
explicit (``exp2(fma(s, scale, -m))``, ``fma(l, alpha, rowsum(p))``; no compiler contraction choice), so a row's
bits do not depend on which of its tiles were masked. ``rowsum(p)`` is a ``tl.dot`` of the probabilities (as fed to
the P @ V dot) with a ones tile, so its order is the MMA's K chain: a ``tl.sum`` tree would depend on how a launch's
warps split the key tile, and with the dot no query-side launch parameter enters a row's bits. The number of
splits of a query is ``p // SPLIT + 1``: a function of its own position, never of the batch. The key-side
partition (``BLOCK_N``, ``SPLIT``) depends only on ``(head_dim, dtype)`` (:func:`_fwd_config`) — never on sequence
lengths, the number of sequences, or paged vs packed.
The query-side launch (``BLOCK_M``, warps, stages) has two entries (:func:`_launch_config`): pure decode launches
(one query per sequence, :data:`DECODE_LAUNCH_16BIT`, with :data:`DECODE_DEEP_STAGES` for small split-parallel grids)
and all others (:data:`PREFILL_LAUNCH_16BIT`); a row's bits must not depend on it, which
``benchmarks/attention_configs.py`` and the GPU exactness tests check bitwise before an entry may differ.
``attention_varlen`` and ``attention_paged`` launch the same ``_attn_fwd_kernel``; the constexpr ``PAGED`` only changes
how a key position becomes an address, and ``SPLIT_PAR`` only changes which program computes a split: decode-sized
paged launches give each split its own program (grid axis 2), which stores its fp32 partial and takes a ticket from a
per-tile counter; the program that draws the last ticket folds the stored partials (:func:`_fold_partials`, in the
same launch). Other launches loop over the splits in one program and fold in registers. Both fold the same partials
with the same function in the same order, so a query row is bitwise equal whether it is computed in a training batch,
in a prefill chunk of any size, or in decode. (One online softmax across all tiles would give other bits than
split-then-merge; what matters is that every path uses the same splits.)
On sm_90 Gluon kernels carry some of these launches with the same tiles, splits and per-row operations, so the
same bits: packed launches (:mod:`rlexact.ops.gluon_attention`, or its warp-specialized pair of query tiles
:mod:`rlexact.ops.gluon_attention_pair` where the sequences are long), paged launches with many queries per sequence
(prefill chunks with earlier keys: their keys gathered out of the caches, :mod:`rlexact.ops.kv_gather`, then the packed
kernels) and decode steps whose contexts fit one split (:mod:`rlexact.ops.gluon_decode`, persistent over the
(sequence, head group) items).
Sliding windows (``window``: a query at ``p`` sees keys ``p - window + 1 .. p``) run the ``tl`` kernel alone, with the
same tiles and splits: every key tile is masked (the window's edge may cut any of them), tiles wholly before a query
tile's window are skipped (exact: they only add hidden scores), and so are whole splits (empty partials); the
backward kernels apply the same mask and skip the key tiles (dQ) and query chunks (dK, dV) wholly outside it, whose
products would add exact zeros.

GQA packing. The ``HP`` query heads that share one KV head are packed into the ``BLOCK_M`` rows of a tile (row
``r`` = query ``r // HP`` of the tile, head ``r % HP`` of the group), in training and inference alike. A row's
arithmetic does not depend on which row of the MMA tile it occupies, so decode (one position × ``HP`` heads per
tile) and training (``BLOCK_M // HP`` positions × ``HP`` heads) compute every row identically, while decode loads
each K/V tile once per KV head instead of once per query head. ``HP`` depends only on the model's head counts.

Work decomposition. Programs are laid out over query tiles of all sequences flattened: sequence ``b`` owns tile slots
``[cu[b] // P + b, cu[b+1] // P + b + 1)`` with ``P = BLOCK_M // HP`` positions per tile (at least
``ceil(nq_b / P)`` slots; surplus slots exit at once). The grid ``(T // P + B, Hq / HP, splits)`` depends only on
tensor shapes (``splits`` is 1, or for split-parallel launches ``ceil(block-table width * page size / SPLIT)``;
programs past a tile's last split exit at once), so the launch needs no host synchronization and is CUDA-graph
capturable; so is the split-parallel workspace (fp32 partials and zeroed ticket counters, sized from the same
shapes).

Backward (:func:`attention_varlen_backward`) is FA2-style and deterministic (no atomics): the forward kernel is rerun
to get the log-sum-exp of the split-merged forward (the same splits, so the same ``lse`` as the forward), one kernel
computes dK/dV per key tile looping over the group's query heads and query tiles in a fixed order, another computes
dQ per query tile looping over key tiles.

Under ``TRITON_INTERPRET=1`` (CPU) the dots of 16-bit inputs are upcast to fp32 because the interpreter's bf16
``tl.dot`` is broken; on the GPU they run on tensor cores with fp32 accumulation. fp32 dots use
``input_precision="ieee"`` (no TF32).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from . import gluon_attention, gluon_attention_pair, gluon_decode, kv_gather
from .backend import interpreter_enabled
from .shared_prefix import QUERY_ROWS, SharedPrefix, heads_per_tile
from .triton_pdl import pdl_entry, pdl_options
from .triton_shared import COMPILE_OPTIONS, num_sms

__all__ = ["attention_paged", "attention_varlen", "attention_varlen_backward", "split_keys"]

_INTERPRET = interpreter_enabled()
_LOG2E = math.log2(math.e)
_SCAN = 128
"""Sequences examined per step when a program looks up which sequence its tile belongs to."""
_SPLIT_PAR_BYTES = 64 << 20
"""Largest fp32 workspace of split partials for which a paged launch computes the splits in parallel programs (a
decode step); above it (prefill chunks) each program loops over its splits. Either way the same bits."""


# ---------------------------------------------------------------------------------------------------------------------
# configuration: a function of (head_dim, dtype) only
# ---------------------------------------------------------------------------------------------------------------------


def _block_d(head_dim: int) -> int:
    """``BLOCK_D``: the head dimension padded to a power of two, at least 16 (the smallest ``tl.dot`` extent)."""
    return max(16, triton.next_power_of_2(head_dim))


SPLIT_KEYS_16BIT = 1024
"""Keys per KV split (``SPLIT``) for bf16/fp16 at every head_dim (a multiple of every 16-bit ``BLOCK_N``). Chosen
from ``benchmarks/split_kv_sweep.py`` at head_dim 128 (16 query / 8 KV heads): among 512 ... 8192 and no split,
1,024 and 2,048 keys tied on the summed long-context decode time; 1,024 is faster for the few-sequence long tail
(batch 1-4 at 8k keys), 2,048 for batch 32 at 8k and batch 4 at 32k keys. A later run with one-warp decode programs
(``benchmarks/results/split_kv_sweep_h200.json``) has 512 and 1,024 tied on the sum, 512 ahead at batch 1-4 x 8k
and behind at batch 32 x 8k and 4 x 32k. Short contexts (one split) do not depend on it; the packed prefill/training
forward at long sequences gains a little from larger splits and trails SDPA's default kernel at every size, no split
included (``benchmarks/results/split_kv_sweep_h100.json``), so its speed does not decide ``SPLIT``."""
SPLIT_KEYS_FP32 = 2048
"""Keys per KV split (``SPLIT``) for fp32 at every head_dim (a multiple of every fp32 ``BLOCK_N``; not swept)."""


PREFILL_LAUNCH_16BIT = {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3}
"""Query-side launch ``BLOCK_M, num_warps, num_stages`` of bf16/fp16 forwards at head_dim <= 128 for every launch
that is not a pure decode step (training forward, backward's forward rerun, prefill chunks, mixed batches); pure
decode launches keep :func:`_fwd_config`'s. Set it from ``benchmarks/attention_configs.py`` (its result's
``choice.prefill_launch``): only a candidate whose outputs are bitwise equal to the decode launch's is allowed, since
a query row must get the same bits from both launches."""
DECODE_LAUNCH_16BIT = {"BLOCK_M": 16, "num_warps": 2, "num_stages": 2}
"""Query-side launch of bf16/fp16 pure decode launches (one query per sequence) at the head dims of
:data:`PREFILL_LAUNCH_HEAD_DIMS`. Set from ``benchmarks/attention_configs.py --decode`` (its result's
``choice.decode_launch``, ``benchmarks/results/attention_decode_configs_h200.json``): only a candidate whose outputs
are bitwise equal to the previous entry's and whose decode steps equal the training forward is allowed. Since the
row sum became a dot every candidate there agreed (before, candidates whose warps split the key tile did not). A
16-row tile wastes fewer rows on a decode query's ``HP`` heads; two warps split its key tile."""
DECODE_DEEP_STAGES = 5
"""Pipeline stages of a split-parallel decode launch (contexts past one KV split, each program a chain of up to
``SPLIT / BLOCK_N`` key tiles) with at most :data:`DECODE_DEEP_MAX_PROGRAMS_PER_SM` programs per SM. A paged key
tile's K/V copies wait on its block-table load, so Triton's pipeliner keeps them in flight across iterations only
from five stages on; with fewer, each tile's load latency is exposed, which many resident programs per SM hide and a
few do not, while five stages of K/V tiles leave shared memory for one program per SM. Measured in
``benchmarks/results/attention_decode_configs_h200.json`` (faster for a few long sequences, slower for many
programs); single-split decode launches keep :data:`DECODE_LAUNCH_16BIT` (``benchmarks/results/rollout_h200.json``
at 0089106 ran them with five stages, and batch 64 got slower)."""
DECODE_DEEP_MAX_PROGRAMS_PER_SM = 4
"""Largest number of split-parallel decode programs per SM (grid size / SMs) that gets :data:`DECODE_DEEP_STAGES`."""
PREFILL_LAUNCH_HEAD_DIMS = (128,)
"""Padded head dims (``_block_d``) at which :data:`PREFILL_LAUNCH_16BIT` and :data:`DECODE_LAUNCH_16BIT` apply: the
ones the sweeps checked bitwise on the GPU. Other head dims run every launch with :func:`_fwd_config`'s query-side
entries, but decode launches at the head dims of :data:`DECODE_LAUNCH_BY_HEAD_DIM`."""
DECODE_LAUNCH_BY_HEAD_DIM: dict[int, dict[str, int]] = {256: {"BLOCK_M": 16, "num_warps": 4, "num_stages": 5}}
"""Query-side launch of bf16/fp16 pure decode launches at padded head dims outside :data:`PREFILL_LAUNCH_HEAD_DIMS`
(Gemma 3's 256), each set from ``benchmarks/attention_configs.py --decode --shape NAME`` under the same rule as
:data:`DECODE_LAUNCH_16BIT`: bitwise equal to :func:`_fwd_config`'s launch, and decode == training forward with it
installed (256: ``benchmarks/results/attention_decode_configs_gemma3_h100.json``). Head dims without an entry keep
:func:`_fwd_config`'s launch."""


@functools.cache
def _fwd_config(head_dim: int, dtype: torch.dtype) -> Mapping[str, int]:
    """Forward tile shape ``BLOCK_M, BLOCK_N, num_warps, num_stages`` and KV split size ``SPLIT`` for
    ``(head_dim, dtype)``: nothing else. Decode launches use it as is; other launches replace the query-side entries
    with :func:`_launch_config`'s. Built once per arguments (read-only: merge it into a new dict to change it)."""
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        split = {"SPLIT": SPLIT_KEYS_FP32}
        if block_d <= 32:
            cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
        elif block_d <= 64:
            cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
        else:
            cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    elif dtype in (torch.bfloat16, torch.float16):
        split = {"SPLIT": SPLIT_KEYS_16BIT}
        if block_d <= 128:
            cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
        else:
            cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    else:
        raise TypeError(f"attention: unsupported dtype {dtype} (expected float32, bfloat16 or float16)")
    return MappingProxyType(cfg | split)


def _launch_config(head_dim: int, dtype: torch.dtype, decode: bool) -> Mapping[str, int]:
    """The forward config of one launch: :func:`_fwd_config`, with the query-side entries of
    :data:`DECODE_LAUNCH_16BIT` (:data:`DECODE_LAUNCH_BY_HEAD_DIM` at other head dims) when every sequence of the
    launch has exactly one query (``decode``), else of :data:`PREFILL_LAUNCH_16BIT`. The key-side entries
    (``BLOCK_N``, ``SPLIT``), which fix the bits, are the same for both."""
    cfg = _fwd_config(head_dim, dtype)
    if not _swept_launch(head_dim, dtype):
        other = DECODE_LAUNCH_BY_HEAD_DIM.get(_block_d(head_dim)) if decode and dtype != torch.float32 else None
        return cfg if other is None else cfg | other
    return cfg | (DECODE_LAUNCH_16BIT if decode else PREFILL_LAUNCH_16BIT)


def split_keys(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per KV split (``SPLIT``, part of the bit contract) at ``(head_dim, dtype)``."""
    return _fwd_config(head_dim, dtype)["SPLIT"]


def _swept_launch(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the swept query-side launches (:data:`PREFILL_LAUNCH_16BIT`, :data:`DECODE_LAUNCH_16BIT`,
    :data:`DECODE_DEEP_STAGES`) apply at ``(head_dim, dtype)``."""
    return dtype != torch.float32 and _block_d(head_dim) in PREFILL_LAUNCH_HEAD_DIMS


def _bwd_config(head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, int, int, int]]:
    """Backward tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the dK/dV and dQ kernels, per ``(head_dim,
    dtype)``. Not part of the exactness contract (backward only has to be deterministic and correct)."""
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        return {"dkdv": (32, 32, 4, 1), "dq": (32, 32, 4, 1)}
    if block_d > 128:
        return {"dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
    # measured on an H200 (head_dim 128, bf16): 64x64 tiles, 4 warps, 2 stages beat 32x128 / 128x64 / 8 warps
    return {"dkdv": (64, 64, 4, 2), "dq": (64, 64, 4, 2)}


# ---------------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _locate_tile(cu_ptr, num_seqs, slot, TILE: tl.constexpr, SCAN: tl.constexpr):
    """Map a flat tile slot to ``(sequence b, tile index within b)``; sequence ``b`` owns slots from
    ``cu[b] // TILE + b``. Returns ``b = -1``-free results; the caller checks the tile against the length."""
    count = slot * 0
    for c in range(0, num_seqs, SCAN):
        offs = c + tl.arange(0, SCAN)
        inside = offs < num_seqs
        start = tl.load(cu_ptr + offs, mask=inside, other=0)
        count += tl.sum(((start // TILE + offs <= slot) & inside).to(tl.int32), axis=0)
    b = count - 1
    tile = slot - (tl.load(cu_ptr + b) // TILE + b)
    return b, tile


@triton.jit
def _program_tile(cu_q, num_seqs, P: tl.constexpr, SCAN: tl.constexpr, DIRECT: tl.constexpr):
    """``(sequence b, tile index within b)`` of this program's grid-axis-0 index. ``DIRECT``: every sequence's
    queries fit one tile and axis 0 has one program per sequence, so ``b`` is the index itself (no lookup of
    ``cu_q``: one dependent load less before the first key tile). Otherwise the slots of all sequences' tiles,
    later (costlier) tiles first."""
    if DIRECT:
        return tl.program_id(0), 0
    return _locate_tile(cu_q, num_seqs, tl.num_programs(0) - 1 - tl.program_id(0), P, SCAN)


@triton.jit
def _merge_split(m, s, acc, m2, s2, acc2):
    """Fold the fp32 partial ``(m2, s2, acc2)`` (max, sum, accumulator) of the next KV split into the running
    ``(m, s, acc)``. Explicit fused multiply-adds fix the rounding (no compiler contraction choice), so every kernel
    that merges computes the same bits. Merging into the empty state ``(-inf, 0, 0)`` returns the partial exactly;
    merging an empty partial is an exact no-op."""
    m_new = tl.maximum(m, m2)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(m - m_use)
    b = tl.math.exp2(m2 - m_use)
    return m_new, tl.fma(s, a, s2 * b), tl.fma(acc, a[:, None], acc2 * b[:, None])


@triton.jit
def _bf16_round_f32(x):
    """``x`` (fp32, finite) rounded to the nearest bfloat16, ties to even, as fp32: the GPU's fp32 -> bf16 conversion,
    for the interpreter, whose conversion truncates (probabilities just below 1 would lose a whole bf16 step)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _attn_key_tile(
    q,
    m_s,
    l_s,
    acc_s,
    K,
    V,
    j,
    kv_begin,
    seqlen_k,
    kv_head,
    pos,
    bt_row,
    offs_n,
    offs_d,
    d_ok,
    qk_scale,
    window,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One online-softmax update of a split's state ``(m_s, l_s, acc_s)`` with key tile ``j``; with ``HAS_WINDOW``
    the mask also hides keys ``window`` or more positions before a query (every tile of a windowed launch is masked).

    ``MASKED=False`` is only for tiles visible to every row of the query tile (all keys written, none past a query):
    it skips the loads' bounds masks and the score mask. Unmasked scores take exactly the same operations as visible
    scores of a masked tile (the mask only replaces hidden scores by ``-inf`` before them), and every rounding is
    explicit (``tl.fma``), so a row's bits do not depend on which of its tiles were masked."""
    kpos = j * BLOCK_N + offs_n
    k_ok = kpos < seqlen_k
    if PAGED:
        if MASKED:
            blk = tl.load(bt_row + kpos // PAGE_SIZE, mask=k_ok, other=0)
        else:
            blk = tl.load(bt_row + kpos // PAGE_SIZE)
        krow = blk.to(tl.int64) * PAGE_SIZE + (kpos % PAGE_SIZE)
    else:
        krow = (kv_begin + kpos).to(tl.int64)
    k_ptrs = K + krow[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = V + krow[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    if MASKED:
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        seen = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
        if HAS_WINDOW:
            seen = seen & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    # the scale is positive, so max(s) * scale is the max of the rounded scaled scores
    m_new = tl.maximum(m_s, tl.max(s, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet stay empty
    alpha = tl.math.exp2(m_s - m_use)
    p = tl.math.exp2(tl.fma(s, qk_scale, -m_use[:, None]))
    # the row sum is a dot with a ones tile (every column of it is the row sum; max picks one exactly): a reduction
    # order fixed by the MMA's K chain, whatever the warps' layout (a tl.sum tree depends on which warps hold a row)
    ones = tl.full([BLOCK_N, 16], 1.0, dtype=tl.float32)
    if FP32_DOT:
        pv = p
        rows = tl.dot(p, ones, input_precision="ieee")
    else:
        if UPCAST:
            if V.dtype.element_ty == tl.bfloat16:
                pv = _bf16_round_f32(p)
            else:
                pv = p.to(V.dtype.element_ty).to(tl.float32)
            rows = tl.dot(pv, ones)
        else:
            pv = p.to(V.dtype.element_ty)
            rows = tl.dot(pv, ones.to(V.dtype.element_ty))
    l_s = tl.fma(l_s, alpha, tl.max(rows, 1))
    acc_s = acc_s * alpha[:, None]
    if FP32_DOT:
        acc_s = tl.dot(pv, v, acc_s, input_precision="ieee")
    else:
        acc_s = tl.dot(pv, v, acc_s)
    return m_new, l_s, acc_s


@triton.jit
def _attn_split(
    q,
    K,
    V,
    j_lo,
    j_hi,
    n_full,
    kv_begin,
    seqlen_k,
    kv_head,
    pos,
    bt_row,
    offs_n,
    offs_d,
    d_ok,
    qk_scale,
    window,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    EVEN_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """The fp32 partial ``(max, sum, acc)`` of key tiles ``[j_lo, j_hi)`` (one split, ascending, from the empty
    state): tiles below ``n_full`` unmasked, the rest masked."""
    m_s = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_s = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_s = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    j_mid = tl.minimum(j_hi, tl.maximum(j_lo, n_full))
    for j in range(j_lo, j_mid):
        m_s, l_s, acc_s = _attn_key_tile(
            q, m_s, l_s, acc_s, K, V, j, kv_begin, seqlen_k, kv_head, pos, bt_row, offs_n, offs_d, d_ok, qk_scale,
            window, stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N=BLOCK_N, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE,
            MASKED=False, EVEN_D=EVEN_D, FP32_DOT=FP32_DOT, UPCAST=UPCAST, HAS_WINDOW=HAS_WINDOW,
        )  # fmt: skip
    for j in range(j_mid, j_hi):
        m_s, l_s, acc_s = _attn_key_tile(
            q, m_s, l_s, acc_s, K, V, j, kv_begin, seqlen_k, kv_head, pos, bt_row, offs_n, offs_d, d_ok, qk_scale,
            window, stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N=BLOCK_N, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE,
            MASKED=True, EVEN_D=EVEN_D, FP32_DOT=FP32_DOT, UPCAST=UPCAST, HAS_WINDOW=HAS_WINDOW,
        )  # fmt: skip
    return m_s, l_s, acc_s


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    DELTA,
    cu_q,
    seqlens_k,
    block_tables,
    qk_scale,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_lt,
    stride_lh,
    PACC,
    PML,
    CNT,
    n_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HP: tl.constexpr,
    GROUP: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BWD_PREP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    SCAN: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_PAR: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_Q: tl.constexpr,
    PDL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    pdl_entry(PDL)
    P: tl.constexpr = BLOCK_M // HP  # query positions per tile
    TPS: tl.constexpr = SPLIT // BLOCK_N  # key tiles per split
    hgroup = tl.program_id(1)  # which pack of HP query heads
    kvh = (hgroup * HP) // GROUP
    if ONE_Q:  # every sequence has exactly one query, so cu_q is arange: no dependent load before q
        b = tl.program_id(0)
        tile = 0
        q_begin = b
        nq = 1
    else:
        b, tile = _program_tile(cu_q, num_seqs, P, SCAN, DIRECT)
        q_begin = tl.load(cu_q + b)
        nq = tl.load(cu_q + b + 1) - q_begin
        if tile * P >= nq:
            return
    if PAGED:
        seqlen_k = tl.load(seqlens_k + b)
        kv_begin = 0
    else:
        seqlen_k = nq
        kv_begin = q_begin
    q_start = seqlen_k - nq  # absolute position of the sequence's first query

    rows = tl.arange(0, BLOCK_M)
    qi = tile * P + rows // HP  # query index within the sequence
    head = hgroup * HP + rows % HP
    row_ok = (rows < P * HP) & (qi < nq)
    pos = q_start + qi
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + (q_begin + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    last_pos = q_start + tl.minimum(tile * P + P, nq) - 1
    n_tiles = last_pos // BLOCK_N + 1
    n_splits = last_pos // SPLIT + 1
    if SPLIT_PAR:  # one split per program along grid axis 2; the last one to finish folds them
        sp_lo = tl.program_id(2)
        if sp_lo >= n_splits:
            return
        sp_hi = sp_lo + 1
    else:
        sp_lo = 0
        sp_hi = n_splits

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    kv_head = kvh.to(tl.int64)
    # key tiles below n_full lie wholly at or before the tile's first query: visible to every row, all written
    n_full = (q_start + tile * P + 1) // BLOCK_N
    j_seen = 0
    if HAS_WINDOW:
        # tiles below j_seen lie wholly before every row's window: skipped, which leaves a split's state exactly as
        # processing them would (they only add hidden scores); the window's edge may cut any other tile: all masked
        j_seen = tl.maximum(q_start + tile * P - window + 1, 0) // BLOCK_N
        n_full = j_seen
    # the first split's partial is the merged state (merging into the empty state is exact), so only tiles spanning
    # several splits hold two accumulators
    m_i, l_i, acc = _attn_split(
        q, K, V, tl.maximum(sp_lo * TPS, j_seen), tl.minimum(sp_lo * TPS + TPS, n_tiles), n_full, kv_begin,
        seqlen_k, kv_head, pos, bt_row, offs_n, offs_d, d_ok, qk_scale, window, stride_kt, stride_kh, stride_vt,
        stride_vh, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE,
        EVEN_D=EVEN_D, FP32_DOT=FP32_DOT, UPCAST=UPCAST, HAS_WINDOW=HAS_WINDOW,
    )  # fmt: skip
    for sp in range(sp_lo + 1, sp_hi):
        m_s, l_s, acc_s = _attn_split(
            q, K, V, tl.maximum(sp * TPS, j_seen), tl.minimum(sp * TPS + TPS, n_tiles), n_full, kv_begin,
            seqlen_k, kv_head, pos, bt_row, offs_n, offs_d, d_ok, qk_scale, window, stride_kt, stride_kh,
            stride_vt, stride_vh, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PAGED=PAGED,
            PAGE_SIZE=PAGE_SIZE, EVEN_D=EVEN_D, FP32_DOT=FP32_DOT, UPCAST=UPCAST, HAS_WINDOW=HAS_WINDOW,
        )  # fmt: skip
        m_i, l_i, acc = _merge_split(m_i, l_i, acc, m_s, l_s, acc_s)

    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT_PAR:  # tiles spanning several splits store this split's partial; the last one to finish merges them
        multi = (rows * 0 + n_splits) > 1  # as a [BLOCK_M] tensor (a scalar bool mask breaks the interpreter)
        partial = row_ok & multi
        prow0 = ((q_begin + qi).to(tl.int64) * n_heads + head) * tl.num_programs(2)
        prow = prow0 + sp_lo
        tl.store(PML + prow * 2, m_i, mask=partial)
        tl.store(PML + prow * 2 + 1, l_i, mask=partial)
        tl.store(PACC + prow[:, None] * BLOCK_D + offs_d[None, :], acc, mask=partial[:, None])
        o_mask = o_mask & ~multi[:, None]
        if n_splits > 1:
            # every program's partial stores happen before its ticket (CTA barrier, then a release at GPU scope);
            # the program that draws the last ticket acquires them all and folds them in ascending split order
            tl.debug_barrier()
            cnt = CNT + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:
                m_i, l_i, acc = _fold_partials(PML, PACC, prow0, n_splits, row_ok, offs_d, BLOCK_M, BLOCK_D)
                tl.store(cnt, 0)  # the counters are zero again for the next launch that uses them
                o_mask = row_ok[:, None] & d_ok[None, :]
    out = acc * (1.0 / l_i)[:, None]  # the bits of acc / l (rlexact.ops.gluon_attention.normalized)
    o_ptrs = Out + (q_begin + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if BWD_PREP:
        # backward preprocessing: Out holds dO; store the base-2 log-sum-exp and delta = rowsum(dO * O) (fp32 O)
        do = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        lrow = (q_begin + qi).to(tl.int64) * stride_lt + head * stride_lh
        tl.store(LSE + lrow, m_i + tl.math.log2(l_i), mask=row_ok)
        tl.store(DELTA + lrow, tl.sum(out * do, 1), mask=row_ok)
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)


@triton.jit
def _fold_partials(PML, PACC, prow0, n_splits, row_ok, offs_d, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Fold the stored fp32 split partials ``0 .. n_splits - 1`` of a query tile's rows (``prow0``: their first
    partial's row in the workspace) in ascending split order with :func:`_merge_split`, from the empty state: the
    same fold as the looped (non-split-parallel) launch. The loads bypass L1 (``.cg``): other SMs wrote them."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for sp in range(0, n_splits):
        prow = prow0 + sp
        m_s = tl.load(PML + prow * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(PML + prow * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(
            PACC + prow[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg"
        )
        m_i, l_i, acc = _merge_split(m_i, l_i, acc, m_s, l_s, acc_s)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["window"])
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    cu,
    qk_scale,
    sm_scale,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_lt,
    stride_lh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    SCAN: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """dK, dV of one key tile (``BLOCK_N`` keys) of one KV head; loops over the group's query heads, then over query
    chunks of ``BLOCK_M`` in ascending order. Works in the transposed frame (``[keys, queries]``)."""
    slot = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    b, tile = _locate_tile(cu, num_seqs, slot, BLOCK_N, SCAN)
    begin = tl.load(cu + b)
    length = tl.load(cu + b + 1) - begin
    if tile * BLOCK_N >= length:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kpos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = kpos < length
    krow = (begin + kpos).to(tl.int64)
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(K + krow[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + krow[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    first = (tile * BLOCK_N) // BLOCK_M
    n_chunks = tl.cdiv(length, BLOCK_M)
    if HAS_WINDOW:  # later query chunks see none of this tile's keys: their products would add exact zeros
        n_chunks = tl.minimum(n_chunks, (tile * BLOCK_N + BLOCK_N - 1 + window - 1) // BLOCK_M + 1)
    for hh in range(0, GROUP):
        head = kvh * GROUP + hh
        for i in range(first, n_chunks):
            qpos = i * BLOCK_M + offs_m
            q_ok = qpos < length
            qrow = (begin + qpos).to(tl.int64)
            qt_mask = d_ok[:, None] & q_ok[None, :]
            qT = tl.load(Q + qrow[None, :] * stride_qt + head * stride_qh + offs_d[:, None], mask=qt_mask, other=0.0)
            do = tl.load(
                DO + qrow[:, None] * stride_dot + head * stride_doh + offs_d[None, :],
                mask=q_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            lse = tl.load(LSE + qrow * stride_lt + head * stride_lh, mask=q_ok, other=0.0)
            delta = tl.load(DELTA + qrow * stride_lt + head * stride_lh, mask=q_ok, other=0.0)
            if UPCAST:
                qT = qT.to(tl.float32)
                do = do.to(tl.float32)
            if FP32_DOT:
                sT = tl.dot(k, qT, input_precision="ieee")
            else:
                sT = tl.dot(k, qT)
            visible = (kpos[:, None] <= qpos[None, :]) & q_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (kpos[:, None] > qpos[None, :] - window)
            pT = tl.where(visible, tl.math.exp2(sT * qk_scale - lse[None, :]), 0.0)
            if FP32_DOT:
                dv = tl.dot(pT, do, dv, input_precision="ieee")
                dpT = tl.dot(v, tl.trans(do), input_precision="ieee")
            else:
                p16 = pT.to(DO.dtype.element_ty)
                if UPCAST:
                    p16 = p16.to(tl.float32)
                dv = tl.dot(p16, do, dv)
                dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - delta[None, :])
            if FP32_DOT:
                dk = tl.dot(dsT, tl.trans(qT), dk, input_precision="ieee")
            else:
                ds16 = dsT.to(Q.dtype.element_ty)
                if UPCAST:
                    ds16 = ds16.to(tl.float32)
                dk = tl.dot(ds16, tl.trans(qT), dk)
    dk = dk * sm_scale
    tl.store(
        DK + krow[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask
    )
    tl.store(
        DV + krow[:, None] * stride_dvt + kvh * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask
    )


@triton.jit(do_not_specialize=["window"])
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    cu,
    qk_scale,
    sm_scale,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_lt,
    stride_lh,
    stride_dqt,
    stride_dqh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    SCAN: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """dQ of one query tile (``BLOCK_M`` queries) of one query head; loops over key chunks of ``BLOCK_N``."""
    slot = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    b, tile = _locate_tile(cu, num_seqs, slot, BLOCK_M, SCAN)
    begin = tl.load(cu + b)
    length = tl.load(cu + b + 1) - begin
    if tile * BLOCK_M >= length:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    qpos = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = qpos < length
    qrow = (begin + qpos).to(tl.int64)
    qm = q_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + qrow[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=qm, other=0.0)
    do = tl.load(DO + qrow[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=qm, other=0.0)
    lse = tl.load(LSE + qrow * stride_lt + head * stride_lh, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + qrow * stride_lt + head * stride_lh, mask=q_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    last = tl.minimum(tile * BLOCK_M + BLOCK_M, length) - 1
    j_first = 0
    if HAS_WINDOW:  # earlier key tiles lie before every row's window: their products would add exact zeros
        j_first = tl.maximum(tile * BLOCK_M - window + 1, 0) // BLOCK_N
    for j in range(j_first, last // BLOCK_N + 1):
        kpos = j * BLOCK_N + offs_n
        k_ok = kpos < length
        krow = (begin + kpos).to(tl.int64)
        kt_mask = d_ok[:, None] & k_ok[None, :]
        kT = tl.load(K + krow[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None], mask=kt_mask, other=0.0)
        vT = tl.load(V + krow[None, :] * stride_vt + kvh * stride_vh + offs_d[:, None], mask=kt_mask, other=0.0)
        if UPCAST:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        if FP32_DOT:
            s = tl.dot(q, kT, input_precision="ieee")
            dp = tl.dot(do, vT, input_precision="ieee")
        else:
            s = tl.dot(q, kT)
            dp = tl.dot(do, vT)
        visible = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        p = tl.where(visible, tl.math.exp2(s * qk_scale - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if FP32_DOT:
            dq = tl.dot(ds, tl.trans(kT), dq, input_precision="ieee")
        else:
            ds16 = ds.to(K.dtype.element_ty)
            if UPCAST:
                ds16 = ds16.to(tl.float32)
            dq = tl.dot(ds16, tl.trans(kT), dq)
    dq = dq * sm_scale
    tl.store(DQ + qrow[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qm)


# ---------------------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------------------


def _dtype_flags(dtype: torch.dtype) -> dict[str, bool]:
    fp32 = dtype == torch.float32
    return {"FP32_DOT": fp32, "UPCAST": _INTERPRET and not fp32}


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.shape[-1] != k.shape[-1] or k.shape != v.shape:
        raise ValueError(f"attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if q.shape[1] % k.shape[-2]:
        raise ValueError(f"attention: query heads {q.shape[1]} not a multiple of kv heads {k.shape[-2]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attention: the head dimension of q, k, v must be contiguous")


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    seqlens_k: torch.Tensor | None,
    block_tables: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    lse_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
    cfg: dict[str, int] | None = None,
    max_seqlen_q: int | None = None,
    counters: torch.Tensor | None = None,
    prefix: SharedPrefix | None = None,
    window: int | None = None,
) -> None:
    """Launch the one forward kernel. ``k, v`` are ``[T, Hkv, D]`` (packed) or ``[NB, BS, Hkv, D]`` (paged).

    With ``lse_delta = (lse, delta)`` (both ``[T, Hq]`` fp32) this is the backward's preprocessing: ``out`` must hold
    dO; it is read, not written, and ``lse`` (base 2) and ``delta = rowsum(dO * O)`` are stored instead. ``cfg``
    overrides entries of :func:`_launch_config` (benchmarks and tests only; ``{"GLUON": False}`` keeps a launch on the
    ``tl`` kernel where :mod:`rlexact.ops.gluon_attention` (packed, or paged with gathered keys) or
    :mod:`rlexact.ops.gluon_decode` (a decode step within one KV split) would take it; ``{"PAIR": bool}`` picks the
    packed Gluon kernel, which :func:`rlexact.ops.gluon_attention_pair.chosen` picks otherwise (a gathered launch: the
    pair); ``{"PROGRAMS": n}`` caps the pair's programs (:func:`rlexact.ops.gluon_attention_pair.forward`);
    ``{"HP": n}`` sets the ``tl`` kernel's query heads per program (:func:`_heads_per_program`); ``{"GATHER": bool}``
    decides what :func:`rlexact.ops.kv_gather.chosen` decides otherwise).
    ``max_seqlen_q``: an upper bound of every sequence's query count; when it fits one query tile, grid axis 0 has one
    program per sequence (``DIRECT``). A bound of 1 with as many queries as sequences means one query each, so ``cu_q``
    is ``arange`` and the kernel does not read it (``ONE_Q``). ``counters``: int32 zeros for the split-parallel tickets
    (left zeroed); allocated here when None or too small. ``prefix``: the decode step's shared key tiles, which the
    Gluon decode launch reads once per group (:mod:`rlexact.ops.shared_prefix`); other launches compute the same rows
    without it. ``window``: a sliding window (keys per query); such a launch runs the ``tl`` kernel alone, whose rows
    the Gluon kernels equal bitwise without a window (``tests/test_triton_attention.py``), and keeps no plan.
    """
    planned = block_tables is None and cfg is None and window is None
    plan_key = _plan_key(q, k, v, cu_q, out, lse_delta) if planned else None
    if plan_key is not None and _planned_launch(plan_key, q, k, v, cu_q, scale, out, lse_delta):
        return
    lse, delta = lse_delta if lse_delta is not None else (None, None)
    tq, hq, d = q.shape
    hkv = k.shape[-2]
    num_seqs = cu_q.shape[0] - 1
    if tq == 0 or num_seqs <= 0:
        return
    decode = tq == num_seqs
    override = cfg or {}
    cfg = _launch_config(d, q.dtype, decode) | override
    gluon = window is None and cfg.get("GLUON", True)  # the Gluon kernels do not mask by a window
    split = cfg["SPLIT"]
    if split % cfg["BLOCK_N"]:
        raise ValueError(f"attention: SPLIT {split} is not a multiple of BLOCK_N {cfg['BLOCK_N']}")
    paged = block_tables is not None
    if not paged and gluon and gluon_attention.supported(q, k, v, cfg["BLOCK_N"]):
        pair = cfg.get("PAIR", gluon_attention_pair.chosen(tq, num_seqs))
        launched = _gluon_packed(pair, q, k, v, cu_q, scale, out, split, lse_delta, programs=cfg.get("PROGRAMS"))
        if plan_key is not None:  # the library's configuration (no override) on aligned tensors
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[plan_key] = launched
        return
    if paged:
        page_size = k.shape[1]
        stride_kt, stride_kh = k.stride(1), k.stride(2)
        stride_vt, stride_vh = v.stride(1), v.stride(2)
        if k.stride(0) != page_size * stride_kt or v.stride(0) != page_size * stride_vt:
            raise ValueError("attention_paged: cache blocks must be laid out contiguously ([NB, BS, ...] strides)")
        stride_bt = block_tables.stride(0)
        max_keys = block_tables.shape[1] * page_size
    else:
        page_size = 1
        stride_kt, stride_kh = k.stride(0), k.stride(1)
        stride_vt, stride_vh = v.stride(0), v.stride(1)
        stride_bt = 0
        max_keys = tq
    if paged and lse is None and gluon and _gathered(q, k, v, cu_q, seqlens_k, block_tables, scale, out, cfg, max_keys):
        return
    block_d = _block_d(d)
    n_split = -(-max_keys // split)
    if (
        paged
        and decode
        and max_seqlen_q == 1
        and n_split == 1
        and lse is None
        and block_tables.stride(1) == 1
        and gluon
        and gluon_decode.supported(q, k, v, cfg["BLOCK_N"], split)
    ):
        gluon_decode.forward(q, k, v, block_tables, seqlens_k, scale, out, heads_per_tile(hq, hkv, QUERY_ROWS), prefix)
        return
    par = paged and lse is None and n_split > 1 and tq * n_split * hq * (block_d + 2) * 4 <= _SPLIT_PAR_BYTES
    hp = _heads_per_program(hq, hkv, cfg, override)
    pos_per_tile = cfg["BLOCK_M"] // hp
    direct = max_seqlen_q is not None and max_seqlen_q <= pos_per_tile
    slots = num_seqs if direct else gluon_attention.tile_slots(tq, num_seqs, pos_per_tile)
    grid = (slots, hq // hp, n_split if par else 1)
    if par:
        pacc = torch.empty((tq, hq, n_split, block_d), dtype=torch.float32, device=q.device)
        pml = torch.empty((tq, hq, n_split, 2), dtype=torch.float32, device=q.device)
        if counters is None or counters.numel() < grid[0] * grid[1]:
            counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=q.device)
    else:
        pacc = pml = counters = out
    if par and decode and "num_stages" not in override and _swept_launch(d, q.dtype):
        if grid[0] * grid[1] * grid[2] <= DECODE_DEEP_MAX_PROGRAMS_PER_SM * num_sms(q.device):
            cfg = cfg | {"num_stages": DECODE_DEEP_STAGES}
    pdl = pdl_options(q.device)
    _attn_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse if lse is not None else out,
        delta if delta is not None else out,
        cu_q,
        seqlens_k if seqlens_k is not None else cu_q,
        block_tables if block_tables is not None else cu_q,
        scale * _LOG2E,
        num_seqs,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_bt,
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        pacc,
        pml,
        counters,
        hq,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        EVEN_D=block_d == d,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        HP=hp,
        GROUP=hq // hkv,
        PAGED=paged,
        PAGE_SIZE=page_size,
        BWD_PREP=lse is not None,
        SCAN=_SCAN,
        SPLIT=split,
        SPLIT_PAR=par,
        DIRECT=direct,
        ONE_Q=decode and max_seqlen_q == 1,
        HAS_WINDOW=window is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **_dtype_flags(q.dtype),
        **pdl,
        **COMPILE_OPTIONS,
    )


def _heads_per_program(hq: int, hkv: int, cfg: Mapping[str, int], override: Mapping[str, int]) -> int:
    """Query heads in each program's tile: as many of the GQA group as fit ``BLOCK_M`` rows
    (:func:`rlexact.ops.shared_prefix.heads_per_tile`), or ``override["HP"]`` (a divisor of the group that fits; a
    row's operations do not depend on its tile's other rows, so any such ``HP`` gives the same bits). One head per
    program doubles a few long sequences' decode programs but reads each K/V tile once per head, and was never
    faster (``benchmarks/results/decode_heads_h100.json``)."""
    if "HP" not in override:
        return heads_per_tile(hq, hkv, cfg["BLOCK_M"])
    hp, group = override["HP"], hq // hkv
    if not isinstance(hp, int) or hp < 1 or group % hp or hp > cfg["BLOCK_M"]:
        raise ValueError(f"attention: HP {hp!r} must be a positive divisor of the GQA group {group} that fits "
                         f"BLOCK_M {cfg['BLOCK_M']}")  # fmt: skip
    return hp


def _gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, seqlens_k: torch.Tensor,
              block_tables: torch.Tensor, scale: float, out: torch.Tensor, cfg: dict,
              max_keys: int) -> bool:  # fmt: skip
    """Run a paged forward as a packed Gluon launch over its keys gathered out of the caches
    (:mod:`rlexact.ops.kv_gather`), where :func:`rlexact.ops.kv_gather.chosen` (or ``cfg["GATHER"]``) takes it and
    the packed kernel supports the gathered rows; returns whether it ran. The paired query tiles carry it unless
    ``cfg["PAIR"]`` is False."""
    tq, _, d = q.shape
    num_seqs, hkv = cu_q.shape[0] - 1, k.shape[2]
    take = cfg.get("GATHER", kv_gather.chosen(tq, num_seqs, max_keys, hkv * d * k.element_size()))
    if not take or not (k.is_contiguous() and v.is_contiguous()):
        return False
    flat_k, flat_v = k.view(-1, hkv, d), v.view(-1, hkv, d)
    if not gluon_attention.supported(q, flat_k, flat_v, cfg["BLOCK_N"]):
        return False
    kk, vv = kv_gather.gather(k, v, block_tables, seqlens_k, max_keys)
    _gluon_packed(cfg.get("PAIR", True), q, kk, vv, cu_q, scale, out, cfg["SPLIT"], gathered=(seqlens_k, max_keys),
                  programs=cfg.get("PROGRAMS"))  # fmt: skip
    return True


def _gluon_packed(pair: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, scale: float,
                  out: torch.Tensor, split: int, lse_delta: tuple[torch.Tensor, torch.Tensor] | None = None,
                  gathered: tuple[torch.Tensor, int] | None = None,
                  programs: int | None = None) -> tuple[gluon_attention.PackedPlan, tuple]:  # fmt: skip
    """The packed Gluon forward (:func:`rlexact.ops.gluon_attention.forward`'s arguments), through the paired query
    tiles if ``pair`` and TMA reads ``q`` (over at most ``programs`` programs; None: the kernel's default), with the
    model's query heads per tile. Either kernel gives the same bits. Returns the plan launched and its launch key."""
    hp = heads_per_tile(q.shape[1], k.shape[1], 16 * gluon_attention.WARPS)
    if pair and gluon_attention_pair.takes(q, out):
        return gluon_attention_pair.forward(q, k, v, cu_q, scale, out, hp, split, lse_delta, gathered, programs)
    return gluon_attention.forward(q, k, v, cu_q, scale, out, hp, split, lse_delta, gathered)


_PLANS: dict[tuple, tuple[gluon_attention.PackedPlan, tuple]] = {}
""":func:`_plan_key` -> ``(plan, launch key)`` of the packed Gluon launches :func:`_forward` made with the library's
configuration."""
MAX_PLANS = 4096
"""Plans kept at most; past it the table starts over (a key holds sizes, not token counts, so few are in use)."""


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, out: torch.Tensor,
              lse_delta: tuple[torch.Tensor, torch.Tensor] | None) -> tuple | None:  # fmt: skip
    """What decides a packed launch's plan and launch key besides the tensors' data: sizes but the token count,
    strides, dtypes, device, the kernel choice (:func:`rlexact.ops.gluon_attention_pair.chosen`), whether the keys
    are the queries, whether the token and sequence counts are 1 or multiples of 16 (as Triton specializes them),
    and the key tiles and KV split of :func:`_fwd_config` (so a patched configuration gets plans of its own). None,
    so no plan applies, when the launch is empty or a tensor is not 16-byte aligned (plans are kept for aligned
    launches only)."""
    tq, num_seqs = q.shape[0], cu_q.shape[0] - 1
    ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | cu_q.data_ptr()
    lse_key = None
    if lse_delta is not None:
        lse, delta = lse_delta
        ptrs |= lse.data_ptr() | delta.data_ptr()
        lse_key = (lse.stride(), delta.stride(), lse.dtype, delta.dtype)
    if ptrs % 16 or tq == 0 or num_seqs <= 0:
        return None
    counts = (gluon_attention_pair.chosen(tq, num_seqs), k.shape[0] == tq, tq == 1, tq % 16 == 0, num_seqs == 1,
              num_seqs % 16 == 0)  # fmt: skip
    sizes = (q.shape[1:], k.shape[1:], q.stride(), k.stride(), v.stride(), out.stride(), lse_key)
    cfg = _fwd_config(q.shape[2], q.dtype)
    types = (q.dtype, k.dtype, v.dtype, out.dtype, cu_q.dtype, q.device)
    return (*counts, *sizes, *types, cfg["BLOCK_N"], cfg["SPLIT"])


def _planned_launch(plan_key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                    scale: float, out: torch.Tensor,
                    lse_delta: tuple[torch.Tensor, torch.Tensor] | None) -> bool:  # fmt: skip
    """Launch a packed forward (:func:`_forward`'s arguments, the library's configuration) through the plan kept
    under ``plan_key`` (its :func:`_plan_key`) and return True; False, launching nothing, when none is kept. Inputs of
    one key get the kernel, grid and arguments :func:`_forward`'s own decisions give them, which then need not be
    made again: the key holds everything they read."""
    entry = _PLANS.get(plan_key)
    if entry is None:
        return False
    plan, key = entry
    args, tensors, ints = plan.arguments(q, k, v, cu_q, scale, out, lse_delta, None)
    grid = plan.grid(q.shape[0], cu_q.shape[0] - 1)
    if not gluon_attention.run_cached(key, grid, args):
        gluon_attention.launch(plan.kernel, grid, args, tensors, ints, plan.options)
    return True


def _as_int32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int32).contiguous()


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention over packed variable-length sequences (the training path).

    ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, ``cu_seqlens [B+1]`` int32 -> ``[T, Hq, D]`` in ``q.dtype`` (fp32 or
    bf16/fp16; fp32 accumulation). Every row equals the same row from :func:`attention_paged` bitwise. ``window``:
    a query at position ``p`` sees keys ``p - window + 1 .. p`` only.
    """
    _check_inputs(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError("attention_varlen: q and k must have the same number of tokens")
    out = torch.empty_like(q)
    _forward(q, k, v, _as_int32(cu_seqlens, q.device), None, None, float(scale), out, window=window)
    return out


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    split_counters: torch.Tensor | None = None,
    prefix: SharedPrefix | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of new queries (prefill chunks and decode, mixed in one launch) over a paged KV cache.

    ``q [Tq, Hq, D]``; ``k_cache, v_cache [NB, BS, Hkv, D]``; ``block_tables [B, max_blocks]`` int32;
    ``cu_seqlens_q [B+1]`` int32; ``seqlens_k [B]`` int32. Sequence ``b``'s queries are its last ``nq_b`` positions;
    key ``p`` lives at slot ``block_tables[b, p // BS] * BS + p % BS``. Slots past ``seqlens_k[b]`` are never read.
    ``max_seqlen_q``, if given, must bound every ``nq_b`` (the device cannot check it without a host sync: a
    sequence with more queries than a small bound would get only its first tile); it only changes the launch grid,
    never a row's bits. ``split_counters``: see :func:`_forward`'s ``counters``; ``prefix`` its ``prefix``;
    ``window``: as in :func:`attention_varlen`.
    """
    _check_inputs(q, k_cache, v_cache)
    if k_cache.dim() != 4:
        raise ValueError(f"attention_paged: caches must be [NB, BS, Hkv, D], got {tuple(k_cache.shape)}")
    out = torch.empty_like(q)
    dev = q.device
    _forward(
        q,
        k_cache,
        v_cache,
        _as_int32(cu_seqlens_q, dev),
        _as_int32(seqlens_k, dev),
        block_tables.to(device=dev, dtype=torch.int32),
        float(scale),
        out,
        max_seqlen_q=max_seqlen_q,
        counters=split_counters,
        prefix=prefix,
        window=window,
    )
    return out


def attention_varlen_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic gradients ``(dq, dk, dv)`` of :func:`attention_varlen` (no atomics, fixed loop orders; a
    ``window`` hides the same keys as in the forward).

    Reruns the forward kernel to get the base-2 log-sum-exp and ``delta = rowsum(dO * O)`` (O in fp32), then a dK/dV
    kernel (per key tile; query heads of the group, then query chunks, in ascending order) and a dQ kernel.
    """
    _check_inputs(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do = do.to(q.dtype).contiguous()
    t, hq, d = q.shape
    hkv = k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    num_seqs = cu_seqlens.shape[0] - 1
    if t == 0 or num_seqs <= 0:
        return dq, dk, dv
    cu = _as_int32(cu_seqlens, q.device)
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse)
    _forward(q, k, v, cu, None, None, float(scale), do, (lse, delta), window=window)
    cfg = _bwd_config(d, q.dtype)
    common = {"HEAD_DIM": d, "BLOCK_D": _block_d(d), "GROUP": hq // hkv, "SCAN": _SCAN}
    common |= {"HAS_WINDOW": window is not None, **_dtype_flags(q.dtype)}
    qk_scale = float(scale) * _LOG2E
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *do.stride()[:2], *lse.stride())
    bm, bn, warps, stages = cfg["dkdv"]
    _attn_bwd_dkdv_kernel[(t // bn + num_seqs, hkv)](
        q, k, v, do, lse, delta, dk, dv, cu, qk_scale, float(scale), num_seqs, window or 0, *strides, *dk.stride()[:2],
        *dv.stride()[:2], BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    bm, bn, warps, stages = cfg["dq"]
    _attn_bwd_dq_kernel[(t // bm + num_seqs, hq)](
        q, k, v, do, lse, delta, dq, cu, qk_scale, float(scale), num_seqs, window or 0, *strides, *dq.stride()[:2],
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return dq, dk, dv
