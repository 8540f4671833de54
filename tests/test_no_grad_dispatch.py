"""The differentiable ops call their kernel directly where autograd records nothing (grad mode off, or no input
requiring grad), and through their ``autograd.Function`` otherwise: the same bits either way, no graph without grad.

CPU, torch backend; the dispatch is the same code for the Triton backend (``rlexact.ops._tracked``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlexact import ops
from rlexact.ops import autograd as ag


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t, hq, hkv, d = 11, 4, 2, 16
    angles = torch.randn(t, d // 2, generator=g)
    return {
        "x": torch.randn(t, 32, generator=g),
        "w": torch.rand(32, generator=g) + 0.5,
        "q": torch.randn(t, hq, d, generator=g),
        "k": torch.randn(t, hkv, d, generator=g),
        "v": torch.randn(t, hkv, d, generator=g),
        "cos": torch.cat([angles.cos(), angles.cos()], -1),
        "sin": torch.cat([angles.sin(), angles.sin()], -1),
        "qw": torch.rand(d, generator=g) + 0.5,
        "kw": torch.rand(d, generator=g) + 0.5,
    }


CU = torch.tensor([0, 4, 11], dtype=torch.int32)
CASES: dict[str, tuple[type, str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]] = {
    "rms_norm": (ag.RMSNormFn, "x", lambda a: ops.rms_norm(a["x"], a["w"], 1e-6)),
    "silu_mul": (ag.GatedMulFn, "x", lambda a: ops.silu_mul(a["x"], a["x"].flip(0))),
    "gelu_tanh_mul": (ag.GatedMulFn, "x", lambda a: ops.gelu_tanh_mul(a["x"], a["x"].flip(0))),
    "qk_norm_rope": (ag.QKNormRopeFn, "q",
                     lambda a: torch.cat([t.flatten() for t in ops.qk_norm_rope(a["q"], a["k"], a["cos"], a["sin"],
                                                                                a["qw"], a["kw"])])),
    "attention_varlen": (ag.AttentionVarlenFn, "q", lambda a: ops.attention_varlen(a["q"], a["k"], a["v"], CU, 0.25)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_no_grad_skips_the_function_with_the_same_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, tracked, call = CASES[name]
    a = _inputs(0)
    a[tracked].requires_grad_()
    with_grad = call(a)  # through the Function: its graph is recorded
    assert with_grad.grad_fn is not None
    a[tracked] = a[tracked].detach()

    def refuse(*args: object) -> None:
        raise AssertionError(f"{fn.__name__}.apply called where autograd records nothing")

    monkeypatch.setattr(fn, "apply", refuse)
    direct = call(a)  # no input requires grad
    assert torch.equal(direct, with_grad.detach()) and direct.grad_fn is None
    a[tracked].requires_grad_()
    with torch.no_grad():  # grad mode off
        assert torch.equal(call(a), direct)
    with pytest.raises(AssertionError, match="apply called"):  # negative control: with grad the Function runs
        call(a)
    b = _inputs(0)
    b[tracked][3] += 0.5
    assert not torch.equal(call(b), direct), "negative control: a changed input must change the output"
