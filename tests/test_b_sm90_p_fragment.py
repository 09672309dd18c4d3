"""Host proof (CPU, no GPU): stage B's SM90 P stays in place from the QK accumulator
to the PV wgmma's A operand, and the row statistics live on the right threads.

The kernel (stages/b_p_onchip/sm90.py) rounds the QK accumulator S = P (after the
softmax) to 16 bits in registers laid out exactly like the accumulator, then hands
those registers to the register-sourced PV wgmma through
``common.p_staging.acc_to_a_layout`` (no data movement). That is only right if, for
every thread t of the CTA (both warpgroups) and every register i of P:

  the (m, n) that the QK MMA's accumulator partition (``partition_C`` of the 128 x 128
  identity tile, register i = ``make_fragment_C(...).layout`` of the value) assigns to
  register i  ==  the (m, k) that the PV MMA's A partition (``partition_A`` of the
  128 x 128 identity P tile) assigns to the A value the reinterpretation reads from
  register i,

and the reinterpretation is a bijection onto the 64 registers. Built with the builders
the kernel calls (``common.sm90_gemm.make_tiled_mma``, ``common.p_staging.make_pv_tiled_mma``,
``acc_to_a_layout``, ``common.softmax.acc_rows_layout``), for bf16 and fp16.

Here the accumulator's register order already is the A fragment's, so the correct
relabelling is a plain reshape; the negative controls are the plausible wrong ones,
each rejected by the same checker:
  - ``kblock_strided``: the octet mode reshaped (8, 2) instead of (2, 8), i.e. k-block j
    built from column octets j and j + 8 (a reshape in the wrong mode order);
  - ``halves_swapped``: the two 8-column halves of every k-block exchanged;
  - ``rows_for_halves``: the row-pair and column-half value modes exchanged.

Also proven: (1) the softmax's row view (``acc_rows_layout``) puts one row in each
row of the view, the 4 lanes of a quad share those rows and hold all 128 keys of them
between them, the PV accumulator's row view has the same rows per thread (so 1/rowsum
scales the right O rows), and exactly one thread per row holds column 0 (the LSE writer);
(2) V's MN-major MMA view (``make_mn_major_smem_layout``) is, element for element, the
transpose of the K-major layout TMA fills.

Nothing is launched; only plain Python ints leave the trace.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
from cutlass.cute.nvgpu import warpgroup
from partitions import coords, kblock_strided, rows_for_halves

from dsv4_attention.common.layout_proof import as_ints, first_mismatches, offset_of, trace
from dsv4_attention.common.p_staging import acc_to_a_layout, make_pv_tiled_mma
from dsv4_attention.common.sm90_gemm import (
    NUM_THREADS,
    TILE_K,
    TILE_M,
    TILE_N,
    make_kmajor_smem_layout,
    make_mn_major_smem_layout,
    make_tiled_mma,
    num_k_blocks,
)
from dsv4_attention.common.softmax import QUAD, acc_rows_layout

pytestmark = [pytest.mark.stage_b, pytest.mark.proof, pytest.mark.arch("sm90")]

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
HEAD_DIMS = (64, 128, 256)
PV_HEAD_DIM = 128  # the A operand (P) does not depend on the PV MMA's N


# ---------------------------------------------------------------------------------------
# wrong reinterpretations (negative controls), same signature as acc_to_a_layout


class halves_swapped:  # noqa: N801 - used like the layout functions
    """The two 8-column halves of each k-block exchanged (register of half h read as 1 - h)."""

    def __init__(self, acc_layout):
        self.right = acc_to_a_layout(acc_layout)
        self.half_stride = acc_layout.stride[0][2]
        self.shape = self.right.shape

    def __call__(self, i):
        reg = int(self.right(i))
        return reg ^ self.half_stride  # half_stride = 4: flips bit 2 of c + 2r + 4h + 8j


REINTERPRETATIONS = {
    "right": acc_to_a_layout,
    "kblock_strided": kblock_strided,
    "halves_swapped": halves_swapped,
    "rows_for_halves": rows_for_halves,
}


# ---------------------------------------------------------------------------------------
# gather (inside the trace) and check (plain Python)


def _mode_sizes(shape) -> tuple[int, ...]:
    return tuple(int(cute.size(shape, mode=[i])) for i in range(len(shape)))


def gather(dtype_name: str) -> dict:
    """What every thread holds, as the kernel builds it. Per thread t:
    qk[t][i] = (m, n) of accumulator register i; a[t][v] = (m, k) of A value v
    (values in the order cute.gemm slices them); o_rows[t][i] = rows that the PV
    accumulator's row-view row i touches; lse[t] = (holds column 0, rows). Per
    reinterpretation: regs[name][v] = register read as A value v."""

    def body():
        dtype = DTYPES[dtype_name]
        qk_mma = make_tiled_mma(dtype)
        pv_mma = make_pv_tiled_mma(dtype, PV_HEAD_DIM)
        ident_s = cute.make_identity_tensor((TILE_M, TILE_N))
        ident_p = cute.make_identity_tensor((TILE_M, TILE_N))  # P: 128 rows x 128 keys
        ident_o = cute.make_identity_tensor((TILE_M, PV_HEAD_DIM))

        # The kernel makes each thread's fragment from its own slice; it is the same
        # compact register layout for every thread (checked), so one serves all.
        frags = set()
        for t in (0, 31, 127, 128, 255):
            thr = qk_mma.get_slice(t)
            acc = thr.make_fragment_C(thr.partition_shape_C((TILE_M, TILE_N)))
            frags.add(str(acc.layout))
        acc_layout = acc.layout
        a_shape = _mode_sizes(pv_mma.get_slice(0).partition_shape_A((TILE_M, TILE_N)))
        regs, shapes = {}, {}
        for name, fn in REINTERPRETATIONS.items():
            lay = fn(acc_layout)
            shapes[name] = _mode_sizes(lay.shape)
            regs[name] = [int(lay(v)) for v in range(cute.size(lay.shape))]
        acc_regs = [int(acc_layout(i)) for i in range(cute.size(acc_layout))]
        rows_lay = acc_rows_layout(acc_layout)
        rows_regs = [
            [int(rows_lay((i, j))) for j in range(cute.size(rows_lay, mode=[1]))]
            for i in range(cute.size(rows_lay, mode=[0]))
        ]

        thr_pv0 = pv_mma.get_slice(0)
        acc_o = thr_pv0.make_fragment_C(thr_pv0.partition_shape_C((TILE_M, PV_HEAD_DIM)))
        o_regs = [int(acc_o.layout(v)) for v in range(cute.size(acc_o.layout))]
        o_rows_lay = acc_rows_layout(acc_o.layout)
        o_rows_regs = [
            [int(o_rows_lay((i, j))) for j in range(cute.size(o_rows_lay, mode=[1]))]
            for i in range(cute.size(o_rows_lay, mode=[0]))
        ]

        qk, a, o_rows, lse = [], [], [], []
        for t in range(NUM_THREADS):
            thr_qk = qk_mma.get_slice(t)
            thr_pv = pv_mma.get_slice(t)
            tScS = thr_qk.partition_C(ident_s)
            held = coords(tScS)
            qk.append({acc_regs[i]: held[i] for i in range(len(held))})
            a.append(coords(thr_pv.partition_A(ident_p)))
            # O's row view, as the epilogue scales it: register -> row, row view -> registers
            o_held = coords(thr_pv.partition_C(ident_o))
            o_row_of = {o_regs[v]: o_held[v][0] for v in range(len(o_held))}
            o_rows.append([sorted({o_row_of[r] for r in regs}) for regs in o_rows_regs])
            c_view = cute.make_tensor(tScS.iterator, acc_rows_layout(tScS.layout))
            lse.append((int(c_view[0, 0][1]) == 0, [int(c_view[i, 0][0]) for i in range(cute.size(c_view, mode=[0]))]))
        return {
            "frags": sorted(frags),
            "a_shape": a_shape,
            "shapes": shapes,
            "regs": regs,
            "rows_regs": rows_regs,
            "qk": qk,
            "a": a,
            "o_rows": o_rows,
            "lse": lse,
        }

    return trace(body, arch="sm90")


def placement_failures(g: dict, name: str) -> list:
    """Every (thread, A value) whose register holds a different (m, n) than the PV MMA
    reads there, plus shape and bijection failures. Empty list = proven."""
    regs = g["regs"][name]
    fails = []
    if g["shapes"][name] != g["a_shape"]:
        fails.append(("mode sizes", g["a_shape"], g["shapes"][name]))
    if sorted(regs) != sorted(g["qk"][0]):
        fails.append(("not a bijection onto the accumulator registers", sorted(g["qk"][0]), sorted(regs)))
    for t in range(NUM_THREADS):
        expected = {v: mk for v, mk in enumerate(g["a"][t])}
        actual = {v: g["qk"][t].get(regs[v]) for v in range(len(regs))}
        fails += [(f"thread {t} A value {v}", want, got) for v, want, got in first_mismatches(expected, actual)]
        if len(fails) >= 8:
            break
    return fails


@pytest.fixture(scope="module", params=list(DTYPES))
def holdings(request):
    return gather(request.param)


def test_p_registers_are_the_pv_a_fragment(holdings):
    g = holdings
    assert g["frags"] == ["((2,2,16),1,1):((1,2,4),0,0)"], g["frags"]
    assert len(g["a"]) == NUM_THREADS and all(len(a) == 64 for a in g["a"])
    # every (m, key) of the 128 x 128 P tile is read exactly once by the PV MMA
    assert len({mk for a in g["a"] for mk in a}) == TILE_M * TILE_N
    fails = placement_failures(g, "right")
    assert not fails, fails


@pytest.mark.parametrize("wrong", ["kblock_strided", "halves_swapped", "rows_for_halves"])
def test_negative_controls_are_rejected(holdings, wrong):
    assert placement_failures(holdings, wrong), f"{wrong} passed the checker"


def test_fast_coordinates_match_tensor_indexing():
    """``coords`` (used by the gather for speed) agrees with plain ``tensor[v]``."""

    def body():
        qk_mma = make_tiled_mma(cutlass.BFloat16)
        pv_mma = make_pv_tiled_mma(cutlass.BFloat16, PV_HEAD_DIM)
        ident = cute.make_identity_tensor((TILE_M, TILE_N))
        same = True
        for t in (0, 77, 200):
            for part in (qk_mma.get_slice(t).partition_C(ident), pv_mma.get_slice(t).partition_A(ident)):
                plain = [tuple(int(x) for x in part[v]) for v in range(cute.size(part))]
                same = same and plain == coords(part)
        return same

    assert trace(body, arch="sm90")


def test_row_statistics_live_on_the_quad_that_owns_the_row(holdings):
    g = holdings
    rows_regs = g["rows_regs"]
    owners = {}
    for t in range(NUM_THREADS):
        rows = []
        for i, regs in enumerate(rows_regs):
            ms = {g["qk"][t][r][0] for r in regs}
            assert len(ms) == 1, f"thread {t}: row view row {i} mixes rows {sorted(ms)}"
            rows.append(ms.pop())
        quad0 = t - t % QUAD
        for i, m in enumerate(rows):
            # the quad holds all keys of row m, each once
            keys = sorted(g["qk"][q][r][1] for q in range(quad0, quad0 + QUAD) for r in rows_regs[i])
            assert keys == list(range(TILE_N)), f"quad of thread {t} does not hold all keys of row {m}"
        o_rows = g["o_rows"][t]
        assert o_rows == [[m] for m in rows], f"thread {t}: O row view {o_rows} != S rows {rows}"
        is_writer, lse_rows = g["lse"][t]
        assert lse_rows == rows, f"thread {t}: LSE rows {lse_rows} != S rows {rows}"
        if is_writer:
            for m in rows:
                assert m not in owners, f"row {m} written by threads {owners[m]} and {t}"
                owners[m] = t
    assert sorted(owners) == list(range(TILE_M))


# ---------------------------------------------------------------------------------------
# V: the bytes TMA writes (K-major, (key, head_dim)) are the MMA's MN-major (head_dim, key)








def v_mismatches(head_dim: int, wrong_order: bool = False) -> list:
    """(key, d) whose element offset in the TMA layout (key, d % 64, d / 64) differs from
    the MMA view's (d, key). wrong_order: the negative control, an MN-major view tiled
    head-dim blocks first (order (0, 1)) instead of key atoms first."""

    def body():
        dtype = cutlass.BFloat16
        tma = make_kmajor_smem_layout(dtype, TILE_N, num_k_blocks(head_dim))
        if wrong_order:
            atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dtype)
            mma = cute.tile_to_shape(atom, (head_dim, TILE_N), order=(0, 1))
        else:
            mma = make_mn_major_smem_layout(dtype, head_dim, TILE_N)
        return (
            str(tma.inner),
            str(mma.inner),
            as_ints(tma.outer.shape),
            as_ints(tma.outer.stride),
            as_ints(mma.outer.shape),
            as_ints(mma.outer.stride),
            int(cute.cosize(tma)),
            int(cute.cosize(mma)),
        )

    tma_swz, mma_swz, tshape, tstride, mshape, mstride, tcos, mcos = trace(body, arch="sm90")
    bad = []
    if tma_swz != mma_swz:  # the swizzle rides on the (shared) pointer: it must agree
        bad.append(("swizzle", tma_swz, mma_swz))
    if not tcos == mcos == TILE_N * head_dim:
        bad.append(("cosize", tcos, mcos))
    bad += [
        (key, d)
        for key in range(TILE_N)
        for d in range(head_dim)
        if offset_of(tshape, tstride, (key, d % TILE_K, d // TILE_K)) != offset_of(mshape, mstride, (d, key))
    ]
    return bad


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_v_mma_view_is_the_transpose_of_the_tma_layout(head_dim):
    bad = v_mismatches(head_dim)
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:4]}"


def test_v_checker_rejects_a_wrongly_tiled_view():
    assert v_mismatches(128, wrong_order=True)
