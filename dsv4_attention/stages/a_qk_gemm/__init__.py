"""Stage A: the QK GEMM, S = scale * Q K^T, on Hopper (sm90.py) and Blackwell (sm100.py).

The first kernel taken through the whole harness: TMA loads of Q and K tiles
in head-dim k-blocks (so head dim 512 fits shared memory), the tensor-core
MMA (wgmma on SM90, tcgen05 into TMEM on SM100), and an fp32 epilogue with
predicated stores for tails. Later stages keep this GEMM and add the softmax.
"""

from __future__ import annotations

import torch

from dsv4_attention.common import jit
from dsv4_attention.common.arch import arch_of_device
from dsv4_attention.common.autograd import refuse_grad
from dsv4_attention.common.validation import check_out, check_qk, check_scale

ID = "a"
NAME = "qk_gemm"
ADDS = "QK GEMM: TMA + tensor-core MMA over head-dim k-blocks, fp32 scores out"
HEAD_DIMS = (64, 128, 256, 512)
DTYPES = (torch.bfloat16, torch.float16)
MAX_GRID_Z = 65535  # CTAs along z, one per (head, batch)


KERNELS = {
    "sm90": "dsv4_attention.stages.a_qk_gemm.sm90:QKGemmSm90",
    "sm100": "dsv4_attention.stages.a_qk_gemm.sm100:QKGemmSm100",
}


def make_kernel(arch: str, dtype: torch.dtype, head_dim: int):
    return jit.kernel_class(KERNELS, arch)(jit.cutlass_dtype(dtype), head_dim)


def example_args(dtype: torch.dtype, head_dim: int, device="cpu"):
    """The kernel's arguments as a call passes them (any shapes: the kernel is shape-dynamic)."""
    q = torch.empty(2, 300, 4, head_dim, dtype=dtype, device=device)
    k = torch.empty(2, 200, 2, head_dim, dtype=dtype, device=device)
    s = torch.empty(2, 4, 300, 200, dtype=torch.float32, device=device)
    return [q, k, s, 0.125, jit.STREAM]


def forward(
    q: torch.Tensor, k: torch.Tensor, *, softmax_scale: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """S[b, h, i, j] = softmax_scale * q[b, i, h, :] . k[b, j, h // (h / hk), :], fp32.

    q: [batch, seqlen_q, heads, head_dim], k: [batch, seqlen_k, kv_heads, head_dim],
    bf16 or fp16, head_dim in {64, 128, 256, 512}, kv_heads dividing heads.
    softmax_scale defaults to head_dim ** -0.5.

    Returns:
        s: [batch, heads, seqlen_q, seqlen_k] fp32, written into ``out`` when given (fp32,
        contiguous, that shape, q's device).

    Raises:
        ValueError: before any launch, naming the argument the kernel does not serve.
        NotDifferentiableError: under grad mode, an input that requires grad.
    """
    refuse_grad(f"stage {ID}'s forward", q=q, k=k)
    check_qk(q, k, HEAD_DIMS)
    scale = check_scale(softmax_scale, q.shape[3])
    b, sq, h, d = q.shape
    if b * h > MAX_GRID_Z:
        raise ValueError(f"batch * heads must be at most {MAX_GRID_Z} (the grid's z extent); got {b * h}")
    shape = (b, h, sq, k.shape[1])
    if out is not None:
        check_out("out", out, shape, torch.float32, q.device)
    arch = arch_of_device(q.device)
    s = torch.empty(shape, dtype=torch.float32, device=q.device) if out is None else out
    jit.launch(ID, KERNELS, arch, q.dtype, d, [q, k, s, float(scale), jit.STREAM])
    return s


def flops(batch, seqlen_q, seqlen_k, heads, head_dim) -> int:
    return 2 * batch * heads * seqlen_q * seqlen_k * head_dim


def demo_case(device, head_dim: int = 128, batch=1, heads=16, seqlen_q=4096, seqlen_k=4096):
    """One bf16 run against the float64 reference, timed: (errors, milliseconds, TFLOP/s)."""
    from dsv4_attention.common import bench
    from dsv4_attention.common.reference import qk_scores
    from dsv4_attention.common.testing import errors, random_bshd

    q = random_bshd(batch, seqlen_q, heads, head_dim, torch.bfloat16, device)
    k = random_bshd(batch, seqlen_k, heads, head_dim, torch.bfloat16, device)
    s = forward(q, k)
    e = errors(s, qk_scores(q, k))
    ms = bench.time_ms([lambda: forward(q, k, out=s)])
    return e, ms, bench.tflops(flops(batch, seqlen_q, seqlen_k, heads, head_dim), ms)
