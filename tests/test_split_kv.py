"""Split-KV attention on CPU: keys cut at fixed absolute positions every ``ATTN_SPLIT`` keys, partials merged in
ascending order, the same in training, chunked prefill and decode. The production split is longer than these
sequences, so the tests shrink it to one key tile (several splits on short sequences)."""

from __future__ import annotations

import pytest
import torch

import rlexact
from models import prompts_for, tiny_model
from rlexact import ops
from rlexact.ops import cpu, reference
from rlexact.rollout import Generator, SamplingParams

SPLIT = cpu.ATTN_BLOCK_N


@pytest.fixture
def small_split(monkeypatch):
    monkeypatch.setattr(cpu, "ATTN_SPLIT", SPLIT)


def _inputs(lengths: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return q, k, v, cu


def _paged(q, k, v, scale, chunk, block_size=8, seed=1):
    """One sequence fed in chunks of ``chunk`` queries over a shuffled paged cache (NaN in unused slots)."""
    n = k.shape[0]
    nb = -(-n // block_size)
    table = torch.randperm(nb + 3, generator=torch.Generator().manual_seed(seed))[:nb].to(torch.int32)
    kc = torch.full((nb + 3, block_size, *k.shape[1:]), float("nan"), dtype=k.dtype)
    vc = torch.full_like(kc, float("nan"))
    pos = torch.arange(n)
    ops.write_kv(k, v, kc, vc, table[pos // block_size].long() * block_size + pos % block_size)
    outs = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        cu, seqk = torch.tensor([0, hi - lo], dtype=torch.int32), torch.tensor([hi], dtype=torch.int32)
        outs.append(ops.attention_paged(q[lo:hi], kc, vc, table[None], cu, seqk, scale))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_training_prefill_decode_equal(small_split, dtype) -> None:
    lengths = [1, 70, 3 * SPLIT + 5]
    q, k, v, cu = _inputs(lengths, 4, 2, 16, dtype)
    scale = 0.25
    full = ops.attention_varlen(q, k, v, cu, scale)
    ref = reference.attention_varlen(q.double(), k.double(), v.double(), cu, scale)
    assert (full.double() - ref).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)
    s, e = int(cu[-2]), int(cu[-1])
    for chunk in (1, 7, SPLIT + 3, e - s):
        out = _paged(q[s:e], k[s:e], v[s:e], scale, chunk)
        assert torch.equal(out, full[s:e]), f"chunk {chunk}: paged != training forward"


def test_split_size_changes_bits_past_the_first_split(monkeypatch) -> None:
    """Negative control: the same rows with the production split (one split here) and with small splits agree to
    rounding, are bitwise equal inside the first split and differ after it; so all paths must share the split."""
    q, k, v, cu = _inputs([3 * SPLIT], 4, 2, 16, torch.float32, seed=3)
    whole = ops.attention_varlen(q, k, v, cu, 0.25)
    monkeypatch.setattr(cpu, "ATTN_SPLIT", SPLIT)
    split = ops.attention_varlen(q, k, v, cu, 0.25)
    assert (split - whole).abs().max().item() < 1e-5
    assert torch.equal(split[:SPLIT], whole[:SPLIT])
    assert not torch.equal(split[SPLIT:], whole[SPLIT:])


@pytest.mark.parametrize("split", [1, 16, 64, 1000])
def test_reference_split_decomposition_equals_dense(split) -> None:
    """The split-then-merge decomposition the kernels compute is the dense softmax (float64, to rounding)."""
    q, k, v, _ = _inputs([150], 4, 2, 16, torch.float64, seed=2)
    for start, nq in ((0, 150), (149, 1), (40, 33)):
        dense = reference.attention_sequence(q[start : start + nq], k[: start + nq], v[: start + nq], start, 0.25)
        split_ = reference.attention_sequence_split(
            q[start : start + nq], k[: start + nq], v[: start + nq], start, 0.25, split
        )
        assert (split_ - dense).abs().max().item() < 1e-12


def test_generator_exact_with_several_splits(small_split) -> None:
    """Prompts spanning several splits, shared by n = 2 samples, chunked prefill, preemption and shuffled pages:
    every log-prob equals the trainer's (which uses the same split structure)."""
    model = rlexact.exactify(tiny_model("qwen3", max_pos=256, weight_scale=2.5, seed=5))
    prompts = prompts_for(3, 97, lo=2 * SPLIT - 10, hi=3 * SPLIT, seed=4)
    gen = Generator(model, num_kv_blocks=40, block_size=8, max_num_batched_tokens=48, shuffle_blocks=True)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=5, seed=9, n=2))
    assert gen.stats["preemptions"] > 0 and gen.stats["prompt_forks"] > 0
    ref = rlexact.sequence_logprobs(model, [o.sequence for o in outs])
    for o, r in zip(outs, ref):
        assert torch.equal(o.logprobs, r[-len(o.token_ids) :])


def test_attention_paged_split_counters_checked_and_unused_on_cpu() -> None:
    """``split_counters`` must be contiguous int32; the CPU backend ignores a valid one (same bits)."""
    q, k, v, _ = _inputs([40], 4, 2, 16, torch.float32, seed=5)
    table = torch.arange(5, dtype=torch.int32)[None]
    kc = torch.zeros(5, 8, 2, 16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(40)
    ops.write_kv(k, v, kc, vc, table[0][pos // 8].long() * 8 + pos % 8)
    cu, seqk = torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    plain = ops.attention_paged(q, kc, vc, table, cu, seqk, 0.25)
    counters = torch.zeros(8, dtype=torch.int32)
    assert torch.equal(ops.attention_paged(q, kc, vc, table, cu, seqk, 0.25, split_counters=counters), plain)
    for bad in (counters.long(), torch.zeros(8, 2, dtype=torch.int32)[:, 0]):
        with pytest.raises(ValueError, match="split_counters must be a contiguous int32"):
            ops.attention_paged(q, kc, vc, table, cu, seqk, 0.25, split_counters=bad)
