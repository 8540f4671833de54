"""The ``rlexact`` command: a LightningCLI with the ``fit`` and ``validate`` subcommands, plus ``rlexact demo`` and
``rlexact export``.

Usage::

    rlexact demo                                                   # the embedded demo (python -m rlexact.demo)
    rlexact fit --config demo.yaml                                 # a packaged recipe, from any directory
    rlexact fit --config grpo_qwen3_1p7b.yaml --model.init_args.model_path /ckpt/Qwen3-1.7B ...
    rlexact fit --config my_recipe.yaml --print_config             # the resolved configuration, nothing loaded
    rlexact fit --config demo.yaml --ckpt_path runs/demo/version_0/checkpoints/last.ckpt     # resume
    rlexact validate --config my_recipe.yaml --ckpt_path last.ckpt # needs data.init_args.val_path
    rlexact export last.ckpt exported/                             # checkpoint file or folder -> transformers folder

``--config NAME`` takes a file path or the name of a recipe shipped in the package (``rlexact/configs``:
``demo.yaml``, ``grpo_qwen3_1p7b.yaml``, ``reinforce_qwen3_1p7b.yaml``, ``corrections/*.yaml``); a file of that name
in the working directory wins.

The YAML has LightningCLI's sections: ``trainer`` (callbacks as ``class_path`` / ``init_args``, e.g.
``rlexact.callbacks.MismatchProbe``), ``model`` (``class_path: rlexact.RLModule`` or a subclass, with
``init_args`` holding the :class:`rlexact.RLModule` arguments and the nested :mod:`rlexact.config` dataclasses) and
``data`` (``class_path: rlexact.data.PromptDataModule``). Unknown keys anywhere are errors (jsonargparse).

``--ckpt_path last`` resumes from the newest ``last*.ckpt`` of the logger's earlier versions when the checkpoint
callbacks write under the logger's versioned folder (no ``dirpath`` of their own), as the recipes' do: Lightning looks
only in the new run's version folder, which is empty, and would start afresh. Without any earlier checkpoint the run
starts afresh, as Lightning's own ``"last"`` does.

A configuration the classes reject (a missing ``model_path``, a bad setting) or a Trainer that
:meth:`rlexact.RLModule.check_trainer` refuses (checked before the run writes anything) raises :class:`ConfigError`
from :func:`main`, chained to the class's own error; the ``rlexact`` command prints that error in one line and exits
with status 2 (the status of jsonargparse's parse errors). Errors once the subcommand runs keep their tracebacks.
``rlexact export`` reports a checkpoint or output it cannot use (:class:`rlexact.export.ExportError`: a missing or
non-checkpoint path, a module the checkpoint cannot rebuild, ...) the same way; its other errors keep their tracebacks.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerTypeTuple
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from rlexact.data import PromptDataModule
from rlexact.export import ExportError
from rlexact.export import main as export_main
from rlexact.module import RLModule
from rlexact.resources import config_path

__all__ = ["ConfigError", "RLExactCLI", "entry", "main", "previous_last_checkpoint"]


OTHER_COMMANDS = (
    "other commands: 'rlexact demo [--help]' runs the embedded demo; 'rlexact export CKPT DIR' writes a checkpoint "
    "(file or sharded folder) as a transformers folder"
)
"""The top-level help's last line: the commands :func:`entry` runs before LightningCLI."""

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")
"""``ckpt_path`` values that Lightning resolves itself (not files; also ``registry:...`` and URLs)."""


class ConfigError(ValueError):
    """The configuration parsed, but instantiating its classes failed; the message is the first error raised (a
    class's own check, not the wrapper jsonargparse raises around it)."""

    @classmethod
    def of(cls, error: BaseException) -> ConfigError:
        first = error
        while (first.__cause__ or first.__context__) is not None:
            first = first.__cause__ or first.__context__
        return cls(f"{type(first).__name__}: {first}")


class RLExactCLI(LightningCLI):
    """LightningCLI restricted to ``fit`` and ``validate`` (RL training has no test / predict loop).

    The top-level ``optimizer:`` / ``lr_scheduler:`` sections (``--optimizer AdamW --optimizer.lr 1e-6``) are
    LightningCLI's, linked into ``RLModule(optimizer=..., lr_scheduler=...)`` rather than patched into
    ``configure_optimizers``: the parameters exist only after ``configure_model`` (and FSDP2 shards them there).
    Without them the module's AdamW + warmup from ``optim:`` applies.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_optimizer_args((Optimizer,), link_to="model.init_args.optimizer")
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple, link_to="model.init_args.lr_scheduler")

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, OSError) as e:
            raise ConfigError.of(e) from e

    @override
    def before_fit(self) -> None:
        self._check_trainer(fitting=True)
        self._resolve_checkpoint()

    @override
    def before_validate(self) -> None:
        self._check_trainer(fitting=False)
        self._resolve_checkpoint()

    def _check_trainer(self, fitting: bool) -> None:
        """:meth:`RLModule.check_trainer` before Lightning starts (which writes the run's config and log folder), its
        refusal as a :class:`ConfigError`."""
        try:
            self.model.check_trainer(self.trainer, fitting)
        except ValueError as e:
            raise ConfigError.of(e) from e

    def _resolve_checkpoint(self) -> None:
        """Refuse a ``ckpt_path`` file that is not there (one line, before training); resolve ``last`` to the newest
        last checkpoint of the logger's earlier versions."""
        kwargs = self.config_init[self.subcommand]
        ckpt = kwargs.get("ckpt_path")
        named = ckpt in LIGHTNING_CKPT_NAMES or str(ckpt).startswith("registry:") or "://" in str(ckpt)
        if ckpt is not None and not named and not os.path.exists(ckpt):
            raise ConfigError(
                f"FileNotFoundError: ckpt_path {os.fspath(ckpt)!r} does not exist (looked from {os.getcwd()}); "
                "--ckpt_path last resumes from the newest last checkpoint of the logger's runs"
            )
        if ckpt != "last":
            return
        found = previous_last_checkpoint(self.trainer)
        if found is not None:
            rank_zero_info(f"ckpt_path='last': resuming from {found}, the newest last checkpoint of the logger's runs")
            kwargs["ckpt_path"] = found

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        full = LightningCLI.subcommands()
        return {k: full[k] for k in ("fit", "validate")}


def main(args: Any = None, *, run: bool = True) -> RLExactCLI:
    """Entry point of the ``rlexact`` console script.

    Args:
        args: command-line arguments (a list of strings or a dict); None reads ``sys.argv``.
        run: run the subcommand (False: only parse and instantiate, e.g. for tests).
    """
    return RLExactCLI(
        RLModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"epilog": OTHER_COMMANDS},
        args=args,
        run=run,
    )


def previous_last_checkpoint(trainer: L.Trainer) -> str | None:
    """The newest ``last*.ckpt`` (file or sharded folder) under ``<logger root>/version_*/checkpoints``, when every
    checkpoint callback writes under the logger's version folder (none has a ``dirpath``), else None."""
    callbacks = trainer.checkpoint_callbacks
    root = getattr(trainer.logger, "root_dir", None)
    if not callbacks or root is None or any(getattr(cb, "dirpath", None) is not None for cb in callbacks):
        return None
    found = glob.glob(os.path.join(glob.escape(root), "version_*", "checkpoints", "last*.ckpt"))

    def newest(path: str) -> tuple[float, int]:  # the later version breaks a tie of coarse modification times
        version = os.path.basename(os.path.dirname(os.path.dirname(path)))[len("version_") :]
        return os.path.getmtime(path), int(version) if version.isdigit() else -1

    return max(found, key=newest) if found else None


def _packaged_configs(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config`` / ``-c`` value that is not a file but names a packaged recipe replaced by the
    recipe's path."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        value = out[i + 1]
        if arg in ("--config", "-c") and not os.path.exists(value):
            out[i + 1] = config_path(value) or value
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            value = arg.split("=", 1)[1]
            if not os.path.exists(value):
                out[i] = "--config=" + (config_path(value) or value)
    return out


def entry(argv: Sequence[str] | None = None) -> None:
    """The ``rlexact`` console script: ``rlexact demo [options]`` runs the embedded demo, ``rlexact export CKPT DIR``
    writes a transformers folder, anything else goes to :func:`main` (LightningCLI). A :class:`ConfigError` or an
    :class:`rlexact.export.ExportError` is printed in one line (``rlexact: error: ...``) with exit status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["demo"]:
        from rlexact.demo.run import main as demo_main

        demo_main(args[1:])
        return
    try:
        if args[:1] == ["export"]:
            export_main(args[1:])
            return
        resolved = _packaged_configs(args)
        if argv is None:  # from the command line: LightningCLI reads sys.argv itself (it warns when given args as well)
            sys.argv[1:] = resolved
        main(None if argv is None else resolved)
    except (ConfigError, ExportError) as e:
        print(f"rlexact: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    entry()
