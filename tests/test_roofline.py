"""The benchmarks' roofline counts (``benchmarks/roofline.py``) against the model objects they describe."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from models import tiny_model
from rlexact.rollout.runner import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import roofline  # noqa: E402

PEAKS = {"hbm_bytes_per_s": 2.0e12, "bf16_dense_flops_per_s": 1.0e15}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_counts_match_the_model(arch: str) -> None:
    model = tiny_model(arch)
    shape = roofline.DecoderShape.of(model.config)
    layers = model.model.layers
    body = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    assert shape.body_params == body
    assert shape.head_params == model.lm_head.weight.numel()
    cfg = model.config
    kv = KVCache.bytes_per_block(cfg.num_hidden_layers, 16, shape.kv_heads, shape.head_dim, torch.bfloat16) // 16
    assert shape.kv_bytes_per_token(2) == kv
    assert roofline.DecoderShape.of(cfg.to_dict()) == shape


def test_decode_bound_is_the_slower_of_memory_and_compute() -> None:
    shape = roofline.DecoderShape(hidden=64, intermediate=128, layers=2, q_heads=4, kv_heads=2, head_dim=16, vocab=100)
    small = roofline.decode_step_bound(shape, batch=1, mean_context=10, elem_bytes=2, peaks=PEAKS)
    weights = (shape.body_params + shape.head_params) * 2
    assert small["weight_bytes"] == weights
    assert small["kv_bytes"] == 10 * shape.kv_bytes_per_token(2)
    assert small["memory_bound_ms"] == pytest.approx((weights + small["kv_bytes"]) / PEAKS["hbm_bytes_per_s"] * 1e3)
    assert small["decode_step_bound_ms"] == small["memory_bound_ms"] > small["compute_bound_ms"]
    fast_memory = dict(PEAKS, hbm_bytes_per_s=1.0e18)
    big = roofline.decode_step_bound(shape, batch=4096, mean_context=10, elem_bytes=2, peaks=fast_memory)
    assert big["decode_step_bound_ms"] == big["compute_bound_ms"] > big["memory_bound_ms"]
    assert big["decode_tokens_per_s_bound"] == pytest.approx(4096 / big["decode_step_bound_ms"] * 1e3)


def test_update_flops_are_three_forwards() -> None:
    shape = roofline.DecoderShape(hidden=64, intermediate=128, layers=2, q_heads=4, kv_heads=2, head_dim=16, vocab=100)
    seqs = [5, 7]
    attn = sum(4.0 * 2 * 4 * 16 * s * (s + 1) / 2 for s in seqs)
    forward = 2.0 * shape.body_params * 12 + 2.0 * shape.head_params * 6 + attn
    assert roofline.update_flops(shape, seqs, head_rows=6) == pytest.approx(3.0 * forward)
