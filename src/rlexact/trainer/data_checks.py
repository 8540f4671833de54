"""Checks of the prompt data against the policy, run once before training (``RLModule.setup`` / ``on_fit_start``).

A mismatch is found before the first rollout, not hours into a run: the data's tokenizer must be the module's, every
prompt token id must fit the model's vocabulary, and the longest prompt must leave room for ``max_new_tokens``. The
mini-batch size is checked against the sequences a rollout step makes (a warning: the run is valid, but its optimizer
steps are not what the setting says).
"""

from __future__ import annotations

import os
from typing import Any

from rlexact.data import describe_source

__all__ = ["check_prompt_lengths", "check_token_ids", "minibatch_mismatch", "same_tokenizer"]


def same_tokenizer(module_source: Any, module_tok: Any, data_source: Any, data_tok: Any) -> bool:
    """True if the two tokenizers agree (the same argument, or the same vocabulary and special tokens); raises
    ``ValueError`` naming both when they disagree."""
    if module_tok is data_tok:
        return True
    if isinstance(module_source, (str, os.PathLike)) and isinstance(data_source, (str, os.PathLike)):
        if os.fspath(module_source) == os.fspath(data_source):
            return True
    specials = ("eos_token_id", "pad_token_id", "bos_token_id")
    agree = module_tok.get_vocab() == data_tok.get_vocab() and all(
        getattr(module_tok, k, None) == getattr(data_tok, k, None) for k in specials
    )
    if not agree:
        raise ValueError(
            f"the data's tokenizer ({describe_source(data_source)}) differs from the module's "
            f"({describe_source(module_source)}): prompts would be encoded with one vocabulary and decoded with "
            "another; pass the model's tokenizer to both (PromptDataModule(tokenizer=...) and "
            "RLModule(tokenizer=...), by default its model_path)"
        )
    return True


def check_token_ids(max_token_id: int, vocab_size: int, source: Any) -> None:
    """Raise ``ValueError`` if a prompt token id does not fit the model's vocabulary."""
    if max_token_id >= vocab_size:
        raise ValueError(
            f"the prompts of {describe_source(source)} contain token id {max_token_id}, but the model's vocabulary has "
            f"{vocab_size} tokens: the data was tokenized with another tokenizer; pass the model's tokenizer to "
            "PromptDataModule(tokenizer=...)"
        )


def check_prompt_lengths(longest: int, row: int, max_context: int, max_new_tokens: int) -> None:
    """Raise ``ValueError`` if the longest prompt (dataset row ``row``) leaves no room for ``max_new_tokens`` in the
    context of ``max_context`` tokens (:func:`rlexact.trainer.sampling.max_context`), naming the two ways out. When
    ``max_new_tokens`` alone fills the context (only the model's can be that short: ``RolloutConfig`` refuses such a
    ``rollout.max_context``), no prompt fits, and the error names ``rollout.max_new_tokens`` as the setting to
    lower."""
    if max_new_tokens >= max_context:
        fits = max_context - longest
        room = f", which leaves room for the longest prompt (dataset row {row}, {longest} tokens)"
        hint = f" to at most {fits}{room}" if fits > 0 else ""
        raise ValueError(
            f"rollout.max_new_tokens={max_new_tokens} must be below the model's context of {max_context} tokens: a "
            f"rollout needs at least one prompt token; lower rollout.max_new_tokens{hint}"
        )
    budget = max_context - max_new_tokens
    if longest > budget:
        raise ValueError(
            f"the longest prompt (dataset row {row}) has {longest} tokens, but a context of {max_context} tokens with "
            f"rollout.max_new_tokens={max_new_tokens} leaves room for prompts of at most {budget} tokens; "
            f"set PromptDataModule(max_prompt_length={budget}) to filter longer prompts out, or lower "
            "rollout.max_new_tokens"
        )


def minibatch_mismatch(sequences: int, mini_batch_size: int | None) -> str | None:
    """Why ``mini_batch_size`` does not tile a rollout step's ``sequences`` (on one rank) into equal optimizer steps,
    or None when it does (or is None: one step on the whole batch)."""
    if mini_batch_size is None or sequences % mini_batch_size == 0:
        return None
    if mini_batch_size > sequences:
        return (
            f"algorithm.mini_batch_size={mini_batch_size} exceeds the {sequences} sequences a rollout step makes on "
            f"this rank (data.batch_size x rollout.n): every optimizer step takes all {sequences}; lower "
            "mini_batch_size or raise data.batch_size"
        )
    sizes = [mini_batch_size] * (sequences // mini_batch_size) + [sequences % mini_batch_size]
    return (
        f"algorithm.mini_batch_size={mini_batch_size} does not divide the {sequences} sequences a rollout step makes "
        f"on this rank (data.batch_size x rollout.n): each rollout step makes {len(sizes)} optimizer steps of "
        f"{', '.join(map(str, sizes))} sequences; choose a divisor of {sequences} for equal steps"
    )
