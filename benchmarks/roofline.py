"""Roofline bounds of the benchmarks' dense-decoder workloads: datasheet peaks of the GPU, and the FLOPs and HBM bytes
of a decode step or of a training update, counted from the model's shape.

A bound is a lower limit on time: ``max(bytes / peak bandwidth, flops / peak throughput)``. The benchmarks store it
beside the measured time, so a missed target can be judged against what the hardware allows at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PEAKS = {
    "NVIDIA H200": {"hbm_bytes_per_s": 4.8e12, "bf16_dense_flops_per_s": 989.4e12},
    "NVIDIA H100 80GB HBM3": {"hbm_bytes_per_s": 3.35e12, "bf16_dense_flops_per_s": 989.4e12},
}
"""Datasheet peaks by ``torch.cuda.get_device_name()``: HBM bandwidth, dense bf16 tensor-core throughput (SXM)."""


def device_peaks() -> dict | None:
    """The current CUDA device's entry of :data:`PEAKS` with its name, or None (no GPU, or one not listed)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    peaks = PEAKS.get(name)
    return None if peaks is None else {"device": name, **peaks, "source": "datasheet (SXM)"}


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions of a dense decoder-only transformer that its FLOPs and bytes depend on."""

    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Mapping | object) -> DecoderShape:
        """From a transformers config object or a dict with the same keys (``head_dim`` defaults to
        ``hidden_size // num_attention_heads``)."""
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        heads = get("num_attention_heads")
        return cls(
            hidden=get("hidden_size"), intermediate=get("intermediate_size"), layers=get("num_hidden_layers"),
            q_heads=heads, kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads, vocab=get("vocab_size"),
        )  # fmt: skip

    @property
    def body_params(self) -> int:
        """Weights of the decoder layers' projections (attention and MLP; norms left out)."""
        qkv = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        attn = qkv + self.q_heads * self.head_dim * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.intermediate)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """K and V cache bytes of one token over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * elem_bytes

    def attention_flops(self, queries: float, keys: float) -> float:
        """Forward FLOPs of ``queries`` query rows over ``keys`` visible keys each, all layers (QK^T and PV)."""
        return 4.0 * self.layers * self.q_heads * self.head_dim * queries * keys


def decode_step_bound(shape: DecoderShape, batch: int, mean_context: float, elem_bytes: int, peaks: dict) -> dict:
    """The roofline of one decode step of ``batch`` sequences at ``mean_context`` keys each: every weight (projections
    and the head) and every sequence's K/V read once from HBM, and the step's matrix FLOPs at peak throughput."""
    weight_bytes = (shape.body_params + shape.head_params) * elem_bytes
    kv_bytes = batch * mean_context * shape.kv_bytes_per_token(elem_bytes)
    flops = 2.0 * batch * (shape.body_params + shape.head_params) + shape.attention_flops(batch, mean_context)
    memory_ms = (weight_bytes + kv_bytes) / peaks["hbm_bytes_per_s"] * 1e3
    compute_ms = flops / peaks["bf16_dense_flops_per_s"] * 1e3
    bound_ms = max(memory_ms, compute_ms)
    return {
        "mean_context": mean_context,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "flops": flops,
        "memory_bound_ms": memory_ms,
        "compute_bound_ms": compute_ms,
        "decode_step_bound_ms": bound_ms,
        "decode_tokens_per_s_bound": batch / bound_ms * 1e3,
        "peaks": peaks,
    }


def update_flops(shape: DecoderShape, seq_lens: list[int], head_rows: int) -> float:
    """Model FLOPs of one forward + backward over sequences of ``seq_lens`` tokens (causal attention), the head on
    ``head_rows`` rows: the usual three times the forward (backward = two forwards), no recomputation counted."""
    tokens = sum(seq_lens)
    attn = sum(shape.attention_flops(s, (s + 1) / 2) for s in seq_lens)
    forward = 2.0 * shape.body_params * tokens + 2.0 * shape.head_params * head_rows + attn
    return 3.0 * forward
