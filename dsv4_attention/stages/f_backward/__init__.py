"""Stage F: the backward of attention (training). dQ, dK, dV of dense attention from the forward's
O and LSE, recomputing P tile by tile: nothing of size seqlen_q x seqlen_k is ever stored.

The first step of issue 44: head dims 64 and 128, bf16 / fp16, GQA / MQA (the group's dK and dV
summed inside one CTA), causal and sliding windows (bottom-right aligned, the forward's
convention), per-batch key counts (``seqused_k``), on Hopper (sm90.py). Three launches a call: D = rowsum(dO * O) and the padded LSE
(torch, elementwise), the kernel (dK, dV complete; dQ accumulated in fp32 across KV tiles), and
dQ's rounding to q's dtype (torch). ``deterministic`` (or ``torch.use_deterministic_algorithms``)
adds dQ's partial sums KV tile by KV tile (a counter per Q tile), so every gradient is bitwise
repeatable. The attention sink (stage D5's ``learnable_sink``) is one
more key with value 0: the kernel runs unchanged on LSE' = logaddexp(LSE, sink[h]) and the
sink-scaled O, and the sink's gradient, - sum over rows of exp(sink[h] - LSE') D, is a reduction
on the host. The sm100 kernel, head dims 256 and 512, variable-length batches and DeepSeek-V4's
gathered entries are not built yet: those calls refuse gradients (common/autograd.py), never
return a silent missing one.
"""

from __future__ import annotations

import math

import torch

from dsv4_attention.common import jit
from dsv4_attention.common.arch import arch_of_device
from dsv4_attention.common.bench import visible_pairs
from dsv4_attention.common.validation import (
    check_out,
    check_qkv,
    check_scale,
    check_seqused_k,
    check_sink,
    check_window,
)

ID = "f"
NAME = "backward"
ADDS = "gradients: dQ, dK, dV recomputing P per tile (dK, dV per KV tile in registers, dQ by a TMA reduce-add a visit)"
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {"sm90": "dsv4_attention.stages.f_backward.sm90:FlashAttentionBackwardSm90"}
TILE_M = 64  # queries per visit (the padding of LSE, D and the dQ accumulator)
LOG2E = math.log2(math.e)

make_kernel = jit.kernel_maker(KERNELS)


def example_args(dtype: torch.dtype, head_dim: int, **_):
    """CPU arguments to compile against (every shape dynamic)."""
    q = torch.empty(2, 300, 4, head_dim, dtype=dtype)
    k = torch.empty(2, 1000, 2, head_dim, dtype=dtype)
    rows = 320
    stats = torch.empty(2, 4, rows, dtype=torch.float32)
    return [q, k, k.clone(), q.clone(), stats, stats.clone(), torch.empty(2, rows, 4, head_dim, dtype=torch.float32),
            k.clone(), k.clone(), torch.empty(2, 4, rows // TILE_M, dtype=torch.int32),
            torch.empty(2, dtype=torch.int32), 0.125 * LOG2E, 0.125, 0, 0, jit.STREAM]


def padded_rows(seqlen_q: int) -> int:
    return -(-seqlen_q // TILE_M) * TILE_M


def _clamp(bound, limit: int) -> int:
    """A window bound as the kernel's int32 (past ``limit`` a bound hides nothing: stages/f_backward/span.py)."""
    return 0 if bound is None else min(int(bound), limit)


def backward(q, k, v, o, lse, do, *, softmax_scale: float | None = None, causal: bool = False,
             window_size=(None, None), seqused_k=None, learnable_sink=None, deterministic: bool | None = None,
             dk_out=None, dv_out=None):
    """Gradients of ``o = attention(q, k, v, softmax_scale, causal, window_size, learnable_sink)``
    (the loss's gradient reaches o only: LSE is an output without one).

    Args:
        q: [batch, seqlen_q, heads, head_dim], bf16 or fp16, head_dim 64 or 128.
        k, v: [batch, seqlen_k, kv_heads, head_dim] (kv_heads dividing heads); v may be k.
        o: the forward's output, like q; lse: its [batch, heads, seqlen_q] fp32 LSE (natural
            log; -inf where a row saw no key).
        do: the gradient of the loss with respect to o, like q.
        softmax_scale, causal, window_size: the forward's.
        seqused_k: the forward's [batch] int32 key counts, or None: batch b's keys are the first
            seqused_k[b] (the others get dK = dV = 0), its queries aligned to them bottom-right.
        learnable_sink: the forward's [heads] fp32 sink, or None; then o is the sink-scaled output
            and lse the LSE without the sink, as the forward returns them.
        deterministic: add dQ's partial sums in a fixed order (KV tile by KV tile), so that every
            gradient is bitwise repeatable; slower (a KV tile waits for the previous one's sum).
            dK and dV are repeatable either way. None (the default): torch's setting,
            ``torch.use_deterministic_algorithms``.
        dk_out, dv_out: outputs to write (like k, contiguous).

    Returns:
        (dq, dk, dv) like q, k, v; with a sink (dq, dk, dv, dsink), dsink [heads] fp32. Where v is
        k, the caller adds dk and dv (autograd does).

    Raises:
        ValueError: before any launch, for an input the kernel does not serve, naming it.
    """
    check_qkv(q, k, v, HEAD_DIMS)
    if k.shape[1] == 0:
        raise ValueError("seqlen_k must be at least 1 for the backward")
    for name, t in (("o", o), ("do", do)):
        check_out(name, t, q.shape, q.dtype, q.device)
    check_out("lse", lse, (q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device)
    arch = arch_of_device(q.device)
    if arch not in KERNELS:
        raise ValueError(f"the backward runs on Hopper (sm90) only so far; these tensors are on {arch}")
    scale = check_scale(softmax_scale, q.shape[3])
    left, right = check_window(causal, window_size)
    b, sq, h, d = q.shape
    if seqused_k is not None:
        check_seqused_k(seqused_k, b, k.shape[1], q.device)
    if learnable_sink is not None:
        check_sink(learnable_sink, h, q.device)
        lse = torch.logaddexp(lse, learnable_sink[None, :, None])  # the sink joins the normalizer
    rows = padded_rows(sq)
    # LSE in the exp2 domain; a row that saw no key gets +inf, so its P is 0 and so are its gradients
    lse2 = torch.full((b, h, rows), math.inf, dtype=torch.float32, device=q.device)
    lse2[..., :sq] = torch.where(torch.isneginf(lse), math.inf, lse * LOG2E)
    dsum = torch.zeros((b, h, rows), dtype=torch.float32, device=q.device)
    dsum[..., :sq] = (do.float() * o.float()).sum(-1).transpose(1, 2)
    dq_acc = torch.zeros((b, rows, h, d), dtype=torch.float32, device=q.device)
    for name, t in (("dk_out", dk_out), ("dv_out", dv_out)):
        if t is not None:
            check_out(name, t, k.shape, k.dtype, k.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk_out is None else dk_out
    dv = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dv_out is None else dv_out
    limit = sq + k.shape[1]
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    # deterministic dQ: per (batch, head, Q tile), how many KV tiles have added their sum
    turns = torch.zeros((b, h, rows // TILE_M) if deterministic else (1, 1, 1), dtype=torch.int32, device=q.device)
    used = seqused_k if seqused_k is not None else turns.new_zeros((1,))  # (read only with has_seqused)
    args = [q, k, v, do, lse2, dsum, dq_acc, dk, dv, turns, used, float(scale * LOG2E), float(scale),
            _clamp(left, limit), _clamp(right, limit), jit.STREAM]
    options = {"has_left": left is not None, "has_right": right is not None, "deterministic": bool(deterministic),
               "has_seqused": seqused_k is not None}
    jit.launch(ID, KERNELS, arch, q.dtype, d, args, options)
    if learnable_sink is None:
        return dq_acc[:, :sq].to(q.dtype), dk, dv
    # the sink's probability per row (0 where LSE' = -inf: neither a key nor a finite sink)
    p_sink = torch.exp(learnable_sink[None, :, None] - lse).nan_to_num(0.0)
    return dq_acc[:, :sq].to(q.dtype), dk, dv, -(p_sink * dsum[..., :sq]).sum((0, 2))


def flops(batch, seqlen_q, seqlen_k, heads, head_dim, causal: bool = False, window_size=(None, None)) -> int:
    """FlashAttention's count for a backward: 2.5 times the forward's (five GEMMs of the forward's
    two's size), over the visible (query, key) pairs."""
    return 10 * batch * heads * visible_pairs(seqlen_q, seqlen_k, causal, window_size) * head_dim


def serves(q, k, v) -> str | None:
    """Why this backward cannot differentiate attention on these inputs, or None if it can (checked
    before the forward runs, so that a training step never computes a forward it cannot finish)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k and v must be tensors"
    if q.dim() != 4 or q.shape[-1] not in HEAD_DIMS:
        return (f"the backward serves head dims {HEAD_DIMS} of [batch, seqlen, heads, head_dim] tensors; "
                f"got q {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        return f"the backward serves {DTYPES}; got {q.dtype}"
    if q.device.type != "cuda":
        return f"the backward runs on CUDA tensors (Hopper sm90); got {q.device}"
    arch = arch_of_device(q.device)
    if arch not in KERNELS:
        return f"the backward runs on Hopper (sm90) only so far; these tensors are on {arch}"
    return None
