"""Models given wrapped by ``torch.compile``.

rlexact never calls a model's ``forward``: the generator and the trainer run its decoder through their own packed
paths and exact kernels. A ``torch.compile`` wrapper (``OptimizedModule``) would therefore compile nothing, and its
``_orig_mod.`` prefix would leak into checkpoints, so every entry point takes the module it wraps, with a warning.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

__all__ = ["uncompiled"]


def uncompiled(model: nn.Module) -> nn.Module:
    """``model``, or the module a ``torch.compile`` wrapper holds (warning that the compilation has no effect)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile; absent, nothing is compiled
    if eval_frame is None or not isinstance(model, eval_frame.OptimizedModule):
        return model
    original = model._orig_mod
    warnings.warn(
        f"rlexact was given a torch.compile'd {type(original).__name__}: rollouts and log-probs run its decoder "
        "through rlexact's packed paths and exact kernels, never through forward(), so the compilation has no effect; "
        "using the original module (pass it directly to silence this)",
        UserWarning,
        stacklevel=3,
    )
    return original
