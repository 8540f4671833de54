"""Small pure helpers the callbacks need that :mod:`rlexact.callbacks.functional` does not provide.

- :func:`first_bitwise_mismatch` -- where two log-prob streams first differ bit for bit (ExactnessGuard).
- :func:`keyed_normal` and :func:`perturb_logprobs` -- the synthetic training-inference mismatch of
  :class:`~rlexact.callbacks.injection.MismatchInjection`.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch
from torch import Tensor

from rlexact.callbacks.functional import BIT_VIEWS

__all__ = ["InjectionTarget", "first_bitwise_mismatch", "keyed_normal", "keyed_seed", "perturb_logprobs"]

InjectionTarget = Literal["logprobs", "logits"]


def first_bitwise_mismatch(a: Tensor, b: Tensor, mask: Tensor) -> tuple[int, int | None]:
    """``(count, first)``: how many masked positions of ``a`` and ``b`` differ in their bit patterns, and the index of
    the first one (``None`` when none does). ``a``/``b`` are 1-D floating tensors of one dtype, ``mask`` bool.

    Bit patterns, not values: ``-0.0`` differs from ``0.0`` and two NaNs with the same payload are equal, i.e.
    exactly the ``torch.equal``-or-stricter contract of docs/design.md §1.
    """
    if a.shape != b.shape or a.shape != mask.shape or a.dim() != 1:
        raise ValueError(f"shapes must be equal and 1-D: {tuple(a.shape)}, {tuple(b.shape)}, {tuple(mask.shape)}")
    if a.dtype != b.dtype or a.dtype not in BIT_VIEWS:
        raise ValueError(f"need two floating tensors of one dtype, got {a.dtype} and {b.dtype}")
    view = BIT_VIEWS[a.dtype]
    differ = mask & (a.detach().contiguous().view(view) != b.detach().contiguous().view(view))
    count = int(differ.sum())
    if count == 0:
        return 0, None
    return count, int(differ.nonzero()[0, 0])


def keyed_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (stable across processes, Python versions and platforms)."""
    digest = hashlib.sha256(",".join(str(int(k)) for k in keys).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def keyed_normal(num: int, *keys: int) -> Tensor:
    """``[num]`` float64 standard-normal draws on CPU that depend only on ``keys`` (a private generator; the global
    RNG is untouched)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(keyed_seed(*keys))
    return torch.randn(num, generator=gen, dtype=torch.float64)


def perturb_logprobs(logp: Tensor, noise: Tensor, mask: Tensor, target: InjectionTarget) -> Tensor:
    """Synthetic mismatch: a new ``[T]`` tensor (``logp``'s dtype) equal to ``logp`` off ``mask`` and perturbed on it.

    ``noise`` is ``[T]`` (already scaled; float64 recommended). The result is always a valid log-probability
    (``<= 0``); ``noise == 0`` returns the input values bit for bit.

    - ``"logprobs"``: ``min(logp + noise, 0)`` -- additive noise on the reported log-prob, a direct model of an
      engine whose log-prob of the sampled token is off by a random amount.
    - ``"logits"``: noise on the logit of the sampled token *relative to the rest of the vocabulary*. With
      ``p = exp(logp)`` the log-odds ``l = log p - log(1 - p)`` becomes ``l + noise`` and the new log-prob is
      ``logsigmoid(l + noise)``. This is the sampled-token marginal of adding noise to one logit (or of a
      difference of logit errors), computable from the log-prob alone: confident tokens (``p -> 1``) barely move,
      uncertain ones move by about ``noise`` -- the shape of real kernel mismatch, which concentrates on
      low-probability tokens. ``p == 1`` stays 1 and ``p == 0`` stays 0.
    """
    if logp.shape != noise.shape or logp.shape != mask.shape or logp.dim() != 1:
        raise ValueError(
            f"shapes must be equal and 1-D: {tuple(logp.shape)}, {tuple(noise.shape)}, {tuple(mask.shape)}"
        )
    x = logp.detach().double()
    eps = noise.to(device=x.device, dtype=torch.float64)
    if target == "logprobs":
        new = (x + eps).clamp(max=0.0)
    elif target == "logits":
        log_odds = x - torch.log(-torch.expm1(x))  # log p - log(1 - p); +inf at p == 1, -inf at p == 0
        new = torch.nn.functional.logsigmoid(log_odds + eps)
    else:
        raise ValueError(f"target must be 'logprobs' or 'logits', got {target!r}")
    changed = mask & (eps != 0)
    return torch.where(changed, new.to(logp.dtype), logp.detach())
