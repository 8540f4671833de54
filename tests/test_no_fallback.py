"""No silent fallback: transformers ``model.generate`` (DynamicCache, left padding) on an exactified model runs the
exact kernels (decode logits == full forward logits, torch.equal), and unsupported settings raise errors that name
the problem."""

from __future__ import annotations

import pytest
import torch

import rlexact
from models import CACHE_ARG, tiny_model

VOCAB = 97


def _left_padded(prompts: list[torch.Tensor], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel() :] = p
        mask[i, width - p.numel() :] = 1
    return ids.to(device), mask.to(device)


def _decode_vs_full(
    model: torch.nn.Module, device: str, new_tokens: int = 10, **generate_kw: object
) -> tuple[int, int]:
    """``(equal, total)``: generated steps whose decode logits equal the full (cache-free) forward bitwise."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 11, 3)]
    ids, mask = _left_padded(prompts, device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **generate_kw,
        )  # fmt: skip
        steps = torch.stack(out.logits, 1)
        equal = total = 0
        for i, p in enumerate(prompts):
            seq = torch.cat([p.to(device), out.sequences[i, ids.shape[1] :]])
            full = model(seq[None], use_cache=False).logits[0, p.numel() - 1 : -1]
            equal += sum(bool(torch.equal(a, b)) for a, b in zip(full, steps[i]))
            total += full.shape[0]
    return equal, total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch", ["qwen3", "llama", "mistral", "ministral3", "mistral3_vl", "olmo2", "olmo3", "phi3", "smollm3",
             "granite", "gemma3", "gemma3_vl"]
)  # fmt: skip
def test_generate_decode_equals_full_forward(arch, dtype) -> None:
    derived = ("olmo2", "olmo3", "phi3", "smollm3")  # these derive head_dim from hidden / heads
    sizes = dict(hidden=64, heads=4, kv_heads=2, head_dim=16) if arch in derived else {}
    model = rlexact.exactify(tiny_model(arch, dtype=dtype, **sizes))
    equal, total = _decode_vs_full(model, "cpu")
    assert equal == total == 30
    with rlexact.use_kernels(model, "native"):  # negative control: the stock kernels differ
        equal, total = _decode_vs_full(model, "cpu")
    assert equal < total


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral", "olmo2", "phi3", "smollm3", "granite", "gemma3"])
def test_generate_decode_equals_full_forward_gpu(arch) -> None:
    """fp32 and bf16: every decode step equals the full forward. Negative control: the unmodified model differs in
    at least one of the two dtypes (at these sizes the stock kernels of one dtype can agree on every step: on an
    H200, SmolLM3's stock bf16 decode matched its full forward everywhere, its fp32 decode did not)."""
    hidden = 512 if arch in ("olmo2", "phi3", "smollm3") else 256  # these derive head_dim from hidden / heads
    stock_differs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(arch, dtype=dtype, hidden=hidden, heads=8, kv_heads=2, head_dim=64, intermediate=512)
        rlexact.exactify(model.cuda())
        equal, total = _decode_vs_full(model, "cuda", new_tokens=40)
        assert equal == total, dtype
        rlexact.exactify(model, enabled=False)
        equal, total = _decode_vs_full(model, "cuda", new_tokens=40)
        stock_differs.append(equal < total)
    assert any(stock_differs)


def test_right_padding_is_an_error() -> None:
    model = rlexact.exactify(tiny_model("qwen3"))
    ids = torch.randint(0, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=mask, use_cache=False)


def test_cached_attention_with_grad_is_an_error() -> None:
    model = rlexact.exactify(tiny_model("qwen3"))
    out = model(torch.randint(0, VOCAB, (1, 5)), use_cache=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        model(torch.randint(0, VOCAB, (1, 1)), **{CACHE_ARG: getattr(out, CACHE_ARG)}, use_cache=True)


def test_phi3_settings_the_kernels_do_not_implement_are_errors() -> None:
    """Phi-3: residual dropout, a partial rotary factor and longrope scaling are refused before anything is patched;
    without them the same config is exactified."""
    from transformers import Phi3Config, Phi3ForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    bad = [
        (dict(resid_pdrop=0.1), "resid_pdrop=0.1.*resid_pdrop=0.0"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         "partial_rotary_factor=0.5"),
    ]  # fmt: skip
    for extra, match in bad:
        model = Phi3ForCausalLM(Phi3Config(**common, **extra))
        with pytest.raises(ValueError, match=match):
            rlexact.exactify(model)
        assert not rlexact.is_exactified(model)
    model = Phi3ForCausalLM(Phi3Config(**common))
    model.config.rope_parameters = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        rlexact.exactify(model)
    assert rlexact.is_exactified(rlexact.exactify(Phi3ForCausalLM(Phi3Config(**common))))


def test_attention_dropout_in_train_mode_is_an_error() -> None:
    model = rlexact.exactify(tiny_model("qwen3"))
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        model(ids)  # eval mode: no dropout, fine
    model.train()
    with pytest.raises(ValueError, match="attention_dropout=0.1 in train mode"):
        model(ids)
    with pytest.raises(ValueError, match="attention_dropout=0.1 in train mode"):
        rlexact.sequence_logprobs(model, [ids[0]])


def test_autocast_is_an_error() -> None:
    model = rlexact.exactify(tiny_model("qwen3"))
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="autocast"):
        rlexact.sequence_logprobs(model, [ids[0]])
    with rlexact.use_kernels(model, "native"), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)  # the native baseline may run under autocast
