"""Keyed sampling: the draw for a token depends only on ``(seed, request id, absolute position)``.

Gumbel-max with counter-based noise. For the row that samples position ``p`` of request ``r`` under seed ``s``, the
noise of vocabulary entry ``v`` is ``g = -log(-log(u))`` with ``u = ((h >> 9) + 0.5) * 2**-23`` and
``h = H(s, r, p, v)``, a 32-bit integer hash (lowbias32 rounds, :mod:`rlexact.ops.keyed_hash`) computed with
int64 torch ops masked to 32 bits — every intermediate stays below ``2**49``, so there is no signed-overflow
ambiguity. The sampled token is ``argmax(z + g)`` over the allowed tokens (first index on ties), ``z`` the
temperature-scaled logits. No global RNG and no batch-shaped noise: a request samples the same tokens alone or in a
batch of 500, and again after preemption and recompute.

Order: temperature (already in ``z``, from :func:`rlexact.models.head_logits`) -> top-k -> top-p -> draw; the
truncation (:func:`rlexact.models.truncation.top_k_top_p_threshold`, row-invariant) restricts the draw. The reported
log-prob is ``z[t] - lse`` under the full tempered softmax with ``logprobs="full"``, or ``z[t] - lse_K`` under the
truncated, renormalized distribution actually sampled with ``logprobs="sampled"``
(:func:`rlexact.models.truncation.kept_logsumexp`, the function the trainer uses too). Greedy (temperature 0) is
``argmax(z)`` with ``z`` at temperature 1 and its log-prob at temperature 1 (full softmax).

On CUDA the noise + argmax runs as fused Triton kernels (:mod:`rlexact.ops.triton_sampler`: vocabulary slices
in parallel, then a merge that also reads the token's log-prob) that never materialize ``[B, V]`` noise; they use the
same integer hash and the same noise up to rounding (a series near ``u = 1`` and the GPU's approximate base-2
logarithms elsewhere, so the noise differs from torch's by a few ulp, and a token can differ between the two
implementations on rare near-ties; within one device and implementation the draw is deterministic and
batch-invariant). ``RLEXACT_SAMPLER=torch`` forces the torch path.
"""

from __future__ import annotations

import os

import torch

from rlexact.models.truncation import LogprobMode, kept_logsumexp, top_k_top_p_threshold
from rlexact.ops.keyed_hash import row_keys, token_hash

__all__ = ["gumbel_argmax", "gumbel_from_hash", "gumbel_noise", "sample"]


def gumbel_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise fp32 from 32-bit hashes: ``-log(-log(u))``, ``u = ((h >> 9) + 0.5) * 2**-23``."""
    u = ((h >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(u))


def gumbel_noise(seed: int, request_ids: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Keyed Gumbel noise ``[B, V]`` fp32 (torch implementation)."""
    ka, kb = row_keys(seed, request_ids, positions)
    return gumbel_from_hash(token_hash(ka, kb, vocab))


def _gumbel_argmax_torch(
    z: torch.Tensor, threshold: torch.Tensor | None, seed: int, request_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    scores = z + gumbel_noise(seed, request_ids, positions, z.shape[-1])
    if threshold is not None:
        scores = scores.masked_fill(z < threshold, float("-inf"))
    return scores.argmax(-1)


def _use_triton(z: torch.Tensor) -> bool:
    mode = os.environ.get("RLEXACT_SAMPLER", "")
    if mode == "torch" or (not z.is_cuda and mode != "triton"):
        return False
    from rlexact.ops.backend import triton_available

    return triton_available()


def _draw(
    z: torch.Tensor,
    threshold: torch.Tensor | None,
    seed: int,
    request_ids: torch.Tensor,
    positions: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(tokens, z[tokens] - lse)`` from the fused Triton sampler, or ``(tokens, None)`` where the torch path runs or
    ``lse`` is None (the caller gathers the log-prob then)."""
    if _use_triton(z):
        from rlexact.ops.triton_sampler import gumbel_argmax_triton

        return gumbel_argmax_triton(z, threshold, seed, request_ids, positions, lse)
    return _gumbel_argmax_torch(z, threshold, seed, request_ids, positions), None


def gumbel_argmax(
    z: torch.Tensor, threshold: torch.Tensor | None, seed: int, request_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``argmax(z + keyed Gumbel noise)`` over ``z >= threshold`` per row -> int64 ``[B]``. Host-sync free."""
    return _draw(z, threshold, seed, request_ids, positions)[0]


def sample(
    z: torch.Tensor,
    lse: torch.Tensor,
    *,
    greedy: bool,
    top_k: int,
    top_p: float,
    seed: int,
    request_ids: torch.Tensor,
    positions: torch.Tensor,
    logprobs: LogprobMode = "full",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and report its log-prob.

    Args:
        z: ``[B, V]`` fp32 temperature-scaled logits (temperature 1 when greedy), from ``head_logits``.
        lse: ``[B]`` fp32 ``logsumexp(z)`` from the same call.
        greedy: argmax instead of a draw (top-k/top-p are irrelevant then).
        top_k, top_p: truncation of the draw (0 / 1.0 disable).
        seed: base seed.
        request_ids: ``[B]`` int64 request ids.
        positions: ``[B]`` int64 absolute position of the token being sampled.
        logprobs: ``"full"`` reports ``z[tokens] - lse`` (full tempered softmax); ``"sampled"`` reports
            ``z[tokens] - lse_K`` under the truncated, renormalized distribution of the draw (the same as ``"full"``
            when nothing is truncated, and for greedy).

    Returns:
        ``(tokens [B] int64, logprobs [B] fp32)``. Contains no host synchronization (CUDA-graph capturable).
    """
    threshold = None
    if greedy:
        tokens = z.argmax(-1)
    else:
        threshold = top_k_top_p_threshold(z, top_k, top_p)
        full = logprobs == "full" or threshold is None  # the reported log-prob is z[t] - lse
        tokens, logp = _draw(z, threshold, seed, request_ids, positions, lse if full else None)
        if logp is not None:
            return tokens, logp
    picked = z.gather(-1, tokens[:, None]).squeeze(-1)
    if logprobs == "sampled" and threshold is not None:
        return tokens, picked - kept_logsumexp(z, threshold)
    return tokens, picked - lse
