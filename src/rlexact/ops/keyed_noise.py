"""The keyed Gumbel noise of rlexact's sampler in Triton: ``@triton.jit`` helpers shared by every kernel
that draws (the sampler of :mod:`rlexact.rollout._sampler_triton` and the fused lm head of
:mod:`rlexact.ops.triton_logprob`), so that they compute the same bits.

The draw for vocabulary entry ``v`` of the row sampling position ``p`` of request ``r`` under seed ``s`` is
``z - log(-log(u))`` with ``u = ((h >> 9) + 0.5) * 2**-23`` and ``h = mix32(mix32(ka ^ v) ^ kb)``, ``(ka, kb)`` the row
keys of ``(s, r, p)`` (:func:`row_keys`); ``mix32`` is lowbias32 on uint32. The torch twin is
:mod:`rlexact.rollout.keyed_hash` (same integers; its float ``log`` may differ in the last ulp).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hash_constants import C1, C2, ROW_SALT

__all__ = ["mix32", "neg_gumbel", "row_keys"]

_C1 = tl.constexpr(C1)
_C2 = tl.constexpr(C2)
_SALT = tl.constexpr(ROW_SALT)


@triton.jit
def mix32(x):
    """lowbias32 on a uint32 tensor."""
    c1 = tl.full(x.shape, _C1, tl.uint32)
    c2 = tl.full(x.shape, _C2, tl.uint32)
    x = x ^ (x >> 16)
    x = x * c1
    x = x ^ (x >> 15)
    x = x * c2
    return x ^ (x >> 16)


@triton.jit
def row_keys(seed_lo_salted, seed_hi, rid, pos):
    """``(ka, kb)`` uint32 row keys from int64 tensors ``rid`` (request ids) and ``pos`` (positions) of one shape;
    ``seed_lo_salted = (seed & MASK32) ^ ROW_SALT`` and ``seed_hi = seed >> 32`` (scalars)."""
    k = mix32(tl.full(rid.shape, seed_lo_salted, tl.int64).to(tl.uint32))
    k = mix32(k ^ tl.full(rid.shape, seed_hi, tl.int64).to(tl.uint32))
    k = mix32(k ^ rid.to(tl.uint32))
    k = mix32(k ^ (rid >> 32).to(tl.uint32))
    k = mix32(k ^ pos.to(tl.uint32))
    ka = mix32(k ^ (pos >> 32).to(tl.uint32))
    kb = mix32(ka ^ tl.full(rid.shape, _SALT, tl.int64).to(tl.uint32))
    return ka, kb


@triton.jit
def neg_gumbel(ka, kb, cols):
    """``log(-log(u))``: minus the Gumbel noise of vocabulary ids ``cols`` (int32) under row keys ``ka, kb``
    (broadcastable to ``cols``); a draw's score is ``z - neg_gumbel(...)``."""
    h = mix32(mix32(ka ^ cols.to(tl.uint32)) ^ kb)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return tl.log(-tl.log(u))
