"""Stage D3: per-request key counts.

``seqused_k`` ([batch] int32, the origin's ``swa_lens``; FlashAttention's name): keys at index
>= seqused_k[b] are invisible to request b. KV tiles wholly past it are never loaded; a request
with no visible key returns O = 0 and LSE = -inf (the spec's convention), never NaN.

Variable-length batches in FlashAttention's convention: ``cu_seqlens_q`` / ``cu_seqlens_k``
([requests + 1] int32 offsets) over q [total_q, heads, d], k and v [total_k, kv_heads, d]; o
like q, lse [heads, total_q]. ``max_seqlen_q`` / ``max_seqlen_k`` may be given (else read from
the offsets: one sync; required inside a CUDA graph capture). Lengths of 0 are legal.
"""

from __future__ import annotations

import torch

from dsv4_attention.common import interface, jit
from dsv4_attention.stages.d2_pack_heads import tile_rows

ID = "d3"
NAME = "lengths"
ADDS = ("per-request key counts (seqused_k) and variable-length batches (cu_seqlens): tiles past a request "
        "never loaded, empty rows O = 0 / LSE = -inf")
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "dsv4_attention.stages.d3_lengths.sm90:FlashAttentionD3Sm90",
    "sm100": "dsv4_attention.stages.d3_lengths.sm100:FlashAttentionD3Sm100",
}
#: what the CPU demo compiles at every head dim
DEMO_OPTIONS = {"pack_group": 64, "seqused_k": True}


make_kernel = jit.kernel_maker(KERNELS)
#: CPU arguments to compile against (the kernels are shape-dynamic)
example_args = interface.attention_example_args


def forward(q, k, v, *, softmax_scale: float | None = None, seqused_k: torch.Tensor | None = None,
            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, pack_gqa: bool | None = None,
            out=None, lse_out=None, p_in_smem: bool | None = None):
    """Stage D2's attention with keys j >= seqused_k[b] invisible to request b, or over a
    variable-length batch (cu_seqlens_q / cu_seqlens_k, see the module docstring).

    seqused_k: None (every key) or [batch] int32 on q's device with values in [0, seqlen_k]
    (checked before launch). Variable-length: q [total_q, heads, d], k and v [total_k, kv_heads,
    d], o like q and lse [heads, total_q].

    Returns / Raises: as every attention stage (``common/interface.attention_forward``).
    """
    return interface.masked_attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                              tile_rows=tile_rows, p_in_smem=p_in_smem, pack_gqa=pack_gqa,
                                              seqused_k=seqused_k, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                              max_seqlen_k=max_seqlen_k)


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 512):
    """bf16 decode: 64 requests x 2 query tokens x 128 heads on one KV head, K = V, up to 8192 keys."""
    return interface.attention_demo_case(forward, flops, device, head_dim, 64, 128, 2, 8192, kv_heads=1,
                                         kv_shared=True)
