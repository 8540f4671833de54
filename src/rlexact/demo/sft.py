"""Supervised fine-tuning of the embedded demo's start checkpoint (reproducible, plain torch, CPU or one GPU).

Builds a tiny ``Qwen3ForCausalLM`` from a ``Qwen3Config`` with the character tokenizer of
:mod:`rlexact.char_tokenizer`, trains it with AdamW and teacher forcing on ``"12+7=" → "19<|im_end|>"`` (loss on the
completion only) and saves model + tokenizer with ``save_pretrained`` (safetensors, fp32) plus ``sft.json`` (the
settings, the parameter count and the held-out evaluation)::

    python -m rlexact.demo.sft --out src/rlexact/demo/assets/checkpoint

The start model of the demo must leave room for RL: the SFT is short and uses label smoothing, so the model knows
2-digit addition (high greedy accuracy) but is under-confident — sampled at temperature 1 it answers a minority of
held-out problems exactly. GRPO then raises the sampled reward quickly.

Determinism: weights, data order and evaluation draws come from seeds only (torch generators, and
:class:`rlexact.demo.task.ArithmeticTask`, whose rows are pure functions of ``(seed, index)``); deterministic
algorithms are on and the thread count is fixed (``--threads``), so two runs on the same machine produce bitwise
identical weights. Across CPUs with different vector units the float results may differ in the last bits.

``--device cuda`` (or ``auto``) trains on the current GPU, for the larger start models of the study
(``configs/study/h200.yaml``): the same seeded initialization (drawn on the CPU, then moved), data order and
evaluation draws (sampled on the CPU from the GPU's probabilities), TF32 matrix products, and torch's deterministic
algorithms where torch has them (an operation without one warns instead of failing), so a GPU run is seeded but
bitwise reproducibility is only promised on the CPU. The CPU path is unchanged by the option.

Held-out evaluation: ``eval_size`` rows of the task with ``eval_seed``; training rows (the task with ``train_seed``)
whose prompt appears in the evaluation set are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F

from rlexact.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from rlexact.checks import finite, flag_message, integer, not_a_file, positive_int
from rlexact.demo.task import ArithmeticTask
from rlexact.envinfo import library_versions

__all__ = [
    "DEVICES",
    "SFTConfig",
    "build_model",
    "encode_example",
    "encode_examples",
    "evaluate",
    "main",
    "resolve_device",
    "sample_answers",
    "train_sft",
]

SFT_JSON = "sft.json"
"""Name of the settings/evaluation file written next to the checkpoint."""

DEVICES: tuple[str, ...] = ("cpu", "cuda", "auto")
"""Values of ``SFTConfig.device`` / ``--device``."""


@dataclass
class SFTConfig:
    """Settings of the demo SFT (the defaults produce the shipped checkpoint).

    Attributes:
        seed: seed of the weight init, the data order and the evaluation draws.
        steps: optimizer steps.
        batch_size: examples per step.
        lr: peak AdamW learning rate (linear warmup, then cosine decay to ``lr * min_lr_ratio``).
        warmup_steps: linear warmup steps.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        weight_decay: AdamW weight decay (matrices only).
        label_smoothing: cross-entropy label smoothing over the vocabulary; > 0 keeps the model under-confident.
        grad_clip: gradient-norm clip.
        hidden_size: model width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA).
        head_dim: per-head width.
        intermediate_size: MLP width.
        max_position_embeddings: longest sequence the model supports.
        max_operand: operands are drawn from ``[0, max_operand]``.
        ops: arithmetic operators of the task.
        train_seed: task seed of the training rows.
        eval_seed: task seed of the held-out rows.
        eval_size: held-out problems.
        eval_temperature: sampling temperature of the evaluation (0 = greedy only).
        threads: torch intra-op threads (fixed for reproducibility).
        device: ``"cpu"``, ``"cuda"`` (the current GPU) or ``"auto"`` (``"cuda"`` when one is visible).
    """

    seed: int = 0
    steps: int = 1000
    batch_size: int = 128
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    label_smoothing: float = 0.3
    grad_clip: float = 1.0
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 64
    max_operand: int = 99
    ops: tuple[str, ...] = ("+",)
    train_seed: int = 0
    eval_seed: int = 1
    eval_size: int = 500
    eval_temperature: float = 1.0
    threads: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        sizes = ("steps", "batch_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "threads")  # fmt: skip
        for name in sizes:
            positive_int(name, getattr(self, name))
        integer("max_position_embeddings", self.max_position_embeddings, low=2)
        integer("warmup_steps", self.warmup_steps, low=0)
        integer("eval_size", self.eval_size, low=0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        finite("label_smoothing", self.label_smoothing, low=0.0)
        if self.label_smoothing >= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        finite("lr", self.lr, low=0.0, low_open=True)
        finite("grad_clip", self.grad_clip, low=0.0, low_open=True)
        finite("weight_decay", self.weight_decay, low=0.0)
        finite("eval_temperature", self.eval_temperature, low=0.0, low_open=True)
        finite("min_lr_ratio", self.min_lr_ratio, low=0.0)
        if self.min_lr_ratio > 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        ArithmeticTask(max_operand=self.max_operand, ops=self.ops)  # validates the task settings


def build_model(cfg: SFTConfig, vocab_size: int):
    """A freshly initialized fp32 ``Qwen3ForCausalLM`` (tied embeddings) for the demo tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        use_cache=True,
        dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(config).float()
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model


def encode_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """``(ids, prompt_len)`` of ``prompt + answer + "<|im_end|>"`` (one id per character, no special tokens)."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return list(p) + list(a) + [EOS_ID], len(p)


def encode_examples(tokenizer, rows: Sequence[dict]) -> list[tuple[list[int], int]]:
    """:func:`encode_example` of every ``{"prompt", "answer"}`` row, with one batched tokenizer call per field (the
    same ids)."""
    if not rows:
        return []
    prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r["answer"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(list(p) + list(a) + [EOS_ID], len(p)) for p, a in zip(prompts, answers)]


def resolve_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` (the current GPU; an error naming the fix when none is visible) or ``"auto"``."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but no CUDA device is visible; use --device cpu or auto")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collate(examples: Sequence[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on the prompt and the padding)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (ids, plen) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        labels[i, plen : len(ids)] = torch.tensor(ids[plen:])
    return input_ids, mask, labels


def _lr_at(cfg: SFTConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def sample_answers(
    model,
    tokenizer,
    prompts: Sequence[str],
    temperature: float,
    seed: int = 0,
    max_new_tokens: int = 5,
) -> list[str]:
    """Decoded completions (cut at ``<|im_end|>``) of ``prompts``; ``temperature == 0`` is greedy.

    A plain full-recompute loop over groups of equal-length prompts (no KV cache, no padding) on the model's
    device; draws come from a CPU ``torch.Generator`` seeded with ``seed``. Used for the SFT's held-out evaluation
    only (the demo's own evaluation uses :class:`rlexact.rollout.Generator`).
    """
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    out: list[str] = [""] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    for length in sorted(by_len):
        idx = by_len[length]
        x = torch.tensor([encoded[i] for i in idx], dtype=torch.long, device=device)
        done = torch.zeros(len(idx), dtype=torch.bool)
        new: list[list[int]] = [[] for _ in idx]
        for _ in range(max_new_tokens):
            logits = model(input_ids=x, use_cache=False).logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1).cpu()  # drawn on the CPU on every device
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    if t == EOS_ID:
                        done[j] = True
                    else:
                        new[j].append(t)
            if bool(done.all()):
                break
            x = torch.cat([x, nxt[:, None].to(device)], dim=1)
        for j, i in enumerate(idx):
            out[i] = tokenizer.decode(new[j], skip_special_tokens=True)
    return out


def evaluate(model, tokenizer, rows: Sequence[dict], temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Held-out metrics: exact accuracy and mean partial-credit reward, sampled at ``temperature``, and greedy."""
    from rlexact.rewards import ArithmeticReward

    prompts = [r["prompt"] for r in rows]
    answers = [r["answer"] for r in rows]
    acc = ArithmeticReward(partial_credit=False)
    partial = ArithmeticReward(partial_credit=True)
    result: dict[str, float] = {"n": float(len(rows))}
    if not rows:
        return result
    modes = [("greedy", 0.0)] + ([("sampled", temperature)] if temperature > 0 else [])
    for name, temp in modes:
        comps = sample_answers(model, tokenizer, prompts, temp, seed=seed)
        result[f"{name}_accuracy"] = sum(acc(prompts, comps, answers)) / len(rows)
        result[f"{name}_partial_reward"] = sum(partial(prompts, comps, answers)) / len(rows)
    return result


def _training_rows(cfg: SFTConfig, exclude: set[str]):
    task = ArithmeticTask(seed=cfg.train_seed, max_operand=cfg.max_operand, ops=cfg.ops)
    for row in task:
        if row["prompt"] not in exclude:
            yield row


def train_sft(cfg: SFTConfig, log_every: int = 50, verbose: bool = True):
    """Train the demo model on ``cfg.device``. Returns ``(model, tokenizer, report)``: the model on the CPU, the
    held-out evaluation in ``report``.

    Runs with ``cfg.threads`` torch threads and deterministic algorithms (on a GPU: where torch has them, and TF32
    matrix products); every global setting it changes is restored afterwards.
    """
    device = resolve_device(cfg.device)
    cuda = device.type == "cuda"
    if cuda:  # cuBLAS is deterministic only with a fixed workspace; read when the first handle is created
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous_threads = torch.get_num_threads()
    previous_det = torch.are_deterministic_algorithms_enabled()
    previous_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    previous_precision = torch.get_float32_matmul_precision()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True, warn_only=cuda)
    if cuda:
        torch.set_float32_matmul_precision("high")
    try:
        tokenizer = build_char_tokenizer(model_max_length=cfg.max_position_embeddings)
        model = build_model(cfg, vocab_size=len(tokenizer)).to(device)
        eval_rows = ArithmeticTask(seed=cfg.eval_seed, max_operand=cfg.max_operand, ops=cfg.ops).generate(cfg.eval_size)
        rows = _training_rows(cfg, {r["prompt"] for r in eval_rows})

        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.98),
            eps=1e-8,
        )
        model.train()
        t0 = time.perf_counter()
        loss_value = float("nan")
        for step in range(cfg.steps):
            batch = encode_examples(tokenizer, [next(rows) for _ in range(cfg.batch_size)])
            input_ids, mask, labels = (t.to(device) for t in _collate(batch))
            for group in opt.param_groups:
                group["lr"] = _lr_at(cfg, step)
            logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
                label_smoothing=cfg.label_smoothing,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            last = step == cfg.steps - 1
            if last or (verbose and step % log_every == 0):  # read back only when shown (a GPU step runs ahead)
                loss_value = float(loss.detach())
            if verbose and (step % log_every == 0 or last):
                print(f"step {step:5d}  loss {loss_value:.4f}  lr {_lr_at(cfg, step):.2e}", flush=True)
        if cuda:
            torch.cuda.synchronize(device)
        train_s = time.perf_counter() - t0
        metrics = evaluate(model, tokenizer, eval_rows, cfg.eval_temperature, seed=cfg.seed)
        report = {
            "settings": asdict(cfg),
            "final_train_loss": loss_value,
            "train_seconds": round(train_s, 1),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "eval": metrics,
            "versions": library_versions("transformers"),
            "machine": platform.machine(),
        }
        if cuda:
            report["device"] = torch.cuda.get_device_name(device)
        return model.cpu(), tokenizer, report
    finally:
        torch.use_deterministic_algorithms(previous_det, warn_only=previous_warn_only)
        torch.set_num_threads(previous_threads)
        torch.set_float32_matmul_precision(previous_precision)


def save_checkpoint(model, tokenizer, report: dict, out: str | os.PathLike) -> str:
    """``save_pretrained`` (safetensors, fp32) of model and tokenizer, plus ``sft.json``. Returns the folder."""
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, SFT_JSON), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlexact.demo.sft", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (e.g. src/rlexact/demo/assets/checkpoint)")
    defaults = SFTConfig()
    for f in fields(SFTConfig):
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, tuple):
            p.add_argument(flag, nargs="+", default=list(value))
        elif f.name == "device":
            p.add_argument(flag, choices=DEVICES, default=value, help="cpu (default), cuda or auto")
        else:
            p.add_argument(flag, type=type(value), default=value)
    p.add_argument("--quiet", action="store_true", help="no per-step log")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        not_a_file("out", args.out)
        cfg = SFTConfig(**{f.name: getattr(args, f.name) for f in fields(SFTConfig)})
    except (ValueError, OSError) as e:
        parser.error(flag_message(e, ("out", *(f.name for f in fields(SFTConfig)))))
    model, tokenizer, report = train_sft(cfg, verbose=not args.quiet)
    out = save_checkpoint(model, tokenizer, report, args.out)
    ev = report["eval"]
    summary = ", ".join(f"{k} {v:.3f}" for k, v in ev.items() if k != "n")
    print(f"saved {out} ({report['num_parameters']:,} parameters, {report['train_seconds']} s); held-out: {summary}")
    return report


if __name__ == "__main__":
    main()
