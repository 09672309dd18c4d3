"""Stage E's gather from a paged FP8 cache on Hopper (serving: decode and prefill from the cache
an inference engine keeps; common/kv_cache.py's MODEL1 layout, ``kv_pages`` tokens a page).

Index mode's producer warpgroup fills each ring slot itself, as its bf16 gather does, but from
the cache's bytes (common/fp8_dequant.py). The seesaw loads a slot half by half (chunks 0-3,
then 4-7) in FlashMLA's order, a pair of tiles (a, b) at a time: a0 b1 a1 b0. The producer, not
the consumers, sets the pace of an FP8 decode (ncu on an H200: its slot waits never stall, its
copies' data and list entries do; docs/serving.md), so each half-load is cut in two steps and
the two run a half-load apart (``load_pairs``): issue (L i+1) before convert (L i).

    issue      (the rows' list entries were read a pair ahead: ``pair_entries``) each row's 8
               scale bytes into a register (the half's word); wait for the slot half; the half
               that covers chunk 0 stages the tile's list for the consumers' masks; each row's
               NoPE bytes copied raw by cp.async into the slot half's own upper two chunk
               regions (``raw_offset``: thread-private 16-byte pieces, 16 KiB for half 0's four
               chunks, 12 KiB for half 1's three); RoPE (chunk 7, bf16) by cp.async straight to
               its place, its barrier arrival on the copies' completion; one commit group
    convert    wait for the half-load's group; the lower chunks (0-1, or 4): ld.shared each
               piece, times 2^(scale byte - 127) -> two bf16 units, st.shared at their swizzled
               places (``gather_offset``), proxy fence, one arrival a thread on the chunk's full
               barrier; then every piece of the upper chunks into registers, a producer-only
               named barrier (``Sm90FwdBarrier.FP8_GATHER``: no thread overwrites raw bytes
               another has not read), and the upper chunks alike

Producer thread i owns piece k = i % 4 (16 e4m3 bytes: bf16 units 2k, 2k + 1) of tile rows
i / 4 + 32 p (``piece_row``). A list position that names no visible token is zero-filled without
a read (cp.async's source size 0, the scale load's zero address flag). The address maps are the
format's own (``kv_cache.token_bytes`` / ``unit_bytes``, proven in tests/test_kv_cache.py); the
pieces, rows and raw places are proven on the host in tests/test_e_fp8_gather_host.py (every
(row, unit) of a chunk written once, each thread's raw bytes its own and inside the upper
regions, never under a lower chunk's or RoPE's writes).
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.fp8_dequant import dequant_e4m3x8, load_8_bytes, load_shared_16_bytes, store_16_bytes
from dsv4_attention.common.kv_cache import TILE, TILES, token_bytes, unit_bytes
from dsv4_attention.common.sm90_barriers import Sm90FwdBarrier
from dsv4_attention.common.sm90_gather import cp_async_row_unit, l2_evict_last_policy
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP
from dsv4_attention.common.sm90_kv_chunks import gather_offset

PIECE = 16  # bytes of one copy: 16 e4m3 values, bf16 units 2k and 2k + 1 of a chunk
PIECES = TILE // PIECE  # 4 pieces a row's chunk
ROWS_PER_PASS = THREADS_PER_WARPGROUP // PIECES  # 32
UPPER = 2  # a half's last two NoPE chunks: their regions hold the half's raw bytes until converted


def piece_row(tidx, p: int):
    """The tile row producer thread ``tidx`` reads in pass p."""
    return tidx // PIECES + p * ROWS_PER_PASS


def piece_units(tidx):
    """The two bf16 units (of 8 dims) of a 64-column chunk that thread ``tidx``'s piece holds."""
    k = tidx % PIECES
    return 2 * k, 2 * k + 1


def half_chunks(chunks: range) -> tuple:
    """(lower, upper, rope) chunks of a slot half: NoPE chunks converted before the raw bytes'
    regions are overwritten, the last ``UPPER`` NoPE chunks (their regions are the raw area),
    and bf16 RoPE."""
    nope = [c for c in chunks if c < TILES]
    return nope[:-UPPER], nope[-UPPER:], [c for c in chunks if c >= TILES]


def raw_area(slot, upper: list, tile_n: int, head_dim: int):
    """Byte offset in the ring of a slot half's raw area: its upper chunks' regions, contiguous
    (``gather_offset``'s chunk c of slot s spans tile_n x 128 bytes from row 0, unit 0)."""
    return gather_offset(0, 0, upper[0], slot, tile_n, head_dim) * 2


def raw_offset(chunk_i: int, p: int, tidx, passes: int):
    """Byte offset in the raw area of thread ``tidx``'s piece of the half's NoPE chunk
    ``chunk_i`` (0 .. 3), pass p: thread-private, 16-byte aligned, a warp's 32 pieces one
    contiguous 512 bytes (conflict-free ld.shared.v4)."""
    return ((chunk_i * passes + p) * THREADS_PER_WARPGROUP + tidx) * PIECE


class PagedFp8Gather:
    """The FP8 page gather's methods, mixed into stage E's sm90 kernel class."""

    @cute.jit
    def fp8_row_source(self, span, j, base, page_stride, mExtra):
        """(address of resolved entry j's first data byte, the offset from there to its 8 scale
        bytes); token 0's for j < 0 (a copy of 0 bytes still takes an address). ``mExtra``
        (``kv_pages_extra``): entries >= ``span.first`` are the second cache's slots."""
        d_off, s_off = token_bytes(cutlass.Int64(cutlass.max(j, 0)), self.kv_pages, page_stride)
        src = cutlass.Int64(base + d_off)
        to_scales = cutlass.Int64(s_off - d_off)
        if cutlass.const_expr(mExtra is not None):
            d_b, s_b = token_bytes(cutlass.Int64(cutlass.max(j - span.first, 0)), self.kv_pages_extra,
                                   cutlass.Int64(mExtra.stride[0]))
            in_b = j >= span.first
            if in_b:
                src = cutlass.Int64(mExtra.iterator.toint() + d_b)
                to_scales = cutlass.Int64(s_b - d_b)
        return src, to_scales

    @cute.jit
    def pair_entries(self, span, n, out):
        """``out`` (passes, 2) <- the resolved entries of this thread's rows of tiles n and n - 1
        (a visit pair), -1 for a tile before the first."""
        tidx = cute.arch.thread_idx()[0]
        for i in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(self.tile_n // ROWS_PER_PASS):
                out[p, i] = cutlass.Int32(-1)
                if n - i >= 0:
                    out[p, i] = self.gather_source_row(span, n - i, piece_row(tidx, p))

    @cute.jit
    def issue_fp8_half(self, ring, t, n, span, entries, i: int, sources, half: int, scales):
        """Ring use t, half ``half`` <- tile n's rows (``entries[:, i]``), step one (module doc):
        the scale words into ``scales`` (passes,), the raw copies and RoPE issued, one group."""
        s = t % self.slots
        tidx = cute.arch.thread_idx()[0]  # 0 .. 127: the producer warpgroup
        u0, _ = piece_units(tidx)
        passes = self.tile_n // ROWS_PER_PASS
        mPages, mExtra = sources.mC_mem_hb, sources.extra
        lower, upper, rope = half_chunks(ring.chunk_range(half))
        nope = lower + upper
        word = nope[0] // 4  # the half's NoPE chunks share one scale word (bytes 4 w .. 4 w + 3)
        assert all(c // 4 == word for c in nope)
        base = mPages.iterator.toint()
        page_stride = cutlass.Int64(mPages.stride[0])
        policy = l2_evict_last_policy()
        src = cute.make_rmem_tensor(passes, cutlass.Int64)
        nbytes = cute.make_rmem_tensor(passes, cutlass.Int32)
        for p in cutlass.range_constexpr(passes):
            j = entries[p, i]
            src[p], to_scales = self.fp8_row_source(span, j, base, page_stride, mExtra)
            nbytes[p] = cutlass.Int32(PIECE) if j >= 0 else cutlass.Int32(0)
            scales[p] = load_8_bytes(to_scales, src[p] if j >= 0 else cutlass.Int64(0))[word]
        ring.wait_load(t, half)
        if cutlass.const_expr(half == 0):  # the load that covers chunk 0 stages the list
            if tidx < self.tile_n:
                lsrc, ldst = self.list_copy_views(span, n, tidx)
                if cutlass.const_expr(mExtra is not None):  # two lists: the resolved entry (TwoListSpan)
                    ldst[0] = span.listed_entry(n, tidx)
                else:
                    ldst[0] = lsrc[0]
        s_base = sources.ring_base.toint()
        raw = s_base + raw_area(s, upper, self.tile_n, self.head_dim)
        for ci in cutlass.range_constexpr(len(nope)):
            off = unit_bytes(nope[ci], u0)[0]
            for p in cutlass.range_constexpr(passes):
                cp_async_row_unit(raw + raw_offset(ci, p, tidx, passes), src[p] + off, nbytes[p], policy)
        for c in rope:  # bf16 RoPE: no conversion, straight into the slot
            for p in cutlass.range_constexpr(passes):
                for h in cutlass.range_constexpr(2):
                    place = gather_offset(piece_row(tidx, p), u0 + h, c, s, self.tile_n, self.head_dim) * 2
                    cp_async_row_unit(s_base + place, src[p] + unit_bytes(c, u0 + h)[0], nbytes[p], policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(ring.full + (s * ring.chunks + c))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def convert_fp8_half(self, ring, t, sources, half: int, scales, newer: int):
        """Ring use t, half ``half``, step two (module doc): ``scales`` its rows' scale words;
        ``newer`` the commit groups issued after its own (1 in the pipeline, 0 at its end)."""
        s = t % self.slots
        tidx = cute.arch.thread_idx()[0]
        u0, _ = piece_units(tidx)
        passes = self.tile_n // ROWS_PER_PASS
        lower, upper, _ = half_chunks(ring.chunk_range(half))
        s_base = sources.ring_base.toint()
        raw = s_base + raw_area(s, upper, self.tile_n, self.head_dim)
        cute.arch.cp_async_wait_group(newer)  # this thread's raw pieces of the half have landed
        for ci in cutlass.range_constexpr(len(lower)):
            for p in cutlass.range_constexpr(passes):
                self.store_fp8_piece(load_shared_16_bytes(raw + raw_offset(ci, p, tidx, passes)), lower[ci], p,
                                     scales[p], s, s_base)
            # the stores are the generic proxy, the wgmma's reads the async one
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(ring.full + (s * ring.chunks + lower[ci]))
        held = [[load_shared_16_bytes(raw + raw_offset(len(lower) + ui, p, tidx, passes)) for p in range(passes)]
                for ui in range(UPPER)]
        # every producer thread has read its raw pieces: the upper regions may be overwritten
        cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.FP8_GATHER), number_of_threads=THREADS_PER_WARPGROUP)
        for ui in cutlass.range_constexpr(UPPER):
            for p in cutlass.range_constexpr(passes):
                self.store_fp8_piece(held[ui][p], upper[ui], p, scales[p], s, s_base)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(ring.full + (s * ring.chunks + upper[ui]))

    @cute.jit
    def store_fp8_piece(self, raw, c: int, p: int, scale_word, s, s_base):
        """One raw piece (4 words: 16 e4m3 of chunk c, row ``piece_row(tidx, p)``) times its
        scale byte, stored as its two bf16 units in slot s (``s_base``: the ring's address)."""
        tidx = cute.arch.thread_idx()[0]
        u0, _ = piece_units(tidx)
        scale = (scale_word >> (8 * (c % 4))) & 0xFF
        for h in cutlass.range_constexpr(2):
            out = dequant_e4m3x8(raw[2 * h], raw[2 * h + 1], scale)
            place = gather_offset(piece_row(tidx, p), u0 + h, c, s, self.tile_n, self.head_dim) * 2
            store_16_bytes(s_base + place, out)

    @cute.jit
    def load_pairs_fp8(self, ring, n_blocks, srcs, q_load, warp_idx, uses_before, tiles_before, q_empty):
        """The seesaw's loads of a Q tile (``load_pairs``' order: a0 b1 a1 b0 a pair, the last
        pair of an odd count a alone) pipelined a half-load deep, issue (L i+1) before convert
        (L i), the rows' entries read a pair ahead (module doc); Q's TMA first (``q_first``). A
        missing b commits an empty group in its place, so each issue position adds one group and
        a convert always has one newer group in flight (none for the Q tile's last)."""
        span, sources = srcs[0], srcs[-1]  # load_kv's span and EntrySources
        passes = self.tile_n // ROWS_PER_PASS
        self.issue_q(q_load, warp_idx, tiles_before, q_empty)
        entries = cute.make_rmem_tensor((passes, 2), cutlass.Int32)
        ahead = cute.make_rmem_tensor((passes, 2), cutlass.Int32)
        s_a0 = cute.make_rmem_tensor(passes, cutlass.Int32)
        s_a1 = cute.make_rmem_tensor(passes, cutlass.Int32)
        s_b1 = cute.make_rmem_tensor(passes, cutlass.Int32)
        s_b0 = cute.make_rmem_tensor(passes, cutlass.Int32)
        self.pair_entries(span, span.visit_tile(0), entries)
        for k in cutlass.range((n_blocks + 1) // 2, unroll=1):
            t_a = uses_before + 2 * k
            n_a = span.visit_tile(2 * k)  # tile a; b is n_a - 1
            has_b = 2 * k + 1 < n_blocks
            self.pair_entries(span, n_a - 2, ahead)  # the next pair's rows
            self.issue_fp8_half(ring, t_a, n_a, span, entries, 0, sources, 0, s_a0)
            if k > 0:
                self.convert_fp8_half(ring, t_a - 1, sources, 0, s_b0, 1)  # the previous pair's b0
            if has_b:
                self.issue_fp8_half(ring, t_a + 1, n_a - 1, span, entries, 1, sources, 1, s_b1)
            else:
                cute.arch.cp_async_commit_group()
            self.convert_fp8_half(ring, t_a, sources, 0, s_a0, 1)
            self.issue_fp8_half(ring, t_a, n_a, span, entries, 0, sources, 1, s_a1)
            if has_b:
                self.convert_fp8_half(ring, t_a + 1, sources, 1, s_b1, 1)
                self.issue_fp8_half(ring, t_a + 1, n_a - 1, span, entries, 1, sources, 0, s_b0)
            else:
                cute.arch.cp_async_commit_group()
            self.convert_fp8_half(ring, t_a, sources, 1, s_a1, 1)
            for p in cutlass.range_constexpr(passes):
                for i in cutlass.range_constexpr(2):
                    entries[p, i] = ahead[p, i]
        if n_blocks % 2 == 0 and n_blocks > 0:  # the last pair's b0
            self.convert_fp8_half(ring, uses_before + n_blocks - 1, sources, 0, s_b0, 0)
