"""Whether cuBLAS computes the exact matmul's bits for one product shape, checked on the GPU before it is used.

The exact chain of a product without fixed K splits (:mod:`rlexact.ops.triton_matmul`) is the one a GEMM kernel
gets when it keeps one fp32 accumulator per output element and issues the tensor core's k16 steps in ascending K:
no split-K, no stream-K, no second accumulator. Whether the kernel cuBLAS picks for ``(M, N, K)`` does that is a
property of that pick (shape, alignment, settings), not of the values, so it is checked, never assumed:
:func:`same_bits` runs ``torch.mm`` and the exact kernel on probe operands of the shape and compares them bitwise.

Random operands alone would rarely show another order: a 16-bit output keeps 8 or 11 of the fp32 sum's 24 bits.
So every output of a probe carries a cancelling pair: column ``a`` of ``x`` and of ``w`` holds ``+B`` and ``1``,
column ``b > a`` holds ``+B`` and ``-1``, with ``B`` large. The running sum is near ``B`` from column ``a`` to
column ``b``, so every product in between is rounded to a coarse grid that depends on what was summed before it,
and ``-B`` then exposes those roundings in the output. A chain that splits, regroups or reorders the columns
between ``a`` and ``b`` gives other outputs; each probe places the pair elsewhere.

cuBLAS picks its kernel from the shape, the operands' alignment and the user's reduced-precision settings
(:func:`settings`), so the caller keys a verdict by the shape and the settings and uses cuBLAS only for operands
aligned like the probes (:func:`aligned_like_probe`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["PROBES", "aligned_like_probe", "same_bits", "settings"]

PROBES = 3
"""Probe inputs per verdict."""
ALIGNMENT = 256
"""Byte alignment of every operand cuBLAS gets (the probes' alignment; PyTorch reports alignment up to this to
cuBLAS's kernel selection)."""


def settings() -> tuple:
    """The PyTorch settings that can change which kernel cuBLAS runs for a 16-bit product: the reduced-precision,
    split-K and fp16-accumulation switches (those this PyTorch has) and the preferred BLAS library. (The workspace
    size, the other input of cuBLAS's choice, is read from the environment once per process.) Called on every
    eligible matmul, so it reads each switch through the getter PyTorch's own attribute calls."""
    return tuple(get() for get in _GETTERS)


def _getter(fast: str, public: str) -> Callable[[], object]:
    """``torch._C.<fast>`` where this PyTorch has it (what ``torch.backends.cuda.matmul.<public>`` returns, without
    the attribute lookup's cost), else the public attribute, or ``None`` where neither exists."""
    get = getattr(torch._C, fast, None)
    if get is not None:
        return get
    return lambda: getattr(torch.backends.cuda.matmul, public, None)


_GETTERS = (
    _getter("_get_cublas_allow_bf16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"),
    _getter("_get_cublas_allow_fp16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"),
    _getter("_get_cublas_allow_fp16_accumulation", "allow_fp16_accumulation"),
    getattr(torch._C, "_get_blas_preferred_backend", None) or torch.backends.cuda.preferred_blas_library,
)


def aligned_like_probe(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts at an :data:`ALIGNMENT`-byte boundary, as the probes do."""
    return all(t.data_ptr() % ALIGNMENT == 0 for t in tensors)


def same_bits(exact: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], m: int, n: int, k: int,
              dtype: torch.dtype, device: torch.device) -> bool:  # fmt: skip
    """Whether ``torch.mm(x, w.T, out=out)`` (the call the library makes) equals ``exact(x, w)`` bitwise on
    :data:`PROBES` probe operands ``x [m, k]``, ``w [n, k]`` (contiguous, fresh, so aligned like every operand cuBLAS
    gets). Synchronizes with the device; call outside CUDA-graph capture."""
    if k < 3:
        raise ValueError(f"same_bits: K = {k}; the probes need at least 3 columns")
    gen = torch.Generator(device=device).manual_seed(m * 31 + n * 7 + k)
    big = 2.0 ** (11 if dtype == torch.float16 else 20)
    pairs = ((0, k - 1), (k // 3, (2 * k) // 3 + 1), (1, min(k - 1, 37)))
    for a, b in pairs[:PROBES]:
        x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        w = torch.randn(n, k, device=device, dtype=dtype, generator=gen).mul_(k**-0.5)
        x[:, a], x[:, b], w[:, a], w[:, b] = big, big, 1.0, -1.0
        out = torch.empty(m, n, device=device, dtype=dtype)
        if not torch.equal(torch.mm(x, w.t(), out=out), exact(x, w)):
            return False
    return True
