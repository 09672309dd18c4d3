"""Stage D3 on Hopper (SM90): per-request key counts (``seqused_k``).

Stage D2's kernel with one seam changed: the keys of request b are seqused_k[b] (the origin's
``swa_lens``), read once per CTA, clamped to the tensor's seqlen_k. The span (common/kv_span.py)
then covers only those keys: KV tiles wholly past seqused_k[b] are never loaded, the first tile
a CTA visits masks the tail as before, and a request with no key (seqused_k[b] = 0) visits one
wholly masked tile, so its rows return O = 0 and LSE = -inf (the online softmax's empty-row path,
common/softmax.py, is compiled in for this stage on). Bottom-right alignment (D4) uses this count.
"""

import cutlass

from stages.d2_pack_heads.sm90 import FlashAttentionD2Sm90


class FlashAttentionD3Sm90(FlashAttentionD2Sm90):
    def __init__(self, dtype, head_dim: int, *, seqused_k: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.uses_seqused_k = bool(seqused_k)

    def kv_length(self, mSeqUsedK, batch, seqlen_k):
        if cutlass.const_expr(self.uses_seqused_k):
            return cutlass.max(cutlass.min(mSeqUsedK[batch], seqlen_k), 0)
        return seqlen_k
