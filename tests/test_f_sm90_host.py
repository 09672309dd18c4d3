"""Host proof (CPU, no GPU): stage F's SM90 backward reads every operand where it was written,
built with the kernel's own builders (stages/f_backward/sm90.py, common/sm90_gemm.py), at each of
the kernel's (head dim, queries a visit) configurations (``TILES``; the host pads by the same tile).

1. Transposed SMEM views. dS^T is written through the S^T accumulator's partition of the
   (keys, queries) K-major view ``make_tile_smem_layout(tile_n, tile_m)`` and read by the dQ wgmma
   as the (queries, keys) MN-major A ``make_tile_smem_layout_mn(tile_n, tile_m)``; Q / dO (TMA,
   K-major) are read as the MN-major B of dK / dV, K as the B of dQ. For every element and stage:
   the offset of (r, c, s) in the written layout equals that of (c, r, s) in the read one, with the
   same swizzle. Negative control: a K-major view of the transposed shape.
2. Column statistics. The kernel's column view (``common.softmax.acc_cols_layout`` of the S^T
   fragment) covers each value once, the values of each of its rows share one query, and the rows'
   queries are distinct, for every consumer thread: LSE and D scale the right columns. Negative
   control: the row view (``acc_rows_layout``) in its place.
3. Coverage. The dQ MMA's C partition over 256 threads covers the (tile_m, d) tile exactly once
   (each dQ element is added once per visit), and so do dK / dV's over (tile_n, d).
4. dQ's staging. ``dq_smem_layout`` places every (query, column) where the TMA reduction's box
   reads it (blocks of 8 fp32 columns, 32 bytes a row, the blocks one after the other: written out
   here as byte (n // 8) 32 tile_m + 32 m + 4 (n % 8)); each thread's value pairs are 8-byte
   aligned neighbours (one 8-byte store each); and every warp's store of a pair touches each bank
   at most twice (two wavefronts, the least 256 bytes take). Negative control: the row-major
   (tile_m, d) staging the kernel had, 8 wavefronts a store.
Nothing is launched.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
from partitions import coords, partition_coords, stat_failures, stat_views

from dsv4_attention.common.layout_proof import as_ints, offset_of, trace
from dsv4_attention.common.p_staging import make_pv_tiled_mma
from dsv4_attention.common.sm90_gemm import make_tile_smem_layout, make_tile_smem_layout_mn, make_tiled_mma
from dsv4_attention.stages.f_backward import sm90 as kernel

pytestmark = [pytest.mark.stage_f, pytest.mark.proof, pytest.mark.arch("sm90")]

TILE_M, TILE_N, THREADS = 64, 128, 256
#: the kernel's (head dim, queries a visit) configurations: 128 at head dim 64
#: (``f_backward.queries_per_visit``), 64 otherwise; (64, 64) the tile it had, kept proven
TILES = [(64, 128), (64, 64), (128, 64)]


def transpose_mismatches(rows: int, cols: int, stages: int, wrong: bool = False) -> list:
    def body():
        dtype = cutlass.BFloat16
        written = make_tile_smem_layout(dtype, rows, cols, stages)
        read = make_tile_smem_layout(dtype, cols, rows, stages) if wrong else \
            make_tile_smem_layout_mn(dtype, rows, cols, stages)
        return (str(written.inner), str(read.inner), as_ints(written.outer.shape), as_ints(written.outer.stride),
                as_ints(read.outer.shape), as_ints(read.outer.stride))

    wsw, rsw, wshape, wstride, rshape, rstride = trace(body, arch="sm90")
    bad = [("swizzle", wsw, rsw)] if wsw != rsw else []
    bad += [(r, c, s) for s in range(stages) for r in range(rows) for c in range(cols)
            if offset_of(wshape, wstride, (r, c, s)) != offset_of(rshape, rstride, (c, r, s))]
    return bad


@pytest.mark.parametrize("view", [("dS", TILE_N, TILE_M, kernel.DS_STAGES), ("dS128", TILE_N, 128, kernel.DS_STAGES),
                                  ("K", TILE_N, 128, 1), ("K64", TILE_N, 64, 1), ("Q_dO", TILE_M, 128, 2),
                                  ("Q_dO64", TILE_M, 64, 2), ("Q_dO64_m128", 128, 64, 2)],
                         ids=lambda v: v[0])
def test_transposed_views_read_what_was_written(view):
    _, rows, cols, stages = view
    bad = transpose_mismatches(rows, cols, stages)
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:4]}"


def test_transposed_view_checker_rejects_a_kmajor_read():
    assert transpose_mismatches(TILE_N, TILE_M, 1, wrong=True)


def held(head_dim: int, tile_m: int) -> dict:
    def body():
        dtype = cutlass.BFloat16
        sdp = make_tiled_mma(dtype, tile_m, warpgroups=2)
        dkv = make_pv_tiled_mma(dtype, head_dim, warpgroups=2)
        dq = kernel.make_dq_tiled_mma(dtype, head_dim)
        thr = sdp.get_slice(0)
        acc = thr.make_fragment_C(thr.partition_shape_C((TILE_N, tile_m)))
        return {"views": stat_views(acc.layout),
                "s": [partition_coords(sdp, t, (TILE_N, tile_m)) for t in range(THREADS)],
                "dq": [partition_coords(dq, t, (tile_m, head_dim)) for t in range(THREADS)],
                "dkv": [partition_coords(dkv, t, (TILE_N, head_dim)) for t in range(THREADS)]}

    return trace(body, arch="sm90")


@pytest.fixture(scope="module", params=TILES, ids=lambda t: f"hd{t[0]}-m{t[1]}")
def holdings(request):
    return request.param, held(*request.param)


def test_column_statistics_are_the_values_queries(holdings):
    (_, tile_m), h = holdings
    bad = stat_failures(h["s"], h["views"]["cols"], axis=1)
    assert not bad, bad[:5]
    assert len(h["views"]["cols"]) == tile_m // 4  # tile_m / 4 statistics, two values (row halves) each


def test_statistics_checker_rejects_the_row_view(holdings):
    _, h = holdings
    assert stat_failures(h["s"], h["views"]["rows"], axis=1)


def test_each_gradient_element_has_one_owner(holdings):
    (d, tile_m), h = holdings
    for name, shape in (("dq", (tile_m, d)), ("dkv", (TILE_N, d))):
        seen = [c for values in h[name] for c in values]
        assert len(seen) == shape[0] * shape[1] and len(set(seen)) == len(seen), name
        assert set(seen) == {(r, c) for r in range(shape[0]) for c in range(shape[1])}, name


def dq_staging(head_dim: int, tile_m: int = TILE_M, kernels: bool = True) -> dict:
    """The dQ accumulator's thread values and the staging layout's shape and stride (the kernel's
    ``dq_smem_layout``, or the row-major control)."""
    def body():
        if kernels:
            layout = kernel.dq_smem_layout(tile_m, head_dim)
        else:
            layout = cute.make_layout((tile_m, head_dim, 1), stride=(head_dim, 1, tile_m * head_dim))
        dq = kernel.make_dq_tiled_mma(cutlass.BFloat16, head_dim)
        ident = cute.make_identity_tensor((tile_m, head_dim))
        return {"threads": [coords(dq.get_slice(t).partition_C(ident)) for t in range(THREADS)],
                "shape": as_ints(layout.shape), "stride": as_ints(layout.stride), "tile_m": tile_m}

    return trace(body, arch="sm90")


def staging_byte(plan: dict, m: int, n: int) -> int:
    return 4 * offset_of(plan["shape"], plan["stride"], (m, n, 0))


def tma_box_byte(m: int, n: int, tile_m: int) -> int:
    """Blocks of (tile_m rows, 8 fp32 columns), dense: where the reduction's box reads (m, n)."""
    return (n // 8) * tile_m * 32 + m * 32 + (n % 8) * 4


def store_wavefronts(plan: dict) -> list:
    """Per (warp, value pair): the most distinct 4-byte words any bank receives from the warp's
    8-byte stores (shared memory serves one word per bank per wavefront)."""
    out = []
    for w in range(THREADS // 32):
        for k in range(len(plan["threads"][0]) // 2):
            words = set()
            for t in range(32 * w, 32 * w + 32):
                for m, n in plan["threads"][t][2 * k:2 * k + 2]:
                    words.add(staging_byte(plan, m, n) // 4)
            per_bank = {}
            for word in words:
                per_bank[word % 32] = per_bank.get(word % 32, 0) + 1
            out.append(max(per_bank.values()))
    return out


@pytest.mark.parametrize("head_dim,tile_m", TILES)
def test_dq_staging_is_the_tma_box_and_conflict_free(head_dim, tile_m):
    plan = dq_staging(head_dim, tile_m)
    placed = {(m, n): staging_byte(plan, m, n) for m in range(tile_m) for n in range(head_dim)}
    bad = [(c, b, tma_box_byte(*c, tile_m)) for c, b in placed.items() if b != tma_box_byte(*c, tile_m)]
    assert not bad, f"{len(bad)} elements off the TMA box, e.g. {bad[:4]}"
    for t, values in enumerate(plan["threads"]):
        for k in range(0, len(values), 2):
            (m0, n0), (m1, n1) = values[k], values[k + 1]
            b0 = placed[(m0, n0)]
            assert (m1, n1) == (m0, n0 + 1) and placed[(m1, n1)] == b0 + 4 and b0 % 8 == 0, (t, k)
    assert set(store_wavefronts(plan)) == {2}


def test_dq_staging_checker_rejects_the_row_major_staging():
    plan = dq_staging(128, kernels=False)
    assert max(store_wavefronts(plan)) == 8
    assert any(staging_byte(plan, m, n) != tma_box_byte(m, n, TILE_M) for m in range(TILE_M) for n in range(128))


@pytest.mark.parametrize("head_dim,windowed", [(64, False), (64, True), (128, False), (128, True)])
def test_host_pads_by_the_kernels_tile(head_dim, windowed):
    """The host pads LSE2, D, dQ's accumulator and the turns by ``queries_per_visit``; the
    kernel's default tile for the same options is that (a mismatch would let a 128-row tile
    reach the next request's rows, or read past the padding). Negative control: a tile it lacks."""
    from dsv4_attention.stages import f_backward as stage

    tile = stage.queries_per_visit("sm90", head_dim)
    made = kernel.FlashAttentionBackwardSm90(cutlass.BFloat16, head_dim, has_right=windowed)
    assert made.tile_m == tile == (128 if head_dim == 64 else 64)
    assert made.dv_after_ds == (tile > 64)
    assert made.late_dp == (tile > 64 and windowed)
    assert stage.padded_rows(300, tile) % tile == 0
    with pytest.raises(ValueError, match="64 or 128 queries"):
        kernel.FlashAttentionBackwardSm90(cutlass.BFloat16, head_dim, tile_m=96)
