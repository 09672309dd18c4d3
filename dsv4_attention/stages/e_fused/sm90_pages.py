"""Stage E's gather from a paged FP8 cache on Hopper (serving: decode and prefill from the cache
an inference engine keeps; common/kv_cache.py's MODEL1 layout, ``kv_pages`` tokens a page).

Index mode's producer warpgroup fills each ring slot itself, as its bf16 gather does, but from
the cache's bytes (common/fp8_dequant.py): producer thread i owns 16-byte unit u = i % 8 of tile
rows i / 8 + 16 p (p < tile_n / 16) in every 64-column chunk; per row it reads

    the scale words its chunks need (4 bytes each) once, before waiting for the slot;
    chunk c < 7:  8 e4m3 bytes at data + 64 c + 8 u, times 2^(scale byte c - 127) -> 8 bf16
    chunk 7:      16 bf16 bytes of RoPE at data + 448 + 16 u

(``kv_cache.token_bytes`` / ``unit_bytes``: the format's own address map, proven on the host in
tests/test_kv_cache.py), and stores the 16 bytes where the bf16 gather's cp.async would have
put them (``gather_offset``, the swizzled slot). A chunk is handed over by a proxy fence and one
arrival a thread on its full barrier (the barrier counts the 128 producer threads, as for the
bf16 gather). A list position that names no visible token reads nothing and stores zeros.
"""

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.fp8_dequant import load_8_bytes, load_unit, store_16_bytes
from dsv4_attention.common.kv_cache import TILES, token_bytes, unit_bytes
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP
from dsv4_attention.common.sm90_kv_chunks import gather_offset

UNITS = 8  # 16-byte bf16 units of a 64-column chunk


class PagedFp8Gather:
    """The FP8 page gather's methods, mixed into stage E's sm90 kernel class."""

    @cute.jit
    def gather_fp8_tile(self, ring, t, n, span, ring_base: cute.Pointer, mPages: cute.Tensor, half=None):
        """Ring use t <- the cache tokens at list positions [n T, n T + T) of the Q tile's token,
        dequantized (module doc). ``mPages``: (pages, bytes) over the cache, a page's bytes
        contiguous, ``mPages.stride[0]`` bytes apart. ``half``: the seesaw's half of the chunks."""
        s = t % self.slots
        tidx = cute.arch.thread_idx()[0]  # 0 .. 127: the producer warpgroup
        unit = tidx % UNITS
        passes = self.tile_n * UNITS // THREADS_PER_WARPGROUP
        chunks = ring.chunk_range(half)
        base = mPages.iterator.toint()
        page_stride = cutlass.Int64(mPages.stride[0])
        # per row: its token's first data byte, or 0 where the position names no token (the
        # loads' flag), and the scale words this load's chunks need (word w: tiles 4 w .. 4 w + 3)
        words = sorted({unit_bytes(c, 0)[2] // 4 for c in chunks if c < TILES})
        data = cute.make_rmem_tensor(passes, cutlass.Int64)
        scales = cute.make_rmem_tensor((2, passes), cutlass.Int32)
        for p in cutlass.range_constexpr(passes):
            j = self.gather_source_row(span, n, self.gather_row(tidx, p))
            d_off, s_off = token_bytes(cutlass.Int64(cutlass.max(j, 0)), self.kv_pages, page_stride)
            data[p] = base + d_off if j >= 0 else cutlass.Int64(0)
            if cutlass.const_expr(len(words) > 0):
                got = load_8_bytes(s_off - d_off, data[p])  # the row's 8 scale bytes
                for wi in cutlass.range_constexpr(len(words)):
                    scales[words[wi], p] = got[words[wi]]
        ring.wait_load(t, half)
        if cutlass.const_expr(chunks.start == 0):  # the load that covers chunk 0 stages the list
            if tidx < self.tile_n:
                src, dst = self.list_copy_views(span, n, tidx)
                dst[0] = src[0]
        s_base = ring_base.toint()
        for c in cutlass.range_constexpr(chunks.start, chunks.stop):
            off, _, tile = unit_bytes(c, unit)
            for p in cutlass.range_constexpr(passes):
                out = load_unit(data[p], off, tile, None if tile is None else scales[tile // 4, p])
                row = self.gather_row(tidx, p)
                store_16_bytes(s_base + gather_offset(row, unit, c, s, self.tile_n, self.head_dim) * 2, out)
            # the stores are the generic proxy, the wgmma's reads the async one
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(ring.full + (s * ring.chunks + c))
