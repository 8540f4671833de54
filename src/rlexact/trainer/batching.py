"""Batch stage: pack completions into a :class:`rlexact.batch.RolloutBatch`, split it into chunks, and score it with
the trainer's packed forward."""

from __future__ import annotations

import torch
from torch import nn

from rlexact import algorithms as alg
from rlexact.batch import RolloutBatch
from rlexact.distributed import fsdp_call, gathered_params
from rlexact.logprobs import Packed, pack, packed_logprobs
from rlexact.rollout import Completion

__all__ = ["batch_logprobs", "build_rollout_batch", "chunks", "score_chunks", "seq_valid"]


def build_rollout_batch(
    completions: list[Completion],
    rewards: torch.Tensor,
    seq_adv: torch.Tensor,
    group_ids: torch.Tensor,
    device: torch.device | str,
) -> RolloutBatch:
    """Pack prompt+response sequences on ``device``: response tokens carry the rollout log-probs (also the initial
    ``old_logprobs``) and their sequence's advantage; token weights are 1 and the loss mask is the response mask."""
    packed = pack([c.prompt_token_ids + c.token_ids for c in completions], device)
    t = packed.input_ids.numel()
    response_mask = torch.zeros(t, dtype=torch.bool)
    rollout_lp = torch.zeros(t, dtype=torch.float32)
    starts = packed.cu_seqlens[:-1].tolist()
    for c, s in zip(completions, starts):
        lo, m = s + len(c.prompt_token_ids), len(c.token_ids)
        if m:
            lp = torch.as_tensor(c.logprobs, dtype=torch.float32).reshape(-1)
            if lp.numel() != m:
                raise RuntimeError(f"completion has {m} tokens but {lp.numel()} log-probs")
            response_mask[lo : lo + m] = True
            rollout_lp[lo : lo + m] = lp.cpu()
    response_mask = response_mask.to(device)
    rollout_lp = rollout_lp.to(device)
    adv_tok = torch.where(response_mask, alg.broadcast_to_tokens(seq_adv.to(device), packed.cu_seqlens), 0.0)
    return RolloutBatch(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        cu_seqlens=packed.cu_seqlens,
        response_mask=response_mask,
        rollout_logprobs=rollout_lp,
        old_logprobs=rollout_lp.clone(),
        advantages=adv_tok.float(),
        token_weights=torch.ones(t, dtype=torch.float32, device=device),
        loss_mask=response_mask.clone(),
        rewards=rewards.to(device, torch.float32),
        group_ids=group_ids.to(device),
        seq_advantages=seq_adv.to(device, torch.float32),
    )


def chunks(num_seqs: int, size: int | None) -> list[list[int]]:
    """Consecutive index chunks of at most ``size`` sequences covering ``range(num_seqs)`` (one chunk for None)."""
    size = size or num_seqs
    return [list(range(i, min(i + size, num_seqs))) for i in range(0, num_seqs, size)]


def seq_valid(batch: RolloutBatch) -> torch.Tensor:
    """Bool ``[N]``: the sequences with at least one token in the loss."""
    counts = alg.segment_sum(batch.loss_mask.float(), batch.seq_ids, batch.num_seqs)
    return counts > 0


def batch_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    temperature: float,
    *,
    with_entropy: bool,
    truncation: tuple[int, float] = (0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Trainer log-probs ``[T]`` (and entropies when asked) of ``batch``'s response tokens under ``model``: one packed
    forward, the head on the response rows only; prompt entries are 0. ``truncation``: ``(top_k, top_p)`` of the
    distribution the log-probs describe (``(0, 1.0)``: the full one)."""
    packed = Packed(batch.input_ids, batch.position_ids, batch.cu_seqlens)
    top_k, top_p = truncation
    return packed_logprobs(
        model, packed, temperature, with_entropy=with_entropy, top_k=top_k, top_p=top_p, mask=batch.response_mask
    )


@torch.no_grad()
def score_chunks(
    batch: RolloutBatch,
    model: nn.Module,
    index_chunks: list[list[int]],
    temperature: float,
    truncation: tuple[int, float] = (0, 1.0),
) -> torch.Tensor:
    """Detached log-probs ``[T]`` of ``batch``'s response tokens under ``model`` (prompt entries 0), one packed
    forward per chunk of sequence indices (consecutive, covering the batch); every parameter gathered once under
    FSDP."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
    start = 0
    with gathered_params(model):
        for sub in batch.split(index_chunks):  # consecutive chunks: each starts where the previous one ended
            lp = fsdp_call(
                model,
                lambda sub=sub: batch_logprobs(model, sub, temperature, with_entropy=False, truncation=truncation)[0],
            )
            out[start : start + sub.num_tokens] = lp
            start += sub.num_tokens
    return out
