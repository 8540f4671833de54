"""Paged KV-cache bookkeeping: which cache blocks belong to which sequence, with blocks shared between the samples of
one prompt (reference-counted, the last partial block copied on write) and full blocks found again by their token
prefix (prefix caching)."""

from __future__ import annotations

import random
from collections import OrderedDict, deque

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

    Prefix caching (:meth:`register`, :meth:`match`): a full block whose K/V are written is recorded under its
    *prefix node*, the identity of all tokens from position 0 to the block's end: node ids come from a trie keyed by
    ``(parent node, the block's tokens)`` and are never reused, so equal nodes mean equal token prefixes, exactly (no
    hashing). A later sequence with the same leading tokens takes references to those blocks instead of computing
    them. Exact under row-invariant kernels: the K/V of a position depend only on the tokens up to it, never on the
    batch that computed them. A recorded block whose last holder frees it is kept (evictable, least recently released
    first) until a new allocation needs it; then its record is dropped. Records live as long as this manager (one
    generator call, whose weights do not change).

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
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}
        """Prefix trie: ``(parent node, block tokens) -> node``; the root is :data:`ROOT`."""
        self._node_block: dict[int, int] = {}
        """Prefix node -> the cache block recorded for it."""
        self._block_node: dict[int, int] = {}
        """Cache block -> its prefix node (recorded blocks only)."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Recorded blocks nobody holds, least recently released first."""
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))
        self.table = torch.zeros((max_rows, width), dtype=torch.int32)
        """``[max_rows, width]`` int32: row ``seq.row`` lists ``seq.block_table`` (stale entries past its end)."""
        self._table_view = self.table.numpy()  # the same memory: element writes without a tensor op each
        self.updates: list[tuple[int, int, int]] = []
        """``(row, column, block)`` writes to :attr:`table` since the last :meth:`take_updates`."""
        self.record_updates = True
        """Whether writes are logged in :attr:`updates`; turned off by a user that keeps no device copy."""

    ROOT = -1
    """Prefix node of the empty prefix."""

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and recorded ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks recorded for prefix caching (held or evictable)."""
        return len(self._block_node)

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
        """``count`` blocks with one reference each: free ones first, then the least recently released recorded
        ones (their records dropped)."""
        new = []
        for _ in range(count):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._node_block[self._block_node.pop(b)]
            self._refs[b] = 1
            new.append(b)
        return new

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` cache slots for positions ``[0, num_tokens)``; ``False`` (nothing changed) if blocks run out."""
        if num_tokens <= len(seq.block_table) * self.block_size:
            return True
        need = self.missing(seq, num_tokens)
        if need > self.num_free:
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
        if partial and not self.num_free:
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
            for b in released:
                if b in self._block_node:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
            seq.block_table = []
        self.release_row(seq)
        seq.cache_node, seq.cache_blocks = self.ROOT, 0

    def release_row(self, seq: Sequence) -> None:
        """Give back ``seq``'s table row (if it holds one), keeping its blocks: a finished sequence kept for its
        siblings to fork from (:meth:`fork` reads its block list, not its row) must not hold a row that a running
        sequence needs."""
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def check_released(self) -> None:
        """Raise ``RuntimeError`` unless every block and table row is back (call once every sequence is freed). A
        block or row kept by mistake would only shrink the cache for the rest of the call, showing as preemptions."""
        rows = self.max_rows - len(self._free_rows)
        if rows or self.num_free != self.num_blocks or any(self._refs):
            held = [b for b, r in enumerate(self._refs) if r]
            raise RuntimeError(
                f"KV block bookkeeping leaked: {len(held)} blocks still referenced (first {held[:8]}), {rows} table "
                f"rows held, {self.num_free} of {self.num_blocks} blocks allocatable after every sequence was freed; "
                "this is a bug in rlexact's scheduler or block manager, please report it with the generator config"
            )

    def _node(self, parent: int, tokens: list[int], index: int, create: bool) -> int | None:
        """The prefix node of block ``index`` of ``tokens`` below ``parent`` (created when missing and ``create``)."""
        bs = self.block_size
        key = (parent, tuple(tokens[index * bs : (index + 1) * bs]))
        node = self._nodes.get(key)
        if node is None and create:
            node = self._nodes[key] = len(self._nodes)
        return node

    def register(self, seq: Sequence) -> None:
        """Record ``seq``'s full blocks whose K/V are all written (positions below ``num_computed``) for prefix
        caching. A prefix already recorded in another block keeps that block."""
        full = min(seq.num_computed, len(seq.block_table) * self.block_size) // self.block_size
        i = seq.cache_blocks
        if i >= full:
            return
        node = seq.cache_node
        while i < full:
            node = self._node(node, seq.tokens, i, create=True)
            b = seq.block_table[i]
            if node not in self._node_block and b not in self._block_node:
                self._node_block[node] = b
                self._block_node[b] = node
            i += 1
        seq.cache_node, seq.cache_blocks = node, i

    def match(self, seq: Sequence) -> int:
        """Give ``seq`` (holding no blocks) references to the recorded blocks of its longest recorded token prefix of
        whole blocks, leaving at least its last token to compute; returns the number of positions they hold."""
        if seq.block_table or seq.row >= 0:
            raise RuntimeError("match: the sequence already holds blocks")
        node, blocks = self.ROOT, []
        for i in range((len(seq.tokens) - 1) // self.block_size):
            nxt = self._node(node, seq.tokens, i, create=False)
            b = self._node_block.get(nxt) if nxt is not None else None
            if b is None:
                break
            node = nxt
            blocks.append(b)
        if not blocks:
            return 0
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        self._append(seq, blocks)
        seq.cache_node, seq.cache_blocks = node, len(blocks)
        return len(blocks) * self.block_size

    def take_updates(self) -> list[tuple[int, int, int]]:
        """The ``(row, column, block)`` table writes since the last call (and forget them)."""
        out, self.updates = self.updates, []
        return out
