"""Stage D3 on Hopper (SM90): per-request key counts (``seqused_k``) and variable-length
batches (``cu_seqlens``).

Stage D2's kernel with one seam changed: the keys of request b are seqused_k[b] (the origin's
``swa_lens``), read once per CTA, clamped to the tensor's seqlen_k. The span (common/kv_span.py)
then covers only those keys: KV tiles wholly past seqused_k[b] are never loaded, the first tile
a CTA visits masks the tail as before, and a request with no key (seqused_k[b] = 0) visits one
wholly masked tile, so its rows return O = 0 and LSE = -inf (the online softmax's empty-row path,
common/softmax.py, is compiled in for this stage on). Bottom-right alignment (D4) uses this count.

Variable-length batches change a second seam, ``request_views``: the tensors are one batch of
every request's tokens ([1, total, heads, d]; LSE [1, heads, total]) and request b is the rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of Q / O / LSE and the keys cu_seqlens_k[b] .. of K and V.
Each CTA offsets its views to its request's first token (``cute.domain_offset``: TMA boxes start
at any row; with heads packed, packed row cu_q[b] * g is that token's first head) and takes the
request's row and key counts; the grid runs the tiles of the longest request, and a tile past
its request's rows does nothing. Loads past the request's end read the next request's rows,
which the key mask hides (keys) or nobody stores (queries); the one Q tile that straddles the
end stores O row by row (common/sm90_epilogue.copy_rows), never the next request's rows.

    request b:   Q/O rows  [cu_q[b] * g, cu_q[b + 1] * g)      (packed rows, g heads per token)
                 K/V keys  [cu_k[b], cu_k[b + 1])
                 LSE       [0, head, cu_q[b] * g + r]           (row r of the request)
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.layouts import request_rows
from dsv4_attention.stages.d2_pack_heads.sm90 import FlashAttentionD2Sm90


class FlashAttentionD3Sm90(FlashAttentionD2Sm90):
    def __init__(self, dtype, head_dim: int, *, seqused_k: bool = False, varlen: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        if seqused_k and varlen:  # as sm100's: the public API refuses it too, this guards direct use
            raise ValueError("seqused_k with varlen is not supported: each request's keys come from cu_seqlens_k")
        self.uses_seqused_k = bool(seqused_k)
        self.varlen = bool(varlen)

    def kv_length(self, mSeqUsedK, batch, seqlen_k):
        if cutlass.const_expr(self.uses_seqused_k):
            return cutlass.max(cutlass.min(mSeqUsedK[batch], seqlen_k), 0)
        return seqlen_k

    def request_views(self, batch, mQ, mK, mV, mO, mO_mem, mLSE, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK):
        if cutlass.const_expr(not self.varlen):
            return super().request_views(batch, mQ, mK, mV, mO, mO_mem, mLSE, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK)
        row0, k0, n_rows, n_k = request_rows(mCuSeqlensQ, mCuSeqlensK, batch, self.pack_group)
        rows0 = (row0, 0, 0, 0)  # a flat packed row: CuTe splits it as (head in group, token) = (0, q0)
        mQ, mO, mO_mem = (cute.domain_offset(rows0, t) for t in (mQ, mO, mO_mem))
        mK, mV = (cute.domain_offset((k0, 0, 0, 0), t) for t in (mK, mV))
        mLSE = cute.domain_offset((0, 0, row0), mLSE)
        return mQ, mK, mV, mO, mO_mem, mLSE, 0, n_rows, n_k
