"""The paired prefill attention's machine code per build, compiled for sm_90 on the host (no GPU needed).

    python benchmarks/pair_sass.py [--variants 3x3 3x3S 3x3M 3x3W ...] [--out ...]

Each variant is a :class:`rlexact.ops.gluon_attention_pair.Build` in ``pair_depth_probe.py``'s notation
(``RxI[xN][S][F][T][Z][M][W]``), compiled as the library launches the pair for Qwen3-1.7B's heads in bf16 (two query
heads per tile, the library's KV split, packed keys, no backward preprocessing), by Triton's compiler and ``ptxas``
for sm_90. From the cubin (``cuobjdump``, bundled with Triton): registers per thread, stack (spills), shared memory,
the kernel's SASS instructions, and for each consumer its key-tile loop (the innermost loop with the scores' and
P @ V's wgmmas): its instructions and most frequent opcodes, the conditional block it skips for a key tile every row
sees in full (the masking of a diagonal or tail tile), hence the instructions of an unmasked key tile, and its
``WARPGROUP.DEPBAR`` levels (the products left in flight at each wait). Counts are static: each instruction once per
copy of the code. The GPU's timings of the same builds are ``pair_depth_probe.py``'s. Output:
``benchmarks/results/pair_sass_sm90.json``.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile

import torch

from common import ROOT, header, run_cases

sys.path.insert(0, str(ROOT / "tests"))  # the sm_90 host compile helpers the generated-code tests use

from hopper_compile import compile_gluon_for_hopper, tma_desc_type  # noqa: E402
from kernel_resources import SASS_INSTRUCTION, _cuobjdump  # noqa: E402
from pair_depth_probe import HKV, HQ, LIBRARY, geometry, name, parse  # noqa: E402
from rlexact.ops import gluon_attention as ga  # noqa: E402
from rlexact.ops import gluon_attention_pair as gp  # noqa: E402

DEFAULT = ["3x3", "3x3S", "3x3F", "3x3T", "3x3Z", "3x3M", "3x3W", "3x3SFTZM", "3x3SFTZMW"]
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
"""One instruction of ``cuobjdump -sass``: address, predicate, opcode, operands."""


def instructions(sass: str) -> list[tuple[int, bool, str, str]]:
    """``(address, predicated, opcode, operands)`` of each SASS instruction in address order."""
    return [(int(m[1], 16), m[2] is not None, m[3], m[4]) for m in map(LINE.match, sass.splitlines()) if m]


def key_tile_loops(code: list[tuple[int, bool, str, str]]) -> list[tuple[int, int]]:
    """``(first, last)`` indices of each consumer's key-tile loop: the innermost conditional backward branches whose
    body holds a score and a P @ V wgmma (``HGMMA.64x64`` and ``HGMMA.64x128``; the unconditional jumps back from the
    mbarrier waits' retry code past the kernel's end are not loops)."""
    index = {a: i for i, (a, *_) in enumerate(code)}
    spans = []
    for i, (_, predicated, op, operands) in enumerate(code):
        target = re.match(r"\s*(0x[0-9a-f]+)", operands) if op == "BRA" and predicated else None
        if target and int(target[1], 16) in index and index[int(target[1], 16)] < i:
            first = index[int(target[1], 16)]
            body = [c[2] for c in code[first : i + 1]]
            if any(o.startswith("HGMMA.64x64x16") for o in body) and any(o.startswith("HGMMA.64x128") for o in body):
                spans.append((first, i))
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def masked_block(code: list[tuple[int, bool, str, str]], first: int, last: int) -> int:
    """Instructions of the largest block a predicated forward branch in ``code[first..last]`` skips within it."""
    index = {a: i for i, (a, *_) in enumerate(code)}
    best = 0
    for i in range(first, last):
        _, predicated, op, operands = code[i]
        target = re.match(r"\s*(0x[0-9a-f]+)", operands) if op == "BRA" and predicated else None
        if target and i < index.get(int(target[1], 16), -1) <= last:
            best = max(best, index[int(target[1], 16)] - i - 1)
    return best


def measure(spec: str) -> dict:
    build = parse(spec)
    hp, split = geometry(torch.bfloat16)
    positions = 16 * build.warps // hp
    kv = tma_desc_type(4096, HKV * ga.HEAD_DIM, [build.tile_n, ga.HEAD_DIM], ga.kv_layout(False))
    q = tma_desc_type(4096, ga.HEAD_DIM, [positions, hp, ga.HEAD_DIM], gp.q_layout(False, positions, hp), heads=HQ)
    args = dict(q_ptr="*bf16", o_ptr="*bf16", lse_ptr="*fp32", delta_ptr="*fp32", k_desc=kv, v_desc=kv,
                cu_ptr="*i32", num_seqs="i32", qk_scale="fp32", seqk_ptr="*i32", kv_rows="i32", heads="i32",
                q_desc=q, counter_ptr="*i32", o_desc=q)  # fmt: skip
    args |= dict.fromkeys(("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_lt", "stride_lh"), "i32")
    kernel = gp.kernel(hp, split, False, HQ // HKV, False, build)
    compiled = compile_gluon_for_hopper(kernel, args, {}, num_warps=build.warps, maxnreg=gp.MAXNREG)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    fields = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", next(ln for ln in usage.stdout.splitlines()
                                                                       if "REG:" in ln))}  # fmt: skip
    code = instructions(sass)
    loops = []
    for first, last in key_tile_loops(code):
        body = code[first : last + 1]
        skipped = masked_block(code, first, last)
        ops = collections.Counter(op.split(".")[0] for _, _, op, _ in body)
        loops.append({
            "instructions": len(body),
            "masked_block": skipped,
            "unmasked_tile_instructions": len(body) - skipped,
            "depbar_levels": [re.search(r"0x[0-9a-f]+", o)[0] for _, _, op, o in body if op == "WARPGROUP.DEPBAR.LE"],
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
