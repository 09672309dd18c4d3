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


def num_k_blocks(head_dim: int) -> int:
    return head_dim // TILE_K


def make_tiled_mma(
    dtype: type[cutlass.Numeric],
    tile_n: int = TILE_N,
    *,
    b_major: OperandMajorMode = OperandMajorMode.K,
    a_source: warpgroup.OperandSource = warpgroup.OperandSource.SMEM,
) -> cute.TiledMma:
    """wgmma 64 x tile_n x 16, fp32 accumulators; two atoms stacked along M give
    the 128-row CTA tile (one per warpgroup). A is K-major (from SMEM, or from
    registers with a_source=RMEM); B is K-major (QK: K rows) or MN-major (PV: V)."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        OperandMajorMode.K,
        b_major,
        cutlass.Float32,
        (NUM_MMA_WARPGROUPS, 1, 1),
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
