"""Which sequences of a decode step share their first key tiles (the same cache blocks), so that the exact decode
attention reads those tiles once per group (:class:`rlexact.ops.SharedPrefix`): the ``n`` samples of a prompt, or
prompts that prefix caching gave the same leading blocks."""

from __future__ import annotations

from dataclasses import dataclass

TILE_KEYS = 64
"""Keys per tile of the exact attention (the shared prefix is a whole number of them)."""


@dataclass(frozen=True)
class PrefixPlan:
    """A decode step's groups. ``start[i]``: the first key tile batch row ``i`` reads itself (``0``: it shares none);
    ``groups[g]``: the batch rows of group ``g`` (at least two); ``tiles[g]``: the tiles they share."""

    start: list[int]
    groups: list[list[int]]
    tiles: list[int]

    def subset(self, rows: list[int]) -> PrefixPlan:
        """The plan of a later step whose row ``i`` is row ``rows[i]`` of this one (the others finished): each
        group keeps its members that run, and its tiles (they do not depend on the position once shared); a member
        left alone walks all its tiles itself."""
        new_of = {old: new for new, old in enumerate(rows)}
        start = [self.start[r] for r in rows]
        groups: list[list[int]] = []
        tiles: list[int] = []
        for members, t in zip(self.groups, self.tiles):
            kept = [new_of[r] for r in members if r in new_of]
            if len(kept) > 1:
                groups.append(kept)
                tiles.append(t)
            else:
                for r in kept:
                    start[r] = 0
        return PrefixPlan(start, groups, tiles)

    @property
    def tiles_saved(self) -> int:
        """Key tiles per KV head and layer that the step does not read again: each group's tiles, read once instead
        of once per member."""
        return sum(t * (len(g) - 1) for g, t in zip(self.groups, self.tiles))


class _Node:
    """A trie node: the rows whose first ``depth`` tiles are the same blocks, and the tiles that follow."""

    __slots__ = ("children", "depth", "rows")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.rows: list[int] = []
        self.children: dict[int, _Node] = {}


def _best(node: _Node, capacity: int) -> tuple[int, list[_Node]]:
    """``(tiles saved, nodes whose rows form groups)`` of the best split of ``node``'s subtree: its rows grouped at
    its depth (in groups of at most ``capacity``), or each child's best; a tie keeps the shallower, fewer groups."""
    below = [_best(c, capacity) for c in node.children.values() if len(c.rows) > 1]
    deeper = sum(b[0] for b in below), [n for b in below for n in b[1]]
    n = len(node.rows)
    here = node.depth * (n - -(-n // capacity)) if node.depth else 0
    return (here, [node]) if here and here >= deeper[0] else deeper


def plan_shared_prefix(
    tables: list[list[int]], positions: list[int], prompt_lens: list[int], block_size: int, capacity: int
) -> PrefixPlan:
    """Group the rows of a decode step that hold their prompts' first tiles in the same cache blocks.

    ``tables[i]``: batch row ``i``'s cache blocks in position order; ``positions[i]``: the position of the token it
    feeds this step (its keys are ``0 .. positions[i]``); ``prompt_lens[i]``: its prompt's tokens. A row's candidate
    tiles are the whole tiles of its prompt before its position (only prompt blocks are held by several sequences:
    forked samples, prefix-cache hits), so it keeps at least one tile of its own. Rows are grouped at the depth (in
    tiles) that saves the most tile reads: the samples of a prompt at its depth, or all prompts behind a shared
    system prefix at that prefix's, whichever reads less. A group holds at most ``capacity`` rows
    (:func:`rlexact.ops.group_capacity`) and every member's table holds its first member's blocks there; a row left
    alone, and every row when ``block_size`` does not divide a tile, walks all its tiles itself.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if not len(tables) == len(positions) == len(prompt_lens):
        raise ValueError(f"{len(tables)} block tables, {len(positions)} positions, {len(prompt_lens)} prompt lengths")
    start = [0] * len(tables)
    groups: list[list[int]] = []
    tiles: list[int] = []
    if TILE_KEYS % block_size or capacity < 2:
        return PrefixPlan(start, groups, tiles)
    per_tile = TILE_KEYS // block_size
    root = _Node(0)
    for i, (table, pos, prompt) in enumerate(zip(tables, positions, prompt_lens)):
        node = root
        for t in range(min(min(pos, prompt) // TILE_KEYS, len(table) // per_tile)):
            last = table[(t + 1) * per_tile - 1]  # shared blocks come as prefixes: checked whole below
            node = node.children.setdefault(last, _Node(t + 1))
            node.rows.append(i)
    for node in _best(root, capacity)[1]:
        n = node.depth * per_tile
        lead = tables[node.rows[0]][:n]
        rows = [i for i in node.rows if tables[i][:n] == lead]
        for c in range(0, len(rows) - 1, capacity):
            chunk = rows[c : c + capacity]
            if len(chunk) < 2:
                continue
            groups.append(chunk)
            tiles.append(node.depth)
            for i in chunk:
                start[i] = node.depth
    return PrefixPlan(start, groups, tiles)
