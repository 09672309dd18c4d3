"""Stage D5 on Blackwell (SM100): the attention sink.

Stage D4's kernel with the epilogue's per-row scale seam (``row_scale``) switched on: in the
correction warpgroup, thread t owns row t of O, so each thread scales its own row's
1 / rowsum by sigmoid(LSE - sink[h]) = 1 / (1 + 2^((sink[h] - LSE) log2 e)) before O leaves
TMEM. LSE is stored without the sink; a row that saw no key (LSE = -inf) gets factor 0 and O
stays 0. Row t of Q tile m_blk is packed row r = m_blk * 128 + t of its request, query head
h * g + r % g (D2's map; g = 1 unpacked, where h is the query head).
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.softmax import sink_factor
from dsv4_attention.stages.d4_causal_window.sm100 import FlashAttentionD4Sm100


class FlashAttentionD5Sm100(FlashAttentionD4Sm100):
    def __init__(self, dtype, head_dim: int, *, has_sink: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.has_sink = bool(has_sink)

    @cute.jit
    def row_scale(self, inv_row_sum, lse, mSink, q_row, h):
        if cutlass.const_expr(self.has_sink):
            inv_row_sum = inv_row_sum * sink_factor(lse, mSink[h * self.pack_group + q_row % self.pack_group])
        return inv_row_sum
