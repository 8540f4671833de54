"""Router mismatch metrics of ``MismatchProbe`` on Mixture-of-Experts policies (tiny Qwen3-MoE, CPU).

* the pure comparison (:func:`rlexact.callbacks.routing.router_disagreement`) against a hand-computed example;
* exact kernels: two *separate* recordings (different packings) select identical expert sets, and the probe reports
  0 (token and every layer); negative control: the native kernels in bf16 route some tokens differently;
* dense models get no router metrics; the recorder's one-selection-per-forward contract;
* end to end through ``RLModule``: the metrics are logged and 0 in exact mode.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import rlexact
from _callbacks_worker import make_batch
from models import addition_items, ids, tiny_model, tiny_moe, tiny_moe_rl_config
from rlexact.callbacks import MismatchProbe
from rlexact.callbacks.routing import RouterRecorder, router_disagreement


class _Module:
    """What the probe reads from an RL module: the policy and the generator's kernels."""

    def __init__(self, model: torch.nn.Module, kernels: str) -> None:
        self.model = model
        self.rollout_cfg = type("RolloutCfg", (), {"kernels": kernels})()


@pytest.fixture(scope="module")
def moe_bf16() -> torch.nn.Module:
    """64 experts top-8, MoE layers 0 and 2 (layer 1 dense), weights at scale 1.0: close router scores."""
    return rlexact.exactify(tiny_moe(experts=64, top_k=8, weight_scale=1.0, dtype=torch.bfloat16))


def _batch():  # noqa: ANN202 - a packed RolloutBatch of 8 sequences, 58 scored response tokens
    return make_batch(seed=3, num_seqs=8, max_resp=12)


def test_disagreement_hand_computed() -> None:
    """Sets compare equal under permutation; a token differing in both layers counts once overall."""
    rollout = [ids(0, 1, 2, 3, 4, 5, 9, 8).view(4, 2), ids(0, 1, 2, 3, 6, 7, 5, 6).view(4, 2)]
    trainer = [ids(1, 0, 2, 4, 5, 4, 8, 9).view(4, 2), ids(0, 1, 3, 5, 7, 6, 5, 7).view(4, 2)]
    # token 0: same sets in both layers; token 1: differs in layers 0 and 1; token 2: permuted only;
    # token 3: layer 0 permuted, layer 1 differs
    got = router_disagreement(rollout, trainer)
    assert (got.num_tokens, got.token_disagree, got.layer_disagree) == (4, 2, (1, 2))
    assert got.token_disagree_frac == 0.5 and got.layer_disagree_frac == (0.25, 0.5)
    same = router_disagreement(rollout, [t.flip(-1) for t in rollout])
    assert (same.token_disagree, same.layer_disagree) == (0, (0, 0))
    empty = router_disagreement([], [])
    assert empty.token_disagree_frac == 0.0 and empty.layer_disagree == ()
    with pytest.raises(ValueError, match="2 rollout layers vs 1 trainer layers"):
        router_disagreement(rollout, trainer[:1])
    with pytest.raises(ValueError, match=r"layer 1 has rollout ids \(4, 2\) and trainer ids \(3, 2\)"):
        router_disagreement(rollout, [trainer[0], trainer[1][:3]])


def _record(model: torch.nn.Module, chunk_seqs: int, kernels: str) -> RouterRecorder:
    """Routing of the scoring rows of :func:`_batch`, from the probe's packed forwards in chunks of ``chunk_seqs``."""
    batch = _batch()
    mask = batch.response_mask & (batch.position_ids > 0)
    with rlexact.use_kernels(model, kernels), RouterRecorder(model) as recorder:
        MismatchProbe()._argmax_tokens(model, batch, mask, chunk_seqs, recorder=recorder, head=False)
    return recorder


def test_exact_routing_equal_across_separate_forwards_native_differs(moe_bf16) -> None:
    one = _record(moe_bf16, 8, "exact")  # one packed forward of all 8 sequences
    two = _record(moe_bf16, 3, "exact")  # three separate forwards, other packings
    assert one.labels == ("0", "2")
    assert [t.shape for t in one.ids] == [torch.Size([58, 8])] * 2
    assert all(torch.equal(a, b) for a, b in zip(one.ids, two.ids))
    exact = router_disagreement(one.ids, two.ids)
    assert (exact.num_tokens, exact.token_disagree, exact.layer_disagree) == (58, 0, (0, 0))
    # negative control: the stock transformers forward in bf16 sends some tokens to other experts
    native = router_disagreement(_record(moe_bf16, 8, "native").ids, one.ids)
    print("native vs exact routing, bf16 64x8:", native)
    assert native.token_disagree > 0 and max(native.layer_disagree) > 0


def test_probe_router_metrics_exact_zero_native_nonzero(moe_bf16) -> None:
    batch = _batch()
    probe = MismatchProbe(histograms=False)
    flips, routing = probe._kernel_paths(_Module(moe_bf16, "exact"), batch)
    dis, labels = routing
    assert flips == 0.0 and labels == ("0", "2")
    assert (dis.num_tokens, dis.token_disagree_frac, dis.layer_disagree_frac) == (58, 0.0, (0.0, 0.0))
    flips, (dis, labels) = probe._kernel_paths(_Module(moe_bf16, "native"), batch)
    assert dis.token_disagree_frac > 0 and max(dis.layer_disagree_frac) > 0
    assert dis.token_disagree_frac >= max(dis.layer_disagree_frac)  # a token counts once over its layers
    # router=False and dense models: no router metrics; the argmax is unaffected
    assert MismatchProbe(router=False)._kernel_paths(_Module(moe_bf16, "native"), batch) == (flips, None)
    dense = rlexact.exactify(tiny_model(vocab=97))
    got = MismatchProbe()._kernel_paths(_Module(dense, "native"), batch)
    assert got[1] is None and 0.0 <= got[0] <= 1.0
    assert MismatchProbe(argmax=False)._kernel_paths(_Module(dense, "native"), batch) == (None, None)


def test_recorder_requires_one_selection_per_forward(moe_bf16) -> None:
    x = torch.arange(5)
    with RouterRecorder(moe_bf16) as recorder, pytest.raises(RuntimeError, match="without a selection"):
        moe_bf16(x[None])
    with RouterRecorder(moe_bf16) as recorder:
        recorder.select(torch.tensor([1, 3]))
        with pytest.raises(RuntimeError, match=r"routers \[0, 1\] did not run"):
            recorder.select(torch.tensor([0]))
        moe_bf16(x[None])
        assert [t.shape for t in recorder.ids] == [torch.Size([2, 8])] * 2
    assert not any(m._forward_hooks for _, m in moe_bf16.named_modules())  # hooks removed on exit
    assert RouterRecorder(rlexact.exactify(tiny_model())).ids == []


def _reward(prompts: list, completions: list, answers: list) -> list[float]:
    return [float(len(c) % 3) for c in completions]


@pytest.mark.parametrize("kernels", ["exact", "native"])
def test_rlmodule_logs_router_mismatch(kernels: str) -> None:
    """Through ``RLModule`` (bf16, 64 experts top-8 at transformers' initialization, whose router scores are close):
    logged, 0 with exact rollout kernels, > 0 with native ones."""
    from rlexact.char_tokenizer import build_char_tokenizer
    from rlexact.module import RLModule

    tok = build_char_tokenizer()
    cfg = tiny_moe_rl_config(len(tok), layers=3, experts=64, top_k=8)
    items = addition_items(tok, 2)
    mode = "exact" if kernels == "exact" else "recompute"
    module = RLModule(
        model_config=cfg, tokenizer=tok, dtype="bfloat16", reward=_reward,
        rollout={"n": 3, "max_new_tokens": 5, "kernels": kernels}, algorithm={"old_logprob_mode": mode},
        optim={"lr": 1e-3},
    )  # fmt: skip
    probe = MismatchProbe(histograms=False)
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*val_dataloader.*")
        trainer.fit(module, DataLoader(items, batch_size=2, collate_fn=list))
    m = {k: v for k, v in probe.last_metrics.items() if "router" in k}
    print(kernels, m)
    layers = [m["mismatch/router_layer_disagree/0"], m["mismatch/router_layer_disagree/2"]]
    assert "mismatch/router_layer_disagree/1" not in m  # the dense layer
    assert "mismatch/router_token_disagree_frac" in trainer.callback_metrics
    if kernels == "exact":
        assert m["mismatch/router_token_disagree_frac"] == 0.0 and layers == [0.0, 0.0]
    else:
        assert m["mismatch/router_token_disagree_frac"] > 0.0 and max(layers) > 0.0
