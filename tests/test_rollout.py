"""Rollout engine on CPU: exactness against the trainer path under batching, chunking, preemption and page order;
keyed sampling; native negative control; weight sharing; scoring; bad inputs."""

from __future__ import annotations

import importlib.util
import subprocess

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import rlexact
from interpreter_jobs import failure_report
from models import prompts_for, tiny_model
from rlexact.distributed import gathered_params
from rlexact.rollout import Completion, Generator, GeneratorConfig, SamplingParams
from rlexact.rollout import sampler as S


def make_model(
    arch: str = "qwen3", *, dtype: torch.dtype = torch.float32, hidden: int = 48, max_pos: int = 256, **kw
) -> torch.nn.Module:
    """A tiny randomly initialized, exactified causal LM (no downloads); 2-D weights x2.5 for sharper distributions,
    so sampled tokens differ from uniform noise."""
    model = tiny_model(
        arch, dtype=dtype, hidden=hidden, intermediate=2 * hidden - 8, max_pos=max_pos, weight_scale=2.5, **kw
    )
    return rlexact.exactify(model)


def assert_exact(model: torch.nn.Module, outs: list[Completion], temperature: float = 1.0) -> None:
    """THE invariant: every reported log-prob equals the trainer path bitwise."""
    ref = rlexact.sequence_logprobs(model, [o.sequence for o in outs], temperature)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.logprobs.dtype == torch.float32
        assert o.logprobs.shape == (len(o.token_ids),) and len(o.token_ids) > 0
        assert torch.equal(o.logprobs, r[-len(o.token_ids) :]), f"completion {i} log-probs differ from the trainer"


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    return make_model("qwen3", kv_heads=2)


@pytest.fixture(scope="module")
def llama_bf16() -> torch.nn.Module:
    return make_model("llama", dtype=torch.bfloat16, vocab=61, hidden=64, kv_heads=1, seed=1)


# ----------------------------------------------------------------------------------------------------------------------
# exactness
# ----------------------------------------------------------------------------------------------------------------------


def test_exact_batch_sizes_1_to_64(qwen):
    """One call per batch size; mixed prompt lengths; every token's log-prob equals the trainer's."""
    gen = Generator(qwen, block_size=8)
    params = SamplingParams(max_new_tokens=5, seed=3)
    all_outs = []
    for size in (1, 2, 3, 7, 16, 33, 64):
        outs = gen.generate(prompts_for(size, 97, seed=size), params)
        assert len(outs) == size
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        all_outs += outs
    assert_exact(qwen, all_outs)


@pytest.mark.parametrize("budget", [4, 11, 29])
def test_exact_chunked_prefill_bf16(llama_bf16, budget):
    """Prompts split into chunks mixed with decodes in the same packed forward (Llama, bf16, MQA)."""
    gen = Generator(llama_bf16, max_num_batched_tokens=budget, max_num_seqs=5, block_size=4)
    prompts = prompts_for(7, 61, lo=5, hi=34, seed=budget)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=5, seed=1, temperature=0.8))
    assert gen.stats["steps"] > 5  # really chunked / interleaved
    assert_exact(llama_bf16, outs, temperature=0.8)


def test_fresh_prefill_steps_run_packed_attention(llama_bf16, monkeypatch):
    """Eager steps whose sequences all start at position 0 run exact attention packed over their own keys (the
    training kernels); the others, chunks with past keys and decodes, the paged kernel; completions are bitwise the
    trainer's. Negative control: a chunk with past keys marked fresh sees only its own keys and leaves the bits."""
    from rlexact import ops
    from rlexact.rollout.runner import ModelRunner

    calls = {"packed": 0, "paged": 0}
    varlen, paged = ops.attention_varlen, ops.attention_paged
    monkeypatch.setattr(ops, "attention_varlen", lambda *a, **k: calls.__setitem__("packed", calls["packed"] + 1)
                        or varlen(*a, **k))  # fmt: skip
    monkeypatch.setattr(ops, "attention_paged", lambda *a, **k: calls.__setitem__("paged", calls["paged"] + 1)
                        or paged(*a, **k))  # fmt: skip
    prompts = prompts_for(5, 61, lo=5, hi=30, seed=4)
    params = SamplingParams(max_new_tokens=4, seed=2)
    cfg = dict(max_num_batched_tokens=24, max_num_seqs=2, block_size=4, cuda_graphs=False)
    outs = Generator(llama_bf16, **cfg).generate(prompts, params)
    assert calls["packed"] > 0 and calls["paged"] > 0
    monkeypatch.setattr(ops, "attention_varlen", varlen)
    monkeypatch.setattr(ops, "attention_paged", paged)
    assert_exact(llama_bf16, outs)
    prepare = ModelRunner._prepare
    monkeypatch.setattr(ModelRunner, "_prepare", lambda self, b: prepare(self, b) | {"fresh": True})
    wrong = Generator(llama_bf16, **cfg).generate(prompts, params)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(outs, wrong))


@pytest.mark.parametrize(
    "arch", ["mistral", "ministral3", "mistral3_vl", "olmo2", "olmo3", "phi3", "smollm3", "granite", "gemma3",
             "gemma3_vl"]
)  # fmt: skip
def test_exact_rollout_per_architecture_bf16(arch):
    """Rollout == trainer bitwise in bf16 through chunked prefill for the architectures without a fixture of their
    own (OLMo-2: whole-projection q/k norms before the rotation; Phi-3: one qkv_proj and one gate_up_proj; SmolLM3:
    layers without rotary; Granite: scaled residual branches and logits; Gemma 3: a sliding-window layer and a
    full one with their own rotary tables, (1 + w) norms, the GELU-tanh gate; OLMo 3: OLMo-2's layers with the
    windows and tables of Gemma 3; Gemma 3 4B+: the same text decoder inside the image-text model; Ministral 3:
    queries scaled by position, alone and inside Mistral 3's image-text model); negative control: the native kernels
    differ."""
    model = make_model(arch, dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=2, head_dim=16, seed=6)
    prompts, params = prompts_for(9, 97, lo=2, hi=25, seed=6), SamplingParams(max_new_tokens=6, seed=6)
    assert_exact(model, Generator(model, max_num_batched_tokens=16, block_size=4).generate(prompts, params))
    native = Generator(model, kernels="native", max_num_batched_tokens=16, block_size=4).generate(prompts, params)
    with pytest.raises(AssertionError, match="differ from the trainer"):
        assert_exact(model, native)


def test_chunk_size_does_not_change_results(qwen):
    prompts = prompts_for(6, 97, lo=10, hi=30, seed=7)
    params = SamplingParams(max_new_tokens=6, seed=11)
    a = Generator(qwen, max_num_batched_tokens=5, block_size=4).generate(prompts, params)
    b = Generator(qwen, chunked_prefill=False, block_size=16).generate(prompts, params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)


def test_exact_cache_is_uninitialized_and_never_read_unwritten(qwen, monkeypatch):
    """The exact path takes its KV cache uninitialized (no zero fill). Filled with NaN instead, every completion is
    still bitwise the trainer's (preemption, shuffled pages, shared prompt blocks); the native path zeroes its cache."""
    import rlexact.rollout.engine as engine_mod

    made = []

    class NanCache(engine_mod.KVCache):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self.zeroed)
            if not self.zeroed:
                self.data.fill_(float("nan"))

    monkeypatch.setattr(engine_mod, "KVCache", NanCache)
    prompts = prompts_for(7, 97, lo=4, hi=14, seed=6)
    params = SamplingParams(max_new_tokens=8, seed=2, n=2)
    gen = Generator(qwen, num_kv_blocks=10, block_size=4, max_num_batched_tokens=24, shuffle_blocks=True)
    outs = gen.generate(prompts, params)
    assert gen.stats["preemptions"] > 0 and made == [False]
    assert_exact(qwen, outs)
    Generator(qwen, kernels="native", block_size=4).generate(prompts[:2], params)
    assert made == [False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_preemption_and_shuffled_pages(dtype):
    """A KV budget small enough to force preemption + recompute, with shuffled free blocks (Qwen3, head_dim 64)."""
    model = make_model("qwen3", dtype=dtype, hidden=64, heads=4, kv_heads=4, head_dim=64, seed=2)
    prompts = prompts_for(7, 97, lo=4, hi=14, seed=5)
    params = SamplingParams(max_new_tokens=8, seed=5, n=2)
    gen = Generator(model, num_kv_blocks=10, block_size=4, max_num_batched_tokens=24, shuffle_blocks=True)
    outs = gen.generate(prompts, params)
    assert gen.stats["preemptions"] > 0
    assert any(o.num_preemptions > 0 for o in outs)
    assert_exact(model, outs)
    # same samples without memory pressure, pages in order
    roomy = Generator(model, block_size=4, max_num_batched_tokens=24).generate(prompts, params)
    assert roomy and all(o.num_preemptions == 0 for o in roomy)
    for x, y in zip(outs, roomy):
        assert x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)


def test_score_equals_sequence_logprobs(qwen):
    seqs = prompts_for(9, 97, lo=1, hi=45, seed=9)
    gen = Generator(qwen, max_num_batched_tokens=7, block_size=4)
    for temp in (1.0, 0.7):
        got = gen.score(seqs, temperature=temp)
        ref = rlexact.sequence_logprobs(qwen, seqs, temp)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g.dtype == torch.float32 and g.shape == r.shape
            assert torch.equal(g, r)


def test_top_k_top_p_report_full_softmax_logprobs(qwen):
    prompts = prompts_for(5, 97, seed=12)
    for top_k, top_p in ((5, 1.0), (0, 0.6), (7, 0.8)):
        outs = Generator(qwen).generate(
            prompts, SamplingParams(max_new_tokens=6, temperature=0.9, top_k=top_k, top_p=top_p, seed=2)
        )
        assert_exact(qwen, outs, temperature=0.9)


def test_greedy(qwen):
    prompts = prompts_for(4, 97, seed=13)
    a = Generator(qwen).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, seed=1))
    b = Generator(qwen).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, seed=2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert_exact(qwen, a, temperature=1.0)  # greedy reports temperature-1 log-probs
    for o in a:  # every greedy token is the argmax of the trainer's distribution
        for k, t in enumerate(o.token_ids):
            prefix = o.prompt_token_ids + o.token_ids[:k]
            alts = rlexact.sequence_logprobs(qwen, [prefix + [v] for v in range(97)])
            best = torch.stack([x[-1] for x in alts]).argmax().item()
            assert t == best
            break


# ----------------------------------------------------------------------------------------------------------------------
# keyed sampling
# ----------------------------------------------------------------------------------------------------------------------


def test_request_alone_equals_request_in_batch(qwen):
    """Same seed and request id: identical tokens and log-probs alone and inside a batch of 50 others."""
    target = [5, 17, 3, 88, 41, 9]
    others = prompts_for(50, 97, lo=1, hi=25, seed=21)
    params = SamplingParams(max_new_tokens=8, seed=123, top_p=0.95)
    alone = Generator(qwen).generate([target], params, request_ids=[777])[0]
    batch = [*others[:20], target, *others[20:]]
    rids = [1000 + i for i in range(20)] + [777] + [2000 + i for i in range(30)]
    crowd = Generator(qwen, max_num_batched_tokens=200, block_size=4).generate(batch, params, request_ids=rids)
    assert crowd[20].request_id == 777
    assert crowd[20].token_ids == alone.token_ids
    assert torch.equal(crowd[20].logprobs, alone.logprobs)


def test_n_samples_prompt_major_and_distinct(qwen):
    prompts = prompts_for(3, 97, seed=31)
    outs = Generator(qwen).generate(prompts, SamplingParams(max_new_tokens=8, n=4, seed=0))
    assert [o.prompt_index for o in outs] == [0] * 4 + [1] * 4 + [2] * 4
    assert [o.request_id for o in outs] == list(range(12))
    assert all(o.prompt_token_ids == prompts[o.prompt_index] for o in outs)
    assert len({tuple(o.token_ids) for o in outs[:4]}) > 1  # different request ids draw differently
    again = Generator(qwen).generate(prompts, SamplingParams(max_new_tokens=8, n=4, seed=0))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    other_seed = Generator(qwen).generate(prompts, SamplingParams(max_new_tokens=8, n=4, seed=1))
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in outs]


def test_keyed_gumbel_matches_softmax():
    """Frequencies of keyed Gumbel-max draws over many positions match softmax(z); truncation restricts support."""
    torch.manual_seed(0)
    z = torch.randn(1, 7) * 1.5
    n = 20000
    pos = torch.arange(n)
    rid = torch.full((n,), 3)
    zz = z.expand(n, -1).contiguous()
    toks = S._gumbel_argmax_torch(zz, None, 42, rid, pos)
    freq = torch.bincount(toks, minlength=7).float() / n
    p = torch.softmax(z[0], -1)
    assert (freq - p).abs().max() < 0.015
    thr = S.top_k_top_p_threshold(zz, 3, 1.0)
    allowed = set(torch.topk(z[0], 3).indices.tolist())
    assert set(S._gumbel_argmax_torch(zz, thr, 42, rid, pos).unique().tolist()) <= allowed
    thr = S.top_k_top_p_threshold(zz, 0, 0.5)
    order = torch.argsort(z[0], descending=True)
    cum = torch.cumsum(p[order], 0)
    keep = set(order[: int((cum - p[order] < 0.5).sum())].tolist())
    assert set(S._gumbel_argmax_torch(zz, thr, 42, rid, pos).unique().tolist()) <= keep
    # no overflow: extreme keys stay 32-bit
    ka, kb = S.row_keys(2**64 - 1, torch.tensor([2**63 - 1, 0]), torch.tensor([2**62, 0]))
    h = S.token_hash(ka, kb, 11)
    assert int(h.min()) >= 0 and int(h.max()) < 2**32


SAMPLER_INTERP = (
    "import torch\n"
    "from rlexact.rollout import sampler as S\n"
    "from rlexact.ops.triton_sampler import gumbel_argmax_triton\n"
    "torch.manual_seed(0)\n"
    "z = torch.randn(6, 9001) * 2\n"
    "rid = torch.tensor([0, 1, 2, 2**40, 5, 6]); pos = torch.tensor([3, 4, 5, 6, 2**33, 0])\n"
    "thr = S.top_k_top_p_threshold(z, 20, 0.9)\n"
    "z[1, 2500:] = float('-inf'); z[4, 4100:] = float('-inf')  # slices with no finite score\n"
    "lse = torch.logsumexp(z, -1)\n"
    "for seed in (9, 2**40 + 7, 2**64 - 1):\n"
    "    for t in (None, thr):\n"
    "        ref = S._gumbel_argmax_torch(z, t, seed, rid, pos)\n"
    "        for splits in (1, 2, 5):\n"
    "            got, lp = gumbel_argmax_triton(z, t, seed, rid, pos, lse, splits=splits)\n"
    "            assert torch.equal(got, ref), (seed, t is None, splits)\n"
    "            assert torch.equal(lp, z.gather(-1, ref[:, None]).squeeze(-1) - lse)\n"
    "        assert gumbel_argmax_triton(z, t, seed, rid, pos)[1] is None\n"
    "        other = gumbel_argmax_triton(z, t, seed + 1, rid, pos)[0]\n"
    "        assert not torch.equal(other, ref)  # negative control: the seed enters the draw\n"
    "print('ok')\n"
)


@pytest.mark.interpreter("-c", SAMPLER_INTERP)
def test_triton_sampler_matches_torch_under_interpreter(interpreter_run: subprocess.CompletedProcess) -> None:
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert "ok" in interpreter_run.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="needs triton's CUDA backend")
def test_triton_sampler_noise_uses_hardware_log2() -> None:
    """Compiled for sm_90 on the host: with ``FAST_LOG`` each noise value takes two ``lg2.approx`` instructions (the
    series near ``u = 1`` needs none), and the kernel is less than two thirds the size of the libdevice version;
    without it there is no ``lg2.approx`` (negative control)."""
    from hopper_compile import compile_for_hopper
    from rlexact.ops import triton_sampler as st

    args = dict(z_ptr="*fp32", thr_ptr="*fp32", rid_ptr="*i64", pos_ptr="*i64", best_ptr="*fp32", idx_ptr="*i32",
                seed_lo_salted="i64", seed_hi="i64", V="i32", stride_z="i32", SLICE_V="i32")  # fmt: skip
    const = dict(HAS_THR=False, BLOCK_V=2048, C1=st.C1, C2=st.C2, SALT=st.ROW_SALT, PDL=False)
    ptx = {
        fast: compile_for_hopper(st._gumbel_argmax_kernel, args, const | {"FAST_LOG": fast}, num_warps=8).asm["ptx"]
        for fast in (True, False)
    }
    per_thread = 2048 // (8 * 32)  # noise values per thread and loop iteration
    assert ptx[True].count("lg2.approx.f32") == 2 * per_thread
    assert "lg2.approx" not in ptx[False]
    assert len(ptx[True].splitlines()) < 2 / 3 * len(ptx[False].splitlines())


# ----------------------------------------------------------------------------------------------------------------------
# negative control, weight sharing, stop tokens, FSDP hook
# ----------------------------------------------------------------------------------------------------------------------


def test_native_kernels_differ_from_trainer(qwen):
    """Negative control: the stock-kernel path is not bitwise equal to the trainer path (so the tests can fail)."""
    prompts = prompts_for(8, 97, lo=5, hi=30, seed=41)
    outs = Generator(qwen, kernels="native", block_size=4).generate(prompts, SamplingParams(max_new_tokens=8, seed=4))
    ref = rlexact.sequence_logprobs(qwen, [o.sequence for o in outs])
    diffs = [(o.logprobs - r[-len(o.token_ids) :]).abs().max().item() for o, r in zip(outs, ref)]
    assert max(diffs) > 0, "native path unexpectedly bitwise equal to the exact trainer path"
    assert max(diffs) < 1e-3  # but it is the same model
    assert rlexact.models.get_state(qwen).kernels == "exact"  # restored after the call
    sc = Generator(qwen, kernels="native", max_num_batched_tokens=9).score([o.sequence for o in outs])
    assert any(not torch.equal(a, b) for a, b in zip(sc, ref))


def test_weight_update_is_seen_without_copy():
    model = make_model("qwen3", kv_heads=1, seed=4)
    gen = Generator(model, keep_kv_cache=True)
    prompts = prompts_for(4, 97, seed=51)
    params = SamplingParams(max_new_tokens=6, seed=8)
    before = gen.generate(prompts, params)
    assert_exact(model, before)
    with torch.no_grad():  # simulate an optimizer step, in place
        model.model.layers[0].mlp.up_proj.weight.add_(0.05 * torch.randn_like(model.model.layers[0].mlp.up_proj.weight))
    after = gen.generate(prompts, params)
    assert_exact(model, after)
    assert any(a.token_ids != b.token_ids or not torch.equal(a.logprobs, b.logprobs) for a, b in zip(before, after))
    gen.release()


def test_stop_tokens_and_ignore_eos(qwen):
    prompts = prompts_for(4, 97, seed=61)
    free = Generator(qwen).generate(prompts, SamplingParams(max_new_tokens=10, seed=2))
    stop_tok = free[0].token_ids[3]
    outs = Generator(qwen).generate(prompts, SamplingParams(max_new_tokens=10, seed=2, stop_token_ids=(stop_tok,)))
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop_tok
    for o, f in zip(outs, free):
        cut = f.token_ids.index(stop_tok) + 1 if stop_tok in f.token_ids else len(f.token_ids)
        assert o.token_ids == f.token_ids[:cut]
        assert o.finish_reason == ("stop" if stop_tok in f.token_ids else "length")
    assert_exact(qwen, outs)
    # EOS from the model config, and ignore_eos
    qwen.generation_config.eos_token_id = stop_tok
    try:
        eos = Generator(qwen).generate(prompts[:1], SamplingParams(max_new_tokens=10, seed=2))
        assert eos[0].finish_reason == "stop"
        ign = Generator(qwen).generate(prompts[:1], SamplingParams(max_new_tokens=10, seed=2, ignore_eos=True))
        assert ign[0].finish_reason == "length" and len(ign[0].token_ids) == 10
    finally:
        qwen.generation_config.eos_token_id = None


def test_generator_exactifies_and_config(qwen):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    plain = Qwen3ForCausalLM(cfg).eval()
    assert not rlexact.is_exactified(plain)
    gen = Generator(plain, GeneratorConfig(block_size=4), max_num_seqs=3, progress=True)
    assert rlexact.is_exactified(plain) and gen.model is plain
    assert gen.config.block_size == 4 and gen.config.max_num_seqs == 3
    outs = gen.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=3))
    assert_exact(plain, outs)
    assert gen.stats["generated_tokens"] == 6 and gen.stats["kv_blocks"] >= 1
    assert GeneratorConfig(max_num_seqs=20).batch_buckets() == (1, 2, 4, 8, 16, 20)
    assert GeneratorConfig(max_num_seqs=64).batch_buckets()[-3:] == (32, 48, 64)
    for bad in (
        dict(kernels="fast"),
        dict(max_num_seqs=0),
        dict(block_size=-1),
        dict(max_num_batched_tokens=1.5),
        dict(num_kv_blocks=0),
        dict(kv_cache_memory_fraction=1.5),
        dict(graph_batch_sizes=(0, 4)),
    ):
        with pytest.raises(ValueError):
            GeneratorConfig(**bad)


def test_gathered_params_is_noop_without_fsdp(qwen):
    with gathered_params(qwen) as mods:
        assert mods == []


# ----------------------------------------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "kwargs", "gen_kwargs", "match"),
    [
        ([], {}, {}, "empty"),
        ([[1, 2], []], {}, {}, r"prompt_token_ids\[1\] is empty"),
        ([[1, 97]], {}, {}, "outside the vocabulary"),
        ([[-1, 3]], {}, {}, "outside the vocabulary"),
        (["123"], {}, {}, r"prompt_token_ids\[0\] is text, not token ids: tokenize it first"),
        ([5, 14, 5], {}, {}, r"prompt_token_ids\[0\] is the token id 5, not a sequence.*\[\[5, \.\.\.\]\] for one"),
        ([[1, 2.5]], {}, {}, r"must contain integer token ids, got 2.5 \(float\)"),
        ([torch.tensor([1.0, 2.0])], {}, {}, r"must contain integer token ids, got 1.0 \(float\)"),
        ([[1] * 250], dict(max_new_tokens=10), {}, "exceeds the model context 256"),
        ([[1] * 300], dict(max_new_tokens=1), {}, "exceeds the model context"),
        ([[1] * 20], dict(max_new_tokens=20), dict(max_model_len=32), "exceeds the model context 32"),
        ([[1] * 10], dict(max_new_tokens=8), dict(num_kv_blocks=3, block_size=4), r"KV cache too small.*needs 5"),
        ([[1] * 10], dict(max_new_tokens=8), dict(kv_cache_tokens=8, block_size=4), "KV cache too small"),
        ([[1] * 10], dict(max_new_tokens=8), dict(chunked_prefill=False, max_num_batched_tokens=8), "chunked"),
    ],
)
def test_bad_inputs_raise_value_error(qwen, prompts, kwargs, gen_kwargs, match):
    gen = Generator(qwen, **gen_kwargs)
    with pytest.raises(ValueError, match=match):
        gen.generate(prompts, SamplingParams(**kwargs))


def test_prompt_ids_of_any_integer_type_generate_alike(qwen):
    """Python ints, numpy integers and an int64 tensor are the same prompt (the all-``int`` fast path and the checked
    conversion agree); a float among numpy integers is still refused."""
    gen = Generator(qwen)
    params = SamplingParams(max_new_tokens=4, seed=5)
    ids = [5, 17, 3, 42]
    ref = gen.generate([ids], params)[0]
    for prompt in (np.array(ids), [np.int32(t) for t in ids], torch.tensor(ids)):
        out = gen.generate([prompt], params)[0]
        assert out.token_ids == ref.token_ids and torch.equal(out.logprobs, ref.logprobs)
    with pytest.raises(ValueError, match=r"must contain integer token ids, got 2.5 \(float\)"):
        gen.generate([[np.int64(1), 2.5]], params)


def test_bad_sampling_params_and_misc(qwen):
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-3)
    for p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=p)
    # values of the wrong type raise instead of being coerced or accepted
    for kwargs, match in ((dict(max_new_tokens=True), "max_new_tokens must be a positive int"),
                          (dict(temperature="1"), "temperature must be a finite number"),
                          (dict(temperature=float("nan")), "temperature must be a finite number"),
                          (dict(top_k=2.5), "top_k must be an int"), (dict(top_k=-1), "top_k must be >= 0"),
                          (dict(seed="abc"), "seed must be an int"), (dict(seed=1.5), "seed must be an int"),
                          (dict(n=2.0), "n must be a positive int"), (dict(ignore_eos=1), "ignore_eos must be a bool"),
                          (dict(stop_token_ids=[3, 1.5]), r"stop_token_ids\[1\] must be a non-negative integer"),
                          (dict(stop_token_ids=[-2]), r"stop_token_ids\[0\] must be a non-negative integer"),
                          (dict(stop_token_ids=5), r"must be a list of token ids, got 5; for one write \[5\]"),
                          (dict(stop_token_ids="ab"), "stop_token_ids is text, not token ids"),
                          (dict(temperature=0.0, top_k=5, logprobs="sampled"), "greedy.*'sampled'"),
                          (dict(temperature=0.0, top_p=0.9, logprobs="sampled"), "greedy.*'sampled'")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    assert SamplingParams(stop_token_ids=[3, 5]).stop_token_ids == (3, 5)
    assert SamplingParams(seed=np.int64(3)).seed == 3 and type(SamplingParams(seed=np.int64(3)).seed) is int
    SamplingParams(temperature=0.0, top_k=5)  # greedy with full log-probs, and greedy "sampled" without truncation
    SamplingParams(temperature=0.0, logprobs="sampled")
    gen = Generator(qwen)
    with pytest.raises(ValueError, match="request_ids has 1 entries"):
        gen.generate([[1], [2]], SamplingParams(max_new_tokens=2), request_ids=[0])
    for kwargs, match in ((dict(keys=[100.9]), r"keys\[0\] must be a non-negative integer key below 2\*\*63"),
                          (dict(keys=["100"]), r"keys\[0\] must be"), (dict(keys=[None]), r"keys\[0\] must be"),
                          (dict(request_ids=[0.5, 1.5]), r"request_ids\[0\] must be a non-negative integer request"),
                          (dict(request_ids=[True, 2]), r"request_ids\[0\] must be"),
                          (dict(request_ids=[0, 1 << 63]), r"request_ids\[1\] must be .* below 2\*\*63")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            gen.generate([[1], [2]], SamplingParams(max_new_tokens=2), **kwargs)
    with pytest.raises(ValueError, match="sequences is empty"):
        gen.score([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.score([[0, 1000]])
    with pytest.raises(ValueError, match="temperature"):
        gen.score([[0, 1]], temperature=0.0)
    # a length-1 sequence scores to an empty tensor, like sequence_logprobs
    assert gen.score([[5]])[0].shape == (0,)
    # the generator is still usable after errors
    assert_exact(qwen, gen.generate([[1, 2]], SamplingParams(max_new_tokens=2)))


def test_native_paged_attention_matches_exact_kernel_closely():
    """The native paged path (decode batch + grouped padded prefill) computes the same attention, up to rounding."""
    from rlexact import ops
    from rlexact.models import AttnMetadata, PagedKV
    from rlexact.models.native_attention import native_paged

    torch.manual_seed(0)
    nb, bs, hkv, hq, d = 40, 4, 2, 6, 16
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    nqs, lks = [1, 5, 1, 17, 3, 2], [9, 5, 30, 20, 3, 11]
    tables = torch.stack([torch.randperm(nb)[:8] for _ in nqs]).to(torch.int32)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(nqs), 0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d)
    meta = AttnMetadata(cu, PagedKV([(kc, vc)], tables, torch.tensor(lks, dtype=torch.int32), torch.zeros(0)))
    ref = ops.attention_paged(q, kc, vc, tables, cu, meta.paged.seqlens_k, 0.25)
    got = native_paged(q, meta, kc, vc, 0.25)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    dq = q[: len(nqs)]
    dmeta = AttnMetadata(torch.arange(len(nqs) + 1, dtype=torch.int32), meta.paged)
    dref = ops.attention_paged(dq, kc, vc, tables, dmeta.cu_seqlens, meta.paged.seqlens_k, 0.25)
    dmeta.paged.max_seqlen_q, dmeta.paged.max_seqlen_k = 1, 32  # static padded bound (graph mode)
    torch.testing.assert_close(native_paged(dq, dmeta, kc, vc, 0.25), dref, atol=2e-5, rtol=1e-4)


def test_every_stats_key_is_documented(qwen):
    """``Generator.stats`` is a documented contract: each key a call (generate or score) records is named in the
    class docstring, and each documented key of a generate call is present (``capture_ahead_failed`` only on a
    failure)."""
    import re

    documented = set(re.findall(r"``([a-z_]+)``", Generator.__doc__.split("``stats`` describes")[1]))
    gen = Generator(qwen, max_num_seqs=4)
    gen.generate(prompts_for(2, 97, lo=3, hi=8, seed=1), SamplingParams(max_new_tokens=3, n=2, seed=0))
    assert set(gen.stats) <= documented, set(gen.stats) - documented
    assert documented - set(gen.stats) == {"capture_ahead_failed"}
    gen.score([[5, 6, 7, 8]])
    assert set(gen.stats) <= documented, set(gen.stats) - documented


def test_native_score_slices_the_head(qwen, monkeypatch):
    """Native scoring materializes ``[rows, vocab]`` fp32 logits, so a step's scored rows go through the head in
    slices of at most ``NATIVE_SCORE_LOGITS`` elements; the log-probs match one unsliced call (the native path makes
    no bitwise promise across shapes, so within fp32 rounding)."""
    from rlexact.rollout import runner as runner_mod

    seqs = [p + [3, 4, 5] for p in prompts_for(4, 97, lo=5, hi=12, seed=7)]
    whole = Generator(qwen, kernels="native").score(seqs)
    rows: list[int] = []
    real = runner_mod.head_logprobs

    def counting(model, hidden, *args, **kwargs):  # noqa: ANN001, ANN202
        rows.append(hidden.shape[0])
        return real(model, hidden, *args, **kwargs)

    monkeypatch.setattr(runner_mod, "head_logprobs", counting)
    vocab = rlexact.models.lm_head_weight(qwen).shape[0]
    monkeypatch.setattr(runner_mod, "NATIVE_SCORE_LOGITS", 3 * vocab)
    sliced = Generator(qwen, kernels="native").score(seqs)
    assert len(rows) > 1 and max(rows) <= 3 and sum(rows) == sum(len(s) - 1 for s in seqs)
    for a, b in zip(sliced, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_completions_convert_logprobs_per_sequence() -> None:
    """A call's completions carry their own fp32 log-prob tensors (no shared storage), equal to converting each
    sequence's log-probs alone, in the sequences' order; a sequence that generated nothing gets an empty tensor."""
    from rlexact.rollout.sequence import Sequence, completions

    seqs = [Sequence(i, [1, 2, 3][: i + 1], 10 + i, i, 8) for i in range(3)]
    values = torch.randn(12, dtype=torch.float32).double().tolist()
    for s, chunk in zip(seqs, (values[:5], values[5:], [])):
        for v in chunk:
            s.append(7, v)
        s.finish_reason = "length"
    out = completions(seqs)
    for s, c in zip(seqs, out):
        assert c.request_id == s.request_id and c.token_ids == [7] * s.num_generated
        assert c.logprobs.dtype == torch.float32
        assert torch.equal(c.logprobs, torch.tensor(s.generated_logprobs, dtype=torch.float32))
        assert c.logprobs.untyped_storage().nbytes() == 4 * s.num_generated
    assert out[2].logprobs.shape == (0,)
    out[0].logprobs[0] = 99.0  # negative control: writing one completion leaves the others unchanged
    assert not torch.equal(out[0].logprobs, torch.tensor(values[:5], dtype=torch.float32))
    assert torch.equal(out[1].logprobs, torch.tensor(values[5:], dtype=torch.float32))
