"""The study's update-direction probe: does the update move the rollout engine's log-probs the way it moves the
trainer's?

The paper's metric (:class:`rlexact.callbacks.UpdateDirectionProbe`) counts tokens whose rollout-engine log-prob
moves against their advantage after the update. With any optimizer that is not infinitesimal, interference between
tokens makes some of them move against their advantage in the *trainer* too, exact engine or not, so that share is
not 0 for an exact run at a finite learning rate. :class:`DirectionAgreementProbe` measures it on both sides and the
part that is due to the mismatch alone: the share of tokens whose log-prob change has a different sign in the
rollout engine than in the trainer. That share is exactly 0 for an exact engine (both sides compute the same bits
before and after the update) and is the quantity the paper's "the update does not translate to the rollout engine"
argument is about.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from rlexact.callbacks import UpdateDirectionProbe
from rlexact.callbacks import functional as F
from rlexact.callbacks.aggregation import log_scalars
from rlexact.callbacks.base import RLCallback, require_trainer_logprobs

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from rlexact.batch import RolloutBatch

__all__ = ["DirectionAgreementProbe", "direction_agreement"]


def direction_agreement(
    engine_before: torch.Tensor,
    engine_after: torch.Tensor,
    trainer_before: torch.Tensor,
    trainer_after: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """Update-direction statistics of both numeric paths over masked tokens with ``A != 0``.

    Returns ``engine_misaligned_frac`` and ``trainer_misaligned_frac`` (:func:`rlexact.callbacks.functional.
    update_direction_stats` of each side), ``sign_disagreement_frac`` (``sign(delta_engine) != sign(delta_trainer)``)
    and ``num_tokens``; 0.0 fractions when no token qualifies.
    """
    engine = F.update_direction_stats(engine_before, engine_after, advantages, mask)
    trainer = F.update_direction_stats(trainer_before, trainer_after, advantages, mask)
    active = mask & (advantages != 0)
    d_engine = engine_after.float() - engine_before.float()
    d_trainer = trainer_after.float() - trainer_before.float()
    disagree = int((active & (torch.sign(d_engine) != torch.sign(d_trainer))).sum())
    n = int(engine["num_tokens"])
    return {
        "engine_misaligned_frac": float(engine["misaligned_frac"]),
        "trainer_misaligned_frac": float(trainer["misaligned_frac"]),
        "sign_disagreement_frac": disagree / n if n else 0.0,
        "num_tokens": float(n),
    }


class DirectionAgreementProbe(RLCallback):
    """After each update: log-prob changes of the trained batch through the rollout engine and through the trainer.

    Engine side: ``before`` = the rollout log-probs, ``after`` = the generator's re-scoring with the new weights
    (the paper's measurement). Trainer side: ``before`` = ``batch.trainer_logprobs``, ``after`` =
    ``pl_module.score_batch(batch)``. Logs under ``direction/`` the keys of :func:`direction_agreement` plus the
    counts ``engine_misaligned_count``, ``trainer_misaligned_count`` and ``sign_disagreement_count`` (so runs can
    be pooled). One process only (the counts are not reduced across ranks).
    """

    needs_trainer_logprobs = True
    state_fields = (("steps", int),)

    def __init__(self) -> None:
        self.steps = 0
        self.last_metrics: dict[str, float] = {}
        self._scorer = UpdateDirectionProbe()
        self._trainer_before: torch.Tensor | None = None

    @override
    def metric_prefixes(self) -> tuple[str, ...]:
        return ("direction",)

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        self._trainer_before = require_trainer_logprobs(batch, type(self).__name__).clone()

    def on_rl_update_end(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        if self._trainer_before is None:
            return
        engine_after = self._scorer.score(pl_module, batch)
        trainer_after = _score(pl_module, batch)
        stats = direction_agreement(
            batch.rollout_logprobs,
            engine_after,
            self._trainer_before,
            trainer_after,
            batch.advantages,
            batch.response_mask,
        )
        n = stats["num_tokens"]
        metrics = {f"direction/{k}": v for k, v in stats.items()}
        for key in ("engine_misaligned", "trainer_misaligned", "sign_disagreement"):
            metrics[f"direction/{key}_count"] = float(round(stats[f"{key}_frac"] * n))
        self.last_metrics = metrics
        log_scalars(trainer, pl_module, metrics)
        self.steps += 1
        self._trainer_before = None


def _score(pl_module: Any, batch: RolloutBatch) -> torch.Tensor:
    score = getattr(pl_module, "score_batch", None)
    if score is None:
        raise TypeError(f"DirectionAgreementProbe needs an rlexact.RLModule (score_batch); got {type(pl_module)}")
    return score(batch)
