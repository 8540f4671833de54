"""Shared test helpers: tiny transformers models built from configs (no downloads), random prompts and the
one-line tensor constructors of the hand-computed tests."""

from __future__ import annotations

import inspect
import random

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Ministral3Config,
    Ministral3ForCausalLM,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PixtralVisionConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SiglipVisionConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

CACHE_ARG: str = "cache" if "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters else "past_key_values"
"""The keyword of a transformers model's KV cache and the output field holding it: ``cache`` since transformers 5.24,
``past_key_values`` before (the library reads either)."""

MOE_VOCAB = 97
TINY_VISION: dict = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         image_size=28, patch_size=14)  # fmt: skip
"""A one-layer vision tower for the tiny image-text models (Siglip's; Pixtral's adds ``head_dim=16``)."""
IMAGE_TEXT_TYPES: dict[str, str] = {"gemma3": "gemma3_text", "mistral3": "ministral3"}
"""``model_type`` of the tiny image-text models -> the text decoder's they are built around."""


def image_text_config(model_type: str, text: dict) -> dict:
    """``model_config`` dict of a tiny image-text model (:data:`IMAGE_TEXT_TYPES`) around the text decoder's
    ``model_config`` dict ``text``, with a :data:`TINY_VISION` tower."""
    if model_type == "gemma3":
        return {"model_type": model_type, "text_config": text, "vision_config": TINY_VISION, "mm_tokens_per_image": 4}
    vision = TINY_VISION | {"model_type": "pixtral", "head_dim": 16}
    return {"model_type": model_type, "text_config": text, "vision_config": vision}


def tiny_model(
    arch: str = "qwen3",
    *,
    vocab: int = 97,
    hidden: int = 48,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 88,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_pos: int = 512,
    tie_embeddings: bool = False,
    random_norms: bool = True,
    weight_scale: float = 1.0,
) -> torch.nn.Module:
    """A randomly initialized causal LM of the given architecture, in eval mode.

    ``random_norms`` draws the norm weights from U(0.5, 1.5) so RMSNorm weight handling is exercised;
    ``weight_scale`` multiplies every 2-D weight (in float32, before the cast to ``dtype``) for sharper distributions.
    """
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie_embeddings,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, **common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(head_dim=head_dim, **common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(head_dim=head_dim, sliding_window=None, **common))
    elif arch == "olmo2":
        assert heads * head_dim == hidden, "olmo2 derives head_dim from hidden/heads"
        model = Olmo2ForCausalLM(Olmo2Config(pad_token_id=0, eos_token_id=2, **common))  # ids inside tiny vocabularies
    elif arch == "olmo3":  # OLMo-2's layers, a sliding-window layer then a full one (rotary tables per layer type)
        assert heads * head_dim == hidden, "olmo3 derives head_dim from hidden/heads"
        config = Olmo3Config(
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2), pad_token_id=0, eos_token_id=2, **common,
        )  # fmt: skip
        model = Olmo3ForCausalLM(config)
    elif arch == "phi3":
        assert heads * head_dim == hidden, "phi3 derives head_dim from hidden/heads"
        model = Phi3ForCausalLM(Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **common))
    elif arch == "smollm3":  # every second layer without rotary (NoPE)
        assert heads * head_dim == hidden, "smollm3 derives head_dim from hidden/heads"
        config = SmolLM3Config(no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
        model = SmolLM3ForCausalLM(config)
    elif arch == "granite":  # scaled embeddings, attention, residual branches and logits
        scales = dict(embedding_multiplier=6.0, attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0)
        model = GraniteForCausalLM(GraniteConfig(head_dim=head_dim, **scales, **common))
    elif arch in ("gemma3", "gemma3_vl"):  # a sliding-window layer, then a full one: two rotary bases, (1 + w)
        # norms, GELU gate; gemma3_vl: the same text decoder in the image-text model (Gemma 3 4B and up)
        config = Gemma3TextConfig(
            head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **common,
        )  # fmt: skip
        if arch == "gemma3":
            model = Gemma3ForCausalLM(config)
        else:
            vision = SiglipVisionConfig(**TINY_VISION)
            tokens = dict(image_token_index=vocab - 1, boi_token_index=vocab - 3, eoi_token_index=vocab - 2)
            full = Gemma3Config(text_config=config, vision_config=vision, mm_tokens_per_image=4, **tokens)
            model = Gemma3ForConditionalGeneration(full)
    elif arch in ("ministral3", "mistral3_vl"):  # yarn tables; queries scaled by position past every 16 tokens;
        # mistral3_vl: the same text decoder in the image-text model (Ministral 3, Mistral Small 3.x)
        rope = dict(rope_type="yarn", rope_theta=10_000.0, factor=max_pos / 16, original_max_position_embeddings=16,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                    llama_4_scaling_beta=0.1)  # fmt: skip
        config = Ministral3Config(head_dim=head_dim, rope_parameters=rope, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, **common)  # fmt: skip
        if arch == "ministral3":
            model = Ministral3ForCausalLM(config)
        else:
            vision = PixtralVisionConfig(**TINY_VISION, head_dim=16)
            full = Mistral3Config(text_config=config, vision_config=vision, image_token_index=vocab - 1)
            model = Mistral3ForConditionalGeneration(full)
    elif arch == "qwen2":
        assert heads * head_dim == hidden, "qwen2 derives head_dim from hidden/heads"
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                if random_norms:
                    p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and weight_scale != 1.0:
                p.mul_(weight_scale)
    return model.to(dtype).eval()


def tiny_rl_config(vocab_size: int, max_pos: int = 64) -> dict:
    """``model_config`` dict of the tiny Qwen3 used by the RLModule, callback and FSDP tests."""
    return dict(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
    )


def tiny_moe(
    arch: str = "qwen3_moe",
    *,
    experts: int = 8,
    top_k: int = 2,
    layers: int = 3,
    hidden: int = 48,
    moe_inter: int = 24,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    weight_scale: float = 2.5,
    **extra: object,
) -> torch.nn.Module:
    """A random tiny MoE causal LM in eval mode. The Qwen ones mix in a dense layer by default
    (``mlp_only_layers=[1]``); Mixtral's layers are all sparse (its experts' ``intermediate_size`` is ``moe_inter``).
    2-D and 3-D weights are scaled for sharper distributions and norm weights drawn from U(0.5, 1.5)."""
    torch.manual_seed(seed)
    if arch == "mixtral":
        config = dict(
            vocab_size=MOE_VOCAB, hidden_size=hidden, intermediate_size=moe_inter, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=experts,
            num_experts_per_tok=top_k, max_position_embeddings=256, tie_word_embeddings=False, sliding_window=None,
        )  # fmt: skip
        return _scaled(MixtralForCausalLM(MixtralConfig(**(config | extra))), weight_scale, dtype)
    if arch == "granitemoe":  # every layer sparse, Granite's scaled branches and logits
        config = dict(
            vocab_size=MOE_VOCAB, hidden_size=hidden, intermediate_size=moe_inter, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=experts,
            num_experts_per_tok=top_k, max_position_embeddings=256, tie_word_embeddings=False,
            embedding_multiplier=6.0, attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0,
        )  # fmt: skip
        return _scaled(GraniteMoeForCausalLM(GraniteMoeConfig(**(config | extra))), weight_scale, dtype)
    common = dict(
        vocab_size=MOE_VOCAB, hidden_size=hidden, intermediate_size=40, moe_intermediate_size=moe_inter,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    common.update(extra)
    common.setdefault("mlp_only_layers", [1])
    if arch == "qwen3_moe":
        common.setdefault("head_dim", 16)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(norm_topk_prob=True, **common))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(shared_expert_intermediate_size=32, **common))
    return _scaled(model, weight_scale, dtype)


def _scaled(model: torch.nn.Module, weight_scale: float, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its norm weights drawn from U(0.5, 1.5) and its 2-D and 3-D weights times ``weight_scale``, in
    ``dtype`` and eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.mul_(weight_scale)
    return model.to(dtype).eval()


def tiny_moe_rl_config(
    vocab_size: int, *, layers: int = 2, experts: int = 8, top_k: int = 2, mlp_only_layers: tuple[int, ...] = (1,),
    arch: str = "qwen3_moe",
) -> dict:  # fmt: skip
    """``model_config`` dict of a tiny Qwen3-MoE for the RLModule tests: :func:`tiny_rl_config` with MoE layers
    (``moe_intermediate_size=32``, normalized top-k) except the dense ``mlp_only_layers``. ``arch="mixtral"``: a
    Mixtral of the same sizes, every layer sparse (experts of ``intermediate_size=32``); ``arch="granitemoe"``: the
    same as a Granite-MoE, with its scaled branches and logits."""
    cfg = tiny_rl_config(vocab_size)
    if arch == "granitemoe":
        cfg.update(
            model_type="granitemoe", num_hidden_layers=layers, intermediate_size=32, num_local_experts=experts,
            num_experts_per_tok=top_k, embedding_multiplier=6.0, attention_multiplier=0.3, residual_multiplier=0.5,
            logits_scaling=4.0,
        )  # fmt: skip
        return cfg
    if arch == "mixtral":
        cfg.update(
            model_type="mixtral", num_hidden_layers=layers, intermediate_size=32, num_local_experts=experts,
            num_experts_per_tok=top_k, sliding_window=None,
        )  # fmt: skip
        return cfg
    cfg.update(
        model_type="qwen3_moe", num_hidden_layers=layers, moe_intermediate_size=32, num_experts=experts,
        num_experts_per_tok=top_k, norm_topk_prob=True, mlp_only_layers=list(mlp_only_layers),
    )  # fmt: skip
    return cfg


def addition_items(tok, n: int) -> list[dict]:  # noqa: ANN001 - a tokenizer callable
    """``n`` prompt items ``"i+i="`` with answer ``2 i`` (the fields the RL data module yields)."""
    texts = [f"{i}+{i}=" for i in range(n)]
    return [{"prompt_ids": tok(t)["input_ids"], "prompt_text": t, "answer": str(2 * i), "index": i}
            for i, t in enumerate(texts)]  # fmt: skip


def prompts_for(n: int, vocab: int, lo: int = 1, hi: int = 20, seed: int = 0) -> list[list[int]]:
    """``n`` reproducible random prompts of ``lo..hi`` token ids below ``vocab``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def mask(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


def assert_same_completions(a: list, b: list) -> None:
    """Two generate results are the same: token ids equal and log-probs bitwise equal, in order."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert torch.equal(x.logprobs, y.logprobs)


def assert_trainer_logprobs(model: torch.nn.Module, outs: list) -> None:
    """Every completion's log-probs equal the trainer's packed forward on its sequence, bitwise."""
    import rlexact

    ref = rlexact.sequence_logprobs(model, [o.sequence for o in outs])
    for o, r in zip(outs, ref):
        assert torch.equal(o.logprobs, r[-len(o.token_ids) :])
