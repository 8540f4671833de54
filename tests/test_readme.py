"""Everything the README shows runs as written: every ```python block and every command line of the ```bash blocks,
with the tiny packaged demo checkpoint where a block names a real one and tiny step counts.

The substitutions are listed in SUBSTITUTIONS (Python) and the command handlers in COMMANDS; a README command that
no handler recognises fails the test, so a new command needs a deliberate entry here.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("jsonargparse")

from rlexact.demo.run import checkpoint_path  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)

# placeholder -> tiny stand-in (Python blocks)
SUBSTITUTIONS = {
    '"/ckpt/Qwen3-1.7B"': "CKPT",
    '"prompts.jsonl"': "PROMPTS",
    "max_new_tokens=4096": "max_new_tokens=6",
    "n=8,": "n=2,",
    "batch_size=64": "batch_size=2",
    "max_steps=1000": "max_steps=2",
    "every_n_train_steps=100": "every_n_train_steps=1",
}
# tiny settings appended to the demo recipe (a 1-step run of 2 prompts x 2 samples)
TINY_FIT = [
    "--trainer.max_steps", "1", "--data.init_args.batch_size", "2", "--data.init_args.limit", "4",
    "--model.init_args.rollout.n", "2", "--trainer.enable_progress_bar", "false",
]  # fmt: skip
TINY_DEMO = ["--steps", "1", "--prompts-per-step", "2", "--n", "2", "--eval-prompts", "2", "--eval-n", "1",
             "--no-progress"]  # fmt: skip


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README.read_text()) if kind == lang]


def command_lines() -> list[str]:
    lines = []
    for body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlexact.demo.run import demo_rows
    from rlexact.demo.task import write_jsonl

    root = tmp_path_factory.mktemp("readme")
    write_jsonl(root / "prompts.jsonl", demo_rows("train", 8))
    return root


def test_readme_starts_with_the_demo_and_the_tests() -> None:
    first = blocks("bash")[:2]
    assert first[0].strip().endswith("python -m rlexact.demo")
    assert first[1].strip().endswith('pytest -q -m "not gpu"')


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index: int, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = blocks("python")[index]
    for old, new in SUBSTITUTIONS.items():
        code = code.replace(old, new)
    monkeypatch.chdir(workdir)
    namespace = {"__name__": "__main__", "CKPT": checkpoint_path(), "PROMPTS": str(workdir / "prompts.jsonl")}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)  # noqa: S102


# ------------------------------------------------------------------------------------------------- command lines


def _skip(args: list[str], root: Path) -> None:
    """Installation lines and the test suite itself (the suite is what runs this)."""


def _demo(args: list[str], root: Path) -> None:
    from rlexact.demo.run import main

    extra = [a for a in args if a not in ("python", "-m", "rlexact.demo")]
    if "--record" in extra:
        extra[extra.index("--record") + 1] = str(root / "record.json")
    summary = main([*extra, *TINY_DEMO, "--out", str(root / "demo_runs")])
    assert summary["train_rollout_tokens_differing"] == 0
    if "--record" in extra:
        assert (root / "record.json").is_file()


def _sft(args: list[str], root: Path) -> None:
    from rlexact.demo import sft

    tiny = ["--quiet", "--steps", "2", "--batch-size", "4", "--hidden-size", "32", "--num-layers", "1",
            "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "16", "--intermediate-size", "48",
            "--eval-size", "4"]  # fmt: skip
    sft.main(["--out", str(root / "sft"), *tiny])
    assert (root / "sft" / "model.safetensors").is_file()


def _write_data(args: list[str], root: Path) -> None:
    from rlexact.demo.run import main

    main(["--write-data", str(root / "data")])
    assert (root / "data" / "train.jsonl").is_file() and (root / "data" / "eval.jsonl").is_file()


def _rlexact(args: list[str], root: Path) -> None:
    from rlexact.cli import entry

    args = args[1:]
    if args[:1] == ["export"]:
        out = root / args[2]
        entry(["export", str(root / args[1]), str(out)])
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoModelForCausalLM.from_pretrained(out)
        AutoTokenizer.from_pretrained(out)
        return
    if "--help" in args:
        with pytest.raises(SystemExit) as exc:
            entry(args)
        assert exc.value.code in (0, None)
        return
    if any(a.startswith("/ckpt/") for a in args):  # a GPU recipe: the tiny checkpoint, parsed and instantiated only
        args = [checkpoint_path() if a.startswith("/ckpt/") else a for a in args]
        args = [str(root / "prompts.jsonl") if a.startswith("/data/") else a for a in args]
        from rlexact.cli import _packaged_configs, main

        main(_packaged_configs(args[1:]) + ["--trainer.accelerator", "cpu"], run=False)
        return
    if "--ckpt_path" in args:
        i = args.index("--ckpt_path")
        args[i + 1] = str(root / args[i + 1])
        assert Path(args[i + 1]).is_file(), "the README's resume line needs the checkpoint of the fit line before it"
        import torch

        before = torch.load(args[i + 1], weights_only=True)["rlexact"]["rollout_step"]
        entry([*args, *TINY_FIT[:1], "2", *TINY_FIT[2:]])
        resumed = args[i + 1].replace("version_0", "version_1")  # a resumed run logs to the next version folder
        after = torch.load(resumed, weights_only=True)
        assert after["rlexact"]["rollout_step"] == before + 1 == 2  # it trained on, from where it stopped
        assert after["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 2
        return
    entry([*args, *TINY_FIT])


COMMANDS: dict[str, Callable[[list[str], Path], None]] = {
    "python3 -m venv": _skip,
    "python -m rlexact.demo.sft": _sft,
    "python -m rlexact.demo.run --write-data": _write_data,
    "python -m rlexact.demo": _demo,
    "rlexact ": _rlexact,
}


def handler(line: str) -> Callable[[list[str], Path], None]:
    for prefix, fn in COMMANDS.items():
        if line.startswith(prefix):
            return fn
    raise AssertionError(f"README command without a test handler: {line!r}; add one to tests/test_readme.py")


def test_every_command_line_runs(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In README order (the resume and export lines use the checkpoint the fit line writes)."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "argv", ["rlexact"])
    lines = command_lines()
    assert any(line.startswith("rlexact fit --config demo.yaml --ckpt_path") for line in lines)
    for line in lines:
        handler(line)(line.split(), workdir)
