"""Generator configuration (validated in ``__post_init__``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlexact.checks import choice, fraction, indices, integer, positive_int
from rlexact.models.state import KERNELS, Kernels


@dataclass
class GeneratorConfig:
    """How :class:`rlexact.rollout.Generator` schedules and executes.

    KV-cache size: ``num_kv_blocks`` if set, else ``ceil(kv_cache_tokens / block_size)`` if set, else on CUDA the
    blocks that fit in ``kv_cache_memory_fraction`` of the free device memory (free + cached-but-unused in torch's
    allocator) at the start of ``generate``; on CPU, enough blocks for every request at full length. In every case
    the cache is capped at what the call can use (``max_num_seqs`` longest requests at full length), so small calls
    allocate small caches.
    """

    kernels: Kernels = "exact"
    """``"exact"``: the batch-invariant kernels (log-probs equal the trainer's bitwise). ``"native"``: the same engine
    under :func:`rlexact.use_kernels` ``"native"`` (stock cuBLAS/SDPA/torch) — the controlled mismatch baseline."""
    max_num_seqs: int = 256
    """Sequences running concurrently at most (also the largest CUDA-graph batch)."""
    max_num_batched_tokens: int = 16384
    """Tokens per packed forward at most (decodes + prefill chunks); also the chunk size of :meth:`Generator.score`.
    An eager forward's host launch cost hardly depends on its token count, so small budgets leave the GPU waiting on
    the host during prefill (``benchmarks/results/prefill_chunks_h200.json``). Scoring's logits do not grow with
    it: native-mode scoring runs the head in bounded row slices (``rollout.runner.NATIVE_SCORE_LOGITS``), the exact
    head never materializes them."""
    chunked_prefill: bool = True
    """Split prompts into chunks that fit the token budget (mixed with decodes). If ``False`` a prompt is prefilled in
    one step, so ``prompt + max_new_tokens`` (the recompute length) must fit ``max_num_batched_tokens``."""
    block_size: int = 16
    """Tokens per KV-cache block (page)."""
    share_prompt_blocks: bool = True
    """The ``n`` samples of a prompt share its KV-cache blocks: the prompt is prefilled once, the other samples fork
    from the first (full blocks reference-counted, the last partial block copied) and feed only the last prompt
    token. Bitwise the same tokens and log-probs as without sharing in exact mode (row-invariant kernels)."""
    prefix_caching: bool = True
    """Within a ``generate`` call, a sequence whose leading tokens fill whole KV blocks that another sequence of the
    call has computed takes those blocks instead of computing them again (a shared system prompt or few-shot prefix;
    a preempted sequence's recompute). Blocks are found by their exact token prefix and kept while free blocks last.
    Bitwise the same tokens and log-probs as without it in exact mode (row-invariant kernels). Nothing is kept
    across calls: the weights may change in between."""
    shared_prefix_decode: bool = True
    """Exact kernels with CUDA graphs: decode steps read the key tiles that several running sequences hold in the
    same cache blocks (the ``n`` samples' prompt, a prefix-cache hit) once per group of them instead of once per
    sequence (:mod:`rlexact.rollout.prefix_plan`, :mod:`rlexact.ops.shared_prefix`); the Gluon decode launch on sm_90
    does so. Bitwise the same tokens and log-probs as without it."""
    num_kv_blocks: int | None = None
    """KV-cache size in blocks (overrides ``kv_cache_tokens`` and ``kv_cache_memory_fraction``)."""
    kv_cache_tokens: int | None = None
    """KV-cache size in tokens (rounded up to whole blocks)."""
    kv_cache_memory_fraction: float = 0.85
    """CUDA only, when no explicit size is given: fraction of the free device memory for the KV cache."""
    max_model_len: int | None = None
    """Longest sequence (prompt + generated); defaults to the model's ``max_position_embeddings``."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs captured per batch-size bucket (CUDA only). If capture fails the engine
    warns once, records the reason in ``Generator.stats['cuda_graphs_disabled']`` and runs eagerly."""
    graph_batch_sizes: tuple[int, ...] | None = None
    """Batch-size buckets of the decode graphs; default ``1, 2, 4, 8, 16, 32, 48, ...`` up to ``max_num_seqs``."""
    fuse_projections: bool = True
    """Exact kernels on CUDA: run each layer's q/k/v and gate/up projections as one matmul on concatenated copies of
    their weights (:mod:`rlexact.models.fusion`; bitwise the separate projections, so rollout == trainer still holds).
    Costs one copy of those weights while a call runs (kept with ``keep_kv_cache``)."""
    overlap_decode: bool = True
    """With CUDA graphs: launch the next decode step before reading back the current one, its input tokens taken
    from the device, so the host's scheduling and bookkeeping run while the GPU decodes. Used while a step's
    sequences all continue (no length limit reached, nothing to admit); a sequence that stops at step ``t`` is
    dropped from step ``t + 1``'s results (keyed sampling: nothing else changes). Off: every step is launched after
    the previous one was read back (the results are identical)."""
    overlap_prefill: bool = True
    """Launch the next prefill step before reading back the current eager step when it feeds no token that step
    samples (:meth:`rlexact.rollout.scheduler.Scheduler.chain_prefill`: prompt chunks and admissions, at least half
    of ``max_num_batched_tokens``, never a preemption), so the device is not idle while the host reads back,
    schedules and prepares the next step, or captures a decode graph ahead. Mostly the prefill steps at the start
    of a call; the decodes of sequences that sampled in one of them wait for the chain to end. Off: every eager step
    is launched after the previous one was read back (the results are identical)."""
    keep_kv_cache: bool = False
    """Keep the KV cache (and captured graphs) between ``generate`` calls; by default both are freed so the trainer
    gets the memory back. Freed memory returns to PyTorch's caching allocator, which serves the trainer's tensors
    from it; the generator does not call ``torch.cuda.empty_cache`` (that would also drop the trainer's own cached
    blocks and make both re-allocate from the driver), so call it yourself when memory outside PyTorch needs it."""
    shuffle_blocks: bool = False
    """Hand out KV blocks in a seeded random order (tests: results must not depend on page order)."""
    block_seed: int = 0
    """Seed of the block shuffle."""
    progress: bool = False
    """Show a tqdm bar with generated tokens/s."""

    def __post_init__(self) -> None:
        choice("kernels", self.kernels, KERNELS)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            positive_int(name, getattr(self, name))
        for name in ("num_kv_blocks", "kv_cache_tokens", "max_model_len"):
            positive_int(name, getattr(self, name), allow_none=True)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be a bool, got {value!r}")
        fraction("kv_cache_memory_fraction", self.kv_cache_memory_fraction)
        integer("block_seed", self.block_seed)
        if self.graph_batch_sizes is not None:
            sizes = tuple(sorted(set(indices("graph_batch_sizes", self.graph_batch_sizes, what="batch size"))))
            if not sizes or sizes[0] < 1:
                raise ValueError(f"graph_batch_sizes must be positive ints, got {self.graph_batch_sizes!r}")
            self.graph_batch_sizes = sizes

    def batch_buckets(self) -> tuple[int, ...]:
        """Decode-graph batch sizes (ascending); the last one is at least ``max_num_seqs``."""
        if self.graph_batch_sizes is not None:
            sizes = [b for b in self.graph_batch_sizes if b < self.max_num_seqs]
        else:
            sizes = [b for b in (1, 2, 4, 8, 16) if b < self.max_num_seqs]
            sizes += list(range(32, self.max_num_seqs, 16))
        return tuple(sizes) + (self.max_num_seqs,)
