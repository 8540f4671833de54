"""Paged KV-cache bookkeeping: which cache blocks belong to which sequence, with blocks shared between the samples of
one prompt (reference-counted, the last partial block copied on write)."""

from __future__ import annotations

import random
from collections import deque

import torch

from rlexact.rollout.sequence import Sequence


class BlockManager:
    """Free list of ``num_blocks`` cache blocks of ``block_size`` tokens, reference counts, and a block-table tensor.

    Allocation is optimistic: a sequence gets blocks only for the tokens of the step being scheduled
    (:meth:`ensure`), and the scheduler preempts when the free list runs dry. A sequence holding blocks also holds a
    row of :attr:`table` (``[max_rows, width]`` int32, CPU) mirroring its ``block_table``, so the runner builds the
    per-step block tables with one ``index_select`` instead of per-sequence Python lists. While
    :attr:`record_updates` is set, every write to :attr:`table` is also appended to :attr:`updates` so a device copy
    of the table can be kept in sync incrementally (:meth:`take_updates`).

    Sharing (:meth:`fork`): a sequence may take references to the full blocks of another sequence's first
    ``num_tokens`` positions; a block returns to the free list when its last holder frees it. Shared blocks are never
    written again: they lie wholly before ``num_tokens``, and every holder writes only at positions
    ``>= num_tokens``. The block holding position ``num_tokens - 1`` is shared only when it is full; otherwise the
    forking sequence gets a fresh block and the caller copies the cached slots over (copy on write).

    ``shuffle=True`` hands out blocks in a seeded random order (tests: results must not depend on page order).
    """

    def __init__(
        self, num_blocks: int, block_size: int, max_rows: int, width: int, shuffle: bool = False, seed: int = 0
    ) -> None:
        if num_blocks < 1 or block_size < 1 or max_rows < 1 or width < 1:
            raise ValueError(f"bad block manager sizes {num_blocks=}, {block_size=}, {max_rows=}, {width=}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.width = width
        self.max_rows = max_rows
        order = list(range(num_blocks))
        self._rng = random.Random(seed) if shuffle else None
        if self._rng is not None:
            self._rng.shuffle(order)
        self._free: deque[int] = deque(order)
        self._refs = [0] * num_blocks
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))
        self.table = torch.zeros((max_rows, width), dtype=torch.int32)
        """``[max_rows, width]`` int32: row ``seq.row`` lists ``seq.block_table`` (stale entries past its end)."""
        self._table_view = self.table.numpy()  # the same memory: element writes without a tensor op each
        self.updates: list[tuple[int, int, int]] = []
        """``(row, column, block)`` writes to :attr:`table` since the last :meth:`take_updates`."""
        self.record_updates = True
        """Whether writes are logged in :attr:`updates`; turned off by a user that keeps no device copy."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` cache slots."""
        return -(-num_tokens // self.block_size)

    def missing(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that ``num_tokens`` of its positions have cache slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def _check_width(self, num_tokens: int) -> None:
        if self.blocks_for(num_tokens) > self.width:
            raise RuntimeError(
                f"sequence needs {self.blocks_for(num_tokens)} blocks, block table width is {self.width}"
            )

    def _append(self, seq: Sequence, blocks: list[int]) -> None:
        """Append ``blocks`` (references already taken) to ``seq``'s block table and its table row."""
        if seq.row < 0:
            seq.row = self._free_rows.pop()
        start = len(seq.block_table)
        seq.block_table.extend(blocks)
        self._table_view[seq.row, start : start + len(blocks)] = blocks
        if self.record_updates:
            self.updates.extend((seq.row, start + i, b) for i, b in enumerate(blocks))

    def _take(self, count: int) -> list[int]:
        new = [self._free.popleft() for _ in range(count)]
        for b in new:
            self._refs[b] = 1
        return new

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` cache slots for positions ``[0, num_tokens)``; ``False`` (nothing changed) if blocks run out."""
        if num_tokens <= len(seq.block_table) * self.block_size:
            return True
        need = self.missing(seq, num_tokens)
        if need > len(self._free):
            return False
        self._check_width(num_tokens)
        self._append(seq, self._take(need))
        return True

    def fork(self, src: Sequence, dst: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give ``dst`` (holding no blocks) the cached positions ``[0, num_tokens)`` of ``src``.

        The full blocks are shared; a partial last block is replaced by a fresh block of ``dst``. Returns
        ``(src_block, dst_block)`` when that block's slots must be copied before ``dst`` runs, ``(-1, -1)`` when no
        copy is needed, and ``None`` (nothing changed) if no block is free for the copy.
        """
        if dst.block_table or dst.row >= 0:
            raise RuntimeError("fork: the destination sequence already holds blocks")
        if num_tokens < 1 or self.blocks_for(num_tokens) > len(src.block_table):
            raise RuntimeError(f"fork: the source holds {len(src.block_table)} blocks, not {num_tokens} positions")
        full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        if partial and not self._free:
            return None
        shared = src.block_table[:full]
        for b in shared:
            self._refs[b] += 1
        blocks = list(shared)
        copy = (-1, -1)
        if partial:
            fresh = self._take(1)[0]
            blocks.append(fresh)
            copy = (src.block_table[full], fresh)
        self._append(dst, blocks)
        return copy

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (blocks nobody else holds return to the free list) and its table row."""
        if seq.block_table:
            released = []
            for b in seq.block_table:
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    released.append(b)
            if self._rng is not None:
                self._rng.shuffle(released)
            self._free.extend(released)
            seq.block_table = []
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def take_updates(self) -> list[tuple[int, int, int]]:
        """The ``(row, column, block)`` table writes since the last call (and forget them)."""
        out, self.updates = self.updates, []
        return out
