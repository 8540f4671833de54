"""Shared test helpers: tiny transformers models built from configs (no downloads), random prompts and the
one-line tensor constructors of the hand-computed tests."""

from __future__ import annotations

import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM


def tiny_model(
    arch: str = "qwen3",
    *,
    vocab: int = 97,
    hidden: int = 48,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 88,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_pos: int = 512,
    tie_embeddings: bool = False,
    random_norms: bool = True,
    weight_scale: float = 1.0,
) -> torch.nn.Module:
    """A randomly initialized causal LM of the given architecture, in eval mode.

    ``random_norms`` draws the norm weights from U(0.5, 1.5) so RMSNorm weight handling is exercised;
    ``weight_scale`` multiplies every 2-D weight (in float32, before the cast to ``dtype``) for sharper distributions.
    """
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie_embeddings,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, **common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(head_dim=head_dim, **common))
    elif arch == "qwen2":
        assert heads * head_dim == hidden, "qwen2 derives head_dim from hidden/heads"
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                if random_norms:
                    p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and weight_scale != 1.0:
                p.mul_(weight_scale)
    return model.to(dtype).eval()


def tiny_rl_config(vocab_size: int, max_pos: int = 64) -> dict:
    """``model_config`` dict of the tiny Qwen3 used by the RLModule, callback and FSDP tests."""
    return dict(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
    )


def prompts_for(n: int, vocab: int, lo: int = 1, hi: int = 20, seed: int = 0) -> list[list[int]]:
    """``n`` reproducible random prompts of ``lo..hi`` token ids below ``vocab``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def mask(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)
