"""The shared-prefix plan of a decode step (``rlexact.rollout.prefix_plan``) and its device-side container."""

from __future__ import annotations

import pytest
import torch

from rlexact.ops import SharedPrefix, group_capacity
from rlexact.rollout.prefix_plan import TILE_KEYS, plan_shared_prefix


def blocks(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_samples_of_a_prompt_share_its_whole_tiles() -> None:
    """Eight samples of a 520-token prompt (32 full 16-token pages, then each sample's own copy of the partial one)
    share its 8 whole tiles; a row of another prompt and a row without a whole tile before its position walk alone."""
    prompt = blocks(100, 32)
    tables = [prompt + [200 + i, 300 + i] for i in range(8)] + [blocks(500, 20), blocks(600, 4)]
    positions = [520 + i for i in range(8)] + [300, 63]
    plan = plan_shared_prefix(tables, positions, [520] * 8 + [300, 60], 16, 32)
    assert plan.groups == [list(range(8))] and plan.tiles == [8]
    assert plan.start == [8] * 8 + [0, 0]
    assert plan.tiles_saved == 8 * 7


def test_shared_tiles_stop_before_the_position_and_the_prompt() -> None:
    """A row keeps at least one tile of its own: a sample feeding its prompt's last token at position 128 shares two
    tiles, not three. Grouped at two tiles the four samples save more reads (2 x 3) than in two groups at three and
    two tiles (3 + 2), and more than with the row that shares one tile (1 x 4)."""
    prompt = blocks(0, 12)  # a 192-token prompt: three whole tiles
    tables = [prompt + [50], prompt + [51], prompt, prompt + [52], prompt[:4] + [60, 61, 62, 63]]
    positions = [192, 193, 128, 130, 140]
    plan = plan_shared_prefix(tables, positions, [192, 192, 129, 192, 192], 16, 8)
    assert plan.groups == [[0, 1, 2, 3]] and plan.tiles == [2]
    assert plan.start == [2, 2, 2, 2, 0] and plan.tiles_saved == 6


def test_forked_samples_share_the_tiles_before_their_copied_page() -> None:
    """Samples forked at the last prompt token (a 512-token prompt) hold copies of its last page, so the first
    sample and its forks share 7 tiles, not 8; prompts behind a shared 2-tile system prefix are grouped per prompt,
    where that saves more, and across prompts where it does not."""
    system = blocks(0, 8)
    tables = []
    for p in range(3):
        prompt = system + blocks(100 * (p + 1), 24)  # 32 full pages; the forks copy page 31
        tables += [prompt + [1000 + 10 * p]] + [prompt[:31] + [2000 + 10 * p + i, 3000 + i] for i in range(3)]
    positions = [512, 511, 511, 511] * 3
    plan = plan_shared_prefix(tables, positions, [512] * 12, 16, 32)
    assert plan.groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] and plan.tiles == [7, 7, 7]
    short = [system + [500 + r] for r in range(6)]  # six prompts of 144 tokens: two shared tiles, one row each
    plan = plan_shared_prefix(short, [144] * 6, [144] * 6, 16, 32)
    assert plan.groups == [list(range(6))] and plan.tiles == [2] and plan.tiles_saved == 10


def test_groups_hold_at_most_capacity_rows() -> None:
    """Twenty samples of one prompt with room for eight per group: groups of 8, 8 and 4; with 17 the last row is
    alone. Page sizes that do not divide a tile give no groups."""
    tables = [blocks(0, 8) + [100 + i] for i in range(20)]
    plan = plan_shared_prefix(tables, [128] * 20, [128] * 20, 16, 8)
    assert [len(g) for g in plan.groups] == [8, 8, 4] and plan.start == [2] * 20
    plan = plan_shared_prefix(tables[:17], [128] * 17, [128] * 17, 16, 8)
    assert [len(g) for g in plan.groups] == [8, 8] and plan.start == [2] * 16 + [0]
    assert not plan_shared_prefix(tables, [128] * 20, [128] * 20, 48, 8).groups
    assert not plan_shared_prefix(tables, [128] * 20, [128] * 20, 16, 1).groups


def test_subset_keeps_the_groups_of_the_rows_that_run() -> None:
    """After some rows finish, each group keeps its running members at its depth; a member left alone starts at 0.
    Planned anew, the same rows give the same plan here."""
    prompt = blocks(0, 8)
    tables = [prompt + [100 + i] for i in range(4)] + [blocks(50, 8) + [200 + i] for i in range(3)]
    plan = plan_shared_prefix(tables, [130] * 7, [128] * 7, 16, 8)
    assert plan.groups == [[0, 1, 2, 3], [4, 5, 6]] and plan.tiles == [2, 2]
    rows = [6, 1, 3, 4]  # rows 0, 2 and 5 finished; the order changes too
    sub = plan.subset(rows)
    assert sub.groups == [[1, 2], [3, 0]] and sub.tiles == [2, 2] and sub.start == [2, 2, 2, 2]
    anew = plan_shared_prefix([tables[r] for r in rows], [131] * 4, [128] * 4, 16, 8)
    assert sorted(map(sorted, anew.groups)) == sorted(map(sorted, sub.groups)) and anew.start == sub.start
    alone = plan.subset([0, 4])
    assert not alone.groups and alone.start == [0, 0] and alone.tiles_saved == 0


def test_plan_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="positions"):
        plan_shared_prefix([[1]], [], [1], 16, 8)
    with pytest.raises(ValueError, match="capacity"):
        plan_shared_prefix([[1]], [1], [1], 16, 0)


def test_group_capacity_fills_the_decode_tile() -> None:
    """A group's members times the query heads of one tile fill 64 rows: Qwen3-1.7B's 16 / 8 heads take 32 members."""
    assert group_capacity(16, 8) == 32 and group_capacity(32, 4) == 8 and group_capacity(8, 8) == 64
    assert group_capacity(24, 8) == 21  # three heads per tile
    assert TILE_KEYS == 64
    with pytest.raises(ValueError, match="multiple"):
        group_capacity(12, 8)


def test_shared_prefix_validates() -> None:
    i32 = torch.int32
    ok = dict(start=torch.zeros(4, dtype=i32), members=torch.full((2, 8), -1, dtype=i32),
              tiles=torch.zeros(2, dtype=i32), count=torch.zeros(1, dtype=i32))  # fmt: skip
    SharedPrefix(**ok)
    with pytest.raises(ValueError, match="int32"):
        SharedPrefix(**(ok | {"start": torch.zeros(4, dtype=torch.int64)}))
    with pytest.raises(ValueError, match="members"):
        SharedPrefix(**(ok | {"members": torch.full((3, 8), -1, dtype=i32)}))
    with pytest.raises(ValueError, match="count"):
        SharedPrefix(**(ok | {"count": torch.zeros(2, dtype=i32)}))
