"""Stage E on Blackwell (SM100): the window and the compressed entries in one softmax, one launch.

Stage D5's kernel (sink in the epilogue, D4's window span, D2's packed heads) with a second K = V
source: DeepSeek-V4's compressed entries (``compressed_kv``, ratio r; common/compressed.py). Entry
j is visible to the query at position t' (bottom-right aligned, D4) iff j < floor((t' + 1) / r).
Both sources are K = V tensors of the same head_dim, loaded by TMA atoms of the same box into the
same ring stages, so the MMA, softmax and correction warps cannot tell them apart: the online
softmax, the O rescale and the sink run over the union exactly as over one key set.

Per 128-row Q tile (rows = tokens t_lo .. t_hi), tiles in one index space (``FusedSpan``, T = tile_n):

    n < n_cmp    compressed entries [n T, n T + T)           TMA: compressed view, entry n T
    n >= n_cmp   window tile n - n_cmp of D4's span          TMA: K's view, key origin + (n - n_cmp) T
    n_cmp = ceil(count(t_hi) / T),   count(t) = min(n_compressed, floor((t' + 1) / r))

visited last-first as before: the window's tiles (its first visit holds the diagonal), then the
compressed ones from the last (the only one a row can see partly) down to 0. Softmax thread t
computes its row's count once per CTA beside D4's window bounds (``row_keys``); a compressed tile's
visible columns are [0, count - n T) (``tile_columns``), masked by D4's ``mask_from`` only where
that cuts the tile; a window tile keeps D4's bounds from its first key. Seams used, all in stage
D1's skeleton: ``kv_span`` (the fused span), ``load_k_block`` (the TMA warp's source per tile: one
runtime branch between two descriptors of the same box), ``compressed_tma_view``, ``row_keys``,
``tile_columns``, ``masks_inner_tiles``; ``__call__`` builds the compressed atom (``has_compressed``).
Host proof: tests/test_e_sm100_host.py.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from dsv4_attention.common.compressed import FusedSpan
from dsv4_attention.common.sm100_softmax import visible_columns, visible_entries
from dsv4_attention.common.tmem import QK_TILE_M
from dsv4_attention.stages.d5_sink_merge.sm100 import FlashAttentionD5Sm100


class FlashAttentionESm100(FlashAttentionD5Sm100):
    def __init__(self, dtype, head_dim: int, *, has_compressed: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.has_compressed = bool(has_compressed)
        if self.has_compressed and not self.kv_shared:
            raise ValueError("compressed entries are K = V rows: the window's K and V must be one tensor (kv)")
        if self.has_compressed and self.varlen:
            raise ValueError("compressed entries with cu_seqlens are not supported yet: pass batched tensors")

    def kv_span(self, m_block, rows, seqlen_k, window_left, window_right, compress_ratio=0, n_compressed=0):
        if cutlass.const_expr(not self.has_compressed):
            return super().kv_span(m_block, rows, seqlen_k, window_left, window_right, compress_ratio, n_compressed)
        return FusedSpan(m_block, rows, seqlen_k, QK_TILE_M, self.plan.tile_n, self.pack_group, window_left,
                         window_right, self.has_left, self.has_right, compress_ratio, n_compressed)

    def masks_inner_tiles(self) -> bool:
        # every compressed tile may cut a row (count grows along the tile's tokens)
        return super().masks_inner_tiles() or self.has_compressed

    @cute.jit
    def load_k_block(self, span, tile, kb, tma_atom_k, tKgK, tma_atom_c, tCgC, dst, barrier):
        if cutlass.const_expr(self.has_compressed):
            if tile < span.n_cmp:
                cute.copy(tma_atom_c, tCgC[None, tile, kb], dst, tma_bar_ptr=barrier)
            else:
                cute.copy(tma_atom_k, tKgK[None, span.window_tile(tile), kb], dst, tma_bar_ptr=barrier)
        else:
            cute.copy(tma_atom_k, tKgK[None, tile, kb], dst, tma_bar_ptr=barrier)

    def row_keys(self, span, m_blk, tTR_cS):
        keys = super().row_keys(span, m_blk, tTR_cS)
        if not self.has_compressed:
            return keys
        # the row's entry count beside its window bounds: one integer per thread, once per CTA
        return keys, visible_entries(span, m_blk * QK_TILE_M + tTR_cS[0][0])

    def tile_columns(self, span, keys, n):
        if not self.has_compressed:
            return super().tile_columns(span, keys, n)
        return self.fused_columns(span, keys, n)

    @cute.jit
    def fused_columns(self, span, keys, n):
        """Tile n's visible columns: a compressed tile's [0, count - n T), a window tile's D4 bounds
        from its first key. Selects bounds, so the softmax keeps one mask pass per bound."""
        window_keys, count = keys
        lo, hi = visible_columns(window_keys, span.first_key(n))
        compressed = n < span.n_cmp
        hi = (count - n * span.tile_n) if compressed else hi
        if cutlass.const_expr(lo is not None):
            lo = Int32(0) if compressed else lo
        return lo, hi
