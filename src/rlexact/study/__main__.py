"""``python -m rlexact.study EXPERIMENT [EXPERIMENT ...] [--config configs/study/cpu.yaml]``.

Runs the named experiments (``all`` = every one; ``list`` prints them), merges their entries into the result JSON
(default ``benchmarks/results/study_<device>.json``) and writes the report's tables and plots (default
``docs/study/``). ``report`` only rewrites the tables and plots from an existing JSON. See
:mod:`rlexact.study`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rlexact.envinfo import named_commit
from rlexact.study.config import load_config
from rlexact.study.experiments import EXPERIMENTS, experiment_arms, summarize
from rlexact.study.report import device_tag, entry_header, fill_page, write_json, write_plots, write_tables
from rlexact.study.runner import FailedRuns, resolve_device, run_arms

__all__ = ["main", "run_study"]

T = TypeVar("T")


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_study(
    names: Sequence[str],
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    json_path: str | None = None,
    docs: str | None = None,
    out: str | None = None,
    report: bool = True,
    page: str | None = None,
) -> dict[str, Any]:
    """Run experiments ``names`` (or ``["all"]``) and write the JSON (and the report unless ``report=False``; with
    ``page``, also the tables between the ``<!-- study:NAME -->`` markers of that markdown file).

    The JSON is rewritten after every finished run, so a study cut short (a time limit) leaves the runs it finished
    in it (entries marked ``complete: false``, with their ``missing_runs``). When runs fail, the others still run,
    the JSON and the report are written from the finished ones, and :class:`~rlexact.study.runner.FailedRuns` is
    raised at the end. Returns the whole result document."""
    cfg = load_config(config, overrides)
    if out is not None:
        cfg.out = out
    names = list(EXPERIMENTS) if list(names) == ["all"] else list(names)
    plans = {name: experiment_arms(cfg, name) for name in names}  # validates every name and knob first
    tasks = [(arm, steps) for arms, steps, _ in plans.values() for arm in arms]
    header = entry_header()
    path = json_path or cfg.json or f"benchmarks/results/study_{device_tag(resolve_device(cfg.scale.device))}.json"

    def write(results: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
        return write_json(path, {name: summarize(cfg, name, results, header) for name in names})

    failed: FailedRuns | None = None
    try:
        results = run_arms(tasks, cfg.scale, cfg.out, log=_say, on_result=write)
    except FailedRuns as exc:
        results, failed = exc.results, exc
    doc = write(results)
    _say(f"wrote {path}")
    if report:
        _report(doc, docs or cfg.docs, page)
    if failed is not None:
        raise failed
    return doc


def _report(doc: dict[str, Any], folder: str, page: str | None) -> None:
    _say(f"wrote {write_tables(doc, folder)}")
    for path in write_plots(doc, folder, log=_say):
        _say(f"wrote {path}")
    if page is not None:
        _say(f"filled the tables of {', '.join(fill_page(doc, page)) or 'no experiment'} in {page}")


def _checked(parser: argparse.ArgumentParser, check: Callable[[], T]) -> T:
    """``check()``, its ``ValueError`` or ``FileNotFoundError`` (a bad config, experiment or setting) reported as a
    usage error (exit status 2, one line)."""
    try:
        return check()
    except (ValueError, FileNotFoundError) as e:
        parser.error(f"{type(e).__name__}: {e}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlexact.study", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "experiments", nargs="+", help=f"experiments to run: {', '.join(EXPERIMENTS)}, 'all', 'list' or 'report'"
    )
    parser.add_argument("--config", help="study YAML (configs/study/*.yaml); default: the built-in CPU demo scale")
    parser.add_argument("--steps", type=int, help="override scale.steps")
    parser.add_argument("--seeds", type=int, nargs="+", help="override scale.seeds")
    parser.add_argument("--workers", type=int, help="override scale.workers")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), help="override scale.device")
    parser.add_argument("--checkpoint", help="override scale.checkpoint (a folder of python -m rlexact.demo.sft)")
    parser.add_argument("--out", help="runs folder (overrides output.out)")
    parser.add_argument("--json", help="result JSON (overrides output.json)")
    parser.add_argument("--docs", help="folder of the report's tables and plots (overrides output.docs)")
    parser.add_argument("--no-report", action="store_true", help="write the JSON only")
    parser.add_argument(
        "--page", help="markdown page whose <!-- study:NAME --> ... <!-- /study:NAME --> blocks get the tables"
    )
    args = parser.parse_args(argv)
    alone = sorted({"list", "report"} & set(args.experiments))
    if alone and len(args.experiments) > 1:
        parser.error(f"{alone[0]!r} stands alone: give it without experiment names")
    if args.experiments == ["list"]:
        for exp in EXPERIMENTS.values():
            _say(f"{exp.name:13s} {exp.title}")
        return 0
    if args.experiments == ["report"]:
        import json

        cfg = _checked(parser, lambda: load_config(args.config))
        path = args.json or cfg.json
        if path is None:
            parser.error("report needs --json PATH (or output.json in --config)")
        if not Path(path).is_file():
            parser.error(f"report: no result JSON {path!r}")
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        _report(doc, args.docs or cfg.docs, args.page)
        return 0
    given = (("steps", args.steps), ("workers", args.workers), ("device", args.device), ("checkpoint", args.checkpoint))
    overrides = {k: v for k, v in given if v is not None}
    if args.seeds is not None:
        overrides["seeds"] = tuple(args.seeds)
    names = list(EXPERIMENTS) if args.experiments == ["all"] else args.experiments
    cfg = _checked(parser, lambda: load_config(args.config, overrides))
    _checked(parser, lambda: [experiment_arms(cfg, name) for name in names])
    _checked(parser, named_commit)  # the result JSON's header names it: a malformed one fails now, not after the runs
    run_study(
        args.experiments,
        args.config,
        overrides,
        json_path=args.json,
        docs=args.docs,
        out=args.out,
        report=not args.no_report,
        page=args.page,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
