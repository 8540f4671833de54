"""Rollout glue of the trainer: prompt validation, per-step sampling parameters and seeds, and the generate call
on the policy's own parameters (no weight copy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from rlexact.config import RolloutConfig
from rlexact.distributed import fsdp_call, gathered_params
from rlexact.ops.keyed_hash import request_key
from rlexact.rollout import Completion, Generator, SamplingParams, eos_token_ids
from rlexact.trainer.data_checks import check_prompt_lengths

__all__ = [
    "ENGINE_COUNTERS",
    "check_prompts",
    "engine_counters",
    "generate_completions",
    "make_generator",
    "prompt_keys",
    "sampling_params",
    "stop_token_ids",
]


def stop_token_ids(cfg: RolloutConfig, model: nn.Module, tokenizer: Any) -> list[int] | None:
    """``cfg.stop_token_ids`` when set, else the EOS ids of :func:`rlexact.rollout.eos_token_ids` (model configs and
    tokenizer), sorted; None when there is none."""
    if cfg.stop_token_ids is not None:
        return list(cfg.stop_token_ids)
    return sorted(eos_token_ids(model, tokenizer)) or None


def sampling_params(
    cfg: RolloutConfig,
    *,
    rollout_step: int,
    rank: int,
    stop_ids: list[int] | None,
    n: int | None = None,
    temperature: float | None = None,
    keyed: bool = False,
) -> SamplingParams:
    """The ``SamplingParams`` of rollout step ``rollout_step`` on ``rank``. ``keyed``: the prompts carry data keys
    (:func:`prompt_keys`), so the seed is ``cfg.seed`` alone; else it is mixed from seed, step and rank."""
    return SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=request_key(cfg.seed) if keyed else request_key(cfg.seed, rollout_step, rank),
        n=cfg.n if n is None else n,
        stop_token_ids=stop_ids,
        logprobs=cfg.logprobs,
    )


TRAIN_KEYS, VALIDATION_KEYS = 0, 1
"""Split tags mixed into the prompt keys, so training and validation draws never share keys."""


def prompt_keys(items: Sequence[dict], *, split: int, epoch: int) -> list[int] | None:
    """Per-prompt sampling keys ``request_key(split, index, epoch)`` from the items' dataset row ``index``; ``None``
    (with a warning) when an item has none, and the generator falls back to slot ids and a rank-mixed seed.

    With keys, sample ``j`` of a row draws from ``(seed, split, index, epoch, j)`` only: the same data samples the same
    tokens whatever the batch size, the order or the number of ranks."""
    if not all(isinstance(it, dict) and isinstance(it.get("index"), int) for it in items):
        rank_zero_warn(
            "prompt items carry no integer 'index' (dataset row): sampling keys fall back to the slot in the batch and "
            "the rank, so samples change with batch size, order and world size. Add 'index' to every item "
            "(rlexact.data.PromptDataModule does).",
        )
        return None
    return [request_key(split, it["index"], epoch) for it in items]


def max_context(cfg: RolloutConfig, max_positions: int) -> int:
    """``rollout.max_context``, or the model's ``max_positions`` when it is None; a longer one raises ``ValueError``."""
    if cfg.max_context is None:
        return max_positions
    if cfg.max_context > max_positions:
        raise ValueError(
            f"rollout.max_context={cfg.max_context} is longer than the model's max_position_embeddings="
            f"{max_positions}; set rollout.max_context to at most {max_positions}"
        )
    return cfg.max_context


def check_prompts(items: Sequence[dict], cfg: RolloutConfig, max_positions: int) -> list[list[int]]:
    """The token ids of a data batch's prompts; an empty batch, an item without ``prompt_ids``, an empty prompt or one
    that leaves no room for ``max_new_tokens`` in the context (:func:`max_context`) raise ``ValueError`` naming the
    item and the fix."""
    if not isinstance(items, (list, tuple)) or len(items) == 0:
        raise ValueError(
            "training_step got an empty batch of prompts; check that the dataset is not empty "
            "(rlexact.data.PromptDataModule yields lists of prompt dicts)"
        )
    context = max_context(cfg, max_positions)
    budget = context - cfg.max_new_tokens
    prompts = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "prompt_ids" not in item:
            raise ValueError(f"batch item {i} must be a dict with 'prompt_ids', got {type(item).__name__}")
        ids = [int(t) for t in item["prompt_ids"]]
        if not ids:
            raise ValueError(f"prompt {i} (dataset index {item.get('index')}) is empty")
        if len(ids) > budget:
            if budget < 1:  # no prompt fits: the error names rollout.max_new_tokens
                check_prompt_lengths(len(ids), item.get("index"), context, cfg.max_new_tokens)
            raise ValueError(
                f"prompt {i} (dataset index {item.get('index')}) has {len(ids)} tokens; with "
                f"max_new_tokens={cfg.max_new_tokens} the context of {context} tokens leaves room "
                f"for prompts of at most {budget} tokens (filter long prompts, e.g. "
                "PromptDataModule(max_prompt_length=...), or lower rollout.max_new_tokens)"
            )
        prompts.append(ids)
    return prompts


ENGINE_COUNTERS = (
    "prompt_tokens",
    "prefill_tokens",
    "shared_prompt_tokens",
    "prefix_cached_tokens",
    "decode_shared_prefix_keys",
    "preemptions",
)
"""Counters of a ``generate`` call (``Generator.stats``) that the module logs as ``rollout/<name>``, summed over
ranks: prompt tokens requested, tokens prefilled (recomputes after a preemption included), prompt tokens taken from a
sibling's blocks or from the prefix cache, keys the decode steps read once for a group of sequences instead of once
per sequence, and preemptions (a KV cache too small for the batch)."""


def engine_counters(generator: Generator | None, before: dict | None) -> dict[str, float]:
    """``{name: value}`` of :data:`ENGINE_COUNTERS` from ``generator``'s last call, or ``{}`` when ``generator`` made no
    call since its ``stats`` were ``before`` (a ``generate`` override that samples elsewhere)."""
    if generator is None or generator.stats is before or not generator.stats:
        return {}
    return {name: float(generator.stats.get(name) or 0) for name in ENGINE_COUNTERS}


def make_generator(model: nn.Module, cfg: RolloutConfig) -> Generator:
    """A :class:`rlexact.rollout.Generator` on ``model`` itself (it shares the parameters)."""
    return Generator(model, kernels=cfg.kernels, **cfg.generator)


@torch.no_grad()
def generate_completions(
    model: nn.Module,
    generator: Generator,
    prompts: list[list[int]],
    params: SamplingParams,
    keys: list[int] | None = None,
) -> list[Completion]:
    """Sample with ``generator`` under ``no_grad`` and ``model.eval()`` (all parameters gathered once under FSDP);
    ``keys``: per-prompt sampling keys (:func:`prompt_keys`) or ``None`` for slot ids.

    Returns ``len(prompts) * params.n`` completions in prompt-major order (checked)."""
    was_training = model.training
    model.eval()
    try:
        with gathered_params(model):
            outs = fsdp_call(model, lambda: generator.generate(prompts, params, keys=keys))
    finally:
        model.train(was_training)
    expected = len(prompts) * params.n
    if len(outs) != expected:
        raise RuntimeError(f"generator returned {len(outs)} completions for {len(prompts)} x {params.n}")
    for k, c in enumerate(outs):
        if c.prompt_index != k // params.n:
            raise RuntimeError("generator completions are not in prompt-major order")
    return outs
