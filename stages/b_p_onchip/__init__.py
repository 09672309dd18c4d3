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

import math

import torch

from common import jit
from common.arch import arch_of_device
from common.validation import check_out, check_qkv, check_scale

ID = "b"
NAME = "p_onchip"
ADDS = "softmax + PV over one KV tile; P on-chip (TMEM-P on sm100, registers on sm90); O and LSE"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
KV_TILE = 128
LOG2E = math.log2(math.e)
MAX_GRID_YZ = 65535  # grid = (q tiles, heads, batch)


KERNELS = {
    "sm90": "stages.b_p_onchip.sm90:AttentionOneTileSm90",
    "sm100": "stages.b_p_onchip.sm100:AttentionOneTileSm100",
}


def make_kernel(arch: str, dtype: torch.dtype, head_dim: int):
    return jit.kernel_class(KERNELS, arch)(jit.cutlass_dtype(dtype), head_dim)


def example_args(dtype: torch.dtype, head_dim: int, device="cpu"):
    """Arguments to compile against (any shapes: the kernel is shape-dynamic)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    q = torch.empty(2, 300, 4, head_dim, dtype=dtype, device=device)
    k = torch.empty(2, 100, 2, head_dim, dtype=dtype, device=device)
    lse = torch.empty(2, 4, 300, dtype=torch.float32, device=device)
    return [jit.as_cute(q), jit.as_cute(k), jit.as_cute(k.clone()), jit.as_cute(q.clone()), jit.as_cute(lse),
            cutlass.Float32(0.125 * LOG2E), make_fake_stream()]


def forward(q, k, v, *, softmax_scale: float | None = None, out=None, lse_out=None):
    """O[b, i, h, :] = sum_j softmax_j(scale * q_i . k_j) v_j and LSE[b, h, i] (natural log, fp32).

    q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, kv_heads, head_dim] with
    1 <= seqlen_k <= 128 (one KV tile; longer sequences are stage C's), bf16 or fp16, head_dim in
    {64, 128, 256}. seqlen_k = 0 gives O = 0 and LSE = -inf for every row. Returns (o, lse) with
    o like q and lse [batch, heads, seqlen_q]; written into ``out`` / ``lse_out`` when given.
    """
    import cutlass

    check_qkv(q, k, v, HEAD_DIMS, KV_TILE, " (one KV tile); stage C serves longer sequences")
    scale = check_scale(softmax_scale, q.shape[3])
    b, sq, h, d = q.shape
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ValueError(f"heads and batch must each be at most {MAX_GRID_YZ} (grid y, z); got {h}, {b}")
    if out is not None:
        check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if lse_out is not None:
        check_out("lse_out", lse_out, (b, h, sq), torch.float32, q.device)
    arch = arch_of_device(q.device)
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if k.shape[1] == 0:  # no key at all: the empty sum, decided without a launch
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    args = [jit.as_cute(q), jit.as_cute(k), jit.as_cute(v), jit.as_cute(o), jit.as_cute(lse),
            cutlass.Float32(scale * LOG2E), jit.current_stream()]
    jit.stage_kernel(ID, KERNELS, arch, q.dtype, d, args)(*args)
    return o, lse


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 4 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 128, batch=4, heads=16, seqlen_q=8192, seqlen_k=KV_TILE):
    """One bf16 run against the float64 reference, timed: (errors of O, milliseconds, TFLOP/s)."""
    from common import bench
    from common.reference import attention
    from common.testing import errors, random_bshd

    q = random_bshd(batch, seqlen_q, heads, head_dim, torch.bfloat16, device)
    k = random_bshd(batch, seqlen_k, heads, head_dim, torch.bfloat16, device)
    v = random_bshd(batch, seqlen_k, heads, head_dim, torch.bfloat16, device)
    o, lse = forward(q, k, v)
    e = errors(o, attention(q, k, v)[0])
    ms = bench.time_ms([lambda: forward(q, k, v, out=o, lse_out=lse)])
    return e, ms, bench.tflops(flops(batch, seqlen_q, seqlen_k, heads, head_dim), ms)
