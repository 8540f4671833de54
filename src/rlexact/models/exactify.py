"""Plug the exact ops into a transformers causal LM in place, through public extension points.

* Attention: an ``AttentionInterface`` function named ``"rlexact"`` plus a matching ``AttentionMaskInterface``
  entry (:mod:`rlexact.models.attention`), selected through ``config._attn_implementation``. It reads
  :class:`~rlexact.models.metadata.AttnMetadata` from the forward kwargs. Plain transformers calls (``model(ids)``,
  ``model.generate`` with its ``DynamicCache`` and left padding) run the same exact kernels, sliding windows included
  (:mod:`rlexact.models.context`); settings the kernels do not implement (attention dropout in train mode, autocast)
  raise an error naming the fix.
* ``nn.Linear``, RMSNorm, the gated MLP, the rotary embedding and the attention layer (fused q/k-norm + rotary):
  instance ``forward`` replacements that dispatch on the model's :class:`~rlexact.models.state.ExactState` (exact
  kernels, or the stock forward in ``"native"`` mode).

Nothing is copied: the generator and the trainer run this very module object. ``exactify(model, enabled=False)``
removes every replacement and restores the original attention implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from rlexact import ops
from rlexact.models.attention import (
    ATTN_IMPL,
    check_attention_settings,
    register_attention,
    rlexact_attention,
    transformers_attention,
)
from rlexact.models.compiled import uncompiled
from rlexact.models.context import context_limit, is_attention, sliding_window
from rlexact.models.moe import MOE_MODEL_TYPES, check_moe, moe_forward
from rlexact.models.query_scale import position_query_scale
from rlexact.models.state import STATE_ATTR, ExactState, get_state
from rlexact.models.text import TEXT_OF_MULTIMODAL, decoder, text_config, text_modules, vision_tower

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "qwen3", "qwen2", "llama", "mistral", "ministral3", "olmo2", "olmo3", "phi3", "smollm3", "granite",
    "gemma3_text", *TEXT_OF_MULTIMODAL, *MOE_MODEL_TYPES,
)  # fmt: skip
GATES: dict[str, str] = {"silu": "silu_mul", "swish": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}
"""The gated MLP's activation (``hidden_act``, Gemma's ``hidden_activation``) -> the exact op that applies it."""
GATE_UPS: dict[str, str] = {"silu_mul": "gate_up_silu", "gelu_tanh_mul": "gate_up_gelu_tanh"}
"""A gate's op -> the op that runs the gate and up products and that gate over one fused ``[gate; up]`` weight."""


def check_supported(model: nn.Module) -> None:
    """Raise ``ValueError`` listing the supported architectures when ``model`` is not one of them."""
    config = text_config(model)
    mt = str(getattr(model.config, "model_type", ""))
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {mt!r} ({type(model).__name__}); rlexact supports model_type in "
            f"{list(SUPPORTED_MODEL_TYPES)} (Qwen3, Qwen2, Llama, Mistral, Ministral 3, OLMo-2, OLMo 3, Phi-3 / "
            "Phi-4, SmolLM3, Granite, Gemma 3, Qwen3-MoE, Qwen2-MoE, Mixtral and Granite-MoE *ForCausalLM, and the "
            "text decoders of the Gemma 3 and Mistral 3 image-text models)"
        )
    if mt in TEXT_OF_MULTIMODAL and (
        getattr(config, "model_type", None) not in TEXT_OF_MULTIMODAL[mt] or decoder(model) is model.model
    ):
        raise ValueError(
            f"{type(model).__name__} ({mt!r}): expected its text decoder at model.model.language_model with a "
            f"text_config of model_type in {list(TEXT_OF_MULTIMODAL[mt])} (transformers' *ForConditionalGeneration); "
            f"got {getattr(config, 'model_type', None)!r}"
        )
    gate_op(config)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise ValueError(
                f"unsupported {name}={getattr(config, name)}: rlexact's kernels do not soft-cap logits; load the "
                f"model with {name}=None if it was trained without it"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True: rlexact's attention kernels are causal")
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    per_layer_type = isinstance(rope, dict) and rope and all(isinstance(r, dict) for r in rope.values())
    ropes = list(rope.values()) if per_layer_type else [rope]  # Gemma 3 keeps one rope dict per layer type
    for r in ropes:
        rope_type = r.get("rope_type", r.get("type", "default")) if isinstance(r, dict) else "default"
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(
                f"unsupported rope_type {rope_type!r}: its tables change with sequence length, so a token's rotation "
                "would depend on how long its batch is. Train with a fixed rope: 'default', or 'linear' / 'yarn' / "
                "'llama3' with the scaling the model was trained with"
            )
        partial = float(r.get("partial_rotary_factor", 1.0) if isinstance(r, dict) else 1.0)
        partial = float(getattr(config, "partial_rotary_factor", partial) or partial)
        if partial != 1.0:
            raise ValueError(
                f"unsupported partial_rotary_factor={partial}: rlexact's fused rotary kernel rotates the whole head"
            )
    resid = float(getattr(config, "resid_pdrop", 0.0) or 0.0)
    if resid > 0:
        raise ValueError(
            f"resid_pdrop={resid}: residual dropout makes the trainer's forward differ from the rollout's. Load the "
            "model with resid_pdrop=0.0, e.g. from_pretrained(path, resid_pdrop=0.0), before rlexact.exactify."
        )
    check_moe(model)


def gate_op(config: object) -> str:
    """The name of the :mod:`rlexact.ops` function that applies the gated MLP's activation of a model with ``config``
    (:data:`GATES`); ``ValueError`` for activations it has none for."""
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
    if act not in GATES:
        raise ValueError(f"unsupported hidden activation {act!r}; rlexact's gated MLP kernels implement {list(GATES)}")
    return GATES[act]


ROUND_ONCE_NORMS: tuple[str, ...] = ("Olmo2RMSNorm", "Olmo3RMSNorm", "Gemma3RMSNorm")
"""RMSNorm classes that multiply the fp32 normalized row by the weight and round once (``round_normed=False`` of
:func:`rlexact.ops.rms_norm`); the others round the normalized row first, as Llama's does."""
OFFSET_NORMS: tuple[str, ...] = ("Gemma3RMSNorm",)
"""RMSNorm classes whose scale is ``1 + weight``, added in fp32 (Gemma's)."""


def _norm_kind(m: nn.Module | None) -> dict[str, bool]:
    """The ``round_normed`` and ``offset`` arguments of :func:`rlexact.ops.rms_norm` that a transformers RMSNorm
    module ``m`` computes with (:data:`ROUND_ONCE_NORMS`, :data:`OFFSET_NORMS`)."""
    name = type(m).__name__
    return {"round_normed": name not in ROUND_ONCE_NORMS, "offset": name in OFFSET_NORMS}


def _norm_forward(m: nn.Module) -> Callable:
    """Exact forward of a transformers RMSNorm (:func:`_norm_kind`)."""
    eps, kind = _norm_eps(m), _norm_kind(m)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, m.weight, eps, **kind)

    return forward


def _patch(state: ExactState, module: nn.Module, exact_forward: Callable) -> None:
    """Replace ``module.forward`` by a switch: ``exact_forward`` in exact mode, the original forward in native
    mode (the original is kept for ``exactify(model, enabled=False)``)."""
    orig = module.forward
    state.original_forwards.append((module, orig))

    def forward(*args: object, **kwargs: object) -> object:
        if not state.exact:
            return orig(*args, **kwargs)
        check_autocast(args[0] if args else next(iter(kwargs.values())))  # type: ignore[arg-type]
        return exact_forward(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def _rope_from_table(state: ExactState, rotary: nn.Module, max_positions: int) -> Callable:
    """Exact rotary forward of the module ``rotary``: ``(cos, sin)`` gathered from one fp32 table over
    ``[0, max_positions)`` per device (and per layer type, for rotary modules that take one: Gemma 3's local and global
    layers rotate at different bases), built once with the stock forward, so a position's values never depend on the
    shape of the call."""
    orig = rotary.forward

    def table(device: torch.device, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rotary, device, layer_type)
        if key not in state.rope_tables:
            pos = torch.arange(max_positions, device=device)[None]
            dummy = torch.empty(1, dtype=torch.float32, device=device)
            with torch.no_grad():
                cos, sin = orig(dummy, pos) if layer_type is None else orig(dummy, pos, layer_type)
            state.rope_tables[key] = (cos[0].float().contiguous(), sin[0].float().contiguous())
        return state.rope_tables[key]

    def forward(
        x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and int(position_ids.max()) >= max_positions:
            raise ValueError(
                f"position {int(position_ids.max())} exceeds max_position_embeddings={max_positions} of the model"
            )
        cos, sin = table(x.device, layer_type)  # built before capture: the generator runs eager steps first
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    return forward


def _attention_forward(m: nn.Module) -> Callable:
    """Exact forward of a Qwen3 / Qwen2 / Llama / Mistral / Ministral 3 / OLMo-2 / OLMo 3 / Phi-3 / SmolLM3 /
    Gemma 3 attention layer: the projections, one fused q/k-norm + rotary kernel (:func:`rlexact.ops.qk_norm_rope`,
    with the per-head norms' kind: Qwen3's Llama norm, Gemma 3's round-once ``1 + w`` norm) instead of the stock
    per-op chain, the exact attention, and the output projection. OLMo-2's q/k norms span the whole projection, so
    they run as the model's (exact) RMSNorm modules before the kernel, which then only rotates. Phi-3's q, k and v
    come from its one ``qkv_proj``. SmolLM3's NoPE layers (``use_rope`` False) skip the kernel. Ministral 3 scales
    the rotated queries by their position (:mod:`rlexact.models.query_scale`).

    With :class:`~rlexact.models.metadata.AttnMetadata` (the generator and the trainer) attention is
    :func:`~rlexact.models.attention.rlexact_attention`. Without it (a plain transformers call: ``model(ids)``,
    ``model.generate``), it is :func:`~rlexact.models.attention.transformers_attention`, which honours a transformers
    ``DynamicCache`` and left padding with the same kernels, so a decode step over the cache computes bitwise what
    the full forward computes."""
    q_norm, k_norm = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
    eps = _norm_eps(q_norm)
    # OLMo-2 normalizes the whole projection (weights of Hq * D and Hkv * D) before splitting heads; Qwen3 and Gemma 3
    # each head, in the fused kernel with their norm's kind
    full_norm = q_norm is not None and q_norm.weight.shape[-1] != m.head_dim
    per_head = q_norm is not None and not full_norm
    kind = _norm_kind(q_norm) if per_head else {}  # the kernel's defaults where it only rotates
    if per_head and _norm_kind(k_norm) != kind:
        raise ValueError(f"{type(m).__name__}: q_norm and k_norm of different kinds are not implemented by rlexact")
    rotates = bool(getattr(m, "use_rope", True))  # SmolLM3's NoPE layers attend without positions
    if not rotates and per_head:
        raise ValueError(f"{type(m).__name__}: per-head q/k norms without rotary are not implemented by rlexact")
    query_scale = position_query_scale(m)
    qkv_proj = getattr(m, "qkv_proj", None)
    if qkv_proj is not None:
        hq, hkv = m.config.num_attention_heads, m.config.num_key_value_heads
        qkv_sizes = (hq * m.head_dim, hkv * m.head_dim, hkv * m.head_dim)

    def forward(
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: object | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        past = kwargs.pop("past_key_values", None)
        cache = cache if cache is not None else past
        meta = kwargs.pop("rlexact_meta", None)
        input_shape = hidden_states.shape[:-1]
        shape = (*input_shape, -1, m.head_dim)
        fused = _fused_linear(m, hidden_states)
        if fused is None and qkv_proj is not None:  # Phi-3's own fused projection: q, k, v are column views of it
            fused = qkv_proj(hidden_states).split(qkv_sizes, dim=-1)
        if fused is not None:
            q, k, v = (t.view(shape) for t in fused)
        else:
            q = m.q_proj(hidden_states).view(shape)
            k = m.k_proj(hidden_states).view(shape)
            v = m.v_proj(hidden_states).view(shape)
        if full_norm:  # the patched norm modules over the flat projections; the fused kernel then only rotates
            q, k = q_norm(q.flatten(-2)).view(shape), k_norm(k.flatten(-2)).view(shape)
        cos, sin = position_embeddings
        qw, kw = (q_norm.weight, k_norm.weight) if per_head else (None, None)
        paged = None if meta is None else meta.paged
        # generator steps without autograd: the rotation kernel also stores this layer's new K/V rows in the paged
        # cache; otherwise (and in layers without rotary) the attention call writes them
        kv_written = rotates and paged is not None and _no_autograd(q, k, v, *(w for w in (qw, kw) if w is not None))
        if kv_written:
            kc, vc = paged.caches[m.layer_idx]
            q, k = ops.qk_norm_rope_write_kv(q, k, v, cos, sin, qw, kw, eps, kc, vc, paged.slot_mapping, **kind)
        elif rotates:
            q, k = ops.qk_norm_rope(q, k, cos, sin, qw, kw, eps, **kind)
        position_ids = kwargs.get("position_ids")
        if query_scale is not None:  # Ministral 3: rotated queries scaled by their position
            if position_ids is None:
                raise ValueError(f"{type(m).__name__}: its position-dependent query scale needs position_ids")
            q = query_scale(q, position_ids)
        dropout = m.attention_dropout if m.training else 0.0
        if meta is None:
            check_attention_settings(dropout)
            out = transformers_attention(m, q, k, v, attention_mask, cache, position_ids, sliding_window(m))
        else:
            out, _ = rlexact_attention(
                m, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask, dropout=dropout,
                scaling=m.scaling, rlexact_meta=meta, sliding_window=sliding_window(m), kv_written=kv_written,
            )  # fmt: skip
        return m.o_proj(out.reshape(*input_shape, -1)), None

    return forward


def _fused_entry(m: nn.Module, x: torch.Tensor):  # noqa: ANN202 - a rlexact.models.fusion.FusedLinear
    """``m``'s fused projection weights when in effect for input ``x``, else ``None`` (not set, native mode, or
    autograd needed): then the caller runs the projections separately."""
    state: ExactState | None = get_state(m)
    if state is None or not state.fused or not state.exact:
        return None
    fused = state.fused.get(m)
    return fused if fused is not None and _no_autograd(x) else None


def _fused_linear(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The outputs of ``m``'s projections from its fused weight (column views of one exact matmul), or ``None``."""
    fused = _fused_entry(m, x)
    return None if fused is None else ops.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)


def _mlp_forward(m: nn.Module, gate_name: str) -> Callable:
    """Exact gated MLP: ``down(act(gate(x)) * up(x))`` with ``act(g) * u`` the op ``gate_name`` of
    :data:`GATES`; with fused weights in effect, gate, up and the activation are one op (:data:`GATE_UPS`, bitwise
    the separate ops)."""
    gated, gate_up = getattr(ops, gate_name), getattr(ops, GATE_UPS[gate_name])

    def forward(x: torch.Tensor) -> torch.Tensor:
        fused = _fused_entry(m, x)
        if fused is not None and fused.bias is None and fused.sizes[0] == fused.sizes[1]:
            return m.down_proj(gate_up(x, fused.weight))
        gate, up = _fused_linear(m, x) or (m.gate_proj(x), m.up_proj(x))
        return m.down_proj(gated(gate, up))

    return forward


def _fused_mlp_forward(m: nn.Module) -> Callable:
    """Exact gated MLP over one ``gate_up_proj`` (Phi-3: gate rows, then up rows): :func:`rlexact.ops.gate_up_silu`
    on its weight, the SiLU gate applied as in :func:`_mlp_forward`."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if m.gate_up_proj.bias is None:
            return m.down_proj(ops.gate_up_silu(x, m.gate_up_proj.weight))
        gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
        return m.down_proj(ops.silu_mul(gate, up))

    return forward


def fused_groups(model: nn.Module) -> Iterator[tuple[nn.Module, list[nn.Linear]]]:
    """``(module, linears)`` whose outputs one fused matmul may compute: each attention layer's q/k/v and each gated
    MLP's gate/up projections, in the order their outputs are split (none for layers whose checkpoint already fuses
    them, as Phi-3's)."""
    for m in text_modules(model):
        if is_attention(m) and hasattr(m, "q_proj"):
            yield m, [m.q_proj, m.k_proj, m.v_proj]
        elif _is_gated_mlp(m):
            yield m, [m.gate_proj, m.up_proj]


def _norm_eps(m: nn.Module | None) -> float:
    """The epsilon of a transformers RMSNorm (``variance_epsilon`` or ``eps``; 1e-6 when it has neither)."""
    return float(getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6)))


def _is_rmsnorm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)


def _is_gated_mlp(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _is_fused_gated_mlp(m: nn.Module) -> bool:
    """Phi-3's MLP: one ``gate_up_proj`` linear (MoE experts hold a 3-D ``gate_up_proj`` parameter instead)."""
    return type(m).__name__.endswith("MLP") and all(
        isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_up_proj", "down_proj")
    )


SANDWICH_NORMS: tuple[str, ...] = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
"""The norms of a layer that normalizes both branches' outputs as well as their inputs (Gemma 3): its
``post_attention_layernorm`` then normalizes the attention output before the residual add."""


def _is_decoder_layer(m: nn.Module) -> bool:
    """A pre-norm decoder layer whose residual adds :func:`_decoder_layer_forward` fuses into the norms, with or
    without :data:`SANDWICH_NORMS` (Granite's scaled residual branches, ``residual_multiplier``, keep the stock
    forward)."""
    norms = ("input_layernorm", "post_attention_layernorm")
    if any(hasattr(m, n) for n in SANDWICH_NORMS):
        norms += SANDWICH_NORMS
    return (
        type(m).__name__.endswith("DecoderLayer")
        and float(getattr(m, "residual_multiplier", 1.0)) == 1.0
        and all(_is_rmsnorm(getattr(m, n, None)) for n in norms)
        and all(isinstance(getattr(m, n, None), nn.Module) for n in ("self_attn", "mlp"))
    )


def _no_autograd(*tensors: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _version(t: torch.Tensor) -> int | None:
    """The in-place version counter of ``t`` (``None`` for inference tensors, which have none)."""
    return None if t.is_inference() else t._version


def _decoder_layer_forward(layer: nn.Module, next_norm: nn.Module | None, handoff: list) -> Callable:
    """Exact forward of a pre-norm (Qwen, Llama, Mistral, their MoE, Gemma 3) decoder layer, transformers'
    ``DecoderLayer.forward`` with the residual adds fused into the norms that follow them
    (:func:`rlexact.ops.add_rms_norm`): one launch instead of an add and a norm. Outputs are bitwise those of the
    unfused layer; every kwarg goes to ``self_attn``.

    Without autograd (no grad mode, or no input requiring grad): the post-attention add and the norm after it
    (``post_attention_layernorm``, or with :data:`SANDWICH_NORMS` ``pre_feedforward_layernorm``, the attention output
    normalized by ``post_attention_layernorm`` first) are one call, and the MLP-output add (of its output normalized by
    ``post_feedforward_layernorm`` with sandwich norms) is fused with ``next_norm`` (the next layer's
    ``input_layernorm``; ``None`` for the last layer). A branch's output norm of the same kind as the norm after the add
    runs in that call too (:func:`rlexact.ops.norm_add_rms_norm`). The layer still returns the residual stream; the
    normed rows go to the next layer through ``handoff`` (one slot shared by the layers of a stack), which uses them
    only when it receives that very tensor and its norm weight is the one used, unmodified; else it runs its norm
    itself. A sharded (DTensor) next weight is not read. With autograd (grad mode on and a parameter of the layer or its
    input requiring grad) the layer runs its class forward (transformers' layer over the exact modules, with its
    activation checkpointing when enabled): the trainer's backward is unchanged."""
    sandwich = hasattr(layer, SANDWICH_NORMS[0])
    in_norm = layer.input_layernorm
    attn_out_norm, post_norm, mlp_out_norm = (
        (layer.post_attention_layernorm, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
        if sandwich
        else (None, layer.post_attention_layernorm, None)
    )
    post_eps, post_kind = _norm_eps(post_norm), _norm_kind(post_norm)
    next_eps, next_kind = _norm_eps(next_norm), _norm_kind(next_norm)
    attn_branch, mlp_branch = _branch_norm(attn_out_norm, post_kind), _branch_norm(mlp_out_norm, next_kind)

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        handed, handoff[0] = handoff[0], None
        if torch.is_grad_enabled() and (
            hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters())
        ):
            # the trainer: the stock layer over the exact modules (its class forward also applies transformers'
            # activation checkpointing, which an instance forward would bypass)
            return type(layer).forward(
                layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
            )  # fmt: skip
        residual = hidden_states
        key = (residual, in_norm.weight)
        if handed is not None and all(a is b and _version(a) == v for a, b, v in zip(key, handed[0], handed[1])):
            hidden_states = handed[2]
        else:
            hidden_states = in_norm(hidden_states)
        hidden_states, _ = layer.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )  # fmt: skip
        hidden_states, residual = _add_norm(attn_branch, hidden_states, residual, post_norm.weight, post_eps, post_kind)
        hidden_states = layer.mlp(hidden_states)
        w = None if next_norm is None else next_norm.weight
        if w is None or type(w) not in (torch.Tensor, nn.Parameter) or not _no_autograd(hidden_states, residual, w):
            return residual + (hidden_states if mlp_out_norm is None else mlp_out_norm(hidden_states))
        normed, out = _add_norm(mlp_branch, hidden_states, residual, w, next_eps, next_kind)
        handoff[0] = ((out, w), (_version(out), _version(w)), normed)
        return out

    return forward


def _branch_norm(norm: nn.Module | None, kind: dict[str, bool]) -> tuple[nn.Module | None, float, bool]:
    """``(norm, its eps, whether it joins the add-norm after it)`` of a branch whose output ``norm`` (None: none)
    normalizes before the residual add that a norm of ``kind`` follows: it joins when both norms are of one kind
    (Gemma 3's are)."""
    return norm, _norm_eps(norm), norm is not None and _norm_kind(norm) == kind


def _add_norm(branch: tuple[nn.Module | None, float, bool], h: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
              eps: float, kind: dict[str, bool]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(rms_norm(s, w, eps), s)`` with ``s = residual + h``, ``h`` first through the branch norm of ``branch``
    (:func:`_branch_norm`): one :func:`rlexact.ops.norm_add_rms_norm` call where the norm joins, else the norm module
    and :func:`rlexact.ops.add_rms_norm`."""
    norm, norm_eps, joins = branch
    if joins:
        return ops.norm_add_rms_norm(h, norm.weight, norm_eps, residual, w, eps, **kind)
    return ops.add_rms_norm(h if norm is None else norm(h), residual, w, eps, **kind)


def _patch_decoder_layers(state: ExactState, model: nn.Module) -> None:
    """Patch every stack (``nn.ModuleList``) of decoder layers with :func:`_decoder_layer_forward`, each layer fused
    with the next one's ``input_layernorm``."""
    for stack in text_modules(model):
        if not isinstance(stack, nn.ModuleList) or not len(stack) or not all(map(_is_decoder_layer, stack)):
            continue
        handoff: list = [None]
        for i, layer in enumerate(stack):
            nxt = stack[i + 1].input_layernorm if i + 1 < len(stack) else None
            _patch(state, layer, _decoder_layer_forward(layer, nxt, handoff))


def exactify(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make ``model`` compute with the exact kernels (in place), or restore it with ``enabled=False``.

    Idempotent. Works on models from ``from_pretrained`` and ``from_config``, fp32 and bf16, before or after FSDP2
    ``fully_shard``. Raises ``ValueError`` for unsupported architectures (listing the supported ones). Given a
    ``torch.compile`` wrapper, works on and returns the module it wraps (:func:`rlexact.models.uncompiled`). Of an
    image-text model (:data:`rlexact.models.text.TEXT_OF_MULTIMODAL`) only the text decoder and the LM head run the
    exact kernels; its vision tower then raises: rlexact trains such models on text.
    """
    model = uncompiled(model)
    state = get_state(model)
    if not enabled:
        if state is None:
            return model
        for module, fwd in reversed(state.original_forwards):
            if module.__dict__.get("forward") is not None:
                del module.forward
            if module.forward != fwd:
                module.forward = fwd  # type: ignore[method-assign]
        _set_attn_impl(model, state.original_attn_impl or "sdpa")
        for m in model.modules():
            m.__dict__.pop(STATE_ATTR, None)
        return model
    if state is not None:
        return model
    check_supported(model)
    register_attention()
    state = ExactState(original_attn_impl=getattr(text_config(model), "_attn_implementation", None))
    max_pos, gate = context_limit(model), gate_op(text_config(model))
    vision = vision_tower(model)
    if vision is not None:  # in both kernel modes
        state.original_forwards.append((vision, vision.forward))
        vision.forward = _text_only(model)  # type: ignore[method-assign]
    for m in text_modules(model):
        if isinstance(m, nn.Linear):
            _patch(state, m, lambda x, m=m: ops.linear(x, m.weight, m.bias))
        elif _is_rmsnorm(m):
            _patch(state, m, _norm_forward(m))
        elif _is_gated_mlp(m):
            _patch(state, m, _mlp_forward(m, gate))
            m.__dict__[STATE_ATTR] = state
        elif _is_fused_gated_mlp(m):
            _patch(state, m, _fused_mlp_forward(m))
        elif type(m).__name__.endswith("RotaryEmbedding"):
            _patch(state, m, _rope_from_table(state, m, max_pos))
        elif is_attention(m):
            _patch(state, m, _attention_forward(m))
        elif (moe_fwd := moe_forward(m)) is not None:
            _patch(state, m, moe_fwd)
        if hasattr(m, "layer_idx") and (hasattr(m, "q_proj") or hasattr(m, "qkv_proj")):
            m.__dict__[STATE_ATTR] = state
    _patch_decoder_layers(state, model)
    model.__dict__[STATE_ATTR] = state
    _set_attn_impl(model, ATTN_IMPL)
    return model


def _text_only(model: nn.Module) -> Callable:
    """The vision tower's forward in an exactified image-text model: an error naming the fix."""

    def forward(*args: object, **kwargs: object) -> None:
        raise ValueError(
            f"{type(model).__name__} is exactified for text: rlexact's exact kernels run its text decoder and LM "
            "head, not its vision tower, whose image features would differ between the rollout and the trainer "
            "(and Gemma 3's image tokens attend bidirectionally, which the causal kernels do not). Pass text only "
            "(no pixel_values), or call rlexact.exactify(model, enabled=False) before running images."
        )

    return forward


def _set_attn_impl(model: nn.Module, name: str) -> None:
    for m in text_modules(model):
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def check_autocast(x: torch.Tensor) -> None:
    """Raise ``RuntimeError`` when an autocast context is active for ``x``'s device: it would change the dtypes the
    exact kernels see."""
    if torch.is_autocast_enabled(x.device.type):
        raise RuntimeError(
            f"an autocast context is active on {x.device.type!r} while rlexact's exact kernels run; autocast changes "
            "their input dtypes and breaks bitwise exactness. Leave autocast off (Lightning: precision='32-true', not "
            "'*-mixed') and set the model dtype instead (model.to(torch.bfloat16) / RLModule(dtype='bfloat16'))."
        )
