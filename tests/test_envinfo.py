"""Provenance of committed results: the host CPU model beside the device."""

from __future__ import annotations

import os
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


MALFORMED_COMMITS = ["FULL", "f8feddc\nf8feddc", "test-commit", "abc12", "F8FEDDC", "f" * 41, " " + "f" * 40]


@pytest.mark.parametrize("value", MALFORMED_COMMITS)
def test_a_malformed_named_commit_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A ``$RLEXACT_COMMIT`` that is no commit id (a placeholder left in a command, a command substitution that printed
    twice) stops the run when its result header is built, naming the variable and the fix."""
    monkeypatch.setenv("RLEXACT_COMMIT", value)
    with pytest.raises(ValueError, match=r"RLEXACT_COMMIT=.* is not a commit id: set it to the hexadecimal sha"):
        git_commit()
    with pytest.raises(ValueError, match="RLEXACT_COMMIT="):
        result_header("probe")


@pytest.mark.parametrize("value", ["0123abc", "f" * 40])
def test_a_well_formed_named_commit_is_recorded(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """The negative control of the test above: commit ids of 7 and 40 characters, unknown to this checkout, are
    recorded as given; an empty variable reads the checkout's own commit."""
    monkeypatch.setenv("RLEXACT_COMMIT", value)
    assert git_commit() == value and result_header("probe")["commit"] == value
    monkeypatch.setenv("RLEXACT_COMMIT", "")
    assert git_commit() == git_commit(Path(__file__).resolve().parent)


@pytest.mark.parametrize("script", [["scripts/gpu_suite.sh", "bench", "decode", "0"], ["scripts/study_gpu.sh"]])
def test_the_gpu_scripts_stop_on_a_malformed_named_commit(tmp_path: Path, script: list[str]) -> None:
    """The device scripts check ``$RLEXACT_COMMIT`` before they run anything, so a mistyped command costs no device
    time and leaves no result behind."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RLEXACT_COMMIT": "FULL", "OUT": str(tmp_path / "out"), "RESULTS": str(tmp_path / "results"),
           "STUDY_RUNS": str(tmp_path / "runs"), "STUDY_JSON": str(tmp_path / "study.json"),
           "STUDY_DOCS": str(tmp_path / "docs"), "SFT_OUT": str(tmp_path / "ckpt")}  # fmt: skip
    proc = subprocess.run(["bash", *script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "RLEXACT_COMMIT='FULL' is not a commit id" in proc.stderr
    assert not list((tmp_path / "results").glob("*.json")) and not (tmp_path / "study.json").exists()


def test_the_demo_and_the_study_refuse_a_malformed_named_commit_before_running(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m rlexact.demo --record`` and ``python -m rlexact.study`` write ``$RLEXACT_COMMIT`` into their result
    headers after the run: a malformed one is a usage error before anything runs, and no file is written."""
    from rlexact.demo.run import main as demo_main
    from rlexact.study.__main__ import main as study_main

    monkeypatch.setenv("RLEXACT_COMMIT", "FULL")
    runs = [
        (demo_main, ["--record", str(tmp_path / "record.json")]),
        (study_main, ["shadow", "--json", str(tmp_path / "s.json"), "--out", str(tmp_path / "runs"), "--no-report"]),
    ]
    for main, argv in runs:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        assert "RLEXACT_COMMIT='FULL' is not a commit id" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
