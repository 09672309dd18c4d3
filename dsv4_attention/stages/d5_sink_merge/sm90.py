"""Stage D5 on Hopper (SM90): the attention sink.

Stage D4's kernel with the epilogue's per-row scale seam (``row_scale``) switched on. A sink is a
logit in the softmax's denominator only (FlashAttention-4's ``learnable_sink``, one per query
head): with the row's LSE over its keys,

    O_sink = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink[h])) = O * sigmoid(LSE - sink[h])

so the kernel runs unchanged and each row's 1 / rowsum is multiplied by
1 / (1 + exp(sink[h] - LSE)) before O is scaled; LSE is stored without the sink (the public
convention). A row that saw no key has LSE = -inf: the factor is 1 / (1 + inf) = 0 and O stays 0.

Row i of this thread is packed row r = m_block * tile_m + row_i of its request, query head
head * g + r % g (D2's map: g heads per token; g = 1 unpacked, where head is the query head).
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.softmax import acc_rows_view, sink_factor
from dsv4_attention.stages.d4_causal_window.sm90 import FlashAttentionD4Sm90


class FlashAttentionD5Sm90(FlashAttentionD4Sm90):
    def __init__(self, dtype, head_dim: int, *, has_sink: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        self.has_sink = bool(has_sink)

    @cute.jit
    def row_scale(self, inv_sum, lse, mSink, tScS, m_block, head):
        if cutlass.const_expr(self.has_sink):
            rows_c = acc_rows_view(tScS)
            g = self.pack_group
            for i in cutlass.range_constexpr(cute.size(inv_sum)):
                r = m_block * self.tile_m + rows_c[i, 0][0]
                inv_sum[i] = inv_sum[i] * sink_factor(lse[i], mSink[head * g + r % g])
