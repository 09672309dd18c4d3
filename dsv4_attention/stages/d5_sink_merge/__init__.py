"""Stage D5: the attention sink, and the exact merge of two attentions.

``learnable_sink`` ([heads] fp32, FlashAttention-4's name; DeepSeek-V4's ``attn_sink``): a logit
in the softmax's denominator only. O[b, i, h] is multiplied by sigmoid(LSE[b, h, i] - sink[h]) in
the epilogue; LSE is returned without the sink (the public convention, so that a caller can
still merge partial results); a row with no visible key stays O = 0, LSE = -inf. Everything of
stage D4 (causal, windows, seqused_k, variable-length batches, packed heads, K = V) composes.

``merge_attention(o1, lse1, o2, lse2)`` (common/merge.py): two attentions over disjoint key sets
(DeepSeek-V4's window branch and its compressed entries) as one softmax over their union, exact
in fp32 (the LSE formula). The sink belongs to the union: apply it after the merge
(``apply_sink``), or pass it to the last call only when the other side is empty.
"""

from __future__ import annotations

import torch

from dsv4_attention.common import interface, jit
from dsv4_attention.common.merge import merge_attention, sink_scale
from dsv4_attention.common.validation import check_window
from dsv4_attention.stages.d2_pack_heads import tile_rows
from dsv4_attention.stages.d4_causal_window import flops  # noqa: F401 - the same FLOPs as D4

ID = "d5"
NAME = "sink_merge"
ADDS = "attention sink (learnable_sink: O *= sigmoid(LSE - sink) in the epilogue) and the exact LSE merge"
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "dsv4_attention.stages.d5_sink_merge.sm90:FlashAttentionD5Sm90",
    "sm100": "dsv4_attention.stages.d5_sink_merge.sm100:FlashAttentionD5Sm100",
}
#: what the CPU demo compiles at every head dim: DeepSeek-V4's window branch with its sink
DEMO_OPTIONS = {"pack_group": 64, "has_left": True, "has_right": True, "has_sink": True}

__all__ = ["forward", "merge_attention", "apply_sink", "flops"]


make_kernel = jit.kernel_maker(KERNELS)
#: CPU arguments to compile against (the kernels are shape-dynamic)
example_args = interface.attention_example_args


def forward(q, k, v, *, softmax_scale: float | None = None, learnable_sink: torch.Tensor | None = None,
            causal: bool = False, window_size=(None, None), seqused_k: torch.Tensor | None = None,
            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, pack_gqa: bool | None = None,
            out=None, lse_out=None, p_in_smem: bool | None = None):
    """Stage D4's attention with an attention sink: ``learnable_sink`` None or [heads] fp32 on
    q's device, O *= sigmoid(LSE - sink[h]).

    Returns / Raises: as every attention stage (``common/interface.attention_forward``); LSE
    never includes the sink.
    """
    window = check_window(causal, window_size)
    return interface.masked_attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                              tile_rows=tile_rows, p_in_smem=p_in_smem, pack_gqa=pack_gqa,
                                              seqused_k=seqused_k, window=window, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                              max_seqlen_k=max_seqlen_k, learnable_sink=learnable_sink)


def apply_sink(o: torch.Tensor, lse: torch.Tensor, learnable_sink: torch.Tensor, *, lse_layout: str = "bhs"):
    """O * sigmoid(LSE - sink[h]) in fp32 (the kernel's epilogue, in torch): the sink of a merged
    result. lse [batch, heads, seqlen] (``"bhs"``) or [heads, total] (``"ht"``). A row with no
    visible key (LSE = -inf) stays O = 0 for any sink, +-inf included (``merge.sink_scale``).

    Args:
        o: [batch, seqlen, heads, d] (``"bhs"``) or [total, heads, d] (``"ht"``).
        lse: the natural-log LSE of ``o``'s rows, without a sink.
        learnable_sink: [heads] logits (any float dtype); -inf: no sink, +inf: O = 0.

    Returns:
        O scaled by the sink, in ``o``'s dtype (LSE is unchanged: it never includes the sink)."""
    s = learnable_sink
    if lse_layout == "bhs":
        w = sink_scale(lse, s[None, :, None]).transpose(1, 2)[..., None]
    else:
        w = sink_scale(lse, s[:, None]).transpose(0, 1)[..., None]
    return (o.float() * w).to(o.dtype)


def demo_case(device, head_dim: int = 512):
    """bf16 DeepSeek-V4 window branch with its sink: 128 heads on one KV head, K = V, 4096 tokens,
    causal, window (127, 0)."""
    from dsv4_attention.common import bench
    from dsv4_attention.common.reference import attention
    from dsv4_attention.common.testing import errors, random_bshd

    q = random_bshd(1, 4096, 128, head_dim, torch.bfloat16, device)
    kv = random_bshd(1, 4096, 1, head_dim, torch.bfloat16, device)
    sink = torch.randn(128, device=device)
    kw = {"causal": True, "window_size": (127, 0), "learnable_sink": sink}
    o, _ = forward(q, kv, kv, **kw)
    rows = slice(0, 512)
    e = errors(o[:, rows], attention(q[:, rows], kv[:, :512], kv[:, :512], **kw)[0])
    ms = bench.time_ms([lambda: forward(q, kv, kv, **kw)])
    return e, ms, bench.tflops(flops(1, 4096, 4096, 128, head_dim, True, (127, 0)), ms)
