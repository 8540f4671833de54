"""Fused decode ops: the one-launch KV-cache write, the fused residual add + RMSNorm, and the decoder layers of an
exactified model that use it.

* ``write_kv`` (torch twin and Triton kernel) stores exactly what two ``index_copy_`` calls store, from strided inputs
  and with a dtype cast; a wrong slot mapping gives another cache (negative control). ``qk_norm_rope_write_kv``
  (the decode step's attention prologue) equals ``qk_norm_rope`` followed by ``write_kv`` of its keys.
* ``add_rms_norm`` returns ``(rms_norm(x + r), x + r)`` bitwise, ``x + r`` being torch's elementwise add (fp32 add,
  one rounding); normalizing the unrounded fp32 sum differs (negative control).
* An exactified model's fused decoder layers give bitwise the hidden states, log-probs and logits of the unfused exact
  layers (transformers' own layer forward over the exact submodules), with and without autograd, on the paged decode
  path too; an fp32-rounded sum in the fusion differs (negative control); native mode keeps the stock layer.

CPU: the torch twins here; the Triton kernels (and a whole model forced onto them) under the Triton interpreter in a
subprocess (``TRITON_INTERPRET=1 python tests/test_fused_decode_ops.py``). GPU (``@pytest.mark.gpu``): the kernels
at Qwen3-1.7B shapes, a CUDA-graph captured KV write, and the model comparison on CUDA.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import rlexact
from interpreter_jobs import failure_report
from models import tiny_model, tiny_moe
from rlexact import ops
from rlexact.models import AttnMetadata, PagedKV, forward_hidden, head_logprobs
from rlexact.ops import autograd

HERE = Path(__file__).resolve().parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")


# ----------------------------------------------------------------------------------------------------------------------
# checks shared by the torch twin, the interpreter and the GPU
# ----------------------------------------------------------------------------------------------------------------------


def _index_copy_kv(k, v, kc, vc, slots) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc = kc.clone(), vc.clone()
    kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k.to(kc.dtype))
    vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(vc.dtype))
    return kc, vc


def check_write_kv(device: str, backend: str, hkv: int = 3, d: int = 10, block: int = 4, nblocks: int = 7) -> None:
    """Strided K/V views (a fused qkv-like buffer), every in/out dtype pair, caches pre-filled with NaN; negative
    control: a wrong slot mapping gives another cache."""
    g = torch.Generator().manual_seed(3)
    for t in (1, 5, nblocks * block - 1):
        slots = torch.randperm(nblocks * block, generator=g)[:t].to(device)
        buf = torch.randn(t, hkv + 1, 2, d + 6, generator=g).to(device)
        for src_dt, dst_dt in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                               (torch.float16, torch.bfloat16)]:  # fmt: skip
            b = buf.to(src_dt)
            k, v = b[:, :hkv, 0, :d], b[:, 1:, 1, 6:]  # [T, Hkv, D] views with row and head strides
            kc = torch.full((nblocks, block, hkv, d), float("nan"), dtype=dst_dt, device=device)
            vc = torch.full_like(kc, float("nan"))
            want_k, want_v = _index_copy_kv(k, v, kc, vc, slots)
            ops.write_kv(k, v, kc, vc, slots, backend=backend)
            assert torch.equal(kc.nan_to_num(7.0), want_k.nan_to_num(7.0)), (t, src_dt, dst_dt, "K")
            assert torch.equal(vc.nan_to_num(7.0), want_v.nan_to_num(7.0)), (t, src_dt, dst_dt, "V")
            assert torch.equal(kc.isnan(), want_k.isnan()) and torch.equal(vc.isnan(), want_v.isnan())
            if t > 1:  # negative control: two tokens' slots swapped
                wrong = slots.clone()
                wrong[[0, 1]] = slots[[1, 0]]
                kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
                ops.write_kv(k, v, kc2, vc2, wrong, backend=backend)
                assert not torch.equal(kc2.nan_to_num(7.0), want_k.nan_to_num(7.0))


def check_rope_write_kv(
    device: str, backend: str, hq: int = 4, hkv: int = 2, d: int = 16, block: int = 4, nblocks: int = 5
) -> None:
    """``qk_norm_rope_write_kv`` == ``qk_norm_rope`` then ``write_kv`` of its keys, bitwise: q/k/v as column blocks
    of a fused projection, with and without norm weights, caches of the input dtype (one launch) and of another
    (second launch), caches pre-filled with NaN; negative control: a wrong slot mapping gives another cache."""
    g = torch.Generator().manual_seed(11)
    for t in (1, 6):
        slots = torch.randperm(nblocks * block, generator=g)[:t].to(device)
        buf = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
        cos, sin = torch.randn(t, d, generator=g).to(device), torch.randn(t, d, generator=g).to(device)
        for src_dt, dst_dt in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                               (torch.bfloat16, torch.float32)]:  # fmt: skip
            b = buf.to(src_dt).to(device)
            q, k, v = (x.view(t, -1, d) for x in b.split([hq * d, hkv * d, hkv * d], dim=-1))
            for weights in (None, (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5)):
                qw, kw = (None, None) if weights is None else (w.to(src_dt).to(device) for w in weights)
                want_q, want_k = ops.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, backend=backend)
                kc = torch.full((nblocks, block, hkv, d), float("nan"), dtype=dst_dt, device=device)
                vc = torch.full_like(kc, float("nan"))
                want_kc, want_vc = _index_copy_kv(want_k, v, kc, vc, slots)
                got_q, got_k = ops.qk_norm_rope_write_kv(
                    q, k, v, cos, sin, qw, kw, 1e-6, kc, vc, slots, backend=backend
                )  # fmt: skip
                what = (t, src_dt, dst_dt, weights is not None)
                assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), what
                assert torch.equal(kc.nan_to_num(7.0), want_kc.nan_to_num(7.0)), (*what, "K cache")
                assert torch.equal(vc.nan_to_num(7.0), want_vc.nan_to_num(7.0)), (*what, "V cache")
                assert torch.equal(kc.isnan(), want_kc.isnan()) and torch.equal(vc.isnan(), want_vc.isnan())
                if t > 1:  # negative control: two tokens' slots swapped
                    wrong = slots.clone()
                    wrong[[0, 1]] = slots[[1, 0]]
                    kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
                    ops.qk_norm_rope_write_kv(q, k, v, cos, sin, qw, kw, 1e-6, kc2, vc2, wrong, backend=backend)
                    assert not torch.equal(kc2.nan_to_num(7.0), want_kc.nan_to_num(7.0))
                    assert not torch.equal(vc2.nan_to_num(7.0), want_vc.nan_to_num(7.0))


def add_norm_fp32_sum(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float):
    """Negative control of ``add_rms_norm``: the norm of the fp32 sum before its rounding to the input dtype."""
    s32 = x.float() + r.float()
    y = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return w * y, s32.to(x.dtype)


def check_add_rms_norm(device: str, backend: str, sizes: tuple[int, ...] = (48, 100, 8232)) -> None:
    """Both outputs equal torch's add and ``ops.rms_norm`` of the sum bitwise (fp32, bf16, fp16; single- and two-pass
    norm rows; strided inputs); the fp32-sum control differs for 16-bit inputs."""
    g = torch.Generator().manual_seed(5)
    for h in sizes:
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(7, h + 3, generator=g) * 4)[:, :h].to(dt).to(device)
            r = (torch.randn(7, h, generator=g) * 4).to(dt).to(device)
            w = (torch.rand(h, generator=g) + 0.5).to(dt).to(device)
            normed, s = ops.add_rms_norm(x, r, w, 1e-6, backend=backend)
            assert s.dtype == dt and torch.equal(s, x + r), (h, dt, "sum")
            assert torch.equal(s, (x.float() + r.float()).to(dt)), (h, dt, "fp32 add, one rounding")
            assert torch.equal(normed, ops.rms_norm(x + r, w, 1e-6, backend=backend)), (h, dt, "norm")
            if dt != torch.float32:
                bad, _ = add_norm_fp32_sum(x, r, w, 1e-6)
                assert not torch.equal(bad, normed), (h, dt, "negative control did not differ")


@contextlib.contextmanager
def unfused(model: torch.nn.Module) -> Iterator[None]:
    """Decoder layers run transformers' own forward (the exact submodules, separate adds and norms) inside."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer") and "forward" in m.__dict__]
    assert layers, "exactify did not patch the decoder layers"
    saved = [(m, m.__dict__.pop("forward")) for m in layers]
    try:
        yield
    finally:
        for m, fwd in saved:
            m.forward = fwd


def _outputs(model: torch.nn.Module, seqs: list[torch.Tensor], logits: bool = True) -> list[torch.Tensor]:
    """Final hidden states and log-probs of a packed forward (the trainer path), and plain ``model(ids)`` logits."""
    dev = next(model.parameters()).device
    ids = torch.cat(seqs).to(dev)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(dev)
    cu = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0).to(torch.int32).to(dev)
    hidden = forward_hidden(model, ids, pos, AttnMetadata(cu))
    lp, _ = head_logprobs(model, hidden, ids.roll(-1), 1.0)
    out = [hidden, lp]
    if logits:
        out.append(model(seqs[0][None].to(dev)).logits)
    return out


def check_model_fused_equal(model: torch.nn.Module, seqs: list[torch.Tensor], logits: bool = True) -> None:
    """Fused decoder layers == unfused exact layers, bitwise, and the fused ops really ran (2 * layers - 1 calls of
    ``add_rms_norm``, or of ``norm_add_rms_norm`` where a branch's output norm joins it)."""
    calls = []
    names = ("add_rms_norm", "norm_add_rms_norm")
    origs = {name: getattr(ops, name) for name in names}

    def spy(name: str):  # noqa: ANN202
        def call(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            calls.append(name)
            return origs[name](*a, **kw)

        return call

    with torch.no_grad():
        with pytest.MonkeyPatch.context() as mp:
            for name in names:
                mp.setattr(ops, name, spy(name))
            fused = _outputs(model, seqs, logits)
        with unfused(model):
            ref = _outputs(model, seqs, logits)
    n_layers = model.config.num_hidden_layers
    assert len(calls) == (2 * n_layers - 1) * (2 if logits else 1), len(calls)
    sandwich = any(hasattr(m, "pre_feedforward_layernorm") for m in model.modules())  # Gemma 3's branch norms
    assert set(calls) == {names[1] if sandwich else names[0]}, set(calls)
    for i, (a, b) in enumerate(zip(fused, ref)):
        assert torch.equal(a, b), f"output {i}: fused decoder layers differ from the unfused exact layers"


# ----------------------------------------------------------------------------------------------------------------------
# CPU: torch twins
# ----------------------------------------------------------------------------------------------------------------------


def test_write_kv_torch() -> None:
    check_write_kv("cpu", "torch")


def test_rope_write_kv_torch() -> None:
    check_rope_write_kv("cpu", "torch")


def test_rope_write_kv_refuses_autograd() -> None:
    q, k = torch.randn(3, 2, 8, requires_grad=True), torch.randn(3, 1, 8)
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    kc = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="no backward"):
        ops.qk_norm_rope_write_kv(q, k, k.clone(), cos, sin, None, None, 1e-6, kc, kc.clone(), torch.arange(3))
    with torch.no_grad():  # the same call without autograd runs
        ops.qk_norm_rope_write_kv(q, k, k.clone(), cos, sin, None, None, 1e-6, kc, kc.clone(), torch.arange(3))


def test_add_rms_norm_torch() -> None:
    check_add_rms_norm("cpu", "torch")


def test_add_rms_norm_autograd_and_errors() -> None:
    """With autograd the op runs the separate (differentiable) ops: the same bits, gradients flow to all inputs."""
    x, r = torch.randn(4, 3, 40, requires_grad=True), torch.randn(4, 3, 40, requires_grad=True)
    w = (torch.rand(40) + 0.5).requires_grad_()
    normed, s = ops.add_rms_norm(x, r, w, 1e-5)
    with torch.no_grad():
        assert torch.equal(normed, ops.add_rms_norm(x, r, w, 1e-5)[0]) and torch.equal(s, x + r)
    (normed.square().sum() + s.sum()).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (x, r, w))
    with pytest.raises(ValueError, match="differ in shape"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(1, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight shape"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(7), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "mistral", "phi3", "gemma3"])
def test_model_fused_equals_unfused(arch: str, dtype: torch.dtype) -> None:
    hd = 12 if arch in ("qwen2", "phi3") else 16
    model = rlexact.exactify(tiny_model(arch, layers=3, heads=4, kv_heads=2, head_dim=hd, dtype=dtype, seed=2))
    g = torch.Generator().manual_seed(0)
    check_model_fused_equal(model, [torch.randint(0, 97, (n,), generator=g) for n in (9, 1, 30)])


def test_moe_model_fused_equals_unfused() -> None:
    model = rlexact.exactify(tiny_moe("qwen3_moe", layers=3, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    check_model_fused_equal(model, [torch.randint(0, 97, (n,), generator=g) for n in (12, 5)])


def _fp32_sum_variant(x, r, w, eps, *, backend=None, round_normed=True, offset=False):  # noqa: ANN001, ANN202
    assert round_normed and not offset, "the variant implements Qwen3's norm"
    s = x + r
    if torch.is_grad_enabled() and (x.requires_grad or r.requires_grad or w.requires_grad):
        return ops.rms_norm(s, w, eps), s
    return add_norm_fp32_sum(x, r, w, eps)


def test_model_negative_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fusion that normalizes the unrounded fp32 sum changes the bf16 model's outputs: the equality test can fail."""
    model = rlexact.exactify(tiny_model("qwen3", layers=3, dtype=torch.bfloat16, seed=3))
    seqs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(2)) for n in (20, 7)]
    with torch.no_grad():
        with unfused(model):
            ref = _outputs(model, seqs, logits=False)
        monkeypatch.setattr(ops, "add_rms_norm", _fp32_sum_variant)
        bad = _outputs(model, seqs, logits=False)
    assert not torch.equal(bad[0], ref[0]) and not torch.equal(bad[1], ref[1])


def test_trainer_with_grad_equals_fused_no_grad() -> None:
    """The trainer's forward with autograd (separate ops) == the no-grad fused forward (the generator's), bitwise;
    paged chunked prefill / decode steps (the generator's path) run the fused layers and give the same log-probs."""
    model = rlexact.exactify(tiny_model("qwen3", layers=3, dtype=torch.bfloat16, seed=4))
    seq = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(3))
    with torch.enable_grad():
        train = rlexact.sequence_logprobs(model, [seq])[0]
        assert train.requires_grad
    with torch.no_grad():
        assert torch.equal(rlexact.sequence_logprobs(model, [seq])[0], train.detach())
        for chunk in (1, 6):
            assert torch.equal(_paged_logprobs(model, seq, chunk), train.detach()), chunk


def _paged_logprobs(model: torch.nn.Module, seq: torch.Tensor, chunk: int, block: int = 4) -> torch.Tensor:
    """Teacher-forced log-probs of ``seq[1:]`` through prefill chunks of ``chunk`` tokens over a paged cache."""
    cfg = model.config
    n = seq.numel()
    nb = -(-n // block) + 1
    dtype = next(model.parameters()).dtype
    shape = (nb, block, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_hidden_layers)]
    table = torch.randperm(nb, generator=torch.Generator().manual_seed(chunk)).to(torch.int32)
    out = []
    for start in range(0, n - 1, chunk):
        stop = min(n - 1, start + chunk)
        pos = torch.arange(start, stop)
        slots = table[pos // block].long() * block + pos % block
        paged = PagedKV(caches, table[None], torch.tensor([stop], dtype=torch.int32), slots)
        meta = AttnMetadata(torch.tensor([0, stop - start], dtype=torch.int32), paged)
        hidden = forward_hidden(model, seq[start:stop], pos, meta)
        out.append(head_logprobs(model, hidden, seq[start + 1 : stop + 1], 1.0)[0])
    return torch.cat(out)


def test_handoff_is_used_only_for_its_tensor_and_weight() -> None:
    """The next layer uses the handed-over norm only for the very tensor it was computed from and an unmodified
    weight; otherwise it normalizes itself (so the result is always that of the unfused layer)."""
    model = rlexact.exactify(tiny_model("qwen3", layers=2, dtype=torch.bfloat16, seed=5))
    layers = model.model.layers
    h0 = torch.randn(1, 6, 48).bfloat16()
    pe = model.model.rotary_emb(h0, torch.arange(6)[None])
    kw = dict(position_embeddings=pe, rlexact_meta=AttnMetadata(torch.tensor([0, 6], dtype=torch.int32)))
    norm_calls = []
    layers[1].input_layernorm.register_forward_hook(lambda *_: norm_calls.append(1))
    with torch.no_grad():
        with unfused(model):
            ref1 = layers[1](layers[0](h0, **kw), **kw)
        h1 = layers[0](h0, **kw)
        norm_calls.clear()
        assert torch.equal(layers[1](h1, **kw), ref1) and not norm_calls  # handed over
        layers[0](h0, **kw)
        assert torch.equal(layers[1](h1.clone(), **kw), ref1) and norm_calls  # another tensor: own norm, same bits
        h1 = layers[0](h0, **kw)
        layers[1].input_layernorm.weight.mul_(2)  # in place, after the handover: the handed norm is stale
        got = layers[1](h1, **kw)
        with unfused(model):
            ref2 = layers[1](h1, **kw)
        assert torch.equal(got, ref2) and not torch.equal(ref2, ref1)


def test_native_mode_keeps_stock_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    model = rlexact.exactify(tiny_model("qwen3", layers=2, seed=6))
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a, **k: pytest.fail("fused op in native mode"))
    seq = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), rlexact.use_kernels(model, "native"):
        model(seq[None])
    rlexact.exactify(model, enabled=False)
    assert all("forward" not in m.__dict__ for m in model.modules())


# ----------------------------------------------------------------------------------------------------------------------
# CPU: Triton interpreter (subprocess running this file)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.interpreter("tests/test_fused_decode_ops.py")
def test_interpreter(interpreter_run: subprocess.CompletedProcess) -> None:
    assert interpreter_run.returncode == 0, failure_report(interpreter_run)
    assert "fused decode ops ok" in interpreter_run.stdout


@contextlib.contextmanager
def forced_backend(backend: str) -> Iterator[None]:
    """Every op of :mod:`rlexact.ops` resolves to ``backend`` inside (the model runs on the Triton kernels)."""
    orig: Callable = ops.resolve_backend
    ops.resolve_backend = lambda t, b: orig(t, backend)
    try:
        yield
    finally:
        ops.resolve_backend = orig


def _interpreter_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    check_write_kv("cpu", "triton")
    print("write_kv ok", flush=True)
    check_rope_write_kv("cpu", "triton")
    print("qk_norm_rope_write_kv ok", flush=True)
    check_add_rms_norm("cpu", "triton")
    print("add_rms_norm ok", flush=True)
    g = torch.Generator().manual_seed(0)
    for arch, extra in (("qwen3", {"add_rms_norm", "silu_mul"}), ("gemma3", {"norm_add_rms_norm", "gelu_tanh_mul"})):
        for dtype in (torch.float32, torch.bfloat16):
            model = rlexact.exactify(tiny_model(arch, layers=3, hidden=32, heads=2, kv_heads=1, dtype=dtype, seed=7))
            with forced_backend("triton"):
                check_model_fused_equal(model, [torch.randint(0, 97, (n,), generator=g) for n in (6, 3)], logits=False)
            used = set(autograd._TRITON_IMPLS)  # the Triton functions resolved so far (this forward's among them)
            want = {"rms_norm", "matmul", "attention_varlen", "qk_norm_rope_write_kv"} | extra
            assert want <= used, (arch, used)
            print(f"model {arch} {dtype} ok", flush=True)
    print("fused decode ops ok")


# ----------------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
def test_gpu_write_kv() -> None:
    check_write_kv("cuda", "triton")
    check_write_kv("cuda", "triton", hkv=8, d=128, block=16, nblocks=20)  # Qwen3-1.7B K/V rows
    check_rope_write_kv("cuda", "triton")
    check_rope_write_kv("cuda", "triton", hq=16, hkv=8, d=128, block=16, nblocks=20)


@gpu
@pytest.mark.gpu
def test_gpu_write_kv_cuda_graph() -> None:
    """Captured once, replayed with new K/V and slots: every replay writes what index_copy_ writes."""
    t, hkv, d, block, nb = 16, 8, 128, 16, 40
    dev = "cuda"
    qkv = torch.zeros(t, (16 + 2 * hkv) * d, dtype=torch.bfloat16, device=dev)
    k = qkv[:, 16 * d : (16 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (16 + hkv) * d :].view(t, hkv, d)
    slots = torch.zeros(t, dtype=torch.long, device=dev)
    kc = torch.zeros(nb, block, hkv, d, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    ops.write_kv(k, v, kc, vc, slots)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.write_kv(k, v, kc, vc, slots)
    for seed in range(3):
        g = torch.Generator(device=dev).manual_seed(seed)
        qkv.copy_(torch.randn(qkv.shape, generator=g, device=dev))
        slots.copy_(torch.randperm(nb * block, generator=g, device=dev)[:t])
        want_k, want_v = _index_copy_kv(k, v, kc, vc, slots)
        graph.replay()
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v), seed


@gpu
@pytest.mark.gpu
def test_gpu_add_rms_norm() -> None:
    check_add_rms_norm("cuda", "triton", sizes=(2048, 4096, 5120, 8192 + 40))
    # Qwen3-1.7B decode shapes, every M in 1..64: rows equal the separate ops
    for m in range(1, 65):
        x = torch.randn(m, 2048, device="cuda").bfloat16()
        r = torch.randn(m, 2048, device="cuda").bfloat16()
        w = torch.rand(2048, device="cuda").bfloat16() + 0.5
        normed, s = ops.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(s, x + r) and torch.equal(normed, ops.rms_norm(x + r, w, 1e-6)), m


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_gpu_model_fused_equals_unfused(arch: str, dtype: torch.dtype) -> None:
    model = rlexact.exactify(tiny_model(arch, layers=3, hidden=128, heads=4, head_dim=32, dtype=dtype).cuda())
    g = torch.Generator().manual_seed(0)
    check_model_fused_equal(model, [torch.randint(0, 97, (n,), generator=g) for n in (40, 1, 77)])


if __name__ == "__main__":
    _interpreter_main()
