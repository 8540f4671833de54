"""The attention function and mask function exactify registers with transformers as ``"rlexact"``.

With :class:`~rlexact.models.metadata.AttnMetadata` (the generator and the trainer) attention runs the exact kernels
over the packed stream or the paged cache (or the native baseline's SDPA). Without it (a plain transformers call:
``model(ids)``, ``model.generate``) :func:`transformers_attention` honours a transformers ``DynamicCache`` and left
padding with the same kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from rlexact import ops
from rlexact.models.metadata import AttnMetadata
from rlexact.models.native_attention import native_paged, native_varlen
from rlexact.models.state import ExactState, get_state
from rlexact.ops.reference import hidden_keys

ATTN_IMPL = "rlexact"


HF_CACHE_BLOCK = 16
"""Block size of the paged view that :func:`transformers_attention` builds over a transformers KV cache."""


def check_attention_settings(dropout: float) -> None:
    """Raise ``ValueError`` for attention settings the exact kernels do not implement (never ignore them silently):
    attention dropout in train mode."""
    if dropout > 0:
        raise ValueError(
            f"attention_dropout={dropout} in train mode: rlexact's attention kernels do not implement dropout. "
            "Set model.config.attention_dropout = 0.0 and every attention layer's attention_dropout = 0.0 (or call "
            "model.eval())."
        )


def _cache_update(m: nn.Module, cache: object, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``k, v [B, T, Hkv, D]`` to a transformers ``DynamicCache``; return all keys/values ``[B, L, Hkv, D]`` at
    their cache indices, with zeros for those a sliding-window layer dropped (they lie before every new query's
    window, and the kernels' key tiles stay anchored at absolute positions)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"rlexact's exact attention supports transformers' DynamicCache, got {type(cache).__name__}; use "
            "model.generate(...) with the default cache (no cache_implementation) or rlexact.rollout.Generator"
        )
    k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2), m.layer_idx)
    layer = cache.layers[m.layer_idx]
    dropped = 0
    if type(layer) is DynamicSlidingWindowLayer:  # returns the last keys only once the cache outgrows the window
        dropped = layer.cumulative_length - k_all.shape[-2]
    elif type(layer) is not DynamicLayer:
        raise ValueError(
            f"rlexact's exact attention supports full and sliding-window DynamicCache layers, got "
            f"{type(layer).__name__} in layer {m.layer_idx}; use the default DynamicCache (no quantized or offloaded "
            "layers)"
        )
    k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)
    if dropped:  # zeros in their place: every query of this call is past the window of the dropped keys
        k_all, v_all = (torch.cat([x.new_zeros((x.shape[0], dropped, *x.shape[2:])), x], 1) for x in (k_all, v_all))
    return k_all, v_all


def _key_starts(
    mask: torch.Tensor | None, b: int, t: int, length: int, window: int | None, position_ids: object
) -> torch.Tensor:
    """First valid key ``s_b`` ``[B]`` of every row from a 4-D transformers mask (``None``: no padding).

    The exact kernels implement causal attention (within a sliding ``window``) over keys ``[s_b, L)`` whose
    positions restart at 0: a left-padded causal mask. Any other mask (right padding, holes, a custom pattern)
    raises ``ValueError``. Under a window the last query's row need not reach back to ``s_b``, so ``s_b`` comes from
    its position (``position_ids``) and the mask is checked against it.
    """
    if mask is None:
        return torch.zeros(b, dtype=torch.long)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != length or mask.shape[-2] != t:
        raise ValueError(f"unsupported attention mask {type(mask).__name__} for rlexact's exact attention")
    valid = (mask if mask.dtype == torch.bool else mask == 0)[:, 0].expand(b, t, length).cpu()
    if window is None:
        starts = length - valid[:, -1].sum(-1)
    elif isinstance(position_ids, torch.Tensor):
        starts = (length - 1) - position_ids.reshape(-1, t).expand(b, t)[:, -1].cpu().long()
    else:
        raise ValueError(
            "a sliding-window layer got an attention mask without position_ids; call the model with attention_mask "
            "and let transformers derive position_ids (as model.generate does)"
        )
    kidx = torch.arange(length)
    c = length - t + torch.arange(t)  # cache index of each query
    # padding shifts a row's queries and keys alike, so causality and the window hold in cache indices
    expected = (kidx[None, None] >= starts[:, None, None]) & ~hidden_keys(kidx, c, window)[None]
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
            "position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0) with the mask (model.generate derives them "
            "this way; a plain forward call counts from 0 at the padding)"
        )


def _paged_rows(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    nq: list[int],
    scale: float,
    window: int | None,
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
    return ops.attention_paged(
        q, paged(keys), paged(values), table.to(dev), cu.to(dev), lens.to(dev), scale, window=window
    )


def transformers_attention(
    m: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cache: object | None,
    position_ids: object,
    window: int | None,
) -> torch.Tensor:
    """Exact attention for a plain transformers call: ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]`` -> ``[B, T, Hq, D]``
    (``window``: the layer's sliding window).

    With a ``DynamicCache`` the new keys are appended first and the queries (the last ``T`` keys) attend over the
    whole cache. Left padding is removed per row, so row ``b`` is the unpadded sequence ``[s_b, L)``: without past
    keys that is :func:`rlexact.ops.attention_varlen` (the training path, differentiable); with past keys it is
    :func:`rlexact.ops.attention_paged` (the generator's decode, inference only), bitwise equal per row. Outputs of
    padding queries are zero.
    """
    b, t, hq, d = q.shape
    k_all, v_all = (k, v) if cache is None else _cache_update(m, cache, k, v)
    length = k_all.shape[1]
    if window is not None and isinstance(mask, torch.Tensor) and 0 < mask.shape[-1] < length:
        # transformers' sliding-window mask spans the last keys only (those its cache layer keeps, or fewer): the
        # others lie before every query's window
        hidden = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        mask = torch.cat([mask.new_full((*mask.shape[:-1], length - mask.shape[-1]), hidden), mask], -1)
    starts = _key_starts(mask, b, t, length, window, position_ids)
    _check_positions(position_ids, starts, b, t, length)
    st = starts.tolist()
    nq = [min(t, length - s) for s in st]
    q_rows = torch.cat([q[i, t - n :] for i, n in enumerate(nq)])
    keys = [k_all[i, s:] for i, s in enumerate(st)]
    values = [v_all[i, s:] for i, s in enumerate(st)]
    scale = float(m.scaling)
    if all(n == length - s for n, s in zip(nq, st)):
        cu = torch.tensor([0, *nq], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        rows = ops.attention_varlen(q_rows, torch.cat(keys), torch.cat(values), cu, scale, window=window)
    else:
        if torch.is_grad_enabled() and (q.requires_grad or k_all.requires_grad):
            raise RuntimeError(
                "attention over past keys of a transformers KV cache is inference-only in rlexact (no gradient): run "
                "it under torch.no_grad(), or pass use_cache=False / no cache to get a differentiable forward"
            )
        rows = _paged_rows(q_rows, keys, values, nq, scale, window)
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
    ``kv_written``: a paged step's new K/V rows are already in the cache (:func:`rlexact.ops.qk_norm_rope_write_kv`).
    ``sliding_window`` (a keyword transformers' attention layers pass): the layer's window, which every path
    applies."""
    state: ExactState | None = get_state(module)
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
    check_attention_settings(dropout)
    window: int | None = kwargs.get("sliding_window")  # type: ignore[assignment]
    if query.shape[0] != 1:
        raise ValueError(f"packed forward expects batch dimension 1, got {query.shape[0]}")
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1)  # [T, Hkv, D]; a row-strided view under fused projections (write_kv takes it)
    exact = state is None or state.exact
    if rlexact_meta.paged is None:
        v = v.contiguous()
        if exact:
            out = ops.attention_varlen(q, k, v, rlexact_meta.cu_seqlens, scale, window=window)
        else:
            out = native_varlen(q, k, v, rlexact_meta.cu_seqlens.tolist(), scale, window)
    else:
        paged = rlexact_meta.paged
        kc, vc = paged.caches[module.layer_idx]
        if not kv_written:
            ops.write_kv(k, v, kc, vc, paged.slot_mapping)
        if exact and paged.fresh:
            out = ops.attention_varlen(q, k, v, rlexact_meta.cu_seqlens, scale, window=window)
        elif exact:
            out = ops.attention_paged(
                q, kc, vc, paged.block_tables, rlexact_meta.cu_seqlens, paged.seqlens_k, scale,
                max_seqlen_q=paged.max_seqlen_q, split_counters=paged.split_counters, prefix=paged.prefix,
                window=window,
            )  # fmt: skip
        else:
            out = native_paged(q, rlexact_meta, kc, vc, scale, window)
    return out[None], None


def _rlexact_mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    """Mask function for ``"rlexact"``: no mask for unpadded inputs of full-attention layers (causality is in the
    kernels), else SDPA's (sliding-window layers: ``local_size``; the native mode's stock attention needs it)."""
    from transformers.masking_utils import sdpa_mask

    mask = kwargs.get("attention_mask")
    unpadded = mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and bool(mask.all()))
    if unpadded and kwargs.get("local_size") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    """Register the ``"rlexact"`` attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPL, rlexact_attention)
    AttentionMaskInterface.register(ATTN_IMPL, _rlexact_mask)
