"""rlexact: zero-mismatch LLM reinforcement learning on PyTorch Lightning."""

from rlexact import ops
from rlexact.logprobs import Packed, pack, packed_logprobs, sequence_logprobs
from rlexact.models import exactify, is_exactified, use_kernels

__version__ = "0.1.0"
__all__ = [
    "Packed",
    "exactify",
    "is_exactified",
    "ops",
    "pack",
    "packed_logprobs",
    "sequence_logprobs",
    "use_kernels",
]
