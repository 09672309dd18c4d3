"""K and V tiles on Blackwell (SM100): one ring of SMEM stages, filled by TMA, drained by the MMA warp.

A KV tile is 128 keys x head_dim. K_j feeds the QK MMA (B operand, K-major: head_dim contiguous)
and V_j the PV MMA (B operand, MN-major: head_dim contiguous, keys strided). Both tiles have the
same size, so they take turns in one ring of ``stages`` stages (FlashAttention-4's layout): the
TMA warp fills the ring in the order K_a, V_a, K_b, V_b, ... (a, b, ... the tiles in the order the
kernel visits them), one ``PipelineTmaUmma`` stage per tile, and the MMA warp releases a stage
with tcgen05.commit once the MMAs that read it have completed. K and V are two views of the
same bytes:

    sK  S<3,4,3> o ((128,16),1,(4,D/64),STAGES):((64,1),0,(16,8192),128 D)      K-major
    sV  S<3,4,3> o (((64,D/64),16),1,8,STAGES):(((1,8192),64),0,1024,128 D)     MN-major

(for D = 64 the (4, 1) / (64, 1) modes print as 4 / 64), both 128 D elements per stage, 1024-byte
aligned. TMA zero-fills keys past seqlen_k and still counts the whole box, so every stage
expects the same byte count.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05

from dsv4_attention.common.sm100_qk import qk_tile_tiler
from dsv4_attention.common.tmem import PV_TILE_K, QK_TILE_M

#: keys per KV tile (= N of the QK MMA = K of the PV MMA)
KV_TILE = PV_TILE_K


def pv_tiler(head_dim: int):
    """The PV MMA tiler (M, N = head_dim, K = keys of a KV tile)."""
    return (QK_TILE_M, head_dim, KV_TILE)


def kv_stage_bytes(dtype, head_dim: int) -> int:
    """Bytes of one ring stage: one K or one V tile."""
    return KV_TILE * head_dim * dtype.width // 8


def kv_ring_stages(dtype, head_dim: int, smem_budget: int, max_stages: int = 4) -> int:
    """The number of ring stages ``smem_budget`` bytes hold (at most ``max_stages``); at least 2,
    so that the MMA warp can hold V_j and K_(j+1) at once."""
    stages = min(max_stages, smem_budget // kv_stage_bytes(dtype, head_dim))
    if stages < 2:
        raise ValueError(f"a K/V ring needs 2 stages of {kv_stage_bytes(dtype, head_dim)} B; {smem_budget} B left")
    return stages


def make_kv_ring_layouts(qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, dtype, head_dim: int, stages: int):
    """(k_smem, v_smem): the ring seen as K tiles and as V tiles, ``(MMA, MMA_N, MMA_K, STAGE)``.
    Raises unless both views put stage s at the same element offset (they share the bytes)."""
    k_smem = sm100_utils.make_smem_layout_b(qk_mma, qk_tile_tiler(head_dim), dtype, stages)
    v_smem = sm100_utils.make_smem_layout_b(pv_mma, pv_tiler(head_dim), dtype, stages)
    k_stride = cute.cosize(cute.select(k_smem.outer, mode=[0, 1, 2]))
    v_stride = cute.cosize(cute.select(v_smem.outer, mode=[0, 1, 2]))
    if not (k_stride == v_stride == KV_TILE * head_dim and cute.cosize(k_smem) == cute.cosize(v_smem)):
        raise ValueError(f"K and V stages differ in size: {k_smem} vs {v_smem}")
    return k_smem, v_smem


def make_kv_tma_atoms(qk_mma, pv_mma, k: cute.Tensor, v: cute.Tensor, k_smem, v_smem, head_dim: int):
    """TMA loads of one whole K tile (``k`` in the (seqlen_k, head_dim, kv_heads, batch) view) and
    one whole V tile (``v`` in the (head_dim, seqlen_k, kv_heads, batch) view). Returns
    (tma_atom_k, tma_k, tma_atom_v, tma_v, tile_bytes): tile_bytes is what a stage's full barrier
    receives, the same for K and V."""
    op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
    k_tile = cute.select(k_smem, mode=[0, 1, 2])
    v_tile = cute.select(v_smem, mode=[0, 1, 2])
    tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(op, k, k_tile, qk_tile_tiler(head_dim), qk_mma)
    tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(op, v, v_tile, pv_tiler(head_dim), pv_mma)
    k_bytes = cute.size_in_bytes(k.element_type, k_tile)
    if k_bytes != cute.size_in_bytes(v.element_type, v_tile):
        raise ValueError("K and V tiles must have the same byte count (one barrier count for the ring)")
    return tma_atom_k, tma_k, tma_atom_v, tma_v, k_bytes


@cute.jit
def partition_kv_loads(qk_mma, pv_mma, tma_atom_k, mK_bh, sK, tma_atom_v, mV_bh, sV, head_dim: cutlass.Constexpr[int]):
    """TMA partitions of every K tile and V tile of one (kv head, batch) against the ring:
    returns (tKgK, tKsK, tVgV, tVsV), indexed ``tKgK[None, tile]`` / ``tKsK[None, stage]``.
    ``mK_bh`` is (seqlen_k, head_dim) and ``mV_bh`` (head_dim, seqlen_k) of that kv head."""
    gK = cute.local_tile(mK_bh, cute.select(qk_tile_tiler(head_dim), mode=[1, 2]), (None, 0))
    gV = cute.local_tile(mV_bh, cute.select(pv_tiler(head_dim), mode=[1, 2]), (0, None))
    tKsK, tKgK = cpasync.tma_partition(
        tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
        cute.group_modes(qk_mma.get_slice(0).partition_B(gK), 0, 3),
    )  # fmt: skip
    tVsV, tVgV = cpasync.tma_partition(
        tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
        cute.group_modes(pv_mma.get_slice(0).partition_B(gV), 0, 3),
    )  # fmt: skip
    return tKgK, tKsK, tVgV, tVsV


@cute.jit
def load_tile(producer, tma_atom, tXgX, tXsX, tile):
    """TMA warp: the next ring stage (waits until the MMA warp released it) <- tile ``tile``.
    Returns the advanced producer (a helper's rebinds do not reach its caller)."""
    stage = producer.acquire_and_advance()
    cute.copy(tma_atom, tXgX[None, tile], tXsX[None, stage.index], tma_bar_ptr=stage.barrier)
    return producer


# ---------------------------------------------------------------------------------------
# Stage E top-k: a ring stage filled by TMA gather4 (4 rows of a 2D tensor per instruction)


def block_rows_layout(k_block: cute.Layout) -> cute.Layout:
    """A K block's SMEM layout (``k_ring.outer`` of one stage, ((T,16),1,(4,B/64))) as a plain
    (T, B) row layout (T, (16, (4, B/64))): key r, column c at the element the MMA reads (the
    column splits colexicographically into (c % 16, k-phase c // 16), the modes the MMA partition
    uses). Element offsets only; the swizzle stays on the pointer. The gather4 atom's box."""
    (m_shape, k_shape), _, phase_shape = k_block.shape
    (m_stride, k_stride), _, phase_stride = k_block.stride
    return cute.make_layout((m_shape, (k_shape, phase_shape)), stride=(m_stride, (k_stride, phase_stride)))


def gather_view(c: cute.Tensor, tile_n: int):
    """The compressed entries (``c``: (entries, head_dim, kv_heads, batch), seq_major) as the 2D
    tensor a gather4 atom reads, (batch x entries rows, kv_heads x head_dim columns): entry j of
    batch b is row b * entries + j, kv head hk's column x is hk * head_dim + x. Any entry stride
    (a multiple of 16 bytes: a view into a padded buffer is read in place); assumes batch stride =
    entries x entry stride (or one batch entry) and kv-head stride = head_dim (or one kv head), which
    ``validation.check_gather_layout`` checks before launch (proof: tests/test_e_cpu.py). Returns
    (that tensor, the shape of the index tensor the atom is built with: (entries, columns))."""
    entries, head_dim, kv_heads, batch = c.shape
    columns = kv_heads * head_dim
    rows_2d = cute.make_tensor(c.iterator, cute.make_layout((batch * entries, columns), stride=(c.stride[0], 1)))
    return rows_2d, (entries, columns)


#: rows of one gather4 TMA instruction
GATHER4_ROWS = 4


@cute.jit
def topk_rows(span, tile, row0, first=0, n: cutlass.Constexpr = None) -> cute.Tensor:
    """The 2D rows compressed tile ``tile`` of a top-k span gathers, one register per box row r
    (box rows first .. first + n - 1; all T when n is None): row0 + idx[tile T + r] where that list
    position is a visible key (p < k, 0 <= idx < count), else row0 (entry 0: a finite row, its
    score masked; never a read past the list or the request's entries)."""
    n_rows = span.tile_n if cutlass.const_expr(n is None) else n
    rows = cute.make_rmem_tensor((n_rows,), cutlass.Int32)
    for c in cutlass.range(n_rows, unroll_full=True):
        p = tile * span.tile_n + first + c
        j = span.idx_row[cutlass.min(p, span.k - 1)]
        ok = (p < span.k) & (j >= 0) & (j < span.count)
        rows[c] = row0 + (j if ok else cutlass.Int32(0))
    return rows
