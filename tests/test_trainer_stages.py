"""Trainer stages on one process: activation checkpointing, the one stop-token rule, the one seed mixer, and the
reducer without a process group."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from models import tiny_model, tiny_rl_config
from rlexact.char_tokenizer import build_char_tokenizer
from rlexact.logprobs import pack, packed_logprobs
from rlexact.models import exactify, use_kernels
from rlexact.module import RLModule
from rlexact.ops.keyed_hash import request_key
from rlexact.reduction import MetricReducer, all_reduce
from rlexact.rollout import eos_token_ids
from rlexact.trainer.policy import enable_activation_checkpointing
from rlexact.trainer.sampling import ENGINE_COUNTERS, engine_counters


def _fwd_bwd(model: torch.nn.Module, packed) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    lp, ent = packed_logprobs(model, packed, 0.9, with_entropy=True)
    (lp.sum() + 0.1 * ent.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_activation_checkpointing_same_logprobs_and_gradients(arch: str) -> None:
    base = exactify(tiny_model(arch)).train()
    ckpt = copy.deepcopy(base)
    exactify(ckpt, enabled=False)
    exactify(ckpt)
    enable_activation_checkpointing(ckpt)
    packed = pack([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]], "cpu")
    calls = SimpleNamespace(n=0)
    ckpt.model.layers[0].self_attn.register_forward_hook(lambda *a: setattr(calls, "n", calls.n + 1))
    lp0, g0 = _fwd_bwd(base, packed)
    lp1, g1 = _fwd_bwd(ckpt, packed)
    assert calls.n == 2, "the checkpointed layer must run its forward again in the backward"
    assert torch.equal(lp0, lp1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-7, msg=name)
    with torch.no_grad():  # no recompute without grad (rollout, scoring)
        calls.n = 0
        assert torch.equal(packed_logprobs(ckpt, packed, 0.9)[0], lp0)
        assert calls.n == 1
    # the input-embedding hook that transformers adds for reentrant checkpointing is not left behind
    emb = ckpt.get_input_embeddings()
    with torch.no_grad():
        assert not emb(torch.tensor([1, 2])).requires_grad


@pytest.mark.parametrize("kernels", ["exact", "native"])
def test_masked_logprobs_equal_the_full_call_on_the_mask(kernels: str) -> None:
    model = exactify(tiny_model("qwen3")).train()
    packed = pack([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]], "cpu")
    mask = torch.zeros(15, dtype=torch.bool)
    mask[[4, 5, 6, 9, 13, 14]] = True  # a response-like suffix of each sequence
    with use_kernels(model, kernels):
        full, ent_full = packed_logprobs(model, packed, 0.9, with_entropy=True)
        part, ent_part = packed_logprobs(model, packed, 0.9, with_entropy=True, mask=mask)
    assert torch.equal(part[mask], full[mask]) and torch.equal(ent_part[mask], ent_full[mask])
    assert bool((full[~mask] != 0).any()), "the full call must give non-zero log-probs outside the mask"
    assert torch.equal(part[~mask], torch.zeros_like(part[~mask]))
    # the gradient of masked entries is the same through either call (the head's weight gradient sums fewer rows,
    # so within fp32 tolerance)
    grads = []
    for lp, ent in ((full, ent_full), (part, ent_part)):
        model.zero_grad(set_to_none=True)
        (lp[mask].sum() + 0.1 * ent[mask].sum()).backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="mask must be bool"):
        packed_logprobs(model, packed, 0.9, mask=mask.long())


def test_rl_module_option_turns_on_checkpointing_for_the_policy_only() -> None:
    tok = build_char_tokenizer()
    kwargs = dict(model_config=tiny_rl_config(len(tok)), tokenizer=tok, algorithm={"kl_coef": 0.1})
    module = RLModule(**kwargs, activation_checkpointing=True)
    module.configure_model()
    assert all(layer.gradient_checkpointing for layer in module.model.model.layers)
    assert not any(layer.gradient_checkpointing for layer in module.ref_model.model.layers)
    plain = RLModule(**kwargs)
    plain.configure_model()
    assert not any(layer.gradient_checkpointing for layer in plain.model.model.layers)


def test_activation_checkpointing_needs_support() -> None:
    with pytest.raises(ValueError, match="does not support activation checkpointing"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_one_eos_rule() -> None:
    model = tiny_model("qwen3")
    model.config.eos_token_id = 5
    model.generation_config.eos_token_id = [6, 7]
    assert eos_token_ids(model) == {5, 6, 7}
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=8)) == {5, 6, 7, 8}
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=None)) == set()


def test_seed_mixer() -> None:
    keys = {request_key(s, step, rank) for s in range(3) for step in range(20) for rank in range(4)}
    assert len(keys) == 240 and all(0 <= k < 2**63 for k in keys)
    assert request_key(1, 2) != request_key(2, 1)
    assert request_key(1, 2) == request_key(1, 2 + 2**64)  # parts are taken modulo 2**64


def test_reducer_is_the_identity_without_a_process_group() -> None:
    values = (
        MetricReducer()
        .add_mean("m", 0.1 + 0.2, 3)
        .add_mean("empty", 5.0, 0, empty=-1.0)
        .add_sum("s", 4)
        .add_max("hi", None, empty=7.0)
        .add_min("lo", -2.5)
        .reduce()
    )
    assert values == {"m": 0.1 + 0.2, "empty": -1.0, "s": 4.0, "hi": 7.0, "lo": -2.5}
    t = torch.tensor([1.5, -2.0])
    assert all_reduce(t, "max") is t
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce(t, "mean")


@pytest.mark.parametrize("indices", [[4, 0, 2], [1], [5, 5, 3], list(range(6)), []])
def test_batch_select_gathers_the_chosen_sequences_in_order(indices: list[int]) -> None:
    from _callbacks_worker import make_batch

    batch = make_batch(seed=3)
    sub = batch.select(indices)
    cu = batch.cu_seqlens.tolist()
    expect = [list(range(cu[i], cu[i + 1])) for i in indices]
    token_idx = torch.tensor([t for seq in expect for t in seq], dtype=torch.long)
    assert sub.cu_seqlens.tolist() == [0, *torch.tensor([len(s) for s in expect], dtype=torch.long).cumsum(0).tolist()]
    assert torch.equal(sub.input_ids, batch.input_ids[token_idx])
    assert torch.equal(sub.position_ids, batch.position_ids[token_idx])
    assert torch.equal(sub.rollout_logprobs, batch.rollout_logprobs[token_idx])
    assert torch.equal(sub.rewards, batch.rewards[torch.tensor(indices, dtype=torch.long)])


def test_batch_split_gathers_every_group_in_one_call() -> None:
    from _callbacks_worker import make_batch

    batch = make_batch(seed=4)
    cu = batch.cu_seqlens.tolist()
    groups = [[5, 1], [0], [], [2, 2, 4], torch.tensor([3])]
    parts = batch.split(groups)
    assert len(parts) == len(groups)
    for group, part in zip(groups, parts):
        seqs = [int(i) for i in group]
        token_idx = torch.tensor([t for i in seqs for t in range(cu[i], cu[i + 1])], dtype=torch.long)
        lengths = torch.tensor([0] + [cu[i + 1] - cu[i] for i in seqs])
        assert part.cu_seqlens.dtype == torch.int32 and part.cu_seqlens.tolist() == lengths.cumsum(0).tolist()
        for name in ("input_ids", "position_ids", "response_mask", "rollout_logprobs", "advantages", "loss_mask"):
            assert torch.equal(getattr(part, name), getattr(batch, name)[token_idx]), name
        assert torch.equal(part.rewards, batch.rewards[torch.tensor(seqs, dtype=torch.long)])
    assert not torch.equal(parts[0].input_ids, batch.select([1, 5]).input_ids)  # order matters (negative control)
    with pytest.raises(IndexError, match=r"must lie in \[0, 6\).*max 6"):
        batch.split([[0], [6]])
    with pytest.raises(IndexError, match="min -1"):
        batch.select([-1])


def test_engine_counters_only_from_a_call_of_this_step() -> None:
    """The generator's counters are logged only when it ran since the step began (a ``generate`` override that
    samples elsewhere leaves its stats untouched, and stale counters would be logged as this step's)."""
    gen = SimpleNamespace(stats={})
    assert engine_counters(None, None) == {}
    assert engine_counters(gen, None) == {}  # created, never called
    before = gen.stats
    gen.stats = {"prompt_tokens": 12, "prefill_tokens": 6, "shared_prompt_tokens": 6, "preemptions": 1}
    counters = engine_counters(gen, before)
    assert set(counters) == set(ENGINE_COUNTERS)
    assert counters["prefill_tokens"] == 6.0 and counters["prefix_cached_tokens"] == 0.0
    assert engine_counters(gen, gen.stats) == {}  # the same stats object: no call this step
