"""Host proofs (CPU, no GPU) for stage B's SM100 kernel: P in TMEM, and row ownership.

The kernel (stages/b_p_onchip/sm100.py) keeps P on chip. Softmax thread t (warps 0-3) loads row t
of S from TMEM (tcgen05.ld 32x32b), computes P = exp2(x - m) for it in registers, writes P as
16-bit values over S's upper columns (tcgen05.st 32x32b), and the PV MMA reads P from there as
its A operand (tcgen05.mma, A in TMEM). Later thread t loads row t of O and scales it by its own
row statistics. Both halves are address questions, and the origin got both wrong (seeds 001-003:
P stored through the fp32 accumulator's layout and read through another; QK thread N holding row
N/4 while the PV side held row N). Everything below is evaluated at trace time with the builders
the kernel calls (common/tmem.py); only Python ints leave the trace.

1. TMEM-P: for every (m, k) of the 128 x 128 P tile,
   - the register value the softmax computes from S(m, k) is the one its P store treats as
     P(m, k) (same value index in both partitions: the kernel pairs them by index);
   - the TMEM cell (lane, column, half) the store writes, from the P region's layout, equals the
     cell the tcgen05.st.32x32b instruction writes (thread i of warp w -> lane 32w + i; 16-bit
     values 2r, 2r + 1 -> register r -> column first + r, low half first), inside the lanes the
     warp may reach;
   - the cell the PV MMA's A fragment gives for (m, k) equals the cell the MMA instruction reads
     (k-phase kp is issued at the fragment's address for ((0, 0), 0, kp); row m -> lane + m,
     key kk of the phase -> column + kk // 2, half kk % 2);
   - and the two are the same cell, with every (m, k) written exactly once, inside S's columns.
   Negative controls: the P offset added to the 16-bit view in fp32 columns (not doubled), the
   fp32 accumulator's mapping used for 16-bit P (the origin's C-fragment store), and P values
   paired with the wrong S values, all rejected by the same checker.
2. Row ownership: the thread whose S values are row m (the S load partition) is the thread whose
   O values are row m (the O epilogue's load partition), so the statistics it computed scale
   row m and its LSE goes to row m. Negative controls: an S load that spreads rows over threads
   (16x256b, as the origin's N -> N/4) and an O epilogue sliced with a shifted thread index.
3. The compiled kernel's PTX puts the PV MMA's A operand and the P stores at the columns the
   regions say (the pointer arithmetic of ``TmemRegion.at``, which layouts alone cannot see).
"""

from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
import pytest
from cutlass.cute.nvgpu import tcgen05

from dsv4_attention.common.layout_proof import trace
from dsv4_attention.common.tmem import (
    EPI_COLS,
    EPI_THREADS,
    O_TMEM_COL,
    P_STORE_COLS,
    P_TMEM_COL,
    PV_TILE_K,
    QK_TILE_M,
    QK_TILE_N,
    S_TMEM_COL,
    TmemRegion,
    acc_tile,
    attention_tmem_columns,
    elems_per_col,
    epi_view,
    make_acc_fragment,
    make_acc_tmem_load,
    make_p_tmem_store,
    make_qk_tiled_mma,
    o_region,
    p_chunk_view,
    p_operand_region,
    p_region,
    p_store_region,
    placeholder_tmem_base,
    s_region,
    s_region_16bit,
    tmem_cell,
)

pytestmark = [pytest.mark.stage_b, pytest.mark.proof, pytest.mark.arch("sm100")]

HEAD_DIMS = (64, 128, 256)
BF16 = cutlass.BFloat16


# ---------------------------------------------------------------------------------------
# evaluation helpers (inside a trace)


class _Coords:
    """(m, n) of every value of a partition of an identity tile, in flat value order (the order
    of ``part[v]`` and of a compact register tensor of the partition's shape). Every thread's
    partition of one tiled copy has the same layout and its own base coordinate, so the layout
    is evaluated once per distinct layout: ``coords = base + layout(v)``."""

    def __init__(self):
        self._offsets = {}

    def __call__(self, part) -> list[tuple[int, int]]:
        key = str(part.layout)
        offs = self._offsets.get(key)
        if offs is None:
            offs = [tuple(int(x) for x in part.layout(v)) for v in range(cute.size(part))]
            self._offsets[key] = offs
        base = tuple(int(x) for x in part.iterator)
        return [(base[0] + o[0], base[1] + o[1]) for o in offs]


def _leaves(coord):
    if isinstance(coord, tuple):
        return [x for c in coord for x in _leaves(c)]
    return [coord]


def _with_leaves(template, values):
    """``template``'s nesting filled with ``values`` in leaf order."""
    it = iter(values)

    def fill(t):
        return tuple(fill(c) for c in t) if isinstance(t, tuple) else next(it)

    return fill(template)


class _Cells:
    """TMEM cell of a coordinate of a region. A plain CuTe layout is linear in its (flattened)
    coordinate, idx = sum_i c_i * d_i, so each leaf's contribution is evaluated once by cute
    (the coordinate with only that leaf set) and cached; ``test_cells_match_crd2idx`` checks the
    sums against ``cute.crd2idx`` of whole coordinates."""

    def __init__(self, region: TmemRegion, template):
        if not isinstance(region.layout, cute.Layout):
            raise TypeError("only plain layouts are linear")
        self.region, self.template = region, template
        self.n = len(_leaves(template))
        self._part = {}

    def element(self, coord) -> int:
        total = self.region.offset
        for i, x in enumerate(_leaves(coord)):
            key = (i, int(x))
            part = self._part.get(key)
            if part is None:
                only = [0] * self.n
                only[i] = int(x)
                part = int(cute.crd2idx(_with_leaves(self.template, only), self.region.layout))
                self._part[key] = part
            total += part
        return total

    def __call__(self, coord) -> tuple[int, int, int]:
        return tmem_cell(self.element(coord), self.region.dtype.width)


def _identity(shape):
    return cute.make_identity_tensor(shape)


# ---------------------------------------------------------------------------------------
# 1. TMEM-P: what the softmax writes where, what the PV MMA reads where


def gather_p_writes(dtype, store_cols=P_STORE_COLS, p_store=None, pair=lambda v, n: v):
    """Per softmax thread t, as the kernel builds it: the (m, n) of its S registers (value order),
    the (m, k) its P store treats each register value as, the cell the store writes for that
    value by the region's layout and by the 32x32b instruction rule, and its warp's collective
    destination. ``p_store``: a function building the P region the store writes, called in the
    trace (negative controls); ``pair(v, n)``: the S value the kernel converts into P value v
    (it uses S value v)."""

    def body():
        base = placeholder_tmem_base()
        coords = _Coords()
        tiled_s_load, _ = make_acc_tmem_load(s_region(dtype).at(base), EPI_COLS)
        s_ids = epi_view(_identity((QK_TILE_M, QK_TILE_N)), EPI_COLS)
        region = p_store() if p_store is not None else p_store_region(dtype, store_cols)
        cell_of = _Cells(region, (0, 0, 0, 0))  # (m, value in chunk, 0, chunk)
        tiled_p_store = make_p_tmem_store(region.at(base), store_cols)
        p_ids = p_chunk_view(_identity((QK_TILE_M, PV_TILE_K)), dtype, store_cols)
        vals = store_cols * elems_per_col(dtype)  # 16-bit values per thread per store
        threads, warp_dst = [], {}
        for t in range(EPI_THREADS):
            warp, lane = divmod(t, 32)
            s_mn = coords(tiled_s_load.get_slice(t).partition_D(s_ids))
            thr = tiled_p_store.get_slice(t)
            p_mk = coords(thr.partition_S(p_ids))
            if warp not in warp_dst:
                warp_dst[warp] = sorted(set(coords(thr.partition_D(p_ids))))
            cells, hw_cells = [], []
            for v, (m, k) in enumerate(p_mk):
                cells.append(cell_of((m, k % vals, 0, k // vals)))
                chunk, j = divmod(v, vals)
                lane0, col0, _ = cell_of((32 * warp, 0, 0, chunk))  # the instruction's address
                hw_cells.append((lane0 + lane, col0 + j // 2, j % 2))
            s_vals = [s_mn[pair(v, len(s_mn))] if len(s_mn) == len(p_mk) else None for v in range(len(p_mk))]
            threads.append({"s": s_vals, "p": p_mk, "cell": cells, "hw_cell": hw_cells})
        return {"threads": threads, "warp_dst": warp_dst, "vals": vals}

    return trace(body)


def gather_p_reads(dtype, head_dim, operand=None):
    """The PV MMA's A operand over P: for every (m, k), the cell its fragment layout gives and
    the cell the instruction of k-phase kp reads (from the address it is issued at).
    ``operand``: a function building the region instead, called in the trace (negative controls)."""

    def body():
        op = operand() if operand is not None else p_operand_region(dtype, head_dim)
        (mma_m, phase_k), _, phases = cute.shape(op.layout)
        if (mma_m, phase_k * phases) != (QK_TILE_M, PV_TILE_K):
            return {"error": f"A operand covers {mma_m} x {phase_k * phases}, not P's {QK_TILE_M} x {PV_TILE_K}"}
        cell_of = _Cells(op, ((0, 0), 0, 0))  # ((m, key in phase), 0, phase)
        bases = [cell_of(((0, 0), 0, kp)) for kp in range(phases)]
        cell, hw_cell = {}, {}
        for kp in range(phases):
            lane0, col0, _ = bases[kp]
            for kk in range(phase_k):
                for m in range(mma_m):
                    k = kp * phase_k + kk
                    cell[(m, k)] = cell_of(((m, kk), 0, kp))
                    hw_cell[(m, k)] = (lane0 + m, col0 + kk // 2, kk % 2)
        return {"cell": cell, "hw_cell": hw_cell, "bases": bases}

    return trace(body)


def tmem_p_failures(writes, reads, s_columns, max_report: int = 8) -> list[str]:
    """Every way P's writes and the PV MMA's reads disagree (at most ``max_report`` per-thread
    findings, then the whole-tile ones). Empty list = proven."""
    if "error" in reads:
        return [reads["error"]]
    local: list[str] = []  # findings about one thread's values

    def note(msg):
        if len(local) < max_report:
            local.append(msg)

    written: dict = {}
    for t, th in enumerate(writes["threads"]):
        warp = t // 32
        quarter = range(32 * (warp % 4), 32 * (warp % 4) + 32)
        if th["s"] and th["s"][0] is None:
            note(f"thread {t}: its P store and its S load partition different numbers of values")
        bad = [v for v, (smn, mk) in enumerate(zip(th["s"], th["p"], strict=True)) if smn is not None and smn != mk]
        if bad:
            v = bad[0]
            note(f"thread {t} value {v}: P is computed from S{th['s'][v]} but stored as P{th['p'][v]}")
        bad = [v for v, (c, hw) in enumerate(zip(th["cell"], th["hw_cell"], strict=True)) if c != hw]
        if bad:
            v = bad[0]
            note(
                f"thread {t} value {v} (P{th['p'][v]}): the region puts it at {th['cell'][v]}, "
                f"tcgen05.st.32x32b writes {th['hw_cell'][v]} (lane, column, half)"
            )
        if any(hw[0] not in quarter for hw in th["hw_cell"]):
            note(f"warp {warp} (thread {t}) stores outside TMEM lanes {quarter.start}..{quarter.stop - 1}")
        dst = set(writes["warp_dst"][warp])
        if any(mk not in dst for mk in th["p"]):
            note(f"thread {t} holds P values its warp's tcgen05.st does not write")
        for mk, cell in zip(th["p"], th["cell"], strict=True):
            written.setdefault(mk, []).append(cell)

    fails = local
    if len(written) != QK_TILE_M * PV_TILE_K:
        fails.append(f"the stores cover {len(written)} of {QK_TILE_M * PV_TILE_K} P elements")
    twice = [mk for mk, cells in written.items() if len(cells) != 1]
    if twice:
        fails.append(f"{len(twice)} P elements are written more than once, e.g. {twice[:3]}")
    all_cells = [c for cells in written.values() for c in cells]
    if len(set(all_cells)) != len(all_cells):
        fails.append("two P elements are written to the same TMEM cell")
    if any(not (s_columns[0] <= c[1] < s_columns[1]) for c in all_cells):
        fails.append(f"P is written outside S's columns {s_columns[0]}..{s_columns[1] - 1}")

    off = [b for b in reads["bases"] if b[0] or b[2]]
    if off:
        fails.append(f"a PV k-phase is issued at (lane, column, half) {off[0]}: not lane 0 / column-aligned")
    bad = [mk for mk in sorted(reads["cell"]) if reads["cell"][mk] != reads["hw_cell"][mk]]
    if bad:
        mk = bad[0]
        fails.append(f"the A fragment puts P{mk} at {reads['cell'][mk]}, the MMA reads {reads['hw_cell'][mk]}")
    bad = [mk for mk in sorted(written) if written[mk][0] != reads["hw_cell"].get(mk)]
    for mk in bad[:3]:
        fails.append(
            f"P{mk} is written to {written[mk][0]} (lane, column, half); the PV MMA reads {reads['hw_cell'].get(mk)}"
        )
    if bad:
        fails.append(f"{len(bad)} of {len(written)} P elements are read where they were not written")
    return fails


def _s_columns():
    return (S_TMEM_COL, S_TMEM_COL + QK_TILE_N)


@pytest.fixture(scope="module")
def bf16_writes():
    return gather_p_writes(BF16)


@pytest.fixture(scope="module")
def bf16_reads():
    return {d: gather_p_reads(BF16, d) for d in HEAD_DIMS}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_p_written_where_pv_mma_reads_it(bf16_writes, bf16_reads, head_dim):
    fails = tmem_p_failures(bf16_writes, bf16_reads[head_dim], _s_columns())
    assert not fails, "\n".join(fails)


def test_p_cells_are_columns_64_to_127_two_keys_each(bf16_writes):
    """The picture in the kernel's docstring: P(m, k) at lane m, column 64 + k // 2, half k % 2."""
    for th in bf16_writes["threads"]:
        for (m, k), cell in zip(th["p"], th["cell"], strict=True):
            assert cell == (m, P_TMEM_COL + k // 2, k % 2)


def test_p_store_width_x16_proves_too():
    """The proof does not depend on the store width the kernel picked (x32): x16 also passes."""
    fails = tmem_p_failures(gather_p_writes(BF16, store_cols=16), gather_p_reads(BF16, 128), _s_columns())
    assert not fails, "\n".join(fails)


def test_fast_coordinates_match_tensor_indexing():
    """``_Coords`` (base + cached layout offsets) agrees with plain ``tensor[v]``."""

    def body():
        base = placeholder_tmem_base()
        tiled = make_p_tmem_store(p_store_region(BF16).at(base))
        ids = p_chunk_view(_identity((QK_TILE_M, PV_TILE_K)), BF16)
        coords, same = _Coords(), True
        for t in (0, 45, 127):
            thr = tiled.get_slice(t)
            for part in (thr.partition_S(ids), thr.partition_D(ids)):
                plain = [tuple(int(x) for x in part[v]) for v in range(0, cute.size(part), 5)]
                same = same and plain == coords(part)[::5]
        return same

    assert trace(body)


# negative controls: the same checker must reject these


def test_checker_rejects_p_offset_not_doubled(bf16_writes):
    # the A operand re-based by P's first fp32 column (64) counted as 16-bit values: it reads
    # columns 32..95, half of them S's lower half, none of them where P was stored in order
    def wrong():
        right = p_operand_region(BF16, 128)
        return TmemRegion(BF16, P_TMEM_COL, right.layout)

    reads = gather_p_reads(BF16, 128, operand=wrong)
    fails = tmem_p_failures(bf16_writes, reads, _s_columns())
    assert fails, "the checker accepted a P offset that was not doubled for 16-bit data"
    assert any("read where they were not written" in f for f in fails)


def test_checker_rejects_fp32_accumulator_mapping_for_16bit_p(bf16_reads):
    # the origin's store: P written through the fp32 accumulator's layout, (m, k) -> 65536 m + k,
    # now counted in 16-bit elements: rows land in lane m / 2, keys in the wrong columns
    def wrong():
        s32 = cute.composition(acc_tile(make_acc_fragment(make_qk_tiled_mma(BF16))).layout,
                               cute.make_layout((QK_TILE_M, PV_TILE_K)))  # (128,128):(65536,1)
        return TmemRegion(BF16, p_region(BF16).offset, p_chunk_view(s32, BF16))

    writes = gather_p_writes(BF16, p_store=wrong)
    fails = tmem_p_failures(writes, bf16_reads[128], _s_columns())
    assert fails, "the checker accepted P stored through the fp32 accumulator's mapping"
    assert any("tcgen05.st.32x32b writes" in f for f in fails)
    assert any("read where they were not written" in f for f in fails)


def test_checker_rejects_p_paired_with_wrong_s_values(bf16_reads):
    # right cells, wrong values: P value v computed from S value (v + 1) mod n
    writes = gather_p_writes(BF16, pair=lambda v, n: (v + 1) % n)
    fails = tmem_p_failures(writes, bf16_reads[128], _s_columns())
    assert fails and any("is computed from S" in f for f in fails)


def test_cells_match_crd2idx():
    """``_Cells`` (sum of cached per-leaf contributions) equals ``cute.crd2idx`` of whole
    coordinates, for the P store region and the A operand region."""

    def body():
        same = True
        for region, coords in (
            (p_store_region(BF16), [(m, j, 0, c) for m in (0, 1, 33, 127) for j in (0, 1, 17, 63) for c in (0, 1)]),
            (p_operand_region(BF16, 128), [((m, kk), 0, p) for m in (0, 5, 127) for kk in (0, 3, 15) for p in (0, 7)]),
        ):
            cells = _Cells(region, _with_leaves(coords[0], [0] * len(_leaves(coords[0]))))
            for c in coords:
                same = same and cells.element(c) == region.offset + int(cute.crd2idx(c, region.layout))
        return same

    assert trace(body)


# ---------------------------------------------------------------------------------------
# 2. Row ownership: S's row m and O's row m on the same thread


def gather_rows(dtype, head_dim, s_op=None, o_slice=lambda t: t):
    """Per softmax thread t, as the kernel builds it: the (m, n) of its S registers and of its
    O registers (epilogue), their TMEM cells, and the row of its LSE (the row of S value 0).
    ``s_op``: a function building the S load atom instead, called in the trace so that the atom
    targets sm100 whatever GPU is present, and ``o_slice(t)``: the index the epilogue slices the
    O load with (negative controls; the kernel uses the 32x32b atom and t)."""

    def body():
        base = placeholder_tmem_base()
        coords = _Coords()
        s, o = s_region(dtype), o_region(dtype, head_dim)
        tiled_s, _ = make_acc_tmem_load(s.at(base), EPI_COLS, op=s_op() if s_op else None)
        tiled_o, _ = make_acc_tmem_load(o.at(base), EPI_COLS)
        s_ids = epi_view(_identity((QK_TILE_M, QK_TILE_N)), EPI_COLS)
        o_ids = epi_view(_identity((QK_TILE_M, head_dim)), EPI_COLS)
        s_cell, o_cell = _Cells(s, ((0, 0), 0, 0)), _Cells(o, ((0, 0), 0, 0))
        threads = []
        for t in range(EPI_THREADS):
            s_mn = coords(tiled_s.get_slice(t).partition_D(s_ids))
            o_mn = coords(tiled_o.get_slice(o_slice(t)).partition_D(o_ids))
            threads.append(
                {
                    "s": s_mn,
                    "o": o_mn,
                    "s_cells": [s_cell(((m, n), 0, 0)) for m, n in s_mn],
                    "o_cells": [o_cell(((m, n), 0, 0)) for m, n in o_mn],
                    "lse_row": s_mn[0][0],
                }
            )
        return {"threads": threads, "head_dim": head_dim}

    return trace(body)


def row_ownership_failures(rows, max_report: int = 8) -> list[str]:
    """Every way "the thread that reduces row m of S scales row m of O and writes LSE[m]"
    breaks, plus the TMEM facts the loads rely on. Empty list = proven."""
    fails: list[str] = []
    d = rows["head_dim"]
    owner: dict = {}
    for t, th in enumerate(rows["threads"]):
        warp = t // 32
        quarter = range(32 * (warp % 4), 32 * (warp % 4) + 32)
        s_rows = sorted({m for m, _ in th["s"]})
        o_rows = sorted({m for m, _ in th["o"]})
        if len(s_rows) != 1:
            more = "..." if len(s_rows) > 6 else ""
            fails.append(f"thread {t} holds S of rows {s_rows[:6]}{more}: no row statistics")
        elif o_rows != s_rows:
            fails.append(f"thread {t} reduces row {s_rows[0]} of S but scales rows {o_rows[:6]} of O")
        elif th["lse_row"] != s_rows[0]:
            fails.append(f"thread {t} writes LSE of row {th['lse_row']}, its statistics are row {s_rows[0]}'s")
        else:
            owner.setdefault(s_rows[0], []).append(t)
        if sorted(n for _, n in th["s"]) != list(range(QK_TILE_N)):
            fails.append(f"thread {t}'s S values are not the {QK_TILE_N} columns once each")
        if sorted(n for _, n in th["o"]) != list(range(d)):
            fails.append(f"thread {t}'s O values are not the {d} columns once each")
        for (m, n), cell in zip(th["s"], th["s_cells"], strict=True):
            if cell != (m, S_TMEM_COL + n, 0):
                fails.append(f"S({m},{n}) is at {cell}, the QK MMA writes lane {m}, column {S_TMEM_COL + n}")
                break
        for (m, n), cell in zip(th["o"], th["o_cells"], strict=True):
            if cell != (m, O_TMEM_COL + n, 0):
                fails.append(f"O({m},{n}) is at {cell}, the PV MMA writes lane {m}, column {O_TMEM_COL + n}")
                break
        if any(c[0] not in quarter for c in th["s_cells"] + th["o_cells"]):
            fails.append(f"warp {warp} (thread {t}) loads TMEM lanes outside {quarter.start}..{quarter.stop - 1}")
        if len(fails) >= max_report:
            return fails
    shared = {m: ts for m, ts in owner.items() if len(ts) > 1}
    if shared:
        fails.append(f"rows owned by several threads, e.g. {sorted(shared.items())[:2]}")
    if not fails and len(owner) != QK_TILE_M:
        fails.append(f"{QK_TILE_M - len(owner)} rows have no owner")
    return fails


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_s_row_and_o_row_on_the_same_thread(head_dim):
    rows = gather_rows(BF16, head_dim)
    fails = row_ownership_failures(rows)
    assert not fails, "\n".join(fails)
    # and it is the identity: thread t owns row t (the kernel's docstring)
    assert all(th["lse_row"] == t for t, th in enumerate(rows["threads"]))


def test_checker_rejects_s_rows_spread_over_threads():
    # 16 lanes x 256 bits: a thread holds values of two rows of S, a row lies on four threads:
    # no thread has a row's max and sum (the origin's QK thread N / row N/4 family)
    fails = row_ownership_failures(
        gather_rows(BF16, 128, s_op=lambda: tcgen05.Ld16x256bOp(tcgen05.Repetition(EPI_COLS // 8)))
    )
    assert fails, "the checker accepted an S load that spreads rows over threads"
    assert any("no row statistics" in f for f in fails)


def test_checker_rejects_o_epilogue_on_other_rows():
    # right atoms, O epilogue sliced as if its warps were numbered from warp 1: thread t scales
    # row t + 32 with row t's statistics
    fails = row_ownership_failures(gather_rows(BF16, 128, o_slice=lambda t: (t + 32) % EPI_THREADS))
    assert fails, "the checker accepted O rows scaled by another row's statistics"
    assert any("scales rows" in f for f in fails)


# ---------------------------------------------------------------------------------------
# regions, budget, dtypes


def test_tmem_regions_and_budget():
    def body():
        out = {}
        for d in HEAD_DIMS:
            s, p, o = s_region(BF16), p_region(BF16), o_region(BF16, d)
            out[d] = (
                (s.first_column, s.end_column()),
                (p.first_column, p.end_column()),
                (o.first_column, o.end_column()),
                attention_tmem_columns(BF16, d),
            )
        out["s16"] = str(s_region_16bit(BF16).layout)
        return out

    got = trace(body)
    for d, cols in zip(HEAD_DIMS, (256, 256, 512), strict=True):
        assert got[d] == ((0, 128), (64, 128), (128, 128 + d), cols)
    assert got["s16"] == "(128,256):(131072,1)"  # (m, j) -> 2 * (m << 16) + j: two 16-bit values a column


def test_fp16_builds_the_same_tmem_path():
    """The proofs run on bf16; fp16 builds identical regions and copies."""

    def describe(dtype):
        def body():
            base = placeholder_tmem_base()
            regions = [s_region(dtype), p_region(dtype), p_store_region(dtype), p_operand_region(dtype, 128),
                       o_region(dtype, 128)]
            store = make_p_tmem_store(p_store_region(dtype).at(base))
            names = {cutlass.BFloat16: "bf16", cutlass.Float16: "f16"}
            return [(r.offset, str(r.layout)) for r in regions], str(store).replace(f"type:      {names[dtype]}", "T16")

        return trace(body)

    assert describe(BF16) == describe(cutlass.Float16)


# ---------------------------------------------------------------------------------------
# 3. the compiled kernel: TMEM operands in the PTX


_ADD_IMM = re.compile(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);")
_MMA_TS = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[(%r\d+)\],\s*\[(%r\d+)\]")
_ST_P = re.compile(r"tcgen05\.st\.sync\.aligned\.32x32b\.x(\d+)\.b32\s+\[(%r\d+)\]")
_LD_S = re.compile(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x(\d+)\.b32\s+\{[^}]*\},\s*\[(%r\d+)\]")


def _resolve(ptx: str):
    """reg -> (root register, immediate) through chains of ``add.s32 reg, reg, imm``."""
    adds = {m.group(1): (m.group(2), int(m.group(3))) for m in _ADD_IMM.finditer(ptx)}

    def resolve(reg):
        total = 0
        while reg in adds:
            reg, imm = adds[reg]
            total += imm
        return reg, total

    return resolve


@pytest.mark.compile
def test_ptx_reads_and_writes_p_at_the_region_columns(tmp_path):
    import torch

    from dsv4_attention.common import jit
    from dsv4_attention.stages import b_p_onchip as stage

    head_dim = 64
    args = stage.example_args(torch.bfloat16, head_dim)
    kernel = stage.make_kernel("sm100", torch.bfloat16, head_dim)
    ptx = jit.compile_ptx(kernel, args, "sm100", tmp_path)
    resolve = _resolve(ptx)

    # PV MMAs (A in TMEM): O at base + 128, A of k-phase kp at base + 64 + 8 kp, one base
    ts = [(resolve(dst), resolve(a)) for dst, a in _MMA_TS.findall(ptx)]
    assert len(ts) == PV_TILE_K // 16, ts
    roots = {r for (r, _), (r2, _) in ts for r in (r, r2)}
    assert len(roots) == 1, f"the PV MMA operands do not share one TMEM base: {ts}"
    assert [d for (_, d), _ in ts] == [O_TMEM_COL] * len(ts)
    assert [a for _, (_, a) in ts] == [P_TMEM_COL + 8 * kp for kp in range(len(ts))]

    # P stores: from the lane base S was loaded from, at columns 64 + 32 c (x32 stores)
    loads = [(int(x), resolve(r)) for x, r in _LD_S.findall(ptx)]
    stores = [(int(x), resolve(r)) for x, r in _ST_P.findall(ptx)]
    s_loads = loads[: QK_TILE_N // EPI_COLS]
    lane_base = {r for _, (r, _) in s_loads}
    assert len(lane_base) == 1 and [c for _, (_, c) in s_loads] == [S_TMEM_COL + EPI_COLS * i for i in range(4)]
    assert stores and {r for _, (r, _) in stores} == lane_base, (stores, s_loads)
    assert [x for x, _ in stores] == [P_STORE_COLS] * (64 // P_STORE_COLS)
    assert [c for _, (_, c) in stores] == [P_TMEM_COL + P_STORE_COLS * i for i in range(len(stores))]
