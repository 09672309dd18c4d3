"""Stage F on Blackwell (SM100, sm_100a): the backward of attention, dQ, dK, dV from Q, K, V, dO,
the forward's LSE and D = rowsum(dO * O), P recomputed per visit. The algorithm, the grid and the
host's work are sm90.py's; what Blackwell changes is where the products live. Compiled for
sm_100a and its operand layouts proven on the host (tests/test_f_sm100_host.py); it has never run
(no Blackwell GPU is lent). Head dim 128.

Per CTA: KV tile n_block (TILE_N = 128 keys) of one (kv head, batch); visits (query head of the
group, Q tile of TILE_M = 64 queries) that see one of its keys (``span.q_tile_range``), head-major.
The operands and accumulators of a visit (sm100_layouts.py: the table, the SMEM views, the TMEM
map), key n of the tile at TMEM lane n:

    S^T = K Q^T, dP^T = V dO^T                    (SS)        -> TMEM, 64 columns each
    P^T = exp2(S^T scale log2 e - LSE2), 0 where hidden; dS^T = P^T (dP^T - D)
                                                  (compute)   -> TMEM (16-bit, over S^T / dP^T), sdS
    dV += P^T dO, dK += dS^T Q                    (TS)        TMEM accumulators over the visits
    dQ^T = K^T dS^T                               (SS)        -> TMEM -> scale -> red.global.add
                                                              into the fp32 dQ accumulator
    end: dK *= scale; dK, dV -> global (rows past the keys clipped)

Warp roles (192 threads, no register moves):
    warps 0-3   compute: thread t owns key t (TMEM lane t) of S^T, dP^T, P^T, dS^T, of sdS's row t,
                of dK / dV's row t at the end, and of dQ^T's row t = dQ's column t.
    warp 4      TMA: K and V once, then Q and dO of each visit into a ring of ``stages`` slots.
    warp 5      MMA: allocates TMEM (512 columns: one CTA an SM), issues the five MMAs.

Barriers (u: a pipeline's use; every wait on use u's parity):
    kv          TMA -> MMA          K and V landed (once).
    q[s]        TMA <-> MMA         slot s: Q and dO landed / released by tcgen05.commit after the
                                    visit's dV and dK (the last MMAs that read them).
    scores      MMA <-> compute     S^T and dP^T in TMEM / read (and P^T, dS^T stored over them).
    probs       compute <-> MMA     P^T, dS^T in TMEM and dS^T in sdS (tcgen05.wait::st, the async
                                    proxy fence) / sdS read by dQ^T (tcgen05.commit).
    dq          MMA <-> compute     dQ^T in TMEM / read (the next dQ^T may overwrite it).
    turn        named barrier       (deterministic) thread 0 saw this KV tile's turn at the Q tile /
                                    every compute thread's dQ adds are fenced at gpu scope.
    done        MMA -> compute      the last visit's MMAs completed: dK, dV final.
    tmem        named barrier       the allocator's handshake; free after the last TMEM access.
    stats       named barrier       the visit's LSE2 and D staged in SMEM by the compute threads
                                    (two slots by visit parity), read by all of them.

The MMAs of one warp complete in issue order, which the map relies on: the next visit's S^T and
dP^T overwrite P^T and dS^T only after the dV and dK issued before them have read them.

Deterministic mode (sm90's rule, ``span.first_kv_tile``): the KV tiles that visit a Q tile add
their dQ in KV-tile order. Counter mSem[b, h, m] holds how many have added; before its adds the
CTA's thread 0 waits (acquire, gpu scope) until it equals n_block - first_kv_tile(m), the compute
threads meet it at the turn barrier and add; each fences its adds (fence.acq_rel.gpu), they meet
again, and thread 0 increments the counter (release). A CTA waits only for CTAs of lower block
index (the KV tile is the grid's fastest dimension), which are dispatched first: no cycle.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05

from dsv4_attention.common.layouts import with_row_vectors
from dsv4_attention.common.tmem import (
    EPI_COLS,
    epi_view,
    fence_after_thread_sync,
    fence_before_thread_sync,
    make_acc_tmem_load,
)
from dsv4_attention.stages.f_backward import sm100_layouts as L
from dsv4_attention.stages.f_backward.span import Visits, cta_views, kernel_views, key_queries, pass_turn, wait_turn

COMPUTE_THREADS = 128
TMA_WARP, MMA_WARP = 4, 5
TMEM_BARRIER_ID, STATS_BARRIER_ID, TURN_BARRIER_ID = 1, 2, 3
ROW_VEC = 8  # 16-bit values a dK / dV store writes at once (16 bytes)


def _pipeline(kind, bars, producers, consumers, stages: int = 1, tx=None):
    """(producer, consumer) of a ``kind`` pipeline of ``stages`` over the barriers ``bars`` (its
    initialisation published by the kernel's one pipeline_init_arrive / wait)."""
    extra = {} if tx is None else {"tx_count": tx}
    return kind.create(num_stages=stages, producer_group=producers, consumer_group=consumers,
                       barrier_storage=bars.data_ptr(), defer_sync=True, **extra).make_participants()


class FlashAttentionBackwardSm100:
    arch = "sm_100a"

    #: the compile-time options sm90's kernel takes that this one serves (sm90.py's meanings)
    OPTIONS = ("has_left", "has_right", "has_seqused", "varlen", "deterministic")
    has_left: bool
    has_right: bool
    has_seqused: bool
    varlen: bool
    deterministic: bool

    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int, *, stages: int = 2, **options):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        L.check_head_dim(head_dim)
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise TypeError(f"unknown options {unknown}; the sm100 backward takes {self.OPTIONS}")
        self.dtype, self.head_dim, self.stages = dtype, head_dim, stages
        for name in self.OPTIONS:
            setattr(self, name, bool(options.get(name, False)))
        self.tile_m, self.tile_n = L.TILE_M, L.TILE_N
        self.threads = 32 * (MMA_WARP + 1)
        self.tmem_columns = 512
        self.shared_storage = None

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, d)
        mK: cute.Tensor,  # (batch, seqlen_k, kv_heads, d)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # like mQ
        mLSE2: cute.Tensor,  # (batch, heads, rows) fp32: LSE log2(e), +inf where no key; rows padded
        mD: cute.Tensor,  # (batch, heads, rows) fp32: rowsum(dO * O), 0 on padded rows
        mdQacc: cute.Tensor,  # (batch, rows, heads, d) fp32, zeroed
        mdK: cute.Tensor,  # like mK
        mdV: cute.Tensor,
        mSem: cute.Tensor,  # (batch, heads, Q tiles) int32, zeroed: dQ's turns (deterministic only)
        mSeqused: cute.Tensor,  # (batch,) int32 (has_seqused only)
        mCuQ: cute.Tensor,  # (batch + 1,) int32 (varlen only)
        mCuK: cute.Tensor,
        max_seqlen_k: Int32,
        scale_log2: Float32,
        scale: Float32,
        left: Int32,
        right: Int32,
        stream: cuda.CUstream,
    ):
        # types checked; rows first, batch last; (mLSE2, mD) as (rows, heads, batch)
        seqlen_q, seqlen_k, mQ, mK, mV, mdO, mdK, mdV, mdQacc, mLSE2, mD = kernel_views(
            self.dtype, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV)
        # dK / dV rows in 16-byte stores: their strides are a contiguous tensor's (the host checks)
        mdK, mdV = with_row_vectors(mdK, ROW_VEC), with_row_vectors(mdV, ROW_VEC)

        mmas = L.BackwardMmas(self.dtype, self.head_dim)
        smem = L.SmemLayouts(self.dtype, mmas, self.stages)
        s_tiler = mmas.tilers()[0]
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        k_tile, q_tile = cute.select(smem.k, mode=[0, 1, 2]), cute.select(smem.q, mode=[0, 1, 2])
        tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_A(op, mK, k_tile, s_tiler, mmas.scores)
        tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_A(op, mV, k_tile, s_tiler, mmas.scores)
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_B(op, mQ, q_tile, s_tiler, mmas.scores)
        tma_atom_do, tma_do = cute.nvgpu.make_tiled_tma_atom_B(op, mdO, q_tile, s_tiler, mmas.scores)
        self.kv_bytes = 2 * cute.size_in_bytes(self.dtype, k_tile)
        self.q_bytes = 2 * cute.size_in_bytes(self.dtype, q_tile)
        stages, tm = self.stages, self.tile_m

        @cute.struct
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[Int64, 2]
            q_mbar: cute.struct.MemRange[Int64, 2 * stages]
            scores_mbar: cute.struct.MemRange[Int64, 2]
            probs_mbar: cute.struct.MemRange[Int64, 2]
            dq_mbar: cute.struct.MemRange[Int64, 2]
            done_mbar: cute.struct.MemRange[Int64, 2]
            tmem_base: Int32
            stats: cute.struct.MemRange[Float32, 2 * 2 * tm]  # (LSE2, D) x 64 queries x 2 slots
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(smem.k)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(smem.k)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(smem.q)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(smem.q)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(smem.ds)], 1024]

        self.shared_storage = SharedStorage

        kv_tiles = cute.ceil_div(max_seqlen_k if cutlass.const_expr(self.varlen) else seqlen_k, self.tile_n)
        batches = mCuQ.shape[0] - 1 if cutlass.const_expr(self.varlen) else mK.shape[3]
        self.kernel(
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            mLSE2, mD, mdQacc, mdK, mdV, mSem, mSeqused, mCuQ, mCuK, scale_log2, scale, left, right, seqlen_q,
            seqlen_k,
        ).launch(
            grid=(kv_tiles, mK.shape[2], batches), block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA coordinates, (seqlen, d, heads, batch)
        tma_atom_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        mLSE2: cute.Tensor,  # (rows, heads, batch)
        mD: cute.Tensor,
        mdQacc: cute.Tensor,  # (rows, d, heads, batch) fp32
        mdK: cute.Tensor,  # (seqlen_k, d, kv_heads, batch)
        mdV: cute.Tensor,
        mSem: cute.Tensor,
        mSeqused: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        scale_log2: Float32,
        scale: Float32,
        left: Int32,
        right: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx = cute.arch.thread_idx()[0]
        n_block, head_kv, batch = cute.arch.block_idx()
        group = mQ.shape[2] // mK.shape[2]
        mmas = L.BackwardMmas(self.dtype, self.head_dim)
        smem = L.SmemLayouts(self.dtype, mmas, self.stages)

        if warp_idx == TMA_WARP:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        compute = pipeline.CooperativeGroup(pipeline.Agent.Thread, COMPUTE_THREADS)
        kv_producer, kv_consumer = _pipeline(pipeline.PipelineTmaUmma, storage.kv_mbar, one, one, tx=self.kv_bytes)
        q_producer, q_consumer = _pipeline(pipeline.PipelineTmaUmma, storage.q_mbar, one, one, self.stages,
                                           tx=self.q_bytes)
        scores_producer, scores_consumer = _pipeline(pipeline.PipelineUmmaAsync, storage.scores_mbar, one, compute)
        probs_producer, probs_consumer = _pipeline(pipeline.PipelineAsyncUmma, storage.probs_mbar, compute, one)
        dq_producer, dq_consumer = _pipeline(pipeline.PipelineUmmaAsync, storage.dq_mbar, one, compute)
        done_producer, done_consumer = _pipeline(pipeline.PipelineUmmaAsync, storage.done_mbar, one, compute)
        tmem_barrier = pipeline.NamedBarrier(barrier_id=TMEM_BARRIER_ID, num_threads=COMPUTE_THREADS + 32)
        tmem = cutlass.memory.TmemAllocator(storage.tmem_base.ptr, barrier_for_retrieve=tmem_barrier,
                                            allocator_warp_id=MMA_WARP)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sK = storage.sK.get_tensor(smem.k.outer, swizzle=smem.k.inner)
        sV = storage.sV.get_tensor(smem.k.outer, swizzle=smem.k.inner)
        sQ = storage.sQ.get_tensor(smem.q.outer, swizzle=smem.q.inner)
        sdO = storage.sdO.get_tensor(smem.q.outer, swizzle=smem.q.inner)
        sdS = storage.sdS.get_tensor(smem.ds.outer, swizzle=smem.ds.inner)
        # the transposed operands: the same bytes (tests/test_f_sm100_host.py, section 1)
        sKt = cute.make_tensor(sK.iterator, smem.kt.outer)
        sQt = cute.make_tensor(sQ.iterator, smem.qt.outer)
        sdOt = cute.make_tensor(sdO.iterator, smem.qt.outer)
        sdS_rows = cute.make_tensor(sdS.iterator, smem.ds_rows.outer)
        sStats = storage.stats.get_tensor(cute.make_layout((self.tile_m, 2, 2)))  # (query, LSE2 / D, slot)

        # the batch entry's (the request's) tensors and the Q tiles this KV tile visits
        views = cta_views((mQ, mdO), (mK, mV), (mLSE2, mD, mdQacc), (mdK, mdV), n_block, head_kv, batch, group,
                          seqlen_q, seqlen_k, left, right, mSeqused, mCuQ, mCuK, self.tile_m, self.tile_n,
                          self.has_left, self.has_right, self.has_seqused, self.varlen)
        (mQ, mdO), (mK, mV), (mLSE2, mD, mdQacc), (mdK, mdV) = views[:4]
        work, k_rows = views.work, views.k_rows

        if warp_idx == TMA_WARP:
            self.load(tma_atom_q, mQ, sQ, tma_atom_do, mdO, sdO, tma_atom_k, mK, sK, tma_atom_v, mV, sV,
                      kv_producer, q_producer, work)
        if warp_idx == MMA_WARP:
            self.mma(sK, sV, sKt, sQ, sQt, sdO, sdOt, sdS, tmem, tmem_barrier, kv_consumer, q_consumer,
                     scores_producer, probs_consumer, dq_producer, done_producer, work)
        if warp_idx < COMPUTE_THREADS // 32:
            self.compute(mLSE2, mD, mdQacc, mdK, mdV, sdS_rows, sStats, tmem, tmem_barrier, scores_consumer,
                         probs_producer, dq_consumer, done_consumer, scale_log2, scale, left, right, work, k_rows,
                         tidx, mSem, batch)

    # ---- TMA warp -----------------------------------------------------------------------

    @cute.jit
    def load(self, tma_atom_q, mQ, sQ, tma_atom_do, mdO, sdO, tma_atom_k, mK, sK, tma_atom_v, mV, sV,
             kv_producer, q_producer, work: Visits):
        """K and V of the tile once, then Q and dO of each visit (one ring slot, one barrier)."""
        mmas = L.BackwardMmas(self.dtype, self.head_dim)
        thr = mmas.scores.get_slice(0)
        d = self.head_dim
        gK = cute.local_tile(mK[None, None, work.head_kv], (self.tile_n, d), (None, 0))
        gV = cute.local_tile(mV[None, None, work.head_kv], (self.tile_n, d), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                           cute.group_modes(thr.partition_A(gK), 0, 3))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                           cute.group_modes(thr.partition_A(gV), 0, 3))
        if work.visits > 0:
            stage = kv_producer.acquire_and_advance()
            cute.copy(tma_atom_k, tKgK[None, work.n_block], tKsK[None, 0], tma_bar_ptr=stage.barrier)
            cute.copy(tma_atom_v, tVgV[None, work.n_block], tVsV[None, 0], tma_bar_ptr=stage.barrier)
        for it in cutlass.range(work.visits, unroll=1):
            head, m_block = work.at(it)
            gQ = cute.local_tile(mQ[None, None, head], (self.tile_m, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head], (self.tile_m, d), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                               cute.group_modes(thr.partition_B(gQ), 0, 3))
            tOsO, tOgO = cpasync.tma_partition(tma_atom_do, 0, cute.make_layout(1), cute.group_modes(sdO, 0, 3),
                                               cute.group_modes(thr.partition_B(gdO), 0, 3))
            stage = q_producer.acquire_and_advance()
            cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, stage.index], tma_bar_ptr=stage.barrier)
            cute.copy(tma_atom_do, tOgO[None, m_block], tOsO[None, stage.index], tma_bar_ptr=stage.barrier)
        q_producer.tail()

    # ---- MMA warp -----------------------------------------------------------------------

    @cute.jit
    def mma(self, sK, sV, sKt, sQ, sQt, sdO, sdOt, sdS, tmem, tmem_barrier, kv_consumer, q_consumer,
            scores_producer, probs_consumer, dq_producer, done_producer, work: Visits):
        tmem.allocate(self.tmem_columns)
        tmem.relinquish_alloc_permit()
        tmem.wait_for_alloc()
        base = tmem.retrieve_ptr(Float32)
        mmas = L.BackwardMmas(self.dtype, self.head_dim)
        s_acc, dp_acc = L.scores_region(mmas, L.S_COL).at(base), L.scores_region(mmas, L.DP_COL).at(base)
        dv_acc, dk_acc = L.grads_region(mmas, L.DV_COL).at(base), L.grads_region(mmas, L.DK_COL).at(base)
        dq_acc = L.dq_region(mmas).at(base)
        p_op = L.probs_operand_region(self.dtype, mmas, L.S_COL).at(base)
        ds_op = L.probs_operand_region(self.dtype, mmas, L.DP_COL).at(base)
        tCrK, tCrV = mmas.scores.make_fragment_A(sK), mmas.scores.make_fragment_A(sV)
        tCrQ, tCrdO = mmas.scores.make_fragment_B(sQ), mmas.scores.make_fragment_B(sdO)
        tGrQt, tGrdOt = mmas.grads.make_fragment_B(sQt), mmas.grads.make_fragment_B(sdOt)
        tDrKt, tDrdS = mmas.dq.make_fragment_A(sKt), mmas.dq.make_fragment_B(sdS)

        if work.visits > 0:
            kv_consumer.wait_and_advance()  # K and V stay to the end: never released
        for it in cutlass.range(work.visits, unroll=1):
            # fresh tiled MMAs: the accumulate flag is a tiled MMA's state (common/sm100_qk.py)
            v = L.BackwardMmas(self.dtype, self.head_dim)
            q_stage = q_consumer.wait_and_advance()
            s = q_stage.index
            scores = scores_producer.acquire_and_advance()  # the compute threads read the last ones
            self.gemm(v.scores, s_acc, tCrK[None, None, None, 0], tCrQ[None, None, None, s], False)
            self.gemm(v.scores, dp_acc, tCrV[None, None, None, 0], tCrdO[None, None, None, s], False)
            scores.commit()
            probs = probs_consumer.wait_and_advance()
            fence_after_thread_sync()  # after the compute threads' TMEM stores the barrier reports
            self.gemm(v.grads, dv_acc, p_op, tGrdOt[None, None, None, s], it > 0)
            self.gemm(v.grads, dk_acc, ds_op, tGrQt[None, None, None, s], it > 0)  # (gemm sets the flag first)
            dq = dq_producer.acquire_and_advance()  # the compute threads read the last dQ^T
            self.gemm(v.dq, dq_acc, tDrKt[None, None, None, 0], tDrdS[None, None, None, 0], False)
            dq.commit()
            probs.release()  # sdS read: the next visit's dS^T may land
            q_stage.release()  # Q and dO read by dK, dV
        if work.visits > 0:
            done = done_producer.acquire_and_advance()
            done.commit()  # dK, dV final once every MMA above has completed
        tmem_barrier.arrive_and_wait()  # the compute threads' last TMEM access
        fence_after_thread_sync()
        tmem.free(base, self.tmem_columns)

    @cute.jit
    def gemm(self, tiled_mma, acc, a, b, accumulate):
        """acc (+)= a b over the k-phases (mode 2 of both operands); ``accumulate`` False: the first
        phase overwrites acc."""
        tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
        for kp in cutlass.range_constexpr(cute.size(a, mode=[2])):
            cute.gemm(tiled_mma, acc, a[None, None, kp], b[None, None, kp], acc)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)

    # ---- compute warps --------------------------------------------------------------------

    @cute.jit
    def compute(self, mLSE2, mD, mdQacc, mdK, mdV, sdS_rows, sStats, tmem, tmem_barrier, scores_consumer,
                probs_producer, dq_consumer, done_consumer, scale_log2, scale, left, right, work: Visits, k_rows,
                tidx, mSem, batch):
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        seqlen_q, seqlen_k = work.seqlen_q, work.seqlen_k
        tmem.wait_for_alloc()
        base = tmem.retrieve_ptr(Float32)
        mmas = L.BackwardMmas(self.dtype, self.head_dim)
        # key t's row of S^T and dP^T: (registers, ..., chunks), their (key, query); dQ^T's row t
        s_load, s_chunks = make_acc_tmem_load(L.scores_region(mmas, L.S_COL).at(base), EPI_COLS)
        dp_load, dp_chunks = make_acc_tmem_load(L.scores_region(mmas, L.DP_COL).at(base), EPI_COLS)
        dq_load, dq_chunks = make_acc_tmem_load(L.dq_region(mmas).at(base), EPI_COLS)
        thr_s, thr_dp, thr_dq = s_load.get_slice(tidx), dp_load.get_slice(tidx), dq_load.get_slice(tidx)
        tS = thr_s.partition_S(s_chunks)
        tdP = thr_dp.partition_S(dp_chunks)
        tdQ = thr_dq.partition_S(dq_chunks)
        cS = thr_s.partition_D(epi_view(cute.make_identity_tensor((tn, tm)), EPI_COLS))  # (key, query)
        cdQ = thr_dq.partition_D(epi_view(cute.make_identity_tensor((d, tm)), EPI_COLS))  # (dim, query)
        rS = cute.make_rmem_tensor(cS.shape, Float32)
        rdP = cute.make_rmem_tensor(cS.shape, Float32)
        rdQ = cute.make_rmem_tensor(cdQ.shape, Float32)
        # P^T and dS^T, 16-bit, over the scores' upper halves (value v of the store = value v of rS)
        p_chunks = L.probs_store_region(self.dtype, L.S_COL).at(base)
        ds_chunks = L.probs_store_region(self.dtype, L.DP_COL).at(base)
        p_store = L.make_probs_store(p_chunks)
        thr_p = p_store.get_slice(tidx)
        tP, tdS = thr_p.partition_D(p_chunks), thr_p.partition_D(ds_chunks)
        probs_ids = L.probs_chunk_view(cute.make_identity_tensor((tn, tm)), self.dtype)
        rP = cute.make_rmem_tensor(thr_p.partition_S(probs_ids).shape, self.dtype)
        rdS = cute.make_rmem_tensor(rP.shape, self.dtype)
        p_vals = cute.make_tensor(rP.iterator, cute.make_layout(rS.shape))
        ds_vals = cute.make_tensor(rdS.iterator, cute.make_layout(rS.shape))
        n_chunks = cute.size(tS, mode=[4])

        key = work.n_block * tn + cS[0][0]  # this thread's key (t: proven for stage B's loads)
        offset = seqlen_k - seqlen_q
        for it in cutlass.range(work.visits, unroll=1):
            head, m_block = work.at(it)
            q0 = m_block * tm
            slot = it % 2
            # the visit's LSE2 and D: staged once for all 128 threads (rows padded: always in range)
            if tidx < tm:
                sStats[tidx, 0, slot] = mLSE2[q0 + tidx, head]
            else:
                sStats[tidx - tm, 1, slot] = mD[q0 + tidx - tm, head]
            cute.arch.barrier(barrier_id=STATS_BARRIER_ID, number_of_threads=COMPUTE_THREADS)
            q_first, q_last = key_queries(key, q0 + offset, seqlen_k, left, right, self.has_left, self.has_right,
                                          tm)
            scores = scores_consumer.wait_and_advance()
            fence_after_thread_sync()
            # a chunk of EPI_COLS queries at a time: S^T, dP^T, their statistics and the products
            # of one chunk live together (the whole row at once spilled with the masks)
            for c in cutlass.range_constexpr(n_chunks):
                cute.copy(s_load, tS[None, None, None, 0, c], rS[None, None, None, 0, c])
                cute.copy(dp_load, tdP[None, None, None, 0, c], rdP[None, None, None, 0, c])
                cute.arch.fence_view_async_tmem_load()
                self.probabilities(rS[None, None, None, 0, c], rdP[None, None, None, 0, c],
                                   cS[None, None, None, 0, c], p_vals[None, None, None, 0, c],
                                   ds_vals[None, None, None, 0, c], sStats, slot, q_first, q_last, scale_log2)
            # sdS is free once the previous dQ^T has read it; then P^T, dS^T to TMEM, dS^T to sdS
            probs = probs_producer.acquire_and_advance()
            for c in cutlass.range_constexpr(cute.size(tP, mode=[4])):
                cute.copy(p_store, rP[None, None, None, 0, c], tP[None, None, None, 0, c])
                cute.copy(p_store, rdS[None, None, None, 0, c], tdS[None, None, None, 0, c])
            # key t's row of sdS: its 64 queries in order (the registers' order: proven on the host),
            # 128 contiguous bytes, stored 16 bytes at a time (a value at a time spilled: 64 swizzled
            # addresses live at once)
            cute.autovec_copy(cute.make_tensor(rdS.iterator, cute.make_layout(tm)), sdS_rows[cS[0][0], None])
            cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st
            cute.arch.fence_proxy("async.shared", space="cta")  # sdS's stores -> the MMA's reads
            fence_before_thread_sync()
            probs.commit()
            scores.release()
            # dQ^T: thread t holds dQ's column t over the visit's queries -> the fp32 accumulator,
            # a chunk of EPI_COLS queries at a time
            dq = dq_consumer.wait_and_advance()
            fence_after_thread_sync()
            gdQ = mdQacc[None, None, head]  # (rows, d)
            if cutlass.const_expr(self.deterministic):
                turns = mSem[batch, head, None].iterator + m_block
                wait_turn(turns, work, m_block, left, tidx, self.tile_n, self.tile_m, self.has_left, TURN_BARRIER_ID,
                          COMPUTE_THREADS)
            for c in cutlass.range_constexpr(cute.size(tdQ, mode=[4])):
                cute.copy(dq_load, tdQ[None, None, None, 0, c], rdQ[None, None, None, 0, c])
                cute.arch.fence_view_async_tmem_load()
                if cutlass.const_expr(c == cute.size(tdQ, mode=[4]) - 1):
                    fence_before_thread_sync()
                    dq.release()  # the last chunk read: the next dQ^T may land
                # value i of the chunk is query c EPI_COLS + i of dim t (proven on the host): one
                # pointer stepped a row at a time (64 addresses computed up front spilled)
                r_c = rdQ[None, None, None, 0, c]
                j, q = cdQ[None, None, None, 0, c][0]
                ptr = gdQ.iterator + cute.crd2idx((q0 + q, j), gdQ.layout)
                for i in cutlass.range_constexpr(cute.size(r_c)):
                    cute.arch.red(ptr, r_c[i] * scale, op="add", dtype="f32", sem="relaxed", scope="gpu")
                    ptr = ptr + gdQ.layout.stride[0]

            if cutlass.const_expr(self.deterministic):
                pass_turn(turns, tidx, TURN_BARRIER_ID, COMPUTE_THREADS)

        # ---- epilogue: key t's rows of dK (scaled) and dV, or zeros without a visit -----------
        self.store_rows(mdK, L.grads_region(mmas, L.DK_COL).at(base), scale, done_consumer, work, k_rows, tidx,
                        first=True)
        self.store_rows(mdV, L.grads_region(mmas, L.DV_COL).at(base), Float32(1.0), done_consumer, work, k_rows,
                        tidx, first=False)
        tmem_barrier.arrive()

    @cute.jit
    def probabilities(self, rS, rdP, cS, p_vals, ds_vals, sStats, slot, q_first, q_last, scale_log2):
        """One chunk of key t's row: P^T = exp2(S^T scale log2 e - LSE2), 0 for a query outside
        [q_first, q_last] (``span.key_queries``: the forward's rule for this key; padded queries
        have LSE2 = +inf), and dS^T = P^T (dP^T - D), both rounded to 16 bits."""
        for i in cutlass.range_constexpr(cute.size(rS)):
            q = cS[i][1]
            p = cute.math.exp2(rS[i] * scale_log2 - sStats[q, 0, slot], fastmath=True)
            p = Float32(0.0) if (q < q_first) | (q > q_last) else p
            p_vals[i] = p.to(self.dtype)
            ds_vals[i] = (p * (rdP[i] - sStats[q, 1, slot])).to(self.dtype)

    @cute.jit
    def store_rows(self, mOut, acc, factor, done_consumer, work: Visits, k_rows, tidx, first: cutlass.Constexpr):
        """Key t's row of a dK / dV accumulator, times ``factor``, to ``mOut`` a chunk of EPI_COLS
        columns at a time (rows past the tile's keys clipped); zeros where the tile had no visit
        (nothing was accumulated)."""
        load, chunks = make_acc_tmem_load(acc, EPI_COLS)
        thr = load.get_slice(tidx)
        tA = thr.partition_S(chunks)
        cA = thr.partition_D(epi_view(cute.make_identity_tensor((self.tile_n, self.head_dim)), EPI_COLS))
        rA = cute.make_rmem_tensor(cA[None, None, None, 0, 0].shape, Float32)
        out = cute.make_rmem_tensor(rA.shape, self.dtype)
        visited = work.visits > 0
        if cutlass.const_expr(first):
            if visited:
                done_consumer.wait_and_advance()
                fence_after_thread_sync()
        row = work.n_block * self.tile_n + cA[0][0]
        gRow = mOut[row, None, work.head_kv]  # (d,)
        for c in cutlass.range_constexpr(cute.size(tA, mode=[4])):
            rA.fill(0.0)
            if visited:
                cute.copy(load, tA[None, None, None, 0, c], rA)
                cute.arch.fence_view_async_tmem_load()
            for i in cutlass.range_constexpr(cute.size(rA)):
                out[i] = (rA[i] * factor).to(self.dtype)
            if row < k_rows:  # register i of chunk c is column c EPI_COLS + i (proven on the host)
                cute.autovec_copy(out, cute.local_tile(gRow, (EPI_COLS,), (c,)))
