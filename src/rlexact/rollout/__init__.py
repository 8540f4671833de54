"""In-process rollout engine: continuous batching over a paged KV cache, keyed sampling, CUDA graphs.

``Generator(model, kernels="exact")`` samples from the training module itself (no weight copy); in exact mode every
reported log-prob equals the trainer's (:func:`rlexact.sequence_logprobs`) bitwise.
"""

from rlexact.rollout.config import GeneratorConfig
from rlexact.rollout.engine import Generator, eos_token_ids
from rlexact.rollout.params import Completion, FinishReason, SamplingParams

__all__ = ["Completion", "FinishReason", "Generator", "GeneratorConfig", "SamplingParams", "eos_token_ids"]
