"""The host side of CUDA-graph decode steps, on CPU: the graph path's table sync, in-place input staging and
read-back run for real, with the "captured graph" replayed eagerly. Generations must equal (bitwise) the eager
engine's under preemption, shuffled pages, prompt sharing and a shrinking batch, and the trainer's log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rlexact
from models import prompts_for, tiny_model
from rlexact.ops import group_capacity
from rlexact.rollout import Generator, SamplingParams
from rlexact.rollout import engine as engine_mod
from rlexact.rollout.runner import GraphState, GraphVariant, ModelRunner
from rlexact.rollout.sequence import Sequence, Status


class EagerGraphRunner(ModelRunner):
    """The CUDA-graph decode path on CPU: "capturing" returns the graph's step function, which each replay runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.use_graphs = self.sampling is not None
        self.bm.record_updates = self.use_graphs
        cfg = self.model.config
        if self.config.shared_prefix_decode and not self.native:  # staged, then ignored by the CPU kernels
            self.prefix_capacity = group_capacity(cfg.num_attention_heads, cfg.num_key_value_heads)
        self._signature = self.signature()
        kept = kwargs.get("graph_state")  # the engine's reuse rule, now that this runner has a signature
        self.graph_state = kept if kept is not None and kept.signature == self._signature else None

    def _capture(self, gs: GraphState, bucket: int, var: GraphVariant, ahead: bool = False) -> SimpleNamespace:
        self.stats["graph_captures"] += 1
        self.stats["graph_captures_ahead"] += int(ahead)
        self.warmed.add(self._warm_key(bucket, var))
        return SimpleNamespace(replay=self._graph_fn(gs, bucket, var))


class StalePositions(EagerGraphRunner):
    """Negative control: the in-place staging forgets to advance the positions."""

    def _stage_inputs(self, gs: GraphState, seqs: list[Sequence]) -> None:
        in_place = self._staged is not None and seqs == self._staged
        super()._stage_inputs(gs, seqs)
        if in_place:
            gs.ints[1, : len(seqs)] -= 1


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    model = tiny_model("qwen3", hidden=48, intermediate=88, kv_heads=2, max_pos=128, weight_scale=2.5, seed=4)
    return rlexact.exactify(model)


PROMPTS = prompts_for(4, 97, lo=5, hi=12, seed=8)
PARAMS = SamplingParams(max_new_tokens=10, seed=2, n=3, stop_token_ids=[3, 11])
TIGHT = {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 20, "shuffle_blocks": True}


def _generate(model, runner: type[ModelRunner], monkeypatch, **kw) -> tuple[list, dict]:
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "ModelRunner", runner)
        gen = Generator(model, max_num_seqs=8, **kw)
        outs = gen.generate(PROMPTS, PARAMS)
    return outs, gen.stats


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b)
    )


def test_graph_host_path_equals_eager_engine(qwen, monkeypatch) -> None:
    ref = Generator(qwen, block_size=8, share_prompt_blocks=False, max_num_seqs=8).generate(PROMPTS, PARAMS)
    assert all(o.num_preemptions == 0 for o in ref)
    assert any(o.finish_reason == "stop" for o in ref) and any(o.finish_reason == "length" for o in ref)
    outs, stats = _generate(qwen, EagerGraphRunner, monkeypatch, **TIGHT)
    assert stats["graph_steps"] > 0 and stats["eager_steps"] > 0
    assert stats["preemptions"] > 0 and stats["prompt_forks"] > 0
    assert _same(outs, ref)
    trainer = rlexact.sequence_logprobs(qwen, [o.sequence for o in outs])
    for o, r in zip(outs, trainer):
        assert torch.equal(o.logprobs, r[-len(o.token_ids) :])
    host = stats["decode_host_s"]
    assert set(host) == {"schedule", "prepare", "launch", "wait", "collect", "postprocess"}
    assert all(v > 0 for v in host.values())


def test_negative_control_stale_staged_positions(qwen, monkeypatch) -> None:
    """Positions not advanced by the in-place staging change the sampled tokens or log-probs: the equality above
    can fail, and the in-place path runs in that generation."""
    good, _ = _generate(qwen, EagerGraphRunner, monkeypatch, **TIGHT)
    bad, _ = _generate(qwen, StalePositions, monkeypatch, **TIGHT)
    assert not _same(bad, good)


def test_fewer_new_tokens_reuse_the_kept_graphs(qwen, monkeypatch) -> None:
    """With ``keep_kv_cache``, a call with fewer new tokens keeps the block-table width, so it keeps the graph state
    (and the decode graphs) of the first call and generates what a fresh generator does. A call that needs a wider
    table (more new tokens) starts a new graph state: the check can fail."""
    short = SamplingParams(max_new_tokens=4, seed=2, n=3, stop_token_ids=[3, 11])
    longer = SamplingParams(max_new_tokens=40, seed=2, n=3, stop_token_ids=[3, 11])
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "ModelRunner", EagerGraphRunner)
        gen = Generator(qwen, max_num_seqs=8, keep_kv_cache=True, block_size=4)
        gen.generate(PROMPTS, PARAMS)
        first = gen._graph_state
        assert first is not None and first.graphs
        outs = gen.generate(PROMPTS, short)
        assert gen.stats["graph_steps"] > 0 and gen._graph_state is first
        fresh = Generator(qwen, max_num_seqs=8, block_size=4).generate(PROMPTS, short)
        gen.generate(PROMPTS, longer)
        assert gen._graph_state is not first  # negative control: a wider table is a new graph state
    assert _same(outs, fresh)


class CapturesAheadForOneRow(EagerGraphRunner):
    """Negative control: the graph captured ahead runs the step of one row only, so the decode steps that replay
    it leave the other rows' outputs stale."""

    def _capture(self, gs: GraphState, bucket: int, var: GraphVariant, ahead: bool = False) -> SimpleNamespace:
        graph = super()._capture(gs, bucket, var, ahead)
        return SimpleNamespace(replay=self._graph_fn(gs, 1, var)) if ahead else graph


def test_graph_captured_ahead_during_prefill(qwen, monkeypatch) -> None:
    """A later call of the same generator captures its first decode graph while the device runs a prefill step
    (the kernels of that graph key were compiled by the first call) and generates what the first call did, bitwise,
    and the trainer's log-probs; a graph captured ahead for the wrong rows changes the completions."""
    params = SamplingParams(max_new_tokens=10, seed=2, n=3, ignore_eos=True)
    kw = {"block_size": 4, "max_num_seqs": 12}
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "ModelRunner", EagerGraphRunner)
        gen = Generator(qwen, **kw)
        first = gen.generate(PROMPTS, params)
        assert gen.stats["graph_captures_ahead"] == 0
        second = gen.generate(PROMPTS, params)
        assert gen.stats["graph_captures_ahead"] == 1 and gen.stats["eager_steps"] > 0
        m.setattr(engine_mod, "ModelRunner", CapturesAheadForOneRow)
        gen_bad = Generator(qwen, **kw)
        gen_bad.generate(PROMPTS, params)
        bad = gen_bad.generate(PROMPTS, params)
        assert gen_bad.stats["graph_captures_ahead"] == 1
    assert _same(second, first)
    assert not _same(bad, first)
    trainer = rlexact.sequence_logprobs(qwen, [o.sequence for o in second])
    for o, r in zip(second, trainer):
        assert torch.equal(o.logprobs, r[-len(o.token_ids) :])


class KeepsFinishedRows(EagerGraphRunner):
    """Negative control: reading back a step that was launched before an earlier step's stop token was seen keeps
    the row of the stopped sequence."""

    def collect(self, launched):  # noqa: ANN001, ANN201
        kept = [s for s in launched.batch.seqs if s.status is Status.RUNNING]
        out = super().collect(launched)
        seqs = launched.batch.seqs
        if len(kept) < len(seqs):
            both = launched.host_out[:, : len(seqs)]
            return list(zip(seqs, both[0].long().tolist(), both[1].tolist()))
        return out


OVERLAP_CASES = {
    "tight": dict(TIGHT, max_num_seqs=8),  # preemption, shuffled pages, prompt forks
    "roomy": {"block_size": 4, "max_num_seqs": 12},  # long overlapped runs across stop tokens
    "admit": {"block_size": 4, "max_num_seqs": 5},  # fewer slots than samples: admissions between runs
}


@pytest.mark.parametrize("case", sorted(OVERLAP_CASES))
def test_overlapped_decode_equals_sequential(qwen, monkeypatch, case) -> None:
    """Decode steps launched before the previous one is read back (``overlap_decode``) generate bitwise what
    step-by-step decoding does, with stop tokens, token limits, preemption, prompt sharing and admissions, and the
    trainer's log-probs; the overlapped path ran."""
    kw = OVERLAP_CASES[case]
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "ModelRunner", EagerGraphRunner)
        seq_gen = Generator(qwen, overlap_decode=False, **kw)
        ref = seq_gen.generate(PROMPTS, PARAMS)
        ovl_gen = Generator(qwen, **kw)
        outs = ovl_gen.generate(PROMPTS, PARAMS)
    assert seq_gen.stats["overlapped_steps"] == 0 and ovl_gen.stats["overlapped_steps"] > 0
    assert (ovl_gen.stats["preemptions"] > 0) == (case == "tight")
    assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)
    assert _same(outs, ref)
    trainer = rlexact.sequence_logprobs(qwen, [o.sequence for o in outs])
    for o, r in zip(outs, trainer):
        assert torch.equal(o.logprobs, r[-len(o.token_ids) :])


def test_negative_control_overlap_keeps_stopped_rows(qwen, monkeypatch) -> None:
    """A read-back that keeps the rows of sequences that stopped while the next step was in flight changes the
    completions: the overlapped path launched steps across stop tokens, and the equality above can fail."""
    kw = OVERLAP_CASES["roomy"]
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "ModelRunner", EagerGraphRunner)
        good = Generator(qwen, **kw).generate(PROMPTS, PARAMS)
        m.setattr(engine_mod, "ModelRunner", KeepsFinishedRows)
        bad = Generator(qwen, **kw).generate(PROMPTS, PARAMS)
    assert not _same(bad, good)


def test_capture_warm_key_leaves_out_only_addresses_and_seed(qwen, monkeypatch) -> None:
    """A decode graph's warm-up key (what decides its compiled kernels) is the same for another seed and for a later
    call on a new cache, and differs for another temperature or batch bucket."""
    from dataclasses import replace

    keys: list[tuple] = []

    class KeyRunner(EagerGraphRunner):
        def _capture(self, gs: GraphState, bucket: int, var: GraphVariant, ahead: bool = False) -> SimpleNamespace:
            keys.append(self._warm_key(bucket, var))
            return super()._capture(gs, bucket, var, ahead)

    def first_key(params: SamplingParams, prompts: list) -> tuple:
        keys.clear()
        with monkeypatch.context() as m:
            m.setattr(engine_mod, "ModelRunner", KeyRunner)
            Generator(qwen, max_num_seqs=16, block_size=4).generate(prompts, params)
        return keys[0]

    params = SamplingParams(max_new_tokens=6, seed=2, ignore_eos=True)
    base = first_key(params, PROMPTS)
    assert first_key(params, PROMPTS) == base
    assert first_key(replace(params, seed=77), PROMPTS) == base
    assert first_key(replace(params, temperature=0.5), PROMPTS) != base
    assert first_key(params, PROMPTS * 3) != base  # twelve rows: another bucket


class CheckedPlanRunner(EagerGraphRunner):
    """Checks, at every replay of a graph that reads a shared-prefix plan, that the staged buffer holds the step's
    plan in the layout the graph's views read."""

    replays = 0

    def _graph_fn(self, gs: GraphState, bucket: int, var: GraphVariant):
        run = super()._graph_fn(gs, bucket, var)

        def checked() -> None:
            if var.prefix:
                plan, view = self._prefix_plan, self._prefix_views(gs, bucket)
                n, b = len(plan.groups), len(plan.start)
                assert view.start[:b].tolist() == plan.start and not view.start[b:].any()
                assert view.count.tolist() == [n] and view.tiles[:n].tolist() == plan.tiles
                for g, rows in enumerate(plan.groups):
                    assert view.members[g].tolist() == rows + [-1] * (self.prefix_capacity - len(rows))
                CheckedPlanRunner.replays += 1
            run()

        return checked


def test_graph_host_path_stages_shared_prefix_plans(qwen, monkeypatch) -> None:
    """Samples of prompts with a whole 64-key tile: the graph path stages each step's shared-prefix plan (checked at
    every replay; the CPU kernels compute the same rows without it), also as samples stop and the batch shrinks, and
    the completions equal the eager engine's bitwise. A second call captures the graph that reads the plan ahead,
    during its prefill, and needs no other."""
    prompts = prompts_for(3, 97, lo=66, hi=110, seed=9)
    params = SamplingParams(max_new_tokens=8, seed=4, n=4, stop_token_ids=[3, 11])
    ref = Generator(qwen, share_prompt_blocks=False, prefix_caching=False, max_num_seqs=16).generate(prompts, params)
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "ModelRunner", CheckedPlanRunner)
        gen = Generator(qwen, max_num_seqs=16, block_size=16)
        outs = gen.generate(prompts, params)
        assert gen.stats["decode_shared_prefix_keys"] > 0 and CheckedPlanRunner.replays > 0
        again = gen.generate(prompts, params)  # its first graph, captured ahead, reads the plan
    assert gen.stats["graph_captures_ahead"] == 1 and gen.stats["graph_captures"] == 1
    assert _same(outs, ref) and _same(again, ref) and any(o.finish_reason == "stop" for o in outs)


class NarrowRunner(EagerGraphRunner):
    """Graph steps whose sequences fit the first three table columns read only those (as they read one KV split's
    columns on a GPU); records the variants it replays."""

    replayed: set[GraphVariant] = set()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.narrow_blocks = 3

    def _graph_fn(self, gs: GraphState, bucket: int, var: GraphVariant):
        run = super()._graph_fn(gs, bucket, var)

        def recorded() -> None:
            NarrowRunner.replayed.add(var)
            run()

        return recorded


def test_graph_host_path_narrow_tables(qwen, monkeypatch) -> None:
    """Decode steps whose sequences all fit the first table columns replay graphs that gather only those, the later
    ones the whole table (one graph each, the narrow one captured ahead in a second call), and the completions equal
    the eager engine's bitwise."""
    ref = Generator(qwen, block_size=4, max_num_seqs=8).generate(PROMPTS, PARAMS)
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "ModelRunner", NarrowRunner)
        gen = Generator(qwen, block_size=4, max_num_seqs=8)
        outs = gen.generate(PROMPTS, PARAMS)
        assert {v.narrow for v in NarrowRunner.replayed} == {True, False}
        again = gen.generate(PROMPTS, PARAMS)
    assert _same(outs, ref) and _same(again, ref)
    assert gen.stats["graph_captures_ahead"] == 1
