"""The stages, in order. Each stage package exposes ``forward`` on torch tensors in
``[batch, seqlen, heads, head_dim]`` layout (dispatching to its sm90 or sm100 kernel
by the tensors' device) and the hooks the harness uses (``make_kernel``,
``example_args``, ``HEAD_DIMS``, ``DTYPES``, ``flops``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from dsv4_attention.common import call_plan
from dsv4_attention.common.autograd import composed_attention, composed_covers, dense_attention, refuse_grad


@dataclasses.dataclass(frozen=True)
class Stage:
    id: str
    name: str
    adds: str
    module: ModuleType

    @property
    def forward(self) -> Callable:
        return self.module.forward

    @property
    def head_dims(self):
        return self.module.HEAD_DIMS

    def head_dims_for(self, arch: str) -> tuple:
        """The head dims ``arch``'s kernel serves: the stage's ``HEAD_DIMS``, or fewer where the stage
        says so for that architecture (``HEAD_DIMS_BY_ARCH``; stage F's sm100 kernel: 128)."""
        return getattr(self.module, "HEAD_DIMS_BY_ARCH", {}).get(arch, self.module.HEAD_DIMS)

    @property
    def dtypes(self):
        return self.module.DTYPES


def _load(pkg: str) -> Stage:
    m = importlib.import_module(f"dsv4_attention.stages.{pkg}")
    return Stage(m.ID, m.NAME, m.ADDS, m)


STAGES: list[Stage] = [
    _load(p)
    for p in ("a_qk_gemm", "b_p_onchip", "c_online_softmax", "d1_smem_p", "d2_pack_heads", "d3_lengths",
              "d4_causal_window", "d5_sink_merge", "e_fused")
]


#: the stages after the forward's: the backward (training), which differentiates :func:`attention`
#: rather than extending it
TRAINING: list[Stage] = [_load("f_backward")]

#: every stage, forward then training: what the harness compiles, proves and reports
ALL_STAGES: list[Stage] = [*STAGES, *TRAINING]

#: the stage behind :func:`attention`: the newest forward one, serving every case the earlier stages do
FINAL = "e"


def attention(q, k, v=None, *, compressed_kv=None, compress_ratio: int | None = None, topk_indices=None,
              softmax_scale: float | None = None, causal: bool = False, window_size=(None, None), seqused_k=None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, learnable_sink=None, pack_gqa: bool | None = None, positions=None,
              kv_start: int = 0, cu_seqlens_compressed=None, out=None, lse_out=None, check_indices: bool = True,
              num_splits: int | None = 1):
    """The library's attention (``from dsv4_attention import attention``): softmax(q k^T scale) v
    with FlashAttention-4's conventions, computed by the newest stage (:data:`FINAL`).

    DeepSeek-V4: ``attention(q, kv, compressed_kv=ckv, compress_ratio=128, window_size=(127, 0),
    learnable_sink=sink)`` attends, in one softmax, to the window and to the compressed entries
    j < floor((t' + 1) / ratio) (its HCA layers), or only those ``topk_indices`` lists per token
    (its CSA layers). Differentiable in q, k, v, the entries and the sink (docs/training.md): by
    stage F's kernel where it serves the call (dense: scale, causal, window, seqused_k, offsets;
    head dims 64 and 128 on sm90), by its torch-composed backward for other batched calls on a GPU
    (compressed entries, head dim 512); elsewhere refused under grad mode.

    Args:
        q: [batch, seqlen_q, heads, head_dim], bf16 or fp16, head dims 64-512; [total_q, heads,
            head_dim] with ``cu_seqlens_q``.
        k: [batch, seqlen_k, kv_heads, head_dim] (kv_heads dividing heads); [total_k, ...] with
            ``cu_seqlens_k``.
        v: like k; None or k itself: K = V (each KV tile loaded once).
        compressed_kv: [batch, entries, kv_heads, head_dim] K = V entries (k's dtype);
            [total_entries, kv_heads, head_dim] in a variable-length batch.
        compress_ratio: entry j is visible to the query at absolute position t iff
            j < floor((t + 1) / compress_ratio).
        topk_indices: [batch, seqlen_q, k] int32 (-1 padded; [total_q, k] varlen): the entries each
            token attends to, of those visible.
        softmax_scale: default head_dim ** -0.5.
        causal: right bound 0 (bottom-right aligned).
        window_size: (left, right), each an int >= 0 or None (unbounded).
        seqused_k: [batch] int32, keys per request.
        cu_seqlens_q, cu_seqlens_k: [requests + 1] int32 offsets of a variable-length batch.
        max_seqlen_q, max_seqlen_k: the longest request (read from the offsets when None).
        learnable_sink: [heads] fp32 attention sink, O *= sigmoid(LSE - sink[h]).
        pack_gqa: fold the query heads of a KV head into a tile's rows (None: by shape).
        positions: [seqlen_q] or [batch, seqlen_q] int32 ([total_q] varlen), non-decreasing: the
            query tokens' absolute positions instead of bottom-right alignment (a prefill chunk).
        kv_start: the absolute position of k's row 0 (k holding only a sequence's last rows).
        cu_seqlens_compressed: [requests + 1] int32, request b's first entry (default
            floor(keys / ratio) entries per request).
        out, lse_out: outputs to write (o like q, contiguous; lse as returned, fp32).
        check_indices: read topk_indices on the host to refuse values outside [-1, entries) (one
            device synchronisation); False: not read, the kernel treats them as -1.
        num_splits: split-KV decode (sm90, K = V at head dim 384 / 512, batched tensors): each Q
            tile's keys cut over that many CTAs and merged exactly; None chooses; the count a call
            ran with: ``dsv4_attention.common.call_plan.last_splits()``.

    Returns:
        (o, lse): o like q; lse [batch, heads, seqlen_q] fp32 ([heads, total_q] varlen), natural
        log, without the sink. A row with no visible key has O = 0 and LSE = -inf.

    Raises:
        ValueError: before any launch, for an input the kernels do not serve (dtype, device,
            shape, strides, alignment, head dim, lengths, indices), naming the argument.
        NotDifferentiableError: under grad mode, an input that requires grad
            (common/autograd.py).
    """
    grads = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                            for t in (q, k, v, learnable_sink, compressed_kv))
    if grads and _composed(q, k, v, compressed_kv, topk_indices, seqused_k, cu_seqlens_q, cu_seqlens_k, positions,
                           kv_start, out, lse_out, num_splits, causal, window_size, compress_ratio,
                           cu_seqlens_compressed, max_seqlen_k):
        final = get(FINAL).forward
        detached = {n: (None if t is None else t.detach()) for n, t in
                    (("v", v), ("compressed_kv", compressed_kv), ("learnable_sink", learnable_sink))}

        def run_forward():
            return final(q.detach(), k.detach(), detached["v"], compressed_kv=detached["compressed_kv"],
                         compress_ratio=compress_ratio, topk_indices=topk_indices, softmax_scale=softmax_scale,
                         causal=causal, window_size=window_size, learnable_sink=detached["learnable_sink"],
                         pack_gqa=pack_gqa, check_indices=check_indices, seqused_k=seqused_k,
                         positions=positions, kv_start=kv_start, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         cu_seqlens_compressed=cu_seqlens_compressed)

        return composed_attention(q, k, k if v is None else v, compressed_kv, learnable_sink, run_forward,
                                  dict(compress_ratio=compress_ratio, topk_indices=topk_indices,
                                       softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                       seqused_k=seqused_k, positions=positions, kv_start=kv_start,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       cu_seqlens_compressed=cu_seqlens_compressed, max_seqlen_k=max_seqlen_k))
    if grads and compressed_kv is None and \
            _differentiable(compressed_kv, topk_indices, seqused_k, cu_seqlens_q, cu_seqlens_k, learnable_sink,
                            positions, out, lse_out, num_splits):
        final = get(FINAL).forward
        sink = None if learnable_sink is None else learnable_sink.detach()
        return dense_attention(q, k, k if v is None else v, softmax_scale, causal, window_size, lambda: final(
            q.detach(), k.detach(), None if v is None else v.detach(), softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, learnable_sink=sink, pack_gqa=pack_gqa, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k),
            learnable_sink=learnable_sink, seqused_k=seqused_k,
            varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    refuse_grad("attention", q=q, k=k, v=v, compressed_kv=compressed_kv, learnable_sink=learnable_sink)
    key = None
    if topk_indices is None and seqused_k is None and cu_seqlens_q is None and cu_seqlens_k is None and \
            positions is None:
        # validated once per signature (common/call_plan.py): a repeated one goes to its kernel
        key = call_plan.entry_key(q, k, v, compressed_kv, learnable_sink, out, lse_out,
                                  (softmax_scale, causal, compress_ratio, pack_gqa, max_seqlen_q, max_seqlen_k,
                                   kv_start, num_splits),
                                  window_size)
        if key is not None:
            # extra: the final stage's plan tensors, in masked_attention_forward's order
            done = call_plan.entry_call(key, q, k, k if v is None else v, out, lse_out,
                                        (learnable_sink, compressed_kv))
            if done is not None:
                return done
    final = get(FINAL).forward
    return call_plan.entry_run(key, lambda: final(
        q, k, v, compressed_kv=compressed_kv, compress_ratio=compress_ratio, topk_indices=topk_indices,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, seqused_k=seqused_k,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        learnable_sink=learnable_sink, pack_gqa=pack_gqa, positions=positions, kv_start=kv_start,
        cu_seqlens_compressed=cu_seqlens_compressed, out=out, lse_out=lse_out, check_indices=check_indices,
        num_splits=num_splits))


def _composed(q, k, v, compressed_kv, topk_indices, seqused_k, cu_seqlens_q, cu_seqlens_k, positions, kv_start, out,
              lse_out, num_splits, causal, window_size, compress_ratio, cu_seqlens_compressed, max_seqlen_k) -> bool:
    """Whether a call that needs a gradient goes to stage F's torch-composed backward
    (common/autograd.composed_covers: compressed entries, or what stage F's kernel lacks; with
    seqused_k, positions, kv_start or a variable-length batch only in index mode's form of the
    layer, ``fused.lists_form``)."""
    if not (isinstance(q, torch.Tensor) and q.is_cuda):
        return False  # (serves() below is for CUDA tensors)
    entries = compressed_kv is not None or topk_indices is not None
    f = get("f").module
    why = None if entries else f.serves(q, k, k if v is None else v)
    # asked only where an option only that form takes is given (a packed batch's bound may read its offsets)
    placed = kv_start or any(x is not None for x in (seqused_k, positions, cu_seqlens_q, cu_seqlens_k))
    lists_form = bool(placed) and f.lists_form(q, k, k if v is None else v, compressed_kv, compress_ratio,
                                               topk_indices, causal, window_size, cu_seqlens_k,
                                               cu_seqlens_compressed, max_seqlen_k)
    return composed_covers(q, why, entries, dict(
        seqused_k=seqused_k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, positions=positions,
        kv_start=kv_start, out=out, lse_out=lse_out, num_splits=num_splits), lists_form=lists_form)


def _differentiable(compressed_kv, topk_indices, seqused_k, cu_seqlens_q, cu_seqlens_k, learnable_sink, positions,
                    out, lse_out, num_splits) -> bool:
    """Whether stage F's backward covers the call's options (common/autograd.py): dense attention
    with a scale, causal, a window, seqused_k, variable-length batches and the sink; everything
    else is refused under grad mode."""
    # covered: stage F takes the sink (returning its gradient), seqused_k and the offsets
    del learnable_sink, seqused_k, cu_seqlens_q, cu_seqlens_k
    return all(x is None for x in (compressed_kv, topk_indices, positions, out, lse_out)) and \
        num_splits in (1, None)


def get(stage_id: str) -> Stage:
    for s in ALL_STAGES:
        if s.id == stage_id:
            return s
    raise ValueError(f"unknown stage {stage_id!r}; stages are {[s.id for s in ALL_STAGES]}")
