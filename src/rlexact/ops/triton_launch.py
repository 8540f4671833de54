"""Kernel launches through cached launchers: Triton's JIT dispatch once per specialization, the compiled kernel's own
launcher afterwards.

A launch through ``kernel[grid](*args, **kwargs)`` costs tens of microseconds of host time (binding, specialization,
the cache key, launch metadata), which bounds the trainer's micro-batches and the generator's eager steps, whose
kernels are short. :func:`launch` does the same launch and keeps, per specialization, the compiled kernel that
Triton's dispatch returned; later launches with the same key call ``CompiledKernel.run`` on the current stream
directly, which is the last thing Triton's dispatch does.

The key is at least as fine as Triton's specialization (``native_specialize_impl``), so equal keys select the same
compiled kernel: the kernel, the device, every launch option, every constexpr's value, and for every other argument
a class that determines its specialization: a tensor's dtype and whether its address is 16-byte aligned; an
integer's equality to 1, divisibility by 16 and integer type range; the type of a float, bool or ``None``; a host
tensor descriptor's type, base dtype and alignment, block shape, layout, padding and the classes of its shape and
strides. An argument of any other kind (a tuple, a device-side object) keeps that launch on Triton's dispatch. So do the
interpreter, launch hooks (e.g. a profiler, so it sees the launch), a current device other than the arguments',
``RLEXACT_JIT_LAUNCH=1``, and a launcher whose API :func:`rlexact.ops.triton_shared.direct_launch_ok` does not
recognise. A cached launcher that raises switches every later launch to the dispatch, with a warning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from .backend import interpreter_enabled
from .triton_shared import LAUNCHER_ERRORS, cuda_queries, direct_launch_ok, launch_hooks_installed

__all__ = ["UncachedLaunch", "launch", "launcher_count", "specialization_key", "value_class"]

_INTERPRET = interpreter_enabled()
_DIRECT = [os.environ.get("RLEXACT_JIT_LAUNCH", "0") != "1"]
"""False: every launch goes through Triton's JIT dispatch (``RLEXACT_JIT_LAUNCH=1``, or a cached launcher raised)."""
_LAUNCHERS: dict = {}
"""Specialization key -> ``(CompiledKernel.run, function, packed metadata)``."""
_SIGNATURES: dict = {}
"""JIT function -> ``(parameter names, name -> index, constexpr flags, defaults)``."""
_NO_DEFAULT = object()
_INT32 = (-(2**31), 2**31)


class UncachedLaunch(Exception):
    """An argument whose specialization the key does not model: the launch goes through Triton's dispatch."""


def _signature(kernel: object) -> tuple:
    sig = _SIGNATURES.get(kernel)
    if sig is None:
        params = getattr(kernel, "params", None)
        if params is None:  # not a JIT function (a stand-in): its own ``[grid]`` launches it
            raise UncachedLaunch
        names = tuple(p.name for p in params)
        defaults = tuple(p.default if p.has_default else _NO_DEFAULT for p in params)
        sig = _SIGNATURES[kernel] = (names, {n: i for i, n in enumerate(names)}, tuple(p.is_constexpr for p in params),
                                     defaults)  # fmt: skip
    return sig


def _int_class(v: int) -> tuple:
    return ("i", v == 1, v % 16 == 0, _INT32[0] <= v < _INT32[1], v < 2**63)


def value_class(v: object) -> tuple:
    """The class of a non-constexpr argument in the key: arguments of one class get the same specialization from
    Triton (module docstring). Raises :class:`UncachedLaunch` for kinds of argument it does not model."""
    if isinstance(v, torch.Tensor):
        return ("t", v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b",)
    if isinstance(v, int):
        return _int_class(v)
    if isinstance(v, float):
        return ("f",)
    if v is None:
        return ("n",)
    base = getattr(v, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(v, "block_shape"):  # a host tensor descriptor (tl or Gluon)
        dims = tuple(_int_class(int(x)) for x in (*v.shape, *v.strides))
        layout = getattr(v, "layout", None)
        padding = getattr(v, "padding", None)
        return ("d", type(v), base.dtype, base.data_ptr() % 16 == 0, tuple(v.block_shape), layout, padding, dims)
    raise UncachedLaunch


def specialization_key(kernel: object, args: tuple, kwargs: dict) -> tuple[tuple, list, int]:
    """``(key, values, device)`` of ``kernel[grid](*args, **kwargs)``: the cache key, every parameter's value in
    signature order (defaults filled in; what the compiled kernel's launcher takes) and the device index of the first
    tensor argument (-1 on the CPU). Raises :class:`UncachedLaunch` where the launch must go through Triton's
    dispatch (no tensor argument, a missing argument, an argument :func:`value_class` does not model)."""
    names, index, constexpr, defaults = _signature(kernel)
    values = list(args) + [_NO_DEFAULT] * (len(names) - len(args))
    options = []
    for name, v in kwargs.items():
        i = index.get(name)
        if i is None:
            options.append((name, v))
        else:
            values[i] = v
    spec = []
    device = None
    for i, v in enumerate(values):
        if v is _NO_DEFAULT:
            v = values[i] = defaults[i]
            if v is _NO_DEFAULT:
                raise UncachedLaunch  # a missing argument: the dispatch raises its own error
        if constexpr[i]:
            spec.append(v)
            continue
        spec.append(value_class(v))
        if device is None:
            t = v if isinstance(v, torch.Tensor) else getattr(v, "base", None)
            device = t.get_device() if isinstance(t, torch.Tensor) else None
    if device is None:
        raise UncachedLaunch
    return (kernel, device, tuple(spec), tuple(options)), values, device


def launch(kernel: object, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)`` (a ``triton.jit`` or ``gluon.jit`` function, a grid of one to three
    integers), through the cached launcher of its specialization where there is one (module docstring)."""
    if _INTERPRET or not _DIRECT[0]:
        kernel[grid](*args, **kwargs)
        return
    try:
        key, values, device = specialization_key(kernel, args, kwargs)
        entry = _LAUNCHERS.get(key)
    except (UncachedLaunch, TypeError):  # TypeError: an unhashable constexpr or option
        key = None
    if key is None or device < 0:
        kernel[grid](*args, **kwargs)
        return
    if entry is not None and not launch_hooks_installed():
        get_device, raw_stream, _ = cuda_queries()
        if get_device() == device:
            run, function, meta = entry
            g = (*grid, 1, 1)
            try:
                run(g[0], g[1], g[2], raw_stream(device), function, meta, None, None, None, *values)
                return
            except LAUNCHER_ERRORS as e:
                _DIRECT[0] = False
                warnings.warn(f"cached Triton launcher unusable ({e!r}); using Triton's JIT dispatch", stacklevel=2)
    compiled = kernel[grid](*args, **kwargs)
    run = getattr(compiled, "run", None)
    if _DIRECT[0] and direct_launch_ok(run):
        _LAUNCHERS[key] = (run, compiled.function, compiled.packed_metadata)


def launcher_count(kernel: Callable | None = None) -> int:
    """Cached launchers kept (of ``kernel``, or of every kernel): for tests."""
    return sum(1 for k in _LAUNCHERS if kernel is None or k[0] is kernel)
