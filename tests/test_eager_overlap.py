"""Eager (prefill) steps launched before the previous eager step is read back (``overlap_prefill``, CPU): bitwise the
completions of step-by-step execution under several prefill steps, chunked prefill, prompt sharing, prefix caching,
preemption and early stops; ``Scheduler.chain_prefill`` never preempts, never feeds a sequence awaiting its token,
leaves nothing behind when it names no step, and keeps the half-budget policy."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import rlexact
from models import assert_trainer_logprobs, prompts_for, tiny_model
from rlexact.rollout import Generator, GeneratorConfig, SamplingParams
from rlexact.rollout import engine as engine_mod
from rlexact.rollout.block_manager import BlockManager
from rlexact.rollout.runner import EagerLaunch, ModelRunner
from rlexact.rollout.scheduler import ScheduledBatch, Scheduler
from rlexact.rollout.sequence import Sequence, Status
from test_rollout_host import PARAMS, PROMPTS, EagerGraphRunner


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    model = tiny_model("qwen3", hidden=48, intermediate=88, kv_heads=2, max_pos=128, weight_scale=2.5, seed=4)
    return rlexact.exactify(model)


PREFIX = prompts_for(1, 97, lo=13, hi=13, seed=21)[0]
CASES = {
    # (prompts, sampling parameters, generator settings)
    "prefill_steps": (
        prompts_for(12, 97, lo=8, hi=20, seed=1),
        SamplingParams(max_new_tokens=5, seed=3),
        {"max_num_batched_tokens": 32, "block_size": 4, "max_num_seqs": 16},
    ),
    "chunked_long_prompts": (
        prompts_for(4, 97, lo=50, hi=90, seed=2),
        SamplingParams(max_new_tokens=5, seed=3),
        {"max_num_batched_tokens": 16, "block_size": 4},
    ),
    "shared_prompts": (
        prompts_for(6, 97, lo=6, hi=24, seed=3),
        SamplingParams(max_new_tokens=5, seed=3, n=3),
        {"max_num_batched_tokens": 24, "block_size": 4},
    ),
    "prefix_cache": (
        [PREFIX + p for p in prompts_for(8, 97, lo=2, hi=10, seed=4)],
        SamplingParams(max_new_tokens=5, seed=3),
        {"max_num_batched_tokens": 24, "block_size": 4},
    ),
    "preemption": (
        prompts_for(10, 97, lo=10, hi=20, seed=5),
        SamplingParams(max_new_tokens=8, seed=3, n=2),
        {"max_num_batched_tokens": 24, "block_size": 4, "num_kv_blocks": 16, "shuffle_blocks": True},
    ),
    "stop_tokens": (
        prompts_for(10, 97, lo=8, hi=20, seed=6),
        SamplingParams(max_new_tokens=8, seed=3, stop_token_ids=list(range(0, 97, 9))),
        {"max_num_batched_tokens": 24, "block_size": 4},
    ),
    "one_new_token": (  # every sequence finishes at the token of its prefill step, some while a chained one runs
        prompts_for(10, 97, lo=8, hi=20, seed=7),
        SamplingParams(max_new_tokens=1, seed=3),
        {"max_num_batched_tokens": 24, "block_size": 4},
    ),
}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs) and x.finish_reason == y.finish_reason
        for x, y in zip(a, b)
    )


def _both(model: torch.nn.Module, case: str) -> tuple[list, Generator, list, Generator]:
    prompts, params, kw = CASES[case]
    on, off = Generator(model, **kw), Generator(model, overlap_prefill=False, **kw)
    return on.generate(prompts, params), on, off.generate(prompts, params), off


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_prefill_equals_sequential(qwen, case) -> None:
    """Chained prefill steps ran, and every completion (tokens, log-probs, finish reason) is bitwise the one of
    step-by-step eager execution; the case's feature (forks, cache hits, preemptions, stops) was exercised."""
    outs, on, ref, off = _both(qwen, case)
    assert on.stats["overlapped_eager_steps"] > 0 and off.stats["overlapped_eager_steps"] == 0
    assert _same(outs, ref)
    features = {
        "shared_prompts": "prompt_forks",
        "prefix_cache": "prefix_cached_tokens",
        "preemption": "preemptions",
    }
    if case in features:
        assert on.stats[features[case]] > 0 and off.stats[features[case]] > 0
    if case == "stop_tokens":
        assert {o.finish_reason for o in outs} == {"stop", "length"}
    if case == "chunked_long_prompts":
        assert max(len(p) for p in CASES[case][0]) > 2 * CASES[case][2]["max_num_batched_tokens"]


def test_random_configurations_equal_sequential(qwen) -> None:
    """Random settings (block size, token budget, sequence slots, chunking, sharing, prefix caching, shuffled pages,
    tight KV budgets, stop tokens, ``n``) on random prompts, some with a common prefix: overlapped and step-by-step
    prefill give the same completions bitwise, and chained prefill steps ran."""
    rng = random.Random(1)
    chained = 0
    for _ in range(12):
        lo = rng.randint(1, 30)
        prompts = prompts_for(rng.randint(1, 12), 97, lo=lo, hi=lo + rng.randint(0, 60), seed=rng.randrange(10**6))
        if rng.random() < 0.3:
            prefix = prompts_for(1, 97, lo=rng.randint(4, 20), hi=20, seed=rng.randrange(10**6))[0]
            prompts = [prefix + p for p in prompts]
        new, bs, chunked = rng.randint(1, 10), rng.choice([2, 4, 8, 16]), rng.random() < 0.8
        longest = max(len(p) for p in prompts) + new
        budget = rng.choice([8, 16, 24, 32, 64, 128])
        kw = {
            "block_size": bs,
            "max_num_batched_tokens": budget if chunked else max(budget, longest),
            "max_num_seqs": rng.choice([2, 4, 8, 16, 64]),
            "chunked_prefill": chunked,
            "share_prompt_blocks": rng.random() < 0.7,
            "prefix_caching": rng.random() < 0.7,
            "shuffle_blocks": rng.random() < 0.5,
        }
        if rng.random() < 0.4:
            kw["num_kv_blocks"] = -(-longest // bs) + rng.randint(0, 10)
        stop = list(range(rng.randint(0, 8), 97, rng.randint(5, 30))) if rng.random() < 0.4 else None
        params = SamplingParams(max_new_tokens=new, seed=rng.randint(0, 99), n=rng.choice([1, 1, 2, 3]),
                                stop_token_ids=stop)  # fmt: skip
        on = Generator(qwen, **kw)
        outs = on.generate(prompts, params)
        assert _same(outs, Generator(qwen, overlap_prefill=False, **kw).generate(prompts, params)), kw
        chained += on.stats["overlapped_eager_steps"]
    assert chained > 0


def test_overlapped_prefill_equals_trainer(qwen) -> None:
    outs, _, _, _ = _both(qwen, "preemption")
    assert_trainer_logprobs(qwen, outs)


def test_negative_control_request_ids_and_seed(qwen) -> None:
    """Other request ids, or another seed, change the completions: the equality above can fail."""
    prompts, params, kw = CASES["prefill_steps"]
    ref = Generator(qwen, **kw).generate(prompts, params)
    shifted = Generator(qwen, **kw).generate(prompts, params, request_ids=[i + 1 for i in range(len(prompts))])
    reseeded = Generator(qwen, **kw).generate(prompts, dataclasses.replace(params, seed=params.seed + 1))
    assert not _same(shifted, ref) and not _same(reseeded, ref)


class SharedReadBack(ModelRunner):
    """Negative control: every eager step's sampled tokens land in one host buffer, which a launch overwrites while
    an earlier step in flight was not read back yet (the hazard of reusing a pending read-back buffer)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shared = torch.zeros(2, self.config.max_num_seqs, dtype=torch.float64)

    def launch_eager(self, batch: ScheduledBatch, decode_rows: int = 0) -> EagerLaunch:
        launched = super().launch_eager(batch, decode_rows)
        if launched.host_out is None:
            return launched
        rows = launched.host_out.shape[1]
        self.shared[:, :rows] = launched.host_out
        return dataclasses.replace(launched, host_out=self.shared[:, :rows])


def test_negative_control_shared_read_back_buffer(qwen, monkeypatch) -> None:
    """A read-back buffer reused by the next launch is harmless step by step but changes the completions once
    prefill steps overlap: the comparison catches a pending buffer being overwritten."""
    prompts, params, kw = CASES["prefill_steps"]
    ref = Generator(qwen, overlap_prefill=False, **kw).generate(prompts, params)
    monkeypatch.setattr(engine_mod, "ModelRunner", SharedReadBack)
    sequential = Generator(qwen, overlap_prefill=False, **kw).generate(prompts, params)
    gen = Generator(qwen, **kw)
    overlapped = gen.generate(prompts, params)
    assert gen.stats["overlapped_eager_steps"] > 0
    assert _same(sequential, ref) and not _same(overlapped, ref)


class LoggingRunner(ModelRunner):
    """Records the order of eager launches, early captures and read-backs."""

    last: LoggingRunner  # the runner of the latest generate call

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[str] = []
        LoggingRunner.last = self

    def launch_eager(self, batch: ScheduledBatch, decode_rows: int = 0) -> EagerLaunch:
        self.log.append("launch")
        return super().launch_eager(batch, decode_rows)

    def capture_ahead(self, rows: int) -> None:
        self.log.append("capture")
        super().capture_ahead(rows)

    def collect_eager(self, launched: EagerLaunch) -> list[tuple[Sequence, int, float]]:
        out = super().collect_eager(launched)
        self.log.append("collect")
        return out


def test_capture_ahead_runs_after_the_chained_launch(qwen, monkeypatch) -> None:
    """The decode graph is captured ahead once the chained step is queued too (the most device work in flight),
    before the first step is read back; without chaining, after each launch, as before."""
    prompts, params, kw = CASES["prefill_steps"]
    monkeypatch.setattr(engine_mod, "ModelRunner", LoggingRunner)
    Generator(qwen, **kw).generate(prompts, params)
    assert LoggingRunner.last.log[:4] == ["launch", "launch", "capture", "collect"]
    Generator(qwen, overlap_prefill=False, **kw).generate(prompts, params)
    assert LoggingRunner.last.log[:6] == ["launch", "capture", "collect"] * 2
    eager_s = LoggingRunner.last.stats["eager_s"]  # the parts, and the early captures
    assert 0 < sum(LoggingRunner.last.eager_host_s.values()) <= eager_s + 1e-9


def test_overlapped_prefill_on_the_graph_host_path(qwen, monkeypatch) -> None:
    """With the CUDA-graph decode path's host side (graphs replayed eagerly on CPU): prefill steps chain, the decode
    steps after them overlap, a generator's second call captures its decode graph ahead, and every completion is
    bitwise the one of step-by-step prefill."""
    kw = {"block_size": 4, "max_num_seqs": 12, "max_num_batched_tokens": 16}
    monkeypatch.setattr(engine_mod, "ModelRunner", EagerGraphRunner)
    on, off = Generator(qwen, **kw), Generator(qwen, overlap_prefill=False, **kw)
    outs = on.generate(PROMPTS, PARAMS) + on.generate(PROMPTS, PARAMS)
    ref = off.generate(PROMPTS, PARAMS) + off.generate(PROMPTS, PARAMS)
    assert _same(outs, ref)
    assert on.stats["overlapped_eager_steps"] > 0 and on.stats["overlapped_steps"] > 0
    assert on.stats["graph_captures_ahead"] == off.stats["graph_captures_ahead"] == 1


def test_overlap_prefill_config() -> None:
    assert GeneratorConfig().overlap_prefill is True
    for flag in ("overlap_prefill", "overlap_decode"):
        with pytest.raises(ValueError, match=flag):
            GeneratorConfig(**{flag: 1})


# ----------------------------------------------------------------------------------------------------------------------
# Scheduler.chain_prefill
# ----------------------------------------------------------------------------------------------------------------------


def _launch(batch: ScheduledBatch) -> ScheduledBatch:
    """What launching a step does to its sequences: their fed tokens count as computed."""
    for s, n in zip(batch.seqs, batch.num_new):
        s.num_computed += n
    return batch


def _sched(num_blocks: int, budget: int, **kw) -> Scheduler:
    bm = BlockManager(num_blocks=num_blocks, block_size=4, max_rows=8, width=8)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget, chunked_prefill=True, **kw)


def _state(sched: Scheduler) -> tuple:
    """What a chain_prefill that names no step must leave as it was."""
    return (
        sched.bm.num_free,
        list(sched.waiting),
        list(sched.running),
        [(s.status, s.num_computed, list(s.block_table), s.row) for s in sched.waiting],
        [(s.num_computed, list(s.block_table)) for s in sched.running],
        (sched.num_forks, sched.shared_tokens, sched.cached_tokens, sched.num_preemptions),
    )


def test_chain_prefill_continues_prompts_and_admits() -> None:
    """Behind a prefill step: the next chunk of a prompt still prefilling, then admissions; never the sequences that
    sample in the step in flight (they await their token) nor a running sequence's decode."""
    sched = _sched(num_blocks=32, budget=16)
    a, b, c, d, e = (Sequence(i, [i + 1] * n, i, i, 4) for i, n in enumerate([6, 6, 20, 5, 8]))
    for s in (a, b, c, d, e):
        sched.add(s)
    first = _launch(sched.schedule())
    assert first.seqs == [a, b, c] and first.num_new == [6, 6, 4]
    assert sched.chain_prefill(ScheduledBatch([a], [1], True)) is None  # behind a decode: never
    chained = sched.chain_prefill(first)
    assert chained is not None and chained.seqs == [c] and chained.num_new == [16] and not chained.is_decode
    assert chained.num_prefill_tokens == 16
    _launch(chained)
    a.append(7, -1.0)  # a's token is read back: a now has a decode pending, which chain_prefill leaves alone
    third = sched.chain_prefill(chained)
    assert third is not None and third.seqs == [d, e] and third.num_new == [5, 8]
    assert all(s.num_computed < len(s.tokens) for s in third.seqs) and sched.num_preemptions == 0


def test_chain_prefill_below_half_budget_changes_nothing() -> None:
    """A chained step under half the token budget is not named, and everything it tried is undone: admissions
    (a fork from a sibling, a prefix-cache hit) return to their places in the waiting queue holding no blocks."""
    sched = _sched(num_blocks=32, budget=32, share_prompts=True, prefix_cache=True)
    prompt = list(range(1, 11))
    src, sib = Sequence(0, prompt, 0, 0, 4), Sequence(1, prompt, 1, 0, 4)
    cached = Sequence(2, prompt[:8] + [50, 51], 2, 1, 4)  # its first two blocks are the source's
    other = Sequence(3, [60] * 30, 3, 2, 4)
    sched.add(src)
    first = _launch(sched.schedule())
    assert first.seqs == [src]
    for s in (sib, cached):
        sched.add(s)
    before = _state(sched)
    assert sched.chain_prefill(first) is None  # a fork (1 token) and a cached tail (2 tokens): 3 < 32 / 2
    assert _state(sched) == before
    sched.add(other)
    chained = sched.chain_prefill(first)
    assert chained is not None and chained.seqs == [sib, cached, other] and chained.num_new == [1, 2, 29]
    assert sched.num_forks == 1 and sched.cached_tokens == 8 and len(chained.copies) == 1


def test_chain_prefill_never_preempts_and_leaks_no_blocks() -> None:
    """With no free block, chain_prefill names no step where :meth:`schedule` would preempt; an admission whose
    prefix-cache hit leaves blocks to allocate that do not fit holds nothing afterwards."""
    sched = _sched(num_blocks=8, budget=16, prefix_cache=True)
    a, b = Sequence(0, [1] * 16, 0, 0, 4), Sequence(1, [2] * 16, 1, 1, 4)
    c = Sequence(2, [1] * 16 + [99] * 6, 2, 2, 4)  # its first four blocks are a's
    for s in (a, b):
        sched.add(s)
    first = _launch(sched.schedule())
    assert first.seqs == [a]
    chained = _launch(sched.chain_prefill(first))
    assert chained.seqs == [b] and sched.bm.num_free == 0
    sched.add(c)
    before = _state(sched)
    assert sched.chain_prefill(chained) is None  # c takes a's four blocks, then needs two more
    assert _state(sched) == before and c.block_table == [] and c.row == -1
    assert a.status is b.status is Status.RUNNING and sched.num_preemptions == 0
    a.append(7, -1.0)
    sched.schedule()  # once a's token is read back, the ordinary step preempts for a's decode
    assert sched.num_preemptions == 1 and b.status is Status.WAITING


def test_chain_prefill_keeps_the_blocks_of_planned_chunks() -> None:
    """The blocks a running prompt's next chunk needs are kept from the admissions after it (which would otherwise
    take them first: the chunk's blocks are allocated last, once the step is known to be chained)."""
    sched = _sched(num_blocks=7, budget=16)
    a, b = Sequence(0, [1] * 24, 0, 0, 4), Sequence(1, [2] * 12, 1, 1, 4)
    for s in (a, b):
        sched.add(s)
    first = _launch(sched.schedule())
    assert first.seqs == [a] and sched.bm.num_free == 3
    chained = sched.chain_prefill(first)  # a's 8 tokens take 2 blocks; b's 8 would need 2 of the 1 left
    assert chained is not None and chained.seqs == [a] and chained.num_new == [8]
    assert len(a.block_table) == 6 and sched.bm.num_free == 1 and list(sched.waiting) == [b]
