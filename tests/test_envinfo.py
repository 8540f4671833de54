"""Provenance of committed results: the host CPU model beside the device."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from rlexact.envinfo import commit_sources, digest_files, git_commit, host_cpu, is_source, result_header, source_digest


def test_host_cpu_reads_the_first_model_name(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU 9000\n\nmodel name\t: B\n")
    assert host_cpu(info) == "Example CPU 9000"


def test_host_cpu_falls_back_without_a_model_name(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t:\n")
    fallback = platform.processor() or "unknown"
    assert host_cpu(info) == fallback
    assert host_cpu(tmp_path / "missing") == fallback


def test_result_header_records_the_host_cpu() -> None:
    header = result_header("probe")
    assert header["host_cpu"] == host_cpu() and header["host_cpu"] != ""
    assert list(header)[:8] == [
        "benchmark", "command", "commit", "source_digest", "date", "device", "host_cpu", "cpu_count"
    ]  # fmt: skip


def test_source_files_are_the_library_and_the_benchmark_scripts() -> None:
    assert is_source("src/rlexact/ops/gluon_decode.py") and is_source("benchmarks/rollout_throughput.py")
    assert not is_source("benchmarks/results/x.py") and not is_source("tests/test_envinfo.py")
    assert not is_source("src/rlexact/demo/assets/data/train.jsonl") and not is_source("README.md")


def test_source_digest_changes_with_any_file(tmp_path: Path) -> None:
    files = {"src/rlexact/a.py": b"x = 1\n", "benchmarks/b.py": b"y = 2\n"}
    base = digest_files(files)
    assert digest_files(dict(reversed(files.items()))) == base
    assert digest_files({**files, "src/rlexact/a.py": b"x = 2\n"}) != base
    assert digest_files({"src/rlexact/c.py": b"x = 1\n", "benchmarks/b.py": b"y = 2\n"}) != base
    assert digest_files({"src/rlexact/a.py": b"x = 1\n"}) != base
    for path, data in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    (tmp_path / "benchmarks" / "results").mkdir()
    (tmp_path / "benchmarks" / "results" / "ignored.py").write_bytes(b"z = 3\n")
    assert source_digest(tmp_path) == base
    assert source_digest(tmp_path / "benchmarks") is None  # not a checkout


def test_a_named_commit_whose_code_is_not_the_trees_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$RLEXACT_COMMIT`` naming a commit of this checkout whose sources differ from the tree's (a stale ``.git``'s
    ``HEAD`` passed on, say) gets ``+mismatch``; the commit whose sources these are, and one the checkout does not
    know (a copied tree), pass unmarked."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head, first = git("rev-parse", "HEAD"), git("rev-list", "--max-parents=0", "HEAD").split()[0]
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    if first == head or digest_files(commit_sources(head, root)) != source_digest(root):
        pytest.skip("needs a checkout with history whose sources are HEAD's")
    unknown = "f" * 40
    for named, expected in ((first, first + "+mismatch"), (head, head), (unknown, unknown)):
        monkeypatch.setenv("RLEXACT_COMMIT", named)
        assert git_commit() == expected
