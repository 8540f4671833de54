"""The study's experiments: the paper's figures in miniature, plus shadow-mode calibration.

Each :class:`Experiment` lists its arms (from its knobs, overridable in ``experiments.<name>`` of a study YAML) and
turns the arms' runs into one JSON entry: per-arm metrics (means over seeds, with each seed's value), per-step curves
and ``findings`` that compare each arm with its exact reference. Arms with equal settings are one run shared by
every experiment that lists them (e.g. the exact GRPO arm serves ``grpo``, ``c_ratio``, ``misalignment``,
``corrections`` and ``shadow``).

Mismatch sources in the arms: ``native`` (the stock kernels in bf16, the real TIM baseline; its exact reference is
the exact engine in bf16) and ``engine`` (a rollout engine on perturbed weights, :mod:`rlexact.study.engine`, with
an fp32 trainer; its reference is the exact engine in fp32).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rlexact.callbacks.functional import PRESETS
from rlexact.study.config import Arm, StudyConfig
from rlexact.study.runner import truncate_result

__all__ = ["EXPERIMENTS", "Experiment", "arm_metrics", "experiment_arms", "summarize"]


@dataclass(frozen=True)
class Experiment:
    """One experiment: its arms, what it reports and the paper's claim it is compared with.

    Attributes:
        name: CLI name.
        title: one line.
        paper: the paper's setup and claim (for the comparison in the report).
        defaults: knobs (``steps: None`` = the scale's steps).
        arms: ``(config, knobs) -> [Arm]`` (seed 0; the runner repeats them per seed).
        curves: history keys plotted per step.
        findings: ``(arms' entries, knobs) -> dict`` of comparisons.
    """

    name: str
    title: str
    paper: str
    defaults: dict[str, Any]
    arms: Callable[[StudyConfig, dict[str, Any]], list[Arm]]
    curves: tuple[str, ...]
    findings: Callable[[list[dict[str, Any]], dict[str, Any]], dict[str, Any]]


# ----------------------------------------------------------------------------------------------------- statistics
def _values(history: list[dict[str, float]], key: str) -> list[float]:
    return [row[key] for row in history if key in row and not math.isnan(row[key])]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(history: list[dict[str, float]], num: str, den: str) -> float | None:
    n, d = sum(_values(history, num)), sum(_values(history, den))
    return n / d if d else None


def arm_metrics(result: dict[str, Any]) -> dict[str, float | None]:
    """Scalar summaries of one run (None where the run did not log the quantity)."""
    h = result["history"]
    rewards = _values(h, "reward/mean")
    grad = _values(h, "grad_norm")
    tokens = _values(h, "mismatch/num_tokens")
    equal = _values(h, "mismatch/bitwise_equal_frac")
    out: dict[str, float | None] = {
        "reward_first5": _mean(rewards[:5]),
        "reward_last10": _mean(rewards[-10:]),
        "reward_mean": _mean(rewards),
        "eval_before": (result.get("eval_before") or {}).get("reward"),
        "eval_after": (result.get("eval_after") or {}).get("reward"),
        "k3_mean": _mean(_values(h, "mismatch/k3_mean")),
        "abs_diff_max": max(_values(h, "mismatch/abs_diff_max"), default=None),
        "bitwise_equal_frac": (
            sum(e * t for e, t in zip(equal, tokens)) / sum(tokens) if tokens and len(equal) == len(tokens) else None
        ),
        "grad_norm_mean": _mean(grad),
        "grad_norm_max": max(grad, default=None),
        "clipfrac_mean": _mean(_values(h, "clipfrac")),
        "misaligned_frac": _ratio(h, "direction/engine_misaligned_count", "direction/num_tokens"),
        "misaligned_frac_trainer": _ratio(h, "direction/trainer_misaligned_count", "direction/num_tokens"),
        "sign_disagreement_frac": _ratio(h, "direction/sign_disagreement_count", "direction/num_tokens"),
        "train_seconds": result.get("train_seconds"),
    }
    for side in ("train", "rollout"):
        for sign in ("pos", "neg"):
            out[f"c_ppo_{side}_{sign}"] = _mean(_values(h, f"mismatch/c_ppo_{side}_{sign}"))
    for key in ("tis/mean", "tis/truncated_frac", "rejection/rejected_seq_frac", "rejection/rejected_token_frac"):
        values = _values(h, key)
        if values:
            out[key] = _mean(values)
    return out


def _shadow_metrics(result: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{source prefix: {"<correction>/<metric>": mean over probes}}`` of a shadow run, plus
    ``"<correction>/cosine_later"``: the mean cosine over probes after the first PPO mini-step of a rollout step
    (where ``pi_theta != pi_old``, so ``r_ppo``-based rejection differs from ``r_corr``-based)."""
    out: dict[str, dict[str, float | None]] = {}
    for prefix, rows in (result.get("shadow") or {}).items():
        keys = sorted({k for row in rows for k in row if k.startswith(prefix + "/")})
        out[prefix] = {k[len(prefix) + 1 :]: _mean(_values(rows, k)) for k in keys}
        later = [row for row in rows if row.get("epoch", 0) > 0 or row.get("ministep", 0) > 0]
        for k in keys:
            if k.endswith("/cosine") and k.count("/") == 2:
                out[prefix][k[len(prefix) + 1 :] + "_later"] = _mean(_values(later, k))
        out[prefix]["probes"] = len(rows)
    return out


def _shadow_curve(rows: list[dict[str, float]], prefix: str) -> dict[str, list[float | None]]:
    """Cosine per probe and correction (first seed), with ``x`` = rollout step + mini-step fraction."""
    per_step = 1 + max((int(row.get("ministep", 0)) for row in rows), default=0)
    curve: dict[str, list[float | None]] = {
        "x": [row["rollout_step"] + row.get("ministep", 0) / per_step for row in rows]
    }
    for n in _correction_names(rows, prefix):
        curve[f"{n}/cosine"] = [row.get(f"{prefix}/{n}/cosine") for row in rows]
    return curve


def _correction_names(rows: list[dict[str, float]], prefix: str) -> list[str]:
    """Correction names probed by a shadow source, in first-seen order."""
    names: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith(prefix + "/") and key.endswith("/cosine") and key.count("/") == 2:
                names[key.split("/")[1]] = None
    return list(names)


def _mean_over_seeds(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _curve(results: list[dict[str, Any]], key: str) -> list[float | None]:
    """Per-step mean over seeds of ``key`` (None where no seed logged it)."""
    steps = min(len(r["history"]) for r in results)
    out = []
    for i in range(steps):
        vals = [r["history"][i].get(key) for r in results]
        out.append(_mean_over_seeds([v for v in vals if v is not None and not math.isnan(v)]))
    return out


# ---------------------------------------------------------------------------------------------------------- arms
def _grpo_arms(cfg: StudyConfig, knobs: dict[str, Any]) -> list[Arm]:
    arms = [_exact_fp32_grpo(cfg)]
    for engine in knobs["engines"]:
        arms += [
            Arm(f"{engine} recompute", kernels="exact", mode="recompute", engine=engine),
            Arm(f"{engine} bypass", kernels="exact", mode="bypass", engine=engine),
        ]
    if knobs["native"]:
        arms += [
            Arm("exact bf16", dtype="bfloat16"),
            Arm("native bf16 recompute", kernels="native", dtype="bfloat16", mode="recompute"),
            Arm("native bf16 bypass", kernels="native", dtype="bfloat16", mode="bypass"),
        ]
    return arms


def _exact_fp32_grpo(cfg: StudyConfig) -> Arm:
    """The exact fp32 GRPO arm, carrying the shadow probes of the ``shadow`` experiment's knobs."""
    knobs = cfg.knobs("shadow", _SHADOW_DEFAULTS)
    return Arm(
        "exact fp32",
        shadow=tuple(knobs["sources"]),
        shadow_every=int(knobs["every"]),
        shadow_thresholds=tuple(knobs["thresholds"]),
    )


def _reinforce_arms(cfg: StudyConfig, knobs: dict[str, Any]) -> list[Arm]:
    arms = [Arm("exact fp32", objective="reinforce")]
    arms += [Arm(f"engine {e}", objective="reinforce", mode="recompute", engine=e) for e in knobs["engines"]]
    if knobs["native"]:
        arms += [
            Arm("exact bf16", objective="reinforce", dtype="bfloat16"),
            Arm("native bf16", objective="reinforce", kernels="native", dtype="bfloat16", mode="recompute"),
        ]
    return arms


def _correction_arms(cfg: StudyConfig, knobs: dict[str, Any]) -> list[Arm]:
    engine = knobs["engine"]
    arms = [_exact_fp32_grpo(cfg), Arm("no correction", mode="recompute", engine=engine)]
    arms += [Arm(name, mode="recompute", engine=engine, correction=name) for name in knobs["corrections"]]
    return arms


def _shadow_arms(cfg: StudyConfig, knobs: dict[str, Any]) -> list[Arm]:
    return [_exact_fp32_grpo(cfg)]


# ------------------------------------------------------------------------------------------------------ findings
def _reference(entry: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The exact arm with the same objective and dtype as ``entry`` (None for exact arms)."""
    arm = entry["arm"]
    if arm["kernels"] == "exact" and arm["engine"] is None:
        return None
    for other in entries:
        o = other["arm"]
        exact = o["kernels"] == "exact" and o["engine"] is None
        if exact and o["objective"] == arm["objective"] and o["dtype"] == arm["dtype"]:
            return other
    return None


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _vs_exact(entries: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for entry in entries:
        ref = _reference(entry, entries)
        if ref is None:
            continue
        out[entry["label"]] = {
            "reference": ref["label"],
            **{f"{k}_minus_exact": _delta(entry["metrics"].get(k), ref["metrics"].get(k)) for k in keys},
        }
    return out


def _curve_distance(entry: dict[str, Any], ref: dict[str, Any], key: str = "reward/mean") -> float | None:
    a, b = entry["curves"].get(key) or [], ref["curves"].get(key) or []
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(abs(x - y) for x, y in pairs) / len(pairs) if pairs else None


def _training_findings(entries: list[dict[str, Any]], knobs: dict[str, Any]) -> dict[str, Any]:
    return {
        "vs_exact": _vs_exact(
            entries, ("reward_last10", "reward_mean", "eval_after", "grad_norm_mean", "grad_norm_max", "k3_mean")
        )
    }


def _c_ratio_findings(entries: list[dict[str, Any]], knobs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for entry in entries:
        m = entry["metrics"]
        out[entry["label"]] = {
            f"train_minus_rollout_{sign}": _delta(m.get(f"c_ppo_train_{sign}"), m.get(f"c_ppo_rollout_{sign}"))
            for sign in ("pos", "neg")
        }
    return {"c_train_minus_c_rollout": out}


def _misalignment_findings(entries: list[dict[str, Any]], knobs: dict[str, Any]) -> dict[str, Any]:
    keys = ("misaligned_frac", "misaligned_frac_trainer", "sign_disagreement_frac")
    return {
        **{key: {e["label"]: e["metrics"][key] for e in entries} for key in keys},
        "paper": {"non-exact (vLLM)": 0.173, "exact (VeXact)": 0.0},
    }


def _correction_findings(entries: list[dict[str, Any]], knobs: dict[str, Any]) -> dict[str, Any]:
    ref = next(e for e in entries if e["arm"]["engine"] is None)
    rows = []
    for entry in entries:
        if entry is ref:
            continue
        rows.append(
            {
                "label": entry["label"],
                "reward_curve_mean_abs_diff": _curve_distance(entry, ref),
                "reward_last10_minus_exact": _delta(entry["metrics"]["reward_last10"], ref["metrics"]["reward_last10"]),
                "eval_after_minus_exact": _delta(entry["metrics"]["eval_after"], ref["metrics"]["eval_after"]),
            }
        )
    rows.sort(key=lambda r: math.inf if r["reward_curve_mean_abs_diff"] is None else r["reward_curve_mean_abs_diff"])
    return {"ranking_by_reward_curve_distance": rows, "reference": ref["label"]}


def _shadow_findings(entries: list[dict[str, Any]], knobs: dict[str, Any]) -> dict[str, Any]:
    shadow = entries[0].get("shadow") or {}
    ranking = {}
    for prefix, stats in shadow.items():
        names = [k[: -len("/cosine")] for k in stats if k.endswith("/cosine")]
        ranking[prefix] = sorted(
            (
                {
                    "correction": n,
                    "cosine": stats[f"{n}/cosine"],
                    "cosine_later": stats.get(f"{n}/cosine_later"),
                    "norm_ratio": stats[f"{n}/norm_ratio"],
                    "masked_frac": stats.get(f"{n}/masked_frac"),
                    "tis_truncated_frac": stats.get(f"{n}/tis_truncated_frac"),
                }
                for n in names
            ),
            key=lambda r: -(r["cosine"] if r["cosine"] is not None else -math.inf),
        )
    return {"ranking_by_cosine": ranking}


_SHADOW_DEFAULTS: dict[str, Any] = {
    "sources": ["inject:0.1", "engine:fp8_e4m3", "native"],
    "every": 4,
    "thresholds": [0.01, 0.1],
    "steps": None,
}
_GRPO_DEFAULTS: dict[str, Any] = {"engines": ["fp8_e4m3"], "native": True, "steps": None}
_TRAINING_CURVES = ("reward/mean", "mismatch/k3_mean", "mismatch/bitwise_equal_frac", "grad_norm")

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            name="reinforce",
            title="REINFORCE: exact vs native bf16 vs engine-level TIM at three strengths (paper Fig. 2)",
            paper=(
                "REINFORCE with batch-whitened advantages, Qwen3-1.7B and Qwen3-30B-A3B, vLLM vs the exact engine: "
                "the non-exact run degrades (MoE: train reward 0.574 -> 0.255, validation 0.293 -> 0.067 after "
                "step 280) with loss and gradient-norm anomalies; the exact run keeps improving (0.753 / 0.534)."
            ),
            defaults={"engines": ["bf16", "fp8_e4m3", "noise:0.1"], "native": True, "steps": None},
            arms=_reinforce_arms,
            curves=_TRAINING_CURVES,
            findings=_training_findings,
        ),
        Experiment(
            name="grpo",
            title="GRPO: exact vs recompute vs bypass on a non-exact engine (paper Fig. 3)",
            paper=(
                "GRPO, Qwen3-1.7B: exact keeps train reward ~0.93; vLLM recompute degrades 0.87 -> 0.40 in 650 steps "
                "and collapses near step 1665; vLLM bypass degrades once to ~0.4 without a loss spike."
            ),
            defaults=dict(_GRPO_DEFAULTS),
            arms=_grpo_arms,
            curves=(*_TRAINING_CURVES, "clipfrac"),
            findings=_training_findings,
        ),
        Experiment(
            name="c_ratio",
            title="Surrogate contribution C(r) = -(r - 1) A by advantage sign, trainer vs rollout ratio (paper Fig. 5)",
            paper=(
                "Exact: C(r_ppo^train) and C(r_ppo^rollout) coincide. vLLM recompute: the rollout-referenced "
                "contribution stays near zero while the trainer-referenced one separates by advantage sign, with a "
                "larger positive shift for A < 0 tokens, even while KL estimators look normal."
            ),
            defaults=dict(_GRPO_DEFAULTS),
            arms=_grpo_arms,
            curves=(
                "mismatch/c_ppo_train_pos",
                "mismatch/c_ppo_train_neg",
                "mismatch/c_ppo_rollout_pos",
                "mismatch/c_ppo_rollout_neg",
            ),
            findings=_c_ratio_findings,
        ),
        Experiment(
            name="misalignment",
            title="Update direction: share of tokens whose rollout log-prob moves against their advantage",
            paper=(
                "First 10 GRPO steps of Qwen3-1.7B on GSM8K: 17.3% of token log-prob changes (re-scored by the "
                "rollout engine after the update) are misaligned with the advantage sign with vLLM, 0% exact."
            ),
            defaults={**_GRPO_DEFAULTS, "steps": 10},
            arms=_grpo_arms,
            curves=(
                "direction/engine_misaligned_frac",
                "direction/trainer_misaligned_frac",
                "direction/sign_disagreement_frac",
            ),
            findings=_misalignment_findings,
        ),
        Experiment(
            name="corrections",
            title="Corrections ranked against the exact run under one engine-level TIM (paper Fig. 6)",
            paper=(
                "GRPO with vLLM: r_corr-based sequence rejection beats r_ppo-based; token TIS + sequence rejection "
                "(tis-srs-k3/k1-corr-ratio) tracks the exact reference most closely; K1 vs K3 matters little."
            ),
            defaults={"engine": "fp8_e4m3", "corrections": ["tis", *PRESETS], "steps": None},
            arms=_correction_arms,
            curves=("reward/mean", "mismatch/k3_mean", "grad_norm"),
            findings=_correction_findings,
        ),
        Experiment(
            name="shadow",
            title="Shadow mode: each correction's gradient under a mismatch vs the exact gradient, same batch",
            paper=(
                "Not in the paper (its Sec. 4.2 calls for calibrating correction thresholds against an exact "
                "reference); this is that calibration, per mini-step on the run's own data."
            ),
            defaults=dict(_SHADOW_DEFAULTS),
            arms=_shadow_arms,
            curves=("reward/mean",),
            findings=_shadow_findings,
        ),
    )
}
"""Every experiment by CLI name."""


def experiment_arms(cfg: StudyConfig, name: str) -> tuple[list[Arm], int, dict[str, Any]]:
    """``(arms for every seed, steps, knobs)`` of experiment ``name`` under ``cfg``."""
    exp = _get(name)
    knobs = cfg.knobs(name, exp.defaults)
    steps = int(knobs["steps"]) if knobs.get("steps") is not None else cfg.scale.steps
    if steps < 1:
        raise ValueError(f"experiments.{name}.steps must be >= 1, got {steps}")
    base = exp.arms(cfg, knobs)
    labels = [a.label for a in base]
    if len(set(labels)) != len(labels):
        raise ValueError(f"experiment {name}: duplicate arm labels {labels}")
    return [arm.with_seed(seed) for arm in base for seed in cfg.scale.seeds], steps, knobs


def summarize(
    cfg: StudyConfig, name: str, results: dict[tuple[str, int], dict[str, Any]], header: dict[str, Any]
) -> dict[str, Any]:
    """The JSON entry of experiment ``name`` from the runs in ``results`` (keyed by ``(arm key, seed)``).

    Runs missing from ``results`` (a study cut short, or a run that failed) are listed in ``missing_runs`` and
    ``complete`` is False; the arms that have runs are summarized over the seeds they have (each arm lists its
    ``seeds``), and the ``findings`` are computed only when every arm has at least one run (else None)."""
    exp = _get(name)
    arms, steps, knobs = experiment_arms(cfg, name)
    by_label: dict[str, list[tuple[Arm, dict[str, Any]]]] = {}
    missing: list[dict[str, Any]] = []
    for arm in arms:
        found = results.get((arm.key(), arm.seed))
        if found is None:
            missing.append({"label": arm.label, "seed": arm.seed})
            continue
        by_label.setdefault(arm.label, []).append((arm, truncate_result(found, steps)))
    entries = []
    for label, runs in by_label.items():
        per_seed = [arm_metrics(res) for _, res in runs]
        keys = per_seed[0].keys()
        arm = runs[0][0]
        entry = {
            "label": label,
            "arm": {k: v for k, v in asdict(arm).items() if k not in ("label", "seed")},
            "seeds": [a.seed for a, _ in runs],
            "metrics": {k: _mean_over_seeds([m[k] for m in per_seed]) for k in keys},
            "per_seed": per_seed,
            "curves": {key: _curve([res for _, res in runs], key) for key in exp.curves},
            "tensorboard": [res.get("tensorboard") for _, res in runs],
        }
        shadows = [_shadow_metrics(res) for _, res in runs if res.get("shadow")]
        if shadows and name == "shadow":
            entry["shadow"] = {
                prefix: {k: _mean_over_seeds([s[prefix].get(k) for s in shadows]) for k in shadows[0][prefix]}
                for prefix in shadows[0]
            }
            entry["shadow_curves"] = {
                prefix: _shadow_curve(runs[0][1]["shadow"][prefix], prefix) for prefix in shadows[0]
            }
        entries.append(entry)
    return {
        "experiment": name,
        "title": exp.title,
        "paper": exp.paper,
        **header,
        "steps": steps,
        "seeds": list(cfg.scale.seeds),
        "knobs": knobs,
        "scale": asdict(cfg.scale),
        "complete": not missing,
        "missing_runs": missing,
        "arms": entries,
        "findings": exp.findings(entries, knobs) if len(by_label) == len({a.label for a in arms}) else None,
    }


def _get(name: str) -> Experiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ValueError(f"unknown experiment {name!r}; expected one of {sorted(EXPERIMENTS)} or 'all'") from None
