"""Triton-interpreter check scripts run as background jobs of the test session.

The interpreter checks (``TRITON_INTERPRET=1`` subprocesses running ``tests/_interp_*.py`` and similar) are
single-threaded and long. A test marked ``@pytest.mark.interpreter(script, *args, timeout=...)`` does not start its
subprocess itself: ``conftest.py`` submits every selected marked test's job when collection finishes, one background
worker runs them in collection order while the session runs other tests on the other core, and the test's
``interpreter_run`` fixture waits for its own job's :class:`subprocess.CompletedProcess`. A job that is never
submitted (the test selected alone) runs when the fixture asks for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 600.0


def run_interpreter(argv: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess:
    """``python *argv`` from the repository root under the Triton interpreter (CPU, ``src`` importable); ``argv[0]``
    is a script path relative to the root, or ``-c``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


class InterpreterJobs:
    """One background worker running interpreter jobs in submission order; a job is keyed by its ``argv``."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="triton-interpreter")
        self._jobs: dict[tuple[str, ...], Future] = {}

    def submit(self, argv: tuple[str, ...], timeout: float = DEFAULT_TIMEOUT_S) -> Future:
        if argv not in self._jobs:
            self._jobs[argv] = self._pool.submit(run_interpreter, argv, timeout)
        return self._jobs[argv]

    def result(self, argv: tuple[str, ...], timeout: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
        """The job's finished process (submitted now if it was not); a subprocess timeout is raised here."""
        return self.submit(argv, timeout).result()

    def close(self) -> None:
        """Drop jobs not started yet; a running one finishes (its subprocess has its own timeout)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


SCALAR_LOOP_PROBE = """
import torch, triton, triton.language as tl

@triton.jit(do_not_specialize=["n"])
def count(out, n, STEP: tl.constexpr):
    acc = tl.program_id(0) * 0
    for _ in range(0, n, STEP):
        acc += 1
    tl.store(out, acc)

out = torch.zeros(1, dtype=torch.int32)
count[(1,)](out, 10, 4)
assert out.item() == 3, out
"""


def interpreter_defect() -> str | None:
    """Why this environment's Triton interpreter cannot run the checks, or ``None``. Known defect: the
    interpreters of some triton releases (3.6; 3.9 is fixed) convert a runtime scalar argument to a Python ``int``
    with ``int()`` of a one-element array, which NumPy 2.4 and later refuse, so a kernel loop bounded by a scalar
    argument fails."""
    proc = run_interpreter(("-c", SCALAR_LOOP_PROBE), 300.0)
    if proc.returncode == 0:
        return None
    if "only 0-dimensional arrays can be converted to Python scalars" in proc.stderr:
        return (
            "this triton's interpreter cannot bound a loop by a scalar argument under NumPy >= 2.4 (int() of a "
            "one-element array); install a fixed triton (3.9) or numpy < 2.4 to run the interpreter checks"
        )
    raise RuntimeError(f"the Triton interpreter probe failed for another reason:\n{proc.stderr[-3000:]}")


def failure_report(proc: subprocess.CompletedProcess, tail: int = 5000) -> str:
    return f"interpreter checks failed (exit {proc.returncode}):\n{proc.stdout[-tail:]}\n{proc.stderr[-tail:]}"
