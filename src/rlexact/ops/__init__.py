"""Exact (batch-invariant, deterministic) ops shared by the generator and the trainer.

Contract for every op: the result for a row (a token, or a query position) depends only on that row's inputs and the
weights — never on how many other rows are in the call, where the row sits, or how the batch was split — and is
bitwise reproducible. Backends: Triton on CUDA (or under ``TRITON_INTERPRET=1``), batch-invariant torch on CPU
(:mod:`rlexact.ops.cpu`). ``backend=None`` picks from the input's device; pass ``"torch"`` or ``"triton"`` to force.
"""

from __future__ import annotations

import torch

from rlexact.checks import temperature_value

from .autograd import AttentionVarlenFn, GatedMulFn, MatmulFn, QKNormRopeFn, RMSNormFn, TokenLogprobsFn, kernel_impl
from .backend import Backend, interpreter_enabled, resolve_backend, triton_available
from .moe import grouped_matmul, moe_experts, moe_router, sigmoid_gate
from .shared_prefix import SharedPrefix, group_capacity

__all__ = [
    "Backend",
    "SharedPrefix",
    "add_rms_norm",
    "attention_paged",
    "attention_varlen",
    "decode_split_keys",
    "gate_up_gelu_tanh",
    "gate_up_silu",
    "gelu_tanh_mul",
    "group_capacity",
    "grouped_matmul",
    "interpreter_enabled",
    "linear",
    "lm_head_logits",
    "matmul",
    "matmul_k_splits",
    "moe_experts",
    "moe_router",
    "norm_add_rms_norm",
    "qk_norm_rope",
    "qk_norm_rope_write_kv",
    "resolve_backend",
    "rms_norm",
    "sigmoid_gate",
    "silu_mul",
    "token_logprobs",
    "triton_available",
    "write_kv",
]


def _check_2d_match(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"{what}: input feature size {x.shape[-1]} does not match weight shape {tuple(w.shape)}")


def _tracked(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors``: grad mode on and one of them requiring grad. Where it does not,
    the differentiable ops call their kernel without the ``autograd.Function`` (the same kernel, so the same bits, and
    no graph either way), which saves the Function's host work on every inference call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def matmul(x: torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``x @ w.T``: ``x [M, K]``, ``w [N, K]`` -> ``[M, N]`` in ``x.dtype``; fp32 accumulation, fixed K order.

    Differentiable through :class:`MatmulFn`. When autograd is off or neither input requires grad, the kernel is
    called without the ``autograd.Function`` (the same kernel, so the same bits, and the same result: no graph)."""
    be = resolve_backend(x, backend)
    if x.dim() != 2:
        raise ValueError(f"matmul: x must be [M, K], got shape {tuple(x.shape)}; use linear for leading dimensions")
    if be == "torch":  # the Triton matmul checks its operands itself (one check per call)
        _check_2d_match(x, w, "matmul")
    return _matmul(x, w, be)


def _matmul(x: torch.Tensor, w: torch.Tensor, backend: Backend) -> torch.Tensor:
    if _tracked(x, w):
        return MatmulFn.run(x.contiguous(), w, backend)
    return kernel_impl(backend, "matmul")(x.contiguous(), w)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str | None = None):
    """``nn.Linear`` semantics on any leading shape: ``matmul(x.reshape(-1, K), w).reshape(..., N) + bias``."""
    be = resolve_backend(x, backend)
    if be == "triton":  # takes any leading shape and checks its operands itself (no views, one check per call)
        y = _matmul(x, w, be)
    else:
        _check_2d_match(x, w, "linear")
        y = _matmul(x.reshape(-1, x.shape[-1]), w, be).reshape(*x.shape[:-1], w.shape[0])
    return y + bias if bias is not None else y


def matmul_k_splits(n: int, k: int, dtype: torch.dtype, device: torch.device) -> int:
    """Columns per fixed K split of the exact matmul's per-element chain for ``[M, k] @ [n, k].T`` on ``device``, for
    every M (0: one chain over all of K; always 0 off CUDA). Products computed together on concatenated weights
    (``rlexact.models.fusion``) give the separate products' bits only when their values agree."""
    if device.type != "cuda" or not triton_available():
        return 0
    from .triton_matmul import chain_splits

    return chain_splits(n, k, dtype, device)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu_mul(linear(x, w[:N]), linear(x, w[N:]))`` for ``w [2N, K]`` (gate rows, then up rows), bitwise, any
    leading shape. Without autograd, on GPUs where :func:`rlexact.ops.triton_matmul.gated_supported` holds, one
    launch computes both products and the gate (no ``[..., 2N]`` intermediate; at the row counts of
    :data:`rlexact.ops.triton_matmul.GATED_CUBLAS_ROWS` cuBLAS's verified product and the gate's kernel); elsewhere
    it runs the two products and :func:`silu_mul`."""
    return _gate_up(x, w, "silu_mul", backend)


def gate_up_gelu_tanh(x: torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """:func:`gate_up_silu` with :func:`gelu_tanh_mul`'s gate: ``gelu_tanh_mul(linear(x, w[:N]), linear(x, w[N:]))``,
    bitwise, in one launch where the SiLU-gated product runs in one."""
    return _gate_up(x, w, "gelu_tanh_mul", backend)


def _gate_up(x: torch.Tensor, w: torch.Tensor, op: str, backend: str | None) -> torch.Tensor:
    if w.dim() != 2 or w.shape[0] % 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"gate_up ({op}): x {tuple(x.shape)} and w {tuple(w.shape)} do not match; expected "
                         "x [..., K] and w [2N, K] (gate rows, then up rows)")  # fmt: skip
    be = resolve_backend(x, backend)
    n = w.shape[0] // 2
    if be == "triton" and x.dtype == w.dtype and not _tracked(x, w):
        from . import triton_matmul as tmm

        if tmm.gated_supported(n, w.shape[1], x.dtype, x.device):
            return tmm.gated_matmul(x, w, gelu=op == "gelu_tanh_mul")
    return _gated_mul(linear(x, w[:n], backend=be), linear(x, w[n:], backend=be), op, be)


def rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    *,
    round_normed: bool = True,
    offset: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim with transformers semantics; any leading shape. ``round_normed`` (Llama, Qwen):
    ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` in ``promote(w.dtype, x.dtype)``; else (OLMo-2)
    ``(w * x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``, one rounding. ``offset`` (Gemma 3, with
    ``round_normed=False``): the scale is ``1 + w``, added in fp32. Batch invariant either way."""
    if w.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(w.shape)} does not match hidden size {x.shape[-1]}")
    x2, be, eps = x.reshape(-1, x.shape[-1]).contiguous(), resolve_backend(x, backend), float(eps)
    if _tracked(x, w):
        y = RMSNormFn.apply(x2, w, eps, be, bool(round_normed), bool(offset))
    else:
        y = kernel_impl(be, "rms_norm")(x2, w, eps, bool(round_normed), bool(offset))
    return y.reshape(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    *,
    round_normed: bool = True,
    offset: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and the RMSNorm after it: ``(rms_norm(s, w, eps, ...), s)``,
    ``s = x + residual`` (``round_normed`` and ``offset`` as in :func:`rms_norm`).

    Bitwise contract: both outputs equal ``s = x + residual`` (torch's elementwise add) and ``rms_norm(s, w, eps)``
    computed separately; any leading shape, ``x`` and ``residual`` of one shape. With autograd off or no input
    requiring grad, and one input dtype, it is one fused launch (:func:`rlexact.ops.triton_norm.add_rms_norm`);
    otherwise it runs the two ops (differentiable through :func:`rms_norm`).
    """
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    if w.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm: weight shape {tuple(w.shape)} does not match hidden size {x.shape[-1]}")
    be = resolve_backend(x, backend)
    if _tracked(x, residual, w) or residual.dtype != x.dtype:
        s = x + residual
        return rms_norm(s, w, eps, round_normed=round_normed, offset=offset, backend=be), s
    h = x.shape[-1]
    x2, r2 = x.reshape(-1, h), residual.reshape(-1, h)
    normed, s = kernel_impl(be, "add_rms_norm")(x2, r2, w, float(eps), bool(round_normed), bool(offset))
    return normed.reshape(x.shape), s.reshape(x.shape)


def norm_add_rms_norm(
    x: torch.Tensor,
    x_weight: torch.Tensor,
    x_eps: float,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    *,
    round_normed: bool = True,
    offset: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A branch's output norm, the residual add and the RMSNorm after it (Gemma 3's sandwich norms):
    :func:`add_rms_norm` of ``rms_norm(x, x_weight, x_eps)`` and ``residual``, both norms of one kind
    (``round_normed``, ``offset``).

    Bitwise contract: both outputs equal :func:`rms_norm` then :func:`add_rms_norm` computed separately. With autograd
    off or no input requiring grad, one input dtype and a branch norm that keeps it, the Triton backend launches it
    once where that keeps the bits (:func:`rlexact.ops.triton_norm.norm_add_rms_norm`: 16-bit rows of a norm that
    rounds once, Gemma 3's); otherwise it runs the separate ops.
    """
    if x_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm_add_rms_norm: x_weight {tuple(x_weight.shape)} does not match hidden size {x.shape[-1]}"
                         )  # fmt: skip
    be = resolve_backend(x, backend)
    keeps = not round_normed or torch.promote_types(x_weight.dtype, x.dtype) == x.dtype
    if _tracked(x, x_weight, residual, w) or residual.dtype != x.dtype or not keeps:
        normed = rms_norm(x, x_weight, x_eps, round_normed=round_normed, offset=offset, backend=be)
        return add_rms_norm(normed, residual, w, eps, round_normed=round_normed, offset=offset, backend=be)
    if residual.shape != x.shape or w.shape != (x.shape[-1],):
        shapes = f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and w {tuple(w.shape)}"
        raise ValueError(f"norm_add_rms_norm: {shapes} do not match")
    h = x.shape[-1]
    x2, r2 = x.reshape(-1, h), residual.reshape(-1, h)
    normed, s = kernel_impl(be, "norm_add_rms_norm")(x2, x_weight, float(x_eps), r2, w, float(eps), bool(round_normed),
                                                      bool(offset))  # fmt: skip
    return normed.reshape(x.shape), s.reshape(x.shape)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    round_normed: bool = True,
    offset: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention prologue: optional per-head RMSNorm (Qwen3's ``q_norm``/``k_norm``), then rotary embedding.

    ``q [..., Hq, D]``, ``k [..., Hkv, D]`` with the same leading shape and dtype; ``cos, sin [..., D]`` (broadcast to
    that leading shape; any float dtype, the rotation is computed in fp32); ``q_weight, k_weight [D]`` both or
    neither; ``round_normed``, ``offset``: the norm's kind, as in :func:`rms_norm` (Gemma 3's q/k norms: ``False``,
    ``True``). Returns rotated ``(q, k)`` in the input dtype and shape. Row-local: a head's result depends only on
    that head, its position's ``cos``/``sin`` and the weights. Semantics in :mod:`rlexact.ops.triton_rope`.
    """
    q3, k3, c, s = _rope_rows(q, k, cos, sin, q_weight, k_weight)
    be = resolve_backend(q, backend)
    kind = (bool(round_normed), bool(offset))
    if _tracked(q, k, cos, sin, q_weight, k_weight):
        qo, ko = QKNormRopeFn.apply(q3, k3, c, s, q_weight, k_weight, float(eps), be, kind)
    else:
        qo, ko = kernel_impl(be, "qk_norm_rope")(q3, k3, c, s, q_weight, k_weight, float(eps), *kind)
    return qo.reshape(q.shape), ko.reshape(k.shape)


def _rope_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked ``(q [T, Hq, D], k [T, Hkv, D], cos [T, D], sin [T, D])`` of :func:`qk_norm_rope`'s arguments."""
    lead, d = q.shape[:-2], q.shape[-1]
    if k.shape[:-2] != lead or k.shape[-1] != d or k.dtype != q.dtype:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} do not match")
    if d % 2:
        raise ValueError(f"qk_norm_rope: head_dim must be even, got {d}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: pass both q_weight and k_weight or neither")
    if q_weight is not None and (q_weight.shape != (d,) or k_weight.shape != (d,)):
        shapes = f"{tuple(q_weight.shape)}, {tuple(k_weight.shape)}"
        raise ValueError(f"qk_norm_rope: norm weights must be [{d}], got {shapes}")
    if cos.shape != sin.shape or cos.shape[-1] != d:
        raise ValueError(f"qk_norm_rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must end in head_dim {d}")
    t = lead.numel()
    if not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(f"qk_norm_rope: cos/sin must be floating point, got {cos.dtype}, {sin.dtype}")
    c = cos.expand(*lead, d).reshape(t, d)  # a view for transformers' [B, S, D] tables: no copy, no cast
    s = sin.expand(*lead, d).reshape(t, d)
    return q.reshape(t, *q.shape[-2:]), k.reshape(t, *k.shape[-2:]), c, s


def qk_norm_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    round_normed: bool = True,
    offset: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rope` that also stores the rotated keys and ``v`` (``[..., Hkv, D]``, the leading shape of ``k``)
    in the paged caches: bitwise ``qk_norm_rope`` followed by :func:`write_kv` of its keys. The Triton backend does
    both in one launch (the attention prologue of a decode step). Inference only: it raises when autograd would need
    its outputs' gradients."""
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"qk_norm_rope_write_kv: v {tuple(v.shape)} {v.dtype} does not match k {tuple(k.shape)}")
    if _tracked(q, k, v, q_weight, k_weight):
        raise ValueError(
            "qk_norm_rope_write_kv has no backward; under autograd call qk_norm_rope, then write_kv of its keys"
        )
    with torch.no_grad():
        be = resolve_backend(q, backend)
        if be == "torch":
            qo, ko = qk_norm_rope(
                q, k, cos, sin, q_weight, k_weight, eps, round_normed=round_normed, offset=offset, backend=be
            )
            k3, v3 = ko.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:])
            write_kv(k3, v3, k_cache, v_cache, slot_mapping, backend=be)
            return qo, ko
        q3, k3, c, s = _rope_rows(q, k, cos, sin, q_weight, k_weight)
        qo, ko = kernel_impl(be, "qk_norm_rope_write_kv")(
            q3, k3, v.reshape(k3.shape), c, s, q_weight, k_weight, float(eps), k_cache, v_cache, slot_mapping,
            bool(round_normed), bool(offset),
        )  # fmt: skip
    return qo.reshape(q.shape), ko.reshape(k.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32 and cast once; any leading shape."""
    return _gated_mul(gate, up, "silu_mul", backend)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (transformers' ``gelu_pytorch_tanh``: Gemma's gate) computed in fp32 and cast once;
    any leading shape."""
    return _gated_mul(gate, up, "gelu_tanh_mul", backend)


def _gated_mul(gate: torch.Tensor, up: torch.Tensor, op: str, backend: str | None) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    d = gate.shape[-1]
    # row-strided views (column blocks of a fused projection) pass as they are: both backends take any row stride
    g2, u2, be = gate.reshape(-1, d), up.reshape(-1, d), resolve_backend(gate, backend)
    y = GatedMulFn.apply(g2, u2, be, op) if _tracked(gate, up) else kernel_impl(be, op)(g2, u2)
    return y.reshape(gate.shape)


def _check_head(hidden: torch.Tensor, w: torch.Tensor, temperature: float) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    _check_2d_match(hidden, w, "lm head")
    temperature_value("temperature", temperature)


def token_logprobs(
    hidden: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str | None = None,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused lm-head + temperature + log-softmax + gather: the one log-prob function of rlexact.

    ``hidden [T, H]``, ``w [V, H]`` (the lm-head weight), ``targets [T]`` int64 -> ``(logp [T], entropy [T])`` fp32,
    with ``logp[t] = z[t, targets[t]] - logsumexp(z[t])`` and ``z = (hidden @ w.T in fp32) / temperature``.
    ``[T, V]`` fp32 logits are never materialized. Differentiable in ``hidden`` and ``w``.

    ``check_targets=False`` skips the range check of ``targets`` (a host synchronization that waits for everything
    queued before it); only for callers that have checked every target lies in ``[0, V)``.
    """
    _check_head(hidden, w, temperature)
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden rows {hidden.shape[0]}")
    if check_targets and targets.numel():
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one host synchronization
        if lo < 0 or hi >= w.shape[0]:
            raise ValueError(f"targets outside the vocabulary [0, {w.shape[0]}): min {lo}, max {hi}")
    return TokenLogprobsFn.apply(
        hidden.contiguous(), w, targets.long().contiguous(), float(temperature), resolve_backend(hidden, backend)
    )


@torch.no_grad()
def lm_head_logits(
    hidden: torch.Tensor, w: torch.Tensor, temperature: float = 1.0, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits ``z [B, V]`` fp32 and ``logsumexp(z) [B]`` fp32 for sampling.

    Bitwise contract: ``z[i, t] - lse[i] == token_logprobs(hidden, w, t)[0][i]`` for every token ``t``.
    """
    _check_head(hidden, w, temperature)
    return kernel_impl(resolve_backend(hidden, backend), "lm_head_logits")(hidden.contiguous(), w, float(temperature))


def _check_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    if q.dim() != 3 or k.dim() != v.dim() or k.shape[-1] != q.shape[-1] or k.shape != v.shape:
        raise ValueError(f"attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    hkv = k.shape[-2]
    if q.shape[1] % hkv:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {hkv}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention: window must be None or a positive int (keys per query), got {window!r}")


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention over packed variable-length sequences (the training path). Differentiable.

    ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, ``cu_seqlens [B+1]`` int32 -> ``[T, Hq, D]`` in ``q.dtype``. Query ``i``
    of a sequence attends its keys ``0..i`` (``max(0, i - window + 1)..i`` with a sliding ``window``, transformers'
    convention) in key tiles anchored at position 0.
    """
    _check_attn(q, k, v, window)
    if k.shape[0] != q.shape[0]:
        raise ValueError("attention_varlen: q and k must have the same number of tokens")
    args = (q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, float(scale), window)
    be = resolve_backend(q, backend)
    return AttentionVarlenFn.apply(*args, be) if _tracked(q, k, v) else kernel_impl(be, "attention_varlen")(*args)


@torch.no_grad()
def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    split_counters: torch.Tensor | None = None,
    prefix: SharedPrefix | None = None,
    window: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of new queries (prefill chunks or decode) over a paged KV cache. Inference only.

    ``q [Tq, Hq, D]``; ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``; ``block_tables [B, max_blocks]`` int32;
    ``cu_seqlens_q [B+1]`` int32; ``seqlens_k [B]`` int32 (keys per sequence, new ones included). The queries of
    sequence ``b`` are its last ``nq_b`` positions. Each row equals :func:`attention_varlen` on the full sequence.
    ``max_seqlen_q``: optional host-side bound of every ``nq_b`` (``1`` for a decode step); it must hold (the CPU
    backend checks it; the GPU kernel cannot without a host sync) and lets the GPU launch one program per sequence.
    ``split_counters``: optional int32 zeros on the GPU from which a split-parallel launch takes its per-tile tickets
    and which it leaves zeroed, so one buffer serves every layer of a forward; too small or None, the launch
    allocates zeroed counters itself. It never changes a result; the CPU backend ignores it. ``prefix``: key tiles
    that groups of this decode step's sequences share (:class:`rlexact.ops.shared_prefix.SharedPrefix`), which the
    Gluon decode launch reads once per group; it never changes a result either, and other launches ignore it.
    ``window``: the sliding window, as in :func:`attention_varlen`.
    """
    _check_attn(q, k_cache, v_cache, window)
    if max_seqlen_q is not None and max_seqlen_q < 1:
        raise ValueError(f"attention_paged: max_seqlen_q must be >= 1, got {max_seqlen_q}")
    if split_counters is not None and (split_counters.dtype != torch.int32 or not split_counters.is_contiguous()):
        raise ValueError(
            f"attention_paged: split_counters must be a contiguous int32 tensor of zeros, got {split_counters.dtype}"
        )
    return kernel_impl(resolve_backend(q, backend), "attention_paged")(
        q.contiguous(), k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, float(scale), max_seqlen_q,
        split_counters, prefix, window,
    )  # fmt: skip


def decode_split_keys(head_dim: int, dtype: torch.dtype) -> int | None:
    """Keys per KV split of the GPU attention kernels at ``(head_dim, dtype)``, or None without Triton. A paged decode
    launch whose block table spans at most this many keys runs one split per sequence: on sm_90 the Gluon decode
    kernel, which reads shared prefixes (:class:`SharedPrefix`) once per group."""
    if not triton_available():
        return None
    from .triton_attention import split_keys

    return split_keys(head_dim, dtype)


@torch.no_grad()
def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write ``k, v [T, Hkv, D]`` into slots ``slot_mapping [T]`` (``block * block_size + offset``) of the caches
    ``[num_blocks, block_size, Hkv, D]``, converted to the cache dtype with ``Tensor.to``.

    Both backends store the bits of ``cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k.to(cache.dtype))``. The
    Triton kernel writes K and V in one launch from strided inputs without a host synchronization (CUDA-graph
    capturable) and does not check the slots; the torch twin raises on an out-of-range slot."""
    kernel_impl(resolve_backend(k, backend), "write_kv")(k, v, k_cache, v_cache, slot_mapping)
