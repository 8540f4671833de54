"""Export a trained policy as a plain transformers checkpoint (model and tokenizer).

``rlexact export CKPT DIR`` (or :func:`export_checkpoint`) turns a Lightning checkpoint of :class:`rlexact.RLModule`
into a folder that ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load.
``CKPT`` is a checkpoint file, or the sharded ``torch.distributed.checkpoint`` folder that ``ModelParallelStrategy``
(FSDP2) writes by default (``save_distributed_checkpoint=True``): its shards (``*.distcp``, indexed by
``.metadata``) hold the module's ``state_dict`` and the optimizer states, and ``meta.pt`` holds the rest of the
checkpoint (hyperparameters, loop and callback states). A folder is read in this process with torch's public DCP
API and no process group: only the ``state_dict`` tensors are read, in full, and written with ``meta.pt``'s entries
as one checkpoint file in a temporary directory (``tempfile``'s, so under ``TMPDIR``), which is removed however the
export ends; the file is then loaded like any checkpoint file.

The module is rebuilt from the checkpoint's hyperparameters (``module_class.load_from_checkpoint``), so what they
name must be loadable here (``model_path``, the tokenizer). A module built from a model object
(``RLModule(model=...)``) has no model source in its checkpoint: pass the object, ``export_checkpoint(CKPT, DIR,
model=...)``.

A checkpoint or output the export cannot use raises :class:`ExportError`, chained to the error behind it: a missing
path, a file that is not a Lightning checkpoint (torch.load's ``weights_only=True`` reader refuses it), a folder that
is not a complete sharded checkpoint, a module that cannot be rebuilt from the checkpoint (its own argument checks'
``ValueError`` / ``TypeError`` / ``OSError``, or a ``RuntimeError`` raised by rlexact itself, e.g. a placeholder for
an object the checkpoint did not save), or an output folder that cannot be written. The ``rlexact`` command prints
it in one line and exits with status 2; any other error keeps its traceback.

:func:`save_pretrained` writes what ``AutoModelForCausalLM.from_pretrained(dir)`` loads back with identical weights:
the exactify patches live only on the in-memory object (instance ``forward`` replacements and
``config._attn_implementation = "rlexact"``) and are kept out of the saved files — the attention implementation is
set back to the one the model had before :func:`rlexact.exactify` while saving, and any attention-implementation key
that still names ``"rlexact"`` is removed from ``config.json``. An FSDP2-sharded model is gathered into a full state
dict (every rank must call this; rank 0 writes).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
import zipfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlexact.distributed import is_fsdp
from rlexact.models import ATTN_IMPL, get_state

__all__ = ["ExportError", "export_checkpoint", "main", "save_pretrained"]

_ATTN_KEYS = ("_attn_implementation", "attn_implementation", "_attn_implementation_internal")
_SHARDS_INDEX = ".metadata"
"""``torch.distributed.checkpoint``'s index of the shards in a sharded checkpoint folder."""
_LIGHTNING_META = "meta.pt"
"""The rest of the checkpoint (all but ``state_dict`` and the optimizer states) in a sharded checkpoint folder, written
by ``ModelParallelStrategy.save_checkpoint`` on rank 0."""
_STATE_DICT = "state_dict."
"""The shards' key prefix of the module's ``state_dict`` entries (DCP flattens the nested dict with dots)."""
_WHAT_TO_PASS = "pass a .ckpt file or sharded checkpoint folder written by Trainer.fit / ModelCheckpoint"


class ExportError(ValueError):
    """A checkpoint or output folder that the export cannot use; the message (one line) names the problem and the
    fix, and the exception is chained to the error behind it."""


def _one_line(error: BaseException) -> str:
    """``"Type: message"`` in one line; for torch.load's ``weights_only`` refusal, only its reason."""
    text = str(error)
    reason = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    return f"{type(error).__name__}: {' '.join((reason.group(1) if reason else text).split())}"


def _unwrap(module_or_model: Any) -> nn.Module:
    if hasattr(module_or_model, "save_pretrained"):
        return module_or_model
    model = getattr(module_or_model, "model", None)
    if model is not None and hasattr(model, "save_pretrained"):
        return model
    name = type(module_or_model).__name__
    if model is None and hasattr(module_or_model, "model") and hasattr(module_or_model, "configure_model"):
        raise RuntimeError(
            f"the model of this {name} is not built yet: call module.configure_model() first (Lightning does it in fit)"
        )
    got = name if model is None else f"{name} whose .model is a {type(model).__name__} (no save_pretrained)"
    raise TypeError(f"expected an rlexact.RLModule or a transformers PreTrainedModel, got {got}")


def _configs(model: nn.Module) -> list[Any]:
    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def save_pretrained(
    module_or_model: Any,
    save_directory: str | os.PathLike,
    tokenizer: Any = None,
    *,
    safe_serialization: bool = True,
    **kwargs: Any,
) -> str:
    """Save the policy (and optionally the tokenizer) as a transformers checkpoint in ``save_directory``.

    Args:
        module_or_model: an :class:`rlexact.RLModule` with its model built (:meth:`~rlexact.RLModule.configure_model`,
            which Lightning calls in fit; ``RuntimeError`` before) or a transformers causal LM, exactified or not,
            FSDP2-sharded or not.
        save_directory: output folder (created).
        tokenizer: a tokenizer object to save alongside (``tokenizer.save_pretrained``); None saves an
            ``RLModule``'s own tokenizer (``module.tokenizer``) and nothing for a bare model. The tokenizer is
            resolved before anything is written, so a tokenizer that fails to load leaves no partial folder.
        safe_serialization: write safetensors.
        **kwargs: forwarded to ``PreTrainedModel.save_pretrained``.

    Returns:
        The output directory as a string. The in-memory model is left exactly as it was (still exactified).
    """
    model = _unwrap(module_or_model)
    if tokenizer is None and model is not module_or_model:
        tokenizer = getattr(module_or_model, "tokenizer", None)
    save_tokenizer = tokenizer.save_pretrained if tokenizer is not None else None  # fails here, before any write
    out = os.fspath(save_directory)
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    state = get_state(model)
    original = (state.original_attn_impl if state is not None else None) or "sdpa"
    configs = _configs(model)
    previous = [cfg._attn_implementation for cfg in configs]
    state_dict = None
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    try:
        for cfg in configs:
            if cfg._attn_implementation == ATTN_IMPL:
                cfg._attn_implementation = original
        if rank0:
            os.makedirs(out, exist_ok=True)
            with torch.no_grad():
                model.save_pretrained(out, state_dict=state_dict, safe_serialization=safe_serialization, **kwargs)
            _strip_attn_impl(os.path.join(out, "config.json"))
            if save_tokenizer is not None:
                save_tokenizer(out)
    finally:
        for cfg, prev in zip(configs, previous):
            cfg._attn_implementation = prev
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def _strip_attn_impl(path: str) -> None:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    changed = False
    for key in _ATTN_KEYS:
        if cfg.get(key) == ATTN_IMPL:
            del cfg[key]
            changed = True
    if changed:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")


def export_checkpoint(
    ckpt_path: str | os.PathLike,
    save_directory: str | os.PathLike,
    module_class: Any = None,
    **overrides: Any,
) -> str:
    """Load an :class:`rlexact.RLModule` Lightning checkpoint and :func:`save_pretrained` its policy and tokenizer
    into ``save_directory``; returns the directory.

    Args:
        ckpt_path: a checkpoint file written by ``Trainer.fit`` / ``ModelCheckpoint``, or the sharded
            ``torch.distributed.checkpoint`` folder that ``ModelParallelStrategy`` writes (see the module docstring:
            read in this process, through a temporary file that is always removed).
        save_directory: output folder (created).
        module_class: the ``RLModule`` subclass that wrote the checkpoint (default ``RLModule``).
        **overrides: arguments of ``module_class`` that replace or supply the checkpoint's hyperparameters (those of
            ``load_from_checkpoint``), e.g. ``model=`` the model object of a module built with one (its weights are
            then loaded from the checkpoint, and the object is exactified).

    Raises:
        ExportError: a checkpoint or output folder the export cannot use (the module docstring lists them).
    """
    from rlexact.module import RLModule

    path = os.fspath(ckpt_path)
    cls = module_class or RLModule
    if os.path.isdir(path):
        meta = _sharded_meta(path)
        with tempfile.TemporaryDirectory(prefix="rlexact-export-") as tmp:
            file = os.path.join(tmp, "checkpoint.ckpt")
            _consolidate(path, meta, file)
            module, tokenizer = _load_module(cls, file, path, meta, overrides)
    elif os.path.exists(path):
        checkpoint = _read_checkpoint(path, path)
        if "state_dict" not in checkpoint:
            raise ExportError(f"{path!r} is not a Lightning checkpoint (it has no 'state_dict'); {_WHAT_TO_PASS}")
        module, tokenizer = _load_module(cls, path, path, checkpoint, overrides)
    else:
        raise ExportError(f"FileNotFoundError: checkpoint {path!r} does not exist; {_WHAT_TO_PASS}")
    try:
        return save_pretrained(module, save_directory, tokenizer)
    except OSError as e:
        raise ExportError(f"cannot write {os.fspath(save_directory)!r}: {_one_line(e)}") from e


def _read_checkpoint(path: str, shown: str) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` on the CPU, memory-mapped where the file allows (the tensors are read
    on use), as a dict; anything else is an :class:`ExportError` naming ``shown``."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except OSError as e:
        raise ExportError(f"cannot read {shown!r}: {_one_line(e)}") from e
    except Exception as e:  # a file torch's weights-only reader refuses (any failure): not a Lightning checkpoint
        raise ExportError(
            f"{shown!r} is not a Lightning checkpoint that torch.load(weights_only=True) reads ({_one_line(e)}); "
            + _WHAT_TO_PASS
        ) from e
    if not isinstance(checkpoint, dict):
        raise ExportError(
            f"{shown!r} is not a Lightning checkpoint (it holds a {type(checkpoint).__name__}); {_WHAT_TO_PASS}"
        )
    return checkpoint


def _sharded_meta(folder: str) -> dict[str, Any]:
    """The checkpoint without its weights and optimizer states (``meta.pt``) of a sharded checkpoint folder."""
    missing = [name for name in (_LIGHTNING_META, _SHARDS_INDEX) if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ExportError(
            f"{folder!r} is a folder but not a sharded Lightning checkpoint: it has no {' and no '.join(missing)} "
            f"(ModelParallelStrategy writes the shards, their index {_SHARDS_INDEX} and {_LIGHTNING_META}); "
            + _WHAT_TO_PASS
        )
    return _read_checkpoint(os.path.join(folder, _LIGHTNING_META), os.path.join(folder, _LIGHTNING_META))


def _consolidate(folder: str, meta: dict[str, Any], file: str) -> None:
    """Write ``meta`` with the full ``state_dict`` read from the folder's shards (the tensors only, not the optimizer
    states) to ``file``, with torch's public DCP reader in this process (no process group)."""
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(folder)
    try:
        with warnings.catch_warnings():  # no_dist=True is the intent: DCP warns about it all the same
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            entries = reader.read_metadata().state_dict_metadata
            state_dict = {
                key.removeprefix(_STATE_DICT): torch.empty(entry.size, dtype=entry.properties.dtype)
                for key, entry in entries.items()
                if key.startswith(_STATE_DICT) and isinstance(entry, TensorStorageMetadata)
            }
            if state_dict:
                load({"state_dict": state_dict}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # an incomplete or corrupt folder (e.g. a save that was killed)
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        raise ExportError(
            f"{folder!r} is not a complete sharded checkpoint: reading its shards fails ({_one_line(cause)}); export "
            "a checkpoint whose save finished"
        ) from e
    if not state_dict:
        raise ExportError(f"{folder!r} holds no 'state_dict' tensors in its shards; {_WHAT_TO_PASS}")
    torch.save({**meta, "state_dict": state_dict}, file)


def _raised_by_rlexact(error: BaseException) -> bool:
    """Whether ``error`` was raised in rlexact's own code (the innermost frame of its traceback)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] == "rlexact"


def _load_module(
    cls: Any, file: str, shown: str, checkpoint: dict[str, Any], overrides: dict[str, Any]
) -> tuple[Any, Any]:
    """The module of checkpoint ``file`` with its model built, and its tokenizer; the errors that say the checkpoint
    cannot rebuild the module as an :class:`ExportError` naming ``shown``."""
    try:
        module = cls.load_from_checkpoint(file, map_location="cpu", **overrides)
        module.configure_model()
        tokenizer = module.tokenizer  # loaded here: its errors are the checkpoint's (e.g. an unsaved tokenizer object)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not _raised_by_rlexact(e):
            raise
        hparams = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {}
        sources = ("model_path", "model_config")
        if "model" not in overrides and all(k in hparams and hparams[k] is None for k in sources):
            raise ExportError(
                f"{shown!r} holds no model source: its module was built from a model object (RLModule(model=...)), "
                "which checkpoints do not save; export it in Python with that object: "
                f"rlexact.export.export_checkpoint({shown!r}, DIR, model=<the model>)"
            ) from e
        raise ExportError(f"cannot load {cls.__name__} from {shown!r}: {_one_line(e)}") from e
    return module, tokenizer


def main(argv: list[str] | None = None) -> str:
    """``rlexact export CKPT DIR``: a Lightning checkpoint of an RLModule (a file or a sharded checkpoint folder) ->
    a transformers folder with the tokenizer."""
    import argparse
    import importlib

    from rlexact.module import RLModule

    parser = argparse.ArgumentParser(prog="rlexact export", description=main.__doc__)
    parser.add_argument(
        "ckpt", help="checkpoint file (.ckpt) or sharded checkpoint folder written by Trainer.fit / ModelCheckpoint"
    )
    parser.add_argument("out", help="output folder for save_pretrained (model + tokenizer)")
    parser.add_argument(
        "--module-class",
        default=None,
        help="import path of the RLModule subclass that wrote the checkpoint (pkg.mod:Name); default rlexact.RLModule",
    )
    args = parser.parse_args(argv)
    cls = None
    if args.module_class:
        module_name, _, attr = args.module_class.replace(":", ".").rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:  # ValueError: no module part
            raise ExportError(f"--module-class {args.module_class!r} does not import ({_one_line(e)})") from e
        if not (isinstance(cls, type) and issubclass(cls, RLModule)):
            raise ExportError(f"--module-class {args.module_class!r} is not an rlexact.RLModule subclass")
    out = export_checkpoint(args.ckpt, args.out, cls)
    print(f"exported {args.ckpt} to {out}", flush=True)
    return out
