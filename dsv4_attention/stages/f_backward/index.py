"""Index mode's backward (DeepSeek-V4's sparse attention, FlashMLA's ``flash_mla_sparse_fwd``
function): the gradients of ``e_fused.index_attention`` (issue 44, item 3). ``index_backward``
runs the kernel (sm90_index.py: Hopper, 16-bit, head dim 512, heads a multiple of 64) where
``kernel_serves`` says so, and otherwise the torch form below, ``index_backward_torch``, composed
of torch operations over chunks of tokens, which is also the definition the kernel is tested against.

Token t attends to the rows idx[t, :topk_length[t]] of kv (-1 = none; K = V, one row a key, its
heads sharing the list), with the sink as one more key of value 0. With G_t = kv[idx[t]] the
token's gathered rows and LSE' = logaddexp(LSE, sink[h]) (+inf where it is -inf: no key, no
finite sink, so P = 0), per token:

    P = exp(scale q G^T - LSE') (0 at invalid entries)   D = rowsum(dO * O)
    dP = dO G^T,  dS = P (dP - D)
    dq = scale dS G,  dG = P^T dO + scale dS^T q        (K = V: the key's and the value's gradient)
    dkv[idx[t, j]] += dG[j]  (every valid entry; a row listed twice gets both)
    dsink[h] = - sum over tokens of exp(sink[h] - LSE') D

Computed in fp32 (fp64 for fp64 inputs), a chunk of tokens at a time so that the gathered rows and
the scores stay within a memory budget; dkv by ``index_add_`` (deterministic under
``torch.use_deterministic_algorithms``). This is the function's definition made fast enough to
train small models, not the kernel: its cost is the gathers and five batched GEMMs per chunk.
"""

from __future__ import annotations

import math

import torch

from dsv4_attention.common import jit
from dsv4_attention.common.interface import LOG2E
from dsv4_attention.stages.f_backward import preprocess
from dsv4_attention.stages.f_backward import sink as sink_terms
from dsv4_attention.stages.f_backward.fused import part, tensor_core_gemms

#: the kernel of index mode's backward (sm90_index.py): its own configuration key beside stage F's
KERNEL_ID = "f_index"
KERNELS = {"sm90": "dsv4_attention.stages.f_backward.sm90_index:IndexBackwardSm90"}
HEAD_DIM = 512
HEADS_PER_CTA = 64

#: bytes of temporaries a chunk may hold (scores, P, dP, dS; gathered rows and their gradients)
CHUNK_BYTES = 1 << 30


def index_backward(q, kv, indices, o, lse, do, *, topk_length=None, attn_sink=None,
                   softmax_scale: float | None = None, chunk_bytes: int = CHUNK_BYTES):
    """Gradients of ``(o, lse) = index_attention(q, kv, indices, topk_length=, attn_sink=,
    softmax_scale=)`` (the loss's gradient reaches o only): by the kernel where it serves the call
    (``kernel_serves``), else by ``index_backward_torch``. Under
    ``torch.use_deterministic_algorithms(True)`` always the torch form: the kernel adds dkv by
    unordered atomics, the torch form's ``index_add_`` is deterministic under that flag, so every
    gradient is bitwise repeatable (slowly: no fixed-order kernel yet).

    Args:
        q: [tokens, heads, d]; kv: [rows, 1, d] K = V rows (bf16 rows: the paged FP8 cache is
            not differentiable); indices: [tokens, 1, k] int32, -1 padded; topk_length: [tokens]
            int32 or None.
        o, lse: the forward's outputs ([tokens, heads, d] sink-scaled, [tokens, heads] fp32
            natural log without the sink, -inf for a token with no valid index).
        do: the loss's gradient with respect to o, like q.
        attn_sink: [heads] fp32 or None; softmax_scale: default d ** -0.5.
        chunk_bytes: the temporaries' budget per chunk of tokens.

    Returns:
        (dq like q, dkv like kv, dsink [heads] fp32 or None).
    """
    if kernel_serves(q, kv, indices) is None:
        return index_backward_kernel(q, kv, indices, o, lse, do, topk_length=topk_length, attn_sink=attn_sink,
                                     softmax_scale=softmax_scale)
    return index_backward_torch(q, kv, indices, o, lse, do, topk_length=topk_length, attn_sink=attn_sink,
                                softmax_scale=softmax_scale, chunk_bytes=chunk_bytes)


def index_backward_torch(q, kv, indices, o, lse, do, *, topk_length=None, attn_sink=None,
                         softmax_scale: float | None = None, chunk_bytes: int = CHUNK_BYTES):
    """``index_backward`` composed of torch operations (the module doc's definition), on any
    device and dtype: what a call the kernel does not serve runs, and the tests' reference. A
    16-bit call's GEMMs run on TF32 tensor cores, exact for its operands (``fused.tensor_core_gemms``)."""
    with tensor_core_gemms(q.dtype, q.device):
        return _index_backward_torch(q, kv, indices, o, lse, do, topk_length, attn_sink, softmax_scale, chunk_bytes)


def _index_backward_torch(q, kv, indices, o, lse, do, topk_length, attn_sink, softmax_scale, chunk_bytes):
    tokens, heads, d = q.shape
    k = indices.shape[-1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    acc = torch.promote_types(q.dtype, torch.float32)
    idx = indices.reshape(tokens, k)
    valid = (idx >= 0) & (idx < kv.shape[0])  # the kernel's contract: an index outside the rows is -1
    if topk_length is not None:
        valid &= torch.arange(k, device=idx.device)[None] < topk_length[:, None]
    lse_all = sink_terms.normalizer(lse.to(acc), attn_sink)
    lse_p = torch.where(torch.isneginf(lse_all), math.inf, lse_all)  # no key, no finite sink: P = 0
    dsum = (do.to(acc) * o.to(acc)).sum(-1)  # [tokens, heads]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros((kv.shape[0], d), dtype=acc, device=kv.device)
    per_token = (4 * heads * k + 3 * k * d) * torch.finfo(acc).bits // 8
    chunk = max(1, min(tokens, chunk_bytes // max(per_token, 1)))
    for t0 in range(0, tokens, chunk):
        sl = slice(t0, t0 + chunk)
        ok = valid[sl]
        rows = torch.where(ok, idx[sl], 0).long()  # an index past the rows is gathered as row 0, masked
        g = kv[rows].to(acc)  # [c, k, 1, d]: one kv head, the token's heads its group
        qc, doc = q[sl].to(acc)[:, None], do[sl].to(acc)[:, None]
        # the same per-query-list part as the layer's top-k entries (fused.part), one kv head
        p, ds = part((qc, doc, lse_p[sl, None], dsum[sl, None], dq[sl].view(-1, 1, heads, d)), g, g, ok, scale)
        dg = torch.einsum("ckgn,ckgd->cnd", p, doc) + torch.einsum("ckgn,ckgd->cnd", ds, qc) * scale
        dkv.index_add_(0, rows[ok], dg[ok])
    dsink = None if attn_sink is None else sink_terms.gradient(attn_sink, lse_all, dsum)
    return dq.to(q.dtype), dkv.to(kv.dtype).reshape(kv.shape), dsink


def example_args(dtype: torch.dtype, head_dim: int = HEAD_DIM) -> list:
    """CPU arguments to compile the kernel against (every shape dynamic): 128 heads, 100 list
    positions, 1000 rows."""
    tokens, heads, k, rows = 3, 2 * HEADS_PER_CTA, 100, 1000
    q = torch.empty(tokens, heads, head_dim, dtype=dtype)
    stats = torch.empty(tokens, heads, dtype=torch.float32)
    return [q, q.clone(), torch.empty(rows, head_dim, dtype=dtype), torch.empty(tokens, k, dtype=torch.int32), stats,
            stats.clone(), q.clone(), torch.empty(rows, head_dim, dtype=torch.float32), 0.06, 0.04, jit.STREAM]


def kernel_serves(q, kv, indices) -> str | None:
    """None where the kernel (sm90_index.py) computes this call's gradients, else why not: not
    under ``torch.use_deterministic_algorithms(True)`` (its dkv reductions land in any order), a
    Hopper GPU, 16-bit q / kv of head dim 512, heads a multiple of 64, kv rows [rows, 1, 512]
    whose rows start 16-byte aligned (the gather's 16-byte copies)."""
    from dsv4_attention.common.arch import arch_of_device

    if torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms are on: the kernel adds dkv by atomics in no fixed order"
    if not (isinstance(q, torch.Tensor) and q.is_cuda):
        return "not a CUDA tensor"
    try:
        arch = arch_of_device(q.device)
    except ValueError as e:
        return str(e)
    if arch not in KERNELS:
        return f"no index-mode backward kernel for {arch} (sm90 only)"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        return f"q and kv must be bf16 or fp16 alike; got {q.dtype}, {kv.dtype}"
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or q.shape[1] % HEADS_PER_CTA:
        return f"q must be [tokens, 64 n heads, {HEAD_DIM}]; got {tuple(q.shape)}"
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.stride(2) != 1 or (kv.stride(0) * kv.element_size()) % 16 \
            or kv.data_ptr() % 16:
        return "kv must be rows [rows, 1, 512], each 16-byte aligned, head dims contiguous"
    if indices.dim() != 3 or indices.shape[1] != 1:
        return f"indices must be [tokens, 1, k]; got {tuple(indices.shape)}"
    return None


def index_backward_kernel(q, kv, indices, o, lse, do, *, topk_length=None, attn_sink=None,
                          softmax_scale: float | None = None):
    """``index_backward`` by the kernel (sm90_index.py), where ``kernel_serves``: the lists cut at
    ``topk_length`` here (-1 past it), LSE joined with the sink by torch, D = rowsum(dO * O) and
    LSE2 by the preprocess kernel, then one launch, one CTA per (token, 64 heads); dkv accumulates
    in fp32 (vector reductions: not bitwise repeatable) and is rounded to kv's dtype; the sink's
    gradient by torch."""
    tokens, heads, d = q.shape
    rows, k = kv.shape[0], indices.shape[-1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    idx = indices.reshape(tokens, k)
    if topk_length is not None:
        idx = torch.where(torch.arange(k, device=idx.device)[None] < topk_length[:, None], idx, -1)
    idx = idx.to(torch.int32).contiguous()
    lse_all = sink_terms.normalizer(lse.float(), attn_sink)
    q_c, do_c = q.contiguous(), do.contiguous()
    # D = rowsum(dO * O) and LSE2 (+inf where no key: P = 0) by the dense backward's preprocess
    # kernel, one pass over O and dO (torch's casts, product and sum took 1.4 ms of the call's 4.6
    # at V4-Flash, 4096 tokens: docs/results/experiments/issue44_profiles/); its (1, heads, tokens)
    # outputs transposed to the kernel's (tokens, heads)
    lse2_ht = torch.empty((1, heads, tokens), dtype=torch.float32, device=q.device)
    dsum_ht = torch.empty_like(lse2_ht)
    preprocess.statistics(o.to(q.dtype).contiguous()[None], do_c.to(q.dtype)[None],
                          lse_all.t().contiguous()[None], lse2_ht, dsum_ht)
    lse2, dsum = lse2_ht[0].t().contiguous(), dsum_ht[0].t().contiguous()
    dq = torch.empty_like(q_c)
    dkv = torch.zeros((rows, d), dtype=torch.float32, device=q.device)
    if tokens and k and rows:
        args = [q_c, do_c, kv.reshape(rows, d), idx, lse2, dsum, dq, dkv, float(scale * LOG2E), float(scale),
                jit.STREAM]
        jit.launch(KERNEL_ID, KERNELS, "sm90", q.dtype, d, args)
    else:  # no list position or no row: every gradient of q and kv 0
        dq.zero_()
    dsink = None if attn_sink is None else sink_terms.gradient(attn_sink, lse_all, dsum)
    return dq, dkv.to(kv.dtype).reshape(kv.shape), dsink
