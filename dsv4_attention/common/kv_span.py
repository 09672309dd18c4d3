"""Which keys a Q tile visits, and which of its KV tiles need a mask (FlashAttention's block_info).

Visibility (FlashAttention's convention, bottom-right aligned): query token i of a request
with seqlen_q queries and seqlen_k keys sits at i' = i + seqlen_k - seqlen_q and sees key j iff

    0 <= j < seqlen_k,    j >= i' - left  (left is not None),    j <= i' + right  (right is not None)

causal is right = 0. seqlen_k is the request's key count: seqused_k[b] where given (stage D3).

The span of a Q tile whose rows hold tokens [t_lo, t_hi] is the keys any of them sees,

    lo = max(0, t_lo' - left)   (0 without a left bound)
    hi = min(seqlen_k, t_hi' + right + 1)   (seqlen_k without a right bound)

(with per-token ``positions``, stage E, t' is the token's given position: ``token_position``;
the positions are non-decreasing, so t_lo' and t_hi' still bound the tile's rows) and the kernels
cut it into KV tiles starting at ``origin = lo``, not at a multiple of tile_n:
TMA boxes may start at any row, so a window of w keys takes ceil(w / tile_n) tiles instead of
one more half-masked tile (DeepSeek-V4's 128-key window over one token's heads: two 64-key
tiles, not three). An empty span (a window that hides every key, seqused_k = 0) still visits
one tile, wholly masked: the softmax then sees no key and returns O = 0, LSE = -inf.

A KV tile [a, a + tile_n) needs no mask iff every key of it is visible to every row of the Q
tile: a + tile_n <= seqlen_k, a + tile_n - 1 <= t_lo' + right, a >= t_hi' - left. The kernels
visit the tiles last-first; the mask runs only where ``tile_needs_mask`` says so.

Every function here is plain integer arithmetic (``cutlass.min`` / ``cutlass.max`` work on
Python ints and DSL integers alike), so the host proofs and tests call the same code the
kernels trace.

In 32 bits without overflow: a bound may be any int below 2**31 (a window wider than every
sequence is a way to say "unbounded"), so ``p + right`` and ``p - left`` can pass the int32 range.
The sums are never formed as such: a right bound is first cut to seqlen_k - 1 - p (past it the
bound hides no key; that difference fits, the calls validate kv_start + seqlen_k < 2**31 and
positions in [0, 2**30)), and a left bound subtracts at most p + 1 from max(p, -1) (below -1 it
hides no key). The host proofs include bounds of 2**31 - 1.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.dsl_state import DslState


def visible_at(p: int, j: int, seqlen_k: int, left, right) -> bool:
    """The plain formula, one (query at position p of the keys' frame, key j) pair: for tests and
    host proofs."""
    return 0 <= j < seqlen_k and (left is None or j >= p - left) and (right is None or j <= p + right)


def visible(i: int, j: int, seqlen_q: int, seqlen_k: int, left, right) -> bool:
    """``visible_at`` of query token i, bottom-right aligned (i' = i + seqlen_k - seqlen_q)."""
    return visible_at(i + seqlen_k - seqlen_q, j, seqlen_k, left, right)


def tile_tokens(m_block, tile_m: int, group: int, seqlen_q):
    """(t_lo, t_hi): the first and last query token among the rows of Q tile m_block (rows packed
    g heads per token, stage D2; g = 1 is one token per row). Rows past the last token count as
    the last token (their results are never stored)."""
    t_lo = m_block * tile_m // group
    t_hi = cutlass.min((m_block * tile_m + tile_m - 1) // group, seqlen_q - 1)
    return t_lo, t_hi


def right_end(p, right, seqlen_k):
    """min(seqlen_k, p + right + 1): one past the last key position p sees through a right bound,
    with no sum that can overflow (the module doc)."""
    return p + 1 + cutlass.min(right, seqlen_k - 1 - p)


def left_start(p, left):
    """max(p - left, -1): the first key position p sees through a left bound, -1 where it hides no
    key, with no sum that can overflow (the module doc)."""
    p = cutlass.max(p, -1)
    return p - cutlass.min(left, p + 1)


def row_keys(p, seqlen_k, left, right, has_left: bool, has_right: bool):
    """(lo, hi): the keys lo <= key < hi a query at position p sees, lo None without a left bound;
    hi in [-1, seqlen_k], lo in [-1, max(p, -1)] (-1: nothing hidden on that side, or every key
    hidden), so a kernel may subtract a tile's first key from either without overflow. The one
    per-row rule of both architectures' masks (``mask_tile``, ``common.sm100_softmax.visible_keys``)."""
    hi = seqlen_k
    lo = None
    if has_right:
        hi = cutlass.max(right_end(p, right, seqlen_k), -1)
    if has_left:
        lo = left_start(p, left)
    return lo, hi


def key_span_at(p_lo, p_hi, seqlen_k, tile_n: int, left, right, has_left: bool, has_right: bool):
    """(origin, n_tiles): the first key of the span and the KV tiles that cover it (>= 1), for a Q
    tile whose tokens sit at positions p_lo <= .. <= p_hi in the frame of the keys (key j at j)."""
    lo = 0
    hi = seqlen_k
    if has_left:
        lo = cutlass.max(left_start(p_lo, left), 0)
    if has_right:
        hi = right_end(p_hi, right, seqlen_k)
    n_tiles = cutlass.max((hi - lo + tile_n - 1) // tile_n, 1)
    return lo, n_tiles


def key_span(t_lo, t_hi, seqlen_q, seqlen_k, tile_n: int, left, right, has_left: bool, has_right: bool):
    """``key_span_at`` of tokens t_lo .. t_hi, bottom-right aligned (t' = t + seqlen_k - seqlen_q)."""
    shift = seqlen_k - seqlen_q
    return key_span_at(t_lo + shift, t_hi + shift, seqlen_k, tile_n, left, right, has_left, has_right)


def tile_needs_mask_at(first_key, p_lo, p_hi, seqlen_k, tile_n: int, left, right, has_left: bool,
                       has_right: bool):
    """Whether KV tile [first_key, first_key + tile_n) hides any key from any row of a Q tile whose
    tokens sit at positions p_lo <= .. <= p_hi (the keys' frame)."""
    last_key = first_key + tile_n - 1
    needs = last_key >= seqlen_k
    if has_right:
        needs = needs | (last_key >= right_end(p_lo, right, seqlen_k))
    if has_left:
        needs = needs | (first_key < left_start(p_hi, left))
    return needs


def tile_needs_mask(first_key, t_lo, t_hi, seqlen_q, seqlen_k, tile_n: int, left, right, has_left: bool,
                    has_right: bool):
    """``tile_needs_mask_at`` of tokens t_lo .. t_hi, bottom-right aligned."""
    shift = seqlen_k - seqlen_q
    return tile_needs_mask_at(first_key, t_lo + shift, t_hi + shift, seqlen_k, tile_n, left, right, has_left,
                              has_right)


def token_position(token, seqlen_q, seqlen_k, positions=None, kv_start=0):
    """Query token ``token``'s position in the keys' frame (key j at j): bottom-right aligned,
    token + seqlen_k - seqlen_q, or, with ``positions`` (the tokens' absolute positions, raw key 0
    at ``kv_start``), positions[token] - kv_start. Tokens past the last one (padding rows of the
    last Q tile, never stored) read the last token's position: no read past ``positions``."""
    if cutlass.const_expr(positions is None):
        return token + seqlen_k - seqlen_q
    return positions[cutlass.min(token, seqlen_q - 1)] - kv_start


def positions_row(mPositions, b):
    """Request b's row of the (batch or 1, seqlen_q) int32 positions (one row serves every
    request), or None without positions (kernel code)."""
    if cutlass.const_expr(mPositions is None):
        return None
    return mPositions[b * cutlass.min(mPositions.shape[0] - 1, 1), None]


@cute.jit
def mask_tile(acc: cute.Tensor, tScS: cute.Tensor, first_row, group: cutlass.Constexpr[int], first_key,
              seqlen_q, seqlen_k, left, right, has_left: cutlass.Constexpr[bool],
              has_right: cutlass.Constexpr[bool], positions=None, kv_start=0):
    """Scores of keys a row may not see -> -inf, in place. Value i of the thread holds tile row
    tScS[i][0] (packed row first_row + that: token // group) and key first_key + tScS[i][1];
    the token's position is ``token_position`` (``positions``: read per value, the loads of one
    row's values are one address).

    Written for the instruction count (this runs on every tile that straddles an edge: 2-3 of a
    causal Q tile's, which at head dim 64 made stage D4 execute 5-15 % more instructions than
    FlashAttention-4): a row's visible keys are one range [lo, hi) (``left_start``,
    ``right_end``), computed once per row relative to the thread's first column, key0 = first_key
    + tScS[0][1]. Value i's column offset tScS[i][1] - tScS[0][1] is a constant of the partition,
    so each value costs one or two compares against an immediate and a select, instead of its key,
    two or three compares and their OR. The row's bounds (``row_keys``) are clamped before key0
    comes off, so no difference overflows either."""
    key0 = first_key + tScS[0][1]
    for i in cutlass.range_constexpr(cute.size(acc)):
        col = tScS[i][1] - tScS[0][1]  # a constant (the partition's column offsets)
        token_pos = token_position((first_row + tScS[i][0]) // group, seqlen_q, seqlen_k, positions, kv_start)
        # per row (the same operands for a row's values: computed once)
        lo, hi = row_keys(token_pos, seqlen_k, left, right, has_left, has_right)
        hide = col >= hi - key0
        if cutlass.const_expr(has_left):
            hide = hide | (col < lo - key0)
        acc[i] = -cutlass.Float32.inf if hide else acc[i]


class KvSpan(DslState):
    """One Q tile's keys, as the kernels use them: ``origin`` (first key of KV tile 0) and
    ``n_tiles``, and the masks of its tiles. Built once per CTA from the tile's rows
    (``rows`` packed rows of ``group`` heads per token: seqlen_q = rows // group); ``left`` /
    ``right`` are runtime window bounds, used only where ``has_left`` / ``has_right``.
    ``positions`` (None: bottom-right aligned): the request's query tokens' absolute positions,
    non-decreasing (validated on the host), raw key 0 at absolute position ``kv_start``; the tile's
    tokens then sit at p_lo = positions[t_lo] - kv_start .. p_hi = positions[t_hi] - kv_start."""

    def __init__(self, m_block, rows, seqlen_k, tile_m: int, tile_n: int, group: int, left, right,
                 has_left: bool, has_right: bool, positions=None, kv_start=0):
        self.seqlen_q = rows // group
        self.seqlen_k = seqlen_k
        self.tile_n, self.group = tile_n, group
        self.left, self.right, self.has_left, self.has_right = left, right, has_left, has_right
        self.positions, self.kv_start = positions, kv_start
        t_lo, t_hi = tile_tokens(m_block, tile_m, group, self.seqlen_q)
        self.p_lo, self.p_hi = self.token_position(t_lo), self.token_position(t_hi)
        self.origin, self.n_tiles = key_span_at(self.p_lo, self.p_hi, seqlen_k, tile_n, left, right, has_left,
                                                has_right)

    def token_position(self, token):
        """Query token ``token``'s position in the keys' frame (``kv_span.token_position``)."""
        return token_position(token, self.seqlen_q, self.seqlen_k, self.positions, self.kv_start)

    # A runtime loop that uses the span carries it through its IR values (the DSL integers)
    _DYNAMIC = ("seqlen_q", "seqlen_k", "left", "right", "p_lo", "p_hi", "origin", "n_tiles", "positions",
                "kv_start", "n_end")
    #: split-KV (common/split_kv.py): the tile after the first one this work unit visits; None: the
    #: whole span, n_tiles (a compile-time None: an unsplit kernel computes exactly what it did)
    n_end = None

    def visit_tile(self, v):
        """The tile of visit v: the kernels visit tiles last first, from n_end - 1."""
        end = self.n_tiles if self.n_end is None else self.n_end
        return end - 1 - v

    def first_key(self, n):
        return self.origin + n * self.tile_n

    @cute.jit
    def mask(self, acc: cute.Tensor, tScS: cute.Tensor, n, first_row):
        """Mask KV tile n of the span for the rows from packed row ``first_row`` on."""
        mask_tile(acc, tScS, first_row, self.group, self.first_key(n), self.seqlen_q, self.seqlen_k, self.left,
                  self.right, self.has_left, self.has_right, self.positions, self.kv_start)

    @cute.jit
    def mask_if_needed(self, acc: cute.Tensor, tScS: cute.Tensor, n, first_row):
        """``mask`` where the tile straddles a boundary (the tiles inside every row's range skip it)."""
        if tile_needs_mask_at(self.first_key(n), self.p_lo, self.p_hi, self.seqlen_k, self.tile_n, self.left,
                              self.right, self.has_left, self.has_right):
            self.mask(acc, tScS, n, first_row)

