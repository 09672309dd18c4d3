"""Stage C on a GPU: attention over any seqlen_k against the float64 reference.

Stage B's bounds (O relative error <= 4e-3 bf16 / 2e-3 fp16, rows <= 3x, LSE within
1e-4), now over many KV tiles: the tail tile, a late max forced by an outlier key in
the last tile, bitwise-repeatable runs, and compute-sanitizer's memcheck and racecheck.
"""

import math

import pytest
import torch
from repeatable import assert_bitwise_repeatable

from dsv4_attention.common.testing import (
    attention_inputs,
    check_attention,
    gpu_arch_params,
    sanitizer_test,
)
from dsv4_attention.stages import c_online_softmax as stage

pytestmark = [pytest.mark.stage_c]


def check(arch, q, k, v, record, g, **case):
    check_attention(stage.forward, q, k, v, record, g, arch=arch, **case)


def inputs(b, sq, sk, h, hk, d, dtype, magnitude=1.0):
    return attention_inputs(b, sq, sk, h, hk, d, dtype, magnitude=magnitude)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
@pytest.mark.parametrize("seqlen_k", [1, 127, 128, 129, 1000, 4096, 16384])
def test_seqlen_k(arch, dtype, head_dim, seqlen_k, record_errors):
    q, k, v, g = inputs(2, 300, seqlen_k, 4, 2, head_dim, dtype)
    check(arch, q, k, v, record_errors, g)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q", [1, 129, 2047])
def test_seqlen_q_and_mha(arch, head_dim, seqlen_q, record_errors):
    q, k, v, g = inputs(3, seqlen_q, 777, 2, 2, head_dim, torch.bfloat16)
    check(arch, q, k, v, record_errors, g)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
def test_large_scores(arch, dtype, head_dim, record_errors):
    """Scaled scores of standard deviation ~9 over 3 tiles: the max moves often and far."""
    q, k, v, g = inputs(2, 200, 300, 2, 1, head_dim, dtype, magnitude=3.0)
    check(arch, q, k, v, record_errors, g, magnitude=3.0)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
@pytest.mark.parametrize("key", [0, -1], ids=["first_key", "last_key"])
def test_outlier_forces_late_rescale(arch, head_dim, key, record_errors):
    """Every query scores ~+20 (scaled) against one key at either end of the sequence: the row
    max jumps in the tile a kernel visits last, after O has accumulated 7 tiles under a smaller
    max. (The sm90 kernel visits KV tiles from the last to the first, sm100 from the first:
    one of the two cases is each kernel's late one.)"""
    q, k, v, g = inputs(2, 256, 1000, 2, 2, head_dim, torch.bfloat16)
    u = torch.randn(head_dim, generator=g).sign().to(q.device)
    q = (q.float() + 0.5 * u).to(q.dtype)
    k[:, key] = (u * 40.0 / math.sqrt(head_dim)).to(k.dtype)
    check(arch, q, k, v, record_errors, g, case=f"outlier at key {key}")


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, k, v, _ = inputs(2, 1000, 3000, 4, 2, 128, torch.bfloat16)
    assert_bitwise_repeatable(stage.forward, q, k, v)


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import c_online_softmax as stage
q = torch.randn(1, 200, 2, 64, device="cuda").bfloat16()
k = torch.randn(1, 300, 1, 64, device="cuda").bfloat16()
o, lse = stage.forward(q, k, k.clone())
assert torch.isfinite(o).all()
"""

test_compute_sanitizer = sanitizer_test(SANITIZER_CASE)
