"""Exact resume and reproducibility on the CPU (tiny Qwen3, distinct prompts, 4 batches per epoch), checkpoints that
load with torch's default ``weights_only=True``, and atomic checkpoint writes.

- 6 rollout steps uninterrupted vs 3 steps + a resume in a new process to step 6: the same prompts are consumed in
  the same order (across the epoch boundary) and the final weights are bitwise equal;
- negative control: the same resume from a checkpoint without the data order's state replays the epoch's first
  prompts and ends with other weights;
- two same-seed runs (in-process and in a new process) end with bitwise-equal weights;
- the same resume with 2 gloo ranks under FSDP2 (distributed-checkpoint folders): every rank consumes the same prompts
  and the gathered weights are bitwise equal; ``rlexact.export`` exports such a folder in this process with the
  gathered weights, bitwise, and the tokenizer (and refuses an incomplete folder in one line).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import _resume_worker as worker
from rlexact import RLModule
from rlexact.checkpoint import AtomicCheckpointIO, atomic_torch_save

TESTS = Path(__file__).resolve().parent


def spawn(out_dir: Path, steps: int, resume: str | None = None, ranks: int = 1) -> subprocess.Popen:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    args = json.dumps({"out_dir": str(out_dir), "steps": steps, "resume": resume, "ranks": ranks})
    return subprocess.Popen(
        [sys.executable, str(TESTS / "_resume_worker.py"), args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, out_dir: Path, name: str = "result.json") -> dict:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return json.loads((out_dir / name).read_text())


def weights(result: dict) -> dict[str, torch.Tensor]:
    return torch.load(result["weights"], weights_only=True)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("resume")
    full = worker.run(str(root / "full"), 6)
    part = worker.run(str(root / "part"), 3)
    step3 = root / "part" / "ckpt" / "epoch=0-step=6.ckpt"  # optimizer step 6 = rollout step 3 (mid-epoch)
    ckpt = torch.load(step3, weights_only=True)  # plain hparams: torch's default weights_only load works
    assert ckpt["rlexact"]["rollout_step"] == 3
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 3
    del ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    no_data = root / "no_data.ckpt"
    torch.save(ckpt, no_data)
    procs = {
        "resumed": spawn(root / "resumed", 6, str(step3)),
        "no_data": spawn(root / "no_data", 6, str(no_data)),
        "repeat": spawn(root / "repeat", 6),
    }
    out = {name: finish(p, root / name) for name, p in procs.items()}
    return {"full": full, "part": part, "step3": {"path": str(step3)}, **out}


def test_resume_consumes_the_same_prompts_and_ends_bitwise_equal(runs: dict[str, dict]) -> None:
    full, part, resumed = runs["full"], runs["part"], runs["resumed"]
    flat = [i for batch in full["consumed"][:4] for i in batch]
    assert sorted(flat) == list(range(worker.NUM_PROMPTS))  # one epoch = every prompt once
    assert full["consumed"][4:] != full["consumed"][:2]  # epoch 1 is another permutation
    assert part["consumed"] == full["consumed"][:3]
    assert resumed["consumed"] == full["consumed"][3:]  # continues mid-epoch and into the next epoch
    assert resumed["rollout_step"] == full["rollout_step"] == 6
    assert bitwise_equal(weights(resumed), weights(full))
    assert not bitwise_equal(weights(part), weights(full))  # the last 3 steps changed the weights


def test_resume_without_data_state_differs(runs: dict[str, dict]) -> None:
    full, no_data = runs["full"], runs["no_data"]
    assert no_data["consumed"][0] == full["consumed"][0]  # the epoch restarts: its first prompts again
    assert no_data["consumed"] != full["consumed"][3:]
    assert not bitwise_equal(weights(no_data), weights(full))


def test_same_seed_runs_are_bitwise_equal(runs: dict[str, dict]) -> None:
    assert runs["repeat"]["consumed"] == runs["full"]["consumed"]
    assert bitwise_equal(weights(runs["repeat"]), weights(runs["full"]))


def test_python_api_checkpoint_loads_with_weights_only(runs: dict[str, dict]) -> None:
    path = runs["step3"]["path"]
    module = RLModule.load_from_checkpoint(path)  # torch's default weights_only=True
    assert module.hparams["rollout"]["n"] == 2 and module.hparams["optim"]["lr"] == 1e-2
    assert module.hparams["tokenizer"] == "demo-char"
    assert module.rollout_cfg.max_new_tokens == 3 and module.optim_cfg.betas == (0.9, 0.999)
    saved = torch.load(path, weights_only=True)["state_dict"]
    loaded = module.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert module.rollout_step == 3


def test_atomic_checkpoint_survives_a_crash_during_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    good = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 1}
    AtomicCheckpointIO().save_checkpoint(good, path)

    def crash(obj, f, *args, **kwargs):  # writes part of the file, then the process "dies"
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "global_step": 2}, path)
    monkeypatch.undo()
    loaded = torch.load(path, weights_only=True)
    assert loaded["global_step"] == 1 and torch.equal(loaded["state_dict"]["w"], good["state_dict"]["w"])
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file is gone

    # negative control: the same crash while writing in place leaves a file that does not load
    def in_place(obj, target):
        with open(target, "wb") as f:
            crash(obj, f)

    with pytest.raises(KeyboardInterrupt):
        in_place(good, path)
    with pytest.raises(Exception):  # noqa: B017 - any unpickling/zip error: the checkpoint is lost
        torch.load(path, weights_only=True)


def test_atomic_save_replaces_and_rejects_remote_paths(tmp_path: Path) -> None:
    atomic_torch_save({"a": 1}, tmp_path / "x.pt")
    atomic_torch_save({"a": 2}, tmp_path / "x.pt")
    assert torch.load(tmp_path / "x.pt", weights_only=True) == {"a": 2}
    with pytest.raises(ValueError, match="writes local files only"):
        AtomicCheckpointIO().save_checkpoint({}, "s3://bucket/x.ckpt")


def check_export(out: str, saved: dict[str, torch.Tensor], prefix: str = "") -> None:
    """The exported folder holds exactly ``saved``'s weights (keys ``prefix`` + the transformers names), bitwise, a
    config without the exactify attention implementation, and the char tokenizer (saved without being passed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlexact.char_tokenizer import build_char_tokenizer

    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert {prefix + k for k in exported} == saved.keys()
    for key, value in saved.items():
        assert torch.equal(exported[key.removeprefix(prefix)], value), key
    assert AutoTokenizer.from_pretrained(out).get_vocab() == build_char_tokenizer().get_vocab()
    assert "rlexact" not in (Path(out) / "config.json").read_text()


def test_export_checkpoint_to_transformers_folder(runs: dict[str, dict], tmp_path: Path) -> None:
    from rlexact.export import export_checkpoint

    out = export_checkpoint(runs["step3"]["path"], tmp_path / "hf")
    check_export(out, torch.load(runs["step3"]["path"], weights_only=True)["state_dict"], "model.")


def check_sharded_export(folder: Path, weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Export a sharded checkpoint folder in this process (no process group) and compare with the gathered weights;
    negative controls: a folder without meta.pt, and one with a missing shard, are export errors. The temporary
    checkpoint file is gone either way."""
    import torch.distributed as dist

    from rlexact.export import ExportError, export_checkpoint

    scratch = tmp_path / "tmp"
    scratch.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the export's temporary directory goes
    check_export(export_checkpoint(folder, tmp_path / "hf"), torch.load(weights, weights_only=True))
    assert not dist.is_initialized() and not list(scratch.iterdir())
    no_meta = shutil.copytree(folder, tmp_path / "no_meta.ckpt")
    (no_meta / "meta.pt").unlink()
    with pytest.raises(ExportError, match=r"is a folder but not a sharded Lightning checkpoint: it has no meta\.pt"):
        export_checkpoint(no_meta, tmp_path / "out")
    no_shard = shutil.copytree(folder, tmp_path / "no_shard.ckpt")
    next(no_shard.glob("*.distcp")).unlink()
    with pytest.raises(ExportError, match=r"is not a complete sharded checkpoint: reading its shards fails \(\w+"):
        export_checkpoint(no_shard, tmp_path / "out")
    assert not list(scratch.iterdir()) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fsdp2_two_rank_resume_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """6 steps vs 3 + resume on 2 gloo ranks (ModelParallelStrategy, sharded distributed checkpoints); the export of
    the 3-step run's last checkpoint folder (:func:`check_sharded_export`)."""
    procs = {name: spawn(tmp_path / name, steps, ranks=2) for name, steps in (("full", 6), ("part", 3))}
    for name, proc in procs.items():
        finish(proc, tmp_path / name, "result_rank0.json")
    step3 = tmp_path / "part" / "ckpt" / "epoch=1-step=6.ckpt"  # 2 batches per epoch and rank: mid-epoch 1
    assert step3.is_dir() and (step3 / "meta.pt").is_file()  # a torch.distributed.checkpoint folder
    finish(spawn(tmp_path / "resumed", 6, str(step3), ranks=2), tmp_path / "resumed", "result_rank0.json")
    for rank in (0, 1):
        full, part, resumed = (
            json.loads((tmp_path / name / f"result_rank{rank}.json").read_text())
            for name in ("full", "part", "resumed")
        )
        assert part["consumed"] == full["consumed"][:3]
        assert resumed["consumed"] == full["consumed"][3:]
    first = [json.loads((tmp_path / "full" / f"result_rank{r}.json").read_text())["consumed"] for r in (0, 1)]
    assert first[0] != first[1]  # the ranks hold different shards of the data
    full_w = torch.load(tmp_path / "full" / "weights.pt", weights_only=True)
    assert bitwise_equal(torch.load(tmp_path / "resumed" / "weights.pt", weights_only=True), full_w)
    assert not bitwise_equal(torch.load(tmp_path / "part" / "weights.pt", weights_only=True), full_w)
    check_sharded_export(step3, tmp_path / "part" / "weights.pt", tmp_path / "export", monkeypatch)
