"""The stock-kernel attention of the native baseline (``kernels="native"``): PyTorch SDPA over the packed stream
or over keys gathered from the paged cache. Not exact; the mismatch it shows is what rlexact removes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlexact.models.metadata import AttnMetadata
from rlexact.ops.reference import hidden_keys


def native_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal SDPA (within a sliding ``window``) per packed sequence ``[cu[i], cu[i + 1])`` of ``q [T, Hq, D]`` over
    its own keys (not exact)."""
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            pos = torch.arange(e - s, device=q.device)
            mask = None if window is None else ~hidden_keys(pos, pos, window)
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None],
                k[s:e].transpose(0, 1)[None],
                v[s:e].transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[s:e] = o[0].transpose(0, 1)
    return out


def native_paged(
    q: torch.Tensor, meta: AttnMetadata, kc: torch.Tensor, vc: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Stock-kernel attention over the paged cache (within a sliding ``window``): gather keys to contiguous memory,
    then SDPA (not exact).

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
        valid = ~hidden_keys(torch.arange(nblk * bs, device=dev), lens_k.long() - 1, window)  # the query: lens_k - 1
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
        mask = ~hidden_keys(kpos, qpos, window) & (kpos[None, None] < lk_t[:, None, None])
        mask = mask | (kpos == 0)[None, None]  # padded query rows attend key 0 (discarded) instead of nothing
        kk, vv = gather(paged.block_tables[idx], nblk)
        qf = qp.reshape(n, qmax, hkv, grp, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, grp * qmax, d)
        mf = mask[:, None, None].expand(n, 1, grp, qmax, nblk * bs).reshape(n, 1, grp * qmax, nblk * bs)
        o = F.scaled_dot_product_attention(qf, kk, vv, attn_mask=mf, scale=scale)
        o = o.reshape(n, hkv, grp, qmax, d).permute(0, 3, 1, 2, 4).reshape(n, qmax, hq, d)
        out[src] = o[valid_q]
    return out
