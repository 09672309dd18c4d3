"""Compressed entries: which ones a query sees, and the span of a Q tile over window + compressed keys.

DeepSeek-V4 (``../shared/spec/dsv4-attention.md``) attends, in one softmax, to the union of two
disjoint key sets: its sliding window over the raw KV rows (stage D4's span) and the entries of a
second KV tensor of compressed rows (the same head_dim, K = V). With compression ratio r, entry j
is visible to the query at absolute position t iff

    j < floor((t + 1) / r)      (and j < n_compressed, the entries the request has)

(HCA layers: r = 128, every visible entry). t is the query's position bottom-right aligned as in
D4: t = i + seqlen_k - seqlen_q for query token i of a request with seqlen_k raw keys. A query at
t < r - 1 sees no entry; a negative t (seqlen_q > seqlen_k) none either.

The fused span of a Q tile (rows = tokens t_lo .. t_hi) visits its KV tiles in one index space,

    tile n < n_cmp:   compressed entries [n T, n T + T)                  (T = tile_n)
    tile n >= n_cmp:  window tile n - n_cmp of D4's span (keys origin + (n - n_cmp) T ..)
    n_cmp = ceil(count(t_hi) / T)        count(t) = min(n_compressed, floor((t + 1) / r))

and the kernels visit them last-first as before: the window's tiles (the first visit holds the
diagonal and is masked, as in D4), then the compressed ones from the last. A compressed tile needs
a mask iff it holds an entry some row of the tile does not see: n T + T > count(t_lo) (count grows
with t, so row t_lo sees the fewest). Entries past n_compressed are zero-filled by TMA and masked.

Every function is plain integer arithmetic (``cutlass.min`` / ``cutlass.max`` on Python ints and
DSL integers alike): the host proofs run the kernels' own code.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.kv_span import KvSpan


def compressed_visible(i: int, j: int, seqlen_q: int, seqlen_k: int, ratio: int, n_compressed: int) -> bool:
    """The plain formula, one (query token, compressed entry) pair: for tests and host proofs."""
    t = i + seqlen_k - seqlen_q
    return 0 <= j < n_compressed and (t + 1) >= 0 and j < (t + 1) // ratio


def compressed_count(token, seqlen_q, seqlen_k, ratio, n_compressed):
    """Entries [0, count) visible to query token ``token``: min(n_compressed, floor((t' + 1) / r)),
    0 where t' + 1 <= 0 (clamped before the division: DSL integers divide toward zero)."""
    t1 = cutlass.max(token + seqlen_k - seqlen_q + 1, 0)
    return cutlass.min(t1 // ratio, n_compressed)


@cute.jit
def mask_compressed_tile(acc: cute.Tensor, tScS: cute.Tensor, first_row, group: cutlass.Constexpr[int],
                         first_entry, seqlen_q, seqlen_k, ratio, n_compressed):
    """Scores of entries a row may not see -> -inf, in place (SM90 fragment: value i of the thread
    is tile row tScS[i][0], packed row first_row + that, token // group, and entry
    first_entry + tScS[i][1])."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        token = (first_row + tScS[i][0]) // group
        count = compressed_count(token, seqlen_q, seqlen_k, ratio, n_compressed)
        acc[i] = -cutlass.Float32.inf if first_entry + tScS[i][1] >= count else acc[i]


class FusedSpan(KvSpan):
    """A Q tile's window span (D4's ``KvSpan``, the same fields) with its compressed tiles in front:
    ``n_tiles`` = n_cmp + the window's tiles; ``origin`` / ``window_tiles`` are D4's span
    (``origin`` its first key: the K view the kernels offset)."""

    _DYNAMIC = KvSpan._DYNAMIC + ("ratio", "n_compressed", "n_cmp", "c_lo", "window_tiles")

    def __init__(self, m_block, rows, seqlen_k, tile_m: int, tile_n: int, group: int, left, right,
                 has_left: bool, has_right: bool, ratio, n_compressed):
        super().__init__(m_block, rows, seqlen_k, tile_m, tile_n, group, left, right, has_left, has_right)
        self.ratio, self.n_compressed = ratio, n_compressed
        c_hi = compressed_count(self.t_hi, self.seqlen_q, seqlen_k, ratio, n_compressed)
        self.c_lo = compressed_count(self.t_lo, self.seqlen_q, seqlen_k, ratio, n_compressed)
        self.n_cmp = (c_hi + tile_n - 1) // tile_n
        self.window_tiles = self.n_tiles
        self.n_tiles = self.n_cmp + self.window_tiles

    def window_tile(self, n):
        """Tile n as a tile of the window span (n >= n_cmp)."""
        return n - self.n_cmp

    def first_key(self, n):
        """First raw key of window tile n (n >= n_cmp; compressed tile n starts at entry n T):
        what D4's mask code asks of a window tile."""
        return self.origin + (n - self.n_cmp) * self.tile_n

    def compressed_needs_mask(self, n):
        return n * self.tile_n + self.tile_n > self.c_lo

    @cute.jit
    def mask(self, acc: cute.Tensor, tScS: cute.Tensor, n, first_row):
        if n < self.n_cmp:
            mask_compressed_tile(acc, tScS, first_row, self.group, n * self.tile_n, self.seqlen_q, self.seqlen_k,
                                 self.ratio, self.n_compressed)
        else:
            KvSpan.mask(self, acc, tScS, n, first_row)  # first_key(n): the window's key

    @cute.jit
    def mask_if_needed(self, acc: cute.Tensor, tScS: cute.Tensor, n, first_row):
        if n < self.n_cmp:
            if self.compressed_needs_mask(n):
                mask_compressed_tile(acc, tScS, first_row, self.group, n * self.tile_n, self.seqlen_q,
                                     self.seqlen_k, self.ratio, self.n_compressed)
        else:
            KvSpan.mask_if_needed(self, acc, tScS, n, first_row)
