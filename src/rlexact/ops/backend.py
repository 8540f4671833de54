"""Backend selection for the exact ops.

Every exact op has two implementations with the same semantics: a Triton kernel (CUDA, or the Triton interpreter on
CPU when ``TRITON_INTERPRET=1``) and a batch-invariant torch twin (CPU). The backend is chosen per call from the input
device unless the caller passes ``backend=`` explicitly; there is no global switch.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["torch", "triton"]
BACKENDS: tuple[str, ...] = ("torch", "triton")


def triton_available() -> bool:
    """True when the ``triton`` package imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(t: torch.Tensor, backend: str | None) -> Backend:
    """Pick the backend for an op whose main input is ``t``.

    ``None`` means: Triton on CUDA tensors, the torch twin on CPU tensors. ``"triton"`` on a CPU tensor requires the
    Triton interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported).
    """
    if backend is None:
        return "triton" if t.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install 'rlexact[gpu]')")
        if not t.is_cuda and not interpreter_enabled():
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
    return backend  # type: ignore[return-value]
