"""A sliding window shorter than the model's context limits the context to the window: within it the exact kernels'
full causal attention is the model's attention (agreement with stock transformers, whose window is active past it),
rollouts equal the trainer bitwise, and any path that would run past the window raises an error naming the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import rlexact
from rlexact.config import RolloutConfig
from rlexact.models import ContextLimit, context_limit
from rlexact.rollout import Generator, SamplingParams
from rlexact.trainer import sampling
from test_no_fallback import _decode_vs_full, _left_padded
from test_rollout import assert_exact

VOCAB = 97
WINDOW = 24
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
OFF = {"qwen3": "use_sliding_window=False", "mistral": "sliding_window=None", "phi3": "sliding_window=None"}


def _config(arch: str, window: bool) -> object:
    """``arch``'s tiny config with every layer's window at :data:`WINDOW`, or the same config with it off."""
    if arch == "qwen3":  # the window is a per-layer attribute, switched by use_sliding_window
        return Qwen3Config(head_dim=16, use_sliding_window=window, sliding_window=WINDOW, max_window_layers=0, **COMMON)
    cls = MistralConfig if arch == "mistral" else Phi3Config
    extra = {"head_dim": 16} if arch == "mistral" else {}
    return cls(sliding_window=WINDOW if window else None, **extra, **COMMON)


def _model(arch: str, window: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cls = {"qwen3": Qwen3ForCausalLM, "mistral": MistralForCausalLM, "phi3": Phi3ForCausalLM}[arch]
    model = cls(_config(arch, window)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.5 if p.dim() == 2 else 1.0)  # sharper distributions than the default init
    return model


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "phi3"])
def test_window_limits_the_context_and_agrees_with_stock_within_it(arch: str) -> None:
    stock = _model(arch)
    full = _model(arch, window=False)
    full.load_state_dict(stock.state_dict())
    model = rlexact.exactify(copy.deepcopy(stock))
    assert context_limit(stock) == ContextLimit(WINDOW, WINDOW, OFF[arch])
    assert rlexact.models.get_state(model).context == ContextLimit(WINDOW, WINDOW, OFF[arch])
    ids = torch.randint(3, VOCAB, (1, WINDOW + 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = model(ids[:, :WINDOW]).logits
        torch.testing.assert_close(exact, stock(ids[:, :WINDOW]).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(exact, full(ids[:, :WINDOW]).logits, atol=1e-4, rtol=1e-4)
        # negative control: past the window the stock model's own attention differs from full attention
        past = (stock(ids).logits[0, -1] - full(ids).logits[0, -1]).abs().max()
        assert past > 1e-3
        message = f"sliding window of {WINDOW}.*{OFF[arch]}"
        for kernels in ("exact", "native"):  # the native baseline's attention is full causal too
            with rlexact.use_kernels(model, kernels), pytest.raises(ValueError, match=message):
                model(ids[:, : WINDOW + 1])


def test_a_window_that_covers_the_context_is_no_limit() -> None:
    for window in (None, 128, 4096):
        model = MistralForCausalLM(MistralConfig(sliding_window=window, **COMMON))
        assert context_limit(model) == ContextLimit(128)
        assert rlexact.models.get_state(rlexact.exactify(model)).context == ContextLimit(128)
    with pytest.raises(ValueError, match="position 128 exceeds max_position_embeddings=128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_window_changed_after_exactify_is_an_error() -> None:
    model = rlexact.exactify(_model("mistral", window=False))
    ids = torch.randint(3, VOCAB, (1, 5))
    model(ids)
    model.config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding_window=16 of MistralAttention is shorter than the context limit"):
        model(ids)
    with pytest.raises(ValueError, match="sliding_window=16 of MistralAttention"):
        rlexact.sequence_logprobs(model, [ids[0]])
    rlexact.exactify(model, enabled=False)
    assert rlexact.models.get_state(rlexact.exactify(model)).context == ContextLimit(16, 16, "sliding_window=None")
    model(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_within_the_window_equals_the_trainer(dtype: torch.dtype) -> None:
    model = rlexact.exactify(_model("mistral", seed=3).to(dtype))
    prompts = [[int(x) for x in torch.randint(3, VOCAB, (n,))] for n in (3, 9, 16, 12)]
    params = SamplingParams(max_new_tokens=WINDOW - 16, seed=5)
    outs = Generator(model, block_size=4, max_num_batched_tokens=16).generate(prompts, params)
    assert max(len(o.sequence) for o in outs) == WINDOW
    assert_exact(model, outs)
    native = Generator(model, kernels="native", block_size=4).generate(prompts, params)
    with pytest.raises(AssertionError, match="log-probs differ from the trainer"):  # negative control
        assert_exact(model, native)
    with pytest.raises(ValueError, match=f"exceeds the model context {WINDOW} .*sliding_window={WINDOW}"):
        Generator(model, block_size=4).generate([prompts[2]], SamplingParams(max_new_tokens=WINDOW - 15, seed=5))


def test_rollout_max_context_past_the_window_is_an_error() -> None:
    limit = ContextLimit(WINDOW, WINDOW, "sliding_window=None")
    assert sampling.max_context(RolloutConfig(max_new_tokens=8), limit) == WINDOW
    assert sampling.max_context(RolloutConfig(max_new_tokens=8, max_context=16), limit) == 16
    with pytest.raises(ValueError, match=f"max_context=32 is longer than the model's context of {WINDOW} tokens"):
        sampling.max_context(RolloutConfig(max_new_tokens=8, max_context=32), limit)
    items = [{"prompt_ids": list(range(3, 3 + 17)), "index": 0}]
    with pytest.raises(ValueError, match=f"context of {WINDOW} tokens leaves room for prompts of at most 16"):
        sampling.check_prompts(items, RolloutConfig(max_new_tokens=8), limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_with_sliding_window_cache_layers(dtype: torch.dtype) -> None:
    """transformers' ``generate`` builds sliding-window cache layers for the windowed model; within the window they
    hold every key, so decode logits equal the full forward bitwise (stock kernels: not); past it, errors."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = rlexact.exactify(_model("mistral", seed=4).to(dtype))
    equal, total = _decode_vs_full(model, "cpu")  # prompts of up to 11 tokens + 10 new: inside the window
    assert equal == total == 30
    with rlexact.use_kernels(model, "native"):
        equal, total = _decode_vs_full(model, "cpu")
    assert equal < total
    ids, mask = _left_padded([torch.randint(3, VOCAB, (n,)) for n in (20, 6)], "cpu")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=WINDOW - 20, **kw)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        assert all(type(layer) is DynamicSlidingWindowLayer for layer in cache.layers)
        model.generate(ids, attention_mask=mask, max_new_tokens=WINDOW - 19, **kw)  # the last token is not fed
        with pytest.raises(ValueError, match=f"position {WINDOW} is outside the sliding window"):
            model.generate(ids, attention_mask=mask, max_new_tokens=WINDOW - 18, **kw)
        # every row padded: positions stay inside the window but the padded cache outgrows it
        wide, wide_mask = _left_padded([torch.randint(3, VOCAB, (n,)) for n in (12, 6)], "cpu")
        pad = torch.zeros(2, 16, dtype=torch.long)
        wide, wide_mask = torch.cat([pad, wide], 1), torch.cat([pad, wide_mask], 1)
        with pytest.raises(ValueError, match="sliding-window cache dropped keys past its window"):
            model.generate(wide, attention_mask=wide_mask, max_new_tokens=3, **kw)


def test_mixtral_window_limits_the_context() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    model = rlexact.exactify(MixtralForCausalLM(config).eval())
    assert rlexact.models.get_state(model).context == ContextLimit(WINDOW, WINDOW, "sliding_window=None")
    with pytest.raises(ValueError, match=f"sliding window of {WINDOW}"):
        rlexact.sequence_logprobs(model, [torch.randint(3, VOCAB, (WINDOW + 1,))])
