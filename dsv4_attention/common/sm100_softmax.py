"""Online softmax on Blackwell (SM100): one thread owns one row of S, in registers, per KV tile.

The SM100 kernels load row t of an S tile from TMEM into thread t's registers (tcgen05.ld
32x32b, ``common.tmem``), so a row's max and sum need no shuffles: every reduction here is over
one thread's values. The numeric domain is the one of every stage (``common.softmax`` says it):

    x = s * scale_log2       (scale_log2 = softmax_scale * log2 e, applied once to the raw score)
    m = running max of x     P = exp2(x - m)      l = running sum of P (fp32, before rounding P)
    O = (sum_j P_j V_j) / l   LSE = (m + log2 l) * ln 2

Across KV tiles the max is updated lazily (FlashAttention-4): a warp keeps the max it applied so
far unless some row of the warp saw a new max more than RESCALE_THRESHOLD (log2 units) above it,
decided by one vote over the warp. Then every row of the warp moves to its new max and its
running sum and O are multiplied by exp2(m_old - m_new) (O by the correction warps, in TMEM).
Results stay exact: P, l and O all use the max actually applied, and the final O / l cancels it.
While a stale max is kept, x - m <= RESCALE_THRESHOLD, so P <= 2^8 = 256: representable in bf16
and fp16 (max 65504), and the fp32 sums cannot overflow for any practical sequence length.

Masks (stages D3, D4): the visibility formula of ``common.kv_span`` for one packed row
(``visible_keys``, once per CTA) and one KV tile (``visible_columns``: plain integer arithmetic on
Python ints or DSL integers), and the two in-place masks of a row, each applied only where its
bound cuts the tile (``mask_from``, ``mask_below``); tests/test_d34_sm100_host.py runs the kernel's
mask code on the host CPU for every thread and checks it against ``common.kv_span.visible``.
A row may then see no key in a tile, or in any tile (``may_be_empty``): its max stays -inf, every
exp2 subtracts 0 instead (``max_to_subtract``), its rescale factor is 1, and the correction warps
write O = 0 and LSE = -inf.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32, const_expr

from dsv4_attention.common.compressed import compressed_count
from dsv4_attention.common.kv_span import row_keys

#: log2 units a row's max may grow before the warp rescales (FlashAttention-4's value)
RESCALE_THRESHOLD = 8.0


@cute.jit
def lazy_max_update(m_applied: Float32, s_max: Float32, scale_log2: Float32, threshold: cutlass.Constexpr[float],
                    may_be_empty: cutlass.Constexpr[bool] = False):
    """One KV tile's max update for this thread's row, decided per warp.

    ``m_applied``: the max (x domain) P and O currently use (-inf before the first tile);
    ``s_max``: the max raw score of this tile's row. Returns (m, scale): the max to use from now
    on and exp2(m_applied - m), the factor the row's sum and O must be multiplied by (exactly 1.0
    when the warp keeps its max; 0 on the first tile, where there is nothing to rescale).
    ``may_be_empty``: the row may have seen no key yet (m stays -inf); its factor is then 1."""
    m_tile = s_max * scale_log2
    m_cand = cute.arch.fmax(m_applied, m_tile)
    # warp-uniform: one row's large growth moves the whole warp, so the correction warp serving
    # these 32 rows rescales all of them or none
    grow = cute.arch.vote_any_sync(m_cand - m_applied > threshold)
    m_new = m_cand if grow else m_applied
    scale = cute.math.exp2(m_applied - m_new, fastmath=True) if grow else Float32(1.0)
    if const_expr(may_be_empty):
        # another row grew the warp's max while this one still has none: exp2(-inf - -inf) is NaN;
        # its sum and O are 0, so any finite factor keeps them so
        scale = Float32(1.0) if m_new == -Float32.inf else scale
    return m_new, scale


@cute.jit
def max_to_subtract(m: Float32, may_be_empty: cutlass.Constexpr[bool]) -> Float32:
    """The max P = exp2(x - m) subtracts: m, or 0 for a row that saw no key (m = -inf; its
    scores are all -inf, so P = exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN)."""
    m_sub = m
    if const_expr(may_be_empty):
        m_sub = Float32(0.0) if m == -Float32.inf else m
    return m_sub


@cute.jit
def exp2_into_p(s_row: cute.Tensor, p_row: cute.Tensor, scale_log2: Float32, m: Float32) -> Float32:
    """P = exp2(s * scale_log2 - m) for this thread's row: written (rounded to ``p_row``'s 16-bit
    type) into ``p_row``, value v of one being value v of the other; ``s_row`` is overwritten with
    the fp32 P. Returns the row's sum of the fp32 P of this tile."""
    neg_m = -m
    for v in cutlass.range(0, cute.size(s_row), 2, unroll_full=True):
        x0, x1 = cute.arch.fma_packed_f32x2((s_row[v], s_row[v + 1]), (scale_log2, scale_log2), (neg_m, neg_m))
        s_row[v] = cute.math.exp2(x0, fastmath=True)
        s_row[v + 1] = cute.math.exp2(x1, fastmath=True)
    p = s_row.load()
    p_row.store(p.to(p_row.element_type))
    return p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


@cute.jit
def row_max(s_row: cute.Tensor) -> Float32:
    """The max of this thread's raw scores."""
    return s_row.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)


# ---------------------------------------------------------------------------------------
# Masks: which keys of a KV tile one row sees (stages D3, D4; stage D1's seqlen_k tail)


def visible_keys(span, packed_row):
    """(lo, hi): the keys lo <= key < hi that packed row ``packed_row`` of ``span``'s Q tile sees
    (lo None without a left bound): ``kv_span.visible`` for one row, token = packed_row // group,
    at ``span.token_position`` (bottom-right aligned, token' = token + seqlen_k - seqlen_q, or the
    caller's positions). Per row, not per tile: a softmax thread computes it once per CTA."""
    if not (span.has_left or span.has_right):
        return None, span.seqlen_k  # the seqlen_k tail (every stage)
    token_pos = span.token_position(packed_row // span.group)
    return row_keys(token_pos, span.seqlen_k, span.left, span.right, span.has_left, span.has_right)


def visible_columns(keys, first_key):
    """``visible_keys`` in a KV tile whose column 0 is key ``first_key``: (lo, hi) with columns
    lo <= c < hi visible (keys >= 0 always: tiles start at the span's origin >= 0)."""
    lo, hi = keys
    return (None if lo is None else lo - first_key), hi - first_key


def visible_entries(span, packed_row):
    """Stage E: the compressed entries [0, count) packed row ``packed_row`` of ``span``'s Q tile (a
    ``FusedSpan``) sees: ``compressed_count`` of its token. Per row, once per CTA, as ``visible_keys``."""
    return compressed_count(packed_row // span.group, span.seqlen_q, span.seqlen_k, span.ratio, span.n_compressed,
                            span.kv_start, span.positions)


@cute.jit
def mask_from(s_row: cute.Tensor, tTR_cS: cute.Tensor, hi):
    """Scores of this thread's row at columns >= hi -> -inf, in place; value i holds column
    tTR_cS[i][1] (the S load's partition of the identity tile)."""
    for i in cutlass.range_constexpr(cute.size(s_row)):
        s_row[i] = -Float32.inf if tTR_cS[i][1] >= hi else s_row[i]


@cute.jit
def mask_below(s_row: cute.Tensor, tTR_cS: cute.Tensor, lo):
    """Scores of this thread's row at columns < lo -> -inf, in place (as ``mask_from``). A pass of
    its own, under its own branch: one pass testing both bounds per value took ptxas to 166
    registers at head dim 512 (128 this way) and spilled at head dim 256."""
    for i in cutlass.range_constexpr(cute.size(s_row)):
        s_row[i] = -Float32.inf if tTR_cS[i][1] < lo else s_row[i]



def topk_position_visible(idx_row: cute.Tensor, p, count, k):
    """Stage E top-k: whether list position p of the tile's token (``idx_row``, k positions) is a
    visible key: p < k and 0 <= idx_row[p] < count. Reads the list at min(p, k - 1): never past its end."""
    j = idx_row[cutlass.min(p, k - 1)]
    return (p < k) & (j >= 0) & (j < count)


@cute.jit
def topk_tile_words(idx_row: cute.Tensor, first_pos, count, k, tile_n: cutlass.Constexpr[int], lane,
                    on_host: cutlass.Constexpr[bool] = False, visible=None):
    """The visible positions first_pos .. first_pos + tile_n - 1 of the tile's one token as tile_n / 32
    bit words (bit l of word w: position first_pos + 32 w + l), one warp-wide ballot per word: lane l
    tests position 32 w + l. Every row of the tile is that token's, so all rows share them: 2 (T = 64)
    or 4 (T = 128) list loads per thread instead of T. ``on_host``: the same words
    assembled by a loop over the 32 lanes (what vote.ballot returns; host proofs run on the CPU).
    ``visible(p)``: the test of position p instead of ``topk_position_visible`` (decode's two lists:
    common/compressed.TwoListSpan, a position visible where it resolves to an entry)."""
    if const_expr(visible is None):
        visible = lambda p: topk_position_visible(idx_row, p, count, k)  # noqa: E731
    words = []
    for w in cutlass.range_constexpr(tile_n // 32):
        if const_expr(on_host):
            word = Uint32(0)
            for lane_l in cutlass.range(32, unroll=1):
                bit = Uint32(1) if visible(first_pos + 32 * w + lane_l) else Uint32(0)
                word = word | (bit << Uint32(lane_l))
        else:
            word = Uint32(cute.arch.vote_ballot_sync(visible(first_pos + 32 * w + lane)))
        words.append(word)
    return words


@cute.jit
def low_bits(b):
    """A Uint32 of its b low bits set (0 <= b <= 32)."""
    return Uint32(0xFFFFFFFF) if b >= 32 else (Uint32(1) << Uint32(b)) - Uint32(1)


@cute.jit
def column_range_words(lo, hi, tile_n: cutlass.Constexpr[int]):
    """The columns lo <= c < hi of a tile (lo None: 0) as ``topk_tile_words``' tile_n / 32 bit words
    (bit c % 32 of word c // 32): D4's window bounds in the form ``mask_topk_row`` applies."""
    words = []
    for w in cutlass.range_constexpr(tile_n // 32):
        word = low_bits(cutlass.min(cutlass.max(hi - 32 * w, 0), 32))
        if const_expr(lo is not None):
            word = word & (low_bits(cutlass.min(cutlass.max(lo - 32 * w, 0), 32)) ^ Uint32(0xFFFFFFFF))
        words.append(word)
    return words


@cute.jit
def mask_topk_row(s_row: cute.Tensor, tTR_cS: cute.Tensor, words):
    """Stage E top-k: scores of this row's columns whose bit in ``words`` (``topk_tile_words``) is
    clear -> -inf, in place; value i holds column tTR_cS[i][1] (static), bit c % 32 of word c // 32."""
    for i in cutlass.range_constexpr(cute.size(s_row)):
        c = tTR_cS[i][1]
        hidden = (words[c // 32] & Uint32(1 << (c % 32))) == Uint32(0)
        s_row[i] = -Float32.inf if hidden else s_row[i]
