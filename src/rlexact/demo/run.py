"""The embedded demo: GRPO with exact rollouts teaches a tiny Qwen3 model 2-digit addition on CPU.

``python -m rlexact.demo`` (or ``python -m rlexact.demo.run``) runs, in a few minutes on 2 CPU cores:

1. loads the packaged start checkpoint (``rlexact/demo/assets/checkpoint``: a ~0.45M-parameter ``Qwen3ForCausalLM``
   and its character tokenizer, produced by ``python -m rlexact.demo.sft``);
2. evaluates the mean reward on held-out problems (sampled at temperature 1 with :class:`rlexact.rollout.Generator`);
3. trains with GRPO (:class:`rlexact.RLModule`, ``Trainer.fit``) with exact rollouts: the rollout log-probs are the
   trainer's bit for bit, so pi_old needs no recompute; :class:`rlexact.callbacks.MismatchProbe` recomputes them
   anyway on every step and counts the tokens whose two log-probs differ in any bit. The progress bar shows
   ``reward/mean``; TensorBoard logs go to ``<out>/demo``;
4. evaluates again and prints the summary: reward before and after, and how many rollout tokens differed bitwise
   from the trainer (0). ``<out>/summary.json`` keeps it.

The reward is :class:`rlexact.rewards.ArithmeticReward` (1 for the exact sum, else 0, i.e. exact-answer accuracy;
``--partial-credit`` grades wrong integers). Everything is seeded, so a run is reproducible on one machine.

The same demo is the TIM baseline: ``--kernels native --dtype bfloat16`` samples with the stock kernels (pi_old is
then recomputed by the trainer) and ``--inject 0.05`` perturbs the rollout log-probs with
:class:`rlexact.callbacks.MismatchInjection`; the summary's ``train_bitwise_equal_frac`` (MismatchProbe's
``mismatch/bitwise_equal_frac`` over the run) is 1.0 only for the exact engine without injection.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import itertools
import json
import os
import platform
import re
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import TQDMProgressBar

from rlexact.checks import choice, finite, flag_message, integer, not_a_file, positive_int
from rlexact.envinfo import library_versions, named_commit
from rlexact.resources import DEMO_MODEL, checkpoint_path, resolve

__all__ = [
    "DemoConfig",
    "build_datamodule",
    "build_module",
    "checkpoint_path",
    "demo_rows",
    "evaluate",
    "field_descriptions",
    "main",
    "quiet_library_logs",
    "run_demo",
    "start_checkpoint",
    "write_record",
]

TRAIN_FILE_ROWS = 8192
"""Rows of the packaged ``train.jsonl``."""
EVAL_FILE_ROWS = 500
"""Rows of the packaged ``eval.jsonl`` (the SFT's held-out problems)."""


@dataclass
class DemoConfig:
    """Settings of the demo (the defaults are the documented run).

    Attributes:
        out: output folder (TensorBoard logs under ``<out>/demo``, ``summary.json``).
        steps: rollout steps (one GRPO optimizer step each).
        prompts_per_step: prompts per rollout step.
        n: samples per prompt (GRPO group size).
        lr: AdamW learning rate.
        warmup_steps: linear learning-rate warmup (optimizer steps).
        clip: PPO clip epsilon (low and high).
        max_new_tokens: response budget (answers have at most 3 digits plus ``<|im_end|>``).
        eval_prompts: held-out prompts of the before/after evaluation.
        eval_n: samples per held-out prompt.
        seed: seed of the sampler, the data order and the evaluation draws.
        partial_credit: train and report the partial-credit reward (else 0/1 accuracy).
        threads: torch intra-op threads during the demo (restored afterwards); 0 leaves torch's setting. Default 1:
            the demo's tiny matrices gain little from a second thread, and threads that compete with another busy
            process for the same cores slow the demo down many times over.
        checkpoint: start checkpoint (``"demo"`` = the packaged one, or a local folder).
        progress: show the Lightning progress bar.
        kernels: rollout engine kernels, ``"exact"`` or ``"native"`` (the stock-kernel TIM baseline; pi_old is then
            recomputed by the trainer instead of taken from the rollout).
        dtype: model dtype, ``"float32"`` or ``"bfloat16"``.
        inject: scale of :class:`rlexact.callbacks.MismatchInjection` noise on the rollout log-probs (0 = off).
    """

    out: str = "runs"
    steps: int = 100
    prompts_per_step: int = 32
    n: int = 8
    lr: float = 3e-4
    warmup_steps: int = 10
    clip: float = 0.2
    max_new_tokens: int = 6
    eval_prompts: int = 200
    eval_n: int = 4
    seed: int = 0
    partial_credit: bool = False
    threads: int = 1
    checkpoint: str = DEMO_MODEL
    progress: bool = True
    kernels: str = "exact"
    dtype: str = "float32"
    inject: float = 0.0

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "n", "max_new_tokens", "eval_prompts", "eval_n"):
            positive_int(name, getattr(self, name))
        if self.n < 2:
            raise ValueError(f"n must be >= 2 (a GRPO group), got {self.n}")
        finite("lr", self.lr, low=0.0, low_open=True)
        integer("warmup_steps", self.warmup_steps, low=0)
        finite("clip", self.clip, low=0.0, low_open=True)
        integer("seed", self.seed, low=0)
        choice("kernels", self.kernels, ("exact", "native"))
        choice("dtype", self.dtype, ("float32", "bfloat16"))
        finite("inject", self.inject, low=0.0)
        integer("threads", self.threads, low=0)


# ---------------------------------------------------------------------------------------------------------------------
# the packaged checkpoint and data
# ---------------------------------------------------------------------------------------------------------------------


def resolve_model_path(path: str) -> str:
    """``"demo"`` / ``"rlexact://demo"`` -> :func:`checkpoint_path`; any other string is returned unchanged."""
    return resolve(path)


def _sft_report(ckpt: str) -> dict:
    from rlexact.demo.sft import SFT_JSON

    try:
        with open(os.path.join(ckpt, SFT_JSON), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def data_path(split: str) -> str:
    """The packaged prompt file of ``split`` (``"train"`` or ``"eval"``): ``rlexact/demo/assets/data/<split>.jsonl``
    (what :func:`write_data` writes; ``configs/demo.yaml`` reads it)."""
    return os.fspath(importlib.resources.files("rlexact.demo").joinpath("assets", "data", f"{split}.jsonl"))


def write_data(folder: str, train_size: int = TRAIN_FILE_ROWS, eval_size: int = EVAL_FILE_ROWS) -> list[str]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (rows of :func:`demo_rows`) into ``folder``; returns the paths."""
    from rlexact.demo.task import write_jsonl

    return [
        write_jsonl(os.path.join(folder, "train.jsonl"), demo_rows("train", train_size)),
        write_jsonl(os.path.join(folder, "eval.jsonl"), demo_rows("eval", eval_size)),
    ]


def demo_rows(split: str, size: int, ckpt: str | None = None) -> list[dict[str, str]]:
    """Prompt rows of the demo: ``"eval"`` = the SFT's held-out problems, ``"train"`` = other problems of the same
    task (task seed 2, with the held-out prompts removed). Deterministic."""
    from rlexact.demo.task import ArithmeticTask

    settings = _sft_report(ckpt or checkpoint_path()).get("settings", {})
    max_operand = int(settings.get("max_operand", 99))
    ops = tuple(settings.get("ops", ("+",)))
    eval_task = ArithmeticTask(seed=int(settings.get("eval_seed", 1)), max_operand=max_operand, ops=ops)
    if split == "eval":
        return eval_task.generate(size)
    if split != "train":
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    held_out = {r["prompt"] for r in eval_task.generate(int(settings.get("eval_size", EVAL_FILE_ROWS)))}
    train_task = ArithmeticTask(seed=2, max_operand=max_operand, ops=ops)
    return list(itertools.islice((r for r in train_task if r["prompt"] not in held_out), size))


# ---------------------------------------------------------------------------------------------------------------------
# module, data, evaluation
# ---------------------------------------------------------------------------------------------------------------------


def build_module(cfg: DemoConfig, ckpt: str):
    """The :class:`rlexact.RLModule` of the demo (GRPO, exact rollouts, pi_old = rollout log-probs)."""
    from rlexact.char_tokenizer import EOS_ID
    from rlexact.config import AlgorithmConfig, OptimConfig, RolloutConfig
    from rlexact.module import RLModule

    return RLModule(
        model_path=ckpt,
        tokenizer=ckpt,
        reward="arithmetic",
        reward_kwargs={"partial_credit": cfg.partial_credit},
        rollout=RolloutConfig(
            n=cfg.n,
            max_new_tokens=cfg.max_new_tokens,
            temperature=1.0,
            seed=cfg.seed,
            kernels=cfg.kernels,
            stop_token_ids=[EOS_ID],
        ),
        algorithm=AlgorithmConfig(
            objective="grpo",
            clip_low=cfg.clip,
            clip_high=cfg.clip,
            loss_agg_mode="token-mean",
            ppo_epochs=1,
            old_logprob_mode="exact" if cfg.kernels == "exact" else "recompute",
        ),
        optim=OptimConfig(lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, grad_clip=1.0, warmup_steps=cfg.warmup_steps),
        dtype=cfg.dtype,
    )


def build_datamodule(cfg: DemoConfig, ckpt: str):
    """Training prompts (raw ``"12+7="`` strings, no chat template): the first ``steps x prompts_per_step`` rows of
    :func:`demo_rows` ``("train")``, each used once, in a seeded order."""
    from rlexact.data import PromptDataModule

    return PromptDataModule(
        demo_rows("train", cfg.steps * cfg.prompts_per_step, ckpt),
        tokenizer=ckpt,
        batch_size=cfg.prompts_per_step,
        use_chat_template=False,
        shuffle=True,
        seed=cfg.seed,
        drop_last=True,
    )


@torch.no_grad()
def evaluate(module, rows: Sequence[dict], n: int, seed: int, max_new_tokens: int) -> dict[str, Any]:
    """Sample ``n`` completions per held-out row at temperature 1 with the module's generator and score them.

    Returns ``reward`` (the training reward's mean), ``accuracy`` (exact answers), ``samples``, and the exactness
    check of this rollout: ``tokens`` and ``tokens_differing`` (generator log-prob vs the trainer's packed forward,
    :func:`rlexact.sequence_logprobs`, compared bitwise).
    """
    from rlexact.data import encode_prompts
    from rlexact.logprobs import sequence_logprobs
    from rlexact.rewards import ArithmeticReward
    from rlexact.rollout import SamplingParams

    items = [{"prompt_text": r["prompt"], "answer": r["answer"]} for r in rows]
    prompts = encode_prompts(module.tokenizer, [r["prompt"] for r in rows], use_chat_template=False)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=seed,
        n=n,
        stop_token_ids=module.stop_token_ids(),
    )
    completions = module.generate(prompts, params)
    rewards = module.compute_rewards(items, completions, n)
    texts = [module.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    answers = [rows[k // n]["answer"] for k in range(len(completions))]
    acc = ArithmeticReward(partial_credit=False)([""] * len(texts), texts, answers)
    trainer_lp = sequence_logprobs(module.model, [c.sequence for c in completions], temperature=1.0)
    differing = 0
    tokens = 0
    for c, lp in zip(completions, trainer_lp):
        m = len(c.token_ids)
        if m:
            a = torch.as_tensor(c.logprobs, dtype=torch.float32).reshape(-1)
            b = lp[-m:].float().cpu()
            differing += int((a.view(torch.int32) != b.view(torch.int32)).sum())
            tokens += m
    return {
        "reward": float(rewards.double().mean()),
        "accuracy": sum(acc) / len(acc),
        "samples": len(completions),
        "tokens": tokens,
        "tokens_differing": differing,
    }


class DemoProgressBar(TQDMProgressBar):
    """The tqdm bar of the demo: ``GRPO`` steps with the logged ``reward/mean`` (no logger version)."""

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("GRPO")


class RewardHistory(Callback):
    """Keeps the logged ``reward/mean`` of every rollout step (for the summary)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("reward/mean")
        if value is not None:
            self.rewards.append(float(value))


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
    """Lightning's info lines (GPU/TPU availability, tips) and the transformers weight-loading bar off for the block;
    the previous logger levels and bar setting are restored afterwards. Warnings are untouched."""
    import logging

    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    bar_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bar_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence library chatter that does not apply to a CPU demo (:func:`quiet_library_logs`, hints about workers and
    validation); warnings that matter still show."""
    with quiet_library_logs(), warnings.catch_warnings():
        for pattern in (
            ".*does not have many workers.*",
            ".*GPU available but not used.*",
            ".*The number of training batches.*",
            ".*smaller than the logging interval.*",
            ".*validation_step.*no .val_dataloader.*",
            ".*isinstance.treespec, LeafSpec.*",
        ):
            warnings.filterwarnings("ignore", message=pattern)
        yield


# ---------------------------------------------------------------------------------------------------------------------
# the demo
# ---------------------------------------------------------------------------------------------------------------------


def start_checkpoint(cfg: DemoConfig) -> str:
    """The folder of ``cfg``'s start checkpoint, once ``cfg`` is checked against it and the file system: the
    checkpoint exists, ``out`` is no file, and ``eval_prompts`` stays within the checkpoint's held-out problems."""
    ckpt = resolve_model_path(cfg.checkpoint)
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(
            f"checkpoint {ckpt!r} not found; build a start checkpoint with python -m rlexact.demo.sft --out DIR"
        )
    not_a_file("out", cfg.out)
    held_out = int(_sft_report(ckpt).get("settings", {}).get("eval_size", EVAL_FILE_ROWS))
    if cfg.eval_prompts > held_out:
        raise ValueError(
            f"eval_prompts must be at most {held_out}, the start checkpoint's held-out problems (more would "
            f"evaluate on training prompts), got {cfg.eval_prompts}"
        )
    return ckpt


def run_demo(args: argparse.Namespace | DemoConfig | dict | None = None) -> dict[str, Any]:
    """Run the demo (see the module docstring) and return the summary dict (also written to ``<out>/summary.json``).

    Args:
        args: a :class:`DemoConfig`, a dict of its fields, an ``argparse.Namespace`` with (some of) its fields
            (the ``rlexact demo`` subcommand hook), or None for the defaults.
    """
    cfg = _as_config(args)
    ckpt = start_checkpoint(cfg)
    threads = torch.get_num_threads()
    try:
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        with _quiet():
            return _run(cfg, ckpt)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DemoConfig, ckpt: str) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from rlexact.callbacks import MismatchInjection, MismatchProbe

    t_start = time.perf_counter()
    os.makedirs(cfg.out, exist_ok=True)
    had_seed_env = "PL_GLOBAL_SEED" in os.environ
    L.seed_everything(cfg.seed, verbose=False)  # nothing in the demo should draw from the global RNGs; belt and braces
    if not had_seed_env:
        os.environ.pop("PL_GLOBAL_SEED", None)
    module = build_module(cfg, ckpt)
    module.configure_model()
    data = build_datamodule(cfg, ckpt)
    eval_rows = demo_rows("eval", cfg.eval_prompts, ckpt)
    eval_seed = cfg.seed + 1_000_003  # the same held-out draws before and after training

    _say(f"rlexact demo: GRPO with {cfg.kernels} rollouts on {_describe_model(module.model)}, CPU")
    _say(f"  start checkpoint: {ckpt}")
    _say(f"  reward: {_reward_name(cfg)}")
    t0 = time.perf_counter()
    before = evaluate(module, eval_rows, cfg.eval_n, eval_seed, cfg.max_new_tokens)
    _say(
        f"before training: mean reward {before['reward']:.3f} on {before['samples']} held-out samples "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    probe = MismatchProbe(argmax=False, histograms=True, histogram_every_n_steps=10)
    history = RewardHistory()
    logger = TensorBoardLogger(save_dir=cfg.out, name="demo", default_hp_metric=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=cfg.steps,
        max_epochs=1,
        logger=logger,
        callbacks=([MismatchInjection(scale=cfg.inject, seed=cfg.seed)] if cfg.inject > 0 else [])
        + [probe, history]
        + ([DemoProgressBar(refresh_rate=1)] if cfg.progress else []),
        enable_checkpointing=False,
        enable_progress_bar=cfg.progress,
        enable_model_summary=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    train_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    after = evaluate(module, eval_rows, cfg.eval_n, eval_seed, cfg.max_new_tokens)
    _say(f"after training:  mean reward {after['reward']:.3f} ({time.perf_counter() - t0:.1f} s)")
    k = min(5, len(history.rewards))
    summary = {
        "reward": _reward_name(cfg),
        "reward_before": round(before["reward"], 4),
        "reward_after": round(after["reward"], 4),
        "reward_rise": round(after["reward"] - before["reward"], 4),
        "accuracy_before": round(before["accuracy"], 4),
        "accuracy_after": round(after["accuracy"], 4),
        "eval_samples": before["samples"],
        "train_reward_window": k,
        "train_reward_first5": round(sum(history.rewards[:k]) / k, 4) if k else None,
        "train_reward_last5": round(sum(history.rewards[-k:]) / k, 4) if k else None,
        "rollout_steps": int(module.rollout_step),
        "train_rollout_tokens": int(probe.tokens_total),
        "train_rollout_tokens_differing": int(probe.unequal_tokens_total),
        "train_bitwise_equal_frac": 1.0 - int(probe.unequal_tokens_total) / max(1, int(probe.tokens_total)),
        "eval_tokens": before["tokens"] + after["tokens"],
        "eval_tokens_differing": before["tokens_differing"] + after["tokens_differing"],
        "train_seconds": round(train_s, 1),
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "tensorboard": os.path.abspath(logger.log_dir),
        "config": asdict(cfg),
        "threads": torch.get_num_threads(),
        "versions": library_versions("lightning", "transformers"),
        "machine": platform.machine(),
    }
    with open(os.path.join(cfg.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    _print_summary(summary)
    return summary


def _reward_name(cfg: DemoConfig) -> str:
    if cfg.partial_credit:
        return "ArithmeticReward(partial_credit=True): 1 for the exact sum, graded credit for a wrong integer"
    return "ArithmeticReward: 1 if the sampled answer is the exact sum, else 0 (= exact-answer accuracy)"


def _print_summary(s: dict[str, Any]) -> None:
    exact = s["train_rollout_tokens_differing"] == 0 and s["eval_tokens_differing"] == 0
    verdict = (
        "exact: every rollout log-prob equals the trainer's, bit for bit"
        if exact
        else f"NOT EXACT: bitwise-equal fraction {s['train_bitwise_equal_frac']:.4f} (kernels="
        f"{s['config']['kernels']}, inject={s['config']['inject']})"
    )
    k = s["train_reward_window"]
    steps = "step" if k == 1 else "steps"
    lines = [
        "",
        "=" * 80,
        "rlexact demo summary",
        f"  reward: {s['reward']}",
        f"  mean reward on {s['eval_samples']} held-out samples (temperature 1):",
        f"    before {s['reward_before']:.3f}  ->  after {s['reward_after']:.3f}   (rise {s['reward_rise']:+.3f})",
        f"  training batches (reward/mean): first {k} {steps} {s['train_reward_first5']:.3f}, "
        f"last {k} {steps} {s['train_reward_last5']:.3f}",
        "  rollout tokens whose log-prob differed bitwise from the trainer's:",
        f"    {s['train_rollout_tokens_differing']} of {s['train_rollout_tokens']} during training (MismatchProbe), "
        f"{s['eval_tokens_differing']} of {s['eval_tokens']} in the evaluations",
        f"    -> {verdict}",
        f"  {s['rollout_steps']} GRPO steps in {s['train_seconds']:.1f} s, {s['wall_seconds']:.1f} s in all "
        f"({s['threads']} CPU thread{'' if s['threads'] == 1 else 's'})",
        f"  TensorBoard logs: tensorboard --logdir {s['tensorboard']}",
        "=" * 80,
    ]
    _say("\n".join(lines))


def _say(msg: str) -> None:
    print(msg, flush=True)


def _describe_model(model) -> str:
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return (
        f"{type(model).__name__} ({params / 1e6:.2f}M parameters, {c.num_hidden_layers} layers, hidden {c.hidden_size})"
    )


def _as_config(args: Any) -> DemoConfig:
    if args is None:
        return DemoConfig()
    if isinstance(args, DemoConfig):
        return args
    names = {f.name for f in fields(DemoConfig)}
    values = dict(args) if isinstance(args, dict) else vars(args)
    unknown = sorted(k for k in values if k not in names and isinstance(args, dict))
    if unknown:
        raise ValueError(f"unknown demo settings {unknown}; valid: {sorted(names)}")
    return DemoConfig(**{k: v for k, v in values.items() if k in names and v is not None})


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options (the :class:`DemoConfig` fields, described by its docstring) to ``parser``."""
    defaults = DemoConfig()
    described = field_descriptions(DemoConfig)
    for f in fields(DemoConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        text = f"{described.get(f.name, '')} (default {value!r})".lstrip()
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(flag, type=type(value), default=None, help=text)
    return parser


def field_descriptions(cls: type) -> dict[str, str]:
    """``name -> description`` of the ``Attributes:`` section of ``cls``'s docstring (continuation lines joined)."""
    described: dict[str, str] = {}
    name = None
    for line in (cls.__doc__ or "").partition("Attributes:")[2].splitlines():
        head = re.match(r"^ {8}(\w+): (.*)$", line)
        if head:
            name = head.group(1)
            described[name] = head.group(2)
        elif name is not None and line.startswith(" " * 12):
            described[name] += " " + line.strip()
        elif line.strip():
            name = None
    return described


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m rlexact.demo`` / ``python -m rlexact.demo.run`` (``--help`` lists the options)."""
    parser = argparse.ArgumentParser(prog="python -m rlexact.demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument(
        "--write-data",
        metavar="DIR",
        default=None,
        help="only write the demo's train.jsonl / eval.jsonl into DIR (e.g. src/rlexact/demo/assets/data) and exit",
    )
    parser.add_argument(
        "--record",
        metavar="FILE",
        default=None,
        help="also write the summary with its provenance (command, commit, date, device, versions) to FILE, e.g. "
        "benchmarks/results/demo_cpu.json",
    )
    args = parser.parse_args(argv)
    if args.write_data:
        for path in write_data(args.write_data):
            _say(f"wrote {path}")
        return {}
    try:
        cfg = _as_config(args)
        start_checkpoint(cfg)
        if args.record:
            named_commit()  # the record's header names it: a malformed one fails now, not after the run
    except (ValueError, OSError) as e:
        parser.error(flag_message(e, (f.name for f in fields(DemoConfig))))
    summary = run_demo(cfg)
    if args.record:
        _say(f"recorded {write_record(summary, args.record)}")
    return summary


RECORD_NOTES = [
    "reward = the training reward (ArithmeticReward: 1 for the exact sum, else 0, unless partial_credit), mean over "
    "eval_prompts held-out prompts x eval_n samples at temperature 1; the same seeded draws before and after training",
    "train_rollout_tokens_differing: MismatchProbe recomputes the trainer log-prob of every rollout token of every "
    "step and compares the float32 bits; eval_tokens_differing: the same check on the evaluation rollouts",
    "wall_seconds: measured inside the process, from the start of the demo to the summary (imports excluded)",
]
"""Explanations written with every :func:`write_record` result."""


def write_record(summary: dict[str, Any], path: str) -> str:
    """Write ``summary`` headed by :func:`rlexact.envinfo.result_header` (benchmark name, command, git commit,
    date, device, CPU count, versions) to the JSON file ``path``; returns the path."""
    from rlexact.envinfo import result_header

    record = {
        **result_header("embedded demo: GRPO with exact rollouts on the packaged tiny Qwen3 (CPU)", "lightning",
                        "transformers"),
        **{k: v for k, v in summary.items() if k not in ("versions", "tensorboard")},
        "notes": RECORD_NOTES,
    }  # fmt: skip
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return path


if __name__ == "__main__":
    main()
