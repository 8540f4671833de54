"""The version floors: ``rlexact.requirements`` against ``pyproject.toml``, the import-time check and its message."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlexact.requirements import MINIMUM_VERSIONS, check_versions, installed_versions, version_tuple

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _pyproject_floors() -> dict[str, str]:
    text = PYPROJECT.read_text()
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9][^",;\s]*)', text))


def test_floors_match_pyproject() -> None:
    """Each checked floor is the one ``pyproject.toml`` requires, so the two cannot drift apart."""
    floors = _pyproject_floors()
    assert {name: floors.get(name) for name in MINIMUM_VERSIONS} == MINIMUM_VERSIONS
    assert floors["triton"] == "3.6"  # torch 2.11's Triton, the one the GPU kernels were checked with


def test_version_tuple() -> None:
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert version_tuple("5.17.0.dev0") == (5, 17, 0)
    assert version_tuple("2.6") < version_tuple("2.6.6") < version_tuple("2.10")
    with pytest.raises(ValueError, match="'dev' does not start with a release number"):
        version_tuple("dev")


def test_installed_versions_pass_and_older_ones_are_named() -> None:
    """The installed libraries pass; older ones raise one ``ImportError`` naming each with its floor and the pip
    command (negative control: the floors themselves pass, one release below fails)."""
    check_versions(installed_versions())
    check_versions(MINIMUM_VERSIONS)
    with pytest.raises(ImportError) as err:
        check_versions({"torch": "2.10.0+cpu", "transformers": "5.16.1", "lightning": "2.6.0", "numpy": "1.0"})
    msg = str(err.value)
    assert "torch 2.10.0+cpu (needs >= 2.11)" in msg and "transformers 5.16.1 (needs >= 5.17)" in msg
    assert "lightning" not in msg.split("Upgrade")[0] and "numpy" not in msg
    assert msg.endswith("pip install -U 'torch>=2.11' 'transformers>=5.17'")


def test_import_checks_the_versions() -> None:
    """Importing rlexact with an older transformers (its reported version patched) fails with that message before
    anything has imported torch or transformers."""
    code = (
        "import importlib.metadata as m, sys\n"
        "real = m.version\n"
        "m.version = lambda name: '5.0.0' if name == 'transformers' else real(name)\n"
        "try:\n"
        "    import rlexact\n"
        "except ImportError as e:\n"
        "    print(e); print(sorted(k for k in ('torch', 'transformers', 'lightning') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "rlexact needs newer libraries: transformers 5.0.0 (needs >= 5.17)" in out
    assert out.splitlines()[-1] == "[]"
