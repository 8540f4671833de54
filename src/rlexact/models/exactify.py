"""Plug the exact ops into a transformers causal LM in place, through public extension points.

* Attention: an ``AttentionInterface`` function named ``"rlexact"`` plus a matching ``AttentionMaskInterface``
  entry, selected through ``config._attn_implementation``. It reads :class:`~rlexact.models.metadata.AttnMetadata`
  from the forward kwargs. Plain transformers calls (``model(ids)``, ``model.generate`` with its ``DynamicCache``
  and left padding) run the same exact kernels; settings the kernels do not implement (attention dropout in train
  mode, autocast) raise an error naming the fix, and so does a sequence past a sliding window
  (:mod:`rlexact.models.context`).
* ``nn.Linear``, RMSNorm, the gated MLP, the rotary embedding and the attention layer (fused q/k-norm + rotary):
  instance ``forward`` replacements that dispatch on the model's :class:`ExactState` (exact kernels, or the stock
  forward in ``"native"`` mode).

Nothing is copied: the generator and the trainer run this very module object. ``exactify(model, enabled=False)``
removes every replacement and restores the original attention implementation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rlexact import ops
from rlexact.models.compiled import uncompiled
from rlexact.models.context import ContextLimit, context_limit, is_attention, sliding_window
from rlexact.models.metadata import AttnMetadata
from rlexact.models.moe import MOE_MODEL_TYPES, check_moe, moe_forward

Kernels = Literal["exact", "native"]
KERNELS: tuple[str, ...] = ("exact", "native")
ATTN_IMPL = "rlexact"
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "qwen3", "qwen2", "llama", "mistral", "olmo2", "phi3", "smollm3", *MOE_MODEL_TYPES
)  # fmt: skip
_STATE_ATTR = "_rlexact_state"


@dataclass
class ExactState:
    """Per-model switch shared by every patched module of one model.

    Attributes:
        context: the longest sequence the model runs (:func:`rlexact.models.context.context_limit` at exactify time).
        kernels: ``"exact"`` or ``"native"``; change it with :func:`use_kernels` (reentrant, try/finally).
        original_forwards: the replaced modules and their original ``forward`` (restored by ``enabled=False``).
        original_attn_impl: ``config._attn_implementation`` before exactify.
        rope_tables: fp32 ``(cos, sin)`` tables over ``[0, max_position_embeddings)`` per device.
        fused: concatenated projection weights per attention layer / gated MLP, used in exact mode without autograd
            (set for the duration of a generator call by :func:`rlexact.models.fusion.use_fused_projections`).
    """

    context: ContextLimit
    kernels: Kernels = "exact"
    original_forwards: list[tuple[nn.Module, Callable]] = field(default_factory=list)
    original_attn_impl: str | None = None
    rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    fused: dict[nn.Module, object] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.kernels == "exact"


def get_state(model: nn.Module) -> ExactState | None:
    """The :class:`ExactState` of an exactified model, else ``None``."""
    return model.__dict__.get(_STATE_ATTR)


def is_exactified(model: nn.Module) -> bool:
    return get_state(model) is not None


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no transformers config; expected a transformers causal LM")
    return str(getattr(config, "model_type", ""))


def check_supported(model: nn.Module) -> None:
    """Raise ``ValueError`` listing the supported architectures when ``model`` is not one of them."""
    mt = _model_type(model)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {mt!r} ({type(model).__name__}); rlexact supports model_type in "
            f"{list(SUPPORTED_MODEL_TYPES)} (Qwen3, Qwen2, Llama, Mistral, OLMo-2, Phi-3 / Phi-4, SmolLM3, Qwen3-MoE, "
            "Qwen2-MoE and Mixtral *ForCausalLM)"
        )
    act = getattr(model.config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}; rlexact's gated MLP kernel implements silu")
    rope = getattr(model.config, "rope_scaling", None) or getattr(model.config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: its tables change with sequence length")
    partial = float(rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0)
    partial = float(getattr(model.config, "partial_rotary_factor", partial) or partial)
    if partial != 1.0:
        raise ValueError(
            f"unsupported partial_rotary_factor={partial}: rlexact's fused rotary kernel rotates the whole head"
        )
    resid = float(getattr(model.config, "resid_pdrop", 0.0) or 0.0)
    if resid > 0:
        raise ValueError(
            f"resid_pdrop={resid}: residual dropout makes the trainer's forward differ from the rollout's. Load the "
            "model with resid_pdrop=0.0, e.g. from_pretrained(path, resid_pdrop=0.0), before rlexact.exactify."
        )
    check_moe(model)


ROUND_ONCE_NORMS: tuple[str, ...] = ("Olmo2RMSNorm",)
"""RMSNorm classes that multiply the fp32 normalized row by the weight and round once (``round_normed=False`` of
:func:`rlexact.ops.rms_norm`); the others round the normalized row first, as Llama's does."""


def _patch(
    state: ExactState, module: nn.Module, exact_forward: Callable, native: Callable[[Callable], Callable] | None = None
) -> None:
    """Replace ``module.forward`` by a switch: ``exact_forward`` in exact mode, the original forward (or
    ``native(original)``) in native mode; the original is kept for ``exactify(model, enabled=False)``."""
    orig = module.forward
    state.original_forwards.append((module, orig))
    native_forward = orig if native is None else native(orig)

    def forward(*args: object, **kwargs: object) -> object:
        if not state.exact:
            return native_forward(*args, **kwargs)
        check_autocast(args[0] if args else next(iter(kwargs.values())))  # type: ignore[arg-type]
        return exact_forward(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def _check_positions_in_context(state: ExactState, x: torch.Tensor, position_ids: torch.Tensor) -> None:
    """:meth:`ContextLimit.check` of the largest position (skipped inside a CUDA-graph capture, whose lengths the
    generator checks when it admits the sequences)."""
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        state.context.check(int(position_ids.max()))


def _window_guarded(state: ExactState) -> Callable[[Callable], Callable]:
    """The native rotary forward: the stock one, after the positions are checked against a sliding window that
    limits the context (the native attention paths are full causal too); unchanged without such a window."""

    def wrap(orig: Callable) -> Callable:
        if state.context.window is None:
            return orig

        def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            _check_positions_in_context(state, x, position_ids)
            return orig(x, position_ids)

        return forward

    return wrap


def _rope_from_table(state: ExactState, orig: Callable, max_positions: int) -> Callable:
    """Exact rotary forward: ``(cos, sin)`` gathered from one fp32 table over ``[0, max_positions)`` per device,
    built once with the stock forward, so a position's values never depend on the shape of the call. Positions
    past the model's :class:`ContextLimit` raise ``ValueError``."""

    def table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in state.rope_tables:
            pos = torch.arange(max_positions, device=device)[None]
            dummy = torch.empty(1, dtype=torch.float32, device=device)
            with torch.no_grad():
                cos, sin = orig(dummy, pos)
            state.rope_tables[device] = (cos[0].float().contiguous(), sin[0].float().contiguous())
        return state.rope_tables[device]

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_positions_in_context(state, x, position_ids)
        cos, sin = table(x.device)  # built before capture: the generator runs eager steps first
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    return forward


def _attention_forward(m: nn.Module) -> Callable:
    """Exact forward of a Qwen3 / Qwen2 / Llama / Mistral / OLMo-2 / Phi-3 / SmolLM3 attention layer: the
    projections, one fused q/k-norm + rotary kernel (:func:`rlexact.ops.qk_norm_rope`) instead of the stock per-op
    chain, the exact attention, and the output projection. OLMo-2's q/k norms span the whole projection, so they run
    as the model's (exact) RMSNorm modules before the kernel, which then only rotates. Phi-3's q, k and v come from
    its one ``qkv_proj``. SmolLM3's NoPE layers (``use_rope`` False) skip the kernel.

    With :class:`~rlexact.models.metadata.AttnMetadata` (the generator and the trainer) attention is
    :func:`rlexact_attention`. Without it (a plain transformers call: ``model(ids)``, ``model.generate``), it is
    :func:`_transformers_attention`, which honours a transformers ``DynamicCache`` and left padding with the same
    kernels, so a decode step over the cache computes bitwise what the full forward computes."""
    q_norm, k_norm = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
    eps = _norm_eps(q_norm)
    # OLMo-2 normalizes the whole projection (weights of Hq * D and Hkv * D) before splitting heads; Qwen3 each head
    full_norm = q_norm is not None and q_norm.weight.shape[-1] != m.head_dim
    rotates = bool(getattr(m, "use_rope", True))  # SmolLM3's NoPE layers attend without positions
    if not rotates and q_norm is not None and not full_norm:
        raise ValueError(f"{type(m).__name__}: per-head q/k norms without rotary are not implemented by rlexact")
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
        if full_norm:  # the patched norms over the flat projections; the fused kernel then only rotates
            q, k = q_norm(q.flatten(-2)).view(shape), k_norm(k.flatten(-2)).view(shape)
        cos, sin = position_embeddings
        qw, kw = (None, None) if q_norm is None or full_norm else (q_norm.weight, k_norm.weight)
        paged = None if meta is None else meta.paged
        if paged is not None and not _no_autograd(q, k, v, *(w for w in (qw, kw) if w is not None)):
            paged = None  # paged steps under autograd: rotate here, attention writes the cache
        if not rotates:  # nothing to fuse: attention writes the cache
            paged = None
        elif paged is None:
            q, k = ops.qk_norm_rope(q, k, cos, sin, qw, kw, eps)
        else:  # generator steps: the rotation kernel also stores this layer's new K/V rows in the paged cache
            kc, vc = paged.caches[m.layer_idx]
            q, k = ops.qk_norm_rope_write_kv(q, k, v, cos, sin, qw, kw, eps, kc, vc, paged.slot_mapping)
        dropout = m.attention_dropout if m.training else 0.0
        if meta is None:
            check_attention_settings(m, dropout, sliding_window(m))
            out = _transformers_attention(m, q, k, v, attention_mask, cache, kwargs.get("position_ids"))
        else:
            out, _ = rlexact_attention(
                m, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask, dropout=dropout,
                scaling=m.scaling, rlexact_meta=meta, sliding_window=sliding_window(m),
                kv_written=paged is not None,
            )  # fmt: skip
        return m.o_proj(out.reshape(*input_shape, -1)), None

    return forward


def _fused_entry(m: nn.Module, x: torch.Tensor):  # noqa: ANN202 - a rlexact.models.fusion.FusedLinear
    """``m``'s fused projection weights when in effect for input ``x``, else ``None`` (not set, native mode, or
    autograd needed): then the caller runs the projections separately."""
    state: ExactState | None = m.__dict__.get(_STATE_ATTR)
    if state is None or not state.fused or not state.exact:
        return None
    fused = state.fused.get(m)
    return fused if fused is not None and _no_autograd(x) else None


def _fused_linear(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The outputs of ``m``'s projections from its fused weight (column views of one exact matmul), or ``None``."""
    fused = _fused_entry(m, x)
    return None if fused is None else ops.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)


def _mlp_forward(m: nn.Module) -> Callable:
    """Exact gated MLP: ``down(silu(gate(x)) * up(x))``; with fused weights in effect, gate, up and the SiLU gate are
    one :func:`rlexact.ops.gate_up_silu` call (bitwise the separate ops)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        fused = _fused_entry(m, x)
        if fused is not None and fused.bias is None and fused.sizes[0] == fused.sizes[1]:
            return m.down_proj(ops.gate_up_silu(x, fused.weight))
        gate, up = _fused_linear(m, x) or (m.gate_proj(x), m.up_proj(x))
        return m.down_proj(ops.silu_mul(gate, up))

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
    for m in model.modules():
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


def _is_decoder_layer(m: nn.Module) -> bool:
    return (
        type(m).__name__.endswith("DecoderLayer")
        and all(_is_rmsnorm(getattr(m, n, None)) for n in ("input_layernorm", "post_attention_layernorm"))
        and all(isinstance(getattr(m, n, None), nn.Module) for n in ("self_attn", "mlp"))
    )


def _no_autograd(*tensors: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _version(t: torch.Tensor) -> int | None:
    """The in-place version counter of ``t`` (``None`` for inference tensors, which have none)."""
    return None if t.is_inference() else t._version


def _decoder_layer_forward(layer: nn.Module, next_norm: nn.Module | None, handoff: list) -> Callable:
    """Exact forward of a pre-norm (Qwen, Llama, Mistral, their MoE) decoder layer, transformers'
    ``DecoderLayer.forward`` with the residual adds fused into the norms that follow them
    (:func:`rlexact.ops.add_rms_norm`): one launch instead of an add and a norm. Outputs are bitwise those of the
    unfused layer; every kwarg goes to ``self_attn``.

    Without autograd (no grad mode, or no input requiring grad): the post-attention add and
    ``post_attention_layernorm`` are one call, and the MLP-output add is fused with ``next_norm`` (the next layer's
    ``input_layernorm``; ``None`` for the last layer). The layer still returns the residual stream; the normed rows
    go to the next layer through ``handoff`` (one slot shared by the layers of a stack), which uses them only when it
    receives that very tensor and its norm weight is the one used, unmodified; else it runs its norm itself. A
    sharded (DTensor) next weight is not read. With autograd (grad mode on and a parameter of the layer or its input
    requiring grad) the layer runs its class forward (transformers' layer over the exact modules, with its activation
    checkpointing when enabled): the trainer's backward is unchanged."""
    in_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    post_eps = _norm_eps(post_norm)
    next_eps = _norm_eps(next_norm)

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
        hidden_states, residual = ops.add_rms_norm(hidden_states, residual, post_norm.weight, post_eps)
        hidden_states = layer.mlp(hidden_states)
        w = None if next_norm is None else next_norm.weight
        if w is None or type(w) not in (torch.Tensor, nn.Parameter) or not _no_autograd(hidden_states, residual, w):
            return residual + hidden_states
        normed, out = ops.add_rms_norm(hidden_states, residual, w, next_eps)
        handoff[0] = ((out, w), (_version(out), _version(w)), normed)
        return out

    return forward


def _patch_decoder_layers(state: ExactState, model: nn.Module) -> None:
    """Patch every stack (``nn.ModuleList``) of decoder layers with :func:`_decoder_layer_forward`, each layer fused
    with the next one's ``input_layernorm``."""
    for stack in model.modules():
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
    ``torch.compile`` wrapper, works on and returns the module it wraps (:func:`rlexact.models.uncompiled`).
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
            m.__dict__.pop(_STATE_ATTR, None)
        return model
    if state is not None:
        return model
    check_supported(model)
    register_attention()
    state = ExactState(context_limit(model), original_attn_impl=getattr(model.config, "_attn_implementation", None))
    max_pos = int(model.config.max_position_embeddings)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            _patch(state, m, lambda x, m=m: ops.linear(x, m.weight, m.bias))
        elif _is_rmsnorm(m):
            eps, rounded = _norm_eps(m), type(m).__name__ not in ROUND_ONCE_NORMS
            _patch(state, m, lambda x, m=m, eps=eps, r=rounded: ops.rms_norm(x, m.weight, eps, round_normed=r))
        elif _is_gated_mlp(m):
            _patch(state, m, _mlp_forward(m))
            m.__dict__[_STATE_ATTR] = state
        elif _is_fused_gated_mlp(m):
            _patch(state, m, _fused_mlp_forward(m))
        elif type(m).__name__.endswith("RotaryEmbedding"):
            _patch(state, m, _rope_from_table(state, m.forward, max_pos), native=_window_guarded(state))
        elif is_attention(m):
            _patch(state, m, _attention_forward(m))
        elif (moe_fwd := moe_forward(m)) is not None:
            _patch(state, m, moe_fwd)
        if hasattr(m, "layer_idx") and (hasattr(m, "q_proj") or hasattr(m, "qkv_proj")):
            m.__dict__[_STATE_ATTR] = state
    _patch_decoder_layers(state, model)
    model.__dict__[_STATE_ATTR] = state
    _set_attn_impl(model, ATTN_IMPL)
    return model


def _set_attn_impl(model: nn.Module, name: str) -> None:
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


@contextlib.contextmanager
def use_kernels(model: nn.Module, kernels: str) -> Iterator[None]:
    """Run ``model`` with ``"exact"`` or ``"native"`` kernels inside the block; restores the previous choice."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    state = get_state(model)
    if state is None:
        raise ValueError("use_kernels needs an exactified model: call rlexact.exactify(model) first")
    previous = state.kernels
    state.kernels = kernels  # type: ignore[assignment]
    try:
        yield
    finally:
        state.kernels = previous


# ---------------------------------------------------------------------------------------------------------------------
# attention function and mask function registered with transformers
# ---------------------------------------------------------------------------------------------------------------------


def _native_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None],
                k[s:e].transpose(0, 1)[None],
                v[s:e].transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[s:e] = o[0].transpose(0, 1)
    return out


def _native_paged(q: torch.Tensor, meta: AttnMetadata, kc: torch.Tensor, vc: torch.Tensor, scale: float):
    """Stock-kernel attention over the paged cache: gather keys to contiguous memory, then SDPA (not exact).

    Query heads of one KV group are folded into the query length (``[B, Hkv, g * nq, D]``), so K/V are never
    expanded for GQA and SDPA may pick its memory-efficient masked kernel.

    * Pure decode (one query per sequence): one padded SDPA call; keys are padded to ``paged.max_seqlen_k`` when
      given — a static bound, so with ``max_seqlen_q`` also set the step has no host sync and is CUDA-graph
      capturable — else to ``max(seqlens_k)``.
    * Mixed steps (eager): decode rows as above; prefill chunks in padded groups (sorted by chunk length, a group
      grows while its padded work stays within 2x of its real work), one SDPA call per group.
    """
    paged = meta.paged
    assert paged is not None
    bs, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    hq = q.shape[1]
    grp = hq // hkv
    dev = q.device
    num_seqs = meta.num_seqs

    def gather(tables: torch.Tensor, nblk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, Hkv, nblk * bs, D]`` of the sequences whose block tables are ``tables``."""
        slots = (tables[:, :nblk].long()[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(tables.shape[0], -1)
        kk = kc.reshape(-1, hkv, d)[slots].transpose(1, 2)
        vv = vc.reshape(-1, hkv, d)[slots].transpose(1, 2)
        return kk, vv

    def decode(qd: torch.Tensor, tables: torch.Tensor, lens_k: torch.Tensor, lmax: int) -> torch.Tensor:
        n = qd.shape[0]
        nblk = -(-lmax // bs)
        kk, vv = gather(tables, nblk)
        valid = torch.arange(nblk * bs, device=dev)[None] < lens_k[:, None].long()
        o = F.scaled_dot_product_attention(
            qd.reshape(n, hkv, grp, d), kk, vv, attn_mask=valid[:, None, None], scale=scale
        )
        return o.reshape(n, hq, d)

    max_q = paged.max_seqlen_q
    if max_q is None:
        max_q = int((meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).max())
    if max_q == 1 and q.shape[0] == num_seqs:
        lmax = paged.max_seqlen_k if paged.max_seqlen_k is not None else int(paged.seqlens_k.max())
        return decode(q, paged.block_tables, paged.seqlens_k, lmax)

    out = torch.empty_like(q)
    cu = meta.cu_seqlens.tolist()
    lens = paged.seqlens_k.tolist()
    nqs = [e - s for s, e in zip(cu[:-1], cu[1:])]
    dec = [i for i, n in enumerate(nqs) if n == 1]
    if dec:
        idx = torch.tensor(dec, device=dev)
        rows = torch.tensor([cu[i] for i in dec], device=dev)
        out[rows] = decode(q[rows], paged.block_tables[idx], paged.seqlens_k[idx], max(lens[i] for i in dec))
    pre = sorted((i for i, n in enumerate(nqs) if n > 1), key=lambda i: -nqs[i])
    groups: list[list[int]] = []
    for i in pre:
        if groups:
            cand = groups[-1] + [i]
            padded = len(cand) * nqs[cand[0]] * max(lens[j] for j in cand)
            if padded <= 2 * sum(nqs[j] * lens[j] for j in cand):
                groups[-1] = cand
                continue
        groups.append([i])
    for g in groups:
        n, qmax = len(g), nqs[g[0]]
        nblk = -(-max(lens[j] for j in g) // bs)
        idx = torch.tensor(g, device=dev)
        nq_t = torch.tensor([nqs[j] for j in g], device=dev)
        lk_t = torch.tensor([lens[j] for j in g], device=dev)
        start_t = torch.tensor([cu[j] for j in g], device=dev)
        qi = torch.arange(qmax, device=dev)
        valid_q = qi[None] < nq_t[:, None]  # [n, Q]
        src = (start_t[:, None] + qi[None])[valid_q]
        qp = q.new_zeros((n, qmax, hq, d))
        qp[valid_q] = q[src]
        qpos = (lk_t - nq_t)[:, None] + qi[None]  # absolute query positions [n, Q]
        kpos = torch.arange(nblk * bs, device=dev)
        mask = (kpos[None, None] <= qpos[:, :, None]) & (kpos[None, None] < lk_t[:, None, None])
        mask = mask | (kpos == 0)[None, None]  # padded query rows attend key 0 (discarded) instead of nothing
        kk, vv = gather(paged.block_tables[idx], nblk)
        qf = qp.reshape(n, qmax, hkv, grp, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, grp * qmax, d)
        mf = mask[:, None, None].expand(n, 1, grp, qmax, nblk * bs).reshape(n, 1, grp * qmax, nblk * bs)
        o = F.scaled_dot_product_attention(qf, kk, vv, attn_mask=mf, scale=scale)
        o = o.reshape(n, hkv, grp, qmax, d).permute(0, 3, 1, 2, 4).reshape(n, qmax, hq, d)
        out[src] = o[valid_q]
    return out


HF_CACHE_BLOCK = 16
"""Block size of the paged view that :func:`_transformers_attention` builds over a transformers KV cache."""


def check_attention_settings(module: nn.Module, dropout: float, window: int | None) -> None:
    """Raise ``ValueError`` for attention settings the exact kernels do not implement (never ignore them silently):
    attention dropout in train mode, and a sliding window shorter than the context limit that exactify set (the
    window changed afterwards)."""
    if dropout > 0:
        raise ValueError(
            f"attention_dropout={dropout} in train mode: rlexact's attention kernels do not implement dropout. "
            "Set model.config.attention_dropout = 0.0 and every attention layer's attention_dropout = 0.0 (or call "
            "model.eval())."
        )
    state: ExactState | None = module.__dict__.get(_STATE_ATTR)
    if window is not None and state is not None and int(window) < state.context.tokens:
        raise ValueError(
            f"sliding_window={window} of {type(module).__name__} is shorter than the context limit exactify set "
            f"({state.context.tokens} tokens, from {state.context.source}): the window changed after exactify. Call "
            "rlexact.exactify(model, enabled=False), then rlexact.exactify(model), so the context follows the window."
        )


def check_autocast(x: torch.Tensor) -> None:
    """Raise ``RuntimeError`` when an autocast context is active for ``x``'s device: it would change the dtypes the
    exact kernels see."""
    if torch.is_autocast_enabled(x.device.type):
        raise RuntimeError(
            f"an autocast context is active on {x.device.type!r} while rlexact's exact kernels run; autocast changes "
            "their input dtypes and breaks bitwise exactness. Leave autocast off (Lightning: precision='32-true', not "
            "'*-mixed') and set the model dtype instead (model.to(torch.bfloat16) / RLModule(dtype='bfloat16'))."
        )


def _cache_update(m: nn.Module, cache: object, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``k, v [B, T, Hkv, D]`` to a transformers ``DynamicCache``; return all keys/values ``[B, L, Hkv, D]``."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"rlexact's exact attention supports transformers' DynamicCache, got {type(cache).__name__}; use "
            "model.generate(...) with the default cache (no cache_implementation) or rlexact.rollout.Generator"
        )
    k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2), m.layer_idx)
    layer = cache.layers[m.layer_idx]
    if type(layer) is DynamicSlidingWindowLayer:  # holds every key while the cache fits the window
        if k_all.shape[-2] != layer.cumulative_length:
            raise ValueError(
                f"layer {m.layer_idx}'s sliding-window cache dropped keys past its window of {layer.sliding_window} "
                "(padding included); rlexact's kernels attend to every key, so keep padded prompt + new tokens "
                f"within {layer.sliding_window}"
            )
    elif type(layer) is not DynamicLayer:
        raise ValueError(
            f"rlexact's exact attention supports full and sliding-window DynamicCache layers, got "
            f"{type(layer).__name__} in layer {m.layer_idx}; use the default DynamicCache (no quantized or offloaded "
            "layers)"
        )
    return k_all.transpose(1, 2), v_all.transpose(1, 2)


def _key_starts(mask: torch.Tensor | None, b: int, t: int, length: int) -> torch.Tensor:
    """First valid key ``s_b`` ``[B]`` of every row from a 4-D transformers mask (``None``: no padding).

    The exact kernels implement causal attention over keys ``[s_b, L)`` whose positions restart at 0: a left-padded
    causal mask. Any other mask (right padding, holes, a custom pattern) raises ``ValueError``.
    """
    if mask is None:
        return torch.zeros(b, dtype=torch.long)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != length or mask.shape[-2] != t:
        raise ValueError(f"unsupported attention mask {type(mask).__name__} for rlexact's exact attention")
    valid = (mask if mask.dtype == torch.bool else mask == 0)[:, 0].expand(b, t, length).cpu()
    starts = length - valid[:, -1].sum(-1)
    kidx = torch.arange(length)
    c = length - t + torch.arange(t)  # cache index of each query
    expected = (kidx[None, None] >= starts[:, None, None]) & (kidx[None, None] <= c[None, :, None])
    real = c[None] >= starts[:, None]
    if bool(((valid != expected) & real[:, :, None]).any()):
        raise ValueError(
            "rlexact's exact attention supports left padding with a causal mask only (the padded tokens first, then "
            "the real ones): this attention mask has right padding or holes. Left-pad the batch "
            "(tokenizer.padding_side = 'left') or pass unpadded sequences to rlexact.sequence_logprobs / "
            "rlexact.rollout.Generator."
        )
    return starts


def _check_positions(position_ids: object, starts: torch.Tensor, b: int, t: int, length: int) -> None:
    """The real queries of row ``b`` must sit at positions ``cache index - s_b`` (positions restart after padding)."""
    if not isinstance(position_ids, torch.Tensor):
        return
    c = length - t + torch.arange(t)
    expected = c[None] - starts[:, None]
    got = position_ids.reshape(-1, t).expand(b, t).cpu()
    if bool(((got != expected) & (expected >= 0)).any()):
        raise ValueError(
            "position_ids do not restart at 0 after the left padding, so they differ from the unpadded forward; pass "
            "attention_mask and let transformers derive the positions (as model.generate does: cumsum(mask) - 1)"
        )


def _paged_rows(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], nq: list[int], scale: float
) -> torch.Tensor:
    """:func:`rlexact.ops.attention_paged` of ``q [sum nq, Hq, D]`` over per-row keys/values ``[L_b, Hkv, D]``
    copied into a paged view of :data:`HF_CACHE_BLOCK`-token blocks (queries are each row's last ``nq_b`` keys)."""
    bs = HF_CACHE_BLOCK
    nblk = [-(-x.shape[0] // bs) for x in keys]

    def paged(rows: list[torch.Tensor]) -> torch.Tensor:
        padded = [torch.cat([x, x.new_zeros((n * bs - x.shape[0], *x.shape[1:]))]) for x, n in zip(rows, nblk)]
        return torch.cat(padded).view(-1, bs, *rows[0].shape[1:])

    table = torch.zeros((len(keys), max(nblk)), dtype=torch.int32)
    first = 0
    for i, n in enumerate(nblk):
        table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    cu = torch.tensor([0, *nq], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor([x.shape[0] for x in keys], dtype=torch.int32)
    dev = q.device
    return ops.attention_paged(q, paged(keys), paged(values), table.to(dev), cu.to(dev), lens.to(dev), scale)


def _transformers_attention(
    m: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cache: object | None,
    position_ids: object,
) -> torch.Tensor:
    """Exact attention for a plain transformers call: ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]`` -> ``[B, T, Hq, D]``.

    With a ``DynamicCache`` the new keys are appended first and the queries (the last ``T`` keys) attend over the
    whole cache. Left padding is removed per row, so row ``b`` is the unpadded sequence ``[s_b, L)``: without past
    keys that is :func:`rlexact.ops.attention_varlen` (the training path, differentiable); with past keys it is
    :func:`rlexact.ops.attention_paged` (the generator's decode, inference only), bitwise equal per row. Outputs of
    padding queries are zero.
    """
    b, t, hq, d = q.shape
    k_all, v_all = (k, v) if cache is None else _cache_update(m, cache, k, v)
    length = k_all.shape[1]
    starts = _key_starts(mask, b, t, length)
    _check_positions(position_ids, starts, b, t, length)
    st = starts.tolist()
    nq = [min(t, length - s) for s in st]
    q_rows = torch.cat([q[i, t - n :] for i, n in enumerate(nq)])
    keys = [k_all[i, s:] for i, s in enumerate(st)]
    values = [v_all[i, s:] for i, s in enumerate(st)]
    scale = float(m.scaling)
    if all(n == length - s for n, s in zip(nq, st)):
        cu = torch.tensor([0, *nq], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        rows = ops.attention_varlen(q_rows, torch.cat(keys), torch.cat(values), cu, scale)
    else:
        if torch.is_grad_enabled() and (q.requires_grad or k_all.requires_grad):
            raise RuntimeError(
                "attention over past keys of a transformers KV cache is inference-only in rlexact (no gradient): run "
                "it under torch.no_grad(), or pass use_cache=False / no cache to get a differentiable forward"
            )
        rows = _paged_rows(q_rows, keys, values, nq, scale)
    if all(n == t for n in nq):
        return rows.view(b, t, hq, d)
    out = q.new_zeros((b, t, hq, d))
    first = 0
    for i, n in enumerate(nq):
        out[i, t - n :] = rows[first : first + n]
        first += n
    return out


def rlexact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    rlexact_meta: AttnMetadata | None = None,
    kv_written: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, Hq, T, D]``, ``key/value [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``.
    ``kv_written``: a paged step's new K/V rows are already in the cache (:func:`rlexact.ops.qk_norm_rope_write_kv`)."""
    state: ExactState | None = module.__dict__.get(_STATE_ATTR)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    if rlexact_meta is None:
        if state is not None and state.exact:
            raise RuntimeError(
                f"rlexact attention called without AttnMetadata by {type(module).__name__}, which exactify did not "
                "patch; the exact kernels cannot run there. Call the model through its exactified attention layers "
                "(plain model(...) / model.generate) or rlexact.sequence_logprobs / rlexact.rollout.Generator."
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale)
    check_attention_settings(module, dropout, kwargs.get("sliding_window"))  # type: ignore[arg-type]
    if query.shape[0] != 1:
        raise ValueError(f"packed forward expects batch dimension 1, got {query.shape[0]}")
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1)  # [T, Hkv, D]; a row-strided view under fused projections (write_kv takes it)
    exact = state is None or state.exact
    if rlexact_meta.paged is None:
        v = v.contiguous()
        if exact:
            out = ops.attention_varlen(q, k, v, rlexact_meta.cu_seqlens, scale)
        else:
            out = _native_varlen(q, k, v, rlexact_meta.cu_seqlens.tolist(), scale)
    else:
        paged = rlexact_meta.paged
        kc, vc = paged.caches[module.layer_idx]
        if not kv_written:
            ops.write_kv(k, v, kc, vc, paged.slot_mapping)
        if exact and paged.fresh:
            out = ops.attention_varlen(q, k, v, rlexact_meta.cu_seqlens, scale)
        elif exact:
            out = ops.attention_paged(
                q, kc, vc, paged.block_tables, rlexact_meta.cu_seqlens, paged.seqlens_k, scale,
                max_seqlen_q=paged.max_seqlen_q, split_counters=paged.split_counters, prefix=paged.prefix,
            )  # fmt: skip
        else:
            out = _native_paged(q, rlexact_meta, kc, vc, scale)
    return out[None], None


def _rlexact_mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    """Mask function for ``"rlexact"``: no mask for unpadded inputs (causality is in the kernels), else SDPA's."""
    from transformers.masking_utils import sdpa_mask

    mask = kwargs.get("attention_mask")
    if mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and bool(mask.all())):
        return None
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    """Register the ``"rlexact"`` attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPL, rlexact_attention)
    AttentionMaskInterface.register(ATTN_IMPL, _rlexact_mask)
