"""Stage D3 on a GPU: per-request key counts (seqused_k), against the float64 reference with the
same keys masked. Stage B's bounds, NaN-poisoned outputs, fresh random inputs and lengths; rows
of a request with no key must come back O = 0 and LSE = -inf exactly."""

import pytest
import torch

from common.testing import attention_inputs, check_attention, fresh_generator, gpu_arch_params, run_compute_sanitizer
from stages import d3_lengths as stage

pytestmark = [pytest.mark.stage_d3]


def lengths(batch, seqlen_k, g, extremes=True):
    """Random seqused_k in [0, seqlen_k], with 0 and seqlen_k among them when ``extremes``."""
    n = torch.randint(0, seqlen_k + 1, (batch,), generator=g, dtype=torch.int32)
    if extremes and batch >= 2:
        n[0], n[1] = 0, seqlen_k
    return n.cuda()


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [64, 128, 256, 320, 512])
@pytest.mark.parametrize("kv_shared", [True, False], ids=["k_eq_v", "k_ne_v"])
@pytest.mark.parametrize("group", [1, 8, 64])
def test_random_lengths(arch, head_dim, kv_shared, group, record_errors):
    q, k, v, g = attention_inputs(5, 77, 900, 2 * group, 2, head_dim, torch.bfloat16, kv_shared=kv_shared)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"seqused_k": lengths(5, 900, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_request_empty(arch, dtype, record_errors):
    q, k, v, g = attention_inputs(3, 130, 300, 4, 1, 128, dtype)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"seqused_k": torch.zeros(3, dtype=torch.int32, device="cuda")})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("seqlen_k", [1, 64, 65, 3000])
def test_decode_mqa_128_heads(arch, seqlen_k, record_errors):
    """DeepSeek-V4's decode: 2 tokens x 128 heads on one latent KV head (K = V, hd 512), one KV
    tensor of seqlen_k rows per request and each request using a random prefix of it."""
    b = 6 if seqlen_k <= 100 else 2  # the float64 reference expands K to all 128 heads: ~5 GB at 3000 keys
    q, k, v, g = attention_inputs(b, 2, seqlen_k, 128, 1, 512, torch.bfloat16, kv_shared=True)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"seqused_k": lengths(b, seqlen_k, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_full_lengths_equal_no_lengths(arch):
    """seqused_k = seqlen_k everywhere gives stage D2's bits."""
    from stages import d2_pack_heads

    q, k, v, _ = attention_inputs(2, 100, 777, 16, 2, 256, torch.bfloat16)
    o1, l1 = stage.forward(q, k, v, seqused_k=torch.full((2,), 777, dtype=torch.int32, device="cuda"))
    o2, l2 = d2_pack_heads.forward(q, k, v)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bad_lengths_are_refused_before_launch(arch):
    q, k, v, _ = attention_inputs(2, 10, 50, 2, 1, 128, torch.bfloat16)
    for bad, match in [(torch.tensor([3, 51], dtype=torch.int32, device="cuda"), "values must lie"),
                       (torch.tensor([3, -1], dtype=torch.int32, device="cuda"), "values must lie"),
                       (torch.tensor([3, 4], dtype=torch.int64, device="cuda"), "int32"),
                       (torch.tensor([3, 4], dtype=torch.int32), "must be on"),
                       (torch.tensor([3], dtype=torch.int32, device="cuda"), "shape")]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, k, v, seqused_k=bad)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, k, v, g = attention_inputs(4, 33, 3000, 128, 1, 512, torch.bfloat16, kv_shared=True)
    n = lengths(4, 3000, fresh_generator())
    o1, l1 = stage.forward(q, k, v, seqused_k=n)
    o2, l2 = stage.forward(q, k, v, seqused_k=n)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


SANITIZER_CASE = """
import torch
from stages import d3_lengths as stage
q = torch.randn(3, 3, 128, 512, device="cuda").bfloat16()
kv = torch.randn(3, 300, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, kv, seqused_k=torch.tensor([0, 77, 300], dtype=torch.int32, device="cuda"))
q8 = torch.randn(2, 77, 16, 128, device="cuda").bfloat16()
k8 = torch.randn(2, 150, 2, 128, device="cuda").bfloat16()
stage.forward(q8, k8, k8.clone(), seqused_k=torch.tensor([1, 150], dtype=torch.int32, device="cuda"))
torch.cuda.synchronize()
print("sanitized case ran")
"""


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(arch, tool):
    run_compute_sanitizer(tool, SANITIZER_CASE)
