"""Stage D2 on Hopper (SM90): query heads packed into the rows of a Q tile.

Stage D1's kernel (stages/d1_smem_p/sm90.py: producer warp, consumer warpgroups, K = V
chunked ring, split O at head dims >= 320) run on folded views of Q, O and LSE
(common/pack_heads.py): for KV head hk, packed row r is token r // g, query head
hk * g + r % g, with g = heads / kv_heads compiled in. The grid becomes
(ceil(g seqlen_q / tile_m), kv_heads, batch), and each CTA's KV tiles serve g heads'
rows at once. Nothing inside the kernel changes: Q's TMA box, the O store over sQ and the
LSE writes all address through the folded layouts, which is the point of making the
packed-row map a layout rather than index arithmetic.

Which groups pack (whole TMA boxes, tiles starting on a token):
    rows layout, tile_m = 128 (head dims 128-256): g in {2, 4, ..., 128} and multiples of 128
    rows layout, tile_m = 192 (head dim 64): g dividing 192 (2, 3, 4, 6, 8, ..., 64) or a multiple
    split layout, tile_m = 64 (head dims 320-512): g dividing 64 or a multiple of 64 (128: two
        CTAs per token, 64 heads each)
"""

from dsv4_attention.common.pack_heads import fold_heads, packable
from dsv4_attention.stages.d1_smem_p.sm90 import FlashAttentionD1Sm90


class FlashAttentionD2Sm90(FlashAttentionD1Sm90):
    def __init__(self, dtype, head_dim: int, *, pack_group: int = 1, **options):
        super().__init__(dtype, head_dim, **options)
        if pack_group != 1 and not packable(pack_group, self.tile_m):
            raise ValueError(f"pack_group {pack_group} does not pack into {self.tile_m}-row tiles")
        self.pack_group = pack_group

    def row_views(self, mQ, mO, mLSE):
        """Q, O (rows, head_dim, heads, batch) and LSE (batch, heads, rows) with g heads folded into the rows."""
        g = self.pack_group
        return fold_heads(mQ, 0, 2, g), fold_heads(mO, 0, 2, g), fold_heads(mLSE, 2, 1, g)
