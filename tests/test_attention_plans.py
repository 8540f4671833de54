"""Kept launch plans of the packed Gluon attention forward (``triton_attention._planned_launch``), on CPU: the
Gluon dispatch is taken with its GPU checks stubbed, and the compiled launcher is a recorder. A planned launch must
pass the cached launcher exactly the kernel, grid and arguments the unplanned path (``cfg={}``: every decision made
again) passes for the same inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlexact.ops import gluon_attention as ga
from rlexact.ops import triton_attention as ta

HQ, HKV, D = 16, 8, 128
SCALE = D**-0.5

pytestmark = pytest.mark.skipif(ga.gluon is None, reason="needs a Triton with Gluon's Hopper language")


class _Recorder:
    """A compiled kernel's launcher that records each launch: the kernel, the grid and the arguments."""

    global_scratch_size = 0

    def __init__(self, kernel: object, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __call__(self, grid_x: int, grid_y: int, grid_z: int, stream: int, function: object, *args: object) -> None:
        self.launches.append((self.kernel, (grid_x, grid_y, grid_z), args[4:]))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """The recorded launches (a compiling launch's arguments as ``("compiled",)``); Gluon's packed dispatch on CPU
    tensors, empty launcher and plan tables."""
    recorded: list = []

    def jit_launch(kernel: object, grid: tuple, args: tuple, kwargs: dict) -> object:
        recorded.append((kernel, (*grid, 1), ("compiled",)))
        return type("Compiled", (), {"run": _Recorder(kernel, recorded), "function": 0, "packed_metadata": None})

    monkeypatch.setattr(ga, "supported", lambda q, k, v, block_n: block_n == ga.BLOCK_N)
    monkeypatch.setattr(ga, "jit_launch", jit_launch)
    monkeypatch.setattr(ga, "direct_launch_ok", lambda run: True)
    monkeypatch.setattr(ga, "cuda_queries", lambda: ((lambda: -1), (lambda device: 0), (lambda: False)))
    monkeypatch.setattr(ga, "_LAUNCHERS", {})
    monkeypatch.setattr(ga, "_DIRECT", [True])
    monkeypatch.setattr(ta, "_PLANS", {})
    return recorded


def _normal(arg: object) -> object:
    """A launch argument as comparable data: tensors by address and layout, but the item counter (new zeros each
    launch on CPU tensors, :func:`~rlexact.ops.gluon_attention.item_counter`) by its values; descriptors by every
    field."""
    if isinstance(arg, torch.Tensor):
        if arg.shape == (2,) and arg.dtype == torch.int32:
            return ("counter", tuple(arg.tolist()))
        return ("tensor", arg.data_ptr(), tuple(arg.shape), arg.stride(), arg.dtype)
    if dataclasses.is_dataclass(arg) and not isinstance(arg, type):
        fields = {f.name: getattr(arg, f.name) for f in dataclasses.fields(arg)}
        return ("descriptor", fields.pop("base").data_ptr(), tuple(sorted((k, repr(v)) for k, v in fields.items())))
    return arg


def _launch(launches: list, planned: bool, *args: object, lse_delta: tuple | None = None) -> tuple:
    """The launch the packed forward of ``args`` (``q, k, v, cu, out``) records, with or without plans."""
    q, k, v, cu, out = args
    before = len(launches)
    ta._forward(q, k, v, cu, None, None, SCALE, out, lse_delta, cfg=None if planned else {})
    assert len(launches) == before + 1
    kernel, grid, launch_args = launches[-1]
    return id(kernel), grid, tuple(_normal(a) for a in launch_args)


def _through_plan(launches: list, *args: object, lse_delta: tuple | None = None) -> tuple:
    """:func:`_launch` with plans, failing if the launch does not go through a kept plan (the unplanned path's
    dispatch raises)."""

    def unplanned(*a: object, **kw: object) -> None:
        raise AssertionError("the launch took the unplanned path")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ta, "_gluon_packed", unplanned)
        return _launch(launches, True, *args, lse_delta=lse_delta)


def _inputs(lens: list[int], seed: int = 0, q_stride: int = HQ) -> tuple[torch.Tensor, ...]:
    """``q, k, v, cu, out`` of sequences of ``lens`` tokens; ``q`` a view into rows of ``q_stride`` heads."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, q_stride, D, generator=g).bfloat16()[:, :HQ]
    k, v = (torch.randn(t, HKV, D, generator=g).bfloat16() for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, torch.empty(t, HQ, D, dtype=torch.bfloat16)


CASES = {
    "paired": [300, 200],
    "single": [5, 40, 70],
    "one_sequence": [1024],
    "sixteen_sequences": [16] * 16,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("q_stride", [HQ, HQ + 2 * HKV], ids=["dense_q", "q_in_qkv_rows"])
def test_planned_launch_equals_unplanned(launches: list, case: str, q_stride: int) -> None:
    """The first launch keeps a plan; the next launches of the same inputs go through it and pass the cached
    launcher what the unplanned path passes: the same kernel, grid and arguments (a zeroed counter for the paired
    kernel)."""
    args = _inputs(CASES[case], q_stride=q_stride)
    _launch(launches, True, *args)
    assert len(ta._PLANS) == 1
    assert _through_plan(launches, *args) == _launch(launches, False, *args)
    plan, _ = next(iter(ta._PLANS.values()))
    assert (plan.q_layout is not None) == (sum(CASES[case]) >= 128 * len(CASES[case]))


def test_planned_backward_preparation_equals_unplanned(launches: list) -> None:
    """The backward's preprocessing launch (``lse_delta``) gets a plan of its own, which gives the unplanned
    launch's arguments."""
    args = _inputs([300, 200])
    t = args[0].shape[0]
    lse_delta = (torch.empty(t, HQ), torch.empty(t, HQ))
    _launch(launches, True, *args)
    _launch(launches, True, *args, lse_delta=lse_delta)
    assert len(ta._PLANS) == 2
    planned = _through_plan(launches, *args, lse_delta=lse_delta)
    assert planned == _launch(launches, False, *args, lse_delta=lse_delta)
    assert planned != _launch(launches, False, *args)


def test_plan_shared_across_token_counts(launches: list) -> None:
    """Launches that differ only in token and sequence counts of the same specialization (not 1, multiples of 16
    or not alike) share one plan, and each gets its own grid and arguments."""
    cases = ([300, 200], [400, 300], [200, 304, 500])
    for i, lens in enumerate(cases):
        args = _inputs(lens, seed=i)
        _launch(launches, True, *args)
        planned = _through_plan(launches, *args)
        assert planned == _launch(launches, False, *args)
    assert len(ta._PLANS) == 1


def test_no_plan_for_misaligned_tensors(launches: list) -> None:
    """A query buffer that is not 16-byte aligned keeps no plan (its launch specializes differently) and launches
    as the unplanned path does."""
    t, lens = 500, [300, 200]
    buf = torch.randn(t * HQ * D + 1).bfloat16()
    q = buf[1:].view(t, HQ, D)
    _, k, v, cu, out = _inputs(lens)
    assert _launch(launches, True, q, k, v, cu, out)[2] == ("compiled",)
    assert _launch(launches, True, q, k, v, cu, out) == _launch(launches, False, q, k, v, cu, out)
    assert not ta._PLANS


def test_a_wrong_plan_is_seen(launches: list) -> None:
    """Negative control: the paired launch's plan kept under the single-kernel launch's key gives arguments that
    differ from the unplanned launch's, so the comparisons above can fail."""
    paired, single = _inputs([300, 200]), _inputs([5, 40, 70])
    _launch(launches, True, *paired)
    _launch(launches, True, *single)
    (key_paired, entry_paired), (key_single, _) = ta._PLANS.items()
    ta._PLANS[key_single] = entry_paired
    assert _through_plan(launches, *single) != _launch(launches, False, *single)


def test_patched_configuration_gets_its_own_plan(launches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """A different KV split (``_fwd_config`` patched, as split sweeps do) keys a plan of its own instead of reusing
    the library split's."""
    args = _inputs([300, 200])
    _launch(launches, True, *args)
    library = _through_plan(launches, *args)
    orig = ta._fwd_config
    monkeypatch.setattr(ta, "_fwd_config", lambda hd, dt: orig(hd, dt) | {"SPLIT": 128})
    _launch(launches, True, *args)
    assert len(ta._PLANS) == 2
    planned = _through_plan(launches, *args)
    assert planned == _launch(launches, False, *args) and planned[0] != library[0]


def test_plan_table_is_bounded(launches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``MAX_PLANS`` the table starts over."""
    monkeypatch.setattr(ta, "MAX_PLANS", 2)
    for lens in ([300, 200], [5, 40, 70], [1024]):
        _launch(launches, True, *_inputs(lens))
    assert len(ta._PLANS) == 1


def test_descriptor_matches_checked_constructor() -> None:
    """The unchecked descriptor has every field of the checked constructor's, with the same values."""
    k = torch.empty(64, HKV, D, dtype=torch.bfloat16)
    layout = ga.kv_layout(False)
    args = (k, [64, HKV * D], [HKV * D, 1], [ga.BLOCK_N, D], layout)
    fast, checked = ga.descriptor(*args), ga.GluonDescriptor(*args)
    assert type(fast) is type(checked) and _normal(fast) == _normal(checked)
    assert vars(fast).keys() == vars(checked).keys()


def test_strides_key_their_own_plans(launches: list) -> None:
    """A query view into wider rows (a fused QKV projection's) keys a plan apart from dense queries of the same
    sizes, and each plan gives its own launch's arguments."""
    for q_stride in (HQ, HQ + 2 * HKV):
        args = _inputs([300, 200], q_stride=q_stride)
        _launch(launches, True, *args)
        assert _through_plan(launches, *args) == _launch(launches, False, *args)
    assert len(ta._PLANS) == 2


def test_windowed_launch_keeps_to_the_tl_kernel(launches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sliding-window launch never takes a Gluon kernel or a plan (they do not mask by the window): with Gluon's
    dispatch available, the unwindowed launch takes it and the windowed one the ``tl`` kernel, with the window and
    ``HAS_WINDOW``; negative control: the same stubs put the unwindowed launch on Gluon."""
    tl_launches: list = []

    class _TlRecorder:
        def __getitem__(self, grid: tuple):  # noqa: ANN204 - kernel[grid](*args, **meta)
            return lambda *args, **meta: tl_launches.append((args, meta))

    at = ta._attn_fwd_kernel.arg_names.index("window")
    monkeypatch.setattr(ta, "_attn_fwd_kernel", _TlRecorder())
    args = _inputs(CASES["single"])
    _launch(launches, True, *args)
    assert len(launches) == 1 and not tl_launches  # Gluon took the unwindowed launch
    q, k, v, cu, out = args
    for window in (7, 4096):
        ta._forward(q, k, v, cu, None, None, SCALE, out, window=window)
        (call_args, meta), *_ = tl_launches[-1:]
        assert meta["HAS_WINDOW"] and call_args[at] == window
    assert len(launches) == 1 and len(ta._PLANS) == 1 and len(tl_launches) == 2


def test_stream_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton_shared.stream_buffer`` (the paired kernel's item counters, the matmul's descriptor scratch): one
    tensor per device and stream, made again when too small, and a new one for every launch during CUDA-graph
    capture, which the cache never keeps."""
    from rlexact.ops import triton_shared

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    made: list = []

    def make(n: int, device: torch.device) -> torch.Tensor:
        made.append((n, device))
        return torch.zeros(n, dtype=torch.int32)

    cache: dict = {}
    a = triton_shared.stream_buffer(cache, 0, 11, 2, make)
    assert triton_shared.stream_buffer(cache, 0, 11, 2, make) is a
    assert triton_shared.stream_buffer(cache, 0, 12, 2, make) is not a  # another stream
    assert triton_shared.stream_buffer(cache, 1, 11, 2, make) is not a  # another device
    bigger = triton_shared.stream_buffer(cache, 0, 11, 5, make)
    assert bigger.numel() == 5 and triton_shared.stream_buffer(cache, 0, 11, 2, make) is bigger
    capturing[0] = True
    captured = [triton_shared.stream_buffer(cache, 0, 11, 2, make) for _ in range(2)]
    assert captured[0] is not captured[1] and all(c is not bigger for c in captured)
    assert cache[(0, 11)] is bigger and len(cache) == 3
    assert made[0] == (2, torch.device("cuda", 0)) and len(made) == 6


def test_item_counter_per_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gluon_attention.item_counter`` on a CUDA device (its queries stubbed): one pair of zeros per current stream,
    the same tensor for every launch on that stream, a new one on another stream or during capture; new zeros each
    call for CPU tensors."""
    stream, capturing = [7], [False]
    monkeypatch.setattr(ga, "cuda_queries", lambda: ((lambda: 0), (lambda device: stream[0]), (lambda: capturing[0])))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(ga, "_zero_counter", lambda n, device: torch.zeros(n, dtype=torch.int32))
    monkeypatch.setattr(ga, "_COUNTERS", {})
    dev = torch.device("cuda", 0)
    first = ga.item_counter(dev)
    assert first.tolist() == [0, 0] and ga.item_counter(dev) is first
    stream[0] = 8
    assert ga.item_counter(dev) is not first
    stream[0], capturing[0] = 7, True
    assert ga.item_counter(dev) is not first
    capturing[0] = False
    assert ga.item_counter(dev) is first and set(ga._COUNTERS) == {(0, 7), (0, 8)}
    cpu = torch.device("cpu")
    assert ga.item_counter(cpu) is not ga.item_counter(cpu)
