"""Router mismatch of Mixture-of-Experts models: which experts each token was sent to, on two numeric paths.

:class:`RouterRecorder` records, through forward hooks on every MoE router of a model (``rlexact.models.moe``), the
expert ids each router selected for chosen rows of a packed forward; :func:`router_disagreement` compares two such
recordings (the rollout side and the trainer side) as expert *sets*: a token disagrees in a layer when the sets of
its ``k`` selected experts differ there (the order of the top-k slots is ignored), and disagrees overall when it does
in at least one MoE layer. :class:`~rlexact.callbacks.MismatchProbe` logs the result (docs/metrics.md, docs/moe.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from rlexact.models.moe import router_modules, router_output

__all__ = ["RouterDisagreement", "RouterRecorder", "router_disagreement"]

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class RouterDisagreement:
    """Expert-set disagreement between two recordings of the same tokens.

    Attributes:
        num_tokens: tokens compared.
        token_disagree: tokens whose expert set differs in at least one MoE layer (counted once per token).
        layer_disagree: per MoE layer (recording order), tokens whose expert set differs in that layer.
    """

    num_tokens: int
    token_disagree: int
    layer_disagree: tuple[int, ...]

    @property
    def token_disagree_frac(self) -> float:
        """``token_disagree / num_tokens`` (0.0 without tokens)."""
        return self.token_disagree / self.num_tokens if self.num_tokens else 0.0

    @property
    def layer_disagree_frac(self) -> tuple[float, ...]:
        """``layer_disagree[i] / num_tokens`` per MoE layer (0.0 without tokens)."""
        return tuple(c / self.num_tokens if self.num_tokens else 0.0 for c in self.layer_disagree)


def router_disagreement(
    rollout_ids: Sequence[torch.Tensor], trainer_ids: Sequence[torch.Tensor]
) -> RouterDisagreement:
    """Compare the selected experts of the same ``N`` tokens on two paths, as sets.

    Args:
        rollout_ids: one ``[N, k]`` integer tensor per MoE layer: the experts each token was routed to.
        trainer_ids: the same layers and tokens on the other path.

    Each row is sorted before comparing, so ``[3, 1]`` and ``[1, 3]`` are the same set. Raises ``ValueError`` when the
    layer counts or the shapes of a layer differ."""
    if len(rollout_ids) != len(trainer_ids):
        raise ValueError(f"router_disagreement: {len(rollout_ids)} rollout layers vs {len(trainer_ids)} trainer layers")
    if not rollout_ids:
        return RouterDisagreement(num_tokens=0, token_disagree=0, layer_disagree=())
    n = rollout_ids[0].shape[0]
    any_layer = torch.zeros(n, dtype=torch.bool, device=rollout_ids[0].device)
    per_layer = []
    for i, (a, b) in enumerate(zip(rollout_ids, trainer_ids)):
        if a.dim() != 2 or a.shape != b.shape or a.shape[0] != n:
            raise ValueError(
                f"router_disagreement: layer {i} has rollout ids {tuple(a.shape)} and trainer ids {tuple(b.shape)}; "
                f"expected both [{n}, k]"
            )
        differs = (a.sort(dim=-1).values != b.to(a.device).sort(dim=-1).values).any(dim=-1)
        per_layer.append(int(differs.sum()))
        any_layer |= differs
    return RouterDisagreement(num_tokens=n, token_disagree=int(any_layer.sum()), layer_disagree=tuple(per_layer))


def _layer_label(name: str, ordinal: int) -> str:
    """The decoder layer index in a router's qualified name (``model.layers.3.mlp.gate`` -> ``"3"``), else the
    router's ordinal among the model's routers."""
    found = _LAYER_INDEX.search(name)
    return found.group(1) if found else str(ordinal)


class RouterRecorder:
    """Context manager recording the expert ids selected by every MoE router of ``model`` for chosen rows.

    Inside the block, call :meth:`select` before each packed forward with the rows (indices into that forward's
    ``[T]`` token stream) to keep; every router call appends those rows of its ``ids [T, k]`` output to its layer's
    recording, so :attr:`ids` holds one ``[N, k]`` tensor per MoE layer with the selected rows of all forwards in
    call order. A forward made without a preceding :meth:`select` raises ``RuntimeError`` (one selection per
    forward). Hooks are removed on exit.

    Args:
        model: the model whose routers to hook (:func:`rlexact.models.moe.router_modules`); none for a dense model.
    """

    def __init__(self, model: nn.Module) -> None:
        routers = router_modules(model)
        self.labels: tuple[str, ...] = tuple(_layer_label(name, i) for i, (name, _) in enumerate(routers))
        """One label per MoE layer: its decoder layer index (see the metric names in docs/metrics.md)."""
        self._routers = [m for _, m in routers]
        self._parts: list[list[torch.Tensor]] = [[] for _ in routers]
        self._rows: torch.Tensor | None = None
        self._pending: set[int] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> RouterRecorder:
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self._routers)]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def select(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` (int64 indices into the next forward's token stream) of the next forward's routers."""
        if self._pending:
            raise RuntimeError(f"RouterRecorder: routers {sorted(self._pending)} did not run since the last select")
        self._rows = rows
        self._pending = set(range(len(self._routers)))

    @property
    def ids(self) -> list[torch.Tensor]:
        """One ``[N, k]`` tensor of selected expert ids per MoE layer (``[0, 0]`` before any selected row)."""
        if self._pending:
            raise RuntimeError(f"RouterRecorder: routers {sorted(self._pending)} did not run since the last select")
        return [torch.cat(p) if p else torch.zeros(0, 0, dtype=torch.int64) for p in self._parts]

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if index not in self._pending or self._rows is None:
                raise RuntimeError(
                    "RouterRecorder: a router ran without a selection; call select(rows) before each forward"
                )
            ids = router_output(module, output, "ids") if isinstance(output, tuple) and len(output) == 3 else None
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
                raise RuntimeError(
                    f"RouterRecorder: router {self.labels[index]} returned {type(output).__name__}; expected "
                    "the logits, weights and integer ids [T, k] that transformers' TopKRouter returns"
                )
            self._pending.discard(index)
            self._parts[index].append(ids[self._rows.to(ids.device)].detach())

        return hook
