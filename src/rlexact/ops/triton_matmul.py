"""Batch-invariant Triton matmul: ``out[M, N] = x[M, K] @ w[N, K].T`` with fp32 accumulation.

Why the result for a row depends only on that row
-------------------------------------------------
Every output element is ``acc = 0; for k-tile in 0, 1, ..., cdiv(K, BK) - 1: acc = dot(x_tile, w_tile^T, acc)``:
one program owns a whole ``BM x BN`` output tile (no atomics), the K tiles are visited in ascending order,
the accumulator is fp32 and is carried through ``tl.dot``'s accumulator operand (never ``acc += dot(...)``), and
fp32 operands use ``input_precision="ieee"`` (no TF32). Out-of-range rows/columns/K-tail are zero-filled (TMA
out-of-bounds fill or masked loads), so padding rows never influence real rows: matrix instructions compute each
output element from its own row of ``x`` and column of ``w^T`` only.

Fixed K splits. For K-heavy shapes too narrow to occupy the GPU at small M (:func:`split_keys`, a function of N, K,
dtype and the device only) the chain restarts from zero every ``KS`` columns, anchored at column 0, and the split
chains are summed in ascending order:
``out = ((0 + c_0) + c_1) + ...``. That is still a function of the row alone. Decode-sized M computes the splits in
separate programs (``"split"`` configs: fp32 partials, then a summing launch), larger M in one program with a second
register accumulator (``"tma"`` configs with ``KS``); the sums are the same fp32 additions in the same order, so the
bits are the same (``tests/_interp_kernels.py``, ``tests/test_triton_kernels.py``). At small M the output tiles of
such shapes are too few to fill the GPU, and the splits multiply the programs without re-reading ``x`` per narrow
column tile (``benchmarks/results/matmul_splitk_h200.json``).

cuBLAS where verified. A product of at most :data:`CUBLAS_MAX_M` rows without K splits runs ``torch.mm`` once
:mod:`rlexact.ops.cublas_verify` found cuBLAS's kernel for that ``(M, N, K)`` and the current reduced-precision
settings computing this chain bitwise (probes that expose any other summation order); until then, during graph
capture, or where the check failed, it runs the kernels below (docs/design.md §2.2).

The tile configuration is a function of ``(N, K, dtype, device)`` only (:func:`static_config`), never of M. On Hopper
an M-bucketed list of variants (:func:`row_tile_variants`, itself a function of N, K, dtype, device) trades tile
shapes for speed -- narrow pointer-kernel tiles for decode, wide TMA tiles for prefill/training. That is legal only
because the variants differ in BM / BN / BK / kernel but not in the per-element arithmetic:

* **fp32** lowers ``tl.dot(..., input_precision="ieee")`` to scalar FMA chains, ``acc = fma(a[m, k], b[k, n], acc)``
  for k ascending -- the per-element operation sequence does not involve BM, BN or BK at all.
* **bf16/fp16 on Hopper** lowers to ``wgmma.m64nNk16`` instructions issued per warpgroup (64 rows), chained on the
  accumulator k16-step by k16-step in ascending K. A BM=64 tile and a BM=128 tile (two warpgroups) issue the same
  k16 chain for every row; only the instruction's N width differs (n64 vs n256), and the tensor core computes each
  output element with the same datapath whatever N is. This is a *hardware* property, so it is verified rather
  than assumed: ``tests/test_triton_kernels.py::test_gpu_matmul_row_tile_variants_bitwise`` compares every variant
  of :func:`row_tile_variants` bitwise, and the invariance tests compare rows at M = 1..64 (decode variant) with the
  same rows inside M = 4096 / 16384 (large variant). Should a Triton/driver/GPU combination ever break this, set
  ``RLEXACT_MATMUL_SINGLE_TILE=1`` (or :data:`USE_ROW_TILE_VARIANTS` = False) and every M uses the one static config.
* Anything else (Triton interpreter, pre-Hopper GPUs, K or N not 16-byte aligned for TMA, Triton without tensor
  descriptors/warp specialization) uses the portable pointer kernel with a single static config for all M.

So the variant for a given M is picked from a list whose members are bitwise-equivalent per row; the list itself is
a function of (N, K, dtype, device). With variants disabled the M-independence is by construction. (On the H200 the
pointer kernel, the TMA kernel with host or device descriptors, BM 64/128, BN 16..256, BK 64/128/256 and warp
specialization on/off all produced identical bits for bf16.)

Row-tile variants (bf16 on Hopper; tuned on the Qwen3-1.7B projections with CUDA-graph timings, see
``benchmarks/results/matmul_variants_h200.json``, ``benchmarks/results/matmul_variants_m256_h200.json`` and the
``matmul`` section of ``benchmarks/results/ops_h200.json``; every candidate there was bitwise identical):

* Split shapes (``KS`` set): M <= 16 ``"split"`` 16 x 64 x 128, M <= 64 ``"split"`` 64 x 64 x 128, M <= 256 TMA
  64 x 64 x 128, M <= 2048 TMA 128 x 128 x 64, larger M TMA 128 x 256 x 64 (8 warps, 3 stages), all with ``KS``
  (``benchmarks/results/matmul_splitk_h200.json``).
* Other K-heavy shapes (K >= 2N, one chain): pointer kernel with 16-column tiles, 4 warps, M <= 16 16 x 16 x 128
  (6 stages), M <= 32 32 x 16 x 128 (6 stages), M <= 64 64 x 16 x 256 (4 stages); M <= 256 TMA 64 x 64 x 128
  (5 stages); then the mid and large tiles below (``benchmarks/results/matmul_splitk_unsplit_h200.json``, the
  fastest bitwise-equal candidates per M on the Qwen3-1.7B down projection). The rules below are for the rest.
* M <= 16 ("narrow"): pointer kernel, BM = 16, BN = 32 where N still gives ~#SMs column tiles, else 16, BK = 128,
  4 warps, 4 stages (``benchmarks/results/matmul_decode16_h200.json``: every 16-row candidate there, over one warp
  or four, was bitwise equal to the large-M tiles).
* 16 < M <= 64 ("decode"): pointer kernel, BM = 64, BN in {64, 32, 16} chosen from N so that ~#SMs column tiles
  exist (small M is bound by reading ``w`` once, and without K splits N is the only parallelism), BK = 128 for
  BN = 32 and 64 otherwise, 6 stages for BN = 64. TMA with such narrow tiles was slower.
* 64 < M <= 256: persistent TMA, 4 warps, 64 x 128 x 128 with 4 stages, or 64 x 64 x 128 with 5 when N is too small
  for ~one 64 x 128 tile per SM at M = 256 (BK 128 with 4 stages beat BK 64 with 5 for the fused q/k/v and the
  gate or up projection with weights from HBM: ``benchmarks/results/matmul_variants_qkv_cold_h200.json``). For wide
  N (``cdiv(N, 128) * 2 >= 0.6 * #SMs``, e.g. the 6144-wide gate/up projections) 128 < M <= 256 uses 128 x 128 x 64,
  4 warps, 4 stages; for very wide N (``cdiv(N, 256) * 2 >= 0.6 * #SMs``, the
  fused gate/up projection) 128 x 256 x 64, 8 warps, 3 stages.
* 256 < M <= 2048: persistent TMA, 128 x 128 x 64, 8 warps, 4 stages.
* M > 2048: persistent TMA, 128 x 256 x 64, 8 warps, 3 stages, epilogue stored in two halves.
* ``tl.range(..., warp_specialize=True)`` (``MatmulConfig.warp_specialize``) is never chosen: at M = 256 every
  warp-specialized tile was slower than the best plain one, and 19 of 51 changed bits, among them every tile of the
  K-split down projection (``benchmarks/results/matmul_variants_ws_m256_h200.json``). So it is not a scheduling-only
  choice here: a configuration that asks for it must pass the bitwise variant checks first (a failed WS compile runs
  the tile without it).

Host overhead (the trainer calls the matmul eagerly): every TMA variant builds its tensor descriptors on the device
(``tl.make_tensor_descriptor``), so no host descriptor is encoded per launch. Each ``(M, N, K, dtype, device)`` gets
a cached :class:`_Launch` (configuration, grid, arguments) and, after its first launch, a cached launcher
(:func:`_keep_runner`). On Triton 3.6 that is :func:`_direct_runner`: it calls the compiled kernel's C launcher
itself with the stream, function, metadata and arguments bound once, pointers passed as integers and the descriptor
scratch handed over directly (the last stream's buffer, or the CUDA-graph pool during capture, :func:`_scratch`),
so a call costs one shape check, one dictionary lookup, one ``torch.empty`` and the C launch. Launch hooks, when
installed, still see every launch (the launch then goes through Triton's runner). On other Triton versions the
cached launcher is Triton's ``CompiledKernel[grid]`` runner, whose descriptor scratch comes from Triton's per-thread
allocator (:func:`ensure_allocator` installs :func:`_torch_alloc` in a thread that has none; nothing else is
global). Where no launcher can be reused (unaligned pointers of the pointer kernel, the interpreter, another current
device) the call goes through Triton's regular JIT dispatch, which compiles the same kernel for the same
specialization (``RLEXACT_MATMUL_JIT_LAUNCH=1`` forces that path everywhere; a cached launcher that raises on an
incompatible Triton warns and switches to it). A ``"split"`` plan (K-heavy shapes at M <= 64) launches its partials
through the cached launcher too, plus a summing kernel through Triton's JIT dispatch: one more launch and its host
time per call, which CUDA-graph decode steps do not repeat.
Eager vs CUDA-graph timings: ``benchmarks/matmul_launch.py`` and ``benchmarks/results/ops_h200.json``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import cublas_verify, gluon_matmul
from .backend import interpreter_enabled
from .triton_norm import gelu_tanh_mul, silu_mul
from .triton_pdl import pdl_entry, pdl_options
from .triton_shared import (
    COMPILE_OPTIONS,
    LAUNCHER_ERRORS,
    TL_DTYPE,
    TensorDescriptor,
    aligned,
    cast_out,
    cuda_props,
    cuda_queries,
    device_key,
    direct_launch_ok,
    dot_flags,
    gate_times,
    launch_hooks_installed,
    num_sms,
    rne_fix,
    stream_buffer,
    tile_coords,
    tma_ok,
)

try:  # the thread's Triton allocator (device-side descriptor scratch)
    from triton.runtime import _allocation
except ImportError:  # pragma: no cover - old triton
    _allocation = None

_INTERPRET = interpreter_enabled()

USE_ROW_TILE_VARIANTS = os.environ.get("RLEXACT_MATMUL_SINGLE_TILE", "0") != "1"
"""Allow the bitwise-equivalent row-tile variants (decode / mid / large M) on Hopper. See the module docstring."""

@dataclass(frozen=True)
class MatmulConfig:
    """One kernel launch configuration. ``kernel`` is ``"tma"`` (persistent, tensor descriptors), ``"ptr"``, or
    ``"split"`` (one program per output tile and K split, fp32 partials summed by a second launch; needs ``KS``)."""

    kernel: str
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    warp_specialize: bool = False
    subtile: bool = False
    """Store the epilogue as two ``BM x BN/2`` halves (frees shared memory for pipeline stages)."""
    device_desc: bool = True
    """TMA kernel only: build the tensor descriptors on the device (no per-launch host encoding). ``False`` builds
    them on the host (same arithmetic; kept for comparison)."""
    joint: bool = False
    """Gated TMA launches only: load a tile's gate and up rows as one ``[2, BN, BK]`` block and run one dot of
    width ``2 * BN`` (instead of two dots of width ``BN``); the columns of each chain are the same."""
    KS: int = 0
    """Keys per fixed K split (0: one chain over all of K). With ``KS``, every output element is
    ``((0 + c_0) + c_1) + ...`` where ``c_s`` is the K chain of columns ``[s * KS, (s + 1) * KS)`` started from zero:
    the ``"tma"`` kernel sums the splits in registers, ``"split"`` in a second launch, with the same bits."""

    def __post_init__(self) -> None:
        if self.kernel not in ("tma", "ptr", "split"):
            raise ValueError(f"MatmulConfig: unknown kernel {self.kernel!r} (expected 'tma', 'ptr' or 'split')")
        if self.KS % self.BK or (self.kernel == "split" and not self.KS) or (self.kernel == "ptr" and self.KS):
            raise ValueError(
                f"MatmulConfig: KS={self.KS} must be a multiple of BK={self.BK}, set for 'split' and 0 for 'ptr'"
            )


SPLIT_K_KEYS = 1536
"""``KS`` of the split shapes (:func:`split_keys`): chosen from ``benchmarks/results/matmul_splitk_h200.json`` (on
the Qwen3-1.7B ``down`` projection, N = 2,048, K = 6,144: 1,536 keys were fastest at M = 4 and 64; a multiple of
every BK)."""
NARROW_BN = 16
"""The narrowest column tile: at small M a K-heavy product without splits has ``cdiv(N, NARROW_BN)`` programs."""


def split_keys(N: int, K: int, dtype: torch.dtype, tma: bool, sms: int) -> int:
    """``KS`` for ``(N, K, dtype)`` on a TMA-capable device of ``sms`` SMs: :data:`SPLIT_K_KEYS` for K-heavy shapes
    (K at least 4,096 and at least twice N) whose :data:`NARROW_BN`-column tiles are too few to occupy the SMs, else
    0 (where they are enough, one chain over all of K is as fast at decode row counts and faster at large M, and
    cuBLAS can run it: ``benchmarks/results/matmul_splitk_unsplit_h200.json``). Part of the static configuration, so
    every M of the shape splits K at the same columns."""
    if not (tma and USE_ROW_TILE_VARIANTS) or dtype == torch.float32:
        return 0
    heavy = K >= 4096 and K >= 2 * N
    return SPLIT_K_KEYS if heavy and triton.cdiv(N, NARROW_BN) < 0.9 * sms else 0


def chain_splits(N: int, K: int, dtype: torch.dtype, device: torch.device) -> int:
    """``KS`` of the per-element chain of an ``[M, K] @ [N, K].T`` product on ``device`` (0: one chain over all of K),
    for every M. Two shapes whose products may be computed by one matmul on concatenated weights (fused projections)
    must have equal values, or the fused output's bits differ from the separate products'. The static
    configuration's ``KS`` (every row-tile variant carries it)."""
    return static_config(N, K, dtype, device).KS


@functools.cache
def _static_config(N: int, K: int, dtype: torch.dtype, device_key: tuple, tma: bool) -> MatmulConfig:
    if device_key[0] == "interp":
        return MatmulConfig("ptr", BM=16, BN=32, BK=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # FMA path (ieee); tiles only affect speed, not bits
        return MatmulConfig("ptr", BM=64, BN=64, BK=32, num_warps=4, num_stages=3)
    ks = split_keys(N, K, dtype, tma, cuda_props(device_key[1])[1] if tma else 0)
    if ks:  # fastest in-register-sum tile at M = 4,096 and 16,384 (matmul_splitk_h200.json, part "large")
        return MatmulConfig("tma", 128, 256, 64, num_warps=8, num_stages=3, KS=ks)
    if tma:  # warp specialization: slower and not always bitwise equal on the H200 (triton 3.6), see the module doc
        if N >= 256:
            return MatmulConfig("tma", 128, 256, 64, num_warps=8, num_stages=3, subtile=True)
        return MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4)
    return MatmulConfig("ptr", BM=128, BN=128, BK=64, num_warps=8, num_stages=3)


def static_config(N: int, K: int, dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """The configuration used for every M when row-tile variants are off (a function of N, K, dtype, device)."""
    return _static_config(N, K, dtype, device_key(device), tma_ok(N, K, dtype, device))


def _decode_bn(N: int, num_sms: int) -> int:
    """Widest BN in {64, 32, 16} that still gives about one column tile per SM (small M reads ``w`` once and, for
    shapes without K splits, N is the only source of parallelism)."""
    for bn in (64, 32):
        if triton.cdiv(N, bn) >= 0.9 * num_sms:
            return bn
    return 16


@functools.cache
def _variants(N: int, K: int, dtype: torch.dtype, device_key: tuple, tma: bool) -> tuple:
    base = _static_config(N, K, dtype, device_key, tma)
    if not (tma and USE_ROW_TILE_VARIANTS):
        return ((None, base),)
    if base.KS:  # K-heavy: small M splits K across programs, larger M sums the same splits in registers
        narrow = MatmulConfig("split", 16, 64, 128, num_warps=4, num_stages=4, KS=base.KS)
        decode = MatmulConfig("split", 64, 64, 128, num_warps=4, num_stages=4, KS=base.KS)
        small = MatmulConfig("tma", 64, 64, 128, num_warps=4, num_stages=5, KS=base.KS)
        mid = MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4, KS=base.KS)
        return ((16, narrow), (64, decode), (256, small), (2048, mid), (None, base))
    sms = cuda_props(device_key[1])[1]
    mid = MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=4)
    if K >= 2 * N:  # K-heavy, one chain: narrow column tiles with deep K steps (matmul_splitk_unsplit_h200.json)
        narrow = MatmulConfig("ptr", 16, NARROW_BN, 128, num_warps=4, num_stages=6)
        decode32 = MatmulConfig("ptr", 32, NARROW_BN, 128, num_warps=4, num_stages=6)
        decode = MatmulConfig("ptr", 64, NARROW_BN, 256, num_warps=4, num_stages=4)
        small = MatmulConfig("tma", 64, 64, 128, num_warps=4, num_stages=5)
        return ((16, narrow), (32, decode32), (64, decode), (256, small), (2048, mid), (None, base))
    bn = _decode_bn(N, sms)
    # All variants are bitwise-identical per row (verified on an H200, see the module docstring); tuned on the
    # Qwen3-1.7B projections with CUDA-graph timings (GPU time, host overhead excluded).
    # benchmarks/results/matmul_variants_h200.json: BK 64 for BN 16 / 64 (6 stages for 64), BK 128 for BN 32.
    decode = MatmulConfig("ptr", 64, bn, 128 if bn == 32 else 64, num_warps=4, num_stages=6 if bn == 64 else 4)
    # M <= 16: 16-row tiles (no shared memory or loads spent on 48 empty rows), the decode rule's BN capped at 32
    # (benchmarks/results/matmul_decode16_h200.json)
    narrow = MatmulConfig("ptr", 16, min(bn, 32), 128, num_warps=4, num_stages=4)
    if triton.cdiv(N, 128) * 4 < 0.9 * sms:  # fewer than ~one 64 x 128 tile per SM at M = 256: narrower tiles
        small = MatmulConfig("tma", 64, 64, 128, num_warps=4, num_stages=5)
    else:
        small = MatmulConfig("tma", 64, 128, 128, num_warps=4, num_stages=4)
    if triton.cdiv(N, 256) * 2 >= 0.6 * sms:  # very wide N (fused gate/up): 128 x 256 tiles fill the GPU at M = 256
        wide = MatmulConfig("tma", 128, 256, 64, num_warps=8, num_stages=3)
        return ((16, narrow), (64, decode), (128, small), (256, wide), (2048, mid), (None, base))
    if triton.cdiv(N, 128) * 2 >= 0.6 * sms:  # wide N: 128 x 128 tiles still fill the GPU at 128 < M <= 256
        wide = MatmulConfig("tma", 128, 128, 64, num_warps=4, num_stages=4)
        return ((16, narrow), (64, decode), (128, small), (256, wide), (2048, mid), (None, base))
    return ((16, narrow), (64, decode), (256, small), (2048, mid), (None, base))


def row_tile_variants(N: int, K: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """``((max_M or None, MatmulConfig), ...)``, ascending; all members give bitwise-identical rows (see module doc)."""
    return _variants(N, K, dtype, device_key(device), tma_ok(N, K, dtype, device))


_PLANS: dict = {}
"""``(N, K, dtype, device) -> row_tile_variants(...)``: keeps the per-call host work small."""


def config_for(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """The configuration :func:`matmul` launches for ``M`` rows: the first member of :func:`row_tile_variants` whose
    ``max_M`` admits ``M``."""
    key = (N, K, dtype, device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = row_tile_variants(N, K, dtype, device)
    return next(cfg for max_m, cfg in plan if max_m is None or M <= max_m)


# ----------------------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _gate_up(acc, acc_up, OUT_DTYPE: tl.constexpr, RNE_FIX: tl.constexpr, GELU: tl.constexpr):
    """The gated epilogue: both fp32 chains rounded to ``OUT_DTYPE`` (as the separate products store them), then
    :func:`~rlexact.ops.triton_shared.gate_times` of the rounded values, in fp32 (the caller rounds once more, as
    ``silu_mul`` / ``gelu_tanh_mul`` do)."""
    gate = cast_out(acc, OUT_DTYPE, RNE_FIX).to(tl.float32)
    return gate_times(gate, cast_out(acc_up, OUT_DTYPE, RNE_FIX).to(tl.float32), GELU)


@triton.jit
def _dot_tile(a, b, acc, UPCAST: tl.constexpr):
    """``acc`` chained through one K tile: ``a [BM, BK] @ b[BN, BK].T``."""
    if UPCAST:  # interpreter only: its low-precision tl.dot is unreliable
        return tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
    return tl.dot(a, b.T, acc)


@triton.jit(do_not_specialize=["M"])
def _mm_tma_kernel(
    x_desc,
    w_desc,
    o_desc,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    WS: tl.constexpr,
    SUBTILE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_FIX: tl.constexpr,
    DEV_DESC: tl.constexpr,
    PDL: tl.constexpr,
    KS: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
):
    """Persistent matmul over tensor descriptors: ``x_desc [M, K]`` block ``[BM, BK]``, ``w_desc [N, K]`` block
    ``[BN, BK]`` (loaded as the B^T tile), ``o_desc [M, N]`` block ``[BM, BN]`` (``[BM, BN // 2]`` if SUBTILE).

    ``DEV_DESC``: the three arguments are plain (contiguous) tensors and the descriptors are built on the device
    (cheaper launches; needs a Triton allocator for the descriptor scratch, see :func:`ensure_allocator`).
    ``KS > 0``: the chain restarts from zero every ``KS`` columns and the splits are summed in ascending order.
    ``GATED`` (with ``KS == 0`` and ``DEV_DESC``): ``w_desc`` is ``[2N, K]``, gate rows then up rows; each tile runs
    the chain of its gate columns and, on the same ``x`` tiles, of its up columns, and stores ``silu(gate) * up``, or
    with ``GELU`` ``gelu_tanh(gate) * up`` (:func:`_gate_up`). ``GATED == 1`` runs two dots of width ``BN``;
    ``GATED == 2`` loads the gate and up tiles as one ``[2, BN, BK]`` block and runs one dot of width ``2 * BN``."""
    pdl_entry(PDL)  # before the descriptors are written: the previous launch may still read the same scratch
    if DEV_DESC:
        OB: tl.constexpr = BN // 2 if SUBTILE else BN
        WN: tl.constexpr = 2 if GATED else 1
        x_desc = tl.make_tensor_descriptor(x_desc, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
        if GATED == 2:
            w_desc = tl.make_tensor_descriptor(w_desc, shape=[2, N, K], strides=[N * K, K, 1], block_shape=[2, BN, BK])
        else:
            w_desc = tl.make_tensor_descriptor(w_desc, shape=[WN * N, K], strides=[K, 1], block_shape=[BN, BK])
        o_desc = tl.make_tensor_descriptor(o_desc, shape=[M, N], strides=[N, 1], block_shape=[BM, OB])
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    tile_id_c = start_pid - NUM_PROGS  # separate epilogue counter (helps the pipeliner, as in the Triton tutorial)
    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGS, flatten=False, warp_specialize=WS):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BM
        offs_n = pid_n * BN
        AW: tl.constexpr = 2 * BN if GATED == 2 else BN
        acc = tl.zeros((BM, AW), dtype=tl.float32)
        if KS > 0:
            total = tl.zeros((BM, BN), dtype=tl.float32)
        if GATED == 1:
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):  # ascending K, accumulator chained through tl.dot
            a = x_desc.load([offs_m, ki * BK])
            if GATED == 2:
                b = tl.reshape(w_desc.load([0, offs_n, ki * BK]), (2 * BN, BK))
            else:
                b = w_desc.load([offs_n, ki * BK])
            acc = _dot_tile(a, b, acc, UPCAST)
            if GATED == 1:
                acc_up = _dot_tile(a, w_desc.load([N + offs_n, ki * BK]), acc_up, UPCAST)
            if KS > 0:
                if ((ki + 1) % (KS // BK) == 0) | (ki == k_tiles - 1):  # a split ends: add its chain to the sum
                    total = total + acc
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
        if KS > 0:
            acc = total
        if GATED == 1:
            acc = _gate_up(acc, acc_up, OUT_DTYPE, RNE_FIX, GELU)
        if GATED == 2:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
            acc = _gate_up(gate, up, OUT_DTYPE, RNE_FIX, GELU)
        tile_id_c += NUM_PROGS
        pid_m, pid_n = tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        offs_cm = pid_m * BM
        offs_cn = pid_n * BN
        if SUBTILE:
            acc3 = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(acc3)
            o_desc.store([offs_cm, offs_cn], cast_out(acc0, OUT_DTYPE, RNE_FIX))
            o_desc.store([offs_cm, offs_cn + BN // 2], cast_out(acc1, OUT_DTYPE, RNE_FIX))
        else:
            o_desc.store([offs_cm, offs_cn], cast_out(acc, OUT_DTYPE, RNE_FIX))


@triton.jit
def _dot_ptr_tile(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``acc`` chained through one K tile of the pointer kernel: ``a [BM, BK] @ b [BK, BN]``."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _mm_ptr_kernel(
    x_ptr,
    w_ptr,
    o_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    RNE_FIX: tl.constexpr,
    PDL: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
):
    """Portable pointer matmul (one output tile per program); same per-element recurrence as the TMA kernel.
    ``GATED``: ``w`` is ``[2N, K]`` (gate rows, then up rows) and the output ``silu(gate) * up`` (with ``GELU``
    ``gelu_tanh(gate) * up``), as the TMA kernel."""
    pdl_entry(PDL)
    pid = tl.program_id(0)
    pid_m, pid_n = tile_coords(pid, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BK, BN] = tile of w^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BK)):
        k_ok = rk < K - ki * BK
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = n_ok[None, :] & k_ok[:, None]
        acc = _dot_ptr_tile(a, tl.load(w_ptrs, mask=b_mask, other=0.0), acc, UPCAST, IEEE)
        if GATED:
            acc_up = _dot_ptr_tile(a, tl.load(w_ptrs + N * stride_wn, mask=b_mask, other=0.0), acc_up, UPCAST, IEEE)
        x_ptrs += BK
        w_ptrs += BK
    if GATED:
        acc = _gate_up(acc, acc_up, o_ptr.dtype.element_ty, RNE_FIX, GELU)
    o_ptrs = o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, cast_out(acc, o_ptr.dtype.element_ty, RNE_FIX), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _mm_split_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    KS: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """The fp32 chain of K split ``program_id(2)`` (columns ``[s * KS, (s + 1) * KS)``, from zero) of one output tile,
    stored at ``ws[s]`` (``[splits, M, N]``); :func:`_split_sum_kernel` adds the splits."""
    pdl_entry(PDL)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    offs_m = tl.program_id(0) * BM
    offs_n = tl.program_id(1) * BN
    s = tl.program_id(2)
    TPS: tl.constexpr = KS // BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(s * TPS, tl.minimum(s * TPS + TPS, tl.cdiv(K, BK))):
        acc = _dot_tile(x_desc.load([offs_m, ki * BK]), w_desc.load([offs_n, ki * BK]), acc, UPCAST)
    rows = offs_m + tl.arange(0, BM)
    cols = offs_n + tl.arange(0, BN)
    p_ptrs = ws_ptr + (s * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(p_ptrs, acc, mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _split_sum_kernel(ws_ptr, o_ptr, numel, splits, BLOCK: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr):
    """``out = ((0 + ws[0]) + ws[1]) + ...`` in ascending split order (the TMA kernel's in-register sum), cast once."""
    pdl_entry(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        total = total + tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(o_ptr + offs, cast_out(total, o_ptr.dtype.element_ty, RNE_FIX), mask=ok)


_SPLIT_SUM_BLOCK = 1024


# ----------------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------------

_WS_BROKEN: set = set()
"""Configs whose warp-specialized compile failed on this machine: they run without WS, with a warning, since
Triton's warp-specialized tiles are not always bitwise equal to the same tiles without it."""

_SCRATCH: dict = {}
"""``(device index, stream) -> int8 buffer`` reused as device-descriptor scratch by launches on that stream."""


def warp_specialized(cfg: MatmulConfig) -> bool:
    """Whether launches of ``cfg`` run warp-specialized: it asks for it and its warp-specialized compile did not fail
    on this machine (a failed one runs the same tile without it and warns, :data:`_WS_BROKEN`)."""
    return cfg.warp_specialize and cfg not in _WS_BROKEN


def ensure_allocator() -> None:
    """Device-side tensor descriptors need scratch memory. Launches through Triton's own launcher (JIT dispatch, or
    the cached ``CompiledKernel[grid]`` runner) ask the allocator of the current thread (Triton keeps it in a context
    variable, so every new thread starts without one); install :func:`_torch_alloc` there when none is set, and
    never replace an allocator the user installed. Called on those paths only: the direct launcher of
    :func:`_direct_runner` hands the scratch to the kernel itself and needs no allocator."""
    if _allocation is not None and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_alloc)


def _scratch(size: int, device: int, stream: int) -> torch.Tensor:
    """Descriptor scratch of at least ``size`` bytes for a launch on ``stream`` of CUDA device ``device``: each launch
    writes its descriptors before reading them, so the launches on one stream share a buffer
    (:func:`~rlexact.ops.triton_shared.stream_buffer`)."""
    return stream_buffer(_SCRATCH, device, stream, size, _scratch_bytes)


def _scratch_bytes(size: int, device: torch.device) -> torch.Tensor:
    """A new int8 scratch buffer of at least ``size`` bytes (at least 64 KiB, so small launches share one)."""
    return torch.empty(max(size, 1 << 16), dtype=torch.int8, device=device)


def _torch_alloc(size: int, alignment: int, stream) -> torch.Tensor:  # noqa: ANN001
    """Triton's allocator protocol over :func:`_scratch` (the current device; buffers are 512-byte aligned)."""
    return _scratch(size, torch.cuda.current_device(), stream)


@dataclass
class _Launch:
    """Everything about one matmul launch that depends only on ``(M, N, K, dtype, device)``.

    ``ints`` are the integer kernel arguments (fixed by the key); ``runner``, set after the first launch through
    Triton's JIT dispatch with 16-byte-aligned operands (:func:`_keep_runner`), launches the compiled kernel again:
    ``runner(x, w, out, x_ptr, w_ptr, out_ptr) -> bool`` (False: not launched, use the JIT dispatch)."""

    cfg: MatmulConfig
    kernel: object
    grid: tuple
    constexprs: dict
    options: dict
    ints: tuple
    device: int
    runner: object = None
    sum_launch: tuple | None = None
    """``"split"`` plans: ``(grid, keyword arguments)`` of the launch of :func:`_split_sum_kernel`."""
    cublas: dict | None = None
    """Plans cuBLAS may run (:func:`cublas_eligible`): :func:`rlexact.ops.cublas_verify.settings` -> whether
    ``torch.mm`` gave this plan's bits under them."""


_LAUNCHES: dict = {}
"""``(M, N, K, dtype, device index) -> _Launch``; gated products (``..., "gated", gelu``) map to a :class:`_Launch`
or to the :class:`rlexact.ops.gluon_matmul.GluonMatmulConfig` they run in."""

MAX_LAUNCHES = 4096
"""Most launch plans kept (packed training batches produce many distinct M; the cache is cleared when full)."""


def _plan(
    M: int,
    N: int,
    K: int,
    dtype: torch.dtype,
    device: torch.device,
    cfg: MatmulConfig,
    gated: bool = False,
    gelu: bool = False,
) -> _Launch:
    """The launch of ``cfg`` for ``[M, K] @ [N, K].T``; ``gated``: of the gated product over ``[2N, K]`` weights
    (``"tma"`` or ``"ptr"`` configurations without ``KS``), its gate SiLU or, with ``gelu``, GELU (tanh)."""
    if gated and (cfg.kernel == "split" or cfg.KS):
        raise ValueError(f"gated matmul: {cfg} splits K; the gated kernels run one chain over all of K")
    if cfg.joint and not (gated and cfg.kernel == "tma" and cfg.device_desc):
        raise ValueError(f"{cfg}: joint gate/up tiles need a gated launch of the TMA kernel with device descriptors")
    if gated and cfg.kernel == "tma" and not cfg.device_desc:
        raise ValueError(f"gated matmul: {cfg} needs device descriptors (device_desc=True)")
    pdl = dict(pdl_options(device))
    out_flags = {"RNE_FIX": rne_fix(dtype), "PDL": pdl.pop("PDL")}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} | pdl
    idx = device.index if device.type == "cuda" and device.index is not None else -1
    if cfg.kernel == "split":
        grid = (triton.cdiv(M, cfg.BM), triton.cdiv(N, cfg.BN), triton.cdiv(K, cfg.KS))
        constexprs = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, KS=cfg.KS, UPCAST=_INTERPRET, PDL=out_flags["PDL"])
        sum_launch = ((triton.cdiv(M * N, _SPLIT_SUM_BLOCK),), dict(BLOCK=_SPLIT_SUM_BLOCK, **out_flags, **pdl))
        return _Launch(cfg, _mm_split_kernel, grid, constexprs, options, (M, N, K), idx, sum_launch=sum_launch)
    if cfg.kernel == "tma":
        num_progs = max(1, min(num_sms(device), triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN)))
        constexprs = dict(
            BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.group_m, NUM_PROGS=num_progs,
            WS=cfg.warp_specialize and cfg not in _WS_BROKEN and not _INTERPRET, SUBTILE=cfg.subtile,
            OUT_DTYPE=TL_DTYPE[dtype], UPCAST=_INTERPRET, DEV_DESC=cfg.device_desc, KS=cfg.KS,
            GATED=(2 if cfg.joint else 1) if gated else 0, GELU=gelu,
            **out_flags,
        )  # fmt: skip
        return _Launch(cfg, _mm_tma_kernel, (num_progs,), constexprs, options, (M, N, K), idx)
    grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN),)
    constexprs = dict(
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.group_m, GATED=gated, GELU=gelu, **dot_flags(dtype),
        **out_flags,
    )  # fmt: skip
    return _Launch(cfg, _mm_ptr_kernel, grid, constexprs, options, (M, N, K, K, K, N), idx)


_RUNNER_BROKEN: list[bool] = [os.environ.get("RLEXACT_MATMUL_JIT_LAUNCH", "0") == "1"]
"""True: every launch goes through Triton's JIT dispatch (``RLEXACT_MATMUL_JIT_LAUNCH=1``, or set when a cached
launcher raised, i.e. an incompatible Triton)."""


def _launch(plan: _Launch, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """Launch ``plan`` on contiguous ``x [..., K]``, ``w [N, K]``, ``out [..., N]`` (``M`` rows; same CUDA device,
    or the interpreter). A ``"split"`` plan writes its fp32 partials into a fresh workspace (from the CUDA-graph pool
    during capture) and a second launch sums them into ``out``."""
    if plan.cfg.kernel != "split":
        _launch_kernel(plan, x, w, out)
        return
    M, N, _ = plan.ints
    ws = torch.empty((plan.grid[2], M, N), dtype=torch.float32, device=out.device)
    _launch_kernel(plan, x, w, ws)
    grid, kwargs = plan.sum_launch
    _split_sum_kernel[grid](ws, out, M * N, plan.grid[2], **kwargs, **COMPILE_OPTIONS)


def _launch_kernel(plan: _Launch, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """Launch ``plan``'s kernel with ``out`` as its third argument (the output, or a split plan's workspace), through
    the cached launcher when there is one. Descriptor kernels need 16-byte-aligned bases, so a misaligned operand is
    copied first."""
    cfg = plan.cfg
    px, pw = x.data_ptr(), w.data_ptr()
    if (px | pw) % 16 and cfg.kernel != "ptr":
        x, w = aligned(x), aligned(w)
        px, pw = x.data_ptr(), w.data_ptr()
    runner = plan.runner
    if runner is not None:
        po = out.data_ptr()
        if (px | pw | po) % 16 == 0:
            try:
                if runner(x, w, out, px, pw, po):
                    return
            except LAUNCHER_ERRORS as e:
                _RUNNER_BROKEN[0] = True
                plan.runner = None
                warnings.warn(f"cached Triton launcher unusable ({e!r}); using Triton's JIT dispatch", stacklevel=2)
    M, N, K = plan.ints[:3]
    if cfg.kernel == "tma" and not cfg.device_desc:
        o_block = [cfg.BM, cfg.BN // 2 if cfg.subtile else cfg.BN]
        args = (
            TensorDescriptor.from_tensor(x.view(M, K), [cfg.BM, cfg.BK]),
            TensorDescriptor.from_tensor(w, [cfg.BN, cfg.BK]),
            TensorDescriptor.from_tensor(out.view(M, N), o_block),
        ) + (M, N, K)
    else:
        ensure_allocator()
        args = (x, w, out, *plan.ints)
    try:
        compiled = plan.kernel[plan.grid](*args, **plan.constexprs, **plan.options, **COMPILE_OPTIONS)
    except Exception as e:
        if not plan.constexprs.get("WS"):
            raise
        # the tile without warp specialization (only configurations that ask for it get here; none of the library's)
        _WS_BROKEN.add(cfg)
        warnings.warn(
            f"exact matmul: tile {cfg} failed to compile with warp specialization ({e!r}); running it without, "
            "whose bits may differ from the warp-specialized tile's",
            stacklevel=3,
        )
        plan.constexprs["WS"] = False
        compiled = plan.kernel[plan.grid](*args, **plan.constexprs, **plan.options, **COMPILE_OPTIONS)
    _keep_runner(plan, compiled, x, w, out)


def _keep_runner(plan: _Launch, compiled, *tensors: torch.Tensor) -> None:  # noqa: ANN001
    """Keep a launcher of ``compiled`` for later launches when this launch's specialization is the one every later
    launch of the plan will have (16-byte-aligned pointers; the integers are fixed by the plan's key, M is not
    specialized): :func:`_direct_runner` where this Triton's launcher API is the known one, else
    :func:`_triton_runner`."""
    if _INTERPRET or _RUNNER_BROKEN[0] or not hasattr(compiled, "__getitem__") or plan.runner is not None:
        return
    if any(t.data_ptr() % 16 for t in tensors):
        return
    if not plan.cfg.device_desc and plan.cfg.kernel == "tma":
        return  # host descriptors are rebuilt per call
    names = list(plan.kernel.arg_names)
    n_rt = 3 + len(plan.ints)
    if set(names[n_rt:]) != set(plan.constexprs):
        return
    tail = (*plan.ints, *(plan.constexprs[n] for n in names[n_rt:]))
    grid = (*plan.grid, 1, 1)[:3]  # the launcher reads a 3-D grid
    plan.runner = _direct_runner(plan.device, compiled, grid, tail) or _triton_runner(plan.device, compiled, grid, tail)


def _triton_runner(device: int, compiled, grid: tuple, tail: tuple):  # noqa: ANN001, ANN202
    """``CompiledKernel[grid]`` (Triton's own per-launch path: stream query, launch hooks, scratch from the thread's
    allocator), skipped when the current device is not the plan's (then the JIT dispatch decides, as without a
    cached launcher)."""
    run = compiled[grid]
    get_device = cuda_queries()[0]

    def runner(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *ptrs: int) -> bool:
        if get_device() != device:
            return False
        ensure_allocator()
        run(x, w, out, *tail)
        return True

    return runner


def _direct_runner(device: int, compiled, grid: tuple, tail: tuple):  # noqa: ANN001, ANN202
    """A launcher that calls Triton's C ``launch`` of ``compiled`` itself, or None where
    :func:`~rlexact.ops.triton_shared.direct_launch_ok` does not recognise this Triton (then :func:`_triton_runner`
    is used).

    Per launch it does only what Triton's ``CompiledKernel[grid]`` + ``CudaLauncher`` would do for this kernel with
    no launch hooks installed: read the current stream, take the global scratch (descriptor scratch of
    device-side tensor descriptors) from :func:`_scratch` -- the buffer of the last stream is kept, so an eager
    launch on the same stream costs one capture query -- and call the C launcher with pointers as integers (the
    plan's operands are CUDA tensors of its device, checked by :func:`matmul`). With launch hooks installed
    (``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``, e.g. a profiler) it defers to Triton's own
    runner so the hooks see every launch; when the current device is not the plan's it returns False (the JIT
    dispatch decides)."""
    launcher = compiled.run
    if not direct_launch_ok(launcher) or launcher.profile_scratch_size:
        return None
    c_launch = launcher.launch
    gx, gy, gz = grid
    nbytes = gx * gy * gz * launcher.num_ctas * launcher.global_scratch_size
    function, meta = compiled.function, compiled.packed_metadata
    coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    get_device, raw_stream, capturing = cuda_queries()
    hooked = _triton_runner(device, compiled, grid, tail)
    last = (None, None)  # (stream, scratch buffer) of the previous eager launch

    def runner(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, px: int, pw: int, po: int) -> bool:
        nonlocal last
        if launch_hooks_installed():
            return hooked(x, w, out)
        if get_device() != device:
            return False
        stream = raw_stream(device)
        scratch = None
        if nbytes:
            if capturing():
                scratch = _scratch(nbytes, device, stream)
            elif last[0] == stream:
                scratch = last[1]
            else:
                scratch = _scratch(nbytes, device, stream)
                last = (stream, scratch)
        c_launch(gx, gy, gz, stream, function, coop, pdl, scratch, None, meta, None, None, None, px, pw, po, *tail)
        return True

    return runner


def matmul_with_config(
    x: torch.Tensor, w: torch.Tensor, cfg: MatmulConfig, gated: bool = False, gelu: bool = False
) -> torch.Tensor:
    """Run one explicit configuration (tests and benchmarks). ``x [M, K]``, ``w [N, K]``, same dtype; ``gated``: the
    gated product of :func:`gated_matmul` (``w [2N, K]``, output ``[M, N]``), SiLU or with ``gelu`` GELU (tanh)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    _launch(_plan(M, N, K, x.dtype, x.device, cfg, gated, gelu), x, w, out)
    return out


GATED_VARIANTS: tuple = (
    (16, MatmulConfig("ptr", 16, 32, 128, num_warps=4, num_stages=4)),
    (64, MatmulConfig("ptr", 64, 32, 64, num_warps=4, num_stages=5)),
    (128, MatmulConfig("tma", 128, 64, 128, num_warps=8, num_stages=3)),
    (None, MatmulConfig("tma", 128, 128, 64, num_warps=8, num_stages=3, joint=True)),
)
"""``((max_M or None, config), ...)`` of :func:`gated_matmul` on a GPU where the row-tile variants apply: the row
tiles are free for the same reason as :func:`row_tile_variants`' (each output element's chains do not involve them).
The fastest bitwise-equal candidates of ``benchmarks/results/matmul_gated_h200.json`` (Qwen3-1.7B gated MLP, weights
from HBM) at M = 1 / 16, 64, 128 and 256 / 2,048 / 8,192."""


GLUON_GATED_VARIANTS: tuple = (
    (64, None),
    (128, gluon_matmul.GluonMatmulConfig(64, 64, per_sm=2)),
    (None, gluon_matmul.GluonMatmulConfig(128, 128)),
)
"""``((max_M or None, config or None), ...)``: the row counts at which :func:`gated_matmul` runs the
warp-specialized Gluon kernel (:mod:`rlexact.ops.gluon_matmul`, same bits as the ``tl`` tiles) on an sm_90 GPU, and
its tiles; ``None`` keeps :data:`GATED_VARIANTS`. The fastest bitwise-equal candidates of
``benchmarks/results/gluon_matmul_probe_h200.json`` (the ``tl`` tiles won at 64 rows)."""


def gluon_gated_config(M: int, N: int, K: int, dtype: torch.dtype,
                       device: torch.device) -> gluon_matmul.GluonMatmulConfig | None:  # fmt: skip
    """The Gluon tiles :func:`gated_matmul` runs for ``M`` rows of an ``[M, K] @ [2N, K].T`` gated product, or
    ``None`` where it runs the ``tl`` tiles (no gated kernel for the shape, a GPU other than sm_90, or
    :data:`GLUON_GATED_VARIANTS` keeps them at ``M``)."""
    if not gluon_matmul.supported(device) or gated_config_for(M, N, K, dtype, device) is None:
        return None
    return next(cfg for max_m, cfg in GLUON_GATED_VARIANTS if max_m is None or M <= max_m)


@functools.cache
def gated_supported(N: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`gated_matmul` runs ``[M, K] @ [2N, K].T`` gated products (any M) on ``device``: on Hopper-class
    GPUs with the row-tile variants on, in 16-bit dtypes, for shapes whose products do not split K (elsewhere the
    caller runs the two products and the gate's op)."""
    return USE_ROW_TILE_VARIANTS and tma_ok(2 * N, K, dtype, device) and not chain_splits(N, K, dtype, device)


def gated_config_for(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> MatmulConfig | None:
    """The configuration of :func:`gated_matmul` for ``M`` rows of an ``[M, K] @ [2N, K].T`` gated product, or
    ``None`` where it does not run (:func:`gated_supported`)."""
    if not gated_supported(N, K, dtype, device):
        return None
    return next(cfg for max_m, cfg in GATED_VARIANTS if max_m is None or M <= max_m)


def gated_matmul(x: torch.Tensor, w: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``silu(x @ w[:N].T) * (x @ w[N:].T)`` for ``x [..., K]``, ``w [2N, K]`` (gate rows, then up rows), bitwise
    ``silu_mul(matmul(x, w[:N]), matmul(x, w[N:]))``; with ``gelu`` the GELU (tanh) gate, bitwise ``gelu_tanh_mul``
    of the products. Each tile runs both products' per-element chains, rounds them to ``x.dtype`` as a product's
    output is rounded, and applies the gate's formula (:func:`~rlexact.ops.triton_shared.gate_times`) before its one
    store; at the row counts of :data:`GATED_CUBLAS_ROWS` a verified ``torch.mm`` and the gate's kernel give the same
    bits in two launches. Needs :func:`gated_config_for` to name a configuration (it raises otherwise)."""
    if w.dim() != 2 or w.shape[0] % 2 or x.dim() == 0 or x.size(-1) != w.size(1):
        raise ValueError(f"gated_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not match; expected x [..., K]"
                         " and w [2N, K] (gate rows, then up rows)")  # fmt: skip
    if x.dtype != w.dtype or x.get_device() != w.get_device():
        raise ValueError(f"gated_matmul: x ({x.dtype}, {x.device}) and w ({w.dtype}, {w.device}) differ")
    x, w = x.contiguous(), w.contiguous()
    (N2, K), shape = w.shape, x.shape
    N, M = N2 // 2, math.prod(shape[:-1])
    key = (M, N, K, x.dtype, x.get_device(), "gated", gelu)
    plan = _LAUNCHES.get(key)
    if plan is None:
        cfg = gated_config_for(M, N, K, x.dtype, x.device)
        if cfg is None:
            raise ValueError(f"gated_matmul: no gated kernel for N={N}, K={K}, {x.dtype} on {x.device}; run the two "
                             "products and the gate's op (see gated_config_for)")  # fmt: skip
        if not (M and N and K):
            return matmul_with_config(x.reshape(M, K), w, cfg, gated=True, gelu=gelu).reshape(*shape[:-1], N)
        if len(_LAUNCHES) >= MAX_LAUNCHES:
            _LAUNCHES.clear()
        gluon_cfg = gluon_gated_config(M, N, K, x.dtype, x.device)
        plan = _LAUNCHES[key] = gluon_cfg or _plan(M, N, K, x.dtype, x.device, cfg, gated=True, gelu=gelu)
    if GATED_CUBLAS_ROWS[0] <= M <= GATED_CUBLAS_ROWS[1]:
        y = _gated_through_cublas(x.view(M, K), w, gelu)
        if y is not None:
            return y.view(*shape[:-1], N)
    out = torch.empty((*shape[:-1], N), dtype=x.dtype, device=x.device)
    if isinstance(plan, gluon_matmul.GluonMatmulConfig):
        gluon_matmul.forward(x.view(M, K), w, out.view(M, N), plan, gated=True, gelu=gelu)
    else:
        _launch(plan, x, w, out)
    return out


GATED_CUBLAS_ROWS: tuple[int, int] = (257, 512)
"""``(first, last)`` row counts at which :func:`gated_matmul` runs ``torch.mm`` over all ``2N`` weight rows and then
the gate's kernel on the two halves, where cuBLAS was verified to give the exact bits of that product (the fused
kernel elsewhere, and where it is not verified), with the same bits. Up to 256 rows the one launch is as fast or
faster; above, cuBLAS's product plus the gate's pass is faster (the Qwen3-1.7B MLP on an H100:
``benchmarks/results/matmul_gated_current_h100.json``, ``benchmarks/results/matmul_gated_route_h100.json``)."""


def _gated_through_cublas(x: torch.Tensor, w: torch.Tensor, gelu: bool) -> torch.Tensor | None:
    """``silu_mul`` (``gelu``: ``gelu_tanh_mul``) of the two halves of ``torch.mm(x, w.T)`` for ``x [M, K]``,
    ``w [2N, K]``, where cuBLAS was verified to give :func:`matmul`'s bits for that product; ``None`` elsewhere (not
    eligible, not verified, or operands aligned unlike the probes). The bits are :func:`gated_matmul`'s: its callers
    ensure one chain over all of K for ``N`` columns, the verified product has one for ``2N`` (:func:`cublas_eligible`),
    and a column's chain does not depend on its neighbours."""
    (M, K), N2 = x.shape, w.shape[0]
    y = _mm_where_verified(_matmul_plan(M, N2, K, x), x, w)
    if y is None:
        return None
    gate, up = y.split(N2 // 2, dim=1)
    return gelu_tanh_mul(gate, up) if gelu else silu_mul(gate, up)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w[N, K].T -> [..., N]`` in ``x.dtype``; fp32 accumulation; rows independent of how many rows
    there are (bitwise). The leading dimensions of ``x`` are rows (``[M, K]`` is the usual case).

    Mixed dtypes run the fp32 kernel on upcast copies (products in fp32, as the CPU twin), then cast once. ``x`` and
    ``w`` must be on the same device. A call with a cached plan does: this check, one dictionary lookup, one
    ``torch.empty`` and the launch (:func:`_launch`, or ``torch.mm`` where :func:`cublas_eligible` holds and cuBLAS
    was verified to give the same bits).
    """
    if w.dim() != 2 or x.dim() == 0 or x.size(-1) != w.size(1):
        raise ValueError(
            f"matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not match; expected x [..., K] and w [N, K]"
        )
    dtype = x.dtype
    if dtype != w.dtype or dtype not in TL_DTYPE:
        return matmul(x.float(), w.float()).to(dtype)
    dev = x.get_device()
    if w.get_device() != dev:
        raise ValueError(f"matmul: x is on {x.device} but w is on {w.device}; move both to one device")
    if not x.is_contiguous():
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    N, K = w.shape
    shape = x.shape
    if len(shape) == 2:
        M = shape[0]
        out_shape = (M, N)
    else:
        M = math.prod(shape[:-1])
        out_shape = (*shape[:-1], N)
    plan = _LAUNCHES.get((M, N, K, dtype, dev))
    if plan is None:
        if not (M and N and K):
            return torch.zeros(out_shape, dtype=dtype, device=x.device)
        plan = _matmul_plan(M, N, K, x)
    out = torch.empty(out_shape, dtype=dtype, device=x.device)
    if _mm_where_verified(plan, x, w, out) is None:
        _launch(plan, x, w, out)
    return out


def _mm_where_verified(
    plan: _Launch, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``torch.mm`` of contiguous ``x [..., K]`` and ``w [N, K]`` into ``out [..., N]`` (None: a new ``[M, N]``, made
    only once cuBLAS is known to run) where cuBLAS was verified to give ``plan``'s bits and the operands are aligned
    like the probes, returning ``out``; ``None`` (nothing run) elsewhere."""
    if plan.cublas is None or not _cublas_verified(plan, w) or not cublas_verify.aligned_like_probe(x, w):
        return None
    N, K = w.shape
    if out is None:
        out = torch.empty(x.numel() // K, N, dtype=x.dtype, device=x.device)
    if not cublas_verify.aligned_like_probe(out):
        return None
    torch.mm(x.view(-1, K), w.t(), out=out.view(-1, N))
    return out


def _matmul_plan(M: int, N: int, K: int, x: torch.Tensor) -> _Launch:
    """The cached plan of :func:`matmul` for a non-empty ``[M, K] @ [N, K].T`` product of ``x``'s dtype on its device
    (made on first use)."""
    dtype, device = x.dtype, x.device
    key = (M, N, K, dtype, x.get_device())
    plan = _LAUNCHES.get(key)
    if plan is None:
        if len(_LAUNCHES) >= MAX_LAUNCHES:
            _LAUNCHES.clear()
        plan = _LAUNCHES[key] = _plan(M, N, K, dtype, device, config_for(M, N, K, dtype, device))
        if cublas_eligible(M, dtype, device, plan.cfg):
            plan.cublas = {}
    return plan


USE_CUBLAS = os.environ.get("RLEXACT_MATMUL_CUBLAS", "1") != "0"
"""Let :func:`matmul` run cuBLAS where it was verified to give the exact bits (``RLEXACT_MATMUL_CUBLAS=0``: never)."""
CUBLAS_MAX_M = 512
"""Most rows a product may have for :func:`matmul` to try cuBLAS: the decode and small-batch row counts, where
cuBLAS's kernels are faster than the library's tiles (``benchmarks/results/cublas_bitwise_probe_h200.json``); each
row count is verified once."""


def cublas_eligible(M: int, dtype: torch.dtype, device: torch.device, cfg: MatmulConfig) -> bool:
    """Whether :func:`matmul` checks cuBLAS for an ``M``-row product of ``cfg``: 16-bit operands on a CUDA GPU (not
    the interpreter), at most :data:`CUBLAS_MAX_M` rows, and one chain over all of K (cuBLAS does not split K at
    the library's fixed columns; ``"split"`` configurations always set ``KS``)."""
    return (
        USE_CUBLAS
        and not _INTERPRET
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and M <= CUBLAS_MAX_M
        and not cfg.KS
    )


def _cublas_verified(plan: _Launch, w: torch.Tensor) -> bool:
    """Whether ``torch.mm`` gives ``plan``'s bits under the current settings: checked on the first call outside
    CUDA-graph capture (a call during capture runs the library's kernel and leaves the check to a later call)."""
    key = cublas_verify.settings()
    verdict = plan.cublas.get(key)
    if verdict is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        M, N, K = plan.ints[:3]
        verdict = plan.cublas[key] = cublas_verify.same_bits(lambda x, wt: _exact(plan, x, wt), M, N, K, w.dtype,
                                                             w.device)  # fmt: skip
    return verdict


def _exact(plan: _Launch, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``plan``'s kernel on ``x [M, K]``, ``w [N, K]`` into a new ``[M, N]``."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _launch(plan, x, w, out)
    return out
