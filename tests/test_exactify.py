"""exactify on tiny transformers models: decode == chunked prefill == packed training forward (torch.equal),
negative controls on the native path, correctness vs the unmodified model, restore, loading, bad input."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

import rlexact
from models import tiny_model
from rlexact.models import AttnMetadata, PagedKV, forward_hidden, get_state, head_logprobs, text_config

BLOCK = 8


def _paged_logprobs(model: torch.nn.Module, seq: torch.Tensor, chunk: int, shuffle_seed: int = 0) -> torch.Tensor:
    """Teacher-forced log-probs of seq[1:] through the generator's numeric path: chunked prefill of ``chunk``
    tokens per forward over a paged KV cache with shuffled blocks, then (for chunk=1) one token per forward."""
    cfg = text_config(model)
    n = seq.numel()
    n_blocks = -(-n // BLOCK) + 2
    dtype = next(model.parameters()).dtype
    dev = seq.device
    hkv, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    caches = [
        (
            torch.full((n_blocks, BLOCK, hkv, d), float("nan"), dtype=dtype, device=dev),
            torch.full((n_blocks, BLOCK, hkv, d), float("nan"), dtype=dtype, device=dev),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    table = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(shuffle_seed)).to(torch.int32).to(dev)
    out = []
    for start in range(0, n - 1, chunk):
        stop = min(n - 1, start + chunk)
        pos = torch.arange(start, stop, device=dev)
        slots = table[pos // BLOCK].long() * BLOCK + pos % BLOCK
        meta = AttnMetadata(
            torch.tensor([0, stop - start], dtype=torch.int32, device=dev),
            PagedKV(caches, table[None], torch.tensor([stop], dtype=torch.int32, device=dev), slots),
        )
        hidden = forward_hidden(model, seq[start:stop], pos, meta)
        lp, _ = head_logprobs(model, hidden, seq[start + 1 : stop + 1], 1.0)
        out.append(lp)
    return torch.cat(out)


CASES = [
    # arch, heads, kv_heads, head_dim, hidden, vocab
    ("qwen3", 4, 4, 16, 48, 97),
    ("qwen3", 4, 2, 16, 40, 61),
    ("qwen3", 8, 2, 64, 64, 131),
    ("llama", 4, 1, 16, 48, 97),
    ("llama", 4, 2, 64, 64, 61),
    ("mistral", 4, 2, 16, 40, 97),
    ("olmo2", 4, 2, 16, 64, 97),
    ("phi3", 4, 1, 16, 64, 97),
    ("smollm3", 4, 2, 16, 64, 97),
    ("granite", 4, 2, 16, 48, 97),
    ("gemma3", 4, 2, 16, 48, 97),
    ("olmo3", 4, 2, 16, 64, 97),
    ("gemma3_vl", 4, 2, 16, 48, 97),
    ("ministral3", 4, 2, 16, 48, 97),
    ("mistral3_vl", 4, 2, 16, 48, 97),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,heads,kv,hd,hidden,vocab", CASES)
def test_decode_prefill_training_equal(dtype, arch, heads, kv, hd, hidden, vocab) -> None:
    model = rlexact.exactify(
        tiny_model(arch, heads=heads, kv_heads=kv, head_dim=hd, hidden=hidden, vocab=vocab, dtype=dtype)
    )
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in (2, 9, 33, 70)]
    with torch.no_grad():
        train = rlexact.sequence_logprobs(model, seqs)
        for i, s in enumerate(seqs):
            assert torch.equal(rlexact.sequence_logprobs(model, [s])[0], train[i]), "batch composition changed a row"
            for chunk in (1, 5, 16) if i == 2 else (7, 32):
                paged = _paged_logprobs(model, s, chunk, shuffle_seed=i + chunk)
                assert torch.equal(paged, train[i]), f"seq {i}: chunk {chunk} != packed training forward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_path_differs(dtype) -> None:
    """Negative control: the same comparison on the stock kernels finds a difference."""
    model = rlexact.exactify(tiny_model("qwen3", hidden=64, heads=4, kv_heads=2, head_dim=16, dtype=dtype))
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (40, 70, 90)]
    differ = 0
    with torch.no_grad(), rlexact.use_kernels(model, "native"):
        train = rlexact.sequence_logprobs(model, seqs)
        for i, s in enumerate(seqs):
            differ += int(not torch.equal(_paged_logprobs(model, s, 1), train[i]))
            differ += int(not torch.equal(rlexact.sequence_logprobs(model, [s])[0], train[i]))
    assert differ > 0


@pytest.mark.parametrize(
    "arch",
    ["qwen3", "llama", "qwen2", "mistral", "ministral3", "mistral3_vl", "olmo2", "olmo3", "phi3", "smollm3",
     "granite", "gemma3", "gemma3_vl"],
)  # fmt: skip
def test_matches_unmodified_transformers_fp32(arch) -> None:
    """Exactified log-probs agree with the stock transformers model within 1e-4 (fp32)."""
    ref = tiny_model(arch, hidden=64, heads=4, kv_heads=2, head_dim=16)
    model = rlexact.exactify(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (3, 30, 64)]
    with torch.no_grad():
        ours = rlexact.sequence_logprobs(model, seqs)
        for s, lp in zip(seqs, ours):
            logits = ref(s[None]).logits[0].float()
            expected = torch.log_softmax(logits, -1)[:-1].gather(-1, s[1:, None])[:, 0]
            assert (lp - expected).abs().max() < 1e-4


def test_olmo2_norms_round_once_bf16() -> None:
    """OLMo-2's RMSNorm multiplies the fp32 normalized row by the weight and rounds once; its exact norms do the same
    (``round_normed=False``): bitwise the stock modules on the CPU twin (the same torch ops per row), every one of
    them; negative control: the Llama-style norm, which rounds the normalized row first, differs."""
    ref = tiny_model("olmo2", hidden=64, heads=4, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    model = rlexact.exactify(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(4)
    norms = [(a, b) for a, b in zip(ref.modules(), model.modules()) if type(a).__name__ == "Olmo2RMSNorm"]
    assert len(norms) == 2 * 4 + 1  # q/k, post-attention and post-feedforward norms per layer, the final norm
    llama_differs = 0
    with torch.no_grad():
        for stock, exact in norms:
            x = (3 * torch.randn(11, stock.weight.shape[0], generator=g)).bfloat16()
            assert torch.equal(exact(x), stock(x)), "exact OLMo-2 norm != stock"
            llama = rlexact.ops.rms_norm(x, stock.weight, stock.variance_epsilon)
            llama_differs += int(not torch.equal(llama, stock(x)))
    assert llama_differs > 0


def test_gemma3_norms_gate_and_rotary_tables() -> None:
    """Gemma 3's pieces, each against the stock module and with a negative control:

    * its RMSNorm scales by ``1 + w`` in fp32 and rounds once: the exact norms (the q/k norms on ``[..., heads, D]``
      included) are bitwise the stock modules on the CPU twin in bf16; without the offset they differ;
    * its MLP's GELU-tanh gate: the exact MLP agrees with the stock one (fp32), the SiLU gate does not;
    * its local and global layers rotate from two tables of one rotary module: both are kept, they differ, and each
      layer type's rows equal the stock forward's;
    * its q/k norms run inside the fused rotary kernel: the exact forward calls neither module."""
    ref = tiny_model("gemma3", hidden=64, heads=4, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    model = rlexact.exactify(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(5)
    norms = [(a, b) for a, b in zip(ref.modules(), model.modules()) if type(a).__name__ == "Gemma3RMSNorm"]
    assert len(norms) == 6 * 2 + 1  # q/k and four sandwich norms per layer, the final norm
    without_offset = 0
    with torch.no_grad():
        for stock, exact in norms:
            shape = (11, 4, 16) if stock.weight.shape[0] == 16 else (11, stock.weight.shape[0])
            x = (3 * torch.randn(*shape, generator=g)).bfloat16()
            assert torch.equal(exact(x), stock(x)), "exact Gemma 3 norm != stock"
            plain = rlexact.ops.rms_norm(x, stock.weight.float(), stock.eps, round_normed=False)
            without_offset += int(not torch.equal(plain, stock(x)))
    assert without_offset == len(norms)

    ref32 = tiny_model("gemma3", hidden=64, heads=4, kv_heads=2, head_dim=16)
    model32 = rlexact.exactify(copy.deepcopy(ref32))
    x = torch.randn(7, 64, generator=g)
    with torch.no_grad():
        stock_mlp, exact_mlp = ref32.model.layers[0].mlp, model32.model.layers[0].mlp
        torch.testing.assert_close(exact_mlp(x), stock_mlp(x), rtol=1e-5, atol=1e-5)
        silu = stock_mlp.down_proj(torch.nn.functional.silu(stock_mlp.gate_proj(x)) * stock_mlp.up_proj(x))
        assert (silu - stock_mlp(x)).norm() > 0.01 * stock_mlp(x).norm()

        seq = torch.randint(0, 97, (1, 30), generator=g)
        model32(seq)  # builds the tables
        tables = {k[2]: v for k, v in get_state(model32).rope_tables.items()}
        assert set(tables) == {"sliding_attention", "full_attention"}
        assert not torch.equal(tables["sliding_attention"][0], tables["full_attention"][0])
        pos = torch.arange(30)[None]
        rotary = model32.model.rotary_emb
        for layer_type, (cos, _) in tables.items():
            stock_cos, _ = type(rotary).forward(rotary, x, pos, layer_type)
            torch.testing.assert_close(cos[:30], stock_cos[0].float(), rtol=0, atol=1e-6)

        calls = []
        for layer in model32.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.register_forward_hook(lambda *_: calls.append(1))
        model32(seq)
        assert not calls, "Gemma 3's q/k norms ran as modules, not in the fused rotary kernel"
        branch, layers = [], model32.model.layers
        for i, layer in enumerate(layers):
            layer.post_attention_layernorm.register_forward_hook(lambda *_, i=i: branch.append(("attn", i)))
            layer.post_feedforward_layernorm.register_forward_hook(lambda *_, i=i: branch.append(("mlp", i)))
        model32(seq)
        # the last layer's MLP output has no next norm to join: it runs its norm and the add
        assert branch == [("mlp", len(layers) - 1)], "Gemma 3's branch norms ran apart from the add-norm kernel"


@pytest.mark.parametrize(
    "change,match",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "causal"),
        ({"hidden_activation": "gelu"}, "hidden activation 'gelu'"),
    ],
)
def test_gemma3_settings_the_kernels_lack_are_errors(change: dict, match: str) -> None:
    model = tiny_model("gemma3")
    for k, v in change.items():
        setattr(model.config, k, v)
    with pytest.raises(ValueError, match=match):
        rlexact.exactify(model)


@pytest.mark.parametrize(("arch", "prefix"), [("qwen3", "Qwen3"), ("gemma3", "Gemma3")])
def test_restore_and_reexactify(arch: str, prefix: str) -> None:
    ref = tiny_model(arch)
    model = rlexact.exactify(copy.deepcopy(ref))
    ids = torch.randint(0, 97, (1, 20))
    patched = [type(m).__name__ for m in model.modules() if "forward" in m.__dict__]
    kinds = ("Attention", "MLP", "RMSNorm", "RotaryEmbedding", "DecoderLayer")
    assert {"Linear", *(prefix + k for k in kinds)} <= set(patched)
    with torch.no_grad():
        exact_logits = model(ids).logits
        rlexact.exactify(model, enabled=False)
        assert not rlexact.is_exactified(model)
        assert not any("forward" in m.__dict__ for m in model.modules()), "an instance forward was left behind"
        assert torch.equal(model(ids).logits, ref(ids).logits), "enabled=False must restore the stock forward"
        rlexact.exactify(model)
        assert torch.equal(model(ids).logits, exact_logits)


def test_gemma3_image_text_model_runs_its_text_decoder(tmp_path) -> None:
    """Gemma 3 4B and up (``Gemma3ForConditionalGeneration``, what ``AutoModelForCausalLM`` loads): exactify patches
    the text decoder and the LM head only, so the vision tower keeps its stock modules and attention implementation;
    images then raise an error naming the fix (the causal kernels would attend over image tokens wrongly), and after
    ``enabled=False`` they run again, bitwise the stock model. A checkpoint saved from the trained model loads back
    as the image-text model with the same weights."""
    from transformers import AutoModelForCausalLM

    from rlexact.export import save_pretrained

    ref = tiny_model("gemma3_vl")
    model = rlexact.exactify(copy.deepcopy(ref))
    vision = model.model.vision_tower
    assert not any("forward" in m.__dict__ for m in vision.modules() if m is not vision)
    assert "forward" in model.model.language_model.layers[0].self_attn.__dict__
    assert vision.config._attn_implementation == ref.model.vision_tower.config._attn_implementation != "rlexact"
    assert rlexact.models.text_config(model)._attn_implementation == "rlexact"
    ids = torch.randint(0, 90, (1, 12))
    ids[0, 2:6] = model.config.image_token_index
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        with pytest.raises(ValueError, match="pixel_values"):
            model(ids, pixel_values=pixels)
        rlexact.exactify(model, enabled=False)
        assert torch.equal(model(ids, pixel_values=pixels).logits, ref(ids, pixel_values=pixels).logits)
    rlexact.exactify(model)
    save_pretrained(model, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back) is type(ref)
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_ministral3_query_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ministral 3 multiplies its rotated queries by ``1 + beta log(1 + floor(p / original))``: the exact factor
    agrees with transformers' ``get_llama_4_attn_scale`` at every position, the exact model agrees with the stock one
    over many periods, and without the factor it does not (negative control)."""
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    from rlexact.models.query_scale import position_query_scale

    ref = tiny_model("ministral3", weight_scale=3.0)  # sharper attention: the factor moves the log-probs more
    pos = torch.arange(512)[None]
    ones = torch.ones(1, 512, 1, 1)
    got = position_query_scale(ref.model.layers[0].self_attn)(ones, pos)[0, :, 0, 0]
    torch.testing.assert_close(got, get_llama_4_attn_scale(pos, 0.1, 16)[0, 0, :, 0], rtol=1e-6, atol=0)
    assert got[0] == 1 and got[-1] > 1.3
    seqs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(9)) for n in (40, 300)]

    def stock_agreement(model: torch.nn.Module) -> float:
        with torch.no_grad():
            worst = 0.0
            for s, lp in zip(seqs, rlexact.sequence_logprobs(model, seqs)):
                logp = torch.log_softmax(ref(s[None]).logits[0].float(), -1)[:-1].gather(-1, s[1:, None])[:, 0]
                worst = max(worst, (lp - logp).abs().max().item())
        return worst

    assert stock_agreement(rlexact.exactify(copy.deepcopy(ref))) < 1e-4
    monkeypatch.setattr(sys.modules["rlexact.models.exactify"], "position_query_scale", lambda m: None)
    assert stock_agreement(rlexact.exactify(copy.deepcopy(ref))) > 1e-2


def test_from_pretrained_local_dir(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        model = rlexact.exactify(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval())
        seqs = [torch.randint(0, 97, (n,)) for n in (4, 25)]
        with torch.no_grad():
            lp = rlexact.sequence_logprobs(model, seqs)
            assert torch.equal(_paged_logprobs(model, seqs[1], 3), lp[1])


def test_unsupported_architecture() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="qwen3"):
        rlexact.exactify(model)


def test_bad_sequences() -> None:
    model = rlexact.exactify(tiny_model("qwen3", max_pos=64))
    with pytest.raises(ValueError, match="empty"):
        rlexact.sequence_logprobs(model, [[1, 2], []])
    with pytest.raises(ValueError, match="token ids"):
        rlexact.sequence_logprobs(model, [[1, 200]])
    with pytest.raises(ValueError, match=r"sequence 1 is text, not token ids: tokenize it first"):
        rlexact.sequence_logprobs(model, [[1, 2], "12"])
    with pytest.raises(ValueError, match=r"sequence 0 must hold integer token ids, got dtype torch.float32"):
        rlexact.sequence_logprobs(model, [torch.tensor([1.0, 2.5])])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        rlexact.sequence_logprobs(model, [list(range(70))])


def test_training_gradients_flow() -> None:
    model = rlexact.exactify(tiny_model("qwen3")).train()
    seqs = [torch.randint(0, 97, (n,)) for n in (6, 19)]
    lp = rlexact.sequence_logprobs(model, seqs)
    torch.cat(lp).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_compiled_model_is_unwrapped_with_a_warning() -> None:
    from rlexact.models import uncompiled
    from rlexact.rollout import Generator, SamplingParams

    model = tiny_model(vocab=50, max_pos=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert uncompiled(model) is model  # negative control: a plain module passes through, silently
    compiled = torch.compile(model)  # a wrapper; nothing is compiled until it is called
    warns = pytest.warns(UserWarning, match="torch.compile'd Qwen3ForCausalLM.*no effect")
    with warns:
        assert rlexact.exactify(compiled) is model
    with warns:
        gen = Generator(compiled, kernels="exact")
    assert gen.model is model
    outs = gen.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, seed=0))
    with warns:
        from_wrapper = rlexact.sequence_logprobs(compiled, [o.sequence for o in outs])
    for lp, ref, o in zip(from_wrapper, rlexact.sequence_logprobs(model, [o.sequence for o in outs]), outs):
        assert torch.equal(lp, ref) and torch.equal(lp[-len(o.token_ids) :], o.logprobs)
    with warns:
        module = rlexact.RLModule(model=torch.compile(tiny_model(vocab=50, max_pos=64)), tokenizer="demo-char")
    assert not any("_orig_mod" in k for k in module.state_dict())
