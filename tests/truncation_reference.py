"""float64 reference of the top-k -> top-p thresholds (explicit sort, softmax, exclusive cumsum), shared by the
interpreter and GPU checks of :mod:`rlexact.ops.triton_truncation`."""

from __future__ import annotations

import torch


def float64_thresholds(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``[B, 1]`` fp32: per row, the smallest kept value under top-k (the k-th largest, ties kept) then top-p (the
    shortest prefix of the sorted top-k values whose renormalized mass reaches ``top_p``), in float64."""
    out = []
    for row in z.double().cpu():
        vals = torch.sort(row, descending=True).values
        cand = vals[: top_k if 0 < top_k < row.numel() else row.numel()]
        if top_p < 1.0:
            p = torch.softmax(cand, -1)
            cand = cand[: max(1, int(((torch.cumsum(p, 0) - p) < top_p).sum()))]
        out.append(cand[-1].item())
    return torch.tensor(out, dtype=torch.float32, device=z.device)[:, None]


def within_rounding(z: torch.Tensor, thr: torch.Tensor, top_k: int, top_p: float, tol: float) -> torch.Tensor:
    """``[B]`` bool: ``thr`` is a kept set's threshold in float64 up to ``tol`` of mass: a candidate value whose first
    sorted position has mass before it below ``top_p + tol``, while the next lower value's has at least
    ``top_p - tol`` (a boundary that fp32 sums in another order may place one token either way)."""
    ok = []
    for row, t in zip(z.double().cpu(), thr.double().cpu().flatten()):
        vals = torch.sort(row, descending=True).values
        cand = vals[: top_k if 0 < top_k < row.numel() else row.numel()]
        p = torch.softmax(cand, -1)
        before = torch.cumsum(p, 0) - p
        first = int((cand > t).sum())
        nxt = int((cand >= t).sum())
        lower_dropped = nxt == cand.numel() or bool(before[nxt] >= top_p - tol)
        ok.append(first < nxt and bool(before[first] < top_p + tol) and lower_dropped)
    return torch.tensor(ok)
