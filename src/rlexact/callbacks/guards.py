"""ExactnessGuard: stop training the moment the exactness contract (docs/design.md §1) breaks.

In an exact run the generator's log-prob of every sampled token equals, bit for bit, what the trainer computes for
it. The guard asks the module for ``batch.trainer_logprobs`` (``needs_trainer_logprobs = True``: one extra no-grad
trainer forward on the steps it checks) and compares them with ``batch.rollout_logprobs`` on every response token
through an integer view of the bits (stricter than ``torch.equal``: ``-0.0 != 0.0``). On the first difference it
raises :class:`ExactnessError` naming the rollout step, the sequence index in the batch, the token position in
the sequence (and in the response), the token id and both values with their bit patterns.

Under data parallelism every rank checks its own sequences and the outcome is all-reduced, so all ranks raise
together (no rank is left waiting in a collective); the rank that found the difference reports it in full.

Use it in exact runs (``rollout.kernels="exact"``); with the native generator or a
:class:`~rlexact.callbacks.injection.MismatchInjection` it fires on the first step, which is what it is for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from rlexact.callbacks._extra import first_bitwise_mismatch
from rlexact.callbacks.aggregation import MetricReducer, global_rank, log_scalars
from rlexact.callbacks.base import RLCallback, require_trainer_logprobs
from rlexact.callbacks.functional import BIT_VIEWS
from rlexact.checks import positive_int

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from rlexact.batch import RolloutBatch

__all__ = ["ExactnessError", "ExactnessGuard"]


class ExactnessError(RuntimeError):
    """Rollout and trainer log-probs differ bitwise. Attributes locate the first difference on the reporting rank
    (``None`` on ranks that only learned that another rank found one)."""

    def __init__(
        self,
        message: str,
        *,
        rollout_step: int,
        rank: int,
        seq_index: int | None = None,
        position: int | None = None,
        response_position: int | None = None,
        token_id: int | None = None,
        rollout_value: float | None = None,
        trainer_value: float | None = None,
        num_mismatched: int = 0,
    ) -> None:
        super().__init__(message)
        self.rollout_step = rollout_step
        self.rank = rank
        self.seq_index = seq_index
        self.position = position
        self.response_position = response_position
        self.token_id = token_id
        self.rollout_value = rollout_value
        self.trainer_value = trainer_value
        self.num_mismatched = num_mismatched


def _bits(value: torch.Tensor) -> str:
    """The bit pattern of a one-element floating tensor (a dtype of ``BIT_VIEWS``) as zero-padded hex."""
    width = value.element_size() * 2  # hex digits
    raw = int(value.reshape(1).view(BIT_VIEWS[value.dtype]).item()) & ((1 << (width * 4)) - 1)
    return f"0x{raw:0{width}x}"


class ExactnessGuard(RLCallback):
    """Raise :class:`ExactnessError` when rollout and trainer log-probs are not bitwise equal.

    Args:
        every_n_steps: check one rollout step in ``n`` (the first step is always checked). Each check costs the
            trainer forward that produces ``batch.trainer_logprobs``.

    Logs ``exactness/mismatched_tokens`` (0 on a passing check) on the checked steps.
    """

    state_fields = (("steps_seen", int), ("checks_passed", int))

    needs_trainer_logprobs = True

    def __init__(self, every_n_steps: int = 1) -> None:
        positive_int(f"{type(self).__name__}: every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self.steps_seen = 0
        self.checks_passed = 0
        self.last_metrics: dict[str, float] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps)

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return ("exactness",)

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        step = self.steps_seen
        self.steps_seen += 1
        if step % self.every_n_steps:
            return
        trainer_lp = require_trainer_logprobs(batch, type(self).__name__)
        rollout_lp = batch.rollout_logprobs
        mask = batch.response_mask
        if trainer_lp.dtype != rollout_lp.dtype:
            count, first = int(mask.sum()), None
            reason = f"dtype differs: rollout {rollout_lp.dtype}, trainer {trainer_lp.dtype}"
        else:
            count, first = first_bitwise_mismatch(rollout_lp, trainer_lp, mask)
            reason = ""
        rank = global_rank()
        red = MetricReducer()
        red.add_sum("mismatched", count)
        red.add_min("first_rank", rank if count else None, empty=-1.0)
        out = red.reduce(rollout_lp.device)
        total, first_rank = int(out["mismatched"]), int(out["first_rank"])
        self.last_metrics = {"exactness/mismatched_tokens": float(total)}
        if total == 0:
            self.checks_passed += 1
            log_scalars(trainer, pl_module, self.last_metrics)
            return
        if count == 0:
            raise ExactnessError(
                f"exactness broken at rollout step {step}: rank {first_rank} found rollout and trainer log-probs that "
                f"differ ({total} response tokens over all ranks); see that rank's error",
                rollout_step=step,
                rank=rank,
                num_mismatched=total,
            )
        if first is None:  # dtype mismatch
            raise ExactnessError(
                f"exactness broken at rollout step {step} (rank {rank}): {reason}",
                rollout_step=step,
                rank=rank,
                num_mismatched=count,
            )
        n_resp = int(mask.sum())
        seq = int(batch.seq_ids[first])
        start = int(batch.cu_seqlens[seq])
        position = first - start
        response_position = int(mask[start:first].sum())
        token = int(batch.input_ids[first])
        r_val, t_val = rollout_lp[first], trainer_lp[first]
        raise ExactnessError(
            f"exactness broken at rollout step {step} (rank {rank}): {count} of {n_resp} response tokens differ "
            f"between rollout and trainer log-probs ({total} over all ranks). First: sequence {seq} of the batch, "
            f"token position {position} in the sequence (response token {response_position}, packed index {first}, "
            f"token id {token}): rollout {r_val.item()!r} ({_bits(r_val)}) vs trainer {t_val.item()!r} "
            f"({_bits(t_val)}), difference {t_val.item() - r_val.item():.3e}",
            rollout_step=step,
            rank=rank,
            seq_index=seq,
            position=position,
            response_position=response_position,
            token_id=token,
            rollout_value=float(r_val.item()),
            trainer_value=float(t_val.item()),
            num_mismatched=count,
        )
