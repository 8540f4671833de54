"""The library's Gluon kernels compile for Hopper (sm_90) with the installed Triton, on a CPU-only host.

Gluon is experimental and its names move between Triton releases (a CTA barrier and the TMA box copy were renamed
after 3.6); a kernel that no longer compiles would fail at its first launch on a Hopper GPU. This catches that on
any machine with Triton's CUDA backend. The bits are checked on the GPU (``test_gluon_matmul.py``,
``test_triton_attention.py``)."""

from __future__ import annotations

import importlib.util
import re

import pytest

HAS_NVIDIA_BACKEND = importlib.util.find_spec("triton") is not None and (
    importlib.util.find_spec("triton.backends.nvidia") is not None
)


def _gluon():  # noqa: ANN202
    from rlexact.ops import gluon_attention

    if gluon_attention.gluon is None:
        pytest.skip("this Triton has no Gluon Hopper language")
    return gluon_attention


def _wgmmas(kernel: object) -> int:
    return kernel.asm["ptx"].count("wgmma.mma_async")


SCHEDULES = dict(sum_with_pv=True, first_fold=True, tree_max=True, zero_start=True, one_bound=True)
"""The pair's schedules that keep the bits and run one instruction stream per consumer (the library's build adds its
column sums over an 8-column row-sum product)."""


def _assert_overlapped(sass: str, consumers: int, in_flight: dict[str, int] | None = None) -> None:
    """Each consumer's key-tile loop waits with products still in flight as ``in_flight`` says (``WARPGROUP.DEPBAR``
    level -> waits per loop); by default twice at 1: for the scores while the previous tile's P @ V runs, and for that
    P @ V while the row sum runs (``gluon_attention``'s module docstring). ``ptxas`` that cannot keep the wgmmas
    asynchronous (an accumulator touched while its product runs, a product in flight across a loop edge) serializes
    them: every wait then drains all, one after each wgmma."""
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    for level, per_loop in (in_flight or {"0x1": 2}).items():
        assert waits.count(level) == per_loop * consumers, waits
    assert len(waits) < sass.count("HGMMA") // 4, (len(waits), sass.count("HGMMA"))


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="needs triton's CUDA backend")
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["plain", "silu", "gelu"])
def test_gluon_matmul_compiles_for_sm90(mode: int) -> None:
    _gluon()
    from hopper_compile import compile_gluon_for_hopper, gluon_matmul_types
    from rlexact.ops import gluon_matmul as gm

    cfg = gm.GluonMatmulConfig(128, 128)
    k = compile_gluon_for_hopper(gm._mm_kernel, gluon_matmul_types(), dict(BM=128, BN=128, GATED=mode),
                                 **gm.options_for(cfg))  # fmt: skip
    assert k.metadata.shared >= cfg.ring_bytes(gated=mode > 0)
    assert _wgmmas(k) == (2 if mode else 1) * 4  # four k16 steps per 64-column slice, per chain


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="needs triton's CUDA backend")
def test_gluon_attention_kernels_compile_for_sm90() -> None:
    ga = _gluon()
    from hopper_compile import compile_gluon_for_hopper, decode_attention_types, packed_attention_types
    from rlexact.ops import gluon_attention_pair as gp
    from rlexact.ops import gluon_decode as gd

    single = packed_attention_types(ga.BLOCK_N)
    pair_types = packed_attention_types(ga.BLOCK_N, 16 * gp.WARPS // 2)
    for prep, gathered in ((False, False), (True, False), (False, True)):
        const = dict(HP=2, GROUP=2, D=128, BLOCK_N=ga.BLOCK_N, SPLIT=1024, BWD_PREP=prep, SCAN=ga.SCAN, W=ga.WARPS,
                     GATHERED=gathered)  # fmt: skip
        k = compile_gluon_for_hopper(ga._fwd_kernel, single, const, num_warps=ga.WARPS)
        assert _wgmmas(k) > 0
        _assert_overlapped(k.asm["sass"], 1)
        pair = compile_gluon_for_hopper(gp.kernel(2, 1024, prep, 2, gathered), pair_types, {},
                                        num_warps=gp.WARPS, maxnreg=gp.MAXNREG)  # fmt: skip
        assert _wgmmas(pair) > 0 and pair.metadata.shared <= 227 * 1024
        _assert_overlapped(pair.asm["sass"], 2, {"0x2": 1, "0x1": 0})
    probes = (gp.Build(), gp.Build(sum_with_pv=True), gp.Build(first_fold=True), gp.Build(zero_start=True),
              gp.Build(one_bound=True), gp.Build(wide=True), gp.Build(**SCHEDULES), gp.Build(**SCHEDULES, wide=True),
              gp.Build(**SCHEDULES, column_sums=True), gp.Build(**SCHEDULES, column_sums=True, row_sum_n=8),
              gp.Build(ring_depth=4, item_depth=2))  # fmt: skip
    for build in probes:
        k = compile_gluon_for_hopper(gp.kernel(2, 1024, False, 2, False, build),
                                     packed_attention_types(ga.BLOCK_N, 16 * build.warps // 2), {},
                                     num_warps=build.warps, maxnreg=gp.MAXNREG)  # fmt: skip
        assert k.metadata.shared <= 227 * 1024
        # with the row sum issued with P @ V: the scores under that P @ V and the row sum
        _assert_overlapped(k.asm["sass"], build.consumers, {"0x2": 1, "0x1": 0} if build.sum_with_pv else None)
    with pytest.raises(Exception, match="bound by rlexact.ops.gluon_attention_pair.kernel"):
        compile_gluon_for_hopper(gp._pair_kernel, pair_types, {}, num_warps=gp.WARPS)
    dec = decode_attention_types()
    for mode in (0, 1, 2):  # plain, from a shared prefix's state, the shared prefix
        k = compile_gluon_for_hopper(gd.kernel(mode), dec, dict(HP=2, D=128), **gd.LAUNCH_OPTIONS)
        assert _wgmmas(k) > 0 and k.metadata.shared > 0


def test_overlap_check_flags_serialized_wgmmas() -> None:
    """The negative control of :func:`_assert_overlapped`: SASS whose every wgmma is drained at once fails it, the
    same products with two waits in flight pass."""
    product = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;\n"
    with pytest.raises(AssertionError):
        _assert_overlapped((product + "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n") * 12, 1)
    _assert_overlapped(product * 12 + "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n" * 2, 1)


def test_pair_build_refuses_what_cannot_run() -> None:
    ga = _gluon()
    from rlexact.ops import gluon_attention_pair as gp

    assert gp.Build(**SCHEDULES, column_sums=True, row_sum_n=8) == gp.LIBRARY_BUILD
    assert gp.LIBRARY_BUILD.tile_n == ga.BLOCK_N
    assert (gp.LIBRARY_BUILD.warps, gp.LIBRARY_BUILD.consumers) == (gp.WARPS, 2)
    assert (gp.Build(wide=True).warps, gp.Build(wide=True).consumers) == (2 * gp.WARPS, 1)  # the same rows per item
    with pytest.raises(ValueError, match="item_depth must be >= 2"):
        gp.Build(item_depth=1)  # a slot released an item late: the producer would wait on itself
    with pytest.raises(ValueError, match="tile_n must be 64 or 128"):
        gp.Build(tile_n=96)
    with pytest.raises(ValueError, match="column_sums needs sum_with_pv"):
        gp.Build(column_sums=True)  # without it the row sum is folded in before the next tile's is issued
    with pytest.raises(ValueError, match="row_sum_n must be 8 or 16"):
        gp.Build(row_sum_n=4)
