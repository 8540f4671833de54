"""Prefix caching inside a generate call (CPU): full KV blocks found again by their exact token prefix give bitwise
the completions of a run that computes them, under chunked prefill, preemption, evictions and shuffled pages; the
block manager's records, references and eviction order."""

from __future__ import annotations

import pytest
import torch

import rlexact
from models import assert_same_completions, assert_trainer_logprobs, prompts_for, tiny_model
from rlexact.rollout import Generator, SamplingParams
from rlexact.rollout.block_manager import BlockManager
from rlexact.rollout.sequence import Sequence


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    model = tiny_model("qwen3", hidden=48, intermediate=88, kv_heads=2, max_pos=128, weight_scale=2.5, seed=4)
    return rlexact.exactify(model)


def _computed(seq: Sequence, bm: BlockManager, n: int) -> Sequence:
    assert bm.ensure(seq, n)
    seq.num_computed = n
    return seq


def test_block_manager_records_matches_and_evicts_least_recent() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, max_rows=5, width=4)
    a = _computed(Sequence(0, list(range(10)), 0, 0, 4), bm, 10)  # two full blocks and a partial one
    bm.register(a)
    assert bm.num_cached == 2 and a.cache_blocks == 2
    bm.register(a)  # idempotent
    assert bm.num_cached == 2
    b = Sequence(1, [*range(9), 77], 1, 1, 4)
    assert bm.match(b) == 8 and b.block_table == a.block_table[:2]
    c = Sequence(2, [0, 1, 2, 99, *range(4, 10)], 2, 2, 4)  # differs in the first block's last token
    assert bm.match(c) == 0 and c.block_table == [] and c.row == -1
    d = Sequence(3, list(range(8)), 3, 3, 4)  # two whole blocks, but its last token must be computed: one block
    assert bm.match(d) == 4 and d.block_table == a.block_table[:1]
    assert bm.table[b.row, :2].tolist() == b.block_table
    first, second = a.block_table[:2]
    for s in (b, d, a):
        bm.free(s)
    assert bm.num_free == 6 and bm.num_cached == 2  # recorded blocks stay, evictable
    e = Sequence(4, [5] * 16, 4, 4, 0)
    assert bm.ensure(e, 16)  # the four unrecorded blocks first
    assert bm.num_cached == 2 and first not in e.block_table and second not in e.block_table
    f = Sequence(5, [6] * 4, 5, 5, 0)
    assert bm.ensure(f, 4) and f.block_table == [first]  # then the least recently released recorded block
    assert bm.num_cached == 1
    g = Sequence(6, list(range(10)), 6, 6, 4)
    assert bm.match(g) == 0  # its first block's record is gone, so the second is unreachable
    bm.free(e)
    bm.free(f)
    assert bm.num_free == 6 and bm.num_cached == 1
    h, i = Sequence(7, [7] * 16, 7, 7, 0), Sequence(8, [8] * 8, 8, 8, 0)
    assert bm.ensure(h, 16) and second not in h.block_table
    assert bm.ensure(i, 8) and second in i.block_table  # the last free block, then the evictable one
    assert bm.num_cached == 0 and bm.num_free == 0


def test_preempted_sequence_finds_its_own_blocks() -> None:
    """A sequence freed (preempted) after its blocks were recorded gets them back, generated tokens included."""
    bm = BlockManager(num_blocks=8, block_size=4, max_rows=2, width=4)
    s = _computed(Sequence(0, list(range(6)), 0, 0, 8), bm, 6)
    s.tokens += [40, 41, 42, 43, 44]  # five generated tokens, the last one not fed yet
    assert bm.ensure(s, 10)
    s.num_computed = 10
    bm.register(s)
    held = list(s.block_table)
    bm.free(s)
    s.num_computed = 0
    assert bm.match(s) == 8 and s.block_table == held[:2]


def _cached_and_uncached(model, prompts, params, **kw) -> tuple[Generator, Generator]:  # noqa: ANN001
    """Generate with and without prefix caching (other settings ``kw``), check the completions are bitwise the same
    and equal to the trainer's, and return both generators (their ``stats``)."""
    cached, plain = Generator(model, **kw), Generator(model, prefix_caching=False, **kw)
    outs = cached.generate(prompts, params)
    assert_same_completions(outs, plain.generate(prompts, params))
    assert_trainer_logprobs(model, outs)
    return cached, plain


def test_prefix_caching_equals_uncached_and_trainer(qwen) -> None:
    """Prompts sharing a 21-token prefix (and one that is a prefix of the others), n = 2: the cached run computes
    fewer prompt positions and gives bitwise the completions of the uncached run."""
    prefix = prompts_for(1, 97, lo=21, hi=21, seed=5)[0]
    prompts = [prefix + s for s in prompts_for(6, 97, lo=1, hi=9, seed=6)] + [prefix[:13]]
    params = SamplingParams(max_new_tokens=6, seed=3, n=2)
    cached, plain = _cached_and_uncached(qwen, prompts, params, block_size=4, max_num_batched_tokens=40)
    hits = cached.stats["prefix_cached_tokens"]
    assert hits >= 4 * 20 and hits % 4 == 0 and plain.stats["prefix_cached_tokens"] == 0
    assert cached.stats["prefill_tokens"] == plain.stats["prefill_tokens"] - hits
    assert cached.stats["prompt_forks"] == plain.stats["prompt_forks"] == len(prompts)


def test_prompts_admitted_together_compute_a_shared_prefix_once(qwen) -> None:
    """Prompts with a common 8-token prefix that one step could admit together: the first computes the prefix, the
    others wait a step and take both of its blocks; bitwise the uncached completions. Without the wait they would
    all compute it side by side (no hit at all)."""
    prefix = prompts_for(1, 97, lo=8, hi=8, seed=12)[0]
    prompts = [prefix + s for s in prompts_for(5, 97, lo=2, hi=6, seed=13)]
    params = SamplingParams(max_new_tokens=5, seed=6)
    gen, plain = _cached_and_uncached(qwen, prompts, params, block_size=4, max_num_batched_tokens=256)
    assert gen.stats["prefix_cached_tokens"] == 4 * 8
    assert gen.stats["prefill_tokens"] == plain.stats["prefill_tokens"] - 4 * 8


def test_prefix_caching_with_preemption_evictions_and_shuffled_pages(qwen) -> None:
    prefix = prompts_for(1, 97, lo=12, hi=12, seed=9)[0]
    prompts = [prefix + s for s in prompts_for(5, 97, lo=2, hi=8, seed=10)]
    params = SamplingParams(max_new_tokens=8, seed=4, n=2)
    gen = Generator(qwen, num_kv_blocks=14, block_size=4, max_num_batched_tokens=24, shuffle_blocks=True)
    outs = gen.generate(prompts, params)
    assert gen.stats["preemptions"] > 0 and gen.stats["prefix_cached_tokens"] > 0
    roomy = Generator(qwen, block_size=8, share_prompt_blocks=False, prefix_caching=False).generate(prompts, params)
    assert all(o.num_preemptions == 0 for o in roomy)
    assert_same_completions(outs, roomy)
    assert_trainer_logprobs(qwen, outs)


def test_negative_control_prefix_key_missing_a_token(qwen, monkeypatch) -> None:
    """Keying blocks on all but their last token lets a prompt that differs there take another prompt's block: its
    log-probs change, so the equalities above can fail."""
    first = prompts_for(1, 97, lo=12, hi=12, seed=11)[0]
    second = [*first[:3], (first[3] + 1) % 97, *first[4:]]  # differs at the last position of the first block
    params = SamplingParams(max_new_tokens=4, seed=2)
    kw = {"block_size": 4, "max_num_batched_tokens": 12}  # the first prompt prefills alone, the second one later
    good = Generator(qwen, **kw).generate([first, second], params)
    assert_trainer_logprobs(qwen, good)
    original = BlockManager._node

    def loose(self, parent, tokens, index, create):  # noqa: ANN001, ANN202
        bs = self.block_size
        return original(self, parent, [*tokens[: (index + 1) * bs - 1], 0], index, create)

    monkeypatch.setattr(BlockManager, "_node", loose)
    gen = Generator(qwen, **kw)
    bad = gen.generate([first, second], params)
    assert gen.stats["prefix_cached_tokens"] > 0
    assert torch.equal(bad[0].logprobs, good[0].logprobs)
    assert not torch.equal(bad[1].logprobs, good[1].logprobs)
