"""Hopper (SM90) GEMM building blocks shared by the stage kernels.

Every SM90 stage runs its MMAs the same way: a 128-row CTA tile split over two
MMA warpgroups (one wgmma 64xNx16 atom each, stacked along M), operands staged
in SMEM by TMA in head-dim k-blocks of 64 16-bit elements (one 128-byte
swizzle row), fp32 accumulators in registers.

    tile      (TILE_M = 128) x N: warpgroup w owns rows [64 w, 64 w + 64)
    k-block   TILE_K = 64 head-dim elements; head_dim / 64 of them per tile
    SMEM      K-major (rows, 64, k-blocks), 128B swizzle, 16 KiB per 128-row k-block:
                S<3,4,3> o ((8,16),(64,1),(1,kb)):((64,512),(1,0),(0,8192))
    TMA       one (rows, 64) box per k-block, zero fill past the tensor's rows

The same bytes read as an MN-major operand: a tile stored (rows, head_dim)
with head_dim contiguous is, for a GEMM that reduces over the rows (PV: V is
B with N = head_dim, K = keys), the MN-major 128B-swizzled layout

                S<3,4,3> o ((64,kb),(8,16)):((1,8192),(64,512))   (head_dim, rows)

i.e. ``make_mn_major_smem_layout`` is the transpose of ``make_kmajor_smem_layout``
element for element (tests/test_b_sm90_p_fragment.py checks it).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

TILE_M = 128  # rows per CTA tile (2 warpgroups x 64 rows)
TILE_N = 128  # columns of the QK tile (keys per CTA)
TILE_K = 64  # head-dim elements per k-block: one 128-byte swizzle row (16-bit)
WGMMA_M = 64  # rows of one wgmma atom, i.e. of one warpgroup
NUM_MMA_WARPGROUPS = TILE_M // WGMMA_M
THREADS_PER_WARPGROUP = 128
NUM_THREADS = NUM_MMA_WARPGROUPS * THREADS_PER_WARPGROUP
# setmaxnreg (consumer, producer) per consumer-warpgroup count of the warp-specialized kernels
# (one producer warpgroup): 65536 registers over 128 x (1 + W) threads, in multiples of 8
REGISTERS = {2: (240, 24), 3: (160, 32)}
SMEM_ALIGN = 1024  # the 128B swizzle repeats every 8 rows (1 KiB); wgmma descriptors assume it


def register_plan(kernel) -> list:
    """[(threads, setmaxnreg target), ...] of a warp-specialized kernel's roles: its producer
    warpgroup and its ``num_wg`` consumer warpgroups (a kernel method: ``register_plan = register_plan``).
    ``setmaxnreg.inc`` waits until the CTA's pool (threads x the registers the launch gave each)
    holds the target: a plan over the pool hangs every launch (common/compile.register_split_error)."""
    return [(THREADS_PER_WARPGROUP, kernel.producer_regs),
            (THREADS_PER_WARPGROUP * kernel.num_wg, kernel.consumer_regs)]


def num_k_blocks(head_dim: int) -> int:
    return head_dim // TILE_K


def make_tiled_mma(
    dtype: type[cutlass.Numeric],
    tile_n: int = TILE_N,
    *,
    b_major: OperandMajorMode = OperandMajorMode.K,
    a_source: warpgroup.OperandSource = warpgroup.OperandSource.SMEM,
    warpgroups: int = NUM_MMA_WARPGROUPS,
) -> cute.TiledMma:
    """wgmma 64 x tile_n x 16, fp32 accumulators; ``warpgroups`` atoms stacked
    along M give the CTA tile (64 rows per warpgroup: 128 by default). A is
    K-major (from SMEM, or from registers with a_source=RMEM); B is K-major
    (QK: K rows) or MN-major (PV: V)."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        OperandMajorMode.K,
        b_major,
        cutlass.Float32,
        (warpgroups, 1, 1),
        tiler_mn=(WGMMA_M, tile_n),
        a_source=a_source,
    )


def make_kmajor_smem_layout(dtype: type[cutlass.Numeric], rows: int, blocks: int) -> cute.ComposedLayout:
    """(rows, TILE_K, blocks) with the 128B swizzle, K-major: TILE_K 16-bit
    elements are one 128-byte row. ``blocks`` are ring stages or k-blocks."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, (rows, TILE_K, blocks), order=(0, 1, 2))


def make_smem_layouts(dtype: type[cutlass.Numeric], stages: int) -> tuple[cute.ComposedLayout, cute.ComposedLayout]:
    """Staged (rows, TILE_K, stages) layouts of the Q (TILE_M rows) and K
    (TILE_N rows) buffers."""
    return make_kmajor_smem_layout(dtype, TILE_M, stages), make_kmajor_smem_layout(dtype, TILE_N, stages)


def make_mn_major_smem_layout(dtype: type[cutlass.Numeric], mn: int, k: int) -> cute.ComposedLayout:
    """(mn, k) MN-major with the 128B swizzle: 64 MN-contiguous elements per K
    row, 8 K rows per 1 KiB atom, K atoms fastest, then the 64-wide MN blocks.
    For mn = head_dim, k = rows this is the transpose of
    ``make_kmajor_smem_layout(dtype, rows, head_dim // TILE_K)``."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dtype)
    return cute.tile_to_shape(atom, (mn, k), order=(1, 0))


def make_tma_load(
    m_sdhb: cute.Tensor, smem_layout_staged: cute.ComposedLayout, rows: int
) -> tuple[cute.CopyAtom, cute.Tensor]:
    """TMA load of a (rows, TILE_K) box from a (seqlen, head_dim, heads, batch)
    tensor into one stage / k-block of smem_layout_staged."""
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(),
        m_sdhb,
        cute.slice_(smem_layout_staged, (None, None, 0)),
        (rows, TILE_K),
    )


def make_tma_store(
    m_sdhb: cute.Tensor, smem_layout_staged: cute.ComposedLayout, rows: int
) -> tuple[cute.CopyAtom, cute.Tensor]:
    """TMA store of a (rows, TILE_K) box from one k-block of smem_layout_staged
    into a (seqlen, head_dim, heads, batch) tensor; rows past seqlen are clipped."""
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileS2GOp(),
        m_sdhb,
        cute.slice_(smem_layout_staged, (None, None, 0)),
        (rows, TILE_K),
    )


# ---------------------------------------------------------------------------------------
# Whole (rows, head_dim) tiles in a ring of stages (stage C on): one layout per buffer,
# head-dim k-blocks folded into the column mode.


def make_tile_smem_layout(
    dtype: type[cutlass.Numeric], rows: int, head_dim: int, stages: int
) -> cute.ComposedLayout:
    """(rows, head_dim, stages), K-major, 128B swizzle: the 64-column k-blocks of
    one stage one after the other, as ``make_kmajor_smem_layout(dtype, rows,
    head_dim // TILE_K)`` lays them out, then the stages:

        S<3,4,3> o ((8,rows/8),(64,kb),stages):((64,512),(1,rows*64),rows*head_dim)
    """
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, (rows, head_dim, stages), order=(0, 1, 2))


def make_tile_smem_layout_mn(
    dtype: type[cutlass.Numeric], rows: int, head_dim: int, stages: int
) -> cute.ComposedLayout:
    """(head_dim, rows, stages): the same bytes as ``make_tile_smem_layout`` read
    as an MN-major operand (V as the B of O = P V, keys are its K):

        S<3,4,3> o ((64,kb),(8,rows/8),stages):((1,rows*64),(64,512),rows*head_dim)
    """
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dtype)
    return cute.tile_to_shape(atom, (head_dim, rows, stages), order=(1, 0, 2))


def make_tma_tile_atom(
    op, m_sdhb: cute.Tensor, smem_layout_staged: cute.ComposedLayout, rows: int, head_dim: int
) -> tuple[cute.CopyAtom, cute.Tensor]:
    """TMA between a (seqlen, head_dim, heads, batch) tensor and one stage of
    ``smem_layout_staged``, a (rows, head_dim) tile per copy (one box per 64-column
    k-block, issued by one ``cute.copy``). ``op``: CopyBulkTensorTileG2SOp (load,
    zero fill past seqlen) or CopyBulkTensorTileS2GOp (store, rows past seqlen clipped)."""
    return cpasync.make_tiled_tma_atom(op, m_sdhb, cute.slice_(smem_layout_staged, (None, None, 0)), (rows, head_dim))


def tile_tma_partition(tma_atom: cute.CopyAtom, sX: cute.Tensor, gX: cute.Tensor):
    """(SMEM, global) TMA partitions of whole (rows, cols) tiles: sX (rows, cols, slots) and
    gX (rows, cols, tiles) -> (atom, slots) and (atom, tiles)."""
    return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                 cute.group_modes(gX, 0, 2))


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
):
    """Issue acc (+)= A B as one wgmma group (not waited: the caller picks
    ``warpgroup.wait_group``). The fence orders every earlier register write of
    acc and of a register-sourced A before the asynchronous MMAs read them."""
    warpgroup.fence()
    # a fresh atom: its ACCUMULATE field is set per k-step, independent of other GEMMs
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
