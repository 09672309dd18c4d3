"""The calling convention every attention stage shares, on torch tensors.

``forward(q, k, v, *, softmax_scale=None, out=None, lse_out=None) -> (o, lse)`` with
q [batch, seqlen_q, heads, head_dim], k and v [batch, seqlen_k, kv_heads, head_dim],
o like q (contiguous) and lse [batch, heads, seqlen_q] fp32 (natural log). The steps,
in order: validate everything (ValueError before any compile or launch), pick the
architecture from the device, handle seqlen_k = 0 on the host (every row is empty:
O = 0, LSE = -inf), then launch the stage's compiled kernel with
scale_log2 = softmax_scale * log2(e), the one numeric domain of every stage.
"""

from __future__ import annotations

import math

import torch

from common import jit
from common.arch import arch_of_device
from common.validation import check_out, check_qkv, check_scale

LOG2E = math.log2(math.e)
MAX_GRID_YZ = 65535  # attention grids are (q tiles, heads, batch)


def attention_example_args(dtype: torch.dtype, head_dim: int, seqlen_k: int = 1000):
    """CPU arguments to compile an attention kernel against (kernels are shape-dynamic)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    q = torch.empty(2, 300, 4, head_dim, dtype=dtype)
    k = torch.empty(2, seqlen_k, 2, head_dim, dtype=dtype)
    lse = torch.empty(2, 4, 300, dtype=torch.float32)
    return [jit.as_cute(q), jit.as_cute(k), jit.as_cute(k.clone()), jit.as_cute(q.clone()), jit.as_cute(lse),
            cutlass.Float32(0.125 * LOG2E), make_fake_stream()]


def same_memory(k: torch.Tensor, v: torch.Tensor) -> bool:
    """k and v are one tensor's memory (same start, shape, strides, dtype): K = V."""
    return (k is v) or (k.data_ptr() == v.data_ptr() and k.shape == v.shape and k.stride() == v.stride()
                        and k.dtype == v.dtype and k.device == v.device)


def attention_forward(stage_id: str, kernels: dict, head_dims, q, k, v, softmax_scale, out, lse_out,
                      max_seqlen_k: int | None = None, too_long: str = "", options: dict | None = None,
                      options_for=None, extra_args=None):
    """``options``: the kernel's compile-time options; ``options_for(arch, q, k)``, when given,
    adds the options that depend on the validated inputs and the architecture (e.g. D2's group);
    ``extra_args()``, when given, returns the kernel's arguments after the stream (D3's
    seqused_k, D4's window bounds), called after validation."""
    import cutlass

    check_qkv(q, k, v, head_dims, max_seqlen_k, too_long)
    scale = check_scale(softmax_scale, q.shape[3])
    b, sq, h, d = q.shape
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ValueError(f"heads and batch must each be at most {MAX_GRID_YZ} (grid y, z); got {h}, {b}")
    if out is not None:
        check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if lse_out is not None:
        check_out("lse_out", lse_out, (b, h, sq), torch.float32, q.device)
    arch = arch_of_device(q.device)
    if options_for is not None:
        options = {**(options or {}), **options_for(arch, q, k)}
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if k.shape[1] == 0:  # no key at all: the empty sum, decided without a launch
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    args = [jit.as_cute(q), jit.as_cute(k), jit.as_cute(v), jit.as_cute(o), jit.as_cute(lse),
            cutlass.Float32(scale * LOG2E), jit.current_stream()]
    if extra_args is not None:
        args += extra_args()
    jit.stage_kernel(stage_id, kernels, arch, q.dtype, d, args, options)(*args)
    return o, lse


def attention_demo_case(forward, flops, device, head_dim, batch, heads, seqlen_q, seqlen_k, check_rows=1024,
                        kv_heads=None, kv_shared=False):
    """One bf16 run, timed; O of the first batch's first ``check_rows`` queries against the
    float64 reference (the whole problem's float64 scores would not fit). Returns
    (errors, milliseconds, TFLOP/s)."""
    from common import bench
    from common.reference import attention
    from common.testing import errors, random_bshd

    q = random_bshd(batch, seqlen_q, heads, head_dim, torch.bfloat16, device)
    hk = heads if kv_heads is None else kv_heads
    k = random_bshd(batch, seqlen_k, hk, head_dim, torch.bfloat16, device)
    v = k if kv_shared else random_bshd(batch, seqlen_k, hk, head_dim, torch.bfloat16, device)
    o, lse = forward(q, k, v)
    rows = slice(0, min(check_rows, seqlen_q))
    e = errors(o[:1, rows], attention(q[:1, rows], k[:1], v[:1])[0])
    ms = bench.time_ms([lambda: forward(q, k, v, out=o, lse_out=lse)])
    return e, ms, bench.tflops(flops(batch, seqlen_q, seqlen_k, heads, head_dim), ms)
