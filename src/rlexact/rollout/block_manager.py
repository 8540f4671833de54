"""Paged KV-cache bookkeeping: which cache blocks belong to which sequence (no prefix caching)."""

from __future__ import annotations

import random
from collections import deque

import torch

from rlexact.rollout.sequence import Sequence


class BlockManager:
    """Free list of ``num_blocks`` cache blocks of ``block_size`` tokens, plus a block-table tensor.

    Allocation is optimistic: a sequence gets blocks only for the tokens of the step being scheduled
    (:meth:`ensure`), and the scheduler preempts when the free list runs dry. A sequence holding blocks also holds a
    row of :attr:`table` (``[max_rows, width]`` int32, CPU) mirroring its ``block_table``, so the runner builds the
    per-step block tables with one ``index_select`` instead of per-sequence Python lists.

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
        order = list(range(num_blocks))
        self._rng = random.Random(seed) if shuffle else None
        if self._rng is not None:
            self._rng.shuffle(order)
        self._free: deque[int] = deque(order)
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))
        self.table = torch.zeros((max_rows, width), dtype=torch.int32)
        """``[max_rows, width]`` int32: row ``seq.row`` lists ``seq.block_table`` (stale entries past its end)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` cache slots."""
        return -(-num_tokens // self.block_size)

    def missing(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that ``num_tokens`` of its positions have cache slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` cache slots for positions ``[0, num_tokens)``; ``False`` (nothing changed) if blocks run out."""
        need = self.missing(seq, num_tokens)
        if need == 0:
            return True
        if need > len(self._free):
            return False
        if self.blocks_for(num_tokens) > self.width:
            raise RuntimeError(
                f"sequence needs {self.blocks_for(num_tokens)} blocks, block table width is {self.width}"
            )
        if seq.row < 0:
            seq.row = self._free_rows.pop()
        start = len(seq.block_table)
        new = [self._free.popleft() for _ in range(need)]
        seq.block_table.extend(new)
        self.table[seq.row, start : start + need] = torch.tensor(new, dtype=torch.int32)
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks (and its table row) to the free lists."""
        if seq.block_table:
            blocks = seq.block_table
            if self._rng is not None:
                blocks = list(blocks)
                self._rng.shuffle(blocks)
            self._free.extend(blocks)
            seq.block_table = []
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1
