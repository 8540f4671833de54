"""The ``rlexact`` command: a LightningCLI with the ``fit`` and ``validate`` subcommands, plus ``rlexact demo``.

Usage::

    rlexact demo                                                   # the embedded demo (python -m rlexact.demo)
    rlexact fit --config configs/grpo_qwen3_1p7b.yaml
    rlexact fit --config configs/grpo_qwen3_1p7b.yaml --model.init_args.model_path /ckpt/Qwen3-1.7B
    rlexact fit --config configs/demo.yaml --print_config          # the resolved configuration, nothing loaded
    rlexact validate --config configs/demo.yaml --ckpt_path last.ckpt

The YAML has LightningCLI's sections: ``trainer`` (callbacks as ``class_path`` / ``init_args``, e.g.
``rlexact.callbacks.MismatchProbe``), ``model`` (``class_path: rlexact.RLModule`` or a subclass, with
``init_args`` holding the :class:`rlexact.RLModule` arguments and the nested :mod:`rlexact.config` dataclasses) and
``data`` (``class_path: rlexact.data.PromptDataModule``). Unknown keys anywhere are errors (jsonargparse).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import LightningCLI

from rlexact.data import PromptDataModule
from rlexact.module import RLModule

__all__ = ["RLExactCLI", "entry", "main"]


class RLExactCLI(LightningCLI):
    """LightningCLI restricted to ``fit`` and ``validate`` (RL training has no test / predict loop)."""

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
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


def entry(argv: Sequence[str] | None = None) -> None:
    """The ``rlexact`` console script: ``rlexact demo [options]`` runs the embedded demo, anything else goes to
    :func:`main` (LightningCLI)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from rlexact.demo.run import main as demo_main

        demo_main(argv[1:])
        return
    main(argv)


if __name__ == "__main__":  # pragma: no cover
    entry()
