"""Sliding-window attention: the exact kernels take each layer's window, so windowed models agree with stock
transformers past the window, decode == chunked prefill == training and rollout == trainer hold bitwise there, and
transformers' ``generate`` runs them exactly, with its sliding-window cache layers (whose dropped keys lie before
every new query's window) or a cache that keeps every key."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicCache

import rlexact
from models import CACHE_ARG
from rlexact.config import RolloutConfig
from rlexact.models.context import sliding_window
from rlexact.rollout import Generator, SamplingParams
from rlexact.trainer import sampling
from test_exactify import _paged_logprobs
from test_no_fallback import _decode_vs_full
from test_rollout import assert_exact

VOCAB = 97
WINDOW = 8
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ARCHS = ("qwen3", "mistral", "phi3", "mixtral")


def _model(
    arch: str, window: int | None = WINDOW, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """``arch``'s tiny model with every layer's sliding window at ``window`` (None: full attention), sharper
    distributions than the default init, in eval mode."""
    torch.manual_seed(seed)
    if arch == "qwen3":  # a per-layer attribute, switched by use_sliding_window
        cfg = Qwen3Config(
            head_dim=16, use_sliding_window=window is not None, sliding_window=window or 4096, max_window_layers=0,
            **COMMON,
        )  # fmt: skip
        model = Qwen3ForCausalLM(cfg)
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(head_dim=16, sliding_window=window, **COMMON))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(sliding_window=window, **COMMON))
    else:
        experts = dict(num_local_experts=4, num_experts_per_tok=2)
        model = MixtralForCausalLM(MixtralConfig(head_dim=16, sliding_window=window, **experts, **COMMON))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.5 if p.dim() >= 2 else 1.0)
    return model.to(dtype).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_windowed_models_agree_with_stock_past_the_window(arch: str) -> None:
    stock = _model(arch)
    full = _model(arch, window=None)
    full.load_state_dict(stock.state_dict())
    model = rlexact.exactify(copy.deepcopy(stock))
    assert {sliding_window(m) for m in model.modules() if type(m).__name__.endswith("Attention")} == {WINDOW}
    ids = torch.randint(3, VOCAB, (2, 5 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stock(ids).logits
        # negative control: past the window the stock model's attention is not full attention
        assert (want[:, WINDOW:] - full(ids).logits[:, WINDOW:]).abs().max() > 1e-3
        torch.testing.assert_close(model(ids).logits, want, atol=2e-4, rtol=2e-4)
        with rlexact.use_kernels(model, "native"):  # the native baseline's attention applies the window too
            torch.testing.assert_close(model(ids).logits, want, atol=2e-4, rtol=2e-4)
        lp = rlexact.sequence_logprobs(model, list(ids))
    expected = torch.log_softmax(want.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert max((a - b).abs().max() for a, b in zip(lp, expected)) < 2e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_decode_prefill_training_equal_past_the_window(arch: str, dtype: torch.dtype) -> None:
    model = rlexact.exactify(_model(arch, seed=2, dtype=dtype))
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (3, 21, 70)]
    with torch.no_grad():
        train = rlexact.sequence_logprobs(model, seqs)
        for i, s in enumerate(seqs):
            assert torch.equal(rlexact.sequence_logprobs(model, [s])[0], train[i])
            for chunk in (1, 5, 16):
                assert torch.equal(_paged_logprobs(model, s, chunk, shuffle_seed=chunk), train[i]), (i, chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_past_the_window_equals_the_trainer(dtype: torch.dtype) -> None:
    model = rlexact.exactify(_model("mistral", seed=3, dtype=dtype))
    prompts = [[int(x) for x in torch.randint(3, VOCAB, (n,))] for n in (3, 9, 16, 12)]
    params = SamplingParams(max_new_tokens=3 * WINDOW, seed=5)
    outs = Generator(model, block_size=4, max_num_batched_tokens=16).generate(prompts, params)
    assert min(len(o.sequence) for o in outs) > 2 * WINDOW
    assert_exact(model, outs)
    native = Generator(model, kernels="native", block_size=4).generate(prompts, params)
    with pytest.raises(AssertionError, match="log-probs differ from the trainer"):  # negative control
        assert_exact(model, native)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_past_the_window(dtype: torch.dtype) -> None:
    """Prompts of up to 11 tokens and 10 new ones, left-padded, past a window of 8: with the default cache (whose
    sliding-window layers drop keys past the window) and with a DynamicCache built without the config (every key
    kept) each decode step's logits equal the full forward's bitwise; negative control: the stock kernels' do not."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = rlexact.exactify(_model("mistral", seed=4, dtype=dtype))
    made = []
    update = DynamicSlidingWindowLayer.update
    def recorded(self: DynamicSlidingWindowLayer, *a: object, **kw: object) -> object:
        made.append(self)
        return update(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:  # record the default cache's layers, to see they dropped keys
        mp.setattr(DynamicSlidingWindowLayer, "update", recorded)
        equal, total = _decode_vs_full(model, "cpu")
    assert equal == total == 30
    assert made and max(layer.cumulative_length - layer.keys.shape[-2] for layer in made) > 0, "nothing dropped"
    equal, total = _decode_vs_full(model, "cpu", **{CACHE_ARG: DynamicCache()})
    assert equal == total == 30
    with rlexact.use_kernels(model, "native"):
        equal, total = _decode_vs_full(model, "cpu", **{CACHE_ARG: DynamicCache()})
    assert equal < total


def test_rollout_max_context_past_max_positions_is_an_error() -> None:
    assert sampling.max_context(RolloutConfig(max_new_tokens=8), 128) == 128
    assert sampling.max_context(RolloutConfig(max_new_tokens=8, max_context=16), 128) == 16
    with pytest.raises(ValueError, match="max_context=256 is longer than the model's max_position_embeddings=128"):
        sampling.max_context(RolloutConfig(max_new_tokens=8, max_context=256), 128)
    items = [{"prompt_ids": list(range(3, 3 + 121)), "index": 0}]
    with pytest.raises(ValueError, match="context of 128 tokens leaves room for prompts of at most 120"):
        sampling.check_prompts(items, RolloutConfig(max_new_tokens=8), 128)


def test_layers_with_and_without_a_window_agree_with_stock() -> None:
    """Qwen3 with ``max_window_layers=1``: layer 0 attends to every earlier key, layer 1 within its window; each
    layer's own window reaches the kernels (rollout == trainer past the window, stock agreement)."""
    cfg = Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **COMMON)
    torch.manual_seed(6)
    stock = Qwen3ForCausalLM(cfg).eval()
    model = rlexact.exactify(copy.deepcopy(stock))
    layers = [layer.self_attn for layer in model.model.layers]
    assert [sliding_window(m) for m in layers] == [None, WINDOW]
    ids = torch.randint(3, VOCAB, (1, 6 * WINDOW), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, atol=2e-4, rtol=2e-4)
    outs = Generator(model, block_size=4).generate([ids[0, :20].tolist()], SamplingParams(max_new_tokens=20, seed=6))
    assert_exact(model, outs)


def test_generate_with_a_one_key_window() -> None:
    """A window of one key: transformers' mask spans fewer keys than its cache layer returns (it keeps them all),
    which the exact path widens alike; decode == full forward bitwise."""
    model = rlexact.exactify(_model("mistral", window=1, seed=7))
    equal, total = _decode_vs_full(model, "cpu")
    assert equal == total == 30
