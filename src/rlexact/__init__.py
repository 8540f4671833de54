"""rlexact: zero-mismatch LLM reinforcement learning on PyTorch Lightning.

Public surface (see the README and ``docs/design.md`` §5): :func:`exactify`, :func:`sequence_logprobs`,
:mod:`rlexact.rollout` (``Generator``, ``SamplingParams``), :class:`RLModule` with its config dataclasses,
:class:`PromptDataModule`, :mod:`rlexact.callbacks` and the pure :mod:`rlexact.algorithms`.
"""

from rlexact import requirements  # noqa: I001 - first: it checks the library versions before the others import them
from rlexact import algorithms, callbacks, ops, rollout
from rlexact.batch import RolloutBatch
from rlexact.callbacks import RLCallback
from rlexact.config import AlgorithmConfig, FSDPConfig, OptimConfig, RolloutConfig
from rlexact.data import PromptDataModule
from rlexact.logprobs import Packed, pack, packed_logprobs, sequence_logprobs
from rlexact.models import SUPPORTED_MODEL_TYPES, exactify, is_exactified, use_kernels
from rlexact.module import RLModule
from rlexact.rewards import RewardConfig

__version__ = "0.1.0"
__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AlgorithmConfig",
    "FSDPConfig",
    "OptimConfig",
    "Packed",
    "PromptDataModule",
    "RLCallback",
    "RLModule",
    "RewardConfig",
    "RolloutBatch",
    "RolloutConfig",
    "algorithms",
    "callbacks",
    "exactify",
    "is_exactified",
    "ops",
    "pack",
    "packed_logprobs",
    "requirements",
    "rollout",
    "sequence_logprobs",
    "use_kernels",
]
