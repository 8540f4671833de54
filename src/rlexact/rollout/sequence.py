"""Per-request state of the generator: one :class:`Sequence` per sample (or per scored sequence)."""

from __future__ import annotations

import enum
import itertools

import numpy as np
import torch

from rlexact.rollout.params import Completion


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token state of one request.

    ``tokens`` is the prompt followed by the generated tokens. ``num_computed`` tokens have their K/V in the paged
    cache (blocks listed in ``block_table``); the next forward feeds ``tokens[num_computed : num_computed + n]``.
    When ``num_computed == len(tokens)`` after a forward, the hidden state of the last fed token samples the next
    token, whose absolute position is ``len(tokens)`` (the sampler key).

    Preemption frees the blocks and resets ``num_computed`` to 0; the generated tokens and their log-probs are kept,
    and the next admission re-prefills ``prompt + generated`` (recompute), after which sampling continues at the
    same absolute position with the same key, so the completion is unchanged.

    ``score_only`` sequences are never sampled from: they finish when their last token has been fed, and the runner
    records the teacher-forced log-prob of every token ``1 .. L-1`` in ``score_logprobs``.
    """

    __slots__ = (
        "block_table",
        "cache_blocks",
        "cache_node",
        "finish_reason",
        "generated_logprobs",
        "index",
        "max_new_tokens",
        "num_computed",
        "num_preemptions",
        "num_prompt_tokens",
        "prompt_index",
        "request_id",
        "row",
        "score_logprobs",
        "score_only",
        "status",
        "tokens",
    )

    def __init__(
        self,
        index: int,
        prompt: list[int],
        request_id: int,
        prompt_index: int,
        max_new_tokens: int,
        score_only: bool = False,
    ) -> None:
        self.index = index
        """Position of this sequence in the caller's output list."""
        self.tokens: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.request_id = request_id
        self.prompt_index = prompt_index
        self.max_new_tokens = max_new_tokens
        self.score_only = score_only
        self.generated_logprobs: list[float] = []
        self.score_logprobs: torch.Tensor | None = None
        self.num_computed = 0
        self.block_table: list[int] = []
        self.row = -1
        """Row of this sequence in the block manager's block-table tensor (``-1`` when it holds no blocks)."""
        self.cache_node = -1
        """Prefix node of the first ``cache_blocks`` blocks of ``block_table`` (:meth:`BlockManager.register`)."""
        self.cache_blocks = 0
        """Leading blocks of ``block_table`` recorded (or found) in the block manager's prefix cache."""
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens not yet fed to the model (``1`` for a running decode, the rest of the prompt for a prefill)."""
        return len(self.tokens) - self.num_computed

    @property
    def max_len(self) -> int:
        """Longest this sequence can become (prompt + max_new_tokens; the prompt alone when scoring)."""
        return self.num_prompt_tokens + self.max_new_tokens

    def append(self, token: int, logprob: float) -> None:
        self.tokens.append(token)
        self.generated_logprobs.append(logprob)

    def to_completion(self, logprobs: torch.Tensor) -> Completion:
        """The finished sequence as a :class:`Completion` whose log-probs are ``logprobs`` (its generated tokens')."""
        assert self.finish_reason is not None and logprobs.shape == (self.num_generated,)
        return Completion(
            prompt_token_ids=self.tokens[: self.num_prompt_tokens],
            token_ids=self.tokens[self.num_prompt_tokens :],
            logprobs=logprobs,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            request_id=self.request_id,
            prompt_index=self.prompt_index,
            num_preemptions=self.num_preemptions,
        )


def completions(seqs: list[Sequence]) -> list[Completion]:
    """The finished ``seqs`` as completions, their log-probs converted to fp32 in one pass over all of them (one
    tensor construction per sequence is the slower part of a large call's end) and copied out per sequence, so
    no completion's tensor holds another's storage."""
    counts = [len(s.generated_logprobs) for s in seqs]
    flat = np.fromiter(
        itertools.chain.from_iterable(s.generated_logprobs for s in seqs), dtype=np.float32, count=sum(counts)
    )
    out = []
    start = 0
    for s, n in zip(seqs, counts):
        out.append(s.to_completion(torch.from_numpy(flat[start : start + n].copy())))
        start += n
    return out
