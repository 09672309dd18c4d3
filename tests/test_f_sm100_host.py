"""Host proof (CPU, no GPU): the operand layouts of stage F's SM100 backward
(stages/f_backward/sm100_layouts.py), built with the module's own builders, which the kernel is
to use. The kernel (stages/f_backward/sm100.py) is built from them; it has never run (no Blackwell GPU is
lent), so these proofs and its compile are what speaks for it.

1. Transposed SMEM views. Q and dO (TMA-written, the K-major B of S^T / dP^T) are read as the
   MN-major B of dK / dV; K as the K-major A of S^T and the MN-major A of dQ^T; dS^T is written
   by the compute thread of each key through the (key, query) row view and read as the MN-major
   B of dQ^T. For every element and stage, the offset (before the swizzle) of (r, c) in one view
   equals that of (c, r) in the other, with the same swizzle. Negative controls: a K-major layout
   for the transposed read, a column-major row view.
2. P^T and dS^T in TMEM. What compute thread t stores (tcgen05.st.32x32b, register r holding its
   16-bit values 2r and 2r + 1) is key t's row, each value at the (lane, column, half) the region
   says; the grads MMA's A operand (k-phase kp issued at its fragment's address) reads (n, q)
   from that same cell. Negative controls: the probabilities' offset in fp32 columns (not
   doubled), the A operand based at the scores' first column.
3. The TMEM map: five accumulators in 448 disjoint columns (a 512-column allocation), P^T and
   dS^T inside their scores'. Negative control: dQ^T moved onto dK.
4. The five MMAs take these operands: one visit's MMAs issued from the layouts compile for
   sm_100a, 20 tcgen05.mma of which dK's 4 read A from TMEM.
5. The register order the kernel relies on: compute thread t's TMEM loads of S^T, dP^T (and of
   dQ^T; dK and dV at the end) hold key t's (dim t's) row, register i of the row being query
   (column) i, the order of its P^T / dS^T stores (section 2), of its sdS row store, of its dQ
   pointer's steps and of its dK / dV row stores. Negative control:
   the load sliced with another warp's thread index.

Nothing is launched.
"""

from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.utils.blackwell_helpers as sm100_utils
import pytest
from partitions import coords

from dsv4_attention.common.layout_proof import as_ints, offset_of, trace
from dsv4_attention.common.tmem import TmemRegion, elems_per_col, placeholder_tmem_base, tmem_cell
from dsv4_attention.stages.f_backward import sm100_layouts as L

pytestmark = [pytest.mark.stage_f, pytest.mark.proof, pytest.mark.arch("sm100")]

BF16 = cutlass.BFloat16
D = 128


# ---- 1. transposed SMEM views ----------------------------------------------------------


def _plain(layout):
    return str(layout.inner), as_ints(layout.outer.shape), as_ints(layout.outer.stride)


def view_pairs(wrong: str = "") -> dict:
    """{name: ((written view), (read view), (rows, cols, stages), how each is indexed)} from the
    builders; ``wrong`` swaps one read view for a negative control."""

    def body():
        mmas, sm = L.example_layouts(D, BF16, stages=2)
        qt = sm.qt
        if wrong == "qt_kmajor":  # dK's B as if K-major: the TMA's bytes read as another tile
            qt = sm100_utils.make_smem_layout_b(mmas.scores, (L.TILE_N, D, L.TILE_M), BF16, 2)
        ds_rows = sm.ds_rows
        if wrong == "ds_colmajor":
            ds_rows = cute.make_composed_layout(sm.ds.inner, 0, cute.make_layout((L.TILE_N, L.TILE_M)))
        return {
            "Q_dO": (_plain(sm.q), _plain(qt), (L.TILE_M, D, 2), ("mma", "mma")),
            "K": (_plain(sm.k), _plain(sm.kt), (L.TILE_N, D, 1), ("mma", "mma")),
            "dS": (_plain(ds_rows), _plain(sm.ds), (L.TILE_N, L.TILE_M, 1), ("plain", "mma")),
        }

    return trace(body)


def _offset(view, how, r, c, s):
    """Offset of logical (r, c) (M/N row, K column) of stage s in a view: an MMA operand layout
    is ((MN, K-in-phase), MN tiles, K phases, stages), a plain one (rows, cols)."""
    _, shape, stride = view
    if how == "plain":
        return offset_of(shape, stride, (r, c))
    k_in = shape[0][1] if isinstance(shape[0][1], int) else None
    if k_in is None:
        raise ValueError(f"unexpected operand shape {shape}")
    return offset_of(shape, stride, ((r, c % k_in), 0, c // k_in, s))


def transpose_mismatches(pair) -> list:
    written, read, (rows, cols, stages), (how_w, how_r) = pair
    bad = [("swizzle", written[0], read[0])] if written[0] != read[0] else []
    for s in range(stages):
        for r in range(rows):
            for c in range(cols):
                if _offset(written, how_w, r, c, s) != _offset(read, how_r, c, r, s):
                    bad.append((r, c, s))
    return bad


@pytest.fixture(scope="module")
def pairs():
    return view_pairs()


@pytest.mark.parametrize("name", ["Q_dO", "K", "dS"])
def test_transposed_views_read_what_was_written(pairs, name):
    bad = transpose_mismatches(pairs[name])
    assert not bad, f"{name}: {len(bad)} mismatches, e.g. {bad[:4]}"


@pytest.mark.parametrize("wrong,name", [("qt_kmajor", "Q_dO"), ("ds_colmajor", "dS")])
def test_transposed_view_checker_rejects_wrong_views(wrong, name):
    assert transpose_mismatches(view_pairs(wrong)[name])


def test_ds_rows_are_128_contiguous_bytes_a_key():
    """Thread n writes key n's 64 queries: one 128-byte row, 16-byte pieces of 8 queries."""
    _, shape, stride = view_pairs()["dS"][0]
    for n in (0, 1, 77, 127):
        offs = [offset_of(shape, stride, (n, q)) for q in range(L.TILE_M)]
        assert offs == list(range(n * L.TILE_M, (n + 1) * L.TILE_M))


# ---- 2. P^T and dS^T in TMEM: the compute threads' stores, the grads MMA's reads ---------


def probs_cells(scores_col: int, wrong: str = "") -> dict:
    """Per compute thread: the (n, q) of each value its store holds and the cell it writes (by the
    region and by the instruction's rule); per (n, q): the cell the grads MMA's A operand gives
    and the one the instruction of its k-phase reads."""

    def body():
        mmas = L.BackwardMmas(BF16, D)
        base = placeholder_tmem_base()
        region = L.probs_store_region(BF16, scores_col)
        if wrong == "fp32_offset":  # the offset in fp32 columns, not in 16-bit values
            region = TmemRegion(BF16, region.offset // elems_per_col(BF16), region.layout)
        store = L.make_probs_store(region.at(base))
        ids = L.probs_chunk_view(cute.make_identity_tensor((L.TILE_N, L.TILE_M)), BF16)
        vals = L.PROBS_STORE_COLS * elems_per_col(BF16)
        writes = []
        for t in range(128):
            warp, lane = divmod(t, 32)
            nq = coords(store.get_slice(t).partition_S(ids))
            cells, hw = [], []
            for v, (n, q) in enumerate(nq):
                cells.append(tmem_cell(region.offset + int(cute.crd2idx((n, q % vals, 0, q // vals), region.layout)),
                                       16))
                chunk, j = divmod(v, vals)
                lane0, col0, _ = tmem_cell(region.offset + int(cute.crd2idx((32 * warp, 0, 0, chunk), region.layout)),
                                           16)
                hw.append((lane0 + lane, col0 + j // 2, j % 2))
            writes.append({"nq": nq, "cell": cells, "hw": hw})
        # control: the operand based at the scores' first column, not their upper half
        op = L.probs_operand_region(BF16, mmas, scores_col, half=0 if wrong == "operand_at_scores" else L.P_HALF)
        (mma_m, phase_k), _, phases = as_ints(cute.shape(op.layout))
        reads, hw_reads = {}, {}
        for kp in range(phases):
            lane0, col0, _ = tmem_cell(op.offset + int(cute.crd2idx(((0, 0), 0, kp), op.layout)), 16)
            for kk in range(phase_k):
                for n in range(mma_m):
                    q = kp * phase_k + kk
                    reads[(n, q)] = tmem_cell(op.offset + int(cute.crd2idx(((n, kk), 0, kp), op.layout)), 16)
                    hw_reads[(n, q)] = (lane0 + n, col0 + kk // 2, kk % 2)
        return {"writes": writes, "reads": reads, "hw_reads": hw_reads}

    return trace(body)


def probs_failures(g, scores_col: int) -> list:
    fails, written = [], {}
    for t, w in enumerate(g["writes"]):
        if any(n != t for n, _ in w["nq"]):
            fails.append(f"thread {t} holds values of other keys than its own")
        if w["cell"] != w["hw"]:
            fails.append(f"thread {t}: the region and tcgen05.st disagree on a cell")
        for nq, cell in zip(w["nq"], w["cell"], strict=True):
            written.setdefault(nq, []).append(cell)
        if len(fails) > 4:
            return fails
    if sorted(written) != [(n, q) for n in range(L.TILE_N) for q in range(L.TILE_M)] or \
            any(len(c) != 1 for c in written.values()):
        fails.append("the stores do not write each (key, query) exactly once")
    lo, hi = scores_col, scores_col + L.TILE_M
    if any(not (lo <= c[0][1] < hi) for c in written.values()):
        fails.append(f"a value is written outside the scores' columns {lo}..{hi - 1}")
    if g["reads"] != g["hw_reads"]:
        fails.append("the A fragment and the MMA instruction disagree on a cell")
    bad = [nq for nq in written if written[nq][0] != g["hw_reads"].get(nq)]
    if bad:
        fails.append(f"{len(bad)} values are read where they were not written, e.g. {bad[:3]}")
    return fails


@pytest.mark.parametrize("scores", [("P^T", L.S_COL), ("dS^T", L.DP_COL)], ids=lambda s: s[0])
def test_probabilities_are_read_where_written(scores):
    fails = probs_failures(probs_cells(scores[1]), scores[1])
    assert not fails, fails


@pytest.mark.parametrize("wrong", ["fp32_offset", "operand_at_scores"])
def test_probabilities_checker_rejects_wrong_maps(wrong):
    assert probs_failures(probs_cells(L.S_COL, wrong), L.S_COL)


# ---- 3. the TMEM map --------------------------------------------------------------------


def test_tmem_map_is_disjoint_and_fits():
    def body():
        mmas = L.BackwardMmas(BF16, D)
        return L.tmem_map(BF16, mmas), L.tmem_columns(BF16, mmas)

    spans, cols = trace(body)
    assert spans == {"dv": (0, 128), "dk": (128, 256), "s": (256, 320), "dp": (320, 384), "dq": (384, 448),
                     "p": (288, 320), "ds": (352, 384)}
    assert cols == 512


def test_tmem_map_rejects_overlaps():
    def body():
        mmas = L.BackwardMmas(BF16, D)
        try:
            L.tmem_columns(BF16, mmas, cols={"dq": L.DK_COL})
        except ValueError as e:
            return str(e)
        return ""

    assert "overlaps" in trace(body)


def test_other_head_dims_are_refused_by_name():
    with pytest.raises(ValueError, match="head dims"):
        L.check_head_dim(64)


# ---- 4. the five MMAs accept these operands (compiled for sm_100a) ------------------------


class _VisitMmas:
    """One visit's five MMAs issued once from the layouts above (one thread, no data, nothing
    synchronised): what the compile proves is that tcgen05 takes every operand as laid out (the
    SMEM descriptors of the K- and MN-major SW128 views, P^T / dS^T from TMEM as the A of a TS
    MMA); the PTX is counted."""

    def __init__(self):
        self.dtype = BF16

    @cute.jit
    def __call__(self, x: cute.Tensor, stream):
        self.kernel().launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self):
        mmas, sm = L.example_layouts(D, self.dtype, stages=2)
        smem = cutlass.memory.SmemAllocator()
        sK = smem.allocate_tensor(self.dtype, sm.k.outer, byte_alignment=1024, swizzle=sm.k.inner)
        sQ = smem.allocate_tensor(self.dtype, sm.q.outer, byte_alignment=1024, swizzle=sm.q.inner)
        sdS = smem.allocate_tensor(self.dtype, sm.ds.outer, byte_alignment=1024, swizzle=sm.ds.inner)
        # the same bytes, transposed (section 1; the pointer carries the swizzle, proven the same)
        sQt = cute.make_tensor(sQ.iterator, sm.qt.outer)
        sKt = cute.make_tensor(sK.iterator, sm.kt.outer)
        base = cute.make_ptr(cutlass.Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16)
        s_acc = L.scores_region(mmas, L.S_COL).at(base)
        dk_acc = L.grads_region(mmas, L.DK_COL).at(base)
        dq_acc = L.dq_region(mmas).at(base)
        probs = L.probs_operand_region(self.dtype, mmas, L.DP_COL).at(base)
        # (every thread issues them: the kernel is compiled, never launched)
        a, b = mmas.scores.make_fragment_A(sK), mmas.scores.make_fragment_B(sQ)
        for kp in cutlass.range_constexpr(cute.size(a, mode=[2])):
            cute.gemm(mmas.scores, s_acc, a[None, None, kp, 0], b[None, None, kp, 0], s_acc)
        b = mmas.grads.make_fragment_B(sQt)
        for kp in cutlass.range_constexpr(cute.size(probs, mode=[2])):
            cute.gemm(mmas.grads, dk_acc, probs[None, None, kp], b[None, None, kp, 0], dk_acc)
        a, b = mmas.dq.make_fragment_A(sKt), mmas.dq.make_fragment_B(sdS)
        for kp in cutlass.range_constexpr(cute.size(a, mode=[2])):
            cute.gemm(mmas.dq, dq_acc, a[None, None, kp, 0], b[None, None, kp, 0], dq_acc)


def test_visit_mmas_compile_for_sm100a(tmp_path):
    import torch

    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import target_arch

    with target_arch("sm100"):
        ptx = jit.compile_ptx(_VisitMmas(), [torch.empty(4), jit.STREAM], "sm100", tmp_path)
    issued = [line for line in ptx.splitlines() if "tcgen05.mma.cta_group::1.kind::f16" in line]
    # S^T: d / 16 = 8 k-phases; dK: 64 / 16 = 4; dQ^T: 128 / 16 = 8
    assert len(issued) == 8 + 4 + 8, len(issued)
    # dK's four read A from TMEM (the TS form: "[d_tmem], [a_tmem], b_desc"), the others two descriptors
    from_tmem = [line for line in issued if re.search(r"\[%r\d+\], \[%r\d+\], %rd", line)]
    assert len(from_tmem) == 4, from_tmem


# ---- 5. the TMEM loads' register order ---------------------------------------------------


def load_orders(region_name: str, wrong: bool = False) -> list:
    """Per compute thread, the (lane row, column) of each register of its load of the region, in
    the flat order the kernel indexes its registers (chunk-major, as ``make_rmem_tensor`` of the
    partition's shape lays them out). ``wrong``: the load sliced with another warp's thread index
    (the negative control)."""
    from dsv4_attention.common.tmem import EPI_COLS, epi_view, make_acc_tmem_load

    def body():
        mmas = L.BackwardMmas(BF16, D)
        region = {"scores": L.scores_region(mmas, L.S_COL), "dq": L.dq_region(mmas),
                  "grads": L.grads_region(mmas, L.DK_COL)}[region_name]
        load, _ = make_acc_tmem_load(region.at(placeholder_tmem_base()), EPI_COLS)
        rows = D if region_name == "dq" else L.TILE_N
        cols = D if region_name == "grads" else L.TILE_M
        ids = epi_view(cute.make_identity_tensor((rows, cols)), EPI_COLS)
        out = []
        for t in range(128):
            part = load.get_slice((t + 32) % 128 if wrong else t).partition_D(ids)
            out.append([tuple(int(x) for x in part[i]) for i in range(cute.size(part))])
        return out

    return trace(body)


def load_order_failures(orders) -> list:
    return [t for t, got in enumerate(orders) if got != [(t, q) for q in range(len(got))]][:4]


@pytest.mark.parametrize("region", ["scores", "dq", "grads"])
def test_loads_hold_a_row_in_query_order(region):
    assert not load_order_failures(load_orders(region))


def test_load_order_checker_rejects_another_threads_slice():
    assert load_order_failures(load_orders("scores", wrong=True))
