"""Stage E's sm90 FP8 page gather (stages/e_fused/sm90_pages.py), on the host: its thread maps.

Each producer thread copies 16-byte pieces of e4m3 (two bf16 units) raw into its own bytes of the
slot half's upper two chunk regions, then dequantizes them into the slot. Proven here with the
kernel's own functions (``piece_row``, ``piece_units``, ``half_chunks``, ``raw_area``,
``raw_offset``, ``kv_cache.unit_bytes``, ``gather_offset``): every (row, unit) of a chunk is read
and written by exactly one thread once, a piece's 16 bytes are its two units' 8 + 8 in order, no
two (thread, chunk, pass) share a raw byte, the raw bytes lie inside the upper chunks' regions of
their slot half, and no write made before the producer's barrier (the lower chunks' bf16, RoPE's
copies) lands on them. Negative controls: the bf16 gather's 8-threads-a-row map, a raw offset
without the thread, and a raw area over the lower chunks are rejected.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32

from dsv4_attention.common import jit
from dsv4_attention.common import kv_cache as kc
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP
from dsv4_attention.common.sm90_kv_chunks import gather_offset
from dsv4_attention.stages.e_fused import sm90_pages as pg

TILE_N = 64
PASSES = TILE_N // pg.ROWS_PER_PASS


def coverage(row_of, units_of):
    """(row, unit) -> the (thread, pass) pairs that write it, for one chunk."""
    seen: dict = {}
    for tidx in range(THREADS_PER_WARPGROUP):
        for p in range(PASSES):
            for u in units_of(tidx):
                seen.setdefault((row_of(tidx, p), u), []).append((tidx, p))
    return seen


def covers_once(seen) -> bool:
    want = {(r, u) for r in range(TILE_N) for u in range(8)}
    return set(seen) == want and all(len(v) == 1 for v in seen.values())


@pytest.mark.proof
def test_pieces_cover_each_row_unit_once():
    assert covers_once(coverage(pg.piece_row, pg.piece_units))


@pytest.mark.proof
def test_coverage_checker_rejects_the_bf16_gathers_map():
    # the bf16 gather's rows (8 threads a row, 16 rows a pass) with two units a thread: half the
    # rows twice over, the other half never
    assert not covers_once(coverage(lambda t, p: t // 8 + 16 * p, pg.piece_units))


@pytest.mark.proof
@pytest.mark.parametrize("chunk", range(8))
def test_a_piece_is_its_two_units_in_order(chunk):
    """NoPE: the 16 bytes at unit 2k's offset are units 2k then 2k + 1 (8 e4m3 bytes each, one
    scale: the chunk's), 16-byte aligned in the token (so in the page: 576 = 36 x 16). RoPE: each
    unit its own 16 bytes, where the format puts dims 448 + 8 u."""
    for tidx in range(THREADS_PER_WARPGROUP):
        u0, u1 = pg.piece_units(tidx)
        off0, n0, tile0 = kc.unit_bytes(chunk, u0)
        off1, n1, tile1 = kc.unit_bytes(chunk, u1)
        if chunk < kc.TILES:
            assert (n0, n1) == (8, 8) and off1 == off0 + 8 and off0 % pg.PIECE == 0
            assert tile0 == tile1 == chunk
        else:
            assert (n0, n1) == (16, 16) and off0 == kc.NOPE_DIMS + 16 * u0 and off1 == off0 + 16
    assert THREADS_PER_WARPGROUP % pg.PIECES == 0 and kc.TOKEN_DATA_BYTES % pg.PIECE == 0


HEAD_DIM = 512
HALVES = (range(0, 4), range(4, 8))  # the seesaw ring's halves at head dim 512 (``chunk_range``)


def raw_ranges(offset, nope: int):
    spans = []
    for tidx in range(THREADS_PER_WARPGROUP):
        for ci in range(nope):
            for p in range(PASSES):
                o = offset(ci, p, tidx, PASSES)
                spans.append((o, o + pg.PIECE))
    return spans


def private_and_inside(spans, total) -> bool:
    spans = sorted(spans)
    disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    return disjoint and spans[0][0] >= 0 and spans[-1][1] <= total and all(a % 16 == 0 for a, _ in spans)


@pytest.mark.proof
@pytest.mark.parametrize("half", [0, 1])
def test_raw_pieces_are_thread_private_and_fit_the_upper_regions(half):
    lower, upper, rope = pg.half_chunks(HALVES[half])
    assert (lower, upper, rope) == (([0, 1], [2, 3], []) if half == 0 else ([4], [5, 6], [7]))
    area = len(upper) * TILE_N * kc.TILE * 2  # the upper chunks' bf16 bytes
    assert private_and_inside(raw_ranges(pg.raw_offset, len(lower + upper)), area)
    # a warp's 32 pieces of one (chunk, pass) are one contiguous 512 bytes: ld.shared.v4 without
    # bank conflicts
    for ci in range(len(lower + upper)):
        for p in range(PASSES):
            offs = sorted(pg.raw_offset(ci, p, t, PASSES) for t in range(32))
            assert offs == list(range(offs[0], offs[0] + 512, 16))


@pytest.mark.proof
def test_raw_checker_rejects_a_shared_place():
    assert not private_and_inside(raw_ranges(lambda ci, p, t, n: (ci * n + p) * 16, 4), 2 * TILE_N * kc.TILE * 2)


def early_writes(chunks: list, slot: int):
    """Ring byte ranges the gather writes in ``chunks`` of ``slot``: each (row, unit) 16 bytes at
    ``gather_offset`` (the lower chunks' st.shared and RoPE's cp.async, both before the barrier)."""
    out = set()
    for c in chunks:
        for tidx in range(THREADS_PER_WARPGROUP):
            for p in range(PASSES):
                for u in pg.piece_units(tidx):
                    o = gather_offset(pg.piece_row(tidx, p), u, c, slot, TILE_N, HEAD_DIM) * 2
                    out.add((o, o + 16))
    return out


def raw_is_clear_of(area_start: int, nope: int, writes) -> bool:
    """Every raw byte of the half (at ``area_start`` + ``raw_offset``) apart from ``writes``, and
    inside the ring's slot."""
    raw = [(area_start + a, area_start + b) for a, b in raw_ranges(pg.raw_offset, nope)]
    return all(b <= w0 or w1 <= a for a, b in raw for w0, w1 in writes)


@pytest.mark.proof
@pytest.mark.parametrize("slot", [0, 1])
@pytest.mark.parametrize("half", [0, 1])
def test_raw_bytes_are_clear_of_the_writes_before_the_barrier(slot, half):
    """The raw area (the upper chunks' regions of this slot half) starts where chunk upper[0]'s
    region starts and ends where upper[-1]'s ends; the lower chunks' bf16 and RoPE's copies,
    written while other threads may still read raw bytes, never land on one; the upper chunks'
    own writes (after the barrier) do."""
    lower, upper, rope = pg.half_chunks(HALVES[half])
    start = pg.raw_area(slot, upper, TILE_N, HEAD_DIM)
    assert start == gather_offset(0, 0, upper[0], slot, TILE_N, HEAD_DIM) * 2
    assert start % 1024 == 0 and start + len(upper) * TILE_N * kc.TILE * 2 == \
        gather_offset(0, 0, upper[-1] + 1, slot, TILE_N, HEAD_DIM) * 2
    assert raw_is_clear_of(start, len(lower + upper), early_writes(lower + rope, slot))
    assert not raw_is_clear_of(start, len(lower + upper), early_writes(upper, slot))


@pytest.mark.proof
def test_raw_checker_rejects_an_area_over_the_lower_chunks():
    lower, upper, _ = pg.half_chunks(HALVES[0])
    wrong = gather_offset(0, 0, lower[0], 0, TILE_N, HEAD_DIM) * 2
    assert not raw_is_clear_of(wrong, len(lower + upper), early_writes(lower, 0))


# ---------------------------------------------------------------------------------------
# decode in one launch: two lists as one (common/compressed.TwoListSpan), run on the CPU


def two_list_runner(wrong: bool = False):
    """A host function (compiled for sm_90a, run on the CPU) that builds the kernel's span of the
    two lists and records ``listed_entry`` at every (tile, row) and the span's tile count.
    ``wrong``: a span that forgets the second list's offset (negative control)."""
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.compressed import TwoListSpan

    class NoOffset(TwoListSpan):
        @cute.jit
        def listed_entry(self, n, r):
            pos = n * self.tile_n + r
            j = Int32(-1)
            if pos < self.k_a:
                j = self.idx_row[pos]
            elif pos < self.k:
                j = self.idx_row_b[pos - self.k_a]
            return j

    cls = NoOffset if wrong else TwoListSpan

    @cute.jit
    def host(out: cute.Tensor, info: cute.Tensor, a: cute.Tensor, b: cute.Tensor, count: Int32, first: Int32):
        span = cls(0, 64, 1, 64, TILE_N, 64, count, a, a.shape[0], b, b.shape[0], first)
        info[0] = span.n_tiles
        info[1] = span.k
        for n in cutlass.range(span.n_tiles, unroll=1):
            for r in cutlass.range(TILE_N, unroll=1):
                out[n, r] = span.listed_entry(n, r)

    bufs = [torch.zeros(40, TILE_N, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            torch.zeros(128, dtype=torch.int32), torch.zeros(1024, dtype=torch.int32)]
    with target_arch("sm90"):
        fn = cute.compile(host, *[jit.as_cute(t) for t in bufs], Int32(1), Int32(1),
                          options=f"--gpu-arch={GPU_ARCH['sm90']}")
    return fn


def two_list_reference(a, b, count, first):
    """The unified list the span stands for: a's entries in [0, first) as themselves, b's in
    [0, count - first) as first + entry, every other position -1."""
    out = [x if 0 <= x < first else -1 for x in a]
    out += [first + x if 0 <= x < count - first else -1 for x in b]
    return out


def two_list_failures(fn, cases):
    g = torch.Generator().manual_seed(11)
    bad = []
    for k_a, k_b, first, rest in cases:
        a = torch.randint(-2, first + 3, (k_a,), generator=g, dtype=torch.int32)
        b = torch.randint(-2, rest + 3, (k_b,), generator=g, dtype=torch.int32)
        out, info = torch.full((40, TILE_N), -7, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        fn(jit.as_cute(out), jit.as_cute(info), jit.as_cute(a), jit.as_cute(b), first + rest, first)
        n_tiles = max(-(-(k_a + k_b) // TILE_N), 1)
        want = two_list_reference(a.tolist(), b.tolist(), first + rest, first)
        want += [-1] * (n_tiles * TILE_N - len(want))
        got = out[:n_tiles].reshape(-1).tolist()
        if int(info[0]) != n_tiles or int(info[1]) != k_a + k_b or got != want:
            bad.append((k_a, k_b, first, rest))
    return bad


TWO_LIST_CASES = [(128, 512, 256 * 40, 64 * 9), (128, 1024, 1000, 2 * 3000), (100, 70, 300, 50), (1, 1, 5, 5),
                  (64, 960, 64, 64)]


@pytest.mark.proof
def test_two_lists_resolve_into_one():
    """Every list position of both lists resolves to the entry the unified list holds (window
    entries as themselves, extra entries offset by the first cache's slot count, -1 for padding,
    negative values and out-of-range entries of either cache), the tile count covers both lists
    (a tile may straddle them: k_a = 100), and positions past both are -1."""
    assert two_list_failures(two_list_runner(), TWO_LIST_CASES) == []


@pytest.mark.proof
def test_two_list_checker_rejects_a_span_without_the_offset():
    assert len(two_list_failures(two_list_runner(wrong=True), TWO_LIST_CASES)) == len(TWO_LIST_CASES)


def sm100_words_runner():
    """sm100's mask words of a two-list tile (``topk_tile_words`` with the span's
    ``position_visible``, as ``mask_s_row`` calls it; the ballots assembled over the 32 lanes on
    the host), compiled for sm_100a and run on the CPU."""
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.compressed import TwoListSpan
    from dsv4_attention.common.sm100_softmax import topk_tile_words

    tile_n = 128

    @cute.jit
    def host(out: cute.Tensor, a: cute.Tensor, b: cute.Tensor, count: Int32, first: Int32):
        span = TwoListSpan(0, 128, 1, 128, tile_n, 128, count, a, a.shape[0], b, b.shape[0], first)
        for n in cutlass.range(span.n_tiles, unroll=1):
            words = topk_tile_words(span.idx_row, n * tile_n, count, span.k, tile_n, 0, True, span.position_visible)
            for w in cutlass.range_constexpr(tile_n // 32):
                out[n, w] = Int32(words[w])

    bufs = [torch.zeros(12, 4, dtype=torch.int32), torch.zeros(128, dtype=torch.int32),
            torch.zeros(1024, dtype=torch.int32)]
    with target_arch("sm100"):
        return cute.compile(host, *[jit.as_cute(t) for t in bufs], Int32(1), Int32(1),
                            options=f"--gpu-arch={GPU_ARCH['sm100']}")


@pytest.mark.proof
def test_sm100_mask_words_of_two_lists():
    """sm100's per-tile visibility bits of decode's two lists (128-key tiles) are the unified
    list's: bit c of tile n set exactly where position 128 n + c resolves to an entry."""
    fn = sm100_words_runner()
    g = torch.Generator().manual_seed(5)
    for k_a, k_b, first, rest in [(128, 512, 1000, 300), (100, 70, 300, 50), (128, 1024, 64, 4000)]:
        a = torch.randint(-2, first + 3, (k_a,), generator=g, dtype=torch.int32)
        b = torch.randint(-2, rest + 3, (k_b,), generator=g, dtype=torch.int32)
        out = torch.zeros(12, 4, dtype=torch.int32)
        fn(jit.as_cute(out), jit.as_cute(a), jit.as_cute(b), first + rest, first)
        want = two_list_reference(a.tolist(), b.tolist(), first + rest, first)
        n_tiles = max(-(-(k_a + k_b) // 128), 1)
        want += [-1] * (n_tiles * 128 - len(want))
        bits = [(int(out[n, c // 32]) >> (c % 32)) & 1 for n in range(n_tiles) for c in range(128)]
        assert bits == [int(x >= 0) for x in want]
        # negative control: the single-list test of the same positions reads list A past its end
        assert bits != [int(0 <= p < k_a and 0 <= int(a[p]) < first + rest) for p in range(n_tiles * 128)]


@pytest.mark.proof
def test_the_halves_are_the_kernels():
    """``HALVES`` above is the FP8 decode kernel's own split of a slot (``KvChunkRing.chunk_range``:
    chunks [0, o_col1 / 64) and the rest)."""
    from dsv4_attention import stages
    from dsv4_attention.common.sm90_kv_chunks import CHUNK_COLS

    kernel = stages.get("e").module.make_kernel(
        "sm90", torch.bfloat16, HEAD_DIM, kv_shared=True, pack_group=128, has_sink=True, has_compressed=True,
        has_topk=True, index_mode=True, kv_pages=256, kv_pages_extra=64)
    r_chunk = kernel.o_col1 // CHUNK_COLS
    assert kernel.seesaw and kernel.tile_n == TILE_N
    assert (range(0, r_chunk), range(r_chunk, HEAD_DIM // CHUNK_COLS)) == HALVES
