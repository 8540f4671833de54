"""The longest sequence an exactified model runs, and why.

The exact attention kernels implement full causal attention. A sliding-window layer attends to key ``k`` from query
``q`` when ``q - k < window`` (transformers' mask), so for sequences of at most ``window`` tokens it is full causal
attention and the kernels compute it; past the window it would need keys masked that the kernels keep. A model
whose layers have a sliding window shorter than ``max_position_embeddings`` therefore runs, with its context limited
to the window, and a longer sequence is an error (:meth:`ContextLimit.check`), never a silent change of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

CONFIG_WINDOW_MODEL_TYPES: tuple[str, ...] = ("mistral", "mixtral", "phi3")
"""Model types whose attention layers apply ``config.sliding_window`` itself (the others set a layer attribute)."""


def is_attention(m: nn.Module) -> bool:
    """An attention layer with q, k, v and o projections, or (Phi-3) one fused ``qkv_proj`` and ``o_proj``."""
    names = ("qkv_proj", "o_proj") if hasattr(m, "qkv_proj") else ("q_proj", "k_proj", "v_proj", "o_proj")
    return type(m).__name__.endswith("Attention") and all(isinstance(getattr(m, n, None), nn.Linear) for n in names)


def sliding_window(m: nn.Module) -> int | None:
    """The sliding window attention layer ``m`` applies: its ``sliding_window`` attribute where it has one (Qwen2 and
    Qwen3 set it per layer, None or absent on full-attention layers), else its config's for the model types that read
    the config (:data:`CONFIG_WINDOW_MODEL_TYPES`: Mistral, Mixtral, Phi-3), else None."""
    if hasattr(m, "sliding_window"):
        return m.sliding_window
    config = getattr(m, "config", None)
    if getattr(config, "model_type", None) in CONFIG_WINDOW_MODEL_TYPES:
        return getattr(config, "sliding_window", None)
    return None


def window_off_setting(config: object) -> str:
    """The load-time setting that turns a model's sliding window off: Qwen2 / Qwen3 switch it with
    ``use_sliding_window``; Mistral, Mixtral and Phi-3 apply any ``config.sliding_window``."""
    return "use_sliding_window=False" if hasattr(config, "use_sliding_window") else "sliding_window=None"


@dataclass(frozen=True)
class ContextLimit:
    """The longest sequence a model runs exactly.

    Attributes:
        tokens: positions ``[0, tokens)`` are allowed.
        window: the sliding window that sets ``tokens`` (shorter than ``max_position_embeddings``), else None.
        off: the setting that turns that window off (:func:`window_off_setting`), else ``""``.
    """

    tokens: int
    window: int | None = None
    off: str = ""

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"a context limit needs at least one token, got {self.tokens}")

    @property
    def source(self) -> str:
        """What sets the limit, for error messages."""
        if self.window is None:
            return f"max_position_embeddings={self.tokens}"
        return f"the attention layers' sliding_window={self.window}"

    def check(self, position: int) -> None:
        """Raise ``ValueError`` when a token sits at ``position`` or later, naming what sets the limit and the fix."""
        if position < self.tokens:
            return
        if self.window is None:
            raise ValueError(f"position {position} exceeds max_position_embeddings={self.tokens} of the model")
        raise ValueError(
            f"position {position} is outside the sliding window of {self.window} tokens: rlexact's kernels implement "
            "full causal attention, which equals the model's sliding-window attention only for sequences of at most "
            f"{self.window} tokens. Keep prompt + new tokens within {self.window} (GeneratorConfig.max_model_len, "
            f"rollout.max_context), or load the model with {self.off} (full attention: a different model past the "
            "window)."
        )


def context_limit(model: nn.Module) -> ContextLimit:
    """``model``'s :class:`ContextLimit`: ``max_position_embeddings``, or the shortest sliding window of its attention
    layers where that is shorter."""
    config = getattr(model, "config", None)
    max_pos = int(getattr(config, "max_position_embeddings", 0) or 0)
    windows = [int(w) for m in model.modules() if is_attention(m) and (w := sliding_window(m)) is not None]
    if windows and (not max_pos or min(windows) < max_pos):
        return ContextLimit(min(windows), min(windows), window_off_setting(config))
    if not max_pos:
        raise ValueError(f"{type(model).__name__}'s config has no max_position_embeddings; expected a transformers LM")
    return ContextLimit(max_pos)
