"""A row-invariant ``tl.dot`` for the Triton interpreter, shared by the interpreter check scripts."""

from __future__ import annotations


def use_row_invariant_interpreter_dot() -> None:
    """Make the interpreter's ``tl.dot`` row-invariant, like tensor-core MMAs on the GPU.

    The interpreter runs ``tl.dot`` as one ``np.matmul``, and numpy's BLAS (OpenBLAS sgemm) rounds a row differently
    depending on its row index within the matrix (edge micro-kernels). A row sits at another tile row in a small
    batch than in a large one, so batch-invariance checks would fail for reasons that do not exist on the GPU. Each
    row is multiplied on its own instead (a batch of one-row products takes one code path for every row).
    """
    import numpy as np
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = np.matmul(a.data[:, None, :], b.data, dtype=d.data.dtype)[:, 0, :]
        return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
