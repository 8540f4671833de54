"""Mixture-of-Experts (Qwen3-MoE, Qwen2-MoE, Mixtral): exact router and grouped expert GEMM, end to end through the
stack.

* CPU (torch twin): correctness against unmodified transformers in fp32; rollout == trainer bitwise (decode, chunked
  prefill, batch sizes) in fp32 and bf16 with native-kernel negative controls; batch invariance of the grouped GEMM and
  of the whole expert MLP with its negative control; router ties; gradients against float64 and a deterministic
  backward; the RLModule exact first mini-step with ratio exactly 1 and the ``save_pretrained`` round trip.
* CPU (Triton interpreter, subprocess ``tests/_interp_moe.py``): the Triton router and grouped GEMM on tiny shapes.
* GPU (``@pytest.mark.gpu``): grouped GEMM vs a torch per-expert reference and batch invariance at Qwen3-30B-A3B
  expert shapes; bitwise rollout == trainer (CUDA graphs on) on a 2-layer model with Qwen3-30B-A3B layer shapes.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import warnings
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import rlexact
from hopper_compile import compile_for_hopper
from interpreter_jobs import failure_report
from models import MOE_VOCAB as VOCAB
from models import addition_items, prompts_for, tiny_moe, tiny_moe_rl_config
from ranks import ranks_report, run_ranks
from rlexact import ops
from rlexact.callbacks.base import RLCallback
from rlexact.models.moe import ROUTER_OUTPUTS, check_moe, router_output, router_outputs
from rlexact.ops.moe import moe_plan
from rlexact.rollout import Generator, SamplingParams

HERE = Path(__file__).resolve().parent
HAS_TRITON = importlib.util.find_spec("triton") is not None


def assert_exact(model: torch.nn.Module, outs: list, temperature: float = 1.0) -> None:
    ref = rlexact.sequence_logprobs(model, [o.sequence for o in outs], temperature)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert len(o.token_ids) > 0
        got = r[-len(o.token_ids) :].to(o.logprobs.device)
        assert torch.equal(o.logprobs, got), f"completion {i}: rollout log-probs != trainer"


@pytest.fixture(scope="module")
def moe_fp32() -> torch.nn.Module:
    return rlexact.exactify(tiny_moe())


@pytest.fixture(scope="module")
def moe_bf16() -> torch.nn.Module:
    model = tiny_moe(experts=64, top_k=8, dtype=torch.bfloat16, decoder_sparse_step=2, mlp_only_layers=[], seed=1)
    return rlexact.exactify(model)


# ----------------------------------------------------------------------------------------------------------------------
# correctness against transformers
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # 8 experts top-2, layer 1 dense
        dict(experts=64, top_k=8, decoder_sparse_step=2, mlp_only_layers=[]),  # layers 1 sparse, 0 and 2 dense
        dict(arch="qwen2_moe", experts=8, top_k=2, hidden=64),  # shared expert with its sigmoid gate
        dict(norm_topk_prob=False),
        dict(arch="mixtral", experts=8, top_k=2),  # every layer sparse; fp32 routing weights
        dict(arch="granitemoe", experts=8, top_k=2),  # every layer sparse; softmax over the top-k logits
    ],
    ids=["qwen3moe-8x2", "qwen3moe-64x8-sparse-step-2", "qwen2moe", "no-topk-norm", "mixtral", "granitemoe"],
)
def test_forward_matches_transformers_fp32(kw: dict) -> None:
    kw = dict(kw)
    arch = kw.pop("arch", "qwen3_moe")
    norm = kw.pop("norm_topk_prob", None)
    ref = tiny_moe(arch, **kw)
    if norm is not None:
        for m in ref.modules():
            if hasattr(m, "norm_topk_prob"):
                m.norm_topk_prob = norm
    model = rlexact.exactify(copy.deepcopy(ref))
    kinds = {type(getattr(layer, "mlp", None) or layer.block_sparse_moe).__name__ for layer in model.model.layers}
    assert len(kinds) == (2 if arch.startswith("qwen") else 1)  # the Qwen models mix sparse and dense layers
    ids = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids).logits
        with rlexact.use_kernels(model, "native"):
            native = model(ids).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert torch.equal(native, want)  # native mode runs the stock forwards
    assert not torch.equal(got, want)  # and exact mode really runs other kernels
    rlexact.exactify(model, enabled=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # every MoE patch removed


# ----------------------------------------------------------------------------------------------------------------------
# rollout == trainer
# ----------------------------------------------------------------------------------------------------------------------


def test_rollout_equals_trainer_fp32(moe_fp32) -> None:
    gen = Generator(moe_fp32, block_size=8)
    outs = []
    for size in (1, 11):
        outs += gen.generate(prompts_for(size, VOCAB, seed=size), SamplingParams(max_new_tokens=4, seed=size))
    assert_exact(moe_fp32, outs)


def test_rollout_equals_trainer_qwen2_moe_bf16() -> None:
    """Qwen2-MoE: shared expert with its sigmoid gate, qkv bias, bf16."""
    model = rlexact.exactify(tiny_moe("qwen2_moe", hidden=64, dtype=torch.bfloat16, seed=3))
    outs = Generator(model, max_num_batched_tokens=16, block_size=4).generate(
        prompts_for(7, VOCAB, lo=2, hi=20, seed=5), SamplingParams(max_new_tokens=5, seed=6)
    )
    assert_exact(model, outs)


@pytest.mark.parametrize(("arch", "weights_dtype"), [("mixtral", torch.float32), ("granitemoe", torch.bfloat16)])
def test_rollout_equals_trainer_renormalizing_routers_bf16(arch: str, weights_dtype: torch.dtype) -> None:
    """Mixtral and Granite-MoE: every layer sparse, routers that always renormalize the top-k (weights in fp32 for
    Mixtral, in the hidden dtype for Granite, as transformers' routers return them), bf16."""
    model = rlexact.exactify(tiny_moe(arch, experts=8, top_k=2, hidden=64, dtype=torch.bfloat16, seed=4))
    layer = model.model.layers[0]
    router = layer.mlp.gate if arch == "mixtral" else layer.block_sparse_moe.router
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        logits, weights, ids = (router_output(router, router(x), k) for k in ROUTER_OUTPUTS)
        with rlexact.use_kernels(model, "native"):
            stock = dict(zip(router_outputs(type(router)), router(x)))
    assert logits.dtype == torch.bfloat16 and weights.dtype == stock["weights"].dtype == weights_dtype
    assert torch.equal(ids, stock["ids"]) and logits.shape == stock["logits"].shape == (5, 8)
    tol = 1e-6 if weights_dtype == torch.float32 else 8e-3  # one bf16 rounding of weights below 1
    torch.testing.assert_close(weights, stock["weights"], atol=tol, rtol=tol)
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(5), atol=tol, rtol=0)
    prompts, params = prompts_for(7, VOCAB, lo=2, hi=20, seed=7), SamplingParams(max_new_tokens=5, seed=8)
    assert_exact(model, Generator(model, max_num_batched_tokens=16, block_size=4).generate(prompts, params))
    native = Generator(model, kernels="native", max_num_batched_tokens=16, block_size=4).generate(prompts, params)
    with pytest.raises(AssertionError, match="rollout log-probs != trainer"):  # negative control
        assert_exact(model, native)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "granitemoe"])
def test_transformers_generate_decode_equals_full_forward(arch: str) -> None:
    """transformers' ``generate`` (DynamicCache, left padding) on an exactified MoE model: every decode step's logits
    equal the full forward's bitwise; negative control: the stock kernels' do not."""
    from test_no_fallback import _decode_vs_full

    model = rlexact.exactify(tiny_moe(arch, dtype=torch.bfloat16, seed=5))
    equal, total = _decode_vs_full(model, "cpu")
    assert equal == total == 30
    with rlexact.use_kernels(model, "native"):
        equal, total = _decode_vs_full(model, "cpu")
    assert equal < total


@pytest.mark.parametrize("budget", [13, 64])
def test_rollout_equals_trainer_bf16_chunked(moe_bf16, budget: int) -> None:
    gen = Generator(moe_bf16, max_num_batched_tokens=budget, max_num_seqs=6, block_size=4)
    outs = gen.generate(prompts_for(6, VOCAB, lo=3, hi=30, seed=budget), SamplingParams(max_new_tokens=5, seed=2))
    assert_exact(moe_bf16, outs, temperature=1.0)


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_native_kernels_differ_from_trainer(moe_fp32, moe_bf16, which: str) -> None:
    """Negative control: the stock transformers MoE path is not bitwise equal to the exact trainer path."""
    model = moe_fp32 if which == "fp32" else moe_bf16
    outs = Generator(model, kernels="native", block_size=4).generate(
        prompts_for(8, VOCAB, lo=5, hi=30, seed=41), SamplingParams(max_new_tokens=8, seed=4)
    )
    ref = rlexact.sequence_logprobs(model, [o.sequence for o in outs])
    diffs = [(o.logprobs - r[-len(o.token_ids) :]).abs().max().item() for o, r in zip(outs, ref)]
    assert max(diffs) > 0, "native MoE path unexpectedly bitwise equal to the exact trainer path"
    assert rlexact.models.get_state(model).kernels == "exact"


# ----------------------------------------------------------------------------------------------------------------------
# batch invariance
# ----------------------------------------------------------------------------------------------------------------------


def _expert_weights(e: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _naive_grouped(x: torch.Tensor, w: torch.Tensor, eids: torch.Tensor) -> torch.Tensor:
    """Negative control: one torch matmul per expert over all of its rows (the row count changes the kernel)."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype)
    for e in range(w.shape[0]):
        rows = (eids == e).nonzero()[:, 0]
        if rows.numel():
            out[rows] = x[rows] @ w[e].T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_batch_invariant(dtype: torch.dtype) -> None:
    """Row results are identical alone and inside batches of 1..64 rows with any expert loads, and equal a
    float64 reference up to one rounding."""
    gen = torch.Generator().manual_seed(1)
    w = _expert_weights(6, 40, 56, dtype)
    pool = torch.randn(70, 56, generator=gen).to(dtype)
    eids = torch.randint(0, 6, (70,), generator=gen)
    eids[:40] = 2  # a heavily loaded expert
    singles = [ops.grouped_matmul(pool[i : i + 1], w, eids[i : i + 1]) for i in range(70)]
    ref = torch.einsum("mk,mnk->mn", pool.double(), w[eids].double())
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(torch.cat(singles).double(), ref, atol=1e-4, rtol=rtol)
    for m in (1, 2, 3, 17, 40, 64):
        for shift in (0, 31):
            idx = [(shift + 7 * j) % 70 for j in range(m)]
            out = ops.grouped_matmul(pool[idx], w, eids[idx])
            for pos, i in enumerate(idx):
                assert torch.equal(out[pos : pos + 1], singles[i]), f"row {i} at {pos} of {m} differs"


def test_grouped_matmul_negative_control() -> None:
    """A per-expert torch matmul over a varying number of rows is not batch-invariant on CPU in fp32."""
    gen = torch.Generator().manual_seed(2)
    w = _expert_weights(8, 64, 64, torch.float32)
    x = torch.randn(64, 64, generator=gen)
    eids = torch.randint(0, 8, (64,), generator=gen)
    batched = _naive_grouped(x, w, eids)
    singles = torch.cat([_naive_grouped(x[i : i + 1], w, eids[i : i + 1]) for i in range(64)])
    assert not torch.equal(batched, singles)
    exact_singles = torch.cat([ops.grouped_matmul(x[i : i + 1], w, eids[i : i + 1]) for i in range(64)])
    assert torch.equal(ops.grouped_matmul(x, w, eids), exact_singles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_token_independent_of_batch(moe_fp32, moe_bf16, dtype: torch.dtype) -> None:
    """A token's MoE-layer output (router + experts + combine) is identical alone and among 1..64 other tokens."""
    model = moe_fp32 if dtype == torch.float32 else moe_bf16
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    h = model.config.hidden_size
    pool = torch.randn(64, h, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        singles = [block(pool[i : i + 1][None])[0] for i in range(64)]
        for m in (2, 9, 64):
            out = block(pool[:m][None])[0]
            assert all(torch.equal(out[i : i + 1], singles[i]) for i in range(m))


def test_plan_groups_pairs_stably() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3], [1, 0]])
    plan = moe_plan(ids, 5)
    assert plan.counts.tolist() == [2, 4, 1, 3, 0]
    assert plan.order.tolist() == [3, 9, 1, 2, 6, 8, 5, 0, 4, 7]  # ascending pair index within an expert
    assert plan.num_rows == 10


# ----------------------------------------------------------------------------------------------------------------------
# router
# ----------------------------------------------------------------------------------------------------------------------


def test_router_ties_go_to_lowest_expert() -> None:
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 1.0], [2.0, 1.0, 2.0, 2.0], [-1.0, 5.0, -1.0, 5.0]]
    )
    weights, ids = ops.moe_router(logits, 2, True)
    assert ids.tolist() == [[0, 1], [1, 2], [0, 2], [1, 3]]
    assert torch.equal(weights[0], torch.tensor([0.5, 0.5]))
    w_un, ids_un = ops.moe_router(logits, 3, False)
    assert ids_un.tolist() == [[0, 1, 2], [1, 2, 0], [0, 2, 3], [1, 3, 0]]
    torch.testing.assert_close(w_un, torch.softmax(logits, -1).gather(-1, ids_un))


def test_router_ties_in_a_model_layer() -> None:
    """Two experts with identical router rows always tie: expert 5 is never chosen without expert 2 in an earlier
    top-k slot."""
    model = rlexact.exactify(tiny_moe(seed=5))
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight[5] = gate.weight[2]
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, ids = gate(x)
    rows = [r for r in ids.tolist() if 5 in r]
    assert rows, "the tied experts were never selected; change the seed"
    assert all(2 in r and r.index(2) < r.index(5) for r in rows)


# ----------------------------------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------------------------------


def _ref_moe(x, logits, top_k, norm, gu, down):  # noqa: ANN001, ANN202 - float64 reference of router + experts
    probs = torch.softmax(logits, -1)
    _, ids = torch.topk(probs, top_k, -1)
    w = probs.gather(-1, ids)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    inter = down.shape[2]
    h = torch.einsum("tkoh,th->tko", gu[ids], x)
    act = F.silu(h[..., :inter]) * h[..., inter:]
    y = torch.einsum("tkhi,tki->tkh", down[ids], act)
    return (w[..., None] * y).sum(1)


@pytest.mark.parametrize("norm", [True, False])
def test_gradients_match_float64(norm: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    t, h, e, inter, k = 21, 24, 6, 10, 3
    x = torch.randn(t, h, generator=gen)
    router = torch.randn(e, h, generator=gen)
    gu = torch.randn(e, 2 * inter, h, generator=gen) * 0.3
    down = torch.randn(e, h, inter, generator=gen) * 0.3
    g_out = torch.randn(t, h, generator=gen)

    def run(dtype: torch.dtype, exact: bool) -> list[torch.Tensor]:
        leaves = [p.detach().to(dtype).clone().requires_grad_(True) for p in (x, router, gu, down)]
        xx, rr, gg, dd = leaves
        if exact:
            wts, ids = ops.moe_router(ops.matmul(xx, rr), k, norm)
            out = ops.moe_experts(xx, ids, wts, gg, dd)
        else:
            out = _ref_moe(xx, xx @ rr.T, k, norm, gg, dd)
        out.backward(g_out.to(dtype))
        return [out.detach()] + [p.grad for p in leaves]

    got, ref = run(torch.float32, True), run(torch.float64, False)
    for name, a, b in zip(["out", "x", "router", "gate_up", "down"], got, ref):
        scale = b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= 1e-5 * max(scale, 1.0), name
    again = run(torch.float32, True)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # deterministic backward


# ----------------------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------------------


def test_bad_inputs() -> None:
    w1, w2 = torch.zeros(4, 10, 8), torch.zeros(4, 8, 5)
    x = torch.zeros(3, 8)
    ids, wts = torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="gate_up_proj"):
        ops.moe_experts(x, ids, wts, torch.zeros(4, 10, 7), w2)
    with pytest.raises(ValueError, match="ids and weights"):
        ops.moe_experts(x, ids[:2], wts, w1, w2)
    with pytest.raises(ValueError, match="2 \\* down_proj"):
        ops.moe_experts(x, ids, wts, torch.zeros(4, 9, 8), w2)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_router(torch.zeros(3, 4), 5, True)
    model = tiny_moe()
    model.model.layers[0].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match="fused gate_up_proj"):
        rlexact.exactify(model)
    assert not rlexact.is_exactified(model)


def test_unrecognized_sparse_blocks_are_errors() -> None:
    """A sparse block whose router is not transformers 5.x's (4.x's ``nn.Linear`` gate and per-expert modules) and
    Mixtral's router jitter are refused before anything is patched; jitter off, the same model is exactified."""
    model = tiny_moe()
    block = model.model.layers[0].mlp
    block.gate = torch.nn.Linear(48, 8, bias=False)
    with pytest.raises(ValueError, match="Qwen3MoeSparseMoeBlock.*gate Linear.*transformers>=5"):
        rlexact.exactify(model)
    assert not rlexact.is_exactified(model)
    model = tiny_moe("mixtral", router_jitter_noise=0.01)
    with pytest.raises(ValueError, match="router_jitter_noise=0.01 .*router_jitter_noise=0.0"):
        rlexact.exactify(model)
    assert not rlexact.is_exactified(model)
    for m in model.modules():
        if hasattr(m, "jitter_noise"):
            m.jitter_noise = 0.0
    assert rlexact.is_exactified(rlexact.exactify(model))


class _IdsFirst(torch.nn.Module):
    """Mixin over a stock ``*TopKRouter`` class (``_stock``): its outputs in Granite-MoE's order before
    transformers 5.21."""

    _stock: type

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = dict(zip(router_outputs(self._stock), self._stock.forward(self, hidden_states)))
        top_k_index, top_k_weights, router_logits = out["ids"], out["weights"], out["logits"]
        return top_k_index, top_k_weights, router_logits


class _LogitsFirst(_IdsFirst):
    """The same outputs in the order of every router since transformers 5.21."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        top_k_index, top_k_weights, router_logits = super().forward(hidden_states)
        return router_logits, top_k_weights, top_k_index


class _Unnamed(_IdsFirst):
    """Outputs whose names do not say which is which (negative control)."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b, c = super().forward(hidden_states)
        return a, b, c


@pytest.mark.parametrize(("mixin", "order"), [(_IdsFirst, ("ids", "weights", "logits")),
                                              (_LogitsFirst, ("logits", "weights", "ids"))])  # fmt: skip
def test_exact_router_returns_in_the_stock_classs_order(mixin: type, order: tuple[str, ...]) -> None:
    """Granite-MoE's router returned ``(ids, weights, logits)`` before transformers 5.21 and ``(logits, weights,
    ids)`` since, and the stock block unpacks its own version's order: the exact router returns its outputs in the
    order of the stock class's return statement (:func:`router_outputs`), the ids equal to the stock router's.
    Negative control: a return whose names do not say which output is which is refused before anything is
    patched."""
    model = tiny_moe("granitemoe", experts=8, top_k=2, hidden=64, seed=4)
    router = model.model.layers[0].block_sparse_moe.router
    stock = type(router)
    router.__class__ = type(stock.__name__, (mixin, stock), {"_stock": stock})
    assert router_outputs(type(router)) == order
    rlexact.exactify(model)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = router(x)
        with rlexact.use_kernels(model, "native"):
            want = router(x)
    assert [t.shape for t in out] == [t.shape for t in want]
    assert [t.dtype for t in out] == [t.dtype for t in want]
    ids = router_output(router, out, "ids")
    assert ids.dtype == torch.int64 and ids.shape == (5, 2) and torch.equal(ids, router_output(router, want, "ids"))
    assert router_output(router, out, "logits").shape == (5, 8)

    bad = tiny_moe("granitemoe", experts=8, top_k=2, hidden=64, seed=4)
    router = bad.model.layers[0].block_sparse_moe.router
    router.__class__ = type(stock.__name__, (_Unnamed, stock), {"_stock": stock})
    with pytest.raises(ValueError, match=r"returns \(a, b, c\).*not supported"):
        check_moe(bad)
    with pytest.raises(ValueError, match="not supported"):
        rlexact.exactify(bad)
    assert not rlexact.is_exactified(bad)


# ----------------------------------------------------------------------------------------------------------------------
# RLModule and export
# ----------------------------------------------------------------------------------------------------------------------


class _Check(RLCallback):
    needs_trainer_logprobs = True

    def __init__(self) -> None:
        self.rollout_equal: list[bool] = []
        self.first_ratio_one: list[bool] = []

    def on_rl_batch(self, trainer, pl_module, batch) -> None:  # noqa: ANN001
        m = batch.response_mask
        self.rollout_equal.append(torch.equal(batch.trainer_logprobs[m], batch.rollout_logprobs[m]))

    def on_rl_minibatch(self, trainer, pl_module, minibatch, logprobs, epoch, step) -> None:  # noqa: ANN001
        if epoch == 0 and step == 0:
            m = minibatch.response_mask
            self.first_ratio_one.append(bool((torch.exp(logprobs[m] - minibatch.old_logprobs[m]) == 1.0).all()))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "granitemoe"])
def test_rlmodule_exact_first_ministep_and_export(tmp_path: Path, arch: str) -> None:
    from rlexact.char_tokenizer import build_char_tokenizer
    from rlexact.export import save_pretrained
    from rlexact.module import RLModule

    tok = build_char_tokenizer()
    cfg = tiny_moe_rl_config(len(tok), mlp_only_layers=(0,), arch=arch)
    items = addition_items(tok, 4)
    module = RLModule(
        model_config=cfg, tokenizer=tok, dtype="bfloat16",
        reward=lambda p, c, a: [float(len(x) % 3) for x in c],
        rollout={"n": 3, "max_new_tokens": 5}, algorithm={"old_logprob_mode": "exact"}, optim={"lr": 1e-3},
    )  # fmt: skip
    check = _Check()
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[check],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*val_dataloader.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        trainer.fit(module, DataLoader(items, batch_size=2, collate_fn=list))
    assert check.rollout_equal == [True, True]
    assert check.first_ratio_one == [True, True]

    out = save_pretrained(module, tmp_path / "hf")
    assert "rlexact" not in json.dumps(json.loads((Path(out) / "config.json").read_text()))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    a, b = module.model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    rlexact.exactify(reloaded)
    seqs = prompts_for(3, len(tok), lo=4, hi=12, seed=9)
    assert all(torch.equal(p, q) for p, q in zip(rlexact.sequence_logprobs(module.model, seqs),
                                                 rlexact.sequence_logprobs(reloaded, seqs)))  # fmt: skip


@pytest.mark.parametrize(("kind", "cls"), [("moe", "Qwen3MoeForCausalLM"), ("mixtral", "MixtralForCausalLM")])
def test_fsdp2_two_ranks_moe(tmp_path: Path, kind: str, cls: str) -> None:
    """FSDP2 (``fully_shard`` per decoder layer, 3-D expert weights sharded on the expert dim; 2 CPU ranks, gloo,
    bf16 compute over fp32 master weights): rollout == trainer and ratio exactly 1 on every rank, the generator's
    scoring == the trainer after updates, identical parameters on both ranks, export. Runs ``tests/_fsdp_worker.py``."""
    proc = run_ranks(HERE / "_fsdp_worker.py", str(tmp_path), "bf16-mixed", "exact", kind)
    assert proc.returncode == 0, ranks_report(proc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["world_size"] == 2 and res["is_fsdp"]
        assert res["rollout_equal"] == [True] * len(res["rollout_equal"]) and res["rollout_equal"]
        assert res["first_ratio_one"] == [True] * len(res["first_ratio_one"])
        assert res["post_update_equal"] == [True] * len(res["post_update_equal"])
    assert results[0]["param_hash"] == results[1]["param_hash"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(reloaded).__name__ == cls


# ----------------------------------------------------------------------------------------------------------------------
# Triton interpreter (subprocess)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.interpreter("tests/_interp_moe.py")
def test_interpreter_moe_kernels(interpreter_run: subprocess.CompletedProcess) -> None:
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert "moe ok" in interpreter_run.stdout


@pytest.mark.interpreter("tests/_interp_moe_configs.py")
def test_interpreter_grouped_candidates_bitwise(interpreter_run: subprocess.CompletedProcess) -> None:
    """Every grouped-GEMM configuration the sweep may choose gives the reference configuration's bits (with a
    reduction-order negative control); see ``tests/_interp_moe_configs.py``."""
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert "moe configs ok" in interpreter_run.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_grouped_row_classes_and_table() -> None:
    """Row classes depend on shapes only and grow with rows per expert; the library table's entries are sweep
    candidates (so they are covered by the bitwise interpreter check) and decode keeps 64-row tiles."""
    from rlexact.ops import triton_moe as tm

    assert [tm.row_class(t * 8, 128) for t in (1, 64, 256, 1024, 16384)] == ["decode", "decode", "decode", "mid",
                                                                              "large"]  # fmt: skip
    cands = set(tm.grouped_candidates())
    assert set(tm._HOPPER_16BIT) == {name for name, _ in tm.ROW_CLASSES}
    assert all(cfg in cands for cfg in tm._HOPPER_16BIT.values())
    assert tm._HOPPER_16BIT["decode"].BM == 64
    with pytest.raises(ValueError, match="w_load"):
        tm.GroupedConfig(64, 128, 64, 4, 4, w_load="tma")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_compile_for_hopper() -> None:
    """The MoE kernels compile for an H100/H200 (sm_90) on a CPU-only machine; the GEMMs use wgmma with pipelined
    asynchronous loads (catches GPU-only compile errors and silent loss of pipelining in CPU CI)."""
    pytest.importorskip("triton.backends.nvidia")
    from rlexact.ops import triton_moe as tm

    p, i = "*bf16", "i32"
    gemm = dict(a_ptr=p, w_ptr=p, o_ptr=p, gather_ptr="*i64", scatter_ptr="*i64", counts_ptr="*i64", E=i, N=i, K=i,
                stride_am=i, stride_we=i, stride_wn=i, stride_om=i, tiles_m=i, tiles_n=i)  # fmt: skip
    flags = dict(UPCAST=False, IEEE=False, RNE_FIX=False)
    for gather in (True, False):
        # a host TMA descriptor is a launch-time argument type: its tiles are compiled through the device-descriptor
        # variant, which has the same body apart from where the descriptor is built
        table = {replace(c, w_load="tma_device") if c.w_load == "tma_host" else c for c in tm._HOPPER_16BIT.values()}
        for cfg in {*table, *[c for c in tm.grouped_candidates() if c.w_load == "tma_device"]}:
            const = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, BLOCK_E=128, GROUP_M=cfg.group_m, EVEN_K=cfg.even_k,
                         W_DESC=tm._W_LOADS[cfg.w_load], GATHER=gather, GATHER_DIV=8, SCATTER=not gather,
                         ROWWISE=False)  # fmt: skip
            k = compile_for_hopper(tm._grouped_mm_kernel, gemm, {**const, **flags}, num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages)  # fmt: skip
            assert "warp_group_dot" in k.asm["ttgir"], cfg
            assert "async_copy_global_to_local" in k.asm["ttgir"] or "async_tma_copy" in k.asm["ttgir"], cfg
    wgrad = dict(g_ptr=p, a_ptr=p, o_ptr=p, gather_ptr="*i64", counts_ptr="*i64", E=i, N=i, K=i, stride_gm=i,
                 stride_am=i, tiles_k=i)  # fmt: skip
    const = dict(BR=64, BN=128, BK=128, BLOCK_E=128, GATHER=True, GATHER_DIV=8)
    k = compile_for_hopper(tm._grouped_wgrad_kernel, wgrad, {**const, **flags}, num_warps=8, num_stages=3)
    assert "warp_group_dot" in k.asm["ttgir"] and "async_copy_global_to_local" in k.asm["ttgir"]
    import triton.language as tl

    router = dict(z_ptr=p, w_ptr=p, id_ptr="*i64", E=i, stride_z=i)
    const = dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, NORM=True, OUT_DTYPE=tl.bfloat16, RNE_FIX=False)
    compile_for_hopper(tm._router_kernel, router, const, num_warps=4)
    const = dict(TOP_K=8, BLOCK_H=1024, OUT_DTYPE=tl.bfloat16, RNE_FIX=False)
    compile_for_hopper(tm._combine_kernel, dict(y_ptr=p, w_ptr=p, o_ptr=p, H=i), const, num_warps=4)


# ----------------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------------

A3B = dict(hidden=2048, experts=128, top_k=8, moe_inter=768)
"""Qwen3-30B-A3B MoE layer shape (the model has 48 such layers; the GPU tests use 2)."""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_matmul_vs_reference_and_invariant(dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    e, (n, k) = A3B["experts"], (2 * A3B["moe_inter"], A3B["hidden"])
    gen = torch.Generator(device=dev).manual_seed(0)
    for n_, k_ in ((n, k), (k, A3B["moe_inter"])):  # gate_up and down projections
        w = (torch.randn(e, n_, k_, device=dev, generator=gen) * 0.05).to(dtype)
        x = torch.randn(4096, k_, device=dev, generator=gen).to(dtype)
        eids = torch.randint(0, e, (4096,), device=dev, generator=gen)
        eids[:1500] = 7  # skewed load
        out = ops.grouped_matmul(x, w, eids)
        ref = torch.empty_like(out, dtype=torch.float32)
        for ex in range(e):
            rows = (eids == ex).nonzero()[:, 0]
            ref[rows] = (x[rows].double() @ w[ex].double().T).float()
        tol = 1e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(out.float(), ref, atol=1e-3, rtol=tol)
        singles = torch.cat([ops.grouped_matmul(x[i : i + 1], w, eids[i : i + 1]) for i in range(64)])
        assert torch.equal(out[:64], singles)
        for m in (1, 2, 7, 33, 64, 1000):
            assert torch.equal(ops.grouped_matmul(x[-m:], w, eids[-m:]), out[-m:])


@pytest.mark.gpu
def test_gpu_moe_layer_token_invariant_a3b() -> None:
    """Router + experts + combine at Qwen3-30B-A3B shapes, bf16: tokens 0..63 computed alone, in batches of 1..64
    and inside 16384 tokens give identical bits."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    h, e, inter, k = A3B["hidden"], A3B["experts"], A3B["moe_inter"], A3B["top_k"]
    router = (torch.randn(e, h, device=dev, generator=gen) * 0.02).bfloat16()
    gu = (torch.randn(e, 2 * inter, h, device=dev, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(e, h, inter, device=dev, generator=gen) * 0.02).bfloat16()
    x = torch.randn(16384, h, device=dev, generator=gen).bfloat16()

    def layer(xb: torch.Tensor) -> torch.Tensor:
        wts, ids = ops.moe_router(ops.matmul(xb, router), k, True)
        return ops.moe_experts(xb, ids, wts, gu, down)

    with torch.no_grad():
        full = layer(x)
        singles = torch.cat([layer(x[i : i + 1]) for i in range(64)])
        assert torch.equal(singles, full[:64])
        for m in (2, 5, 17, 64):
            assert torch.equal(layer(x[:m]), full[:m])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_moe_backward(dtype: torch.dtype) -> None:
    """Triton backward (grouped GEMMs, per-expert weight-gradient kernel) vs the torch-twin backward; deterministic."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    t, h, e, inter, k = 700, 256, 128, 96, 8
    base = [torch.randn(t, h, device=dev, generator=gen), torch.rand(t, k, device=dev, generator=gen),
            torch.randn(e, 2 * inter, h, device=dev, generator=gen) * 0.1,
            torch.randn(e, h, inter, device=dev, generator=gen) * 0.1]  # fmt: skip
    ids = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=-1).indices
    ids[:300, 0] = 3  # one hot expert; others get few or no rows
    g_out = torch.randn(t, h, device=dev, generator=gen).to(dtype)

    def run(backend: str) -> list[torch.Tensor]:
        leaves = [p.to(dtype).clone().requires_grad_(True) for p in base]
        ops.moe_experts(leaves[0], ids, *leaves[1:], backend=backend).backward(g_out)
        return [p.grad for p in leaves]

    got, ref = run("triton"), run("torch")
    for a, b in zip(got, ref):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        else:  # two bf16 results of different GEMM orders: elementwise bounds fail on a few cancelling sums
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 5e-3, f"bf16 MoE gradient relative error {rel:.2e}"
    assert all(torch.equal(a, b) for a, b in zip(got, run("triton")))


@pytest.mark.gpu
def test_gpu_rollout_equals_trainer_a3b_layers_cuda_graphs() -> None:
    model = tiny_moe(
        layers=2, dtype=torch.bfloat16, weight_scale=1.0, mlp_only_layers=[], **A3B, intermediate_size=6144,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=4096,
    )  # fmt: skip
    _check_graph_rollout(rlexact.exactify(model.cuda()), 4096, batch=48, new_tokens=24, seed=0)


def _check_graph_rollout(model: torch.nn.Module, vocab: int, batch: int, new_tokens: int, seed: int) -> None:
    """Rollout with CUDA graphs == trainer bitwise for ``batch`` prompts; negative control: the native kernels'
    rollout of 16 prompts is not."""
    gen = Generator(model, block_size=16)
    outs = gen.generate(prompts_for(batch, vocab, lo=4, hi=60, seed=seed),
                        SamplingParams(max_new_tokens=new_tokens, seed=seed + 1))  # fmt: skip
    assert gen.stats["graph_steps"] > 0 and gen.stats["cuda_graphs_disabled"] is None
    assert_exact(model, outs)
    native = Generator(model, kernels="native", block_size=16).generate(
        prompts_for(16, vocab, lo=4, hi=60, seed=seed), SamplingParams(max_new_tokens=16, seed=seed + 1)
    )
    with pytest.raises(AssertionError, match="rollout log-probs != trainer"):
        assert_exact(model, native)


@pytest.mark.gpu
def test_gpu_rollout_equals_trainer_mixtral_cuda_graphs() -> None:
    """Mixtral-shaped layers (8 experts, top-2, fp32 routing weights; Mixtral-8x7B's widths divided by four)."""
    model = tiny_moe(
        "mixtral", layers=2, experts=8, top_k=2, hidden=1024, moe_inter=3584, dtype=torch.bfloat16, weight_scale=1.0,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=4096,
    )  # fmt: skip
    _check_graph_rollout(rlexact.exactify(model.cuda()), 4096, batch=32, new_tokens=16, seed=2)


# ----------------------------------------------------------------------------------------------------------------------
# recipes
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["grpo_qwen3_30b_a3b.yaml", "reinforce_qwen3_30b_a3b.yaml"])
def test_moe_recipes_parse(recipe: str, capsys: pytest.CaptureFixture) -> None:
    """The MoE recipes parse through the CLI (nothing loaded) and their per-rank units give the paper's global ones."""
    pytest.importorskip("jsonargparse")
    import yaml

    from rlexact.cli import main
    from rlexact.config import AlgorithmConfig, RolloutConfig

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(HERE.parent / "configs" / recipe), "--print_config"])
    assert exc.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    init = cfg["model"]["init_args"]
    ranks = cfg["trainer"]["strategy"]["init_args"]["data_parallel_size"]
    assert ranks == cfg["trainer"]["devices"] * cfg["trainer"]["num_nodes"]
    assert cfg["data"]["init_args"]["batch_size"] * ranks == 64 and init["rollout"]["n"] == 8
    assert init["model_path"] == "/path/to/Qwen3-30B-A3B" and init["fsdp"]["param_dtype"] == "bfloat16"
    algo = init["algorithm"]
    if recipe.startswith("grpo"):
        assert algo["mini_batch_size"] * ranks == 16 * 8 and (algo["clip_low"], algo["clip_high"]) == (0.2, 0.28)
    else:
        assert algo["objective"] == "reinforce" and algo["mini_batch_size"] is None
    AlgorithmConfig(**algo)
    RolloutConfig(**init["rollout"])
