"""The backward's row statistics, one kernel (launched by preprocess.statistics): D = rowsum(dO * O)
in fp32 and the LSE in the exp2 domain, written into the kernel's padded rows (FlashAttention's
"preprocess").

    D[b, h, r(i)]    = sum_c dO[b, i, h, c] O[b, i, h, c]        (fp32 products and sums)
    LSE2[b, h, r(i)] = LSE[b, h, i] log2(e), +inf where LSE = -inf (a row that saw no key: P = 0)

r(i) = i, or the padded row of packed row i (``rows``: a variable-length batch's rows padded per
request, common/varlen.py). Rows no query lands on keep what the caller filled (+inf, 0).

Why a kernel: the same in torch (``preprocess.statistics_torch``, its specification and the CPU's form) casts
O and dO to fp32 copies, multiplies, reduces, then scatters: six launches and four passes over
tensors the size of O, 0.4-0.7 ms at 8 x 2048 tokens x 32 heads, a quarter of the backward kernel's
own time (H200, docs/stages/f_backward.md). This one reads O and dO once, 16 bytes a thread.

Layout: G = min(32, d / 8) threads a row (lanes of one warp), each thread 8 consecutive columns
per step (one 16-byte load of each tensor; the strides are those of contiguous tensors, which
the host checks, so every vector is 16-byte aligned), d / (8 G) steps; the G partial sums meet
by a butterfly over the G lanes; the group's first lane writes D and LSE2. 128 threads a CTA,
128 / G rows. Architecture-neutral (loads, shuffles, stores): the same class serves sm90 and sm100.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.layouts import with_row_vectors
from dsv4_attention.stages.f_backward.preprocess import LOG2E

THREADS = 128
VEC = 8  # 16-bit values a thread loads at once (16 bytes)


def _fadd(a, b):
    return a + b


class BackwardPreprocess:
    """D and LSE2 of every query row into the backward's padded (batch, heads, rows) buffers."""

    def __init__(self, dtype, head_dim: int, *, row_map: bool = False):
        self.dtype, self.head_dim, self.row_map = dtype, head_dim, row_map
        self.group = min(32, head_dim // VEC)
        if head_dim % VEC or head_dim % (VEC * self.group):
            raise ValueError(f"the backward's preprocess takes head dims that are multiples of {VEC} up to "
                             f"{32 * VEC}, or of {32 * VEC} beyond; got {head_dim}")
        self.steps = head_dim // (VEC * self.group)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
                 mRows: cute.Tensor | None, stream):
        # mO, mdO: (batch, seqlen, heads, d), contiguous; mLSE: (batch, heads, seqlen) fp32;
        # mLSE2, mD: (batch, heads, rows) fp32; mRows: (seqlen,) int32, the padded row of each row
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        per_cta = THREADS // self.group
        # strides known to be multiples of 8 (a contiguous tensor's, d % 8 == 0): each thread's 8
        # values are one 16-byte load
        mO, mdO = with_row_vectors(mO, VEC), with_row_vectors(mdO, VEC)
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mRows, rows).launch(
            grid=[cute.ceil_div(rows, per_cta), 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
               mRows: cute.Tensor | None, rows: cutlass.Int32):
        tidx = cute.arch.thread_idx()[0]
        part = tidx % self.group
        row = cute.arch.block_idx()[0] * (THREADS // self.group) + tidx // self.group
        heads, seqlen = mO.shape[2], mO.shape[1]
        h = row % heads
        i = (row // heads) % seqlen
        b = row // (heads * seqlen)
        acc = cutlass.Float32(0.0)
        if row < rows:
            r_o = cute.make_rmem_tensor(VEC, self.dtype)
            r_do = cute.make_rmem_tensor(VEC, self.dtype)
            for step in cutlass.range_constexpr(self.steps):
                chunk = step * self.group + part
                cute.autovec_copy(cute.local_tile(mO[b, i, h, None], (VEC,), (chunk,)), r_o)
                cute.autovec_copy(cute.local_tile(mdO[b, i, h, None], (VEC,), (chunk,)), r_do)
                for e in cutlass.range_constexpr(VEC):
                    acc = acc + r_o[e].to(cutlass.Float32) * r_do[e].to(cutlass.Float32)
        # every lane of the group joins the butterfly (a row past the end adds 0 and stores nothing)
        acc = cute.arch.warp_reduction(acc, _fadd, threads_in_group=self.group)
        if row < rows and part == 0:
            dst = i
            if cutlass.const_expr(self.row_map):
                dst = mRows[i]
            lse = mLSE[b, h, i]
            mLSE2[b, h, dst] = cutlass.Float32.inf if lse == -cutlass.Float32.inf else lse * cutlass.Float32(LOG2E)
            mD[b, h, dst] = acc
