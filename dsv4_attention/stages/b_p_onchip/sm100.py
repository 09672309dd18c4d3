"""Stage B on Blackwell (SM100, sm_100a): attention over one KV tile, P kept in TMEM.

What it computes
----------------
    x[i, j]     = scale_log2 * sum_d Q[b, i, h, d] * K[b, j, hk, d]       (scale_log2 = softmax_scale * log2 e)
    m[i]        = max_j x[i, j]                 over the valid keys j < seqlen_k
    P[i, j]     = exp2(x[i, j] - m[i])          (0 for j >= seqlen_k)
    O[b, i, h]  = sum_j P[i, j] V[b, j, hk] / sum_j P[i, j]                   in Q's dtype
    LSE[b, h, i] = (m[i] + log2 sum_j P[i, j]) * ln 2                          fp32, natural log

with hk = h // (heads // kv_heads) and 1 <= seqlen_k <= 128 (the caller rejects longer and handles
0 on the host). Q, K, V, O are (batch, seqlen, heads, head_dim), bf16 or fp16, head_dim contiguous;
LSE is (batch, heads, seqlen_q) fp32. head_dim (64, 128, 256) is fixed per instance; batch, heads,
kv_heads and both sequence lengths are dynamic. scale_log2 is applied once, to the raw score.
One CTA computes one 128-row tile of Q against the whole KV tile:

    grid = (ceil(seqlen_q / 128), heads, batch)

Warp roles (192 threads)
------------------------
    warps 0-3  softmax + epilogue. Thread t (0..127) owns row t of the tile from start to end:
               it loads row t of S (tcgen05.ld 32x32b), masks keys >= seqlen_k to -inf, keeps
               the row max m and the row sum of P in registers, writes row t of P into TMEM
               (tcgen05.st 32x32b), and after the PV MMA loads row t of O (tcgen05.ld 32x32b),
               scales it by 1 / rowsum, converts it and stores it to SMEM; it writes LSE[row t].
               That S rows and O rows land on the same thread is proven on the host.
    warp  4    MMA: allocates TMEM, issues the QK MMAs (SS: Q, K from SMEM) into S and the PV
               MMAs (TS: A = P from TMEM, B = V from SMEM) into O, frees TMEM.
    warp  5    TMA: Q and K in head-dim k-blocks of 64, then the V tile.

Pipeline and barriers (all single-use: one tile per CTA)
---------------------------------------------------------
    qk    PipelineTmaUmma, NUM_KB = head_dim / 64 stages, one per k-block (each is filled once):
          full[kb] expects the Q + K bytes of k-block kb. TMA zero-fills rows past seqlen_q /
          seqlen_k and still counts the whole box, so the byte counts are fixed.
    v     PipelineTmaUmma, 1 stage: full expects the V tile's bytes (keys past seqlen_k are 0).
    s     PipelineUmmaAsync, 1 stage: tcgen05.commit after the last QK MMA -> S full (128 waiters).
    p     named barrier 2 (160 threads, warps 0-4): each softmax thread, after its tcgen05.st of P,
          runs tcgen05.wait::st and tcgen05.fence::before_thread_sync, then arrives; the MMA warp
          syncs, runs tcgen05.fence::after_thread_sync, then issues the PV MMAs.
    o     PipelineUmmaAsync, 1 stage: tcgen05.commit after the last PV MMA -> O full.
    tmem  named barrier 1 (160 threads): TmemAllocator's alloc handshake, and dealloc after the
          softmax warps' last tcgen05.ld of O.
    epi   named barrier 3 (128 threads, warps 0-3): every thread's SMEM O rows are written and
          fenced (fence.proxy.async.shared::cta) before warp 0 issues the TMA store.

TMEM (fp32 columns; lanes 0..127 are the tile's rows)
-----------------------------------------------------
    column 0 .............. 63 | 64 .............. 127 | 128 ........ 128 + head_dim - 1
           S                   | S, then P (16-bit)    | O
    S(m, n) at lane m, column n;  P(m, k) at lane m, column 64 + k // 2, half k % 2;
    O(m, n) at lane m, column 128 + n.  Allocation: S + O = 192 / 256 / 384 columns -> 256 / 256 / 512
    (the next power of two, computed from the layouts by common.tmem.attention_tmem_columns).
P may overwrite S because (1) the S full barrier says every QK MMA has completed, so nothing
writes S any more, and (2) each thread writes only lane t, and it has read all of lane t's S
(tcgen05.ld + tcgen05.wait::ld) into registers before its first store; no other thread reads
lane t. The PV MMA reads P only after all 128 threads have passed the p barrier.
Where every P(m, k) is written and where the PV MMA's A operand reads it are the same TMEM
cell, for every (m, k), written once: proven on the host with the builders in common/tmem.py
(tests/test_b_sm100_tmem_p.py).

SMEM
----
    sQ, sK  NUM_KB k-blocks of 128 rows x 64 elements, K-major, 128B swizzle, 16 KiB each
            (S<3,4,3> o ((128,16),1,4,NUM_KB):((64,1),0,16,8192)), as in stage A.
    sV      128 keys x head_dim, MN-major (head_dim contiguous), 128B swizzle: 64-element wide
            column blocks of 128 keys (16 KiB each), S<3,4,3> o (((64,D/64),16),1,8):(((1,8192),64),0,1024).
    sO      128 rows x head_dim, row-major, 128B swizzle, in 64-column blocks (the same shape as sQ);
            it reuses sQ's bytes: the O full barrier comes after every QK MMA (the last reader of
            sQ) has completed. SMEM = 3 * 128 * head_dim * 2 bytes + barriers: 48 / 96 / 192 KiB.

Epilogue
--------
One way, no TMEM round trip: O chunk (32 columns) TMEM -> registers, * 1 / rowsum, convert,
-> sO (16-byte stores) -> fence -> one TMA store of the (128, head_dim) tile; TMA clips rows past
seqlen_q. LSE[row] is written by its thread when row < seqlen_q.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from dsv4_attention.common.layouts import check_attention_operands, reorder, seq_major
from dsv4_attention.common.sm100_qk import (
    K_BLOCK,
    QK_MMA_TILER,
    issue_qk_mmas,
    load_qk_kblocks,
    make_qk_smem_layouts,
    make_qk_tma_atoms,
)
from dsv4_attention.common.tmem import (
    EPI_COLS,
    EPI_THREADS,
    PV_TILE_K,
    QK_TILE_M,
    QK_TILE_N,
    attention_tmem_columns,
    epi_view,
    fence_after_thread_sync,
    fence_before_thread_sync,
    make_acc_tmem_load,
    make_p_tmem_store,
    make_pv_tiled_mma,
    make_qk_tiled_mma,
    o_region,
    p_chunk_view,
    p_operand_region,
    p_store_region,
    s_region,
)

O_VEC = 8  # 16-bit elements per 16-byte SMEM store of O
LN2 = math.log(2.0)

# (batch, seqlen_k, kv_heads, head_dim) -> (head_dim, seqlen_k, kv_heads, batch): V as the PV
# MMA's B operand, (N, K, ...), N = head_dim contiguous
V_AS_PV_B = (3, 1, 2, 0)
# (batch, heads, seqlen_q) -> (seqlen_q, heads, batch)
LSE_ROW_MAJOR = (2, 1, 0)


class AttentionOneTileSm100:
    """O = softmax(scale * Q K^T) V and LSE over one KV tile (seqlen_k <= 128) on SM100,
    with P written into TMEM over S and read from there by the PV MMA."""

    arch = "sm_100a"

    def __init__(self, dtype, head_dim: int):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"AttentionOneTileSm100: dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in (64, 128, 256):
            raise ValueError(f"AttentionOneTileSm100: head_dim must be 64, 128 or 256, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.pv_tiler = (QK_TILE_M, head_dim, PV_TILE_K)
        self.num_k_blocks = head_dim // K_BLOCK

        self.softmax_warps = (0, 1, 2, 3)  # w % 4 == w: warp w reaches TMEM lanes 32w..32w+31
        self.mma_warp = 4
        self.tma_warp = 5
        self.threads_per_cta = 32 * 6
        # named barriers (0 is __syncthreads)
        self.tmem_barrier_id = 1
        self.p_barrier_id = 2
        self.epi_barrier_id = 3
        self.mma_and_softmax_threads = 32 * (len(self.softmax_warps) + 1)

        # set when __call__ is traced
        self.shared_storage = None
        self.tmem_columns = None

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        scale_log2: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        check_attention_operands(self.dtype, mQ, mK, mV, mO, mLSE)

        q = seq_major(mQ)  # (seqlen_q, head_dim, heads, batch)
        k = seq_major(mK)  # (seqlen_k, head_dim, kv_heads, batch)
        v = reorder(mV, V_AS_PV_B)  # (head_dim, seqlen_k, kv_heads, batch)
        o = seq_major(mO)  # (seqlen_q, head_dim, heads, batch)
        lse = reorder(mLSE, LSE_ROW_MAJOR)  # (seqlen_q, heads, batch)

        qk_mma = make_qk_tiled_mma(self.dtype, QK_MMA_TILER[:2])
        pv_mma = make_pv_tiled_mma(self.dtype, self.head_dim)

        q_smem, k_smem = make_qk_smem_layouts(qk_mma, self.dtype, self.num_k_blocks)
        v_smem = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, self.dtype, 1)
        o_smem = sm100_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, (QK_TILE_M, self.head_dim), 1
        )
        if const_expr(cute.cosize(o_smem) > cute.cosize(q_smem)):
            raise ValueError("sO must fit in sQ's bytes, which it reuses")

        # bytes a barrier receives; TMA counts full boxes even where it zero-fills
        tma_atom_q, tma_q, tma_atom_k, tma_k, self.qk_kblock_bytes = make_qk_tma_atoms(
            qk_mma, q, k, q_smem, k_smem, self.dtype
        )
        v_tile = cute.select(v_smem, mode=[0, 1, 2])
        tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), v, v_tile, self.pv_tiler, pv_mma
        )
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o, cute.select(o_smem, mode=[0, 1]), (QK_TILE_M, self.head_dim)
        )
        self.v_bytes = cute.size_in_bytes(self.dtype, v_tile)

        self.tmem_columns = attention_tmem_columns(self.dtype, self.head_dim)

        @cute.struct
        class SharedStorage:
            qk_mbar: cute.struct.MemRange[Int64, self.num_k_blocks * 2]
            v_mbar: cute.struct.MemRange[Int64, 2]
            s_mbar: cute.struct.MemRange[Int64, 2]
            o_mbar: cute.struct.MemRange[Int64, 2]
            tmem_base: Int32
            # 1024-byte alignment: the 128B-swizzle pattern repeats every 8 rows x 128 B
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_smem)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_smem)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(v_smem)], 1024]

        self.shared_storage = SharedStorage

        grid = (cute.ceil_div(q.shape[0], QK_TILE_M), q.shape[2], q.shape[3])
        self.kernel(
            qk_mma,
            pv_mma,
            tma_atom_q,
            tma_q,
            tma_atom_k,
            tma_k,
            tma_atom_v,
            tma_v,
            tma_atom_o,
            tma_o,
            lse,
            scale_log2,
            q_smem,
            k_smem,
            v_smem,
            o_smem,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA view (seqlen_q, head_dim, heads, batch)
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,  # TMA view (seqlen_k, head_dim, kv_heads, batch)
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,  # TMA view (head_dim, seqlen_k, kv_heads, batch)
        tma_atom_o: cute.CopyAtom,
        mO: cute.Tensor,  # TMA view (seqlen_q, head_dim, heads, batch)
        mLSE: cute.Tensor,  # (seqlen_q, heads, batch) fp32
        scale_log2: Float32,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        v_smem: cute.ComposedLayout,
        o_smem: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        m_blk, h, b = cute.arch.block_idx()
        hk = h // (mQ.shape[2] // mK.shape[2])  # GQA: `heads // kv_heads` query heads share a KV head

        if warp_idx == self.tma_warp:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # barriers: warp 0 initialises them all; one fence + __syncthreads below publishes them
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        qk_producer, qk_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=self.num_k_blocks,
            producer_group=one_thread,
            consumer_group=one_thread,
            tx_count=self.qk_kblock_bytes,
            barrier_storage=storage.qk_mbar.data_ptr(),
            defer_sync=True,
        ).make_participants()
        v_producer, v_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=1,
            producer_group=one_thread,
            consumer_group=one_thread,
            tx_count=self.v_bytes,
            barrier_storage=storage.v_mbar.data_ptr(),
            defer_sync=True,
        ).make_participants()
        softmax_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, EPI_THREADS)
        s_producer, s_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=one_thread,
            consumer_group=softmax_threads,
            barrier_storage=storage.s_mbar.data_ptr(),
            defer_sync=True,
        ).make_participants()
        o_producer, o_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=one_thread,
            consumer_group=softmax_threads,
            barrier_storage=storage.o_mbar.data_ptr(),
            defer_sync=True,
        ).make_participants()
        tmem_barrier = pipeline.NamedBarrier(
            barrier_id=self.tmem_barrier_id, num_threads=self.mma_and_softmax_threads
        )
        p_barrier = pipeline.NamedBarrier(barrier_id=self.p_barrier_id, num_threads=self.mma_and_softmax_threads)
        epi_barrier = pipeline.NamedBarrier(barrier_id=self.epi_barrier_id, num_threads=EPI_THREADS)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=tmem_barrier,
            allocator_warp_id=self.mma_warp,
        )
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        # (MMA, MMA_M/N, MMA_K, STAGE)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)
        sV = storage.sV.get_tensor(v_smem.outer, swizzle=v_smem.inner)
        # (128, head_dim): O's staging tile, on sQ's bytes
        sO = cute.make_tensor(
            cute.recast_ptr(storage.sQ.data_ptr(), o_smem.inner, dtype=self.dtype), o_smem.outer
        )[None, None, 0]

        if warp_idx == self.tma_warp:
            self.load(
                qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV,
                sQ, sK, sV, qk_producer, v_producer, m_blk, h, hk, b,
            )  # fmt: skip

        if warp_idx == self.mma_warp:
            self.mma(
                qk_mma, pv_mma, sQ, sK, sV, tmem, tmem_barrier, p_barrier,
                qk_consumer, v_consumer, s_producer, o_producer,
            )  # fmt: skip

        if warp_idx < self.mma_warp:
            self.softmax_and_epilogue(
                tma_atom_o, mO, mLSE, sO, scale_log2, mK.shape[0],
                tmem, tmem_barrier, p_barrier, epi_barrier, s_consumer, o_consumer,
                tidx, warp_idx, m_blk, h, b,
            )  # fmt: skip

    # /////////////////////////////////////////////////////////////////////////////////////
    #  TMA warp: Q and K k-block by k-block, then V
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def load(
        self, qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV,
        sQ, sK, sV, qk_producer, v_producer, m_blk, h, hk, b,
    ):  # fmt: skip
        # (128, 64, NUM_KB): the tile's rows cut along head_dim into k-blocks
        gQ = cute.local_tile(mQ[None, None, h, b], cute.select(QK_MMA_TILER, mode=[0, 2]), (m_blk, None))
        gK = cute.local_tile(mK[None, None, hk, b], cute.select(QK_MMA_TILER, mode=[1, 2]), (0, None))
        load_qk_kblocks(qk_mma, tma_atom_q, gQ, sQ, tma_atom_k, gK, sK, qk_producer, self.num_k_blocks)

        # (head_dim, 128): the whole V tile
        gV = cute.local_tile(mV[None, None, hk, b], cute.select(self.pv_tiler, mode=[1, 2]), (0, 0))
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
            cute.group_modes(pv_mma.get_slice(0).partition_B(gV), 0, 3),
        )  # fmt: skip
        stage = v_producer.acquire_and_advance()
        cute.copy(tma_atom_v, tVgV, tVsV[None, 0], tma_bar_ptr=stage.barrier)
        # every stage is filled once and never released: no producer tail to wait for

    # /////////////////////////////////////////////////////////////////////////////////////
    #  MMA warp: TMEM owner; S = Q K^T (SS), then O = P V (TS, P from TMEM)
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def mma(
        self, qk_mma, pv_mma, sQ, sK, sV, tmem, tmem_barrier, p_barrier,
        qk_consumer, v_consumer, s_producer, o_producer,
    ):  # fmt: skip
        tmem.allocate(self.tmem_columns)
        tmem.relinquish_alloc_permit()  # one allocation per CTA: let co-resident CTAs allocate
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)
        tStS = s_region(self.dtype).at(tmem_base)  # (MMA, 1, 1) fp32
        tOtO = o_region(self.dtype, self.head_dim).at(tmem_base)  # (MMA, 1, 1) fp32
        tOrP = p_operand_region(self.dtype, self.head_dim).at(tmem_base)  # (MMA, 1, PV_K_PHASES) 16-bit

        tOrV = pv_mma.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, 1) SMEM descriptors
        pv_k_phases = cute.size(tOrP, mode=[2])

        s_slot = s_producer.acquire_and_advance()  # single tile: the slot is free
        # each k-block has its own stage, filled once: nothing to release
        issue_qk_mmas(qk_mma, tStS, sQ, sK, qk_consumer, self.num_k_blocks, False)
        s_slot.commit()  # tcgen05.commit -> S full once every QK MMA has landed in TMEM

        # P: all 128 softmax threads have stored their row and waited for the stores
        p_barrier.arrive_and_wait()
        fence_after_thread_sync()
        v_consumer.wait_and_advance()
        o_slot = o_producer.acquire_and_advance()
        pv_mma.set(tcgen05.Field.ACCUMULATE, False)
        for kp in cutlass.range_constexpr(pv_k_phases):
            cute.gemm(pv_mma, tOtO, tOrP[None, None, kp], tOrV[None, None, kp, 0], tOtO)
            pv_mma.set(tcgen05.Field.ACCUMULATE, True)
        o_slot.commit()  # tcgen05.commit -> O full once every PV MMA has landed in TMEM

        # dealloc only after the softmax warps' last tcgen05.ld
        tmem_barrier.arrive_and_wait()
        fence_after_thread_sync()
        tmem.free(tmem_base, self.tmem_columns)

    # /////////////////////////////////////////////////////////////////////////////////////
    #  Softmax + epilogue warps 0-3: thread t owns row t
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def softmax_and_epilogue(
        self, tma_atom_o, mO, mLSE, sO, scale_log2, seqlen_k,
        tmem, tmem_barrier, p_barrier, epi_barrier, s_consumer, o_consumer,
        tidx, warp_idx, m_blk, h, b,
    ):  # fmt: skip
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)

        # row t of S: (T2R, T2R_M, T2R_N, 1, S_CHUNKS) registers, and their (m, n)
        tiled_s_load, tS_chunks = make_acc_tmem_load(s_region(self.dtype).at(tmem_base), EPI_COLS)
        thr_s_load = tiled_s_load.get_slice(tidx)
        tTR_tS = thr_s_load.partition_S(tS_chunks)
        tTR_cS = thr_s_load.partition_D(epi_view(cute.make_identity_tensor((QK_TILE_M, QK_TILE_N)), EPI_COLS))
        tTR_rS = cute.make_rmem_tensor(tTR_cS.shape, Float32)

        # row t of P: (R2T, R2T_M, R2T_N, 1, P_CHUNKS) 16-bit registers, and their (m, k)
        p_store = p_store_region(self.dtype)
        tStP = p_store.at(tmem_base)
        tiled_p_store = make_p_tmem_store(tStP)
        thr_p_store = tiled_p_store.get_slice(tidx)
        tRT_tP = thr_p_store.partition_D(tStP)
        tRT_rP = cute.make_rmem_tensor(
            thr_p_store.partition_S(p_chunk_view(cute.make_identity_tensor((QK_TILE_M, PV_TILE_K)), self.dtype)).shape,
            self.dtype,
        )

        s_consumer.wait_and_advance()
        fence_after_thread_sync()  # order the loads after the MMAs that S full reports
        for c in cutlass.range_constexpr(cute.size(tTR_tS, mode=[4])):
            cute.copy(tiled_s_load, tTR_tS[None, None, None, 0, c], tTR_rS[None, None, None, 0, c])
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the whole row is in registers

        row_max, row_sum = self.softmax_row(tTR_rS, tTR_cS, tRT_rP, scale_log2, seqlen_k)

        # P over S's upper half (lane t only), then tell the MMA warp
        for c in cutlass.range_constexpr(cute.size(tRT_tP, mode=[4])):
            cute.copy(tiled_p_store, tRT_rP[None, None, None, 0, c], tRT_tP[None, None, None, 0, c])
        cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st
        fence_before_thread_sync()
        p_barrier.arrive()

        # LSE of row t, natural log
        row = m_blk * QK_TILE_M + tTR_cS[0][0]
        if row < mLSE.shape[0]:
            mLSE[row, h, b] = (row_max + cute.math.log2(row_sum, fastmath=True)) * Float32(LN2)

        # O: TMEM -> registers -> * 1 / rowsum -> sO, one 32-column chunk at a time
        tiled_o_load, tO_chunks = make_acc_tmem_load(o_region(self.dtype, self.head_dim).at(tmem_base), EPI_COLS)
        thr_o_load = tiled_o_load.get_slice(tidx)
        tTR_tO = thr_o_load.partition_S(tO_chunks)
        tTR_sO = thr_o_load.partition_D(epi_view(sO, EPI_COLS))  # the same partition of sO
        tTR_rO = cute.make_rmem_tensor(tTR_sO[None, None, None, 0, 0].shape, Float32)
        tTR_rO_out = cute.make_rmem_tensor(tTR_rO.shape, self.dtype)
        smem_store = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=O_VEC * self.dtype.width
        )
        inv_row_sum = cute.arch.rcp_approx(row_sum)

        o_consumer.wait_and_advance()
        fence_after_thread_sync()
        for c in cutlass.range(cute.size(tTR_tO, mode=[4]), unroll=1):
            cute.copy(tiled_o_load, tTR_tO[None, None, None, 0, c], tTR_rO)
            cute.arch.fence_view_async_tmem_load()
            tTR_rO_out.store((tTR_rO.load() * inv_row_sum).to(self.dtype))
            r_vec = cute.zipped_divide(cute.coalesce(tTR_rO_out), (O_VEC,))
            s_vec = cute.zipped_divide(cute.coalesce(tTR_sO[None, None, None, 0, c]), (O_VEC,))
            for g in cutlass.range_constexpr(cute.size(r_vec, mode=[1])):
                cute.copy(smem_store, r_vec[None, g], s_vec[None, g])
        fence_before_thread_sync()  # every tcgen05.ld has completed (waited above)
        tmem_barrier.arrive()  # TMEM may be freed

        # sO complete and visible to the async proxy -> one TMA store of the tile
        cute.arch.fence_view_async_shared()
        epi_barrier.arrive_and_wait()
        if warp_idx == self.softmax_warps[0]:
            gO = cute.local_tile(mO[None, None, h, b], (QK_TILE_M, self.head_dim), (m_blk, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            # one thread: this DSL does not elect inside an S2G TMA copy (it does for loads),
            # and 32 issuing threads would store the tile 32 times
            with cute.arch.elect_one():
                cute.copy(tma_atom_o, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # sO must outlive the TMA's reads

    @cute.jit
    def softmax_row(self, tTR_rS, tTR_cS, tRT_rP, scale_log2, seqlen_k):
        """Row t of S (registers, with their (m, n) in ``tTR_cS``) -> P in ``tRT_rP`` (same
        value order: value v of both is column v of the row), returns (m, rowsum) in the
        x = s * scale_log2 domain. Keys n >= seqlen_k are -inf before the max."""
        per_chunk = cute.size(tTR_rS, mode=[0])
        for c in cutlass.range_constexpr(cute.size(tTR_rS) // per_chunk):
            for i in cutlass.range_constexpr(per_chunk):
                v = c * per_chunk + i  # flat value index
                x = tTR_rS[v] * scale_log2
                tTR_rS[v] = x if tTR_cS[v][1] < seqlen_k else -Float32.inf
        x_row = tTR_rS.load()
        row_max = x_row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
        p_row = cute.math.exp2(x_row - row_max, fastmath=True)
        row_sum = p_row.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # tRT_rP is compact like tTR_rS: flat value v of one is flat value v of the other
        cute.make_tensor(tRT_rP.iterator, cute.make_layout(tTR_rS.shape)).store(p_row.to(self.dtype))
        return row_max, row_sum
