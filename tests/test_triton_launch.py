"""The cached kernel launcher (``rlexact.ops.triton_launch``), on the CPU.

* the key's argument classes refine Triton's own specialization (``native_specialize_impl``): two arguments of one
  class always get the same specialization, so a cached launcher never runs a kernel compiled for other arguments;
* the values handed to a cached launcher are every parameter in signature order, defaults filled in, as Triton's
  dispatch passes them;
* ``launch`` with a stub kernel and launcher: the first launch of a key goes through the dispatch, later ones through
  the cached launcher, and launch hooks, another device, another key or the switch send it back to the dispatch.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _values() -> list:
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**63 - 16, 2**63,
            -(2**31), -(2**31) - 16, -(2**40)]  # fmt: skip
    buf = torch.zeros(64, dtype=torch.float32)
    tensors = [buf, buf[1:], buf[4:], buf.to(torch.bfloat16), buf.to(torch.bfloat16)[8:], buf.to(torch.bfloat16)[3:],
               buf.to(torch.int32), buf.to(torch.int64)[1:]]  # fmt: skip
    return [*ints, *tensors, 0.5, 1.0, -2.0, True, False, None]


@needs_triton
def test_value_classes_refine_tritons_specialization() -> None:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from rlexact.ops.triton_launch import value_class

    def spec(v: object) -> tuple:
        return native_specialize_impl(BaseBackend, v, False, True, True)

    values = _values()
    for a, b in itertools.product(values, repeat=2):
        if value_class(a) == value_class(b):
            assert spec(a) == spec(b), (a, b)
    # the classes are not all one: the test can fail
    assert len({value_class(v) for v in values}) > 10
    assert spec(16) != spec(17) and value_class(16) != value_class(17)


@needs_triton
def test_specialization_key_binds_like_the_dispatch() -> None:
    import inspect

    import triton
    import triton.language as tl

    from rlexact.ops.triton_launch import UncachedLaunch, specialization_key

    @triton.jit
    def kern(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False, extra=3):
        pass

    x, y = torch.zeros(8), torch.zeros(8)
    calls = [((x, y, 5, 0.5), {"BLOCK": 64, "num_warps": 4}), ((x,), {"y_ptr": y, "n": 16, "scale": 2.0, "BLOCK": 32,
             "FLAG": True, "extra": 1})]  # fmt: skip
    for args, kwargs in calls:
        key, values, device = specialization_key(kern, args, kwargs)
        params = {k: v for k, v in kwargs.items() if k != "num_warps"}
        bound = inspect.signature(kern.fn).bind(*args, **params)
        bound.apply_defaults()
        assert values == list(bound.arguments.values())
        assert device == -1 and key[0] is kern
    k1 = specialization_key(kern, *calls[0])[0]
    assert specialization_key(kern, (x, y, 21, 0.25), {"BLOCK": 64, "num_warps": 4})[0] == k1  # same classes
    assert specialization_key(kern, (x, y, 16, 0.5), {"BLOCK": 64, "num_warps": 4})[0] != k1  # n % 16
    assert specialization_key(kern, (x, y, 5, 0.5), {"BLOCK": 32, "num_warps": 4})[0] != k1  # a constexpr
    assert specialization_key(kern, (x, y, 5, 0.5), {"BLOCK": 64, "num_warps": 8})[0] != k1  # an option
    assert specialization_key(kern, (x[1:], y, 5, 0.5), {"BLOCK": 64, "num_warps": 4})[0] != k1  # alignment
    with pytest.raises(UncachedLaunch):
        specialization_key(kern, (x, y, (1, 2), 0.5), {"BLOCK": 64})  # a tuple: not modelled
    with pytest.raises(UncachedLaunch):
        specialization_key(kern, (x, y, 5), {"BLOCK": 64})  # a missing argument: the dispatch reports it


class _Param:
    def __init__(self, name: str, constexpr: bool = False) -> None:
        self.name, self.is_constexpr, self.has_default, self.default = name, constexpr, False, None


class _StubKernel:
    """A JIT function's launch surface: ``kernel[grid](*args, **kwargs)`` returns a compiled kernel whose ``run``
    records its launches."""

    def __init__(self) -> None:
        self.params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK", constexpr=True)]
        self.dispatched: list = []
        self.ran: list = []
        self.compiled = type("Compiled", (), {})()
        self.compiled.run = lambda *a: self.ran.append(a)
        self.compiled.function, self.compiled.packed_metadata = "fn", "meta"

    def __getitem__(self, grid: tuple):
        def call(*args: object, **kwargs: object) -> object:
            self.dispatched.append((grid, args, kwargs))
            return self.compiled

        return call


class _OnGpu0(torch.Tensor):
    def get_device(self) -> int:  # noqa: D102
        return 0


@needs_triton
def test_launch_caches_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlexact.ops import triton_launch as tl_launch

    hooks = [False]
    device = [0]
    monkeypatch.setattr(tl_launch, "_LAUNCHERS", {})
    monkeypatch.setattr(tl_launch, "_INTERPRET", False)
    monkeypatch.setattr(tl_launch, "_DIRECT", [True])
    monkeypatch.setattr(tl_launch, "direct_launch_ok", lambda run: True)
    monkeypatch.setattr(tl_launch, "launch_hooks_installed", lambda: hooks[0])
    monkeypatch.setattr(tl_launch, "cuda_queries", lambda: (lambda: device[0], lambda d: 1234, lambda: False))
    kern = _StubKernel()
    x = torch.Tensor._make_subclass(_OnGpu0, torch.zeros(8))

    tl_launch.launch(kern, (3,), x, 5, BLOCK=64, num_warps=4)
    assert len(kern.dispatched) == 1 and not kern.ran and tl_launch.launcher_count(kern) == 1
    tl_launch.launch(kern, (3,), x, 21, BLOCK=64, num_warps=4)  # same key: the cached launcher
    assert len(kern.dispatched) == 1 and kern.ran == [(3, 1, 1, 1234, "fn", "meta", None, None, None, x, 21, 64)]
    tl_launch.launch(kern, (2, 5), x, 16, BLOCK=64, num_warps=4)  # n % 16 == 0: another key, dispatched
    assert len(kern.dispatched) == 2 and tl_launch.launcher_count(kern) == 2
    hooks[0] = True  # a profiler's hooks see every launch
    tl_launch.launch(kern, (3,), x, 5, BLOCK=64, num_warps=4)
    assert len(kern.dispatched) == 3 and len(kern.ran) == 1
    hooks[0], device[0] = False, 1  # another current device: the dispatch decides
    tl_launch.launch(kern, (3,), x, 5, BLOCK=64, num_warps=4)
    assert len(kern.dispatched) == 4 and len(kern.ran) == 1
    device[0] = 0
    monkeypatch.setattr(tl_launch, "_DIRECT", [False])  # RLEXACT_JIT_LAUNCH=1
    tl_launch.launch(kern, (3,), x, 5, BLOCK=64, num_warps=4)
    assert len(kern.dispatched) == 5 and len(kern.ran) == 1


@needs_triton
def test_launcher_that_raises_switches_to_the_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlexact.ops import triton_launch as tl_launch

    monkeypatch.setattr(tl_launch, "_LAUNCHERS", {})
    monkeypatch.setattr(tl_launch, "_INTERPRET", False)
    monkeypatch.setattr(tl_launch, "_DIRECT", [True])
    monkeypatch.setattr(tl_launch, "direct_launch_ok", lambda run: True)
    monkeypatch.setattr(tl_launch, "launch_hooks_installed", lambda: False)
    monkeypatch.setattr(tl_launch, "cuda_queries", lambda: (lambda: 0, lambda d: 1, lambda: False))
    kern = _StubKernel()

    def broken(*a: object) -> None:
        raise TypeError("launcher API changed")

    kern.compiled.run = broken
    x = torch.Tensor._make_subclass(_OnGpu0, torch.zeros(8))
    tl_launch.launch(kern, (1,), x, 5, BLOCK=64)
    with pytest.warns(UserWarning, match="cached Triton launcher unusable"):
        tl_launch.launch(kern, (1,), x, 5, BLOCK=64)
    assert len(kern.dispatched) == 2 and tl_launch._DIRECT == [False]


@needs_triton
def test_stand_in_kernels_are_dispatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """An object that is not a JIT function (a test's recorder) is launched through its own ``[grid]``."""
    from rlexact.ops import triton_launch as tl_launch

    monkeypatch.setattr(tl_launch, "_INTERPRET", False)
    monkeypatch.setattr(tl_launch, "_DIRECT", [True])
    calls = []

    class Recorder:
        def __getitem__(self, grid: tuple):
            return lambda *a, **k: calls.append((grid, a, k))

    x = torch.Tensor._make_subclass(_OnGpu0, torch.zeros(8))
    tl_launch.launch(Recorder(), (2,), x, 3, BLOCK=16)
    assert calls == [((2,), (x, 3), {"BLOCK": 16})]
