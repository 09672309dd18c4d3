"""Stage D1: P staged through shared memory, head dims up to 512, K = V loaded once.

Stage C keeps P where the softmax produced it (registers on Hopper, TMEM on Blackwell).
From head dim 320 on that stops working: on Hopper O's 512 fp32 columns do not fit one
warpgroup's registers, so two warpgroups split O's columns and both need every P; on
Blackwell O alone takes the TMEM columns S would share P with. P therefore goes to a
swizzled SMEM buffer in the layout the PV MMA reads as its A operand (proven byte for
byte on the host, bank conflicts counted). The QK GEMM's K dimension runs in k-subtiles
accumulated into one S before the softmax; PV is split along V's dimension in MMA N
chunks of at most 256. When the caller passes one tensor as both K and V (DeepSeek-V4's
shared latent KV), each KV tile is loaded once and serves both GEMMs.
"""

from __future__ import annotations

import torch

from dsv4_attention.common import interface, jit, seams

ID = "d1"
NAME = "smem_p"
ADDS = "P staged in SMEM (byte-proven A operand), head dims 64..512 in k-subtiles, K = V loaded once"
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "dsv4_attention.stages.d1_smem_p.sm90:FlashAttentionD1Sm90",
    "sm100": "dsv4_attention.stages.d1_smem_p.sm100:FlashAttentionD1Sm100",
}
#: the compile-time variants CI compiles and budgets (kernel keyword options)
VARIANTS = ({"kv_shared": False}, {"kv_shared": True})


make_kernel = jit.kernel_maker(KERNELS)
#: CPU arguments to compile against (the kernels are shape-dynamic)
example_args = interface.attention_example_args


def forward(q, k, v, *, softmax_scale: float | None = None, out=None, lse_out=None, p_in_smem: bool | None = None):
    """O[b, i, h, :] = sum_j softmax_j(scale * q_i . k_j) v_j and LSE[b, h, i] (natural log, fp32).

    q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, kv_heads, head_dim], bf16 or
    fp16, head_dim a multiple of 64 up to 512, kv_heads dividing heads, any seqlen_k (0 gives
    O = 0 and LSE = -inf). Passing the same tensor (or a view of the same memory with the same
    shape and strides) as k and v selects the K = V kernel, which loads each KV tile once.
    ``p_in_smem`` forces P through SMEM (True) or registers / TMEM (False) where the kernel
    allows both; None takes the kernel's default for the head dim.

    Returns / Raises: as every attention stage (``common/interface.attention_forward``).
    """
    options = {"kv_shared": interface.same_memory(k, v)}
    if p_in_smem is not None:
        options["p_in_smem"] = bool(p_in_smem)
    return interface.attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                       options=options, tail=seams.tail(), plan=(p_in_smem,))


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 512):
    """bf16, batch 1 x 128 heads (MQA) x 4096 x 4096, K = V (DeepSeek-V4's prefill shape): (errors, ms, TFLOP/s)."""
    return interface.attention_demo_case(forward, flops, device, head_dim, 1, 128, 4096, 4096, kv_heads=1,
                                         kv_shared=True)
