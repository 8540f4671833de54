"""Every Triton / Gluon kernel launch of the library passes ``triton_shared.COMPILE_OPTIONS``: the machine code (FP
contraction pinned on) does not follow the installed Triton's default, which Triton 3.10 turns off."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rlexact"


def _launches_without_options(source: str) -> tuple[int, list[int]]:
    """``(launches, lines of those without **COMPILE_OPTIONS)``; a launch is a call of a subscripted expression whose
    name ends in ``kernel`` (``_rms_norm_kernel[grid](...)``, ``plan.kernel[plan.grid](...)``)."""
    count, bare = 0, []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            if not ast.unparse(node.func.value).endswith("kernel"):
                continue
            count += 1
            spread = {ast.unparse(k.value) for k in node.keywords if k.arg is None}
            if "COMPILE_OPTIONS" not in spread:
                bare.append(node.lineno)
    return count, bare


def test_every_kernel_launch_pins_the_compile_options() -> None:
    """Negative control: a launch without the options is reported, one with them is not."""
    total, bare = 0, {}
    for path in sorted(SRC.rglob("*.py")):
        count, lines = _launches_without_options(path.read_text())
        total += count
        if lines:
            bare[str(path.relative_to(SRC))] = lines
    assert bare == {}
    assert total >= 20, f"found only {total} kernel launches: the scan no longer recognises them"
    assert _launches_without_options("k_kernel[(1,)](x, num_warps=4)\n") == (1, [1])
    assert _launches_without_options("k_kernel[(1,)](x, **pdl, **COMPILE_OPTIONS)\nd[k](x)\n") == (1, [])


def test_compile_options_pin_fp_fusion() -> None:
    from rlexact.ops.triton_shared import COMPILE_OPTIONS

    assert dict(COMPILE_OPTIONS) == {"enable_fp_fusion": True}
