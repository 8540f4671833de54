"""The stages of :class:`rlexact.RLModule`'s training step, one module each.

* :mod:`~rlexact.trainer.policy`: model building / loading, the reference model, FSDP2 sharding, fp32 RoPE,
  activation checkpointing, the precision check;
* :mod:`~rlexact.trainer.sampling`: prompt validation, sampling parameters and seeds, the generate call;
* :mod:`~rlexact.trainer.rewards`: decoding and scoring, reward metrics;
* :mod:`~rlexact.trainer.advantages`: per-sequence advantages and dynamic sampling;
* :mod:`~rlexact.trainer.batching`: packing the :class:`~rlexact.batch.RolloutBatch`, chunked no-grad scoring;
* :mod:`~rlexact.trainer.update`: the PPO epochs, mini- and micro-batches (FSDP2 gradient sync on the last one),
  and the update statistics;
* :mod:`~rlexact.trainer.optim`: the optimizer and LR scheduler;
* :mod:`~rlexact.trainer.hooks`: dispatch of the RL-callback hooks;
* :mod:`~rlexact.trainer.step_metrics`, :mod:`~rlexact.trainer.data_checks`, :mod:`~rlexact.trainer.hparams`:
  per-step diagnostics, checks of the data against the model, plain hyperparameters.

The module keeps the Lightning hooks and the overridable stage methods; these modules hold the work
(docs/design.md §3).
"""
