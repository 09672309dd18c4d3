"""Stage E on Blackwell (SM100): the window and the compressed entries in one softmax, one launch.

Stage D5's kernel (sink in the epilogue, D4's window span, D2's packed heads) with a second K = V
source: DeepSeek-V4's compressed entries (``compressed_kv``, ratio r; common/compressed.py). Entry
j is visible to the query at position t' (bottom-right aligned, D4) iff j < floor((t' + 1) / r).
Both sources are K = V tensors of the same head_dim, loaded by TMA atoms of the same box into the
same ring stages, so the MMA, softmax and correction warps cannot tell them apart: the online
softmax, the O rescale and the sink run over the union exactly as over one key set.

Per 128-row Q tile (rows = tokens t_lo .. t_hi), tiles in one index space (``FusedSpan``, T = tile_n):

    n < n_cmp    compressed entries [n T, n T + T)           TMA: compressed view, entry n T
    n >= n_cmp   window tile n - n_cmp of D4's span          TMA: K's view, key origin + (n - n_cmp) T
    n_cmp = ceil(count(t_hi) / T),   count(t) = min(n_compressed, floor((t' + 1) / r))

visited last-first as before: the window's tiles (its first visit holds the diagonal), then the
compressed ones from the last (the only one a row can see partly) down to 0. Softmax thread t
computes its row's count once per CTA beside D4's window bounds (``row_keys``); a compressed tile's
visible columns are [0, count - n T) (``tile_columns``), masked by D4's ``mask_from`` only where
that cuts the tile; a window tile keeps D4's bounds from its first key. The entries arrive as
common/seams.Entries; the hooks of stage D1's skeleton this stage fills: ``entry_operands`` (the
compressed atom, traced in ``__call__``), ``request_entries``, ``prefetch_entries``,
``entry_sources`` (the TMA warp's views), ``kv_span`` (the fused span), ``load_k_block`` (the TMA
warp's source per tile: one runtime branch between two descriptors of the same box),
``row_keys``, ``tile_columns``, ``masks_inner_tiles``.
Host proof: tests/test_e_sm100_host.py.

64 query heads with top-k lists or in index mode (DeepSeek-V4-Flash; pack_group 64, which D2 packs
two tokens a tile): one token a 128-row tile, rows 64 .. 127 padding (``owned_rows`` = 64, D1's
``padded`` seams): tile m's span holds token m's list, its Q box starts at packed row 64 m (rows
64 .. 127 the next token's heads or TMA's zeros), every per-row decision takes row r as r % 64
(``packed_row``), and only rows 0 .. 63 store O (row by row) and LSE. A compile-time consequence
of (pack_group, has_topk); docs/stages/e_fused.md says what it costs and why not an M = 64 MMA.
"""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from dsv4_attention.common.compressed import (
    FusedSpan,
    IndexSpan,
    TopkSpan,
    TwoListSpan,
    set_options,
    varlen_entries,
)
from dsv4_attention.common.kv_span import KvSpan, positions_row
from dsv4_attention.common.layouts import seq_major
from dsv4_attention.common.sm100_kv import GATHER4_ROWS, block_rows_layout, gather_view, topk_rows
from dsv4_attention.common.sm100_smem_p import make_pv_mma, make_qk_mma, make_smem_layouts
from dsv4_attention.common.sm100_softmax import (
    column_range_words,
    mask_topk_row,
    topk_tile_words,
    visible_columns,
    visible_entries,
)
from dsv4_attention.common.tmem import QK_TILE_M
from dsv4_attention.stages.d5_sink_merge.sm100 import FlashAttentionD5Sm100
from dsv4_attention.stages.e_fused.sm100_pages import PagedFp8GatherSm100


class EntryOperands(NamedTuple):
    """The kernel's form of common/seams.Entries (``entry_operands``): the entries' TMA atom and view
    (K's box; top-k: a gather4 atom over the 2D rows), then the bundle's other fields as given."""
    atom: Any
    mC: Any
    ratio: Any
    mTopk: Any  # (batch, seqlen_q, k) int32 lists of entries, -1 padded
    kv_start: Any  # the absolute position of raw key 0 (compressed visibility)
    mPositions: Any  # (batch or 1, seqlen_q) int32 query tokens' absolute positions
    mCuSeqlensC: Any  # varlen: request b's entries are rows cu_c[b] .. cu_c[b + 1]
    mExtra: Any = None  # kv_pages_extra: the second cache's bytes (pages, bytes, 1, 1)
    mExtraTopk: Any = None  # kv_pages_extra: its (batch, seqlen_q, k_b) lists


class RequestEntries(NamedTuple):
    """A request's entries (``request_entries``): the atom, the TMA view to index with batch
    coordinate b, its entry count, its first entry as a row of every batch's entries (top-k), its
    (seqlen_q, k) lists and query positions (or None), the ratio and kv_start."""
    atom: Any
    mC: Any
    count: Any
    c_row0: Any
    topk: Any
    positions: Any
    ratio: Any
    kv_start: Any
    extra: Any = None  # kv_pages_extra: the second cache's bytes
    extra_topk: Any = None  # kv_pages_extra: its (seqlen_q, k_b) lists
    first: Any = None  # kv_pages_extra: the first cache's slot count (the second's slots follow)


class FlashAttentionESm100(PagedFp8GatherSm100, FlashAttentionD5Sm100):
    #: host proofs only: the top-k mask's ballots assembled by a loop over the lanes (no warp on the CPU)
    topk_words_on_host = False

    def __init__(self, dtype, head_dim: int, *, has_compressed: bool = False, has_topk: bool = False,
                 index_mode: bool = False, has_positions: bool = False, kv_pages: int = 0, kv_pages_extra: int = 0,
                 **options):
        super().__init__(dtype, head_dim, **options)
        set_options(self, QK_TILE_M, has_compressed, has_topk, index_mode, has_positions, padded_topk=True,
                    kv_pages=kv_pages, kv_pages_extra=kv_pages_extra)
        if self.has_topk and self.pack_group < QK_TILE_M:
            # 64 heads (set_options admits no other group below the tile): one token per 128-row tile,
            # rows 64 .. 127 padding (``padded``; the module doc)
            self.owned_rows = self.pack_group

    # ---- the entries seam (stage D1's hooks) ----

    def entry_operands(self, entries, load_op, k_ring, qk_mma):
        if cutlass.const_expr(not (self.has_compressed or self.has_positions)):
            return None
        atom = view = None
        if cutlass.const_expr(self.kv_pages):  # a paged FP8 cache: read by address, (pages, bytes, 1, 1)
            view = seq_major(entries.compressed)
        elif cutlass.const_expr(self.has_compressed):
            atom, view = self.compressed_tma_atom(load_op, entries.compressed, k_ring, qk_mma, entries.topk)
        extra = extra_topk = None
        if cutlass.const_expr(self.kv_pages_extra):  # decode's second cache, read by address like the first
            extra, extra_topk = seq_major(entries.extra), entries.extra_topk
        return EntryOperands(atom, view, entries.ratio, entries.topk, entries.kv_start, entries.positions,
                             entries.cu_seqlens_c, extra, extra_topk)

    def compressed_tma_atom(self, op, mCompressed, k_ring, qk_mma, mTopk):
        """(atom, TMA view) of the compressed entries: K's box into the same ring stages; top-k: a
        gather4 atom (4 rows a TMA instruction) over the entries as 2D rows, K's box and ring."""
        plan = self.plan
        if not self.has_topk:
            return cute.nvgpu.make_tiled_tma_atom_B(
                op, seq_major(mCompressed), cute.select(k_ring, mode=[0, 1, 2]),
                (QK_TILE_M, plan.tile_n, plan.d_block), qk_mma,
            )  # fmt: skip
        rows_2d, index_shape = gather_view(seq_major(mCompressed), plan.tile_n)
        gI = cute.make_tensor(mTopk.iterator, cute.make_layout(index_shape, stride=(1, 0)))
        smem = cute.make_composed_layout(k_ring.inner, 0, block_rows_layout(cute.select(k_ring.outer, mode=[0, 1, 2])))
        atom, view = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensor2DGather4G2SOp(), rows_2d, smem,
                                                 (plan.tile_n, plan.d_block), gmem_coord_tensor=gI)
        return atom, view

    def request_entries(self, request, b, entries, lengths):
        if cutlass.const_expr(entries is None):
            return None
        e = entries
        if cutlass.const_expr(self.varlen and self.has_compressed):
            # top-k: the gather view stays whole (its rows are addressed from c_row0); dense: offset like K
            view = None if cutlass.const_expr(self.has_topk) else e.mC
            offset, _, count, topk, positions, c_row0 = varlen_entries(request, view, None, e.mTopk, e.mPositions,
                                                                       lengths.cu_seqlens_q, e.mCuSeqlensC)
            if cutlass.const_expr(self.has_topk):  # masked positions gather row c_row0: kept in the tensor
                return RequestEntries(e.atom, e.mC, count, cutlass.min(c_row0, cutlass.max(e.mC.shape[0] - 1, 0)),
                                      topk, positions, e.ratio, e.kv_start)
            return RequestEntries(e.atom, offset, count, c_row0, topk, positions, e.ratio, e.kv_start)
        topk = count = c_row0 = None
        if cutlass.const_expr(e.mTopk is not None):
            topk = e.mTopk[b, None, None]
        if cutlass.const_expr(self.kv_pages_extra):  # the second cache's slots follow the first's
            first = e.mC.shape[0] * self.kv_pages
            return RequestEntries(e.atom, e.mC, first + e.mExtra.shape[0] * self.kv_pages_extra, 0, topk, None,
                                  e.ratio, e.kv_start, e.mExtra, e.mExtraTopk[b, None, None], first)
        if cutlass.const_expr(self.kv_pages):  # every slot of every page
            count, c_row0 = e.mC.shape[0] * self.kv_pages, 0
        elif cutlass.const_expr(e.mC is not None):
            count, c_row0 = e.mC.shape[0], b * e.mC.shape[0]
        return RequestEntries(e.atom, e.mC, count, c_row0, topk, positions_row(e.mPositions, b), e.ratio,
                              e.kv_start)

    @cute.jit
    def prefetch_entries(self, entries):
        if cutlass.const_expr(self.has_compressed and not self.kv_pages):
            cpasync.prefetch_descriptor(entries.atom)

    def entry_sources(self, qk_mma, entries, sK, hk, b):
        """(atom, tCgC): tCgC[None, n, kb] is K block kb of compressed tile n, a (tile_n, d_block) box
        of (entries, head_dim) at entry n * tile_n (no origin: entries are not windowed; past the
        tensor zero-filled, and masked); the same box and ring stages as K's. Top-k: (the gather
        view's (tile_n, d_block) boxes along the columns (kv head hk's blocks), hk's first column
        block, the request's first 2D row c_row0: rows are (batch, entry) pairs)."""
        if not self.has_compressed:
            return None
        plan = self.plan
        if self.kv_pages_extra:  # both caches' pages as (pages, bytes)
            return None, entries.mC[None, None, 0, 0], entries.extra[None, None, 0, 0]
        if self.kv_pages:  # the pages as (pages, bytes): gathered by address
            return None, entries.mC[None, None, 0, 0]
        if self.has_topk:
            return entries.atom, (cute.local_tile(entries.mC, (plan.tile_n, plan.d_block), (0, None)),
                                  hk * plan.blocks, entries.c_row0)
        gC = cute.local_tile(entries.mC[None, None, hk, b], (plan.tile_n, plan.d_block), (None, None))
        _, tCgC = cpasync.tma_partition(
            entries.atom, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
            cute.group_modes(qk_mma.get_slice(0).partition_B(gC), 0, 3),
        )  # fmt: skip
        return entries.atom, tCgC

    def kv_span(self, m_block, rows, seqlen_k, window, entries):
        if cutlass.const_expr(not self.has_compressed):  # D4's span, in the given positions' frame
            if cutlass.const_expr(entries is None):
                return super().kv_span(m_block, rows, seqlen_k, window, entries)
            return KvSpan(m_block, rows, seqlen_k, QK_TILE_M, self.plan.tile_n, self.pack_group, window.left,
                          window.right, self.has_left, self.has_right, entries.positions, entries.kv_start)
        e = entries
        # top-k: the tile's one token (a padded tile: owned_rows = pack_group rows from m_block * pack_group)
        step = self.owned_rows
        token = m_block * step // self.pack_group
        if cutlass.const_expr(self.kv_pages_extra):  # decode: the two caches' lists are every key
            return TwoListSpan(m_block, rows, seqlen_k, step, self.plan.tile_n, self.pack_group, e.count,
                               e.topk[token, None], e.topk.shape[1], e.extra_topk[token, None],
                               e.extra_topk.shape[1], e.first)
        if cutlass.const_expr(self.index_mode):  # FlashMLA's sparse attention: the list is every key
            return IndexSpan(m_block, rows, seqlen_k, step, self.plan.tile_n, self.pack_group, e.count,
                             e.topk[token, None], e.topk.shape[1])
        if cutlass.const_expr(self.has_topk):
            return TopkSpan(m_block, rows, seqlen_k, step, self.plan.tile_n, self.pack_group, window.left,
                            window.right, self.has_left, self.has_right, e.ratio, e.count,
                            e.topk[token, None], e.topk.shape[1], e.kv_start, e.positions)
        return FusedSpan(m_block, rows, seqlen_k, QK_TILE_M, self.plan.tile_n, self.pack_group, window.left,
                         window.right, self.has_left, self.has_right, e.ratio, e.count, e.kv_start, e.positions)

    def may_hide_rows(self) -> bool:
        # index mode: a token's list may name no row at all (all -1, topk_length 0): the softmax's
        # empty-row path (O = 0, LSE = -inf) must be compiled in, as for an empty window
        return super().may_hide_rows() or self.index_mode

    def masks_inner_tiles(self) -> bool:
        # every compressed tile may cut a row (count grows along the tile's tokens)
        return super().masks_inner_tiles() or self.has_compressed

    @cute.jit
    def load_k_block(self, span, tile, kb, tma_atom_k, tKgK, sources, dst, barrier):
        if cutlass.const_expr(self.kv_pages_extra):  # decode in one launch: rows from either cache
            self.gather_fp8_block(span, tile, kb, sources[1], dst, barrier, sources[2])
        elif cutlass.const_expr(self.kv_pages):  # index mode: every tile is gathered
            self.gather_fp8_block(span, tile, kb, sources[1], dst, barrier)
        elif cutlass.const_expr(self.has_topk):
            tma_atom_c, tCgC = sources
            if tile < span.n_cmp:
                self.gather_k_block(span, tile, kb, tma_atom_c, tCgC, dst, barrier)
            else:
                cute.copy(tma_atom_k, tKgK[None, span.window_tile(tile), kb], dst, tma_bar_ptr=barrier)
        elif cutlass.const_expr(self.has_compressed):
            tma_atom_c, tCgC = sources
            if tile < span.n_cmp:
                cute.copy(tma_atom_c, tCgC[None, tile, kb], dst, tma_bar_ptr=barrier)
            else:
                cute.copy(tma_atom_k, tKgK[None, span.window_tile(tile), kb], dst, tma_bar_ptr=barrier)
        else:
            cute.copy(tma_atom_k, tKgK[None, tile, kb], dst, tma_bar_ptr=barrier)

    def k_block_outer(self):
        """The ring's K-block SMEM layout (``make_smem_layouts``' k_ring outer; static)."""
        plan = self.plan
        qk, pv = make_qk_mma(self.dtype, plan), make_pv_mma(self.dtype, plan)
        return make_smem_layouts(self.dtype, plan, qk, pv)[1].outer

    def gather_rows(self, span, tile, row0, first=0, n=None):
        """Top-k: the 2D rows of compressed tile ``tile``'s box rows first .. first + n - 1 (all T by
        default; ``common.sm100_kv.topk_rows``)."""
        return topk_rows(span, tile, row0, first, n)

    @cute.jit
    def gather_k_block(self, span, tile, kb, tma_atom_c, tCgC, dst, barrier):
        """Top-k: K block kb of compressed tile ``tile`` (list positions tile T .. tile T + T - 1 of the
        tile's token) -> ring stage ``dst``: T / 4 gather4 TMA instructions, row r of the box from 2D
        row b * entries + idx[tile T + r] (``topk_rows``: an invalid position reads entry 0, finite and
        masked), columns kb B .. of kv head hk; the whole box, so the stage's byte count is K's.
        One 4-row group at a time (a runtime loop): its 4 rows are computed into 4 registers right
        before the group's instructions (one per 64 columns), never all T at once (T = 128 rows held
        in registers across the whole box spilled)."""
        views = self.gather_views(span, kb, tma_atom_c, tCgC, dst)
        for g in cutlass.range(span.tile_n // GATHER4_ROWS, unroll=1):
            self.gather_group(span, tile, g, tCgC[2], views, tma_atom_c, barrier)

    def gather_views(self, span, kb, tma_atom_c, tCgC, dst):
        """Top-k: K block kb's gather as (coordinates, index registers, SMEM), each ((64 columns, 4 rows),
        (T / 4 groups, B / 64 parts)): one gather4 instruction's values, then the instructions; the index
        side reads the same 4 registers (the last tensor) for every group."""
        gC, col_block0, _ = tCgC
        rows = cute.make_rmem_tensor((GATHER4_ROWS,), Int32)  # the current group's 4 rows
        gI = cute.make_tensor(rows.iterator, cute.make_layout(((GATHER4_ROWS, span.tile_n // GATHER4_ROWS),
                                                                 gC.shape[1]), stride=((1, 0), 0)))
        gIt = cute.local_tile(gI, (span.tile_n, self.plan.d_block), (0, None))
        sC = cute.make_tensor(dst.iterator, block_rows_layout(cute.select(self.k_block_outer(), mode=[0, 1, 2])))
        tCsC, tCgC_, tCgI = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
            [cute.group_modes(gC, 0, 2), cute.group_modes(gIt, 0, 2)],
        )  # fmt: skip
        src = tCgC_[None, col_block0 + kb]
        # the partition orders the instructions colexicographically (a part count of 1 folded away there)
        inst = src.shape[0][0]
        groups = span.tile_n // GATHER4_ROWS
        modes = cute.make_layout((inst, (groups, cute.size(src) // (cute.size(inst) * groups))))
        return (cute.make_tensor(src.iterator, cute.composition(src.layout, modes)),
                cute.make_tensor(tCgI.iterator, cute.composition(tCgI[None, 0].layout, modes)),
                cute.make_tensor(tCsC.iterator, cute.composition(tCsC.layout, modes)), rows)

    @cute.jit
    def gather_group(self, span, tile, g, row0, views, tma_atom_c, barrier):
        """Top-k: box rows 4 g .. 4 g + 3 of the K block ``views`` (``gather_views``) describe: their 4
        2D rows (``gather_rows``) into the index registers, then the group's gather4 instructions."""
        src, idx, smem, rows = views
        group_rows = self.gather_rows(span, tile, row0, g * GATHER4_ROWS, GATHER4_ROWS)
        rows.store(group_rows.load())
        group = ((None, None), (g, None))
        cute.copy(tma_atom_c, [src[group], idx[group]], smem[group], tma_bar_ptr=barrier)

    @cute.jit
    def mask_s_row(self, s_row, tTR_cS, span, keys, it):
        if cutlass.const_expr(self.has_topk):
            # one mask pass for both kinds of tile (a compressed tile's and D4's window mask in two branches,
            # 128 scores each, spilled at T = 128): the tile's visible columns as bit words, a compressed
            # tile's from the list (one token per tile: every row reads the same list and count), a window
            # tile's from D4's bounds (one token per tile: the same for every row); applied where a bit is clear
            n = span.n_tiles - 1 - it
            _, count = keys
            lane = 0 if cutlass.const_expr(self.topk_words_on_host) else cute.arch.lane_idx()
            # two lists (TwoListSpan): a position is visible where it resolves to an entry
            visible = span.position_visible if cutlass.const_expr(self.kv_pages_extra) else None
            listed = topk_tile_words(span.idx_row, n * span.tile_n, count, span.k, span.tile_n, lane,
                                     self.topk_words_on_host, visible)
            lo, hi = self.tile_columns(span, keys, n)
            window = column_range_words(lo, hi, span.tile_n)
            compressed = n < span.n_cmp
            words = []
            for w in cutlass.range_constexpr(span.tile_n // 32):
                words.append(listed[w] if compressed else window[w])
            cuts = hi < span.tile_n
            if cutlass.const_expr(lo is not None):
                cuts = cuts | (lo > 0)
            if compressed | cuts:
                mask_topk_row(s_row, tTR_cS, words)
        else:
            FlashAttentionD5Sm100.mask_s_row(self, s_row, tTR_cS, span, keys, it)

    def row_keys(self, span, m_blk, tTR_cS):
        keys = super().row_keys(span, m_blk, tTR_cS)
        if not self.has_compressed:
            return keys
        if self.index_mode:  # every listed row of the tensor is a key (IndexSpan: count = entries)
            return keys, span.count
        # the row's entry count beside its window bounds: one integer per thread, once per CTA
        return keys, visible_entries(span, self.packed_row(m_blk, tTR_cS[0][0]))

    def tile_columns(self, span, keys, n):
        if not self.has_compressed:
            return super().tile_columns(span, keys, n)
        return self.fused_columns(span, keys, n)

    @cute.jit
    def fused_columns(self, span, keys, n):
        """Tile n's visible columns: a compressed tile's [0, count - n T), a window tile's D4 bounds
        from its first key. Selects bounds, so the softmax keeps one mask pass per bound."""
        window_keys, count = keys
        lo, hi = visible_columns(window_keys, span.first_key(n))
        compressed = n < span.n_cmp
        hi = (count - n * span.tile_n) if compressed else hi
        if cutlass.const_expr(lo is not None):
            lo = Int32(0) if compressed else lo
        return lo, hi
