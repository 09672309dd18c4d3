"""Stage D3 on Blackwell (SM100): per-request key counts (``seqused_k``).

Stage D2's kernel (stages/d2_pack_heads/sm100.py) with one seam changed: the keys of request b are
seqused_k[b] (the origin's ``swa_lens``), read once per CTA, clamped to the tensor's seqlen_k. The
span (common/kv_span.py) then covers only those keys: the TMA warp never loads a KV tile wholly past
seqused_k[b], the MMA, softmax and correction warps iterate that many tiles, and the softmax masks
the tail of the first tile it visits as before. A request with no key (seqused_k[b] = 0) visits one
wholly masked tile: its rows keep m = -inf, so every exp2 subtracts 0 instead, the rescale factor
stays 1 and the correction warps write O = 0 (1 / l becomes 0) and LSE = -inf (common/sm100_softmax.py,
compiled in for this stage on). Bottom-right alignment (D4) uses this count.
"""

import cutlass

from stages.d2_pack_heads.sm100 import FlashAttentionD2Sm100


class FlashAttentionD3Sm100(FlashAttentionD2Sm100):
    def __init__(self, dtype, head_dim: int, *, seqused_k: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.uses_seqused_k = bool(seqused_k)

    def kv_length(self, mSeqUsedK, batch, seqlen_k):
        if cutlass.const_expr(self.uses_seqused_k):
            return cutlass.max(cutlass.min(mSeqUsedK[batch], seqlen_k), 0)
        return seqlen_k
