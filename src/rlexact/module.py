"""The RL LightningModule: rollout -> reward -> advantages -> old log-probs -> RL callbacks -> PPO epochs.

One ``training_step`` is one *rollout step* (manual optimization); docs/design.md §3 walks through it, and each stage
lives in :mod:`rlexact.trainer`. The module keeps the Lightning hooks, the override points of a subclass
(``generate``, ``compute_rewards``, ``compute_advantages``, ``build_batch``, ``score_batch``, ``policy_loss``) and the
order of the stages.

Counters: Lightning's ``global_step`` counts **optimizer steps** (``ppo_epochs x mini-batches`` per rollout step, or
fewer when mini-steps are skipped), so ``Trainer(max_steps=...)`` bounds optimizer steps (checked after each rollout
step, so the last rollout step may overshoot by up to its mini-steps minus one). :attr:`RLModule.rollout_step`
counts rollout steps; it is logged as ``rollout_step`` and saved in checkpoints. LR schedulers step once per
optimizer step.

Data parallelism (FSDP2 via ``ModelParallelStrategy``): every rank generates for its own shard of the prompts, and
all ``n`` samples of a prompt stay on its rank, so GRPO / RLOO groups are local; REINFORCE whitening and every
logged metric are reduced over ranks (:mod:`rlexact.reduction`). FSDP averages the gradients. Ranks may keep
different numbers of sequences (dynamic sampling), so the number of mini- and micro-batches is padded to the maximum
over ranks with no-loss placeholder batches, which keeps FSDP's collectives aligned. Exactness holds per rank
(docs/design.md §2.5).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch import Callback
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torchmetrics import MeanMetric
from typing_extensions import override

from rlexact.batch import RolloutBatch
from rlexact.callbacks.base import RLCallback, rl_callbacks
from rlexact.callbacks.samples import SampleLogger
from rlexact.checkpoint import AtomicCheckpointIO
from rlexact.config import DTYPES, AlgorithmConfig, FSDPConfig, OptimConfig, RolloutConfig
from rlexact.data import PromptDataset, check_tokenizer_source, load_tokenizer
from rlexact.distributed import is_fsdp
from rlexact.models import context_limit, exactify, text_config, uncompiled
from rlexact.reduction import MetricReducer
from rlexact.rewards import RewardConfig, RewardExecutor, RewardResult, resolve_reward, shared_executor
from rlexact.rollout import Completion, Generator, SamplingParams
from rlexact.trainer import advantages as advantage_stage
from rlexact.trainer import batching, data_checks, policy, sampling
from rlexact.trainer import optim as optim_stage
from rlexact.trainer import rewards as reward_stage
from rlexact.trainer import update as update_stage
from rlexact.trainer.hooks import call_rl_hook
from rlexact.trainer.hparams import Unsaved, is_plain, is_unsaved, plain, require, restore, unsaved_marker
from rlexact.trainer.step_metrics import StageTimer, advantage_metrics

__all__ = ["RLModule"]

_CKPT_KEY = "rlexact"


class RLModule(L.LightningModule):
    """Exact-rollout RL of a transformers causal LM (manual optimization; see the module docstring for one step).

    The stages live in :mod:`rlexact.trainer`; the methods ``generate``, ``compute_rewards``, ``compute_advantages``,
    ``build_batch``, ``score_batch`` and ``policy_loss`` are the override points of a subclass.

    Args:
        model_path: a local checkpoint directory (or hub name) loaded with ``AutoModelForCausalLM.from_pretrained``
            in :meth:`configure_model`, or ``"demo"`` (the packaged demo checkpoint, :mod:`rlexact.resources`). A
            path that looks local (absolute, ``./``, ``~``) must exist.
        model: a transformers causal LM object (Python use); exclusive with ``model_path`` / ``model_config``.
        model_config: keyword arguments of ``AutoConfig.for_model`` (must include ``model_type``) to build a freshly
            initialized model in :meth:`configure_model` (tiny models for tests and demos).
        tokenizer: tokenizer object, path / hub name, ``"demo"`` or ``"demo-char"``; None = ``model_path`` (recorded
            as such in the hyperparameters). It must agree with the data's tokenizer (checked at setup).
        reward: reward name (``"math"``, ``"arithmetic"``, ``"exact_match"``), import path ``"pkg.mod:Name"``, or a
            callable ``(prompts, completions, answers) -> list[float]``.
        reward_kwargs: constructor arguments of a named reward.
        reward_config: how the reward runs (:class:`rlexact.rewards.RewardConfig`, or a dict of its fields): worker
            processes (``workers``, default the CPUs per rank; 0 = in this process), a wall-clock limit per sample
            (``timeout_s``) and what a timed-out or failing sample scores. See :mod:`rlexact.rewards.executor`.
        rollout / algorithm / optim / fsdp: :mod:`rlexact.config` dataclasses (or dicts of their fields).
        dtype: dtype the model is loaded / built in (``"float32"``, ``"bfloat16"``, ``"float16"``); None = the
            checkpoint's dtype for ``model_path``, float32 for ``model_config``, unchanged for ``model``.
        init_seed: seed of the weight initialization for ``model_config``.
        activation_checkpointing: recompute each decoder layer's activations in the backward instead of keeping them
            (less memory for long sequences, one more layer forward per backward); with or without FSDP2. The
            forward's values, and so every log-prob, are unchanged bitwise.
        optimizer / lr_scheduler: callables ``params -> Optimizer`` / ``optimizer -> scheduler`` (LightningCLI builds
            them from its top-level ``optimizer:`` / ``lr_scheduler:`` sections); None keeps AdamW with ``optim``
            and its warmup. ``optim.grad_clip`` applies either way; schedulers step once per optimizer step. The
            ``optim`` fields that a callable replaces (all but ``grad_clip`` for ``optimizer``, ``warmup_steps`` for
            ``lr_scheduler``) must keep their defaults: ``ValueError`` otherwise, as they would be ignored.

    After :meth:`configure_model`, ``self.model`` is the exactified causal LM (set at once when ``model`` is
    given); ``self.ref_model`` is a frozen copy of the initial policy when ``algorithm.kl_coef > 0`` (not in
    checkpoints, not optimized); ``self.rollout_step`` counts the rollout steps done (see the module docstring) and
    ``self.rollout_steps_without_update`` the last ones in a row that made no optimizer step (bounded by
    ``algorithm.max_rollout_steps_without_update``); checkpoints keep both.

    The hyperparameters hold plain values only (the configs as dicts, the tokenizer as its resolved source), so a
    checkpoint loads with ``torch.load``'s default ``weights_only=True``: ``RLModule.load_from_checkpoint(path)``
    and ``Trainer.fit(..., ckpt_path=path)`` work. An argument given as an object (a reward object or function, a
    tokenizer object, an ``optimizer`` / ``lr_scheduler`` callable) is recorded as a marker that describes it
    (:mod:`rlexact.trainer.hparams`): the checkpoint still loads, and each use of the missing object (scoring,
    ``configure_optimizers``, the tokenizer) raises ``RuntimeError`` naming it; pass it again with
    ``RLModule.load_from_checkpoint(path, reward=...)`` (or ``tokenizer=``, ``optimizer=``, ``lr_scheduler=``).
    Two exceptions record a plain value instead: LightningCLI's ``optimizer:`` / ``lr_scheduler:`` sections (their
    ``class_path`` and ``init_args``, which ``load_from_checkpoint`` rebuilds) and, at setup, a tokenizer object
    that agrees with the datamodule's tokenizer given by name (that name).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        model: Any = None,
        model_config: dict[str, Any] | None = None,
        tokenizer: Any = None,
        reward: Any = "math",
        reward_kwargs: dict[str, Any] | None = None,
        reward_config: RewardConfig | None = None,
        rollout: RolloutConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        optim: OptimConfig | None = None,
        fsdp: FSDPConfig | None = None,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        init_seed: int = 0,
        activation_checkpointing: bool = False,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        model_path = policy.check_model_source(model_path, model, model_config, dtype)
        # the arguments that may be objects (save_hyperparameters reads them from this frame: they keep the values
        # given); a marker, recorded as it is, becomes a placeholder that raises where its object would be used
        given = {"tokenizer": tokenizer, "reward": reward, "optimizer": optimizer, "lr_scheduler": lr_scheduler}
        objects = {
            k: v for k, v in given.items() if not (v is None or isinstance(v, (str, os.PathLike)) or is_unsaved(v))
        }
        given = {k: restore(k, v) for k, v in given.items()}
        self.rollout_cfg: RolloutConfig = policy.as_config(rollout, RolloutConfig)
        self.algo: AlgorithmConfig = policy.as_config(algorithm, AlgorithmConfig)
        self.optim_cfg: OptimConfig = policy.as_config(optim, OptimConfig)
        self.fsdp_cfg: FSDPConfig = policy.as_config(fsdp, FSDPConfig)
        self.reward_cfg: RewardConfig = policy.as_config(reward_config, RewardConfig)
        if self.algo.old_logprob_mode == "exact" and self.rollout_cfg.kernels != "exact":
            raise ValueError(
                "algorithm.old_logprob_mode='exact' needs rollout.kernels='exact' (the native generator's log-probs "
                "are not the trainer's); use old_logprob_mode='recompute' or 'bypass' with the native generator"
            )
        if self.algo.needs_groups and self.rollout_cfg.n < 2:
            name = self.algo.estimator.upper()
            raise ValueError(
                f"{name} advantages need n >= 2 samples per prompt (rollout.n={self.rollout_cfg.n}); "
                "set rollout.n >= 2 or algorithm.estimator='reinforce'"
            )
        self.model_path = model_path
        self.model_config = dict(model_config) if model_config is not None else None
        self.dtype_name = dtype
        self.init_seed = int(init_seed)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.optimizer_spec = given["optimizer"]
        self.lr_scheduler_spec = given["lr_scheduler"]
        optim_stage.check_spec("optimizer", self.optimizer_spec)
        optim_stage.check_spec("lr_scheduler", self.lr_scheduler_spec)
        optim_stage.check_ignored_settings(self.optim_cfg, self.optimizer_spec, self.lr_scheduler_spec)
        check_tokenizer_source(tokenizer)  # model_path, its default, is checked above
        self._tokenizer_arg = given["tokenizer"] if tokenizer is not None else model_path
        self._tokenizer_setting = "tokenizer" if tokenizer is not None else "model_path (the default tokenizer)"
        if self._tokenizer_arg is None:
            raise ValueError("a tokenizer is required when the model is not given by model_path")
        self._tokenizer = objects.get("tokenizer")
        self.reward_fn: Callable = given["reward"]
        if not isinstance(self.reward_fn, Unsaved):
            self.reward_fn = resolve_reward(reward, **(reward_kwargs or {}))
        self.reward_result: RewardResult | None = None  # of the last compute_rewards call
        self.model: nn.Module | None = None
        self.__dict__["ref_model"] = None
        self.__dict__["_generator"] = None
        self._rope_fp32: dict[str, torch.Tensor] = {}
        self.rollout_step = 0
        self.rollout_steps_without_update = 0
        self.val_reward = MeanMetric().set_dtype(torch.float64)
        self.val_response_length = MeanMetric().set_dtype(torch.float64)
        self.save_hyperparameters(ignore=["model", *objects])  # objects are neither copied nor pickled
        if objects and "_instantiator" in self.hparams:
            # LightningCLI gives the hyperparameters as its configuration, in which an object is the plain
            # class_path / init_args that its instantiator rebuilds in load_from_checkpoint: record those
            self.save_hyperparameters(*objects)
        # plain values (checkpoints load with weights_only=True): the configs as dicts, a marker in place of each
        # object argument, and the tokenizer actually used (model_path by default) rather than None
        configs = {"rollout": self.rollout_cfg, "algorithm": self.algo, "optim": self.optim_cfg, "fsdp": self.fsdp_cfg}
        configs["reward_config"] = self.reward_cfg
        self._record_hparams(**{k: plain(v) for k, v in configs.items()})
        unsaved = {k: v for k, v in objects.items() if k not in self.hparams or not is_plain(self.hparams[k])}
        self._record_hparams(**{k: unsaved_marker(v) for k, v in unsaved.items()})
        if isinstance(self._tokenizer_arg, (str, os.PathLike)):
            self._record_hparams(tokenizer=os.fspath(self._tokenizer_arg))
        if model is not None:
            model = uncompiled(model)
            if dtype is not None:
                model = model.to(DTYPES[dtype])
            self._setup_model(model)

    # ------------------------------------------------------------------------------------------------------------
    # model, tokenizer, generator (stage: rlexact.trainer.policy)
    # ------------------------------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded from the ``tokenizer`` argument on first use; ``RuntimeError`` for a tokenizer object
        that the checkpoint the module was loaded from did not hold)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(require(self._tokenizer_arg), self._tokenizer_setting)
        return self._tokenizer

    def _setup_model(self, model: nn.Module) -> None:
        policy.check_model_dtype(model)
        if self.algo.kl_coef > 0 and self.ref_model is None:
            self.__dict__["ref_model"] = policy.make_reference(model)
        exactify(model)
        if self.activation_checkpointing:
            policy.enable_activation_checkpointing(model)
        self._rope_fp32 = policy.rope_fp32_snapshot(model)
        model.train()
        self.model = model

    @override
    def configure_model(self) -> None:
        """Build / load the model (once), exactify it, and apply FSDP2 under ``ModelParallelStrategy``.

        Idempotent. Under ``ModelParallelStrategy`` each decoder layer and then the root are ``fully_shard``-ed over
        the data-parallel mesh (tensor parallelism is rejected: its reductions would break exactness).
        """
        if self.model is None:
            self._setup_model(policy.build_model(self.model_path, self.model_config, self.dtype_name, self.init_seed))
        policy.apply_data_parallel(self.model, self.ref_model, self._device_mesh_or_none(), self.fsdp_cfg)

    def _device_mesh_or_none(self) -> Any:
        try:
            return self.device_mesh
        except (AttributeError, RuntimeError):
            return None

    @property
    def generator(self) -> Generator:
        """The :class:`rlexact.rollout.Generator` on :attr:`model` (created on first use; shares the parameters)."""
        if self.__dict__.get("_generator") is None:
            if self.model is None:
                raise RuntimeError("the model is not built yet: call configure_model() (Lightning does it in fit)")
            self.__dict__["_generator"] = sampling.make_generator(self.model, self.rollout_cfg)
        return self.__dict__["_generator"]

    @override
    def setup(self, stage: str) -> None:
        """Check the Trainer's strategy and the FSDP settings' use (:func:`rlexact.trainer.policy.check_strategy`,
        :func:`~rlexact.trainer.policy.check_fsdp_settings`), install
        :class:`rlexact.checkpoint.AtomicCheckpointIO` in place of Lightning's default checkpoint IO, and
        check that the datamodule's tokenizer agrees with the module's (before Lightning merges their
        hyperparameters; the same tokenizer under two names, or given to the module as an object, is recorded under
        the data's name, which then loads it from the checkpoint)."""
        self.check_trainer(self.trainer)
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        data = self.trainer.datamodule
        source = getattr(data, "tokenizer_source", None)
        if source is None or (isinstance(source, str) and source == self._tokenizer_arg):
            return
        data_checks.same_tokenizer(self._tokenizer_arg, self.tokenizer, source, data.tokenizer)
        if isinstance(source, (str, os.PathLike)):
            self._record_hparams(tokenizer=os.fspath(source))

    def check_trainer(self, trainer: L.Trainer, fitting: bool = False) -> None:
        """Raise ``ValueError`` for a Trainer this module cannot run under: its strategy and the FSDP settings' use
        (:func:`rlexact.trainer.policy.check_strategy`, :func:`~rlexact.trainer.policy.check_fsdp_settings`), with
        ``fitting`` the Trainer options that RLModule replaces (:func:`~rlexact.trainer.policy.check_trainer_options`),
        and what each RL callback on the trainer refuses (:meth:`rlexact.callbacks.RLCallback.check`: e.g. TIS with
        ``old_logprob_mode='bypass'``, a MismatchInjection after a probe, two callbacks logging under one metric
        prefix). Lightning's hooks run these checks; the ``rlexact`` command runs them before the run starts, so a
        refused run leaves no log folder behind."""
        policy.check_strategy(trainer.strategy)
        policy.check_fsdp_settings(trainer.strategy, self.fsdp_cfg)
        if fitting:
            policy.check_trainer_options(trainer)
        for callback in rl_callbacks(trainer):
            callback.check(trainer, self)

    def _record_hparams(self, **values: Any) -> None:
        """Record hyperparameters in ``hparams`` and in Lightning's initial copy (which the loggers and the merge
        with the datamodule's hyperparameters read)."""
        for hparams in (self.hparams, getattr(self, "_hparams_initial", None) or {}):
            hparams.update(values)

    @override
    def configure_callbacks(self) -> list[Callback]:
        """A :class:`rlexact.callbacks.SampleLogger` (prompts and completions as TensorBoard text every 10 rollout
        steps) unless the trainer has one. For a fit whose datamodule has no validation data the module also presents
        no ``validation_step`` until teardown (Lightning would warn that there is no ``val_dataloader``). Lightning
        calls this hook before it validates the loop configuration, so Trainer options that RLModule replaces
        (gradient clipping and accumulation) are rejected here with the setting to use instead."""
        trainer = self.trainer
        fitting = trainer.state.fn == "fit"
        if fitting:
            policy.check_trainer_options(trainer)
        data = trainer.datamodule
        if fitting and data is not None and not is_overridden("val_dataloader", data):
            self.validation_step = L.LightningModule.validation_step.__get__(self)
        if any(isinstance(cb, SampleLogger) for cb in trainer.callbacks):
            return []
        return [SampleLogger()]

    @override
    def teardown(self, stage: str) -> None:
        self.__dict__.pop("validation_step", None)

    @override
    def on_fit_start(self) -> None:
        policy.check_precision(self.trainer, self.dtype_name)
        if self.trainer.loggers and self.trainer.log_every_n_steps > 1:
            rank_zero_warn(
                f"RLModule logs its metrics once per rollout step, and Trainer(log_every_n_steps="
                f"{self.trainer.log_every_n_steps}) writes every {self.trainer.log_every_n_steps}th of them (a short "
                "run may write none); set Trainer(log_every_n_steps=1)"
            )
        data = self.trainer.datamodule
        batch_size = getattr(data, "batch_size", None)
        if isinstance(batch_size, int) and not self.algo.dynamic_sampling:  # dynamic sampling varies the count
            message = data_checks.minibatch_mismatch(batch_size * self.rollout_cfg.n, self.algo.mini_batch_size)
            if message is not None:
                rank_zero_warn(message)
        dataset = getattr(data, "train_dataset", None)
        if isinstance(dataset, PromptDataset) and len(dataset):  # prompt problems surface now, not at their batch
            data_checks.check_token_ids(dataset.max_token_id, int(text_config(self.model).vocab_size), data.path)
            longest, row = dataset.longest_prompt
            max_context = sampling.max_context(self.rollout_cfg, context_limit(self.model))
            data_checks.check_prompt_lengths(longest, row, max_context, self.rollout_cfg.max_new_tokens)
        policy.restore_fp32_rope(self.model, self._rope_fp32)
        if self.ref_model is not None and not is_fsdp(self.ref_model):
            dtype = next(self.model.parameters()).dtype  # follow a `*-true` precision conversion of the policy
            self.ref_model.to(device=self.device, dtype=dtype)
            policy.restore_fp32_rope(self.ref_model, self._rope_fp32)

    @override
    def on_validation_start(self) -> None:
        policy.restore_fp32_rope(self.model, self._rope_fp32)

    # ------------------------------------------------------------------------------------------------------------
    # optimizer, checkpoints
    # ------------------------------------------------------------------------------------------------------------

    @override
    def configure_optimizers(self) -> Any:
        """The ``optimizer`` / ``lr_scheduler`` arguments when given (LightningCLI's ``optimizer:`` /
        ``lr_scheduler:`` sections), else AdamW(lr, betas, eps, weight_decay) with, when ``warmup_steps > 0``, a
        linear warmup; schedulers step once per optimizer step (:mod:`rlexact.trainer.optim`). An ``optimizer`` /
        ``lr_scheduler`` object that the checkpoint the module was loaded from did not hold raises ``RuntimeError``
        (:mod:`rlexact.trainer.hparams`)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer, lr_scheduler = require(self.optimizer_spec), require(self.lr_scheduler_spec)
        return optim_stage.build_optimizer(params, self.optim_cfg, optimizer, lr_scheduler)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[_CKPT_KEY] = {
            "rollout_step": int(self.rollout_step),
            "rollout_steps_without_update": int(self.rollout_steps_without_update),
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(_CKPT_KEY, {})
        self.rollout_step = int(state.get("rollout_step", 0))
        self.rollout_steps_without_update = int(state.get("rollout_steps_without_update", 0))  # older checkpoints: 0

    # ------------------------------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------------------------------

    def _log_step_metrics(self, metrics: dict[str, float]) -> None:
        """Log one rollout step's metrics, already reduced over the ranks (:mod:`rlexact.reduction`), so Lightning
        does not sync them again; NaN (no data anywhere) is left out."""
        if self._trainer is None:
            return
        values = {k: float(v) for k, v in metrics.items() if not math.isnan(float(v))}
        shown = {k: values.pop(k) for k in ("reward/mean", "rollout_step") if k in values}
        self.log_dict(shown, on_step=True, on_epoch=False, prog_bar=True, sync_dist=False, batch_size=1)
        self.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)

    @property
    def exact_rollout(self) -> bool:
        """Whether the generator's reported log-probs are the trainer's bit for bit (``rollout.kernels='exact'``,
        the exactness contract); the RL callbacks read it (:func:`rlexact.callbacks.base.rollout_equals_trainer`)."""
        return self.rollout_cfg.kernels == "exact"

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the rollout's reported log-probs, used by every trainer-side log-prob."""
        return float(self.rollout_cfg.temperature)

    @property
    def logprob_truncation(self) -> tuple[int, float]:
        """``(top_k, top_p)`` of the distribution the trainer-side log-probs describe: the sampling truncation with
        ``rollout.logprobs="sampled"``, else ``(0, 1.0)`` (the full tempered softmax)."""
        cfg = self.rollout_cfg
        return (cfg.top_k, cfg.top_p) if cfg.logprobs == "sampled" else (0, 1.0)

    def stop_token_ids(self) -> list[int] | None:
        """The token ids that end a rollout sample: ``rollout.stop_token_ids`` when set, else the EOS ids of the model
        configs and tokenizer; None when there is none."""
        return sampling.stop_token_ids(self.rollout_cfg, self.model, self.tokenizer)

    def sampling_params(
        self, *, n: int | None = None, temperature: float | None = None, keyed: bool = False
    ) -> SamplingParams:
        """The ``SamplingParams`` of the current rollout step on this rank (``keyed``: the prompts carry data keys)."""
        return sampling.sampling_params(
            self.rollout_cfg,
            rollout_step=self.rollout_step,
            rank=self.global_rank,
            stop_ids=self.stop_token_ids(),
            n=n,
            temperature=temperature,
            keyed=keyed,
        )

    def _check_prompts(self, items: Sequence[dict]) -> list[list[int]]:
        return sampling.check_prompts(items, self.rollout_cfg, context_limit(self.model))

    # ------------------------------------------------------------------------------------------------------------
    # step stages (overridable)
    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, keys: list[int] | None = None
    ) -> list[Completion]:
        """Sample completions with the module's generator (no grad, eval mode; all parameters gathered under FSDP).
        ``keys``: per-prompt sampling keys from the data (:func:`rlexact.trainer.sampling.prompt_keys`).

        Returns ``len(prompts) * params.n`` completions in prompt-major order."""
        return sampling.generate_completions(self.model, self.generator, prompts, params, keys)

    @property
    def reward_executor(self) -> RewardExecutor:
        """The process-wide executor of ``reward_fn`` with ``reward_config`` (workers start on first use; a new one if
        ``reward_fn`` was replaced). A reward object that the checkpoint the module was loaded from did not hold
        raises ``RuntimeError`` here, in this process, before any executor could run (or score) it."""
        executor = self.__dict__.get("_reward_executor")
        if executor is None or executor.closed or executor.reward is not self.reward_fn:
            executor = self.__dict__["_reward_executor"] = shared_executor(require(self.reward_fn), self.reward_cfg)
        return executor

    def compute_rewards(self, items: Sequence[dict], completions: list[Completion], n: int) -> torch.Tensor:
        """Decode the completions and score them with :attr:`reward_executor`: float32 ``[len(completions)]``
        (validated); the :class:`~rlexact.rewards.RewardResult` (timeouts, errors) is kept in ``reward_result``."""
        rewards, self.reward_result = reward_stage.score_completions(
            self.reward_executor,
            self.tokenizer,
            items,
            completions,
            n,
            skip_special_tokens=self.rollout_cfg.skip_special_tokens,
        )
        return rewards

    def compute_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """Per-sequence advantages ``[N]`` by ``algorithm.estimator`` (REINFORCE whitening over the global batch)."""
        return advantage_stage.sequence_advantages(self.algo, rewards, group_ids)

    def build_batch(
        self, completions: list[Completion], rewards: torch.Tensor, seq_adv: torch.Tensor, group_ids: torch.Tensor
    ) -> RolloutBatch:
        """Pack prompt+response sequences into a :class:`RolloutBatch` (``old_logprobs`` = rollout log-probs)."""
        return batching.build_rollout_batch(completions, rewards, seq_adv, group_ids, self.device)

    @torch.no_grad()
    def score_batch(self, batch: RolloutBatch, model: nn.Module | None = None) -> torch.Tensor:
        """No-grad trainer log-probs ``[T]`` of ``batch``'s response tokens under ``model`` (default: the policy;
        prompt entries 0), in chunks of ``micro_batch_size`` (else ``mini_batch_size``) sequences; every parameter
        gathered once under FSDP."""
        size = self.algo.micro_batch_size or self.algo.mini_batch_size
        return batching.score_chunks(
            batch,
            self.model if model is None else model,
            batching.chunks(batch.num_seqs, size),
            self.logprob_temperature,
            self.logprob_truncation,
        )

    def policy_loss(self, micro: RolloutBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss ``[T]`` of the configured objective and its detached diagnostics."""
        return update_stage.policy_loss(self.algo, micro, logp)

    # ------------------------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------------------------

    @override
    def training_step(self, batch: list[dict], batch_idx: int = 0) -> None:
        """One rollout step (see the module docstring). Returns None (manual optimization)."""
        items = batch
        prompts = self._check_prompts(items)
        n = self.rollout_cfg.n
        callbacks = rl_callbacks(self.trainer) if self._trainer is not None else []
        metrics: dict[str, float] = {}

        timer = StageTimer()

        # (1) rollout
        epoch = int(items[0].get("epoch", self.current_epoch)) if items and isinstance(items[0], dict) else 0
        keys = sampling.prompt_keys(items, split=sampling.TRAIN_KEYS, epoch=epoch)  # the data epoch (exact resume)
        params = self.sampling_params(keyed=keys is not None)
        engine = self.__dict__.get("_generator")
        engine_stats = engine.stats if engine is not None else None
        t0 = time.perf_counter()
        completions = self.generate(prompts, params, keys)
        gen_s = max(time.perf_counter() - t0, 1e-9)
        timer.seconds["rollout"] = gen_s
        lengths = [len(c.token_ids) for c in completions]
        rollout_red = MetricReducer().add_sum("tokens", sum(lengths)).add_max("seconds", gen_s)
        for name, value in sampling.engine_counters(self.__dict__.get("_generator"), engine_stats).items():
            rollout_red.add_sum(f"rollout/{name}", value)
        timing = rollout_red.reduce()
        metrics["rollout/tokens_per_s"] = timing.pop("tokens") / timing["seconds"]
        metrics["rollout/seconds"] = timing.pop("seconds")
        metrics.update(timing)

        # (2) rewards, (3) advantages
        self.reward_result = None
        with timer("scoring"):
            scores = self.compute_rewards(items, completions, n)
        group_ids = torch.tensor([c.prompt_index for c in completions], dtype=torch.long)
        seq_adv = self.compute_advantages(scores, group_ids)
        metrics.update(advantage_metrics(scores, seq_adv, group_ids))
        metrics.update(reward_stage.reward_metrics(scores, lengths, completions))
        if self.reward_result is not None:  # None when an override of compute_rewards does not set it
            metrics.update(reward_stage.execution_metrics(self.reward_result, self.device))
            reward_stage.log_reward_examples(self.loggers, self.reward_result, self.rollout_step)

        keep = torch.ones(len(completions), dtype=torch.bool)
        num_kept = len(completions)  # > 0 on every rank without dynamic sampling
        if self.algo.dynamic_sampling:
            keep, num_kept, metrics["dynamic_sampling/kept_frac"] = advantage_stage.dynamic_sampling(scores, group_ids)
        full = self.build_batch(completions, scores, seq_adv, group_ids)
        if keep.all():
            rl_batch = full
        elif keep.any():
            rl_batch = full.select(keep.nonzero().squeeze(-1).tolist())
        else:  # this rank keeps nothing: a placeholder sequence that carries no loss (keeps FSDP collectives aligned)
            rl_batch = full.select([0])
            rl_batch.loss_mask.zero_()

        if num_kept == 0:
            rank_zero_warn(
                f"rollout step {self.rollout_step}: dynamic sampling dropped every group (all rewards equal within "
                "each group); no optimizer step",
            )
            self._finish_step(metrics, rl_batch, callbacks, updated=False, stepped=False, timer=timer)
            return None

        # (4) old log-probs, trainer / reference log-probs
        mode = self.algo.old_logprob_mode
        need_trainer = mode == "recompute" or any(cb.needs_trainer_logprobs for cb in callbacks)
        if need_trainer:
            rl_batch.trainer_logprobs = self.score_batch(rl_batch)
        if mode == "recompute":
            rl_batch.old_logprobs = rl_batch.trainer_logprobs.clone()
        else:  # exact / bypass: pi_old = the rollout log-probs
            rl_batch.old_logprobs = rl_batch.rollout_logprobs.clone()
        if self.algo.kl_coef > 0:
            rl_batch.ref_logprobs = self.score_batch(rl_batch, self.ref_model)

        # (5) RL callbacks see the batch
        with timer("callbacks"):
            call_rl_hook("on_rl_batch", callbacks, self.trainer if callbacks else None, self, self.model, rl_batch)

        # (6) PPO epochs x mini-batches
        update = update_stage.PPOUpdate(self, self._trainer)
        with timer("update"):
            metrics.update(update.run(rl_batch, callbacks))
        self._finish_step(metrics, rl_batch, callbacks, updated=True, stepped=update.stats.steps > 0, timer=timer)
        return None

    def _finish_step(
        self,
        metrics: dict[str, float],
        rl_batch: RolloutBatch,
        callbacks: list[RLCallback],
        *,
        updated: bool,
        stepped: bool,
        timer: StageTimer,
    ) -> None:
        """(7) The post-update hooks (``updated``: the PPO epochs ran), the step's metrics and counters; raises
        ``RuntimeError`` when the rollout steps without an optimizer step (``stepped`` False) in a row exceed
        ``algorithm.max_rollout_steps_without_update``."""
        if updated:
            with timer("callbacks"):
                call_rl_hook(
                    "on_rl_update_end", callbacks, self.trainer if callbacks else None, self, self.model, rl_batch
                )
        metrics.update(timer.metrics(self.device))
        self.rollout_step += 1
        metrics["rollout_step"] = float(self.rollout_step)
        for k, v in rl_batch.metrics.items():
            metrics.setdefault(k, float(v))
        self._log_step_metrics(metrics)
        # every rank decides `stepped` alike (the global kept-sequence and loss-token counts), so the count and the
        # error below are the same on every rank
        self.rollout_steps_without_update = 0 if stepped else self.rollout_steps_without_update + 1
        limit = self.algo.max_rollout_steps_without_update
        if limit is not None and self.rollout_steps_without_update > limit:
            raise RuntimeError(
                f"the last {self.rollout_steps_without_update} rollout steps (of {self.rollout_step}) made no "
                "optimizer step, and Trainer(max_steps=...) counts optimizer steps: the run would not end. Likely "
                "causes: RL callbacks that mask or reject every token (e.g. RejectionSampling, or another correction "
                "whose threshold rejects everything), or dynamic sampling dropping every group (all rewards equal "
                f"within each group: check the reward). The limit is algorithm.max_rollout_steps_without_update="
                f"{limit}; raise it, or set it to None for no limit"
            )

    # ------------------------------------------------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------------------------------------------------

    @override
    def validation_step(self, batch: list[dict], batch_idx: int = 0) -> None:
        """One sample per prompt at the rollout temperature; logs ``val/reward`` (epoch mean) and response length."""
        prompts = self._check_prompts(batch)
        keys = sampling.prompt_keys(batch, split=sampling.VALIDATION_KEYS, epoch=0)
        params = self.sampling_params(n=1, keyed=keys is not None)
        completions = self.generate(prompts, params, keys)
        scores = self.compute_rewards(batch, completions, 1)
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
        # torchmetrics accumulates sums and counts over batches and ranks: sample-weighted epoch means
        self.val_reward.update(scores.double().to(self.val_reward.device))
        self.val_response_length.update(lengths.to(self.val_response_length.device))
        self.log("val/reward", self.val_reward, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/response_length", self.val_response_length, on_step=False, on_epoch=True)
