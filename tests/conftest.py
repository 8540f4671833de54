"""Shared test configuration: GPU tests are skipped without CUDA, and the Triton-interpreter checks of tests marked
``interpreter`` run as background jobs (``interpreter_jobs.py``). The shared model helpers live in ``models.py``."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch

from interpreter_jobs import DEFAULT_TIMEOUT_S, InterpreterJobs, interpreter_defect

JOBS = pytest.StashKey[InterpreterJobs]()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "interpreter(script, *args, timeout=600): runs `python script *args` under the Triton interpreter as a "
        "background job from the end of collection; the test reads it through the interpreter_run fixture",
    )
    config.stash[JOBS] = InterpreterJobs()


def pytest_unconfigure(config: pytest.Config) -> None:
    if JOBS in config.stash:
        config.stash[JOBS].close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Submit the interpreter job of every selected ``interpreter`` test, or skip them all where this environment
    cannot run them (no triton; :func:`interpreter_jobs.interpreter_defect`, probed only when one is selected)."""
    interpreted = [item for item in session.items if item.get_closest_marker("interpreter") is not None]
    if not interpreted:
        return
    reason = "needs triton" if not HAS_TRITON else interpreter_defect()
    jobs = session.config.stash[JOBS]
    for item in interpreted:
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        else:
            marker = item.get_closest_marker("interpreter")
            jobs.submit(tuple(marker.args), marker.kwargs.get("timeout", DEFAULT_TIMEOUT_S))


@pytest.fixture
def interpreter_run(request: pytest.FixtureRequest) -> subprocess.CompletedProcess:
    """The finished interpreter job of this test's ``interpreter`` marker."""
    marker = request.node.get_closest_marker("interpreter")
    if marker is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses interpreter_run without an @pytest.mark.interpreter")
    return request.config.stash[JOBS].result(tuple(marker.args), marker.kwargs.get("timeout", DEFAULT_TIMEOUT_S))
