"""Stage D2: query heads packed into the M dimension (grouped- and multi-query attention).

Up to D1 a Q tile holds tile_m tokens of one query head, so with g = heads / kv_heads query
heads per KV head every KV tile is loaded g times, and a decode step (1-2 query tokens) fills
1-2 rows of a 64- or 128-row tile. D2 folds the g heads that share a KV head into the rows:
packed row r of KV head hk is token r // g, head hk * g + r % g. The fold is a layout of Q, O
and LSE (common/pack_heads.py), so D1's kernels run on it unchanged; g is a compile-time
option, chosen per call from the shapes (``pack_gqa``).
"""

from __future__ import annotations

import torch

from dsv4_attention.common import interface, jit
from dsv4_attention.common.tiles import q_tile_rows

ID = "d2"
NAME = "pack_heads"
ADDS = "query heads sharing a KV head packed into the rows of a Q tile (one KV load per group; decode fills tiles)"
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "dsv4_attention.stages.d2_pack_heads.sm90:FlashAttentionD2Sm90",
    "sm100": "dsv4_attention.stages.d2_pack_heads.sm100:FlashAttentionD2Sm100",
}
#: the compile-time variants CI compiles and budgets (kernel keyword options)
VARIANTS = ({"kv_shared": True, "pack_group": 128}, {"kv_shared": False, "pack_group": 8})
#: what the CPU demo compiles at every head dim: 64 heads per KV head packs into every tile shape
DEMO_OPTIONS = {"pack_group": 64}


make_kernel = jit.kernel_maker(KERNELS)
#: CPU arguments to compile against (the kernels are shape-dynamic)
example_args = interface.attention_example_args


def tile_rows(arch: str, head_dim: int, kv_shared: bool, p_in_smem: bool | None) -> int:
    """Rows of the kernel's Q tile for this configuration (what a group must pack into): the
    kernels' own table (common/tiles.py), read without importing them; K = V and P's staging do
    not change it (tests/test_d2_cpu.py compares it with every kernel's tile_m)."""
    return q_tile_rows(arch, head_dim)


def forward(q, k, v, *, softmax_scale: float | None = None, pack_gqa: bool | None = None, out=None,
            lse_out=None, p_in_smem: bool | None = None):
    """Stage D1's attention (O and LSE, K = V detected, head dims 64..512) with the query heads
    that share a KV head packed into the rows of a Q tile.

    pack_gqa: None (default) packs whenever heads / kv_heads forms whole tiles (it divides the
    kernel's tile rows or is a multiple of them; see common/pack_heads.py), True insists
    (ValueError where it cannot), False runs one head per tile as stage D1.

    Returns / Raises: as every attention stage (``common/interface.attention_forward``).
    """
    return interface.masked_attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                              tile_rows=tile_rows, p_in_smem=p_in_smem, pack_gqa=pack_gqa)


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 512):
    """bf16, MQA decode-like prefill chunk: batch 8 x 128 heads x 64 query tokens x 4096 keys, K = V."""
    return interface.attention_demo_case(forward, flops, device, head_dim, 8, 128, 64, 4096, kv_heads=1,
                                         kv_shared=True)
