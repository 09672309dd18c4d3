"""Index mode's backward (DeepSeek-V4's sparse attention, FlashMLA's ``flash_mla_sparse_fwd``
function), composed of torch operations over chunks of tokens: the gradients of
``e_fused.index_attention``, for training while its kernel is not built (issue 44, item 3).

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

from dsv4_attention.stages.f_backward import sink as sink_terms
from dsv4_attention.stages.f_backward.fused import part

#: bytes of temporaries a chunk may hold (scores, P, dP, dS; gathered rows and their gradients)
CHUNK_BYTES = 1 << 30


def index_backward(q, kv, indices, o, lse, do, *, topk_length=None, attn_sink=None,
                   softmax_scale: float | None = None, chunk_bytes: int = CHUNK_BYTES):
    """Gradients of ``(o, lse) = index_attention(q, kv, indices, topk_length=, attn_sink=,
    softmax_scale=)`` (the loss's gradient reaches o only).

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
        rows, ok = idx[sl].clamp(min=0).long(), valid[sl]
        g = kv[rows].to(acc)  # [c, k, 1, d]: one kv head, the token's heads its group
        qc, doc = q[sl].to(acc)[:, None], do[sl].to(acc)[:, None]
        # the same per-query-list part as the layer's top-k entries (fused.part), one kv head
        p, ds = part((qc, doc, lse_p[sl, None], dsum[sl, None], dq[sl].view(-1, 1, heads, d)), g, g, ok, scale)
        dg = torch.einsum("ckgn,ckgd->cnd", p, doc) + torch.einsum("ckgn,ckgd->cnd", ds, qc) * scale
        dkv.index_add_(0, rows[ok], dg[ok])
    dsink = None if attn_sink is None else sink_terms.gradient(attn_sink, lse_all, dsum)
    return dq.to(q.dtype), dkv.to(kv.dtype).reshape(kv.shape), dsink
