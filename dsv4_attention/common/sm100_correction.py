"""The correction warps on Blackwell (SM100): O rows rescaled in TMEM, then the one-way epilogue.

Four warps whose ``warp % 4`` is 0, 1, 2, 3 (the lanes each may reach) own the rows of an O
accumulator exactly as the softmax warps own the rows of S: correction thread c holds row c of O
in every value of the 32x32b loads and stores below (``common.tmem``; proven with the kernel's
builders in tests/test_c_sm100_host.py). Its row's statistics reach it through SMEM, indexed by
row: the softmax thread of row m writes slot m, the correction thread of row m reads slot m.

- ``rescale_o_row``: O(row, :) *= scale in place: per 32-column chunk, tcgen05.ld 32x32b.x32 ->
  registers -> multiply -> tcgen05.st 32x32b.x32 back to the same cells; then tcgen05.wait::st.
  Used only when a warp's max grew (``common.sm100_softmax.lazy_max_update``).
- ``o_row_to_smem``: the final O(row, :) * (1 / l), converted, into the SMEM staging tile of O
  (16-byte stores), from which one thread issues the TMA store. No TMEM round trip.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

#: 16-bit elements per 16-byte SMEM store of O
O_VEC = 8


@cute.jit
def rescale_o_row(tiled_o_load, tTR_tO, tiled_o_store, tRT_tO, tTR_rO, scale: Float32):
    """O row of this thread *= ``scale``, in TMEM. ``tTR_tO`` / ``tRT_tO``: the load's source and
    the store's destination partitions of O cut in chunks (``(.., .., .., 1, CHUNKS)``), which
    name the same cells in the same value order; ``tTR_rO``: one chunk of registers."""
    for c in cutlass.range_constexpr(cute.size(tTR_tO, mode=[4])):
        cute.copy(tiled_o_load, tTR_tO[None, None, None, 0, c], tTR_rO)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
        for v in cutlass.range(0, cute.size(tTR_rO), 2, unroll_full=True):
            tTR_rO[v], tTR_rO[v + 1] = cute.arch.mul_packed_f32x2((tTR_rO[v], tTR_rO[v + 1]), (scale, scale))
        cute.copy(tiled_o_store, tTR_rO, tRT_tO[None, None, None, 0, c])
    cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st: O is rescaled before anyone is told


@cute.jit
def o_row_to_smem(tiled_o_load, tTR_tO, tTR_sO, tTR_rO, inv_row_sum: Float32, dtype: cutlass.Constexpr):
    """O row of this thread * ``inv_row_sum`` -> the SMEM staging tile, in ``dtype``. ``tTR_sO``
    is the same partition of the (128, head_dim) SMEM tile as ``tTR_tO`` of O in TMEM, so each
    value lands on its own (row, column)."""
    tTR_rO_out = cute.make_rmem_tensor(tTR_rO.shape, dtype)
    smem_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=O_VEC * dtype.width)
    for c in cutlass.range_constexpr(cute.size(tTR_tO, mode=[4])):
        cute.copy(tiled_o_load, tTR_tO[None, None, None, 0, c], tTR_rO)
        cute.arch.fence_view_async_tmem_load()
        tTR_rO_out.store((tTR_rO.load() * inv_row_sum).to(dtype))
        r_vec = cute.zipped_divide(cute.coalesce(tTR_rO_out), (O_VEC,))
        s_vec = cute.zipped_divide(cute.coalesce(tTR_sO[None, None, None, 0, c]), (O_VEC,))
        for g in cutlass.range_constexpr(cute.size(r_vec, mode=[1])):
            cute.copy(smem_store, r_vec[None, g], s_vec[None, g])


@cute.jit
def o_row_smem_to_gmem(tTR_sO: cute.Tensor, tTR_gO: cute.Tensor):
    """This thread's row of the staged O tile (``tTR_sO``, as ``o_row_to_smem`` wrote it) -> global
    memory (``tTR_gO``: the same partition of the tile's (128, o_cols) view of O), 16 bytes per
    store. The store of a varlen Q tile that straddles its request's end, where a TMA box would
    overwrite the next request's rows: only the threads of the request's rows call it. Each 16-byte
    vector is 8 consecutive columns of one row, contiguous in both (the 128-byte swizzle moves
    whole 16-byte units)."""
    dtype = tTR_sO.element_type
    copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=O_VEC * dtype.width)
    for c in cutlass.range_constexpr(cute.size(tTR_sO, mode=[4])):
        s_vec = cute.zipped_divide(cute.coalesce(tTR_sO[None, None, None, 0, c]), (O_VEC,))
        g_vec = cute.zipped_divide(cute.coalesce(tTR_gO[None, None, None, 0, c]), (O_VEC,))
        for v in cutlass.range_constexpr(cute.size(s_vec, mode=[1])):
            cute.copy(copy_atom, s_vec[None, v], g_vec[None, v])
