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


def attention_example_args(dtype: torch.dtype, head_dim: int, seqlen_k: int = 1000, *, kv_shared: bool = False,
                           seqused_k: bool = False, has_left: bool = False, has_right: bool = False, **_):
    """CPU arguments to compile an attention kernel against (kernels are shape-dynamic), for the
    kernel options given: K = V (one tensor as K and V) and, from stage D3 on, the trailing
    (seqused_k, window_left, window_right) arguments where the options use them."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    q = torch.empty(2, 300, 4, head_dim, dtype=dtype)
    k = torch.empty(2, seqlen_k, 2, head_dim, dtype=dtype)
    lse = torch.empty(2, 4, 300, dtype=torch.float32)
    v = k if kv_shared else k.clone()
    args = [jit.as_cute(q), jit.as_cute(k), jit.as_cute(v), jit.as_cute(q.clone()), jit.as_cute(lse),
            cutlass.Float32(0.125 * LOG2E), make_fake_stream()]
    if seqused_k or has_left or has_right:
        args += [jit.as_cute(torch.empty(2, dtype=torch.int32)) if seqused_k else None,
                 cutlass.Int32(127) if has_left else None, cutlass.Int32(0) if has_right else None]
    return args


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


def masked_attention_forward(stage_id: str, kernels: dict, head_dims, q, k, v, softmax_scale, out, lse_out, *,
                             tile_rows, p_in_smem=None, pack_gqa=None, seqused_k=None, window=(None, None)):
    """The call of stages D2-D4: stage D1's options (K = V from the tensors, ``p_in_smem``) plus
    the packed group (D2: ``pack_gqa``, g chosen against ``tile_rows(arch, head_dim, kv_shared,
    p_in_smem)``), per-request key counts (D3: ``seqused_k``, validated before launch) and the
    window bounds (D4: ``window`` = (left, right), already validated). An option that is not used
    is not passed to the kernel, so each stage's kernel compiles only what the call needs."""
    from common.pack_heads import pack_group
    from common.validation import check_seqused_k

    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be True, False or None; got {pack_gqa!r}")
    left, right = window
    kv_shared = same_memory(k, v)
    options = {"kv_shared": kv_shared}
    if p_in_smem is not None:
        options["p_in_smem"] = bool(p_in_smem)
    if seqused_k is not None:
        options["seqused_k"] = True
    if left is not None:
        options["has_left"] = True
    if right is not None:
        options["has_right"] = True

    def prepare(arch, q, k):
        if seqused_k is not None:
            check_seqused_k(seqused_k, q.shape[0], k.shape[1], q.device)
        m = tile_rows(arch, q.shape[3], kv_shared, None if p_in_smem is None else bool(p_in_smem))
        return {"pack_group": pack_group(pack_gqa, q.shape[2], k.shape[2], m)}

    def extra():
        import cutlass

        return [None if seqused_k is None else jit.as_cute(seqused_k),
                None if left is None else cutlass.Int32(left), None if right is None else cutlass.Int32(right)]

    return attention_forward(stage_id, kernels, head_dims, q, k, v, softmax_scale, out, lse_out,
                             options=options, options_for=prepare, extra_args=extra)
