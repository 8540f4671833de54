"""Compile a Triton kernel for an H100/H200 (sm_90) on a CPU-only host, for tests that inspect the generated code."""

from __future__ import annotations


def compile_for_hopper(fn, args: dict, const: dict, pin: bool = True, **options: object):  # noqa: ANN001, ANN201
    """The compiled kernel. ``args`` maps runtime argument names to Triton types, all taken as 16-divisible (what the
    launcher sees for aligned tensors and model-sized integers); ``const`` the constexprs; ``options`` compile options
    (``num_warps``, ``num_stages``, ``launch_pdl``), on top of the library's ``COMPILE_OPTIONS`` (the machine code
    the library's launches compile) unless ``pin`` is False (the installed Triton's defaults)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlexact.ops.triton_shared import COMPILE_OPTIONS

    sig = {**args, **dict.fromkeys(const, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(args))}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    opts = {**COMPILE_OPTIONS, **options} if pin else options
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def compile_gluon_for_hopper(fn, args: dict, const: dict, **options: object):  # noqa: ANN001, ANN201
    """:func:`compile_for_hopper` for a Gluon kernel: ``args`` maps runtime argument names to Triton types (a Gluon
    tensor descriptor's type string for a descriptor argument), pointers and strides taken as 16-divisible."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from rlexact.ops.triton_shared import COMPILE_OPTIONS

    names = fn.arg_names
    sig = {n: args.get(n, "constexpr") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in args and (args[n].startswith("*") or n.startswith("stride"))}  # fmt: skip
    src = GluonASTSource(fn=fn, signature=sig, constexprs={n: const[n] for n in names if n in const}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**COMPILE_OPTIONS, **options})


def tma_desc_type(rows: int, cols: int, block: list[int], layout: object, heads: int = 0) -> str:
    """The type string of a bf16 Gluon TMA descriptor over ``[rows, cols]``, or with ``heads`` over ``[rows, heads,
    cols]``, with boxes of ``block`` in shared-memory ``layout`` (a descriptor argument of
    :func:`compile_gluon_for_hopper`)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    shape = [rows, heads, cols] if heads else [rows, cols]
    t = torch.empty(shape, dtype=torch.bfloat16)
    return mangle_type(TensorDescriptor(t, shape, list(t.stride()), block, layout))


def packed_attention_types(block_n: int = 64, pair_positions: int = 0) -> dict[str, str]:
    """The runtime argument types of a packed Gluon attention launch at Qwen3-1.7B's heads in bf16 (16 query / 8 KV
    heads of 128, two query heads per tile): :func:`rlexact.ops.gluon_attention.packed_args`'s, K/V boxes of
    ``block_n`` keys; with ``pair_positions`` also the paired kernel's (its query and output descriptors, boxes of that
    many positions)."""
    from rlexact.ops import gluon_attention as ga

    kv = tma_desc_type(4096, 1024, [block_n, ga.HEAD_DIM], ga.kv_layout(False))
    types = dict(q_ptr="*bf16", o_ptr="*bf16", lse_ptr="*fp32", delta_ptr="*fp32", k_desc=kv, v_desc=kv,
                 cu_ptr="*i32", num_seqs="i32", qk_scale="fp32", seqk_ptr="*i32", kv_rows="i32")  # fmt: skip
    types |= dict.fromkeys(("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_lt", "stride_lh"), "i32")
    if pair_positions:
        from rlexact.ops import gluon_attention_pair as gp

        box = [pair_positions, 2, ga.HEAD_DIM]
        q = tma_desc_type(4096, ga.HEAD_DIM, box, gp.q_layout(False, pair_positions, 2), heads=16)
        types |= dict(heads="i32", q_desc=q, counter_ptr="*i32", o_desc=q)
    return types


def decode_attention_types() -> dict[str, str]:
    """The runtime argument types of the Gluon paged decode launch (:mod:`rlexact.ops.gluon_decode`) over bf16 caches
    of 16-token pages at Qwen3-1.7B's heads (8 KV heads of 128)."""
    from rlexact.ops import gluon_attention as ga
    from rlexact.ops import gluon_decode as gd

    pages = tma_desc_type(16 * 1024, 1024, [gd.PAGE, ga.HEAD_DIM], ga.kv_layout(False))
    ints = ("n_items", "n_groups", "hp", "group", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt",
            "stride_mem", "width", "n_rows")  # fmt: skip
    plan = dict.fromkeys(("start_ptr", "members_ptr", "tiles_ptr", "count_ptr"), "*i32")
    return (dict(q_ptr="*bf16", o_ptr="*bf16", k_desc=pages, v_desc=pages, bt_ptr="*i32", seqlens_ptr="*i32",
                 ml_ptr="*fp32", sacc_ptr="*fp32", qk_scale="fp32") | plan | dict.fromkeys(ints, "i32"))  # fmt: skip


def gluon_matmul_types() -> dict[str, str]:
    """The runtime argument types of a Gluon matmul launch (:mod:`rlexact.ops.gluon_matmul`) in bf16 128 x 128 tiles:
    ``x [256, 2048]``, ``w [4096, 2048]``."""
    from rlexact.ops import gluon_matmul as gm

    return dict(x_desc=tma_desc_type(256, 2048, [128, gm.BK], gm._smem_layout(128, False)),
                w_desc=tma_desc_type(4096, 2048, [128, gm.BK], gm._smem_layout(128, False)), out_ptr="*bf16", M="i32",
                N="i32", K="i32", stride_om="i32", group_m="i32")  # fmt: skip
