"""Top-p (and top-k) truncation thresholds on the GPU: top-p in Triton, without sorting the vocabulary.

Contract. For rows ``z [B, V]`` fp32 (``-0.0`` read as ``+0.0``) :func:`truncation_thresholds` returns ``tau`` per
row with the kept set ``{v : z[v] >= tau}``:

* top-k: ``tau_k``, the ``k``-th largest value (ties at the boundary all kept), from ``torch.topk``'s values: a
  selection, so the same value whatever the batch shape or the implementation;
* top-p over the candidates (the ``k`` sorted top-k values with top-k, so exactly ``k`` values however many tie at
  ``tau_k``, as the torch path in :mod:`rlexact.models.truncation` renormalizes; else every token): with weights
  ``w = exp(z - m)`` (``m`` the largest candidate) and ``W(x) = sum(w over candidates > x)``, ``tau`` is the
  smallest candidate value ``x`` with ``W(x) < top_p * S``, ``S`` the candidates' mass. The largest value always
  qualifies (``W = 0``), so the top token is always kept.

In exact arithmetic that is the torch path's threshold (sorted values, ``cumsum - p < top_p``); here the masses
are fp32 sums in the order of the search below, so the two can differ only where the kept mass is within rounding
of ``top_p``. The search reads nothing but its own row, in an order fixed by the row's values and ``V``: a row's
threshold does not depend on the batch, which is what the generator and the trainer need to agree bitwise.

Search. Values map to order-preserving int32 keys. The threshold lies in a key interval ``(lo, hi]``, at first the
row's ``(min - 1, max]``, with ``W(hi) < target <= W(lo)``. One pass over the row sums the in-interval weights (and
counts) above :data:`PROBES` probe keys evenly spaced in the interval and keeps the sub-interval where ``W`` crosses
the target; once at most :data:`CAP` elements are left, they are copied to a scratch row (in any order: equal values
are equal bits), sorted and scanned (exclusive prefix sums). Each pass narrows the interval ``PROBES`` times, so
:func:`passes` passes leave at most one key.

Two launch plans, chosen by ``V`` alone (so never by the batch):

* ``V <= SEGMENT`` (top-k candidates): :func:`_top_p_kernel`, one program per row running every pass;
* longer rows: each pass sums fixed :data:`SEGMENT`-entry segments of the row, one partial per segment, in a
  launch of several programs per row (:data:`PROGRAMS_PER_SM`). A program first folds the previous pass's partials
  (one fixed reduction tree over the segments: the same in every program of the row) into the row's next interval,
  then sums its segments. :func:`passes` pass launches always run; a row whose search has ended skips its work. A
  pass thus spreads over many SMs at any batch.

:func:`kept_logsumexp` gives the logsumexp over the kept entries (the ``"sampled"`` log-probs' normalizer), one
program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_shared import COMPILE_OPTIONS, num_sms

__all__ = ["CAP", "PROBES", "SEGMENT", "kept_logsumexp", "passes", "truncation_thresholds"]

PROBES = 16
"""Probe keys per pass (each pass narrows the key interval this many times; a power of two)."""
CAP = 2048
"""Elements left in the interval at which the search copies, sorts and scans them."""
BLOCK = 512
"""Vocabulary entries per loop iteration of a pass."""
SEGMENT = 4096
"""Entries per program of the segmented plan (rows longer than this) and per segment of :func:`kept_logsumexp`
(every row); part of the bit contract, like ``BLOCK``."""
WARPS = 8
"""Warps of every launch of this module."""
LSE_WARPS = 4
"""Warps of :func:`kept_logsumexp`'s segment launch (speed only: a segment is one tile whatever the warps)."""
PROGRAMS_PER_SM = 2
"""Programs per SM the segmented plan aims at: a row gets ``ceil(PROGRAMS_PER_SM * SMs / B)`` programs (at most
one per segment), each walking its share of the segments. Speed only: a segment's sums do not depend on it."""

# Row-state fields of the segmented plan (int64; fp32 values stored as their bits).
_LO, _HI, _BASE, _TARGET, _M, _COUNT, _DONE, _TAU = (tl.constexpr(i) for i in range(8))
STATE_FIELDS = tl.constexpr(8)


def passes(probes: int) -> int:
    """Probe passes that narrow any int32 key interval to one key: ``ceil(32 / log2(probes))``."""
    return -(-32 // (probes.bit_length() - 1))


@triton.jit
def _key(z):
    """Order-preserving int32 key of fp32 ``z`` (signed comparison of keys is comparison of values)."""
    b = z.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _value(k):
    """The fp32 value of key ``k`` (inverse of :func:`_key`)."""
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _pick(vec, j, sel):
    """``vec[sel]`` of a ``[P]`` vector (``j = arange(P)``), exactly."""
    return tl.sum(tl.where(j == sel, vec, 0), axis=0)


@triton.jit
def _probes(lo, hi, P: tl.constexpr):
    """The pass's probe keys ``lo + (hi - lo) * j // P``, ``j < P`` (int32)."""
    return (lo + ((hi - lo) * tl.arange(0, P)) // P).to(tl.int32)


@triton.jit
def _narrow(acc_w, acc_c, kmin, lo, hi, base, target, P: tl.constexpr):
    """The sub-interval where ``W = base + acc_w`` crosses ``target``: ``(lo, hi, base, count, done, tau)``;
    ``done`` (1) when every in-interval element is kept (``tau`` their smallest key)."""
    j = tl.arange(0, P)
    probes = _probes(lo, hi, P)
    w_at = base + acc_w
    js = tl.max(tl.where(w_at >= target, j, -1), axis=0)
    done = (js < 0).to(tl.int32)
    jn = tl.minimum(js + 1, P - 1)
    last = js == P - 1
    new_lo = _pick(probes, j, tl.maximum(js, 0)).to(tl.int64)
    new_hi = tl.where(last, hi, _pick(probes, j, jn).to(tl.int64))
    new_base = tl.where(last, base, base + _pick(acc_w, j, jn))
    count = _pick(acc_c, j, tl.maximum(js, 0)) - tl.where(last, 0, _pick(acc_c, j, jn))
    return new_lo, new_hi, new_base, count, done, kmin.to(tl.int64)


@triton.jit
def _load(row, start, end, BLOCK: tl.constexpr):
    """Entries ``start .. start + BLOCK`` of the row (``-inf`` from ``end`` on), ``-0.0`` read as ``+0.0`` (one key
    per value)."""
    offs = start + tl.arange(0, BLOCK)
    return tl.load(row + offs, mask=offs < end, other=float("-inf")) + 0.0


@triton.jit
def _extent(row, start, end, BLOCK: tl.constexpr):
    """The largest and the smallest value of entries ``start .. end``."""
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    for s in range(start, end, BLOCK):
        z = _load(row, s, end, BLOCK)
        mx = tl.maximum(mx, z)
        mn = tl.minimum(mn, tl.where(s + tl.arange(0, BLOCK) < end, z, float("inf")))
    return tl.max(mx, axis=0), tl.min(mn, axis=0)


@triton.jit
def _first_interval(mx, mn):
    """The key interval ``(lo, hi]`` the search starts from: ``(key(min) - 1, key(max)]`` (int64)."""
    return _key(mn).to(tl.int64) - 1, _key(mx).to(tl.int64)


@triton.jit
def _segment(g, SEG: tl.constexpr, V):
    """Entries ``start .. end`` of segment ``g``."""
    return g * SEG, tl.minimum(g * SEG + SEG, V)


@triton.jit
def _load_row(row, start, end, BLOCK: tl.constexpr):
    """:func:`_load` as a ``[1, BLOCK]`` tile, the layout of the ``[P, BLOCK]`` probe tiles (no layout change per
    block)."""
    offs = start + tl.arange(0, BLOCK)[None, :]
    return tl.load(row + offs, mask=offs < end, other=float("-inf")) + 0.0


@triton.jit
def _probe_pass(row, start, end, lo, hi, m, BLOCK: tl.constexpr, P: tl.constexpr):
    """One pass over entries ``start .. end``: for the probe keys of ``(lo, hi]``, the in-interval weight and count
    above each, and the smallest in-interval key (``hi`` if none). An entry outside the interval takes key ``lo``,
    which no probe is below. Each thread accumulates its own lanes (reduced once, at the end); loads run three blocks
    ahead of their use."""
    probes = _probes(lo, hi, P)[:, None]
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    acc_w = tl.zeros([P, BLOCK], tl.float32)
    acc_c = tl.zeros([P, BLOCK], tl.int32)
    kmin = tl.full([1, BLOCK], 0, tl.int32) + hi32
    z1 = _load_row(row, start, end, BLOCK)
    z2 = _load_row(row, start + BLOCK, end, BLOCK)
    z3 = _load_row(row, start + 2 * BLOCK, end, BLOCK)
    for s in range(start, end, BLOCK):
        z = z1
        z1 = z2
        z2 = z3
        z3 = _load_row(row, s + 3 * BLOCK, end, BLOCK)
        k = _key(z)
        inside = (s + tl.arange(0, BLOCK)[None, :] < end) & (k > lo32) & (k <= hi32)
        k = tl.where(inside, k, lo32)
        above = k > probes
        acc_w += tl.where(above, tl.exp(z - m), 0.0)
        acc_c += above.to(tl.int32)
        kmin = tl.minimum(kmin, tl.where(inside, k, hi32))
    return tl.sum(acc_w, axis=1), tl.sum(acc_c, axis=1), tl.min(tl.min(kmin, axis=1), axis=0)


@triton.jit
def _copy_range(row, buf, slot, start, end, lo, hi, BLOCK: tl.constexpr):
    """Entries ``start .. end`` with keys in ``(lo, hi]`` copied to the scratch row, each to a slot drawn from an
    atomic counter (the copy's order varies, its sorted values do not)."""
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    z1 = _load(row, start, end, BLOCK)
    z2 = _load(row, start + BLOCK, end, BLOCK)
    for s in range(start, end, BLOCK):
        z = z1
        z1 = z2
        z2 = _load(row, s + 2 * BLOCK, end, BLOCK)
        k = _key(z)
        inside = (s + tl.arange(0, BLOCK) < end) & (k > lo32) & (k <= hi32)
        pos = tl.atomic_add(slot + tl.zeros([BLOCK], tl.int32), 1, mask=inside, sem="relaxed")
        tl.store(buf + pos, z, mask=inside)


@triton.jit
def _sorted_threshold(buf, base, target, m, count, CAP: tl.constexpr):
    """The threshold's key from the ``count <= CAP`` copied elements: sorted, scanned (exclusive prefix sums of
    their weights on top of ``base``), the last one whose mass before it is below ``target``."""
    i = tl.arange(0, CAP)
    valid = i < count
    s = tl.sort(tl.load(buf + i, mask=valid, other=float("-inf")), descending=True)
    w = tl.where(valid, tl.exp(s - m), 0.0)
    before = base + (tl.cumsum(w, axis=0) - w)
    keep = tl.maximum(tl.sum((valid & (before < target)).to(tl.int32), axis=0), 1)
    tau = tl.max(tl.where(i == keep - 1, s, float("-inf")), axis=0)
    return _key(tau).to(tl.int64)


@triton.jit
def _end_key(done, tau, lo, hi, buf, base, target, m, count, CAP: tl.constexpr):
    """The threshold's key once the passes are over: the smallest in-interval key when all of it is kept, ``hi``
    when the interval is one key, else from the sorted copy."""
    if done == 0:
        if hi - lo > 1:
            tau = _sorted_threshold(buf, base, target, m, count, CAP)
        else:
            tau = hi
    return tau


@triton.jit(do_not_specialize=["V"])
def _top_p_kernel(z_ptr, stride_z, V, out_ptr, buf_ptr, slot_ptr, top_p, BLOCK: tl.constexpr, P: tl.constexpr,
                  CAP: tl.constexpr):  # fmt: skip
    """Rows of at most ``SEGMENT`` entries: one program per row runs the whole search."""
    r = tl.program_id(0)
    row = z_ptr + r.to(tl.int64) * stride_z
    buf = buf_ptr + r.to(tl.int64) * CAP
    slot = slot_ptr + r  # the last step's copy counter (zeroed by the launcher)
    m, mn = _extent(row, 0, V, BLOCK)
    lo, hi = _first_interval(m, mn)
    zero = tl.sum(tl.zeros([2], tl.float32), axis=0)
    acc_w, acc_c, kmin = _probe_pass(row, 0, V, lo, hi, m, BLOCK, P)
    target = top_p * _pick(acc_w, tl.arange(0, P), 0)  # top_p * S
    lo, hi, base, count, done, tau = _narrow(acc_w, acc_c, kmin, lo, hi, zero, target, P)
    while (done == 0) & (count > CAP) & (hi - lo > 1):
        acc_w, acc_c, kmin = _probe_pass(row, 0, V, lo, hi, m, BLOCK, P)
        lo, hi, base, count, done, tau = _narrow(acc_w, acc_c, kmin, lo, hi, base, target, P)
    if (done == 0) & (hi - lo > 1):
        _copy_range(row, buf, slot, 0, V, lo, hi, BLOCK)
        tl.debug_barrier()  # the copies are visible to every thread of the program
    tau = _end_key(done, tau, lo, hi, buf, base, target, m, count, CAP)
    tl.store(out_ptr + r, _value(tau.to(tl.int32)))


@triton.jit
def _bits(x):
    """fp32 ``x`` as int64 (its bits) for the state row."""
    return x.to(tl.int32, bitcast=True).to(tl.int64)


@triton.jit
def _unbits(v):
    """Inverse of :func:`_bits`."""
    return v.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _read_state(st):
    lo = tl.load(st + _LO)
    hi = tl.load(st + _HI)
    base = _unbits(tl.load(st + _BASE))
    target = _unbits(tl.load(st + _TARGET))
    m = _unbits(tl.load(st + _M))
    count = tl.load(st + _COUNT).to(tl.int32)
    done = tl.load(st + _DONE).to(tl.int32)
    tau = tl.load(st + _TAU)
    return lo, hi, base, target, m, count, done, tau


@triton.jit
def _write_state(st, lo, hi, base, target, m, count, done, tau):
    tl.store(st + _LO, lo)
    tl.store(st + _HI, hi)
    tl.store(st + _BASE, _bits(base))
    tl.store(st + _TARGET, _bits(target))
    tl.store(st + _M, _bits(m))
    tl.store(st + _COUNT, count.to(tl.int64))
    tl.store(st + _DONE, done.to(tl.int64))
    tl.store(st + _TAU, tau)


@triton.jit
def _searching(done, count, lo, hi, CAP: tl.constexpr):
    """Whether the row's search needs another probe pass."""
    return (done == 0) & (count > CAP) & (hi - lo > 1)


@triton.jit(do_not_specialize=["V", "n_seg", "n_rows", "step"])
def _segment_kernel(z_ptr, stride_z, V, n_seg, n_rows, ext_ptr, part_ptr, state_ptr, buf_ptr, slot_ptr, top_p, step,
                    SEG: tl.constexpr, SEGS: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, CAP: tl.constexpr,
                    MODE: tl.constexpr):  # fmt: skip
    """Program ``(row, q)`` of step ``step`` of the segmented plan: the row's segments ``q, q + G, ...`` (``G``
    programs per row; a segment's results do not depend on ``G``). ``MODE`` 0: each segment's extent into
    ``ext [B, n_seg, 2]``. 1: the row's state (from the extents at step 1, else narrowed by the previous pass's
    partials) into state slot ``step % 2`` by program 0, then, while the search goes on, this pass's partials of each
    segment into ``part [2, B, n_seg, 2P + 1]`` (slot ``step % 2``). 2: the state narrowed by the last pass, then the
    segments' in-interval entries copied to the scratch row."""
    r = tl.program_id(0)
    q = tl.program_id(1)
    n_prog = tl.num_programs(1)
    row = z_ptr + r.to(tl.int64) * stride_z
    if MODE == 0:
        for g in range(q, n_seg, n_prog):
            start, end = _segment(g, SEG, V)
            mx, mn = _extent(row, start, end, BLOCK)
            tl.store(ext_ptr + (r * n_seg + g) * 2, mx)
            tl.store(ext_ptr + (r * n_seg + g) * 2 + 1, mn)
    else:
        segs = tl.arange(0, SEGS)
        seg_ok = segs < n_seg
        width = 2 * P + 1
        if step == 1:
            e = ext_ptr + (r * n_seg + segs) * 2
            m = tl.max(tl.load(e, mask=seg_ok, other=float("-inf")), axis=0)
            lo, hi = _first_interval(m, tl.min(tl.load(e + 1, mask=seg_ok, other=float("inf")), axis=0))
            base = tl.sum(tl.zeros([2], tl.float32), axis=0)
            target = base
            count = tl.full([], 2147483647, tl.int32)
            done = tl.full([], 0, tl.int32)
            tau = hi
        else:
            lo, hi, base, target, m, count, done, tau = _read_state(
                state_ptr + ((step - 1) % 2 * n_rows + r) * STATE_FIELDS
            )
            if _searching(done, count, lo, hi, CAP):  # the previous pass ran: fold its partials
                j = tl.arange(0, P)
                pp = part_ptr + (((step - 1) % 2 * n_rows + r) * n_seg + segs[:, None]) * width + j[None, :]
                acc_w = tl.sum(tl.load(pp, mask=seg_ok[:, None], other=0.0), axis=0)
                acc_c = tl.sum(tl.load(pp + P, mask=seg_ok[:, None], other=0.0), axis=0).to(tl.int32)
                km = tl.load(pp + 2 * P, mask=seg_ok[:, None] & (j == 0)[None, :], other=float("inf"))
                kmin = _key(tl.min(tl.min(km, axis=1), axis=0))
                if step == 2:
                    target = top_p * _pick(acc_w, j, 0)  # top_p * S
                lo, hi, base, count, done, tau = _narrow(acc_w, acc_c, kmin, lo, hi, base, target, P)
        if q == 0:
            _write_state(state_ptr + (step % 2 * n_rows + r) * STATE_FIELDS, lo, hi, base, target, m, count, done,
                         tau)  # fmt: skip
        if MODE == 1:
            if _searching(done, count, lo, hi, CAP):
                for g in range(q, n_seg, n_prog):
                    start, end = _segment(g, SEG, V)
                    acc_w, acc_c, kmin = _probe_pass(row, start, end, lo, hi, m, BLOCK, P)
                    j = tl.arange(0, P)
                    out = part_ptr + ((step % 2 * n_rows + r) * n_seg + g) * width
                    tl.store(out + j, acc_w)
                    tl.store(out + P + j, acc_c.to(tl.float32))
                    tl.store(out + 2 * P, _value(kmin))
        elif (done == 0) & (hi - lo > 1) & (count <= CAP):  # holds after passes(P) narrowings; guards the scratch row
            for g in range(q, n_seg, n_prog):
                start, end = _segment(g, SEG, V)
                _copy_range(row, buf_ptr + r.to(tl.int64) * CAP, slot_ptr + r, start, end, lo, hi, BLOCK)


@triton.jit(do_not_specialize=["n_rows", "step"])
def _select_kernel(state_ptr, buf_ptr, out_ptr, n_rows, step, CAP: tl.constexpr):
    """The threshold of row ``program_id(0)`` from the final state (slot ``step % 2``) and its copied entries."""
    r = tl.program_id(0)
    lo, hi, base, target, m, count, done, tau = _read_state(state_ptr + (step % 2 * n_rows + r) * STATE_FIELDS)
    tau = _end_key(done, tau, lo, hi, buf_ptr + r.to(tl.int64) * CAP, base, target, m, count, CAP)
    tl.store(out_ptr + r, _value(tau.to(tl.int32)))


def _top_p(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p thresholds ``[B, 1]`` of ``z [B, V]`` (``B > 0``) with the launch plan for ``V``."""
    b, v = z.shape
    dev = z.device
    out = torch.empty((b, 1), dtype=torch.float32, device=dev)
    buf = torch.empty((b, CAP), dtype=torch.float32, device=dev)
    slots = torch.zeros(b, dtype=torch.int32, device=dev)
    if v <= SEGMENT:
        _top_p_kernel[(b,)](
            z, z.stride(0), v, out, buf, slots, float(top_p), BLOCK=BLOCK, P=PROBES, CAP=CAP, num_warps=WARPS,
            **COMPILE_OPTIONS,
        )  # fmt: skip
        return out
    n_seg = triton.cdiv(v, SEGMENT)
    grid = (b, min(n_seg, triton.cdiv(PROGRAMS_PER_SM * num_sms(dev), b)))
    ext = torch.empty((b, n_seg, 2), dtype=torch.float32, device=dev)
    part = torch.empty((2, b, n_seg, 2 * PROBES + 1), dtype=torch.float32, device=dev)
    state = torch.empty((2, b, STATE_FIELDS.value), dtype=torch.int64, device=dev)
    n_pass = passes(PROBES)
    const = dict(SEG=SEGMENT, SEGS=triton.next_power_of_2(n_seg), BLOCK=BLOCK, P=PROBES, CAP=CAP)
    for step in range(n_pass + 2):  # extents, the passes, the copy
        mode = 0 if step == 0 else 1 if step <= n_pass else 2
        _segment_kernel[grid](
            z, z.stride(0), v, n_seg, b, ext, part, state, buf, slots, float(top_p), step, **const, MODE=mode,
            num_warps=WARPS, **COMPILE_OPTIONS,
        )  # fmt: skip
    _select_kernel[(b,)](state, buf, out, b, n_pass + 1, CAP=CAP, num_warps=WARPS, **COMPILE_OPTIONS)
    return out


def truncation_thresholds(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Per-row thresholds ``[B, 1]`` fp32 of ``z [B, V]`` fp32 for ``0 < top_k < V`` and/or ``top_p < 1`` (the
    module's contract; at least one must truncate). Row-invariant, no host synchronization: top-k is ``torch.topk``'s
    values over the whole batch; top-p runs the search on the rows, or with top-k on their ``k`` sorted values."""
    if z.dim() != 2 or z.dtype != torch.float32 or z.stride(-1) != 1:
        raise ValueError(f"truncation_thresholds: z must be a row-major fp32 [B, V] tensor, got {z.dtype} {z.shape}")
    b, v = z.shape
    use_k, use_p = 0 < top_k < v, top_p < 1.0
    if not (use_k or use_p):
        raise ValueError(f"truncation_thresholds: top_k={top_k}, top_p={top_p} truncate nothing of {v} tokens")
    if use_k:
        z = torch.topk(z, top_k, dim=-1).values
        if not use_p:
            return z[:, -1:].contiguous()
    if b == 0:
        return torch.empty((0, 1), dtype=torch.float32, device=z.device)
    return _top_p(z, top_p)


@triton.jit(do_not_specialize=["V", "n_seg"])
def _kept_lse_segment_kernel(z_ptr, stride_z, V, t_ptr, part_ptr, n_seg, SEG: tl.constexpr):
    """Segment ``program_id(1)`` of row ``program_id(0)``: ``(m_s, s_s)``, the largest kept entry (``z >= t``) of the
    segment and ``sum(exp(z - m_s))`` over its kept entries (``(-inf, 0)`` with none), as one tile."""
    r = tl.program_id(0)
    seg = tl.program_id(1)
    t = tl.load(t_ptr + r)
    offs = seg * SEG + tl.arange(0, SEG)
    z = tl.load(z_ptr + r.to(tl.int64) * stride_z + offs, mask=offs < V, other=float("-inf"))
    kept = z >= t
    m = tl.max(tl.where(kept, z, float("-inf")), axis=0)
    shift = tl.where(m > float("-inf"), m, 0.0)  # a segment with nothing kept sums no term (and computes no NaN)
    total = tl.sum(tl.where(kept, tl.exp(z - shift), 0.0), axis=0)
    out = part_ptr + r.to(tl.int64) * 2 * n_seg + seg
    tl.store(out, m)
    tl.store(out + n_seg, total)


@triton.jit(do_not_specialize=["n_seg"])
def _kept_lse_fold_kernel(part_ptr, out_ptr, n_seg, SEGS: tl.constexpr):
    """Row ``program_id(0)``: ``M + log(sum_s s_s * exp(m_s - M))`` over its segment partials, ``M`` the largest
    ``m_s``, the sum one reduction of a ``SEGS``-wide tile (a fixed order for a given row length)."""
    r = tl.program_id(0)
    i = tl.arange(0, SEGS)
    base = part_ptr + r.to(tl.int64) * 2 * n_seg
    m = tl.load(base + i, mask=i < n_seg, other=float("-inf"))
    s = tl.load(base + n_seg + i, mask=i < n_seg, other=0.0)
    top = tl.max(m, axis=0)
    scaled = tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0)
    tl.store(out_ptr + r, top + tl.log(tl.sum(scaled, axis=0)))


def kept_logsumexp(z: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``lse_K [B]`` fp32: logsumexp of ``z [B, V]`` fp32 over the entries ``z >= threshold [B, 1]`` (at least one
    per row). One program per fixed :data:`SEGMENT`-entry segment of a row (its kept maximum and the sum of
    ``exp(z - max)`` over it), then one per row folding the segments' partials: every value a function of the row
    and ``V`` only, so row-invariant."""
    if z.dim() != 2 or z.dtype != torch.float32 or z.stride(-1) != 1 or threshold.shape != (z.shape[0], 1):
        raise ValueError(f"kept_logsumexp: z must be a row-major fp32 [B, V] tensor and threshold [B, 1], got "
                         f"{z.dtype} {tuple(z.shape)} and {tuple(threshold.shape)}")  # fmt: skip
    b, v = z.shape
    out = torch.empty(b, dtype=torch.float32, device=z.device)
    if b:
        t = threshold.float().contiguous()
        n_seg = triton.cdiv(v, SEGMENT)
        part = torch.empty((b, 2, n_seg), dtype=torch.float32, device=z.device)
        _kept_lse_segment_kernel[(b, n_seg)](z, z.stride(0), v, t, part, n_seg, SEG=SEGMENT, num_warps=LSE_WARPS,
                                             **COMPILE_OPTIONS)  # fmt: skip
        _kept_lse_fold_kernel[(b,)](part, out, n_seg, SEGS=max(16, triton.next_power_of_2(n_seg)), num_warps=1,
                                    **COMPILE_OPTIONS)  # fmt: skip
    return out
