"""Prompt blocks shared by the ``n`` samples of a prompt (CPU): bitwise the same completions as without sharing,
log-probs equal to the trainer's, under chunked prefill, preemption and shuffled pages; block reference counts."""

from __future__ import annotations

import pytest
import torch

import rlexact
from models import assert_same_completions, assert_trainer_logprobs, prompts_for, tiny_model
from rlexact.rollout import Generator, SamplingParams
from rlexact.rollout.block_manager import BlockManager
from rlexact.rollout.runner import ModelRunner
from rlexact.rollout.sequence import Sequence, Status


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    model = tiny_model("qwen3", hidden=48, intermediate=88, kv_heads=2, max_pos=128, weight_scale=2.5, seed=4)
    return rlexact.exactify(model)


def test_block_manager_refcounts_and_copy_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, max_rows=3, width=4)
    a, b, c = (Sequence(i, [1] * 11, i, 0, 4) for i in range(3))
    assert bm.ensure(a, 11) and len(a.block_table) == 3
    assert bm.fork(a, b, 10) == (a.block_table[2], b.block_table[2])  # 2 full blocks shared, the 3rd copied
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert bm.fork(a, c, 8) == (-1, -1)  # block-aligned: nothing to copy
    assert bm.num_free == 8 - 4
    assert bm.table[b.row, :3].tolist() == b.block_table
    bm.free(a)
    assert bm.num_free == 8 - 3  # only a's unshared third block came back
    bm.free(b)
    assert bm.num_free == 8 - 2  # c still holds the two shared blocks
    bm.free(c)
    assert bm.num_free == 8
    ups = bm.take_updates()
    assert len(ups) == 3 + 3 + 2 and bm.take_updates() == []


def test_shared_prompts_equal_unshared_and_trainer(qwen) -> None:
    """n = 4 samples of 5 prompts: the prompt is prefilled once per prompt and every completion is bitwise the one
    computed without sharing (chunked prefill mixes the forks with decodes and prefill chunks)."""
    prompts = prompts_for(5, 97, lo=6, hi=30, seed=3)
    params = SamplingParams(max_new_tokens=6, seed=7, n=4)
    kw = {"block_size": 4, "max_num_batched_tokens": 32}
    shared = Generator(qwen, **kw)
    outs = shared.generate(prompts, params)
    plain = Generator(qwen, share_prompt_blocks=False, prefix_caching=False, **kw)
    ref = plain.generate(prompts, params)
    assert_same_completions(outs, ref)
    assert_trainer_logprobs(qwen, outs)
    requested = sum(len(p) for p in prompts) * 4
    assert shared.stats["prompt_tokens"] == plain.stats["prompt_tokens"] == requested
    assert shared.stats["prompt_forks"] == 5 * 3 and plain.stats["shared_prompt_tokens"] == 0
    assert shared.stats["shared_prompt_tokens"] == sum(len(p) - 1 for p in prompts) * 3
    assert plain.stats["prefill_tokens"] == requested
    assert shared.stats["prefill_tokens"] == requested - shared.stats["shared_prompt_tokens"]


def test_shared_prompts_with_preemption_and_shuffled_pages(qwen) -> None:
    prompts = prompts_for(3, 97, lo=5, hi=12, seed=8)
    params = SamplingParams(max_new_tokens=6, seed=2, n=3)
    gen = Generator(qwen, num_kv_blocks=9, block_size=4, max_num_batched_tokens=20, shuffle_blocks=True)
    outs = gen.generate(prompts, params)
    assert gen.stats["preemptions"] > 0 and gen.stats["prompt_forks"] > 0
    roomy = Generator(qwen, block_size=8, share_prompt_blocks=False).generate(prompts, params)
    assert all(o.num_preemptions == 0 for o in roomy)
    assert_same_completions(outs, roomy)
    assert_trainer_logprobs(qwen, outs)


def _first_token_stops(qwen, prompts, n, monkeypatch=None, **kw):
    """Greedy ``n`` samples per prompt that all stop at their first token (the stop set is each prompt's greedy
    first token), with and without prompt sharing; returns both generators and results."""
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    first = Generator(qwen, share_prompt_blocks=False).generate(prompts, greedy)
    stop = sorted({o.token_ids[0] for o in first})
    params = SamplingParams(max_new_tokens=5, temperature=0.0, n=n, stop_token_ids=stop)
    shared = Generator(qwen, block_size=4, **kw)
    outs = shared.generate(prompts, params)
    plain = Generator(qwen, block_size=4, share_prompt_blocks=False, prefix_caching=False, **kw)
    ref = plain.generate(prompts, params)
    assert all(o.finish_reason == "stop" and len(o.token_ids) == 1 for o in outs)
    return shared, outs, ref


def test_samples_fork_from_a_sibling_that_stopped_at_its_first_token(qwen) -> None:
    """A sample that stops at its first token keeps its prompt blocks until its waiting siblings forked from them:
    the prompt is prefilled once, in one step with the first token, not once per sample in a step each."""
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]]
    shared, outs, ref = _first_token_stops(qwen, prompts, n=12)
    assert_same_completions(outs, ref)
    assert_trainer_logprobs(qwen, outs)
    assert shared.stats["steps"] == 2 and shared.stats["prompt_forks"] == 11
    assert shared.stats["prefill_tokens"] == len(prompts[0]) + 11


def test_negative_control_siblings_without_a_donor(qwen, monkeypatch) -> None:
    """Releasing a finished sample's blocks at once (no donor) makes each waiting sibling prefill the prompt again,
    one step each: the counts above would fail."""
    from rlexact.rollout.scheduler import Scheduler

    def finish_at_once(self, seq, reason):
        seq.finish_reason, seq.status = reason, Status.FINISHED
        self._stop(seq)

    monkeypatch.setattr(Scheduler, "finish", finish_at_once)
    shared, outs, ref = _first_token_stops(qwen, [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]], n=12)
    assert_same_completions(outs, ref)
    assert shared.stats["steps"] == 12 and shared.stats["prompt_forks"] == 0


def test_donors_hold_no_row_and_give_way_to_preemption(qwen) -> None:
    """Donors under two sequence slots (their table rows are given back at once) and a cache of a few blocks (they
    are released before any running sample is preempted): the same completions as unshared, every block back."""
    prompts = prompts_for(3, 97, lo=5, hi=12, seed=8)
    shared, outs, ref = _first_token_stops(qwen, prompts, n=4, max_num_seqs=2)
    assert_same_completions(outs, ref)
    assert shared.stats["prompt_forks"] == 3 * 3
    params = SamplingParams(max_new_tokens=6, seed=5, n=4, stop_token_ids=list(range(0, 97, 11)))
    tight = Generator(qwen, num_kv_blocks=9, block_size=4, max_num_batched_tokens=20, shuffle_blocks=True)
    outs = tight.generate(prompts, params)
    assert tight.stats["preemptions"] > 0 and tight.stats["prompt_forks"] > 0
    assert any(len(o.token_ids) == 1 for o in outs) and any(len(o.token_ids) > 1 for o in outs)
    roomy = Generator(qwen, block_size=8, share_prompt_blocks=False).generate(prompts, params)
    assert_same_completions(outs, roomy)
    assert_trainer_logprobs(qwen, outs)


def test_negative_control_without_copy_on_write(qwen, monkeypatch) -> None:
    """Skipping the copy of the partial prompt block leaves forked samples reading stale slots: their log-probs
    change, so the equalities above can fail. The exact path's cache is uninitialized memory (which may still hold
    an earlier call's identical K/V), so both runs poison it with NaN first."""
    import rlexact.rollout.engine as engine_mod

    class NanCache(engine_mod.KVCache):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.data.fill_(float("nan"))

    monkeypatch.setattr(engine_mod, "KVCache", NanCache)
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]]  # 9 shared positions, block 4: a partial third block
    params = SamplingParams(max_new_tokens=4, seed=1, n=3)
    good = Generator(qwen, block_size=4).generate(prompts, params)
    assert_trainer_logprobs(qwen, good)
    monkeypatch.setattr(ModelRunner, "_copy_blocks", lambda self, copies: None)
    bad = Generator(qwen, block_size=4).generate(prompts, params)
    assert torch.equal(bad[0].logprobs, good[0].logprobs)  # the sample that prefilled is unaffected
    assert any(not torch.equal(x.logprobs, y.logprobs) for x, y in zip(bad[1:], good[1:]))


def test_block_copies_apply_in_order() -> None:
    """Copy-on-write copies of one step that chain (a block copied from a block filled by an earlier copy) are
    applied in order; independent copies in one batched gather/scatter."""
    from types import SimpleNamespace

    data = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).reshape(2, 2, 4, 3)  # [layers, k/v, blocks, slots]
    fake = SimpleNamespace(cache=SimpleNamespace(data=data.clone()), _to_device=lambda t: t)
    ModelRunner._copy_blocks(fake, [(0, 1), (1, 2)])
    for blk in (1, 2):
        assert torch.equal(fake.cache.data[:, :, blk], data[:, :, 0])
    fake.cache.data = data.clone()
    ModelRunner._copy_blocks(fake, [(0, 2), (1, 3)])
    assert torch.equal(fake.cache.data[:, :, 2:], data[:, :, :2])


def test_device_block_table_sync_last_write_wins() -> None:
    """The decode graphs' copy of the block table follows the block manager through frees and reused rows: the
    incremental sync applies the last write of an entry written twice since the previous sync."""
    from types import SimpleNamespace

    bm = BlockManager(num_blocks=16, block_size=4, max_rows=3, width=4)
    fake = SimpleNamespace(bm=bm, _table_synced=False, _to_device=lambda t: t)
    gs = SimpleNamespace(table=torch.full((4, 4), -1, dtype=torch.int32))
    a, b, c = (Sequence(i, [1] * 9, i, 0, 4) for i in range(3))
    assert bm.ensure(a, 8)
    ModelRunner._sync_table(fake, gs)  # first sync: the whole table
    assert torch.equal(gs.table[:3], bm.table)
    bm.free(a)
    assert bm.ensure(b, 12) and b.row == 0  # a's row again, other blocks: entries (0, 0), (0, 1) rewritten
    assert bm.fork(b, c, 9) != (-1, -1)
    ModelRunner._sync_table(fake, gs)
    assert torch.equal(gs.table[:3], bm.table) and gs.table[3].eq(-1).all()
