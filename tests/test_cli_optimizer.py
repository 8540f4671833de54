"""LightningCLI's ``optimizer:`` / ``lr_scheduler:`` sections reach RLModule.configure_optimizers (built after
configure_model); without them the module keeps AdamW + warmup from ``optim:``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rlexact.cli import main
from rlexact.module import RLModule
from test_cli import tiny_yaml


def _cli(tmp_path: Path, **sections: dict) -> RLModule:
    path = tiny_yaml(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    # optimizer: / lr_scheduler: replace optim's settings (RLModule refuses non-default ones they would ignore)
    cfg["model"]["init_args"]["optim"] = {} if sections else {"lr": 1e-3, "warmup_steps": 4}
    cfg.update(sections)
    path.write_text(yaml.safe_dump(cfg))
    module = main(["--config", str(path)], run=False).model
    module.configure_model()
    return module


def test_optimizer_and_scheduler_from_yaml(tmp_path: Path) -> None:
    module = _cli(
        tmp_path,
        optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.5}},
        lr_scheduler={"class_path": "torch.optim.lr_scheduler.LinearLR", "init_args": {"start_factor": 0.5}},
    )
    out = module.configure_optimizers()
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.5
    assert isinstance(sched, torch.optim.lr_scheduler.LinearLR) and out["lr_scheduler"]["interval"] == "step"
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # start_factor applied at construction
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in module.model.parameters()}


def test_default_is_adamw_with_warmup(tmp_path: Path) -> None:
    out = _cli(tmp_path).configure_optimizers()
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    assert type(opt) is torch.optim.AdamW and isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)  # warmup step 1 of 4


def test_bad_specs_error_clearly(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="optimizer must be a callable"):
        RLModule(model_config={"model_type": "qwen3"}, tokenizer="demo-char", optimizer={"lr": 1.0})
    module = _cli(tmp_path, lr_scheduler={"class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau"})
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs a monitored metric"):
        module.configure_optimizers()
