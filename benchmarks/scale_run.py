"""Paper-scale exact RL steps under FSDP2: a Qwen3-30B-A3B-shaped MoE (random weights, no download), K rollout steps
with :class:`rlexact.callbacks.MismatchProbe`, a distributed checkpoint, and a resume in a new process; writes
``benchmarks/results/scale_<kind>.json``.

Phases (``--phase``), each a separate process group launched by Lightning (plain ``python``: its launcher starts the
other ranks) or by ``torchrun`` (one process per rank):

* ``train``: the uninterrupted run of ``K + 1`` rollout steps (``--steps K``); after rollout step ``K`` it saves a
  ``torch.distributed.checkpoint`` folder (sharded fp32 weights, AdamW state, data position, ``rollout_step``) and
  keeps going. Saving only reads the state, so steps ``K + 1`` of this run are those of a run that never saved.
* ``resume``: a new process group loads that folder and runs step ``K + 1`` only.
* ``report``: no ranks; compares the two runs and writes the JSON.
* ``all`` (default): runs ``train``, ``resume`` and ``report`` as child processes (plain-``python`` launch only).

``--no-resume`` runs the ``K + 1`` steps without a checkpoint or a resume (for a model whose checkpoint does not fit
on the disk); its JSON has ``resume_matches_uninterrupted: null``.

Stages of a step (``stages_s``, seconds of the slowest rank): ``rollout`` (generation), ``rewards`` (decoding and the
reward), ``scoring`` (trainer log-probs of the batch), ``callbacks`` (the probe, incl. its argmax forward), ``update``
(the PPO mini-steps); ``step_s`` is the whole step. Rollout tok/s = generated tokens of all ranks / ``rollout``;
trainer tok/s = packed tokens of all ranks x PPO epochs / ``update``.

Every rank records, per rollout step, the packed token ids, ``cu_seqlens`` and rollout log-probs of every sequence it
sampled, its own fraction of response tokens whose trainer and rollout log-probs have identical bits (and the
probe's all-rank ``mismatch/bitwise_equal_frac``), the stage times, its peak GPU memory, and after the last step a
SHA-256 of its local fp32 weight shards (also at the checkpoint). ``resume_matches_uninterrupted`` is true when, on
every rank, the resumed step's token ids, ``cu_seqlens`` and rollout log-probs are ``torch.equal`` to step ``K + 1``
of the uninterrupted run and the weights after it hash the same; ``weights_changed_after_checkpoint_per_rank`` shows
that step ``K + 1`` changed the weights (so their equality says something).

Model and recipe: ``Qwen3MoeConfig`` with Qwen3-30B-A3B's dimensions (48 layers, hidden 2048, 128 experts, top-8,
``moe_intermediate_size`` 768, 32 query / 4 KV heads of 128, vocab 151,936); ``--layers`` keeps the first L layers,
``--tiny`` is a CPU-sized MoE. The model is created on the meta device, sharded (one ``fully_shard`` per decoder layer,
then the root), and only each rank's shards are allocated and drawn (N(0, 0.02), norms 1), so no rank ever holds the
full fp32 model. fp32 sharded masters with FSDP2 ``param_dtype=bfloat16``, ``reduce_dtype=float32`` (the recipe's
``fsdp`` section). The algorithm, optimizer, rollout and per-rank batch settings are read from
``configs/reinforce_qwen3_30b_a3b.yaml`` or ``configs/grpo_qwen3_30b_a3b.yaml`` (``--algo``); only the response length
(``--max-new-tokens``), the stop tokens (none: every response has full length) and what a flag overrides change.
Prompts are random token ids; a synthetic verifiable reward scores them: :class:`DigitTokenizer` decodes token ``t`` as
``"0123456789\\n"[t % 11]`` and :class:`rlexact.rewards.ArithmeticReward` (partial credit) compares the digits before
the first newline with the prompt's answer, ``sum(prompt ids) mod 1000``.

Sizes: one rollout step gathers the bf16 weights on every rank (2 bytes per parameter) next to the fp32 shards, grads
and AdamW moments (16 bytes per parameter over N ranks); the checkpoint holds 12 bytes per parameter (checked against
the free disk before training). Qwen3-30B-A3B has about 0.62B parameters per layer plus 0.62B for the embeddings and
the head: 48 layers need ~366 GB of checkpoint, 24 layers ~187 GB.

Commands (a GPU session, through the device tool; from the repository root, where the GPU suite runs: system
``python3``, ``RLEXACT_COMMIT`` names the commit for the JSON header; each call at most 10 minutes)::

    # 2 x H200 (nvidia-h200-x2): 8 layers (~5.6B parameters, ~67 GB checkpoint)
    RLEXACT_COMMIT=<sha> python3 benchmarks/scale_run.py --devices 2 --layers 8 --algo grpo --kind h200x2 \\
        --work-dir /tmp/scale2 && cp benchmarks/results/scale_h200x2.json $OUT/

    # 8 x H200 (nvidia-h200-x8): 24 layers (the full 48 need a ~366 GB checkpoint, more than the 235 GiB disk)
    RLEXACT_COMMIT=<sha> python3 benchmarks/scale_run.py --devices 8 --layers 24 --algo grpo --kind h200x8 \\
        --work-dir /tmp/scale8 && cp benchmarks/results/scale_h200x8.json $OUT/

    # 8 x H200, the full 48 layers: the K + 1 steps only (--no-resume: no checkpoint), same JSON without the resume
    RLEXACT_COMMIT=<sha> python3 benchmarks/scale_run.py --devices 8 --algo grpo --kind h200x8_full --no-resume \\
        --work-dir /tmp/scale8full && cp benchmarks/results/scale_h200x8_full.json $OUT/

    # the same phases in separate calls (the machine must stay warm between them: /tmp/scale8 holds the state)
    A="--devices 8 --layers 24 --algo grpo --kind h200x8 --work-dir /tmp/scale8"
    python3 benchmarks/scale_run.py --phase train $A     # or: torchrun --nproc-per-node 8 benchmarks/scale_run.py ...
    python3 benchmarks/scale_run.py --phase resume $A
    RLEXACT_COMMIT=<sha> python3 benchmarks/scale_run.py --phase report $A
    cp benchmarks/results/scale_h200x8.json $OUT/

    # CPU check (benchmarks/results/scale_cpu.json; tests/test_scale_run.py runs K = 2): 2 gloo ranks, tiny MoE
    python benchmarks/scale_run.py --accelerator cpu --devices 2 --tiny --kind cpu --work-dir /tmp/scale_cpu

``--algo reinforce`` runs the paper's MoE REINFORCE recipe instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from common import ROOT, header, require_cuda

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, max_position_embeddings=1024)  # fmt: skip
RECIPES = {"grpo": "grpo_qwen3_30b_a3b.yaml", "reinforce": "reinforce_qwen3_30b_a3b.yaml"}
INIT_STD = 0.02
ANSWER_MOD = 1000


# ---------------------------------------------------------------------------------------------------------- settings
def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """The Qwen3-MoE config dict of the run (``--tiny`` / ``--layers``)."""
    cfg = dict(TINY if args.tiny else QWEN3_30B_A3B)
    if args.layers is not None:
        if args.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {args.layers}")
        cfg["num_hidden_layers"] = args.layers
    return cfg


def parameter_count(cfg: dict[str, Any]) -> int:
    """Parameters of a Qwen3-MoE config (all layers sparse, untied head)."""
    h, d, e, i = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    attn = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) + 2 * d
    layer = attn + e * 3 * h * i + e * h + 2 * h
    return cfg["num_hidden_layers"] * layer + 2 * cfg["vocab_size"] * h + h


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    """RLModule arguments and the per-rank prompt batch from the paper's recipe YAML, with this run's overrides."""
    import yaml

    spec = yaml.safe_load((ROOT / "configs" / RECIPES[args.algo]).read_text())
    init = spec["model"]["init_args"]
    rollout = dict(init["rollout"], max_new_tokens=args.max_new_tokens, stop_token_ids=[])
    algorithm = dict(init["algorithm"])
    optim = dict(init["optim"])
    if args.n is not None:
        rollout["n"] = args.n
    for key, value in (("mini_batch_size", args.mini_batch_size), ("micro_batch_size", args.micro_batch_size)):
        if value is not None:
            algorithm[key] = value if value > 0 else None
    if args.lr is not None:
        optim["lr"] = args.lr
    if args.tiny:  # CPU: the generator sizes its cache from the call, not from GPU memory
        rollout.pop("generator", None)
    prompts = args.prompts_per_rank or int(spec["data"]["init_args"]["batch_size"])
    return {
        "recipe": f"configs/{RECIPES[args.algo]}",
        "rollout": rollout,
        "algorithm": algorithm,
        "optim": optim,
        "fsdp": dict(init["fsdp"]),
        "dtype": init["dtype"],
        "prompts_per_rank": prompts,
    }


# ------------------------------------------------------------------------------------------------- data and reward
class DigitTokenizer:
    """Decodes token id ``t`` as the character ``"0123456789\\n"[t % 11]`` (any vocabulary size, no download)."""

    eos_token_id = None
    pad_token_id = 0
    ALPHABET = "0123456789\n"

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[int(t) % len(self.ALPHABET)] for t in ids)


def synthetic_rows(num: int, prompt_len: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    """``num`` random prompts of ``prompt_len`` token ids, each answered by ``sum(ids) mod 1000``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num, prompt_len), generator=g).tolist()
    return [{"prompt_ids": p, "prompt_text": "", "answer": str(sum(p) % ANSWER_MOD)} for p in ids]


def make_datamodule(rows: list[dict[str, Any]], batch_size: int, seed: int) -> Any:
    """A datamodule over ``rows`` whose train loader is a :class:`rlexact.data.ResumableDataLoader` (its data
    position is checkpointed, so the resumed run continues with the next batch)."""
    import lightning as L

    from rlexact.data import PromptDataset, ResumableDataLoader, ResumableSampler, collate_prompts

    class SyntheticPrompts(L.LightningDataModule):
        path = "<synthetic prompts>"

        def __init__(self) -> None:
            super().__init__()
            self.train_dataset = PromptDataset(
                [r["prompt_ids"] for r in rows], [r["prompt_text"] for r in rows], [r["answer"] for r in rows]
            )

        def train_dataloader(self) -> ResumableDataLoader:
            kwargs = self.trainer.distributed_sampler_kwargs or {}
            sampler = ResumableSampler(
                len(self.train_dataset),
                seed=seed,
                num_replicas=int(kwargs.get("num_replicas", 1)),
                rank=int(kwargs.get("rank", 0)),
            )
            return ResumableDataLoader(
                self.train_dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_prompts
            )

    return SyntheticPrompts()


# --------------------------------------------------------------------------------------------------------- the model
def meta_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """The causal LM of ``cfg`` on the meta device (no memory; materialized after sharding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(cfg)
    hf = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf, dtype=torch.float32)


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, seed: int, rank: int) -> None:
    """Allocate ``model``'s (sharded) meta tensors on ``device`` and draw each rank's shards: N(0, 0.02) for matrices
    and expert banks, 1 for norm weights; rotary buffers are recomputed from the config by a fresh rotary module."""
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if "norm" in name:
            local.fill_(1.0)
            continue
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) * 131 + rank)
        local.normal_(0.0, INIT_STD, generator=g)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(module)(config=module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf)


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over this rank's local parameter shards (names and raw bytes, in ``named_parameters`` order)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(name.encode())
        h.update(local.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_module(args: argparse.Namespace, settings: dict[str, Any]) -> Any:
    """An :class:`rlexact.RLModule` on the meta-device model whose ``configure_model`` shards, then materializes it,
    and whose trainer log-prob scoring is timed (``score_seconds``)."""
    from rlexact import RLModule
    from rlexact.rewards.executor import RewardConfig

    class ScaleModule(RLModule):
        score_seconds = 0.0

        @override
        def configure_model(self) -> None:
            super().configure_model()
            if any(t.is_meta for t in self.model.parameters()):
                # the strategy's device: the module itself is moved there only after configure_model
                materialize(self.model, self.trainer.strategy.root_device, args.init_seed, self.global_rank)

        @override
        def score_batch(self, batch, model=None):  # noqa: ANN001, ANN202
            _sync()
            t0 = time.perf_counter()
            out = super().score_batch(batch, model)
            _sync()
            self.score_seconds += time.perf_counter() - t0
            return out

    return ScaleModule(
        model=meta_model(model_config(args)),
        tokenizer=DigitTokenizer(),
        reward="arithmetic",
        reward_kwargs={"partial_credit": True},
        reward_config=RewardConfig(workers=0) if args.tiny else None,  # CPU: no worker pool to start
        rollout=settings["rollout"],
        algorithm=settings["algorithm"],
        optim=settings["optim"],
        fsdp=settings["fsdp"],
        dtype=settings["dtype"],
    )


# ------------------------------------------------------------------------------------------------------ the callbacks
def make_recorder(work: Path, save_at: int | None) -> Any:
    """A callback that records every rollout step of this rank (see the module docstring) and, after rollout step
    ``save_at``, saves the distributed checkpoint ``<work>/ckpt``."""
    from rlexact.callbacks.base import RLCallback

    class Recorder(RLCallback):
        needs_trainer_logprobs = True

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.rollouts: dict[int, dict[str, torch.Tensor]] = {}
            self._t0 = 0.0

        @override
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            _sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            pl_module.score_seconds = 0.0
            self._t0 = time.perf_counter()

        @override
        def on_rl_batch(self, trainer, pl_module, batch) -> None:  # noqa: ANN001
            m = batch.response_mask
            train_bits = batch.trainer_logprobs[m].contiguous().view(torch.int32)
            roll_bits = batch.rollout_logprobs[m].contiguous().view(torch.int32)
            step = int(pl_module.rollout_step) + 1
            self.rollouts[step] = {
                "input_ids": batch.input_ids.cpu(),
                "cu_seqlens": batch.cu_seqlens.cpu(),
                "rollout_logprobs": batch.rollout_logprobs.cpu(),
            }
            self.steps.append({
                "step": step,
                "sequences": int(batch.num_seqs),
                "tokens": int(batch.num_tokens),
                "response_tokens": int(m.sum()),
                "bitwise_equal_tokens": int((train_bits == roll_bits).sum()),
            })  # fmt: skip

        @override
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            _sync()
            rec = self.steps[-1]
            logged = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
            probe = next(cb for cb in trainer.callbacks if type(cb).__name__ == "MismatchProbe")
            rec.update(
                step_s=time.perf_counter() - self._t0,
                bitwise_equal_frac=rec["bitwise_equal_tokens"] / max(rec["response_tokens"], 1),
                probe_bitwise_equal_frac_all_ranks=float(probe.last_metrics["mismatch/bitwise_equal_frac"]),
                stages_s={
                    "rollout": logged.get("timing/rollout_s"),
                    "rewards": logged.get("timing/scoring_s"),
                    "scoring": pl_module.score_seconds,
                    "callbacks": logged.get("timing/callbacks_s"),
                    "update": logged.get("timing/update_s"),
                },
                module_rollout_tokens_per_s=logged.get("rollout/tokens_per_s"),
                reward_mean=logged.get("reward/mean"),
                peak_gpu_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                peak_gpu_reserved_gb=torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None,
                peak_host_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            )
            if save_at is not None and rec["step"] == save_at:
                t0 = time.perf_counter()
                trainer.save_checkpoint(str(work / "ckpt"))
                rec["checkpoint_save_s"] = time.perf_counter() - t0
                rec["weights_sha256"] = weights_sha256(pl_module.model)

    return Recorder()


# ------------------------------------------------------------------------------------------------------ rank phases
def run_phase(args: argparse.Namespace) -> None:
    """``train`` or ``resume`` on this process group; writes ``<work>/<phase>/rank<r>.json`` and ``.pt``."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from rlexact.callbacks import MismatchProbe

    torch.set_num_threads(max(1, torch.get_num_threads() // args.devices) if args.accelerator == "cpu" else 4)
    work = Path(args.work_dir)
    settings = recipe(args)
    cfg = model_config(args)
    per_rank = settings["prompts_per_rank"]
    rows = synthetic_rows(per_rank * args.devices * (args.steps + 1), args.prompt_len, cfg["vocab_size"], args.seed)
    ckpt = work / "ckpt"
    save = args.phase == "train" and not args.no_resume
    if save:
        check_disk(work, cfg)
    elif args.phase == "resume" and not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt} does not exist; run --phase train with the same --work-dir first")
    module = build_module(args, settings)
    recorder = make_recorder(work, args.steps if save else None)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        precision="32-true",
        max_epochs=1,  # the data holds exactly K + 1 batches per rank
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[MismatchProbe(histograms=False), recorder],
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(
            module,
            datamodule=make_datamodule(rows, per_rank, args.seed),
            ckpt_path=str(ckpt) if args.phase == "resume" else None,
        )
    wall = time.perf_counter() - t0
    rank = trainer.global_rank
    out = work / args.phase
    out.mkdir(parents=True, exist_ok=True)
    torch.save(recorder.rollouts, out / f"rank{rank}.pt")
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "fit_s": wall,
        "rollout_step": int(module.rollout_step),
        "steps": recorder.steps,
        "weights_sha256": weights_sha256(module.model),
        "settings": settings,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


def check_disk(work: Path, cfg: dict[str, Any]) -> None:
    """Fail before training when the checkpoint (fp32 weights + two AdamW moments) cannot fit in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    need = 12 * parameter_count(cfg)
    free = shutil.disk_usage(work).free
    if need > 0.95 * free:
        raise RuntimeError(
            f"the checkpoint needs ~{need / 1e9:.0f} GB but {work} has {free / 1e9:.0f} GB free; use fewer --layers "
            "or a --work-dir on a larger disk"
        )


# ----------------------------------------------------------------------------------------------------------- report
def rollouts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same token ids, sequence boundaries and rollout log-probs, bit for bit."""
    keys = ("input_ids", "cu_seqlens", "rollout_logprobs")
    return all(torch.equal(a[k], b[k]) for k in keys)


def summarize_step(step: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One rollout step over all ranks: throughput from summed tokens over the slowest rank's stage time."""
    recs = [next(s for s in r["steps"] if s["step"] == step) for r in ranks]
    stages = {k: max(rec["stages_s"][k] or 0.0 for rec in recs) for k in recs[0]["stages_s"]}
    response = sum(rec["response_tokens"] for rec in recs)
    tokens = sum(rec["tokens"] for rec in recs)
    epochs = int(ranks[0]["settings"]["algorithm"].get("ppo_epochs", 1))
    out = {
        "step": step,
        "sequences": sum(rec["sequences"] for rec in recs),
        "response_tokens": response,
        "tokens": tokens,
        "step_s": max(rec["step_s"] for rec in recs),
        "stages_s": stages,
        "rollout_tokens_per_s": response / stages["rollout"] if stages["rollout"] else None,
        "trainer_tokens_per_s": epochs * tokens / stages["update"] if stages["update"] else None,
        "peak_gpu_mem_gb_per_rank": [rec["peak_gpu_mem_gb"] for rec in recs],
        "peak_gpu_reserved_gb_per_rank": [rec["peak_gpu_reserved_gb"] for rec in recs],
        "peak_host_rss_gb_per_rank": [rec["peak_host_rss_gb"] for rec in recs],
        "mismatch/bitwise_equal_frac_per_rank": [rec["bitwise_equal_frac"] for rec in recs],
        "mismatch/bitwise_equal_frac": recs[0]["probe_bitwise_equal_frac_all_ranks"],
        "reward_mean": recs[0]["reward_mean"],
    }
    if "checkpoint_save_s" in recs[0]:
        out["checkpoint_save_s"] = max(rec["checkpoint_save_s"] for rec in recs)
    return out


def report(args: argparse.Namespace) -> dict[str, Any]:
    """Compare the resumed step with the uninterrupted run and write the result JSON; returns it."""
    work = Path(args.work_dir)
    runs = {}
    for phase in ("train",) if args.no_resume else ("train", "resume"):
        files = sorted((work / phase).glob("rank*.json"))
        if len(files) != args.devices:
            raise FileNotFoundError(f"{work / phase} holds {len(files)} rank results, expected {args.devices}")
        runs[phase] = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])
    steps = [summarize_step(s, runs["train"]) for s in range(1, args.steps + 2)]
    resume = {"resume": "not run (--no-resume)", "resume_matches_uninterrupted": None}
    if not args.no_resume:
        resume = resume_check(args, runs)
    checked = [*steps, resume["resumed_step"]] if "resumed_step" in resume else steps
    fracs = [f for s in checked for f in s["mismatch/bitwise_equal_frac_per_rank"]]
    res = header("scale_run", "triton", "transformers", "lightning")
    res.update(
        kind=args.kind,
        device=runs["train"][0]["device"],
        world_size=args.devices,
        model={**model_config(args), "parameters": parameter_count(model_config(args)), "init": "random meta-init"},
        algo=args.algo,
        settings=runs["train"][0]["settings"],
        prompt_len=args.prompt_len,
        checkpoint_steps=args.steps,
        steps=steps,
        fit_s={phase: max(r["fit_s"] for r in ranks) for phase, ranks in runs.items()},
        all_bitwise_equal=all(f == 1.0 for f in fracs),
        **resume,
    )
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"scale_{args.kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out}: all_bitwise_equal={res['all_bitwise_equal']} "
          f"resume_matches_uninterrupted={res['resume_matches_uninterrupted']}", flush=True)  # fmt: skip
    return res


def resume_check(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The resumed step's summary and, per rank, whether its rollouts and final weights equal the uninterrupted
    run's step ``K + 1`` and whether that step changed the weights."""
    work = Path(args.work_dir)
    last = args.steps + 1
    rollouts_match, weights_match, weights_changed = [], [], []
    for rank in range(args.devices):
        full = torch.load(work / "train" / f"rank{rank}.pt", weights_only=True)
        resumed = torch.load(work / "resume" / f"rank{rank}.pt", weights_only=True)
        rollouts_match.append(sorted(resumed) == [last] and rollouts_equal(resumed[last], full[last]))
        weights_match.append(runs["resume"][rank]["weights_sha256"] == runs["train"][rank]["weights_sha256"])
        at_ckpt = next(s["weights_sha256"] for s in runs["train"][rank]["steps"] if s["step"] == args.steps)
        weights_changed.append(at_ckpt != runs["train"][rank]["weights_sha256"])
    return {
        "resumed_step": summarize_step(last, runs["resume"]),
        "resume_rollouts_equal_per_rank": rollouts_match,
        "resume_weights_equal_per_rank": weights_match,
        "weights_changed_after_checkpoint_per_rank": weights_changed,
        "resume_matches_uninterrupted": all(rollouts_match) and all(weights_match),
    }


def run_all(args: argparse.Namespace, argv: list[str]) -> None:
    """``train`` then ``resume`` as new processes (Lightning's launcher starts their ranks), then ``report``.
    ``argv`` is this call's arguments; the appended ``--phase`` overrides any given one."""
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        raise RuntimeError("--phase all starts its own processes; under torchrun give --phase train/resume/report")
    work = Path(args.work_dir)
    for sub in ("train", "resume", "ckpt"):
        shutil.rmtree(work / sub, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "NODE_RANK", "LOCAL_RANK")}
    for phase in ("train",) if args.no_resume else ("train", "resume"):
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--phase", phase]
        subprocess.run(cmd, env=env, check=True)
    report(args)
    if not args.keep_checkpoint:
        shutil.rmtree(work / "ckpt", ignore_errors=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=["all", "train", "resume", "report"], default="all")
    ap.add_argument("--accelerator", default="gpu")
    ap.add_argument("--devices", type=int, default=8, help="data-parallel ranks (one per device)")
    ap.add_argument("--kind", default="h200x8", help="names the result: benchmarks/results/scale_<kind>.json")
    ap.add_argument("--algo", choices=sorted(RECIPES), default="grpo")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 48, or 2 with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized MoE (8 experts, hidden 64), in-process rewards")
    ap.add_argument("--steps", type=int, default=3, help="K: rollout steps before the checkpoint (K + 1 in all)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 512 (8 with --tiny)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (8 with --tiny)")
    ap.add_argument("--prompts-per-rank", type=int, default=None, help="default: the recipe's (2 with --tiny)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default: the recipe's; 4 with --tiny)")
    ap.add_argument("--mini-batch-size", type=int, default=None, help="sequences per rank; 0 = the whole batch")
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="default: the recipe's optim.lr")
    ap.add_argument("--seed", type=int, default=0, help="prompts and data order")
    ap.add_argument("--init-seed", type=int, default=0, help="random weights")
    ap.add_argument("--work-dir", default="/tmp/rlexact_scale", help="checkpoint and per-rank records")
    ap.add_argument("--no-resume", action="store_true", help="K + 1 steps only: no checkpoint, no resume")
    ap.add_argument("--keep-checkpoint", action="store_true", help="--phase all: keep <work-dir>/ckpt")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/scale_<kind>.json)")
    args = ap.parse_args(argv)
    for name, full, tiny in (("max_new_tokens", 512, 8), ("prompt_len", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.tiny:
        args.prompts_per_rank = args.prompts_per_rank or 2
        args.n = args.n or 4
    if args.steps < 1 or args.devices < 1:
        raise ValueError(f"--steps and --devices must be >= 1, got {args.steps} and {args.devices}")
    return args


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.accelerator in ("gpu", "cuda") and args.phase != "report":  # the report only reads the ranks' records
        require_cuda("scale_run.py", "--accelerator cpu --tiny")
    if args.phase == "all":
        run_all(args, argv)
    elif args.phase == "report":
        report(args)
    else:
        run_phase(args)


if __name__ == "__main__":
    main()
