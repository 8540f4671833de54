"""Run the study's arms: one Lightning fit per (arm, seed), with the probes every arm carries, cached on disk.

Every run trains the packaged (or a given) arithmetic checkpoint with :class:`~rlexact.study.engine.
PerturbedRolloutModule` and carries :class:`~rlexact.callbacks.MismatchProbe`,
:class:`~rlexact.study.probes.DirectionAgreementProbe`, the arm's correction and, for shadow arms,
:class:`~rlexact.callbacks.ShadowCorrection` instances. :class:`History` keeps one row of scalars per
rollout step. A run's result is written to ``<out>/runs/<arm key>-s<seed>/result.json`` and reused by every later
experiment that needs the same arm for at most as many steps (the training prompts are a fixed seeded pool, so the
first ``k`` steps of a run do not depend on how many steps it has in all).

Several runs at once (``scale.workers > 1``) are spawned processes; on CUDA they share the visible GPUs round-robin
(several runs per GPU are fine: a run of a small model leaves most of a GPU idle). Each run uses ``scale.threads``
torch threads (0: the CPUs divided among the workers). The reward (a string comparison) is scored in the run's own
process, so the workers start no reward pools.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from rlexact.study.config import Arm, Scale, parse_engine, parse_shadow_source

__all__ = [
    "FailedRuns",
    "History",
    "build_callbacks",
    "build_module",
    "load_result",
    "resolve_device",
    "run_arm",
    "run_arms",
    "run_threads",
    "truncate_result",
]

TRAIN_POOL = 8192
"""Training prompts drawn (then shuffled by the run's seed) when ``steps x prompts_per_step`` fits."""

_MODULE_KEYS = (
    "reward/mean",
    "grad_norm",
    "loss/pg_loss",
    "entropy",
    "clipfrac",
    "ratio/mean",
    "response_length/mean",
    "update/optimizer_steps",
    "update/skipped_steps",
)
"""Scalars the module logs on every rollout step that the history keeps."""

_UPDATE_KEYS = ("grad_norm", "loss/pg_loss", "entropy", "clipfrac", "ratio/mean")
"""Of those, the ones logged only when the rollout step made an optimizer step."""


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is visible, else ``"cpu"``; ``"cuda"`` without one is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("scale.device='cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    return device


def run_threads(scale: Scale) -> int:
    """Torch intra-op threads of one run: ``scale.threads``, or for 0 the CPUs this process may use divided among
    ``scale.workers`` (at least 1), so parallel runs do not oversubscribe the cores."""
    if scale.threads > 0:
        return scale.threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS, Windows)
        cpus = os.cpu_count() or 1
    return max(1, cpus // scale.workers)


class FailedRuns(RuntimeError):
    """Some runs of :func:`run_arms` raised; the others finished. ``results``: the finished runs (as
    :func:`run_arms` returns them); ``failures``: ``[(arm, traceback text)]``."""

    def __init__(self, results: dict[tuple[str, int], dict[str, Any]], failures: list[tuple[Arm, str]]) -> None:
        names = ", ".join(f"{arm.label!r} (seed {arm.seed})" for arm, _ in failures)
        super().__init__(f"{len(failures)} run(s) failed: {names}; their tracebacks are in the log above")
        self.results = results
        self.failures = failures


class History(Callback):
    """One row per rollout step: the module's scalars plus the ``last_metrics`` of the given RL callbacks.

    Args:
        sources: ``{name: callback}``; each callback's ``last_metrics`` are stored under their own keys.
    """

    def __init__(self, sources: dict[str, Any]) -> None:
        self.sources = sources
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row: dict[str, float] = {"step": float(len(self.rows))}
        metrics = trainer.callback_metrics
        for key in _MODULE_KEYS:
            if key in metrics:
                row[key] = float(metrics[key])
        if row.get("update/optimizer_steps") == 0.0:  # no update: the module logged no update metrics this step,
            for key in _UPDATE_KEYS:  # so callback_metrics still hold the previous step's
                row.pop(key, None)
        for cb in self.sources.values():
            for key, value in getattr(cb, "last_metrics", {}).items():
                row[key] = float(value)
        copy = getattr(pl_module, "rollout_copy", None)
        if copy is not None:
            row["rollout_engine/weight_rel_diff"] = float(copy.weight_rel_diff)
        self.rows.append(row)


def build_module(arm: Arm, scale: Scale, checkpoint: str):
    """The arm's :class:`~rlexact.study.engine.PerturbedRolloutModule` (arithmetic reward scored in this process,
    demo tokenizer)."""
    from rlexact.char_tokenizer import EOS_ID
    from rlexact.config import AlgorithmConfig, OptimConfig, RolloutConfig
    from rlexact.rewards import RewardConfig
    from rlexact.study.engine import PerturbedRolloutModule

    reinforce = arm.objective == "reinforce"
    batch = scale.prompts_per_step * scale.n
    engine, engine_scale = parse_engine(arm.engine)
    return PerturbedRolloutModule(
        model_path=checkpoint,
        tokenizer=checkpoint,
        reward="arithmetic",
        reward_config=RewardConfig(workers=0),
        rollout=RolloutConfig(
            n=scale.n,
            max_new_tokens=scale.max_new_tokens,
            temperature=1.0,
            seed=arm.seed,
            kernels=arm.kernels,
            stop_token_ids=[EOS_ID],
        ),
        algorithm=AlgorithmConfig(
            objective=arm.objective,
            clip_low=scale.clip,
            clip_high=scale.clip,
            loss_agg_mode="token-mean",
            ppo_epochs=1,
            mini_batch_size=None if reinforce else batch // scale.mini_batches,
            shuffle_seed=arm.seed,
            old_logprob_mode=arm.mode,
        ),
        optim=OptimConfig(
            lr=scale.lr, betas=(0.9, 0.99), weight_decay=0.0, grad_clip=1.0, warmup_steps=scale.warmup_steps
        ),
        dtype=arm.dtype,
        rollout_weights=engine,
        rollout_weight_scale=engine_scale,
        rollout_weight_seed=arm.seed,
    )


def _engine_scorer(kind: str, scale: float, seed: int):
    """A ShadowCorrection mismatch callable: log-probs of the batch under a perturbed copy of the policy."""
    from rlexact.callbacks.probes import policy_model
    from rlexact.callbacks.shadow import module_logprobs
    from rlexact.study.engine import PerturbedCopy

    state: dict[str, Any] = {}

    @torch.no_grad()
    def engine_logprobs(pl_module, batch):
        if "copy" not in state:
            state["copy"] = PerturbedCopy(policy_model(pl_module), kind, scale, seed)
        return module_logprobs(pl_module, state["copy"].sync(), batch)

    engine_logprobs.__name__ = f"engine_{kind}"
    return engine_logprobs


def build_callbacks(arm: Arm) -> tuple[list[Callback], dict[str, Any], dict[str, Any]]:
    """``(callbacks in hook order, {name: callback} for the history, {prefix: ShadowCorrection})``."""
    from rlexact.callbacks import MismatchProbe, ShadowCorrection, ShadowSpec, TruncatedIS, correction_callbacks
    from rlexact.callbacks.functional import RejectionSpec, TISSpec
    from rlexact.callbacks.shadow import SHADOW_CORRECTIONS
    from rlexact.study.probes import DirectionAgreementProbe

    corrections: list[Callback] = []
    if arm.correction == "tis":
        corrections = [TruncatedIS(level="token", cap=2.0)]
    elif arm.correction is not None:
        corrections = list(correction_callbacks(arm.correction))
    probe = MismatchProbe(argmax=False, histograms=True, histogram_every_n_steps=10)
    direction = DirectionAgreementProbe()
    specs: dict[str, Any] = dict(SHADOW_CORRECTIONS)
    for tau in arm.shadow_thresholds:
        specs[f"tis-srs-k3-corr-ratio@{tau:g}"] = ShadowSpec(
            "recompute", tis=TISSpec("token", 2.0), rejection=RejectionSpec("corr", "sequence_sum", "k3", tau)
        )
    shadows: dict[str, Any] = {}
    for source in arm.shadow:
        kind, engine, value = parse_shadow_source(source)
        prefix = f"shadow_{kind}" if engine is None else f"shadow_engine_{engine}"
        every = arm.shadow_every
        if kind == "inject":
            mismatch: Any = "inject"
        elif kind == "native":
            mismatch = "native"
        else:
            mismatch = _engine_scorer(engine, value, arm.seed)
        shadows[prefix] = ShadowCorrection(
            corrections=specs,
            mismatch=mismatch,
            scale=value,
            target="logits",
            seed=arm.seed,
            every_n_steps=every,
            all_ministeps=True,
            prefix=prefix,
        )
    sources = {f"correction{i}": cb for i, cb in enumerate(corrections)}
    sources.update({"mismatch": probe, "direction": direction})
    callbacks = [*corrections, probe, direction, *shadows.values()]
    return callbacks, sources, shadows


def _run_dir(out: str | Path, arm: Arm) -> Path:
    return Path(out) / "runs" / f"{arm.key()}-s{arm.seed}"


def load_result(out: str | Path, arm: Arm, steps: int) -> dict[str, Any] | None:
    """The cached result of ``arm`` cut to ``steps`` rollout steps, or None when no cached run has that many."""
    path = _run_dir(out, arm) / "result.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    if result.get("steps", 0) < steps:
        return None
    return truncate_result(result, steps)


def truncate_result(result: dict[str, Any], steps: int) -> dict[str, Any]:
    """``result`` cut to its first ``steps`` rollout steps (a new dict; ``eval_after`` becomes None when the run
    had more steps, since it was measured after them)."""
    if result["steps"] < steps:
        raise ValueError(f"the run has {result['steps']} steps, fewer than {steps}")
    if result["steps"] == steps:
        return result
    out = dict(result)
    out["history"] = result["history"][:steps]
    out["shadow"] = {k: [row for row in rows if row["rollout_step"] < steps] for k, rows in result["shadow"].items()}
    out["eval_after"] = None
    out["steps"] = steps
    return out


def run_arm(arm: Arm, scale: Scale, out: str | Path, steps: int | None = None, device_index: int = 0) -> dict[str, Any]:
    """Train one arm for ``steps`` rollout steps (default ``scale.steps``), write and return its result.

    ``device_index``: the CUDA device of the run when ``scale.device`` resolves to ``"cuda"`` (made current for the
    run's kernels). The result holds the arm, the per-step ``history`` rows, the ``shadow`` probes' rows, the
    held-out evaluation ``eval_before`` / ``eval_after`` (:func:`rlexact.demo.run.evaluate`, sampled by the arm's
    rollout engine), the wall time and the TensorBoard folder.
    """
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from rlexact.data import PromptDataModule
    from rlexact.demo.run import demo_rows, evaluate, quiet_library_logs, resolve_model_path

    steps = scale.steps if steps is None else int(steps)
    device = resolve_device(scale.device)
    checkpoint = resolve_model_path(scale.checkpoint)
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(
            f"study checkpoint {checkpoint!r} not found; use 'demo' or build one with "
            "python -m rlexact.demo.sft --out DIR"
        )
    run_dir = _run_dir(out, arm)
    run_dir.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        torch.cuda.set_device(device_index)  # Triton launches on the current device
    threads = torch.get_num_threads()
    torch.set_num_threads(run_threads(scale))
    try:
        with quiet_library_logs():
            t_start = time.perf_counter()
            module = build_module(arm, scale, checkpoint)
            module.configure_model()
            if device == "cuda":
                module.to(torch.device("cuda", device_index))
            pool = max(TRAIN_POOL, steps * scale.prompts_per_step)
            data = PromptDataModule(
                demo_rows("train", pool, checkpoint),
                tokenizer=checkpoint,
                batch_size=scale.prompts_per_step,
                use_chat_template=False,
                shuffle=True,
                seed=arm.seed,
                drop_last=True,
            )
            eval_rows = demo_rows("eval", scale.eval_prompts, checkpoint) if scale.eval_prompts else []
            eval_seed = arm.seed + 1_000_003
            before = evaluate(module, eval_rows, scale.eval_n, eval_seed, scale.max_new_tokens) if eval_rows else None
            callbacks, sources, shadows = build_callbacks(arm)
            history = History(sources)
            logger = TensorBoardLogger(save_dir=str(run_dir), name="tb", version=0, default_hp_metric=False)
            trainer = L.Trainer(
                accelerator="gpu" if device == "cuda" else "cpu",
                devices=[device_index] if device == "cuda" else 1,
                max_epochs=1,
                limit_train_batches=steps,
                logger=logger,
                callbacks=[*callbacks, history],
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                log_every_n_steps=1,
                num_sanity_val_steps=0,
            )
            t0 = time.perf_counter()
            trainer.fit(module, datamodule=data)
            train_s = time.perf_counter() - t0
            after = evaluate(module, eval_rows, scale.eval_n, eval_seed, scale.max_new_tokens) if eval_rows else None
            result = {
                "arm": asdict(arm),
                "key": arm.key(),
                "steps": len(history.rows),
                "history": history.rows,
                "shadow": {prefix: cb.history for prefix, cb in shadows.items()},
                "eval_before": before,
                "eval_after": after,
                "train_seconds": round(train_s, 1),
                "wall_seconds": round(time.perf_counter() - t_start, 1),
                "threads": torch.get_num_threads(),
                "device": device if device == "cpu" else f"cuda:{device_index}",
                "tensorboard": os.path.abspath(logger.log_dir),
            }
    finally:
        torch.set_num_threads(threads)
    if result["steps"] != steps:
        raise RuntimeError(f"arm {arm.label!r} ran {result['steps']} of {steps} steps (too few training prompts?)")
    with open(run_dir / "result.json", "w", encoding="utf-8") as f:
        json.dump(result, f)
    return result


def _run_task(task: tuple[Arm, Scale, str, int, int]) -> dict[str, Any]:
    arm, scale, out, steps, device_index = task
    return run_arm(arm, scale, out, steps, device_index)


def run_arms(
    tasks: Sequence[tuple[Arm, int]],
    scale: Scale,
    out: str | Path,
    *,
    log: Callable[[str], None] = print,
    on_result: Callable[[dict[tuple[str, int], dict[str, Any]]], Any] | None = None,
) -> dict[tuple[str, int], dict[str, Any]]:
    """Results of every ``(arm, steps)`` keyed by ``(arm key, seed)``: cached runs are reused, the others run in
    ``scale.workers`` processes. Arms with one key run once, for the largest number of steps.

    Order: seed by seed (in ``scale.seeds`` order), the longest runs of a seed first, so that a study cut short has
    whole seeds. ``on_result(results so far)`` is called after every finished run (e.g. to write the result file).
    A run that raises does not stop the others: its traceback is logged and, once every run has ended,
    :class:`FailedRuns` is raised with the finished results."""
    need: dict[tuple[str, int], tuple[Arm, int]] = {}
    for arm, steps in tasks:
        k = (arm.key(), arm.seed)
        if k not in need or need[k][1] < steps:
            need[k] = (arm, steps)
    results: dict[tuple[str, int], dict[str, Any]] = {}
    todo: list[tuple[Arm, int]] = []
    for k, (arm, steps) in need.items():
        cached = load_result(out, arm, steps)
        if cached is not None:
            results[k] = cached
        else:
            todo.append((arm, steps))
    seed_rank = {seed: i for i, seed in enumerate(scale.seeds)}
    todo.sort(key=lambda t: (seed_rank.get(t[0].seed, len(seed_rank)), -t[1] * (1 + len(t[0].shadow))))
    cuda = resolve_device(scale.device) == "cuda"
    gpus = torch.cuda.device_count() if cuda else 1
    run_tasks = [(arm, scale, str(out), steps, i % gpus) for i, (arm, steps) in enumerate(todo)]
    log(
        f"study: {len(need)} runs needed, {len(results)} cached, {len(todo)} to train ({scale.workers} workers, "
        f"{run_threads(scale)} threads each" + (f", {gpus} GPU(s))" if cuda else ")")
    )
    failures: list[tuple[Arm, str]] = []

    def finished(task: tuple[Arm, Scale, str, int, int], res: dict[str, Any] | None, error: str | None) -> None:
        arm = task[0]
        name = f"{arm.objective} {arm.label} (seed {arm.seed}, {arm.key()})"
        if error is not None:
            failures.append((arm, error))
            log(f"  FAILED {name}:\n{error}")
            return
        results[(arm.key(), arm.seed)] = res
        log(f"  done {name}: {res['wall_seconds']} s ({len(results)} of {len(need)} runs)")
        if on_result is not None:
            on_result(results)

    if scale.workers == 1 or len(run_tasks) <= 1:
        for task in run_tasks:
            try:
                res = _run_task(task)
            except Exception:  # noqa: BLE001 - reported with its traceback; the other runs go on
                finished(task, None, traceback.format_exc())
            else:
                finished(task, res, None)
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=scale.workers, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_run_task, task): task for task in run_tasks}
            for fut in as_completed(futures):
                error = fut.exception()
                if error is not None:
                    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
                    finished(futures[fut], None, text)
                else:
                    finished(futures[fut], fut.result(), None)
    if failures:
        raise FailedRuns(results, failures)
    return results
