"""Every Triton / Gluon kernel launch of the library and of the benchmarks passes ``triton_shared.COMPILE_OPTIONS``:
the machine code (FP contraction pinned on) does not follow the installed Triton's default, which Triton 3.10 turns
off, and a benchmark's own kernels compile as the library's do."""

from __future__ import annotations

import ast
from pathlib import Path

from source_scan import jitted

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (ROOT / "src" / "rlexact", ROOT / "benchmarks")


def _launches_without_options(source: str) -> tuple[int, list[int]]:
    """``(launches, lines of those without **COMPILE_OPTIONS)``; a launch is a call of a subscripted expression that
    names a ``jit`` function of the module or ends in ``kernel`` (``_rms_norm_kernel[grid](...)``,
    ``plan.kernel[plan.grid](...)``)."""
    tree = ast.parse(source)
    jitted_names = jitted(tree)
    count, bare = 0, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            name = ast.unparse(node.func.value)
            if not (name.endswith("kernel") or name in jitted_names):
                continue
            count += 1
            spread = {ast.unparse(k.value) for k in node.keywords if k.arg is None}
            if "COMPILE_OPTIONS" not in spread:
                bare.append(node.lineno)
    return count, bare


def test_every_kernel_launch_pins_the_compile_options() -> None:
    """Negative controls: a launch without the options is reported, one with them is not, and a launch of a jit
    function whose name does not end in ``kernel`` counts."""
    total, bare = 0, {}
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            count, lines = _launches_without_options(path.read_text())
            total += count
            if lines:
                bare[str(path.relative_to(ROOT))] = lines
    assert bare == {}
    assert total >= 25, f"found only {total} kernel launches: the scan no longer recognises them"
    assert _launches_without_options("k_kernel[(1,)](x, num_warps=4)\n") == (1, [1])
    assert _launches_without_options("k_kernel[(1,)](x, **pdl, **COMPILE_OPTIONS)\nd[k](x)\n") == (1, [])
    probe = "@gluon.jit\ndef fwd(x):\n    pass\n\nfwd[grid](x, num_warps=4)\nother[grid](x)\n"
    assert _launches_without_options(probe) == (1, [5])


def test_compile_options_pin_fp_fusion() -> None:
    from rlexact.ops.triton_shared import COMPILE_OPTIONS

    assert dict(COMPILE_OPTIONS) == {"enable_fp_fusion": True}
