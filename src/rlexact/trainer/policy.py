"""Policy setup: build or load the causal LM, exactify it, keep a frozen reference copy, shard it with FSDP2, and
keep its rotary tables fp32.

Everything here runs before the first training step (``RLModule.__init__`` / ``configure_model`` /
``on_fit_start``); nothing is called per step.
"""

from __future__ import annotations

import copy
import os
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch import nn

from rlexact.config import DTYPES, FSDPConfig
from rlexact.distributed import apply_fsdp, is_fsdp
from rlexact.models import exactify, get_state
from rlexact.models.text import TEXT_OF_MULTIMODAL
from rlexact.resources import load_named, missing_local_path, resolve

__all__ = [
    "apply_data_parallel",
    "as_config",
    "build_model",
    "check_fsdp_settings",
    "check_model_dtype",
    "check_model_source",
    "check_precision",
    "check_strategy",
    "check_trainer_options",
    "enable_activation_checkpointing",
    "make_reference",
    "restore_fp32_rope",
    "rope_fp32_snapshot",
]


def as_config(value: Any, cls: type) -> Any:
    """``value`` as a ``cls`` config dataclass: None -> defaults, a dict of its fields, or another dataclass with the
    same fields. Unknown dict keys raise ``ValueError`` listing the valid ones."""
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


def check_model_source(
    model_path: str | os.PathLike | None, model: Any, model_config: dict[str, Any] | None, dtype: str | None
) -> str | None:
    """Validate the model arguments of :class:`rlexact.RLModule` (exactly one source, an existing local path, a
    ``model_type`` in ``model_config``, a known dtype). Returns ``model_path`` as a string (or None)."""
    sources = {"model_path": model_path, "model": model, "model_config": model_config}
    given = [name for name, v in sources.items() if v is not None]
    if len(given) != 1:
        raise ValueError(
            f"RLModule needs exactly one of model_path, model, model_config; got {given or 'none'}"
            + (
                " (set model.init_args.model_path in the config; a checkpoint of a module built from a model object "
                "loads with RLModule.load_from_checkpoint(path, model=model))"
                if not given
                else ""
            )
        )
    if model_path is not None:
        model_path = os.fspath(model_path)
        if missing_local_path(model_path) is not None:  # "demo" names the packaged demo checkpoint
            raise FileNotFoundError(
                f"model_path {model_path!r} does not exist; set model.init_args.model_path to a local "
                "transformers checkpoint directory (e.g. a downloaded Qwen/Qwen3-1.7B)"
            )
    if model_config is not None and "model_type" not in model_config:
        raise ValueError("model_config needs a 'model_type' key (e.g. 'qwen3')")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers causal LM (nn.Module), got {type(model).__name__}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {dtype!r}")
    return model_path


def build_model(
    model_path: str | None, model_config: dict[str, Any] | None, dtype_name: str | None, init_seed: int
) -> nn.Module:
    """Load ``model_path`` with ``AutoModelForCausalLM.from_pretrained`` (in ``dtype_name``, else the checkpoint's
    dtype) or build a freshly initialized model from ``model_config`` (seeded by ``init_seed``, float32 by default).
    Image-text models whose text decoder rlexact trains (:data:`rlexact.models.text.TEXT_OF_MULTIMODAL`) load with
    ``AutoModelForImageTextToText``, which maps the ones ``AutoModelForCausalLM`` does not (Mistral 3)."""
    from transformers import AutoConfig

    dtype = DTYPES[dtype_name] if dtype_name else None
    if model_path is not None:
        path = os.path.expanduser(resolve(model_path))
        kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
        model_type = load_named(AutoConfig.from_pretrained, path, model_path, "model_path").model_type
        return _auto_class(model_type).from_pretrained(path, **kwargs)
    if model_config is None:
        raise ValueError("build_model needs model_path or model_config")
    cfg = dict(model_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return _auto_class(config.model_type).from_config(config, dtype=dtype or torch.float32)


def _auto_class(model_type: str) -> Any:
    """The transformers auto class that builds a ``model_type`` model with its LM head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if model_type in TEXT_OF_MULTIMODAL else AutoModelForCausalLM


def make_reference(model: nn.Module) -> nn.Module:
    """A frozen (no grad, eval) exactified deep copy of ``model``, taken before ``model`` itself is exactified
    (exactify's closures point at the modules they patch, so an already patched model is un-patched first)."""
    if get_state(model) is not None:
        exactify(model, enabled=False)
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return exactify(ref)


def rope_fp32_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of every rotary embedding's ``inv_freq``, by module name (see :func:`restore_fp32_rope`)."""
    return {
        name: m.inv_freq.detach().float().clone()
        for name, m in model.named_modules()
        if type(m).__name__.endswith("RotaryEmbedding") and isinstance(getattr(m, "inv_freq", None), torch.Tensor)
    }


def restore_fp32_rope(model: nn.Module | None, saved: dict[str, torch.Tensor]) -> None:
    """Put the fp32 ``inv_freq`` of ``saved`` back where a ``*-true`` trainer precision (``module.to(dtype)``) cast
    the rotary buffers; the exact kernels' RoPE tables are then rebuilt from it."""
    if model is None:
        return
    changed = False
    for name, m in model.named_modules():
        fp32 = saved.get(name)
        buf = getattr(m, "inv_freq", None)
        if fp32 is not None and isinstance(buf, torch.Tensor) and buf.dtype != torch.float32:
            m.inv_freq = fp32.to(buf.device)
            changed = True
    state = get_state(model)
    if changed and state is not None:
        state.rope_tables.clear()


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint every decoder layer of a transformers causal LM (non-reentrant ``torch.utils.checkpoint``).

    transformers' decoder layers checkpoint their ``forward`` only in training mode with grad enabled, so rollout and
    no-grad scoring run as before; FSDP2's hooks stay outside the checkpoint (its all-gather runs again for the
    recompute). The recompute runs the same kernels on the same inputs, so gradients match the run without
    checkpointing and the forward's values are untouched. Raises ``ValueError`` for a model without support.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support activation checkpointing; set activation_checkpointing=False"
        )
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers may hook the input embeddings to make their output require grad (needed by reentrant
    # checkpointing and adapters only); the hook would also fire in the no-grad rollout, so it is removed
    if getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None) is not None:
        model.disable_input_require_grads()


_UNSUPPORTED_DTYPE = (
    "which rlexact's exact kernels do not support (they accumulate in float32 and take "
    + ", ".join(repr(name) for name in DTYPES)
    + " parameters)"
)
"""The end of the errors about a model dtype outside :data:`rlexact.config.DTYPES`."""


def check_precision(trainer: Any, dtype: str | None = None) -> None:
    """Reject a Trainer precision that breaks exactness: a mixed (autocast) one changes the kernels of the trainer
    forward, and a float64 one (``64``, ``"64"`` or ``"64-true"``) converts the model to a dtype the exact kernels do
    not support (:data:`rlexact.config.DTYPES` lists those they do). Also reject a half precision (``"bf16-true"``,
    ``"16-true"``) that would convert the model away from the ``dtype`` the module was asked for
    (``RLModule(dtype=...)``; None: no request). Each error names ``RLModule(dtype=...)``, the setting that chooses
    the model's dtype instead."""
    precision = str(getattr(trainer, "precision", "32-true"))
    converts = {"bf16-true": "bfloat16", "16-true": "float16"}.get(precision)
    if converts is not None and dtype is not None and dtype != converts:
        raise ValueError(
            f"Trainer(precision={precision!r}) converts the model to {converts}, but RLModule(dtype={dtype!r}) asks "
            f"for {dtype}: choose the model's dtype with RLModule(dtype=...) alone and leave the Trainer precision "
            "at '32-true'"
        )
    if "mixed" in precision:
        raise ValueError(
            f"Trainer(precision={precision!r}) runs the step under autocast, which changes the kernels of the "
            "trainer forward and breaks rollout/trainer exactness; set RLModule(dtype='bfloat16') (or "
            "fsdp.param_dtype with ModelParallelStrategy) and leave the Trainer precision at '32-true'"
        )
    if precision.startswith("64"):
        raise ValueError(
            f"Trainer(precision={precision!r}) converts the model to float64, {_UNSUPPORTED_DTYPE}; set "
            "RLModule(dtype=...) to one of those (--model.init_args.dtype on the CLI) and leave the Trainer precision "
            "at '32-true'"
        )


def check_model_dtype(model: nn.Module) -> None:
    """Raise ``ValueError`` when a floating-point parameter of ``model`` has a dtype outside
    :data:`rlexact.config.DTYPES` (float64, say): the exact kernels would compute it in float32 without a word."""
    supported = DTYPES.values()
    bad = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype not in supported})
    if bad:
        raise ValueError(
            f"the model has {' and '.join(bad)} parameters, {_UNSUPPORTED_DTYPE}; pass RLModule(dtype=...) with one "
            "of those, which converts the model, or convert it before"
        )


def check_strategy(strategy: Any) -> None:
    """Reject a Trainer strategy RLModule cannot run: the generator samples from the module's own parameters between
    optimizer steps, which FSDP1's flat shards and DeepSpeed's engine do not leave readable. Single-device, DDP and
    ``ModelParallelStrategy`` (FSDP2, gathered for the rollout) are supported."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy

    supported = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, supported):
        raise ValueError(
            f"Trainer(strategy={type(strategy).__name__}) is not supported by RLModule, whose generator samples from "
            "the module's own parameters; use ModelParallelStrategy(data_parallel_size=<devices>, "
            "tensor_parallel_size=1) (FSDP2) or strategy='ddp' (a model that fits on each device)"
        )
    start = getattr(strategy, "_start_method", "popen")  # DDPStrategy keeps its start method only privately
    if isinstance(strategy, DDPStrategy) and start != "popen":
        raise ValueError(
            f"Trainer(strategy='ddp_{'notebook' if start == 'fork' else start}') trains in processes it starts and "
            "hands back only the weights that exist before RLModule builds its model, so the trained model would be "
            "lost; use strategy='ddp' (run the script with one process per device) or ModelParallelStrategy"
        )


def check_fsdp_settings(strategy: Any, config: FSDPConfig) -> None:
    """Refuse FSDP settings other than the defaults under a strategy that does not apply them (anything but
    ``ModelParallelStrategy``): they would be ignored, e.g. a bf16 ``param_dtype`` training in fp32."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if config != FSDPConfig() and not isinstance(strategy, ModelParallelStrategy):
        raise ValueError(
            f"RLModule(fsdp={config}) applies under ModelParallelStrategy only, and the Trainer's strategy is "
            f"{type(strategy).__name__}: use Trainer(strategy=ModelParallelStrategy(data_parallel_size=<devices>, "
            "tensor_parallel_size=1)), or drop fsdp (RLModule(dtype='bfloat16') computes in bf16 without it)"
        )


def check_trainer_options(trainer: Any) -> None:
    """Reject the Trainer's automatic gradient accumulation and clipping, naming the RLModule settings that do each
    (Lightning's own error for a manual-optimization module suggests switching to automatic optimization, which
    RLModule cannot do)."""
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip is not None and clip > 0:
        raise ValueError(
            f"Trainer(gradient_clip_val={clip}) is not applied by RLModule, which clips the global gradient norm "
            f"itself: remove it from the Trainer and set OptimConfig(grad_clip={clip}) (RLModule(optim=...); "
            "--model.init_args.optim.grad_clip on the CLI)"
        )
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={accumulate}) is not applied by RLModule, which accumulates gradients "
            "over the micro-batches of each mini-batch itself: remove it from the Trainer and set "
            "AlgorithmConfig(mini_batch_size=..., micro_batch_size=...) (sequences per optimizer step and per "
            "forward/backward on one rank)"
        )


def apply_data_parallel(model: nn.Module, ref_model: nn.Module | None, mesh: Any, config: FSDPConfig) -> None:
    """FSDP2-shard ``model`` (and ``ref_model``) over the data-parallel dimension of Lightning's device ``mesh``;
    a no-op without a mesh or when ``model`` is already sharded. A tensor-parallel dimension larger than 1 is
    rejected (its reductions inside the forward would break exactness)."""
    if mesh is None or is_fsdp(model):
        return
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() != 1:
        raise ValueError(
            "rlexact supports data parallelism only (tensor-parallel reductions break exactness): use "
            "ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1)"
        )
    dp_mesh = mesh["data_parallel"] if "data_parallel" in names else mesh
    kwargs = {
        "param_dtype": DTYPES[config.param_dtype] if config.param_dtype else None,
        "reduce_dtype": DTYPES[config.reduce_dtype] if config.reduce_dtype else None,
        "reshard_after_forward": config.reshard_after_forward,
    }
    apply_fsdp(model, dp_mesh, **kwargs)
    if ref_model is not None:
        apply_fsdp(ref_model, dp_mesh, **kwargs)
