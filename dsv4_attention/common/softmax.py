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

from dsv4_attention.common.dsl_state import DslState

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


def acc_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, V, MMA_N), (2, MMA_M)): ``acc_rows_layout`` transposed,
    (column, row) of the thread's values, same offsets. A kernel whose accumulator holds a
    transposed score tile (the backward's S^T: keys as rows, queries as columns) keeps its softmax
    statistics per column: view row s is one column's values."""
    (c, r, v), m, n = acc_layout.shape
    (dc, dr, dv), dm, dn = acc_layout.stride
    return cute.make_layout(((c, v, n), (r, m)), stride=((dc, dv, dn), (dr, dm)))


def acc_cols_view(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_cols_layout(acc.layout))


@cute.jit
def quad_allreduce(x: cutlass.Float32, op: cutlass.Constexpr) -> cutlass.Float32:
    """op-reduce x over the 4 lanes of this lane's quad; every lane gets the result (the DSL's
    butterfly over groups of 4 lanes: offsets 2, then 1)."""
    return cute.arch.warp_reduction(x, op, threads_in_group=QUAD)


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


LOG2E = 1.0 / LN2


@cute.jit
def sink_factor(lse: cutlass.Float32, sink: cutlass.Float32) -> cutlass.Float32:
    """The attention sink's factor on a row's O, sigmoid(LSE - sink) = 1 / (1 + 2^((sink - LSE) log2 e)):
    a logit in the denominator only. Every architecture's epilogue and the split-KV merge call this
    one form. The cases it must get right (FlashMLA draws sinks of +-inf):

        LSE finite, sink finite   1 / (1 + e^(sink - LSE))
        LSE finite, sink -inf     1   (e^-inf = 0: the sink changes nothing)
        LSE finite, sink +inf     0   (1 / (1 + inf): the sink takes the whole row)
        LSE -inf (row empty)      0   for any sink: the row's O is 0 whatever the sink; the
                                      formula alone gives e^(-inf - -inf) = NaN there, and O * NaN
                                      is NaN, so the empty row is decided by the select."""
    factor = cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp2((sink - lse) * cutlass.Float32(LOG2E),
                                                                            fastmath=True))
    return factor if lse > -cutlass.Float32.inf else cutlass.Float32(0.0)


# ---------------------------------------------------------------------------------------
# Online softmax over a sequence of KV tiles (stage C on)


def _max_tree(values: list):
    """fmax over a list in a 4-wide tree: short dependency chains for the scheduler."""
    acc = list(values[:4])
    for j in range(4, len(values)):
        acc[j % 4] = _fmax(acc[j % 4], values[j])
    while len(acc) > 1:
        acc = [_fmax(acc[k], acc[k + 1]) if k + 1 < len(acc) else acc[k] for k in range(0, len(acc), 2)]
    return acc[0]


def _sum_tree(values: list):
    acc = list(values[:4])
    for j in range(4, len(values)):
        acc[j % 4] = acc[j % 4] + values[j]
    while len(acc) > 1:
        acc = [acc[k] + acc[k + 1] if k + 1 < len(acc) else acc[k] for k in range(0, len(acc), 2)]
    return acc[0]


class OnlineSoftmax(DslState):
    """The running statistics of the rows a thread holds in a wgmma accumulator,
    updated one KV tile at a time (same exp2 domain as ``softmax_rows``).

    Per row, after tiles 0..j (x = s * scale_log2, keys of those tiles only):

        row_max  m_j = max(m_{j-1}, max_k x)               quad-reduced: every lane of the quad
        row_sum  l_j = l_{j-1} * exp2(m_{j-1} - m_j) + sum_k P   this thread's columns only
        P        = exp2(s * scale_log2 - m_j)              one FFMA + one EX2 per score
        rescale  r_j = exp2(m_{j-1} - m_j) <= 1            returned; O_{j-1} * r_j before O += P_j V_j

    The max is taken over the raw scores s and scaled once per row (scale_log2 > 0,
    so it commutes with the max), which lets x - m fold into one FFMA. The row sum
    stays a per-thread partial (the rescale is linear, so the quad reduction moves
    to ``finalize``). Every row must see a finite score in the first tile
    (the kernels mask only keys past seqlen_k and start with the tile holding key
    seqlen_k - 1), so m is finite from the first tile on and r never is NaN.
    """

    def __init__(self, acc_layout: cute.Layout, scale_log2: cutlass.Float32, may_be_empty: bool = False):
        rows = cute.size(acc_rows_layout(acc_layout), mode=[0])
        self.scale_log2 = scale_log2
        # masks that can hide every key of a row (windows, per-request lengths: stages D3, D4)
        # break the invariant above: a row may reach any tile, even the end, with m = -inf
        self.may_be_empty = may_be_empty
        self.row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
        self.row_sum = cute.make_rmem_tensor(rows, cutlass.Float32)

    # A runtime loop carries the object through its IR values (scale, the two tensors).
    _DYNAMIC = ("scale_log2", "row_max", "row_sum")

    @cute.jit
    def tile_max(self, acc: cute.Tensor) -> cute.Tensor:
        """The raw (unscaled) max of each of the thread's rows over this tile's keys,
        quad-reduced; -inf where every key of the row is masked."""
        rows = acc_rows_view(acc)
        n_rows = cute.size(rows, mode=[0])
        n_cols = cute.size(rows, mode=[1])
        out = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for i in cutlass.range_constexpr(n_rows):
            out[i] = quad_allreduce(_max_tree([rows[i, j] for j in range(n_cols)]), _fmax)
        return out

    def reset(self):
        """Statistics of no key yet (m = -inf, l = 0), for a loop whose every tile takes
        ``update(is_first=False)`` (stage D1's seesaw): the first rescale is exp2(-inf) = 0."""
        self.row_max.fill(-cutlass.Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def m_sub(self, m: cutlass.Float32) -> cutlass.Float32:
        """The max that exponents subtract: m, or 0 where no key is visible yet (may_be_empty:
        -inf - -inf would be NaN; P = exp2(-inf - 0) = 0 instead)."""
        if cutlass.const_expr(self.may_be_empty):
            return cutlass.Float32(0.0) if m == -cutlass.Float32.inf else m
        return m

    @cute.jit
    def new_max(self, tile_max: cute.Tensor) -> cute.Tensor:
        """The rows' running max after a tile of raw max ``tile_max`` (exp2 domain), without
        updating anything: what a seesaw leader publishes before its exponentials."""
        out = cute.make_rmem_tensor(cute.size(self.row_max), cutlass.Float32)
        for i in cutlass.range_constexpr(cute.size(self.row_max)):
            out[i] = _fmax(tile_max[i] * self.scale_log2, self.row_max[i])
        return out

    @cute.jit
    def follow(self, m_other: cute.Tensor) -> cute.Tensor:
        """Adopt the running max ``m_other`` (exp2 domain, >= this one's) that another
        warpgroup reached over keys this one has not seen: returns r = exp2(m - m_other) per
        row, by which this thread's O, row sum and any unstored P must be scaled (the row sum
        is scaled here)."""
        row_scale = cute.make_rmem_tensor(cute.size(self.row_max), cutlass.Float32)
        for i in cutlass.range_constexpr(cute.size(self.row_max)):
            row_scale[i] = cute.math.exp2(self.row_max[i] - self.m_sub(m_other[i]), fastmath=True)
            self.row_max[i] = m_other[i]
            self.row_sum[i] = self.row_sum[i] * row_scale[i]
        return row_scale

    @cute.jit
    def update(self, acc: cute.Tensor, is_first: cutlass.Constexpr[bool], tile_max=None, floor=None) -> cute.Tensor:
        """acc (raw scores, masked keys at -inf) <- P in place; returns the per-row
        rescale factor r (1 for the first tile) for O accumulated so far.

        ``tile_max`` (optional): the rows' raw max over the whole KV tile when this
        thread holds only part of the tile's keys (stage D1's split warpgroups
        exchange it); it must be >= the max of this thread's keys and finite.
        ``floor`` (optional, exp2 domain, >= the running max): a max another warpgroup
        already reached (the seesaw follower takes the leader's); the new max is at least it."""
        rows = acc_rows_view(acc)
        n_rows = cute.size(rows, mode=[0])
        n_cols = cute.size(rows, mode=[1])
        if cutlass.const_expr(tile_max is None):
            tile_max = self.tile_max(acc)
        row_scale = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for i in cutlass.range_constexpr(n_rows):
            m_new = tile_max[i] * self.scale_log2
            m_old = self.row_max[i]
            if cutlass.const_expr(not is_first):
                m_new = _fmax(m_new, m_old)
            if cutlass.const_expr(floor is not None):
                m_new = _fmax(m_new, floor[i])
            self.row_max[i] = m_new
            # no visible key yet: subtract 0, not -inf (-inf - -inf is NaN); P = exp2(-inf) = 0
            m_sub = self.m_sub(m_new)
            if cutlass.const_expr(not is_first):
                row_scale[i] = cute.math.exp2(m_old - m_sub, fastmath=True)
            else:
                row_scale[i] = cutlass.Float32(1.0)
            p = [cute.math.exp2(rows[i, j] * self.scale_log2 - m_sub, fastmath=True) for j in range(n_cols)]
            for j in cutlass.range_constexpr(n_cols):
                rows[i, j] = p[j]
            tile_sum = _sum_tree(p)
            if cutlass.const_expr(not is_first):
                tile_sum = tile_sum + self.row_sum[i] * row_scale[i]
            self.row_sum[i] = tile_sum
        return row_scale

    @cute.jit
    def row_sums(self) -> cute.Tensor:
        """The quad-reduced row sums (this thread's keys of every tile so far)."""
        n_rows = cute.size(self.row_sum)
        total = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for i in cutlass.range_constexpr(n_rows):
            total[i] = quad_allreduce(self.row_sum[i], _fadd)
        return total

    @cute.jit
    def finalize(self, total=None) -> cute.Tensor:
        """Returns 1 / rowsum per row (to scale O), and leaves the natural-log LSE as
        ``lse``. ``total``: the rows' full sums when other threads hold some of the keys
        (default: ``row_sums()``, this quad's keys are all of them)."""
        if cutlass.const_expr(total is None):
            total = self.row_sums()
        n_rows = cute.size(self.row_sum)
        inv_sum = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        self.lse = cute.make_rmem_tensor(n_rows, cutlass.Float32)
        for i in cutlass.range_constexpr(n_rows):
            inv_sum[i] = cutlass.Float32(1.0) / total[i]
            if cutlass.const_expr(self.may_be_empty):  # a row that saw no key: O = 0 (not 0 * inf), LSE = -inf
                inv_sum[i] = cutlass.Float32(0.0) if total[i] == cutlass.Float32(0.0) else inv_sum[i]
            self.lse[i] = log_sum_exp(self.row_max[i], total[i])
        return inv_sum


@cute.jit
def scale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    """acc[row i of the thread, :] *= row_scale[i] (O rescale and the final 1/rowsum)."""
    rows = acc_rows_view(acc)
    for i in cutlass.range_constexpr(cute.size(rows, mode=[0])):
        for j in cutlass.range_constexpr(cute.size(rows, mode=[1])):
            rows[i, j] = rows[i, j] * row_scale[i]
