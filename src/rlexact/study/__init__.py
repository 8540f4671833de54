"""The mismatch study: the paper's figures in miniature, and shadow-mode calibration of TIM corrections.

``python -m rlexact.study EXPERIMENT --config configs/study/cpu.yaml`` (``docs/study.md`` has every command and
the measured numbers). The parts:

- :mod:`rlexact.study.config`: :class:`Scale` (shared by every run), :class:`Arm` (one training run),
  :class:`StudyConfig` and the YAML loader;
- :mod:`rlexact.study.engine`: a controlled engine-level mismatch, :class:`PerturbedRolloutModule` (the rollout
  samples from a lower-precision or noisy copy of the weights);
- :mod:`rlexact.study.runner`: one Lightning fit per arm and seed, with the probes, cached per arm;
- :mod:`rlexact.study.experiments`: ``reinforce``, ``grpo``, ``c_ratio``, ``misalignment``, ``corrections``,
  ``shadow``;
- :mod:`rlexact.study.report`: the result JSON, markdown tables and PNG plots (matplotlib optional).
"""

from rlexact.study.config import Arm, Scale, StudyConfig, load_config
from rlexact.study.engine import PerturbedCopy, PerturbedRolloutModule
from rlexact.study.experiments import EXPERIMENTS, Experiment

__all__ = [
    "EXPERIMENTS",
    "Arm",
    "Experiment",
    "PerturbedCopy",
    "PerturbedRolloutModule",
    "Scale",
    "StudyConfig",
    "load_config",
]
