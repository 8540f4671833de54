"""The stages of :class:`rlexact.RLModule`'s training step, one module each.

* :mod:`~rlexact.trainer.policy`: model building / loading, the reference model, FSDP2 sharding, fp32 RoPE, the
  precision check;
* :mod:`~rlexact.trainer.sampling`: prompt validation, sampling parameters and seeds, the generate call;
* :mod:`~rlexact.trainer.rewards`: decoding and scoring, reward metrics;
* :mod:`~rlexact.trainer.advantages`: per-sequence advantages and dynamic sampling;
* :mod:`~rlexact.trainer.batching`: packing the :class:`~rlexact.batch.RolloutBatch`, chunked no-grad scoring;
* :mod:`~rlexact.trainer.update`: the PPO epochs, mini- and micro-batches, and the update statistics;
* :mod:`~rlexact.trainer.hooks`: dispatch of the RL-callback hooks.

The module keeps the Lightning hooks and the overridable stage methods; these modules hold the work.
"""
