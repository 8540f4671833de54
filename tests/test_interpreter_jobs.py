"""The background interpreter jobs (``interpreter_jobs.py``, ``conftest.py``): a marked test gets its own finished
subprocess, run under ``TRITON_INTERPRET=1`` from the repository root, with its exit status and output intact."""

from __future__ import annotations

import subprocess

import pytest

PROBE = "import os, sys; print(os.environ['TRITON_INTERPRET'], os.getcwd()); sys.exit(int(sys.argv[1]))"


@pytest.mark.interpreter("-c", PROBE, "0")
def test_job_succeeds_under_the_interpreter(interpreter_run: subprocess.CompletedProcess) -> None:
    from interpreter_jobs import ROOT

    assert interpreter_run.returncode == 0
    assert interpreter_run.stdout.split() == ["1", str(ROOT)]


@pytest.mark.interpreter("-c", PROBE, "3")
def test_job_failure_reaches_the_test(interpreter_run: subprocess.CompletedProcess) -> None:
    assert interpreter_run.returncode == 3  # a failing check script is seen as failing


def test_unmarked_test_cannot_ask_for_a_job(request: pytest.FixtureRequest) -> None:
    with pytest.raises(pytest.UsageError, match="without an @pytest.mark.interpreter"):
        request.getfixturevalue("interpreter_run")
