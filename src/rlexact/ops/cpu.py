"""Batch-invariant torch twins of the exact kernels (CPU backend).

Plain CPU ``torch.mm`` and elementwise kernels are not batch-invariant: the BLAS picks kernels and thread splits
from M, and vectorized elementwise loops hand a shape-dependent tail of elements to scalar code whose ``exp`` differs
from the SIMD one. Every op here therefore runs on **fixed-shape row blocks**: the input rows are zero-padded to a
multiple of :data:`ROW_BLOCK` and each block goes through the same torch calls with the same shape, so the result
for a row depends only on that row (and the weights), never on how many rows came with it or where it sits.

A fixed shape is not enough for a block's matrix product: MKL's AVX2 sgemm, with two or more threads, computes the
last rows of each thread's share of M with other instructions than the rest, so a row's bits depended on its place
in the block (on CPUs without AVX-512, or under ``MKL_ENABLE_INSTRUCTIONS=AVX2``). :func:`block_linear` therefore
puts the block's rows on the product's N axis, ``(w @ x.T).T``: there a row is a vector lane (or a column of a
narrower tail kernel) through the same chain of multiply-adds over K wherever it sits
(``tests/test_cpu_row_invariance.py`` checks each instruction set and thread count the host's MKL offers).

Attention mirrors the split-KV contract of :mod:`rlexact.ops.triton_attention`: the keys of a query are cut into
splits of :data:`ATTN_SPLIT` keys anchored at absolute position 0; within a split, key tiles of :data:`ATTN_BLOCK_N`
keys are visited in ascending order with one online-softmax update from an empty state, on fixed-shape
``[G, H, ATTN_BLOCK_M, D] x [G, H, D, ATTN_BLOCK_N]`` products over groups of ``ATTN_GROUP`` query tiles; the fp32
split partials ``(max, sum, acc)`` are folded in ascending split order. Masked keys contribute exactly zero, so tiles
and splits past a query's position are exact no-ops.

All accumulation is fp32; outputs are cast to the input dtype once at the end (matmul, norm, silu-mul, attention) or
stay fp32 (log-probs, logits, lse, entropy). A float64 input is computed the same way, so its results carry fp32
precision (and fp32's row invariance); torch's default dtype never changes what any op here computes in.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlexact.ops.reference import hidden_keys

ROW_BLOCK = 64
"""Rows per fixed-shape block for matmul, norms, elementwise ops and the log-prob head."""
ATTN_BLOCK_M = 16
"""Query rows per attention tile."""
ATTN_BLOCK_N = 64
"""Keys per attention tile; tile ``j`` covers absolute key positions ``[j * ATTN_BLOCK_N, (j + 1) * ATTN_BLOCK_N)``."""
ATTN_GROUP = 8
"""Query tiles processed together in one fixed-shape batched matmul (padded with idle tiles)."""
ATTN_SPLIT = 1024
"""Keys per KV split (a multiple of :data:`ATTN_BLOCK_N`); split ``s`` covers absolute key positions
``[s * ATTN_SPLIT, (s + 1) * ATTN_SPLIT)``."""


def padded_blocks(x: torch.Tensor, block: int = ROW_BLOCK) -> tuple[torch.Tensor, int]:
    """Zero-pad the rows of ``x`` to a multiple of ``block``; return ``(padded, original_rows)``."""
    m = x.shape[0]
    pad = (-m) % block
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))], dim=0)
    return x, m


PROBE_ROWS = (1, 2, 3, 5, 7, 8, 15, 16, 29, 30, 31, 32, 33, 47, 48, 59, 60, 61, 62, 63)
"""Places in a row block that :func:`check_block_product` moves a row to: the edges of every split of the block into
two, three, four or eight thread shares and the tails of 4-, 6-, 8- and 16-row kernels."""
PROBE_ELEMENTS = 1 << 24
"""The largest ``N * K`` weight :func:`check_block_product` probes at full size; a larger one is probed on its first
``PROBE_ELEMENTS // K`` rows."""


def _block_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(w, x).T


@functools.cache
def check_block_product(n: int, k: int, threads: int) -> None:
    """Raise ``RuntimeError`` if this host's BLAS gives a row of a ``[ROW_BLOCK, k] x [k, n]`` block product other
    bits at another place in the block (:data:`PROBE_ROWS`) with ``threads`` torch threads, which would make
    rollout log-probs differ from the trainer's. The probe multiplies fp32 operands, the dtype :func:`block_linear`
    multiplies in, whatever torch's default dtype is. Memoized: each shape and thread count is probed once per
    process."""
    n_probe = max(1, min(n, PROBE_ELEMENTS // max(k, 1)))
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n_probe, k, generator=g, dtype=torch.float32)
    x = torch.randn(ROW_BLOCK, k, generator=g, dtype=torch.float32)
    ref = _block_product(x, w)[0]
    for place in PROBE_ROWS:
        moved = _block_product(torch.roll(x, place, 0), w)[place]
        if not torch.equal(moved, ref):
            raise RuntimeError(
                f"rlexact's CPU kernels are not row-invariant on this host: its BLAS gives a row of a "
                f"[{ROW_BLOCK}, {k}] x [{k}, {n_probe}] block product other bits at place {place} of the block than at "
                f"place 0 with {threads} torch threads, so rollout log-probs would differ from the trainer's. Run "
                "with torch.set_num_threads(1), or use a CUDA device; please report the CPU model and "
                "torch.__config__.show() to rlexact"
            )


def block_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` of one fixed-shape row block, fp32 ``x [ROW_BLOCK, K]`` and ``w [N, K]`` -> fp32 ``[ROW_BLOCK,
    N]`` (a transposed view), computed as ``(w @ x.T).T`` so that a row's result does not depend on its place in the
    block (module docstring); :func:`check_block_product` first, for each shape and thread count."""
    check_block_product(w.shape[0], w.shape[1], torch.get_num_threads())
    return _block_product(x, w)


def linear_blocks(xp: torch.Tensor, wf: torch.Tensor) -> torch.Tensor:
    """:func:`block_linear` of every row block of ``xp [M, K]`` (``M`` a multiple of :data:`ROW_BLOCK`, any dtype,
    taken to fp32 block by block) with fp32 ``wf [N, K]`` -> fp32 ``[M, N]``; the BLAS check once for the call."""
    check_block_product(wf.shape[0], wf.shape[1], torch.get_num_threads())
    out = torch.empty((xp.shape[0], wf.shape[0]), dtype=torch.float32, device=xp.device)
    for s in range(0, xp.shape[0], ROW_BLOCK):
        out[s : s + ROW_BLOCK] = _block_product(xp[s : s + ROW_BLOCK].float(), wf)
    return out


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with fp32 accumulation. ``x [M, K]``, ``w [N, K]`` -> ``[M, N]`` in ``x.dtype``."""
    xp, m = padded_blocks(x)
    return linear_blocks(xp, w.float())[:m].to(x.dtype)


def offset_scale(w: torch.Tensor, offset: bool) -> torch.Tensor:
    """The scale a norm multiplies by: ``w``, or with ``offset`` (Gemma's) ``1 + w`` added in fp32."""
    return 1.0 + w.float() if offset else w


def rms_norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, round_normed: bool = True, offset: bool = False
) -> torch.Tensor:
    """transformers RMSNorm semantics (:func:`rlexact.ops.reference.rms_norm`): ``w * (x32 * rsqrt(mean(x32^2) +
    eps)).to(x.dtype)`` in ``promote(w.dtype, x.dtype)``; with ``round_normed=False`` the product in fp32, rounded
    once to ``x.dtype``; with ``offset`` the scale is ``1 + w`` added in fp32. ``x [M, H]``."""
    w = offset_scale(w, offset)
    xp, m = padded_blocks(x)
    out_dtype = torch.promote_types(w.dtype, x.dtype) if round_normed else x.dtype
    out = torch.empty(xp.shape, dtype=out_dtype, device=x.device)
    for s in range(0, xp.shape[0], ROW_BLOCK):
        xf = xp[s : s + ROW_BLOCK].float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out[s : s + ROW_BLOCK] = w * n.to(x.dtype) if round_normed else (w * n).to(x.dtype)
    return out[:m]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, round_normed: bool = True,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(rms_norm(s, w, eps, ...), s)`` with ``s = x + residual`` (torch's add: exactly rounded, so
    batch-invariant)."""
    s = x + residual
    return rms_norm(s, w, eps, round_normed, offset), s


def norm_add_rms_norm(
    x: torch.Tensor, x_weight: torch.Tensor, x_eps: float, residual: torch.Tensor, w: torch.Tensor, eps: float,
    round_normed: bool = True, offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`add_rms_norm` of ``rms_norm(x, x_weight, x_eps, ...)`` and ``residual``."""
    return add_rms_norm(rms_norm(x, x_weight, x_eps, round_normed, offset), residual, w, eps, round_normed, offset)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k, v [T, Hkv, D]`` into slots ``slot_mapping [T]`` of the caches ``[num_blocks, block_size, Hkv, D]``,
    converted to the cache dtype (``index_copy_``; out-of-range slots raise)."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, v.to(vc.dtype))


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    round_normed: bool = True,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given; ``round_normed``, ``offset``: its kind, as in :func:`rms_norm`)
    then rotary in fp32, cast once; see :mod:`rlexact.ops.triton_rope`. ``q [T, Hq, D]``, ``k [T, Hkv, D]``, fp32
    ``cos, sin [T, D]``."""
    kind = (round_normed, offset)
    return (
        _norm_rope_one(q, cos, sin, q_weight, eps, kind),
        _norm_rope_one(k, cos, sin, k_weight, eps, kind),
    )


def _norm_rope_one(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor | None, eps: float, kind: tuple[bool, bool]
) -> torch.Tensor:
    """The norm runs on fixed row blocks (:func:`rms_norm`); the rotation is exactly rounded multiplies and adds (no
    transcendental, no fused multiply-add), so vectorized and scalar code agree and it needs no blocking. Llama's
    norm multiplies by the weight in the input dtype; a round-once norm scales in fp32, as the kernel does."""
    t, h, d = x.shape
    if w is not None:
        w = w.to(x.dtype) if kind[0] else w
        x = rms_norm(x.reshape(t * h, d), w, eps, *kind).reshape(t, h, d)
    xf, half = x.float(), d // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.float()[:, None] + rot * sin.float()[:, None]).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``(silu(gate32) * up32).to(gate.dtype)``: one cast at the end. ``gate, up [M, I]``."""
    return _gated_mul(gate, up, F.silu)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``(gelu_tanh(gate32) * up32).to(gate.dtype)`` (transformers' ``gelu_pytorch_tanh``). ``gate, up [M, I]``."""
    return _gated_mul(gate, up, functools.partial(F.gelu, approximate="tanh"))


def _gated_mul(gate: torch.Tensor, up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``(act(gate32) * up32).to(gate.dtype)`` on fixed row blocks: torch's vectorized elementwise kernels give a
    column the same lane whatever the number of rows."""
    gp, m = padded_blocks(gate)
    upp, _ = padded_blocks(up)
    out = torch.empty(gp.shape, dtype=gate.dtype, device=gate.device)
    for s in range(0, gp.shape[0], ROW_BLOCK):
        out[s : s + ROW_BLOCK] = (act(gp[s : s + ROW_BLOCK].float()) * upp[s : s + ROW_BLOCK].float()).to(gate.dtype)
    return out[:m]


def _head_block(h: torch.Tensor, wf: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits ``[ROW_BLOCK, V]`` fp32 and their logsumexp ``[ROW_BLOCK]`` for one fixed-shape row block."""
    scaled = block_linear(h.float(), wf) / temperature
    mx = scaled.amax(-1, keepdim=True)
    lse = (mx + torch.log(torch.exp(scaled - mx).sum(-1, keepdim=True))).squeeze(-1)
    return scaled, lse


def token_logprobs(
    hidden: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log softmax(hidden @ w.T / temperature)[target]`` and entropy, both fp32 ``[T]``.

    Never holds more than ``[ROW_BLOCK, V]`` logits. ``logp == scaled[target] - lse`` with the same ``scaled`` and
    ``lse`` that :func:`lm_head_logits` returns, so the sampler and the trainer agree bitwise.
    """
    hp, m = padded_blocks(hidden)
    tp, _ = padded_blocks(targets)
    wf = w.float()
    logp = torch.empty(hp.shape[0], dtype=torch.float32, device=hidden.device)
    ent = torch.empty(hp.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, hp.shape[0], ROW_BLOCK):
        scaled, lse = _head_block(hp[s : s + ROW_BLOCK], wf, temperature)
        logp[s : s + ROW_BLOCK] = scaled.gather(-1, tp[s : s + ROW_BLOCK, None]).squeeze(-1) - lse
        ent[s : s + ROW_BLOCK] = lse - (torch.exp(scaled - lse[:, None]) * scaled).sum(-1)
    return logp[:m], ent[:m]


def lm_head_logits(hidden: torch.Tensor, w: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits ``[B, V]`` fp32 and logsumexp ``[B]`` fp32, computed exactly as in :func:`token_logprobs`."""
    hp, m = padded_blocks(hidden)
    wf = w.float()
    logits = torch.empty((hp.shape[0], w.shape[0]), dtype=torch.float32, device=hidden.device)
    lse = torch.empty(hp.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, hp.shape[0], ROW_BLOCK):
        logits[s : s + ROW_BLOCK], lse[s : s + ROW_BLOCK] = _head_block(hp[s : s + ROW_BLOCK], wf, temperature)
    return logits[:m], lse[:m]


@dataclass
class _QueryTile:
    """``ATTN_BLOCK_M`` query rows of one sequence: rows ``[q_lo, q_hi)`` of the output, first at position ``pos0``."""

    q_lo: int
    q_hi: int
    pos0: int
    seq: int


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """The running max with ``-inf`` (no visible key yet) replaced by 0, so empty rows stay exactly empty."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _packed_rows(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows of sequences of ``lens`` rows packed in order: each row's sequence and position in it."""
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                  torch.tensor(lens, dtype=torch.long, device=device))  # fmt: skip
    starts = torch.tensor([0, *itertools.accumulate(lens)][:-1], dtype=torch.long, device=device)
    return seq, torch.arange(seq.shape[0], device=device) - starts[seq]


def _key_tiles(x: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Per-sequence keys (or values) packed in ``x [sum(lens), Hkv, D]`` as key tiles: ``(tiles [n + 1,
    ATTN_BLOCK_N, Hkv, D], first)``, sequence ``s``'s tile ``j`` at ``first[s] + j`` (its rows past the sequence
    zero) and an all-zero tile last."""
    bn = ATTN_BLOCK_N
    _, hkv, d = x.shape
    first = [0, *itertools.accumulate(-(-n // bn) for n in lens)]  # the last entry: the zero tile
    seq, pos = _packed_rows(lens, x.device)
    xp = x.new_zeros((first[-1] + 1, bn, hkv, d))
    xp.view(-1, hkv, d)[torch.tensor(first[:-1], dtype=torch.long, device=x.device)[seq] * bn + pos] = x
    return xp, first[:-1]


def _expanded(tiles: torch.Tensor, hq: int) -> torch.Tensor:
    """Key tiles ``[n, ATTN_BLOCK_N, Hkv, D]`` as contiguous fp32 ``[n, Hq, ATTN_BLOCK_N, D]``, query head ``h``
    reading KV head ``h // (hq / Hkv)``."""
    n, bn, hkv, d = tiles.shape
    return tiles.float().permute(0, 2, 1, 3)[:, :, None].expand(n, hkv, hq // hkv, bn, d).reshape(n, hq, bn, d)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: list[int],
    tiles: list[_QueryTile],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention for query tiles over per-sequence keys (with a sliding ``window``: a query at position ``p``
    sees keys ``p - window + 1 .. p``).

    ``q [Tq, Hq, D]``; ``k, v [sum(lens), Hkv, D]`` hold each sequence's keys packed, sequence ``s``'s ``lens[s]``
    keys at positions ``0..lens[s]-1``. Tiles are processed ``ATTN_GROUP`` at a time on fixed-shape
    ``[G, Hq, BM, D] x [G, Hq, D, BN]`` products; idle slots and tiles past a query's position are fully masked and
    leave its online-softmax state bit-identical.
    """
    _, hq, d = q.shape
    bm, bn, gsz, split = ATTN_BLOCK_M, ATTN_BLOCK_N, ATTN_GROUP, ATTN_SPLIT
    if split % bn:
        raise ValueError(f"attention: ATTN_SPLIT {split} is not a multiple of ATTN_BLOCK_N {bn}")
    dev = q.device
    f32 = torch.float32  # explicit: never the (possibly bf16) default dtype
    kf, first = _key_tiles(k, lens)
    vf, _ = _key_tiles(v, lens)
    zero = kf.shape[0] - 1
    # where a sequence's key tiles serve several query tiles, expand them once; else as each group takes them (the
    # same operands either way)
    once = len(tiles) > len(lens)
    if once:
        kf, vf = _expanded(kf, hq), _expanded(vf, hq)
    out = torch.empty_like(q)
    offs = torch.arange(bn, device=dev)
    # every tile's query rows (the zero row appended to q past a tile's rows), positions and key count, in slots of
    # whole groups (idle slots: zero rows at position -1, every key masked)
    idle = [0] * (-len(tiles) % gsz)
    qz = torch.cat([q.float(), q.new_zeros((1, hq, d), dtype=f32)])
    rows = torch.arange(bm, device=dev)
    lo = torch.tensor([t.q_lo for t in tiles] + idle, dtype=torch.long, device=dev)
    nrows = torch.tensor([t.q_hi - t.q_lo for t in tiles] + idle, device=dev)
    q_rows = torch.where(rows < nrows[:, None], lo[:, None] + rows, q.shape[0])  # [slots, BM]
    pos_all = torch.tensor([t.pos0 for t in tiles] + idle, dtype=torch.long, device=dev)[:, None] + rows
    pos_all[len(tiles) :] = -1
    klen_all = torch.tensor([lens[t.seq] for t in tiles] + idle, dtype=torch.long, device=dev)
    # key tiles each query tile reads: up to its last row's position, within its sequence
    reads = [min(-(-lens[t.seq] // bn), (t.pos0 + t.q_hi - t.q_lo - 1) // bn + 1) for t in tiles]
    for g0 in range(0, len(tiles), gsz):
        grp = tiles[g0 : g0 + gsz]
        qb = qz[q_rows[g0 : g0 + gsz]]  # [G, BM, Hq, D]
        pos, klen = pos_all[g0 : g0 + gsz], klen_all[g0 : g0 + gsz]
        n_tiles = reads[g0 : g0 + gsz]
        qf = qb.permute(0, 2, 1, 3)  # [G, Hq, BM, D]
        m_i = torch.full((gsz, hq, bm), float("-inf"), dtype=f32, device=dev)
        l_i = torch.zeros((gsz, hq, bm), dtype=f32, device=dev)
        acc = torch.zeros((gsz, hq, bm, d), dtype=f32, device=dev)
        tiles_per_split = split // bn
        for s0 in range(0, max(n_tiles), tiles_per_split):
            m_s = torch.full_like(m_i, float("-inf"))
            l_s = torch.zeros_like(l_i)
            acc_s = torch.zeros_like(acc)
            for j in range(s0, min(s0 + tiles_per_split, max(n_tiles))):
                idx = [first[t.seq] + j if j < n_tiles[i] else zero for i, t in enumerate(grp)]
                idx = torch.tensor(idx + [zero] * (gsz - len(grp)), device=dev)
                kt, vt = kf.index_select(0, idx), vf.index_select(0, idx)
                if not once:
                    kt, vt = _expanded(kt, hq), _expanded(vt, hq)
                kpos = j * bn + offs
                scores = torch.matmul(qf, kt.transpose(-1, -2)) * scale  # [G, Hq, BM, BN]
                # idle slots (position -1) stay fully masked
                masked = hidden_keys(kpos, pos, window) | (kpos[None, None, :] >= klen[:, None, None])
                scores = scores.masked_fill(masked[:, None], float("-inf"))
                m_new = torch.maximum(m_s, scores.amax(-1))
                m_use = _finite_or_zero(m_new)
                alpha = torch.exp(m_s - m_use)
                p = torch.exp(scores - m_use[..., None])
                l_s = l_s * alpha + p.sum(-1)
                acc_s = acc_s * alpha[..., None] + torch.matmul(p, vt)
                m_s = m_new
            m_new = torch.maximum(m_i, m_s)
            m_use = _finite_or_zero(m_new)
            a, b = torch.exp(m_i - m_use), torch.exp(m_s - m_use)
            l_i = l_i * a + l_s * b
            acc = acc * a[..., None] + acc_s * b[..., None]
            m_i = m_new
        o = (acc / l_i[..., None]).permute(0, 2, 1, 3)  # [G, BM, Hq, D]
        dest = q_rows[g0 : g0 + gsz]
        real = dest < q.shape[0]
        out[dest[real]] = o[real].to(q.dtype)
    return out


def _query_tiles(cu_q: list[int], starts: list[int]) -> list[_QueryTile]:
    """Split each sequence's queries (absolute start ``starts[b]``) into tiles of ``ATTN_BLOCK_M`` rows."""
    tiles = []
    for b, (s, e) in enumerate(zip(cu_q[:-1], cu_q[1:])):
        for lo in range(s, e, ATTN_BLOCK_M):
            tiles.append(_QueryTile(lo, min(e, lo + ATTN_BLOCK_M), starts[b] + lo - s, b))
    return tiles


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences. ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, ``cu_seqlens [B+1]``;
    ``window``: the sliding window (None: every earlier key)."""
    cu = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    keys, values = k[cu[0] : cu[-1]], v[cu[0] : cu[-1]]
    return _attend(q, keys, values, lens, _query_tiles(cu, [0] * (len(cu) - 1)), scale, window)


def gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Keys (or values) ``[sum(lens), Hkv, D]`` of the sequences whose block tables are the rows of ``block_tables``,
    packed (sequence ``b``'s ``lens[b]`` keys in order), from a paged cache ``[num_blocks, block_size, Hkv, D]``."""
    bs = cache.shape[1]
    seq, pos = _packed_rows(lens, cache.device)
    slots = block_tables[seq, pos // bs].long() * bs + pos % bs
    return cache.reshape(-1, *cache.shape[2:])[slots]


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
    prefix: object = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of new queries over a paged KV cache (prefill chunks and decode), with an optional sliding
    ``window``.

    Sequence ``b`` has ``nq_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` queries, the last ``nq_b`` of its
    ``seqlens_k[b]`` keys, already written to the cache. Row results equal :func:`attention_varlen` bitwise.
    ``max_seqlen_q`` (a launch hint on the GPU) is checked against the actual query counts; ``split_counters`` (the
    GPU's ticket counters) and ``prefix`` (the GPU's shared-tile plan, :mod:`rlexact.ops.shared_prefix`) are not
    used here: neither changes a row.
    """
    cu = cu_seqlens_q.tolist()
    longest = max((e - s for s, e in zip(cu[:-1], cu[1:])), default=0)
    if max_seqlen_q is not None and longest > max_seqlen_q:
        raise ValueError(
            f"attention_paged: a sequence has {longest} queries but max_seqlen_q is {max_seqlen_q}; pass the true "
            "maximum (or None)"
        )
    lens = seqlens_k.tolist()
    keys, values = gather_paged(k_cache, block_tables, lens), gather_paged(v_cache, block_tables, lens)
    starts = [lens[b] - (cu[b + 1] - cu[b]) for b in range(len(lens))]
    return _attend(q, keys, values, lens, _query_tiles(cu, starts), scale, window)
