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
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

#: rows of the QK tile = TMEM lanes = MMA M (cta_group::1)
QK_TILE_M = 128
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


def fence_before_thread_sync():
    """``tcgen05.fence::before_thread_sync``: order this thread's completed tcgen05 work
    (MMA, ld) before a following barrier arrive/sync."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def fence_after_thread_sync():
    """``tcgen05.fence::after_thread_sync``: order tcgen05 work after a barrier wait
    behind what the other side did before it (MMA results, finished loads)."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)
