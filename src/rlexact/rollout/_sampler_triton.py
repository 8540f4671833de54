"""Fused keyed Gumbel-argmax in Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``).

One program per row derives the row keys (the integer function of :func:`rlexact.rollout.keyed_hash.row_keys`), then
streams the ``V`` logits once: 32-bit hash (uint32 arithmetic, the same integer function as
:func:`rlexact.rollout.keyed_hash.token_hash`), Gumbel noise, optional threshold mask, running argmax with first-index
tie-breaking. One launch per sampling step, no ``[B, V]`` temporaries, no host synchronization, grid ``(B,)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlexact.ops.triton_pdl import pdl_entry, pdl_options
from rlexact.rollout.keyed_hash import C1, C2, MASK32, ROW_SALT

_BLOCK_V = 2048


@triton.jit
def _mix32(x, c1, c2):
    """lowbias32 on uint32 tensors (``c1, c2``: the multipliers as uint32 tensors broadcastable to ``x``)."""
    x = x ^ (x >> 16)
    x = x * c1
    x = x ^ (x >> 15)
    x = x * c2
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    z_ptr,
    thr_ptr,
    rid_ptr,
    pos_ptr,
    out_ptr,
    seed_lo_salted,
    seed_hi,
    V,
    stride_z,
    HAS_THR: tl.constexpr,
    BLOCK_V: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    SALT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    row = tl.program_id(0)
    one = tl.arange(0, 1)
    k1 = tl.full([1], C1, tl.uint32)
    k2 = tl.full([1], C2, tl.uint32)
    rid = tl.load(rid_ptr + row + one)
    pos = tl.load(pos_ptr + row + one)
    k = _mix32(tl.full([1], seed_lo_salted, tl.int64).to(tl.uint32), k1, k2)
    k = _mix32(k ^ tl.full([1], seed_hi, tl.int64).to(tl.uint32), k1, k2)
    k = _mix32(k ^ rid.to(tl.uint32), k1, k2)
    k = _mix32(k ^ (rid >> 32).to(tl.uint32), k1, k2)
    k = _mix32(k ^ pos.to(tl.uint32), k1, k2)
    ka = _mix32(k ^ (pos >> 32).to(tl.uint32), k1, k2)
    kb = _mix32(ka ^ tl.full([1], SALT, tl.int64).to(tl.uint32), k1, k2)
    c1 = tl.full([BLOCK_V], C1, tl.uint32)
    c2 = tl.full([BLOCK_V], C2, tl.uint32)
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], dtype=tl.int32)
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    base = z_ptr + row.to(tl.int64) * stride_z
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        z = tl.load(base + offs, mask=mask, other=float("-inf"))
        h = _mix32(_mix32(ka ^ offs.to(tl.uint32), c1, c2) ^ kb, c1, c2)
        u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        s = z - tl.log(-tl.log(u))
        if HAS_THR:
            s = tl.where(z >= thr, s, float("-inf"))
        s = tl.where(mask, s, float("-inf"))
        upd = s > best_val
        best_val = tl.where(upd, s, best_val)
        best_idx = tl.where(upd, offs, best_idx)
    m = tl.max(best_val, 0)
    idx = tl.min(tl.where(best_val == m, best_idx, V), 0)
    idx = tl.minimum(idx, V - 1)
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_argmax_triton(
    z: torch.Tensor, threshold: torch.Tensor | None, seed: int, request_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``argmax(z + keyed noise)`` over ``z >= threshold``: ``z [B, V]`` fp32, ``request_ids, positions`` int64
    ``[B]`` (non-negative), ``seed`` a Python int -> int64 ``[B]``."""
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(-1) != 1:
        raise ValueError(f"gumbel_argmax_triton: z must be a row-major fp32 [B, V] tensor, got {z.dtype} {z.shape}")
    b, v = z.shape
    out = torch.empty(b, dtype=torch.int64, device=z.device)
    if b == 0:
        return out
    thr = threshold.reshape(b).contiguous().float() if threshold is not None else z
    seed &= (1 << 64) - 1
    _gumbel_argmax_kernel[(b,)](
        z,
        thr,
        request_ids.long().contiguous(),
        positions.long().contiguous(),
        out,
        (seed & MASK32) ^ ROW_SALT,
        seed >> 32,
        v,
        z.stride(0),
        HAS_THR=threshold is not None,
        BLOCK_V=_BLOCK_V,
        C1=C1,
        C2=C2,
        SALT=ROW_SALT,
        num_warps=8,
        **pdl_options(z.device),
    )
    return out
