"""Stage C: attention over any sequence length: pipelined K/V tiles, online softmax, O rescale.

Stage B's one-tile kernel, looped over KV tiles: K and V of tile j stream through a
multi-stage TMA pipeline, each row keeps a running max and a running sum in the
exp2 domain, and O is rescaled by exp2(m_old - m_new) whenever a row's max grows,
before the next PV accumulates into it. On Hopper (sm90.py) it is FlashAttention-3's
schedule: a producer warpgroup, consumer warpgroups with register reallocation,
P in registers, intra-warpgroup overlap and ping-pong. On Blackwell (sm100.py)
correction warps rescale O in TMEM, lazily (only when a max grew past a threshold).
"""

from __future__ import annotations

import torch

from dsv4_attention.common import interface, jit

ID = "c"
NAME = "online_softmax"
ADDS = "any seqlen_k: pipelined K/V tiles, online softmax, O rescale (correction warps on sm100)"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "dsv4_attention.stages.c_online_softmax.sm90:FlashAttentionSm90",
    "sm100": "dsv4_attention.stages.c_online_softmax.sm100:FlashAttentionSm100",
}


def make_kernel(arch: str, dtype: torch.dtype, head_dim: int):
    return jit.kernel_class(KERNELS, arch)(jit.cutlass_dtype(dtype), head_dim)


def example_args(dtype: torch.dtype, head_dim: int):
    return interface.attention_example_args(dtype, head_dim, seqlen_k=1000, plain=True)


def forward(q, k, v, *, softmax_scale: float | None = None, out=None, lse_out=None):
    """O[b, i, h, :] = sum_j softmax_j(scale * q_i . k_j) v_j and LSE[b, h, i] (natural log, fp32).

    q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, kv_heads, head_dim], any
    seqlen_k (0 gives O = 0 and LSE = -inf), bf16 or fp16, head_dim in {64, 128, 256}, kv_heads
    dividing heads.

    Returns / Raises: as every attention stage (``common/interface.attention_forward``).
    """
    return interface.attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out, plan=())


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 128):
    """bf16, batch 4 x 16 heads x 8192 x 8192 (FlashAttention-4's anchor shape): (errors, ms, TFLOP/s)."""
    return interface.attention_demo_case(forward, flops, device, head_dim, 4, 16, 8192, 8192)
