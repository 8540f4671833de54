"""GPU: exactified models with the Triton kernels — decode == chunked prefill == packed training forward, bitwise,
in fp32 and bf16, plus the negative control on the stock cuBLAS/SDPA path and agreement with transformers."""

from __future__ import annotations

import copy

import pytest
import torch

import rlexact
from models import tiny_model
from test_exactify import _paged_logprobs

pytestmark = pytest.mark.gpu

CASES = [
    ("qwen3", 4, 2, 64, 256, 1031),  # arch, heads, kv_heads, head_dim, hidden, vocab
    ("qwen3", 16, 8, 128, 2048, 151_936),  # Qwen3-1.7B layer shapes, 2 layers
    ("llama", 8, 2, 64, 512, 32_000),
    ("mistral", 8, 2, 128, 1024, 32_768),
    ("olmo2", 8, 2, 128, 1024, 32_768),
    ("phi3", 8, 2, 128, 1024, 32_768),
    ("smollm3", 8, 2, 128, 1024, 32_768),
    ("granite", 8, 2, 128, 1024, 32_768),
    ("gemma3", 8, 2, 256, 1024, 32_768),
    ("olmo3", 8, 2, 128, 1024, 32_768),
    ("ministral3", 8, 2, 128, 1024, 32_768),
    ("gemma3_vl", 8, 2, 256, 1024, 32_768),
    ("mistral3_vl", 8, 2, 128, 1024, 32_768),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,heads,kv,hd,hidden,vocab", CASES)
def test_gpu_decode_prefill_training_equal(dtype, arch, heads, kv, hd, hidden, vocab) -> None:
    model = tiny_model(
        arch, heads=heads, kv_heads=kv, head_dim=hd, hidden=hidden, vocab=vocab, intermediate=3 * hidden, dtype=dtype
    )
    model = rlexact.exactify(model.cuda())
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).cuda() for n in (1 + 1, 33, 200, 300)]
    with torch.no_grad():
        train = rlexact.sequence_logprobs(model, seqs)
        for i, s in enumerate(seqs):
            assert torch.equal(rlexact.sequence_logprobs(model, [s])[0], train[i])
        for chunk in (1, 64, 100):
            assert torch.equal(_paged_logprobs(model, seqs[2], chunk, shuffle_seed=chunk), train[2]), chunk
        with rlexact.use_kernels(model, "native"):
            native = rlexact.sequence_logprobs(model, seqs)
            native_decode = _paged_logprobs(model, seqs[3], 1)
        if dtype == torch.bfloat16:
            assert not torch.equal(native_decode, native[3]), "negative control: native decode should differ"
        ref = copy.deepcopy(model)
        rlexact.exactify(ref, enabled=False)
        logits = ref(seqs[2][None]).logits[0].float()
        expected = torch.log_softmax(logits, -1)[:-1].gather(-1, seqs[2][1:, None])[:, 0]
        tol = 1e-3 if dtype == torch.float32 else 0.25
        assert (train[2] - expected).abs().max() < tol


def test_gpu_training_backward_runs() -> None:
    model = rlexact.exactify(tiny_model("qwen3", heads=4, kv_heads=2, head_dim=64, hidden=256, vocab=1031).cuda())
    model.train()
    seqs = [torch.randint(0, 1031, (n,)).cuda() for n in (17, 130)]
    lp = rlexact.sequence_logprobs(model, seqs)
    torch.cat(lp).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sliding_window_past_the_window(dtype) -> None:
    """A Mistral with a 64-key sliding window: decode == chunked prefill == training bitwise on sequences of up to 300
    tokens, the rollout equal to the trainer, and agreement with stock transformers (whose window is active)."""
    from rlexact.rollout import Generator, SamplingParams

    model = tiny_model("mistral", heads=8, kv_heads=2, head_dim=128, hidden=1024, vocab=32_768, dtype=dtype)
    model.config.sliding_window = 64
    ref = copy.deepcopy(model).cuda()
    model = rlexact.exactify(model.cuda())
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 32_768, (n,), generator=g).cuda() for n in (33, 200, 300)]
    with torch.no_grad():
        train = rlexact.sequence_logprobs(model, seqs)
        for chunk in (1, 64, 100):
            assert torch.equal(_paged_logprobs(model, seqs[2], chunk, shuffle_seed=chunk), train[2]), chunk
        logits = ref(seqs[2][None]).logits[0].float()
        expected = torch.log_softmax(logits, -1)[:-1].gather(-1, seqs[2][1:, None])[:, 0]
        assert (train[2] - expected).abs().max() < (1e-3 if dtype == torch.float32 else 0.25)
    outs = Generator(model).generate([s[:40].tolist() for s in seqs], SamplingParams(max_new_tokens=100, seed=1))
    ref_lp = rlexact.sequence_logprobs(model, [o.sequence for o in outs])
    assert all(torch.equal(o.logprobs, r[-len(o.token_ids) :].cpu()) for o, r in zip(outs, ref_lp))
