"""Stage D2 on a GPU: query heads packed into the rows of a Q tile, against the float64 reference.

Stage B's bounds, NaN-poisoned outputs, fresh random inputs. Groups heads / kv_heads of 1, 2, 8, 64
and 128 at head dims 64-512, packed (pack_gqa None: the kernel's choice, asserted to be the packed
kernel where the group packs) and unpacked (pack_gqa False), with decode-sized seqlen_q (1, 2) and
row counts that are not a tile multiple; K = V and not; bf16 and fp16.
"""

import pytest
import torch
from repeatable import assert_bitwise_repeatable

from dsv4_attention.common import jit
from dsv4_attention.common.pack_heads import packable
from dsv4_attention.common.testing import (
    attention_inputs,
    check_attention,
    gpu_arch_params,
    sanitizer_test,
)
from dsv4_attention.stages import d2_pack_heads as stage

pytestmark = [pytest.mark.stage_d2]


def compiled_with_group(arch, dtype, head_dim, group) -> bool:
    return any(key[0] == "d2" and key[1] == arch and key[3] == head_dim and ("pack_group", group) in key[4]
               for key in list(jit._compiled))


def run_case(arch, b, sq, sk, hk, group, d, dtype, kv_shared, pack_gqa, record_errors):
    q, k, v, g = attention_inputs(b, sq, sk, hk * group, hk, d, dtype, kv_shared=kv_shared)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch, group=group,
                    options={"pack_gqa": pack_gqa})
    tile_m = stage.tile_rows(arch, d, kv_shared, None)
    packed = pack_gqa is not False and packable(group, tile_m)
    assert compiled_with_group(arch, dtype, d, group if packed else 1)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("pack_gqa", [None, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("group", [1, 2, 8, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("seqlen_q", [1, 2, 77])
def test_groups(arch, pack_gqa, group, head_dim, seqlen_q, record_errors):
    run_case(arch, 2, seqlen_q, 300, 1, group, head_dim, torch.bfloat16, head_dim >= 256, pack_gqa, record_errors)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [128, 320, 448, 512])
@pytest.mark.parametrize("kv_shared", [True, False], ids=["k_eq_v", "k_ne_v"])
def test_gqa_two_kv_heads(arch, dtype, head_dim, kv_shared, record_errors):
    """Two KV heads of 8 query heads each, rows past a tile multiple, more KV tiles than one."""
    run_case(arch, 3, 301, 1000, 2, 8, head_dim, dtype, kv_shared, True, record_errors)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("seqlen_k", [1, 64, 4097])
def test_decode_mqa_128_heads(arch, seqlen_k, record_errors):
    """DeepSeek-V4's decode: 128 heads on one latent KV head, hd 512, K = V, 2 query tokens, 16 requests
    (2 at 4097 keys: the float64 reference expands K to every head)."""
    run_case(arch, 16 if seqlen_k < 4096 else 2, 2, seqlen_k, 1, 128, 512, torch.bfloat16, True, True,
             record_errors)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_pack_gqa_true_refuses_a_group_that_cannot_pack(arch):
    q, k, v, _ = attention_inputs(1, 4, 100, 3, 1, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="pack_gqa=True"):
        stage.forward(q, k, v, pack_gqa=True)
    o, _ = stage.forward(q, k, v)  # None: runs unpacked
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, k, v, _ = attention_inputs(2, 33, 3000, 128, 1, 512, torch.bfloat16, kv_shared=True)
    assert_bitwise_repeatable(stage.forward, q, k, v)


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import d2_pack_heads as stage
q = torch.randn(2, 3, 128, 512, device="cuda").bfloat16()
kv = torch.randn(2, 200, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, kv)                                   # 128 heads of one token: two 64-row tiles
q8 = torch.randn(1, 77, 16, 128, device="cuda").bfloat16()
k8 = torch.randn(1, 150, 2, 128, device="cuda").bfloat16()
stage.forward(q8, k8, k8.clone())                          # 8 heads x 16 tokens per tile, last tile partial
"""

# memcheck: the folded TMA boxes and LSE writes stay inside Q, O and LSE (rows past the last token
# are clipped); racecheck: nothing the fold changes reorders SMEM traffic
test_compute_sanitizer = sanitizer_test(SANITIZER_CASE)
