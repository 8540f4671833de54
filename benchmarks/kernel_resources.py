"""Registers, spills and shared memory of the decode step's kernels, compiled for sm_90 on the host (no GPU needed).

    python benchmarks/kernel_resources.py [--cases attn_decode_w2_s2 ...] [--out ...]

Each case compiles one kernel specialization the way a launch on an H100/H200 would (Triton's compiler and ptxas,
target sm_90), reads the cubin's resource usage with the ``cuobjdump`` bundled with Triton, and derives how many
programs of it fit one SM: by registers (65,536 per SM, allocated per warp in units of 256), by shared memory
(233,472 bytes per SM, 1 KB reserved per program), by threads (2,048) and by the 32-program limit. That bound is the
occupancy a latency-bound kernel lives on (``kernel_counters_h200.json`` measures the achieved one on the GPU); a
nonzero ``stack_bytes`` means ptxas spilled registers to local memory. ``sass_instructions`` counts the kernel's
machine instructions (static, from ``cuobjdump -sass``), with its most frequent opcodes. The numbers are those of
the Triton installed where the script runs (``versions`` in the result). With the GPU machine's Triton on the path
(``pip install --target DIR triton==X`` of its version, then ``PYTHONPATH=DIR``) they are the GPU's own: Triton 3.6
on the host gave the same registers, spills and instruction counts as ``kernel_resources_sass_h200.json`` compiled
on the H200.

Cases: ``attn_decode_w{W}_s{S}``: the paged decode launch (one query per sequence, 16 query / 8 KV heads, head dim
128, 16-token pages, bf16) with W warps and S pipeline stages (the library's is ``w2_s2``); ``attn_prefill``: the
packed training / prefill launch; ``mm256_{qkv,o,down}``: the exact matmul's M = 256 tiles of the Qwen3-1.7B
projections as the library picks them on a 132-SM H200; ``gated256``, ``gated64``: the SiLU-gated matmul's M = 256
and M = 64 variants (``GATED_VARIANTS``); ``gluon_prefill_single``, ``gluon_prefill_pair``, ``gluon_decode``: the sm_90
Gluon attention kernels the library launches there (the packed forward's single and persistent paired kernels, the
paged decode kernel). Output: ``benchmarks/results/kernel_resources_sm90.json``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

from common import ROOT, header, run_cases

sys.path.insert(0, str(ROOT / "tests"))  # the sm_90 host compile helper the generated-code tests use

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hopper_compile import (  # noqa: E402
    compile_for_hopper,
    compile_gluon_for_hopper,
    decode_attention_types,
    packed_attention_types,
)
from rlexact.ops import triton_attention as ta  # noqa: E402
from rlexact.ops import triton_matmul as tmm  # noqa: E402

REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED, THREADS_PER_SM, PROGRAMS_PER_SM = 65536, 233472, 1024, 2048, 32
PB, I32 = "*bf16", "i32"
ATTN_ARGS = {
    **dict(Q=PB, K=PB, V=PB, Out=PB, LSE=PB, DELTA=PB, cu_q="*i32", seqlens_k="*i32", block_tables="*i32"),
    **dict(qk_scale="fp32", num_seqs=I32, window=I32),
    **dict.fromkeys(["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kt", "stride_kh"], I32),
    **dict.fromkeys(["stride_vt", "stride_vh", "stride_bt", "stride_lt", "stride_lh"], I32),
    **dict(PACC="*fp32", PML="*fp32", CNT="*i32", n_heads=I32),
}
ATTN_DECODE = dict(
    HEAD_DIM=128, BLOCK_D=128, EVEN_D=True, BLOCK_M=16, BLOCK_N=64, HP=2, GROUP=2, PAGED=True, PAGE_SIZE=16,
    BWD_PREP=False, SCAN=128, SPLIT=ta.SPLIT_KEYS_16BIT, SPLIT_PAR=False, DIRECT=True, ONE_Q=True, FP32_DOT=False,
    UPCAST=False, PDL=False, HAS_WINDOW=False,
)  # fmt: skip
MM_TMA_ARGS = dict(x_desc=PB, w_desc=PB, o_desc=PB, M=I32, N=I32, K=I32)
MM_PTR_ARGS = dict(x_ptr=PB, w_ptr=PB, o_ptr=PB, M=I32, N=I32, K=I32, stride_xm=I32, stride_wn=I32, stride_om=I32)
MM256 = {  # the library's M = 256 tiles on a 132-SM H200 (triton_matmul.row_tile_variants)
    "qkv": tmm.MatmulConfig("tma", 64, 128, 128, num_warps=4, num_stages=4),
    "o": tmm.MatmulConfig("tma", 64, 64, 128, num_warps=4, num_stages=5),
    "down": tmm.MatmulConfig("tma", 64, 64, 128, num_warps=4, num_stages=5),
}


def _gated(m: int) -> tmm.MatmulConfig:
    """The gated matmul's variant for ``m`` rows (``gated_config_for`` on a GPU that takes the variants)."""
    return next(cfg for max_m, cfg in tmm.GATED_VARIANTS if max_m is None or m <= max_m)


def _matmul_case(cfg: tmm.MatmulConfig, gated: bool) -> tuple:
    flags = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.group_m, RNE_FIX=False, PDL=False, UPCAST=False)
    if cfg.kernel == "ptr":
        return tmm._mm_ptr_kernel, MM_PTR_ARGS, flags | dict(IEEE=False, GATED=gated, GELU=False), cfg
    gate = (2 if cfg.joint else 1) if gated else 0
    tma = dict(NUM_PROGS=132, WS=False, SUBTILE=cfg.subtile, OUT_DTYPE=tl.bfloat16, DEV_DESC=True, KS=cfg.KS)
    return tmm._mm_tma_kernel, MM_TMA_ARGS, flags | tma | dict(GATED=gate, GELU=False), cfg


def cases() -> dict[str, tuple]:
    """``name -> (kernel, runtime argument types, constexprs, object with num_warps / num_stages)``."""
    out: dict[str, tuple] = {}
    for warps in (1, 2, 4):
        for stages in (1, 2, 3):
            launch = tmm.MatmulConfig("ptr", 16, 64, 64, num_warps=warps, num_stages=stages)  # carries the options
            out[f"attn_decode_w{warps}_s{stages}"] = (ta._attn_fwd_kernel, ATTN_ARGS, ATTN_DECODE, launch)
    prefill = ta.PREFILL_LAUNCH_16BIT
    const = ATTN_DECODE | dict(BLOCK_M=prefill["BLOCK_M"], HP=2, PAGED=False, PAGE_SIZE=1, DIRECT=False, ONE_Q=False)
    launch = tmm.MatmulConfig("ptr", 16, 64, 64, num_warps=prefill["num_warps"], num_stages=prefill["num_stages"])
    out["attn_prefill"] = (ta._attn_fwd_kernel, ATTN_ARGS, const, launch)
    for name, cfg in MM256.items():
        out[f"mm256_{name}"] = _matmul_case(cfg, gated=False)
    out["gated256"] = _matmul_case(_gated(256), gated=True)
    out["gated64"] = _matmul_case(_gated(64), gated=True)
    return out


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


SASS_INSTRUCTION = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)"
"""One instruction of ``cuobjdump -sass``: its address comment (four or more hex digits), an optional predicate, and
the opcode (captured)."""


def programs_per_sm(regs: int, threads: int, smem: int) -> dict[str, int]:
    """How many programs fit one SM by each resource (Hopper's limits) and overall."""
    warps = -(-threads // 32)
    regs_per_warp = -(-regs * 32 // 256) * 256
    by = {
        "registers": REGS_PER_SM // (regs_per_warp * warps),
        "shared_memory": SMEM_PER_SM // (smem + SMEM_RESERVED),
        "threads": THREADS_PER_SM // threads,
        "programs": PROGRAMS_PER_SM,
    }
    return by | {"fit": min(by.values())}


def cubin_report(cubin: bytes) -> tuple[dict[str, int], str]:
    """``cuobjdump``'s resource usage of a compiled kernel (``REG``, ``STACK``, ``LOCAL``, ... -> int) and its SASS."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    line = next(ln for ln in usage.stdout.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}, sass


def gluon_cases() -> dict[str, tuple]:
    """``name -> (Gluon kernel, runtime argument types, constexprs, compile options)``: the library's sm_90 attention
    launches at Qwen3-1.7B's heads in bf16 (the packed single and paired prefill kernels, the paged decode kernel)."""
    from pair_depth_probe import HKV, HQ, geometry
    from rlexact.ops import gluon_attention as ga
    from rlexact.ops import gluon_attention_pair as gp
    from rlexact.ops import gluon_decode as gd

    hp, split = geometry(torch.bfloat16)  # the library's heads per tile and KV split
    single = dict(HP=hp, GROUP=HQ // HKV, D=ga.HEAD_DIM, BLOCK_N=ga.BLOCK_N, SPLIT=split, BWD_PREP=False,
                  SCAN=ga.SCAN, W=ga.WARPS, GATHERED=False)  # fmt: skip
    build = gp.LIBRARY_BUILD
    pair = gp.kernel(hp, split, False, HQ // HKV, False)
    return {
        "gluon_prefill_single": (ga._fwd_kernel, packed_attention_types(ga.BLOCK_N), single, {"num_warps": ga.WARPS}),
        "gluon_prefill_pair": (pair, packed_attention_types(ga.BLOCK_N, 16 * build.warps // hp), {},
                               {"num_warps": build.warps, "maxnreg": gp.MAXNREG}),
        "gluon_decode": (gd.kernel(0), decode_attention_types(), dict(HP=hp, D=ga.HEAD_DIM), dict(gd.LAUNCH_OPTIONS)),
    }  # fmt: skip


def measure(kernel, args: dict, const: dict, launch: tmm.MatmulConfig) -> dict:  # noqa: ANN001
    compiled = compile_for_hopper(kernel, args, const, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return report(compiled, launch.num_stages)


def measure_gluon(kernel, args: dict, const: dict, options: dict) -> dict:  # noqa: ANN001
    compiled = compile_gluon_for_hopper(kernel, args, const, **options)
    return report(compiled, options.get("num_stages", 1))


def report(compiled, num_stages: int) -> dict:  # noqa: ANN001
    """Resources, occupancy bound and machine-code counts of a compiled kernel (its warps per program as launched:
    a warp-specialized Gluon kernel's partitions included)."""
    num_warps = int(compiled.metadata.num_warps)
    fields, sass = cubin_report(compiled.asm["cubin"])
    ops = collections.Counter(m.split(".")[0] for m in re.findall(SASS_INSTRUCTION, sass))
    threads = num_warps * 32
    smem = int(compiled.metadata.shared)
    fit = programs_per_sm(fields["REG"], threads, smem)
    return {
        "num_warps": num_warps,
        "num_stages": num_stages,
        "registers_per_thread": fields["REG"],
        "stack_bytes": fields["STACK"],
        "local_bytes": fields["LOCAL"],
        "shared_bytes": smem,
        "programs_per_sm": fit,
        "warps_per_sm": fit["fit"] * num_warps,
        "sass_instructions": sum(ops.values()),
        "sass_top_opcodes": dict(ops.most_common(16)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernel_resources_sm90.json"))
    ap.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
    args = ap.parse_args()
    table, gluon = cases(), gluon_cases()
    names = args.cases or [*table, *gluon]
    result: dict = header("kernel_resources", "triton") | {
        "target": "sm_90 (H100 / H200), compiled on the host",
        "limits_per_sm": dict(registers=REGS_PER_SM, shared_bytes=SMEM_PER_SM, threads=THREADS_PER_SM),
    }

    def measure_case(name: str) -> dict:
        if name in gluon:
            entry = measure_gluon(*gluon[name])
        else:
            kernel, kargs, const, launch = table[name]
            entry = measure(kernel, kargs, const, launch)
        if name.startswith(("mm", "gated")):
            entry["config"] = repr(launch)
        print(f"[kernel_resources] {name}: {entry['registers_per_thread']} registers, stack "
              f"{entry['stack_bytes']} B, shared {entry['shared_bytes']} B, {entry['warps_per_sm']} warps per SM "
              f"({entry['programs_per_sm']})", flush=True)  # fmt: skip
        return entry

    return run_cases(result, "cases", names, measure_case, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
