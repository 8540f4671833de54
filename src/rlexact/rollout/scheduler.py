"""Continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rlexact.rollout.block_manager import BlockManager
from rlexact.rollout.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step: feed ``num_new[i]`` tokens of ``seqs[i]`` (in this order, packed).

    Attributes:
        seqs: the sequences of the step, running ones first (admission order), newly admitted ones after.
        num_new: tokens fed per sequence (``1`` for decodes, a prompt chunk for prefills).
        is_decode: every sequence feeds exactly one token and samples (the CUDA-graph path).
    """

    seqs: list[Sequence]
    num_new: list[int]
    is_decode: bool


class Scheduler:
    """Chooses which sequences run in the next packed forward.

    Each step has a budget of ``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` running sequences.
    Running sequences are served first, oldest admission first: a decode takes one token, an unfinished prefill takes
    the rest of its prompt up to the remaining budget (``chunked_prefill``) — so prefill chunks and decodes share one
    forward. Then waiting sequences are admitted in order while budget, sequence slots and free blocks last.

    Blocks are allocated optimistically, only for the tokens of the step. When the free list runs dry for a running
    sequence, the most recently admitted running sequence is preempted (blocks freed, ``num_computed = 0``, put back
    at the front of the waiting queue) until the allocation fits; it later recomputes ``prompt + generated``. No
    admissions happen in a step that preempted. Progress is guaranteed because every sequence fits the cache alone
    (checked by the engine up front).
    """

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = seq.num_pending
        if n <= budget:
            return n
        return budget if self.chunked_prefill else 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        """The next step (never empty while sequences remain)."""
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        num_new: list[int] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            target = seq.num_computed + n
            while not self.bm.ensure(seq, target):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # seq preempted itself: everything after it is gone too
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = self._chunk(seq, budget)
                if n == 0 or not self.bm.ensure(seq, seq.num_computed + n):
                    break
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                seqs.append(seq)
                num_new.append(n)
                budget -= n
        if not seqs:
            raise RuntimeError(
                "scheduler made no progress: a sequence does not fit the KV cache or the token budget "
                f"(free blocks {self.bm.num_free}/{self.bm.num_blocks}, budget {self.max_num_batched_tokens})"
            )
        is_decode = all(n == 1 and s.num_computed + 1 == len(s.tokens) for s, n in zip(seqs, num_new))
        return ScheduledBatch(seqs, num_new, is_decode)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks."""
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.bm.free(seq)
