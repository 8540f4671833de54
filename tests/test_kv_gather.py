"""``rlexact.ops.kv_gather``: paged K/V copied into per-sequence rows in position order (CPU; the GPU bits of the
gathered attention launch are checked in ``test_triton_attention.py``)."""

from __future__ import annotations

import pytest
import torch

from rlexact.ops import kv_gather


def _paged(lens: list[int], page: int, hkv: int = 2, d: int = 8) -> tuple[torch.Tensor, ...]:
    """Caches with each sequence's pages shuffled over the cache, tables whose entries past a sequence are garbage
    (-1 and an index past the cache), and the expected rows ``[B, rows, Hkv, D]`` built position by position."""
    g = torch.Generator().manual_seed(0)
    nblk = [-(-n // page) for n in lens]
    kc, vc = (torch.randn(sum(nblk) + 1, page, hkv, d, generator=g) for _ in "kv")
    perm = torch.randperm(sum(nblk) + 1, generator=g)
    width = max(nblk) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    tables[:, -1] = 10**6
    used = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[used : used + n]
        used += n
    rows = width * page
    want_k = torch.zeros(len(lens), rows, hkv, d)
    want_v = torch.zeros(len(lens), rows, hkv, d)
    for b, n in enumerate(lens):
        for p in range(n):
            blk, off = int(tables[b, p // page]), p % page
            want_k[b, p], want_v[b, p] = kc[blk, off], vc[blk, off]
    return kc, vc, tables, torch.tensor(lens, dtype=torch.int32), want_k, want_v


def test_gather_copies_each_sequence_in_position_order() -> None:
    lens = [1, 15, 16, 17, 40, 0]
    page = 16
    kc, vc, tables, seqlens, want_k, want_v = _paged(lens, page)
    rows = tables.shape[1] * page
    k, v = kv_gather.gather(kc, vc, tables, seqlens, rows)
    assert k.shape == (len(lens) * rows, *kc.shape[2:])
    k, v = k.view(len(lens), rows, *kc.shape[2:]), v.view(len(lens), rows, *kc.shape[2:])
    for b, n in enumerate(lens):
        assert torch.equal(k[b, :n], want_k[b, :n]) and torch.equal(v[b, :n], want_v[b, :n])
        assert torch.equal(k[b, n:], kc[0, 0].expand_as(k[b, n:]))  # past the keys: cache row 0, never a table entry
    short = kv_gather.gather(kc, vc, tables, seqlens, 48)[0].view(len(lens), 48, *kc.shape[2:])
    assert torch.equal(short[4, :40], want_k[4, :40])  # fewer rows: the same keys, the same positions
    swapped = tables.clone()
    swapped[4, [0, 1]] = tables[4, [1, 0]]  # negative control: another page order moves the keys
    k2 = kv_gather.gather(kc, vc, swapped, seqlens, rows)[0].view(len(lens), rows, *kc.shape[2:])
    assert not torch.equal(k2[4, :40], want_k[4, :40])


def test_gather_rejects_bad_rows_and_caches() -> None:
    kc, vc, tables, seqlens, _, _ = _paged([5, 20], 16)
    with pytest.raises(ValueError, match="rows 0 must be in"):
        kv_gather.gather(kc, vc, tables, seqlens, 0)
    with pytest.raises(ValueError, match="block-table width"):
        kv_gather.gather(kc, vc, tables, seqlens, tables.shape[1] * 16 + 1)
    with pytest.raises(ValueError, match="contiguous"):
        kv_gather.gather(kc.transpose(2, 3), vc, tables, seqlens, 16)


def test_chosen_needs_many_queries_per_sequence_and_a_bounded_buffer() -> None:
    n = kv_gather.MIN_MEAN_QUERIES
    assert kv_gather.chosen(4 * n, 4, 8192, 2048)
    assert not kv_gather.chosen(4 * n - 1, 4, 8192, 2048)
    assert not kv_gather.chosen(1, 1, 16, 2048)  # a decode row
    rows = kv_gather.MAX_BYTES // (2 * 4 * 2048)
    assert kv_gather.chosen(4 * n, 4, rows, 2048) and not kv_gather.chosen(4 * n, 4, rows + 1, 2048)
