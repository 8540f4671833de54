"""The CPU twins stay row-invariant whatever instruction set MKL dispatches and however many threads it runs.

MKL picks its sgemm kernels from the host CPU (``MKL_ENABLE_INSTRUCTIONS`` caps the choice) and ATen its vectorized
loops (``ATEN_CPU_CAPABILITY``), so a run on this host can stand in for hosts without AVX-512: the invariance tests
of the CPU ops (``tests/test_ops_cpu.py``, with their negative controls) and of the MoE grouped product run again in
fresh processes under AVX2 with two and three threads, and a rollout's log-probs are compared with the trainer's
there. The negative control shows the failure these runs guard against: under AVX2 with two threads, plain
``x @ w.T`` on a fixed 64-row block gives a row other bits at some places in the block (where MKL dispatches its
Intel AVX2 kernels).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

ROLLOUT_CHECK = """
import torch
from rlexact import exactify, sequence_logprobs
from rlexact.rollout import Generator, SamplingParams
from tests.models import tiny_model

model = exactify(tiny_model(vocab=1003, hidden=64, seed=3))
prompts = [[(7 * i + j) % 97 + 1 for j in range(3 + 5 * i)] for i in range(6)]
params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=5, logprobs="sampled")
outs = Generator(model).generate(prompts, params)
ref = sequence_logprobs(model, [o.sequence for o in outs], top_k=20, top_p=0.9)
bad = [i for i, (o, r) in enumerate(zip(outs, ref)) if not torch.equal(o.logprobs, r[-len(o.token_ids):])]
assert not bad, f"completions {bad}: rollout log-probs differ from the trainer's"
print("rollout == trainer")
"""

POSITION_PROBE = """
import torch
import torch.nn.functional as F

g = torch.Generator().manual_seed(0)
moved = 0
for n, k in ((64, 64), (1003, 64), (64, 160)):
    w = torch.randn(n, k, generator=g)
    for _ in range(4):
        row = torch.randn(k, generator=g)
        ref = F.linear(row.expand(64, k).contiguous(), w)[0]
        for p in range(64):
            x = torch.randn(64, k, generator=g)
            x[p] = row
            moved += not torch.equal(F.linear(x, w)[p], ref)
print(moved)
"""


def _run(code_or_args: list[str], isa: str, threads: int) -> subprocess.CompletedProcess:
    """``python *code_or_args`` in a fresh process whose MKL and ATen kernels are capped at ``isa`` (an AVX2-only
    host's dispatch, as far as this host can stand in for one), with ``threads`` threads."""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": isa, "ATEN_CPU_CAPABILITY": isa.lower(),
           "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}  # fmt: skip
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, timeout=600, cwd=REPO, env=env
    )


@pytest.mark.parametrize("threads", [2, 3])
def test_cpu_ops_row_invariant_under_avx2(threads: int) -> None:
    tests = ["tests/test_ops_cpu.py", "tests/test_moe.py::test_grouped_matmul_batch_invariant",
             "tests/test_moe.py::test_grouped_matmul_negative_control"]  # fmt: skip
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *tests], "AVX2", threads)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_rollout_equals_trainer_under_avx2() -> None:
    proc = _run(["-c", ROLLOUT_CHECK], "AVX2", 2)
    assert proc.returncode == 0 and "rollout == trainer" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def _intel_avx2_mkl() -> bool:
    """Whether MKL here dispatches its Intel AVX2 kernels under ``MKL_ENABLE_INSTRUCTIONS=AVX2``."""
    if not torch.backends.mkl.is_available() or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "GenuineIntel" in cpuinfo and " avx2" in cpuinfo


needs_intel_avx2 = pytest.mark.skipif(
    not _intel_avx2_mkl(),
    reason="needs MKL's Intel AVX2 kernels (an Intel x86 CPU with AVX2 and a torch built with MKL)",
)


@needs_intel_avx2
def test_negative_control_plain_block_product_moves_rows_under_avx2() -> None:
    proc = _run(["-c", POSITION_PROBE], "AVX2", 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert int(proc.stdout.split()[-1]) > 0, "plain F.linear blocks were row-invariant: the runs above prove nothing"


PLAIN_LAYOUT_GUARD = """
import torch
import torch.nn.functional as F
from rlexact.ops import cpu

cpu._block_product = lambda x, w: F.linear(x, w)  # the layout the CPU twins used before block_linear
try:
    cpu.matmul(torch.randn(5, 64), torch.randn(64, 64))  # N <= 64: MKL splits the block's rows over threads
except RuntimeError as e:
    print("refused:", e)
"""


def test_guard_refuses_a_position_dependent_block_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_block_product stops the CPU twins with an error that names the cause and the fix when the block product
    moves a row's bits (here a product that adds one ulp at one place of the block)."""
    from rlexact.ops import cpu

    plain = cpu._block_product

    def one_place_off(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = plain(x, w).clone()
        out[62] = torch.nextafter(out[62], torch.full_like(out[62], float("inf")))
        return out

    monkeypatch.setattr(cpu, "_block_product", one_place_off)
    cpu.check_block_product.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"not row-invariant on this host.*place 62.*torch.set_num_threads\(1\)"):
            cpu.matmul(torch.randn(3, 40), torch.randn(24, 40))
    finally:
        cpu.check_block_product.cache_clear()


@needs_intel_avx2
def test_guard_catches_the_plain_layout_under_avx2() -> None:
    proc = _run(["-c", PLAIN_LAYOUT_GUARD], "AVX2", 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "refused: rlexact's CPU kernels are not row-invariant on this host" in proc.stdout, proc.stdout
