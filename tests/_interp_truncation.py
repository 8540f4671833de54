"""Triton-interpreter checks of the truncation-threshold kernel (run by tests/test_sampled_logprobs.py in a
subprocess: ``TRITON_INTERPRET=1 python tests/_interp_truncation.py``). Small probe count, scratch capacity, block and
segment make the short rows take several narrowing passes before the sorted last step, rows of 700 entries run the
segmented plan (three segments) and top-k candidates of 40 the one-program plan."""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from rlexact.ops import reference  # noqa: E402
from rlexact.ops import triton_truncation as T  # noqa: E402

T.CAP, T.PROBES, T.BLOCK, T.SEGMENT = 64, 8, 128, 256

torch.manual_seed(0)
z = torch.randn(6, 700) * torch.tensor([[1.0], [3.0], [0.05], [8.0], [1.0], [1.0]])
z[0, :90] = 0.5  # a tie group that top_k=300 cuts (the renormalization counts k values of it)
z[4, 200:] = float("-inf")  # masked tokens
z[5] = 2.0  # one value
for k, p in ((40, 1.0), (0, 0.8), (40, 0.8), (300, 0.95), (650, 0.3), (0, 0.999)):
    thr = T.truncation_thresholds(z, k, p)
    ref = reference.truncation_thresholds(z, k, p)
    assert torch.equal(thr, ref), (k, p, thr.flatten().tolist(), ref.flatten().tolist())
    for idx in ([3], [5, 0, 2], [1, 4]):  # a row's threshold does not depend on the rows beside it
        assert torch.equal(T.truncation_thresholds(z[idx], k, p), thr[idx]), (k, p, idx)
# the fixed pass count narrows the widest key interval to one key: a tie group larger than CAP holds the boundary
# (top_p 0.4 falls inside its mass) and -3e38 stretches the interval over most of the int32 keys
w = torch.full((1, 700), -2.0)
w[0, :10], w[0, 10:110], w[0, 110] = 1.0, 0.0, -3e38
assert torch.equal(T.truncation_thresholds(w, 0, 0.4), torch.zeros(1, 1))
assert torch.equal(T.truncation_thresholds(w, 0, 0.4), reference.truncation_thresholds(w, 0, 0.4))
assert [T.passes(p) for p in (4, 8, 16)] == [16, 11, 8]
# lse over the kept tokens: the float64 value up to fp32 rounding, the same bits alone as in the batch; a token below
# the threshold does not enter it, a kept one does
t8 = T.truncation_thresholds(z, 0, 0.8)
lse = T.kept_logsumexp(z, t8)
want = torch.logsumexp(z.double().masked_fill(z < t8, float("-inf")), dim=-1)
assert torch.allclose(lse.double(), want, rtol=0, atol=1e-5), (lse - want).abs().max()
for idx in ([3], [5, 0, 2], [1, 4]):
    assert torch.equal(T.kept_logsumexp(z[idx], t8[idx]), lse[idx]), idx
y = z.clone()
y[1, int(torch.argmin(z[1]))] += 0.5  # still below the threshold
assert torch.equal(T.kept_logsumexp(y, t8)[1], lse[1])
y[1, int(torch.argmax(z[1]))] += 0.5
assert not torch.equal(T.kept_logsumexp(y, t8)[1], lse[1])
# negative control: raising the boundary token's logit moves the threshold
y = z.clone()
y[1, int(torch.argmax((z[1] == thr[1]).int()))] += 0.25
assert not torch.equal(T.truncation_thresholds(y, 0, 0.999)[1], thr[1])
print("ok")
