"""The RL-callback protocol: two-way hooks that :class:`rlexact.RLModule` calls, in callback-list order.

Lightning callbacks cannot change the loss through a sanctioned hook, so RL callbacks are ordinary
``lightning.Callback`` objects (they keep their resumable state in ``state_dict``/``load_state_dict`` and may use any
Lightning hook) that also implement some of these hooks. The module calls them inside ``training_step``, so
``pl_module.log`` works there.

Why the module dispatches these hooks itself (:func:`rlexact.trainer.hooks.call_rl_hook`) instead of Lightning: the
hooks run *between* the stages of one ``training_step`` (after the old log-probs, per mini-batch before the loss,
after the last optimizer step) and change what the next stage sees, while Lightning's callback hooks fire only around
a whole step, and its dispatcher (``Trainer._call_callback_hooks``) is private. The module keeps Lightning's
conventions: the callbacks are the trainer's ``callbacks`` list (including ``configure_callbacks``), called in list
order; under FSDP2 the parameters are gathered around a hook that any callback implements.

Order of one training step:

1. rollout, rewards, advantages, old log-probs (by mode);
2. ``on_rl_batch(trainer, pl_module, batch)`` for every RL callback in list order. Callbacks may *read* every field
   and *write* ``batch.token_weights`` (multiply, never replace blindly, so corrections compose) and
   ``batch.loss_mask`` (AND in rejections). ``batch.trainer_logprobs`` is present when any callback sets
   ``needs_trainer_logprobs = True`` or the mode is ``recompute``.
3. for every PPO epoch and mini-batch: a forward gives the current log-probs, then
   ``on_rl_minibatch(trainer, pl_module, minibatch, logprobs, epoch, step)`` in list order; ``logprobs [T]`` fp32 is
   detached; callbacks may write ``minibatch.token_weights`` / ``minibatch.loss_mask`` before the loss is formed.
   If no token is left in the loss, the module skips that optimizer step with a warning.
4. ``on_rl_update_end(trainer, pl_module, batch)`` after the last optimizer step of the rollout (update-direction
   probes can score ``batch`` with the new weights here).

Refusals. :meth:`RLCallback.check` raises ``ValueError`` for a trainer, module and callback list the callback cannot
run under (e.g. two RL callbacks that would log under the same metric prefix, :meth:`RLCallback.metric_prefixes`).
``RLCallback.setup`` calls it, and so does :meth:`rlexact.RLModule.check_trainer` for every RL callback on the
trainer, which the ``rlexact`` command runs before anything is written (a one-line error, exit status 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from rlexact.batch import RolloutBatch


def old_logprob_mode(pl_module: Any) -> str | None:
    """The module's pi_old mode (``"exact"``, ``"recompute"``, ``"bypass"``) if it exposes one, else ``None``."""
    owners = (getattr(pl_module, "algo", None), getattr(pl_module, "algorithm", None), pl_module)
    for owner in owners:
        mode = getattr(owner, "old_logprob_mode", None) if owner is not None else None
        if isinstance(mode, str):
            return mode
    return None


def rollout_equals_trainer(trainer: Trainer | None, pl_module: Any) -> bool:
    """True when the rollout log-probs the RL callbacks read are known to equal the trainer's bit for bit: the module
    says its rollout is exact (``pl_module.exact_rollout is True``, see :attr:`rlexact.RLModule.exact_rollout`, or
    :func:`old_logprob_mode` is ``"exact"``) and no RL callback on ``trainer`` perturbs them
    (:attr:`RLCallback.perturbs_logprobs`, e.g. a MismatchInjection of scale > 0). Then ``r_corr`` is exactly 1 on
    every token, so a correction on it changes nothing; ``False`` where the module does not say."""
    exact = getattr(pl_module, "exact_rollout", None) is True or old_logprob_mode(pl_module) == "exact"
    callbacks = rl_callbacks(trainer) if trainer is not None else []
    return exact and not any(cb.perturbs_logprobs for cb in callbacks)


class RLCallback(Callback):
    """Base class of RL callbacks; every hook is a no-op by default."""

    needs_trainer_logprobs: bool = False
    """Set to True to have ``batch.trainer_logprobs`` (pi_old^train) computed before :meth:`on_rl_batch`."""

    reads_logprobs: bool = True
    """Whether the hooks read or write the batch's log-probs, ``token_weights`` or ``loss_mask``: True unless the
    callback reads none of them (:class:`~rlexact.callbacks.SampleLogger`: text, rewards and advantages). A
    :class:`~rlexact.callbacks.MismatchInjection` must come before every RL callback that does."""

    perturbs_logprobs: bool = False
    """True when the callback replaces the rollout log-probs by perturbed ones (a MismatchInjection of scale > 0), so
    that the later callbacks no longer read the trainer's values (:func:`rollout_equals_trainer`)."""

    state_fields: tuple[tuple[str, type], ...] = ()
    """``(attribute, type)`` pairs saved by :meth:`state_dict` and restored (cast to the type) by
    :meth:`load_state_dict`: the resumable counters of the callback."""

    @override
    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name, _ in self.state_fields}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [name for name, _ in self.state_fields if name not in state_dict]
        if missing:
            raise KeyError(
                f"{type(self).__name__}: the checkpoint's state for it lacks {missing} (it has {sorted(state_dict)}); "
                "it was saved by another callback or another version of this one"
            )
        for name, kind in self.state_fields:
            setattr(self, name, kind(state_dict[name]))

    def metric_prefixes(self) -> tuple[str, ...]:
        """The first components of the names this callback logs (``"tis"`` for ``tis/mean``, ...); ``()`` (the
        default) for a callback that logs nothing. Two RL callbacks on one Trainer may not share one (:meth:`check`):
        the loggers would keep only one value of each name."""
        return ()

    def check(self, trainer: Trainer | None, pl_module: Any) -> None:
        """Raise ``ValueError``, its message starting with the class name, for a trainer, module and RL-callback list
        this callback cannot run under. Called by :meth:`setup` and by :meth:`rlexact.RLModule.check_trainer` (the
        ``rlexact`` command runs it before the run writes anything), so it may run several times: it neither warns
        nor changes state. The base class refuses a metric prefix shared with another RL callback of ``trainer``
        (:meth:`metric_prefixes`); a subclass adding refusals calls ``super().check(trainer, pl_module)``."""
        callbacks = list(trainer.callbacks) if trainer is not None else []
        if not any(cb is self for cb in callbacks):
            return
        mine = set(self.metric_prefixes())
        for other in rl_callbacks(trainer):
            shared = sorted(mine & set(other.metric_prefixes())) if other is not self else []
            if not shared:
                continue
            owners = [type(cb).__name__ for cb in (self, other) if isinstance(getattr(cb, "prefix", None), str)]
            if len(owners) == 2:
                fix = "give one of them another prefix=..."
            else:
                fix = f"give the {owners[0]} another prefix=..." if owners else "keep one of them"
            raise ValueError(
                f"{type(self).__name__}: trainer.callbacks[{callbacks.index(self)}] {_describe(self)} and "
                f"trainer.callbacks[{callbacks.index(other)}] {_describe(other)} would both log metrics under "
                f"'{shared[0]}/', and the loggers keep only one value of each name: {fix}"
            )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Runs :meth:`check`. A subclass overriding it calls ``super().setup(trainer, pl_module, stage)`` first and
        issues its one-time warnings after it."""
        self.check(trainer, pl_module)

    def on_rl_batch(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        """After old log-probs are set, before the update."""

    def on_rl_minibatch(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        minibatch: RolloutBatch,
        logprobs: torch.Tensor,
        epoch: int,
        step: int,
    ) -> None:
        """Per mini-batch, with the current policy's detached log-probs, before the loss."""

    def on_rl_update_end(self, trainer: Trainer, pl_module: LightningModule, batch: RolloutBatch) -> None:
        """After the last optimizer step on this rollout batch."""


def rl_callbacks(trainer: Trainer) -> list[RLCallback]:
    """The trainer's RL callbacks in list order."""
    return [cb for cb in trainer.callbacks if isinstance(cb, RLCallback)]


def _describe(cb: RLCallback) -> str:
    """``Class(prefix='...')`` for a callback with a ``prefix`` argument, else ``Class`` and what it logs under."""
    prefix = getattr(cb, "prefix", None)
    if isinstance(prefix, str):
        return f"{type(cb).__name__}(prefix={prefix!r})"
    return f"{type(cb).__name__} (logging under {list(cb.metric_prefixes())})"


def require_trainer_logprobs(batch: RolloutBatch, who: str) -> torch.Tensor:
    """``batch.trainer_logprobs``, or a ``RuntimeError`` explaining that the module did not compute them."""
    if batch.trainer_logprobs is None:
        raise RuntimeError(
            f"{who} needs batch.trainer_logprobs (pi_old^train): it sets needs_trainer_logprobs=True, so the module "
            "must recompute them before on_rl_batch"
        )
    return batch.trainer_logprobs


def seqs_with_tokens(batch: RolloutBatch, mask: torch.Tensor) -> int:
    """Number of sequences with at least one ``mask`` token (a count for cross-rank fractions)."""
    if batch.num_seqs == 0:
        return 0
    per_seq = torch.zeros(batch.num_seqs, dtype=torch.long, device=mask.device)
    per_seq.index_add_(0, batch.seq_ids.to(mask.device), mask.long())
    return int((per_seq > 0).sum())
