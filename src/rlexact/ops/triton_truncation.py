"""Top-p (and top-k) truncation thresholds on the GPU: top-p in Triton, one program per row, without sorting the
vocabulary.

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
of ``top_p``. The search reads nothing but its own row, in an order fixed by the row's values: a row's threshold
does not depend on the batch, which is what the generator and the trainer need to agree bitwise.

Search (:func:`_top_p_kernel`). Values map to order-preserving int32 keys. The threshold lies in a key interval
``(lo, hi]``, at first the row's ``(min - 1, max]``, with ``W(hi) < target <= W(lo)``. One pass over the row sums
the in-interval weights (and counts) above :data:`PROBES` probe keys evenly spaced in the interval and keeps the
sub-interval where ``W`` crosses the target; once at most :data:`CAP` elements are left, a last pass copies them to
a scratch row (in any order: equal values are equal bits), which is sorted and scanned (exclusive prefix sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_shared import COMPILE_OPTIONS

__all__ = ["CAP", "PROBES", "truncation_thresholds"]

PROBES = 16
"""Probe keys per pass (each pass narrows the key interval about this many times)."""
CAP = 2048
"""Elements left in the interval at which the search copies, sorts and scans them."""
BLOCK = 512
"""Vocabulary entries per loop iteration of a pass."""


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
def _narrow(acc_w, acc_c, probes, kmin, lo, hi, base, target, P: tl.constexpr):
    """The sub-interval where ``W = base + acc_w`` crosses ``target``: ``(lo, hi, base, count, done, tau)``;
    ``done`` (1) when every in-interval element is kept (``tau`` their smallest key)."""
    j = tl.arange(0, P)
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
def _load(row, start, V, BLOCK: tl.constexpr):
    """Entries ``start .. start + BLOCK`` of the row (``-inf`` past it), ``-0.0`` read as ``+0.0`` (one key per
    value)."""
    offs = start + tl.arange(0, BLOCK)
    return tl.load(row + offs, mask=offs < V, other=float("-inf")) + 0.0


@triton.jit
def _probe_pass(row, V, lo, hi, m, BLOCK: tl.constexpr, P: tl.constexpr):
    """One pass: for probe keys ``lo + (hi - lo) * j // P`` (``j < P``), the in-interval weight and count above
    each, and the smallest in-interval key. Each thread accumulates its own lanes over the row (reduced once, at the
    end); loads run three blocks ahead of their use."""
    j = tl.arange(0, P)
    probes = (lo + ((hi - lo) * j) // P).to(tl.int32)
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    acc_w = tl.zeros([P, BLOCK], tl.float32)
    acc_c = tl.zeros([P, BLOCK], tl.int32)
    kmin = tl.full([BLOCK], 0, tl.int32) + hi32
    z1 = _load(row, 0, V, BLOCK)
    z2 = _load(row, BLOCK, V, BLOCK)
    z3 = _load(row, 2 * BLOCK, V, BLOCK)
    for start in range(0, V, BLOCK):
        z = z1
        z1 = z2
        z2 = z3
        z3 = _load(row, start + 3 * BLOCK, V, BLOCK)
        k = _key(z)
        inside = (start + tl.arange(0, BLOCK) < V) & (k > lo32) & (k <= hi32)
        above = (k[None, :] > probes[:, None]) & inside[None, :]
        acc_w += tl.where(above, tl.exp(z - m)[None, :], 0.0)
        acc_c += above.to(tl.int32)
        kmin = tl.minimum(kmin, tl.where(inside, k, hi32))
    return tl.sum(acc_w, axis=1), tl.sum(acc_c, axis=1), probes, tl.min(kmin, axis=0)


@triton.jit
def _finish(row, buf, slot, V, lo, hi, base, target, m, count, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """The last step: the ``count <= CAP`` elements of ``(lo, hi]`` copied to the scratch row (each takes a slot
    from an atomic counter: the copy's order varies, its sorted values do not), sorted, scanned; the threshold's
    key."""
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    z1 = _load(row, 0, V, BLOCK)
    z2 = _load(row, BLOCK, V, BLOCK)
    for start in range(0, V, BLOCK):
        z = z1
        z1 = z2
        z2 = _load(row, start + 2 * BLOCK, V, BLOCK)
        k = _key(z)
        inside = (start + tl.arange(0, BLOCK) < V) & (k > lo32) & (k <= hi32)
        pos = tl.atomic_add(slot + tl.zeros([BLOCK], tl.int32), 1, mask=inside, sem="relaxed")
        tl.store(buf + pos, z, mask=inside)
    tl.debug_barrier()  # the copies above are visible to every thread of the program
    i = tl.arange(0, CAP)
    valid = i < count
    s = tl.sort(tl.load(buf + i, mask=valid, other=float("-inf")), descending=True)
    w = tl.where(valid, tl.exp(s - m), 0.0)
    before = base + (tl.cumsum(w, axis=0) - w)
    keep = tl.maximum(tl.sum((valid & (before < target)).to(tl.int32), axis=0), 1)
    tau = tl.max(tl.where(i == keep - 1, s, float("-inf")), axis=0)
    return _key(tau).to(tl.int64)


@triton.jit(do_not_specialize=["V"])
def _top_p_kernel(z_ptr, stride_z, V, out_ptr, buf_ptr, slot_ptr, top_p, BLOCK: tl.constexpr, P: tl.constexpr,
                  CAP: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    row = z_ptr + r.to(tl.int64) * stride_z
    buf = buf_ptr + r.to(tl.int64) * CAP
    slot = slot_ptr + r  # the last step's copy counter (zeroed by the launcher)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        z = _load(row, start, V, BLOCK)
        mx = tl.maximum(mx, z)
        mn = tl.minimum(mn, tl.where(start + tl.arange(0, BLOCK) < V, z, float("inf")))
    m = tl.max(mx, axis=0)
    lo = _key(tl.min(mn, axis=0)).to(tl.int64) - 1
    hi = _key(m).to(tl.int64)
    zero = tl.sum(tl.zeros([2], tl.float32), axis=0)
    acc_w, acc_c, probes, kmin = _probe_pass(row, V, lo, hi, m, BLOCK, P)
    target = top_p * _pick(acc_w, tl.arange(0, P), 0)  # top_p * S
    lo, hi, base, count, done, tau = _narrow(acc_w, acc_c, probes, kmin, lo, hi, zero, target, P)
    while (done == 0) & (count > CAP) & (hi - lo > 1):
        acc_w, acc_c, probes, kmin = _probe_pass(row, V, lo, hi, m, BLOCK, P)
        lo, hi, base, count, done, tau = _narrow(acc_w, acc_c, probes, kmin, lo, hi, base, target, P)
    if done == 0:
        if hi - lo > 1:
            tau = _finish(row, buf, slot, V, lo, hi, base, target, m, count, BLOCK, CAP)
        else:
            tau = hi
    tl.store(out_ptr + r, _value(tau.to(tl.int32)))


def truncation_thresholds(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Per-row thresholds ``[B, 1]`` fp32 of ``z [B, V]`` fp32 for ``0 < top_k < V`` and/or ``top_p < 1`` (the
    module's contract; at least one must truncate). Row-invariant, no host synchronization: top-k is ``torch.topk``'s
    values over the whole batch; top-p runs :func:`_top_p_kernel` on the rows, or with top-k on their ``k`` sorted
    values."""
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
    out = torch.empty((b, 1), dtype=torch.float32, device=z.device)
    if b == 0:
        return out
    buf = torch.empty((b, CAP), dtype=torch.float32, device=z.device)
    slots = torch.zeros(b, dtype=torch.int32, device=z.device)
    _top_p_kernel[(b,)](
        z, z.stride(0), z.shape[1], out, buf, slots, float(top_p), BLOCK=BLOCK, P=PROBES, CAP=CAP, num_warps=8,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return out
