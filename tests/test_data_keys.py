"""Data-keyed sampling: a sample's draw depends on (seed, prompt key, sample j, position), never on the prompt's slot
in the call, the batch size or the rank."""

from __future__ import annotations

import pytest
import torch

import rlexact
from models import prompts_for, tiny_model
from rlexact.rollout import Generator, SamplingParams

VOCAB = 97
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, n=2, seed=11, logprobs="sampled", ignore_eos=True)


def _by_row(outs: list, rows: list[int], n: int) -> dict[tuple[int, int], tuple[list[int], torch.Tensor]]:
    return {(rows[c.prompt_index], k % n): (c.token_ids, c.logprobs) for k, c in enumerate(outs)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][0] == b[k][0] and torch.equal(a[k][1], b[k][1]) for k in a)


@pytest.fixture(scope="module")
def gen() -> Generator:
    return Generator(rlexact.exactify(tiny_model("qwen3")), kernels="exact")


def test_keys_make_samples_independent_of_sharding_and_order(gen) -> None:
    prompts = prompts_for(8, VOCAB, seed=4)
    rows = list(range(100, 108))  # dataset row indices used as keys
    whole = _by_row(gen.generate(prompts, PARAMS, keys=rows), rows, PARAMS.n)
    halves: dict = {}
    for part in (slice(0, 4), slice(4, 8)):  # two ranks, each with half of the global batch
        halves |= _by_row(gen.generate(prompts[part], PARAMS, keys=rows[part]), rows[part], PARAMS.n)
    assert _same(whole, halves)
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    prows = [rows[i] for i in perm]
    shuffled = _by_row(gen.generate([prompts[i] for i in perm], PARAMS, keys=prows), prows, PARAMS.n)
    assert _same(whole, shuffled)
    # negative control: without keys the request id is the slot, so splitting the batch changes the samples
    plain = _by_row(gen.generate(prompts, PARAMS), rows, PARAMS.n)
    plain_halves: dict = {}
    for part in (slice(0, 4), slice(4, 8)):
        plain_halves |= _by_row(gen.generate(prompts[part], PARAMS), rows[part], PARAMS.n)
    assert not _same(plain, plain_halves)


def test_bad_keys(gen) -> None:
    prompts = prompts_for(2, VOCAB)
    with pytest.raises(ValueError, match="one per prompt"):
        gen.generate(prompts, PARAMS, keys=[1])
    with pytest.raises(ValueError, match="not both"):
        gen.generate(prompts, PARAMS, request_ids=[0, 1, 2, 3], keys=[1, 2])
    with pytest.raises(ValueError, match=r"keys\[1\] must be a non-negative integer key below 2\*\*63, got -1"):
        gen.generate(prompts, PARAMS, keys=[1, -1])
