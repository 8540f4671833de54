"""Rollout engine on a CUDA GPU (bf16, Triton kernels): exactness with CUDA graphs on and off, graphs == eager."""

from __future__ import annotations

import pytest
import torch

import rlexact
from models import prompts_for, tiny_model
from rlexact.rollout import Completion, Generator, SamplingParams

pytestmark = pytest.mark.gpu


def make_model(arch: str = "qwen3", *, kv_heads: int = 2, head_dim: int = 64, vocab: int = 1003, seed: int = 0):
    model = tiny_model(
        arch,
        vocab=vocab,
        hidden=256,
        layers=3,
        heads=4,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=704,
        seed=seed,
        max_pos=1024,
        tie_embeddings=arch == "qwen3",
        random_norms=False,
        weight_scale=3.0,
    )
    return rlexact.exactify(model.to(device="cuda", dtype=torch.bfloat16))


def assert_exact(model, outs: list[Completion], temperature: float = 1.0) -> None:
    ref = rlexact.sequence_logprobs(model, [o.sequence for o in outs], temperature)
    bad = [i for i, (o, r) in enumerate(zip(outs, ref)) if not torch.equal(o.logprobs, r[-len(o.token_ids) :].cpu())]
    assert not bad, f"{len(bad)}/{len(outs)} completions differ from the trainer path, e.g. {bad[:5]}"


def same(a: list[Completion], b: list[Completion]) -> bool:
    return all(x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def qwen():
    return make_model("qwen3", kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", kv_heads=1, head_dim=128, vocab=517, seed=1)


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_gpu_exact_graphs_on_off(arch, qwen, llama):
    """Batch sizes 1..64, mixed prompt lengths: exact with and without CUDA graphs, and graphs == eager bitwise."""
    model = qwen if arch == "qwen" else llama
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=24, seed=7, temperature=0.9)
    results = {}
    for graphs in (True, False):
        gen = Generator(model, cuda_graphs=graphs, max_num_seqs=64, block_size=16)
        outs = []
        for size in (1, 2, 3, 7, 16, 33, 64):
            outs += gen.generate(prompts_for(size, vocab, hi=60, seed=size), params)
            if graphs:
                assert gen.stats["cuda_graphs_disabled"] is None, f"capture failed: {gen.stats['cuda_graphs_disabled']}"
                assert gen.stats["graph_steps"] > 0
            else:
                assert gen.stats["graph_steps"] == 0
        assert_exact(model, outs, temperature=0.9)
        results[graphs] = outs
    assert same(results[True], results[False])


def test_gpu_exact_chunked_preempted_shuffled(qwen):
    prompts = prompts_for(40, 1003, lo=20, hi=200, seed=3)
    params = SamplingParams(max_new_tokens=32, seed=1, n=2)
    gen = Generator(qwen, max_num_batched_tokens=96, num_kv_blocks=120, block_size=16, shuffle_blocks=True)
    outs = gen.generate(prompts, params)
    assert gen.stats["preemptions"] > 0
    assert gen.stats["graph_steps"] > 0
    assert_exact(qwen, outs)
    roomy = Generator(qwen, cuda_graphs=False).generate(prompts, params)
    assert same(outs, roomy)


def test_gpu_score_and_native_control(qwen):
    prompts = prompts_for(24, 1003, lo=5, hi=120, seed=5)
    params = SamplingParams(max_new_tokens=16, seed=2)
    outs = Generator(qwen).generate(prompts, params)
    seqs = [o.sequence for o in outs]
    ref = rlexact.sequence_logprobs(qwen, seqs)
    got = Generator(qwen, max_num_batched_tokens=64).score(seqs)
    assert all(g.device == r.device and torch.equal(g, r) for g, r in zip(got, ref))
    native = Generator(qwen, kernels="native").generate(prompts, params)
    nref = rlexact.sequence_logprobs(qwen, [o.sequence for o in native])
    assert any(not torch.equal(o.logprobs, r[-len(o.token_ids) :].cpu()) for o, r in zip(native, nref))
    eager = Generator(qwen, kernels="native", cuda_graphs=False).generate(prompts, params)
    assert len(eager) == len(native)


def test_gpu_request_invariance_and_top_p(qwen):
    target = list(range(10, 40))
    params = SamplingParams(max_new_tokens=20, seed=9, top_p=0.9, top_k=50)
    alone = Generator(qwen).generate([target], params, request_ids=[5])[0]
    others = prompts_for(50, 1003, hi=60, seed=8)
    crowd = Generator(qwen).generate(
        others[:25] + [target] + others[25:], params, request_ids=[*range(100, 125), 5, *range(200, 225)]
    )
    assert crowd[25].token_ids == alone.token_ids and torch.equal(crowd[25].logprobs, alone.logprobs)
    assert_exact(qwen, [alone, crowd[25]])


def test_gpu_triton_sampler_batch_invariant():
    from rlexact.rollout import sampler as S

    torch.manual_seed(0)
    z = torch.randn(37, 151936, device="cuda") * 3
    rid = torch.arange(37, device="cuda") * 11
    pos = torch.arange(37, device="cuda") + 100
    full = S.gumbel_argmax(z, None, 3, rid, pos)
    for i in (0, 17, 36):
        one = S.gumbel_argmax(z[i : i + 1].contiguous(), None, 3, rid[i : i + 1], pos[i : i + 1])
        assert one.item() == full[i].item()
    ref = S._gumbel_argmax_torch(z, None, 3, rid, pos)
    assert (ref == full).float().mean().item() > 0.9  # same hash; float log may differ on rare near-ties
    from rlexact.ops.triton_sampler import gumbel_argmax_triton

    lse = torch.logsumexp(z, -1)
    for splits in (1, 7, 75):  # vocabulary slices never change the draw
        tok, lp = gumbel_argmax_triton(z, None, 3, rid, pos, lse, splits=splits)
        assert torch.equal(tok, full), splits
        assert torch.equal(lp, z.gather(-1, full[:, None]).squeeze(-1) - lse)
    assert not torch.equal(S.gumbel_argmax(z, None, 4, rid, pos), full)  # negative control: the seed counts
    # the hardware base-2 logarithms change the noise by a few ulp: the same draws but on near-ties
    accurate = gumbel_argmax_triton(z, None, 3, rid, pos, fast_log=False)[0]
    assert (accurate == full).float().mean().item() > 0.9


def test_gpu_split_counters_shared_and_left_zeroed():
    """One ticket buffer serves consecutive split-parallel decode launches: outputs bitwise those of launches with
    their own counters, and the buffer is zero again after every launch."""
    from rlexact import ops

    torch.manual_seed(0)
    hq, hkv, d, page, keys = 16, 8, 128, 16, 5000
    blocks = -(-keys // page)
    kc = torch.randn(3 * blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(3 * blocks, device="cuda").to(torch.int32).view(3, blocks)
    q = torch.randn(3, hq, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(4, device="cuda", dtype=torch.int32)
    lens = torch.tensor([keys, 1500, 17], device="cuda", dtype=torch.int32)
    ref = ops.attention_paged(q, kc, vc, tables, cu, lens, 0.1, max_seqlen_q=1)
    counters = torch.zeros(3 * hq, dtype=torch.int32, device="cuda")
    for _ in range(3):
        out = ops.attention_paged(q, kc, vc, tables, cu, lens, 0.1, max_seqlen_q=1, split_counters=counters)
        assert torch.equal(out, ref)
        assert int(counters.abs().sum()) == 0
    longer = lens.clone()
    longer[1] = 2100  # negative control: another key count past the first split changes that row
    assert not torch.equal(ops.attention_paged(q, kc, vc, tables, cu, longer, 0.1, max_seqlen_q=1)[1], ref[1])


def test_gpu_later_captures_skip_the_warm_up(qwen):
    """A generator's later calls capture known decode graphs without the eager warm-up step; the completions stay
    bitwise those of the first call and of the trainer."""
    prompts = prompts_for(12, 1003, hi=60, seed=5)
    params = SamplingParams(max_new_tokens=16, seed=3)
    gen = Generator(qwen)
    first = gen.generate(prompts, params)
    assert gen.stats["graph_captures"] >= 1
    assert gen.stats["graph_captures_warmed"] == gen.stats["graph_captures"]
    assert gen.stats["graph_captures_ahead"] == 0
    second = gen.generate(prompts, params)
    assert gen.stats["graph_captures"] >= 1 and gen.stats["graph_captures_warmed"] == 0
    assert gen.stats["graph_captures_ahead"] == 1  # the first decode graph, captured during the prefill
    assert same(first, second)
    reseeded = gen.generate(prompts, SamplingParams(max_new_tokens=16, seed=4))
    assert gen.stats["graph_captures_warmed"] == 0  # the seed is not part of the kernels
    assert [o.token_ids for o in reseeded] != [o.token_ids for o in first]
    assert_exact(qwen, second + reseeded)
    gen.generate(prompts[:2], params)  # a new bucket and table width: warmed once
    assert gen.stats["graph_captures_warmed"] >= 1


def test_gpu_capture_failure_falls_back_cleanly(qwen, monkeypatch):
    """A host sync inside the captured step makes capture fail: warn, record why, run eagerly, leave CUDA usable."""
    import rlexact.rollout.runner as runner_mod

    prompts = prompts_for(6, 1003, hi=60, seed=11)
    params = SamplingParams(max_new_tokens=8, seed=4)
    ok = Generator(qwen, kernels="native").generate(prompts, params)
    original = runner_mod.head_logits

    def syncing_head(model, hidden, temperature):
        hidden.sum().item()  # a host sync: illegal while capturing
        return original(model, hidden, temperature)

    monkeypatch.setattr(runner_mod, "head_logits", syncing_head)
    gen = Generator(qwen, kernels="native")
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        outs = gen.generate(prompts, params)
    assert "item" in gen.stats["cuda_graphs_disabled"] or "capturing" in gen.stats["cuda_graphs_disabled"]
    assert gen.stats["graph_steps"] == 0 and len(outs) == len(prompts)
    monkeypatch.setattr(runner_mod, "head_logits", original)
    torch.randn(4, device="cuda")  # the CUDA RNG is not left in capture mode
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    again = Generator(qwen, kernels="native")
    again_outs = again.generate(prompts, params)
    assert again.stats["graph_steps"] > 0 and again.stats["cuda_graphs_disabled"] is None
    assert [o.token_ids for o in again_outs] == [o.token_ids for o in ok]


def test_gpu_failed_capture_ahead_leaves_the_usual_capture(qwen, monkeypatch):
    """A capture ahead of the decode steps that fails (a host sync inside it) is recorded and changes nothing else:
    no warning, graphs stay on, the decode step captures its graph as usual, same completions."""
    import warnings

    import rlexact.rollout.runner as runner_mod

    prompts = prompts_for(6, 1003, hi=60, seed=12)
    params = SamplingParams(max_new_tokens=8, seed=4)
    gen = Generator(qwen)
    first = gen.generate(prompts, params)
    original_head, original_ahead = runner_mod.head_logits, runner_mod.ModelRunner.capture_ahead
    inside = [False]

    def head(model, hidden, temperature):
        if inside[0]:
            hidden.sum().item()  # a host sync: illegal while capturing
        return original_head(model, hidden, temperature)

    def ahead(self, rows):
        inside[0] = True
        try:
            original_ahead(self, rows)
        finally:
            inside[0] = False

    monkeypatch.setattr(runner_mod, "head_logits", head)
    monkeypatch.setattr(runner_mod.ModelRunner, "capture_ahead", ahead)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        second = gen.generate(prompts, params)
    assert "item" in gen.stats["capture_ahead_failed"] or "capturing" in gen.stats["capture_ahead_failed"]
    assert gen.stats["graph_captures_ahead"] == 0 and gen.stats["graph_captures"] >= 1
    assert gen.stats["cuda_graphs_disabled"] is None and gen.stats["graph_steps"] > 0
    assert same(first, second)


def reused_and_computed(model, prompts, params) -> tuple[Generator, Generator]:
    """Generate with KV blocks reused (prompt sharing and prefix caching, the defaults) and with every block computed;
    check the completions are bitwise the same and the trainer's; return both generators (their ``stats``)."""
    reused = Generator(model, max_num_batched_tokens=256)
    outs = reused.generate(prompts, params)
    plain = Generator(model, max_num_batched_tokens=256, share_prompt_blocks=False, prefix_caching=False)
    assert same(outs, plain.generate(prompts, params))
    assert_exact(model, outs)
    return reused, plain


def test_gpu_shared_prompts_equal_unshared(qwen):
    """n = 8 samples share their prompt's blocks (prefilled once, forks replay decode graphs): the same completions
    as without sharing, bitwise, and equal to the trainer."""
    prompts = prompts_for(6, 1003, lo=30, hi=300, seed=21)
    shared, plain = reused_and_computed(qwen, prompts, SamplingParams(max_new_tokens=16, seed=3, n=8))
    assert shared.stats["prompt_forks"] == 6 * 7 and shared.stats["graph_steps"] > 0
    assert shared.stats["prefill_tokens"] < plain.stats["prefill_tokens"] / 4


def test_gpu_samples_fork_from_a_finished_sibling(qwen):
    """n = 8 samples, a quarter of the vocabulary stops: samples that stop at their first token stay donors until
    their waiting siblings forked from them, so every sibling forks; the same completions as without sharing,
    bitwise, and the trainer's."""
    prompts = prompts_for(6, 1003, lo=30, hi=300, seed=22)
    params = SamplingParams(max_new_tokens=16, seed=4, n=8, stop_token_ids=list(range(0, 1003, 4)))
    shared, _ = reused_and_computed(qwen, prompts, params)
    assert shared.stats["prompt_forks"] == 6 * 7 and shared.stats["graph_steps"] > 0


def test_gpu_prefix_cache_equals_uncached(qwen):
    """Prompts behind a shared 200-token system prefix, n = 4: the prefix is computed about once and the completions
    equal those of a run without prefix caching or sharing, bitwise, and the trainer's."""
    system = prompts_for(1, 1003, lo=200, hi=200, seed=30)[0]
    prompts = [system + p for p in prompts_for(10, 1003, lo=5, hi=120, seed=31)]
    cached, plain = reused_and_computed(qwen, prompts, SamplingParams(max_new_tokens=16, seed=5, n=4))
    assert cached.stats["prefix_cached_tokens"] >= 8 * 192 and cached.stats["graph_steps"] > 0
    assert cached.stats["prefill_tokens"] < plain.stats["prefill_tokens"] / 4


@pytest.mark.parametrize("split", [None, 256], ids=["one_split", "narrow_then_wide"])
def test_gpu_shared_prefix_decode_equals_plain(llama, monkeypatch, split):
    """Head dim 128 (the Gluon decode launch): n = 8 samples of each prompt, and prompts behind a shared system
    prefix, decode with their prompt's tiles read once per group of sequences; the completions equal those with
    ``shared_prefix_decode=False`` bitwise, and the trainer's. The decode launches did read a plan. With KV splits of
    256 keys the call's table spans two splits: its decode graphs read only one split's columns (the one-split
    launches, with the plan) until a sequence passes 256 keys, then the whole table (split-parallel, no plan)."""
    from rlexact.ops import gluon_decode
    from rlexact.ops import triton_attention as ta

    if split is not None:
        orig = ta._fwd_config
        monkeypatch.setattr(ta, "_fwd_config", lambda hd, dt: orig(hd, dt) | {"SPLIT": split})
    plans = []
    real = gluon_decode.forward
    monkeypatch.setattr(gluon_decode, "forward", lambda *a: plans.append(a[8] is not None) or real(*a))
    system = prompts_for(1, 517, lo=130, hi=130, seed=40)[0]
    prompts = prompts_for(5, 517, lo=64, hi=200, seed=41)
    prompts += [system + p for p in prompts_for(4, 517, lo=1, hi=90, seed=42)]
    params = SamplingParams(max_new_tokens=40, seed=3, n=8, temperature=0.9)
    gen = Generator(llama, max_num_batched_tokens=512)
    outs = gen.generate(prompts, params)
    off = Generator(llama, max_num_batched_tokens=512, shared_prefix_decode=False)
    assert same(outs, off.generate(prompts, params))
    assert gen.stats["decode_shared_prefix_keys"] > 0 and off.stats["decode_shared_prefix_keys"] == 0
    assert any(plans) and not all(plans)
    assert_exact(llama, outs, temperature=0.9)


def test_gpu_split_kv_generator(qwen, monkeypatch):
    """KV splits of 128 keys (prompts spanning several splits): split-parallel decode in CUDA graphs, chunked prefill
    with in-program split loops, and the trainer's packed forward agree bitwise."""
    from rlexact.ops import triton_attention as ta

    orig = ta._fwd_config
    monkeypatch.setattr(ta, "_fwd_config", lambda hd, dt: orig(hd, dt) | {"SPLIT": 2 * orig(hd, dt)["BLOCK_N"]})
    prompts = prompts_for(12, 1003, lo=100, hi=600, seed=4)
    gen = Generator(qwen, max_num_batched_tokens=200, block_size=16)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=40, seed=6, n=2))
    assert gen.stats["graph_steps"] > 0 and gen.stats["cuda_graphs_disabled"] is None
    assert_exact(qwen, outs)


def test_gpu_overlapped_decode_equals_sequential(qwen):
    """Decode graphs launched before the previous step is read back (the default) give bitwise the completions of
    step-by-step decoding, across frequent stop tokens (the in-flight step of a stopped sequence is dropped, the
    remaining rows gathered on the device) and admissions (fewer slots than samples); equal to the trainer."""
    prompts = prompts_for(48, 1003, lo=5, hi=90, seed=31)
    params = SamplingParams(max_new_tokens=40, seed=12, n=2, stop_token_ids=list(range(100, 130)))
    kw = {"max_num_seqs": 64, "block_size": 16}
    overlapped = Generator(qwen, **kw)
    outs = overlapped.generate(prompts, params)
    sequential = Generator(qwen, overlap_decode=False, **kw)
    assert same(outs, sequential.generate(prompts, params))
    assert overlapped.stats["overlapped_steps"] > 0 and sequential.stats["overlapped_steps"] == 0
    assert sum(o.finish_reason == "stop" for o in outs) >= 10
    assert_exact(qwen, outs)


def test_gpu_gathered_prefill_chunks(llama, monkeypatch):
    """Prompts longer than the token budget prefill in chunks after their earlier keys; on sm_90 (head dim 128) such
    chunks gather their keys out of the cache and run the packed Gluon forward (``rlexact.ops.kv_gather``), and the
    completions equal the trainer's bitwise. Negative control: a gather that swaps two key rows changes them."""
    from rlexact.ops import gluon_attention, kv_gather

    if gluon_attention.gluon is None or not gluon_attention.sm90(torch.cuda.current_device()):
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    calls = []
    real = kv_gather.gather
    monkeypatch.setattr(kv_gather, "gather", lambda *a: calls.append(1) or real(*a))
    prompts = prompts_for(6, llama.config.vocab_size, lo=300, hi=900, seed=8)
    params = SamplingParams(max_new_tokens=16, seed=3)
    outs = Generator(llama, max_num_batched_tokens=256, block_size=16).generate(prompts, params)
    assert calls, "no prefill chunk was gathered"
    assert_exact(llama, outs)

    def swapped(*args):
        k, v = real(*args)
        k = k.clone()
        k[[1, 2]] = k[[2, 1]]  # the first sequence's keys at positions 1 and 2
        return k, v

    monkeypatch.setattr(kv_gather, "gather", swapped)
    bad = Generator(llama, max_num_batched_tokens=256, block_size=16).generate(prompts, params)
    assert not same(bad, outs)
