"""Batch-invariant torch twins of the Mixture-of-Experts kernels (CPU backend).

Same construction as :mod:`rlexact.ops.cpu`: every torch call whose kernel choice could depend on the number of rows
runs on **fixed-shape row blocks** of :data:`rlexact.ops.cpu.ROW_BLOCK` rows, zero-padded, so a row's result depends
only on that row (and the weights).

* :func:`moe_router`: fp32 softmax of each block of router logits, then a *stable* descending sort, so equal
  probabilities keep ascending expert order and top-k ties go to the lowest expert index; the optional top-k
  renormalization sums the k selected probabilities left to right (exactly rounded adds, no reduction kernel).
* :func:`grouped_matmul`: a per-expert loop; the rows of expert ``e`` (a contiguous range of the expert-sorted rows)
  are multiplied by ``w[e]`` in fixed ``ROW_BLOCK``-row blocks with fp32 accumulation, exactly as the dense twin.
"""

from __future__ import annotations

import torch

from .cpu import ROW_BLOCK, linear_blocks, padded_blocks


def moe_router(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in logits.dtype, expert ids [T, k] int64)`` from router logits ``[T, E]``; see module doc."""
    lp, t = padded_blocks(logits)
    weights = torch.empty((lp.shape[0], top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((lp.shape[0], top_k), dtype=torch.int64, device=logits.device)
    for s in range(0, lp.shape[0], ROW_BLOCK):
        probs = torch.softmax(lp[s : s + ROW_BLOCK].float(), dim=-1)
        vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
        top = vals[:, :top_k]
        if norm_topk_prob:
            total = top[:, 0]
            for j in range(1, top_k):
                total = total + top[:, j]
            top = top / total[:, None]
        weights[s : s + ROW_BLOCK] = top
        ids[s : s + ROW_BLOCK] = idx[:, :top_k]
    return weights[:t].to(logits.dtype), ids[:t]


def grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    counts: list[int],
    gather: torch.Tensor | None,
    scatter: torch.Tensor | None,
) -> torch.Tensor:
    """Expert-grouped ``a @ w[e].T`` with fp32 accumulation, output in ``a.dtype``.

    The ``S = sum(counts)`` expert-sorted rows are grouped by expert: rows ``[start_e, start_e + counts[e])`` belong to
    expert ``e``. Sorted row ``r`` reads ``a[gather[r]]`` (``a[r]`` when ``gather`` is None) and is written to output
    row ``scatter[r]`` (``r`` when None). ``a [Ma, K]``, ``w [E, N, K]`` -> ``[S, N]``.
    """
    n = w.shape[1]
    s_total = sum(counts)
    out = torch.empty((s_total, n), dtype=torch.float32, device=a.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = a[gather[start : start + c]] if gather is not None else a[start : start + c]
        rp, _ = padded_blocks(rows)
        res = linear_blocks(rp, w[e].float())
        if scatter is not None:
            out[scatter[start : start + c]] = res[:c]
        else:
            out[start : start + c] = res[:c]
        start += c
    return out.to(a.dtype)


def sigmoid_gate(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """``(routed32 + sigmoid(gate32) * shared32).to(routed.dtype)`` on fixed row blocks (differentiable).

    ``routed, shared [T, H]``, ``gate_logit [T, 1]``. CPU ``sigmoid`` is vectorized with a scalar tail whose ``exp``
    differs from the SIMD one, so the rows go through fixed ``[ROW_BLOCK, ...]`` shapes.
    """
    r, t = padded_blocks(routed)
    sh, _ = padded_blocks(shared)
    g, _ = padded_blocks(gate_logit)
    blocks = [
        r[s : s + ROW_BLOCK].float() + torch.sigmoid(g[s : s + ROW_BLOCK].float()) * sh[s : s + ROW_BLOCK].float()
        for s in range(0, r.shape[0], ROW_BLOCK)
    ]
    return torch.cat(blocks)[:t].to(routed.dtype)
