"""Provenance recorded in benchmark results, demo summaries and the SFT report: versions, device, git commit."""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
"""The repository root above ``src/rlexact`` when this package runs from a checkout (elsewhere for a wheel)."""

COMMIT_ENV = "RLEXACT_COMMIT"
"""Environment variable that supplies the commit where the tree has no ``.git`` (e.g. a copied working tree)."""


def library_versions(*modules: str) -> dict[str, str]:
    """``{"python": ..., "torch": ..., <module>: <version>}``; a module that fails to import is recorded as
    ``"unavailable: <error>"`` rather than raising (e.g. triton on a CPU-only machine)."""
    out = {"python": platform.python_version()}
    for name in ("torch", *modules):
        try:
            out[name] = str(importlib.import_module(name).__version__)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
            out[name] = f"unavailable: {exc!r}"
    return out


COMMIT_ID = r"[0-9a-f]{7,40}"
"""A commit id as results record it: 7 to 40 lowercase hexadecimal characters (a regular expression)."""


def named_commit() -> str | None:
    """``$RLEXACT_COMMIT``, or ``None`` when it is unset or empty.

    Raises ``ValueError`` naming the variable when it is set to anything but a commit id (7 to 40 lowercase
    hexadecimal characters), so a mistyped command fails before it runs rather than recording a result under a name
    no citation can check."""
    named = os.environ.get(COMMIT_ENV, "")
    if not named:
        return None
    if not re.fullmatch(COMMIT_ID, named):
        raise ValueError(
            f"{COMMIT_ENV}={named!r} is not a commit id: set it to the hexadecimal sha (7 to 40 characters; the "
            f"full 40 where the tree's .git may be stale) of the commit whose sources this tree holds, e.g. what "
            f"`git rev-parse HEAD` prints on the checkout the tree was copied from, or unset it to read this tree's "
            f"own .git"
        )
    return named


def git_commit(path: str | Path | None = None, tree_digest: str | None = None) -> str:
    """:func:`named_commit` when set (a copied working tree may carry a stale ``.git``), with ``+mismatch`` when this
    checkout knows that commit and its sources are not the ones here (:func:`names_other_code`, given the tree's
    ``tree_digest`` where the caller has it); else the ``HEAD`` commit of the repository holding ``path`` (default:
    this package), with ``+dirty`` when tracked files differ from it; else ``"unknown"``."""
    named = named_commit()
    if named is not None:
        return named + ("+mismatch" if names_other_code(named, tree_digest) else "")
    cwd = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


SOURCE_DIRS = ("src/rlexact", "benchmarks")
"""The repository folders whose Python files make up a result's code: the library and the benchmark scripts."""


def is_source(path: str) -> bool:
    """Whether the repository-relative POSIX ``path`` is one of a result's source files: a ``.py`` file anywhere under
    ``src/rlexact`` or directly in ``benchmarks``."""
    if not path.endswith(".py"):
        return False
    return path.startswith("src/rlexact/") or path.count("/") == 1 and path.startswith("benchmarks/")


def digest_files(files: Mapping[str, bytes]) -> str:
    """SHA-256 over ``{repository-relative path: contents}`` in path order, each path and length framed, so renaming,
    moving or editing any file changes it."""
    h = hashlib.sha256()
    for path in sorted(files):
        data = files[path]
        h.update(f"{path}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def source_digest(root: str | Path | None = None) -> str | None:
    """:func:`digest_files` of the :func:`is_source` files of the working tree at ``root`` (default: the repository
    holding this package), or ``None`` where this package is not in a ``src/`` checkout (an installed wheel). A
    result records it beside its commit, so a check can tell whether the tree that ran was that commit's."""
    root = Path(root) if root is not None else CHECKOUT_ROOT
    if not (root / "src" / "rlexact").is_dir():
        return None
    files = {}
    for folder in SOURCE_DIRS:
        for p in (root / folder).rglob("*.py"):
            rel = p.relative_to(root).as_posix()
            if is_source(rel):
                files[rel] = p.read_bytes()
    return digest_files(files)


def commit_sources(commit: str, root: str | Path) -> dict[str, bytes]:
    """The :func:`is_source` files of ``commit`` in the git repository at ``root``, read through git (what
    :func:`source_digest` reads from a working tree)."""
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "-z", "--name-only", commit, "--", *SOURCE_DIRS],
        cwd=root, capture_output=True, check=True, timeout=60,
    ).stdout.decode()  # fmt: skip
    paths = sorted(p for p in listing.split("\0") if p and is_source(p))
    request = "".join(f"{commit}:{p}\n" for p in paths).encode()
    out = subprocess.run(["git", "cat-file", "--batch"], cwd=root, input=request, capture_output=True, check=True,
                         timeout=60).stdout  # fmt: skip
    files, at = {}, 0
    for path in paths:
        header_end = out.index(b"\n", at)
        size = int(out[at:header_end].split()[2])
        files[path] = out[header_end + 1 : header_end + 1 + size]
        at = header_end + 1 + size + 1
    return files


def is_commit(commit: str, root: str | Path) -> bool:
    """Whether ``commit`` names a commit of the git repository at ``root`` (False without git or a repository)."""
    try:
        return subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True,
                              timeout=30).returncode == 0  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False


def names_other_code(commit: str, tree_digest: str | None = None) -> bool:
    """Whether ``commit`` is a commit of the git checkout holding this package whose :func:`commit_sources` differ
    from the :func:`source_digest` of the working tree (``tree_digest``, computed here when None; False where that
    cannot be told: no checkout, an unknown commit, an installed wheel)."""
    tree = tree_digest if tree_digest is not None else source_digest()
    if tree is None:
        return False
    return is_commit(commit, CHECKOUT_ROOT) and digest_files(commit_sources(commit, CHECKOUT_ROOT)) != tree


def device_name() -> str:
    """The CUDA device's name when one is visible, else the CPU's."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "cpu"


def host_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The host CPU's model name (the first ``model name`` of ``cpuinfo`` on Linux), else ``platform.processor()``,
    else ``"unknown"``. Host-bound timings (eager launches, the trainer's update) move with it."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def result_header(name: str, *libraries: str) -> dict:
    """The provenance block every committed result starts with: ``benchmark`` name, ``command`` line, git
    ``commit`` and the :func:`source_digest` of the tree that ran, UTC ``date``, ``device``, the host's CPU model and
    count, library ``versions`` and the ``RLEXACT_*`` environment variables that change how kernels are chosen or
    launched."""
    digest = source_digest()
    return {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(tree_digest=digest),
        "source_digest": digest,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "host_cpu": host_cpu(),
        "cpu_count": os.cpu_count(),
        "versions": library_versions(*libraries),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RLEXACT_") and k != COMMIT_ENV},
    }
