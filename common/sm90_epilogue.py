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
        have nothing left to wait for; in a persistent CTA they sync too, at the same
        instruction: see ``store_o``); then one lane of the store warp issues the
        store, commits and waits for its SMEM reads before the CTA may exit (a
        persistent CTA's lane then arrives on its q_empty barrier: the producer may
        load the next tile's Q over sO).
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
    done_bar: cute.Pointer | None = None,
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
    request's rows). ``done_bar`` (a persistent kernel's): one arrival once sO has been read (the
    TMA store's reads waited for, or every thread's copy done), so the next tile's Q may land there."""
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
        if cutlass.const_expr(done_bar is not None):  # every thread's reads of sO done, before TMA writes it
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
            if tidx == 0:
                cute.arch.mbarrier_arrive(done_bar)
    elif cutlass.const_expr(done_bar is not None):
        # a persistent CTA: every consumer warp syncs, at one barrier instruction. With bar.arrive
        # for the other warps, racecheck reported thousands of write-after-read hazards on the next
        # tile's row-sum exchange (stage D3's varlen case); with bar.sync in two branches,
        # synccheck reported divergent threads (H200, 2026-11-26)
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
        if is_store_warp:
            tma_store(tma_atom_o, sO, gO, m_block, done_bar)
    elif is_store_warp:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
        tma_store(tma_atom_o, sO, gO, m_block)
    else:
        cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=num_threads)
    if cutlass.const_expr(done_bar is not None):
        # the warps reconverge after the one-lane store: a persistent kernel's next tile issues
        # wgmma after this, and without the sync ptxas serializes every wgmma of the kernel
        # (remark C7519, "WG.AR in divergent path": 27 % slower on the H200; common/compile.py
        # fails a kernel that has it)
        cute.arch.sync_warp()


@cute.jit
def tma_store(tma_atom_o: cute.CopyAtom, sO: cute.Tensor, gO: cute.Tensor, m_block: cutlass.Int32,
              done_bar: cute.Pointer | None = None):
    """The store warp: sO -> tile m_block of gO, one TMA. Bulk groups are per thread: one lane
    issues, commits and waits for the store's SMEM reads (then arrives on ``done_bar``)."""
    tOsO_tma, tOgO = tile_tma_partition(tma_atom_o, sO, gO)
    with cute.arch.elect_one():
        cute.copy(tma_atom_o, tOsO_tma[None, 0], tOgO[None, m_block])
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        if cutlass.const_expr(done_bar is not None):
            cute.arch.mbarrier_arrive(done_bar)


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
