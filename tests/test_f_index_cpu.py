"""Index mode's backward (stages/f_backward/index.py) on the CPU: the gradients of DeepSeek-V4's
sparse attention against torch.autograd through the float64 forward reference
(``reference.dsv4_index_attention``), with -1 padding, ``topk_length`` (0 and past the list's
valid entries), a row listed twice by one token (both entries count), a token with no valid index
(its gradients 0), a -inf sink (gradient 0, where autograd gives NaN) and a dominant one, and
chunks of one token and of all of them. Negative control: without the sink in the normalizer the
check fails."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attention.common import reference
from dsv4_attention.stages.f_backward.index import index_backward

pytestmark = [pytest.mark.stage_f]


def case(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens, heads, d, rows, k = 7, 4, 16, 30, 6
    q = torch.randn(tokens, heads, d, dtype=torch.float64, generator=g, requires_grad=True)
    kv = torch.randn(rows, 1, d, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.randint(0, rows, (tokens, 1, k), generator=g, dtype=torch.int32)
    idx[1, 0, 3:] = -1  # padding
    idx[2, 0, :] = -1  # no valid index: O = 0, every gradient 0
    idx[3, 0, 2] = idx[3, 0, 1]  # one row listed twice
    length = torch.tensor([6, 6, 6, 5, 0, 3, 6], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, 3.0, -1.0], dtype=torch.float64, requires_grad=True)
    do = torch.randn(tokens, heads, d, dtype=torch.float64, generator=g)
    return q, kv, idx, length, sink, do


def failures(seed: int, chunk_bytes: int, drop_sink: bool = False) -> list:
    q, kv, idx, length, sink, do = case(seed)
    o, lse = reference.dsv4_index_attention(q, kv[:, 0], idx[:, 0], length, sink, scale=0.3)
    (o * do).sum().backward()
    dq, dkv, dsink = index_backward(q.detach(), kv.detach(), idx, o.detach(), lse.detach(), do, topk_length=length,
                                    attn_sink=None if drop_sink else sink.detach(), softmax_scale=0.3,
                                    chunk_bytes=chunk_bytes)
    bad = []
    for name, ours, ref in (("dq", dq, q.grad), ("dkv", dkv, kv.grad)):
        if not torch.allclose(ours, ref, rtol=1e-9, atol=1e-12):
            bad.append((name, (ours - ref).abs().max().item()))
    if not (dq[2] == 0).all() or not (dq[4] == 0).all():
        bad.append(("tokens with no valid index got dq",))
    if not drop_sink:
        finite = torch.isfinite(sink.detach())
        if not torch.allclose(dsink.double()[finite], sink.grad[finite], rtol=1e-6) or dsink[~finite].any():
            bad.append(("dsink", dsink.tolist(), sink.grad.tolist()))
    return bad


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["token_chunks", "one_chunk"])
@pytest.mark.parametrize("seed", [1, 2])
def test_index_backward_is_autograds(seed, chunk_bytes):
    bad = failures(seed, chunk_bytes)
    assert not bad, bad


def test_index_backward_checker_rejects_a_missing_sink():
    assert failures(1, 1 << 30, drop_sink=True)
