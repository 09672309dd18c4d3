"""Stage D4 on a GPU: causal and sliding windows (FlashAttention-4's bottom-right convention),
against the float64 reference with the same pairs masked. Windows (0, 0), (127, 0), (5, 3),
(None, 0), (0, None) and one wider than the sequence, with seqlen_q <, = and > seqlen_k; heads
packed and not; rows that see no key must return O = 0 and LSE = -inf exactly."""

import pytest
import torch

from common.testing import attention_inputs, check_attention, gpu_arch_params, run_compute_sanitizer
from stages import d4_causal_window as stage

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
    from stages import d3_lengths

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
from stages import d4_causal_window as stage
q = torch.randn(2, 130, 128, 512, device="cuda").bfloat16()
kv = torch.randn(2, 200, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, kv, causal=True, window_size=(127, 0),
              seqused_k=torch.tensor([0, 150], dtype=torch.int32, device="cuda"))
q2 = torch.randn(1, 300, 4, 128, device="cuda").bfloat16()
k2 = torch.randn(1, 200, 2, 128, device="cuda").bfloat16()
stage.forward(q2, k2, k2.clone(), causal=True)
stage.forward(q2, k2, k2.clone(), window_size=(5, 3))
torch.cuda.synchronize()
print("sanitized case ran")
"""


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(arch, tool):
    run_compute_sanitizer(tool, SANITIZER_CASE)
