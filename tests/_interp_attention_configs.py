"""Every launch candidate of ``benchmarks/attention_configs.py`` computes the library's bits (interpreter, CPU).

Run as ``TRITON_INTERPRET=1 python tests/_interp_attention_configs.py`` (``tests/test_triton_attention.py`` does).
The interpreter has no MMA layouts, warps or pipelining, so this checks the kernel logic that a query-side launch
changes (``BLOCK_M``, hence GQA packing, tile slots, which key tiles are masked, split loops), not the GPU's
instruction choice: the sweep itself checks the candidates bitwise on the GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attention_configs  # noqa: E402
from _interp_attention import PagedCache, chunk_schedule, decode_schedule, make_inputs, run_schedule  # noqa: E402
from _interp_dot import use_row_invariant_interpreter_dot  # noqa: E402
from rlexact.ops import reference  # noqa: E402
from rlexact.ops import triton_attention as ta  # noqa: E402

LENS = [1, 5, 17, 150]
HQ, HKV, D = 4, 2, 16
DT = torch.bfloat16
SPLIT = 128  # two key tiles of 64: the 150-token sequence spans two splits


def _varlen(q, k, v, cu, cfg: dict | None) -> torch.Tensor:
    out = torch.empty_like(q)
    ta._forward(q, k, v, cu, None, None, D**-0.5, out, cfg=cfg)
    return out


def _paged_full(q, k, v, cu, cfg: dict) -> torch.Tensor:
    """All queries of every sequence in one paged launch (the prefill path) under ``cfg``."""
    cache = PagedCache(LENS, HKV, D, DT, "cpu", 16)
    starts = cu.tolist()
    for b in range(len(LENS)):
        cache.write(b, 0, k[starts[b] : starts[b + 1]], v[starts[b] : starts[b + 1]])
    out = torch.empty_like(q)
    seqk = torch.tensor(LENS, dtype=torch.int32)
    ta._forward(q, cache.k, cache.v, cu, seqk, cache.block_tables, D**-0.5, out, cfg=cfg)
    return out


def main() -> int:
    use_row_invariant_interpreter_dot()
    orig = ta._fwd_config
    ta._fwd_config = lambda hd, dt: orig(hd, dt) | {"SPLIT": SPLIT}
    try:
        q, k, v, cu = make_inputs(LENS, HQ, HKV, D, DT, "cpu")
        library = ta._fwd_config(D, DT)
        ref = _varlen(q, k, v, cu, library)
        ref_paged = _paged_full(q, k, v, cu, library)
        assert torch.equal(ref_paged, ref), "library config: paged prefill != varlen"
        for launch in attention_configs.CANDIDATES:
            cfg = library | launch
            assert torch.equal(_varlen(q, k, v, cu, cfg), ref), f"candidate {launch}: varlen bits differ"
            assert torch.equal(_paged_full(q, k, v, cu, cfg), ref), f"candidate {launch}: paged prefill bits differ"
        # each distinct query-side tiling installed as the prefill launch: training == chunked prefill == decode
        saved, saved_dims = ta.PREFILL_LAUNCH_16BIT, ta.PREFILL_LAUNCH_HEAD_DIMS
        saved_decode = ta.DECODE_LAUNCH_16BIT
        ta.PREFILL_LAUNCH_HEAD_DIMS = (ta._block_d(D),)  # the launch entries apply at this test's head dim
        try:
            # each decode tiling of the --decode sweep installed as the decode launch: decode == training forward
            for block_m in sorted({c["BLOCK_M"] for c in attention_configs.DECODE_CANDIDATES}):
                ta.DECODE_LAUNCH_16BIT = saved_decode | {"BLOCK_M": block_m}
                out = run_schedule(q, k, v, LENS, decode_schedule(LENS, [max(1, n // 3) for n in LENS]), 16)
                assert torch.equal(out, ref), f"decode BLOCK_M {block_m}: decode != training forward"
            ta.DECODE_LAUNCH_16BIT = saved_decode
            for block_m in sorted({c["BLOCK_M"] for c in attention_configs.CANDIDATES}):
                ta.PREFILL_LAUNCH_16BIT = saved | {"BLOCK_M": block_m}
                full = ta.attention_varlen(q, k, v, cu, D**-0.5)
                assert torch.equal(full, ref), f"BLOCK_M {block_m}: training forward bits differ"
                for name, sched in {
                    "chunk7": chunk_schedule(LENS, 7),
                    "chunk64": chunk_schedule(LENS, 64),
                    "decode": decode_schedule(LENS, [max(1, n // 3) for n in LENS]),
                }.items():
                    out = run_schedule(q, k, v, LENS, sched, 16)
                    assert torch.equal(out, full), f"BLOCK_M {block_m}: {name} != training forward"
        finally:
            ta.PREFILL_LAUNCH_16BIT, ta.PREFILL_LAUNCH_HEAD_DIMS = saved, saved_dims
            ta.DECODE_LAUNCH_16BIT = saved_decode
        # negative control: another key tile (BLOCK_N) stays correct but changes bits
        other = _varlen(q, k, v, cu, library | {"BLOCK_N": library["BLOCK_N"] // 2})
        exact = reference.attention_varlen(q.double(), k.double(), v.double(), cu, D**-0.5)
        assert (other.double() - exact).abs().max().item() < 2e-2
        assert (ref.double() - exact).abs().max().item() < 2e-2
        assert not torch.equal(other, ref), "negative control: another BLOCK_N gave identical bits"
    finally:
        ta._fwd_config = orig
    print("configs: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
