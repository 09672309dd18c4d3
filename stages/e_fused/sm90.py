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
one runtime branch between two TMA descriptors of the same box), ``masks_inner_tiles``.

Top-k (``has_topk``, DeepSeek-V4's CSA layers): compressed tile n is list positions [64 n, 64 n + 64)
of the Q tile's one token (``TopkSpan``; pack_group a multiple of tile_m), its rows gathered by the
whole producer warpgroup with cp.async (``gather_tile``) into the same ring slots, the chunk
barriers counting 128 arrivals (``producer_warps``, ``full_arrivals``). Index mode
(``index_mode``, FlashMLA's sparse attention): the lists are a token's only keys, rows of one
tensor (``IndexSpan``: no window tiles, every tile gathered).

The seesaw's leader, for gathered tiles (``seesaw_lead``). A gathered half-tile lands a few
microseconds after its copies are issued, and the producer issues a pair's halves in the order
they are freed (a.L, b.R, a.R, b.L; stage D1), the last, b.L, into the half the leader frees when
its PV over P_b of the previous pair is done. Stage D1's leader frees it after issuing its whole
QK over tile a, and that issue waits for a.R, the third half-load: so b.L started only after a.R
had landed, and the follower, whose QK ends on b.L, waited for two gathers in a row each pair.
Here the leader issues QK over a.L as one wgmma group, frees b's first half as soon as the PV
before it is done, then issues QK over a.R (FlashMLA's order); and it frees a.L right after its
own PV over it, before it waits for the follower's max. The handoffs and the buffers' reuse
argument (stage D1) are unchanged: every release is of the same reads, only earlier.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup

from dsv4_attention.common.compressed import FusedSpan, IndexSpan, TopkSpan, set_options, varlen_entries
from dsv4_attention.common.p_staging import as_a_operand, convert_p_packed
from dsv4_attention.common.sm90_gather import ROW_UNIT_BYTES, cp_async_row_unit, l2_evict_last_policy
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP, gemm
from dsv4_attention.common.sm90_kv_chunks import CHUNK_COLS, KvChunkRing, gather_offset
from dsv4_attention.common.smem_p import store_p
from dsv4_attention.common.softmax import scale_rows
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

    @cute.jit
    def load_kv(self, ring, t, n, span, tma_atom_k, tKgK, tKsK, tma_atom_c, tCgC, gather, half=None):
        if cutlass.const_expr(self.has_topk):  # all four producer warps run this
            ring_base, mC_hb, warp_idx = gather
            if n < span.n_cmp:
                self.gather_tile(ring, t, n, span, ring_base, mC_hb, half)
            elif warp_idx == 0:
                ring.load(t, tma_atom_k, tKgK, tKsK, n - span.n_cmp, half)
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

    @cute.jit
    def gemm_qk_chunks(self, ring: KvChunkRing, t, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor,
                       tCrB: cute.Tensor, first: int, end: int):
        """One wgmma group of acc (+)= A B over chunks [first, end) of tile use t's slot, each
        after its full barrier; the group starting at chunk 0 overwrites acc, a later one adds."""
        s = t % ring.slots
        phase = (t // ring.slots) & 1
        per_chunk = cute.size(tCrA, mode=[2]) // ring.chunks
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, first > 0)
        for c in cutlass.range_constexpr(first, end):
            cute.arch.mbarrier_wait(ring.full + (s * ring.chunks + c), phase)
            for i in cutlass.range_constexpr(c * per_chunk, (c + 1) * per_chunk):
                cute.gemm(atom, acc, tCrA[None, None, i], tCrB[None, None, i], acc)
                atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def seesaw_lead(self, k, has_b: cutlass.Constexpr[bool], mmas, ring: KvChunkRing, handoffs, ops, acc_s, acc_o,
                    r_p, softmax, stat_rows, row_stats, span, n_blocks, first_row):
        """Warpgroup 0, pair k, for gathered tiles (stage D1's leader otherwise; the module
        docstring says what changes):

            S_a = Q K_a[L]^T (group); [PV_bL of pair k - 1 done: release b's first half];
            S_a += Q K_a[R]^T (group); release a's second half; mask
            m_a -> SMEM, hand over (handoff 0); P_a, l, r_a; O_L = O_L r_a + P_a V_a[:, L] (RS)
            [PV_aL done: release a's first half]; wait for handoff 1; m_b; r_b
            P_a r_b -> sP[0], hand over (handoff 2); O_L *= r_b; O_L += P_b V_b[:, L] (SS)"""
        if cutlass.const_expr(not self.has_topk):
            FlashAttentionD5Sm90.seesaw_lead(self, k, has_b, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax,
                                             stat_rows, row_stats, span, n_blocks, first_row)
        else:
            qk_mma, pv_mma, pv_own_mma = mmas
            t = 2 * k
            tSrK = ops.tSrK[None, None, None, t % self.slots]
            self.gemm_qk_chunks(ring, t, qk_mma, acc_s, ops.tSrQ, tSrK, 0, ring.r_chunk)
            if k > 0:  # pair k - 1's PV over P_b is done: b's first half goes to the producer now
                warpgroup.wait_group(1)
                ring.release(t - 1, 0)
            self.gemm_qk_chunks(ring, t, qk_mma, acc_s, ops.tSrQ, tSrK, ring.r_chunk, ring.chunks)
            warpgroup.wait_group(0)
            ring.release(t, 1)  # the follower's PV over a's second half holds its own count
            if t == 0:
                self.mask_s(span, acc_s, ops.tScS, n_blocks - 1 - t, first_row, first=True)
            else:
                self.mask_s(span, acc_s, ops.tScS, n_blocks - 1 - t, first_row, first=False)
            tile_max = softmax.tile_max(acc_s)
            self.publish_max(softmax.new_max(tile_max), stat_rows, row_stats, 0)
            handoffs[0].arrive()
            row_scale = softmax.update(acc_s, is_first=False, tile_max=tile_max)
            convert_p_packed(acc_s, r_p)
            scale_rows(acc_o, row_scale)
            gemm(pv_own_mma, acc_o, as_a_operand(r_p), ops.tOrV_own[None, None, None, t % self.slots], zero_init=False)
            warpgroup.wait_group(0)  # PV_aL done: a's first half (and its staged list, read by the mask) is free
            ring.release(t, 0)
            handoffs[1].wait(k)  # the follower's max (without b: the leader's own, r_b = 1)
            row_scale = softmax.follow(self.read_max(stat_rows, row_stats, 1))
            scale_rows(acc_s, row_scale)
            store_p(acc_s, r_p, ops.tPsP[None, None, None, self.own_p_buffer(0)])  # r_p is free again
            handoffs[2].arrive()
            scale_rows(acc_o, row_scale)
            if cutlass.const_expr(has_b):
                ring.wait_full(t + 1, 0, self.o_width // CHUNK_COLS)  # the follower's QK waited for them
                gemm(pv_mma, acc_o, ops.tOrP_smem[None, None, None, self.own_p_buffer(1)],
                     ops.tOrV[None, None, None, (t + 1) % self.slots], zero_init=False)
