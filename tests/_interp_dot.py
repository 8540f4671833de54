"""A row-invariant ``tl.dot`` for the Triton interpreter, shared by the interpreter check scripts."""

from __future__ import annotations


def use_row_invariant_interpreter_dot(k_step: int | None = None) -> None:
    """Make the interpreter's ``tl.dot`` row-invariant, like tensor-core MMAs on the GPU.

    The interpreter runs ``tl.dot`` as one ``np.matmul``, and numpy's BLAS (OpenBLAS sgemm) rounds a row differently
    depending on its row index within the matrix (edge micro-kernels). A row sits at another tile row in a small
    batch than in a large one, so batch-invariance checks would fail for reasons that do not exist on the GPU. Each
    row is multiplied on its own instead (a batch of one-row products takes one code path for every row).

    ``k_step``: also model the MMA's K chain: the product is accumulated onto ``d`` in steps of ``k_step`` along K
    (each step rounded to fp32 before the next), so a dot over ``K`` equals two chained dots over its halves, as on
    the GPU, where one dot is a chain of fixed-K MMA instructions.
    """
    import numpy as np
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        step = k_step or a.data.shape[1]
        acc = d.data
        for k0 in range(0, a.data.shape[1], step):
            part = np.matmul(a.data[:, None, k0 : k0 + step], b.data[k0 : k0 + step], dtype=d.data.dtype)[:, 0, :]
            acc = part + acc
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
