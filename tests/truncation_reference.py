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
