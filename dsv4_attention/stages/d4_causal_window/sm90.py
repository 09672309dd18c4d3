"""Stage D4 on Hopper (SM90): causal attention and sliding windows.

Stage D3's kernel with the window seam switched on (``kv_span``, common/kv_span.py; the bounds
arrive as common/seams.Window): query token i sees key j
iff i' - left <= j <= i' + right, i' = i + seqlen_k - seqlen_q (bottom-right; causal is
right = 0). ``has_left`` / ``has_right`` are compile-time (which bounds exist); the bounds
themselves are runtime values, so one compiled kernel serves every window.

Per Q tile (rows = tokens t_lo .. t_hi, heads packed as D2):
    span   keys [max(0, t_lo' - left), min(seqlen_k, t_hi' + right + 1)), cut into KV tiles from
           its first key (a TMA box may start at any row): tiles outside it are never loaded
    mask   only the tiles that straddle a boundary (tile_needs_mask): the first one visited
           (right edge / seqlen_k) and, with a left bound, the last ones; the rest run unmasked
    empty  a row whose window holds no key: O = 0, LSE = -inf (D3's empty-row softmax)
With 128 heads of one token packed into the rows and a (127, 0) window, a Q tile's span is
exactly 128 keys: two 64-key tiles, not three half-masked ones.
"""

from dsv4_attention.common.kv_span import KvSpan
from dsv4_attention.stages.d3_lengths.sm90 import FlashAttentionD3Sm90


class FlashAttentionD4Sm90(FlashAttentionD3Sm90):
    def __init__(self, dtype, head_dim: int, *, has_left: bool = False, has_right: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.has_left, self.has_right = bool(has_left), bool(has_right)
        # causal without a left bound: later Q tiles see more keys; scheduling them first keeps
        # the last wave short (a window gives every tile the same work)
        self.longest_first = self.has_right and not self.has_left

    def kv_span(self, m_block, rows, seqlen_k, window, entries):
        """D1's span bounded by the window (common/seams.Window)."""
        return KvSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window.left, window.right,
                      self.has_left, self.has_right)

    def may_hide_rows(self) -> bool:
        return super().may_hide_rows() or self.has_left or self.has_right

    def masks_inner_tiles(self) -> bool:
        return super().masks_inner_tiles() or self.has_left or self.has_right
