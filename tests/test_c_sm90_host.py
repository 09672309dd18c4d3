"""Host proofs (CPU, no GPU) for what stage C's SM90 kernel adds over stage B.

stages/c_online_softmax/sm90.py runs new tile shapes (192 x 128 with three consumer
warpgroups at head dim 64, 128 x 80 at head dim 256), a ring of K/V stages, a packed
P conversion, a running row max / sum that rescales O in place, and a key mask on
the first KV tile it visits. Proven here, with the builders the kernel calls:

1. V in the ring: for every (key, d, stage), the element the PV wgmma reads through
   ``make_tile_smem_layout_mn`` is the element TMA wrote through ``make_tile_smem_layout``
   (same swizzle, transposed coordinates, stage s at s * rows * d). Negative controls:
   the MN-major view tiled head-dim blocks first, and the stages laid out innermost.
2. P in registers, at each default tile: for every thread of every consumer warpgroup
   and every A value of the PV wgmma, the register the relabelling
   (``common.p_staging.acc_to_a_layout``) hands over holds the (row, key) that A value
   is. Negative controls: k-blocks built from strided octets, halves exchanged.
3. The packed conversion (``convert_p_packed``): registers 2i and 2i+1 of S hold keys
   (k, k + 1) of one row, and the A operand reads them as the low and high half of one
   32-bit register in that order. Negative control: pairs (i, i + 2) (two rows).
4. Rows: the online softmax's row view (``acc_rows_layout``) puts one row per view row,
   the quad holds all tile_n keys of it, the O accumulator's row view has the same rows
   (the rescale and 1/rowsum scale the right O rows), and one thread per row writes LSE.
   Negative control: a row view with the row and column-pair modes exchanged.
5. The key mask (``common.mask``): on the first tile visited, num_kv_tiles - 1, the
   values ``key_limit`` masks are exactly the keys >= seqlen_k, every row keeps at least
   one key, and no other tile has a key past seqlen_k. Negative controls: the limit
   without the tile offset, the mask applied to tile 0 (ascending order).
6. setmaxnreg: the register split fits 64 K registers per SM, multiples of 8.

Nothing is launched; only plain Python ints leave the trace.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
from cutlass.cute.nvgpu import warpgroup
from partitions import coords, kblock_strided, rows_for_halves

from dsv4_attention.common.layout_proof import as_ints, first_mismatches, offset_of, trace
from dsv4_attention.common.mask import key_limit, num_kv_tiles
from dsv4_attention.common.p_staging import acc_to_a_layout, make_pv_tiled_mma
from dsv4_attention.common.sm90_gemm import (
    THREADS_PER_WARPGROUP,
    WGMMA_M,
    make_tile_smem_layout,
    make_tile_smem_layout_mn,
    make_tiled_mma,
)
from dsv4_attention.common.softmax import QUAD, acc_rows_layout
from dsv4_attention.stages.c_online_softmax.sm90 import DEFAULT_TILES, REGISTERS

pytestmark = [pytest.mark.stage_c, pytest.mark.proof, pytest.mark.arch("sm90")]

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
# (tile_m, tile_n, head_dim): the kernel's defaults
CONFIGS = [(m, n, d) for d, (m, n) in sorted(DEFAULT_TILES.items())]
SEQLENS_K = (1, 79, 80, 81, 127, 128, 129, 160, 1000, 4096)








# ---------------------------------------------------------------------------------------
# 1. V through the ring of stages


def v_ring_mismatches(rows: int, head_dim: int, stages: int, wrong: str | None = None) -> list:
    def body():
        dtype = cutlass.BFloat16
        tma = make_tile_smem_layout(dtype, rows, head_dim, stages)
        if wrong == "head_dim_blocks_first":
            atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dtype)
            mma = cute.tile_to_shape(atom, (head_dim, rows, stages), order=(0, 1, 2))
        elif wrong == "stages_innermost":
            atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dtype)
            mma = cute.tile_to_shape(atom, (head_dim, rows, stages), order=(2, 1, 0))
        else:
            mma = make_tile_smem_layout_mn(dtype, rows, head_dim, stages)
        return (str(tma.inner), str(mma.inner), as_ints(tma.outer.shape), as_ints(tma.outer.stride),
                as_ints(mma.outer.shape), as_ints(mma.outer.stride), int(cute.cosize(tma)), int(cute.cosize(mma)))

    tswz, mswz, tshape, tstride, mshape, mstride, tcos, mcos = trace(body, arch="sm90")
    bad = []
    if tswz != mswz:  # the swizzle rides on the one pointer both views share
        bad.append(("swizzle", tswz, mswz))
    if not tcos == mcos == rows * head_dim * stages:
        bad.append(("cosize", tcos, mcos))
    for s in range(stages):
        for key in range(rows):
            for d in range(head_dim):
                written = offset_of(tshape, tstride, (key, d, s))
                if written != offset_of(mshape, mstride, (d, key, s)):
                    bad.append((key, d, s))
                elif d == 0 and key == 0 and written != s * rows * head_dim:
                    bad.append(("stage offset", s, written))
                if len(bad) > 8:
                    return bad
    return bad


@pytest.mark.parametrize("rows,head_dim,stages", [(128, 64, 2), (128, 128, 2), (128, 128, 3), (80, 256, 2)])
def test_v_ring_mma_view_is_the_transpose_of_the_tma_layout(rows, head_dim, stages):
    bad = v_ring_mismatches(rows, head_dim, stages)
    assert not bad, bad


@pytest.mark.parametrize("wrong", ["head_dim_blocks_first", "stages_innermost"])
def test_v_ring_checker_rejects_wrong_views(wrong):
    assert v_ring_mismatches(80, 256, 2, wrong)


# ---------------------------------------------------------------------------------------
# 2-5. What every consumer thread holds, at each default tile


RELABELLINGS = {"right": acc_to_a_layout, "kblock_strided": kblock_strided, "rows_for_halves": rows_for_halves}


def rows_cols_exchanged(acc_layout):
    """A wrong row view: ((c, m), (r, v, n)) instead of ((r, m), (c, v, n))."""
    (c, r, v), m, n = acc_layout.shape
    (dc, dr, dv), dm, dn = acc_layout.stride
    return cute.make_layout(((c, m), (r, v, n)), stride=((dc, dm), (dr, dv, dn)))


ROW_VIEWS = {"right": acc_rows_layout, "rows_cols_exchanged": rows_cols_exchanged}


def gather(tile_m: int, tile_n: int, head_dim: int, dtype_name: str = "bfloat16") -> dict:
    """Per consumer thread t (the kernel's tidx - 128): s[t][reg] = (row, key) of S
    register reg; a[t][v] = (row, key) of PV A value v; o[t][reg] = (row, col) of O
    register reg. Per relabelling: the register read as A value v. Per row view: the
    registers of each view row, for S and for O."""
    warpgroups = tile_m // WGMMA_M

    def body():
        dtype = DTYPES[dtype_name]
        qk = make_tiled_mma(dtype, tile_n, warpgroups=warpgroups)
        pv = make_pv_tiled_mma(dtype, head_dim, warpgroups=warpgroups)
        thr0 = qk.get_slice(0)
        acc = thr0.make_fragment_C(thr0.partition_shape_C((tile_m, tile_n)))
        pv0 = pv.get_slice(0)
        acc_o = pv0.make_fragment_C(pv0.partition_shape_C((tile_m, head_dim)))
        a_sizes = tuple(int(cute.size(pv0.partition_shape_A((tile_m, tile_n)), mode=[i])) for i in range(3))
        relabel = {}
        for name, fn in RELABELLINGS.items():
            lay = fn(acc.layout)
            relabel[name] = (tuple(int(cute.size(lay.shape, mode=[i])) for i in range(3)),
                             [int(lay(v)) for v in range(cute.size(lay.shape))])
        views = {}
        for name, fn in ROW_VIEWS.items():
            for what, layout in (("s", acc.layout), ("o", acc_o.layout)):
                rl = fn(layout)
                views[name, what] = [[int(rl((i, j))) for j in range(cute.size(rl, mode=[1]))]
                                     for i in range(cute.size(rl, mode=[0]))]
        s_regs = [int(acc.layout(v)) for v in range(cute.size(acc.layout))]
        o_regs = [int(acc_o.layout(v)) for v in range(cute.size(acc_o.layout))]
        ident_s = cute.make_identity_tensor((tile_m, tile_n))
        ident_o = cute.make_identity_tensor((tile_m, head_dim))
        s, a, o = [], [], []
        for t in range(warpgroups * THREADS_PER_WARPGROUP):
            held = coords(qk.get_slice(t).partition_C(ident_s))
            s.append({s_regs[v]: held[v] for v in range(len(held))})
            a.append(coords(pv.get_slice(t).partition_A(ident_s)))
            held_o = coords(pv.get_slice(t).partition_C(ident_o))
            o.append({o_regs[v]: held_o[v] for v in range(len(held_o))})
        return {"layout": str(acc.layout), "a_sizes": a_sizes, "relabel": relabel, "views": views,
                "s": s, "a": a, "o": o}

    return trace(body, arch="sm90")


_GATHERED: dict = {}


def holdings(tile_m, tile_n, head_dim, dtype_name="bfloat16"):
    key = (tile_m, tile_n, head_dim, dtype_name)
    if key not in _GATHERED:
        _GATHERED[key] = gather(*key)
    return _GATHERED[key]


CASES = [pytest.param(*c, "bfloat16", id=f"{c[0]}x{c[1]}-hd{c[2]}") for c in CONFIGS] + [
    pytest.param(*CONFIGS[-1], "float16", id=f"{CONFIGS[-1][0]}x{CONFIGS[-1][1]}-hd{CONFIGS[-1][2]}-fp16")
]


def p_failures(g: dict, name: str) -> list:
    sizes, regs = g["relabel"][name]
    fails = []
    if sizes != g["a_sizes"]:
        fails.append(("mode sizes", g["a_sizes"], sizes))
    if sorted(regs) != sorted(g["s"][0]):
        fails.append(("not a bijection onto the S registers",))
    for t, (held, reads) in enumerate(zip(g["s"], g["a"], strict=True)):
        expected = dict(enumerate(reads))
        actual = {v: held.get(regs[v]) for v in range(len(regs))}
        fails += [(f"thread {t} A value {v}", want, got) for v, want, got in first_mismatches(expected, actual)]
        if len(fails) >= 8:
            break
    return fails


@pytest.mark.parametrize("tile_m,tile_n,head_dim,dtype_name", CASES)
def test_p_registers_are_the_pv_a_fragment(tile_m, tile_n, head_dim, dtype_name):
    g = holdings(tile_m, tile_n, head_dim, dtype_name)
    assert g["layout"] == f"((2,2,{tile_n // 8}),1,1):((1,2,4),0,0)", g["layout"]
    # the PV MMA reads every (row, key) of the tile exactly once
    assert len({mk for a in g["a"] for mk in a}) == tile_m * tile_n
    fails = p_failures(g, "right")
    assert not fails, fails


@pytest.mark.parametrize("wrong", ["kblock_strided", "rows_for_halves"])
def test_p_negative_controls_are_rejected(wrong):
    assert p_failures(holdings(*CONFIGS[-1]), wrong), f"{wrong} passed at 128 x 80"
    assert p_failures(holdings(*CONFIGS[0]), wrong), f"{wrong} passed at 192 x 128"


def pair_failures(g: dict, stride: int = 1) -> list:
    """Registers (2i, 2i + stride) must hold keys (k, k + 1) of one row, and be read
    as A values (2u, 2u + 1) in that order."""
    _, regs = g["relabel"]["right"]
    n_regs = len(g["s"][0])
    fails = []
    firsts = [i for i in range(n_regs) if i % (2 * stride) < stride]
    for t, held in enumerate(g["s"]):
        for i in firsts:
            (m0, k0), (m1, k1) = held[i], held[i + stride]
            if (m1, k1) != (m0, k0 + 1):
                fails.append((t, i, held[i], held[i + stride]))
        if fails:
            break
    for u in range(len(regs) // 2):
        lo, hi = regs[2 * u], regs[2 * u + 1]
        if not (lo in firsts and hi == lo + stride):
            fails.append(("A value pair", u, lo, hi))
    return fails


@pytest.mark.parametrize("tile_m,tile_n,head_dim,dtype_name", CASES)
def test_packed_conversion_pairs_neighbouring_keys(tile_m, tile_n, head_dim, dtype_name):
    fails = pair_failures(holdings(tile_m, tile_n, head_dim, dtype_name))
    assert not fails, fails[:4]


def test_packed_pairing_checker_rejects_pairs_across_rows():
    assert pair_failures(holdings(*CONFIGS[1]), stride=2)


def row_failures(g: dict, tile_m: int, tile_n: int, view: str = "right") -> list:
    s_view, o_view = g["views"][view, "s"], g["views"][view, "o"]
    fails, writers = [], {}
    for t, held in enumerate(g["s"]):
        rows = []
        for i, regs in enumerate(s_view):
            ms = {held[r][0] for r in regs}
            if len(ms) != 1:
                fails.append((f"thread {t} S view row {i} mixes rows", sorted(ms)))
                return fails
            rows.append(ms.pop())
        quad0 = t - t % QUAD
        for i, m in enumerate(rows):
            keys = sorted(g["s"][q][r][1] for q in range(quad0, quad0 + QUAD) for r in s_view[i])
            if keys != list(range(tile_n)):
                fails.append((f"quad of thread {t} does not hold each key of row {m} once",))
                return fails
        o_rows = [sorted({g["o"][t][r][0] for r in regs}) for regs in o_view]
        if o_rows != [[m] for m in rows]:
            fails.append((f"thread {t}: O view rows {o_rows} != S rows {rows}",))
            return fails
        if held[s_view[0][0]][1] == 0:  # holds column 0 of its rows: the LSE writer
            for m in rows:
                if m in writers:
                    fails.append((f"row {m} written by threads {writers[m]} and {t}",))
                writers[m] = t
    if sorted(writers) != list(range(tile_m)):
        fails.append(("LSE rows written", len(writers), tile_m))
    return fails


@pytest.mark.parametrize("tile_m,tile_n,head_dim,dtype_name", CASES)
def test_online_softmax_rows_are_the_o_rows(tile_m, tile_n, head_dim, dtype_name):
    fails = row_failures(holdings(tile_m, tile_n, head_dim, dtype_name), tile_m, tile_n)
    assert not fails, fails


def test_row_checker_rejects_a_wrong_row_view():
    tile_m, tile_n, head_dim = CONFIGS[-1]
    assert row_failures(holdings(*CONFIGS[-1]), tile_m, tile_n, "rows_cols_exchanged")


# ---------------------------------------------------------------------------------------
# 5. The key mask on the first tile visited


def mask_failures(g: dict, tile_n: int, seqlen_k: int, variant: str = "right") -> list:
    n_tiles = num_kv_tiles(seqlen_k, tile_n)
    first = n_tiles - 1  # the kernel visits tiles n_tiles - 1 .. 0
    masked_tile = 0 if variant == "tile_0" else first
    fails = []
    if n_tiles * tile_n < seqlen_k or (n_tiles - 1) * tile_n >= seqlen_k:
        fails.append(("tile count", seqlen_k, n_tiles))
    for tile in range(n_tiles):
        if variant == "no_offset":
            limit = seqlen_k
        else:
            limit = key_limit(tile, tile_n, seqlen_k) if tile == masked_tile else tile_n  # unmasked tiles
        visible_rows = set()
        for t, held in enumerate(g["s"]):
            for m, k in held.values():
                masked = k >= limit
                if masked != (tile * tile_n + k >= seqlen_k):
                    fails.append((f"seqlen_k {seqlen_k} tile {tile} thread {t}", (m, k), masked))
                    return fails
                if not masked:
                    visible_rows.add(m)
        if tile == first and len(visible_rows) != len({m for held in g["s"] for m, _ in held.values()}):
            fails.append((f"seqlen_k {seqlen_k}: a row sees no key in the first tile",))
    return fails


@pytest.mark.parametrize("tile_m,tile_n,head_dim", CONFIGS, ids=[f"{m}x{n}" for m, n, _ in CONFIGS])
def test_mask_hides_exactly_the_keys_past_seqlen_k(tile_m, tile_n, head_dim):
    g = holdings(tile_m, tile_n, head_dim)
    for seqlen_k in SEQLENS_K:
        fails = mask_failures(g, tile_n, seqlen_k)
        assert not fails, fails


@pytest.mark.parametrize("variant", ["no_offset", "tile_0"])
def test_mask_checker_rejects_wrong_masks(variant):
    g = holdings(*CONFIGS[-1])
    assert any(mask_failures(g, CONFIGS[-1][1], sk, variant) for sk in SEQLENS_K), variant


# ---------------------------------------------------------------------------------------
# 6. Register reallocation


def register_split_ok(warpgroups: int, consumer: int, producer: int) -> bool:
    total = THREADS_PER_WARPGROUP * (warpgroups * consumer + producer)
    return total <= 65536 and consumer % 8 == 0 and producer % 8 == 0 and 24 <= producer <= consumer <= 256


def test_setmaxnreg_split_fits_the_register_file():
    for warpgroups, (consumer, producer) in REGISTERS.items():
        assert register_split_ok(warpgroups, consumer, producer), (warpgroups, consumer, producer)
    assert not register_split_ok(2, 248, 24)  # negative control: 1024 registers over
    assert not register_split_ok(3, 164, 32)  # negative control: not a multiple of 8
