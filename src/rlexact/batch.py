"""The packed RL batch that flows from the rollout through the callbacks into the loss."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch


@dataclass
class RolloutBatch:
    """A packed batch of ``B`` sampled sequences (prompt + response), ``T`` tokens in all, no padding.

    Per-token tensors are ``[T]`` and aligned with ``input_ids``; entry ``t`` of a log-prob tensor is
    ``log pi(x_t | x_<t)`` and is 0 on prompt tokens. Per-sequence tensors are ``[B]``.

    Attributes:
        input_ids: ``[T]`` int64 tokens.
        position_ids: ``[T]`` int64, restarting at 0 per sequence.
        cu_seqlens: ``[B+1]`` int32 boundaries.
        response_mask: ``[T]`` bool, True on generated tokens.
        rollout_logprobs: ``[T]`` fp32, pi_old^rollout as reported by the generator.
        old_logprobs: ``[T]`` fp32, pi_old used in the PPO ratio (set by the old-log-prob mode).
        advantages: ``[T]`` fp32, the sequence advantage broadcast to its response tokens (0 elsewhere).
        token_weights: ``[T]`` fp32 multiplying the per-token loss (importance weights; 1 by default). Detached.
        loss_mask: ``[T]`` bool, tokens that enter the loss (response tokens not rejected).
        rewards: ``[B]`` fp32.
        group_ids: ``[B]`` int64, the prompt each sample came from (GRPO groups).
        seq_advantages: ``[B]`` fp32, the per-sequence advantages.
        trainer_logprobs: ``[T]`` fp32 pi_old^train recomputed by the trainer at the rollout weights, when the mode
            or a callback needs it (``None`` otherwise).
        ref_logprobs: ``[T]`` fp32 log-probs of the frozen reference model when a KL penalty is used.
        metrics: scalars that stages and callbacks want logged for this rollout step.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor
    loss_mask: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    seq_advantages: torch.Tensor
    trainer_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.input_ids.numel()
        for name in (
            "position_ids",
            "response_mask",
            "rollout_logprobs",
            "old_logprobs",
            "advantages",
            "token_weights",
            "loss_mask",
        ):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected ({t},)")
        b = self.cu_seqlens.numel() - 1
        for name in ("rewards", "group_ids", "seq_advantages"):
            if getattr(self, name).shape != (b,):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected ({b},)")

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def seq_ids(self) -> torch.Tensor:
        """``[T]`` int64: the sequence index of every token."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=lengths.device), lengths)

    def select(self, seq_indices: torch.Tensor | Sequence[int]) -> RolloutBatch:
        """A new packed batch holding the given sequences, in the given order (mini-batching)."""
        return self.split([seq_indices])[0]

    def split(self, groups: Sequence[torch.Tensor | Sequence[int]]) -> list[RolloutBatch]:
        """``[self.select(g) for g in groups]`` with one host synchronization for all of them.

        The sequence boundaries are read to the host once; each group's gather indices are computed there and sent
        to the device from pinned memory without waiting for the stream, so splitting a mini-batch into micro-batches
        does not drain the GPU's queue once per micro-batch. Indices outside ``[0, num_seqs)`` raise ``IndexError``."""
        cu = self.cu_seqlens.cpu().numpy().astype(np.int64)  # the one host synchronization
        device = self.cu_seqlens.device
        out = []
        for group in groups:
            idx = np.asarray(group.cpu() if isinstance(group, torch.Tensor) else group, dtype=np.int64).reshape(-1)
            if idx.size and (idx.min() < 0 or idx.max() >= self.num_seqs):
                raise IndexError(
                    f"RolloutBatch.split: sequence indices must lie in [0, {self.num_seqs}); "
                    f"got min {idx.min()}, max {idx.max()}"
                )
            starts = cu[idx]
            lengths = cu[idx + 1] - starts
            new_cu = np.zeros(idx.size + 1, dtype=np.int64)
            np.cumsum(lengths, out=new_cu[1:])
            # token j of selected sequence i sits at starts[i] + j; as a flat index: (starts - new starts) + arange
            token_idx = np.repeat(starts - new_cu[:-1], lengths) + np.arange(new_cu[-1])
            flat = _to_device(np.concatenate([idx, new_cu, token_idx]), device)
            seq_idx, cu_new, tok = flat.split([idx.size, idx.size + 1, token_idx.size])
            updates: dict[str, object] = {"cu_seqlens": cu_new.to(torch.int32), "metrics": {}}
            for f in fields(self):
                v = getattr(self, f.name)
                if f.name in updates or not isinstance(v, torch.Tensor):
                    continue
                updates[f.name] = v[seq_idx] if f.name in _PER_SEQ else v[tok]
            out.append(replace(self, **updates))  # type: ignore[arg-type]
        return out

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


_PER_SEQ = frozenset({"rewards", "group_ids", "seq_advantages"})


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as an int64 tensor on ``device``; to a CUDA device from pinned memory, ordered on the current stream
    without the host waiting for it."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
