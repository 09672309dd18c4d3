"""Stage A on Blackwell (SM100, sm_100a): the scaled QK^T score tile through tcgen05 and TMEM.

What it computes
----------------
    S[b, h, i, j] = softmax_scale * sum_d Q[b, i, h, d] * K[b, j, hk, d],   hk = h // (heads // kv_heads)

Q (batch, seqlen_q, heads, head_dim) and K (batch, seqlen_k, kv_heads, head_dim) are bf16 or
fp16 with head_dim contiguous; S (batch, heads, seqlen_q, seqlen_k) is fp32, contiguous,
allocated by the caller. head_dim is fixed per instance (64, 128, 256 or 512); batch, heads,
kv_heads and both sequence lengths are dynamic. One CTA computes one 128 x 128 tile of S:

    grid = (ceil(seqlen_q / 128), ceil(seqlen_k / 128), heads * batch),   blockIdx.z = b * heads + h

Warp roles (192 threads, one tile per CTA)
------------------------------------------
    warps 0-3  epilogue: TMEM -> registers (tcgen05.ld 32x32b), * softmax_scale, predicated
               stores to S. Thread t (0..127) owns row t of the tile.
    warp  4    MMA: allocates TMEM, issues tcgen05.mma (the DSL elects one thread), frees TMEM.
    warp  5    TMA: loads the Q and K k-blocks of the tile.

Pipeline and barriers
---------------------
The head dim is consumed in k-blocks of 64 elements (128 bytes, one 128B-swizzle atom wide):
num_kb = head_dim / 64 blocks through STAGES = min(num_kb, 4) SMEM stages.

    ab   (PipelineTmaUmma, STAGES x {full, empty} mbarriers)
         TMA warp: wait empty[s], arrive full[s] expecting the Q+K bytes of a stage, issue the two
         TMA loads of k-block kb onto full[s]. TMA fills out-of-range rows with zeros (tails in
         seqlen_q / seqlen_k) and still counts the whole box, so the byte count is fixed.
         MMA warp: wait full[s], 4 MMAs (K = 16 each), tcgen05.commit -> empty[s] frees the stage
         once those MMAs have read it. The TMA warp ends with producer_tail (waits for every
         stage's last release) so no commit lands on a barrier of an exited CTA.
    acc  (PipelineUmmaAsync, 1 stage): after the last k-block the MMA warp's tcgen05.commit
         arrives on acc.full when all MMAs are done; the 128 epilogue threads wait on it.
         One tile per CTA: nobody waits on acc.empty, so the epilogue never releases it.
    named barrier 1 (160 threads: warps 0-4), used twice by TmemAllocator's protocol:
         1. alloc: warp 4 runs tcgen05.alloc (address -> SMEM word) and relinquishes the permit;
            all 160 threads sync, then read the base address.
         2. dealloc: epilogue threads finish their loads (tcgen05.wait::ld), fence, arrive;
            warp 4 syncs, fences, tcgen05.dealloc.
The MMA accumulate flag is off for the first MMA of k-block 0 (zero-initialises the
accumulator) and on for every later one.

TMEM layout
-----------
    S accumulator: 128 lanes x 128 fp32 columns at column 0 of a 128-column allocation;
    CuTe layout ((128,128),1,1):((65536,1),0,0), i.e. S(m, n) at lane m, column n.
The epilogue reads it in 4 chunks of 32 columns (tcgen05.ld.32x32b.x32: 32 registers per
thread); warp w reads lanes 32w..32w+31, so thread t receives row t, columns 32c..32c+31.
That property is proven on the host for these exact builders (common/tmem.py) by
tests/test_a_sm100_tmem_rows.py.

SMEM layout (per stage, Q and K alike)
--------------------------------------
    128 rows x 64 elements, K-major, 128B swizzle (atom 8 rows x 128 B, Swizzle<3,4,3>):
    S<3,4,3> o 0 o ((128,16),1,4,STAGES):((64,1),0,16,8192)  -> 16 KiB per operand per stage,
    each buffer 1024-byte aligned. SMEM = STAGES * 32 KiB + barriers (128 KiB at head_dim 512).

Epilogue stores
---------------
No TMA store: S rows are seqlen_k * 4 bytes apart, not 16-byte aligned in general. Each thread
writes its own row. When every S stride and seqlen_k are multiples of 4 (and the base is
16-byte aligned) the row is written in 16-byte vectors, each predicated on (row < seqlen_q,
col < seqlen_k) (a group of 4 columns is then all in or all out); otherwise element by element
under the same predicate. Nothing outside S is ever written.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from dsv4_attention.common.layouts import scores_major, seq_major
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
    QK_TILE_M,
    QK_TILE_N,
    acc_tmem_columns,
    epi_view,
    fence_after_thread_sync,
    fence_before_thread_sync,
    make_acc_fragment,
    make_acc_tmem_load,
    make_qk_tiled_mma,
)

MAX_STAGES = 4
VEC = 4  # fp32 per 16-byte store


class QKGemmSm100:
    """S = softmax_scale * Q K^T per (batch, head), fp32 out, on SM100 (tcgen05 + TMEM)."""

    arch = "sm_100a"

    def __init__(self, dtype, head_dim: int):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"QKGemmSm100: dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in (64, 128, 256, 512):
            raise ValueError(f"QKGemmSm100: head_dim must be 64, 128, 256 or 512, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.mma_tiler = QK_MMA_TILER  # (128, 128, K_BLOCK): one head-dim k-block per stage
        self.num_k_blocks = head_dim // K_BLOCK
        self.num_stages = min(self.num_k_blocks, MAX_STAGES)

        self.epi_warps = (0, 1, 2, 3)  # w % 4 == w: warp w reaches TMEM lanes 32w..32w+31
        self.mma_warp = 4
        self.tma_warp = 5
        self.threads_per_cta = 32 * 6
        self.tmem_barrier_id = 1  # 0 is __syncthreads
        self.tmem_barrier_threads = 32 * (len(self.epi_warps) + 1)

        # set when __call__ is traced
        self.shared_storage = None
        self.tmem_columns = None

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mS: cute.Tensor,
        softmax_scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError(f"Q and K must be {self.dtype}, got {mQ.element_type}, {mK.element_type}")
        if const_expr(mS.element_type != Float32):
            raise TypeError(f"S must be Float32, got {mS.element_type}")

        # (seqlen, head_dim, heads, batch) and (seqlen_q, seqlen_k, heads, batch)
        q = seq_major(mQ)
        k = seq_major(mK)
        s = scores_major(mS)

        tiled_mma = make_qk_tiled_mma(self.dtype, self.mma_tiler[:2])
        q_smem_staged, k_smem_staged = make_qk_smem_layouts(tiled_mma, self.dtype, self.num_stages)
        # bytes one stage receives; TMA counts full boxes even where it zero-fills
        tma_atom_q, tma_q, tma_atom_k, tma_k, self.tma_stage_bytes = make_qk_tma_atoms(
            tiled_mma, q, k, q_smem_staged, k_smem_staged, self.dtype
        )

        self.tmem_columns = acc_tmem_columns(make_acc_fragment(tiled_mma, self.mma_tiler[:2]))

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[Int64, self.num_stages * 2]
            acc_mbar: cute.struct.MemRange[Int64, 2]
            tmem_base: Int32
            # 1024-byte alignment: the 128B-swizzle pattern repeats every 8 rows x 128 B
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_smem_staged)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_smem_staged)], 1024]

        self.shared_storage = SharedStorage

        grid = (
            cute.ceil_div(s.shape[0], QK_TILE_M),
            cute.ceil_div(s.shape[1], QK_TILE_N),
            s.shape[2] * s.shape[3],
        )
        self.kernel(
            tiled_mma,
            tma_atom_q,
            tma_q,
            tma_atom_k,
            tma_k,
            s,
            softmax_scale,
            q_smem_staged,
            k_smem_staged,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA view (seqlen_q, head_dim, heads, batch)
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,  # TMA view (seqlen_k, head_dim, kv_heads, batch)
        mS: cute.Tensor,  # (seqlen_q, seqlen_k, heads, batch) fp32
        softmax_scale: Float32,
        q_smem_staged: cute.ComposedLayout,
        k_smem_staged: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        m_blk, n_blk, hb = cute.arch.block_idx()

        heads = mS.shape[2]
        h = hb % heads
        b = hb // heads
        hk = h // (heads // mK.shape[2])  # GQA: `heads // kv_heads` query heads share one K head

        if warp_idx == self.tma_warp:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # barriers: warp 0 initialises them all; one fence + __syncthreads below publishes them
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            tx_count=self.tma_stage_bytes,
            barrier_storage=storage.ab_mbar.data_ptr(),
            defer_sync=True,
        ).make_participants()
        acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPI_THREADS),
            barrier_storage=storage.acc_mbar.data_ptr(),
            defer_sync=True,
        ).make_participants()
        tmem_barrier = pipeline.NamedBarrier(
            barrier_id=self.tmem_barrier_id, num_threads=self.tmem_barrier_threads
        )
        tmem = utils.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=tmem_barrier,
            allocator_warp_id=self.mma_warp,
        )
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        # (MMA, MMA_M, MMA_K, STAGE)
        sQ = storage.sQ.get_tensor(q_smem_staged.outer, swizzle=q_smem_staged.inner)
        sK = storage.sK.get_tensor(k_smem_staged.outer, swizzle=k_smem_staged.inner)
        # (MMA, 1, 1): the accumulator layout, rebased on the allocated TMEM below
        acc_layout = make_acc_fragment(tiled_mma, self.mma_tiler[:2]).layout

        # ///////////////////////////////////////////////////////////////////////////
        #  TMA warp: k-block kb of Q's row tile m_blk and of K's row tile n_blk
        # ///////////////////////////////////////////////////////////////////////////
        if warp_idx == self.tma_warp:
            # (128, 64, KB): the tile's rows, cut along head_dim into k-blocks
            gQ = cute.local_tile(
                mQ[None, None, h, b], cute.select(self.mma_tiler, mode=[0, 2]), (m_blk, None)
            )
            gK = cute.local_tile(
                mK[None, None, hk, b], cute.select(self.mma_tiler, mode=[1, 2]), (n_blk, None)
            )
            ab_producer = load_qk_kblocks(
                tiled_mma, tma_atom_q, gQ, sQ, tma_atom_k, gK, sK, ab_producer, self.num_k_blocks
            )
            ab_producer.tail()

        # ///////////////////////////////////////////////////////////////////////////
        #  MMA warp: TMEM owner and tcgen05.mma issuer
        # ///////////////////////////////////////////////////////////////////////////
        if warp_idx == self.mma_warp:
            tmem.allocate(self.tmem_columns)
            tmem.relinquish_alloc_permit()  # one allocation per CTA: let co-resident CTAs allocate
            tmem.wait_for_alloc()
            tStS = cute.make_tensor(tmem.retrieve_ptr(Float32), acc_layout)

            acc_slot = acc_producer.acquire_and_advance()  # single tile: the slot is free
            # stages are released (tcgen05.commit -> empty[s]): the ring wraps at head_dim 512
            ab_consumer = issue_qk_mmas(tiled_mma, tStS, sQ, sK, ab_consumer, self.num_k_blocks, True)
            acc_slot.commit()  # tcgen05.commit -> acc.full once every MMA has landed in TMEM

            # dealloc only after the epilogue's last tcgen05.ld
            tmem_barrier.arrive_and_wait()
            fence_after_thread_sync()
            tmem.free(tStS.iterator, self.tmem_columns)

        # ///////////////////////////////////////////////////////////////////////////
        #  Epilogue warps 0-3: thread t owns row t of the tile
        # ///////////////////////////////////////////////////////////////////////////
        if warp_idx < self.mma_warp:
            tmem.wait_for_alloc()
            tStS = cute.make_tensor(tmem.retrieve_ptr(Float32), acc_layout)

            tiled_t2r, tS_epi = make_acc_tmem_load(tStS, EPI_COLS)
            thr_t2r = tiled_t2r.get_slice(tidx)
            # (T2R, T2R_M, T2R_N, 1, CHUNKS): what tcgen05.ld reads ...
            tTR_tS = thr_t2r.partition_S(tS_epi)
            # ... and where each register goes in S (same partition of the same chunking)
            gS = cute.local_tile(mS[None, None, h, b], (QK_TILE_M, QK_TILE_N), (m_blk, n_blk))
            tTR_gS = thr_t2r.partition_D(epi_view(gS, EPI_COLS))
            tTR_cS = thr_t2r.partition_D(
                epi_view(cute.make_identity_tensor((QK_TILE_M, QK_TILE_N)), EPI_COLS)
            )
            tTR_rS = cute.make_rmem_tensor(tTR_gS[None, None, None, 0, 0].shape, Float32)
            num_chunks = cute.size(tTR_tS, mode=[4])

            rows_left = mS.shape[0] - m_blk * QK_TILE_M
            cols_left = mS.shape[1] - n_blk * QK_TILE_N
            # 16-byte stores need 16-byte aligned row starts: base (compile time) and every
            # stride in elements (runtime); seqlen_k % 4 == 0 makes 4-column groups all-in/all-out
            vec_ok = cutlass.Boolean(False)
            if const_expr(mS.iterator.alignment >= VEC * 4):
                vec_ok = (
                    (mS.shape[1] % VEC == 0)
                    & (mS.stride[0] % VEC == 0)
                    & (mS.stride[2] % VEC == 0)
                    & (mS.stride[3] % VEC == 0)
                )
            vec_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=VEC * 32)

            acc_consumer.wait_and_advance()
            fence_after_thread_sync()  # order the loads after the MMAs that acc.full reports

            for c in cutlass.range(num_chunks, unroll=1):
                cute.copy(tiled_t2r, tTR_tS[None, None, None, 0, c], tTR_rS)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are read
                tTR_rS.store(tTR_rS.load() * softmax_scale)

                cS_c = tTR_cS[None, None, None, 0, c]
                gS_c = tTR_gS[None, None, None, 0, c]
                if cS_c[0][0] < rows_left:  # the thread's row (all its values share it)
                    if vec_ok:
                        # same partition of S, with the strides' divisibility (checked) made
                        # known, so that the compiler can prove each 4-column group 16B-aligned
                        mS_vec = cute.make_tensor(
                            mS.iterator,
                            cute.make_layout(
                                mS.shape,
                                stride=(
                                    cute.assume(mS.stride[0], divby=VEC),
                                    mS.stride[1],
                                    cute.assume(mS.stride[2], divby=VEC),
                                    cute.assume(mS.stride[3], divby=VEC),
                                ),
                            ),
                        )
                        gS_vec = cute.local_tile(
                            mS_vec[None, None, h, b], (QK_TILE_M, QK_TILE_N), (m_blk, n_blk)
                        )
                        g_vec = thr_t2r.partition_D(epi_view(gS_vec, EPI_COLS))[None, None, None, 0, c]
                        r_grp = cute.zipped_divide(cute.coalesce(tTR_rS), (VEC,))
                        g_grp = cute.zipped_divide(cute.coalesce(g_vec), (VEC,))
                        c_grp = cute.zipped_divide(cute.coalesce(cS_c), (VEC,))
                        for v in cutlass.range_constexpr(cute.size(r_grp, mode=[1])):
                            if c_grp[0, v][1] < cols_left:
                                cute.copy(vec_atom, r_grp[None, v], g_grp[None, v])
                    else:
                        for v in cutlass.range_constexpr(cute.size(tTR_rS)):
                            if cS_c[v][1] < cols_left:
                                gS_c[v] = tTR_rS[v]

            fence_before_thread_sync()  # every load has completed (waited above); publish that
            tmem_barrier.arrive()
