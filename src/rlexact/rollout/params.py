"""Sampling parameters and completions: the generator's public data types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from rlexact.checks import as_index, choice, positive_int, sampling_args, token_ids
from rlexact.models.truncation import LOGPROB_MODES, LogprobMode

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions.

    Attributes:
        max_new_tokens: generated tokens per sample at most (> 0).
        temperature: softmax temperature (> 0, at least :data:`rlexact.checks.MIN_TEMPERATURE`, below which
            ``1 / temperature`` overflows float32); ``0`` means greedy (argmax, log-probs reported at temperature 1).
        top_p: nucleus mass in ``(0, 1]``; 1 disables it.
        top_k: keep the ``k`` most likely tokens; 0 disables it.
        seed: base seed of the keyed sampler (an integer of any type, taken modulo ``2**64``); the draw for a token
            depends only on ``(seed, request id, absolute position)``.
        n: samples per prompt (a GRPO group); sample ``j`` of prompt ``i`` has request id ``i * n + j`` unless the
            caller passes per-prompt keys or explicit request ids (see :meth:`rlexact.rollout.Generator.generate`).
        stop_token_ids: generation ends (inclusive) at any of these tokens; ``None`` uses the model's EOS ids.
        ignore_eos: keep generating through EOS (benchmarks).
        logprobs: which distribution the reported log-probs are of: ``"full"``, the full temperature-scaled softmax
            (top-k/top-p only restrict the draw), or ``"sampled"``, the truncated, renormalized distribution actually
            sampled from; the trainer computes the latter with ``rlexact.sequence_logprobs(..., top_k=, top_p=)``.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: LogprobMode = "full"

    def __post_init__(self) -> None:
        positive_int("max_new_tokens", self.max_new_tokens)
        sampling_args("", self.temperature, self.top_p, self.top_k, greedy=True)
        seed = None if isinstance(self.seed, bool) else as_index(self.seed)  # numpy / torch integers too
        if seed is None:
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        object.__setattr__(self, "seed", seed)
        positive_int("n", self.n)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        choice("logprobs", self.logprobs, LOGPROB_MODES)
        if self.greedy and self.logprobs == "sampled" and (self.top_k > 0 or self.top_p < 1.0):
            raise ValueError(
                f"temperature=0 (greedy) with top_k={self.top_k}, top_p={self.top_p} and logprobs='sampled': a greedy "
                "draw comes from no truncated distribution, and its log-probs are the full softmax's at temperature "
                "1. Use logprobs='full', or drop top_k/top_p (the argmax is the same token)"
            )
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(token_ids("stop_token_ids", self.stop_token_ids)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution whose log-probs are reported (1.0 when greedy)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Completion:
    """One sampled continuation.

    Attributes:
        prompt_token_ids: the prompt.
        token_ids: generated tokens (the stop token included when ``finish_reason == "stop"``).
        logprobs: ``[len(token_ids)]`` fp32: ``log pi(token | prefix)`` under the temperature-scaled full softmax
            (``SamplingParams.logprobs="full"``) or under the truncated, renormalized distribution sampled from
            (``"sampled"``).
        finish_reason: ``"stop"`` (a stop token was produced) or ``"length"`` (``max_new_tokens`` reached).
        request_id: the keyed-sampler id of this sample.
        prompt_index: index of the prompt in the ``generate`` call.
        num_preemptions: times the sample was preempted (its KV blocks freed under memory pressure and its prompt and
            generated tokens recomputed later); the tokens and log-probs do not depend on it.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: FinishReason
    request_id: int
    prompt_index: int
    num_preemptions: int = field(default=0)

    @property
    def sequence(self) -> list[int]:
        """``prompt_token_ids + token_ids``."""
        return self.prompt_token_ids + self.token_ids
