"""Stage C on Hopper (SM90): attention over any number of KV tiles, online softmax,
warp-specialized and pipelined (FlashAttention-3's schedule).

    O[b, i, h, :] = sum_j softmax_j(scale * q_i . k_j) v_j          (input dtype)
    LSE[b, h, i]  = log sum_j exp(scale * q_i . k_j)                 (fp32, natural log)
    0 <= j < seqlen_k (any seqlen_k >= 1), hk = h // (heads / kv_heads)

Q, K, V, O are bf16 or fp16 (batch, seqlen, heads, head_dim), head_dim contiguous;
LSE is fp32 (batch, heads, seqlen_q). head_dim (64/128/256) and the tile shape are
fixed at construction; batch, heads, kv_heads, seqlen_q, seqlen_k are runtime values.

Work decomposition
    grid  = (ceil(seqlen_q / tile_m), heads, batch): one CTA per Q tile of one
            (head, batch), all n_blocks = ceil(seqlen_k / tile_n) KV tiles, visited
            from the last (the one holding key seqlen_k - 1) down to 0: the only tile
            with keys past seqlen_k comes first, so it alone is masked, and every row
            has a finite max from its first tile on (no -inf - -inf).
    block = 128 x (1 + W) threads:
            warpgroup 0      producer: setmaxnreg 24 (W = 2) / 32 (W = 3); warp 0 issues
                             every TMA load, warps 1-3 exit at once.
            warpgroups 1..W  consumers: setmaxnreg 240 (W = 2) / 160 (W = 3); consumer
                             warpgroup w owns Q rows [64 w, 64 w + 64) end to end:
                             QK, mask, online softmax, PV, epilogue.
    tiles (default, per head_dim): 64: 192 x 128 (W = 3); 128: 128 x 128; 256: 128 x 80
            (O is 128 fp32 registers a thread at 256; 80 keys keep S, P and O under 240,
            and Q + 2 x (K + V) = 224 KiB of SMEM).

Pipelines and barriers (who waits on what)
    q_bar          mbarrier, one phase: the producer arms it with Q's bytes and TMAs Q;
                   consumers wait (parity 0) before their first QK.
    pipeline_k/v   PipelineTmaAsync, `stages` (2) slots each, K and V on separate
                   full/empty mbarriers. Producer: acquire slot (wait empty), arm full with
                   the tile's bytes, TMA. Consumer: wait full; after the wgmma that read the
                   slot has completed, lane 0 of each consumer warp arrives on empty
                   (arrive count = consumer warps). KV tile n sits in one slot index for K and
                   for V; the producer orders loads K[n_last], Q, then (K[n-1], V[n]) pairs,
                   then V[0]: the order in which the consumers need them.
    SCHEDULER_WGw  named barriers (ping-pong, head_dim <= 128): consumer warpgroup w syncs on
                   its own before issuing a tile's GEMMs and, once they are issued, arrives on
                   the next warpgroup's (count 2 x 128). Warpgroup 0 arrives on its own once
                   at the start, so it goes first (that extra arrival is the one left
                   pending at exit). One warpgroup's tensor-core work then overlaps the
                   other's softmax. The first QK and the last PV run outside the turns.
    EPILOGUE       named barrier over the consumers (common/sm90_epilogue.py): sQ free for O,
                   then O in SMEM for the TMA store.

Consumer warpgroup, per Q tile (intra-warpgroup overlap, FA3 Algorithm 2)
    first:  S = Q K[n_blocks-1]^T; mask keys >= seqlen_k; m, P, l from it; P -> 16 bits; O = 0.
    for each further tile n (descending):
            issue S = Q K[n]^T            (async wgmma group 1)
            [head_dim > 128: O *= r (the previous tile's rescale), under group 1]
            issue O += P V[n+1]           (async group 2, P of the previous tile in registers)
            wait group 1; release K slot; online softmax of S -> P, r
            wait group 2; release V slot; P -> 16 bits; [head_dim <= 128: O *= r]
    last:   [O *= r]; O += P V[0]; wait; release.
    The PV of tile n+1 accumulates into O scaled to max m_{n+1}; the rescale by
    r = exp2(m_{n+1} - m_n) lands before the PV of tile n is issued, in both variants.
    Then O /= rowsum, LSE = (m + log2 rowsum) ln 2; the final O read follows the last
    PV's wait_group(0).

Numerics (common/softmax.py, OnlineSoftmax): x = s * scale_log2; m = running max of x
over visible keys; P = exp2(s * scale_log2 - m) (one FFMA + EX2); rowsum accumulates
the fp32 P (before P is rounded to 16 bits), rescaled by r when m grows; the rescale
is applied every tile (r = 1 when the max did not grow).

Layouts (consumer warpgroup w, warp w' in it, lane l; tile_n = N)
    sQ          (tile_m, d, 1)  K-major SW128: S<3,4,3> o ((8,tile_m/8),(64,d/64),1):((64,512),(1,64 tile_m),_)
    sK, sV      (N, d, stages)  K-major SW128, slot s at element offset s N d (TMA writes these)
    sVt         (d, N, stages)  the same bytes as sV read MN-major (PV's B operand):
                  S<3,4,3> o ((64,d/64),(8,N/8),stages):((1,64 N),(64,512),N d)
    sO          over sQ (same layout)
    S / P acc   ((2,2,N/8),1,1):((1,2,4),0,0): value (c, r, n) = S[64 w + 16 w' + l/4 + 8 r, 8 n + 2 (l%4) + c]
    P as A      ((2,2,2),1,(N/16,1)): A value ((c, r, h), 0, j) = the same register as S value
                (c, r, 2 j + h) (common/p_staging.py)
    O acc       ((2,2,d/8),1,1): value (c, r, n) = O[64 w + 16 w' + l/4 + 8 r, 8 n + 2 (l%4) + c],
                same rows as S: the row statistics scale O in place.
    tests/test_c_sm90_host.py proves the V views, the P relabelling and packing, the row
    mapping and the key mask at these tiles on the host, with the builders used here.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from dsv4_attention.common.layouts import check_attention_operands, seq_major
from dsv4_attention.common.mask import mask_seqlen_k, num_kv_tiles
from dsv4_attention.common.p_staging import as_a_operand, convert_p_packed, make_pv_tiled_mma
from dsv4_attention.common.sm90_barriers import PingPong, Sm90FwdBarrier, pingpong_start
from dsv4_attention.common.sm90_epilogue import store_lse, store_o
from dsv4_attention.common.sm90_gemm import (
    REGISTERS,
    SMEM_ALIGN,
    THREADS_PER_WARPGROUP,
    WGMMA_M,
    gemm,
    make_tile_smem_layout,
    make_tile_smem_layout_mn,
    make_tiled_mma,
    make_tma_tile_atom,
    register_plan,
    tile_tma_partition,
)
from dsv4_attention.common.sm90_producer import load_q_k_v
from dsv4_attention.common.softmax import OnlineSoftmax, scale_rows

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# (tile_m, tile_n) per head dim. Measured on an H200 (bf16, non-causal): hd 64 192 x 128
# 524 TFLOP/s vs 433 at 128 x 128; hd 256 128 x 80 773 vs 771 at 128 x 64.
DEFAULT_TILES = {64: (192, 128), 128: (128, 128), 256: (128, 80)}


class FlashAttentionSm90(PingPong):
    arch = "sm_90a"

    register_plan = register_plan  # the setmaxnreg split, checked against the launch (common/compile.py)

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        *,
        tile_m: int | None = None,
        tile_n: int | None = None,
        stages: int = 2,  # 3 at hd 128 measured slower (642 vs 669 TFLOP/s): SMEM, no latency to hide
        pingpong: bool | None = None,
    ):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        default_m, default_n = DEFAULT_TILES[head_dim]
        self.tile_m = tile_m or default_m
        self.tile_n = tile_n or default_n
        self.num_wg = self.tile_m // WGMMA_M
        if self.tile_m % WGMMA_M or self.num_wg not in REGISTERS:
            raise ValueError(f"tile_m must be 128 or 192, got {self.tile_m}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.stages = stages
        self.consumer_regs, self.producer_regs = REGISTERS[self.num_wg]
        # Ping-pong: where the softmax is a large share of a tile's time (FA3's choice at
        # <= 128; on the H200 a tie at 128: 669 vs 672 TFLOP/s off). At 256 the GEMMs
        # dominate and the turns cost (752 vs 773): both warpgroups issue freely.
        self.pingpong = head_dim <= 128 if pingpong is None else pingpong
        # At 256, O is 128 registers: rescale it while the QK wgmma runs, not after PV.
        self.rescale_o_before_pv = head_dim > 128
        self.consumer_threads = self.num_wg * THREADS_PER_WARPGROUP
        self.shared_storage = None  # set when __call__ is traced

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

        # (seqlen, head_dim, heads, batch)
        mQ, mK, mV, mO = [seq_major(t) for t in (mQ, mK, mV, mO)]

        d = self.head_dim
        qk_mma = make_tiled_mma(self.dtype, self.tile_n, warpgroups=self.num_wg)
        pv_mma = make_pv_tiled_mma(self.dtype, d, warpgroups=self.num_wg)
        sQ_layout = make_tile_smem_layout(self.dtype, self.tile_m, d, 1)
        sKV_layout = make_tile_smem_layout(self.dtype, self.tile_n, d, self.stages)
        sVt_layout = make_tile_smem_layout_mn(self.dtype, self.tile_n, d, self.stages)
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_q, tma_q = make_tma_tile_atom(load, mQ, sQ_layout, self.tile_m, d)
        tma_atom_k, tma_k = make_tma_tile_atom(load, mK, sKV_layout, self.tile_n, d)
        tma_atom_v, tma_v = make_tma_tile_atom(load, mV, sKV_layout, self.tile_n, d)
        tma_atom_o, tma_o = make_tma_tile_atom(store, mO, sQ_layout, self.tile_m, d)

        @cute.struct
        class SharedStorage:
            q_bar: cutlass.Int64
            k_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]  # full, then empty
            v_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], SMEM_ALIGN]

        self.shared_storage = SharedStorage

        grid = (cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2], mQ.shape[3])
        self.kernel(
            qk_mma, pv_mma,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            mLSE, scale_log2,
            sQ_layout, sKV_layout, sVt_layout,
        ).launch(
            grid=grid,
            block=[THREADS_PER_WARPGROUP * (1 + self.num_wg), 1, 1],
            stream=stream,
            # one CTA per SM: fixes the entry register count that setmaxnreg redistributes
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA coordinate tensors, (seqlen, head_dim, heads, batch)
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q)
        scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_block, head, batch = cute.arch.block_idx()
        head_kv = head // (mQ.shape[2] // mK.shape[2])

        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        q_bar = storage.q_bar.ptr
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(q_bar, 1)
        tile_bytes = self.tile_n * self.head_dim * self.dtype.width // 8
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # one release arrive per consumer warp (lane 0): PipelineTmaAsync's signalling lane
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads // 32)
        pipeline_k, pipeline_v = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=bars.data_ptr(),
                num_stages=self.stages,
                producer_group=producer,
                consumer_group=consumers,
                tx_count=tile_bytes,
                defer_sync=True,
            )
            for bars in (storage.k_bars, storage.v_bars)
        ]
        cute.arch.mbarrier_init_fence()
        # Nobody may wait on (or TMA complete on) a barrier before it is initialised.
        cute.arch.barrier()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sVt = storage.sV.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)

        d = self.head_dim
        # every Q / O tile of this (head, batch) (the CTA takes m_block) and every
        # K / V tile of its (kv head, batch): (rows, d, tiles)
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, d), (None, 0))
        gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, d), (None, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, d), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, d), (None, 0))
        n_blocks = num_kv_tiles(mK.shape[0], self.tile_n)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(
                    q_bar, pipeline_k, pipeline_v, n_blocks, m_block,
                    tma_atom_q, gQ, sQ, tma_atom_k, gK, sK, tma_atom_v, gV, sV,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                qk_mma, pv_mma, q_bar, pipeline_k, pipeline_v, n_blocks,
                sQ, sK, sVt, tma_atom_o, gO, mLSE, scale_log2,
                m_block, head, batch, mQ.shape[0], mK.shape[0],
            )

    # -------------------------------------------------------------------------------
    # Producer: warp 0
    # -------------------------------------------------------------------------------

    @cute.jit
    def load(
        self,
        q_bar: cute.Pointer,
        pipeline_k: pipeline.PipelineTmaAsync,
        pipeline_v: pipeline.PipelineTmaAsync,
        n_blocks: cutlass.Int32,
        m_block: cutlass.Int32,
        tma_atom_q: cute.CopyAtom,
        gQ: cute.Tensor,
        sQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        gK: cute.Tensor,
        sK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        gV: cute.Tensor,
        sV: cute.Tensor,
    ):
        """K[n_last], Q, then (K[n - 1], V[n]) for n = n_last .. 1, then V[0]
        (common/sm90_producer.py). K of tile n and V of tile n share one slot index."""
        tQsQ, tQgQ = tile_tma_partition(tma_atom_q, sQ, gQ)
        tKsK, tKgK = tile_tma_partition(tma_atom_k, sK, gK)
        tVsV, tVgV = tile_tma_partition(tma_atom_v, sV, gV)
        load_q_k_v(q_bar, pipeline_k, pipeline_v, self.stages, n_blocks, m_block,
                   self.tile_m * self.head_dim * self.dtype.width // 8,
                   tma_atom_q, tQgQ, tQsQ, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV)

    # -------------------------------------------------------------------------------
    # Consumers: warpgroups 1..W
    # -------------------------------------------------------------------------------

    @cute.jit
    def consume(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        q_bar: cute.Pointer,
        pipeline_k: pipeline.PipelineTmaAsync,
        pipeline_v: pipeline.PipelineTmaAsync,
        n_blocks: cutlass.Int32,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sVt: cute.Tensor,
        tma_atom_o: cute.CopyAtom,
        gO: cute.Tensor,
        mLSE: cute.Tensor,
        scale_log2: cutlass.Float32,
        m_block: cutlass.Int32,
        head: cutlass.Int32,
        batch: cutlass.Int32,
        seqlen_q: cutlass.Int32,
        seqlen_k: cutlass.Int32,
    ):
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # wgmma operands are per warpgroup: slice by the warpgroup's first thread
        wg_qk = qk_mma.get_slice(wg * THREADS_PER_WARPGROUP)
        wg_pv = pv_mma.get_slice(wg * THREADS_PER_WARPGROUP)
        tSrQ = qk_mma.make_fragment_A(wg_qk.partition_A(sQ))[None, None, None, 0]  # (MMA, 1, d/16)
        tSrK = qk_mma.make_fragment_B(wg_qk.partition_B(sK))  # (MMA, 1, d/16, stages)
        tOrV = pv_mma.make_fragment_B(wg_pv.partition_B(sVt))  # (MMA, 1, N/16, stages)

        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.head_dim)))
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)  # P, 16-bit, laid out like S
        tOrP = as_a_operand(r_p)
        # (row, key) of every S value within a tile
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        softmax = OnlineSoftmax(acc_s.layout, scale_log2)
        o_scale = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)

        if cutlass.const_expr(self.pingpong):
            pingpong_start(wg)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        # ---- first tile (n_blocks - 1, holds the last key): QK, mask, softmax -------
        cute.arch.mbarrier_wait(q_bar, 0)
        pipeline_k.consumer_wait(state)
        gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(state)
        mask_seqlen_k(acc_s, tScS, n_blocks - 1, self.tile_n, seqlen_k)
        softmax.update(acc_s, is_first=True)
        convert_p_packed(acc_s, r_p)
        acc_o.fill(0.0)
        o_scale.fill(1.0)

        # ---- every further tile: QK(n) and PV(n + 1) in flight, then softmax(n) ----
        for _ in cutlass.range(n_blocks - 1, unroll=1):
            v_state = state.clone()
            state.advance()
            pipeline_k.consumer_wait(state)
            self.scheduler_wait(wg)
            gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
            if cutlass.const_expr(self.rescale_o_before_pv):
                scale_rows(acc_o, o_scale)
            pipeline_v.consumer_wait(v_state)
            gemm(pv_mma, acc_o, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
            self.scheduler_pass(wg)
            warpgroup.wait_group(1)  # S(n) complete; PV may still run
            pipeline_k.consumer_release(state)
            row_scale = softmax.update(acc_s, is_first=False)
            warpgroup.wait_group(0)  # PV(n + 1) complete: P and O are free
            pipeline_v.consumer_release(v_state)
            convert_p_packed(acc_s, r_p)
            if cutlass.const_expr(self.rescale_o_before_pv):
                o_scale.store(row_scale.load())
            else:
                scale_rows(acc_o, row_scale)

        # ---- last PV (tile 0) -------------------------------------------------------
        if cutlass.const_expr(self.rescale_o_before_pv):
            scale_rows(acc_o, o_scale)
        pipeline_v.consumer_wait(state)
        gemm(pv_mma, acc_o, tOrP, tOrV[None, None, None, state.index], zero_init=False)
        warpgroup.wait_group(0)  # the final O read below is ordered after the last PV
        pipeline_v.consumer_release(state)

        # ---- epilogue ------------------------------------------------------------------
        inv_sum = softmax.finalize()
        scale_rows(acc_o, inv_sum)
        store_o(
            acc_o, sQ, thr_pv, tma_atom_o, gO,
            m_block, int(Sm90FwdBarrier.EPILOGUE), self.consumer_threads,
            tidx // 32 == 0,
        )
        store_lse(mLSE, softmax.lse, tScS, m_block * self.tile_m, head, batch, seqlen_q)
