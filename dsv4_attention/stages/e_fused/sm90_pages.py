"""Stage E's gather from a paged FP8 cache on Hopper (serving: decode and prefill from the cache
an inference engine keeps; common/kv_cache.py's MODEL1 layout, ``kv_pages`` tokens a page).

Index mode's producer warpgroup fills each ring slot itself, as its bf16 gather does, but from
the cache's bytes (common/fp8_dequant.py). The seesaw loads a slot half by half (chunks 0-3,
then 4-7); per half the producer's time after the slot frees must be its stores alone, so every
global read of a half is issued before the wait for the slot:

    rows       producer thread i owns piece k = i % 4 of tile rows i / 4 + 32 p (p < tile_n / 32)
               (``piece_row``); each row's list entry, then its 8 scale bytes (one load)
    staged     NoPE chunks c of the half, up to ``STAGED`` of them: piece k of chunk c is the 16
               e4m3 bytes at data + 64 c + 16 k (bf16 units 2k, 2k + 1), copied raw by cp.async
               into this thread's own 16 bytes of the staging buffer (``staging_offset``), one
               commit group; no register holds them across the wait
    held       the half's other NoPE chunk (chunk 3: the staging buffer is what the hd-512 SMEM
               has left, 12 KiB, three chunks) loaded into registers (8 a thread)
    -- wait for the slot half --
    RoPE       chunk 7 (bf16, 16 bytes a unit at data + 448 + 16 u): cp.async straight into the
               slot, its barrier arrival on the copies' completion (the bf16 gather's way)
    dequant    per staged or held chunk: ld.shared the 16 bytes (after the group's wait), times
               2^(scale byte c - 127) -> two bf16 units, st.shared at the units' swizzled slot
               places (``gather_offset``, as the bf16 gather's cp.async), proxy fence, one
               arrival a thread on the chunk's full barrier (it counts the 128 producer threads)

A list position that names no visible token is zero-filled without a read (cp.async's source
size 0, the loads' zero address flag). The address maps are the format's own
(``kv_cache.token_bytes`` / ``unit_bytes``, proven in tests/test_kv_cache.py); the pieces, rows
and staging places are proven on the host in tests/test_e_fp8_gather_host.py (every (row, unit)
of a chunk written once, each thread's staging bytes its own).
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.fp8_dequant import (
    dequant_e4m3x8,
    load_8_bytes,
    load_16_bytes,
    load_shared_16_bytes,
    store_16_bytes,
)
from dsv4_attention.common.kv_cache import TILE, TILES, token_bytes, unit_bytes
from dsv4_attention.common.sm90_gather import cp_async_row_unit, l2_evict_last_policy
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP
from dsv4_attention.common.sm90_kv_chunks import gather_offset

PIECE = 16  # bytes of one copy or load: 16 e4m3 values, bf16 units 2k and 2k + 1 of a chunk
PIECES = TILE // PIECE  # 4 pieces a row's chunk
ROWS_PER_PASS = THREADS_PER_WARPGROUP // PIECES  # 32
STAGED = 3  # NoPE chunks of a half staged raw in SMEM (12 KiB at tile_n 64: what hd 512 leaves)


def piece_row(tidx, p: int):
    """The tile row producer thread ``tidx`` reads in pass p."""
    return tidx // PIECES + p * ROWS_PER_PASS


def piece_units(tidx):
    """The two bf16 units (of 8 dims) of a 64-column chunk that thread ``tidx``'s piece holds."""
    k = tidx % PIECES
    return 2 * k, 2 * k + 1


def staging_offset(chunk_i: int, p: int, tidx, passes: int):
    """Byte offset in the staging buffer of thread ``tidx``'s piece of staged chunk ``chunk_i``
    (0 .. STAGED - 1 of its half), pass p: thread-private, 16-byte aligned, a warp's 32 pieces
    one contiguous 512 bytes (conflict-free ld.shared.v4)."""
    return ((chunk_i * passes + p) * THREADS_PER_WARPGROUP + tidx) * PIECE


def staging_bytes(tile_n: int) -> int:
    return STAGED * tile_n * TILE


class PagedFp8Gather:
    """The FP8 page gather's methods, mixed into stage E's sm90 kernel class."""

    @cute.jit
    def gather_fp8_tile(self, ring, t, n, span, ring_base: cute.Pointer, mPages: cute.Tensor, staging, half,
                        mExtra=None):
        """Ring use t, half ``half`` <- the cache tokens at list positions [n T, n T + T) of the Q
        tile's token, dequantized (module doc). ``mPages``: (pages, bytes) over the cache, a
        page's bytes contiguous, ``mPages.stride[0]`` bytes apart; ``staging``: the staging
        buffer's shared-window address. ``mExtra`` (``kv_pages_extra``): the second cache alike,
        its tokens named by resolved entries >= ``span.first`` (common/compressed.TwoListSpan)."""
        s = t % self.slots
        tidx = cute.arch.thread_idx()[0]  # 0 .. 127: the producer warpgroup
        u0, _ = piece_units(tidx)
        passes = self.tile_n // ROWS_PER_PASS
        chunks = ring.chunk_range(half)
        nope = [c for c in chunks if c < TILES]
        staged, held, rope = nope[:STAGED], nope[STAGED:], [c for c in chunks if c >= TILES]
        # the scale words the half's tiles need (word w: tiles 4 w .. 4 w + 3)
        words = sorted({c // 4 for c in nope})
        base = mPages.iterator.toint()
        page_stride = cutlass.Int64(mPages.stride[0])
        policy = l2_evict_last_policy()
        # per row: its token's first data byte (token 0's where the position names none: a copy
        # of 0 bytes still takes an address), the copies' byte count (16 or 0), the loads' flag
        # address (0: no token, zeros without a read) and the scale words
        src = cute.make_rmem_tensor(passes, cutlass.Int64)
        flag = cute.make_rmem_tensor(passes, cutlass.Int64)
        nbytes = cute.make_rmem_tensor(passes, cutlass.Int32)
        scales = cute.make_rmem_tensor((2, passes), cutlass.Int32)
        for p in cutlass.range_constexpr(passes):
            j = self.gather_source_row(span, n, piece_row(tidx, p))
            d_off, s_off = token_bytes(cutlass.Int64(cutlass.max(j, 0)), self.kv_pages, page_stride)
            src[p] = base + d_off
            to_scales = s_off - d_off  # from the token's data to its scale bytes
            if cutlass.const_expr(mExtra is not None):  # a resolved entry >= first: the second cache's slot
                d_b, s_b = token_bytes(cutlass.Int64(cutlass.max(j - span.first, 0)), self.kv_pages_extra,
                                       cutlass.Int64(mExtra.stride[0]))
                in_b = j >= span.first
                src[p] = mExtra.iterator.toint() + d_b if in_b else src[p]
                to_scales = s_b - d_b if in_b else to_scales
            flag[p] = src[p] if j >= 0 else cutlass.Int64(0)
            nbytes[p] = cutlass.Int32(PIECE) if j >= 0 else cutlass.Int32(0)
            if cutlass.const_expr(len(words) > 0):
                got = load_8_bytes(to_scales, flag[p])  # the row's 8 scale bytes
                for w in cutlass.range_constexpr(len(words)):
                    scales[words[w], p] = got[words[w]]
        for ci in cutlass.range_constexpr(len(staged)):
            off = unit_bytes(staged[ci], u0)[0]
            for p in cutlass.range_constexpr(passes):
                cp_async_row_unit(staging + staging_offset(ci, p, tidx, passes), src[p] + off, nbytes[p], policy)
        cute.arch.cp_async_commit_group()
        raw_held = [[load_16_bytes(cutlass.Int64(unit_bytes(c, u0)[0]), flag[p]) for p in range(passes)]
                    for c in held]
        ring.wait_load(t, half)
        if cutlass.const_expr(chunks.start == 0):  # the load that covers chunk 0 stages the list
            if tidx < self.tile_n:
                lsrc, ldst = self.list_copy_views(span, n, tidx)
                if cutlass.const_expr(mExtra is not None):  # two lists: the resolved entry (TwoListSpan)
                    ldst[0] = span.listed_entry(n, tidx)
                else:
                    ldst[0] = lsrc[0]
        s_base = ring_base.toint()
        for c in rope:  # bf16 RoPE: no conversion, straight into the slot
            for p in cutlass.range_constexpr(passes):
                for h in cutlass.range_constexpr(2):
                    off = unit_bytes(c, u0 + h)[0]
                    place = gather_offset(piece_row(tidx, p), u0 + h, c, s, self.tile_n, self.head_dim) * 2
                    cp_async_row_unit(s_base + place, src[p] + off, nbytes[p], policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(ring.full + (s * ring.chunks + c))
        cute.arch.cp_async_wait_group(0)  # this thread's staged pieces have landed
        for ci in cutlass.range_constexpr(len(nope)):
            c = nope[ci]
            for p in cutlass.range_constexpr(passes):
                if cutlass.const_expr(ci < len(staged)):
                    raw = load_shared_16_bytes(staging + staging_offset(ci, p, tidx, passes))
                else:
                    raw = raw_held[ci - len(staged)][p]
                scale = (scales[c // 4, p] >> (8 * (c % 4))) & 0xFF
                for h in cutlass.range_constexpr(2):
                    out = dequant_e4m3x8(raw[2 * h], raw[2 * h + 1], scale)
                    place = gather_offset(piece_row(tidx, p), u0 + h, c, s, self.tile_n, self.head_dim) * 2
                    store_16_bytes(s_base + place, out)
            # the stores are the generic proxy, the wgmma's reads the async one
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(ring.full + (s * ring.chunks + c))
