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


def test_tensor_core_gemms_only_for_16_bit_cuda_calls():
    """The torch-composed backwards' TF32 switch: on for a 16-bit call on CUDA, restored after it
    (also when the body raises); untouched for fp32 / fp64 calls and on the CPU."""
    from dsv4_attention.stages.f_backward.fused import tensor_core_gemms

    matmul = torch.backends.cuda.matmul

    def setting():
        return matmul.fp32_precision if hasattr(matmul, "fp32_precision") else matmul.allow_tf32

    tf32 = "tf32" if hasattr(matmul, "fp32_precision") else True
    before = setting()
    cuda = torch.device("cuda")
    with tensor_core_gemms(torch.bfloat16, cuda):
        assert setting() == tf32
    assert setting() == before
    with pytest.raises(RuntimeError), tensor_core_gemms(torch.float16, cuda):
        assert setting() == tf32
        raise RuntimeError("restored anyway")
    assert setting() == before
    for dtype, device in ((torch.float32, cuda), (torch.float64, cuda), (torch.bfloat16, torch.device("cpu"))):
        with tensor_core_gemms(dtype, device):
            assert setting() == before


def test_index_past_the_rows_is_none():
    """The kernel's contract, which the torch form shares: an index at or past kv's rows is -1 (no
    key, no gradient), not a gather out of bounds (on CUDA that was a device-side assert, the
    2026-12-01 GPU run of the kernel's test). Control: the same list with -1 there."""
    q, kv, idx, length, sink, do = case(3)
    q, kv = q.detach(), kv.detach()
    o, lse = reference.dsv4_index_attention(q, kv[:, 0], idx[:, 0], length, sink.detach(), scale=0.3)
    past, none = idx.clone(), idx.clone()
    past[0, 0, 1], none[0, 0, 1] = kv.shape[0] + 5, -1
    got = index_backward(q, kv, past, o, lse, do, topk_length=length, attn_sink=sink.detach(), softmax_scale=0.3)
    want = index_backward(q, kv, none, o, lse, do, topk_length=length, attn_sink=sink.detach(), softmax_scale=0.3)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    listed = index_backward(q, kv, idx, o, lse, do, topk_length=length, attn_sink=sink.detach(), softmax_scale=0.3)
    assert not torch.equal(listed[0], want[0])  # the entry does count where it is a row


def test_deterministic_mode_keeps_the_kernel_out():
    """Under torch.use_deterministic_algorithms(True) index_backward never takes the kernel (its dkv
    reductions land in any order): kernel_serves says why before anything about the device, so the
    rule holds on any machine; the torch form's index_add_ is deterministic under the flag. Control:
    without the flag the first reason is the device's."""
    from dsv4_attention.stages.f_backward import index

    q, kv, idx, _, _, _ = case(1)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert "deterministic" in index.kernel_serves(q, kv, idx)
        torch.use_deterministic_algorithms(False)
        assert index.kernel_serves(q, kv, idx) == "not a CUDA tensor"
    finally:
        torch.use_deterministic_algorithms(before)
