"""Host proof (CPU, no GPU): index mode's backward kernel (stages/f_backward/sm90_index.py) reads
every operand where it was written and adds every gradient element once, built with the kernel's
own builders (``smem_layouts``, its three tiled MMAs, stage E's ``gather_offset``).

1. The gather. Producer thread i copies 16-byte unit i % 8 of rows i / 8 + 16 p of each 64-column
   chunk to ``gather_offset(row, unit, chunk, 0, 64, 512)``; that is where the kernel's sKV layout
   holds (row, 64 chunk + 8 unit .. + 7), for every row, chunk and unit, and the 128 threads'
   copies cover the (64, 512) slot once. Negative control: the unit without the swizzle's XOR.
2. Transposed views. sP / sdS are written through S's partition of the (heads, rows) K-major
   layout and read by the dkv GEMMs as the (rows, heads) MN-major A; Q / dO (TMA, K-major) as the
   MN-major B of dkv, the rows as the MN-major B of dq: the same offset for (r, c, s) written and
   (c, r, s) read, the same swizzle. Negative control: a K-major view of the transposed shape.
3. Owners. S's partition over the 256 consumer threads covers the (64 heads, 64 rows) step once;
   dq's covers (64, 512) once; one warpgroup's dkv partition covers a (64 rows, 64 columns) chunk
   once. S's row statistics (``acc_rows_view``): each row of the view is one head, its values
   that head's, the two rows distinct heads. Negative control: the column view.
4. The reductions. In each thread's dkv values, 2 m and 2 m + 1 are one row's columns (c, c + 1)
   with c even (negative control: pairs shifted by one value); after the exchange between lanes
   t and t ^ 1 (``common.sm90_reduce.exchange_pairs``), each lane's four values of column group n are one row's
   columns red_col + 8 n .. + 3, the row and columns the kernel's address names, red_col a
   multiple of 4 (a 16-byte-aligned v4 reduction), and the warpgroup's reductions cover the chunk
   once. Negative control: each lane keeping the other pair.
Nothing is launched.
"""

from __future__ import annotations

import cutlass
import pytest
from partitions import exchange_failures, partition_coords, stat_failures, stat_views, transpose_mismatches

from dsv4_attention.common.layout_proof import as_ints, offset_of, swizzle_bytes, trace
from dsv4_attention.stages.f_backward import sm90_index as kernel

pytestmark = [pytest.mark.stage_f, pytest.mark.proof, pytest.mark.arch("sm90")]

H, N, D = kernel.HEADS_PER_CTA, kernel.ROWS_PER_STEP, kernel.HEAD_DIM
CONSUMERS = kernel.NUM_WG * 128


def layouts() -> dict:
    def body():
        out = {}
        for name, lay in kernel.smem_layouts(cutlass.BFloat16).items():
            out[name] = (str(lay.inner), as_ints(lay.outer.shape), as_ints(lay.outer.stride))
        return out

    return trace(body, arch="sm90")


@pytest.fixture(scope="module")
def lays():
    return layouts()


def swizzled(offset: int) -> int:
    """The 128-byte swizzle S<3,4,3> (on byte addresses) of a 16-bit element offset."""
    return swizzle_bytes(2 * offset, 3, 4, 3) // 2


def gather_failures(lays, unswizzled: bool = False) -> list:
    sw, shape, stride = lays["sKV"]
    assert sw == "S<3,4,3>", sw
    bad, seen = [], {}
    passes = N * kernel.UNITS // 128
    for tidx in range(128):
        unit = tidx % kernel.UNITS
        for p in range(passes):
            row = tidx // kernel.UNITS + p * (128 // kernel.UNITS)
            for c in range(D // 64):
                if unswizzled:
                    at = c * N * 64 + row * 64 + unit * 8
                else:
                    at = kernel.gather_offset(row, unit, c, 0, N, D)
                seen[at] = seen.get(at, 0) + 1
                for e in range(8):  # the unit's 8 elements, where the layout holds them
                    col = c * 64 + unit * 8 + e
                    want = swizzled(offset_of(shape, stride, (row, col, 0)))
                    if want != at + e:
                        bad.append((row, col, want, at + e))
    if sorted(seen) != list(range(0, N * D, 8)) or set(seen.values()) != {1}:
        bad.append("the copies do not cover the slot once")
    return bad


def test_gather_writes_where_the_rows_layout_holds_them(lays):
    bad = gather_failures(lays)
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:4]}"


def test_gather_checker_rejects_an_unswizzled_copy(lays):
    assert gather_failures(lays, unswizzled=True)


@pytest.mark.parametrize("view", [("sP", "sPt", H, N, kernel.DS_STAGES), ("sQ", "sQt", H, D, 1),
                                  ("sKV", "sKVt", N, D, 1)], ids=lambda v: v[0])
def test_transposed_views_read_what_was_written(lays, view):
    written, read, rows, cols, stages = view
    bad = transpose_mismatches(lays, written, read, rows, cols, stages)
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:4]}"


def test_transposed_view_checker_rejects_a_kmajor_read(lays):
    wrong = dict(lays, sPt=lays["sP"])  # the written K-major layout read as the transpose
    assert transpose_mismatches(wrong, "sP", "sPt", H, N, 1)


@pytest.fixture(scope="module")
def owners():
    def body():
        dtype = cutlass.BFloat16
        sdp, dq, dkv = kernel.make_sdp_tiled_mma(dtype), kernel.make_dq_tiled_mma(dtype), \
            kernel.make_dkv_tiled_mma(dtype)
        thr = sdp.get_slice(0)
        acc = thr.make_fragment_C(thr.partition_shape_C((H, N)))
        return {"views": stat_views(acc.layout),
                "s": [partition_coords(sdp, t, (H, N)) for t in range(CONSUMERS)],
                "dq": [partition_coords(dq, t, (H, D)) for t in range(CONSUMERS)],
                "dkv": [partition_coords(dkv, t, (N, kernel.DKV_CHUNK)) for t in range(128)]}

    return trace(body, arch="sm90")


def test_each_element_has_one_owner(owners):
    for name, shape in (("s", (H, N)), ("dq", (H, D)), ("dkv", (N, kernel.DKV_CHUNK))):
        seen = [c for values in owners[name] for c in values]
        assert len(seen) == len(set(seen)) == shape[0] * shape[1], name
        assert set(seen) == {(r, c) for r in range(shape[0]) for c in range(shape[1])}, name


def test_row_statistics_are_the_values_heads(owners):
    bad = stat_failures(owners["s"], owners["views"]["rows"], axis=0)
    assert not bad, bad[:5]
    assert len(owners["views"]["rows"]) == 2  # two heads a thread: the LSE2 and D it loads


def test_statistics_checker_rejects_the_column_view(owners):
    assert stat_failures(owners["s"], owners["views"]["cols"], axis=0)


def pair_failures(dkv_coords: list, shift: int = 0) -> list:
    bad = []
    for t, values in enumerate(dkv_coords):
        for m in range(shift, len(values) - 1, 2):
            (r0, c0), (r1, c1) = values[m], values[m + 1]
            if not (r1 == r0 and c1 == c0 + 1 and c0 % 2 == 0):
                bad.append((t, m, values[m], values[m + 1]))
    return bad


def test_dkv_values_pair_into_v2_reductions(owners):
    bad = pair_failures(owners["dkv"])
    assert not bad, bad[:4]


def test_pair_checker_rejects_shifted_pairs(owners):
    assert pair_failures(owners["dkv"], shift=1)


def test_dkv_exchange_makes_16_byte_reductions(owners):
    bad = exchange_failures(owners["dkv"], (N, kernel.DKV_CHUNK))
    assert not bad, bad[:4]


def test_exchange_checker_rejects_the_other_pair(owners):
    assert exchange_failures(owners["dkv"], (N, kernel.DKV_CHUNK), wrong=True)
