"""Corrects the ``commit`` of result files from the ``source_digest`` they recorded.

    python benchmarks/restamp_commit.py benchmarks/results/NAME.json [...] [--depth 200]

A result records the commit it was told (``$RLEXACT_COMMIT``, or the ``HEAD`` of the tree that ran) beside the digest
of the library and benchmark sources that actually ran (:func:`rlexact.envinfo.source_digest`). On a copied tree whose
``.git`` is stale the two can disagree: the measurement is the newer code's, the label an older commit's. For each file
whose recorded commit's sources do not give its digest, this looks through the last ``--depth`` commits of ``HEAD``
for the newest one whose sources do, writes it as ``commit``, keeps the recorded value as ``commit_as_recorded`` and
this command as ``restamped_by``; nothing else in the file changes. A file whose digest matches no commit cannot be
attributed: it is left as it is and the command exits 1 (re-run that benchmark).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rlexact.envinfo import commit_sources, digest_files, is_commit


def history(root: Path, depth: int) -> list[str]:
    """The last ``depth`` commits of ``HEAD`` in the repository at ``root``, newest first."""
    out = subprocess.run(["git", "rev-list", f"--max-count={depth}", "HEAD"], cwd=root, capture_output=True,
                         text=True, check=True, timeout=60).stdout  # fmt: skip
    return out.split()


def restamp(path: Path, root: Path, commits: list[str], digests: dict[str, str], command: str) -> str:
    """Restamps the result at ``path`` (see the module docstring); returns what happened, in words. ``digests``
    caches each commit's source digest across files."""
    text = path.read_text()
    data = json.loads(text)
    recorded, digest = str(data.get("commit", "")), data.get("source_digest")
    if digest is None:
        raise ValueError(f"{path}: records no source_digest, so its code cannot be identified")

    def of(commit: str) -> str:
        if commit not in digests:
            digests[commit] = digest_files(commit_sources(commit, root))
        return digests[commit]

    if is_commit(recorded, root) and of(recorded) == digest:
        return f"{path.name}: commit {recorded[:7]} ran its own code; unchanged"
    match = next((c for c in commits if of(c) == digest), None)
    if match is None:
        raise LookupError(f"{path}: no commit among the last {len(commits)} of HEAD has the sources it ran "
                          f"(recorded {recorded[:7]}); re-run its benchmark")  # fmt: skip
    lines = text.strip().splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else None  # the file's own indentation
    items = list({**data, "commit": match}.items())  # the commit keeps its place
    at = [k for k, _ in items].index("commit") + 1
    items[at:at] = [("commit_as_recorded", recorded), ("restamped_by", command)]
    path.write_text(json.dumps(dict(items), indent=indent) + "\n")
    return f"{path.name}: ran {match[:7]}'s code, recorded as {recorded[:7]}; restamped"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--depth", type=int, default=200, help="how many of HEAD's last commits to search")
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    commits, digests = history(root, args.depth), {}
    command = " ".join(["python", "benchmarks/restamp_commit.py", *(argv if argv is not None else sys.argv[1:])])
    status = 0
    for path in args.files:
        try:
            print(restamp(path, root, commits, digests, command))
        except (LookupError, ValueError) as e:
            print(f"restamp_commit: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
