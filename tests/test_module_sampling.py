"""RLModule sampling stage: rollout.logprobs="sampled" makes the rollout and trainer log-probs of the truncated
distribution bitwise equal; sampling keys come from the data rows (index, epoch), not the slot or the rank."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlexact import sequence_logprobs
from rlexact.config import RolloutConfig
from rlexact.trainer import sampling
from test_module import Inspect, fit, loader, make_module, prompt_items

TRUNC = {"top_k": 8, "top_p": 0.8, "temperature": 0.9}


def test_module_sampled_logprobs_are_exact() -> None:
    module = make_module(rollout={**TRUNC, "logprobs": "sampled"}, algorithm={"old_logprob_mode": "exact"})
    probe = Inspect()
    fit(module, 2, [probe])
    assert probe.trainer_eq_rollout == [True, True]  # trainer (truncated) log-probs == rollout, bitwise
    assert probe.first_eq_old == [True, True] and probe.first_ratio_one_all == [True, True]


def test_full_logprobs_with_truncation_warn_and_differ() -> None:
    with pytest.warns(UserWarning, match="logprobs='sampled'"):
        RolloutConfig(top_p=0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutConfig(top_p=0.8, logprobs="sampled")
        RolloutConfig(top_p=0.8, kernels="native")
    with pytest.raises(ValueError, match="rollout.logprobs"):
        RolloutConfig(logprobs="truncated")
    # negative control: the sampled log-probs are not the full-distribution ones
    module = make_module(rollout={**TRUNC, "logprobs": "sampled"})
    module.configure_model()
    items = prompt_items(3)
    outs = module.generate([it["prompt_ids"] for it in items], module.sampling_params(keyed=True), [0, 1, 2])
    full = sequence_logprobs(module.model, [o.sequence for o in outs], TRUNC["temperature"])
    differ = [not torch.equal(lp[-len(o.token_ids) :], o.logprobs) for lp, o in zip(full, outs)]
    assert all(differ)


def test_keys_from_rows_not_slots_or_ranks() -> None:
    cfg = RolloutConfig(n=2, max_new_tokens=4)
    seeds = {
        sampling.sampling_params(cfg, rollout_step=s, rank=r, stop_ids=None, keyed=True).seed
        for s in (0, 3)
        for r in (0, 1)
    }
    assert len(seeds) == 1  # keyed: the seed depends on rollout.seed only
    items = prompt_items(4)
    keys = sampling.prompt_keys(items, split=sampling.TRAIN_KEYS, epoch=2)
    assert keys == sampling.prompt_keys(items[::-1], split=sampling.TRAIN_KEYS, epoch=2)[::-1]
    assert keys != sampling.prompt_keys(items, split=sampling.TRAIN_KEYS, epoch=3)
    assert keys != sampling.prompt_keys(items, split=sampling.VALIDATION_KEYS, epoch=2)
    with pytest.warns(UserWarning, match="no integer 'index'"):
        assert sampling.prompt_keys([{"prompt_ids": [1]}], split=sampling.TRAIN_KEYS, epoch=0) is None

    class Capture(type(make_module())):
        def generate(self, prompts, params, keys=None):
            self.seen.append((params.seed, keys))
            return super().generate(prompts, params, keys)

    module = make_module()
    module.__class__ = Capture
    module.seen = []
    fit(module, 2, data=loader(4, batch_size=2))
    items = prompt_items(4)
    expected = [sampling.prompt_keys(items[i : i + 2], split=sampling.TRAIN_KEYS, epoch=0) for i in (0, 2)]
    assert [k for _, k in module.seen] == expected
    assert len({s for s, _ in module.seen}) == 1
