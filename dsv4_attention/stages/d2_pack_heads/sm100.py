"""Stage D2 on Blackwell (SM100): query heads packed into the rows of a Q tile.

Stage D1's kernel (stages/d1_smem_p/sm100.py: TMA, MMA, softmax and correction warps,
SMEM-P or TMEM-P, O split over two CTAs at head dim 512) run on folded views of Q, O and
LSE (common/pack_heads.py): for KV head hk, packed row r is token r // g, query head
hk * g + r % g. The 128-row Q tile is one TMA box of the folded Q when g divides 128 or
128 divides g (g heads x 128 / g tokens, or 128 heads of one token); the correction warps'
O store (TMA) and LSE writes (thread t owns row t) address through the same fold.
"""

from dsv4_attention.common.pack_heads import fold_heads, packable
from dsv4_attention.common.tmem import QK_TILE_M
from dsv4_attention.stages.d1_smem_p.sm100 import FlashAttentionD1Sm100


class FlashAttentionD2Sm100(FlashAttentionD1Sm100):
    tile_m = QK_TILE_M

    def __init__(self, dtype, head_dim: int, *, pack_group: int = 1, **options):
        super().__init__(dtype, head_dim, **options)
        if pack_group != 1 and not packable(pack_group, self.tile_m):
            raise ValueError(f"pack_group {pack_group} does not pack into {self.tile_m}-row tiles")
        self.pack_group = pack_group

    def row_views(self, q, o, lse):
        """Q, O (rows, head_dim, heads, batch) and LSE (rows, heads, batch) with g heads folded into the rows."""
        g = self.pack_group
        return fold_heads(q, 0, 2, g), fold_heads(o, 0, 2, g), fold_heads(lse, 0, 1, g)
