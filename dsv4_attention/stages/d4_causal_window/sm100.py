"""Stage D4 on Blackwell (SM100): causal attention and sliding windows.

Stage D3's kernel with the window seam switched on (``kv_span``, common/kv_span.py; the bounds
arrive as common/seams.Window): query token i sees key j
iff i' - left <= j <= i' + right, i' = i + seqlen_k - seqlen_q (bottom-right; causal is
right = 0). ``has_left`` / ``has_right`` are compile-time (which bounds exist); the bounds
themselves are runtime values, so one compiled kernel serves every window.

Per 128-row Q tile (rows = tokens t_lo .. t_hi, heads packed as D2; both O halves of a head-dim-512
tile compute the same span):
    span   keys [max(0, t_lo' - left), min(seqlen_k, t_hi' + right + 1)), cut into KV tiles from its
           first key: the TMA warp offsets K's (and V's) key mode by it, so tiles outside the span
           are never loaded and the MMA / softmax / correction warps iterate only its tiles
    mask   softmax thread t (row t) hides the keys outside [lo, hi) of its token, bounds computed
           once per tile (common/sm100_softmax.py: visible_columns), on the first tile visited and
           on later ones only where tile_needs_mask says the tile straddles an edge
    empty  a row whose window holds no key: O = 0, LSE = -inf (D3's empty-row path)
With 128 heads of one token packed into the rows and a (127, 0) window, a Q tile's span is
exactly 128 keys: two 64-key tiles at head dim 512, not three half-masked ones.
"""

from dsv4_attention.common.kv_span import KvSpan
from dsv4_attention.common.tmem import QK_TILE_M
from dsv4_attention.stages.d3_lengths.sm100 import FlashAttentionD3Sm100


class FlashAttentionD4Sm100(FlashAttentionD3Sm100):
    def __init__(self, dtype, head_dim: int, *, has_left: bool = False, has_right: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.has_left, self.has_right = bool(has_left), bool(has_right)
        # causal without a left bound: later Q tiles see more keys; scheduling them first keeps
        # the last wave short (a window gives every tile the same work)
        self.longest_first = self.has_right and not self.has_left

    def kv_span(self, m_block, rows, seqlen_k, window, entries):
        """D1's span bounded by the window (common/seams.Window)."""
        return KvSpan(m_block, rows, seqlen_k, QK_TILE_M, self.plan.tile_n, self.pack_group, window.left,
                      window.right, self.has_left, self.has_right)

    def q_tile_of(self, bx, grid_x):
        m_blk, half = super().q_tile_of(bx, grid_x)
        if self.longest_first:  # causal: the tiles with the most keys start first
            m_blk = grid_x // self.plan.o_split - 1 - m_blk
        return m_blk, half

    def may_hide_rows(self) -> bool:
        return super().may_hide_rows() or self.has_left or self.has_right

    def masks_inner_tiles(self) -> bool:
        return super().masks_inner_tiles() or self.has_left or self.has_right
