"""Stage F: the backward of attention (training). dQ, dK, dV of dense attention from the forward's
O and LSE, recomputing P tile by tile: nothing of size seqlen_q x seqlen_k is ever stored.

Issue 44's first steps: head dims 64, 128 and 256 (sm90_wide.py: dK and dV split by columns
between the warpgroups, 64-key tiles), bf16 / fp16, GQA / MQA (the group's dK and dV
summed inside one CTA), causal and sliding windows (bottom-right aligned, the forward's
convention), per-batch key counts (``seqused_k``) and variable-length batches (``cu_seqlens_q`` /
``cu_seqlens_k``, packed [total, heads, d] tensors), on Hopper (sm90.py); on Blackwell
(sm100.py: compiled and proven on the host, never run) head dim 128, the deterministic mode
included. Three launches a call:
D = rowsum(dO * O) and the padded LSE (preprocess.py), the kernel (dK, dV complete; dQ
accumulated in fp32 across KV tiles), and dQ's rounding to q's dtype (torch; a variable-length
batch's dQ, dK and dV gathered from rows padded per request, common/varlen.py).
``deterministic`` (or ``torch.use_deterministic_algorithms``) adds dQ's partial sums KV tile by
KV tile (a counter per Q tile), so every gradient is bitwise repeatable. The attention sink
(stage D5's ``learnable_sink``) is one more key with value 0: the kernel runs unchanged on LSE' =
logaddexp(LSE, sink[h]) and the sink-scaled O, and the sink's gradient, - sum over rows of
exp(sink[h] - LSE') D, is a reduction on the host. Index mode (DeepSeek-V4's sparse attention,
``e_fused.index_attention``) and the calls this kernel does not serve (compressed entries, other
head dims, dtypes or architectures: DeepSeek-V4's layer) have backwards composed of torch
operations (index.py, fused.py) until their kernels exist. Calls outside both (seqused_k,
positions or offsets with compressed entries, ``out``, ...) refuse gradients
(common/autograd.py), never return a silent missing one.
"""

from __future__ import annotations

import math

import torch

from dsv4_attention.common import jit
from dsv4_attention.common.arch import arch_of_device
from dsv4_attention.common.bench import visible_pairs
from dsv4_attention.common.interface import LOG2E, MAX_GRID_YZ, check_varlen_shapes
from dsv4_attention.common.validation import (
    check_cu_seqlens,
    check_out,
    check_qkv,
    check_scale,
    check_seqused_k,
    check_sink,
    check_window,
)
from dsv4_attention.common.varlen import padded_index, padded_total
from dsv4_attention.stages.f_backward import index as index_kernels
from dsv4_attention.stages.f_backward import preprocess
from dsv4_attention.stages.f_backward import sink as sink_terms
from dsv4_attention.stages.f_backward.fused import fused_backward, lists_form
from dsv4_attention.stages.f_backward.index import index_backward

__all__ = ["backward", "flops", "fused_backward", "index_backward", "lists_form", "serves"]

ID = "f"
NAME = "backward"
ADDS = "gradients: dQ, dK, dV recomputing P per tile (dK, dV per KV tile in registers, dQ by a TMA reduce-add a visit)"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {"sm90": "dsv4_attention.stages.f_backward.sm90:FlashAttentionBackwardSm90",
           "sm100": "dsv4_attention.stages.f_backward.sm100:FlashAttentionBackwardSm100"}
#: what each architecture's kernel serves of the above (sm100.py: head dim 128); the registry's
#: ``Stage.head_dims_for`` reads it
HEAD_DIMS_BY_ARCH = {"sm90": HEAD_DIMS, "sm100": (128,)}
TILE_M = 64  # queries per visit (the padding of LSE, D and the dQ accumulator), but for:
#: head dims at which sm90.py takes 128 queries a visit (FlashAttention-3's tile at head dim 64:
#: half the visits, each one's barriers and statistics over twice the work)
WIDE_M_HEAD_DIMS, WIDE_TILE_M = (64,), 128
TILE_N = 128  # keys per CTA (a variable-length batch's dK / dV workspace is padded to it)
#: head dims whose dK and dV do not fit sm90.py's registers: sm90_wide.py's kernel, 64 keys a CTA
WIDE_HEAD_DIMS, WIDE_TILE_N = (256,), 64
WIDE_KERNELS = {"sm90": "dsv4_attention.stages.f_backward.sm90_wide:FlashAttentionBackwardSm90Wide"}

def make_kernel(arch: str, dtype, head_dim: int, index_mode: bool = False, **options):
    """The dense backward's kernel for the options, or (``index_mode``) index mode's
    (index.KERNELS: sm90_index.py), which the compile harness reaches by that option."""
    if index_mode:
        return jit.kernel_maker(index_kernels.KERNELS)(arch, dtype, head_dim, **options)
    return jit.kernel_maker(_kernels(arch, head_dim)[0])(arch, dtype, head_dim, **options)


def _kernels(arch: str, head_dim: int) -> tuple:
    """(kernel table, keys per CTA) of the dense backward at this head dim."""
    if arch == "sm90" and head_dim in WIDE_HEAD_DIMS:
        return WIDE_KERNELS, WIDE_TILE_N
    return KERNELS, TILE_N


def example_args(dtype: torch.dtype, head_dim: int, index_mode: bool = False, **_):
    """CPU arguments to compile against (every shape dynamic)."""
    if index_mode:
        return index_kernels.example_args(dtype, head_dim)
    q = torch.empty(2, 300, 4, head_dim, dtype=dtype)
    k = torch.empty(2, 1000, 2, head_dim, dtype=dtype)
    rows = 320
    stats = torch.empty(2, 4, rows, dtype=torch.float32)
    return [q, k, k.clone(), q.clone(), stats, stats.clone(), torch.empty(2, rows, 4, head_dim, dtype=torch.float32),
            k.clone(), k.clone(), torch.empty(2, 4, rows // TILE_M, dtype=torch.int32),
            torch.empty(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            1000, 0.125 * LOG2E, 0.125, 0, 0, jit.STREAM]


def queries_per_visit(arch: str, head_dim: int) -> int:
    """The dense backward's Q tile (the kernel's default ``tile_m`` for these options; the host
    pads LSE2, D, dQ's accumulator and deterministic mode's counters by it)."""
    if arch == "sm90" and head_dim in WIDE_M_HEAD_DIMS:
        return WIDE_TILE_M
    return TILE_M


def padded_rows(seqlen_q: int, tile_m: int = TILE_M) -> int:
    return -(-seqlen_q // tile_m) * tile_m


def _clamp(bound, limit: int) -> int:
    """A window bound as the kernel's int32 (past ``limit`` a bound hides nothing: stages/f_backward/span.py)."""
    return 0 if bound is None else min(int(bound), limit)


def backward(q, k, v, o, lse, do, *, softmax_scale: float | None = None, causal: bool = False,
             window_size=(None, None), seqused_k=None, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, learnable_sink=None,
             deterministic: bool | None = None, dk_out=None, dv_out=None):
    """Gradients of ``o = attention(q, k, v, softmax_scale, causal, window_size, learnable_sink)``
    (the loss's gradient reaches o only: LSE is an output without one).

    Args:
        q: [batch, seqlen_q, heads, head_dim], bf16 or fp16, head_dim 64, 128 or 256 (sm90; sm100:
            128); [total_q, heads,
            head_dim] with ``cu_seqlens_q``.
        k, v: [batch, seqlen_k, kv_heads, head_dim] (kv_heads dividing heads; [total_k, ...] with
            ``cu_seqlens_k``); v may be k.
        o: the forward's output, like q; lse: its [batch, heads, seqlen_q] ([heads, total_q]
            varlen) fp32 LSE (natural log; -inf where a row saw no key).
        do: the gradient of the loss with respect to o, like q.
        softmax_scale, causal, window_size: the forward's.
        seqused_k: the forward's [batch] int32 key counts, or None: batch b's keys are the first
            seqused_k[b] (the others get dK = dV = 0), its queries aligned to them bottom-right.
        cu_seqlens_q, cu_seqlens_k: [requests + 1] int32 offsets of a variable-length batch (the
            forward's); max_seqlen_q, max_seqlen_k: the longest request (read from the offsets
            when None: one device synchronisation; required inside a CUDA graph capture).
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
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:  # packed [total, heads, d] tensors run as one batch of their rows (common/varlen.py)
        check_varlen_shapes(q, k, v, None, None, seqused_k, None, None, None)
        for name, t in (("o", o), ("do", do)):
            check_out(name, t, tuple(q.shape), q.dtype, q.device)
        check_out("lse", lse, (q.shape[1], q.shape[0]), torch.float32, q.device)
        q, k, v, o, lse, do = q[None], k[None], v[None], o[None], lse[None], do[None]
    check_qkv(q, k, v, HEAD_DIMS)
    if k.shape[1] == 0:
        raise ValueError("seqlen_k must be at least 1 for the backward")
    for name, t in (("o", o), ("do", do)):
        check_out(name, t, q.shape, q.dtype, q.device)
    check_out("lse", lse, (q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device)
    arch = arch_of_device(q.device)
    if arch not in KERNELS:
        raise ValueError(f"the backward runs on Hopper (sm90) and Blackwell (sm100); these tensors are on {arch}")
    scale = check_scale(softmax_scale, q.shape[3])
    left, right = check_window(causal, window_size)
    b, sq, h, d = q.shape
    max_q, max_k = sq, k.shape[1]
    if varlen:
        max_q, max_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, sq, k.shape[1], q.device, max_seqlen_q,
                                        max_seqlen_k)
        if cu_seqlens_q.shape[0] - 1 > MAX_GRID_YZ:
            raise ValueError(f"at most {MAX_GRID_YZ} requests (grid z); got {cu_seqlens_q.shape[0] - 1}")
    if seqused_k is not None:
        check_seqused_k(seqused_k, b, k.shape[1], q.device)
    if learnable_sink is not None:
        check_sink(learnable_sink, h, q.device)
        lse = sink_terms.normalizer(lse, learnable_sink)  # the sink joins the normalizer
    for name, t in (("dk_out", dk_out), ("dv_out", dv_out)):
        if t is not None:
            check_out(name, t, k.shape[1:] if varlen else k.shape, k.dtype, k.device)
    if d not in HEAD_DIMS_BY_ARCH[arch]:  # after every other check: what that architecture's kernel lacks
        raise ValueError(f"the {arch} backward serves head dims {HEAD_DIMS_BY_ARCH[arch]}; got {d}")
    kernels, tile_n = _kernels(arch, d)
    tile_m = queries_per_visit(arch, d)
    if varlen:  # rows padded per request; dK and dV through a padded workspace too (by the kernel's tile)
        requests = cu_seqlens_q.shape[0] - 1
        rows, q_rows = padded_total(sq, requests, tile_m), padded_index(cu_seqlens_q, sq, tile_m)
        k_rows = padded_index(cu_seqlens_k, k.shape[1], tile_n)
        kv_shape = (1, padded_total(k.shape[1], requests, tile_n)) + tuple(k.shape[2:])
        dk = torch.empty(kv_shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(kv_shape, dtype=k.dtype, device=k.device)
    else:
        requests, rows, q_rows = b, padded_rows(sq, tile_m), slice(0, sq)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk_out is None else dk_out
        dv = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dv_out is None else dv_out
    # LSE in the exp2 domain (+inf for a row that saw no key: its P is 0, and so are its gradients)
    # and D = rowsum(dO * O), one launch (preprocess.py); padded rows keep +inf and 0
    lse2 = torch.full((b, h, rows), math.inf, dtype=torch.float32, device=q.device)
    dsum = torch.zeros((b, h, rows), dtype=torch.float32, device=q.device)
    preprocess.statistics(o, do, lse, lse2, dsum, q_rows.int() if varlen else None)
    dq_acc = torch.zeros((b, rows, h, d), dtype=torch.float32, device=q.device)
    limit = max_q + max_k
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    # deterministic dQ: per (request, head, Q tile), how many KV tiles have added their sum
    turns = torch.zeros((requests, h, -(-max_q // tile_m)) if deterministic else (1, 1, 1), dtype=torch.int32,
                        device=q.device)
    unused = turns.new_zeros((2,))  # stands for the tensors the call's options do not read
    args = [q, k, v, do, lse2, dsum, dq_acc, dk, dv, turns, unused if seqused_k is None else seqused_k,
            cu_seqlens_q if varlen else unused, cu_seqlens_k if varlen else unused, max_k,
            float(scale * LOG2E), float(scale), _clamp(left, limit), _clamp(right, limit), jit.STREAM]
    options = {"has_left": left is not None, "has_right": right is not None, "deterministic": bool(deterministic),
               "has_seqused": seqused_k is not None, "varlen": varlen}
    if max_q and max_k:
        jit.launch(ID, kernels, arch, q.dtype, d, args, options)
    else:  # (varlen) no request with a query row or a key: every gradient 0, nothing to launch (0 CTAs)
        dk.zero_()
        dv.zero_()
    dq = dq_acc[:, q_rows].to(q.dtype)
    if varlen:
        dq = dq[0]
        dk, dv = _unpad(dk[0], k_rows, dk_out), _unpad(dv[0], k_rows, dv_out)
    if learnable_sink is None:
        return dq, dk, dv
    return dq, dk, dv, sink_terms.gradient(learnable_sink, lse, dsum[..., q_rows])


def _unpad(padded, rows, out):
    """A request-padded [rows, heads, d] gradient back in packed rows (into ``out`` if given)."""
    if out is None:
        return padded[rows]
    torch.index_select(padded, 0, rows, out=out)
    return out


def flops(batch, seqlen_q, seqlen_k, heads, head_dim, causal: bool = False, window_size=(None, None)) -> int:
    """FlashAttention's count for a backward: 2.5 times the forward's (five GEMMs of the forward's
    two's size), over the visible (query, key) pairs."""
    return 10 * batch * heads * visible_pairs(seqlen_q, seqlen_k, causal, window_size) * head_dim


def serves(q, k, v) -> str | None:
    """Why this backward cannot differentiate attention on these inputs, or None if it can (checked
    before the forward runs, so that a training step never computes a forward it cannot finish)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k and v must be tensors"
    if q.dim() not in (3, 4) or q.shape[-1] not in HEAD_DIMS:
        return (f"the backward serves head dims {HEAD_DIMS} of [batch, seqlen, heads, head_dim] tensors "
                f"([total, heads, head_dim] varlen); got q {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        return f"the backward serves {DTYPES}; got {q.dtype}"
    if q.device.type != "cuda":
        return f"the backward runs on CUDA tensors (Hopper sm90, Blackwell sm100); got {q.device}"
    arch = arch_of_device(q.device)
    if arch not in KERNELS:
        return f"the backward runs on Hopper (sm90) and Blackwell (sm100); these tensors are on {arch}"
    if q.shape[-1] not in HEAD_DIMS_BY_ARCH[arch]:
        return f"the {arch} backward serves head dims {HEAD_DIMS_BY_ARCH[arch]}; got {q.shape[-1]}"
    return None
