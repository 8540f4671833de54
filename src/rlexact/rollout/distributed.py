"""FSDP2 support: gather full parameters once per generate call, not once per decode step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules of ``model`` (itself included) wrapped by ``torch.distributed.fsdp.fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _reshard_setting(module: nn.Module) -> object:
    """The module's current post-forward reshard setting (FSDP2 internals; ``None`` if not inspectable)."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return None
    if group is None:
        return None
    return ("mesh_info", group.post_forward_mesh_info)


def _restore_reshard_setting(module: nn.Module, saved: object) -> None:
    if isinstance(saved, tuple) and saved and saved[0] == "mesh_info":
        group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
        group.post_forward_mesh_info = saved[1]
    else:
        module.set_reshard_after_forward(True, recurse=False)  # type: ignore[attr-defined]


@contextlib.contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Keep the full (unsharded) parameters of an FSDP2 model materialized inside the block.

    For every ``FSDPModule`` in ``model``: ``set_reshard_after_forward(False)`` and ``unshard()`` on entry, so the
    many forwards of a generate call (every prefill chunk and decode step) reuse one all-gather per module instead of
    all-gathering per forward; on exit (``finally``) the previous reshard setting is restored and ``reshard()`` frees
    the full parameters. Every rank must enter and leave together (the all-gathers are collectives). With no FSDP
    modules this is a no-op. Per-rank compute is unchanged by FSDP (DESIGN §2.5), so exactness holds on every rank.
    Between ``unshard`` and ``reshard`` the forwards issue no collectives, so ranks may run different numbers of
    steps (different prompts, different finish times) inside one generate call.
    """
    modules = fsdp_modules(model)
    if not modules:
        yield []
        return
    saved = [(m, _reshard_setting(m)) for m in modules]
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)  # type: ignore[attr-defined]
        for m in modules:
            m.unshard()  # type: ignore[attr-defined]
        yield modules
    finally:
        for m, setting in saved:
            _restore_reshard_setting(m, setting)
        for m in modules:
            m.reshard()  # type: ignore[attr-defined]
