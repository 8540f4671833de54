"""Whether FP contraction changes the exact kernels' machine code: each kernel of ``kernel_resources.py`` compiled for
sm_90 on the host three ways, with the installed Triton's default, with the library's ``COMPILE_OPTIONS`` (fusion
pinned on) and with fusion off (Triton 3.10's new default); writes ``benchmarks/results/fp_fusion_sm90.json``.

    python benchmarks/fp_fusion_sm90.py [--cases attn_prefill ...] [--out ...]

``options``: whether the pinned options parse to the default ones (then the pin changes no kernel's machine code).
Per case: the SHA-256 of each cubin (first 16 hex digits) and two verdicts, ``pinned_equals_default`` (the pin is a
no-op on this Triton: the GPU results were compiled this way) and ``off_differs`` (a Triton whose default is off, or
``TRITON_DEFAULT_FP_FUSION=0``, would run other machine code, and possibly other bits, unless the options are
pinned). Run it with the GPU machine's Triton on the path (``PYTHONPATH=DIR`` of ``pip install --target DIR
triton==X``) for that version's answer.
"""

from __future__ import annotations

import argparse
import hashlib

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend

from common import ROOT, header, run_cases
from kernel_resources import cases, compile_for_hopper
from rlexact.ops.triton_shared import COMPILE_OPTIONS


def _digest(kernel, args: dict, const: dict, launch, pin: bool, **options: object) -> str:  # noqa: ANN001
    compiled = compile_for_hopper(
        kernel, args, const, pin=pin, num_warps=launch.num_warps, num_stages=launch.num_stages, **options
    )
    return hashlib.sha256(compiled.asm["cubin"]).hexdigest()[:16]


def _options() -> dict:
    """Whether the pinned options parse to the installed Triton's default options for sm_90: when they do, every
    kernel (not only the cases compiled here) gets the machine code it got before the pin."""
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    default, pinned = backend.parse_options({}), backend.parse_options(dict(COMPILE_OPTIONS))
    return {
        "default_enable_fp_fusion": default.enable_fp_fusion,
        "pinned_options_equal_default": default == pinned,
        "default_hash": default.hash(),
        "pinned_hash": pinned.hash(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp_fusion_sm90.json"))
    ap.add_argument("--cases", nargs="+", default=None, help="kernel_resources case names (default: all)")
    args = ap.parse_args()
    table = cases()
    result: dict = header("fp_fusion", "triton") | {
        "target": "sm_90, compiled on the host",
        "options": _options(),
    }

    def measure(name: str) -> dict:
        kernel, kargs, const, launch = table[name]
        row: dict = {
            "default": _digest(kernel, kargs, const, launch, pin=False),
            "pinned": _digest(kernel, kargs, const, launch, pin=True),
            "off": _digest(kernel, kargs, const, launch, pin=False, enable_fp_fusion=False),
        }
        row["pinned_equals_default"] = row["pinned"] == row["default"]
        row["off_differs"] = row["off"] != row["default"]
        print(f"[fp_fusion] {name}: {row}", flush=True)
        return row

    return run_cases(result, "cases", args.cases or list(table), measure, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
