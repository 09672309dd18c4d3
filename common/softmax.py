"""Softmax on an SM90 wgmma accumulator, in registers, in the exp2 domain.

The fp32 accumulator of a 64 x N wgmma (per warpgroup) is, per thread,
((2, 2, N/8), MMA_M, MMA_N) with MMA_M = MMA_N = 1 for our tiles; value
(c, r, n) of lane l in warp w of the warpgroup is

    row 16 w + l / 4 + 8 r,    column 8 n + 2 (l % 4) + c

so a thread holds 2 rows x N/4 columns, and the 4 lanes of a quad
(l / 4 equal) hold the whole of those 2 rows between them: a row's max or
sum is the thread's partial result reduced over the quad with butterfly
shuffles at lane offsets 1 and 2. ``acc_rows_layout`` views the fragment as
(rows of the thread, columns of the thread) so that row i's values are
``view[i, None]``.

Numeric domain (one, for every stage): x = s * scale_log2 with
scale_log2 = softmax_scale * log2(e); m = max_j x over the visible keys;
P = exp2(x - m); rowsum = sum_j P in fp32 (before P is rounded to 16 bits);
LSE = (m + log2(rowsum)) * ln(2).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

LN2 = math.log(2.0)
QUAD = 4  # lanes sharing one accumulator row


def acc_rows_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)): (row, column) of
    the thread's values, same offsets (works on register and coordinate layouts)."""
    (c, r, v), m, n = acc_layout.shape
    (dc, dr, dv), dm, dn = acc_layout.stride
    return cute.make_layout(((r, m), (c, v, n)), stride=((dr, dm), (dc, dv, dn)))


def acc_rows_view(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_rows_layout(acc.layout))


@cute.jit
def quad_allreduce(x: cutlass.Float32, op: cutlass.Constexpr) -> cutlass.Float32:
    """op-reduce x over the 4 lanes of this lane's quad; every lane gets the result."""
    for i in cutlass.range_constexpr(int(math.log2(QUAD))):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1 << i))
    return x


def _fmax(a, b):
    return cute.arch.fmax(a, b)


def _fadd(a, b):
    return a + b


@cute.jit
def softmax_rows(acc: cute.Tensor, scale_log2: cutlass.Float32) -> tuple[cute.Tensor, cute.Tensor]:
    """In place over the accumulator ``acc`` (raw scores s, masked keys at -inf):
    acc <- P = exp2(s * scale_log2 - m). Returns (row_max m, row_sum) per row of
    the thread (fp32 register tensors of acc_rows_view's row count), reduced
    over the quad so every lane of a quad holds its rows' full statistics.

    Requires scale_log2 > 0 (so -inf stays -inf and the max commutes with the
    scale) and at least one visible key per row (m finite): the callers
    validate the scale and launch only for seqlen_k >= 1.
    """
    rows = acc_rows_view(acc)
    n_rows = cute.size(rows, mode=[0])
    n_cols = cute.size(rows, mode=[1])
    row_max = cute.make_rmem_tensor(n_rows, cutlass.Float32)
    row_sum = cute.make_rmem_tensor(n_rows, cutlass.Float32)
    # x = s * scale_log2, the one place the scale is applied.
    acc.store(acc.load() * scale_log2)
    for i in cutlass.range_constexpr(n_rows):
        m = rows[i, 0]
        for j in cutlass.range_constexpr(1, n_cols):
            m = _fmax(m, rows[i, j])
        m = quad_allreduce(m, _fmax)
        row_max[i] = m
        s = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(n_cols):
            p = cute.math.exp2(rows[i, j] - m, fastmath=True)
            rows[i, j] = p
            s = s + p
        row_sum[i] = quad_allreduce(s, _fadd)
    return row_max, row_sum


@cute.jit
def log_sum_exp(row_max: cutlass.Float32, row_sum: cutlass.Float32) -> cutlass.Float32:
    """Natural-log LSE of a row from its exp2-domain max and sum."""
    return (row_max + cute.math.log2(row_sum, fastmath=True)) * LN2
