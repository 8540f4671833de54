"""Trainer-side log-probabilities: one packed forward, no padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlexact.checks import not_text
from rlexact.models import AttnMetadata, forward_hidden, head_logprobs, lm_head_weight, uncompiled


@dataclass
class Packed:
    """A packed token stream.

    Attributes:
        input_ids: ``[T]`` int64, all sequences concatenated.
        position_ids: ``[T]`` int64, restarting at 0 for every sequence.
        cu_seqlens: ``[B+1]`` int32 sequence boundaries.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def _token_ids(seq: Sequence[int] | torch.Tensor, i: int) -> torch.Tensor:
    """Sequence ``i``'s token ids as a flat ``long`` tensor; text, empty sequences and non-integer values raise."""
    not_text(f"pack: sequence {i}", seq)
    ids = torch.as_tensor(seq).reshape(-1)
    if ids.numel() == 0:
        raise ValueError(f"pack: sequence {i} is empty")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"pack: sequence {i} must hold integer token ids, got dtype {ids.dtype}")
    return ids.long()


def pack(sequences: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str = "cpu") -> Packed:
    """Concatenate token sequences into a :class:`Packed` stream. Empty sequences, text and non-integer values are
    rejected."""
    if len(sequences) == 0:
        raise ValueError("pack: no sequences")
    tensors = [_token_ids(s, i) for i, s in enumerate(sequences)]
    lengths = [t.numel() for t in tensors]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return Packed(torch.cat(tensors).to(device), pos.to(device), cu.to(device))


def shifted_targets(packed: Packed, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, targets)``: rows ``[T-B]`` index the hidden state predicting ``targets [T-B]`` (each sequence's
    tokens 1..L-1), in sequence order; with a bool ``mask [T]``, only the targets where it is True."""
    ids = packed.input_ids
    last = packed.cu_seqlens[1:].long() - 1
    keep = torch.ones(ids.numel(), dtype=torch.bool, device=ids.device).index_fill_(0, last, False)
    if mask is not None:
        keep[:-1] &= mask[1:].to(keep.device)
    rows = torch.nonzero(keep).squeeze(-1)
    return rows, ids[rows + 1]


def packed_logprobs(
    model: nn.Module,
    packed: Packed,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``[T]`` fp32 aligned with ``packed.input_ids``: entry ``t`` is ``log p(x_t | x_<t)``;
    the first token of each sequence gets 0. Differentiable when grad is enabled.

    ``mask``: bool ``[T]``; when given, only the entries where it is True are computed (the head runs on those rows
    only) and the others are 0. Each computed entry is bitwise the one the full call gives (the head is row-invariant).

    ``top_k > 0`` or ``top_p < 1``: log-probs (and entropies) under the truncated, renormalized distribution that
    the generator samples from — what it reports with ``SamplingParams(logprobs="sampled")``, bitwise in exact mode.
    """
    _check_vocab(model, packed.input_ids)
    if mask is not None and (mask.shape != packed.input_ids.shape or mask.dtype != torch.bool):
        raise ValueError(
            f"packed_logprobs: mask must be bool {tuple(packed.input_ids.shape)}, got {mask.dtype} {tuple(mask.shape)}"
        )
    rows, targets = shifted_targets(packed, mask)  # host synchronizations before the forward is queued
    hidden = forward_hidden(model, packed.input_ids, packed.position_ids, AttnMetadata(packed.cu_seqlens))
    logp_rows, ent_rows = head_logprobs(
        model, hidden[rows], targets, temperature, top_k=top_k, top_p=top_p, check_targets=False
    )  # the targets are input ids, checked by _check_vocab against the head's vocabulary too
    logp = torch.zeros(packed.input_ids.numel(), dtype=torch.float32, device=hidden.device)
    logp = logp.index_put((rows + 1,), logp_rows)
    ent = None
    if with_entropy:
        ent = torch.zeros_like(logp).index_put((rows + 1,), ent_rows)
    return logp, ent


def _check_vocab(model: nn.Module, ids: torch.Tensor) -> None:
    """Every id lies in both the embedding's and the lm head's vocabulary (the ids are also the head's targets)."""
    vocab = min(model.get_input_embeddings().num_embeddings, lm_head_weight(model).shape[0])
    if not ids.numel():
        return
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one host synchronization
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}); got min {lo}, max {hi}")


def sequence_logprobs(
    model: nn.Module,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[torch.Tensor]:
    """Trainer-path log-probs of each sequence's tokens 1..L-1: a list of ``[L-1]`` fp32 tensors.

    One packed forward over all sequences (no padding). For a completion produced by
    :class:`rlexact.rollout.Generator` on the same weights in exact mode, the last ``len(completion.token_ids)``
    entries equal ``completion.logprobs`` bitwise: with the default ``top_k=0, top_p=1`` for ``logprobs="full"``
    completions, with the sampling ``top_k, top_p`` for ``logprobs="sampled"`` ones. A ``torch.compile`` wrapper is
    replaced by the module it wraps (:func:`rlexact.models.uncompiled`).
    """
    model = uncompiled(model)
    device = next(model.parameters()).device
    packed = pack(sequences, device)
    logp, _ = packed_logprobs(model, packed, temperature, top_k=top_k, top_p=top_p)
    cu = packed.cu_seqlens.tolist()
    return [logp[s + 1 : e] for s, e in zip(cu[:-1], cu[1:])]
