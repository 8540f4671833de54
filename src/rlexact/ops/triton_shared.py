"""Helpers the Triton launchers and kernels share: dtype mapping and rounding flags, device properties, TMA
availability, the grouped tile order, the output cast and the SiLU and GELU-tanh gates' formulas."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .backend import interpreter_enabled

__all__ = [
    "COMPILE_OPTIONS",
    "HAS_WS",
    "LAUNCHER_ERRORS",
    "TL_DTYPE",
    "TensorDescriptor",
    "aligned",
    "cast_out",
    "cuda_props",
    "cuda_queries",
    "device_key",
    "direct_launch_ok",
    "dot_flags",
    "launch_hooks_installed",
    "num_sms",
    "rne_fix",
    "silu_times",
    "tile_coords",
    "tma_ok",
]

try:  # triton >= 3.3: host-side tensor descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old triton
    TensorDescriptor = None


_INTERPRET = interpreter_enabled()
COMPILE_OPTIONS: Mapping[str, bool] = MappingProxyType({"enable_fp_fusion": True})
"""Compile options every exact kernel is launched with (spread into each launch; read-only). ``enable_fp_fusion``
lets the compiler contract a multiply and an add into one FMA, as every Triton up to 3.9 does by default and as the
GPU exactness tests and benchmarks were run; Triton 3.10 turns that default off. Pinned here so the machine code,
and with it the bits every result in ``benchmarks/results`` records, do not change with the installed Triton. The
operations whose rounding the bit contract names are explicit ``fma`` calls either way (docs/design.md §2)."""
HAS_WS = "warp_specialize" in inspect.signature(tl.range.__init__).parameters
"""Whether ``tl.range`` takes ``warp_specialize`` (Triton >= 3.4): also the gate of the TMA kernels."""

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
"""torch -> Triton dtype of the kernels' inputs/outputs (shared by every launcher)."""


def rne_fix(out_dtype: torch.dtype) -> bool:
    """The ``RNE_FIX`` flag of :func:`cast_out` for an output dtype: only the interpreter's fp32 -> bf16 truncates."""
    return _INTERPRET and out_dtype == torch.bfloat16


def dot_flags(dtype: torch.dtype) -> dict[str, bool]:
    """``UPCAST`` / ``IEEE`` constexprs of the pointer-path ``tl.dot`` for inputs of ``dtype`` (matmul and lm head):
    fp32 dots are ``ieee``; under the interpreter 16-bit operands are upcast to fp32 (its 16-bit dot is unreliable)."""
    return {"UPCAST": _INTERPRET and dtype != torch.float32, "IEEE": dtype == torch.float32 or _INTERPRET}


def device_key(device: torch.device) -> tuple:
    """``("cuda", index)`` of a CUDA device, ``("interp",)`` of any other (the Triton interpreter)."""
    if device.type != "cuda":
        return ("interp",)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return ("cuda", idx)


@functools.cache
def cuda_props(idx: int) -> tuple[int, int]:
    """``(compute capability major, SM count)`` of CUDA device ``idx``."""
    p = torch.cuda.get_device_properties(idx)
    return (p.major, p.multi_processor_count)


def cuda_queries() -> tuple:
    """``(current device, current raw stream of a device, is the current stream capturing)`` as torch's C functions
    (the per-launch queries of the cached launchers; CUDA builds of torch only)."""
    c = torch._C
    return c._cuda_getDevice, c._cuda_getCurrentRawStream, c._cuda_isCurrentStreamCapturing


def stream_buffer(cache: dict[tuple[int, int], torch.Tensor], device: int, stream: int, numel: int,
                  make: Callable[[int, torch.device], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """A tensor of at least ``numel`` elements, ``make(numel, device)``, for launches on raw ``stream`` of CUDA device
    ``device``. Kernels on one stream run in order, so launches on the same stream share one tensor: kept in ``cache``
    per device and stream and made again when too small. During CUDA-graph capture a fresh tensor comes from the
    graph's private pool instead, so a replay never shares it with an eager launch on another stream. Use it only for
    a buffer that each launch reads after writing it, or leaves as it found it."""
    if torch.cuda.is_current_stream_capturing():
        return make(numel, torch.device("cuda", device))
    buf = cache.get((device, stream))
    if buf is None or buf.numel() < numel:
        buf = cache[(device, stream)] = make(numel, torch.device("cuda", device))
    return buf


def direct_launch_ok(launcher) -> bool:  # noqa: ANN001
    """True when ``launcher`` (``CompiledKernel.run``) is the CUDA launcher whose call the cached launchers
    reproduce: Triton 3.6's ``CudaLauncher``, ``__call__(gridX, gridY, gridZ, stream, function, *args)`` allocating
    global and profile scratch and then calling the C ``launch(gridX, gridY, gridZ, stream, function, cooperative,
    pdl, global_scratch, profile_scratch, kernel_metadata, launch_metadata, enter_hook, exit_hook, *kernel_args)``
    (argument formats ``iiiKKppOOOOOO``)."""
    try:
        from triton.backends.nvidia import driver as nv
    except ImportError:  # pragma: no cover - no CUDA backend
        return False
    if getattr(nv, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO" or type(launcher) is not nv.CudaLauncher:
        return False
    params = list(inspect.signature(nv.CudaLauncher.__call__).parameters)
    return params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"] and hasattr(
        getattr(triton, "knobs", None), "runtime"
    )


LAUNCHER_ERRORS = (TypeError, IndexError, AttributeError, ValueError)
"""What a cached launcher raises when this Triton's launcher API is not the one it was written for."""


def launch_hooks_installed() -> bool:
    """Whether Triton's launch enter/exit hooks are set (e.g. by a profiler): then launches go through Triton's own
    dispatch, which calls them, instead of a cached launcher."""
    rt = triton.knobs.runtime
    chain = getattr(triton.knobs, "HookChain", ())
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is not None and (type(enter) is not chain or bool(enter.calls))) or (
        leave is not None and (type(leave) is not chain or bool(leave.calls))
    )


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the Triton interpreter)."""
    key = device_key(device)
    return 4 if key[0] == "interp" else cuda_props(key[1])[1]


def tma_ok(N: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``[M, K] @ [N, K].T`` in ``dtype`` on ``device`` can run the TMA kernels (Hopper or newer, 16-bit,
    16-byte aligned rows, a Triton with descriptors and ``warp_specialize``)."""
    key = device_key(device)
    if key[0] != "cuda" or TensorDescriptor is None or not HAS_WS:
        return False
    if cuda_props(key[1])[0] < 9 or dtype not in (torch.bfloat16, torch.float16):
        return False
    return (K * dtype.itemsize) % 16 == 0 and (N * dtype.itemsize) % 16 == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when its data is not 16-byte aligned (what TMA descriptors need)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


@triton.jit
def cast_out(x, DTYPE: tl.constexpr, RNE_FIX: tl.constexpr):
    """``x.to(DTYPE)`` with round-to-nearest-even. ``RNE_FIX``: the Triton interpreter truncates fp32 -> bf16, so
    round the fp32 bits to bf16 precision first (NaN payloads aside); on GPUs the conversion is RNE already."""
    if RNE_FIX:
        u = x.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        x = ((u >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def normed_row(x, r, X_DTYPE: tl.constexpr, RNE_X: tl.constexpr, ROUND_NORMED: tl.constexpr):
    """The normalized row ``x * r`` in fp32, rounded to the input dtype first when ``ROUND_NORMED``."""
    y = x * r
    if ROUND_NORMED:
        y = cast_out(y, X_DTYPE, RNE_X).to(tl.float32)
    return y


@triton.jit
def norm_scale(w_ptr, idx, mask, OFFSET: tl.constexpr):
    """The scale of elements ``idx`` in fp32: ``w``, or with ``OFFSET`` ``1 + w`` added in fp32 (Gemma's)."""
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    return w


@triton.jit
def silu_times(g, u):
    """``silu(g) * u`` in fp32, ``silu(g) = g / (1 + exp(-g))`` with the GPU's fast division (``div.full.f32``): the
    one formula of the exact SiLU gate (the ``silu_mul`` kernel and the gated matmuls' epilogues use it, so they share
    its bits). A correctly rounded division takes a slow-path branch wherever ``1 + exp(-g)`` is huge (very
    negative gates), so a gated launch's time would depend on its data (docs/design.md §2.2); the fast division is
    branch-free."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def gelu_tanh_arg(g):
    """``z = 2 sqrt(2 / pi) (g + 0.044715 g^3)``: ``gelu_tanh(g) = g * sigmoid(z)``, since
    ``0.5 (1 + tanh(y)) = sigmoid(2 y)`` (the forward's and the backward's one argument)."""
    return 1.5957691216057308 * (g + 0.044715 * (g * g * g))


@triton.jit
def gelu_tanh_arg_grad(g):
    """``dz/dg`` of :func:`gelu_tanh_arg`: ``2 sqrt(2 / pi) (1 + 3 * 0.044715 g^2)``."""
    return 1.5957691216057308 * (1.0 + 0.134145 * (g * g))


@triton.jit
def gelu_tanh_times(g, u):
    """``gelu_tanh(g) * u`` in fp32 (transformers' ``gelu_pytorch_tanh``): ``g * sigmoid(gelu_tanh_arg(g)) * u``,
    computed as :func:`silu_times` is, with the same fast division."""
    return g / (1.0 + tl.exp(-gelu_tanh_arg(g))) * u


@triton.jit
def gate_times(g, u, GELU: tl.constexpr):
    """:func:`gelu_tanh_times` with ``GELU``, else :func:`silu_times`."""
    if GELU:
        out = gelu_tanh_times(g, u)
    else:
        out = silu_times(g, u)
    return out


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) tile order; any order gives the same bits, it only affects speed."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n
