"""Stage D4: causal attention and sliding windows.

``causal`` and ``window_size = (left, right)`` with FlashAttention-4's names and bottom-right
alignment: query i sees key j iff i' - left <= j <= i' + right with i' = i + seqlen_k - seqlen_q
(seqlen_k = seqused_k[b] where given); None is unbounded, causal is right = 0. No sentinel means
"no window": bounds are ints >= 0 or None. KV tiles outside a Q tile's visible span are never
loaded; masks run only on the tiles that straddle a boundary; a row that sees no key returns O = 0
and LSE = -inf. The window bounds are runtime arguments: one compiled kernel per (which bounds
exist), whatever their values.
"""

from __future__ import annotations

import torch

from dsv4_attention.common import interface, jit
from dsv4_attention.common.bench import visible_pairs
from dsv4_attention.common.validation import check_window
from dsv4_attention.stages.d2_pack_heads import tile_rows

ID = "d4"
NAME = "causal_window"
ADDS = "causal and sliding-window masks: only the KV tiles of a Q tile's span are loaded, only its edge tiles masked"
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "dsv4_attention.stages.d4_causal_window.sm90:FlashAttentionD4Sm90",
    "sm100": "dsv4_attention.stages.d4_causal_window.sm100:FlashAttentionD4Sm100",
}
#: what the CPU demo compiles at every head dim: DeepSeek-V4's window branch (left and right bounds)
DEMO_OPTIONS = {"pack_group": 64, "seqused_k": True, "has_left": True, "has_right": True}


make_kernel = jit.kernel_maker(KERNELS)
#: CPU arguments to compile against (the kernels are shape-dynamic)
example_args = interface.attention_example_args


def forward(q, k, v, *, softmax_scale: float | None = None, causal: bool = False, window_size=(None, None),
            seqused_k: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None, pack_gqa: bool | None = None, out=None, lse_out=None,
            p_in_smem: bool | None = None):
    """Stage D3's attention (heads packed, seqused_k or variable-length batches) restricted to a
    causal / sliding window (aligned per request).

    causal: right bound 0. window_size: (left, right), each an int >= 0 or None (unbounded).
    DeepSeek-V4's window branch is ``causal=True, window_size=(127, 0)``.

    Returns / Raises: as every attention stage (``common/interface.attention_forward``).
    """
    window = check_window(causal, window_size)
    return interface.masked_attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                              tile_rows=tile_rows, p_in_smem=p_in_smem, pack_gqa=pack_gqa,
                                              seqused_k=seqused_k, window=window, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                              max_seqlen_k=max_seqlen_k)




def flops(batch, seqlen_q, seqlen_k, heads, head_dim, causal: bool = False, window_size=(None, None)) -> int:
    return 4 * batch * heads * visible_pairs(seqlen_q, seqlen_k, causal, window_size) * head_dim


def demo_case(device, head_dim: int = 512):
    """bf16 DeepSeek-V4 window branch: 128 heads on one KV head, K = V, 4096 tokens, causal, window (127, 0)."""
    from dsv4_attention.common import bench
    from dsv4_attention.common.reference import attention
    from dsv4_attention.common.testing import errors, random_bshd

    q = random_bshd(1, 4096, 128, head_dim, torch.bfloat16, device)
    kv = random_bshd(1, 4096, 1, head_dim, torch.bfloat16, device)
    o, _ = forward(q, kv, kv, causal=True, window_size=(127, 0))
    rows = slice(0, 512)
    e = errors(o[:, rows], attention(q[:, rows], kv[:, :512], kv[:, :512], causal=True, window_size=(127, 0))[0])
    ms = bench.time_ms([lambda: forward(q, kv, kv, causal=True, window_size=(127, 0))])
    return e, ms, bench.tflops(flops(1, 4096, 4096, 128, head_dim, True, (127, 0)), ms)
