"""Stage E on Hopper (SM90): the window and the compressed entries in one softmax, one launch.

Stage D5's kernel (sink in the epilogue, D4's window span, D2's packed heads) with a second K = V
source: DeepSeek-V4's compressed entries (``compressed_kv``, ratio r; common/compressed.py). Entry
j is visible to the query at position t' (bottom-right aligned, D4) iff j < floor((t' + 1) / r).
Both sources are K = V tensors of the same head_dim, so their tiles take turns in the one chunked
ring (common/sm90_kv_chunks.py) and the consumers cannot tell them apart: the softmax, the O
rescale and the sink run over the union exactly as over one key set.

Per Q tile (rows = tokens t_lo .. t_hi), tiles in one index space (``FusedSpan``):

    n < n_cmp    compressed entries [64 n, 64 n + 64)          masked iff 64 n + 64 > count(t_lo)
    n >= n_cmp   window tile n - n_cmp of D4's span            D4's masks

visited last-first as before: the window's tiles (its first visit holds the diagonal), then the
compressed ones from the last (the only one a row can see partly) down to 0. The entries arrive
as common/seams.Entries; the hooks of stage D1's skeleton this stage fills: ``entry_operands``
(their TMA atom, K's chunked box), ``request_entries`` (a request's views, count, lists and
positions), ``entry_views`` / ``entry_sources`` (the producer's views), ``kv_span`` (the fused
span), ``load_kv`` (the producer's source per tile: one runtime branch between two TMA
descriptors of the same box), ``masks_inner_tiles``, ``q_first`` (top-k: Q's TMA ahead of the
first gathered tile, whose issue waits for its index list), ``stage_words`` / ``stage_span``
(top-k: each ring slot's list in SMEM).

Top-k (``has_topk``, DeepSeek-V4's CSA layers): compressed tile n is list positions [64 n, 64 n + 64)
of the Q tile's one token (``TopkSpan``; pack_group a multiple of tile_m), its rows gathered by the
whole producer warpgroup with cp.async (``gather_tile``) into the same ring slots, the chunk
barriers counting 128 arrivals (``producer_warps``, ``full_arrivals``). Index mode
(``index_mode``, FlashMLA's sparse attention): the lists are a token's only keys, rows of one
tensor (``IndexSpan``: no window tiles, every tile gathered).
"""

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
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
from dsv4_attention.common.sm90_gather import ROW_UNIT_BYTES, cp_async_row_unit, l2_evict_last_policy
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP, make_tma_tile_atom
from dsv4_attention.common.sm90_kv_chunks import CHUNK_COLS, chunk_views, gather_offset
from dsv4_attention.stages.d5_sink_merge.sm90 import FlashAttentionD5Sm90
from dsv4_attention.stages.e_fused.sm90_pages import PagedFp8Gather

GATHER_BYTES = ROW_UNIT_BYTES  # one cp.async: 8 bf16 columns of a row
UNITS = CHUNK_COLS * 2 // GATHER_BYTES  # 16-byte units of a chunk's 128-byte row


class EntryOperands(NamedTuple):
    """The kernel's form of common/seams.Entries (``entry_operands``): the entries' TMA atom and
    view (K's box, chunked), the ratio, the lists, the entries' memory (top-k rows are gathered by
    address), then the bundle's other fields as given (None / 0 where unused)."""
    atom: Any
    mC: Any  # (entries, d, kv_heads, batch) TMA view
    ratio: Any
    mTopk: Any  # (batch, seqlen_q, k) int32 lists of entries, -1 padded
    mC_mem: Any  # the same rows in memory
    kv_start: Any  # the absolute position of raw key 0 (compressed visibility)
    mPositions: Any  # (batch or 1, seqlen_q) int32 query tokens' absolute positions
    mCuSeqlensC: Any  # varlen: request b's entries are rows cu_c[b] .. cu_c[b + 1]
    mExtra_mem: Any = None  # kv_pages_extra: the second cache's bytes (pages, bytes, 1, 1)
    mExtraTopk: Any = None  # kv_pages_extra: its (batch, seqlen_q, k_b) lists


class RequestEntries(NamedTuple):
    """A request's entries (``request_entries``): the TMA atom, its views to index with batch
    coordinate b, its entry count, its (seqlen_q, k) lists and query positions (or None), the ratio
    and kv_start."""
    atom: Any
    mC: Any
    mC_mem: Any
    count: Any
    topk: Any
    positions: Any
    ratio: Any
    kv_start: Any
    extra_mem: Any = None  # kv_pages_extra: the second cache's bytes
    extra_topk: Any = None  # kv_pages_extra: its (seqlen_q, k_b) lists
    first: Any = None  # kv_pages_extra: the first cache's slot count (the second's slots follow)


class EntrySources(NamedTuple):
    """What ``load_kv`` takes to load an entries tile (``entry_sources``): the TMA atom and this
    tile's chunk views of the entries, the ring's first byte and the rows' memory (top-k gathers),
    the producer warp."""
    atom: Any
    tCgC: Any
    ring_base: Any
    mC_mem_hb: Any
    warp_idx: Any
    extra: Any = None  # kv_pages_extra: the second cache's bytes (pages, bytes)


class FlashAttentionESm90(PagedFp8Gather, FlashAttentionD5Sm90):
    def __init__(self, dtype, head_dim: int, *, has_compressed: bool = False, has_topk: bool = False,
                 index_mode: bool = False, has_positions: bool = False, kv_pages: int = 0, kv_pages_extra: int = 0,
                 **options):
        super().__init__(dtype, head_dim, **options)
        set_options(self, self.tile_m, has_compressed, has_topk, index_mode, has_positions, kv_pages=kv_pages,
                    kv_pages_extra=kv_pages_extra)
        if self.has_topk:
            # every producer thread gathers rows; each chunk's full barrier counts all of them
            self.producer_warps = THREADS_PER_WARPGROUP // 32
            self.full_arrivals = THREADS_PER_WARPGROUP
            self.lanes_read_slot = True
            # the gather's addresses need more than the TMA producer's 24-32 registers (ptxas spilled
            # at 128-key tiles, and with the seesaw's four half-tile gathers a pair at 40); 16 fewer
            # per consumer thread pay for it (setmaxnreg: 64K per CTA)
            self.consumer_regs -= 16
            self.producer_regs += 16 * self.num_wg
            if self.kv_pages and not self.seesaw:
                raise ValueError("kv_pages: the FP8 gather loads a slot by the seesaw's halves (head dim 512)")
            if self.kv_pages and not self.split_kv:
                # the dequantizing gather keeps each row's address and scale words: at 56 registers
                # ptxas spilled 48 bytes. Split-KV's consumers spill at 216 (its partial stores),
                # so there the producer keeps 56 and its spill (tests/test_e_cpu.py's budget)
                self.consumer_regs -= 8
                self.producer_regs += 8 * self.num_wg

    # ---- the entries seam (stage D1's hooks) ----

    def entry_operands(self, entries, load_op, chunk_layout):
        if cutlass.const_expr(not (self.has_compressed or self.has_positions)):
            return None
        atom = view = mem = None
        if cutlass.const_expr(self.has_compressed):  # K's chunked box: the tiles share the ring
            mem = seq_major(entries.compressed)  # kv_pages: (pages, bytes, 1, 1), read by address only
            if cutlass.const_expr(not self.kv_pages):
                atom, view = make_tma_tile_atom(load_op, mem, chunk_layout, self.tile_n, CHUNK_COLS)
        extra = extra_topk = None
        if cutlass.const_expr(self.kv_pages_extra):  # decode's second cache, read by address like the first
            extra, extra_topk = seq_major(entries.extra), entries.extra_topk
        return EntryOperands(atom, view, entries.ratio, entries.topk, mem, entries.kv_start, entries.positions,
                             entries.cu_seqlens_c, extra, extra_topk)

    def stage_words(self) -> int:
        if not self.has_topk:
            return 0
        return self.tile_n * self.slots

    @cute.jit
    def prefetch_entries(self, entries):
        if cutlass.const_expr(self.has_compressed and not self.kv_pages):
            cpasync.prefetch_descriptor(entries.atom)

    def request_entries(self, request, b, entries, lengths):
        if cutlass.const_expr(entries is None):
            return None
        e = entries
        if cutlass.const_expr(self.varlen and self.has_compressed):
            mC, mC_mem, count, topk, positions, _ = varlen_entries(request, e.mC, e.mC_mem, e.mTopk, e.mPositions,
                                                                   lengths.cu_seqlens_q, e.mCuSeqlensC)
            return RequestEntries(e.atom, mC, mC_mem, count, topk, positions, e.ratio, e.kv_start)
        topk = count = None
        if cutlass.const_expr(e.mTopk is not None):
            topk = e.mTopk[b, None, None]
        if cutlass.const_expr(self.kv_pages):  # every slot of every page
            count = e.mC_mem.shape[0] * self.kv_pages
        elif cutlass.const_expr(e.mC is not None):
            count = e.mC.shape[0]
        if cutlass.const_expr(self.kv_pages_extra):  # the second cache's slots follow the first's
            return RequestEntries(e.atom, e.mC, e.mC_mem, count + e.mExtra_mem.shape[0] * self.kv_pages_extra, topk,
                                  None, e.ratio, e.kv_start, e.mExtra_mem, e.mExtraTopk[b, None, None], count)
        return RequestEntries(e.atom, e.mC, e.mC_mem, count, topk, positions_row(e.mPositions, b), e.ratio,
                              e.kv_start)

    def entry_views(self, req, head_kv, b):
        if cutlass.const_expr(not self.has_compressed):
            return None
        e = req.entries
        if cutlass.const_expr(self.kv_pages_extra):
            return (None, None, e.mC_mem[None, None, head_kv, b], e.extra_mem[None, None, 0, 0])
        if cutlass.const_expr(self.kv_pages):
            return (None, None, e.mC_mem[None, None, head_kv, b])
        return (e.atom, e.mC[None, None, head_kv, b], e.mC_mem[None, None, head_kv, b])

    def stage_words_view(self, words):
        if cutlass.const_expr(not self.has_topk):
            return None
        return words.get_tensor(cute.make_layout((self.tile_n, self.slots)))  # (tile_n, slots): a slot's list

    def stage_span(self, span, smem, uses_before):
        if cutlass.const_expr(self.has_topk):  # the producer stages each tile's list entries here
            span.stage_lists(smem.stage_words, self.slots, uses_before)

    def entry_sources(self, smem, tile, warp_idx):
        if cutlass.const_expr(not self.has_compressed):
            return None
        if cutlass.const_expr(self.kv_pages):  # gathered by address only
            extra = tile.entries[3] if cutlass.const_expr(self.kv_pages_extra) else None
            return EntrySources(None, None, smem.ring_base, tile.entries[2], warp_idx, extra)
        atom, mC_hb, mC_mem_hb = tile.entries
        _, tCgC = chunk_views(atom, mC_hb, smem.sK, self.tile_n)
        return EntrySources(atom, tCgC, smem.ring_base, mC_mem_hb, warp_idx)

    def kv_span(self, m_block, rows, seqlen_k, window, entries):
        if cutlass.const_expr(not self.has_compressed):  # D4's span, in the given positions' frame
            if cutlass.const_expr(entries is None):
                return super().kv_span(m_block, rows, seqlen_k, window, entries)
            return KvSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window.left,
                          window.right, self.has_left, self.has_right, entries.positions, entries.kv_start)
        token = m_block * self.tile_m // self.pack_group
        e = entries
        if cutlass.const_expr(self.kv_pages_extra):  # decode: the two caches' lists are every key
            return TwoListSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, e.count,
                               e.topk[token, None], e.topk.shape[1], e.extra_topk[token, None],
                               e.extra_topk.shape[1], e.first)
        if cutlass.const_expr(self.index_mode):  # the list is every key
            return IndexSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, e.count,
                             e.topk[token, None], e.topk.shape[1])
        if cutlass.const_expr(self.has_topk):  # the Q tile's one token's list
            return TopkSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window.left,
                            window.right, self.has_left, self.has_right, e.ratio, e.count,
                            e.topk[token, None], e.topk.shape[1], e.kv_start, e.positions)
        return FusedSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window.left,
                         window.right, self.has_left, self.has_right, e.ratio, e.count, e.kv_start,
                         e.positions)

    def may_hide_rows(self) -> bool:
        # index mode: a token's list may name no row at all (all -1, topk_length 0): the softmax's
        # empty-row path (O = 0, LSE = -inf) must be compiled in, as for an empty window
        return super().may_hide_rows() or self.index_mode

    def masks_inner_tiles(self) -> bool:
        return super().masks_inner_tiles() or self.has_compressed

    def q_first(self) -> bool:
        # a gathered tile's first half-load waits for its index list (the producer warps load it
        # first); Q's TMA issued ahead of it overlaps that wait
        return self.has_topk

    def load_pairs(self, ring, n_blocks, srcs, q_load, warp_idx, uses_before=0, tiles_before=0, q_empty=None):
        if self.kv_pages:  # the FP8 gather's own pipelined loads (sm90_pages.py)
            return self.load_pairs_fp8(ring, n_blocks, srcs, q_load, warp_idx, uses_before, tiles_before, q_empty)
        return super().load_pairs(ring, n_blocks, srcs, q_load, warp_idx, uses_before, tiles_before, q_empty)

    @cute.jit
    def load_kv(self, ring, t, n, span, tma_atom_k, tKgK, tKsK, sources, half=None):
        if cutlass.const_expr(self.has_topk):  # all four producer warps run this
            if n < span.n_cmp:  # (FP8 pages load through load_pairs_fp8, never here)
                self.gather_tile(ring, t, n, span, sources.ring_base, sources.mC_mem_hb, half)
            elif sources.warp_idx == 0:
                ring.load(t, tma_atom_k, tKgK, tKsK, n - span.n_cmp, half)
            else:
                # a TMA tile is warp 0's, but every producer warp waits for its slot half too:
                # a parity wait passes when the barrier is two phases behind, so each warp must
                # wait for every use of a half in turn. Warps that skipped the window's tiles ran
                # ahead into the next Q tile's gathers of a persistent CTA (an unspecified launch
                # failure on the H200, 2026-11-26; tests/test_e_seesaw_protocol.py)
                ring.wait_load(t, half)
        elif cutlass.const_expr(self.has_compressed):
            if n < span.n_cmp:
                ring.load(t, sources.atom, sources.tCgC, tKsK, n, half)
            else:
                ring.load(t, tma_atom_k, tKgK, tKsK, n - span.n_cmp, half)
        else:
            ring.load(t, tma_atom_k, tKgK, tKsK, n, half)

    @staticmethod
    def gather_row(tidx, p: int):
        """The tile row producer thread ``tidx`` gathers in pass p (16 rows a pass, 8 threads a row)."""
        return tidx // UNITS + p * (THREADS_PER_WARPGROUP // UNITS)

    @cute.jit
    def gather_source_row(self, span, n, r):
        """The compressed row that tile row r of compressed tile n holds (``TopkSpan.listed_entry``)."""
        return span.listed_entry(n, r)

    def list_copy_views(self, span, n, c):
        """(src, dst): entry c of compressed tile n's list, one int32 of the token's list in global
        memory and its place in the span's staged (tile_n, slots) SMEM lists (column-major: slot
        s's entries are words s T .. s T + T - 1). Proven on the host (tests/test_e_sm90_host.py)."""
        src = cute.make_tensor(cute.make_ptr(cutlass.Int32, span.idx_row.iterator.toint() + span.list_source(n, c) * 4,
                                             cute.AddressSpace.gmem, assumed_align=4), cute.make_layout(1))
        dst = cute.make_tensor(span.lists.iterator + (span.list_slot(n) * self.tile_n + c), cute.make_layout(1))
        return src, dst

    @cute.jit
    def gather_tile(self, ring, t, n, span, ring_base: cute.Pointer, mC_hb: cute.Tensor, half=None):
        """Top-k: ring use t <- the compressed rows at list positions [n T, n T + T) of the Q
        tile's token, by cp.async (Hopper's TMA has no gather). Producer thread i copies 16-byte
        unit i % 8 of rows i / 8 + 16 p of every 64-column chunk, to ``gather_offset`` (the
        swizzled slot layout, proven on the host), then arrives on the chunk's full barrier when its
        copies have landed (cp.async.mbarrier.arrive.noinc: the barrier counts all 128 threads).
        The seesaw's producer gathers one half of the tile at a time (``half``: its chunks, after
        waiting for that half; the list goes with half 0, which guards it).
        Threads 0 .. T-1 also copy the tile's T list entries to the slot's column of the span's SMEM
        lists before chunk 0's arrival, so chunk 0's barrier covers them: the consumers' masks read
        them there. The slot is free again only after the PV GEMM that follows the mask.
        A position that is not a visible entry (-1, past the list, not yet visible) is zero-filled
        without a read: its score is masked, and a zero V row times P = 0 adds exactly 0. Each copy
        carries an L2 256-byte prefetch and an evict-last policy (common/sm90_gather.py)."""
        s = t % self.slots
        tidx = cute.arch.thread_idx()[0]  # 0 .. 127: the producer warpgroup
        unit = tidx % UNITS
        passes = self.tile_n * UNITS // THREADS_PER_WARPGROUP
        elem = self.dtype.width // 8
        # the rows' list entries are read before the wait for the slot: their latency hides behind
        # it; each kept as the 64-bit address of this thread's unit of the row, and its byte count
        # (16, or 0: a position that is not a visible entry is zero-filled, not read)
        g_base = mC_hb.iterator.toint() + unit * GATHER_BYTES
        row_stride = cutlass.Int64(mC_hb.stride[0] * elem)
        src_addr = cute.make_rmem_tensor(passes, cutlass.Int64)
        src_bytes = cute.make_rmem_tensor(passes, cutlass.Int32)
        for p in cutlass.range_constexpr(passes):
            j = self.gather_source_row(span, n, self.gather_row(tidx, p))
            src_addr[p] = g_base + cutlass.Int64(cutlass.max(j, 0)) * row_stride
            src_bytes[p] = cutlass.Int32(GATHER_BYTES) if j >= 0 else cutlass.Int32(0)
        policy = l2_evict_last_policy()
        chunks = ring.chunk_range(half)
        ring.wait_load(t, half)
        if cutlass.const_expr(chunks.start == 0):  # the load that covers chunk 0 stages the list
            if tidx < self.tile_n:  # the tile's list entries, for the consumers' masks (TopkSpan.tile_list)
                word = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), cutlass.Int32,
                                           num_bits_per_copy=32)
                cute.copy(word, *self.list_copy_views(span, n, tidx))
        s_base = ring_base.toint()
        for c in cutlass.range_constexpr(chunks.start, chunks.stop):
            for p in cutlass.range_constexpr(passes):
                s_off = gather_offset(self.gather_row(tidx, p), unit, c, s, self.tile_n, self.head_dim) * elem
                cp_async_row_unit(s_base + s_off, src_addr[p] + c * CHUNK_COLS * elem, src_bytes[p], policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(ring.full + (s * ring.chunks + c))
