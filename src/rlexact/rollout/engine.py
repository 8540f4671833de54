"""The in-process generator: continuous batching over a paged KV cache on the training module itself."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import nn

from rlexact.checks import as_index, indices, not_text, sampling_args
from rlexact.distributed import gathered_params
from rlexact.models import context_limit, exactify, is_exactified, lm_head_weight, uncompiled, use_kernels
from rlexact.models.fusion import FusedProjections, use_fused_projections
from rlexact.ops.keyed_hash import request_key
from rlexact.rollout.block_manager import BlockManager
from rlexact.rollout.config import GeneratorConfig
from rlexact.rollout.params import Completion, SamplingParams
from rlexact.rollout.prefix_plan import TILE_KEYS
from rlexact.rollout.runner import GraphState, KVCache, ModelRunner, SamplingSetup, model_kv_shape
from rlexact.rollout.scheduler import ScheduledBatch, Scheduler
from rlexact.rollout.sequence import Sequence, completions


def eos_token_ids(model: nn.Module, tokenizer: Any = None) -> set[int]:
    """The one end-of-sequence rule of rlexact: every id in ``model.generation_config.eos_token_id`` and
    ``model.config.eos_token_id`` (an int or a list each), plus ``tokenizer.eos_token_id`` when a tokenizer is given.

    The generator stops at these ids when ``SamplingParams.stop_token_ids`` is None; :class:`rlexact.RLModule` passes
    them (with its tokenizer) as the rollout's stop tokens when ``rollout.stop_token_ids`` is None."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
    return ids


class Generator:
    """Samples completions from ``model`` with log-probs equal (bitwise, exact mode) to the trainer's.

    ``Generator(model, config)`` or ``Generator(model, kernels="exact", max_num_seqs=..., ...)`` (keyword arguments
    are :class:`GeneratorConfig` fields; with both, the keywords override the config). The model must be a
    transformers causal LM supported by :func:`rlexact.exactify`; if it is not exactified yet the generator calls
    ``rlexact.exactify(model)`` on it (in place — the same object the trainer uses). It holds a reference, never a
    copy: after an optimizer step the next ``generate`` uses the new weights.

    ``kernels="native"`` runs the same engine under ``rlexact.use_kernels(model, "native")`` (stock kernels): the
    controlled training-inference-mismatch baseline.

    FSDP2: if submodules are ``fully_shard`` modules, full parameters are gathered once per ``generate``/``score``
    call (:func:`rlexact.distributed.gathered_params`, a no-op inside an enclosing gather); call it on every rank
    with the same arguments.

    The KV cache is allocated at the start of each call and freed at its end (``keep_kv_cache=True`` keeps it, and
    the captured CUDA graphs, while the dtype, device and size still fit).

    ``stats`` describes the last call (a new dict per call):

    - work: ``num_sequences``, ``steps``, ``generated_tokens``, ``prompt_tokens`` (requested), ``prefill_tokens``
      (computed, recomputes after a preemption included), ``shared_prompt_tokens`` / ``prompt_forks`` (taken from a
      sibling's blocks), ``prefix_cached_tokens``, ``preemptions``, ``kv_blocks``, ``block_size``,
      ``decode_shared_prefix_keys`` (per layer and KV head, the keys graph decode steps read once for a group of
      sequences holding them in the same blocks instead of once per sequence, summed over steps;
      :attr:`GeneratorConfig.shared_prefix_decode`);
    - path: ``kernels``, ``fused_projections``, ``cuda_graphs``, ``graph_steps`` / ``eager_steps``,
      ``overlapped_steps`` (decode steps launched before the previous one was read back), ``overlapped_eager_steps``
      (prefill steps launched before the previous eager step was read back), ``graph_captures`` (of
      which ``graph_captures_warmed`` ran an eager warm-up and ``graph_captures_ahead`` were recorded during a
      prefill step), ``cuda_graphs_disabled`` (why graphs were turned off, else None), ``capture_ahead_failed`` (only
      after an early capture failed: why; the decode step then captured as usual);
    - host seconds: ``setup_s`` (to the first step), ``eager_s`` and its split ``eager_host_s``, ``graph_s`` and the
      per-part split of graph decode steps ``decode_host_s``, ``capture_s`` / ``capture_ahead_s``, ``elapsed_s``,
      ``tokens_per_s``, ``release_s`` (after ``elapsed_s``: freeing the cache, graphs and fused weights).
    """

    def __init__(self, model: nn.Module, config: GeneratorConfig | None = None, **kwargs: object) -> None:
        if config is None:
            config = GeneratorConfig(**kwargs)  # type: ignore[arg-type]
        elif kwargs:
            config = dataclasses.replace(config, **kwargs)  # type: ignore[arg-type]
        if not isinstance(config, GeneratorConfig):
            raise TypeError(f"config must be a GeneratorConfig, got {type(config).__name__}")
        model = uncompiled(model)
        if not is_exactified(model):
            exactify(model)
        self.model = model
        self.config = config
        self.stats: dict[str, object] = {}
        self._cache: KVCache | None = None
        self._graph_state: GraphState | None = None
        self._fused: FusedProjections | None = None
        self._table_width = 0
        """Block-table width of the kept cache's last call: a later call on the same cache keeps at least this width,
        so its decode graphs (keyed by the width) are reused by a call with fewer new tokens."""
        self._warmed: set[tuple] = set()
        """Decode-graph kernel keys captured by this generator (``ModelRunner.warmed``): a later call's capture of
        the same key skips the eager warm-up run."""

    # ---------------------------------------------------------------------------------------------------------------
    # properties of the model
    # ---------------------------------------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """Longest allowed sequence: ``min(config.max_model_len, max_position_embeddings)``."""
        limit = context_limit(self.model)
        if self.config.max_model_len is not None:
            limit = min(limit, self.config.max_model_len)
        return limit

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    # ---------------------------------------------------------------------------------------------------------------
    # validation
    # ---------------------------------------------------------------------------------------------------------------

    def _check_tokens(self, seqs: Seq[Seq[int]], what: str) -> list[list[int]]:
        if isinstance(seqs, torch.Tensor) or not isinstance(seqs, (list, tuple)):
            raise ValueError(f"{what} must be a list of token-id lists, got {type(seqs).__name__}")
        if len(seqs) == 0:
            raise ValueError(f"{what} is empty: pass at least one sequence of token ids")
        vocab = self.vocab_size
        out = []
        for i, s in enumerate(seqs):
            not_text(f"{what}[{i}]", s)
            if not isinstance(s, (list, tuple, torch.Tensor)) and as_index(s) is not None:
                raise ValueError(
                    f"{what}[{i}] is the token id {s!r}, not a sequence: {what} is a list of token-id lists, e.g. "
                    f"[[{s!r}, ...]] for one prompt"
                )
            toks = s.tolist() if isinstance(s, torch.Tensor) else list(s)
            if len(toks) == 0:
                raise ValueError(f"{what}[{i}] is empty: every sequence needs at least one token")
            if not set(map(type, toks)) <= {int}:  # other integer types are converted, floats refused
                ids = [as_index(t) for t in toks]
                if None in ids:
                    t = toks[ids.index(None)]
                    raise ValueError(f"{what}[{i}] must contain integer token ids, got {t!r} ({type(t).__name__})")
                toks = ids
            lo, hi = min(toks), max(toks)
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{what}[{i}] has token id {bad} outside the vocabulary [0, {vocab})")
            out.append(toks)
        return out

    def _cache_plan(self, seqs: list[Sequence], device: torch.device, dtype: torch.dtype) -> int:
        """Number of KV blocks for this call; raises ``ValueError`` when one sequence cannot fit."""
        cfg = self.config
        bs = cfg.block_size
        needs = sorted((self._cache_blocks(s) for s in seqs), reverse=True)
        demand = sum(needs[: cfg.max_num_seqs])
        layers, kv_heads, head_dim = model_kv_shape(self.model)
        block_bytes = KVCache.bytes_per_block(layers, bs, kv_heads, head_dim, dtype)
        if cfg.num_kv_blocks is not None:
            budget, source = cfg.num_kv_blocks, f"num_kv_blocks={cfg.num_kv_blocks}"
        elif cfg.kv_cache_tokens is not None:
            budget = -(-cfg.kv_cache_tokens // bs)
            source = f"kv_cache_tokens={cfg.kv_cache_tokens}"
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if self._cache is not None:
                reusable += self._cache.data.numel() * self._cache.data.element_size()
            budget = int((free + reusable) * cfg.kv_cache_memory_fraction) // block_bytes
            source = (
                f"kv_cache_memory_fraction={cfg.kv_cache_memory_fraction} of "
                f"{(free + reusable) / 2**30:.2f} GiB free ({block_bytes} bytes per block)"
            )
        else:
            budget, source = demand, "demand"
        need = needs[0]
        if need > budget:
            s = max(seqs, key=self._cache_tokens)
            raise ValueError(
                f"KV cache too small: it holds {budget} blocks of {bs} tokens ({budget * bs} tokens, from {source}) "
                f"but sequence {s.index} needs {need} blocks ({s.num_prompt_tokens} prompt + {s.max_new_tokens} new "
                f"tokens); it could never finish. Increase the KV budget or shorten the request."
            )
        return max(1, min(budget, demand))

    @staticmethod
    def _cache_tokens(seq: Sequence) -> int:
        """Cache slots a sequence can occupy: every token but the last sampled one (all tokens when scoring)."""
        return seq.num_prompt_tokens if seq.score_only else seq.max_len - 1

    def _cache_blocks(self, seq: Sequence) -> int:
        """KV blocks holding :meth:`_cache_tokens` slots of ``seq``."""
        return -(-self._cache_tokens(seq) // self.config.block_size)

    def _check_lengths(self, seqs: list[Sequence]) -> None:
        limit = self.max_model_len
        for s in seqs:
            if s.max_len > limit:
                extra = f" + max_new_tokens {s.max_new_tokens}" if not s.score_only else ""
                raise ValueError(
                    f"sequence {s.index}: length {s.num_prompt_tokens}{extra} = {s.max_len} exceeds the model "
                    f"context {limit} (max_position_embeddings / GeneratorConfig.max_model_len)"
                )
            if not self.config.chunked_prefill and self._cache_tokens(s) > self.config.max_num_batched_tokens:
                raise ValueError(
                    f"sequence {s.index} needs a prefill of up to {self._cache_tokens(s)} tokens (prompt + generated, "
                    f"on recompute) but chunked_prefill=False and max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens}; enable chunked prefill or raise the budget"
                )

    # ---------------------------------------------------------------------------------------------------------------
    # public API
    # ---------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: Seq[Seq[int]],
        params: SamplingParams | None = None,
        request_ids: Seq[int] | None = None,
        *,
        keys: Seq[int] | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt.

        Args:
            prompt_token_ids: non-empty list of non-empty token-id lists (ids in ``[0, vocab)``), unpadded: every
                id is prompt content, a pad id included, so strip a tokenizer's padding (``tok(batch,
                padding=True)``) first, e.g. with its attention mask.
            params: sampling parameters (default ``SamplingParams()``).
            request_ids: optional keyed-sampler ids, one per sample (``len(prompts) * n``, prompt-major); default
                ``i * n + j`` for sample ``j`` of prompt ``i``. A request samples the same tokens whatever else is in
                the batch, so pass the same id to reproduce a sample in another call.
            keys: optional per-prompt keys (ints in ``[0, 2**63)``, e.g. derived from the dataset row and epoch);
                sample ``j`` of a prompt with key ``k`` gets request id
                :func:`rlexact.ops.keyed_hash.request_key` ``(k, j)``. Its tokens and log-probs then depend on
                ``(seed, k, j)`` only, not on the prompt's slot, the batch size or the rank. Exclusive with
                ``request_ids``.

        Stop tokens: ``params.stop_token_ids`` if given, else the model's EOS ids (:func:`eos_token_ids`:
        ``generation_config`` and ``config.eos_token_id``); ``ignore_eos`` removes the EOS ids from that set
        (explicit non-EOS stop ids still apply). The stop token is included in ``token_ids``
        (``finish_reason="stop"``); otherwise generation ends after ``max_new_tokens`` (``"length"``). A sequence
        whose ``prompt + max_new_tokens`` exceeds the context is rejected up front rather than truncated.

        Returns:
            ``len(prompts) * n`` completions, prompt-major (prompt ``i``'s ``n`` samples are consecutive). Each has
            ``logprobs`` fp32 under the full tempered softmax (``params.logprobs="full"``) or the truncated,
            renormalized distribution sampled from (``"sampled"``); in exact mode they equal
            ``rlexact.sequence_logprobs(model, [c.sequence], temperature)[0][-len(c.token_ids):]`` bitwise (with
            ``top_k=params.top_k, top_p=params.top_p`` for ``"sampled"``).

        Raises:
            ValueError: empty input, empty prompt, prompt or stop ids outside the vocabulary, ``prompt +
                max_new_tokens`` beyond the context (checked up front), a KV budget smaller than one sequence, bad
                ``request_ids``.
            RuntimeError: a KV block or block-table row still held once every sequence finished (an internal
                bookkeeping error, :meth:`BlockManager.check_released`), rather than a silently smaller cache.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompts = self._check_tokens(prompt_token_ids, "prompt_token_ids")
        outside = [i for i in params.stop_token_ids or () if i >= self.vocab_size]
        if outside:
            raise ValueError(
                f"stop_token_ids has ids {outside} outside the vocabulary [0, {self.vocab_size}): they can never be "
                "sampled, so generation would not stop at them"
            )
        n = params.n
        total = len(prompts) * n
        if keys is not None:
            if request_ids is not None:
                raise ValueError("pass keys (one per prompt) or request_ids (one per sample), not both")
            key_list = indices("keys", keys, what="key", below=1 << 63)
            if len(key_list) != len(prompts):
                raise ValueError(f"keys has {len(key_list)} entries, expected one per prompt ({len(prompts)})")
            rids = [request_key(k, j) for k in key_list for j in range(n)]
        elif request_ids is None:
            rids = list(range(total))
        else:
            rids = indices("request_ids", request_ids, what="request id", below=1 << 63)
            if len(rids) != total:
                raise ValueError(
                    f"request_ids has {len(rids)} entries, expected len(prompts) * n = {len(prompts)} * {n} = {total}"
                )
        seqs = [
            Sequence(i * n + j, p, rids[i * n + j], i, params.max_new_tokens)
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        self._check_lengths(seqs)
        eos = eos_token_ids(self.model)
        stop = set(params.stop_token_ids) if params.stop_token_ids is not None else set(eos)
        if params.ignore_eos:
            stop -= eos
        sampling = SamplingSetup(
            greedy=params.greedy,
            temperature=params.logprob_temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            logprobs=params.logprobs,
        )
        self._run(seqs, sampling, stop, progress_total=total * params.max_new_tokens)
        return completions(seqs)

    @torch.no_grad()
    def score(
        self, sequences: Seq[Seq[int]], temperature: float = 1.0, *, top_k: int = 0, top_p: float = 1.0
    ) -> list[torch.Tensor]:
        """Teacher-forced log-probs of tokens ``1..L-1`` of each sequence through the generator's numeric path.

        Paged prefill in chunks of at most ``max_num_batched_tokens`` tokens (the generator's kernels and KV cache).
        Same format as :func:`rlexact.sequence_logprobs`: a list of ``[L-1]`` fp32 tensors on the model's device
        (``[0]`` for a one-token sequence). Exact mode: bitwise
        equal to ``sequence_logprobs``; native mode: the native inference path (e.g. for the update-direction probe).
        ``top_k > 0`` or ``top_p < 1``: log-probs of the truncated, renormalized distribution (what ``generate``
        reports with ``logprobs="sampled"``), bitwise equal to ``sequence_logprobs(..., top_k=, top_p=)`` in exact mode.
        """
        sampling_args("", temperature, top_p, top_k)
        toks = self._check_tokens(sequences, "sequences")
        seqs = [Sequence(i, t, i, i, 0, score_only=True) for i, t in enumerate(toks)]
        self._check_lengths(seqs)
        for s in seqs:
            s.score_logprobs = torch.zeros(len(s) - 1, dtype=torch.float32)
        todo = [s for s in seqs if len(s) > 1]
        if todo:
            truncation = (int(top_k), float(top_p))
            self._run(todo, None, set(), progress_total=0, temperature=float(temperature), truncation=truncation)
        device = self.model.get_input_embeddings().weight.device
        return [s.score_logprobs.to(device) for s in seqs]  # type: ignore[union-attr]

    # ---------------------------------------------------------------------------------------------------------------
    # the loop
    # ---------------------------------------------------------------------------------------------------------------

    def _get_cache(self, num_blocks: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        cfg = self.config
        zeroed = cfg.kernels == "native"  # the exact kernels never read an unwritten slot into a result
        if self._cache is not None and self._cache.matches(num_blocks, cfg.block_size, dtype, device, zeroed):
            return self._cache
        self._cache = None
        self._graph_state = None
        layers, kv_heads, head_dim = model_kv_shape(self.model)
        return KVCache(layers, num_blocks, cfg.block_size, kv_heads, head_dim, dtype, device, zeroed)

    def _run(
        self,
        seqs: list[Sequence],
        sampling: SamplingSetup | None,
        stop: set[int],
        progress_total: int,
        temperature: float = 1.0,
        truncation: tuple[int, float] = (0, 1.0),
    ) -> None:
        cfg = self.config
        model = self.model
        t0 = time.perf_counter()
        stats: dict[str, object] = {"kernels": cfg.kernels, "num_sequences": len(seqs)}
        self.stats = stats
        cache = runner = None
        bar = None
        try:
            with contextlib.ExitStack() as stack, gathered_params(model), use_kernels(model, cfg.kernels):
                lm_head_weight(model)  # fail early on models without a bias-free lm head
                embed = model.get_input_embeddings().weight
                device, dtype = embed.device, embed.dtype
                fused = self._fused_projections(device)
                stack.enter_context(use_fused_projections(model, fused))
                stats["fused_projections"] = fused is not None
                num_blocks = self._cache_plan(seqs, device, dtype)
                cache = self._get_cache(num_blocks, device, dtype)
                width = max(self._cache_blocks(s) for s in seqs)
                if cache is self._cache:
                    width = max(width, self._table_width)
                self._table_width = width
                bm = BlockManager(
                    cache.num_blocks, cfg.block_size, cfg.max_num_seqs, width, cfg.shuffle_blocks, cfg.block_seed
                )
                sched = Scheduler(
                    bm,
                    cfg.max_num_seqs,
                    cfg.max_num_batched_tokens,
                    cfg.chunked_prefill,
                    share_prompts=cfg.share_prompt_blocks and sampling is not None,
                    prefix_cache=cfg.prefix_caching and sampling is not None,
                )
                runner = ModelRunner(
                    model,
                    cfg,
                    cache,
                    bm,
                    sampling,
                    native=cfg.kernels == "native",
                    graph_state=self._graph_state if cfg.keep_kv_cache else None,
                    stats=stats,
                    warmed=self._warmed,
                    shared_prompts=sched.share_prompts and _samples_share_tiles(seqs),
                    prompt_keys=max(s.num_prompt_tokens for s in seqs),
                )
                stats.update(kv_blocks=cache.num_blocks, block_size=cfg.block_size, cuda_graphs=runner.use_graphs)
                for s in seqs:
                    sched.add(s)
                if cfg.progress and progress_total:
                    from tqdm.auto import tqdm

                    bar = tqdm(total=progress_total, unit="tok", desc=f"generate[{cfg.kernels}]", dynamic_ncols=True)
                stats["setup_s"] = time.perf_counter() - t0
                steps = generated = prefill_tokens = chained = eager_chained = 0
                host = runner.decode_host_s
                clock = time.perf_counter
                overlap = cfg.overlap_decode and sampling is not None
                launched = None  # the decode step in flight (overlap): launched, not read back yet
                while launched is not None or not sched.done:
                    t_sched = clock()
                    if launched is None:
                        batch = sched.schedule()
                        steps += 1
                        prefill_tokens += batch.num_prefill_tokens
                        if sampling is None:
                            runner.score_step(batch, temperature, *truncation)
                            for s in batch.seqs:
                                if s.num_computed == len(s):
                                    sched.finish(s, "length")
                            continue
                        host_sched = clock() - t_sched
                        launched = runner.launch(batch)
                        if launched is None:
                            tokens, chained_eager = self._run_eager(sched, runner, batch, stop, bar)
                            generated += tokens
                            steps += len(chained_eager)
                            eager_chained += len(chained_eager)
                            prefill_tokens += sum(b.num_prefill_tokens for b in chained_eager)
                            continue
                        host["schedule"] += host_sched
                        if not overlap:
                            generated += self._finish_step(sched, runner.collect(launched), stop, host, True, bar)
                            launched = None
                            continue
                        t_sched = clock()
                    # a step is in flight: queue the next one before reading this one back when it is known already
                    nxt_batch = sched.chain(launched.batch)
                    host["schedule"] += clock() - t_sched
                    nxt = runner.launch(nxt_batch) if nxt_batch is not None else None
                    if nxt is not None:
                        steps += 1
                        chained += 1
                    results = runner.collect(launched)
                    generated += self._finish_step(sched, results, stop, host, True, bar)
                    launched = nxt
                bm.check_released()
                elapsed = time.perf_counter() - t0
                stats.update(
                    steps=steps,
                    generated_tokens=generated,
                    prefill_tokens=prefill_tokens,
                    overlapped_steps=chained,
                    overlapped_eager_steps=eager_chained,
                    prompt_tokens=sum(s.num_prompt_tokens for s in seqs),
                    shared_prompt_tokens=sched.shared_tokens,
                    prefix_cached_tokens=sched.cached_tokens,
                    prompt_forks=sched.num_forks,
                    preemptions=sched.num_preemptions,
                    elapsed_s=elapsed,
                    tokens_per_s=generated / elapsed if elapsed > 0 else 0.0,
                    cuda_graphs=runner.use_graphs,
                )
                if cfg.keep_kv_cache:
                    self._cache = cache
                    self._graph_state = runner.graph_state
                    self._fused = fused
        finally:
            if bar is not None:
                bar.close()
            t_release = time.perf_counter()
            if not cfg.keep_kv_cache:
                self.release()
            cache = runner = None
            stats["release_s"] = time.perf_counter() - t_release

    def _run_eager(
        self, sched: Scheduler, runner: ModelRunner, batch: ScheduledBatch, stop: set[int], bar: Any
    ) -> tuple[int, list[ScheduledBatch]]:
        """Run the eager step ``batch`` and, with ``overlap_prefill``, the prefill steps chained behind it
        (:meth:`Scheduler.chain_prefill`): each is launched before the one in flight is collected, then that one's
        tokens are appended and its finished sequences finished. Returns the tokens sampled and the chained steps."""
        cfg = self.config
        launched = runner.launch_eager(batch, min(cfg.max_num_seqs, sched.num_unfinished))
        chained: list[ScheduledBatch] = []
        generated = 0
        while launched is not None:
            nxt_batch = sched.chain_prefill(launched.batch) if cfg.overlap_prefill else None
            nxt = None
            if nxt_batch is not None:
                nxt = runner.launch_eager(nxt_batch, min(cfg.max_num_seqs, sched.num_unfinished))
                chained.append(nxt_batch)
            results = runner.collect_eager(launched)  # captures the decode graph ahead before it waits
            generated += self._finish_step(sched, results, stop, runner.decode_host_s, False, bar)
            launched = nxt
        return generated, chained

    @staticmethod
    def _finish_step(
        sched: Scheduler,
        results: list[tuple[Sequence, int, float]],
        stop: set[int],
        host: dict[str, float],
        graph_step: bool,
        bar: Any,
    ) -> int:
        """Append a step's sampled tokens, finish sequences at a stop token or their token limit; returns the
        number of tokens."""
        t0 = time.perf_counter()
        for seq, tok, lp in results:
            seq.append(tok, lp)
            if tok in stop:
                sched.finish(seq, "stop")
            elif seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq, "length")
        if graph_step:
            host["postprocess"] += time.perf_counter() - t0
        if bar is not None:
            bar.update(len(results))
            bar.set_postfix(running=len(sched.running), refresh=False)
        return len(results)

    def _fused_projections(self, device: torch.device) -> FusedProjections | None:
        """The concatenated projection weights for this call (exact kernels on CUDA with ``fuse_projections``): the
        kept ones refreshed in place (their addresses are in the kept graphs' signature), else new ones."""
        if not (self.config.fuse_projections and self.config.kernels == "exact" and device.type == "cuda"):
            return None
        kept = self._fused
        if kept is not None and kept.matches():
            kept.refresh()
            return kept
        self._fused = None
        return FusedProjections(self.model)

    def release(self) -> None:
        """Free a kept KV cache, captured graphs and fused projection weights."""
        self._cache = None
        self._graph_state = None
        self._fused = None


def _samples_share_tiles(seqs: list[Sequence]) -> bool:
    """Whether two of ``seqs`` are samples of one prompt with a whole key tile before its last token (with prompt
    sharing they hold it in the same blocks)."""
    counts = Counter(s.prompt_index for s in seqs if s.num_prompt_tokens > TILE_KEYS)
    return any(c > 1 for c in counts.values())
