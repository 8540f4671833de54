"""Continuous batching with chunked prefill, preemption by recompute, prompt blocks shared by the samples of a
prompt and prefix caching."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from rlexact.rollout.block_manager import BlockManager
from rlexact.rollout.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step: feed ``num_new[i]`` tokens of ``seqs[i]`` (in this order, packed).

    Attributes:
        seqs: the sequences of the step, running ones first (admission order), newly admitted ones after.
        num_new: tokens fed per sequence (``1`` for decodes, a prompt chunk for prefills).
        is_decode: every sequence feeds exactly one token and samples (the CUDA-graph path).
        copies: ``(src_block, dst_block)`` cache blocks to copy (all layers, K and V) before the step runs: the
            partial last prompt block of a sequence that forked from a sibling (copy on write).
        num_prefill_tokens: the sum of ``num_new`` over the sequences that have not fed their whole prompt yet
            (``num_computed < num_prompt_tokens`` when scheduled).
    """

    seqs: list[Sequence]
    num_new: list[int]
    is_decode: bool
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0


class _Step:
    """A step being built: its sequences and token counts, copies, the token budget left, and the positions taken
    from siblings or the prefix cache (counted once the step is committed)."""

    __slots__ = ("blocked", "budget", "cached", "copies", "forks", "is_decode", "num_new", "prefill", "seqs", "shared")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.seqs: list[Sequence] = []
        self.num_new: list[int] = []
        self.is_decode = True
        self.prefill = 0
        self.copies: list[tuple[int, int]] = []
        self.cached = self.forks = self.shared = 0
        self.blocked = False
        """Whether an admission ended for want of free blocks."""

    def add(self, seq: Sequence, n: int) -> None:
        """Feed ``n`` tokens of ``seq`` from its ``num_computed``."""
        self.seqs.append(seq)
        self.num_new.append(n)
        if n != 1 or seq.num_computed + 1 != len(seq.tokens):
            self.is_decode = False
        if seq.num_computed < seq.num_prompt_tokens:
            self.prefill += n
        self.budget -= n


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

    Prompt sharing (``share_prompts``): sequences with the same ``prompt_index`` have the same prompt (the engine's
    ``n`` samples of a request). A waiting sequence holding no cache whose running sibling has its first ``L - 1``
    prompt positions cached forks from it (:meth:`BlockManager.fork`) and starts at ``num_computed = L - 1``: it
    feeds only the last prompt token (a decode-shaped step) and then samples. While a sibling is still prefilling,
    the sequence is skipped (later waiting sequences may be admitted) instead of prefilling the prompt again. A
    sequence that finishes while siblings still wait (e.g. at its first sampled token) keeps its blocks as a donor
    until the next admissions have forked from it (:meth:`finish`), so its siblings do not prefill the prompt one at
    a time. A donor holds no table row and is released once no sibling waits (checked after each admission pass),
    or at once when its blocks are needed: before any preemption, and when an admission finds too few free blocks.
    Exact because every kernel is row-invariant: cached K/V of a position do not depend on which sequence computed
    them.

    Prefix caching (``prefix_cache``): at each :meth:`schedule`, the running sequences' full blocks with written K/V
    are recorded (:meth:`BlockManager.register`); a waiting sequence holding no cache that does not fork takes the
    blocks of its longest recorded prefix of whole blocks (:meth:`BlockManager.match`, at least one token left to
    compute) and starts after them. When nothing is recorded for it yet but a running sequence (or one admitted
    earlier in the same step) is computing the same first block, it waits, like a sibling, so that prompts sharing a
    system prompt and admitted together compute it once. Same exactness argument; it also shortens the recompute
    after a preemption.

    While a step is in flight, :meth:`chain` (the next decode) and :meth:`chain_prefill` (the next prefill) may name
    the step after it, which the engine launches before reading the first one back.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        share_prompts: bool = False,
        prefix_cache: bool = False,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.share_prompts = share_prompts
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_forks = 0
        self.shared_tokens = 0
        """Prompt positions taken from a sibling's cache instead of being prefilled again."""
        self.cached_tokens = 0
        """Positions taken from the prefix cache instead of being computed (prompt and, after a preemption,
        generated tokens)."""
        self._siblings: dict[int, list[Sequence]] = {}
        """Running sequences and donors by ``prompt_index`` (only with ``share_prompts``)."""
        self._donors: list[Sequence] = []
        """Finished sequences still holding their blocks for waiting siblings to fork from (:meth:`finish`)."""
        self._waiting_prompts: Counter[int] = Counter()
        """Waiting sequences by ``prompt_index``."""

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self._waiting_prompts[seq.prompt_index] += 1

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _chunk(self, pending: int, budget: int) -> int:
        if pending <= budget:
            return pending
        return budget if self.chunked_prefill else 0

    def _start(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)
        if self.share_prompts:
            self._siblings.setdefault(seq.prompt_index, []).append(seq)

    def _stop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and take it out of its sibling group."""
        self.bm.free(seq)
        if self.share_prompts:
            group = self._siblings[seq.prompt_index]
            group.remove(seq)
            if not group:
                del self._siblings[seq.prompt_index]

    def _preempt(self, seq: Sequence) -> None:
        self._stop(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self._waiting_prompts[seq.prompt_index] += 1
        self.num_preemptions += 1

    def _release_donors(self, unwaited_only: bool = False) -> None:
        """Free the blocks of every donor (:meth:`finish`), or only of those no sibling waits for."""
        kept = []
        for seq in self._donors:
            if unwaited_only and self._waiting_prompts[seq.prompt_index] > 0:
                kept.append(seq)
            else:
                self._release(seq)
        self._donors = kept

    def _share_source(self, seq: Sequence) -> Sequence | bool:
        """A running sibling whose cache holds ``seq``'s first ``L - 1`` prompt positions; ``True`` when a sibling is
        still prefilling them (wait for it); ``False`` when ``seq`` must prefill on its own."""
        shared = seq.num_prompt_tokens - 1
        if not self.share_prompts or seq.num_computed or seq.score_only or shared < 1:
            return False
        prefilling = False
        for sib in self._siblings.get(seq.prompt_index, ()):
            if sib.tokens[:shared] != seq.tokens[:shared]:
                continue
            if sib.num_computed >= shared:
                return sib
            prefilling = True
        return prefilling

    def _first_block(self, seq: Sequence) -> tuple[int, ...] | None:
        """The tokens of ``seq``'s first KV block when prefix caching could record it and a later sequence take it
        (at least one token after it), else None."""
        bs = self.bm.block_size
        return tuple(seq.tokens[:bs]) if len(seq.tokens) > bs else None

    def _record_running(self) -> set[tuple[int, ...]]:
        """Record the running sequences' written full blocks in the prefix cache; return the first blocks (their
        tokens) that running sequences are still computing: a waiting sequence starting with one of them waits for
        the record instead of computing the same K/V."""
        bs = self.bm.block_size
        leading = set()
        for seq in self.running:
            self.bm.register(seq)
            first = self._first_block(seq) if seq.num_computed < bs and not seq.score_only else None
            if first is not None:
                leading.add(first)
        return leading

    def schedule(self) -> ScheduledBatch:
        """The next step (never empty while sequences remain)."""
        step = _Step(self.max_num_batched_tokens)
        preempted = False
        running = self.running  # preemption removes from this very list
        leading = self._record_running() if self.prefix_cache else None  # the running loop below only preempts
        i = 0
        while i < len(running) and step.budget > 0:
            seq = running[i]
            n = self._chunk(len(seq.tokens) - seq.num_computed, step.budget)
            if n == 0:
                i += 1
                continue
            target = seq.num_computed + n
            while not self.bm.ensure(seq, target):  # returns at once when seq already has the slots
                if self._donors:
                    self._release_donors()
                    continue
                victim = running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # seq preempted itself: everything after it is gone too
            step.add(seq, n)
            i += 1
        if not preempted:
            self._admit(step, leading)
            if step.blocked and self._donors:  # the donors' blocks kept an admission out: free them, admit on
                self._release_donors()
                self._admit(step, self._record_running() if self.prefix_cache else None)
        self._release_donors(unwaited_only=True)
        if not step.seqs:
            raise RuntimeError(
                "scheduler made no progress: a sequence does not fit the KV cache or the token budget "
                f"(free blocks {self.bm.num_free}/{self.bm.num_blocks}, budget {self.max_num_batched_tokens})"
            )
        return self._commit(step)

    def _admit(self, step: _Step, leading: set[tuple[int, ...]] | None, reserve: int = 0) -> list[tuple[int, Sequence]]:
        """Admit waiting sequences into ``step``, in queue order, while its budget, the sequence slots and the free
        blocks last, leaving at least ``reserve`` blocks free; returns ``(queue index, sequence)`` of each admission
        (:meth:`_readmit` undoes them).

        A sequence whose sibling is still prefilling its prompt, or whose first block another sequence is computing
        (``leading``, prefix caching), is skipped; one that can fork from a sibling (:meth:`_share_source`) or take
        recorded blocks (:meth:`BlockManager.match`) starts after them. The first sequence whose blocks do not fit
        ends the admissions, holding nothing."""
        admitted: list[tuple[int, Sequence]] = []
        bm = self.bm
        w = 0
        while w < len(self.waiting) and step.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[w]
            source = self._share_source(seq)
            if source is True:
                w += 1  # a sibling is prefilling this prompt: fork from it later
                continue
            src = source if isinstance(source, Sequence) else None
            hit = 0
            if leading is not None and src is None and not seq.num_computed and not seq.score_only:
                hit = bm.match(seq)
                first = self._first_block(seq)
                if not hit and first is not None:
                    if first in leading:
                        w += 1  # another sequence is computing this first block: take it from the cache later
                        continue
                    leading.add(first)
            start = seq.num_prompt_tokens - 1 if src is not None else seq.num_computed + hit
            n = self._chunk(len(seq.tokens) - start, step.budget)
            copy = None
            if n and src is not None:
                copy = bm.fork(src, seq, start)
                if copy is None:
                    step.blocked = True
                    break
            # the reserve check also catches a fork or match that took reserved blocks
            if n == 0 or bm.missing(seq, start + n) > bm.num_free - reserve or not bm.ensure(seq, start + n):
                if src is not None or hit:
                    bm.free(seq)
                step.blocked = n > 0
                break
            seq.num_computed = start
            step.cached += hit
            if copy is not None:
                step.forks += 1
                step.shared += start
                if copy[0] >= 0:
                    step.copies.append(copy)
            del self.waiting[w]
            self._waiting_prompts[seq.prompt_index] -= 1
            admitted.append((w, seq))
            self._start(seq)
            step.add(seq, n)
        return admitted

    def _readmit(self, admitted: list[tuple[int, Sequence]]) -> None:
        """Undo :meth:`_admit`: the sequences free their blocks and return to their places in the waiting queue."""
        for w, seq in reversed(admitted):
            self._stop(seq)
            seq.num_computed = 0
            seq.status = Status.WAITING
            self.waiting.insert(w, seq)
            self._waiting_prompts[seq.prompt_index] += 1

    def _commit(self, step: _Step) -> ScheduledBatch:
        """Count ``step``'s shared and cached positions and forks; return it as a batch."""
        self.cached_tokens += step.cached
        self.num_forks += step.forks
        self.shared_tokens += step.shared
        return ScheduledBatch(step.seqs, step.num_new, step.is_decode, step.copies, step.prefill)

    @staticmethod
    def _prefilling(seq: Sequence) -> bool:
        """Whether ``seq`` (running) has known tokens to feed beyond a decode: its prompt, or the prompt and generated
        tokens of a recompute, is not fully fed (more than the last token pending)."""
        return seq.num_computed < max(seq.num_prompt_tokens, len(seq.tokens) - 1)

    def _plan_chunks(self, step: _Step) -> tuple[list[tuple[Sequence, int]], int, bool]:
        """Add the next chunk of every running sequence that is still prefilling (:meth:`_prefilling`) to ``step``, in
        admission order, while its budget and the free blocks last, allocating nothing. Returns ``(sequence, positions
        that need slots)`` of each, for :meth:`BlockManager.ensure`, the blocks they need, and whether every chunk's
        blocks fit (``False``: the plan stopped at a sequence whose blocks do not)."""
        free = self.bm.num_free
        reserve = 0
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if step.budget <= 0:
                break
            if not self._prefilling(seq):
                continue
            n = self._chunk(len(seq.tokens) - seq.num_computed, step.budget)
            if n == 0:
                continue
            need = self.bm.missing(seq, seq.num_computed + n)
            if reserve + need > free:
                return chunks, reserve, False
            reserve += need
            chunks.append((seq, seq.num_computed + n))
            step.add(seq, n)
        return chunks, reserve, True

    def chain_prefill(self, in_flight: ScheduledBatch) -> ScheduledBatch | None:
        """A prefill step to launch while the eager step ``in_flight`` is still running (its sampled tokens not read
        back yet, ``num_computed`` already advanced), or None.

        The step holds only work that does not depend on ``in_flight``'s sampled tokens: the next prompt chunk (or
        recompute chunk) of running sequences that are still prefilling, then admissions from the waiting queue
        under the rules of :meth:`schedule` (prompt sharing, prefix caching, token budget, sequence slots). A sequence
        that samples in ``in_flight`` has nothing to feed until its token is appended, and a running sequence's
        decode is left to :meth:`schedule`. It never preempts (a preempted sequence of ``in_flight`` would lose
        blocks the device is still writing): it stops adding sequences at the first one whose blocks do not fit
        (a prompt's chunk or an admission; admissions never take the blocks of the chunks before them).

        Policy (performance only: results never depend on how steps are formed): a step is chained only behind an
        ``in_flight`` step that contains prefill, and only if it carries at least half of ``max_num_batched_tokens``
        tokens; otherwise (steady-state continuous batching, where an admission joins the decodes in a mixed step)
        it returns None, and the sequences it tried are as they were: the running ones hold no new block, the waiting
        ones are back in their places holding none (the free list's order and the prefix-cache records of blocks an
        undone admission evicted may differ)."""
        if not in_flight.num_prefill_tokens:
            return None
        leading = self._record_running() if self.prefix_cache else None
        step = _Step(self.max_num_batched_tokens)
        chunks, reserve, fits = self._plan_chunks(step)
        admitted = self._admit(step, leading, reserve) if fits else []
        if 2 * (self.max_num_batched_tokens - step.budget) < self.max_num_batched_tokens:
            self._readmit(admitted)
            return None
        for seq, target in chunks:
            if not self.bm.ensure(seq, target):
                raise RuntimeError("chain_prefill: a reserved block allocation failed")
        self._release_donors(unwaited_only=True)
        return self._commit(step)

    def chain(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after ``batch`` while ``batch`` is still in flight (its sampled tokens not read back yet,
        ``num_computed`` already advanced): its sequences that are still running and do not reach their token limit
        with ``batch``, in the same order, each feeding the token ``batch`` samples. Returns None unless that is the
        step :meth:`schedule` would choose once ``batch`` is read back: ``batch`` is a decode of every running
        sequence, no waiting sequence could take a slot, the step fits the token budget and every sequence gets the
        slot of its next position without a preemption. (A sequence that stops at a stop token with ``batch`` is
        still in the returned step; the engine drops its result.)"""
        if not batch.is_decode:
            return None
        running = Status.RUNNING
        if [s for s in batch.seqs if s.status is running] != self.running:
            return None
        seqs = [s for s in self.running if s.num_generated + 1 < s.max_new_tokens]
        if not seqs or len(seqs) > self.max_num_batched_tokens:
            return None
        if self.waiting and len(seqs) < self.max_num_seqs:
            return None
        for seq in seqs:
            if not self.bm.ensure(seq, seq.num_computed + 1):
                return None
        return ScheduledBatch(seqs, [1] * len(seqs), True)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks, or, with prompt sharing, keep them as a donor while a
        sibling waits that could fork from it (its first ``L - 1`` prompt positions are cached): the next admissions
        fork from the donor instead of one sibling prefilling the prompt again."""
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        if not (self.share_prompts and self._waiting_prompts[seq.prompt_index] and not seq.score_only):
            self._stop(seq)
            return
        self.running.remove(seq)
        self.bm.release_row(seq)
        self._donors.append(seq)
