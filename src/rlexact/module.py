"""The RL LightningModule: rollout -> reward -> advantages -> old log-probs -> RL callbacks -> PPO epochs.

One ``training_step`` is one *rollout step* (manual optimization):

1. **Rollout.** The prompts of the data batch go to :class:`rlexact.rollout.Generator`, which the module creates
   lazily on its own model object (no weight copy: the generator and the trainer share the parameters), ``n`` samples
   per prompt, under ``no_grad`` and ``model.eval()`` (the model has no dropout, so train/eval mode does not change the
   numerics; the exactness contract relies on that).
2. **Rewards** of the decoded completions, validated with :func:`rlexact.rewards.check_rewards` (a NaN/inf names the
   sample, a count mismatch is an error).
3. **Advantages** (GRPO / RLOO within each prompt's group, REINFORCE whitening over the batch); optional dynamic
   sampling drops the groups whose rewards are all equal.
4. **pi_old** by ``old_logprob_mode``: ``exact`` (the rollout log-probs, bitwise equal to the trainer's: no recompute
   forward), ``recompute`` (no-grad trainer forward at the rollout weights) or ``bypass`` (the rollout log-probs even
   though the generator is not exact). The packed :class:`rlexact.batch.RolloutBatch` is built;
   ``batch.trainer_logprobs`` is computed when the mode is ``recompute`` or an RL callback sets
   ``needs_trainer_logprobs``.
5. ``on_rl_batch`` of every :class:`rlexact.callbacks.base.RLCallback`, in callback-list order.
6. ``ppo_epochs`` x mini-batches: packed forward with grad, ``on_rl_minibatch`` hooks (they may change the mini-batch's
   ``token_weights`` / ``loss_mask``), the policy loss (``token_weights`` multiply the per-token loss), aggregation, the
   optional KL and entropy terms, ``manual_backward``, gradient clipping, optimizer step, LR-scheduler step, zero_grad.
   A mini-step without any token left in the loss is skipped with a warning.
7. ``on_rl_update_end`` hooks.

Counters: Lightning's ``global_step`` counts **optimizer steps** (``ppo_epochs x mini-batches`` per rollout step, or
fewer when mini-steps are skipped), so ``Trainer(max_steps=...)`` bounds optimizer steps (checked after each
rollout step, so the last rollout step may overshoot by up to its mini-steps minus one). :attr:`RLModule.rollout_step`
counts rollout steps (training_step calls); it is logged as ``rollout_step``, saved in checkpoints, and seeds the
sampler and the mini-batch shuffle, so a resumed run continues the same sequence. LR schedulers step once per
optimizer step.

Data parallelism (FSDP2 via ``ModelParallelStrategy``): every rank generates for its own shard of the prompts (the
DataLoader is sharded by rank), with its own sampler seed. All ``n`` samples of a prompt stay on the rank that holds
the prompt, so GRPO/RLOO groups are never split across ranks and group advantages are computed locally; REINFORCE
whitening uses the global batch statistics (an all-reduce of a few scalars). The loss is aggregated per rank and FSDP
averages gradients over ranks. Rollout and no-grad scoring run with every parameter gathered once (ranks decode
different numbers of steps); ranks may keep different numbers of sequences (dynamic sampling), so the number of
mini- and micro-batches is padded to the maximum over ranks with no-loss placeholder batches, keeping FSDP's
collectives aligned. Exactness holds per rank: FSDP all-gathers whole parameters, nothing is reduced inside a forward.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields, is_dataclass
from typing import Any, Literal

import lightning as L
import torch
from torch import nn

from rlexact import algorithms as alg
from rlexact.batch import RolloutBatch
from rlexact.callbacks.base import RLCallback, rl_callbacks
from rlexact.config import AlgorithmConfig, FSDPConfig, OptimConfig, RolloutConfig
from rlexact.distributed import _DTYPES, apply_fsdp, fsdp_call, gathered_params, is_fsdp, reduce_scalars
from rlexact.logprobs import Packed, pack, packed_logprobs
from rlexact.models import exactify, get_state
from rlexact.rewards import check_rewards, resolve_reward

__all__ = ["RLModule"]

_CKPT_KEY = "rlexact"


def _as_config(value: Any, cls: type) -> Any:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys {unknown}; valid keys: {sorted(known)}")
        return cls(**value)
    if is_dataclass(value):
        return cls(**{f.name: getattr(value, f.name) for f in fields(value)})
    raise TypeError(f"expected a {cls.__name__} or a dict, got {type(value).__name__}")


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.isabs(path) or path.startswith(".")


def _mix_seed(*parts: int) -> int:
    """A 31-bit seed from integers (splitmix64 steps); distinct inputs give (practically) distinct seeds."""
    x = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    for p in parts:
        x = (x ^ (int(p) & mask)) & mask
        x = (x + 0x9E3779B97F4A7C15) & mask
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        x = z ^ (z >> 31)
    return x & 0x7FFFFFFF


class RLModule(L.LightningModule):
    """Exact-rollout RL of a transformers causal LM (manual optimization; see the module docstring for one step).

    Args:
        model_path: a local checkpoint directory (or hub name) loaded with ``AutoModelForCausalLM.from_pretrained``
            in :meth:`configure_model`. A path that looks local (absolute, ``./``, ``~``) must exist.
        model: a transformers causal LM object (Python use); exclusive with ``model_path`` / ``model_config``.
        model_config: keyword arguments of ``AutoConfig.for_model`` (must include ``model_type``) to build a freshly
            initialized model in :meth:`configure_model` (tiny models for tests and demos).
        tokenizer: tokenizer object, path / hub name, or ``"demo-char"``; None = ``model_path``.
        reward: reward name (``"math"``, ``"arithmetic"``, ``"exact_match"``), import path ``"pkg.mod:Name"``, or a
            callable ``(prompts, completions, answers) -> list[float]``.
        reward_kwargs: constructor arguments of a named reward.
        rollout / algorithm / optim / fsdp: :mod:`rlexact.config` dataclasses (or dicts of their fields).
        dtype: dtype the model is loaded / built in (``"float32"``, ``"bfloat16"``, ``"float16"``); None = the
            checkpoint's dtype for ``model_path``, float32 for ``model_config``, unchanged for ``model``.
        init_seed: seed of the weight initialization for ``model_config``.

    Attributes:
        model: the exactified causal LM (after :meth:`configure_model`; set immediately when ``model`` is given).
        ref_model: frozen copy of the initial policy, only when ``algorithm.kl_coef > 0`` (not in checkpoints, not
            optimized).
        rollout_step: rollout steps done (see the module docstring).
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
        rollout: RolloutConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        optim: OptimConfig | None = None,
        fsdp: FSDPConfig | None = None,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        init_seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        sources = {"model_path": model_path, "model": model, "model_config": model_config}
        given = [name for name, v in sources.items() if v is not None]
        if len(given) != 1:
            raise ValueError(
                f"RLModule needs exactly one of model_path, model, model_config; got {given or 'none'}"
                + (" (set model.init_args.model_path in the config)" if not given else "")
            )
        if model_path is not None:
            model_path = os.fspath(model_path)
            if _looks_local(model_path) and not os.path.exists(os.path.expanduser(model_path)):
                raise FileNotFoundError(
                    f"model_path {model_path!r} does not exist; set model.init_args.model_path to a local "
                    "transformers checkpoint directory (e.g. a downloaded Qwen/Qwen3-1.7B)"
                )
        if model_config is not None and "model_type" not in model_config:
            raise ValueError("model_config needs a 'model_type' key (e.g. 'qwen3')")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a transformers causal LM (nn.Module), got {type(model).__name__}")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {dtype!r}")
        self.rollout_cfg: RolloutConfig = _as_config(rollout, RolloutConfig)
        self.algo: AlgorithmConfig = _as_config(algorithm, AlgorithmConfig)
        self.optim_cfg: OptimConfig = _as_config(optim, OptimConfig)
        self.fsdp_cfg: FSDPConfig = _as_config(fsdp, FSDPConfig)
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
        self._tokenizer_arg = tokenizer if tokenizer is not None else model_path
        if self._tokenizer_arg is None:
            raise ValueError("a tokenizer is required when the model is not given by model_path")
        self._tokenizer = None if isinstance(tokenizer, (str, os.PathLike)) or tokenizer is None else tokenizer
        self.reward_fn: Callable = resolve_reward(reward, **(reward_kwargs or {}))
        self.model: nn.Module | None = None
        self.__dict__["ref_model"] = None
        self.__dict__["_generator"] = None
        self._rope_fp32: dict[str, torch.Tensor] = {}
        self.rollout_step = 0
        ignore = ["model"]
        if not isinstance(tokenizer, (str, os.PathLike)) and tokenizer is not None:
            ignore.append("tokenizer")
        if not isinstance(reward, str):
            ignore.append("reward")
        self.save_hyperparameters(ignore=ignore)
        if model is not None:
            if dtype is not None:
                model = model.to(_DTYPES[dtype])
            self._setup_model(model)

    # ------------------------------------------------------------------------------------------------------------
    # model, tokenizer, generator
    # ------------------------------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from rlexact.data import load_tokenizer

            self._tokenizer = load_tokenizer(self._tokenizer_arg)
        return self._tokenizer

    def _build_model(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = _DTYPES[self.dtype_name] if self.dtype_name else None
        if self.model_path is not None:
            kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
            return AutoModelForCausalLM.from_pretrained(os.path.expanduser(self.model_path), **kwargs)
        assert self.model_config is not None
        cfg = dict(self.model_config)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init_seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
        return model

    def _setup_model(self, model: nn.Module) -> None:
        state = get_state(model)
        if self.algo.kl_coef > 0 and self.ref_model is None:
            if state is not None:  # exactify's closures point at the modules: copy an un-patched model
                exactify(model, enabled=False)
            import copy

            ref = copy.deepcopy(model)
            ref.requires_grad_(False)
            ref.eval()
            self.__dict__["ref_model"] = exactify(ref)
        exactify(model)
        self._rope_fp32 = {
            name: m.inv_freq.detach().float().clone()
            for name, m in model.named_modules()
            if type(m).__name__.endswith("RotaryEmbedding") and isinstance(getattr(m, "inv_freq", None), torch.Tensor)
        }
        model.train()
        self.model = model

    def configure_model(self) -> None:
        """Build / load the model (once), exactify it, and apply FSDP2 under ``ModelParallelStrategy``.

        Idempotent. Under ``ModelParallelStrategy`` each decoder layer and then the root are ``fully_shard``-ed over
        the data-parallel mesh (tensor parallelism is rejected: its reductions would break exactness).
        """
        if self.model is None:
            self._setup_model(self._build_model())
        mesh = self._device_mesh_or_none()
        if mesh is None or is_fsdp(self.model):
            return
        if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() != 1:
            raise ValueError(
                "rlexact supports data parallelism only (tensor-parallel reductions break exactness): use "
                "ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1)"
            )
        dp_mesh = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        apply_fsdp(self.model, dp_mesh, self.fsdp_cfg)
        if self.ref_model is not None:
            apply_fsdp(self.ref_model, dp_mesh, self.fsdp_cfg)

    def _device_mesh_or_none(self) -> Any:
        try:
            return self.device_mesh
        except (AttributeError, RuntimeError):
            return None

    @property
    def generator(self) -> Any:
        """The :class:`rlexact.rollout.Generator` on :attr:`model` (created on first use; shares the parameters)."""
        if self.__dict__.get("_generator") is None:
            if self.model is None:
                raise RuntimeError("the model is not built yet: call configure_model() (Lightning does it in fit)")
            from rlexact.rollout import Generator

            self.__dict__["_generator"] = Generator(
                self.model, kernels=self.rollout_cfg.kernels, **self.rollout_cfg.generator
            )
        return self.__dict__["_generator"]

    def _restore_fp32_rope(self, model: nn.Module | None = None) -> None:
        """Keep the rotary ``inv_freq`` fp32 when a ``*-true`` trainer precision (``module.to(dtype)``) cast the
        model's buffers; the exact kernels' RoPE tables are rebuilt from it."""
        model = self.model if model is None else model
        if model is None:
            return
        changed = False
        for name, m in model.named_modules():
            saved = self._rope_fp32.get(name)
            buf = getattr(m, "inv_freq", None)
            if saved is not None and isinstance(buf, torch.Tensor) and buf.dtype != torch.float32:
                m.inv_freq = saved.to(buf.device)
                changed = True
        state = get_state(model)
        if changed and state is not None:
            state.rope_tables.clear()

    def _check_precision(self) -> None:
        precision = str(getattr(self.trainer, "precision", "32-true"))
        if "mixed" in precision:
            raise ValueError(
                f"Trainer(precision={precision!r}) runs the step under autocast, which changes the kernels of the "
                "trainer forward and breaks rollout/trainer exactness; set RLModule(dtype='bfloat16') (or "
                "fsdp.param_dtype with ModelParallelStrategy) and leave the Trainer precision at '32-true'"
            )

    def on_fit_start(self) -> None:
        self._check_precision()
        self._restore_fp32_rope()
        if self.ref_model is not None and not is_fsdp(self.ref_model):
            dtype = next(self.model.parameters()).dtype  # follow a `*-true` precision conversion of the policy
            self.ref_model.to(device=self.device, dtype=dtype)
            self._restore_fp32_rope(self.ref_model)

    def on_validation_start(self) -> None:
        self._restore_fp32_rope()

    # ------------------------------------------------------------------------------------------------------------
    # optimizer
    # ------------------------------------------------------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        """AdamW(lr, betas, eps, weight_decay) and, with ``warmup_steps > 0``, a linear-warmup ``LambdaLR`` stepped once
        per optimizer step."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        cfg = self.optim_cfg
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        if cfg.warmup_steps <= 0:
            return opt
        warm = cfg.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[_CKPT_KEY] = {"rollout_step": int(self.rollout_step)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.rollout_step = int(checkpoint.get(_CKPT_KEY, {}).get("rollout_step", 0))

    # ------------------------------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------------------------------

    @property
    def _distributed(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized() and self._world_size > 1

    @property
    def _world_size(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
        return 1

    def _reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return reduce_scalars(values, op, self.device)

    def _log(self, name: str, value: float, *, prog_bar: bool = False, reduce: str = "mean", batch_size: int = 1):
        if self._trainer is None:
            return
        self.log(
            name,
            float(value),
            on_step=True,
            on_epoch=False,
            prog_bar=prog_bar,
            batch_size=batch_size,
            sync_dist=self._distributed,
            reduce_fx=reduce,
        )

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the rollout's reported log-probs, used by every trainer-side log-prob."""
        return float(self.rollout_cfg.temperature)

    def _stop_token_ids(self) -> list[int] | None:
        if self.rollout_cfg.stop_token_ids is not None:
            return list(self.rollout_cfg.stop_token_ids)
        ids: list[int] = []
        for src in (getattr(self.model, "generation_config", None), getattr(self.model, "config", None)):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            ids += [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.append(int(tok_eos))
        return sorted(set(ids)) or None

    def sampling_params(self, *, n: int | None = None, temperature: float | None = None) -> Any:
        """The ``SamplingParams`` of the current rollout step on this rank."""
        from rlexact.rollout import SamplingParams

        cfg = self.rollout_cfg
        return SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            seed=_mix_seed(cfg.seed, self.rollout_step, self.global_rank),
            n=cfg.n if n is None else n,
            stop_token_ids=self._stop_token_ids(),
        )

    def _check_prompts(self, items: Sequence[dict]) -> list[list[int]]:
        if not isinstance(items, (list, tuple)) or len(items) == 0:
            raise ValueError(
                "training_step got an empty batch of prompts; check that the dataset is not empty "
                "(rlexact.data.PromptDataModule yields lists of prompt dicts)"
            )
        max_context = self.rollout_cfg.max_context or int(self.model.config.max_position_embeddings)
        budget = max_context - self.rollout_cfg.max_new_tokens
        prompts = []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "prompt_ids" not in item:
                raise ValueError(f"batch item {i} must be a dict with 'prompt_ids', got {type(item).__name__}")
            ids = [int(t) for t in item["prompt_ids"]]
            if not ids:
                raise ValueError(f"prompt {i} (dataset index {item.get('index')}) is empty")
            if len(ids) > budget:
                raise ValueError(
                    f"prompt {i} (dataset index {item.get('index')}) has {len(ids)} tokens; with "
                    f"max_new_tokens={self.rollout_cfg.max_new_tokens} the context of {max_context} tokens leaves room "
                    f"for prompts of at most {max(budget, 0)} tokens (filter long prompts, e.g. "
                    "PromptDataModule(max_prompt_length=...), or lower rollout.max_new_tokens)"
                )
            prompts.append(ids)
        return prompts

    # ------------------------------------------------------------------------------------------------------------
    # step stages (overridable)
    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        """Sample completions with the module's generator (no grad, eval mode; all parameters gathered under FSDP).

        Returns ``len(prompts) * params.n`` completions in prompt-major order."""
        was_training = self.model.training
        self.model.eval()
        try:
            with gathered_params(self.model):
                outs = fsdp_call(self.model, lambda: self.generator.generate(prompts, params))
        finally:
            self.model.train(was_training)
        expected = len(prompts) * params.n
        if len(outs) != expected:
            raise RuntimeError(f"generator returned {len(outs)} completions for {len(prompts)} x {params.n}")
        for k, c in enumerate(outs):
            if c.prompt_index != k // params.n:
                raise RuntimeError("generator completions are not in prompt-major order")
        return outs

    def compute_rewards(self, items: Sequence[dict], completions: list[Any], n: int) -> torch.Tensor:
        """Decode the completions and score them: float32 ``[len(completions)]`` (validated)."""
        texts = [
            self.tokenizer.decode(c.token_ids, skip_special_tokens=self.rollout_cfg.skip_special_tokens)
            for c in completions
        ]
        prompts = [str(items[k // n].get("prompt_text", "")) for k in range(len(completions))]
        answers = [items[k // n].get("answer") for k in range(len(completions))]
        rewards = self.reward_fn(prompts, texts, answers)
        return check_rewards(rewards, len(completions))

    def compute_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """Per-sequence advantages ``[N]`` by ``algorithm.estimator`` (REINFORCE whitening over the global batch)."""
        est, eps = self.algo.estimator, self.algo.adv_eps
        if est == "grpo":
            return alg.grpo_advantages(rewards, group_ids, normalize_std=self.algo.normalize_std, eps=eps)
        if est == "rloo":
            return alg.rloo_advantages(rewards, group_ids)
        if not self._distributed:
            return alg.reinforce_advantages(rewards, eps=eps)
        r = rewards.double()
        s, sq, cnt, hi, lo = (
            *self._reduce([r.sum().item(), (r * r).sum().item(), float(r.numel())]),
            self._reduce([r.max().item()], "max")[0],
            self._reduce([r.min().item()], "min")[0],
        )
        if cnt < 2:
            raise ValueError(f"REINFORCE whitening needs a batch of N >= 2 rewards, got {int(cnt)}")
        if hi == lo:
            return torch.zeros_like(rewards)
        mean = s / cnt
        std = math.sqrt(max(sq - cnt * mean * mean, 0.0) / (cnt - 1))
        return ((r - mean) / (std + eps)).to(rewards.dtype)

    def build_batch(
        self, completions: list[Any], rewards: torch.Tensor, seq_adv: torch.Tensor, group_ids: torch.Tensor
    ) -> RolloutBatch:
        """Pack prompt+response sequences into a :class:`RolloutBatch` (``old_logprobs`` = rollout log-probs)."""
        device = self.device
        packed = pack([c.prompt_token_ids + c.token_ids for c in completions], device)
        t = packed.input_ids.numel()
        response_mask = torch.zeros(t, dtype=torch.bool)
        rollout_lp = torch.zeros(t, dtype=torch.float32)
        starts = packed.cu_seqlens[:-1].tolist()
        for c, s in zip(completions, starts):
            lo, m = s + len(c.prompt_token_ids), len(c.token_ids)
            if m:
                lp = torch.as_tensor(c.logprobs, dtype=torch.float32).reshape(-1)
                if lp.numel() != m:
                    raise RuntimeError(f"completion has {m} tokens but {lp.numel()} log-probs")
                response_mask[lo : lo + m] = True
                rollout_lp[lo : lo + m] = lp.cpu()
        response_mask = response_mask.to(device)
        rollout_lp = rollout_lp.to(device)
        adv_tok = torch.where(response_mask, alg.broadcast_to_tokens(seq_adv.to(device), packed.cu_seqlens), 0.0)
        return RolloutBatch(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            cu_seqlens=packed.cu_seqlens,
            response_mask=response_mask,
            rollout_logprobs=rollout_lp,
            old_logprobs=rollout_lp.clone(),
            advantages=adv_tok.float(),
            token_weights=torch.ones(t, dtype=torch.float32, device=device),
            loss_mask=response_mask.clone(),
            rewards=rewards.to(device, torch.float32),
            group_ids=group_ids.to(device),
            seq_advantages=seq_adv.to(device, torch.float32),
        )

    def _chunks(self, num_seqs: int, size: int | None) -> list[list[int]]:
        size = size or num_seqs
        return [list(range(i, min(i + size, num_seqs))) for i in range(0, num_seqs, size)]

    @torch.no_grad()
    def score_batch(self, batch: RolloutBatch, model: nn.Module | None = None) -> torch.Tensor:
        """No-grad trainer log-probs ``[T]`` of ``batch`` under ``model`` (default: the policy), in chunks of
        ``micro_batch_size`` (else ``mini_batch_size``) sequences; every parameter gathered once under FSDP."""
        chunk = self.algo.micro_batch_size or self.algo.mini_batch_size
        return self._score_chunks(batch, self.model if model is None else model, self._chunks(batch.num_seqs, chunk))

    @torch.no_grad()
    def _score_chunks(self, batch: RolloutBatch, model: nn.Module, chunks: list[list[int]]) -> torch.Tensor:
        """Detached log-probs ``[T]`` of ``batch`` under ``model``, one packed forward per chunk of sequence
        indices (consecutive, covering the batch)."""
        out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
        cu = batch.cu_seqlens.long()
        with gathered_params(model):
            for idx in chunks:
                sub = batch.select(idx)
                lp = fsdp_call(model, lambda sub=sub: self._logprobs(model, sub, with_entropy=False)[0])
                out[int(cu[idx[0]]) : int(cu[idx[-1] + 1])] = lp
        return out

    def _logprobs(self, model: nn.Module, batch: RolloutBatch, *, with_entropy: bool):
        packed = Packed(batch.input_ids, batch.position_ids, batch.cu_seqlens)
        return packed_logprobs(model, packed, self.logprob_temperature, with_entropy=with_entropy)

    # ------------------------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------------------------

    def training_step(self, batch: list[dict], batch_idx: int = 0) -> None:
        """One rollout step (see the module docstring). Returns None (manual optimization)."""
        items = batch
        prompts = self._check_prompts(items)
        n = self.rollout_cfg.n
        callbacks = rl_callbacks(self.trainer) if self._trainer is not None else []
        metrics: dict[str, float] = {}

        # (1) rollout
        params = self.sampling_params()
        t0 = time.perf_counter()
        completions = self.generate(prompts, params)
        gen_s = max(time.perf_counter() - t0, 1e-9)
        lengths = [len(c.token_ids) for c in completions]
        metrics["rollout/tokens_per_s"] = sum(lengths) / gen_s
        metrics["rollout/seconds"] = gen_s

        # (2) rewards, (3) advantages
        rewards = self.compute_rewards(items, completions, n)
        group_ids = torch.tensor([c.prompt_index for c in completions], dtype=torch.long)
        seq_adv = self.compute_advantages(rewards, group_ids)
        metrics.update(self._reward_metrics(rewards, lengths, completions))

        keep = torch.ones(len(completions), dtype=torch.bool)
        num_kept = len(completions)  # > 0 on every rank without dynamic sampling
        if self.algo.dynamic_sampling:
            keep = alg.dynamic_sampling_keep(rewards, group_ids)
            kept, total = self._reduce([float(keep.sum()), float(keep.numel())])
            metrics["dynamic_sampling/kept_frac"] = kept / max(total, 1.0)
            num_kept = int(kept)
        full = self.build_batch(completions, rewards, seq_adv, group_ids)
        if keep.all():
            rl_batch = full
        elif keep.any():
            rl_batch = full.select(keep.nonzero().squeeze(-1).tolist())
        else:  # this rank keeps nothing: a placeholder sequence that carries no loss (keeps FSDP collectives aligned)
            rl_batch = full.select([0])
            rl_batch.loss_mask.zero_()

        if num_kept == 0:
            warnings.warn(
                f"rollout step {self.rollout_step}: dynamic sampling dropped every group (all rewards equal within "
                "each group); no optimizer step",
                stacklevel=2,
            )
            self._finish_step(metrics, rl_batch, callbacks, updated=False, num_prompts=len(items))
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
        with self._gathered_if(callbacks, "on_rl_batch"):
            for cb in callbacks:
                cb.on_rl_batch(self.trainer, self, rl_batch)

        # (6) PPO epochs x mini-batches
        update = self._update(rl_batch, callbacks)
        metrics.update(update)
        self._finish_step(metrics, rl_batch, callbacks, updated=True, num_prompts=len(items))
        return None

    def _reward_metrics(self, rewards: torch.Tensor, lengths: list[int], completions: list[Any]) -> dict[str, float]:
        r = rewards.double()
        truncated = float(sum(c.finish_reason == "length" for c in completions))
        s, sq, cnt, lsum, truncated = self._reduce(
            [r.sum().item(), (r * r).sum().item(), float(r.numel()), float(sum(lengths)), truncated]
        )
        lmax = self._reduce([float(max(lengths))], "max")[0]
        mean = s / cnt
        var = max(sq / cnt - mean * mean, 0.0)
        return {
            "reward/mean": mean,
            "reward/std": math.sqrt(var),
            "response_length/mean": lsum / cnt,
            "response_length/max": lmax,
            "response_length/clip_frac": truncated / cnt,
        }

    def _overrides(self, cb: RLCallback, hook: str) -> bool:
        return getattr(type(cb), hook, None) is not getattr(RLCallback, hook)

    def _gathered_if(self, callbacks: list[RLCallback], hook: str):
        if is_fsdp(self.model) and any(self._overrides(cb, hook) for cb in callbacks):
            return gathered_params(self.model)
        return contextlib.nullcontext()

    def _finish_step(
        self,
        metrics: dict[str, float],
        rl_batch: RolloutBatch,
        callbacks: list[RLCallback],
        *,
        updated: bool,
        num_prompts: int,
    ) -> None:
        # (7) post-update hooks
        if updated:
            with self._gathered_if(callbacks, "on_rl_update_end"):
                for cb in callbacks:
                    cb.on_rl_update_end(self.trainer, self, rl_batch)
        self.rollout_step += 1
        metrics["rollout_step"] = float(self.rollout_step)
        for k, v in rl_batch.metrics.items():
            metrics.setdefault(k, float(v))
        reduce = {"ratio/min": "min", "ratio/max": "max", "response_length/max": "max", "rollout_step": "max"}
        for k, v in metrics.items():
            if isinstance(v, float) and math.isnan(v):
                continue
            self._log(
                k,
                v,
                prog_bar=k in ("reward/mean", "rollout_step"),
                reduce=reduce.get(k, "mean"),
                batch_size=num_prompts,
            )

    # ------------------------------------------------------------------------------------------------------------
    # update
    # ------------------------------------------------------------------------------------------------------------

    def _update(self, batch: RolloutBatch, callbacks: list[RLCallback]) -> dict[str, float]:
        algo = self.algo
        g = torch.Generator()
        g.manual_seed(_mix_seed(algo.shuffle_seed, self.rollout_step, self.global_rank))
        stats = _Stats()
        n_seq = batch.num_seqs
        for epoch in range(algo.ppo_epochs):
            order = torch.randperm(n_seq, generator=g).tolist() if algo.shuffle else list(range(n_seq))
            size = algo.mini_batch_size or n_seq
            minis = [order[i : i + size] for i in range(0, n_seq, size)]
            num_minis = int(self._reduce([float(len(minis))], "max")[0])
            for step in range(num_minis):
                if step < len(minis):
                    mb = batch.select(minis[step])
                else:  # fewer sequences on this rank: a no-loss placeholder keeps the ranks' collectives aligned
                    mb = batch.select([0])
                    mb.loss_mask = torch.zeros_like(mb.loss_mask)
                self._mini_step(mb, callbacks, epoch, step, stats)
        return stats.finish(self)

    def _mini_step(self, mb: RolloutBatch, callbacks: list[RLCallback], epoch: int, step: int, stats: _Stats) -> None:
        algo = self.algo
        micro_size = algo.micro_batch_size
        single = micro_size is None or micro_size >= mb.num_seqs
        micros = [list(range(mb.num_seqs))] if single else self._chunks(mb.num_seqs, micro_size)
        num_micros = int(self._reduce([float(len(micros))], "max")[0]) if not single or self._distributed else 1
        single = single and num_micros == 1
        hooks = [cb for cb in callbacks if self._overrides(cb, "on_rl_minibatch")]

        if single:
            logp, ent = fsdp_call(self.model, lambda: self._logprobs(self.model, mb, with_entropy=True))
            for cb in hooks:
                cb.on_rl_minibatch(self.trainer, self, mb, logp.detach(), epoch, step)
        elif hooks:
            detached = self._score_chunks(mb, self.model, micros)
            for cb in hooks:
                cb.on_rl_minibatch(self.trainer, self, mb, detached, epoch, step)

        local_tokens = int(mb.loss_mask.sum())
        total_tokens = self._reduce([float(local_tokens)])[0]
        if total_tokens == 0:
            warnings.warn(
                f"rollout step {self.rollout_step}, epoch {epoch}, mini-batch {step}: no token left in the loss "
                "(every token masked or rejected); skipping this optimizer step",
                stacklevel=2,
            )
            stats.skipped += 1
            if single:  # release the graph (FSDP: run the backward so the hooks complete) without a step
                self.manual_backward(logp.sum() * 0.0 + ent.sum() * 0.0)
                self.model.zero_grad(set_to_none=True)
            return
        local_seqs = int(self._seq_valid(mb).sum())
        opt = self.optimizers()
        loss_sum = 0.0
        for k in range(num_micros):
            if single:
                micro, lp, en = mb, logp, ent
            else:
                if k < len(micros):
                    micro = mb.select(micros[k])
                else:
                    micro = mb.select([0])
                    micro.loss_mask = torch.zeros_like(micro.loss_mask)
                lp, en = fsdp_call(self.model, lambda micro=micro: self._logprobs(self.model, micro, with_entropy=True))
            loss = self._micro_loss(micro, lp, en, local_tokens, local_seqs, stats)
            self.manual_backward(loss)
            loss_sum += float(loss.detach())
        stats.loss += loss_sum
        stats.steps += 1
        grad_norm = self._grad_norm()
        if self.optim_cfg.grad_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.optim_cfg.grad_clip, gradient_clip_algorithm="norm")
        stats.grad_norms.append(grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched = self.lr_schedulers()
        if sched is not None:
            (sched[0] if isinstance(sched, list) else sched).step()

    @staticmethod
    def _seq_valid(batch: RolloutBatch) -> torch.Tensor:
        counts = alg.segment_sum(batch.loss_mask.float(), batch.seq_ids, batch.num_seqs)
        return counts > 0

    def policy_loss(self, micro: RolloutBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss ``[T]`` of the configured objective and its detached diagnostics."""
        algo = self.algo
        if algo.objective == "reinforce":
            tok = alg.reinforce_loss(logp, micro.advantages)
            ratio = (logp.detach() - micro.old_logprobs).clamp(-alg.LOG_RATIO_CLAMP, alg.LOG_RATIO_CLAMP).exp()
            zero = torch.zeros_like(micro.loss_mask)
            return tok, {"ratio": ratio, "clipped": zero}
        if algo.objective == "gspo":
            return alg.gspo_loss(
                logp,
                micro.old_logprobs,
                micro.advantages,
                micro.cu_seqlens,
                micro.loss_mask,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
            )
        return alg.ppo_clip_loss(
            logp,
            micro.old_logprobs,
            micro.advantages,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
        )

    def _micro_loss(
        self,
        micro: RolloutBatch,
        logp: torch.Tensor,
        ent: torch.Tensor,
        mini_tokens: int,
        mini_seqs: int,
        stats: _Stats,
    ) -> torch.Tensor:
        algo = self.algo
        mask = micro.loss_mask
        mode = algo.loss_agg_mode
        norm = self.rollout_cfg.max_new_tokens
        # share of this micro-batch in the mini-batch normalizer (1 without micro-batching)
        if mode == "token-mean":
            scale = float(mask.sum()) / max(mini_tokens, 1)
        else:
            scale = float(self._seq_valid(micro).sum()) / max(mini_seqs, 1)

        def agg(values: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
            return alg.aggregate_loss(values, mask, micro.cu_seqlens, mode, token_weights=weights, norm_length=norm)

        tok, info = self.policy_loss(micro, logp)
        pg = agg(tok, micro.token_weights)
        loss = pg
        if algo.kl_coef > 0:
            kl = agg(alg.kl_penalty(logp, micro.ref_logprobs, algo.kl_estimator))
            loss = loss + algo.kl_coef * kl
            stats.add("kl", float(kl.detach()) * scale)
        ent_agg = agg(ent)
        if algo.entropy_coef != 0:
            loss = loss - algo.entropy_coef * ent_agg
        stats.add("pg_loss", float(pg.detach()) * scale)
        stats.add("entropy", float(ent_agg.detach()) * scale)
        stats.token_stats(info["ratio"], info["clipped"], micro.advantages, mask)
        return loss * scale

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    # ------------------------------------------------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[dict], batch_idx: int = 0) -> None:
        """One sample per prompt at the rollout temperature; logs ``val/reward`` (epoch mean) and response length."""
        prompts = self._check_prompts(batch)
        params = self.sampling_params(n=1)
        completions = self.generate(prompts, params)
        rewards = self.compute_rewards(batch, completions, 1)
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
        sync = self._distributed
        self.log(
            "val/reward",
            rewards.mean(),
            on_step=False,
            on_epoch=True,
            prog_bar=True,
            batch_size=len(batch),
            sync_dist=sync,
        )
        self.log(
            "val/response_length", lengths.mean(), on_step=False, on_epoch=True, batch_size=len(batch), sync_dist=sync
        )


class _Stats:
    """Accumulates the update metrics of one rollout step over mini-batches and micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.loss = 0.0
        self.steps = 0
        self.skipped = 0
        self.grad_norms: list[float] = []
        self.ratio_sum = 0.0
        self.ratio_min = math.inf
        self.ratio_max = -math.inf
        self.tokens = 0
        self.pos = [0, 0]  # clipped, total among A > 0 tokens
        self.neg = [0, 0]
        self.clipped = 0

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def token_stats(self, ratio: torch.Tensor, clipped: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> None:
        if not bool(mask.any()):
            return
        r = ratio[mask].float()
        c = clipped[mask]
        a = adv[mask]
        self.ratio_sum += float(r.double().sum())
        self.ratio_min = min(self.ratio_min, float(r.min()))
        self.ratio_max = max(self.ratio_max, float(r.max()))
        self.tokens += int(r.numel())
        self.clipped += int(c.sum())
        self.pos[0] += int((c & (a > 0)).sum())
        self.pos[1] += int((a > 0).sum())
        self.neg[0] += int((c & (a < 0)).sum())
        self.neg[1] += int((a < 0).sum())

    def finish(self, module: RLModule) -> dict[str, float]:
        steps = max(self.steps, 1)
        red = module._reduce(
            [self.ratio_sum, float(self.tokens), float(self.clipped), *map(float, self.pos), *map(float, self.neg)]
        )
        rsum, tokens, clipped, pc, pt, nc, nt = red
        rmin = module._reduce([self.ratio_min], "min")[0]
        rmax = module._reduce([self.ratio_max], "max")[0]
        out = {
            "loss": self.loss / steps,
            "grad_norm": sum(self.grad_norms) / max(len(self.grad_norms), 1) if self.grad_norms else math.nan,
            "update/optimizer_steps": float(self.steps),
            "update/skipped_steps": float(self.skipped),
            "clipfrac": clipped / tokens if tokens else math.nan,
            "clipfrac/pos": pc / pt if pt else math.nan,
            "clipfrac/neg": nc / nt if nt else math.nan,
            "ratio/mean": rsum / tokens if tokens else math.nan,
            "ratio/min": rmin if tokens else math.nan,
            "ratio/max": rmax if tokens else math.nan,
        }
        for k, v in self.sums.items():
            out[f"loss/{k}" if k in ("pg_loss", "kl") else k] = v / steps
        if module._trainer is not None and module.trainer.optimizers:
            out["lr"] = float(module.trainer.optimizers[0].param_groups[0]["lr"])
        return out
