"""What a model's attention layers see: the longest sequence the model runs and each layer's sliding window.

A sliding-window layer attends to key ``k`` from query ``q`` when ``k <= q`` and ``q - k < window`` (transformers'
mask); the exact kernels take the window (``rlexact.ops.attention_varlen(..., window=...)``), so every path
(training, chunked prefill, decode, the native baseline) applies it.
"""

from __future__ import annotations

from torch import nn

from rlexact.models.text import text_config

CONFIG_WINDOW_MODEL_TYPES: tuple[str, ...] = ("mistral", "ministral3", "mixtral", "phi3")
"""Model types whose attention layers apply ``config.sliding_window`` itself (the others set a layer attribute)."""


def is_attention(m: nn.Module) -> bool:
    """An attention layer with q, k, v and o projections, or (Phi-3) one fused ``qkv_proj`` and ``o_proj``."""
    names = ("qkv_proj", "o_proj") if hasattr(m, "qkv_proj") else ("q_proj", "k_proj", "v_proj", "o_proj")
    return type(m).__name__.endswith("Attention") and all(isinstance(getattr(m, n, None), nn.Linear) for n in names)


def sliding_window(m: nn.Module) -> int | None:
    """The sliding window attention layer ``m`` applies: its ``sliding_window`` attribute where it has one (Qwen2,
    Qwen3, SmolLM3, Gemma 3 and OLMo 3 set it per layer, None or absent on full-attention layers), else its config's
    for the model types that read the config (:data:`CONFIG_WINDOW_MODEL_TYPES`: Mistral, Ministral 3, Mixtral,
    Phi-3), else None."""
    config = getattr(m, "config", None)
    if hasattr(m, "sliding_window"):
        window = m.sliding_window
    elif getattr(config, "model_type", None) in CONFIG_WINDOW_MODEL_TYPES:
        window = getattr(config, "sliding_window", None)
    else:
        window = None
    return None if window is None else int(window)


def context_limit(model: nn.Module) -> int:
    """The longest sequence ``model`` runs: its ``max_position_embeddings`` (the exact rotary table's length)."""
    max_pos = int(getattr(text_config(model), "max_position_embeddings", 0) or 0)
    if max_pos < 1:
        raise ValueError(f"{type(model).__name__}'s config has no max_position_embeddings; expected a transformers LM")
    return max_pos
