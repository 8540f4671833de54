"""Export a trained policy as a plain transformers checkpoint (model and tokenizer).

``rlexact export CKPT DIR`` (or :func:`export_checkpoint`) turns a Lightning checkpoint of :class:`rlexact.RLModule`
into a folder that ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load.

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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlexact.distributed import is_fsdp
from rlexact.models import ATTN_IMPL, get_state

__all__ = ["export_checkpoint", "main", "save_pretrained"]

_ATTN_KEYS = ("_attn_implementation", "attn_implementation", "_attn_implementation_internal")


def _unwrap(module_or_model: Any) -> nn.Module:
    if hasattr(module_or_model, "save_pretrained"):
        return module_or_model
    model = getattr(module_or_model, "model", None)
    if model is not None and hasattr(model, "save_pretrained"):
        return model
    raise TypeError(
        f"expected an rlexact.RLModule or a transformers PreTrainedModel, got {type(module_or_model).__name__}"
    )


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
        module_or_model: an :class:`rlexact.RLModule` (its ``.model`` is saved) or a transformers causal LM,
            exactified or not, FSDP2-sharded or not.
        save_directory: output folder (created).
        tokenizer: a tokenizer object to save alongside (``tokenizer.save_pretrained``); None saves an
            ``RLModule``'s own tokenizer (``module.tokenizer``) and nothing for a bare model.
        safe_serialization: write safetensors.
        **kwargs: forwarded to ``PreTrainedModel.save_pretrained``.

    Returns:
        The output directory as a string. The in-memory model is left exactly as it was (still exactified).
    """
    model = _unwrap(module_or_model)
    if tokenizer is None and model is not module_or_model:
        tokenizer = getattr(module_or_model, "tokenizer", None)
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
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
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


def export_checkpoint(ckpt_path: str | os.PathLike, save_directory: str | os.PathLike, module_class: Any = None) -> str:
    """Load an :class:`rlexact.RLModule` Lightning checkpoint (a ``.ckpt`` file) and :func:`save_pretrained` its
    policy and tokenizer into ``save_directory``; returns the directory.

    Args:
        ckpt_path: a checkpoint file written by ``Trainer.fit`` / ``ModelCheckpoint`` (sharded FSDP2 checkpoint
            folders are not supported: write a full checkpoint, e.g. ``ModelParallelStrategy(
            save_distributed_checkpoint=False)``).
        save_directory: output folder (created).
        module_class: the ``RLModule`` subclass that wrote the checkpoint (default ``RLModule``).
    """
    from rlexact.module import RLModule

    path = os.fspath(ckpt_path)
    if os.path.isdir(path):
        raise ValueError(
            f"{path!r} is a folder (a sharded distributed checkpoint); export needs a full checkpoint file: train with "
            "ModelParallelStrategy(save_distributed_checkpoint=False) or consolidate the folder first"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    module = (module_class or RLModule).load_from_checkpoint(path, map_location="cpu")
    module.configure_model()
    return save_pretrained(module, save_directory)


def main(argv: list[str] | None = None) -> str:
    """``rlexact export CKPT DIR``: a Lightning checkpoint of an RLModule -> a transformers folder with the
    tokenizer."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser(prog="rlexact export", description=main.__doc__)
    parser.add_argument("ckpt", help="checkpoint file (.ckpt) written by Trainer.fit / ModelCheckpoint")
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
        cls = getattr(importlib.import_module(module_name), attr)
    out = export_checkpoint(args.ckpt, args.out, cls)
    print(f"exported {args.ckpt} to {out}", flush=True)
    return out
