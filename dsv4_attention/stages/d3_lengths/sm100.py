"""Stage D3 on Blackwell (SM100): per-request key counts (``seqused_k``) and variable-length batches
(``cu_seqlens``).

Stage D2's kernel (stages/d2_pack_heads/sm100.py) with one seam changed: the keys of request b are
seqused_k[b] (the origin's ``swa_lens``), read once per CTA, clamped to the tensor's seqlen_k. The
span (common/kv_span.py) then covers only those keys: the TMA warp never loads a KV tile wholly past
seqused_k[b], the MMA, softmax and correction warps iterate that many tiles, and the softmax masks
the tail of the first tile it visits as before. A request with no key (seqused_k[b] = 0) visits one
wholly masked tile: its rows keep m = -inf, so every exp2 subtracts 0 instead, the rescale factor
stays 1 and the correction warps write O = 0 (1 / l becomes 0) and LSE = -inf (common/sm100_softmax.py,
compiled in for this stage on). Bottom-right alignment (D4) uses this count.

Variable-length batches (``varlen``) change a second seam, ``request_views``: the tensors are one
batch of every request's tokens (Q, K, V, O [1, total, heads, d]; LSE [1, heads, total_q]) and
request b (grid z) is

    Q / O    packed rows [cu_q[b] g, cu_q[b + 1] g) of the folded (rows, head_dim, kv_heads, 1) views
             (g heads per token, D2; packed row cu_q[b] g is token cu_q[b]'s first head of the group)
    LSE      the same rows of the folded (rows, kv_heads, 1) view: LSE[0, hk g + r % g, cu_q[b] + r // g]
    K        keys [cu_k[b], cu_k[b + 1]) of (seqlen_k, head_dim, kv_heads, 1): its mode 0
    V        the same keys of (head_dim, seqlen_k, kv_heads, 1): its mode 1 (K's view when kv_shared)

Each CTA offsets its views to its request's first row and key (``cute.domain_offset``, on the TMA
coordinate views as on memory: a TMA box starts at any row), indexes them with batch 0, and takes
the request's row count (cu_q[b + 1] - cu_q[b]) g and key count cu_k[b + 1] - cu_k[b]: the span,
the key mask and a request with no key (O = 0, LSE = -inf, as seqused_k = 0) follow from them. The
grid runs the Q tiles of the longest request; a tile past its request's rows does nothing. Loads
past the request's end read the next request's rows, which the key mask hides (keys) or nobody
stores (queries). The one Q tile that straddles the request's end stores O row by row (each
correction thread its own row from the staged sO, rows < the request's only) instead of by TMA,
and LSE is written for the request's rows only; the host proof is tests/test_d3_varlen_sm100_host.py.
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.layouts import request_rows
from dsv4_attention.stages.d2_pack_heads.sm100 import FlashAttentionD2Sm100


class FlashAttentionD3Sm100(FlashAttentionD2Sm100):
    def __init__(self, dtype, head_dim: int, *, seqused_k: bool = False, varlen: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        if seqused_k and varlen:
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
        # a flat packed row into the (g, tokens) row mode: CuTe splits it as (head in group, token) = (0, q0)
        row0, k0, n_rows, n_k = request_rows(mCuSeqlensQ, mCuSeqlensK, batch, self.pack_group)
        mQ, mO = cute.domain_offset((row0, 0, 0, 0), mQ), cute.domain_offset((row0, 0, 0, 0), mO)
        if cutlass.const_expr(mO_mem is not None):
            mO_mem = cute.domain_offset((row0, 0, 0, 0), mO_mem)
        mLSE = cute.domain_offset((row0, 0, 0), mLSE)
        mK = cute.domain_offset((k0, 0, 0, 0), mK)
        # V is (head_dim, seqlen_k, ..): its keys are mode 1; K = V: mV is K's view (never loaded)
        mV = mK if cutlass.const_expr(self.kv_shared) else cute.domain_offset((0, k0, 0, 0), mV)
        return mQ, mK, mV, mO, mO_mem, mLSE, 0, n_rows, n_k
