"""The backward of stage E's attention (DeepSeek-V4's layer: a sliding window over the raw keys,
compressed entries, the sink) composed of torch operations over chunks of queries: the gradients
of ``attention(q, kv, compressed_kv=, compress_ratio=, topk_indices=, window_size=,
learnable_sink=)`` wherever stage F's kernel does not serve the call (compressed entries, head
dims other than 64 / 128: DeepSeek-V4's 512 with K = V), for training while its kernel is not
built (issue 44, item 3).

Query i of batch b sits at t = i + seqlen_k - seqlen_q (bottom-right alignment) and sees raw key j
iff t - left <= j <= t + right, and compressed entry j iff j < floor((t + 1) / compress_ratio):
all of them (HCA), or those its ``topk_indices`` row lists (CSA). One softmax over both and the
sink (a key of value 0), so with LSE' = logaddexp(LSE, sink[h]) (+inf where -inf: P = 0) each
part's P = exp(scale q k^T - LSE') is the forward's, and per part

    dP = dO v^T,  dS = P (dP - D),  D = rowsum(dO * O)
    dq += scale dS k,  dk = scale dS^T q,  dv = P^T dO        (K = V: the caller adds dk and dv)

summed over a KV head's query heads; a CSA entry's gradient is scattered to the row its list
names (``index_add_``). A chunk of queries reads only the raw keys its window reaches. fp32
(fp64 for fp64 inputs; a 16-bit call's GEMMs on TF32 tensor cores: ``tensor_core_gemms``);
``tests/test_f_fused_cpu.py`` checks it against torch.autograd through the
float64 reference (``reference.fused_attention``).

Where the layer has index mode's form (``lists_cover``: K = V, one kv head, a window with both
bounds: DeepSeek-V4's layers) the call becomes index mode instead: every query's visible keys as
one list into one pool of rows (``layer_as_lists``; a variable-length batch's, request by
request, ``varlen_as_lists``), whose backward (``index.index_backward``: the kernel on Hopper at
head dim 512) gives the pool's gradient, split back into dk and dcompressed. That form also
carries the queries' frame (``seqused_k``, ``positions``, ``kv_start``) and a packed batch's
offsets, which the chunked torch form above does not take.
"""

from __future__ import annotations

import contextlib
import math

import torch

from dsv4_attention.stages.f_backward import sink as sink_terms

#: bytes of temporaries a chunk of queries may hold
CHUNK_BYTES = 1 << 30


@contextlib.contextmanager
def tensor_core_gemms(dtype: torch.dtype, device: torch.device):
    """The fp32 GEMMs of a 16-bit call on TF32 tensor cores (CUDA only; fp32 and fp64 calls, and
    the CPU, unchanged). Exact for the 16-bit operands (q, k, v, dO: bf16's 8 and fp16's 11
    significant bits fit TF32's 11); P and dS are rounded to TF32, finer than the kernels' 16-bit P
    and dS; every product accumulates in fp32. Restores the process's setting on exit."""
    matmul = torch.backends.cuda.matmul
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9's setting (allow_tf32 is its older form)
        before, matmul.fp32_precision = matmul.fp32_precision, "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:
        before, matmul.allow_tf32 = matmul.allow_tf32, True
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def fused_backward(q, kv, v, o, lse, do, *, compressed_kv=None, compress_ratio=None, topk_indices=None,
                   softmax_scale: float | None = None, causal: bool = False, window_size=(None, None),
                   learnable_sink=None, seqused_k=None, positions=None, kv_start: int = 0, cu_seqlens_q=None,
                   cu_seqlens_k=None, cu_seqlens_compressed=None, max_seqlen_k: int | None = None,
                   chunk_bytes: int = CHUNK_BYTES):
    """Gradients of ``o, lse = attention(q, kv, v, ...)`` with stage E's options above.
    ``seqused_k``, ``positions``, ``kv_start`` and variable-length batches (``cu_seqlens_*``:
    packed q [total_q, heads, d], kv [total_k, 1, d], lse [heads, total_q]) only where the layer
    has index mode's form (``lists_cover``): their gradients go through ``layer_as_lists`` /
    ``varlen_as_lists``.

    Args:
        q: [batch, seqlen_q, heads, d]; kv, v: [batch, seqlen_k, kv_heads, d] (v may be kv).
        o, lse: the forward's (o sink-scaled; lse [batch, heads, seqlen_q] natural log without the
            sink, -inf for a row with no visible key).
        do: the loss's gradient with respect to o.
        compressed_kv: [batch, entries, kv_heads, d] K = V entries, with ``compress_ratio``;
            topk_indices: [batch, seqlen_q, k] int32 (-1: none) or None (every visible entry).
        softmax_scale, causal, window_size, learnable_sink: the forward's.
        seqused_k: [batch] keys per request; positions: [seqlen_q] or [batch, seqlen_q] the queries'
            absolute positions; kv_start: the absolute position of kv's row 0 (the forward's).
        chunk_bytes: the temporaries' budget per chunk of queries.

    Returns:
        (dq, dk, dv, dcompressed or None, dsink or None), each like its input (dsink fp32).
    """
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return varlen_backward(q, kv, v, o, lse, do, compressed_kv, compress_ratio, topk_indices, softmax_scale,
                               causal, window_size, learnable_sink, cu_seqlens_q, cu_seqlens_k, cu_seqlens_compressed,
                               positions, kv_start, max_seqlen_k)
    frame = dict(seqused_k=seqused_k, positions=positions, kv_start=kv_start)
    placed = seqused_k is not None or positions is not None or kv_start != 0
    if placed and not lists_cover(q, kv, v, compressed_kv, topk_indices, causal, window_size):
        raise ValueError("seqused_k, positions and kv_start have a backward only in index mode's form of the layer "
                         "(fused.lists_cover: K = V, one kv head, a window with both bounds, lists of at most "
                         f"{MAX_LIST} positions)")
    lists = layer_as_lists(q, kv, v, compressed_kv, compress_ratio, topk_indices, causal, window_size,
                           kernel_only=not placed, **frame)
    if lists is not None:  # index mode's backward on every query's keys (``layer_as_lists``)
        return by_lists(q, kv, v, o, lse, do, compressed_kv, lists, softmax_scale, learnable_sink)
    return fused_backward_torch(q, kv, v, o, lse, do, compressed_kv=compressed_kv, compress_ratio=compress_ratio,
                                topk_indices=topk_indices, softmax_scale=softmax_scale, causal=causal,
                                window_size=window_size, learnable_sink=learnable_sink, chunk_bytes=chunk_bytes)


def fused_backward_torch(q, kv, v, o, lse, do, *, compressed_kv=None, compress_ratio=None, topk_indices=None,
                         softmax_scale: float | None = None, causal: bool = False, window_size=(None, None),
                         learnable_sink=None, chunk_bytes: int = CHUNK_BYTES):
    """``fused_backward`` composed of torch operations (the module doc), whatever serves the call."""
    with tensor_core_gemms(q.dtype, q.device):
        return _fused_backward(q, kv, v, o, lse, do, compressed_kv, compress_ratio, topk_indices, softmax_scale,
                               causal, window_size, learnable_sink, chunk_bytes)


def _fused_backward(q, kv, v, o, lse, do, compressed_kv, compress_ratio, topk_indices, softmax_scale, causal,
                    window_size, learnable_sink, chunk_bytes):
    b, sq, h, d = q.shape
    sk, hk = kv.shape[1], kv.shape[2]
    g = h // hk
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    acc = torch.promote_types(q.dtype, torch.float32)
    left, right = window_size
    if causal:
        right = 0
    offset = sk - sq
    lse_all = sink_terms.normalizer(lse.to(acc), learnable_sink)
    lse_p = torch.where(torch.isneginf(lse_all), math.inf, lse_all)  # [b, h, sq]
    dsum = (do.to(acc) * o.to(acc)).sum(-1).transpose(1, 2)  # [b, h, sq]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dc = None if compressed_kv is None else torch.zeros(compressed_kv.shape, dtype=acc, device=q.device)
    nc = 0 if compressed_kv is None else compressed_kv.shape[1]
    reach = sk if left is None else min(sk, left + 1 + (right or 0))
    listed = nc if topk_indices is None else topk_indices.shape[-1]
    per_query = h * (reach + listed) * 16 + (0 if topk_indices is None else listed * hk * d * 12)
    chunk = max(1, min(sq, chunk_bytes // max(per_query, 1)))
    if left is not None:  # a chunk's band of raw keys is its window plus its own length
        while chunk > 1 and chunk * (per_query + h * chunk * 16) > chunk_bytes:
            chunk //= 2
    for bi in range(b):
        for i0 in range(0, sq, chunk):
            i1 = min(sq, i0 + chunk)
            t = torch.arange(i0, i1, device=q.device) + offset  # the queries' positions
            qc = q[bi, i0:i1].to(acc).view(-1, hk, g, d)
            doc = do[bi, i0:i1].to(acc).view(-1, hk, g, d)
            lse_c = lse_p[bi, :, i0:i1].transpose(0, 1).reshape(-1, hk, g)
            d_c = dsum[bi, :, i0:i1].transpose(0, 1).reshape(-1, hk, g)
            dq_c = dq[bi, i0:i1].view(-1, hk, g, d)

            rows_c = (qc, doc, lse_c, d_c, dq_c)
            lo = 0 if left is None else max(0, int(t[0]) - left)
            hi = sk if right is None else min(sk, int(t[-1]) + right + 1)
            if lo < hi:
                j = torch.arange(lo, hi, device=q.device)[None]
                ok = torch.ones((i1 - i0, hi - lo), dtype=torch.bool, device=q.device)
                if left is not None:
                    ok &= j >= t[:, None] - left
                if right is not None:
                    ok &= j <= t[:, None] + right
                keys, values = kv[bi, lo:hi].to(acc), v[bi, lo:hi].to(acc)
                p, ds = part(rows_c, keys, values, ok, scale)
                dk[bi, lo:hi] += torch.einsum("ckgn,ckgd->nkd", ds, qc) * scale
                dv[bi, lo:hi] += torch.einsum("ckgn,ckgd->nkd", p, doc)
            if compressed_kv is None:
                continue
            count = torch.clamp(t + 1, min=0) // compress_ratio  # entries visible to each query
            if topk_indices is None:
                n = min(nc, int(count[-1]))
                if n == 0:
                    continue
                ok = torch.arange(n, device=q.device)[None] < count[:, None]
                entries = compressed_kv[bi, :n].to(acc)
                p, ds = part(rows_c, entries, entries, ok, scale)
                dc[bi, :n] += torch.einsum("ckgn,ckgd->nkd", ds, qc) * scale + torch.einsum("ckgn,ckgd->nkd", p, doc)
            else:
                idx = topk_indices[bi, i0:i1].long()  # [c, k]
                ok = (idx >= 0) & (idx < torch.clamp(count, max=nc)[:, None])
                rows = idx.clamp(min=0, max=max(nc - 1, 0))
                if nc == 0:
                    continue
                entries = compressed_kv[bi][rows].to(acc)  # [c, k, hk, d]
                p, ds = part(rows_c, entries, entries, ok, scale)
                grads = torch.einsum("ckgn,ckgd->cnkd", ds, qc) * scale + torch.einsum("ckgn,ckgd->cnkd", p, doc)
                dc[bi].index_add_(0, rows[ok], grads[ok])
    dsink = None if learnable_sink is None else sink_terms.gradient(learnable_sink, lse_all, dsum)
    return (dq.to(q.dtype), dk.to(kv.dtype), dv.to(v.dtype), None if dc is None else dc.to(compressed_kv.dtype),
            dsink)


def part(rows, keys, values, ok, scale):
    """One part of a chunk's keys (the window's raw keys [n, hk, d] shared by the chunk, or each
    query's listed entries [c, n, hk, d]): P and dS ([c, hk, g, n]), dq += scale dS k into the
    chunk's dq rows. ``rows`` = (q, dO, LSE', D, dq) of the chunk, [c, hk, g, (d)]."""
    qc, doc, lse_c, d_c, dq_c = rows
    shared = keys.dim() == 3
    eq = "ckgd,nkd->ckgn" if shared else "ckgd,cnkd->ckgn"
    p = torch.exp(torch.einsum(eq, qc, keys) * scale - lse_c[..., None]).masked_fill(~ok[:, None, None, :], 0.0)
    ds = p * (torch.einsum(eq, doc, values) - d_c[..., None])
    dq_c.add_(torch.einsum("ckgn,nkd->ckgd" if shared else "ckgn,cnkd->ckgd", ds, keys), alpha=scale)
    return p, ds


#: a query's list at most (window + entries) for the layer's backward through index mode's kernel
MAX_LIST = 4096


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """K = V: one tensor passed twice, or two views of the same memory and shape (a fake tensor of
    torch.compile's tracing has no data pointer: there the tensor itself decides)."""
    if a is b:
        return True
    try:
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    except RuntimeError:
        return False


def lists_cover(q, kv, v, compressed_kv, topk_indices, causal, window_size, entries: int | None = None) -> bool:
    """Whether the layer's call has index mode's form (``layer_as_lists``, ``varlen_as_lists``),
    from shapes alone: K = V (one memory), one kv head, a window with both bounds (causal: right
    0), and every query's list (the window's width, then the entries: all of them or its top-k) at
    most ``MAX_LIST``. Batched [b, s, kv_heads, d] or packed [total, kv_heads, d] kv; ``entries``:
    a request's entries at most (a packed batch's HCA lists; default compressed_kv's entry dim)."""
    left, right = window_size
    right = 0 if causal else right
    if not (isinstance(kv, torch.Tensor) and isinstance(v, torch.Tensor) and kv.dim() in (3, 4)):
        return False
    if not same_memory(kv, v) or kv.shape[-2] != 1 or left is None or right is None:
        return False
    width = left + right + 1
    if compressed_kv is not None:
        if topk_indices is not None:
            width += topk_indices.shape[-1]
        else:
            width += compressed_kv.shape[-3] if entries is None else entries
    return width <= MAX_LIST


def lists_form(q, kv, v, compressed_kv, compress_ratio, topk_indices, causal, window_size, cu_seqlens_k=None,
               cu_seqlens_compressed=None, max_seqlen_k: int | None = None) -> bool:
    """``lists_cover`` for a call as the forward receives it: a variable-length batch's HCA lists
    as wide as its entries' bound (``varlen_entries_bound``). The one rule the routing of
    ``attention`` and of the ops asks before the forward runs."""
    bound = None
    if cu_seqlens_k is not None and isinstance(compressed_kv, torch.Tensor) and compress_ratio:
        bound = varlen_entries_bound(compressed_kv, compress_ratio, cu_seqlens_k, cu_seqlens_compressed, max_seqlen_k)
    return lists_cover(q, kv, v, compressed_kv, topk_indices, causal, window_size, bound)


def layer_as_lists(q, kv, v, compressed_kv, compress_ratio, topk_indices, causal, window_size,
                   kernel_only: bool = True, seqused_k=None, positions=None, kv_start: int = 0):
    """DeepSeek-V4's layer as index mode: every query's visible keys as one list into one pool of
    rows, the batches' raw keys then their compressed entries, ``(pool [b sk + b nc, 1, d],
    lists [b sq, 1, n] int32)``, where the call has that form (``lists_cover``) and (``kernel_only``)
    index mode's backward kernel serves it (``index.kernel_serves``: Hopper, 16-bit, head dim 512,
    heads a multiple of 64); else None. Query i of batch b sits at t = i + n_k - sq (n_k =
    seqused_k[b] or sk) or, with ``positions``, at t = positions[b, i] - kv_start (the forward's
    frame: ``reference.fused_attention``); its list is ``token_lists``'. A key's softmax term is
    the same in either form, so index mode's gradients of the pool are the layer's: dk its raw
    rows, dcompressed its entries. ``kernel_only`` False: the lists wherever the layer has that
    form (calls with seqused_k, positions or kv_start, on any device; the host test of their
    construction, through the torch form)."""
    from dsv4_attention.stages.f_backward import index

    if not lists_cover(q, kv, v, compressed_kv, topk_indices, causal, window_size):
        return None
    b, sq, h, d = q.shape
    sk = kv.shape[1]
    nc = 0 if compressed_kv is None else compressed_kv.shape[1]
    dev = q.device
    n_k = torch.full((b,), sk, device=dev) if seqused_k is None else seqused_k.to(dev).long()
    if positions is None:
        t = torch.arange(sq, device=dev)[None] + (n_k - sq)[:, None]  # [b, sq] the queries' positions
    else:
        t = positions.to(dev).long().reshape(-1, sq).expand(b, sq) - kv_start
    batch = torch.arange(b, device=dev).repeat_interleave(sq)  # each token's batch
    listed = None if topk_indices is None else topk_indices.reshape(b * sq, -1)
    lists = token_lists(t.reshape(-1), n_k[batch], batch * sk, torch.full_like(batch, nc), b * sk + batch * nc,
                        listed, nc, window_size, causal, compress_ratio, kv_start, compressed_kv is not None)
    pool = row_pool(kv, compressed_kv)
    if kernel_only and index.kernel_serves(q.reshape(b * sq, h, d), pool, lists) is not None:
        return None
    return pool, lists


def token_lists(t, n_k, key_row0, n_entries, entry_row0, listed, entries: int, window_size, causal: bool,
                compress_ratio, kv_start: int, with_entries: bool) -> torch.Tensor:
    """Index mode's list of each query token ([tokens, 1, n] int32 rows of ``row_pool``'s pool), from
    its position t in the raw keys' frame, its request's key count n_k and first pool row
    key_row0, entry count and first entry row (all [tokens]): raw keys t - left .. t + right
    inside [0, n_k) as rows key_row0 + j, then (``with_entries``) the entries j < min(n_entries,
    floor((kv_start + t + 1) / ratio)) of ``listed`` ([tokens, k] top-k indices local to the
    request, CSA; None: all ``entries`` of them, HCA) as rows entry_row0 + j; -1 elsewhere."""
    left, right = window_size
    right = 0 if causal else right
    keys = t[:, None] - left + torch.arange(left + right + 1, device=t.device)  # [tokens, width]
    lists = [torch.where((keys >= 0) & (keys < n_k[:, None]), keys + key_row0[:, None], -1)]
    if with_entries:
        count = torch.minimum(torch.clamp(kv_start + t + 1, min=0) // compress_ratio, n_entries)
        listed = torch.arange(entries, device=t.device)[None] if listed is None else listed.to(t.device).long()
        seen = (listed >= 0) & (listed < count[:, None])
        lists.append(torch.where(seen, listed + entry_row0[:, None], -1))
    return torch.cat(lists, dim=-1).to(torch.int32).reshape(t.shape[0], 1, -1)


def row_pool(kv, compressed_kv) -> torch.Tensor:
    """One pool of K = V rows [rows, 1, d]: kv's rows (batched or packed), then the entries'."""
    d = kv.shape[-1]
    rows = [kv.reshape(-1, 1, d)] + ([] if compressed_kv is None else [compressed_kv.reshape(-1, 1, d)])
    return torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()


def varlen_entries_bound(compressed_kv, compress_ratio, cu_seqlens_k, cu_seqlens_compressed,
                         max_seqlen_k: int | None) -> int:
    """A packed batch's entries per request at most (its HCA lists' width): floor(longest request's
    keys / ratio) when the entries are the default ones (``max_seqlen_k``, else read from
    ``cu_seqlens_k``, but not inside a CUDA-graph capture), else compressed_kv's rows (a bound that
    reads nothing)."""
    if compressed_kv is None:
        return 0
    if cu_seqlens_compressed is not None:
        return compressed_kv.shape[0]
    if max_seqlen_k is None and cu_seqlens_k.is_cuda and torch.cuda.is_current_stream_capturing():
        return compressed_kv.shape[0]  # no host read inside a capture
    if max_seqlen_k is None:
        try:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if cu_seqlens_k.numel() > 1 else 0
        except Exception:  # noqa: BLE001 - torch.compile's fake offsets have no values: the bound that reads none
            return compressed_kv.shape[0]
    return max_seqlen_k // compress_ratio


def varlen_as_lists(q, kv, compressed_kv, compress_ratio, topk_indices, causal, window_size, cu_seqlens_q,
                    cu_seqlens_k, cu_seqlens_compressed=None, positions=None, kv_start: int = 0,
                    entries: int = 0):
    """A variable-length batch's layer (docs/function.md: every rule per request) as index mode:
    ``(pool [total_k + total_c, 1, d], lists [total_q, 1, n] int32)``, the packed raw keys then
    the packed entries. Token x of request r (cu_q[r] <= x < cu_q[r + 1], local index i) sits at
    t = i + n_k - n_q (its request's bottom-right alignment) or positions[x] - kv_start; its list
    is ``token_lists``' over its request's keys (rows cu_k[r] ..) and entries (rows total_k +
    cu_c[r] ..; ``entries`` positions for HCA, its top-k list local to the request for CSA). cu_c:
    ``cu_seqlens_compressed``, or floor(keys / ratio) entries a request."""
    total_q, total_k = q.shape[0], kv.shape[0]
    dev = q.device
    cu_q, cu_k = cu_seqlens_q.to(dev).long(), cu_seqlens_k.to(dev).long()
    x = torch.arange(total_q, device=dev)
    r = torch.bucketize(x, cu_q[1:], right=True).clamp(max=cu_q.numel() - 2)  # each token's request
    n_k = (cu_k[1:] - cu_k[:-1])[r]
    t = x - cu_q[r] + n_k - (cu_q[1:] - cu_q[:-1])[r] if positions is None else positions.to(dev).long() - kv_start
    if cu_seqlens_compressed is not None:
        cu_c = cu_seqlens_compressed.to(dev).long()
    else:
        cu_c = torch.zeros_like(cu_k)
        if compressed_kv is not None:
            torch.cumsum((cu_k[1:] - cu_k[:-1]) // compress_ratio, 0, out=cu_c[1:])
    lists = token_lists(t, n_k, cu_k[r], (cu_c[1:] - cu_c[:-1])[r], total_k + cu_c[r], topk_indices, entries,
                        window_size, causal, compress_ratio, kv_start, compressed_kv is not None)
    return row_pool(kv, compressed_kv), lists


def varlen_backward(q, kv, v, o, lse, do, compressed_kv, compress_ratio, topk_indices, softmax_scale, causal,
                    window_size, learnable_sink, cu_seqlens_q, cu_seqlens_k, cu_seqlens_compressed, positions,
                    kv_start, max_seqlen_k):
    """``fused_backward`` of a variable-length batch: index mode's backward on ``varlen_as_lists``'
    pool and lists (``pool_backward``)."""
    entries = varlen_entries_bound(compressed_kv, compress_ratio, cu_seqlens_k, cu_seqlens_compressed, max_seqlen_k)
    if cu_seqlens_q is None or cu_seqlens_k is None or q.dim() != 3 or \
            not lists_cover(q, kv, v, compressed_kv, topk_indices, causal, window_size, entries):
        raise ValueError("a variable-length batch has a backward only in index mode's form of the layer "
                         "(fused.lists_cover: both cu_seqlens_q and cu_seqlens_k, K = V, one kv head, a window "
                         f"with both bounds, lists of at most {MAX_LIST} positions)")
    pool, idx = varlen_as_lists(q, kv, compressed_kv, compress_ratio, topk_indices, causal, window_size, cu_seqlens_q,
                                cu_seqlens_k, cu_seqlens_compressed, positions, kv_start, entries)
    return pool_backward(q, kv, v, o, lse.t(), do, compressed_kv, pool, idx, softmax_scale, learnable_sink)


def by_lists(q, kv, v, o, lse, do, compressed_kv, lists, softmax_scale, learnable_sink):
    """``fused_backward`` through index mode's backward on ``layer_as_lists``' pool and lists
    (``pool_backward`` on the batches' tokens as one list each)."""
    pool, idx = lists
    b, sq, h, d = q.shape
    grads = pool_backward(q.reshape(b * sq, h, d), kv, v, o.reshape(b * sq, h, d), lse.permute(0, 2, 1).reshape(-1, h),
                          do.reshape(b * sq, h, d), compressed_kv, pool, idx, softmax_scale, learnable_sink)
    return (grads[0].reshape(q.shape),) + grads[1:]


def pool_backward(q, kv, v, o, lse, do, compressed_kv, pool, idx, softmax_scale, learnable_sink):
    """Index mode's backward (``index.index_backward``: the kernel where it serves) of one list a
    token ([tokens, heads, d] q, o, do; lse [tokens, heads]) into ``row_pool(kv, compressed_kv)``,
    the pool's gradient split back: (dq, dk like kv, dv = 0 (K = V: dk holds both), dcompressed
    like compressed_kv or None, dsink)."""
    from dsv4_attention.stages.f_backward import index

    dq, dpool, dsink = index.index_backward(q, pool, idx, o, lse.contiguous(), do, attn_sink=learnable_sink,
                                            softmax_scale=softmax_scale)
    raw = kv.numel() // kv.shape[-1]
    dk = dpool[:raw].reshape(kv.shape)
    # a copy, not a view of dpool: a custom op's outputs may not alias each other (f_fused_backward)
    dc = None if compressed_kv is None else dpool[raw:].reshape(compressed_kv.shape).clone()
    return dq, dk, torch.zeros_like(v), dc, dsink
