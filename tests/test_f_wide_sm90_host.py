"""Host proof (CPU, no GPU): stage F's head-dim-256 kernel (stages/f_backward/sm90_wide.py) reads
every operand where it was written and adds every gradient element once, built with the kernel's
own builders (``smem_layouts``, its three tiled MMAs, ``common.sm90_reduce``).

1. Transposed views. sP / sdS are written through S's partition of the (queries, keys) K-major
   layout and read by dV / dK as the (keys, queries) MN-major A; Q / dO (TMA, K-major) as the
   MN-major B of dK / dV, K as the MN-major B of dQ: the same offset for (r, c, s) written and
   (c, r, s) read, the same swizzle. Negative control: a K-major view of the transposed shape.
2. Owners. S's partition over the 256 consumer threads covers the (64 queries, 64 keys) tile once;
   dQ's covers (64, 256) once; one warpgroup's dV / dK partition covers (64 keys, 128 columns)
   once, and the two warpgroups' halves (columns from 128 w) the (64, 256) tile once. S's row
   statistics (``acc_rows_view``): each row of the view is one query, the two rows distinct
   queries. Negative control: the column view.
3. dQ's reductions. After the exchange between lanes t and t ^ 1 (``exchange_pairs``), each lane's
   four values of column group n are one row's columns red_col + 8 n .. + 3, the row and columns
   the kernel's address names (``reduced_at``), red_col a multiple of 4 (a 16-byte-aligned v4
   reduction), and the 256 consumers' reductions cover the (64, 256) tile once. Negative control:
   each lane keeping the other pair.
4. SMEM: the kernel's buffers fit the 227 KB a CTA may have (the compile test reads the same from
   the compiled kernel).
Nothing is launched.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
from partitions import exchange_failures, partition_coords, stat_failures, stat_views, transpose_mismatches

from dsv4_attention.common.layout_proof import as_ints, trace
from dsv4_attention.stages.f_backward import sm90_wide as kernel

pytestmark = [pytest.mark.stage_f, pytest.mark.proof, pytest.mark.arch("sm90")]

TM, TN, D, STAGES = 64, kernel.TILE_N, 256, 2
HALF = D // kernel.NUM_WG
CONSUMERS = kernel.NUM_WG * 128


@pytest.fixture(scope="module")
def lays():
    def body():
        return {name: (str(lay.inner), as_ints(lay.outer.shape), as_ints(lay.outer.stride),
                       int(cute.cosize(lay.outer)))
                for name, lay in kernel.smem_layouts(cutlass.BFloat16, D, TM, STAGES).items()}

    return trace(body, arch="sm90")


@pytest.mark.parametrize("view", [("sP", "sPt", TM, TN, kernel.DS_STAGES), ("sQ", "sQt", TM, D, STAGES),
                                  ("sK", "sKt", TN, D, 1)], ids=lambda v: v[0])
def test_transposed_views_read_what_was_written(lays, view):
    written, read, rows, cols, stages = view
    bad = transpose_mismatches(lays, written, read, rows, cols, stages)
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:4]}"


def test_transposed_view_checker_rejects_a_kmajor_read(lays):
    wrong = dict(lays, sPt=lays["sP"])  # the written K-major layout read as the transpose
    assert transpose_mismatches(wrong, "sP", "sPt", TM, TN, 1)


def test_smem_fits_a_cta(lays):
    elems = sum(2 * lays[b][3] for b in ("sQ", "sK", "sP"))  # sQ and sdO, sK and sV, sP and sdS: a layout a pair
    assert elems == 2 * (2 * TM * D + 2 * TN * D // 2 + 2 * TM * TN), elems  # 2 stages of Q, dO; K, V; 2 slots
    stats = 2 * TM * STAGES * 4
    assert 2 * elems + stats <= 232448, (2 * elems, stats)


@pytest.fixture(scope="module")
def owners():
    def body():
        dtype = cutlass.BFloat16
        sdp, dkv, dq = kernel.make_sdp_tiled_mma(dtype), kernel.make_dkv_tiled_mma(dtype, D), \
            kernel.make_dq_tiled_mma(dtype, D)
        thr = sdp.get_slice(0)
        acc = thr.make_fragment_C(thr.partition_shape_C((TM, TN)))
        return {"views": stat_views(acc.layout),
                "s": [partition_coords(sdp, t, (TM, TN)) for t in range(CONSUMERS)],
                "dq": [partition_coords(dq, t, (TM, D)) for t in range(CONSUMERS)],
                "dkv": [partition_coords(dkv, t, (TN, HALF)) for t in range(128)]}

    return trace(body, arch="sm90")


def test_each_element_has_one_owner(owners):
    for name, shape in (("s", (TM, TN)), ("dq", (TM, D)), ("dkv", (TN, HALF))):
        seen = [c for values in owners[name] for c in values]
        assert len(seen) == len(set(seen)) == shape[0] * shape[1], name
        assert set(seen) == {(r, c) for r in range(shape[0]) for c in range(shape[1])}, name
    # the two warpgroups' dV / dK halves, each stored from column 128 w of sK / sV (store_halves)
    halves = [(r, c + w * HALF) for w in range(kernel.NUM_WG) for values in owners["dkv"] for r, c in values]
    assert sorted(halves) == sorted((r, c) for r in range(TN) for c in range(D))


def test_row_statistics_are_the_values_queries(owners):
    bad = stat_failures(owners["s"], owners["views"]["rows"], axis=0)
    assert not bad, bad[:5]
    assert len(owners["views"]["rows"]) == 2  # two queries a thread: the LSE2 and D it reads


def test_statistics_checker_rejects_the_column_view(owners):
    assert stat_failures(owners["s"], owners["views"]["cols"], axis=0)


def test_dq_exchange_makes_16_byte_reductions(owners):
    bad = exchange_failures(owners["dq"], (TM, D))
    assert not bad, bad[:4]


def test_exchange_checker_rejects_the_other_pair(owners):
    assert exchange_failures(owners["dq"], (TM, D), wrong=True)


def test_constructor_refuses_other_head_dims():
    with pytest.raises(ValueError, match="head_dim"):
        kernel.FlashAttentionBackwardSm90Wide(cutlass.BFloat16, 128)
