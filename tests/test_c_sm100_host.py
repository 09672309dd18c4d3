"""Host proofs (CPU, no GPU) for stage C's SM100 kernel: rows through softmax, correction, epilogue;
the TMEM map of two Q tiles; P of every Q tile where its PV MMA reads it.

The kernel (stages/c_online_softmax/sm100.py) keeps one or two 128-row Q tiles in flight. Softmax
warpgroup i owns S_i and P_i (it addresses them as S_0 / P_0 moved by 128 i columns, i being a
runtime value); the correction warpgroup owns the rows of every O_i, rescales them in TMEM
(tcgen05.ld 32x32b, multiply, tcgen05.st 32x32b back) with the factor the softmax thread of the
same row left in an SMEM slot, and writes the final O_i / l and LSE. Everything below is evaluated
at trace time with the builders the kernel calls (common/tmem.py); only Python ints leave the trace.

1. Row chain, per Q tile and thread: the softmax thread that reduces row m of S_i writes slot m
   (its S values are row m by CuTe's partition and by the 32x32b instruction's rule: lane 32 w + i,
   register j = column + j); exactly one correction thread reads slot m, and every O value it
   loads, stores back and writes to SMEM / LSE is row m, at the cell the PV MMA accumulates O_i(m, n)
   in, by both rules; its store puts each value back where its load took it; the softmax warp
   that wrote slot m is the one the correction warp hands off with (stats slot 4 i + w % 4).
   Negative controls: correction copies sliced with a shifted thread index, the softmax writing
   the slot of the next row, an O load that spreads rows over threads.
2. TMEM map: S_i (with P_i inside), O_i do not overlap and fit 512 columns; the softmax's runtime
   addressing of S_i / P_i lands on the map's S_i / P_i. Negative controls: O over S1, two Q tiles
   at head_dim 256, S tiles 64 columns apart.
3. TMEM-P per Q tile, with stage B's checker (tests/test_b_sm100_tmem_p.py): every P_i(m, k) the
   softmax stores is the cell the PV MMA of tile i reads. Negative controls: tile 1's P stored
   without the tile offset, and with the offset not doubled for 16-bit data.
4. The compiled kernel (head_dim 128: two tiles, 256: one): the MMAs' TMEM operands, the correction's O
   loads / stores and the softmax's S loads / P stores sit at the columns the map says.
5. A host model of the schedule's arithmetic (not the kernel): tiles visited last first, tail
   masked, lazy rescale decided per warp, l and O rescaled by the same factor, P <= 2^8; it
   matches float64 softmax, and fails without the O rescale.
"""

from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
import pytest
from cutlass.cute.nvgpu import tcgen05
from test_b_sm100_tmem_p import _Cells, _Coords, _resolve, gather_p_reads, gather_p_writes, tmem_p_failures

from dsv4_attention.common.layout_proof import trace
from dsv4_attention.common.tmem import (
    ACC_DTYPE,
    EPI_COLS,
    EPI_THREADS,
    P_STORE_COLS,
    QK_TILE_M,
    QK_TILE_N,
    TMEM_COLUMNS,
    AttentionTmemMap,
    TmemRegion,
    epi_view,
    make_acc_tmem_load,
    make_acc_tmem_store,
    placeholder_tmem_base,
    q_tiles_in_flight,
    uniform_stride,
)

pytestmark = [pytest.mark.stage_c, pytest.mark.proof, pytest.mark.arch("sm100")]

HEAD_DIMS = (64, 128, 256)
BF16 = cutlass.BFloat16


def _packed(head_dim, dtype=BF16):
    return AttentionTmemMap.packed(dtype, head_dim, q_tiles_in_flight(head_dim))


def _kernel_s_region(tmem_map, i):
    """S_i as the softmax addresses it: S_0's region moved by i * stride fp32 columns."""
    s0 = tmem_map.s(0)
    return TmemRegion(s0.dtype, s0.offset + i * uniform_stride(tmem_map.s_cols, "S"), s0.layout)


def _kernel_p_store_region(tmem_map, i, doubled=True, shifted=True):
    """P_i's store region as the softmax addresses it: the pointer moves by i * stride fp32
    columns before it is recast to 16 bits, i.e. 2 * i * stride 16-bit elements. ``doubled`` /
    ``shifted`` off: the negative controls' wrong arithmetic."""
    p0 = tmem_map.p_store(0)
    cols = i * uniform_stride(tmem_map.s_cols, "S") if shifted else 0
    return TmemRegion(p0.dtype, p0.offset + (2 * cols if doubled else cols), p0.layout)


def _hw_32x32b(cell_of, warp_quarter, per_chunk, n_values):
    """The cells a tcgen05.{ld,st}.32x32b.x<per_chunk> moves for one thread (lane ``l`` of its
    warp), value v = chunk c, register j: the instruction of chunk c is issued at the region's
    cell of (row 32 w, column c * per_chunk); thread l gets lane + l, register j column + j."""

    def cells(lane):
        out = []
        for v in range(n_values):
            c, j = divmod(v, per_chunk)
            lane0, col0, _ = cell_of(((32 * warp_quarter, c * per_chunk), 0, 0))
            out.append((lane0 + lane, col0 + j, 0))
        return out

    return cells


# ---------------------------------------------------------------------------------------
# 1. row chain: softmax row stats -> SMEM slot -> correction (rescale in TMEM) -> epilogue


def gather_chain(head_dim, dtype=BF16, o_slice=lambda t: t, o_op=None, slot_shift=0):
    """Per Q tile i and thread t (0..127), as the kernel builds it: the softmax side (its S
    values' (m, n), their cells by the region and by the 32x32b rule, the slot it writes: its
    ``row`` + ``slot_shift``) and the correction side (its O load / store values' (m, n) and
    cells, the slot it reads: its ``row``). ``o_slice(t)``: the index the correction slices its
    O copies with; ``o_op``: a function building the O load atom, called in the trace so that it
    targets sm100 whatever GPU is present (negative controls; the kernel: t and 32x32b)."""

    def body():
        tmem_map = _packed(head_dim, dtype)
        base = placeholder_tmem_base()
        coords = _Coords()
        s_ids = epi_view(cute.make_identity_tensor((QK_TILE_M, QK_TILE_N)), EPI_COLS)
        o_ids = epi_view(cute.make_identity_tensor((QK_TILE_M, head_dim)), EPI_COLS)
        tiles = []
        for i in range(tmem_map.q_tiles):
            s_reg, o_reg = _kernel_s_region(tmem_map, i), tmem_map.o(i)
            s_cell, o_cell = _Cells(s_reg, ((0, 0), 0, 0)), _Cells(o_reg, ((0, 0), 0, 0))
            s_load, _ = make_acc_tmem_load(s_reg.at(base), EPI_COLS)
            o_load, _ = make_acc_tmem_load(o_reg.at(base), EPI_COLS, op=o_op() if o_op else None)
            o_store, _ = make_acc_tmem_store(o_reg.at(base), EPI_COLS)
            softmax, correction = [], []
            for t in range(EPI_THREADS):
                warp, lane = divmod(t, 32)
                s_mn = coords(s_load.get_slice(t).partition_D(s_ids))
                s_hw = _hw_32x32b(s_cell, warp, EPI_COLS, len(s_mn))(lane)
                softmax.append({
                    "s": s_mn,
                    "s_cells": [s_cell(((m, n), 0, 0)) for m, n in s_mn],
                    "s_hw": s_hw,
                    "slot": s_mn[0][0] + slot_shift,  # the kernel: sStats[row, .., i], row = tTR_cS[0][0]
                    "partner": warp % 4,  # stats slot 4 i + warp % 4
                })
                ld_mn = coords(o_load.get_slice(o_slice(t)).partition_D(o_ids))
                # registers are the store's source: partition_S says which O(m, n) value v goes to
                st_mn = coords(o_store.get_slice(o_slice(t)).partition_S(o_ids))
                per_chunk = len(ld_mn) // (head_dim // EPI_COLS)
                # the instruction's address comes from the slice (the kernel computes it from the
                # index it slices with); the data reach the lanes of the physical warp's thread
                o_hw = _hw_32x32b(o_cell, o_slice(t) // 32, per_chunk, len(ld_mn))(lane)
                correction.append({
                    "ld": ld_mn,
                    "st": st_mn,
                    "o_cells": [o_cell(((m, n), 0, 0)) for m, n in ld_mn],
                    "o_hw": o_hw,
                    "slot": ld_mn[0][0],  # the kernel: row = tTR_cO[0][0]; sO rows and LSE[row] too
                    "partner": warp % 4,
                })
            tiles.append({"softmax": softmax, "correction": correction,
                          "s_col": tmem_map.s_cols[i], "o_col": tmem_map.o_cols[i]})
        return {"tiles": tiles, "head_dim": head_dim}

    return trace(body)


def chain_failures(chain, max_report: int = 8) -> list[str]:
    """Every way "the correction thread holding row m's rescale factor loads, rescales, stores
    and writes out exactly row m of O_i, and that factor came from the softmax thread that
    reduced row m of S_i, through the handshake its warp takes part in" breaks. Empty = proven."""
    fails: list[str] = []
    d = chain["head_dim"]

    def note(msg):
        if len(fails) < max_report:
            fails.append(msg)

    for i, tile in enumerate(chain["tiles"]):
        writers: dict = {}
        for t, sm in enumerate(tile["softmax"]):
            rows = sorted({m for m, _ in sm["s"]})
            quarter = range(32 * (t // 32), 32 * (t // 32) + 32)
            if len(rows) != 1:
                note(f"tile {i}: softmax thread {t} holds S of rows {rows[:6]}: no row statistics")
                continue
            if sorted(n for _, n in sm["s"]) != list(range(QK_TILE_N)):
                note(f"tile {i}: softmax thread {t}'s S values are not the {QK_TILE_N} columns once each")
            if sm["s_cells"] != sm["s_hw"]:
                v = next(v for v, (a, b) in enumerate(zip(sm["s_cells"], sm["s_hw"], strict=True)) if a != b)
                note(f"tile {i}: softmax thread {t} value {v} is S{sm['s'][v]} at {sm['s_cells'][v]} by the "
                     f"region, tcgen05.ld.32x32b reads {sm['s_hw'][v]}")
            if any(c != (m, tile["s_col"] + n, 0) for (m, n), c in zip(sm["s"], sm["s_cells"], strict=True)):
                note(f"tile {i}: softmax thread {t} does not read S_{i} at columns {tile['s_col']}..")
            if any(c[0] not in quarter for c in sm["s_hw"]):
                note(f"tile {i}: softmax warp {t // 32} reads TMEM lanes outside {quarter.start}..{quarter.stop - 1}")
            writers.setdefault(sm["slot"], []).append((t, rows[0], sm["partner"]))

        readers: dict = {}
        for t, co in enumerate(tile["correction"]):
            rows = sorted({m for m, _ in co["ld"]})
            quarter = range(32 * (t // 32), 32 * (t // 32) + 32)
            if rows != [co["slot"]]:
                note(f"tile {i}: correction thread {t} reads the factor of row {co['slot']} "
                     f"but holds O of rows {rows[:6]}")
                continue
            if sorted(n for _, n in co["ld"]) != list(range(d)):
                note(f"tile {i}: correction thread {t}'s O values are not the {d} columns once each")
            if co["st"] != co["ld"]:
                v = next(v for v, (a, b) in enumerate(zip(co["ld"], co["st"], strict=True)) if a != b)
                note(f"tile {i}: correction thread {t} loads O{co['ld'][v]} into value {v} "
                     f"but stores it to O{co['st'][v]}")
            if co["o_cells"] != co["o_hw"]:
                v = next(v for v, (a, b) in enumerate(zip(co["o_cells"], co["o_hw"], strict=True)) if a != b)
                note(f"tile {i}: correction thread {t} value {v} is O{co['ld'][v]} at {co['o_cells'][v]} by the "
                     f"region, the 32x32b instruction moves {co['o_hw'][v]}")
            if any(c != (m, tile["o_col"] + n, 0) for (m, n), c in zip(co["ld"], co["o_cells"], strict=True)):
                note(f"tile {i}: correction thread {t} does not touch O_{i} where the PV MMA accumulates it")
            if any(c[0] not in quarter for c in co["o_hw"]):
                note(f"tile {i}: correction warp {t // 32} (thread {t}) touches TMEM lanes outside "
                     f"{quarter.start}..{quarter.stop - 1}")
            readers.setdefault(co["slot"], []).append(t)
            w = writers.get(co["slot"], [])
            if len(w) != 1:
                note(f"tile {i}: slot {co['slot']} has {len(w)} writers")
                continue
            wt, w_row, w_partner = w[0]
            if w_row != co["slot"]:
                note(f"tile {i}: slot {co['slot']} holds row {w_row}'s statistics (softmax thread {wt}), "
                     f"correction thread {t} applies them to row {co['slot']}")
            if w_partner != co["partner"]:
                note(f"tile {i}: correction warp {t // 32} reads slot {co['slot']}, written by softmax warp "
                     f"{wt // 32}, which hands off with correction warp {w_partner}: an unsynchronised read")
        if not fails:
            if sorted(readers) != list(range(QK_TILE_M)) or any(len(r) != 1 for r in readers.values()):
                note(f"tile {i}: the correction threads do not own the {QK_TILE_M} rows once each")
            if sorted(writers) != list(range(QK_TILE_M)):
                note(f"tile {i}: the softmax threads do not write the {QK_TILE_M} slots once each")
    return fails


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rescale_factor_and_o_rows_on_the_same_thread(head_dim):
    chain = gather_chain(head_dim)
    fails = chain_failures(chain)
    assert not fails, "\n".join(fails)
    # and it is the identity, as the kernel's docstring draws it: thread t owns row t everywhere
    for tile in chain["tiles"]:
        assert [co["slot"] for co in tile["correction"]] == list(range(EPI_THREADS))
        assert [sm["slot"] for sm in tile["softmax"]] == list(range(EPI_THREADS))


def test_checker_rejects_correction_sliced_as_if_from_warp_1():
    # the correction's O copies sliced with (t + 32) % 128: warp w touches the lanes of warp w + 1
    # and applies the factors its handshake partner did not write
    fails = chain_failures(gather_chain(128, o_slice=lambda t: (t + 32) % EPI_THREADS))
    assert fails, "the checker accepted O rows scaled by another warp's statistics"
    assert any("lanes outside" in f for f in fails)
    assert any("unsynchronised read" in f for f in fails)


def test_checker_rejects_factor_written_to_the_next_rows_slot():
    fails = chain_failures(gather_chain(64, slot_shift=1))
    assert fails and any("statistics (softmax thread" in f for f in fails)


def test_checker_rejects_o_rows_spread_over_threads():
    # 16 lanes x 256 bits: a thread holds values of two rows of O, no single factor applies
    fails = chain_failures(gather_chain(128, o_op=lambda: tcgen05.Ld16x256bOp(tcgen05.Repetition(EPI_COLS // 8))))
    assert fails and any("holds O of rows" in f for f in fails)


# ---------------------------------------------------------------------------------------
# 2. the TMEM map


def describe_map(tmem_map_fn):
    def body():
        m = tmem_map_fn()
        out = {"spans": m.spans(), "failures": m.failures(), "q_tiles": m.q_tiles}
        if not out["failures"]:
            out["alloc"] = m.alloc_columns()
            # the softmax's runtime addressing (region 0 + i * stride) against the map's regions
            same = lambda a, b: (a.offset, str(a.layout)) == (b.offset, str(b.layout))  # noqa: E731
            out["s_as_map"] = [same(_kernel_s_region(m, i), m.s(i)) for i in range(m.q_tiles)]
            out["p_as_map"] = [same(_kernel_p_store_region(m, i), m.p_store(i)) for i in range(m.q_tiles)]
        return out

    return trace(body)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_tmem_map_fits_512_without_overlap(head_dim):
    got = describe_map(lambda: _packed(head_dim))
    assert got["failures"] == []
    q = got["q_tiles"]
    assert q == (2 if head_dim <= 128 else 1)
    # the picture in the kernel's docstring
    want = []
    for i in range(q):
        want += [(f"S{i}", 128 * i, 128 * i + 128), (f"P{i}", 128 * i + 64, 128 * i + 128),
                 (f"O{i}", 128 * q + head_dim * i, 128 * q + head_dim * (i + 1))]
    assert got["spans"] == want
    assert got["alloc"] == TMEM_COLUMNS and max(b for _, _, b in got["spans"]) <= TMEM_COLUMNS
    assert all(got["s_as_map"]) and all(got["p_as_map"])


@pytest.mark.parametrize(
    "name, make, expect",
    [
        ("O0 over S1", lambda: AttentionTmemMap(BF16, 128, [0, 128], [192, 320]), "O0 (columns 192..319) overlaps S1"),
        ("two tiles at hd 256", lambda: AttentionTmemMap.packed(BF16, 256, 2), "past the 512 TMEM columns"),
        ("S tiles 64 apart", lambda: AttentionTmemMap(BF16, 64, [0, 64], [256, 320]),
         "S0 (columns 0..127) overlaps S1"),
    ],
)
def test_checker_rejects_bad_tmem_maps(name, make, expect):
    got = describe_map(make)
    assert got["failures"], f"the checker accepted a map with {name}"
    assert any(expect in f for f in got["failures"]), got["failures"]


def test_tiles_that_fit():
    assert [q_tiles_in_flight(d) for d in HEAD_DIMS] == [2, 2, 1]


# ---------------------------------------------------------------------------------------
# 3. TMEM-P for every Q tile in flight (stage B's checker)


@pytest.fixture(scope="module")
def p_writes():
    """What softmax warpgroup i stores as P, per tile, at head_dim 128 (two tiles; the P store
    does not depend on head_dim, only the S tile's column does)."""

    cache = {}

    def tile_writes(i, doubled=True, shifted=True):
        key = (i, doubled, shifted)
        if key not in cache:
            cache[key] = gather_p_writes(
                BF16, p_store=lambda: _kernel_p_store_region(_packed(128), i, doubled=doubled, shifted=shifted)
            )
        return cache[key]

    return tile_writes


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_p_of_every_tile_written_where_its_pv_mma_reads_it(p_writes, head_dim):
    cols = _packed_columns(head_dim)
    for i, s_col in enumerate(cols["s_cols"]):
        reads = gather_p_reads(BF16, head_dim, operand=lambda i=i: _packed(head_dim).p_operand(i))
        fails = tmem_p_failures(p_writes(i), reads, (s_col, s_col + QK_TILE_N))
        assert not fails, f"tile {i}:\n" + "\n".join(fails)


def _packed_columns(head_dim):
    return trace(lambda: {"s_cols": list(_packed(head_dim).s_cols), "o_cols": list(_packed(head_dim).o_cols)})


def test_checker_rejects_tile_1_p_without_the_tile_offset(p_writes):
    reads = gather_p_reads(BF16, 128, operand=lambda: _packed(128).p_operand(1))
    fails = tmem_p_failures(p_writes(1, shifted=False), reads, (QK_TILE_N, 2 * QK_TILE_N))
    assert fails and any("read where they were not written" in f for f in fails)
    assert any("outside S's columns" in f for f in fails)


def test_checker_rejects_tile_offset_not_doubled_for_16bit_p(p_writes):
    reads = gather_p_reads(BF16, 128, operand=lambda: _packed(128).p_operand(1))
    fails = tmem_p_failures(p_writes(1, doubled=False), reads, (QK_TILE_N, 2 * QK_TILE_N))
    assert fails and any("read where they were not written" in f for f in fails)


# ---------------------------------------------------------------------------------------
# 4. the compiled kernel: TMEM operands in the PTX

_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[(%r\d+)\],\s*(\[?%r?d?\d+\]?),")
_LD = re.compile(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x(\d+)\.b32\s+\{[^}]*\},\s*\[(%r\d+)\]")
_ST = re.compile(r"tcgen05\.st\.sync\.aligned\.32x32b\.x(\d+)\.b32\s+\[(%r\d+)\]")
_ALLOC = re.compile(r"tcgen05\.alloc\S*\s+(\[%r\d+\+\d+\])")


def _allocated_base(ptx: str) -> str:
    """The register the MMA warp reads the allocated TMEM base into (the first load of the
    SMEM word tcgen05.alloc wrote)."""
    m = _ALLOC.search(ptx)
    ld = re.compile(r"ld\.shared\.b32\s+(%r\d+),\s*" + re.escape(m.group(1)))
    return ld.search(ptx, m.end()).group(1)


@pytest.mark.compile
@pytest.mark.slow  # about 5 s: one compile
@pytest.mark.parametrize("head_dim", [128, 256])  # two Q tiles (runtime tile offset) / one
def test_ptx_tmem_operands_at_the_map_columns(tmp_path, head_dim):
    import torch

    from dsv4_attention.common import jit
    from dsv4_attention.stages import c_online_softmax as stage

    kernel = stage.make_kernel("sm100", torch.bfloat16, head_dim)
    ptx = jit.compile_ptx(kernel, stage.example_args(torch.bfloat16, head_dim), "sm100", tmp_path)
    resolve = _resolve(ptx)
    base = _allocated_base(ptx)
    cols = _packed_columns(head_dim)
    s_cols, o_cols = cols["s_cols"], cols["o_cols"]

    # MMAs: QK (A in SMEM: a 64-bit descriptor) writes S_i; PV (A in TMEM: [%r]) writes O_i from P_i
    qk, pv = [], []
    for dst, a in _MMA.findall(ptx):
        d_root, d_col = resolve(dst)
        assert d_root == base, f"an MMA's accumulator is not addressed from the allocated base: {dst}"
        if a.startswith("["):
            a_root, a_col = resolve(a.strip("[]"))
            assert a_root == base
            pv.append((d_col, a_col))
        else:
            qk.append(d_col)
    k_phases = head_dim // 16
    assert sorted(set(qk)) == s_cols and len(qk) == 2 * k_phases * len(s_cols)  # iteration 0 and the loop
    for i, (s_col, o_col) in enumerate(zip(s_cols, o_cols, strict=True)):
        a_cols = sorted({a for d, a in pv if d == o_col})
        assert a_cols == [s_col + 64 + 8 * kp for kp in range(QK_TILE_N // 16)], (i, a_cols)
    assert sorted({d for d, _ in pv}) == o_cols

    # correction: O loads and stores at o_col + 32 c from one lane base; the rescale stores only
    # touch columns the loads read
    loads = [(int(x), resolve(r)) for x, r in _LD.findall(ptx)]
    stores = [(int(x), resolve(r)) for x, r in _ST.findall(ptx)]
    o_ld = {c for x, (_, c) in loads if x == EPI_COLS and c >= o_cols[0]}
    o_st = {c for x, (_, c) in stores if x == EPI_COLS and c >= o_cols[0]}
    want = {o + EPI_COLS * c for o in o_cols for c in range(head_dim // EPI_COLS)}
    assert o_ld == want and o_st == want, (sorted(o_ld), sorted(o_st))
    # softmax: S loads at 0, 32, 64, 96 and P stores at 64, 96 from the same (tile-moved) lane base
    s_ld = [(r, c) for x, (r, c) in loads if x == EPI_COLS and c < QK_TILE_N]
    p_st = [(r, c) for x, (r, c) in stores if x == P_STORE_COLS and c < QK_TILE_N]
    assert sorted(c for _, c in s_ld) == [0, 32, 64, 96]
    assert sorted(c for _, c in p_st) == [64, 96]
    assert len({r for r, _ in s_ld + p_st}) == 1, (s_ld, p_st)
    assert ACC_DTYPE.width == 32


# ---------------------------------------------------------------------------------------
# 5. the schedule's arithmetic, modelled on the host (a model, not the kernel: it checks the
#    algebra the kernel's docstring states: tiles visited last first, the tail masked, the max
#    kept per warp unless it grew past RESCALE_THRESHOLD, l and O rescaled by the same factor,
#    P rounded to 16 bits after its fp32 sum was taken)


def _online_model(q, k, v, scale_log2, rescale_o=True, warp=32, tile_n=128):
    import math

    import torch

    from dsv4_attention.common.sm100_softmax import RESCALE_THRESHOLD

    s = q.float() @ k.float().T  # the QK MMA: 16-bit inputs, fp32 accumulator
    rows, n_keys = s.shape
    n_tiles = -(-n_keys // tile_n)
    m = torch.full((rows,), -math.inf)
    l = torch.zeros(rows)  # noqa: E741
    o = torch.zeros(rows, v.shape[1])
    max_p = 0.0
    for it in range(n_tiles):
        tile = n_tiles - 1 - it
        st = torch.full((rows, tile_n), -math.inf)
        keys = slice(tile * tile_n, min(n_keys, (tile + 1) * tile_n))
        st[:, : keys.stop - keys.start] = s[:, keys]  # keys past seqlen_k masked to -inf
        m_cand = torch.maximum(m, st.max(1).values * scale_log2)
        grow = (m_cand - m > RESCALE_THRESHOLD).view(-1, warp).any(1).repeat_interleave(warp)  # the vote
        m_new = torch.where(grow, m_cand, m)
        sc = torch.where(grow, torch.exp2(m - m_new), torch.ones(rows))
        p = torch.exp2(st * scale_log2 - m_new[:, None])
        max_p = max(max_p, float(p.max()))
        l = l * sc + p.sum(1)  # noqa: E741
        v_tile = torch.zeros(tile_n, v.shape[1])
        v_tile[: keys.stop - keys.start] = v[keys].float()  # TMA zero-fills V past seqlen_k
        o = (o * sc[:, None] if rescale_o else o) + p.to(q.dtype).float() @ v_tile
        m = m_new
    return o / l[:, None], (m + torch.log2(l)) * math.log(2.0), max_p


def _growing_max_case(seed=0, rows=128, n_keys=700, d=64):
    """Scores whose row max grows by more than the threshold in the tile visited last (tile 0),
    by less in others, on a few rows per warp only (so the vote matters)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, d, generator=g)
    k = torch.randn(n_keys, d, generator=g)
    k[:128] *= 3.0  # tile 0, visited last: larger scores, the max grows late
    k[300:310] *= 1.5  # a mild growth in tile 2
    v = torch.randn(n_keys, d, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def test_model_of_the_schedule_matches_softmax():
    import math

    import torch

    q, k, v = _growing_max_case()
    scale_log2 = q.shape[1] ** -0.5 * math.log2(math.e)
    o, lse, max_p = _online_model(q, k, v, scale_log2)
    s = q.double() @ k.double().T * q.shape[1] ** -0.5
    ref_o = torch.softmax(s, 1) @ v.double()
    ref_lse = torch.logsumexp(s, 1)
    assert max_p <= 2.0**8  # a stale max keeps P within 2^threshold: fits bf16 / fp16
    assert max_p > 1.0  # ... and the case did run on a stale max
    assert (o.double() - ref_o).norm() / ref_o.norm() < 2e-3  # P rounded to bf16
    assert (lse.double() - ref_lse).abs().max() < 1e-5


def test_model_rejects_a_missing_o_rescale():
    import math

    import torch

    q, k, v = _growing_max_case()
    scale_log2 = q.shape[1] ** -0.5 * math.log2(math.e)
    o, _, _ = _online_model(q, k, v, scale_log2, rescale_o=False)
    s = q.double() @ k.double().T * q.shape[1] ** -0.5
    ref_o = torch.softmax(s, 1) @ v.double()
    assert (o.double() - ref_o).norm() / ref_o.norm() > 0.1
