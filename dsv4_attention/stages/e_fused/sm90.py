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
compressed ones from the last (the only one a row can see partly) down to 0. Seams used, all in
stage D1's skeleton: ``kv_span`` (the fused span), ``load_kv`` (the producer's source per tile:
one runtime branch between two TMA descriptors of the same box), ``masks_inner_tiles``, ``q_first``
(top-k: Q's TMA ahead of the first gathered tile, whose issue waits for its index list).

Top-k (``has_topk``, DeepSeek-V4's CSA layers): compressed tile n is list positions [64 n, 64 n + 64)
of the Q tile's one token (``TopkSpan``; pack_group a multiple of tile_m), its rows gathered by the
whole producer warpgroup with cp.async (``gather_tile``) into the same ring slots, the chunk
barriers counting 128 arrivals (``producer_warps``, ``full_arrivals``). Index mode
(``index_mode``, FlashMLA's sparse attention): the lists are a token's only keys, rows of one
tensor (``IndexSpan``: no window tiles, every tile gathered).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from dsv4_attention.common.compressed import FusedSpan, IndexSpan, TopkSpan, set_options, varlen_entries
from dsv4_attention.common.sm90_gather import ROW_UNIT_BYTES, cp_async_row_unit, l2_evict_last_policy
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP
from dsv4_attention.common.sm90_kv_chunks import CHUNK_COLS, gather_offset
from dsv4_attention.stages.d5_sink_merge.sm90 import FlashAttentionD5Sm90

GATHER_BYTES = ROW_UNIT_BYTES  # one cp.async: 8 bf16 columns of a row
UNITS = CHUNK_COLS * 2 // GATHER_BYTES  # 16-byte units of a chunk's 128-byte row


class FlashAttentionESm90(FlashAttentionD5Sm90):
    def __init__(self, dtype, head_dim: int, *, has_compressed: bool = False, has_topk: bool = False,
                 index_mode: bool = False, has_positions: bool = False, **options):
        super().__init__(dtype, head_dim, **options)
        set_options(self, self.tile_m, has_compressed, has_topk, index_mode, has_positions)
        if self.has_topk:
            # every producer thread gathers rows; each chunk's full barrier counts all of them
            self.producer_warps = THREADS_PER_WARPGROUP // 32
            self.full_arrivals = THREADS_PER_WARPGROUP
            # the gather's addresses need more than the TMA producer's 24-32 registers (ptxas spilled
            # at 128-key tiles, and with the seesaw's four half-tile gathers a pair at 40); 16 fewer
            # per consumer thread pay for it (setmaxnreg: 64K per CTA)
            self.consumer_regs -= 16
            self.producer_regs += 16 * self.num_wg

    def kv_span(self, m_block, rows, seqlen_k, window_left, window_right, compress_ratio, n_compressed, mTopk,
                kv_start=0, positions=None):
        if cutlass.const_expr(not self.has_compressed):
            return super().kv_span(m_block, rows, seqlen_k, window_left, window_right, compress_ratio, n_compressed,
                                   mTopk, kv_start, positions)
        token = m_block * self.tile_m // self.pack_group
        if cutlass.const_expr(self.index_mode):  # the list is every key
            return IndexSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, n_compressed,
                             mTopk[token, None], mTopk.shape[1])
        if cutlass.const_expr(self.has_topk):  # the Q tile's one token's list
            return TopkSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window_left,
                            window_right, self.has_left, self.has_right, compress_ratio, n_compressed,
                            mTopk[token, None], mTopk.shape[1], kv_start, positions)
        return FusedSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window_left,
                         window_right, self.has_left, self.has_right, compress_ratio, n_compressed, kv_start,
                         positions)

    def request_entries(self, request, b, mC, mC_mem, mTopk, mPositions, mCuSeqlensQ, mCuSeqlensC):
        if cutlass.const_expr(not (self.varlen and self.has_compressed)):
            return super().request_entries(request, b, mC, mC_mem, mTopk, mPositions, mCuSeqlensQ, mCuSeqlensC)
        return varlen_entries(request, mC, mC_mem, mTopk, mPositions, mCuSeqlensQ, mCuSeqlensC)[:5]

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

    @cute.jit
    def load_kv(self, ring, t, n, span, tma_atom_k, tKgK, tKsK, tma_atom_c, tCgC, gather, half=None):
        if cutlass.const_expr(self.has_topk):  # all four producer warps run this
            ring_base, mC_hb, warp_idx = gather
            if n < span.n_cmp:
                self.gather_tile(ring, t, n, span, ring_base, mC_hb, half)
            elif warp_idx == 0:
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
                ring.load(t, tma_atom_c, tCgC, tKsK, n, half)
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
        """The compressed row that tile row r of compressed tile n holds: the entry at list position
        n T + r where it is a visible entry, else -1 (not read: the row is zero-filled and masked)."""
        pos = n * self.tile_n + r
        j = cutlass.Int32(-1)
        if pos < span.k:
            j = span.idx_row[pos]
        return j if (j >= 0) & (j < span.count) else cutlass.Int32(-1)

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
