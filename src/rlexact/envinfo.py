"""Library versions recorded in benchmark results, demo summaries and the SFT report."""

from __future__ import annotations

import importlib
import platform


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
