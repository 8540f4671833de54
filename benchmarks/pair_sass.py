"""The paired prefill attention's machine code per build, compiled for sm_90 on the host (no GPU needed).

    python benchmarks/pair_sass.py [--variants 3x3 3x3S 3x3M 3x3W ...] [--out ...]

Each variant is a :class:`rlexact.ops.gluon_attention_pair.Build` in ``pair_depth_probe.py``'s notation
(``RxI[xN][S][F][T][Z][M][W][C[16]]``), compiled as the library launches the pair for Qwen3-1.7B's heads in bf16 (two
query heads per tile, the library's KV split, packed keys, no backward preprocessing), by Triton's compiler and
``ptxas`` for sm_90. From the cubin (``cuobjdump``, bundled with Triton): registers per thread, stack (spills), shared
memory, the kernel's SASS instructions, and for each consumer its key-tile loop (the innermost loop with the scores' and
P @ V's wgmmas): its instructions and most frequent opcodes, the conditional block it skips for a key tile every row
sees in full (the masking of a diagonal or tail tile), hence the instructions of an unmasked key tile, its
``WARPGROUP.DEPBAR`` levels (the products left in flight at each wait), and whether its wait for every product
(``DEPBAR.LE 0x0``) comes after the softmax's exponentials (``MUFU.EX2``), that is whether the previous tile's P @ V
runs under the softmax or before it, with the exponentials between each such wait and the wait before it, and its
partition barriers (``BAR.SYNC``). Counts are static: each instruction once per copy of the code. The GPU's timings of
the same builds are ``pair_depth_probe.py``'s. Output: ``benchmarks/results/pair_sass_sm90.json``.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import torch

from common import ROOT, header, run_cases

sys.path.insert(0, str(ROOT / "tests"))  # the sm_90 host compile helpers the generated-code tests use

from hopper_compile import compile_gluon_for_hopper, packed_attention_types  # noqa: E402
from kernel_resources import SASS_INSTRUCTION, cubin_report  # noqa: E402
from pair_depth_probe import HKV, HQ, LIBRARY, geometry, name, parse  # noqa: E402
from rlexact.ops import gluon_attention as ga  # noqa: E402
from rlexact.ops import gluon_attention_pair as gp  # noqa: E402

DEFAULT = ["3x3", "3x3S", "3x3F", "3x3T", "3x3Z", "3x3M", "3x3W", "3x3SFTZM", "3x3SFTZMW", "3x3SC", "3x3SFTZMC",
           "3x3SFTZMC16"]
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
"""One instruction of ``cuobjdump -sass``: address, predicate, opcode, operands."""


def instructions(sass: str) -> list[tuple[str, str, int | None]]:
    """``(opcode, operands, index of the target)`` of each SASS instruction in address order; the target is that of a
    conditional branch, ``None`` for any other instruction (the mbarrier waits' retry code past the kernel's end
    jumps back unconditionally)."""
    lines = [(int(m[1], 16), m[2] is not None, m[3], m[4]) for m in map(LINE.match, sass.splitlines()) if m]
    index = {a: i for i, (a, *_) in enumerate(lines)}
    code = []
    for _, predicated, op, operands in lines:
        target = re.match(r"\s*(0x[0-9a-f]+)", operands) if op == "BRA" and predicated else None
        code.append((op, operands, index.get(int(target[1], 16)) if target else None))
    return code


def key_tile_loops(code: list[tuple[str, str, int | None]]) -> list[tuple[int, int]]:
    """``(first, last)`` indices of each consumer's key-tile loop: the innermost conditional backward branches whose
    body holds a score and a P @ V wgmma (``HGMMA.64x64`` and ``HGMMA.64x128``)."""
    spans = []
    for i, (_, _, target) in enumerate(code):
        if target is not None and target < i:
            body = [op for op, _, _ in code[target : i + 1]]
            if any(o.startswith("HGMMA.64x64x16") for o in body) and any(o.startswith("HGMMA.64x128") for o in body):
                spans.append((target, i))
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def masked_block(code: list[tuple[str, str, int | None]], first: int, last: int) -> int:
    """Instructions of the largest block a conditional forward branch in ``code[first..last]`` skips within it."""
    skips = [t - i - 1 for i in range(first, last) if (t := code[i][2]) is not None and i < t <= last]
    return max(skips, default=0)


def drains(op: str, operands: str) -> bool:
    """Whether an instruction waits for every wgmma in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x0``)."""
    return op == "WARPGROUP.DEPBAR.LE" and operands.strip().endswith("0x0")


def wait_after_exponentials(body: list[tuple[str, str, int | None]]) -> bool | None:
    """Whether the loop's wait for every product in flight (:func:`drains`) follows its last exponential
    (``MUFU.EX2``); ``None`` for a loop with no such wait."""
    waits = [i for i, (op, o, _) in enumerate(body) if drains(op, o)]
    exps = [i for i, (op, _, _) in enumerate(body) if op == "MUFU.EX2"]
    return waits[0] > exps[-1] if waits and exps else None


def exponentials_before_drains(body: list[tuple[str, str, int | None]]) -> list[int]:
    """For each wait for every product in flight (:func:`drains`) in ``body``, the exponentials (``MUFU.EX2``) since
    the wait before it: how much of a key tile's softmax runs while its products are in flight."""
    counts, n = [], 0
    for op, operands, _ in body:
        if op == "MUFU.EX2":
            n += 1
        elif op == "WARPGROUP.DEPBAR.LE":
            if drains(op, operands):
                counts.append(n)
            n = 0
    return counts


def measure(spec: str) -> dict:
    build = parse(spec)
    hp, split = geometry(torch.bfloat16)
    kernel = gp.kernel(hp, split, False, HQ // HKV, False, build)
    args = packed_attention_types(build.tile_n, 16 * build.warps // hp)
    compiled = compile_gluon_for_hopper(kernel, args, {}, num_warps=build.warps, maxnreg=gp.MAXNREG)
    fields, sass = cubin_report(compiled.asm["cubin"])
    code = instructions(sass)
    loops = []
    for first, last in key_tile_loops(code):
        body = code[first : last + 1]
        skipped = masked_block(code, first, last)
        ops = collections.Counter(op.split(".")[0] for op, _, _ in body)
        loops.append({
            "instructions": len(body),
            "masked_block": skipped,
            "unmasked_tile_instructions": len(body) - skipped,
            "depbar_levels": [re.search(r"0x[0-9a-f]+", o)[0] for op, o, _ in body if op == "WARPGROUP.DEPBAR.LE"],
            "drain_after_exponentials": wait_after_exponentials(body),
            "exponentials_before_each_drain": exponentials_before_drains(body),
            "partition_barriers": sum(op.startswith("BAR.SYNC") for op, _, _ in body),
            "top_opcodes": dict(ops.most_common(14)),
        })  # fmt: skip
    return {
        "build": repr(build),
        "consumers": build.consumers,
        "warps": build.warps * build.consumers + 1,  # the consumers and the producer
        "registers_per_thread_at_launch": fields["REG"],
        "stack_bytes": fields["STACK"],
        "shared_bytes": int(compiled.metadata.shared),
        "sass_instructions": len(re.findall(SASS_INSTRUCTION, sass)),
        "key_tile_loops": loops,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=DEFAULT)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pair_sass_sm90.json"))
    args = ap.parse_args()
    for spec in args.variants:
        parse(spec)
    result: dict = header("pair_sass", "triton") | {
        "target": "sm_90 (H100 / H200), compiled on the host",
        "library_build": name(LIBRARY),
        "heads": [HQ, HKV, ga.HEAD_DIM],
    }

    def measure_case(spec: str) -> dict:
        entry = measure(spec)
        loop = entry["key_tile_loops"][0] if entry["key_tile_loops"] else {}
        print(f"[pair_sass] {spec}: {entry['sass_instructions']} instructions, key-tile loop "
              f"{loop.get('instructions')} ({loop.get('unmasked_tile_instructions')} unmasked) x "
              f"{len(entry['key_tile_loops'])}, stack {entry['stack_bytes']} B", flush=True)  # fmt: skip
        return entry

    return run_cases(result, "variants", args.variants, measure_case, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
