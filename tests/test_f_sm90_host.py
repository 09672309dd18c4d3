"""Host proof (CPU, no GPU): stage F's SM90 backward reads every operand where it was written,
built with the kernel's own builders (stages/f_backward/sm90.py, common/sm90_gemm.py).

1. Transposed SMEM views. dS^T is written through the S^T accumulator's partition of the
   (keys, queries) K-major view ``make_tile_smem_layout(tile_n, tile_m)`` and read by the dQ wgmma
   as the (queries, keys) MN-major A ``make_tile_smem_layout_mn(tile_n, tile_m)``; Q / dO (TMA,
   K-major) are read as the MN-major B of dK / dV, K as the B of dQ. For every element and stage:
   the offset of (r, c, s) in the written layout equals that of (c, r, s) in the read one, with the
   same swizzle. Negative control: a K-major view of the transposed shape.
2. Column statistics. Every S^T value i of every consumer thread has the query of statistic
   ``stat_index(i)`` (read at value ``stat_value(s)``), so LSE and D scale the right columns; each
   thread's statistics are distinct queries. Negative control: statistic i // 2 (the row half
   mistaken for the column pair).
3. Coverage. The dQ MMA's C partition over 256 threads covers the (tile_m, d) tile exactly once
   (each dQ element is added once per visit), and so do dK / dV's over (tile_n, d).

Nothing is launched.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest

from dsv4_attention.common.layout_proof import as_ints, offset_of, trace
from dsv4_attention.common.p_staging import make_pv_tiled_mma
from dsv4_attention.common.sm90_gemm import make_tile_smem_layout, make_tile_smem_layout_mn, make_tiled_mma
from dsv4_attention.stages.f_backward import sm90 as kernel

pytestmark = [pytest.mark.stage_f, pytest.mark.proof, pytest.mark.arch("sm90")]

TILE_M, TILE_N, THREADS = 64, 128, 256


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


@pytest.mark.parametrize("view", [("dS", TILE_N, TILE_M, 1), ("K", TILE_N, 128, 1), ("K64", TILE_N, 64, 1),
                                  ("Q_dO", TILE_M, 128, 2), ("Q_dO64", TILE_M, 64, 2)], ids=lambda v: v[0])
def test_transposed_views_read_what_was_written(view):
    _, rows, cols, stages = view
    bad = transpose_mismatches(rows, cols, stages)
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:4]}"


def test_transposed_view_checker_rejects_a_kmajor_read():
    assert transpose_mismatches(TILE_N, TILE_M, 1, wrong=True)


def _coords(part) -> list:
    base = tuple(int(x) for x in part.iterator)
    return [(base[0] + int(part.layout(v)[0]), base[1] + int(part.layout(v)[1])) for v in range(cute.size(part))]


def held(head_dim: int) -> dict:
    def body():
        dtype = cutlass.BFloat16
        sdp = make_tiled_mma(dtype, TILE_M, warpgroups=2)
        dkv = make_pv_tiled_mma(dtype, head_dim, warpgroups=2)
        dq = kernel.make_dq_tiled_mma(dtype, head_dim)
        out = {"s": [], "dq": [], "dkv": []}
        for t in range(THREADS):
            out["s"].append(_coords(sdp.get_slice(t).partition_C(cute.make_identity_tensor((TILE_N, TILE_M)))))
            out["dq"].append(_coords(dq.get_slice(t).partition_C(cute.make_identity_tensor((TILE_M, head_dim)))))
            out["dkv"].append(_coords(dkv.get_slice(t).partition_C(cute.make_identity_tensor((TILE_N, head_dim)))))
        return out

    return trace(body, arch="sm90")


@pytest.fixture(scope="module", params=[64, 128])
def holdings(request):
    return request.param, held(request.param)


def stat_failures(s_coords: list, stat_index) -> list:
    bad = []
    for t, values in enumerate(s_coords):
        n_stats = len(values) // 2
        stat_query = {}
        for i, (_, query) in enumerate(values):
            s = stat_index(i)
            if not 0 <= s < n_stats or stat_query.setdefault(s, query) != query:
                bad.append((t, i, s))
        if len(set(stat_query.values())) != len(stat_query):
            bad.append((t, "statistics repeat a query"))
        for s, query in stat_query.items():
            if values[kernel.stat_value(s)][1] != query:
                bad.append((t, "stat_value", s))
    return bad


def test_column_statistics_are_the_values_queries(holdings):
    _, h = holdings
    bad = stat_failures(h["s"], kernel.stat_index)
    assert not bad, bad[:5]
    assert len(h["s"][0]) == TILE_M // 2  # tile_m / 4 statistics, two values (row halves) each


def test_statistics_checker_rejects_the_row_half(holdings):
    _, h = holdings
    assert stat_failures(h["s"], lambda i: i // 2)


def test_each_gradient_element_has_one_owner(holdings):
    d, h = holdings
    for name, shape in (("dq", (TILE_M, d)), ("dkv", (TILE_N, d))):
        seen = [c for values in h[name] for c in values]
        assert len(seen) == shape[0] * shape[1] and len(set(seen)) == len(seen), name
        assert set(seen) == {(r, c) for r in range(shape[0]) for c in range(shape[1])}, name
