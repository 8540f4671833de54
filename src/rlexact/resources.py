"""Files shipped in the package and the names that point at them from anywhere (no repository checkout needed).

- ``"demo"`` or ``"rlexact://demo"``: the demo's start checkpoint (``rlexact/demo/assets/checkpoint``: a tiny Qwen3
  and its character tokenizer). Accepted by ``RLModule(model_path=...)``, ``RLModule(tokenizer=...)`` and
  ``PromptDataModule(tokenizer=...)``.
- ``"rlexact://demo/<path>"``: a file under ``rlexact/demo/assets``, e.g. ``rlexact://demo/data/train.jsonl`` (the
  demo's prompts; accepted by ``PromptDataModule(path=...)``).
- ``"rlexact://configs/<name>"``: a recipe of ``rlexact/configs`` (e.g. ``rlexact://configs/demo.yaml``); the
  ``rlexact`` command also accepts the bare recipe name, ``rlexact fit --config demo.yaml``.

Any other string is returned unchanged by :func:`resolve`.
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "DEMO_MODEL",
    "SCHEME",
    "checkpoint_path",
    "config_path",
    "first_line",
    "missing_local_path",
    "load_named",
    "resolve",
]

T = TypeVar("T")

DEMO_MODEL = "demo"
"""Name of the packaged demo checkpoint."""
SCHEME = "rlexact://"
"""Prefix of the names of packaged files."""


def _package_dir() -> str:
    return os.fspath(importlib.resources.files("rlexact"))


def checkpoint_path() -> str:
    """Folder of the packaged demo checkpoint (``save_pretrained`` model + tokenizer + ``sft.json``)."""
    return os.path.join(_package_dir(), "demo", "assets", "checkpoint")


def config_path(name: str) -> str | None:
    """Path of the packaged recipe ``name`` (``"demo"``, ``"demo.yaml"``, ``"corrections/tis-srs-k3-corr-ratio"``),
    or None if there is none."""
    name = name[len(SCHEME + "configs/") :] if name.startswith(SCHEME + "configs/") else name
    if not name.endswith(".yaml"):
        name += ".yaml"
    path = os.path.join(_package_dir(), "configs", *name.split("/"))
    return path if os.path.isfile(path) else None


def resolve(path: str | os.PathLike) -> str:
    """The local path of a packaged name (see the module docstring); any other path is returned unchanged."""
    name = os.fspath(path)
    if name in (DEMO_MODEL, SCHEME + DEMO_MODEL):
        return checkpoint_path()
    if name.startswith(SCHEME + DEMO_MODEL + "/"):
        rest = name[len(SCHEME + DEMO_MODEL + "/") :]
        return os.path.join(_package_dir(), "demo", "assets", *rest.split("/"))
    if name.startswith(SCHEME + "configs/"):
        found = config_path(name)
        if found is None:
            raise FileNotFoundError(f"no packaged recipe {name!r}; see rlexact/configs")
        return found
    if name.startswith(SCHEME):
        raise FileNotFoundError(f"unknown packaged name {name!r}; use 'demo', 'rlexact://demo/...' or 'rlexact://configs/...'")
    return name


def missing_local_path(path: str | os.PathLike, suffixes: tuple[str, ...] = ()) -> str | None:
    """The local path ``path`` names (packaged names resolved, ``~`` expanded) when it can only be a local file or
    folder, never a Hub repository (it starts with ``/``, ``.`` or ``~``, is absolute, or ends in one of
    ``suffixes``), and nothing is there; else None."""
    name = os.path.expanduser(resolve(path))
    local = name.startswith(("/", ".")) or os.path.isabs(name) or name.lower().endswith(suffixes)
    return name if local and not os.path.exists(name) else None


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when the message is empty)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_named(load: Callable[[str], T], path: str, name: str, setting: str) -> T:
    """``load(path)`` (a transformers ``from_pretrained``); where it raises ``OSError`` and nothing is at ``path``,
    ``FileNotFoundError`` instead: ``name`` (the value of ``setting``) names no local folder and did not load as a
    Hub repository either. The error says where the local lookup started and how to mark a local path."""
    try:
        return load(path)
    except OSError as e:
        if os.path.exists(path):
            raise
        reason = first_line(e)
        raise FileNotFoundError(
            f"{setting} {name!r} is not a folder here (looked from {os.getcwd()}) and did not load as a Hub "
            f"repository ({reason}). For a local checkpoint give its absolute path or start it with ./"
        ) from None
