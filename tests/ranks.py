"""Running a two-rank worker script from a test: Lightning's launcher re-runs the script for rank 1, which it cannot
do for a pytest process, so the test starts the script as a subprocess and rank 1 shares its stdout and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT_CHARS = 40_000
"""How much of a failed run's stderr the report keeps: enough for both ranks' tracebacks (the rank that failed first
prints before the rank that then lost its peer, so a short tail shows only the second)."""


def run_ranks(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python script *args`` from the repository root with one thread per rank, a free port picked by Lightning,
    and Python's fault handler on in every rank (a rank killed by a signal prints its stack)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.pop("MASTER_PORT", None)
    return subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def ranks_report(proc: subprocess.CompletedProcess) -> str:
    """The exit status, stdout's tail and stderr's last :data:`REPORT_CHARS` characters of a failed run."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-REPORT_CHARS:]}"
