"""Stage D1 on a GPU: head dims up to 512, K = V, P through SMEM, against the float64 reference.

Stage B's bounds (O relative error <= 4e-3 bf16 / 2e-3 fp16, worst row <= 3x, LSE within 1e-4),
NaN-poisoned outputs, fresh random inputs each run. Head dims 320-512 run the split kernel (two
warpgroups share the rows and split O's columns, P through SMEM); the smaller ones run stage C's
layout with P in registers or, forced, through SMEM. Each case runs with K = V (one tensor, one
load per tile) and with separate K and V.
"""

import math

import pytest
import torch
from repeatable import assert_bitwise_repeatable

from dsv4_attention.common.persistent import cta_limit
from dsv4_attention.common.testing import (
    attention_inputs,
    check_attention,
    cuda_device,
    fresh_generator,
    gpu_arch_params,
    random_bshd,
    sanitizer_test,
)
from dsv4_attention.stages import d1_smem_p as stage

pytestmark = [pytest.mark.stage_d1]

WIDE = (320, 384, 448, 512)


def inputs(b, sq, sk, h, hk, d, dtype, kv_shared, magnitude=1.0):
    return attention_inputs(b, sq, sk, h, hk, d, dtype, kv_shared=kv_shared, magnitude=magnitude)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("kv_shared", [True, False], ids=["k_eq_v", "k_ne_v"])
@pytest.mark.parametrize("head_dim", WIDE)
@pytest.mark.parametrize("seqlen_k", [1, 63, 64, 65, 1000, 4096, 16384])
def test_wide_head_dims(arch, kv_shared, head_dim, seqlen_k, record_errors):
    q, k, v, g = inputs(2, 300, seqlen_k, 4, 2, head_dim, torch.bfloat16, kv_shared)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", (384, 512))
@pytest.mark.parametrize("seqlen_k", [1, 65, 130, 1000])
def test_persistent_ctas_run_many_tiles(arch, head_dim, seqlen_k, record_errors):
    """The seesaw's persistent grid (common/persistent.py) held to 3 CTAs: each runs 13-14 Q tiles in
    a row, every tile with the same KV tile count (1, 2, 3 or 16: odd counts leave the next tile's
    ring uses at the other parity), outputs poisoned as always."""
    q, k, v, g = inputs(2, 300, seqlen_k, 4, 1, head_dim, torch.bfloat16, kv_shared=True)
    with cta_limit(3):
        check_attention(stage.forward, q, k, v, record_errors, g, arch=arch)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
@pytest.mark.parametrize("kv_shared", [True, False], ids=["k_eq_v", "k_ne_v"])
def test_every_head_dim(arch, dtype, head_dim, kv_shared, record_errors):
    q, k, v, g = inputs(2, 257, 777, 4, 1, head_dim, dtype, kv_shared)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", (64, 128, 192, 256))
@pytest.mark.parametrize("seqlen_k", [1, 200, 3000])
def test_p_through_smem_at_small_head_dims(arch, head_dim, seqlen_k, record_errors):
    """The SMEM-P path forced where P could stay in registers (it must give the same answer)."""
    q, k, v, g = inputs(2, 300, seqlen_k, 2, 2, head_dim, torch.bfloat16, kv_shared=False)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch, options={"p_in_smem": True})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", WIDE)
@pytest.mark.parametrize("seqlen_q", [1, 63, 65, 2047])
def test_seqlen_q_and_mqa(arch, head_dim, seqlen_q, record_errors):
    """MQA with 16 query heads on one KV head (DeepSeek-V4's shape, smaller), Q tiles cut anywhere."""
    q, k, v, g = inputs(1, seqlen_q, 500, 16, 1, head_dim, torch.bfloat16, kv_shared=True)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", WIDE)
@pytest.mark.parametrize("key", [0, -1], ids=["first_key", "last_key"])
def test_outlier_forces_late_rescale(arch, head_dim, key, record_errors):
    """One key scores ~+20 (scaled) for every query, at either end of the keys: the row max jumps
    in the first or the last tile a kernel visits; with split warpgroups it lies in one half."""
    q, k, v, g = inputs(2, 130, 1000, 2, 2, head_dim, torch.bfloat16, kv_shared=True)
    u = torch.randn(head_dim, generator=g).sign().to(q.device)
    q = (q.float() + 0.5 * u).to(q.dtype)
    k[:, key] = (u * 40.0 / math.sqrt(head_dim)).to(k.dtype)
    check_attention(stage.forward, q, k, k, record_errors, g, arch=arch, case=f"outlier at key {key}")


# (seqlen_k, outlier key): tiles are visited last-first, visit 2k by the seesaw's leader, 2k + 1 by
# its follower, and an odd count ends with a pair that has no follower tile
SEESAW_CASES = {
    "3_tiles_follower": (129, 100),  # tile 1: the follower's tile of pair 0
    "3_tiles_tail": (129, 5),  # tile 0: the leader's tile of the pair without b
    "5_tiles_follower": (313, 200),  # tile 3: the follower's tile of pair 0
    "5_tiles_leader": (313, 150),  # tile 2: the leader's tile of pair 1
    "5_tiles_tail": (313, 10),  # tile 0: the pair without b
}


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", WIDE)
@pytest.mark.parametrize("case", list(SEESAW_CASES))
def test_seesaw_pairs_and_tail(arch, head_dim, case, record_errors):
    """K = V at head dims 384 and 512 runs the seesaw (stages/d1_smem_p/sm90.py; 320 and 448 the
    lock-step split, which the same cases check). One key scores ~+20 (scaled) for every query in
    the tile the case names: in a follower's tile the follower's max
    exceeds the leader's, so the leader's P and O must be rescaled by r_b = exp2(m_a - m_b) before
    the follower reads P_a; in the leader's tile the follower must take the leader's max as its
    floor; in the tail the follower only adopts the leader's max. Odd tile counts (3, 5) and
    several Q tiles (130 rows)."""
    seqlen_k, key = SEESAW_CASES[case]
    q, k, v, g = inputs(2, 130, seqlen_k, 2, 2, head_dim, torch.bfloat16, kv_shared=True)
    u = torch.randn(head_dim, generator=g).sign().to(q.device)
    q = (q.float() + 0.5 * u).to(q.dtype)
    k[:, key] = (u * 40.0 / math.sqrt(head_dim)).to(k.dtype)
    check_attention(stage.forward, q, k, k, record_errors, g, arch=arch, case=f"seesaw {case}")


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", WIDE)
def test_large_scores(arch, head_dim, record_errors):
    """Scaled scores of standard deviation ~9: the max moves often and far, in both halves."""
    q, k, v, g = inputs(2, 200, 300, 2, 1, head_dim, torch.bfloat16, kv_shared=False, magnitude=3.0)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch, magnitude=3.0)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_k_eq_v_view_of_one_buffer(arch, record_errors):
    """K and V as two views of the same memory with the same strides select the K = V kernel,
    and a strided (non-contiguous heads) KV tensor is read through its strides."""
    dev, g = cuda_device(), fresh_generator()
    kv_big = random_bshd(1, 700, 3, 512, torch.bfloat16, dev, generator=g)
    k = kv_big[:, :, 1:2]  # heads stride 3 * 512
    v = kv_big[:, :, 1:2]
    assert k is not v and k.data_ptr() == v.data_ptr()
    q = random_bshd(1, 129, 8, 512, torch.bfloat16, dev, generator=g)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, k, v, _ = inputs(1, 1000, 3000, 4, 1, 512, torch.bfloat16, kv_shared=True)
    assert_bitwise_repeatable(stage.forward, q, k, k)


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import d1_smem_p as stage
q = torch.randn(1, 100, 2, 512, device="cuda").bfloat16()
kv = torch.randn(1, 200, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, kv)                       # split warpgroups, SMEM-P, K = V chunked ring
stage.forward(q, kv, kv.clone())               # K != V rings
q2, kv2 = q[..., :128].contiguous(), kv[..., :128].contiguous()
stage.forward(q2, kv2, kv2, p_in_smem=True)    # rows layout with SMEM-P
"""

# memcheck: no out-of-bounds access; racecheck: the SMEM-P stores, row-stat exchange and buffer
# reuse are ordered by their barriers; synccheck: every named barrier is reached by the thread
# count it names
test_compute_sanitizer = sanitizer_test(SANITIZER_CASE, tools=("memcheck", "racecheck", "synccheck"))
