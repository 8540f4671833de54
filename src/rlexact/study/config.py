"""Settings of the mismatch study: the scale shared by every run, one :class:`Arm` per training run, and the YAML
files of ``configs/study/``.

A YAML file has three sections (every key optional; the defaults are the CPU demo scale)::

    scale:          # Scale fields: model checkpoint, steps, batch, optimizer, evaluation, device, workers
      steps: 60
    experiments:    # per-experiment knobs (see rlexact.study.experiments.EXPERIMENTS for each one's keys)
      reinforce: {engines: [bf16, fp8_e4m3, "noise:0.1"]}
    output:         # where runs, the result JSON and the report go
      out: runs/study
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rlexact.callbacks.functional import PRESETS
from rlexact.resources import config_path
from rlexact.study.engine import WEIGHT_PERTURBATIONS

__all__ = ["Arm", "Scale", "StudyConfig", "load_config", "parse_engine", "parse_shadow_source", "study_config_file"]

CORRECTIONS: tuple[str, ...] = ("tis", *PRESETS)
"""Corrections an arm may train with: token TIS (``tau = 2``) or a paper preset."""


@dataclass(frozen=True)
class Scale:
    """What every run of a study shares.

    Attributes:
        checkpoint: start checkpoint: ``"demo"`` (the packaged one) or a folder written by ``python -m
            rlexact.demo.sft`` (its ``sft.json`` defines the task of the prompts).
        steps: rollout steps per run (experiments may use a prefix).
        prompts_per_step: prompts per rollout step.
        n: samples per prompt.
        lr: AdamW learning rate; ``warmup_steps``: linear warmup (optimizer steps).
        clip: PPO clip epsilon (GRPO arms).
        mini_batches: PPO mini-batches per rollout step (GRPO arms; REINFORCE makes one step per rollout).
        max_new_tokens: response budget.
        eval_prompts, eval_n: held-out evaluation before and after training (sampled at temperature 1 by the
            arm's rollout engine); ``eval_prompts = 0`` skips it.
        seeds: one run per seed for every arm (sampler, data order, noise).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        threads: torch intra-op threads per run (0 = the CPUs divided among the workers).
        workers: runs in parallel (spawned processes; on CUDA they share the visible GPUs round-robin, several per
            GPU: a run of a small model is launch-bound and leaves most of a GPU idle).
    """

    checkpoint: str = "demo"
    steps: int = 60
    prompts_per_step: int = 16
    n: int = 8
    lr: float = 3e-4
    warmup_steps: int = 5
    clip: float = 0.2
    mini_batches: int = 2
    max_new_tokens: int = 6
    eval_prompts: int = 100
    eval_n: int = 4
    seeds: tuple[int, ...] = (0,)
    device: str = "auto"
    threads: int = 1
    workers: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "n", "mini_batches", "max_new_tokens", "eval_n", "workers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"scale.{name} must be >= 1, got {getattr(self, name)}")
        if self.n < 2:
            raise ValueError(f"scale.n must be >= 2 (GRPO groups), got {self.n}")
        if self.eval_prompts < 0 or self.threads < 0 or self.warmup_steps < 0:
            raise ValueError("scale.eval_prompts, scale.threads and scale.warmup_steps must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"scale.lr must be > 0, got {self.lr}")
        if (self.prompts_per_step * self.n) % self.mini_batches:
            raise ValueError(
                f"scale.mini_batches={self.mini_batches} must divide prompts_per_step x n = "
                f"{self.prompts_per_step * self.n}"
            )
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"scale.device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if not self.seeds:
            raise ValueError("scale.seeds must list at least one seed")
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))


def parse_engine(spec: str | None) -> tuple[str | None, float]:
    """``"fp8_e4m3"`` -> ``("fp8_e4m3", 0.0)``, ``"noise:0.1"`` -> ``("noise", 0.1)``, ``None`` -> ``(None, 0.0)``."""
    if spec is None:
        return None, 0.0
    kind, _, value = str(spec).partition(":")
    if kind not in WEIGHT_PERTURBATIONS:
        raise ValueError(f"unknown engine perturbation {spec!r}; expected one of {WEIGHT_PERTURBATIONS}")
    if kind == "noise":
        try:
            scale = float(value)
        except ValueError:
            raise ValueError(f"engine {spec!r}: write the noise scale as 'noise:<std>', e.g. 'noise:0.1'") from None
        if not scale > 0:
            raise ValueError(f"engine {spec!r}: the noise scale must be > 0")
        return kind, scale
    if value:
        raise ValueError(f"engine {spec!r}: only 'noise' takes a scale")
    return kind, 0.0


def parse_shadow_source(source: str) -> tuple[str, str | None, float]:
    """``"inject:0.1"`` -> ``("inject", None, 0.1)``, ``"engine:noise:0.05"`` -> ``("engine", "noise", 0.05)``,
    ``"engine:fp8_e4m3"`` -> ``("engine", "fp8_e4m3", 0.0)``, ``"native"`` -> ``("native", None, 0.0)``."""
    kind, _, rest = str(source).partition(":")
    if kind == "native" and not rest:
        return "native", None, 0.0
    if kind == "inject":
        try:
            scale = float(rest)
        except ValueError:
            raise ValueError(f"shadow source {source!r}: write 'inject:<logit noise std>', e.g. 'inject:0.1'") from None
        if not scale >= 0:
            raise ValueError(f"shadow source {source!r}: the noise scale must be >= 0")
        return "inject", None, scale
    if kind == "engine":
        engine, scale = parse_engine(rest)
        return "engine", engine, scale
    raise ValueError(f"unknown shadow source {source!r}; expected 'inject:<std>', 'engine:<perturbation>' or 'native'")


@dataclass(frozen=True)
class Arm:
    """One training run of the study (the scale comes from :class:`Scale`).

    Attributes:
        label: short name in plots and tables (not part of :meth:`key`).
        objective: ``"grpo"`` or ``"reinforce"``.
        kernels: rollout kernels, ``"exact"`` or ``"native"`` (stock kernels: the real TIM baseline).
        dtype: model dtype, ``"float32"`` or ``"bfloat16"``.
        mode: pi_old: ``"exact"``, ``"recompute"`` or ``"bypass"``.
        engine: perturbed rollout weights (:func:`parse_engine`), e.g. ``"fp8_e4m3"``; None = the policy's weights.
        correction: ``"tis"`` or a paper preset trained with; None = no correction.
        shadow: mismatch sources of :class:`rlexact.callbacks.ShadowCorrection` instances to attach (exact arms
            only; training is unchanged): ``"inject:<scale>"`` (logit noise), ``"engine:<perturbation>"`` (a
            :class:`~rlexact.study.engine.PerturbedCopy`, e.g. ``"engine:fp8_e4m3"``) or ``"native"``.
        shadow_every: probe one rollout step in this many (every PPO mini-step of a probed rollout step).
        shadow_thresholds: extra shadow corrections: ``tis-srs-k3-corr-ratio`` with each of these ``tau_seq``
            (named ``tis-srs-k3-corr-ratio@<tau>``), to calibrate the threshold.
        seed: seed of the run.
    """

    label: str
    objective: str = "grpo"
    kernels: str = "exact"
    dtype: str = "float32"
    mode: str = "exact"
    engine: str | None = None
    correction: str | None = None
    shadow: tuple[str, ...] = ()
    shadow_every: int = 4
    shadow_thresholds: tuple[float, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "objective": ("grpo", "reinforce"),
            "kernels": ("exact", "native"),
            "dtype": ("float32", "bfloat16"),
            "mode": ("exact", "recompute", "bypass"),
        }
        for name, allowed in checks.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"arm {self.label!r}: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        parse_engine(self.engine)
        exact_engine = self.kernels == "exact" and self.engine is None
        if self.mode == "exact" and not exact_engine:
            raise ValueError(f"arm {self.label!r}: mode 'exact' needs exact kernels and no engine perturbation")
        if self.correction is not None and self.correction not in CORRECTIONS:
            raise ValueError(f"arm {self.label!r}: correction must be one of {CORRECTIONS}, got {self.correction!r}")
        object.__setattr__(self, "shadow", tuple(self.shadow))
        if self.shadow and not exact_engine:
            raise ValueError(f"arm {self.label!r}: shadow mode calibrates against an exact run (exact engine)")
        for source in self.shadow:
            parse_shadow_source(source)
        object.__setattr__(self, "shadow_thresholds", tuple(float(t) for t in self.shadow_thresholds))
        if any(not (0.0 <= t < float("inf")) for t in self.shadow_thresholds):
            raise ValueError(f"arm {self.label!r}: shadow_thresholds must be finite and >= 0")
        if self.shadow_every < 1:
            raise ValueError(f"arm {self.label!r}: shadow_every must be >= 1, got {self.shadow_every}")

    @property
    def exact(self) -> bool:
        """True when the rollout log-probs are the trainer's bit for bit."""
        return self.kernels == "exact" and self.engine is None

    def key(self) -> str:
        """A short hash of everything that changes the run except the label (and the number of steps): arms of
        different experiments with the same key are one run."""
        data = {k: v for k, v in asdict(self).items() if k != "label"}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]

    def with_seed(self, seed: int) -> Arm:
        return replace(self, seed=int(seed))


@dataclass
class StudyConfig:
    """A whole study: the scale, the experiments' knobs and the output paths.

    Attributes:
        scale: :class:`Scale`.
        experiments: ``{experiment name: {knob: value}}`` overriding each experiment's defaults.
        out: folder of the runs (TensorBoard logs and per-run histories, reused across experiments).
        json: the result file; None = ``benchmarks/results/study_<device tag>.json`` under the current directory.
        docs: folder of the report's plots and tables.
    """

    scale: Scale = field(default_factory=Scale)
    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)
    out: str = "runs/study"
    json: str | None = None
    docs: str = "docs/study"

    def knobs(self, experiment: str, defaults: dict[str, Any]) -> dict[str, Any]:
        """``defaults`` updated with this config's knobs of ``experiment`` (unknown knobs are an error)."""
        given = dict(self.experiments.get(experiment) or {})
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ValueError(f"experiments.{experiment}: unknown keys {unknown}; valid keys: {sorted(defaults)}")
        return {**defaults, **given}


def study_config_file(path: str | Path) -> str:
    """The file of a study config: ``path`` where it exists, else the packaged config of that name (``smoke.yaml``,
    ``study/smoke``, ``configs/study/smoke.yaml``: ``rlexact/configs/study``), from any directory."""
    name = os.fspath(path)
    if os.path.exists(name):
        return name
    found = config_path(f"study/{os.path.basename(name)}")
    if found is None:
        packaged = sorted(f.name for f in importlib.resources.files("rlexact").joinpath("configs", "study").iterdir())
        raise FileNotFoundError(f"study config {name!r} not found (looked from {os.getcwd()}); packaged: {packaged}")
    return found


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Read a study YAML (None = the defaults; a packaged config by its name, :func:`study_config_file`) and apply
    ``overrides`` to its ``scale`` section."""
    data: dict[str, Any] = {}
    if path is not None:
        import yaml

        path = study_config_file(path)
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a study config is a mapping with 'scale', 'experiments' and 'output'")
    unknown = sorted(set(data) - {"scale", "experiments", "output"})
    if unknown:
        raise ValueError(f"{path}: unknown sections {unknown}; valid: scale, experiments, output")
    scale_data = {**(data.get("scale") or {}), **(overrides or {})}
    valid = {f.name for f in fields(Scale)}
    bad = sorted(set(scale_data) - valid)
    if bad:
        raise ValueError(f"scale: unknown keys {bad}; valid keys: {sorted(valid)}")
    if "seeds" in scale_data:
        scale_data["seeds"] = tuple(scale_data["seeds"])
    output = data.get("output") or {}
    bad = sorted(set(output) - {"out", "json", "docs"})
    if bad:
        raise ValueError(f"output: unknown keys {bad}; valid keys: out, json, docs")
    return StudyConfig(scale=Scale(**scale_data), experiments=dict(data.get("experiments") or {}), **output)
