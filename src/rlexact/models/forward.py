"""The single model entry point shared by the generator and the trainer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlexact import ops
from rlexact.models.metadata import AttnMetadata
from rlexact.models.state import get_state
from rlexact.models.text import decoder, text_config
from rlexact.models.truncation import truncated_logprobs, truncates


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The ``[V, H]`` output-projection weight (tied or not)."""
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("expected a bias-free lm_head on the causal LM")
    return head.weight


def forward_hidden(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttnMetadata
) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of a packed token stream.

    ``input_ids [T]`` and ``position_ids [T]`` (absolute positions, int64); ``meta`` describes the packing and, for
    the generator, the paged KV cache. The model must be exactified (it may be in ``"native"`` kernel mode).
    """
    if get_state(model) is None:
        raise ValueError("forward_hidden needs an exactified model: call rlexact.exactify(model) first")
    if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} must be [T]")
    # an empty 4-D mask: transformers passes a prepared mask through unchanged instead of deriving one from the
    # positions (a packed-sequence scan with a host synchronization); the packed kernels mask by ``meta`` alone
    no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=input_ids.device)
    out = decoder(model)(
        input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=no_mask, use_cache=False,
        rlexact_meta=meta,
    )  # fmt: skip
    return out.last_hidden_state[0]


def logits_scale(model: nn.Module) -> float:
    """The divisor the model applies to its logits before the softmax (Granite's ``config.logits_scaling``; 1 for
    the others). The head folds it into the temperature: every path computes ``z / (temperature * scale)``."""
    return float(getattr(text_config(model), "logits_scaling", 1.0) or 1.0)


def head_logprobs(
    model: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one log-prob function: ``(logp [T], entropy [T])`` fp32 of ``targets`` given final hidden states.

    Full distribution (``top_k=0, top_p=1``): exact mode runs the fused kernel; native mode the stock ``lm_head`` in
    the model dtype, then fp32 log-softmax (what transformers-based trainers and inference engines do). With
    ``top_k > 0`` or ``top_p < 1``: log-probs and entropy of the truncated, renormalized distribution the sampler
    draws from (:func:`rlexact.models.truncation.truncated_logprobs` over :func:`head_logits`), bitwise equal to the
    generator's ``logprobs="sampled"`` in exact mode. ``check_targets=False``: the caller has checked that every
    target lies in the head's vocabulary (the exact kernel then skips its own check's host synchronization).
    ``temperature`` is the sampling temperature; the model's :func:`logits_scale` multiplies it.
    """
    temperature = temperature * logits_scale(model)
    w = lm_head_weight(model)
    if truncates(w.shape[0], top_k, top_p):
        return truncated_logprobs(
            hidden, w, targets, temperature, top_k, top_p, lambda h: _scaled_logits(model, h, temperature)
        )
    if _exact(model):
        return ops.token_logprobs(hidden, w, targets, temperature, check_targets=check_targets)
    z = _native_logits(hidden, w, temperature)
    logp_all = torch.log_softmax(z, dim=-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), ent


@torch.no_grad()
def head_logits(model: nn.Module, hidden: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits ``[B, V]`` and logsumexp ``[B]`` fp32 for sampling, consistent bitwise with
    :func:`head_logprobs` (``z[i, t] - lse[i]`` is the log-prob of ``t``) in exact mode; :func:`logits_scale`
    multiplies ``temperature``."""
    return _scaled_logits(model, hidden, temperature * logits_scale(model))


@torch.no_grad()
def _scaled_logits(model: nn.Module, hidden: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_logits` at an effective ``temperature`` (the logits scale already folded in)."""
    w = lm_head_weight(model)
    if _exact(model):
        return ops.lm_head_logits(hidden, w, temperature)
    z = _native_logits(hidden, w, temperature)
    return z, torch.logsumexp(z, dim=-1)


def _exact(model: nn.Module) -> bool:
    """The head uses the exact kernels unless the model is exactified and in ``"native"`` mode."""
    state = get_state(model)
    return state is None or state.exact


def _native_logits(hidden: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """Native-mode scaled logits: stock ``lm_head`` in the model dtype, then fp32 division by the temperature."""
    return F.linear(hidden, w).float() / temperature
