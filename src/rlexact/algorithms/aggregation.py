"""Packed-stream helpers and loss aggregation (pure torch, no Lightning).

The training batch is a packed token stream without padding: per-token tensors are 1-D of length ``T`` and
``cu_seqlens`` (int32/int64, shape ``[B + 1]``) holds the sequence boundaries, so sequence ``i`` owns tokens
``cu_seqlens[i]:cu_seqlens[i + 1]``. Per-sequence reductions go through :func:`segment_ids` + :func:`segment_sum`
(deterministic, float64 accumulation).

:func:`aggregate_loss` reduces an unreduced per-token loss ``[T]`` to the scalar that is back-propagated. Its modes
follow verl's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``), with ``loss_mask`` playing verl's ``response_mask``:

- ``token-mean``: ``sum_t m_t l_t / sum_t m_t`` (DAPO-style global token mean).
- ``seq-mean-token-sum``: mean over sequences of ``sum_t m_t l_t``.
- ``seq-mean-token-mean``: mean over sequences of ``sum_t m_t l_t / sum_t m_t`` (original GRPO).
- ``seq-mean-token-sum-norm``: mean over sequences of ``sum_t m_t l_t / norm_length`` where ``norm_length`` is a
  constant (the maximum response length), as in Dr. GRPO; verl's newest ``agg_loss`` divides by its
  ``loss_scale_factor`` the same way.

Deliberate differences from verl: the sequence means run over the sequences that have at least one unmasked token
(verl divides by every row of the micro-batch, so a fully rejected sequence still dilutes the loss), and the
normalizers are the local batch's; a caller that accumulates gradients over micro-batches or data-parallel ranks
must rescale to get verl's global normalization.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LossAggMode",
    "aggregate_loss",
    "require_1d",
    "require_aligned",
    "require_bool_mask",
    "require_finite",
    "segment_ids",
    "segment_sum",
]


def require_1d(name: str, tensor: Tensor, length: int | None = None) -> None:
    """Raise ``ValueError`` unless ``tensor`` is 1-D (and has ``length`` elements when given)."""
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if length is not None and tensor.shape[0] != length:
        raise ValueError(f"{name} has {tensor.shape[0]} elements, expected {length} (shape mismatch)")


def require_aligned(**tensors: Tensor) -> int:
    """Raise ``ValueError`` unless every tensor (given by name) is 1-D with the length of the first; return it."""
    length: int | None = None
    for name, tensor in tensors.items():
        require_1d(name, tensor, length)
        length = tensor.shape[0]
    assert length is not None
    return length


def require_bool_mask(name: str, mask: Tensor, length: int) -> None:
    """Raise ``ValueError`` unless ``mask`` is a 1-D bool tensor of ``length`` elements."""
    require_1d(name, mask, length)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be bool, got {mask.dtype}")


def require_finite(name: str, tensor: Tensor, mask: Tensor | None = None) -> None:
    """Raise ``ValueError`` naming the first index where ``tensor`` is NaN or +-inf (only where ``mask`` is True)."""
    bad = ~torch.isfinite(tensor)
    if mask is not None:
        bad &= mask
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{index}] = {tensor[index].item()} is not finite")


def segment_ids(cu_seqlens: Tensor, num_tokens: int | None = None) -> Tensor:
    """Sequence index of every token of a packed stream.

    Args:
        cu_seqlens: int32/int64 ``[B + 1]``, ``cu_seqlens[0] == 0``, non-decreasing (empty sequences allowed).
        num_tokens: ``T``; when given, ``cu_seqlens[-1]`` must equal it.

    Returns:
        int64 ``[T]`` on ``cu_seqlens.device`` with ``seg[t] = i`` for ``cu_seqlens[i] <= t < cu_seqlens[i + 1]``.
    """
    require_1d("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() == 0:
        raise ValueError("cu_seqlens must have at least one element (B + 1 with B >= 0)")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    checks = torch.stack([cu_seqlens[0].long(), cu_seqlens[-1].long(), (lengths < 0).any().long()])
    first, last, decreasing = checks.tolist()  # one host synchronization
    if first != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {first}")
    if decreasing:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    if num_tokens is not None and last != num_tokens:
        raise ValueError(f"cu_seqlens[-1] = {last} does not match the {num_tokens} tokens of the stream")
    arange = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(arange, lengths, output_size=last)


class _SegmentSum(torch.autograd.Function):
    """Deterministic segment sum: the gradient of ``out[i]`` reaches every token of segment ``i`` by a gather."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, seg: Tensor, num_segments: int) -> Tensor:
        ctx.save_for_backward(seg)
        num_tokens = values.shape[0]
        if num_tokens == 0 or num_segments == 0:
            return torch.zeros(num_segments, dtype=values.dtype, device=values.device)
        # a stable sort by segment: a fixed order (stream order within a segment) whatever the device
        sorted_seg, order = torch.sort(seg, stable=True)
        bounds = torch.searchsorted(sorted_seg, torch.arange(num_segments + 1, device=seg.device))
        width = int((bounds[1:] - bounds[:-1]).max())
        # each segment's tokens become one row of a zero-padded [S, width] float64 matrix, summed along the row
        col = torch.arange(num_tokens, device=seg.device) - bounds[sorted_seg]
        rows = torch.zeros(num_segments, width, dtype=torch.float64, device=values.device)
        rows[sorted_seg, col] = values[order].to(torch.float64)
        return rows.sum(dim=1).to(values.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (seg,) = ctx.saved_tensors
        return grad[seg], None, None


def segment_sum(values: Tensor, seg: Tensor, num_segments: int) -> Tensor:
    """Per-segment sums ``[num_segments]`` of per-token ``values [T]`` (differentiable; empty segments are 0).

    ``seg`` is int64 ``[T]`` with entries in ``[0, num_segments)``, in any order. Deterministic on every device: no
    atomics, each segment's terms are summed in a fixed order (stream order within the segment) in float64 and cast
    back to ``values``' dtype once, so a float32 result is within one float32 rounding of the exact sum. The
    backward is a gather (``grad[seg]``). Costs one host synchronization (the longest segment) and a zero-padded
    float64 buffer of ``num_segments x longest segment`` elements.
    """
    require_1d("values", values)
    require_1d("seg", seg, values.shape[0])
    if not values.is_floating_point():
        raise ValueError(f"segment_sum needs floating-point values, got {values.dtype} (cast with .float())")
    return _SegmentSum.apply(values, seg.long(), int(num_segments))


class LossAggMode(str, Enum):
    """How :func:`aggregate_loss` reduces per-token losses (verl's ``loss_agg_mode`` names)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"

    @classmethod
    def parse(cls, mode: LossAggMode | str) -> LossAggMode:
        """Return the member for ``mode`` or raise ``ValueError`` listing the valid names."""
        try:
            return cls(mode)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of: {valid}") from None


def aggregate_loss(
    token_loss: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    mode: LossAggMode | str,
    *,
    token_weights: Tensor | None = None,
    norm_length: int | None = None,
    seg: Tensor | None = None,
) -> Tensor:
    """Reduce an unreduced per-token loss to a scalar (see the module docstring for the formulas).

    Args:
        token_loss: floating ``[T]``, may require grad.
        loss_mask: bool ``[T]``; True = the token counts (a response token that was not rejected).
        cu_seqlens: int ``[B + 1]`` sequence boundaries of the packed stream.
        mode: a :class:`LossAggMode` or its string value.
        token_weights: optional floating ``[T]`` (e.g. detached TIS weights) multiplied into ``token_loss`` first.
        norm_length: the constant normalizer of ``seq-mean-token-sum-norm`` (the maximum response length);
            required by that mode and ignored by the others.
        seg: ``segment_ids(cu_seqlens, T)`` when the caller has it (it validated the stream); computed otherwise.

    Returns:
        0-dim tensor of ``token_loss``'s dtype. Unmasked tokens contribute exactly nothing (selected away with
        ``torch.where``, so NaN there cannot leak), sequences without unmasked tokens are left out of the sequence
        means, and when no token is unmasked the result is an exact 0 that keeps a ``grad_fn`` connected to
        ``token_loss`` (its gradient is zero). The only host synchronizations on the loss path are the
        ``cu_seqlens`` validation (without ``seg``) and :func:`segment_sum`'s longest segment (sequence modes).
    """
    mode = LossAggMode.parse(mode)
    require_1d("token_loss", token_loss)
    num_tokens = token_loss.shape[0]
    if not token_loss.is_floating_point():
        raise ValueError(f"token_loss must be floating point, got {token_loss.dtype}")
    require_bool_mask("loss_mask", loss_mask, num_tokens)
    if mode is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM and (norm_length is None or norm_length <= 0):
        raise ValueError(f"mode {mode.value!r} needs norm_length > 0 (the max response length), got {norm_length}")
    loss = token_loss
    if token_weights is not None:
        require_1d("token_weights", token_weights, num_tokens)
        loss = loss * token_weights
    masked = torch.where(loss_mask, loss, 0.0)
    if seg is None:
        seg = segment_ids(cu_seqlens, num_tokens)  # validates the stream in every mode
    elif seg.shape != (num_tokens,):
        raise ValueError(f"seg has shape {tuple(seg.shape)}, expected ({num_tokens},): segment_ids of this stream")
    if mode is LossAggMode.TOKEN_MEAN:
        return masked.sum() / loss_mask.sum().clamp(min=1)
    num_seqs = cu_seqlens.numel() - 1
    seq_sum = segment_sum(masked, seg, num_seqs)
    seq_count = segment_sum(loss_mask.to(masked.dtype), seg, num_seqs)
    if mode is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        per_seq = seq_sum / seq_count.clamp(min=1)
    elif mode is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        per_seq = seq_sum / norm_length
    else:
        per_seq = seq_sum
    return per_seq.sum() / (seq_count > 0).sum().clamp(min=1)
