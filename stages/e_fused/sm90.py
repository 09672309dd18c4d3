"""Stage E on Hopper (SM90): the window and the compressed entries in one softmax, one launch.

Stage D5's kernel (sink in the epilogue, D4's window span, D2's packed heads) with a second K = V
source: DeepSeek-V4's compressed entries (``compressed_kv``, ratio r; common/compressed.py). Entry
j is visible to the query at position t' (bottom-right aligned, D4) iff j < floor((t' + 1) / r).
Both sources are K = V tensors of the same head_dim, so their tiles take turns in the one chunked
ring (common/sm90_kv_chunks.py) and the consumers cannot tell them apart: the softmax, the O
rescale and the sink run over the union exactly as over one key set.

Per Q tile (rows = tokens t_lo .. t_hi), tiles in one index space (``FusedSpan``):

    n < n_cmp    compressed entries [64 n, 64 n + 64)          masked iff 64 n + 64 > count(t_lo)
    n >= n_cmp   window tile n - n_cmp of D4's span            D4's masks

visited last-first as before: the window's tiles (its first visit holds the diagonal), then the
compressed ones from the last (the only one a row can see partly) down to 0. Seams used, all in
stage D1's skeleton: ``kv_span`` (the fused span), ``load_kv`` (the producer's source per tile:
one runtime branch between two TMA descriptors of the same box), ``masks_inner_tiles``.
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.compressed import FusedSpan
from dsv4_attention.stages.d5_sink_merge.sm90 import FlashAttentionD5Sm90


class FlashAttentionESm90(FlashAttentionD5Sm90):
    def __init__(self, dtype, head_dim: int, *, has_compressed: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.has_compressed = bool(has_compressed)
        if self.has_compressed and not self.kv_shared:
            raise ValueError("compressed entries are K = V rows: the window's K and V must be one tensor (kv)")
        if self.has_compressed and self.varlen:
            raise ValueError("compressed entries with cu_seqlens are not supported yet: pass batched tensors")

    def kv_span(self, m_block, rows, seqlen_k, window_left, window_right, compress_ratio, n_compressed):
        if cutlass.const_expr(not self.has_compressed):
            return super().kv_span(m_block, rows, seqlen_k, window_left, window_right, compress_ratio, n_compressed)
        return FusedSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window_left,
                         window_right, self.has_left, self.has_right, compress_ratio, n_compressed)

    def masks_inner_tiles(self) -> bool:
        return super().masks_inner_tiles() or self.has_compressed

    @cute.jit
    def load_kv(self, ring, t, n, span, tma_atom_k, tKgK, tKsK, tma_atom_c, tCgC):
        if cutlass.const_expr(self.has_compressed):
            if n < span.n_cmp:
                ring.load(t, tma_atom_c, tCgC, tKsK, n)
            else:
                ring.load(t, tma_atom_k, tKgK, tKsK, n - span.n_cmp)
        else:
            ring.load(t, tma_atom_k, tKgK, tKsK, n)
