"""Stage B: attention over one KV tile with P kept on-chip.

O = softmax(scale * Q K^T) V and LSE for seqlen_k <= 128 (one KV tile): the
softmax runs on S where the QK MMA left it and P never touches global memory.
On Blackwell (sm100.py) P is written into TMEM over S (two 16-bit values per
32-bit column) and read by the PV MMA straight from TMEM; on Hopper (sm90.py)
P stays in registers and the accumulator fragment is reused as the A operand
of a register-sourced wgmma. The origin stalled here: its softmax wrote P
through the QK accumulator's layout and the PV MMA read something else.
"""

from __future__ import annotations

import torch

from dsv4_attention.common import interface, jit

ID = "b"
NAME = "p_onchip"
ADDS = "softmax + PV over one KV tile; P on-chip (TMEM-P on sm100, registers on sm90); O and LSE"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
KV_TILE = 128
KERNELS = {
    "sm90": "dsv4_attention.stages.b_p_onchip.sm90:AttentionOneTileSm90",
    "sm100": "dsv4_attention.stages.b_p_onchip.sm100:AttentionOneTileSm100",
}


def make_kernel(arch: str, dtype: torch.dtype, head_dim: int):
    return jit.kernel_class(KERNELS, arch)(jit.cutlass_dtype(dtype), head_dim)


def example_args(dtype: torch.dtype, head_dim: int):
    return interface.attention_example_args(dtype, head_dim, seqlen_k=100, plain=True)


def forward(q, k, v, *, softmax_scale: float | None = None, out=None, lse_out=None):
    """O[b, i, h, :] = sum_j softmax_j(scale * q_i . k_j) v_j and LSE[b, h, i] (natural log, fp32).

    q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, kv_heads, head_dim] with
    seqlen_k <= 128 (one KV tile; longer sequences are stage C's), bf16 or fp16, head_dim in
    {64, 128, 256}.

    Returns / Raises: as every attention stage (``common/interface.attention_forward``).
    """
    return interface.attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                       KV_TILE, " (one KV tile); stage C serves longer sequences", plan=())


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 128):
    """bf16, batch 4 x 16 heads x 8192 queries against one full KV tile: (errors, ms, TFLOP/s)."""
    return interface.attention_demo_case(forward, flops, device, head_dim, 4, 16, 8192, KV_TILE)
