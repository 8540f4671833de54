"""FSDP2 helpers for :class:`rlexact.RLModule` (Lightning ``ModelParallelStrategy``, ``fully_shard``).

Why these exist:

* The trainer's packed forward and the generator do not go through ``model.forward`` (they call the decoder and the
  fused log-prob head directly), so FSDP2's root pre/post-forward hooks would never run. :func:`apply_fsdp` registers
  one trampoline method on the root with ``register_fsdp_forward_method`` and :func:`fsdp_call` runs any function
  through it: the root's parameters (embeddings, final norm, lm head) are gathered, and its post-backward reduces
  their gradients.
* Every rank samples responses of different lengths, so it runs a different number of decode steps. A collective per
  layer forward would then deadlock. :func:`gathered_params` all-gathers every parameter once (the same number of
  collectives on every rank), keeps them gathered while the rollout and other no-grad scoring run, and reshards at the
  end. Training forwards/backwards run with normal per-layer FSDP; the module pads the number of micro-batches to the
  maximum over ranks so that their collectives line up.

Exactness under FSDP2: the all-gather copies parameters bit for bit, so every rank runs the same kernels on the same
full weights as a single process would (no tensor- or sequence-parallel reduction inside the forward), and rollout and
trainer log-probs stay bitwise equal on every rank. With a ``MixedPrecisionPolicy`` both paths see the same
``param_dtype`` copies; forward inputs are not cast and the rotary tables stay fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from rlexact.models import decoder

__all__ = ["apply_fsdp", "ddp_wrapper", "fsdp_call", "fsdp_modules", "gathered_params", "is_fsdp", "set_gradient_sync"]

T = TypeVar("T")
_CALL = "_rlexact_fsdp_call"
_RESHARD_ATTR = "_rlexact_reshard_after_forward"


def _fsdp_module_cls() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def is_fsdp(model: nn.Module) -> bool:
    """True when ``model`` (the root) was ``fully_shard``-ed."""
    cls = _fsdp_module_cls()
    return cls is not None and isinstance(model, cls)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every FSDP2-managed module under ``model`` (root included), in ``modules()`` order."""
    cls = _fsdp_module_cls()
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def _trampoline(fn: Callable[[], T]) -> T:
    return fn()


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root, on ``mesh`` (the data-parallel 1-D mesh).

    ``param_dtype`` / ``reduce_dtype`` form FSDP2's ``MixedPrecisionPolicy`` (none when ``param_dtype`` is None;
    forward inputs are never cast); ``reshard_after_forward`` applies to the decoder layers (the root stays gathered
    between forward and backward). Registers the trampoline used by :func:`fsdp_call`. Returns ``model`` (sharded in
    place).
    """
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import (
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

    kwargs: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
        )
    layers = getattr(decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
        setattr(layer, _RESHARD_ATTR, reshard_after_forward)
    fully_shard(model, **kwargs)
    setattr(model, _RESHARD_ATTR, False)  # FSDP2 keeps the root gathered between forward and backward
    model.__dict__[_CALL] = _trampoline
    register_fsdp_forward_method(model, _CALL)
    return model


def fsdp_call(model: nn.Module, fn: Callable[[], T]) -> T:
    """Run ``fn()`` as a forward of the FSDP2 root ``model`` (plain call when ``model`` is not sharded)."""
    if is_fsdp(model):
        call = getattr(model, _CALL, None)
        if call is None:
            raise RuntimeError("the FSDP model was not sharded with rlexact.distributed.apply_fsdp")
        return call(fn)
    return fn()


_GATHERED_ATTR = "_rlexact_params_gathered"


def _reshard_setting(module: nn.Module) -> bool | tuple:
    """What to restore after a gather: the setting :func:`apply_fsdp` recorded, else FSDP2's own post-forward
    mesh info (a module sharded by the user with its own ``reshard_after_forward``)."""
    recorded = getattr(module, _RESHARD_ATTR, None)
    if recorded is not None:
        return bool(recorded)
    try:
        group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - FSDP2 internals; fall back to fully_shard's default
        return True
    return True if group is None else ("mesh_info", group.post_forward_mesh_info)


def _restore_reshard_setting(module: nn.Module, saved: bool | tuple) -> None:
    if isinstance(saved, tuple):
        module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info = saved[1]  # type: ignore[attr-defined]
    else:
        module.set_reshard_after_forward(saved, recurse=False)  # type: ignore[attr-defined]


@contextlib.contextmanager
def gathered_params(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Keep every parameter of an FSDP2 ``model`` gathered inside the block; yields the FSDP modules (``[]``, a
    no-op, without FSDP).

    Each rank issues exactly one all-gather per FSDP module on entry, so the block may run any number of forwards
    (e.g. decode steps of a generate call, which differ across ranks) without per-forward collectives; on exit
    (``finally``) the previous reshard settings are restored and ``reshard()`` frees the full parameters. Every rank
    must enter and leave together. Reentrant: a nested block (the generator inside the module's rollout) reuses the
    outer gather. Use it for no-grad work only. Per-rank compute is unchanged by FSDP (docs/design.md §2.5), so
    exactness holds on every rank.
    """
    mods = fsdp_modules(model)
    if not mods or model.__dict__.get(_GATHERED_ATTR, False):  # no FSDP, or an enclosing block holds the gather
        yield mods
        return
    saved = [(m, _reshard_setting(m)) for m in mods]
    model.__dict__[_GATHERED_ATTR] = True
    try:
        for m in mods:
            m.set_reshard_after_forward(False, recurse=False)  # type: ignore[attr-defined]
        for m in mods:
            m.unshard()  # type: ignore[attr-defined]
        yield mods
    finally:
        model.__dict__[_GATHERED_ATTR] = False
        for m, setting in saved:
            _restore_reshard_setting(m, setting)
        for m in mods:
            m.reshard()  # type: ignore[attr-defined]


def ddp_wrapper(strategy: Any) -> nn.Module | None:
    """The ``DistributedDataParallel`` module that Lightning's ``strategy`` wraps the LightningModule in
    (``strategy="ddp"``), else None."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = getattr(strategy, "model", None)
    return wrapped if isinstance(wrapped, DistributedDataParallel) else None


def set_gradient_sync(model: nn.Module, enabled: bool, ddp: nn.Module | None = None) -> None:
    """Turn the gradient reduction on or off: FSDP2's reduce-scatter for every FSDP module of ``model``, and the
    all-reduce of ``ddp`` (:func:`ddp_wrapper`; what its ``no_sync`` switches). A no-op for what is absent.

    With it off, backward passes accumulate gradients locally; the next backward with it on reduces the sum once.
    Gradient accumulation over micro-batches turns it off for all but the last micro-batch of a mini-step, which gives
    the gradients of reducing after every micro-batch (up to the order of the sums) with one collective instead of
    one per micro-batch. Every rank must run the same number of backward passes with the same settings.
    """
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)  # type: ignore[attr-defined]
    if ddp is not None:
        ddp.require_backward_grad_sync = enabled
