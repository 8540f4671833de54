"""transformers integration: :func:`exactify`, the packed forward and the log-prob head."""

from rlexact.models.attention import ATTN_IMPL
from rlexact.models.compiled import uncompiled
from rlexact.models.context import context_limit
from rlexact.models.exactify import SUPPORTED_MODEL_TYPES, check_supported, exactify
from rlexact.models.forward import forward_hidden, head_logits, head_logprobs, lm_head_weight
from rlexact.models.metadata import AttnMetadata, PagedKV
from rlexact.models.state import ExactState, get_state, is_exactified, use_kernels
from rlexact.models.text import decoder, text_config, text_modules

__all__ = [
    "ATTN_IMPL",
    "SUPPORTED_MODEL_TYPES",
    "AttnMetadata",
    "ExactState",
    "PagedKV",
    "check_supported",
    "context_limit",
    "decoder",
    "exactify",
    "forward_hidden",
    "get_state",
    "head_logits",
    "head_logprobs",
    "is_exactified",
    "lm_head_weight",
    "text_config",
    "text_modules",
    "uncompiled",
    "use_kernels",
]
