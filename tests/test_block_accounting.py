"""KV block bookkeeping under random engine loads (CPU): every ``generate`` and ``score`` call ends with every cache
block and block-table row released (``BlockManager.check_released``, which the engine runs at the end of each call),
and the completions equal a roomy run's bitwise, with prompt sharing, prefix caching, chunked prefill, preemption,
stop tokens, page shuffling and the concurrency limit drawn at random."""

from __future__ import annotations

import random

import pytest
import torch

import rlexact
from models import assert_same_completions, prompts_for, tiny_model
from rlexact.rollout import Generator, SamplingParams
from rlexact.rollout.block_manager import BlockManager

VOCAB = 97


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    model = tiny_model("qwen3", hidden=48, intermediate=88, kv_heads=2, max_pos=128, weight_scale=2.5, seed=4)
    return rlexact.exactify(model)


def random_load(case: int) -> tuple[list[list[int]], SamplingParams, dict]:
    """Prompts (a shared prefix of random length before each), sampling parameters and a tight generator config."""
    rng = random.Random(case)
    prefix = prompts_for(1, VOCAB, lo=1, hi=12, seed=100 + case)[0][: rng.randint(0, 12)]
    prompts = [prefix + p for p in prompts_for(rng.randint(2, 6), VOCAB, lo=1, hi=14, seed=case)]
    max_new = rng.randint(2, 9)
    stop = tuple(rng.sample(range(VOCAB), 3)) if rng.random() < 0.5 else None
    params = SamplingParams(max_new_tokens=max_new, seed=case, n=rng.choice([1, 2, 3]), stop_token_ids=stop)
    block_size = rng.choice([2, 4, 8])
    longest = max(len(p) for p in prompts) + max_new
    least = -(-longest // block_size)  # scoring a whole completion caches every one of its tokens
    chunked = rng.random() < 0.75
    config = dict(
        num_kv_blocks=rng.randint(least, 3 * least),
        block_size=block_size,
        max_num_batched_tokens=rng.randint(4, 3 * longest) if chunked else rng.randint(longest, 3 * longest),
        chunked_prefill=chunked,
        max_num_seqs=rng.randint(1, 8),
        share_prompt_blocks=rng.random() < 0.7,
        prefix_caching=rng.random() < 0.7,
        shuffle_blocks=True,
        block_seed=case,
    )
    return prompts, params, config


@pytest.mark.parametrize("case", range(8))
def test_random_loads_release_every_block_and_match_a_roomy_run(qwen, case: int) -> None:
    prompts, params, config = random_load(case)
    gen = Generator(qwen, **config)
    outs = gen.generate(prompts, params)  # raises if a block or table row is still held at the end
    roomy = Generator(qwen, block_size=8, share_prompt_blocks=False, prefix_caching=False).generate(prompts, params)
    assert all(o.num_preemptions == 0 for o in roomy)
    assert_same_completions(outs, roomy)
    scored = gen.score([o.sequence for o in outs])
    assert all(torch.equal(s[-len(o.token_ids) :], o.logprobs) for s, o in zip(scored, outs))


def test_the_loads_preempt_share_and_hit_the_cache(qwen) -> None:
    """The random loads reach the paths the bookkeeping test is about (otherwise it checks little)."""
    seen = {"preemptions": 0, "prompt_forks": 0, "prefix_cached_tokens": 0}
    for case in range(8):
        prompts, params, config = random_load(case)
        gen = Generator(qwen, **config)
        gen.generate(prompts, params)
        for key in seen:
            seen[key] += int(gen.stats[key] > 0)
    assert all(count > 0 for count in seen.values()), seen


def test_negative_control_a_leaked_block_raises(qwen, monkeypatch) -> None:
    """A finished sequence whose blocks are never returned makes the call fail instead of shrinking the cache
    silently (a preempted one keeps using blocks it was not freed of, so the leak is planted at a finish)."""
    free = BlockManager.free
    skipped: list[int] = []

    def leaky_free(self: BlockManager, seq) -> None:  # noqa: ANN001
        if not skipped and seq.block_table and seq.finish_reason is not None:
            skipped.append(seq.index)
            return
        free(self, seq)

    monkeypatch.setattr(BlockManager, "free", leaky_free)
    prompts, params, _ = random_load(0)
    with pytest.raises(RuntimeError, match="KV block bookkeeping leaked"):  # a roomy cache: the call runs to its end
        Generator(qwen, num_kv_blocks=256, block_size=4).generate(prompts, params)
    assert skipped
