"""Stage D3: per-request key counts.

``seqused_k`` ([batch] int32, the origin's ``swa_lens``; FlashAttention's name): keys at index
>= seqused_k[b] are invisible to request b. KV tiles wholly past it are never loaded; a request
with no visible key returns O = 0 and LSE = -inf (the spec's convention), never NaN. Variable-
length batches (``cu_seqlens_q`` / ``cu_seqlens_k``) are not built yet: see the stage page.
"""

from __future__ import annotations

import torch

from common import interface, jit
from common.pack_heads import pack_group
from common.validation import check_seqused_k
from stages.d2_pack_heads import tile_rows

ID = "d3"
NAME = "lengths"
ADDS = "per-request key counts (seqused_k): tiles past them never loaded, empty rows O = 0 / LSE = -inf"
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "stages.d3_lengths.sm90:FlashAttentionD3Sm90",
    "sm100": "stages.d3_lengths.sm100:FlashAttentionD3Sm100",
}
#: what the CPU demo compiles at every head dim
DEMO_OPTIONS = {"pack_group": 64, "seqused_k": True}


def make_kernel(arch: str, dtype: torch.dtype, head_dim: int, **options):
    return jit.kernel_class(KERNELS, arch)(jit.cutlass_dtype(dtype), head_dim, **options)


def example_args(dtype: torch.dtype, head_dim: int, kv_shared: bool = False, seqused_k: bool = False, **_):
    args = interface.attention_example_args(dtype, head_dim, seqlen_k=1000)
    if kv_shared:
        args[2] = args[1]
    if seqused_k:
        args.append(jit.as_cute(torch.empty(2, dtype=torch.int32)))
    return args


def forward(q, k, v, *, softmax_scale: float | None = None, seqused_k: torch.Tensor | None = None,
            pack_gqa: bool | None = None, out=None, lse_out=None, p_in_smem: bool | None = None):
    """Stage D2's attention with keys j >= seqused_k[b] invisible to request b.

    seqused_k: None (every key) or [batch] int32 on q's device with values in [0, seqlen_k]
    (checked before launch). Rows with no visible key: O = 0, LSE = -inf.
    """
    kv_shared = interface.same_memory(k, v)
    options = {"kv_shared": kv_shared}
    if p_in_smem is not None:
        options["p_in_smem"] = bool(p_in_smem)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be True, False or None; got {pack_gqa!r}")

    def prepare(arch, q, k):
        if seqused_k is not None:
            check_seqused_k(seqused_k, q.shape[0], k.shape[1], q.device)
        m = tile_rows(arch, q.shape[3], kv_shared, None if p_in_smem is None else bool(p_in_smem))
        return {"pack_group": pack_group(pack_gqa, q.shape[2], k.shape[2], m), "seqused_k": seqused_k is not None}

    def extra():
        return [jit.as_cute(seqused_k)] if seqused_k is not None else []

    return interface.attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                       options=options, options_for=prepare, extra_args=extra)


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 512):
    """bf16 decode: 64 requests x 2 query tokens x 128 heads on one KV head, K = V, up to 8192 keys."""
    return interface.attention_demo_case(forward, flops, device, head_dim, 64, 128, 2, 8192, kv_heads=1,
                                         kv_shared=True)
