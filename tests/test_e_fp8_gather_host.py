"""Stage E's sm90 FP8 page gather (stages/e_fused/sm90_pages.py), on the host: its thread maps.

Each producer thread copies 16-byte pieces of e4m3 (two bf16 units) into its own staging bytes,
then dequantizes them into the slot. Proven here with the kernel's own functions (``piece_row``,
``piece_units``, ``staging_offset``, ``kv_cache.unit_bytes``): every (row, unit) of a chunk is
read and written by exactly one thread once, a piece's 16 bytes are its two units' 8 + 8 in
order, and no two (thread, chunk, pass) share a staging byte. Negative controls: the bf16
gather's 8-threads-a-row map and a staging offset without the thread are rejected.
"""

from __future__ import annotations

import pytest

from dsv4_attention.common import kv_cache as kc
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP
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


def staging_ranges(offset):
    spans = []
    for tidx in range(THREADS_PER_WARPGROUP):
        for ci in range(pg.STAGED):
            for p in range(PASSES):
                o = offset(ci, p, tidx, PASSES)
                spans.append((o, o + pg.PIECE))
    return spans


def private_and_inside(spans, total) -> bool:
    spans = sorted(spans)
    disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    return disjoint and spans[0][0] >= 0 and spans[-1][1] <= total and all(a % 16 == 0 for a, _ in spans)


@pytest.mark.proof
def test_staging_is_thread_private_and_fits():
    total = pg.staging_bytes(TILE_N)
    assert private_and_inside(staging_ranges(pg.staging_offset), total)
    assert total == pg.STAGED * TILE_N * kc.TILE  # every staged byte of a half has its place
    # a warp's 32 pieces of one (chunk, pass) are one contiguous 512 bytes: ld.shared.v4 without
    # bank conflicts
    for ci in range(pg.STAGED):
        for p in range(PASSES):
            offs = sorted(pg.staging_offset(ci, p, t, PASSES) for t in range(32))
            assert offs == list(range(offs[0], offs[0] + 512, 16))


@pytest.mark.proof
def test_staging_checker_rejects_a_shared_place():
    assert not private_and_inside(staging_ranges(lambda ci, p, t, n: (ci * n + p) * 16), pg.staging_bytes(TILE_N))
