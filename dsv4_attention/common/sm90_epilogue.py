"""The one-way epilogue of the SM90 attention kernels: O from the wgmma
accumulator to global memory through SMEM and one TMA store, LSE straight from
the threads that own the rows.

O: registers -> 16 bits -> SMEM over the Q buffer (same (tile_m, head_dim)
K-major swizzled layout that TMA filled with Q, so the TMA store reads it as
the load wrote Q) -> TMA store; rows past seqlen_q are clipped by TMA.

    EPILOGUE barrier, all consumer threads (sync): every warpgroup's last QK wgmma
        (the last reader of sQ) has completed, so sQ may be overwritten.
    each thread writes its O values; fence.proxy.async.shared::cta makes the
    generic-proxy writes visible to the TMA (async proxy).
    EPILOGUE barrier again: the store warp syncs, the others only arrive (they
        have nothing left to wait for); then one lane of the store warp issues the
        store, commits and waits for its SMEM reads before the CTA may exit.

The persistent seesaw (stage D1's two warpgroups holding O's column halves) streams O through
its P buffers instead (``store_o_chunks``): sQ is then free as soon as the last QK has read it,
and the next tile's Q loads under this tile's last PVs and epilogue.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.sm90_gemm import tile_tma_partition
from dsv4_attention.common.softmax import acc_rows_view


@cute.jit
def store_o(
    acc_o: cute.Tensor,
    sO: cute.Tensor,
    thr_pv: cute.ThrMma,
    tma_atom_o: cute.CopyAtom,
    gO: cute.Tensor,
    m_block: cutlass.Int32,
    barrier_id: cutlass.Constexpr[int],
    num_threads: cutlass.Constexpr[int],
    is_store_warp: cutlass.Boolean,
    sO_mine: cute.Tensor | None = None,
    skip_cols=None,
    gO_rows: cute.Tensor | None = None,
    rows_left=None,
    tidx=None,
):
    """acc_o (fp32, already normalized) -> sO (tile_m, head_dim, 1) -> tile m_block of
    gO (tile_m, head_dim, m_blocks).
    Every thread of the ``num_threads`` consumer threads calls it. ``sO_mine``: the part of
    sO this thread's PV partition covers (default: the whole tile; stage D1's split warpgroups
    each pass their O columns); ``skip_cols``: leave the view's first columns unwritten (a
    runtime count: another warpgroup stores them). ``gO_rows`` (the tile's (tile_m, head_dim)
    global memory), ``rows_left``, ``tidx`` (0 .. num_threads - 1): instead of the TMA store,
    every thread copies its share of the rows < rows_left from sO (the Q tile that straddles the
    end of its request in a variable-length batch, where the TMA box would write the next
    request's rows)."""
    r_o = cute.make_rmem_tensor(acc_o.layout, sO.element_type)
    r_o.store(acc_o.load().to(sO.element_type))
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    view = sO[None, None, 0]
    if cutlass.const_expr(sO_mine is not None):
        view = sO_mine
    tOsO = thr_pv.partition_C(view)
    if cutlass.const_expr(skip_cols is None):
        cute.autovec_copy(r_o, tOsO)
    else:
        cols = thr_pv.partition_C(cute.make_identity_tensor(cute.product_each(view.shape)))
        for i in cutlass.range_constexpr(cute.size(r_o)):
            if cols[i][1] >= skip_cols:
                tOsO[i] = r_o[i]
    cute.arch.fence_proxy("async.shared", space="cta")
    if cutlass.const_expr(gO_rows is not None):
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
        copy_rows(sO[None, None, 0], gO_rows, rows_left, tidx, num_threads)
    elif is_store_warp:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
        # bulk groups are per thread: one lane issues, commits and waits for the store's SMEM reads
        tOsO_tma, tOgO = tile_tma_partition(tma_atom_o, sO, gO)
        with cute.arch.elect_one():
            cute.copy(tma_atom_o, tOsO_tma[None, 0], tOgO[None, m_block])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
    else:
        cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=num_threads)


@cute.jit
def store_lse(
    mLSE: cute.Tensor,
    lse: cute.Tensor,
    tScS: cute.Tensor,
    row_offset: cutlass.Int32,
    head: cutlass.Int32,
    batch: cutlass.Int32,
    seqlen_q: cutlass.Int32,
):
    """Every lane of a quad holds its rows' LSE; the lane holding column 0 of the
    S tile (``tScS``: the thread's QK accumulator coordinates) writes them, one
    writer per row, rows row_offset + r < seqlen_q only. mLSE is (batch, heads, seqlen_q)."""
    rows_c = acc_rows_view(tScS)
    if rows_c[0, 0][1] == 0:
        for i in cutlass.range_constexpr(cute.size(rows_c, mode=[0])):
            row = row_offset + rows_c[i, 0][0]
            if row < seqlen_q:
                mLSE[batch, head, row] = lse[i]


@cute.jit
def store_o_chunks(
    acc_o: cute.Tensor,
    sO: cute.Tensor,
    tOsO: cute.Tensor,
    tma_atom_o: cute.CopyAtom,
    gO: cute.Tensor,
    first_chunk,
    barrier_id,
    is_store_warp: cutlass.Boolean,
    gO_rows: cute.Tensor | None = None,
    rows_left=None,
    tidx=None,
):
    """One warpgroup's O columns, 64 at a time, through one (64, 64) SMEM buffer.

    ``acc_o``: the warpgroup's normalized fp32 accumulator of n 64-column chunks, the wgmma C
    fragment ((2, 2, 8 n), 1, 1) whose flat value index is col_pair + 2 row_half + 4 col_group
    (col = lane's pair + 8 col_group): chunk j is values [32 j, 32 j + 32), laid out as the C
    fragment of a 64 x 64 wgmma. ``sO``: the buffer, (64, 64, 1) K-major 128B-swizzled (a P
    buffer: the layout TMA boxes of 64 columns use); ``tOsO``: this thread's values in it, the
    64 x 64 C partition (the kernel passes the view its P stores use: the same addresses, which
    the compiler keeps once, not a second set alive across a persistent CTA's tile loop).
    ``gO``: the tile's (64, 64, chunks) global chunks; this warpgroup's are ``first_chunk`` on.
    ``barrier_id``: the warpgroup's own named barrier (128 threads); ``is_store_warp``: its
    first warp, one lane of which issues each chunk's TMA store.

    O is converted to 16 bits first; then per chunk: [the previous chunk's store has read sO,
    sync]; write, fence for the async proxy; sync; one TMA box (or, for a tile that straddles its
    request's end, every thread copies rows < ``rows_left`` of the chunk to ``gO_rows``, the
    tile's (64, head_dim) memory). At the end the last store's reads are waited for and the
    warpgroup synced: the buffer holds the next tile's P after this."""
    rows, cols = cute.size(sO, mode=[0]), cute.size(sO, mode=[1])
    frag = cute.make_layout(tOsO.shape)
    per = cute.size(frag)  # values of one chunk (32: 64 x 64 over 128 threads)
    n_chunks = cute.size(acc_o) // per
    sO_tma, gO_tma = tile_tma_partition(tma_atom_o, sO, gO)
    # all of O to 16 bits first: half the registers live through the chunks' waits (fp32 spilled)
    r_o = cute.make_rmem_tensor(acc_o.layout, sO.element_type)
    r_o.store(acc_o.load().to(sO.element_type))
    for j in cutlass.range_constexpr(n_chunks):
        if cutlass.const_expr(j > 0):
            if cutlass.const_expr(gO_rows is None):
                if is_store_warp:
                    with cute.arch.elect_one():
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        cute.autovec_copy(cute.make_tensor(r_o.iterator + j * per, frag), tOsO)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        if cutlass.const_expr(gO_rows is None):
            if is_store_warp:
                with cute.arch.elect_one():
                    cute.copy(tma_atom_o, sO_tma[None, 0], gO_tma[None, first_chunk + j])
                    cute.arch.cp_async_bulk_commit_group()
        else:
            copy_rows(sO[None, None, 0], cute.local_tile(gO_rows, (rows, cols), (0, first_chunk + j)), rows_left, tidx,
                      128)
    if cutlass.const_expr(gO_rows is None):
        if is_store_warp:
            with cute.arch.elect_one():
                cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
    # the warps reconverge after the one-lane stores: the next tile issues wgmma after this, and
    # without the sync ptxas serializes every wgmma of the kernel (remark C7519, "WG.AR in
    # divergent path": 27 % slower on the H200; common/compile.py fails a kernel that has it)
    cute.arch.sync_warp()


@cute.jit
def store_o_rows(acc_o: cute.Tensor, thr_mma: cute.ThrMma, gO: cute.Tensor, rows_left: cutlass.Int32):
    """acc_o (this thread's C fragment of a (rows, cols) MMA tile) straight to ``gO``, the tile's
    global memory in the accumulator's dtype (split-KV's fp32 partial O), rows < ``rows_left``
    only. Each value goes from the thread that holds it: no SMEM, no barrier."""
    # a guard a row, not a value: acc_rows_view's row i holds one row's values (proven on the
    # host: tests/test_c_sm90_host.py, the O view's rows), copied in one autovec copy
    tOgO = acc_rows_view(thr_mma.partition_C(gO))
    coords = acc_rows_view(thr_mma.partition_C(cute.make_identity_tensor(cute.product_each(gO.shape))))
    rows = acc_rows_view(acc_o)
    for i in cutlass.range_constexpr(cute.size(rows, mode=[0])):
        if coords[i, 0][0] < rows_left:
            cute.autovec_copy(rows[i, None], tOgO[i, None])


@cute.jit
def copy_rows(src: cute.Tensor, dst: cute.Tensor, rows_left: cutlass.Int32, tidx: cutlass.Int32,
              num_threads: cutlass.Constexpr[int]):
    """dst[r, :] = src[r, :] for the rows r < rows_left of a (rows, cols) tile, the threads taking
    8-column pieces in turn (row-major over the tile, so a warp's stores cover whole rows)."""
    rows, cols = cute.size(src, mode=[0]), cute.size(src, mode=[1])
    pieces = cols // 8
    for idx in cutlass.range(tidx, rows * pieces, num_threads, unroll=1):
        r = idx // pieces
        if r < rows_left:
            c = (idx % pieces) * 8
            for j in cutlass.range_constexpr(8):
                dst[r, c + j] = src[r, c + j]
