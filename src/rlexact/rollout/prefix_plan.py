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

    @property
    def tiles_saved(self) -> int:
        """Key tiles per KV head and layer that the step does not read again: each group's tiles, read once instead
        of once per member."""
        return sum(t * (len(g) - 1) for g, t in zip(self.groups, self.tiles))


def plan_shared_prefix(
    tables: list[list[int]], positions: list[int], prompt_lens: list[int], block_size: int, capacity: int
) -> PrefixPlan:
    """Group the rows of a decode step that hold their prompts' first tiles in the same cache blocks.

    ``tables[i]``: batch row ``i``'s cache blocks in position order; ``positions[i]``: the position of the token it
    feeds this step (its keys are ``0 .. positions[i]``); ``prompt_lens[i]``: its prompt's tokens. A row's candidate
    tiles are the whole tiles of its prompt before its position (only prompt blocks are held by several sequences:
    forked samples, prefix-cache hits), so it keeps at least one tile of its own; rows whose candidate tiles are the
    same blocks form a group, of at most ``capacity`` rows (:func:`rlexact.ops.group_capacity`). A row left alone,
    and every row when ``block_size`` does not divide a tile, walks all its tiles itself.
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
    by_blocks: dict[tuple[int, ...], list[int]] = {}
    for i, (table, pos, prompt) in enumerate(zip(tables, positions, prompt_lens)):
        t = min(pos, prompt) // TILE_KEYS
        if t > 0 and len(table) >= t * per_tile:
            by_blocks.setdefault(tuple(table[: t * per_tile]), []).append(i)
    for blocks, rows in by_blocks.items():
        for c in range(0, len(rows) - 1, capacity):
            chunk = rows[c : c + capacity]
            if len(chunk) < 2:
                continue
            groups.append(chunk)
            tiles.append(len(blocks) // per_tile)
            for i in chunk:
                start[i] = tiles[-1]
    return PrefixPlan(start, groups, tiles)
