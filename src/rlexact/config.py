"""Validated configuration of :class:`rlexact.RLModule`: rollout, algorithm, optimizer, FSDP2 and reward settings.

Frozen dataclasses, validated in ``__post_init__`` (a bad value raises ``ValueError`` naming the field), with attribute
docstrings that jsonargparse / LightningCLI turn into ``--help`` text. In YAML they are nested under the module::

    model:
      class_path: rlexact.RLModule
      init_args:
        model_path: /ckpt/Qwen3-1.7B
        rollout: {n: 8, max_new_tokens: 8192, temperature: 1.0}
        algorithm: {objective: dapo, clip_low: 0.2, clip_high: 0.28, loss_agg_mode: seq-mean-token-sum-norm}
        optim: {lr: 1.0e-6, betas: [0.9, 0.95]}
        reward_config: {workers: 16, timeout_s: 10.0}   # RewardConfig (defined in rlexact.rewards.executor)

Units. ``RolloutConfig.n`` is samples per prompt; a data batch of ``P`` prompts yields ``P * n`` sequences on each
rank. ``AlgorithmConfig.mini_batch_size`` and ``micro_batch_size`` count **sequences on one rank** (not prompts, not
tokens): the paper's "mini-batch 16 prompts x 8 samples" is ``mini_batch_size: 128``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlexact.checks import choice, finite, integer, positive_int, sampling_args, token_ids
from rlexact.models.state import KERNELS, Kernels
from rlexact.models.truncation import LOGPROB_MODES, LogprobMode
from rlexact.rewards.executor import RewardConfig
from rlexact.rollout.config import GeneratorConfig

__all__ = [
    "DTYPES",
    "ESTIMATORS",
    "KERNELS",
    "LOSS_AGG_MODES",
    "OBJECTIVES",
    "OLD_LOGPROB_MODES",
    "AlgorithmConfig",
    "FSDPConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
]

Objective = Literal["grpo", "ppo", "dapo", "gspo", "reinforce"]
Estimator = Literal["grpo", "rloo", "reinforce"]
OldLogprobMode = Literal["exact", "recompute", "bypass"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k3"]

OBJECTIVES: tuple[str, ...] = ("grpo", "ppo", "dapo", "gspo", "reinforce")
ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce")
OLD_LOGPROB_MODES: tuple[str, ...] = ("exact", "recompute", "bypass")
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names accepted by ``RLModule(dtype=...)`` and :class:`FSDPConfig`."""


def _check_generator_kwargs(kwargs: dict[str, Any]) -> None:
    known = {f.name for f in fields(GeneratorConfig)} - {"kernels"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown rollout.generator keys {unknown}; GeneratorConfig fields: {sorted(known)}")


@dataclass(frozen=True)
class RolloutConfig:
    """How the module samples completions (passed to :class:`rlexact.rollout.Generator` and ``SamplingParams``)."""

    n: int = 8
    """Samples per prompt (the GRPO group size). GRPO/RLOO need ``n >= 2``."""
    max_new_tokens: int = 1024
    """Maximum response length in tokens; also the normalizer of ``seq-mean-token-sum-norm``."""
    temperature: float = 1.0
    """Sampling temperature (> 0, at least :data:`rlexact.checks.MIN_TEMPERATURE`). The trainer computes log-probs at
    the same temperature."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables it. Which distribution the log-probs describe is ``logprobs``."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling; 0 disables it."""
    logprobs: LogprobMode = "full"
    """``"full"``: rollout and trainer log-probs are of the full temperature-scaled softmax (top-k/top-p only restrict
    the draw, so with truncation pi_old is not the distribution sampled from). ``"sampled"``: both are of the
    truncated, renormalized distribution actually sampled (bitwise equal in exact mode); the trainer optimizes that
    policy. Warned about when ``"full"`` meets truncation in exact mode."""
    seed: int = 0
    """Base seed of the keyed sampler. A sample's key is (seed, dataset row ``index`` of the prompt item, sample j,
    epoch), so the same data samples the same tokens whatever the batch size, order or number of ranks, and a
    resumed run samples what the uninterrupted run would have sampled. Items without an ``index`` fall back to
    (seed, rollout step, rank, slot in the batch), with a warning."""
    kernels: Kernels = "exact"
    """Generator kernels: ``"exact"`` (bitwise equal to the trainer) or ``"native"`` (stock transformers / SDPA
    kernels: the non-exact training-inference-mismatch baseline)."""
    stop_token_ids: list[int] | None = None
    """Generation stops at any of these ids; None uses the model's / tokenizer's EOS ids."""
    max_context: int | None = None
    """Prompt + response must fit in this many tokens; None uses the model's ``max_position_embeddings`` (longer is
    an error). A prompt longer than ``max_context - max_new_tokens`` is an error naming the prompt."""
    skip_special_tokens: bool = True
    """Decode completions for the reward with ``skip_special_tokens``."""
    generator: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``Generator(model, kernels=..., **generator)`` (KV-cache size, block size, chunked
    prefill budget, ...), passed through unchanged."""

    def __post_init__(self) -> None:
        positive_int("rollout.n", self.n)
        positive_int("rollout.max_new_tokens", self.max_new_tokens)
        sampling_args("rollout.", self.temperature, self.top_p, self.top_k)
        integer("rollout.seed", self.seed, low=0)
        choice("rollout.kernels", self.kernels, KERNELS)
        choice("rollout.logprobs", self.logprobs, LOGPROB_MODES)
        if self.logprobs == "full" and self.kernels == "exact" and (self.top_p < 1.0 or self.top_k > 0):
            rank_zero_warn(
                f"rollout.top_p={self.top_p}, top_k={self.top_k} with rollout.logprobs='full': tokens are drawn from "
                "the truncated distribution but the rollout and trainer log-probs (pi_old) are of the full one, so "
                "the update is off-policy. Set rollout.logprobs='sampled' for exact log-probs of what was sampled."
            )
        positive_int("rollout.max_context", self.max_context, allow_none=True)
        if self.max_context is not None and self.max_context <= self.max_new_tokens:
            raise ValueError(
                f"rollout.max_context={self.max_context} leaves no room for a prompt with "
                f"max_new_tokens={self.max_new_tokens}"
            )
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", token_ids("rollout.stop_token_ids", self.stop_token_ids))
        if not isinstance(self.generator, dict):
            raise ValueError(f"rollout.generator must be a dict of Generator keyword arguments, got {self.generator!r}")
        if "kernels" in self.generator:
            raise ValueError("set the generator kernels with rollout.kernels, not rollout.generator.kernels")
        _check_generator_kwargs(self.generator)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL objective: advantages, policy loss, PPO epochs and mini-batches, pi_old mode, KL and entropy terms.

    Objectives (all critic-free, outcome rewards):

    - ``grpo`` / ``ppo`` / ``dapo``: the token-level clipped surrogate ``max(-A r, -A clip(r, 1-clip_low,
      1+clip_high))`` (identical code; ``dapo`` is the name for ``clip_high > clip_low``, usually with
      ``dynamic_sampling`` and ``token-mean``). ``dual_clip`` adds dual-clip PPO for ``A < 0``.
    - ``gspo``: the sequence-ratio clipped surrogate (GSPO; use small clips such as 3e-4 / 4e-4).
    - ``reinforce``: ``-A log pi``, exactly one optimizer step per rollout batch (``ppo_epochs=1``, no mini-batches),
      batch-whitened advantages (``estimator="reinforce"``).

    A rollout step can make no optimizer step: when RL callbacks mask or reject every token (each mini-step is then
    skipped, ``update/skipped_steps``) or dynamic sampling drops every group. ``Trainer(max_steps=...)`` counts
    optimizer steps, so a run in which that keeps happening would never end; ``max_rollout_steps_without_update``
    bounds how many such rollout steps may follow one another before the run stops with an error.
    """

    objective: Objective = "grpo"
    """Policy loss: ``grpo``, ``ppo``, ``dapo``, ``gspo`` or ``reinforce``."""
    estimator: Estimator | None = None
    """Advantage estimator: ``grpo`` (group mean/std), ``rloo`` (leave-one-out) or ``reinforce`` (batch whitening).
    None picks ``reinforce`` for the reinforce objective and ``grpo`` otherwise."""
    normalize_std: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    adv_eps: float = 1e-6
    """Epsilon added to the std in GRPO / REINFORCE whitening."""
    clip_low: float = 0.2
    """Lower clip epsilon: the ratio is clipped at ``1 - clip_low``."""
    clip_high: float = 0.2
    """Upper clip epsilon: the ratio is clipped at ``1 + clip_high`` (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant ``c > 1`` for ``A < 0`` tokens (verl ``clip_ratio_c``, 3.0); None disables it."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Loss aggregation: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean`` or
    ``seq-mean-token-sum-norm`` (per-sequence token sum divided by ``rollout.max_new_tokens``, then mean over
    sequences)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int | None = None
    """Sequences per optimizer step on one rank (a mini-batch; ``prompts x n``); None = the whole rollout batch
    (one step per epoch). Sequences are shuffled with a generator seeded by ``(shuffle_seed, rollout_step, epoch)``.
    A size that does not divide a rollout step's sequences (``data.batch_size x rollout.n``) makes a smaller last
    step; RLModule warns at fit start."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward inside a mini-batch (gradient accumulation to bound memory), at most
    ``mini_batch_size``; None = the whole mini-batch in one packed forward. The loss is normalized over the whole
    mini-batch, so the gradient does not depend on this setting."""
    shuffle: bool = True
    """Shuffle sequences before splitting into mini-batches."""
    shuffle_seed: int = 0
    """Seed of the mini-batch shuffle."""
    old_logprob_mode: OldLogprobMode = "exact"
    """Where pi_old comes from: ``exact`` (the rollout log-probs, bitwise equal to the trainer's, so no recompute
    forward; needs ``rollout.kernels="exact"``), ``recompute`` (a no-grad trainer forward at the rollout weights) or
    ``bypass`` (the rollout log-probs used as pi_old even when the generator is not exact)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to a frozen reference model (a copy of the initial policy); 0 disables it (and the
    reference model is never built)."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator: ``k1`` (log-ratio) or ``k3`` (Schulman's non-negative low-variance estimator)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 disables it."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop the groups whose rewards are all equal (they carry zero advantage). If every
    group is dropped the rollout step makes no optimizer step (with a warning)."""
    max_rollout_steps_without_update: int | None = 10
    """How many rollout steps in a row may make no optimizer step (every token masked or rejected by RL callbacks,
    or every group dropped by dynamic sampling); one more raises ``RuntimeError``. The count restarts at each rollout
    step that makes an optimizer step and is saved in checkpoints. None: no limit (the run can then loop without
    ever reaching ``Trainer(max_steps=...)``)."""

    def __post_init__(self) -> None:
        choice("algorithm.objective", self.objective, OBJECTIVES)
        if self.estimator is None:
            object.__setattr__(self, "estimator", "reinforce" if self.objective == "reinforce" else "grpo")
        choice("algorithm.estimator", self.estimator, ESTIMATORS)
        choice("algorithm.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        choice("algorithm.old_logprob_mode", self.old_logprob_mode, OLD_LOGPROB_MODES)
        choice("algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        finite("algorithm.adv_eps", self.adv_eps, low=0.0)
        finite("algorithm.clip_low", self.clip_low, low=0.0)
        if self.clip_low >= 1.0:
            raise ValueError(f"algorithm.clip_low must be in [0, 1), got {self.clip_low}")
        finite("algorithm.clip_high", self.clip_high, low=0.0)
        if self.dual_clip is not None:
            finite("algorithm.dual_clip", self.dual_clip)
            if self.dual_clip <= 1.0:
                raise ValueError(f"algorithm.dual_clip must be > 1 (or None), got {self.dual_clip}")
        positive_int("algorithm.ppo_epochs", self.ppo_epochs)
        positive_int("algorithm.mini_batch_size", self.mini_batch_size, allow_none=True)
        positive_int("algorithm.micro_batch_size", self.micro_batch_size, allow_none=True)
        if self.mini_batch_size is not None and (self.micro_batch_size or 0) > self.mini_batch_size:
            raise ValueError(
                f"algorithm.micro_batch_size ({self.micro_batch_size}) exceeds mini_batch_size "
                f"({self.mini_batch_size}): a micro-batch is a part of a mini-batch; set micro_batch_size <= "
                "mini_batch_size (or None for the whole mini-batch in one forward)"
            )
        positive_int(
            "algorithm.max_rollout_steps_without_update", self.max_rollout_steps_without_update, allow_none=True
        )
        finite("algorithm.kl_coef", self.kl_coef, low=0.0)
        finite("algorithm.entropy_coef", self.entropy_coef)
        if self.objective == "reinforce":
            if self.ppo_epochs != 1:
                raise ValueError(
                    f"algorithm.objective='reinforce' makes one update per rollout batch: ppo_epochs must be 1, "
                    f"got {self.ppo_epochs}"
                )
            if self.mini_batch_size is not None:
                raise ValueError(
                    "algorithm.objective='reinforce' makes one update per rollout batch: mini_batch_size must be "
                    f"None (the whole batch), got {self.mini_batch_size}"
                )
        if self.objective == "dapo" and self.clip_high < self.clip_low:
            raise ValueError(
                f"algorithm.objective='dapo' (clip-higher) needs clip_high >= clip_low, got clip_low={self.clip_low}, "
                f"clip_high={self.clip_high}"
            )

    @property
    def needs_groups(self) -> bool:
        """True when the estimator is group-relative (GRPO / RLOO need ``n >= 2`` samples per prompt)."""
        return self.estimator in ("grpo", "rloo")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and an optional linear warmup. Schedulers step once per optimizer step (not per rollout step)."""

    lr: float = 1e-6
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (the paper's GRPO recipe uses (0.9, 0.95))."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value (``self.clip_gradients``); None disables clipping (the norm is
    still logged)."""
    warmup_steps: int = 0
    """Linear warmup from ``lr / warmup_steps`` to ``lr`` over this many optimizer steps; 0 disables it."""

    def __post_init__(self) -> None:
        finite("optim.lr", self.lr, low=0.0, low_open=True)
        rule = f"optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.95]; got {self.betas!r}"
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2):
            raise ValueError(rule)
        for i, b in enumerate(self.betas):
            finite(f"optim.betas[{i}]", b, low=0.0)
            if b >= 1.0:
                raise ValueError(rule)
        betas = (float(self.betas[0]), float(self.betas[1]))
        object.__setattr__(self, "betas", betas)
        finite("optim.eps", self.eps, low=0.0, low_open=True)
        finite("optim.weight_decay", self.weight_decay, low=0.0)
        if self.grad_clip is not None:
            finite("optim.grad_clip", self.grad_clip, low=0.0, low_open=True)
        integer("optim.warmup_steps", self.warmup_steps, low=0)


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 settings used in ``configure_model`` under Lightning's ``ModelParallelStrategy``.

    Each decoder layer is ``fully_shard``-ed, then the root model. The generator and the trainer run the same sharded
    module; during the rollout (and other no-grad scoring) all parameters are gathered once and kept gathered, so
    every rank may run a different number of decode steps without mismatched collectives.
    """

    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Mixed precision: the dtype parameters are all-gathered in (the computation dtype; the sharded master weights
    and optimizer state stay in the loaded dtype). None = no mixed precision. Forward inputs are never cast
    (``cast_forward_inputs=False``) and the rotary tables stay fp32."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = "float32"
    """Gradient reduce-scatter dtype under mixed precision."""
    reshard_after_forward: bool = True
    """Free the gathered layer parameters after each training forward (ZeRO-3); False keeps them (ZeRO-2)."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None:
                choice(f"fsdp.{name}", v, ("float32", "bfloat16", "float16"))
