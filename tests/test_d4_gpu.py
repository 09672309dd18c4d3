"""Stage D4 on a GPU: causal and sliding windows (FlashAttention-4's bottom-right convention),
against the float64 reference with the same pairs masked. Windows (0, 0), (127, 0), (5, 3),
(None, 0), (0, None) and one wider than the sequence, with seqlen_q <, = and > seqlen_k; heads
packed and not; rows that see no key must return O = 0 and LSE = -inf exactly."""

import pytest
import torch

from dsv4_attention.common.testing import (
    attention_inputs,
    check_attention,
    check_varlen,
    fresh_generator,
    gpu_arch_params,
    sanitizer_test,
    varlen_inputs,
)
from dsv4_attention.stages import d4_causal_window as stage

pytestmark = [pytest.mark.stage_d4]

WINDOWS = [(0, 0), (127, 0), (5, 3), (None, 0), (0, None), (5000, 4000)]
LENGTHS = [(200, 700), (500, 500), (700, 200)]


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("seqlens", LENGTHS, ids=lambda s: f"sq{s[0]}-sk{s[1]}")
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("pack_gqa", [None, False], ids=["packed", "unpacked"])
def test_windows(arch, window, seqlens, head_dim, pack_gqa, record_errors):
    sq, sk = seqlens
    q, k, v, g = attention_inputs(2, sq, sk, 8, 1, head_dim, torch.bfloat16, kv_shared=head_dim == 512)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"window_size": window, "pack_gqa": pack_gqa})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("window", [(None, 0), (127, 0), (5, 3), (0, None)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 512])
@pytest.mark.parametrize("group", [1, 16])
def test_varlen_windows(arch, window, head_dim, group, record_errors):
    """Variable-length batches under causal / window masks, aligned per request (bottom-right:
    each request's own seqlen_k - seqlen_q), with requests of fewer, as many and more queries than
    keys, and empty ones."""
    g0 = fresh_generator()
    q_lens = [0, 200, 500, 77, 130] + torch.randint(1, 300, (3,), generator=g0).tolist()
    k_lens = [50, 700, 500, 0, 20] + torch.randint(1, 300, (3,), generator=g0).tolist()
    q, k, v, cu_q, cu_k, g = varlen_inputs(q_lens, k_lens, group, 1, head_dim, torch.bfloat16,
                                           kv_shared=head_dim == 512, pad=3)
    check_varlen(stage.forward, q, k, v, cu_q, cu_k, record_errors, g, arch=arch, options={"window_size": window})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("window", [(None, 2**31 - 1), (2**31 - 1, None), (2**31 - 1, 2**31 - 1), (2**31 - 1, 0)],
                         ids=str)
@pytest.mark.parametrize("head_dim", [64, 512])
def test_bounds_up_to_2_31(arch, window, head_dim, record_errors):
    """The largest bounds the call accepts (a window wider than any sequence): no position sum may
    wrap (common/kv_span.py; the code before 2026-11-27 lost keys to it). seqlen_q > seqlen_k puts
    tokens before the first key, where the left bound's subtraction would underflow."""
    q, k, v, g = attention_inputs(2, 700, 300, 8, 1, head_dim, torch.bfloat16, kv_shared=head_dim == 512)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch, options={"window_size": window})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_varlen_deepseek_window_branch(arch, record_errors):
    """DeepSeek-V4's window branch over a variable-length prefill batch: 128 heads on one K = V
    head, hd 512, causal window (127, 0)."""
    q, k, v, cu_q, cu_k, g = varlen_inputs([300, 1, 129, 64], [300, 1, 129, 400], 128, 1, 512, torch.bfloat16,
                                           kv_shared=True)
    check_varlen(stage.forward, q, k, v, cu_q, cu_k, record_errors, g, arch=arch,
                 options={"causal": True, "window_size": (127, 0)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [64, 192, 256, 320, 384, 448])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_causal_every_head_dim(arch, head_dim, dtype, record_errors):
    q, k, v, g = attention_inputs(2, 333, 1000, 4, 2, head_dim, dtype)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch, options={"causal": True})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [256, 512])
def test_deepseek_window_branch(arch, head_dim, record_errors):
    """128 heads on one KV head (K = V), causal window (127, 0), per-request lengths."""
    q, k, v, g = attention_inputs(3, 300, 300, 128, 1, head_dim, torch.bfloat16, kv_shared=True)
    n = torch.tensor([300, 1, 190], dtype=torch.int32, device="cuda")
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"causal": True, "window_size": (127, 0), "seqused_k": n})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("window", [(None, 0), (64, 64)], ids=str)
def test_causal_long_sequences(arch, window, record_errors):
    q, k, v, g = attention_inputs(1, 4100, 4100, 2, 1, 128, torch.bfloat16)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch, options={"window_size": window})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_no_window_equals_stage_d3(arch):
    from dsv4_attention.stages import d3_lengths

    q, k, v, _ = attention_inputs(2, 100, 777, 16, 2, 128, torch.bfloat16)
    o1, l1 = stage.forward(q, k, v, window_size=(None, None))
    o2, l2 = d3_lengths.forward(q, k, v)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, k, v, _ = attention_inputs(1, 1000, 1000, 128, 1, 512, torch.bfloat16, kv_shared=True)
    o1, l1 = stage.forward(q, k, v, causal=True, window_size=(127, 0))
    o2, l2 = stage.forward(q, k, v, causal=True, window_size=(127, 0))
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import d4_causal_window as stage
q = torch.randn(2, 130, 128, 512, device="cuda").bfloat16()
kv = torch.randn(2, 200, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, kv, causal=True, window_size=(127, 0),
              seqused_k=torch.tensor([0, 150], dtype=torch.int32, device="cuda"))
q2 = torch.randn(1, 300, 4, 128, device="cuda").bfloat16()
k2 = torch.randn(1, 200, 2, 128, device="cuda").bfloat16()
stage.forward(q2, k2, k2.clone(), causal=True)
stage.forward(q2, k2, k2.clone(), window_size=(5, 3))
"""

test_compute_sanitizer = sanitizer_test(SANITIZER_CASE)


@pytest.mark.big_memory
@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("pack_gqa", [None, False], ids=["packed", "unpacked"])
def test_past_2_31_elements(arch, pack_gqa, record_errors):
    """Q and O of more than 2^31 elements: DeepSeek-V4's window branch (128 heads, hd 512, K = V)
    at 2^31 / (128 * 512) + 100 tokens, so the last 100 tokens' elements lie past 2^31 (byte
    offsets past 4 GiB). Offsets are 64-bit (CuTe's dynamic strides), not rejected: every output
    element must be written (no NaN left from the poison), and the first and last 256 tokens
    must match the reference (windows are local: a slice's reference needs only its 127 keys
    before)."""
    from dsv4_attention.common.reference import attention
    from dsv4_attention.common.testing import LSE_ABS, O_REL, errors, poison_

    t = 2**31 // (128 * 512) + 100
    g = torch.Generator(device="cuda").manual_seed(2**31)
    q = torch.randn(1, t, 128, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, t, 1, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    assert q.numel() > 2**31
    o, lse = poison_(torch.empty_like(q)), poison_(torch.empty(1, 128, t, device="cuda"))
    stage.forward(q, kv, kv, causal=True, window_size=(127, 0), pack_gqa=pack_gqa, out=o, lse_out=lse)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), "elements left unwritten"
    for rows, keys in ((slice(0, 256), slice(0, 256)), (slice(t - 256, t), slice(t - 383, t))):
        o_ref, lse_ref = attention(q[:, rows], kv[:, keys], kv[:, keys], causal=True, window_size=(127, 0))
        e = errors(o[:, rows], o_ref)
        record_errors(e, arch=arch, shape=list(q.shape), rows=[rows.start, rows.stop], pack_gqa=pack_gqa)
        assert e.within(O_REL[q.dtype], 3 * O_REL[q.dtype]), (rows, e)
        assert (lse[:, :, rows].double() - lse_ref).abs().max().item() <= LSE_ABS
    del q, kv, o, lse
