"""Tile order: which Q tile (and head, batch entry, split) each CTA or loop iteration runs.

Three orders, one interface (``grid_tile`` for a CTA of the one-tile grid, ``tile_coords`` for
a unit of the persistent loop), mixed into the kernels that use them:

    single tile      grid (m_tiles, heads, batch): CTA (x, y, z) runs Q tile x of head y, batch
                     entry z
    longest first    the same grid, Q tiles reversed (D4's causal: the tiles with the most keys
                     start first, so the last wave is short)
    static persistent  min(units, SMs) CTAs (common/persistent.py); CTA c runs units c, c + grid,
                     c + 2 grid, ..., unit u decoded as the Q tile fastest, then the split
                     (split-KV), the head, the batch entry: a token's Q tiles and splits run side
                     by side on the same KV rows

The kernel class sets ``split_kv`` (compile-time); D4's causal kernels set ``longest_first``.
"""

import cutlass
import cutlass.cute as cute


class TileScheduler:
    """Tile order (module doc) for a kernel class with ``split_kv`` and ``longest_first``."""

    longest_first = False  # D4 causal: launch the Q tiles that see the most keys first

    @cute.jit
    def grid_tile(self):
        """(m_block, head, batch) of this CTA of the one-tile grid, longest first where asked."""
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.longest_first):  # causal: the tiles with the most keys start first
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        return m_block, head, batch

    @cute.jit
    def tile_coords(self, tile_idx, m_tiles, heads, num_splits=None):
        """(m_block, head, batch, split) of the launch's unit ``tile_idx``: the Q tile fastest, then
        the split (split-KV; else None), the head, the batch entry (the non-persistent grid's x, y,
        z, in that order: a token's Q tiles, and then its splits, run side by side on the same KV
        rows); longest first where D4 asks for it."""
        m_block = tile_idx % m_tiles
        hb = tile_idx // m_tiles
        kv_part = None
        if cutlass.const_expr(self.split_kv):
            kv_part = hb % num_splits
            hb = hb // num_splits
        if cutlass.const_expr(self.longest_first):
            m_block = m_tiles - 1 - m_block
        return m_block, hb % heads, hb // heads, kv_part
