"""The merge of split-KV's partial attentions on the GPU (common/split_kv.combine's kernel).

Split s of batch entry b holds, for each row (token t, head h), its O normalised over its keys
(fp32) and their LSE (natural log; -inf for a split with no visible key, whose O is 0). The row's
attention over every split's keys is

    G = max_s lse_s;  w_s = exp(lse_s - G);  LSE = G + log sum_s w_s;  O = sum_s (w_s / sum w) O_s

times sigmoid(LSE - sink[h]) with an attention sink; all parts empty gives O = 0, LSE = -inf.
Architecture-neutral (loads, stores, fp32 arithmetic): the same class serves sm90 and sm100.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.softmax import sink_factor

ROWS_PER_CTA = 4  # one warp a (token, head) row


class SplitCombine:
    """The merge of split-KV's parts: one warp per row (batch b, token t, head h), 4 rows a CTA.

    Every lane reads the row's S partial LSEs (the same addresses: one broadcast load each) and
    forms G = max_s lse_s, the weights w_s = exp2((lse_s - G) log2 e) / sum (0 for an empty part,
    lse_s = -inf, never read), LSE = G + log(sum); lane l then accumulates columns 4 l + 128 j
    .. + 3 (j < head_dim / 128: each load instruction covers 512 contiguous bytes of a part's row)
    over the parts with a weight, scales by the sink's sigmoid(LSE - sink[h]) and stores them in
    O's dtype; lane 0 stores the LSE. A row whose parts are all empty gets O = 0, LSE = -inf."""

    def __init__(self, dtype, head_dim: int, *, has_sink: bool = False):
        if head_dim % 128:
            raise ValueError(f"the split merge takes head dims that are multiples of 128; got {head_dim}")
        self.dtype, self.head_dim, self.has_sink = dtype, head_dim, has_sink

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSink: cute.Tensor | None, num_splits: cutlass.Int32, stream):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOp, mLSEp, mO, mLSE, mSink, num_splits, rows).launch(
            grid=[cute.ceil_div(rows, ROWS_PER_CTA), 1, 1], block=[32 * ROWS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSink: cute.Tensor | None, num_splits: cutlass.Int32, rows: cutlass.Int32):
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % 32
        row = cute.arch.block_idx()[0] * ROWS_PER_CTA + tidx // 32
        heads, tokens, batch = mO.shape[2], mO.shape[1], mO.shape[0]
        if row < rows:
            h = row % heads
            t = (row // heads) % tokens
            b = row // (heads * tokens)
            log2e = cutlass.Float32(math.log2(math.e))
            g = -cutlass.Float32.inf
            for s in cutlass.range(num_splits, unroll=1):
                g = cutlass.max(g, mLSEp[s * batch + b, h, t])
            g_safe = g if g > -cutlass.Float32.inf else cutlass.Float32(0.0)
            total = cutlass.Float32(0.0)
            for s in cutlass.range(num_splits, unroll=1):
                total = total + cute.math.exp2((mLSEp[s * batch + b, h, t] - g_safe) * log2e, fastmath=True)
            lse = -cutlass.Float32.inf
            inv = cutlass.Float32(0.0)
            if total > cutlass.Float32(0.0):
                lse = g_safe + cute.math.log2(total, fastmath=True) / log2e
                inv = cutlass.Float32(1.0) / total
            if cutlass.const_expr(self.has_sink):
                inv = inv * sink_factor(lse, mSink[h])
            chunks = self.head_dim // 128
            acc = cute.make_rmem_tensor(4 * chunks, cutlass.Float32)
            acc.fill(0.0)
            for s in cutlass.range(num_splits, unroll=1):
                ls = mLSEp[s * batch + b, h, t]
                if ls > -cutlass.Float32.inf:  # an empty part adds nothing (and is not read)
                    w = cute.math.exp2((ls - g_safe) * log2e, fastmath=True) * inv
                    for j in cutlass.range_constexpr(chunks):
                        for e in cutlass.range_constexpr(4):
                            acc[4 * j + e] = acc[4 * j + e] + w * mOp[s * batch + b, t, h, 128 * j + 4 * lane + e]
            for j in cutlass.range_constexpr(chunks):
                for e in cutlass.range_constexpr(4):
                    mO[b, t, h, 128 * j + 4 * lane + e] = acc[4 * j + e].to(self.dtype)
            if lane == 0:
                mLSE[b, h, t] = lse
