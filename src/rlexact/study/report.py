"""The study's outputs: the result JSON (one entry per experiment, with provenance), markdown tables and PNG plots.

The JSON is merged: running one experiment replaces its entry and keeps the others, and the top-level provenance
(:func:`rlexact.envinfo.result_header`: command, commit, date, device, versions) is that of the latest run; each
entry keeps its own command, commit and date. Plots need matplotlib (the optional ``study`` extra,
``pip install 'rlexact[study]'``); without it :func:`write_plots` returns an empty list and says why.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from rlexact.envinfo import result_header

__all__ = [
    "device_tag",
    "entry_header",
    "experiment_markdown",
    "fill_page",
    "markdown_tables",
    "study_command",
    "write_json",
    "write_plots",
    "write_tables",
]

BENCHMARK = "rlexact mismatch study"

_TRAINING_COLUMNS = (
    "reward_first5",
    "reward_last10",
    "eval_before",
    "eval_after",
    "k3_mean",
    "bitwise_equal_frac",
    "grad_norm_mean",
)

_TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "reinforce": (*_TRAINING_COLUMNS, "grad_norm_max"),
    "grpo": (*_TRAINING_COLUMNS, "clipfrac_mean"),
    "c_ratio": ("c_ppo_train_pos", "c_ppo_rollout_pos", "c_ppo_train_neg", "c_ppo_rollout_neg", "k3_mean"),
    "misalignment": (
        "misaligned_frac",
        "misaligned_frac_trainer",
        "sign_disagreement_frac",
        "k3_mean",
        "bitwise_equal_frac",
    ),
    "corrections": (
        "reward_last10",
        "eval_after",
        "k3_mean",
        "tis/truncated_frac",
        "rejection/rejected_seq_frac",
        "grad_norm_mean",
    ),
    "shadow": ("reward_last10", "eval_after"),
}
"""Metric columns of each experiment's arm table."""

_SHADOW_COLUMNS = ("cosine", "cosine_later", "norm_ratio", "masked_frac", "tis_truncated_frac", "ppo_clipped_frac")


def device_tag(device: str) -> str:
    """Short name of the device for file names: ``"cpu"``, or the GPU model (``"NVIDIA H200"`` -> ``"h200"``)."""
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else device
    name = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def study_command() -> str:
    """The command line of this process, written as ``python -m rlexact.study ...`` when run that way."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).as_posix().endswith("rlexact/study/__main__.py"):
        return " ".join(["python", "-m", "rlexact.study", *argv[1:]])
    return " ".join([Path(sys.executable).name, *argv])


def _header() -> dict[str, Any]:
    return {**result_header(BENCHMARK, "lightning", "transformers"), "command": study_command()}


def entry_header() -> dict[str, Any]:
    """Provenance of one experiment entry: command, commit, date, device, versions."""
    h = _header()
    return {k: h[k] for k in ("command", "commit", "date", "device", "cpu_count", "versions")}


def write_json(path: str | Path, entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Merge ``entries`` (``{experiment: entry}``) into the result JSON at ``path`` and write it (atomically: a new
    file renamed over the old one); returns the whole document."""
    path = Path(path)
    doc: dict[str, Any] = {}
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    experiments = dict(doc.get("experiments") or {})
    experiments.update(entries)
    doc = {**_header(), "experiments": experiments}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_finite(doc), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file
    return doc


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: replace them by None (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_tables(doc: dict[str, Any]) -> str:
    """One markdown section per experiment of the result document (:func:`experiment_markdown`)."""
    return "\n".join(
        f"### {name}: {entry['title']}\n\n" + experiment_markdown(name, entry)
        for name, entry in doc.get("experiments", {}).items()
    )


def experiment_markdown(name: str, entry: dict[str, Any]) -> str:
    """The command and the arm table (means over seeds) of one experiment, and for the corrections and shadow
    experiments their rankings."""
    cols = _TABLE_COLUMNS.get(name, ())
    run = f"{entry['steps']} steps, seeds {entry['seeds']}, commit {entry['commit']}"
    parts = [f"`{entry['command']}` ({run})\n"]
    missing = entry.get("missing_runs") or []
    if missing:
        runs = ", ".join(f"{m['label']} (seed {m['seed']})" for m in missing)
        parts.append(f"**Incomplete:** {len(missing)} run(s) did not finish: {runs}.\n")
    rows = [[e["label"], *(e["metrics"].get(c) for c in cols)] for e in entry["arms"]]
    parts.append(_table(["arm", *cols], rows) + "\n")
    if name == "corrections" and entry.get("findings"):
        parts.append(_corrections_table(entry["findings"]))
    if name == "shadow":
        for arm in entry["arms"]:
            parts += [_shadow_table(prefix, stats) for prefix, stats in (arm.get("shadow") or {}).items()]
    return "\n".join(parts)


def fill_page(doc: dict[str, Any], page: str | Path) -> list[str]:
    """Replace, in the markdown file ``page``, the text between ``<!-- study:NAME -->`` and ``<!-- /study:NAME -->``
    with :func:`experiment_markdown` of experiment ``NAME`` (so a hand-written report carries the measured tables);
    returns the names filled. Markers of experiments missing from ``doc`` are left as they are."""
    path = Path(page)
    text = path.read_text(encoding="utf-8")
    filled = []
    for name, entry in doc.get("experiments", {}).items():
        pattern = re.compile(rf"(<!-- study:{re.escape(name)} -->\n).*?(<!-- /study:{re.escape(name)} -->)", re.DOTALL)
        if pattern.search(text):
            body = experiment_markdown(name, entry)
            text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
            filled.append(name)
    path.write_text(text, encoding="utf-8")
    return filled


def _corrections_table(findings: dict[str, Any]) -> str:
    keys = ["reward_curve_mean_abs_diff", "reward_last10_minus_exact", "eval_after_minus_exact"]
    ranked = findings.get("ranking_by_reward_curve_distance", [])
    rows = [[i + 1, r["label"], *(r[k] for k in keys)] for i, r in enumerate(ranked)]
    title = f"Ranked by distance to the exact reward curve ({findings.get('reference')}):\n"
    return title + _table(["rank", "arm", *keys], rows) + "\n"


def _shadow_table(prefix: str, stats: dict[str, Any]) -> str:
    names = sorted(
        sorted({k.split("/")[0] for k in stats if "/" in k}), key=lambda n: -(stats.get(f"{n}/cosine") or -math.inf)
    )
    rows = [[n, *(stats.get(f"{n}/{c}") for c in _SHADOW_COLUMNS)] for n in names]
    title = (
        f"Shadow source `{prefix}` ({_fmt(stats.get('probes'))} probes; mismatch K3 "
        f"{_fmt(stats.get('mismatch_k3_mean'))}, mean |delta logp| {_fmt(stats.get('mismatch_abs_diff_mean'))}):\n"
    )
    return title + _table(["correction", *_SHADOW_COLUMNS], rows) + "\n"


def write_tables(doc: dict[str, Any], folder: str | Path) -> Path:
    """Write :func:`markdown_tables` to ``<folder>/tables.md``; returns the path."""
    path = Path(folder) / "tables.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("<!-- written by python -m rlexact.study report; do not edit -->\n\n" + markdown_tables(doc))
    return path


_SMOOTHED = {"reward/mean": 5, "grad_norm": 5}
"""Curves drawn as a trailing moving average over this many steps (the raw values are in the JSON)."""


def write_plots(doc: dict[str, Any], folder: str | Path, log=print) -> list[Path]:
    """One PNG per experiment in ``folder``: curves per step with one line per arm (``reward/mean`` and
    ``grad_norm`` as 5-step trailing means); ``c_ratio``: mean ``C(r)`` per arm, trainer vs rollout ratio, for
    ``A > 0`` and ``A < 0``; ``shadow``: cosine to the exact gradient per probe and correction. The files are
    256-colour palette PNGs. Returns the paths; without matplotlib, none (and says so through ``log``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install 'rlexact[study]'): no plots written")
        return []
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, entry in doc.get("experiments", {}).items():
        if name == "shadow":
            panels = [
                (_plot_shadow, p, c) for arm in entry["arms"] for p, c in (arm.get("shadow_curves") or {}).items()
            ]
        elif name == "c_ratio":
            panels = [(_plot_c_bars, sign, entry) for sign in ("pos", "neg")]
        else:
            keys = list(entry["arms"][0]["curves"]) if entry["arms"] else []
            panels = [(_plot_curves, key, entry) for key in keys]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
        for ax, (draw, key, data) in zip(axes[0], panels):
            draw(ax, key, data)
            ax.tick_params(labelsize=8)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.suptitle(entry["title"], fontsize=10)
        fig.tight_layout()
        path = folder / f"{name}.png"
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=110)
        plt.close(fig)
        _save_palette_png(buffer, path)
        paths.append(path)
    return paths


def _save_palette_png(buffer: io.BytesIO, path: Path) -> None:
    """Re-encode matplotlib's RGBA PNG as a 256-colour palette PNG (line plots use few colours; the files shrink to
    about a third). Pillow is a dependency of matplotlib, so it is present whenever plots are drawn."""
    from PIL import Image

    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(path, "PNG", optimize=True)


def _trailing_mean(ys: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(ys)):
        window = [y for y in ys[max(0, i - k + 1) : i + 1] if not math.isnan(y)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def _plot_curves(ax, key: str, entry: dict[str, Any]) -> None:
    k = _SMOOTHED.get(key, 1)
    for arm in entry["arms"]:
        ys = _trailing_mean([math.nan if y is None else y for y in arm["curves"][key]], k)
        ax.plot(range(len(ys)), ys, label=arm["label"], linewidth=1.2)
    ax.set_title(key + (f" ({k}-step mean)" if k > 1 else ""), fontsize=9)
    ax.set_xlabel("rollout step")


def _plot_c_bars(ax, sign: str, entry: dict[str, Any]) -> None:
    labels = [arm["label"] for arm in entry["arms"]]
    x = range(len(labels))
    for offset, side in ((-0.2, "train"), (0.2, "rollout")):
        ys = [arm["metrics"].get(f"c_ppo_{side}_{sign}") for arm in entry["arms"]]
        ax.bar([i + offset for i in x], [math.nan if y is None else y for y in ys], width=0.4, label=f"C(r_ppo^{side})")
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
    ax.set_title(f"mean C(r) over tokens with A {'>' if sign == 'pos' else '<'} 0", fontsize=9)


def _plot_shadow(ax, prefix: str, curve: dict[str, list[float | None]]) -> None:
    for series, ys in curve.items():
        if series != "x" and any(y is not None for y in ys):
            ax.plot(curve["x"], [math.nan if y is None else y for y in ys], marker=".", label=series.split("/")[0])
    ax.set_title(f"{prefix}: cosine to the exact gradient", fontsize=9)
    ax.set_xlabel("rollout step (+ mini-step)")
