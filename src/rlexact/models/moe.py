"""Exact forwards for the Mixture-of-Experts modules of transformers' Qwen3-MoE, Qwen2-MoE, Mixtral and Granite-MoE.

Written against transformers 5.x (checked from 5.17 on), where a sparse block holds a router (``*TopKRouter``:
``weight [E, H]``, ``top_k``, and ``norm_topk_prob`` or the fixed renormalization of Mixtral and Granite-MoE) and
fused experts (``*Experts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, dispatched by
``config._experts_implementation``).
:func:`moe_forward` returns the exact replacement forward for each of these modules (``None`` for any other module);
:func:`rlexact.exactify` installs them with its native/exact switch, so the stock block forward keeps running and only
its two calls change:

* router: logits through the exact matmul (:func:`rlexact.ops.matmul`, in the hidden dtype as transformers does),
  then :func:`rlexact.ops.moe_router` (fp32 softmax, top-k with ties to the lowest expert index, ``norm_topk_prob``);
  returns the logits, weights and ids in the order the stock router's class returns them (:func:`router_outputs`;
  Granite-MoE's router returned ``(ids, weights, logits)`` before transformers 5.21), so the stock block's unpacking
  and transformers' ``router_logits`` recording keep working.
  The weights are in the logits' dtype (Qwen, Granite-MoE) or fp32 (Mixtral), as the stock router returns them;
* experts: :func:`rlexact.ops.moe_experts` (batch-invariant grouped GEMM, fp32 top-k combine in top-k order);
* Qwen2-MoE block: the shared expert and its gate run through the patched MLP / linear; the mix
  ``routed + sigmoid(gate) * shared`` is :func:`rlexact.ops.sigmoid_gate`.

Dense layers of a MoE model (``mlp_only_layers``, ``decoder_sparse_step``) are ordinary gated MLPs and are patched as
in dense models. :func:`check_moe` refuses what these forwards do not implement: another experts layout, a sparse
block whose router or experts are not the modules above (transformers 4.x's per-expert ``nn.ModuleList``), and
Mixtral's router jitter.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

from rlexact import ops

MOE_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe", "mixtral", "granitemoe")
"""``config.model_type`` values whose sparse blocks :func:`moe_forward` handles."""

RENORMALIZING_ROUTERS: dict[str, bool] = {"MixtralTopKRouter": True, "GraniteMoeTopKRouter": False}
"""Router classes without ``norm_topk_prob`` that always renormalize the top-k probabilities (Granite's softmax over
the top-k logits is the same function), and whether they return the weights in fp32 (Mixtral) or in the hidden
dtype (Granite; the routers with ``norm_topk_prob`` return them in the logits' dtype too)."""


def _is_router(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    name = type(m).__name__
    return (
        name.endswith("TopKRouter")
        and isinstance(w, torch.Tensor)
        and w.dim() == 2
        and hasattr(m, "top_k")
        and (hasattr(m, "norm_topk_prob") or name in RENORMALIZING_ROUTERS)
    )


def _is_experts(m: nn.Module) -> bool:
    return type(m).__name__.endswith("Experts") and all(
        isinstance(getattr(m, n, None), torch.Tensor) for n in ("gate_up_proj", "down_proj")
    )


def _is_shared_expert_block(m: nn.Module) -> bool:
    return type(m).__name__.endswith("SparseMoeBlock") and all(
        hasattr(m, n) for n in ("gate", "experts", "shared_expert", "shared_expert_gate")
    )


def _check_experts_layout(m: nn.Module) -> None:
    """The fused layout the exact kernel implements; transformers' experts decorator records it on the module."""
    layout = {
        "is_transposed": getattr(m, "is_transposed", False),
        "has_bias": getattr(m, "has_bias", False),
        "has_gate": getattr(m, "has_gate", True),
        "is_concatenated": getattr(m, "is_concatenated", True),
        "has_post_expert_norm": getattr(m, "has_post_expert_norm", False),
    }
    expected = {
        "is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True,
        "has_post_expert_norm": False,
    }  # fmt: skip
    if layout != expected or m.gate_up_proj.dim() != 3 or m.down_proj.dim() != 3:
        raise ValueError(
            f"{type(m).__name__}: rlexact's exact experts implement fused gate_up_proj [E, 2I, H] / down_proj "
            "[E, H, I] without bias or transposition (transformers' Qwen3-MoE / Qwen2-MoE / Mixtral layout); "
            f"got {layout}"
        )
    act = getattr(getattr(m, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{type(m).__name__}: unsupported hidden_act {act!r}; the expert kernel implements silu")


ROUTER_OUTPUTS: tuple[str, ...] = ("logits", "weights", "ids")
"""What a router returns, by name: the ``[T, E]`` logits, the ``[T, k]`` top-k weights and the ``[T, k]`` expert ids."""


def _output_kind(name: str) -> str | None:
    if "ind" in name:
        return "ids"
    if "logit" in name:
        return "logits"
    return "weights" if "weight" in name or "score" in name else None


@functools.cache
def router_outputs(router_class: type) -> tuple[str, ...]:
    """The names of :data:`ROUTER_OUTPUTS` in the order ``router_class.forward`` returns them, read from the variable
    names of its one ``return`` statement (``router_logits``, ``*_weights`` / ``*_scores``, ``*_index`` /
    ``*_indices``). Raises ``ValueError`` naming the class where that statement is not such a tuple."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(router_class.forward)))
    except (OSError, TypeError, SyntaxError) as err:
        raise ValueError(f"{router_class.__name__}: rlexact cannot read its forward's source ({err})") from err
    returns = [node.value for node in ast.walk(tree) if isinstance(node, ast.Return)]
    elts = returns[0].elts if len(returns) == 1 and isinstance(returns[0], ast.Tuple) else []
    kinds = tuple(_output_kind(e.id) if isinstance(e, ast.Name) else None for e in elts)
    if sorted(k or "" for k in kinds) != sorted(ROUTER_OUTPUTS):
        got = ast.unparse(returns[0]) if len(returns) == 1 and returns[0] is not None else f"{len(returns)} returns"
        raise ValueError(
            f"{router_class.__name__}.forward returns {got}: rlexact's exact router needs one return of the logits, "
            "the top-k weights and the expert ids (transformers 5.17 to 5.25 name them router_logits, *_weights or "
            "*_scores, *_index or *_indices); this transformers version is not supported"
        )
    return kinds


def router_output(router: nn.Module, output: tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
    """The output ``name`` (one of :data:`ROUTER_OUTPUTS`) of a call of ``router``, stock or exact."""
    return output[router_outputs(type(router)).index(name)]


def _router_forward(m: nn.Module) -> Callable:
    fp32 = RENORMALIZING_ROUTERS.get(type(m).__name__)  # None: the router reads norm_topk_prob (at every call)
    picks = tuple(ROUTER_OUTPUTS.index(k) for k in router_outputs(type(m)))  # stock position -> ROUTER_OUTPUTS index

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, m.weight.shape[1])
        logits = ops.matmul(x, m.weight)
        renormalize = fp32 is not None or bool(m.norm_topk_prob)
        # the softmax is fp32 either way: only the weights' dtype differs
        weights, ids = ops.moe_router(logits.float() if fp32 else logits, int(m.top_k), renormalize)
        out = (logits, weights, ids)
        return tuple(out[i] for i in picks)

    return forward


def _experts_forward(m: nn.Module) -> Callable:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts(hidden_states, top_k_index, top_k_weights, m.gate_up_proj, m.down_proj)

    return forward


def _shared_expert_block_forward(m: nn.Module) -> Callable:
    order = router_outputs(type(m.gate))
    ids_at, weights_at = order.index("ids"), order.index("weights")

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        shared = m.shared_expert(x)
        routing = m.gate(x)
        routed = m.experts(x, routing[ids_at], routing[weights_at])
        return ops.sigmoid_gate(routed, shared, m.shared_expert_gate(x)).reshape(hidden_states.shape)

    return forward


def moe_forward(m: nn.Module) -> Callable | None:
    """The exact forward replacing ``m.forward`` when ``m`` is a MoE router, fused experts module or Qwen2-MoE sparse
    block; ``None`` for every other module. Does not validate the experts layout: :func:`check_moe` does, for the
    whole model, before :func:`rlexact.exactify` patches anything."""
    if _is_router(m):
        return _router_forward(m)
    if _is_experts(m):
        return _experts_forward(m)
    if _is_shared_expert_block(m):
        return _shared_expert_block_forward(m)
    return None


def is_moe(model: nn.Module) -> bool:
    """True when ``model`` contains a sparse MoE block (a router module)."""
    return any(_is_router(m) for m in model.modules())


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every MoE router of ``model`` in module order (empty for a dense model). Each
    returns the logits, weights and ids in its class's order (:func:`router_output`) in both kernel modes; the ids
    ``[T, k]`` are the selected experts."""
    return [(name, m) for name, m in model.named_modules() if _is_router(m)]


def check_moe(model: nn.Module) -> None:
    """Raise ``ValueError`` when a MoE module of ``model`` is one the exact forwards do not implement: a router whose
    outputs :func:`router_outputs` cannot name, an experts layout other than the fused one, a sparse block whose
    router and experts are not recognized, or router jitter."""
    for m in model.modules():
        if _is_router(m):
            router_outputs(type(m))
        elif _is_experts(m):
            _check_experts_layout(m)
        elif type(m).__name__.endswith("SparseMoeBlock"):
            _check_sparse_block(m)


def _check_sparse_block(m: nn.Module) -> None:
    gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
    if gate is None or experts is None or not _is_router(gate) or not _is_experts(experts):
        raise ValueError(
            f"{type(m).__name__}: rlexact's exact MoE forward needs transformers 5.x's router (*TopKRouter) and fused "
            f"experts (*Experts with gate_up_proj / down_proj); got gate {type(gate).__name__} and experts "
            f"{type(experts).__name__}. Upgrade transformers (pip install 'transformers>=5.17')."
        )
    jitter = float(getattr(m, "jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise ValueError(
            f"{type(m).__name__}: router_jitter_noise={jitter} scales the hidden states by random noise in train mode, "
            "so the trainer's forward would not compute the rollout's log-probs. Load the model with "
            "router_jitter_noise=0.0, e.g. from_pretrained(path, router_jitter_noise=0.0), before rlexact.exactify."
        )
