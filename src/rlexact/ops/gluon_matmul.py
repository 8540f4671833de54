"""The exact matmul in Triton's Gluon dialect, for Hopper: persistent, warp-specialized, plain or gated (SiLU or GELU).

Bitwise the rows of :func:`rlexact.ops.triton_matmul.matmul` (and of its ``gated_matmul``) for shapes without fixed K
splits: every output element is the fp32 chain ``acc = 0``, then ``acc = x_k @ w_k^T + acc`` for every 64-column K tile
in ascending order, carried through the wgmma accumulator (k16 steps, ascending), rounded once to the output dtype. The
gated product runs the gate row's chain and the up row's chain on the same ``x`` tiles, rounds both to the output dtype
and stores ``silu(gate) * up`` with the library's formula (``g / (1 + exp(-g)) * u`` in fp32 with the GPU's fast
division, rounded once), or ``gelu_tanh(gate) * up`` with the same division over the GELU's argument
(:func:`rlexact.ops.triton_shared.gelu_tanh_times`). Tile shapes do not enter a row's arithmetic (the wgmma
instruction's N width and the number of warpgroups do not change an element's k16 chain: ``rlexact.ops.triton_matmul``'s
module docstring), so this kernel and the ``tl`` tiles give the same bits; the GPU tests check it. (Summing fixed K
splits in the consumer, as the ``tl`` kernel does for K-heavy shapes, was bitwise equal but slower at decode row counts:
``benchmarks/results/gluon_matmul_probe_down_h200.json``.)

What differs is how the operands reach the tensor cores. A producer warp streams each tile's ``x`` and ``w`` K slices
through a ``STAGES``-deep TMA ring that runs ahead across tiles; a consumer partition of ``BM / 16`` warps chains
asynchronous wgmmas and releases each slot once the wgmma after it is issued and the one that read it is done, so
the loads of the next slices and of the next tile overlap the MMAs and the epilogue.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .gluon_attention import descriptor, gluon, launch, sm90
from .triton_shared import aligned, device_key, num_sms

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_attention import cta_barrier, tma_load, wgmma_layout

__all__ = ["BK", "GluonMatmulConfig", "forward", "supported"]

BK = 64
"""K columns per ring slot (the chain's k16 steps do not depend on it)."""
STAGE_COUNT = 4
"""Depth of the operand ring."""
SMEM_LIMIT = 227 * 1024
"""Shared memory one Hopper program may use."""


@dataclass(frozen=True)
class GluonMatmulConfig:
    """One launch shape: ``BM x BN`` output tiles (``BN`` columns of the gate and of the up product when gated),
    ``BM / 16`` consumer warps, ``per_sm`` persistent programs per SM."""

    BM: int
    BN: int
    per_sm: int = 1

    def __post_init__(self) -> None:
        if self.BM not in (64, 128) or self.BN not in (64, 128, 256) or self.per_sm not in (1, 2):
            raise ValueError(f"GluonMatmulConfig: BM={self.BM} (64 or 128), BN={self.BN} (64, 128 or 256) and "
                             f"per_sm={self.per_sm} (1 or 2) are the supported tiles")  # fmt: skip

    @property
    def maxnreg(self) -> int:
        """Registers per thread at launch: with two programs per SM each gets half the SM's registers over its 4
        consumer warps and its producer warp padded to a warp group; with one, the share of a 128-row tile's three
        warp groups (64-row tiles take the same)."""
        return 168 if self.per_sm == 1 else 128

    def ring_bytes(self, gated: bool) -> int:
        """Shared memory of the operand ring (16-bit operands): ``x``, gate / ``w`` and up tiles per slot."""
        return STAGE_COUNT * (self.BM + (2 * self.BN if gated else self.BN + 8)) * BK * 2


if gluon is not None:
    STAGES = gl.constexpr(STAGE_COUNT)
    PRODUCER_REGS = gl.constexpr(24)

    @gluon.jit
    def _coords(tile, num_pid_m, num_pid_n, group_m):
        """Grouped tile order (the ``tl`` kernel's; an order does not change a bit)."""
        in_group = group_m * num_pid_n
        first_m = (tile // in_group) * group_m
        size_m = gl.minimum(num_pid_m - first_m, group_m)
        return first_m + tile % size_m, (tile % in_group) // size_m

    @gluon.jit
    def _producer(x_desc, w_desc, a_smem, b_smem, u_smem, ready, empty, M, N, K, group_m):
        """Copy every tile's K slices of ``x`` and of ``w``'s rows into the ring, each slot once the consumer has
        released it. The ring's shapes say which rows (worker partitions take no constexpr arguments): gate rows
        ``n`` into ``b_smem`` and up rows ``N + n`` into ``u_smem`` when ``u_smem`` holds a whole tile, else rows
        ``n`` alone."""
        bm: gl.constexpr = x_desc.block_type.shape[0]
        bk: gl.constexpr = x_desc.block_type.shape[1]
        bn: gl.constexpr = w_desc.block_type.shape[0]
        two_chains: gl.constexpr = u_smem.type.shape[1] == bn
        w_tiles: gl.constexpr = 2 if two_chains else 1
        nbytes: gl.constexpr = (bm + w_tiles * bn) * bk * x_desc.dtype.primitive_bitwidth // 8
        num_pid_m = gl.cdiv(M, bm)
        num_pid_n = gl.cdiv(N, bn)
        c = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = _coords(tile, num_pid_m, num_pid_n, group_m)
            for ki in range(0, gl.cdiv(K, bk)):
                slot = c % STAGES
                bar = ready.index(slot)
                mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)  # a fresh barrier counts as released
                mbarrier.expect(bar, nbytes)
                tma_load(x_desc, [pid_m * bm, ki * bk], bar, a_smem.index(slot))
                tma_load(w_desc, [pid_n * bn, ki * bk], bar, b_smem.index(slot))
                if two_chains:
                    tma_load(w_desc, [N + pid_n * bn, ki * bk], bar, u_smem.index(slot))
                c += 1

    @gluon.jit
    def _gate_times(gate, up, GATED: gl.constexpr):
        """The gate times ``up`` in fp32 with the library's formulas (:func:`rlexact.ops.triton_shared.gate_times`):
        ``GATED`` 1 SiLU, 2 GELU (tanh), whose argument is ``gelu_tanh_arg``'s."""
        if GATED == 2:
            gate_arg = 1.5957691216057308 * (gate + 0.044715 * (gate * gate * gate))
        else:
            gate_arg = gate
        return gate / (1.0 + gl.exp(-gate_arg)) * up

    @gluon.jit
    def _store(out_ptr, acc, up, M, N, stride_om, row0, col0, GATED: gl.constexpr):
        """Store the tile at ``(row0, col0)``: ``acc`` rounded to the output dtype, or with ``GATED`` both chains
        rounded as stored products, then the exact gate in fp32 (:func:`_gate_times`), rounded once."""
        bm: gl.constexpr = acc.type.shape[0]
        width: gl.constexpr = acc.type.shape[1]
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [bm // 16, 1], [1, 0])
        dt: gl.constexpr = out_ptr.dtype.element_ty
        if GATED:
            acc = _gate_times(acc.to(dt).to(gl.float32), up.to(dt).to(gl.float32), GATED)
        rows = row0 + gl.arange(0, bm, layout=gl.SliceLayout(1, out_layout))
        cols = col0 + gl.arange(0, width, layout=gl.SliceLayout(0, out_layout))
        ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        out = gl.convert_layout(acc.to(dt), out_layout)
        gl.store(ptrs, out, mask=(rows < M)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _consumer(out_ptr, a_smem, b_smem, u_smem, ready, empty, M, N, K, stride_om, group_m, BM: gl.constexpr,
                  BN: gl.constexpr, GATED: gl.constexpr):  # fmt: skip
        """Every tile of this program: the wgmma chain(s) over its K slices, then the store of its rows.
        ``GATED``: 0 plain; 1 (SiLU) or 2 (GELU) the gate chain in ``b_smem`` and the up chain in ``u_smem``."""
        CW: gl.constexpr = BM // 16
        bk: gl.constexpr = a_smem.type.shape[2]
        acc_layout: gl.constexpr = wgmma_layout(CW, BN)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, bk)
        c = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = _coords(tile, num_pid_m, num_pid_n, group_m)
            acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
            acc_up = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
            for ki in range(0, k_tiles):  # ascending K, one accumulator per chain
                slot = c % STAGES
                mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
                acc = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), acc, is_async=True)
                if GATED:
                    acc_up = warpgroup_mma(a_smem.index(slot), u_smem.index(slot).permute((1, 0)), acc_up,
                                           is_async=True)  # fmt: skip
                    acc, acc_up = warpgroup_mma_wait(2, deps=(acc, acc_up))  # the previous slot's pair is done
                else:
                    acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous slot's wgmma is done
                if ki > 0:
                    mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
                c += 1
            if GATED:
                acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
            _store(out_ptr, acc, acc_up, M, N, stride_om, pid_m * BM, pid_n * BN, GATED)

    @gluon.jit
    def _mm_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_om, group_m, BM: gl.constexpr, BN: gl.constexpr,
                   GATED: gl.constexpr):  # fmt: skip
        """``GATED``: 0 plain, 1 SiLU-gated, 2 GELU-gated (:func:`_consumer`)."""
        dt: gl.constexpr = x_desc.dtype
        bk: gl.constexpr = x_desc.block_type.shape[1]
        up_rows: gl.constexpr = BN if GATED else 8  # else an unused slot
        a_smem = gl.allocate_shared_memory(dt, [STAGES, BM, bk], x_desc.layout)
        b_smem = gl.allocate_shared_memory(dt, [STAGES, BN, bk], w_desc.layout)
        u_smem = gl.allocate_shared_memory(dt, [STAGES, up_rows, bk], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        cta_barrier()
        gl.warp_specialize(
            [
                (_consumer, (out_ptr, a_smem, b_smem, u_smem, ready, empty, M, N, K, stride_om, group_m, BM, BN,
                             GATED)),
                (_producer, (x_desc, w_desc, a_smem, b_smem, u_smem, ready, empty, M, N, K, group_m)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip

    @functools.cache
    def _smem_layout(rows: int, fp16: bool) -> object:
        return gl.NVMMASharedLayout.get_default_for([rows, BK], gl.float16 if fp16 else gl.bfloat16)


GROUP_M = 8
"""Row tiles per group of the grouped tile order (speed only)."""


def supported(device: torch.device) -> bool:
    """Whether :func:`forward` runs on ``device``: Gluon's Hopper language and an sm_90 GPU. The operands' own
    conditions (16-bit, one dtype, rows TMA can stride) are those of the library's TMA matmul tiles
    (:func:`rlexact.ops.triton_shared.tma_ok`), which every caller checks first."""
    key = device_key(device)
    return gluon is not None and key[0] == "cuda" and sm90(key[1])


def forward(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: GluonMatmulConfig, gated: bool, gelu: bool = False
) -> None:
    """``out [M, N] = x [M, K] @ w [N, K].T``, or with ``gated`` (``w [2N, K]``, gate rows then up rows)
    ``silu(x @ w[:N].T) * (x @ w[N:].T)`` (with ``gelu``: ``gelu_tanh`` as the gate), in ``cfg``'s tiles: one chain
    over all of K, so the library's rows for shapes without fixed K splits
    (:func:`rlexact.ops.triton_matmul.chain_splits` is 0). Call only where :func:`supported` holds. TMA descriptors
    need 16-byte-aligned bases, so a misaligned operand is copied first, as the ``tl`` descriptor tiles do."""
    if cfg.ring_bytes(gated) > SMEM_LIMIT:
        kind = "gated" if gated else "plain"
        raise ValueError(f"gluon_matmul: {cfg} ({kind}) needs {cfg.ring_bytes(gated)} bytes of shared memory, more "
                         f"than {SMEM_LIMIT}; use narrower tiles (BN <= 128 when gated)")  # fmt: skip
    x, w = aligned(x), aligned(w)
    m, k = x.shape
    n_rows = w.shape[0]
    n = out.shape[1]
    fp16 = x.dtype == torch.float16
    x_desc = descriptor(x, [m, k], [k, 1], [cfg.BM, BK], _smem_layout(cfg.BM, fp16))  # aligned; tma_ok held
    w_desc = descriptor(w, [n_rows, k], [k, 1], [cfg.BN, BK], _smem_layout(cfg.BN, fp16))
    tiles = -(-m // cfg.BM) * -(-n // cfg.BN)
    grid = (min(tiles, cfg.per_sm * num_sms(x.device)), 1)
    stride = out.stride(0)
    args = (x_desc, w_desc, out, m, n, k, stride, GROUP_M, cfg.BM, cfg.BN, (2 if gelu else 1) if gated else 0)
    options = options_for(cfg)
    launch(_mm_kernel, grid, args, (x, w, out), (m, n, k, stride, n_rows, GROUP_M), options)


@functools.cache
def options_for(cfg: GluonMatmulConfig) -> Mapping[str, int]:
    """The compile options of a launch in ``cfg``'s tiles."""
    return MappingProxyType({"num_warps": cfg.BM // 16, "maxnreg": cfg.maxnreg})
