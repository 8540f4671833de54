"""Every result file a results table cites exists, and records the commit the citation names; a result that records
its source digest ran that commit's code.

The results tables of README.md and docs/benchmarks.md cite their evidence in the last column as
``` `name.json` (abc1234)``` (several names may share one commit; ``{a,b}`` and ``*`` patterns expand to files, and a
note may follow the commit after a semicolon). A result file records the commit of the script that wrote it (its
``commit`` field; a GPU test log its header line), so a citation whose commit differs from the file's, or whose
file is gone, points at evidence that is not there.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from rlexact.envinfo import COMMIT_ID, SOURCE_DIRS, commit_sources, digest_files, is_commit, is_source, source_digest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "docs/benchmarks.md")

_GROUP = re.compile(rf"((?:`[^`]+`[^`(]*?)+)\(({COMMIT_ID})(?:\)|;[^)]*\))")
"""Backticked names, then the commit they share in parentheses (optionally followed by a note after ``;``)."""
_NAME = re.compile(r"`([^`\s]+\.(?:json|log))`")
_LOG_COMMIT = re.compile(rf"at commit ({COMMIT_ID})(?![+0-9a-f])")


def _expand(name: str) -> list[str]:
    """``a_{x,y}_b.json`` -> ``a_x_b.json, a_y_b.json`` (nested braces are not used in the docs)."""
    m = re.search(r"\{([^}]*)\}", name)
    if m is None:
        return [name]
    return [n for alt in m.group(1).split(",") for n in _expand(name[: m.start()] + alt + name[m.end() :])]


def _recorded_commit(path: Path) -> str:
    if path.suffix == ".json":
        return str(json.loads(path.read_text()).get("commit", ""))
    m = _LOG_COMMIT.search(path.read_text())
    return m.group(1) if m else ""


def citation_errors(text: str, results: Path) -> tuple[int, list[str]]:
    """``(citations checked, problems)`` of the table rows of ``text`` against the files in ``results``."""
    checked, problems = 0, []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cell = line.rstrip().rstrip("|").rsplit("|", 1)[-1]
        for names, sha in _GROUP.findall(cell):
            for pattern in (e for n in _NAME.findall(names) for e in _expand(n)):
                files = sorted(results.glob(pattern))
                if not files:
                    problems.append(f"{pattern} ({sha}): no such file in {results}")
                for f in files:
                    checked += 1
                    recorded = _recorded_commit(f)
                    if not recorded.startswith(sha):
                        problems.append(f"{f.name} cited at {sha} records commit {recorded[:7] or 'none'}")
    return checked, problems


@pytest.mark.parametrize("doc", DOCS)
def test_cited_results_exist_at_their_commits(doc: str) -> None:
    checked, problems = citation_errors((ROOT / doc).read_text(), RESULTS)
    assert not problems, f"{doc}: " + "; ".join(problems)
    assert checked > 0, f"{doc}: no table citation found; has the citation format changed?"


def test_citation_check_catches_wrong_commit_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "a_h200.json").write_text(json.dumps({"commit": "1234567aaaa"}))
    (tmp_path / "b_on_h200.json").write_text(json.dumps({"commit": "89abcdefbbb"}))
    (tmp_path / "b_off_h200.json").write_text(json.dumps({"commit": "89abcdefbbb"}))
    (tmp_path / "suite_h200.log").write_text("# rlexact GPU test suite, one run at commit 1234567aaaa\n")
    good = (
        "| x | y | `a_h200.json` (1234567), `b_{on,off}_h200.json` (89abcde; a note naming `a_h200.json`) |\n"
        "| x | y | `suite_h200.log` (1234567) |"
    )
    assert citation_errors(good, tmp_path) == (4, [])
    assert citation_errors("| x | y | `a_h200.json` (89abcde) |", tmp_path)[1] == [
        "a_h200.json cited at 89abcde records commit 1234567"
    ]
    assert citation_errors("| x | y | `c_h200.json` (1234567) |", tmp_path)[1] == [
        f"c_h200.json (1234567): no such file in {tmp_path}"
    ]
    assert citation_errors("`a_h200.json` (89abcde) outside a table", tmp_path) == (0, [])


def test_results_ran_the_code_of_their_commit() -> None:
    """A result that records a ``source_digest`` was written by the recorded commit's library and benchmark scripts
    (a run whose ``RLEXACT_COMMIT`` named another commit, or whose tree had changes, fails here)."""
    if not is_commit("HEAD", ROOT):
        pytest.skip("not a git checkout")
    problems = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        recorded = data.get("source_digest") if isinstance(data, dict) else None
        if recorded is None:
            continue
        commit = str(data.get("commit", ""))
        if not is_commit(commit, ROOT):
            problems.append(f"{path.name}: commit {commit!r} is not in this repository")
        elif digest_files(commit_sources(commit, ROOT)) != recorded:
            problems.append(f"{path.name}: its code is not commit {commit[:7]}'s (source_digest differs)")
    assert not problems, "; ".join(problems)


def test_source_digest_of_a_clean_tree_is_its_commits() -> None:
    """The working tree's digest equals the one read through git for ``HEAD`` when no source file differs from it,
    and not once one of those files has one byte more."""
    if not is_commit("HEAD", ROOT):
        pytest.skip("not a git checkout")
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", *SOURCE_DIRS], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout  # fmt: skip
    if any(is_source(line[3:]) for line in changed.splitlines()):
        pytest.skip("source files differ from HEAD")
    head = commit_sources("HEAD", ROOT)
    tree = source_digest(ROOT)
    assert digest_files(head) == tree
    assert digest_files({**head, "src/rlexact/envinfo.py": head["src/rlexact/envinfo.py"] + b"#"}) != tree
