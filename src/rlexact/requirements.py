"""The lowest versions of the libraries rlexact patches or subclasses. Importing this module checks them
(:func:`check_versions`), and ``rlexact/__init__.py`` imports it before anything else.

``pyproject.toml`` states the same floors (``tests/test_requirements.py`` keeps the two equal) and CI runs the CPU suite
at them (``scripts/check_floors.sh``). Below them the library does not merely run slower: older transformers classes
return their outputs in other orders or name their settings differently, so checks that refuse what the kernels do not
implement could miss a setting. pip enforces the floors at install; this check covers an environment changed after
that (``--no-deps`` installs, another package manager).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata

__all__ = ["MINIMUM_VERSIONS", "check_versions", "installed_versions", "version_tuple"]

MINIMUM_VERSIONS: dict[str, str] = {"torch": "2.11", "transformers": "5.17", "lightning": "2.6"}
"""Distribution name → lowest supported release."""


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version`` (``"2.11.0+cu130"`` → ``(2, 11, 0)``, ``"5.17.0.dev0"`` →
    ``(5, 17, 0)``). Raises ``ValueError`` when it does not start with a number."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    if m is None:
        raise ValueError(f"version {version!r} does not start with a release number")
    return tuple(int(p) for p in m.group(0).split("."))


def installed_versions() -> dict[str, str]:
    """The installed version of each distribution of :data:`MINIMUM_VERSIONS` (absent ones are left out)."""
    found = {}
    for name in MINIMUM_VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def check_versions(installed: Mapping[str, str]) -> None:
    """Raise ``ImportError`` naming every distribution of ``installed`` older than its :data:`MINIMUM_VERSIONS`
    floor, with the ``pip install`` command that upgrades them all."""
    old = {
        name: version
        for name, version in installed.items()
        if name in MINIMUM_VERSIONS and version_tuple(version) < version_tuple(MINIMUM_VERSIONS[name])
    }
    if old:
        found = ", ".join(f"{name} {version} (needs >= {MINIMUM_VERSIONS[name]})" for name, version in old.items())
        upgrade = " ".join(f"'{name}>={MINIMUM_VERSIONS[name]}'" for name in old)
        raise ImportError(f"rlexact needs newer libraries: {found}. Upgrade them: pip install -U {upgrade}")


check_versions(installed_versions())
