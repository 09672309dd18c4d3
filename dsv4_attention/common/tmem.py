"""Blackwell (SM100) tensor-memory accumulator path, shared by kernels and host proofs.

One tcgen05 MMA with ``cta_group::1`` and M = 128 writes its fp32 accumulator to
tensor memory (TMEM), not to registers. Everything that touches that accumulator
(the MMA that writes it, the epilogue that reads it, the column count handed to
``tcgen05.alloc``) is built here, so that a kernel and the CPU proof of its
layout (``tests/test_a_sm100_tmem_rows.py``) cannot drift apart.

TMEM addressing
---------------
TMEM is 128 lanes x 512 columns of 32-bit cells per SM. A TMEM address is
``lane << 16 | column``, and CuTe encodes it exactly so: an fp32 TMEM tensor's
offset *is* the address. The QK accumulator of a 128 x 128 tile prints as
``((128,128),1,1):((65536,1),0,0)``, i.e.

    S(m, n)  ->  lane m, column n        (row m of the tile lives in lane m)

and it occupies 128 columns from the allocation base (the kernel puts it at
column 0). ``tcgen05.alloc`` hands out columns only, in powers of two >= 32;
``tmem_alloc_columns`` rounds a need up to such a count.

Lane access by warps
--------------------
A warp may touch only its quarter of the lanes: warp ``w`` reaches lanes
``32 * (w % 4) ... 32 * (w % 4) + 31``. The ``tcgen05.ld.32x32b`` atom is the one
that maps a warp's 32 threads onto its 32 lanes one to one: thread ``i`` of the
warp receives lane ``32 * (w % 4) + i`` and, with ``.xR``, R consecutive columns
in R registers. With four consecutive warps whose ``w % 4`` is 0, 1, 2, 3 and
``t`` the thread's index in that group (0..127), the load partition built by
``make_acc_tmem_load`` therefore has the property the epilogues rely on:

    thread t holds row t of the tile, and only row t, in every value.

(The 16xNb atoms spread one lane over several threads and one thread over
several lanes; they do not have it.) The property is proven on the host, for the
exact builders below, by ``tests/test_a_sm100_tmem_rows.py``.

P in TMEM
---------
Attention keeps P on chip: the softmax writes it as 16-bit values over S's columns and the
PV MMA reads it from there as its A operand (a TS MMA). The regions of that allocation (S,
P over S, O), the P store, the PV tiled MMA and the column budget are the second half of
this module; ``tests/test_b_sm100_tmem_p.py`` proves, with these builders, that every P(m, k)
is read where it was written and that the rows of S and of O sit on the same thread.

Several Q tiles in flight
-------------------------
From stage C on a CTA keeps up to two 128-row Q tiles, each with its own S (P inside) and O:
``AttentionTmemMap`` places them (``packed``: the S tiles first, then the O tiles) and checks
that they neither overlap nor leave the 512 columns; the regions above take the first column
of their tile. ``make_acc_tmem_store`` writes an accumulator back (the correction warps' O
rescale). ``tests/test_c_sm100_host.py`` proves the map and, per Q tile, P and the row chain
(softmax row statistics -> correction -> epilogue).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from dsv4_attention.common.tiles import SM100_TILE_M

#: rows of the QK tile = TMEM lanes = MMA M (cta_group::1)
QK_TILE_M = SM100_TILE_M
#: columns of the QK tile = fp32 TMEM columns of the accumulator
QK_TILE_N = 128
#: the instruction K of a 16-bit tcgen05 MMA
MMA_INST_K = 16
#: accumulator element type
ACC_DTYPE = cutlass.Float32
#: columns per tcgen05.ld in the epilogue (32x32b.x32: 32 registers per thread)
EPI_COLS = 32
#: threads of the four warps that read the accumulator
EPI_THREADS = 128

_TMEM_MIN_ALLOC_COLS = 32
_TMEM_MAX_COLS = 512


def make_qk_tiled_mma(ab_dtype, tile_mn=(QK_TILE_M, QK_TILE_N)) -> cute.TiledMma:
    """The tcgen05 MMA for S = Q K^T: cta_group::1, A = Q and B = K both K-major in SMEM,
    fp32 accumulator in TMEM, one instruction covering the whole ``tile_mn`` tile."""
    op = tcgen05.MmaF16BF16Op(
        ab_dtype,
        ACC_DTYPE,
        (tile_mn[0], tile_mn[1], MMA_INST_K),
        tcgen05.CtaGroup.ONE,
        tcgen05.OperandSource.SMEM,
        OperandMajorMode.K,
        OperandMajorMode.K,
    )
    return cute.make_tiled_mma(op)


def make_acc_fragment(tiled_mma: cute.TiledMma, tile_mn=(QK_TILE_M, QK_TILE_N)) -> cute.Tensor:
    """The accumulator as a TMEM tensor ``(MMA, MMA_M, MMA_N)``.

    Its pointer is a placeholder (no TMEM is allocated for it); a kernel rebinds the
    layout onto the allocated base with ``cute.make_tensor(tmem_ptr, frag.layout)``.
    The layout alone is what the host proof needs."""
    return tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(tile_mn))


def tmem_alloc_columns(num_cols: int) -> int:
    """The column count to pass to tcgen05.alloc for ``num_cols`` needed columns:
    the smallest power of two >= max(num_cols, 32). Raises past 512."""
    n = _TMEM_MIN_ALLOC_COLS
    while n < num_cols:
        n *= 2
    if n > _TMEM_MAX_COLS:
        raise ValueError(f"{num_cols} TMEM columns needed, at most {_TMEM_MAX_COLS} exist")
    return n


def acc_tmem_columns(acc: cute.Tensor | cute.Layout, dtype=ACC_DTYPE) -> int:
    """Allocation column count for one accumulator (call inside a trace; static layout).
    The columns it spans are its cosize's low 16 bits (the address's column part)."""
    from cutlass.memory import compute_tmem_cols_from_layout

    layout = acc.layout if isinstance(acc, cute.Tensor) else acc
    return tmem_alloc_columns(int(compute_tmem_cols_from_layout(layout, dtype)))


def acc_tile(acc: cute.Tensor) -> cute.Tensor:
    """The ``(MMA, 1, 1)`` accumulator as a plain ``(M, N)`` tile (one MMA covers it)."""
    return acc[((None, None), 0, 0)]


def epi_view(tile: cute.Tensor, epi_cols: int = EPI_COLS) -> cute.Tensor:
    """Any ``(M, N)`` tile (TMEM accumulator, gmem S tile, identity coordinates) cut
    into epilogue chunks: ``(M, epi_cols, 1, N / epi_cols)``; chunk c is ``[.., 0, c]``.
    Cutting every operand the same way is what makes their partitions line up."""
    return cute.flat_divide(tile, (cute.size(tile, mode=[0]), epi_cols))


def make_acc_tmem_load(acc: cute.Tensor, epi_cols: int = EPI_COLS, op=None):
    """TMEM -> register load of the fp32 accumulator, ``epi_cols`` columns at a time.

    ``acc`` is the ``(MMA, 1, 1)`` accumulator (``make_acc_fragment``, or the same
    layout on the allocated TMEM pointer). Returns ``(tiled_copy, acc_epi)``:
    ``acc_epi = epi_view(acc_tile(acc), epi_cols)`` and a tiled copy of the
    ``tcgen05.ld.32x32b.x<epi_cols>`` atom over one chunk, for 128 threads (4 warps).
    Slice it with ``tiled_copy.get_slice(t)``, t = the thread's index in the four
    epilogue warps; then ``partition_S(acc_epi)`` is what it reads and
    ``partition_D(epi_view(X))`` places the values in any other ``(M, N)`` tile X.

    ``op`` overrides the atom; only the host proof's negative controls use it.
    """
    if op is None:
        op = tcgen05.Ld32x32bOp(tcgen05.Repetition(epi_cols))
    atom = cute.make_copy_atom(op, ACC_DTYPE)
    acc_epi = epi_view(acc_tile(acc), epi_cols)
    tiled_copy = tcgen05.make_tmem_copy(atom, acc_epi[None, None, 0, 0])
    return tiled_copy, acc_epi


def make_acc_tmem_store(acc: cute.Tensor, epi_cols: int = EPI_COLS, op=None):
    """Register -> TMEM store back into the fp32 accumulator, ``epi_cols`` columns at a time:
    the ``tcgen05.st.32x32b.x<epi_cols>`` atom over the same chunks as ``make_acc_tmem_load``
    (``acc_epi = epi_view(acc_tile(acc), epi_cols)``). Thread t of the four warps writes lane t,
    so a value loaded by ``make_acc_tmem_load`` and stored by this copy, both sliced with t,
    returns to its own cell (proven in tests/test_c_sm100_host.py). ``op`` overrides the atom
    (negative controls only)."""
    if op is None:
        op = tcgen05.St32x32bOp(tcgen05.Repetition(epi_cols))
    atom = cute.make_copy_atom(op, ACC_DTYPE)
    acc_epi = epi_view(acc_tile(acc), epi_cols)
    return tcgen05.make_tmem_copy(atom, acc_epi[None, None, 0, 0]), acc_epi


def fence_before_thread_sync():
    """``tcgen05.fence::before_thread_sync``: order this thread's completed tcgen05 work
    (MMA, ld) before a following barrier arrive/sync."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def fence_after_thread_sync():
    """``tcgen05.fence::after_thread_sync``: order tcgen05 work after a barrier wait
    behind what the other side did before it (MMA results, finished loads)."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)


# =======================================================================================
# P kept in TMEM (stage B): S, P and O of one 128-row Q tile against one 128-key KV tile
# =======================================================================================
#
# Columns of the allocation (fp32 columns from its base; every region spans lanes 0..127):
#
#     column   0 ........ 63 | 64 ....... 127 | 128 ........... 128 + head_dim - 1
#              S (fp32)      | S (fp32)       | O (fp32)
#                            | = P (16-bit)   |
#
# S(m, n) is at lane m, column S_TMEM_COL + n (the QK accumulator). After the softmax has read
# its whole row of S into registers, it writes P(m, k) as 16-bit values two to a column over
# S's upper half: lane m, column P_TMEM_COL + k // 2, half k % 2 (half 0 = the low 16 bits).
# That is where the PV MMA's A operand reads it; O(m, n) is at lane m, column O_TMEM_COL + n.
#
# A region is given relative to the allocation base, in units of its element type, because
# no TMEM pointer exists on the host: ``offset`` + ``layout(coord)`` is the element index e.
# For 32-bit types e = lane << 16 | column; a 16-bit view counts halves,
# e = 2 * (lane << 16 | column) + half (``tmem_cell`` decodes either). The kernel turns a
# region into a tensor with ``region.at(base)``; the host proofs evaluate the same region.

#: first fp32 column of S (the QK accumulator)
S_TMEM_COL = 0
#: first fp32 column of P inside S's columns (S's upper half; P needs 128 keys * 16 bit = 64 columns)
P_TMEM_COL = 64
#: first fp32 column of O (the PV accumulator), right after S
O_TMEM_COL = QK_TILE_N
#: keys of the KV tile = K of the PV MMA = columns of S
PV_TILE_K = QK_TILE_N
#: 32-bit columns per tcgen05.st.32x32b of P (.x32: 32 registers, 64 16-bit values per thread)
P_STORE_COLS = 32
#: the PV MMA's N is at most this per instruction (cta_group::1, M = 128)
PV_MAX_N = 256


def elems_per_col(dtype) -> int:
    """Elements of ``dtype`` in one 32-bit TMEM column of a lane (1 for fp32, 2 for 16-bit)."""
    if 32 % dtype.width:
        raise ValueError(f"{dtype} does not pack into 32-bit TMEM columns")
    return 32 // dtype.width


def tmem_cell(e: int, width: int) -> tuple[int, int, int]:
    """(lane, column, half) of element index ``e`` of a TMEM view of ``width``-bit elements
    (half is 0 for 32-bit views, and 0/1 = low/high 16 bits for 16-bit ones). Host-side."""
    if width == 32:
        return (e >> 16, e & 0xFFFF, 0)
    if width == 16:
        a = e >> 1
        return (a >> 16, a & 0xFFFF, e & 1)
    raise ValueError(f"no TMEM cell rule for {width}-bit elements")


class TmemRegion:
    """A TMEM tensor relative to the allocation base: element ``offset + layout(coord)`` of a
    ``dtype`` view. Lives only inside a trace (it holds a CuTe layout)."""

    def __init__(self, dtype, offset: int, layout):
        self.dtype = dtype
        self.offset = int(offset)
        self.layout = layout

    @property
    def first_column(self) -> int:
        return tmem_cell(self.offset, self.dtype.width)[1]

    def end_column(self) -> int:
        """One past the last fp32 column the region touches (static layouts only)."""
        from cutlass.memory import compute_tmem_cols_from_layout

        return self.first_column + int(compute_tmem_cols_from_layout(self.layout, self.dtype))

    def element(self, coord) -> int:
        """The element index of ``coord`` (host proofs)."""
        return self.offset + int(cute.crd2idx(coord, self.layout))

    def at(self, base) -> cute.Tensor:
        """The region as a tensor on the allocation whose base is the fp32 TMEM pointer
        ``base`` (``TmemAllocator.retrieve_ptr(Float32)``). The offset is applied in whole
        fp32 columns before the pointer is recast, so a 16-bit offset is halved here exactly
        once (it was doubled when the region was built)."""
        per_col = elems_per_col(self.dtype)
        if self.offset % per_col:
            raise ValueError(f"region offset {self.offset} is not on a 32-bit column boundary")
        ptr = base + self.offset // per_col
        if self.dtype is not ACC_DTYPE:
            ptr = cute.recast_ptr(ptr, dtype=self.dtype)
        return cute.make_tensor(ptr, self.layout)


def placeholder_tmem_base():
    """A TMEM fp32 pointer for building copies and MMAs on the host (nothing is allocated);
    kernels pass the allocated base instead."""
    return make_acc_fragment(make_qk_tiled_mma(cutlass.BFloat16)).iterator


def s_region(ab_dtype, col: int = S_TMEM_COL) -> TmemRegion:
    """S, the QK accumulator ``(MMA, 1, 1)``: fp32, S(m, n) at lane m, column ``col`` + n
    (``col``: S's first column; stage B's S_TMEM_COL unless a kernel holds several S tiles).
    (Regions build their own tiled MMA: only its layouts are used, and a kernel's tiled MMA
    carries per-warp state, the accumulate flag, that must not leak into other warps' code.)"""
    return TmemRegion(ACC_DTYPE, col, make_acc_fragment(make_qk_tiled_mma(ab_dtype)).layout)


def s_region_16bit(dtype, col: int = S_TMEM_COL) -> TmemRegion:
    """S's columns seen as 16-bit values: ``(128, 2 * QK_TILE_N)``, (m, j) at lane m,
    column ``col`` + j // 2, half j % 2 (the fp32 layout recast to 16-bit elements)."""
    s32 = acc_tile(make_acc_fragment(make_qk_tiled_mma(dtype))).layout  # (128,128):(65536,1)
    return TmemRegion(
        dtype,
        col * elems_per_col(dtype),
        cute.recast_layout(dtype.width, ACC_DTYPE.width, s32),
    )


def p_region(dtype, s_col: int = S_TMEM_COL) -> TmemRegion:
    """P ``(128, PV_TILE_K)`` in the 16-bit view of the S tile starting at column ``s_col``:
    P(m, k) = S16(m, first + k) with first = (P_TMEM_COL - S_TMEM_COL) columns * 2 values per
    column, i.e. P always sits in its own S tile's upper half."""
    s16 = s_region_16bit(dtype, s_col)
    first = (P_TMEM_COL - S_TMEM_COL) * elems_per_col(dtype)
    return TmemRegion(
        dtype,
        s16.element((0, first)),
        cute.composition(s16.layout, cute.make_layout((QK_TILE_M, PV_TILE_K))),
    )


def p_chunk_view(tile, dtype, store_cols: int = P_STORE_COLS):
    """Any ``(128, PV_TILE_K)`` P tile (the TMEM region's layout, the identity coordinates)
    cut into store chunks: ``(128, vals, 1, PV_TILE_K / vals)`` with vals = the 16-bit values
    one tcgen05.st.32x32b.x<store_cols> writes per lane; chunk c is ``[.., 0, c]``."""
    return cute.flat_divide(tile, (QK_TILE_M, store_cols * elems_per_col(dtype)))


def p_store_region(dtype, store_cols: int = P_STORE_COLS, s_col: int = S_TMEM_COL) -> TmemRegion:
    """P's region (in the S tile at ``s_col``) cut into store chunks (``p_chunk_view``)."""
    p = p_region(dtype, s_col)
    return TmemRegion(dtype, p.offset, p_chunk_view(p.layout, dtype, store_cols))


def make_p_tmem_store(p_chunks: cute.Tensor, store_cols: int = P_STORE_COLS, op=None) -> cute.TiledCopy:
    """Register -> TMEM store of P, one chunk of ``store_cols`` 32-bit columns at a time:
    the ``tcgen05.st.32x32b.x<store_cols>`` atom over P's 16-bit element type, for 128 threads.

    ``p_chunks`` is ``p_store_region(dtype, store_cols).at(base)``. Thread t (warp t // 32,
    lane t % 32 of that warp) writes lane t; its 16-bit values 2r and 2r + 1 travel in register
    r, low half first, to column (chunk's first) + r. Slice with ``get_slice(t)``;
    ``partition_S`` of the P tile's identity (cut the same way) says which (m, k) each register
    value must hold. ``op`` overrides the atom (negative controls only)."""
    if op is None:
        op = tcgen05.St32x32bOp(tcgen05.Repetition(store_cols))
    atom = cute.make_copy_atom(op, p_chunks.element_type)
    return tcgen05.make_tmem_copy(atom, p_chunks[None, None, 0, 0])


def make_pv_tiled_mma(ab_dtype, head_dim: int, a_source=tcgen05.OperandSource.TMEM) -> cute.TiledMma:
    """The tcgen05 MMA for O = P V: cta_group::1, M = 128, N = head_dim (or one N chunk of O,
    stage D1), K = 16 per instruction; A = P from TMEM (a TS MMA, stages B and C) or from SMEM
    (SS, stage D1's SMEM-P), K-major either way; B = V from SMEM, MN-major (V is (keys,
    head_dim) with head_dim contiguous, i.e. N-contiguous); fp32 O in TMEM."""
    if head_dim > PV_MAX_N or head_dim % 16:
        raise ValueError(f"PV MMA N must be a multiple of 16 and <= {PV_MAX_N}; got {head_dim}")
    op = tcgen05.MmaF16BF16Op(
        ab_dtype,
        ACC_DTYPE,
        (QK_TILE_M, head_dim, MMA_INST_K),
        tcgen05.CtaGroup.ONE,
        a_source,
        OperandMajorMode.K,
        OperandMajorMode.MN,
    )
    return cute.make_tiled_mma(op)


def p_operand_region(dtype, head_dim: int, s_col: int = S_TMEM_COL) -> TmemRegion:
    """The PV MMA's A operand over P (in the S tile at ``s_col``): ``(MMA, 1, K_PHASES)``, one
    k-phase of 16 keys per instruction. ``make_fragment_A`` gives the layout only (its pointer
    is a placeholder at 0), so the fragment is re-based explicitly onto P's offset."""
    pv = make_pv_tiled_mma(dtype, head_dim)
    frag = pv.make_fragment_A(pv.partition_shape_A((QK_TILE_M, PV_TILE_K)))
    return TmemRegion(dtype, p_region(dtype, s_col).offset, frag.layout)


def o_region(dtype, head_dim: int, col: int = O_TMEM_COL) -> TmemRegion:
    """O, the PV accumulator ``(MMA, 1, 1)``: fp32, O(m, n) at lane m, column ``col`` + n."""
    pv = make_pv_tiled_mma(dtype, head_dim)
    acc = pv.make_fragment_C(pv.partition_shape_C((QK_TILE_M, head_dim)))
    return TmemRegion(ACC_DTYPE, col, acc.layout)


def attention_tmem_columns(dtype, head_dim: int) -> int:
    """The column count to allocate for S (+ P over it) and O, computed from the regions'
    layouts (call inside a trace). Raises if P leaves S's columns or O overlaps S."""
    s, p, o = s_region(dtype), p_region(dtype), o_region(dtype, head_dim)
    if not (s.first_column <= p.first_column and p.end_column() <= s.end_column()):
        raise ValueError(
            f"P (columns {p.first_column}..{p.end_column() - 1}) must lie inside S "
            f"({s.first_column}..{s.end_column() - 1})"
        )
    if o.first_column < s.end_column() and s.first_column < o.end_column():
        raise ValueError("O overlaps S in TMEM")
    return tmem_alloc_columns(max(s.end_column(), o.end_column()))


# =======================================================================================
# Several Q tiles in flight (stage C on): one S (P inside) per Q tile, then one O per Q tile
# =======================================================================================
#
#     column  0 ...... 127 | 128 ..... 255 | ... | 128 q ...... 128 q + d - 1 | ... + d ...
#             S0 (P0 in    | S1 (P1 in     |     | O0                         | O1
#             64 .. 127)   | 192 .. 255)   |     |                            |
#
# Q tile i: S_i(m, n) at lane m, column 128 i + n; P_i(m, k) at lane m, column 128 i + 64 + k // 2,
# half k % 2; O_i(m, n) at lane m, column 128 q + d i + n (q = Q tiles in flight, d = head_dim).
# q = 2 needs 2 (128 + d) columns: 384 at d = 64, 512 at d = 128; d = 256 takes q = 1 (384).

#: TMEM columns of one SM (lanes x 32-bit columns: 128 x 512)
TMEM_COLUMNS = _TMEM_MAX_COLS


def q_tiles_in_flight(head_dim: int, max_tiles: int = 2) -> int:
    """How many 128-row Q tiles (an S and an O each) one CTA's TMEM holds: the most, up to
    ``max_tiles``, with tiles * (QK_TILE_N + head_dim) <= 512."""
    tiles = max_tiles
    while tiles > 1 and tiles * (QK_TILE_N + head_dim) > _TMEM_MAX_COLS:
        tiles -= 1
    return tiles


class AttentionTmemMap:
    """Where each Q tile's S (with P inside it) and O live: first fp32 columns ``s_cols[i]`` and
    ``o_cols[i]``. ``packed`` is the kernels' map (the picture above); explicit columns exist for
    the host proofs' negative controls. Regions live only inside a trace."""

    def __init__(self, dtype, head_dim: int, s_cols, o_cols):
        if len(s_cols) != len(o_cols):
            raise ValueError("one S and one O per Q tile")
        self.dtype = dtype
        self.head_dim = head_dim
        self.s_cols = tuple(int(c) for c in s_cols)
        self.o_cols = tuple(int(c) for c in o_cols)

    @classmethod
    def packed(cls, dtype, head_dim: int, q_tiles: int) -> AttentionTmemMap:
        s_cols = [i * QK_TILE_N for i in range(q_tiles)]
        o_cols = [q_tiles * QK_TILE_N + i * head_dim for i in range(q_tiles)]
        return cls(dtype, head_dim, s_cols, o_cols)

    @property
    def q_tiles(self) -> int:
        return len(self.s_cols)

    def s(self, i: int) -> TmemRegion:
        return s_region(self.dtype, self.s_cols[i])

    def p(self, i: int) -> TmemRegion:
        return p_region(self.dtype, self.s_cols[i])

    def p_store(self, i: int, store_cols: int = P_STORE_COLS) -> TmemRegion:
        return p_store_region(self.dtype, store_cols, self.s_cols[i])

    def p_operand(self, i: int) -> TmemRegion:
        return p_operand_region(self.dtype, self.head_dim, self.s_cols[i])

    def o(self, i: int) -> TmemRegion:
        return o_region(self.dtype, self.head_dim, self.o_cols[i])

    def spans(self) -> list[tuple[str, int, int]]:
        """(name, first column, one past the last) of every region, from the layouts."""
        out = []
        for i in range(self.q_tiles):
            for name, r in ((f"S{i}", self.s(i)), (f"P{i}", self.p(i)), (f"O{i}", self.o(i))):
                out.append((name, r.first_column, r.end_column()))
        return out

    def failures(self) -> list[str]:
        """Every way the map is unusable: P outside its own S, two of the S / O regions sharing a
        column, a region past column 511. Empty = sound."""
        spans = {name: (a, b) for name, a, b in self.spans()}
        fails = []
        for i in range(self.q_tiles):
            (sa, sb), (pa, pb) = spans[f"S{i}"], spans[f"P{i}"]
            if not (sa <= pa and pb <= sb):
                fails.append(f"P{i} (columns {pa}..{pb - 1}) is not inside S{i} ({sa}..{sb - 1})")
        owners = [(n, a, b) for n, a, b in self.spans() if not n.startswith("P")]
        return fails + column_failures(owners)

    def alloc_columns(self) -> int:
        return checked_alloc_columns(self)


def column_failures(owners) -> list[str]:
    """Regions that own TMEM columns, (name, first, one past the last): any two sharing a column,
    any past column 511 (the checks every TMEM map makes)."""
    fails = []
    for x, (n1, a1, b1) in enumerate(owners):
        for n2, a2, b2 in owners[x + 1:]:
            if a1 < b2 and a2 < b1:
                fails.append(f"{n1} (columns {a1}..{b1 - 1}) overlaps {n2} ({a2}..{b2 - 1})")
    for n, _a, b in owners:
        if b > _TMEM_MAX_COLS:
            fails.append(f"{n} ends at column {b - 1}, past the {_TMEM_MAX_COLS} TMEM columns")
    return fails


def checked_alloc_columns(tmem_map) -> int:
    """The column count to allocate (a power of two) for a map with ``spans()`` and
    ``failures()``, after checking it."""
    fails = tmem_map.failures()
    if fails:
        raise ValueError("TMEM map: " + "; ".join(fails))
    return tmem_alloc_columns(max(b for _n, _a, b in tmem_map.spans()))


def uniform_stride(cols, what: str) -> int:
    """The common distance between consecutive entries of ``cols`` (0 for one entry): lets a
    kernel address region i as region 0 moved by i * stride columns, with a runtime i. Raises
    if the entries are not evenly spaced."""
    if len(cols) < 2:
        return 0
    stride = cols[1] - cols[0]
    if any(b - a != stride for a, b in zip(cols[:-1], cols[1:], strict=True)):
        raise ValueError(f"{what} columns {cols} are not evenly spaced")
    return stride
