"""Concatenated projection weights for inference: one matmul for q/k/v and one for gate/up instead of five.

The exact matmul computes an output element from its row of ``x`` and its column of ``w^T`` only, with the same
arithmetic whatever ``N`` is (``rlexact.ops.triton_matmul``: the tile variants differ in BM/BN/BK but not in the
per-element chain, verified bitwise on the GPU), so ``x @ cat([Wq, Wk, Wv]).T`` split by columns is bitwise
``x @ Wq.T``, ``x @ Wk.T``, ``x @ Wv.T``. Fusing therefore changes no bit of the generator's output (rollout ==
trainer still holds; the trainer keeps the separate projections and their autograd) and saves launches and
small-``N`` tiles in decode steps. The concatenated weights are copies: :class:`FusedProjections` is built and
refreshed by the generator while the parameters cannot change (inside one ``generate`` call), and
:func:`use_fused_projections` makes the exactified model use them for the duration of that call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from rlexact import ops
from rlexact.models.exactify import fused_groups
from rlexact.models.state import get_state


@dataclass(frozen=True)
class FusedLinear:
    """``weight [sum(sizes), K]`` (and ``bias``) of several linears with the same input, concatenated in order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]


class FusedProjections:
    """The concatenated q/k/v and gate/up weights of an exactified model (exact kernels only).

    ``table`` maps each attention layer and gated MLP to its :class:`FusedLinear`; modules whose projections differ
    in dtype, device, input size or bias presence are left out (they run unfused), and so are modules where the
    exact matmul would split K differently for the concatenated weight than for one of the projections
    (:func:`rlexact.ops.matmul_k_splits`: e.g. a narrow k/v projection over a wide hidden size), since the fused
    product would then not carry the separate products' bits. :meth:`refresh` copies the
    current parameters into the same buffers, so their addresses (baked into captured CUDA graphs) do not change.
    """

    def __init__(self, model: nn.Module) -> None:
        self.table: dict[nn.Module, FusedLinear] = {}
        self._parts: list[tuple[list[nn.Linear], FusedLinear, tuple]] = []
        for module, linears in fused_groups(model):
            layout = _layout(linears)
            if len({(dtype, device, k, bias) for _, k, dtype, device, bias in layout}) != 1:
                continue  # mixed dtype, device, input size or bias presence: runs unfused
            _, k, dtype, device, has_bias = layout[0]
            sizes = tuple(n for n, *_ in layout)
            if len({ops.matmul_k_splits(n, k, dtype, device) for n in (*sizes, sum(sizes))}) != 1:
                continue  # the fused product's K chain would differ from a projection's: runs unfused
            weight = torch.empty((sum(sizes), k), dtype=dtype, device=device)
            bias_dtype = linears[0].bias.dtype if has_bias else None
            bias = torch.empty(sum(sizes), dtype=bias_dtype, device=device) if has_bias else None
            fused = FusedLinear(weight, bias, sizes)
            self.table[module] = fused
            self._parts.append((linears, fused, layout))
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the current projection weights in."""
        for linears, fused, _ in self._parts:
            torch.cat([lin.weight for lin in linears], out=fused.weight)
            if fused.bias is not None:
                torch.cat([lin.bias for lin in linears], out=fused.bias)

    def matches(self) -> bool:
        """Whether the projections still have the shapes, dtypes, devices and biases the buffers were made for."""
        return all(_layout(linears) == layout for linears, _, layout in self._parts)


def _layout(linears: list[nn.Linear]) -> tuple:
    """``(out_features, in_features, dtype, device, has_bias)`` of each linear: what the fused buffers depend on."""
    return tuple(
        (int(lin.weight.shape[0]), int(lin.weight.shape[1]), lin.weight.dtype, lin.weight.device, lin.bias is not None)
        for lin in linears
    )


@contextlib.contextmanager
def use_fused_projections(model: nn.Module, fused: FusedProjections | None) -> Iterator[None]:
    """Run the exactified ``model``'s attention layers and gated MLPs on ``fused``'s concatenated weights inside the
    block (exact mode, no autograd); ``None`` changes nothing. Restores the previous table on exit."""
    state = get_state(model)
    if state is None:
        raise ValueError("use_fused_projections needs an exactified model: call rlexact.exactify(model) first")
    previous = state.fused
    if fused is not None:
        state.fused = fused.table
    try:
        yield
    finally:
        state.fused = previous
