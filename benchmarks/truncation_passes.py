"""How many passes the top-p threshold search needs, and how much of the row each one still has to look at (host only).

    python3 benchmarks/truncation_passes.py [--out benchmarks/results/truncation_passes_cpu.json]

A float64 model of the search in :mod:`rlexact.ops.triton_truncation` (order-preserving int32 keys, 16 probes per
pass, a sorted last step at 2,048 entries) on rows of 151,936 Gaussian logits, flat (σ 1) and peaked (σ 4), at
top-p 0.95 / 0.9 / 0.7. For each case it records the entries left in the key interval after each probe pass (the
population the next pass would need to look at) for two probe placements: the library's, evenly spaced in key space
from the first pass on, and one whose first pass spaces its probes evenly in value space between the row's finite
minimum and maximum. ``row_reads`` counts the full-row reads of each (the extent pass, the probe passes, the copy);
``entries_read_if_compacted`` the entries read if every pass after the first read only the previous interval's
entries. A model of the pass counts, not of the kernel's fp32 sums (which can pick a neighbouring sub-interval where
the mass is within rounding of the target); its thresholds are checked against the float64 sort-based reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import ROOT, header
from rlexact.ops import reference

V = 151936
P = 16
CAP = 2048
SCALES = {"flat": 1.0, "peaked": 4.0}
TOP_PS = (0.95, 0.9, 0.7)
ROWS = 4


def keys(z: torch.Tensor) -> torch.Tensor:
    """Order-preserving int32 keys of fp32 ``z`` (as int64)."""
    b = z.float().view(torch.int32).long()
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def key_probes(lo: int, hi: int) -> list[int]:
    """The library's probes: ``lo + (hi - lo) * j // P``."""
    return [lo + ((hi - lo) * j) // P for j in range(P)]


def value_probes(z: torch.Tensor, lo: int, hi: int) -> list[int]:
    """Probes evenly spaced in value space between the finite minimum and the maximum (the first one ``lo``)."""
    fin = z[torch.isfinite(z)]
    mn, mx = float(fin.min()), float(fin.max())
    vals = torch.tensor([mn + (mx - mn) * j / P for j in range(P)], dtype=torch.float32)
    return [lo] + [min(max(int(k), lo), hi) for k in keys(vals)[1:]]


def search(z: torch.Tensor, top_p: float, value_first: bool) -> dict:
    """The narrowing passes of one row: the interval's entries after each pass, and the threshold."""
    k = keys(z)
    w = torch.exp(z.double() - z.max().double())
    lo, hi = int(k.min()) - 1, int(k.max())
    target = top_p * float(w.sum())
    base, left, tau = 0.0, [], None
    while tau is None:
        probes = value_probes(z, lo, hi) if value_first and not left else key_probes(lo, hi)
        inside = (k > lo) & (k <= hi)
        mass = [base + float(w[inside & (k > p)].sum()) for p in probes]
        count = [int((inside & (k > p)).sum()) for p in probes]
        js = max((j for j in range(P) if mass[j] >= target), default=-1)
        if js < 0:  # every in-interval entry is kept
            tau = int(k[inside].min())
            break
        last = js == P - 1
        lo, hi = probes[js], hi if last else probes[js + 1]
        base = base if last else mass[js + 1]
        left.append(count[js] - (0 if last else count[js + 1]))
        if hi - lo <= 1:
            tau = hi
        elif left[-1] <= CAP:
            inside = (k > lo) & (k <= hi)
            vals = torch.sort(z.double()[inside], descending=True).values
            ww = torch.exp(vals - z.max().double())
            before = base + torch.cumsum(ww, 0) - ww
            keep = max(int((before < target).sum()), 1)
            tau = int(keys(vals[keep - 1 : keep].float())[0])
    entries = 2 * V + sum(left)  # the extent pass, the first probe pass, then each interval's entries
    return {
        "entries_left": left,
        "probe_passes": len(left),
        "row_reads": 1 + len(left) + 1,
        "entries_read_if_compacted": entries,
        "threshold": tau,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "truncation_passes_cpu.json"))
    args = ap.parse_args()
    cases: dict = {}
    for name, scale in SCALES.items():
        for top_p in TOP_PS:
            g = torch.Generator().manual_seed(0)
            z = torch.randn(ROWS, V, generator=g) * scale
            ref = keys(reference.truncation_thresholds(z, 0, top_p).flatten())
            case: dict = {}
            for placement, value_first in (("key", False), ("value_first", True)):
                rows = [search(z[r], top_p, value_first) for r in range(ROWS)]
                case[placement] = {
                    "rows": rows,
                    "thresholds_equal_float64": all(row["threshold"] == int(t) for row, t in zip(rows, ref)),
                    "mean_row_reads": sum(r["row_reads"] for r in rows) / ROWS,
                    "mean_entries_read_if_compacted_over_v": sum(r["entries_read_if_compacted"] for r in rows)
                    / ROWS
                    / V,
                }
            cases[f"{name} top_p={top_p:g}"] = case
            print(f"[truncation_passes] {name} top_p={top_p:g}: " + ", ".join(
                f"{p}: {c['mean_row_reads']:.2f} row reads, {c['mean_entries_read_if_compacted_over_v']:.2f} V "
                f"compacted, float64 {c['thresholds_equal_float64']}" for p, c in case.items()
            ), flush=True)  # fmt: skip
    result = header("truncation_passes", "torch") | {"vocab": V, "probes": P, "cap": CAP, "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
