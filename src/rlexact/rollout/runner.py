"""Model execution for the generator: paged KV cache, packed step inputs, decode CUDA graphs, sampling, scoring.

Every step is one call of :func:`rlexact.models.forward_hidden` on a packed token stream (prefill chunks and decodes
mixed) with :class:`~rlexact.models.PagedKV` metadata; K/V of the new tokens are written to the cache inside the
attention function before attention reads them. The lm head runs only on the rows that sample (each sequence's last
fed token), through :func:`rlexact.models.head_logits`, whose ``z - lse`` is bitwise the trainer's log-prob in exact
mode.

Step inputs are built with vectorized torch ops from the block manager's block-table tensor (no per-token Python
loops). Pure decode steps replay CUDA graphs captured lazily per batch-size bucket (and, in native mode, per padded
key-length bucket) on static buffers; padding rows write their K/V to a scratch block and are discarded. A graph
captures the block-table gather, slot and key-length arithmetic, forward, lm head and sampler: a decode step uploads
one ``[4, B]`` int64 tensor (tokens, positions, request ids, table rows) plus the block-table entries written since
the previous step, replays, and queues the read-back of one ``[2, B]`` tensor into pinned memory
(:meth:`ModelRunner.launch`); :meth:`ModelRunner.collect` waits for it (the only host synchronization). While
consecutive graph steps decode the same sequences (or a subset, after some finished), the rows are not rebuilt on the
host: the previous step's sampled tokens become the next input ids and the positions advance on the device, so a
step can be launched before the previous one is read back. Eager steps are split the same way
(:meth:`ModelRunner.launch_eager` queues the step and the read-back of its sampled tokens,
:meth:`ModelRunner.collect_eager` waits for it), so a prefill step that feeds no token of the step in flight is
launched before that one is read back.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from rlexact.models import (
    AttnMetadata,
    PagedKV,
    forward_hidden,
    get_state,
    head_logits,
    head_logprobs,
    lm_head_weight,
    text_config,
)
from rlexact.models.truncation import LogprobMode
from rlexact.ops import SharedPrefix, decode_split_keys, group_capacity
from rlexact.rollout.block_manager import BlockManager
from rlexact.rollout.config import GeneratorConfig
from rlexact.rollout.prefix_plan import TILE_KEYS, PrefixPlan, plan_shared_prefix
from rlexact.rollout.sampler import sample
from rlexact.rollout.scheduler import ScheduledBatch
from rlexact.rollout.sequence import Sequence, Status


def model_kv_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` from a transformers config (the text decoder's)."""
    cfg = text_config(model)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers), kv_heads, head_dim


class KVCache:
    """Paged K/V storage: per layer ``(k, v)`` of ``[num_blocks + 1, block_size, Hkv, D]``.

    Block ``num_blocks`` is a scratch block that only padding rows of captured decode graphs write to. With
    ``zeroed`` the cache is zero-initialized, so the native path's padded (masked) reads never see NaN; the exact
    kernels never let an unwritten slot enter a result (masked loads read 0), so they take it uninitialized.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.zeroed = zeroed
        shape = (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.data = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
        self.caches = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def matches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, zeroed: bool
    ) -> bool:
        return (
            (self.zeroed or not zeroed)
            and self.num_blocks >= num_blocks
            and self.block_size == block_size
            and self.dtype == dtype
            and self.device == device
        )


@dataclass(frozen=True)
class SamplingSetup:
    """Per-call sampling constants (baked into captured graphs)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: LogprobMode = "full"


class GraphVariant(NamedTuple):
    """What besides the batch bucket decides the launches of a decode graph."""

    kv_len: int | None
    """Native mode: the padded key length (:meth:`ModelRunner._kv_bucket`); exact mode: None."""
    prefix: bool
    """Whether the graph reads a shared-prefix plan (:meth:`ModelRunner._stage_prefix`)."""
    narrow: bool
    """Whether it reads only the block-table columns of one KV split (every sequence's keys within it), so that
    exact attention runs its one-split decode launch (on sm_90 the Gluon kernel, which reads the plan)."""


@dataclass
class GraphState:
    """Static buffers and captured decode graphs of one generate call (or several, with ``keep_kv_cache``).

    ``max_bs`` below is the largest batch bucket (``max_num_seqs``), ``width`` the block manager's table width (both
    in ``signature``). A step uploads only ``ints``; the graph gathers its block tables from the device mirror
    ``table`` of the block manager's table (kept in sync incrementally) and derives slots and key lengths itself.
    Host buffers are pinned on CUDA.
    """

    signature: tuple
    ints: torch.Tensor  # [4, max_bs] int64: input ids, positions, request ids, block-table rows
    host: torch.Tensor  # [4, max_bs] int64, host: the staging copy of ints
    table: torch.Tensor  # [max_bs + 1, width] int32: the block manager's table; the last row is all scratch block
    cu_seqlens: torch.Tensor  # [max_bs + 1] int32 = arange
    split_counters: torch.Tensor  # [(max_bs + 1) * query heads] int32 zeros: the attention launches' tickets
    out: torch.Tensor  # [2, max_bs] float64: sampled tokens and their log-probs (both exact in float64)
    prefix: torch.Tensor | None  # int32 shared-prefix plan (ModelRunner._prefix_views); None: no plans
    host_out: tuple[torch.Tensor, torch.Tensor]  # two [2, max_bs] float64 host buffers out is read back into, in turn
    pool: object = None
    graphs: dict[tuple[int, GraphVariant], torch.cuda.CUDAGraph] = field(default_factory=dict)
    """Captured decode graphs by batch bucket and variant."""


@dataclass
class DecodeLaunch:
    """A decode step replayed from a CUDA graph whose sampled tokens are not read back yet (:meth:`ModelRunner.collect`
    waits for ``done`` and reads ``host_out``)."""

    batch: ScheduledBatch
    host_out: torch.Tensor  # pinned [2, max_bs] float64 the step's outputs are copied into
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU, where the copy is synchronous)


NATIVE_SCORE_LOGITS = 2**28
"""Logits (rows x vocabulary, fp32: 1 GiB) the native head materializes per call in :meth:`ModelRunner.score_step`;
the scored rows of a step go through it in slices of at most this size. The exact head does not materialize them, and
truncated log-probs are computed in row chunks already (:mod:`rlexact.models.truncation`)."""


@dataclass
class EagerLaunch:
    """An eager step (prefill chunks, mixed steps) whose sampled tokens are not read back yet
    (:meth:`ModelRunner.collect_eager` waits for ``done`` and reads ``host_out``)."""

    batch: ScheduledBatch
    sampled: list[Sequence]  # the sequences that sample in the step, in the order of host_out's columns
    host_out: torch.Tensor | None  # [2, len(sampled)] float64 tokens and log-probs (pinned on CUDA); None: none
    done: torch.cuda.Event | None  # recorded after the copy into host_out (None on CPU or when nothing samples)
    decode_rows: int  # the sequences the coming decode steps are expected to run (ModelRunner.capture_ahead)


class ModelRunner:
    """Executes scheduled steps of one generate/score call."""

    REUSE_STEPS = 8
    """Decode steps a larger captured graph is replayed (padded) before a graph for a smaller bucket is captured."""

    def __init__(
        self,
        model: nn.Module,
        config: GeneratorConfig,
        cache: KVCache,
        block_manager: BlockManager,
        sampling: SamplingSetup | None,
        native: bool,
        graph_state: GraphState | None = None,
        stats: dict | None = None,
        warmed: set[tuple] | None = None,
        shared_prompts: bool = False,
        prompt_keys: int = 0,
    ) -> None:
        """``shared_prompts``: samples of this call share a prompt of a whole key tile or more (and its blocks), so
        :meth:`capture_ahead` captures the graph that reads a shared-prefix plan; ``prompt_keys``: the call's longest
        prompt, so that it captures the narrow graph (:class:`GraphVariant`) when the first decode steps fit one KV
        split."""
        self.model = model
        self.config = config
        self.cache = cache
        self.bm = block_manager
        self.sampling = sampling
        self.native = native
        self.device = cache.device
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("graph_steps", 0)
        self.stats.setdefault("eager_steps", 0)
        self.stats.setdefault("graph_captures", 0)
        self.stats.setdefault("graph_captures_warmed", 0)
        self.stats.setdefault("graph_captures_ahead", 0)
        self.stats.setdefault("cuda_graphs_disabled", None)
        self.stats.setdefault("decode_shared_prefix_keys", 0)
        for key in ("graph_s", "eager_s", "capture_s", "capture_ahead_s"):
            self.stats.setdefault(key, 0.0)
        self._pin = self.device.type == "cuda"
        self.buckets = config.batch_buckets()
        self.use_graphs = bool(config.cuda_graphs and self.device.type == "cuda" and sampling is not None)
        _, kv_heads, head_dim = model_kv_shape(model)
        self.prefix_capacity = (
            group_capacity(int(text_config(model).num_attention_heads), kv_heads)
            if config.shared_prefix_decode and self.use_graphs and not native
            else 0
        )
        """Sequences per shared-prefix group of the graph decode steps (:meth:`_stage_prefix`); 0: no plans."""
        self._prefix_for: list[Sequence] | None = None
        self._shared_prompts = shared_prompts
        self._prompt_keys = prompt_keys
        bs = cache.block_size
        split = decode_split_keys(head_dim, cache.dtype) if self.use_graphs and not native else None
        self.narrow_blocks = split // bs if split and split % bs == 0 and block_manager.width * bs > split else 0
        """Block-table columns of one KV split where the call's table is wider (0: graphs read the whole table). A
        graph step whose sequences all fit them reads only these, so exact attention runs its one-split decode launch
        (on sm_90 the Gluon kernel, which reads shared prefixes once) for as long as the contexts allow."""
        self._prefix_plan: PrefixPlan | None = None
        block_manager.record_updates = self.use_graphs  # only the graph path mirrors the table on the device
        self._signature = self.signature() if self.use_graphs else None
        self.graph_state = graph_state if graph_state is not None and graph_state.signature == self._signature else None
        self._reuse_count: dict[tuple[int, GraphVariant], int] = {}
        self.warmed: set[tuple] = warmed if warmed is not None else set()
        """:meth:`_warm_key` of every graph captured so far (by this runner, or by earlier runners of the same
        generator): a capture with a known key needs no eager warm-up run, its kernels are compiled already."""
        self._table_synced = False
        self._staged: list[Sequence] | None = None
        """The sequences whose inputs ``graph_state.ints`` holds after the last graph step (``None``: rebuild)."""
        self._out_buffer = 0
        """Which of ``graph_state.host_out`` the last launch read back into (launches alternate)."""
        self.decode_host_s: dict[str, float] = self.stats.setdefault(
            "decode_host_s", dict.fromkeys(("schedule", "prepare", "launch", "wait", "collect", "postprocess"), 0.0)
        )
        """Seconds per part of the graph decode steps: ``prepare`` (block copies, table sync, input staging, graph
        choice), ``launch`` (the replay call), ``wait`` (the read-back of the sampled tokens, which waits for the
        device), ``collect`` (advancing the sequences, the result list); the engine adds ``schedule`` and
        ``postprocess`` (appending tokens, stop checks, finishing)."""
        self.eager_host_s: dict[str, float] = self.stats.setdefault(
            "eager_host_s", dict.fromkeys(("prepare", "launch", "wait"), 0.0)
        )
        """Seconds per part of the eager steps (prefill chunks, mixed steps): ``prepare`` (block copies, the packed
        inputs built on the host and uploaded), ``launch`` (the forward, lm head and sampler calls, which return once
        their kernels are queued), ``wait`` (the read-back of the sampled tokens, which waits for the device)."""

    # ---------------------------------------------------------------------------------------------------------------
    # helpers
    # ---------------------------------------------------------------------------------------------------------------

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _head_sample(
        self, hidden: torch.Tensor, request_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sp = self.sampling
        assert sp is not None
        z, lse = head_logits(self.model, hidden, sp.temperature)
        return sample(
            z,
            lse,
            greedy=sp.greedy,
            top_k=sp.top_k,
            top_p=sp.top_p,
            seed=sp.seed,
            request_ids=request_ids,
            positions=positions,
            logprobs=sp.logprobs,
        )

    # ---------------------------------------------------------------------------------------------------------------
    # eager packed step (prefill chunks + decodes)
    # ---------------------------------------------------------------------------------------------------------------

    def _prepare(self, batch: ScheduledBatch) -> dict[str, torch.Tensor | int]:
        """The packed step's CPU inputs: token ids, positions, cache slots, ``cu_seqlens``, block tables (``[B, w]``,
        ``w`` = most blocks held by one sequence) and key lengths. Index arithmetic runs in numpy: torch's CPU ops
        cost a thread-pool round trip each, which the device would wait for between eager steps."""
        seqs, num_new = batch.seqs, batch.num_new
        bs = self.cache.block_size
        ids: list[int] = []
        for s, n in zip(seqs, num_new):
            ids.extend(s.tokens[s.num_computed : s.num_computed + n])
        count = len(seqs)
        n_a = np.asarray(num_new, dtype=np.int64)
        start = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=count)
        cu = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(n_a, out=cu[1:])
        seq_of_token = np.repeat(np.arange(count), n_a)
        pos = np.arange(cu[-1]) - (cu[:-1] - start)[seq_of_token]
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=count)
        width = max(len(s.block_table) for s in seqs)
        bt = self.bm.table.numpy()[rows, :width]
        slots = bt[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        seqlens = start + n_a
        return {
            "ids": torch.tensor(ids, dtype=torch.long),
            "pos": torch.from_numpy(pos),
            "slots": torch.from_numpy(slots),
            "cu": torch.from_numpy(cu.astype(np.int32)),
            "bt": torch.from_numpy(bt),
            "seqlens": torch.from_numpy(seqlens.astype(np.int32)),
            "max_q": max(num_new),
            "max_k": int(seqlens.max()),
            "fresh": not bool(start.any()),
        }

    def _upload(self, inp: dict) -> dict:
        return {k: self._to_device(v) if isinstance(v, torch.Tensor) else v for k, v in inp.items()}

    def _eager_forward(self, d: dict) -> torch.Tensor:
        meta = AttnMetadata(
            d["cu"],
            PagedKV(
                self.cache.caches,
                d["bt"],
                d["seqlens"],
                d["slots"],
                max_seqlen_q=d["max_q"],
                max_seqlen_k=d["max_k"],
                fresh=d["fresh"],
            ),
        )
        self.stats["eager_steps"] += 1
        return forward_hidden(self.model, d["ids"], d["pos"], meta)

    def launch_eager(self, batch: ScheduledBatch, decode_rows: int = 0) -> EagerLaunch:
        """Queue a step that :meth:`launch` did not take (prefill chunks, mixed steps, graphs off) without waiting for
        it: block copies, the packed forward, then the lm head and sampler on the rows that sample (each sequence
        whose fed tokens reach its end) and the copy of their tokens and log-probs to the host. Advances
        ``num_computed``; :meth:`collect_eager` returns the sampled tokens. Launches run in order on the device, so a
        step may be launched before the previous one is collected when it feeds no token the previous one samples.
        ``decode_rows``: the sequences the coming decode steps are expected to run; :meth:`collect_eager` captures
        their graph while the device works (:meth:`capture_ahead`). Host time goes to ``stats["eager_s"]`` and to the
        ``prepare`` and ``launch`` parts of ``eager_host_s``."""
        t0 = time.perf_counter()
        self._copy_blocks(batch.copies)
        self._staged = self._prefix_for = None  # an eager step may preempt, re-admit or fork: plan anew
        inp = self._prepare(batch)
        sampled = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)) if s.num_computed + n == len(s.tokens)]
        if sampled:
            idx = torch.tensor(sampled, dtype=torch.long)
            rows = inp["cu"][1:].long()[idx] - 1
            inp["rows"] = rows
            inp["rid"] = torch.tensor([batch.seqs[i].request_id for i in sampled], dtype=torch.long)
            inp["next_pos"] = inp["pos"][rows] + 1
        d = self._upload(inp)
        t1 = time.perf_counter()
        hidden = self._eager_forward(d)
        for s, n in zip(batch.seqs, batch.num_new):
            s.num_computed += n
        host_out = done = None
        if sampled:
            tok, lp = self._head_sample(hidden[d["rows"]], d["rid"], d["next_pos"])
            host_out, done = self._read_back(torch.stack([tok.double(), lp.double()]))
        t2 = time.perf_counter()
        self.eager_host_s["prepare"] += t1 - t0
        self.eager_host_s["launch"] += t2 - t1
        self.stats["eager_s"] += t2 - t0
        return EagerLaunch(batch, [batch.seqs[i] for i in sampled], host_out, done, decode_rows)

    def _read_back(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the copy of the device tensor ``out`` into a new host tensor (pinned) and record an event after it;
        on CPU ``out`` itself and no event. A new tensor per step: one whose copy is pending is never written again
        (the pinned-memory allocator reuses its memory only once the copy is done)."""
        if self.device.type != "cuda":
            return out, None
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def collect_eager(self, launched: EagerLaunch) -> list[tuple[Sequence, int, float]]:
        """Capture the coming decode graph while the device runs (:meth:`capture_ahead` of ``launched.decode_rows``:
        called after the engine has launched every step it can, so the most device work is queued), then wait for
        ``launched`` and return ``(seq, token, logprob)`` of its sampled rows. Host time goes to ``stats["eager_s"]``
        and to the ``wait`` part of ``eager_host_s`` (the capture to ``capture_ahead_s``)."""
        t0 = time.perf_counter()
        self.capture_ahead(launched.decode_rows)
        t1 = time.perf_counter()
        out: list[tuple[Sequence, int, float]] = []
        if launched.host_out is not None:
            if launched.done is not None:
                launched.done.synchronize()
            both = launched.host_out
            out = list(zip(launched.sampled, both[0].long().tolist(), both[1].tolist()))
        t2 = time.perf_counter()
        self.eager_host_s["wait"] += t2 - t1
        self.stats["eager_s"] += t2 - t0
        return out

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked prompt blocks: block ``dst`` gets block ``src``'s slots in every layer (K and V)."""
        if not copies:
            return
        data = self.cache.data
        if {s for s, _ in copies} & {d for _, d in copies}:  # a copy reads a block another one writes: in order
            for s, d in copies:
                data[:, :, d].copy_(data[:, :, s])
            return
        src, dst = (self._to_device(torch.tensor(c, dtype=torch.long)) for c in zip(*copies))
        data.index_copy_(2, dst, data.index_select(2, src))

    # ---------------------------------------------------------------------------------------------------------------
    # CUDA-graph decode
    # ---------------------------------------------------------------------------------------------------------------

    def signature(self) -> tuple:
        """Everything a captured graph bakes in; graphs are reused only while it is unchanged."""
        params = tuple(p.data_ptr() for p in self.model.parameters())
        state = get_state(self.model)
        fused = tuple(f.weight.data_ptr() for f in state.fused.values()) if state is not None else ()
        return (
            self.cache.data.data_ptr(),
            self.bm.width,
            self.buckets,
            self._sampling_in_graph(),
            self.native,
            self.prefix_capacity,
            hash(params),
            hash(fused),
        )

    def _sampling_in_graph(self) -> tuple | None:
        """The sampling settings a decode graph reads (those of :meth:`_head_sample`); the rest of the
        ``SamplingParams`` (max_new_tokens, n, stop tokens) stay on the host, so changing them keeps the graphs."""
        sp = self.sampling
        if sp is None:
            return None
        return (sp.temperature, sp.greedy, sp.top_k, sp.top_p, sp.seed, sp.logprobs)

    def _ensure_graph_state(self) -> GraphState:
        if self.graph_state is not None:
            return self.graph_state
        max_bs, width = self.buckets[-1], self.bm.width
        dev = self.device
        table = torch.full((max_bs + 1, width), self.cache.scratch_block, dtype=torch.int32, device=dev)
        gs = GraphState(
            signature=self._signature,
            ints=torch.zeros((4, max_bs), dtype=torch.long, device=dev),
            host=torch.zeros((4, max_bs), dtype=torch.long, pin_memory=self._pin),
            table=table,
            cu_seqlens=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            split_counters=torch.zeros(
                (max_bs + 1) * int(text_config(self.model).num_attention_heads), dtype=torch.int32, device=dev
            ),
            out=torch.zeros((2, max_bs), dtype=torch.float64, device=dev),
            prefix=self._prefix_buffer(max_bs),
            host_out=tuple(torch.zeros((2, max_bs), dtype=torch.float64, pin_memory=self._pin) for _ in range(2)),
            pool=torch.cuda.graph_pool_handle() if dev.type == "cuda" else None,
        )
        self.graph_state = gs
        return gs

    def _sync_table(self, gs: GraphState) -> None:
        """Bring ``gs.table`` up to date with the block manager: the whole table on the first graph step of this
        call, then only the entries written since the last step (one small upload and one scatter)."""
        updates = self.bm.take_updates()
        if not self._table_synced:
            gs.table[: self.bm.max_rows].copy_(self._to_device(self.bm.table))
            self._table_synced = True
        elif updates:
            # an entry may have been written twice since the last step (a row freed and reused); the last write wins
            # here, on the host, because index_put_ with repeated indices keeps an arbitrary one
            latest = {(r, c): blk for r, c, blk in updates}
            flat = [(r, c, blk) for (r, c), blk in latest.items()]
            rows, cols, blocks = self._to_device(torch.tensor(flat, dtype=torch.long).T).unbind(0)
            gs.table.index_put_((rows, cols), blocks.to(torch.int32))

    def _kv_bucket(self, width_used: int) -> int | None:
        """Native mode pads decode keys to a static length (graphs are keyed by it): ``width_used`` blocks rounded
        up to the next of 1, 2, 3, 4, 6, 8, 12, 16, ... blocks (at most 50% padding, logarithmically many graphs),
        capped at the block-table width. Exact mode: ``None`` (the kernel reads exactly ``seqlens_k`` keys)."""
        if not self.native:
            return None
        nblk = 1
        while nblk < width_used:
            half = nblk + nblk // 2
            nblk = half if nblk >= 2 and half >= width_used else 2 * nblk
        return min(nblk, self.bm.width) * self.cache.block_size

    def _pick_graph(self, gs: GraphState, b: int, var: GraphVariant) -> tuple[int, torch.cuda.CUDAGraph | None]:
        """The bucket to replay for ``b`` rows. Prefer the smallest bucket that fits; while it is not captured yet,
        replay an already captured larger one (padding) for up to ``REUSE_STEPS`` steps before paying a capture —
        a shrinking tail batch would otherwise capture a new graph for every one or two steps."""
        bucket = next(x for x in self.buckets if x >= b)
        graph = gs.graphs.get((bucket, var))
        if graph is not None:
            return bucket, graph
        larger = [x for x in self.buckets if x > bucket and (x, var) in gs.graphs]
        if larger:
            waited = self._reuse_count.get((bucket, var), 0)
            if waited < self.REUSE_STEPS:
                self._reuse_count[(bucket, var)] = waited + 1
                return larger[0], gs.graphs[(larger[0], var)]
        graph = self._capture(gs, bucket, var)
        if graph is not None:
            gs.graphs[(bucket, var)] = graph
        return bucket, graph

    def _graph_fn(self, gs: GraphState, bucket: int, var: GraphVariant):
        ids, pos, rid, rows = gs.ints[:, :bucket].unbind(0)
        bs = self.cache.block_size
        plan = self._prefix_views(gs, bucket) if var.prefix else None
        table = gs.table[:, : self.narrow_blocks] if var.narrow else gs.table
        kv_len = var.kv_len

        def run() -> None:
            tables = table.index_select(0, rows)
            slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs
            paged = PagedKV(
                self.cache.caches, tables, (pos + 1).to(torch.int32), slots, max_seqlen_q=1, max_seqlen_k=kv_len,
                split_counters=gs.split_counters, prefix=plan,
            )  # fmt: skip
            hidden = forward_hidden(self.model, ids, pos, AttnMetadata(gs.cu_seqlens[: bucket + 1], paged))
            tok, lp = self._head_sample(hidden, rid, pos + 1)
            gs.out[0, :bucket].copy_(tok)
            gs.out[1, :bucket].copy_(lp)

        return run

    def _capture(
        self, gs: GraphState, bucket: int, var: GraphVariant, ahead: bool = False
    ) -> torch.cuda.CUDAGraph | None:
        t0 = time.perf_counter()
        try:
            return self._capture_inner(gs, bucket, var, ahead)
        finally:
            self.stats["capture_ahead_s" if ahead else "capture_s"] += time.perf_counter() - t0

    def capture_ahead(self, rows: int) -> None:
        """Capture the decode graph of ``rows`` sequences now, while the device runs an eager step, if it is not
        captured yet and an earlier capture compiled its kernels (:meth:`_warm_key`), so the capture runs nothing.

        A capture is host work, one launch call per kernel of the step; done between the last prefill step and the
        first decode step it leaves the device idle for as long. Exact mode only (native graphs are also keyed by the
        padded key length, which is not known ahead). A failed capture here changes nothing: it is recorded in
        ``stats["capture_ahead_failed"]`` and the decode step captures as usual, with its inputs staged. The graph
        reads a shared-prefix plan when samples of this call share prompts of a whole key tile (``shared_prompts``);
        a plan of other shared blocks (prefix-cache hits) captures its graph at its first decode step."""
        if not (self.use_graphs and not self.native and 0 < rows <= self.buckets[-1]):
            return
        gs = self._ensure_graph_state()
        bucket = next(x for x in self.buckets if x >= rows)
        var = GraphVariant(None, self.prefix_capacity > 0 and self._shared_prompts, self._narrow(self._prompt_keys))
        if (bucket, var) in gs.graphs or self._warm_key(bucket, var) not in self.warmed:
            return
        graph = self._capture(gs, bucket, var, ahead=True)
        if graph is not None:
            gs.graphs[(bucket, var)] = graph

    def _warm_key(self, bucket: int, var: GraphVariant) -> tuple:
        """What decides the kernels a decode graph launches (shapes, constexprs, dtypes), without the addresses and
        the seed of :meth:`signature`: graphs with the same key launch the same compiled kernels."""
        sp = self._sampling_in_graph()
        state = get_state(self.model)
        return (
            bucket,
            var,
            self.bm.width,
            self.cache.block_size,
            self.cache.dtype,
            str(self.device),
            None if sp is None else sp[:4] + sp[5:],
            self.native,
            tuple(state.fused) if state is not None else (),
        )

    def _capture_inner(
        self, gs: GraphState, bucket: int, var: GraphVariant, ahead: bool
    ) -> torch.cuda.CUDAGraph | None:
        """Capture the decode step of ``bucket`` rows. The first capture of a :meth:`_warm_key` runs the step eagerly
        first (compiles kernels, fills caches outside the capture); a later one captures directly and, should that
        fail, retries once with the warm-up before giving up on graphs (``ahead``: gives up at once, see
        :meth:`capture_ahead`).

        The capture is recorded on a side stream without synchronizing the device first (unlike
        ``torch.cuda.graph``, which also empties the allocator's caches): recording executes nothing, so work in
        flight on the current stream may go on meanwhile."""
        run = self._graph_fn(gs, bucket, var)
        dev = self.device
        key = self._warm_key(bucket, var)
        prev_stream = torch.cuda.current_stream(dev)
        for warm in (False,) if ahead else (False, True) if key in self.warmed else (True,):
            try:
                if warm:
                    side = torch.cuda.Stream(dev)
                    side.wait_stream(prev_stream)
                    with torch.cuda.stream(side):
                        run()
                    prev_stream.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(torch.cuda.Stream(dev)):
                    graph.capture_begin(pool=gs.pool)
                    try:
                        run()
                    finally:
                        graph.capture_end()
                torch.cuda.synchronize(dev)
            except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
                _recover_from_failed_capture(dev, prev_stream)
                # a capture that fails before capture_end finishes leaves its memory pool marked as recording, and a
                # later capture into that pool fails ("already recording"): later graphs take a new pool
                gs.pool = torch.cuda.graph_pool_handle()
                failure = exc
                continue
            self.warmed.add(key)
            self.stats["graph_captures"] += 1
            self.stats["graph_captures_warmed"] += int(warm)
            self.stats["graph_captures_ahead"] += int(ahead)
            return graph
        reason = _describe_capture_failure(failure)
        if ahead:
            self.stats["capture_ahead_failed"] = reason
            return None
        self.stats["cuda_graphs_disabled"] = reason
        self.use_graphs = False
        warnings.warn(
            f"rlexact Generator: CUDA-graph capture failed, running decode eagerly: {reason}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    def _stage_inputs(self, gs: GraphState, seqs: list[Sequence]) -> None:
        """Put the decode inputs of ``seqs`` into ``gs.ints``: rows ``[:b]`` tokens, positions, request ids and
        table rows; padding rows token 0 at position 0 of the scratch row (the scratch block).

        When every sequence was in the last graph step (the same ones in the same order, or some of them after
        others finished), its sampled tokens (still in ``gs.out``) are the next input ids and every position advances
        by one: the rows are updated (or gathered) on the device, without reading anything back, so this step may be
        launched before the last one is read back (:meth:`launch`). Anything else (after an eager step, an admitted
        or re-admitted sequence) rebuilds the rows on the host from the sequences and uploads them."""
        b = len(seqs)
        staged = self._staged
        if staged is not None and seqs == staged:
            gs.ints[0, :b].copy_(gs.out[0, :b])
            gs.ints[1, :b] += 1
            return
        if staged is not None:
            where = {id(s): i for i, s in enumerate(staged)}
            idx = [where.get(id(s), -1) for s in seqs]
            if min(idx) >= 0:  # a subset of the last step's sequences (some finished): gather their rows
                idx_t = self._to_device(torch.tensor(idx, dtype=torch.long))
                rows = gs.ints.index_select(1, idx_t)
                rows[0].copy_(gs.out[0].index_select(0, idx_t))
                rows[1] += 1
                gs.ints[:, :b].copy_(rows)
                gs.ints[:3, b:].zero_()
                gs.ints[3, b:] = gs.table.shape[0] - 1
                self._staged = list(seqs)
                return
        host = gs.host
        host[:, :b] = torch.tensor(
            [
                [s.tokens[-1] for s in seqs],
                [s.num_computed for s in seqs],
                [s.request_id for s in seqs],
                [s.row for s in seqs],
            ],
            dtype=torch.long,
        )
        host[:, b:].zero_()
        host[3, b:] = gs.table.shape[0] - 1
        gs.ints.copy_(host, non_blocking=True)
        self._staged = list(seqs)

    def _narrow(self, pos: int) -> bool:
        """Whether a graph step whose sequences feed positions up to ``pos`` reads only :attr:`narrow_blocks`."""
        return 0 < self.narrow_blocks and pos < self.narrow_blocks * self.cache.block_size

    def _prefix_buffer(self, max_bs: int, device: torch.device | None = None) -> torch.Tensor | None:
        """A zeroed buffer of the decode graphs' shared-prefix plans (:meth:`_plan_views`), on the runner's device
        unless ``device`` is given; None: no plans."""
        if not self.prefix_capacity:
            return None
        groups = max(max_bs // 2, 1)
        size = max_bs + groups + 1 + groups * self.prefix_capacity
        return torch.zeros(size, dtype=torch.int32, device=device or self.device)

    def _plan_views(self, buf: torch.Tensor, max_bs: int, rows: int) -> SharedPrefix:
        """The plan of a ``rows``-row step as views of a plan buffer (:meth:`_prefix_buffer`): ``start`` of every row
        first, then the tiles of each group (at most half the largest bucket; a group has two members or more), the
        group count, and the members of each group."""
        groups = max(max_bs // 2, 1)
        count_at = max_bs + groups
        members = buf[count_at + 1 :].view(groups, self.prefix_capacity)
        return SharedPrefix(buf[:rows], members, buf[max_bs:count_at], buf[count_at : count_at + 1])

    def _prefix_views(self, gs: GraphState, bucket: int) -> SharedPrefix:
        """The plan a ``bucket``-row graph reads: :meth:`_plan_views` of ``gs.prefix``."""
        assert gs.prefix is not None
        return self._plan_views(gs.prefix, gs.ints.shape[1], bucket)

    def _stage_prefix(self, gs: GraphState, seqs: list[Sequence]) -> bool:
        """Put the shared-prefix plan of ``seqs`` (:func:`rlexact.rollout.prefix_plan.plan_shared_prefix`) into
        ``gs.prefix``, unless it holds theirs already (the same sequences in the same order since the last eager
        step: their shared tiles do not change as they decode); returns whether it has a group, i.e. whether the
        step replays a graph that reads it. Adds the step's shared keys to ``stats["decode_shared_prefix_keys"]``."""
        if not self.prefix_capacity:
            return False
        if self._prefix_for != seqs:
            plan = self._next_plan(seqs)
            if plan.groups:
                max_bs = gs.ints.shape[1]
                host = self._prefix_buffer(max_bs, torch.device("cpu"))
                assert host is not None
                view = self._plan_views(host, max_bs, len(seqs))
                view.start.copy_(torch.tensor(plan.start, dtype=torch.int32))
                view.tiles[: len(plan.tiles)] = torch.tensor(plan.tiles, dtype=torch.int32)
                view.count.fill_(len(plan.groups))
                members = view.members.numpy()  # the same memory: row writes without a tensor op each
                members[:] = -1
                for g, rows in enumerate(plan.groups):
                    members[g, : len(rows)] = rows
                gs.prefix.copy_(host.pin_memory() if self._pin else host, non_blocking=self._pin)
            self._prefix_for, self._prefix_plan = list(seqs), plan
        plan = self._prefix_plan
        assert plan is not None
        self.stats["decode_shared_prefix_keys"] += plan.tiles_saved * TILE_KEYS
        return bool(plan.groups)

    def _next_plan(self, seqs: list[Sequence]) -> PrefixPlan:
        """The shared-prefix plan of ``seqs``: the last plan's :meth:`PrefixPlan.subset` when they are some of its
        sequences (others finished), else planned anew."""
        prev, plan = self._prefix_for, self._prefix_plan
        if prev is not None and plan is not None:
            where = {id(s): i for i, s in enumerate(prev)}
            rows = [where.get(id(s), -1) for s in seqs]
            if min(rows, default=-1) >= 0:
                return plan.subset(rows)
        tables, positions = [s.block_table for s in seqs], [s.num_computed for s in seqs]
        prompts = [s.num_prompt_tokens for s in seqs]
        return plan_shared_prefix(tables, positions, prompts, self.cache.block_size, self.prefix_capacity)

    def launch(self, batch: ScheduledBatch) -> DecodeLaunch | None:
        """Replay the decode graph of ``batch`` without waiting for it: advances ``num_computed`` and queues the
        read-back of the sampled tokens; :meth:`collect` returns them. None (nothing launched) when ``batch`` is not
        a graph decode (a prefill, graphs off, more sequences than the largest bucket, a failed capture): run it
        with :meth:`launch_eager`. Graph steps add their host time to ``stats["graph_s"]`` (here and in
        :meth:`collect`); captures to ``stats["capture_s"]``.

        Several launches may be in flight in order: a launch for the same sequences in the same order as the last
        one takes its input ids from the previous step's sampled tokens on the device (:meth:`_stage_inputs`)."""
        if not (batch.is_decode and self.use_graphs and len(batch.seqs) <= self.buckets[-1]):
            return None
        t0 = time.perf_counter()
        self._copy_blocks(batch.copies)
        seqs = batch.seqs
        b = len(seqs)
        gs = self._ensure_graph_state()
        kv_len = self._kv_bucket(max(len(s.block_table) for s in seqs)) if self.native else None
        # inputs first: a capture's eager warm-up run executes the step, so it must see this step's rows (it then
        # writes the same K/V the replay writes); stale rows could write into blocks that changed hands
        self._sync_table(gs)
        self._stage_inputs(gs, seqs)
        var = GraphVariant(kv_len, self._stage_prefix(gs, seqs), self._narrow(max(s.num_computed for s in seqs)))
        bucket, graph = self._pick_graph(gs, b, var)
        if graph is None:
            self._staged = None
            return None
        t1 = time.perf_counter()
        graph.replay()
        self._out_buffer ^= 1
        host_out = gs.host_out[self._out_buffer]
        host_out.copy_(gs.out, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        for s in seqs:
            s.num_computed += 1
        self.stats["graph_steps"] += 1
        t2 = time.perf_counter()
        host = self.decode_host_s
        host["prepare"] += t1 - t0
        host["launch"] += t2 - t1
        self.stats["graph_s"] += t2 - t0
        return DecodeLaunch(batch, host_out, done)

    def collect(self, launched: DecodeLaunch) -> list[tuple[Sequence, int, float]]:
        """Wait for a launched step and return ``(seq, token, logprob)`` of its sequences that are still running
        (one that finished at an earlier step in flight is dropped: its row of this step is discarded)."""
        t2 = time.perf_counter()
        if launched.done is not None:
            launched.done.synchronize()
        t3 = time.perf_counter()
        seqs = launched.batch.seqs
        both = launched.host_out[:, : len(seqs)]
        toks, lps = both[0].long().tolist(), both[1].tolist()
        running = Status.RUNNING
        out = [(s, t, lp) for s, t, lp in zip(seqs, toks, lps) if s.status is running]
        t4 = time.perf_counter()
        host = self.decode_host_s
        host["wait"] += t3 - t2
        host["collect"] += t4 - t3
        self.stats["graph_s"] += t4 - t2
        return out

    # ---------------------------------------------------------------------------------------------------------------
    # scoring (teacher forcing)
    # ---------------------------------------------------------------------------------------------------------------

    def score_step(self, batch: ScheduledBatch, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        """Feed a step of score-only sequences; store the log-prob of every fed token's successor (under the
        ``top_k`` / ``top_p`` truncation when one is set, as :func:`rlexact.models.forward.head_logprobs`)."""
        inp = self._prepare(batch)
        hidden = self._eager_forward(self._upload(inp))
        cu = inp["cu"].tolist()
        spans: list[tuple[Sequence, int, int]] = []  # (sequence, first fed position with a successor, count)
        rows: list[torch.Tensor] = []
        targets: list[int] = []
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)):
            start = s.num_computed
            k = min(n, len(s) - 1 - start)  # fed tokens that have a successor (all but the sequence's last token)
            if k > 0:
                spans.append((s, start, k))
                rows.append(torch.arange(cu[i], cu[i] + k))
                targets.extend(s.tokens[start + 1 : start + 1 + k])
            s.num_computed += n
        if not spans:
            return
        idx, tgt = self._to_device(torch.cat(rows)), self._to_device(torch.tensor(targets, dtype=torch.long))
        # the native head materializes [rows, vocab] fp32 logits: bound them whatever the token budget
        step = max(1, NATIVE_SCORE_LOGITS // lm_head_weight(self.model).shape[0]) if self.native else len(targets)
        parts = [
            head_logprobs(self.model, hidden[idx[i : i + step]], tgt[i : i + step], temperature, top_k=top_k,
                          top_p=top_p)[0]
            for i in range(0, len(targets), step)
        ]  # fmt: skip
        logp = torch.cat(parts).float().cpu()
        offset = 0
        for s, start, k in spans:
            assert s.score_logprobs is not None
            s.score_logprobs[start : start + k] = logp[offset : offset + k]
            offset += k


def _describe_capture_failure(exc: BaseException) -> str:
    """The root cause of a failed capture: the first exception of the chain (usually a host sync such as
    ``.item()`` inside the captured step) and the innermost frame of the model/kernel code that raised it."""
    import traceback

    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 8:
        chain.append(chain[-1].__context__)
    root = chain[-1]
    frames = traceback.extract_tb(root.__traceback__)
    where = ""
    for fr in reversed(frames):
        if "rlexact" in fr.filename or "transformers" in fr.filename:
            where = f" at {fr.filename}:{fr.lineno} ({fr.name}: {(fr.line or '').strip()})"
            break
    first_line = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}: {first_line}{where}"


def _recover_from_failed_capture(device: torch.device, stream: torch.cuda.Stream) -> None:
    """Undo what a failed ``torch.cuda.graph`` capture leaves behind.

    ``CUDAGraph.capture_end`` raises before it restores the caller's stream and before the CUDA generator leaves
    capture mode, after which any RNG use fails ("Offset increment outside graph capture"). Restore the stream and
    run one trivial capture (its prologue/epilogue reset the generator state).
    """
    torch.cuda.set_stream(stream)
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001
        pass
    try:
        probe = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            probe.add_(1)
        torch.cuda.synchronize(device)
        del graph
    except Exception:  # noqa: BLE001
        torch.cuda.set_stream(stream)
