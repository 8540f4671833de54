"""The integer hashes behind rlexact's randomness: the keyed sampler's per-token hash and the seed / request-key
mixer. Pure integer arithmetic, identical on every device, in torch (here) and in the fused Triton sampler
(:mod:`rlexact.ops.triton_sampler`, which uses the constants below).

* :func:`request_key` is the one seed mixer: splitmix64 steps over integers. The generator derives a sample's
  request id from it, the trainer derives the step seed of the sampler and of the mini-batch shuffle from it.
* :func:`mix32` (lowbias32), :func:`row_keys` and :func:`token_hash` give the 32-bit hash ``H(seed, request id,
  position, vocabulary id)`` from which the sampler draws its Gumbel noise.
"""

from __future__ import annotations

import torch

__all__ = ["C1", "C2", "MASK32", "ROW_SALT", "mix32", "request_key", "row_keys", "token_hash"]

MASK32 = 0xFFFFFFFF
"""32-bit mask of the hash arithmetic (held in int64)."""
C1 = 0x7FEB352D
"""First lowbias32 multiplier."""
C2 = 0x846CA68B
"""Second lowbias32 multiplier."""
ROW_SALT = 0x9E3779B9
"""Salt of the first and last row-key rounds."""


def request_key(*parts: int) -> int:
    """A request id in ``[0, 2**63)`` from integers (splitmix64 steps over ``parts``, each taken modulo ``2**64``).

    :meth:`rlexact.rollout.Generator.generate` gives sample ``j`` of a prompt with key ``key`` the request id
    ``request_key(key, j)``, so a sample's draw depends on ``(seed, key, j, position)`` and not on where the prompt sits
    in the call."""
    mask = (1 << 64) - 1
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = ((x ^ (int(p) & mask)) + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        x ^= x >> 31
    return x >> 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow (16-bit split of ``c``)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 permutation of 32-bit values held in int64 (``[0, 2**32)`` in, ``[0, 2**32)`` out)."""
    x = x ^ (x >> 16)
    x = _mul32(x, C1)
    x = x ^ (x >> 15)
    x = _mul32(x, C2)
    return x ^ (x >> 16)


def row_keys(seed: int, request_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys ``(ka, kb)`` per row from ``(seed, request id, absolute position)``; int64 ``[B]`` each.

    ``request_ids`` and ``positions`` are int64 ``[B]`` (non-negative, below ``2**63``); ``seed`` a Python int.
    """
    seed &= (1 << 64) - 1
    s_lo, s_hi = seed & MASK32, seed >> 32
    rid = request_ids.long()
    pos = positions.long()
    k = mix32(torch.full_like(rid, s_lo ^ ROW_SALT))
    k = mix32(k ^ s_hi)
    k = mix32(k ^ (rid & MASK32))
    k = mix32(k ^ ((rid >> 32) & MASK32))
    k = mix32(k ^ (pos & MASK32))
    ka = mix32(k ^ ((pos >> 32) & MASK32))
    kb = mix32(ka ^ ROW_SALT)
    return ka, kb


def token_hash(ka: torch.Tensor, kb: torch.Tensor, vocab: int) -> torch.Tensor:
    """``h [B, V]`` int64 in ``[0, 2**32)``: ``mix32(mix32(ka ^ v) ^ kb)`` for every vocabulary id ``v``."""
    v = torch.arange(vocab, device=ka.device, dtype=torch.int64)
    return mix32(mix32(ka[:, None] ^ v[None, :]) ^ kb[:, None])
