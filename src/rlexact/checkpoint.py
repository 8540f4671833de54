"""Atomic checkpoint files: a crash (or a kill) while a checkpoint is written leaves the previous file intact.

:class:`AtomicCheckpointIO` writes ``torch.save`` output to a temporary file in the target's own directory, flushes
and fsyncs it, and renames it over the target with ``os.replace`` (atomic on POSIX and Windows within a
filesystem), then fsyncs the directory. Until the rename, the target is the last complete checkpoint; after it, the
new one. The temporary file of a failed write is removed.

:class:`rlexact.RLModule` installs it at setup when the strategy uses Lightning's default ``TorchCheckpointIO``
(single-process and DDP-style strategies); pass ``Trainer(plugins=[AtomicCheckpointIO()])`` to set it explicitly.
Sharded FSDP2 checkpoints (``ModelParallelStrategy(save_distributed_checkpoint=True)``) are directories written by
``torch.distributed.checkpoint`` and do not go through a ``CheckpointIO``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "atomic_torch_save"]


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through a temporary file in the same directory and ``os.replace``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # persist the rename itself (POSIX)
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` whose ``save_checkpoint`` is :func:`atomic_torch_save` (local paths only; loading
    and removal are ``TorchCheckpointIO``'s)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        target = os.fspath(path)
        if "://" in target:
            raise ValueError(
                f"{type(self).__name__} writes local files only, got {target!r}; use Lightning's TorchCheckpointIO "
                "for remote storage"
            )
        atomic_torch_save(checkpoint, target)
