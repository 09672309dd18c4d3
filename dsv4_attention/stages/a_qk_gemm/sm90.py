"""Stage A on Hopper (SM90): the scaled score matrix S = scale * Q K^T.

    S[b, h, i, j] = scale * sum_d Q[b, i, h, d] * K[b, j, hk, d],   hk = h // (H / H_kv)

Q and K are bf16 or fp16 in the FlashAttention layout (batch, seqlen, heads,
head_dim) with head_dim contiguous; S is fp32 (batch, heads, seqlen_q, seqlen_k)
with seqlen_k contiguous. head_dim (64/128/256/512) is fixed at construction;
batch, heads, kv_heads and both sequence lengths are runtime values, so one
compile serves every shape and every GQA ratio.

Work decomposition
    grid  = (ceil(seqlen_q / 128), ceil(seqlen_k / 128), heads * batch)
    block = 256 threads = 2 MMA warpgroups. Each CTA computes one 128 x 128
    tile of S for one (head, batch); warpgroup w owns rows [64 w, 64 w + 64).
    Warp 0 also issues the TMA loads (as in CUTLASS's Hopper dense GEMM): with
    at most 8 k-blocks there is too little to overlap to pay for a separate
    producer warpgroup and setmaxnreg.

Mainloop (a multi-stage TMA -> wgmma pipeline over the head dim)
    The head dim is cut into k-blocks of 64 elements (128-byte rows, so the
    128B swizzle applies). Stage s of the SMEM ring holds one k-block of the Q
    tile and of the K tile (2 x 16 KiB) and has a "full" mbarrier (TMA
    transaction count, 32 KiB) and an "empty" mbarrier (one arrive per MMA
    warp, 8) -- cutlass.pipeline.PipelineTmaAsync.
    stages = min(head_dim / 64, 4): hd 64/128/256 load the whole head dim up
    front, hd 512 (8 k-blocks) refills each stage once. Per k-block each
    warpgroup issues 4 wgmma 64x128x16 (A = Q, B = K, both K-major from SMEM),
    commits them as one group and waits for the *previous* group only, so the
    wgmma pipe need not drain between k-blocks; the previous k-block's stage
    is then released and warp 0 refills it with k-block (k - 1 + stages).

Layouts
    sQ, sK : (rows, 64 head-dim, stages) of 16-bit elements, K-major, 128B swizzle:
               S<3,4,3> o ((8,16),(64,1),(1,stages)):((64,512),(1,0),(0,8192))
             row r, col c -> element (r%8)*64 + (r/8)*512 + c, 16 KiB per stage;
             the swizzle acts on byte addresses (XORs the 16-byte chunk, bits
             4-6, with the row within the 1 KiB atom, bits 7-9), which is the
             pattern both TMA (SWIZZLE_128B) and the wgmma descriptors expect.
    gmem   : Q, K viewed as (seqlen, head_dim, heads, batch) (common.layouts);
             TMA box (128 rows, 64 head-dim) at (tile, k-block) of (head, batch);
             rows past seqlen are zero-filled by TMA.
    acc    : per thread ((2, 2, 16), 1, 1) fp32 (the tiled MMA's C layout
             ((4,8,4),(2,2,16)):((128,1,16),(64,8,512)) per warpgroup):
             value (c, r, n) of thread t (w = t%128 / 32, l = t%32) is
               S[64 (t/128) + 16 w + l/4 + 8 r,  8 n + 2 (l%4) + c]
             i.e. every thread holds pairs of adjacent columns.

Epilogue
    Accumulators are scaled in fp32 and stored straight from registers to
    global memory (no TMA store: rows of S need not be 16-byte aligned when
    seqlen_k is arbitrary). Every store is predicated on
    (row < seqlen_q, col < seqlen_k), with the coordinates taken from an
    identity tensor partitioned exactly like the accumulator. When all strides
    of S are even, each column pair is one 8-byte store; otherwise 4-byte
    stores.
"""


import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from dsv4_attention.common.layouts import scores_major, seq_major
from dsv4_attention.common.sm90_gemm import (  # noqa: F401 - TILE_K, NUM_MMA_WARPGROUPS: part of this module's surface
    NUM_MMA_WARPGROUPS,
    NUM_THREADS,
    THREADS_PER_WARPGROUP,
    TILE_K,
    TILE_M,
    TILE_N,
    make_smem_layouts,
    make_tiled_mma,
    make_tma_load,
    num_k_blocks,
)

MAX_STAGES = 4  # 4 x 32 KiB of SMEM
SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)


def num_stages(head_dim: int, max_stages: int = MAX_STAGES) -> int:
    stages = min(num_k_blocks(head_dim), max_stages)
    # A stage is released one k-block late (see the mainloop), so a ring that
    # must be refilled needs at least 2 stages or the refill would wait on
    # itself.
    if stages < num_k_blocks(head_dim) and stages < 2:
        raise ValueError("a refilled pipeline needs at least 2 stages")
    return stages


class QKGemmSm90:
    arch = "sm_90a"

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        *,
        max_stages: int = MAX_STAGES,
    ):
        """max_stages is a tuning knob only (e.g. 3 lets two hd-256 CTAs share
        an SM); the default follows the design."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        self.dtype = dtype
        self.acc_dtype = cutlass.Float32
        self.head_dim = head_dim
        self.k_blocks = num_k_blocks(head_dim)
        self.stages = num_stages(head_dim, max_stages)
        self.shared_storage = None  # set when __call__ is traced

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mS: cute.Tensor,
        softmax_scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr(
            mQ.element_type != self.dtype or mK.element_type != self.dtype
        ):
            raise TypeError(f"Q and K must be {self.dtype}")
        if cutlass.const_expr(mS.element_type != self.acc_dtype):
            raise TypeError("S must be Float32")

        # (seqlen, head_dim, heads, batch) and (seqlen_q, seqlen_k, heads, batch)
        mQ = seq_major(mQ)
        mK = seq_major(mK)
        mS = scores_major(mS)

        tiled_mma = make_tiled_mma(self.dtype)
        sQ_layout, sK_layout = make_smem_layouts(self.dtype, self.stages)
        tma_atom_q, tma_q = make_tma_load(mQ, sQ_layout, TILE_M)
        tma_atom_k, tma_k = make_tma_load(mK, sK_layout, TILE_N)

        @cute.struct
        class SharedStorage:
            # full[stages] then empty[stages]
            pipeline_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            # 1024 B alignment: the 128B swizzle pattern repeats every 8 rows
            # (1 KiB) and wgmma descriptors assume atoms start on it.
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024
            ]

        self.shared_storage = SharedStorage

        grid = (
            cute.ceil_div(mS.shape[0], TILE_M),
            cute.ceil_div(mS.shape[1], TILE_N),
            mS.shape[2] * mS.shape[3],
        )
        self.kernel(
            tiled_mma,
            tma_atom_q,
            tma_q,
            tma_atom_k,
            tma_k,
            mS,
            softmax_scale,
            sQ_layout,
            sK_layout,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA coordinate tensor (seqlen_q, head_dim, heads, batch)
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,  # TMA coordinate tensor (seqlen_k, head_dim, kv_heads, batch)
        mS: cute.Tensor,  # (seqlen_q, seqlen_k, heads, batch)
        softmax_scale: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_block, n_block, head_batch = cute.arch.block_idx()

        # grid z enumerates (head, batch) head-fastest, over S's extents (so
        # no CTA maps outside S). GQA maps query head h to kv head
        # h // (heads / kv_heads), with the ratio taken at runtime.
        num_heads = mS.shape[2]
        head = head_batch % num_heads
        batch = head_batch // num_heads
        head_kv = head // (mQ.shape[2] // mK.shape[2])

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # Producer: warp 0's elected thread (arrive + expect_tx, then TMA).
        # Consumer: one arrive per MMA warp (PipelineTmaAsync signals from lane 0).
        # create() initialises the mbarriers and syncs the CTA.
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, NUM_THREADS // cute.arch.WARP_SIZE
            ),
            tx_count=cute.size_in_bytes(
                self.dtype, cute.slice_(sQ_layout, (None, None, 0))
            )
            + cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0))),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)

        # (TILE, TILE_K, k_blocks): k-block k of this CTA's Q / K rows.
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, TILE_K), (m_block, None))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, TILE_K), (n_block, None))
        # tQsQ: (TMA, stages), tQgQ: (TMA, k_blocks)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1),
            cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2),
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1),
            cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2),
        )

        # wgmma operands are per warpgroup: slice the tiled MMA by the
        # warpgroup's first thread. (MMA, MMA_M|N, MMA_K = 4, stages)
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        wg_mma = tiled_mma.get_slice(warpgroup_idx * THREADS_PER_WARPGROUP)
        tCrQ = tiled_mma.make_fragment_A(wg_mma.partition_A(sQ))
        tCrK = tiled_mma.make_fragment_B(wg_mma.partition_B(sK))
        mma_k_steps = cute.size(tCrQ, mode=[2])

        # The accumulator is per thread: ((2, 2, 16), 1, 1) fp32.
        thr_mma = tiled_mma.get_slice(tidx)
        acc = thr_mma.make_fragment_C(thr_mma.partition_shape_C((TILE_M, TILE_N)))
        # Zero once and always accumulate: no per-k-block ACCUMULATE toggling
        # inside the runtime loop.
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        # ---------------------------------------------------------------
        # Prologue: warp 0 fills the whole ring (k-blocks 0 .. stages-1).
        # ---------------------------------------------------------------
        producer_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.stages
        )
        if warp_idx == 0:
            for _ in cutlass.range(self.stages, unroll=1):
                self.load_k_block(
                    mainloop, producer_state,
                    tma_atom_q, tQgQ, tQsQ, tma_atom_k, tKgK, tKsK,
                )
                producer_state.advance()

        # ---------------------------------------------------------------
        # Mainloop over the k-blocks of the head dim.
        # ---------------------------------------------------------------
        read_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.stages
        )
        release_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.stages
        )
        for k_block in cutlass.range(self.k_blocks, unroll=1):
            mainloop.consumer_wait(read_state)
            # Orders the accumulator writes (zero fill / previous wgmmas)
            # before the wgmmas read them.
            warpgroup.fence()
            for k in cutlass.range_constexpr(mma_k_steps):
                cute.gemm(
                    tiled_mma,
                    acc,
                    tCrQ[None, None, k, read_state.index],
                    tCrK[None, None, k, read_state.index],
                    acc,
                )
            warpgroup.commit_group()
            # Keep this k-block's wgmmas in flight; the previous k-block's
            # group is complete after this, so its stage can be released.
            warpgroup.wait_group(1)
            read_state.advance()
            if k_block > 0:
                mainloop.consumer_release(release_state)
                release_state.advance()
                # Refill the stage just released with k-block
                # (k_block - 1 + stages); only hd 512 has more k-blocks than
                # stages. It comes after this warp's own release because
                # warp 0 waits on that stage's empty barrier, which needs an
                # arrive from every MMA warp, itself included.
                if cutlass.const_expr(self.k_blocks > self.stages):
                    if warp_idx == 0 and producer_state.count < self.k_blocks:
                        self.load_k_block(
                            mainloop, producer_state,
                            tma_atom_q, tQgQ, tQsQ, tma_atom_k, tKgK, tKsK,
                        )
                        producer_state.advance()
        warpgroup.wait_group(0)
        # The last stage is never released: nothing waits on it, and no SMEM
        # is reused by the epilogue.

        # ---------------------------------------------------------------
        # Epilogue: scale in fp32, predicated stores straight to S.
        # ---------------------------------------------------------------
        acc.store(acc.load() * softmax_scale)

        seqlen_q = mS.shape[0]
        seqlen_k = mS.shape[1]
        # Global (row, col) of every accumulator value, partitioned like acc.
        cS = cute.local_tile(
            cute.make_identity_tensor((seqlen_q, seqlen_k)), (TILE_M, TILE_N), (m_block, n_block)
        )
        tScS = thr_mma.partition_C(cS)

        s0, s1, s2, s3 = mS.stride
        if s0 % 2 == 0 and s2 % 2 == 0 and s3 % 2 == 0:
            # Even strides: every (row, even col) element is 8-byte aligned
            # (S's base is 16-byte aligned), so a column pair is one store.
            mS_even = cute.make_tensor(
                mS.iterator,
                cute.make_layout(
                    mS.shape,
                    stride=(
                        cute.assume(s0, divby=2),
                        s1,
                        cute.assume(s2, divby=2),
                        cute.assume(s3, divby=2),
                    ),
                ),
            )
            self.store_tile(acc, tScS, thr_mma, mS_even, head, batch, m_block, n_block, True)
        else:
            self.store_tile(acc, tScS, thr_mma, mS, head, batch, m_block, n_block, False)

    @cute.jit
    def load_k_block(
        self,
        mainloop: pipeline.PipelineTmaAsync,
        state: pipeline.PipelineState,
        tma_atom_q: cute.CopyAtom,
        tQgQ: cute.Tensor,
        tQsQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        tKgK: cute.Tensor,
        tKsK: cute.Tensor,
    ):
        """Load k-block state.count of Q and K into stage state.index."""
        # Waits for the stage to be empty and arms its full barrier with the
        # transaction bytes of both boxes.
        mainloop.producer_acquire(state)
        bar = mainloop.producer_get_barrier(state)
        cute.copy(tma_atom_q, tQgQ[None, state.count], tQsQ[None, state.index], tma_bar_ptr=bar)
        cute.copy(tma_atom_k, tKgK[None, state.count], tKsK[None, state.index], tma_bar_ptr=bar)
        mainloop.producer_commit(state)  # no-op for TMA: the copies complete the tx

    @cute.jit
    def store_tile(
        self,
        acc: cute.Tensor,
        tScS: cute.Tensor,
        thr_mma: cute.ThrMma,
        mS: cute.Tensor,
        head: cutlass.Int32,
        batch: cutlass.Int32,
        m_block: cutlass.Int32,
        n_block: cutlass.Int32,
        pair_stores: cutlass.Constexpr[bool],
    ):
        """Store this thread's (already scaled) accumulators to the
        (m_block, n_block) tile of S[:, :, head, batch], predicated on
        (row < seqlen_q, col < seqlen_k). pair_stores: the column pair of a
        value may be written with one 8-byte store (mS proves even strides)."""
        seqlen_q = mS.shape[0]
        seqlen_k = mS.shape[1]
        gS = cute.local_tile(mS[None, None, head, batch], (TILE_M, TILE_N), (m_block, n_block))
        tSgS = thr_mma.partition_C(gS)  # ((2, 2, 16), 1, 1), like acc
        # Values 2p and 2p+1 are the column pair (col, col + 1) of one row.
        acc_pairs = cute.logical_divide(acc, cute.make_layout(2))
        gS_pairs = cute.logical_divide(tSgS, cute.make_layout(2))
        for p in cutlass.range_constexpr(cute.size(acc) // 2):
            row, col = tScS[2 * p]
            if row < seqlen_q:
                if cutlass.const_expr(pair_stores):
                    if col + 1 < seqlen_k:
                        cute.autovec_copy(acc_pairs[None, p], gS_pairs[None, p])
                    elif col < seqlen_k:
                        gS_pairs[0, p] = acc_pairs[0, p]
                else:
                    if col < seqlen_k:
                        gS_pairs[0, p] = acc_pairs[0, p]
                    if col + 1 < seqlen_k:
                        gS_pairs[1, p] = acc_pairs[1, p]
