"""Compressed entries: which ones a query sees, and the span of a Q tile over window + compressed keys.

DeepSeek-V4 (docs/function.md) attends, in one softmax, to the union of two
disjoint key sets: its sliding window over the raw KV rows (stage D4's span) and the entries of a
second KV tensor of compressed rows (the same head_dim, K = V). With compression ratio r, entry j
is visible to the query at absolute position t iff

    j < floor((t + 1) / r)      (and j < n_compressed, the entries the request has)

(HCA layers: r = 128, every visible entry). t is the query's position bottom-right aligned as in
D4 in the frame of the raw keys, plus the absolute position of raw row 0 (``kv_start``, 0 unless
the caller passes only the last rows of a longer sequence, as a window cache or a context-parallel
shard does): t = kv_start + i + seqlen_k - seqlen_q for query token i of a request with seqlen_k
raw keys. A query at t < r - 1 sees no entry; a negative t none either.

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

from dsv4_attention.common.kv_span import KvSpan, token_position
from dsv4_attention.common.softmax import acc_rows_view


def set_options(kernel, tile_m: int, has_compressed: bool, has_topk: bool, index_mode: bool,
                has_positions: bool = False, padded_topk: bool = False, kv_pages: int = 0,
                kv_pages_extra: int = 0) -> None:
    """Stage E's compile-time options on a kernel object (both archs), refused where they do not
    compose: compressed entries are K = V rows; top-k lists need the compressed tensor and Q tiles
    of one token (pack_group a multiple of ``tile_m``, or, where the kernel pads (``padded_topk``:
    sm100), exactly half of it: ``pack_heads.padded_topk_group``); index mode is top-k with no
    window, batched; per-token positions (``has_positions``: the kernel takes mPositions) have no
    meaning in index mode; ``kv_pages`` (the tokens a page of a MODEL1 FP8 cache, common/kv_cache.py:
    the compressed tensor is that cache's bytes) serves index mode at head dim 512 in bf16;
    ``kv_pages_extra`` (decode's second cache, ``Entries.extra``: its tokens a page) needs it."""
    from dsv4_attention.common.pack_heads import padded_topk_group

    kernel.has_compressed, kernel.has_topk, kernel.index_mode = bool(has_compressed), bool(has_topk), bool(index_mode)
    kernel.has_positions = bool(has_positions)
    if kernel.has_positions and kernel.index_mode:
        raise ValueError("positions have no meaning in index mode (the lists are the keys)")
    if kernel.index_mode and not (kernel.has_topk and not (kernel.has_left or kernel.has_right)):
        raise ValueError("index_mode: the lists are the only keys (has_topk, no window)")
    if kernel.has_topk and not kernel.has_compressed:
        raise ValueError("has_topk lists entries of the compressed tensor: it needs has_compressed")
    if kernel.has_topk and kernel.pack_group % tile_m and not (padded_topk
                                                                and padded_topk_group(kernel.pack_group, tile_m)):
        raise ValueError(f"top-k: a Q tile gathers one token's list, so pack_group ({kernel.pack_group}) must be a "
                         f"multiple of the {tile_m}-row tile" + (f" or {tile_m // 2} (a padded tile)" if padded_topk
                                                                 else ""))
    if kernel.has_compressed and not kernel.kv_shared:
        raise ValueError("compressed entries are K = V rows: the window's K and V must be one tensor (kv)")
    if kernel.index_mode and kernel.varlen:
        raise ValueError("index mode takes flat [tokens, heads, d] tensors, not cu_seqlens")
    kernel.kv_pages = int(kv_pages)
    if kernel.kv_pages and not (kernel.index_mode and kernel.head_dim == 512 and kernel.dtype is cutlass.BFloat16):
        raise ValueError("kv_pages (a paged FP8 cache) serves index mode at head dim 512, bf16 q")
    kernel.kv_pages_extra = int(kv_pages_extra)
    if kernel.kv_pages_extra and not kernel.kv_pages:
        raise ValueError("kv_pages_extra (a second paged FP8 cache) goes with kv_pages")


def varlen_entries(request, mC, mC_mem, mTopk, mPositions, mCuSeqlensQ, mCuSeqlensC):
    """Request ``request``'s stage-E operands in a variable-length batch (kernel code, both archs).
    The tensors hold every request's rows as one batch (b = 0):

        compressed entries   rows cu_c[r] .. cu_c[r + 1] of mC / mC_mem (entries, d, kv_heads, 1)
        top-k lists          rows cu_q[r] .. of mTopk (1, total_q, k): indices local to the request
        positions            rows cu_q[r] .. of mPositions (1, total_q)

    Returns (mC, mC_mem offset to the request's first entry, its entry count, its (seqlen_q, k)
    lists or None, its (seqlen_q,) positions or None, the first entry's row cu_c[r]; the gathers
    clamp that row into the tensor, as a request with no entry may start at its end). A box read
    past the request's entries reads the next request's rows (or TMA's zero fill at the tensor's
    end): the count masks them, as D3 masks a request's trailing keys."""
    c0 = mCuSeqlensC[request]
    n_compressed = mCuSeqlensC[request + 1] - c0
    if cutlass.const_expr(mC is not None):  # sm100 top-k: None (its gather view takes the row cu_c[r])
        mC = cute.domain_offset((c0, 0, 0, 0), mC)
    if cutlass.const_expr(mC_mem is not None):
        # a request with no entry may start at the tensor's end: its (masked) positions gather the
        # view's row 0, kept in bounds by the clamp (with an entry, c0 < total and nothing moves)
        mC_mem = cute.domain_offset((cutlass.min(c0, cutlass.max(mC_mem.shape[0] - 1, 0)), 0, 0, 0), mC_mem)
    topk = positions = None
    if cutlass.const_expr(mTopk is not None or mPositions is not None):
        q0 = mCuSeqlensQ[request]
        if cutlass.const_expr(mTopk is not None):
            topk = cute.domain_offset((q0, 0), mTopk[0, None, None])
        if cutlass.const_expr(mPositions is not None):
            positions = cute.domain_offset((q0,), mPositions[0, None])
    return mC, mC_mem, n_compressed, topk, positions, c0


def compressed_visible_at(t: int, j: int, ratio: int, n_compressed: int) -> bool:
    """The plain formula, one (query at absolute position t, compressed entry j) pair: for tests
    and host proofs."""
    return 0 <= j < n_compressed and (t + 1) >= 0 and j < (t + 1) // ratio


def compressed_visible(i: int, j: int, seqlen_q: int, seqlen_k: int, ratio: int, n_compressed: int,
                       kv_start: int = 0) -> bool:
    """``compressed_visible_at`` of query token i, bottom-right aligned (t = kv_start + i +
    seqlen_k - seqlen_q)."""
    return compressed_visible_at(kv_start + i + seqlen_k - seqlen_q, j, ratio, n_compressed)


def compressed_count_at(position, ratio, n_compressed, kv_start=0):
    """Entries [0, count) visible to a query at ``position`` in the raw keys' frame (absolute
    position kv_start + position): min(n_compressed, floor((t + 1) / r)), 0 where t + 1 <= 0
    (clamped before the division: DSL integers divide toward zero)."""
    t1 = cutlass.max(kv_start + position + 1, 0)
    return cutlass.min(t1 // ratio, n_compressed)


def compressed_count(token, seqlen_q, seqlen_k, ratio, n_compressed, kv_start=0, positions=None):
    """``compressed_count_at`` of query token ``token``, at ``kv_span.token_position`` (bottom-right
    aligned, t = kv_start + token + seqlen_k - seqlen_q, or ``positions[token]``)."""
    return compressed_count_at(token_position(token, seqlen_q, seqlen_k, positions, kv_start), ratio, n_compressed,
                               kv_start)


@cute.jit
def mask_compressed_tile(acc: cute.Tensor, tScS: cute.Tensor, first_row, group: cutlass.Constexpr[int],
                         first_entry, seqlen_q, seqlen_k, ratio, n_compressed, kv_start, positions=None):
    """Scores of entries a row may not see -> -inf, in place (SM90 fragment: value i of the thread
    is tile row tScS[i][0], packed row first_row + that, token // group, and entry
    first_entry + tScS[i][1])."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        token = (first_row + tScS[i][0]) // group
        count = compressed_count(token, seqlen_q, seqlen_k, ratio, n_compressed, kv_start, positions)
        acc[i] = -cutlass.Float32.inf if first_entry + tScS[i][1] >= count else acc[i]


class FusedSpan(KvSpan):
    """A Q tile's window span (D4's ``KvSpan``, the same fields) with its compressed tiles in front:
    ``n_tiles`` = n_cmp + the window's tiles; ``origin`` / ``window_tiles`` are D4's span
    (``origin`` its first key: the K view the kernels offset)."""

    _DYNAMIC = KvSpan._DYNAMIC + ("ratio", "n_compressed", "n_cmp", "c_lo", "window_tiles")

    def __init__(self, m_block, rows, seqlen_k, tile_m: int, tile_n: int, group: int, left, right,
                 has_left: bool, has_right: bool, ratio, n_compressed, kv_start=0, positions=None):
        super().__init__(m_block, rows, seqlen_k, tile_m, tile_n, group, left, right, has_left, has_right, positions,
                         kv_start)
        self.ratio, self.n_compressed = ratio, n_compressed
        # the count grows with the position: row t_lo sees the fewest entries, t_hi the most
        c_hi = compressed_count_at(self.p_hi, ratio, n_compressed, kv_start)
        self.c_lo = compressed_count_at(self.p_lo, ratio, n_compressed, kv_start)
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
                                 self.ratio, self.n_compressed, self.kv_start, self.positions)
        else:
            KvSpan.mask(self, acc, tScS, n, first_row)  # first_key(n): the window's key

    @cute.jit
    def mask_if_needed(self, acc: cute.Tensor, tScS: cute.Tensor, n, first_row):
        if n < self.n_cmp:
            if self.compressed_needs_mask(n):
                mask_compressed_tile(acc, tScS, first_row, self.group, n * self.tile_n, self.seqlen_q,
                                     self.seqlen_k, self.ratio, self.n_compressed, self.kv_start, self.positions)
        else:
            KvSpan.mask_if_needed(self, acc, tScS, n, first_row)


# ---- top-k compressed entries (DeepSeek-V4's CSA layers) ------------------------------------------
#
# The caller names, per query token, k entries of the compressed tensor (``topk_indices`` [batch,
# seqlen_q, k] int32, -1 padded). Position p of token t's list is a key of that token iff
#
#     0 <= idx[t, p] < count(t)          (count as above: entries not yet visible stay hidden)
#
# The kernels gather the rows, 64 (one KV tile) list positions at a time, so a Q tile must hold one
# token (its rows are that token's heads: pack_group a multiple of tile_m), and its compressed
# tiles are list positions [n T, n T + T) for n < n_cmp = ceil(k / T).


def topk_visible(i: int, p: int, idx: int, seqlen_q: int, seqlen_k: int, ratio: int, n_compressed: int,
                 k: int, kv_start: int = 0) -> bool:
    """The plain formula: list position p (holding entry idx) of query token i is a visible key."""
    return 0 <= p < k and idx >= 0 and compressed_visible(i, idx, seqlen_q, seqlen_k, ratio, n_compressed,
                                                           kv_start)


@cute.jit
def mask_topk_tile(acc: cute.Tensor, tScS: cute.Tensor, tile_list: cute.Tensor, first_pos, count, k,
                   tile_n: cutlass.Constexpr[int]):
    """Scores of list positions the tile's token may not see -> -inf, in place (SM90 fragment, seen
    as (rows, columns) of the thread by ``acc_rows_view``: column c holds list position first_pos +
    its tScS column, the same for every row, as a top-k tile is one token's; ``tile_list[col]`` the
    entry at that position, read only where the position is < k; ``count`` the token's visible
    entry count). Per column, not per score: one SMEM read (two adjacent columns in one 64-bit
    load) and its compares, shared by the thread's rows; the bound p < k only on a tile that
    reaches past the list's end (its last). (``Uint32(j) < Uint32(count)`` in one compare ran
    unsigned in the host replay but was emitted signed in the kernel: -1 entries kept.)"""
    acc_v = acc_rows_view(acc)
    cols = acc_rows_view(tScS)
    if first_pos + tile_n <= k:
        _mask_list_columns(acc_v, cols, tile_list, first_pos, count, k, False)
    else:
        _mask_list_columns(acc_v, cols, tile_list, first_pos, count, k, True)


@cute.jit
def _mask_list_columns(acc_v: cute.Tensor, cols: cute.Tensor, tile_list: cute.Tensor, first_pos, count, k,
                       bounded: cutlass.Constexpr[bool]):
    """The column loop of ``mask_topk_tile``; ``bounded``: the tile reaches past the list's end,
    so a position >= k reads no entry (taken as -1)."""
    for c in cutlass.range_constexpr(cute.size(acc_v, mode=[1])):
        col = cols[0, c][1]
        j = cutlass.Int32(-1)
        if cutlass.const_expr(bounded):
            if first_pos + col < k:
                j = tile_list[col]
        else:
            j = tile_list[col]
        keep = (j >= 0) & (j < count)
        for r in cutlass.range_constexpr(cute.size(acc_v, mode=[0])):
            acc_v[r, c] = acc_v[r, c] if keep else -cutlass.Float32.inf


class TopkSpan(FusedSpan):
    """``FusedSpan`` whose compressed tiles are positions of the Q tile's token's top-k list
    (``idx_row``, k positions): n_cmp = ceil(k / T), every compressed tile masked by the list.

    The masks read tile n's T list entries from ``tile_list(n)``: the list in global memory, or,
    once ``stage_lists`` gave it SMEM (sm90), the copy the producer stages beside the gathered rows
    in the ring slot of the tile's visit (column ``list_slot(n)`` of a (T, slots) int32 buffer,
    position n T + c in row c, read from the list at ``list_source(n, c)``): the consumers then
    read 4 bytes of SMEM per score column instead of waiting on global loads after each QK GEMM."""

    _DYNAMIC = FusedSpan._DYNAMIC + ("k", "count", "idx_row", "lists", "list_base")
    lists = None  # (T, slots) int32 SMEM: each ring slot's tile of the list (sm90 top-k)
    slots = 1
    list_base = 0  # the ring uses before this Q tile's (a persistent CTA's earlier tiles)

    def stage_lists(self, lists: cute.Tensor, slots: int, base=0):
        self.lists, self.slots, self.list_base = lists, slots, base

    def list_slot(self, n):
        """The ring slot of tile n's visit (the kernels visit tiles last-first: ring use
        t = base + n_tiles - 1 - n, ``base`` the uses of the CTA's earlier Q tiles; a split-KV unit
        counts from its own first tile, ``tile_visit``)."""
        end = self.n_tiles if self.n_end is None else self.n_end
        return (self.list_base + end - 1 - n) % self.slots

    @cute.jit
    def listed_entry(self, n, r):
        """The entry row r of gathered tile n holds: the one at list position n T + r where it is a
        visible entry, else -1 (not read: the row is zero-filled and masked). Both archs' gathers."""
        pos = n * self.tile_n + r
        j = cutlass.Int32(-1)
        if pos < self.k:
            j = self.idx_row[pos]
        return j if (j >= 0) & (j < self.count) else cutlass.Int32(-1)

    def list_source(self, n, c):
        """The list position whose entry row c of tile n's staged list holds: n T + c, clamped to
        the list (positions past k are masked by p < k, never read)."""
        return cutlass.min(n * self.tile_n + c, self.k - 1)

    def tile_list(self, n):
        if cutlass.const_expr(self.lists is None):
            return cute.domain_offset((n * self.tile_n,), self.idx_row)
        return self.lists[None, self.list_slot(n)]

    def __init__(self, m_block, rows, seqlen_k, tile_m: int, tile_n: int, group: int, left, right,
                 has_left: bool, has_right: bool, ratio, n_compressed, idx_row, k, kv_start=0, positions=None):
        super().__init__(m_block, rows, seqlen_k, tile_m, tile_n, group, left, right, has_left, has_right, ratio,
                         n_compressed, kv_start, positions)
        self.idx_row, self.k = idx_row, k
        self.count = self.c_lo  # one token per Q tile: t_lo = t_hi
        self.n_cmp = (k + tile_n - 1) // tile_n
        self.n_tiles = self.n_cmp + self.window_tiles

    @cute.jit
    def mask(self, acc: cute.Tensor, tScS: cute.Tensor, n, first_row):
        if n < self.n_cmp:
            mask_topk_tile(acc, tScS, self.tile_list(n), n * self.tile_n, self.count, self.k, self.tile_n)
        else:
            KvSpan.mask(self, acc, tScS, n, first_row)

    @cute.jit
    def mask_if_needed(self, acc: cute.Tensor, tScS: cute.Tensor, n, first_row):
        if n < self.n_cmp:
            mask_topk_tile(acc, tScS, self.tile_list(n), n * self.tile_n, self.count, self.k, self.tile_n)
        else:
            KvSpan.mask_if_needed(self, acc, tScS, n, first_row)


class IndexSpan(TopkSpan):
    """Index mode (FlashMLA's sparse attention): the token's list is its only keys, rows of one
    tensor (no window, no visibility rule beyond 0 <= idx < n_compressed): n_tiles = n_cmp =
    max(ceil(k / T), 1) (an empty list still visits one wholly masked tile: O = 0, LSE = -inf)."""

    def __init__(self, m_block, rows, seqlen_k, tile_m: int, tile_n: int, group: int, n_compressed, idx_row, k):
        super().__init__(m_block, rows, seqlen_k, tile_m, tile_n, group, 0, 0, False, False, 1, n_compressed,
                         idx_row, k)
        self.count = n_compressed
        self.n_cmp = cutlass.max((k + tile_n - 1) // tile_n, 1)
        self.window_tiles = 0
        self.n_tiles = self.n_cmp


class TwoListSpan(IndexSpan):
    """Index mode over two lists (serving's decode: the window cache's list and the extra cache's,
    one softmax): the token's keys are list A's k_a positions, then list B's k_b, as one list of
    k_a + k_b positions (n_tiles = max(ceil((k_a + k_b) / T), 1); a tile may hold both lists'
    positions). An entry is resolved into one index space of both caches' slots: list A's entry j
    names slot j of cache A (kept where 0 <= j < first, the A slot count), list B's names slot
    first + j (kept where 0 <= j < count - first). ``listed_entry`` returns that resolved entry (or
    -1); the producer stages it as the tile's list, so the masks (``mask_topk_tile`` with count and
    k = k_a + k_b) read one list as for a single one, and the gather takes a row from cache B
    where its resolved entry is >= first."""

    _DYNAMIC = IndexSpan._DYNAMIC + ("idx_row_b", "k_a", "first")

    def __init__(self, m_block, rows, seqlen_k, tile_m: int, tile_n: int, group: int, n_compressed, idx_row, k_a,
                 idx_row_b, k_b, first):
        super().__init__(m_block, rows, seqlen_k, tile_m, tile_n, group, n_compressed, idx_row, k_a + k_b)
        self.idx_row_b, self.k_a, self.first = idx_row_b, k_a, first

    @cute.jit
    def listed_entry(self, n, r):
        """The resolved entry at list position n T + r (class doc), or -1."""
        pos = n * self.tile_n + r
        j = cutlass.Int32(-1)
        if pos < self.k_a:
            a = self.idx_row[pos]
            if (a >= 0) & (a < self.first):
                j = a
        elif pos < self.k:
            e = self.idx_row_b[pos - self.k_a]
            if (e >= 0) & (e < self.count - self.first):
                j = e + self.first
        return j

    def position_visible(self, p):
        """List position p is a key (sm100's mask words: ``topk_tile_words``' ``visible``)."""
        return self.listed_entry(0, p) >= 0
