"""The text decoder of a transformers causal LM: its config, its base model and its modules.

A text-only causal LM (``*ForCausalLM``) is its own text decoder: ``model.model`` is the base transformer and
``model.config`` its config. An image-text model whose text half rlexact runs (:data:`TEXT_OF_MULTIMODAL`: Gemma 3
4B and up, Mistral Small 3.x and Ministral 3 as ``*ForConditionalGeneration``) keeps it at
``model.model.language_model``, with the config at ``model.config.text_config``; its vision tower and projector are
not part of the text decoder.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Any

from torch import nn

TEXT_OF_MULTIMODAL: dict[str, tuple[str, ...]] = {"gemma3": ("gemma3_text",), "mistral3": ("mistral", "ministral3")}
"""Image-text ``model_type`` -> the ``model_type`` values of its text decoder, for the models rlexact runs on text
alone."""


def text_config(model: nn.Module) -> Any:
    """The config of ``model``'s text decoder: ``model.config`` for a text-only LM, its ``text_config`` for an
    image-text one (:data:`TEXT_OF_MULTIMODAL`). A class-attribute lookup, cheap enough for the per-step head."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no transformers config; expected a transformers causal LM")
    return config.text_config if getattr(config, "model_type", None) in TEXT_OF_MULTIMODAL else config


def decoder(model: nn.Module) -> nn.Module:
    """The base transformer of the text decoder: ``model.model`` for transformers causal LMs,
    ``model.model.language_model`` for an image-text model."""
    base = getattr(model, "model", None)
    if base is None:
        raise ValueError(f"{type(model).__name__} has no .model decoder; expected a transformers *ForCausalLM")
    return getattr(base, "language_model", base)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision tower of an image-text model (``model.model.vision_tower`` beside its text decoder), else None."""
    base = getattr(model, "model", None)
    return None if decoder(model) is base else getattr(base, "vision_tower", None)


def text_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every module of ``model`` that computes text: all of them for a text-only LM; the text decoder and the LM
    head (not the vision tower or projector) for an image-text one."""
    base = decoder(model)
    if base is getattr(model, "model", None):
        return model.modules()
    head = getattr(model, "lm_head", None)
    return chain(base.modules(), () if head is None else head.modules())
