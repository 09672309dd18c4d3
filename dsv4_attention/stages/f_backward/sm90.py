"""Stage F on Hopper (SM90): the backward of attention. dQ, dK, dV from Q, K, V, dO, the
forward's LSE and D = rowsum(dO * O); P is recomputed, never stored (FlashAttention-2/3's
algorithm, with FlashAttention-3's transposed scores).

    P[i, j]  = exp(scale q_i . k_j - LSE_i)      visible (i, j); 0 otherwise
    dV_j     = sum_i P[i, j] dO_i
    dP[i, j] = dO_i . v_j
    dS[i, j] = P[i, j] (dP[i, j] - D_i)
    dQ_i     = scale sum_j dS[i, j] k_j
    dK_j     = scale sum_i dS[i, j] q_i

Tile: tile_n = 128 keys a CTA; tile_m = 64 queries a visit, or 128 at head dim 64
(``f_backward.queries_per_visit``, FlashAttention-3's tile there: half the visits, so half the
per-visit barriers, statistics loads and pipeline waits for the same work; 8-16 % less time
without a bound, 1.5-5 % causal, in its A/Bs, docs/results/experiments/issue44_hd64_tile128/).
At 128 queries the S^T and dP^T accumulators are 64 fp32 registers each, so two orders change
(``dv_after_ds``, ``late_dp``): dV's GEMM waits for dS, and with a window bound dP^T's GEMM is
issued only after P (the mask's per-element work and dP^T's in-flight accumulator do not fit
together: ptxas spilled 4-56 bytes in every mask form tried).

Work decomposition
    grid  = (ceil(seqlen_k / tile_n), kv_heads, batch): one CTA per KV tile of one (kv head,
            batch). K and V of the tile stay in SMEM, its dK and dV accumulate in registers over
            every (query head of the KV head's group, Q tile) that sees one of its keys
            (``span.q_tile_range``), so dK and dV are complete when the CTA ends: GQA's sum over
            the group happens in the CTA, with no atomics and in a fixed order. dQ gets one partial
            sum per KV tile: the consumers write scale * dS K to SMEM and the dQ warp adds it into an
            fp32 accumulator with one TMA reduction (cp.reduce.async.bulk.tensor .add; the host
            rounds the accumulator to q's dtype).
            A variable-length batch (``varlen``): grid z is the request, x the longest request's KV
            tiles (a tile past its request's keys visits nothing and stores nothing); Q, dO, K, V
            are the packed tensors offset to the request's first row, and LSE2, D, dQacc, dK, dV
            rows padded per request, so that a whole tile written for one request never reaches the
            next (common/varlen.py; the host gathers the gradients back).
    block = 128 x 3 threads:
            warpgroup 0      producer (setmaxnreg 24): warp 0 issues every TMA load; warp 1, the
                             dQ warp, issues the TMA reductions of dQ.
            warpgroups 1, 2  consumers (240): warpgroup w owns keys [64 w, 64 w + 64) of the tile
                             for S^T, dP^T, dV, dK, and dQ's columns [d/2 w, d/2 (w + 1)).

Why the scores are transposed (FlashAttention-3's SdP_swapAB): the consumers compute
S^T = K Q^T, whose rows are keys. Then P^T and dS^T, rounded to 16 bits in registers, are the
A operands of dV = P^T dO and dK = dS^T Q as they stand (common/p_staging.py's relabelling, the
forward's P trick), and each thread's row statistics become column statistics: the LSE and D of
the queries its values hold (tile_m / 4 of each), which the producer loads by TMA with Q
(LSE) and dO (D) into the same pipeline slot, and the consumers read from SMEM when they need
them. dQ = dS K needs dS with queries as rows: the warpgroups write dS^T into SMEM once, and
the dQ wgmma reads it MN-major (the same bytes, transposed; the proof is in
tests/test_f_sm90_host.py).

Pipelines and barriers
    kv_bar      mbarrier, one phase: K and V of the tile (TMA); consumers wait before the first GEMM.
    pipeline_q, pipeline_do   PipelineTmaAsync, ``stages`` slots each: the producer loads Q with its
                LSE2 and dO with its D (tile_m fp32 each, a 1-D TMA box) of the visit's (head, Q tile)
                into the same slot index; consumers release both
                after the visit's last wgmma that read them (dK reads Q, dV reads dO).
    DS_READY    named barrier (256 consumer threads): both warpgroups' dS^T rows are in sdS.
                sdS has two slots (visit i writes slot i % 2): a warpgroup writes slot i % 2 again
                at visit i + 2, past DS_READY of visit i + 1, which the other warpgroup reached
                after waiting for its dQ wgmma of visit i. So no barrier frees sdS.
    DQ_FULL, DQ_EMPTY   (256 consumer threads + the dQ warp) the visit's dQ is in sdQ (consumers
                arrive, the dQ warp syncs, then reduces it into global memory and waits for the
                reduction's SMEM reads); sdQ is free again (the dQ warp arrives, the consumers sync
                before they write it).
    EPILOGUE_DK, EPILOGUE_DV   sK / sV may be overwritten by dK / dV, then the TMA stores read them
                (common/sm90_epilogue.store_o); one id each: store_o ends with an arrive phase, which
                a second store's sync on the same id would join, and hang.

Consumer warpgroup, per visit (Q tile m of head h)
    issue S^T = K Q^T, dP^T = V dO^T                       (two wgmma groups)
    wait S^T; LSE2 from the slot; P^T = exp2(S^T scale log2 e - LSE2), 0 where hidden; -> 16 bits
    issue dV += P^T dO                                     (RS; dO read MN-major)
    wait dP^T; D from the slot; dS^T = P^T (dP^T - D); -> 16 bits; dS^T -> sdS
    (padded rows: LSE2 = +inf, D = 0, so P = dS = 0 there)
    [tile_m = 128: P rounded and dV issued only here, after dS: the scores, dP^T and the 16-bit
    P do not fit the registers together with dV's and dK's accumulators (``dv_after_ds``); with a
    window bound dP^T is issued after P, not with S^T (``late_dp``)]
    DS_READY; issue dQ = dS K (SS: sdS and K read MN-major); issue dK += dS^T Q (RS; Q read
    MN-major); wait dQ; DQ_EMPTY; scale dQ -> sdQ; DQ_FULL (the dQ warp: TMA reduce-add into
    dQacc), while dK runs; wait all; release Q, dO
    end: dK *= scale; dK, dV -> SMEM -> TMA stores (rows past seqlen_k clipped).

Layouts (consumer warpgroup w, warp w' in it, lane l)
    sQ, sdO     (tile_m, d, stages) K-major SW128 (TMA fills); sQt, sdOt the same bytes as
                (d, tile_m, stages) MN-major: the B of dK / dV.
    sK, sV      (tile_n, d, 1) K-major SW128; sKt (d, tile_n, 1): the B of dQ.
    sdS         (tile_n, tile_m, 2) K-major SW128 (written from the S^T partition); sdSt the
                same bytes as (tile_m, tile_n, 2) MN-major: the A of dQ.
    sdQ         (tile_m, d, 1) fp32 in blocks of 8 columns (``dq_smem_layout``): the TMA
                reduction's box, stored by the consumers without bank conflicts.
    S^T, dP^T   ((2,2,tile_m/8),1,1): value (c, r, n) = S^T[64 w + 16 w' + l/4 + 8 r,
                8 n + 2 (l%4) + c]: queries 8 n + 2 (l%4) + c, independent of r, so the column
                statistics are tile_m / 4 values a thread: row (c, n) of the column view
                ``acc_cols_view`` (common/softmax.py) holds values (c, 0, n) and (c, 1, n).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from dsv4_attention.common.kv_span import row_keys
from dsv4_attention.common.p_staging import as_a_operand, convert_p_packed, make_pv_tiled_mma
from dsv4_attention.common.sm90_barriers import Sm90BwdBarrier
from dsv4_attention.common.sm90_epilogue import store_o
from dsv4_attention.common.sm90_gemm import (
    SMEM_ALIGN,
    THREADS_PER_WARPGROUP,
    WGMMA_M,
    gemm,
    make_tile_smem_layout,
    make_tile_smem_layout_mn,
    make_tiled_mma,
    make_tma_tile_atom,
    tile_tma_partition,
)
from dsv4_attention.common.softmax import acc_cols_view
from dsv4_attention.stages.f_backward import queries_per_visit
from dsv4_attention.stages.f_backward.span import Visits, cta_views, first_kv_tile, kernel_views

SUPPORTED_HEAD_DIMS = (64, 128)
NUM_WG = 2  # consumer warpgroups: 128 keys
DS_STAGES = 2  # sdS's slots: a visit's dS^T is written while the previous one's may still be read
CONSUMER_REGS, PRODUCER_REGS = 240, 24


def make_dq_tiled_mma(dtype: type[cutlass.Numeric], head_dim: int) -> cute.TiledMma:
    """dQ = dS K: wgmma 64 x (d/2) x 16, the two warpgroups side by side along N (dQ's
    columns); A = dS and B = K both MN-major from SMEM (queries, resp. head dims, contiguous)."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, cutlass.Float32,
        (1, NUM_WG, 1), tiler_mn=(WGMMA_M, head_dim // NUM_WG),
    )


def dq_smem_layout(tile_m: int, head_dim: int) -> cute.Layout:
    """sdQ, one visit's dQ partial sums (tile_m, head_dim, 1) fp32, in blocks of 8 columns
    (32 bytes a row), the blocks one after the other:

        (tile_m, (8, head_dim / 8), 1) : (8, (1, 8 tile_m), tile_m head_dim)

    The consumers store it from dQ's accumulator, 8 bytes a thread: a warp's store covers 8 rows
    x 32 bytes of one block, and rows 32 bytes apart put them in 4 bank groups twice (two
    wavefronts, the least 256 bytes take), at addresses affine in the register index (one base
    register). Rows of head_dim x 4 bytes put all 8 rows in the same banks: 8 wavefronts
    (tests/test_f_sm90_host.py). The TMA reduction reads the blocks as its box."""
    return cute.make_layout((tile_m, (8, head_dim // 8), 1), stride=(8, (1, 8 * tile_m), tile_m * head_dim))


class FlashAttentionBackwardSm90:
    arch = "sm_90a"

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        *,
        has_left: bool = False,
        has_right: bool = False,
        deterministic: bool = False,
        has_seqused: bool = False,
        varlen: bool = False,
        tile_m: int | None = None,
        tile_n: int = NUM_WG * WGMMA_M,
        stages: int = 2,
    ):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        if tile_m is None:
            tile_m = queries_per_visit("sm90", head_dim)
        if tile_m not in (64, 128) or tile_n != NUM_WG * WGMMA_M:
            raise ValueError(f"the backward's tile is 64 or 128 queries x 128 keys; got {tile_m} x {tile_n}")
        self.dtype, self.head_dim = dtype, head_dim
        # compile-time options: a left / right window bound, dQ's fixed order, per-batch key
        # counts, a variable-length batch
        self.has_left, self.has_right, self.deterministic = has_left, has_right, deterministic
        self.has_seqused, self.varlen = has_seqused, varlen
        self.tile_m = tile_m
        # at 128 queries dV's GEMM waits until dS is computed, and P is rounded after dS: issued
        # before dS, as at 64 queries, its P and the fp32 scores both live across dS (ptxas spills)
        self.dv_after_ds = tile_m > 64
        # ... and with a bound's mask, dP^T's GEMM is issued after P (its accumulator not in flight
        # while the mask runs)
        self.late_dp = tile_m > 64 and (has_left or has_right)
        self.tile_n = tile_n
        self.stages = stages
        self.num_wg = NUM_WG
        self.consumer_regs, self.producer_regs = CONSUMER_REGS, PRODUCER_REGS
        self.consumer_threads = NUM_WG * THREADS_PER_WARPGROUP
        self.dq_threads = self.consumer_threads + 32  # the consumers and the dQ warp
        self.shared_storage = None

    def register_plan(self) -> list:
        return [(THREADS_PER_WARPGROUP, self.producer_regs), (self.consumer_threads, self.consumer_regs)]

    def tile_tma_atoms(self, mQ, mdO, mK, mV, mdK, mdV, mLSE2, mD, sQ_layout, sKV_layout) -> tuple:
        """(atom, TMA tensor) of Q, dO, K, V (loads), dK, dV (stores) by their tiles' SMEM layouts,
        and of LSE2, D: a visit's tile_m fp32 each, loaded with Q / dO into the same slot (traced
        in ``__call__``; sm90_wide.py's too)."""
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        return (make_tma_tile_atom(load, mQ, sQ_layout, tm, d), make_tma_tile_atom(load, mdO, sQ_layout, tm, d),
                make_tma_tile_atom(load, mK, sKV_layout, tn, d), make_tma_tile_atom(load, mV, sKV_layout, tn, d),
                make_tma_tile_atom(store, mdK, sKV_layout, tn, d), make_tma_tile_atom(store, mdV, sKV_layout, tn, d),
                cpasync.make_tiled_tma_atom(load, mLSE2, cute.make_layout(tm), (tm,)),
                cpasync.make_tiled_tma_atom(load, mD, cute.make_layout(tm), (tm,)))

    def q_do_pipelines(self, storage) -> tuple:
        """The Q and dO pipelines over the storage's q_bars / do_bars (traced in the kernel): one
        producer thread, the consumer warps; Q (resp. dO) and its statistic land on one barrier."""
        q_bytes = self.tile_m * self.head_dim * self.dtype.width // 8 + self.tile_m * 4
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads // 32)
        return tuple(
            pipeline.PipelineTmaAsync.create(
                barrier_storage=bars.data_ptr(), num_stages=self.stages, producer_group=producer,
                consumer_group=consumers, tx_count=q_bytes, defer_sync=True,
            )
            for bars in (storage.q_bars, storage.do_bars)
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, d)
        mK: cute.Tensor,  # (batch, seqlen_k, kv_heads, d)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # like mQ
        mLSE2: cute.Tensor,  # (batch, heads, rows) fp32: LSE log2(e), +inf where no key; rows >= seqlen_q padded
        mD: cute.Tensor,  # (batch, heads, rows) fp32: rowsum(dO * O), 0 on padded rows
        mdQacc: cute.Tensor,  # (batch, rows, heads, d) fp32, zeroed: dQ accumulates here
        mdK: cute.Tensor,  # like mK
        mdV: cute.Tensor,
        mSem: cute.Tensor,  # (batch, heads, Q tiles) int32, zeroed: dQ's turns (deterministic only)
        mSeqused: cute.Tensor,  # (batch,) int32: each batch's key count (has_seqused only)
        mCuQ: cute.Tensor,  # (batch + 1,) int32: a variable-length batch's query offsets (varlen only)
        mCuK: cute.Tensor,  # (batch + 1,) int32: its key offsets (varlen only)
        max_seqlen_k: cutlass.Int32,  # the longest batch's keys: the grid's KV tiles (varlen only)
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        left: cutlass.Int32,
        right: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        # types checked; rows first, batch last; (mLSE2, mD) as (rows, heads, batch)
        seqlen_q, seqlen_k, mQ, mK, mV, mdO, mdK, mdV, mdQacc, mLSE2, mD = kernel_views(
            self.dtype, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV)

        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        sdp_mma = make_tiled_mma(self.dtype, tm, warpgroups=self.num_wg)  # S^T, dP^T: M = keys, N = queries
        dkv_mma = make_pv_tiled_mma(self.dtype, d, warpgroups=self.num_wg)  # dV, dK: A from registers
        dq_mma = make_dq_tiled_mma(self.dtype, d)
        sQ_layout = make_tile_smem_layout(self.dtype, tm, d, self.stages)
        sQt_layout = make_tile_smem_layout_mn(self.dtype, tm, d, self.stages)
        sKV_layout = make_tile_smem_layout(self.dtype, tn, d, 1)
        sKVt_layout = make_tile_smem_layout_mn(self.dtype, tn, d, 1)
        sdS_layout = make_tile_smem_layout(self.dtype, tn, tm, DS_STAGES)
        sdSt_layout = make_tile_smem_layout_mn(self.dtype, tn, tm, DS_STAGES)
        (tma_atom_q, tma_q), (tma_atom_do, tma_do), (tma_atom_k, tma_k), (tma_atom_v, tma_v), \
            (tma_atom_dk, tma_dk), (tma_atom_dv, tma_dv), (tma_atom_lse, tma_lse), (tma_atom_d, tma_d) = \
            self.tile_tma_atoms(mQ, mdO, mK, mV, mdK, mdV, mLSE2, mD, sQ_layout, sKV_layout)
        sStat_layout = cute.make_layout((tm, self.stages))  # a visit's LSE2 and D, one slot per stage
        # dQ's partial sums: (tile_m, d) fp32 in blocks of 8 columns (dq_smem_layout); one TMA
        # reduce-add a visit
        sdQ_layout = dq_smem_layout(tm, d)
        tma_atom_dq, tma_dq = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.slice_(sdQ_layout, (None, None, 0)), (tm, d))

        @cute.struct
        class SharedStorage:
            kv_bar: cutlass.Int64
            q_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]  # full, then empty
            do_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], SMEM_ALIGN]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], SMEM_ALIGN]
            sdQ: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sdQ_layout)], 128]
            sLSE: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sStat_layout)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sStat_layout)], 128]

        self.shared_storage = SharedStorage

        kv_tiles = cute.ceil_div(max_seqlen_k if cutlass.const_expr(self.varlen) else seqlen_k, tn)
        batches = mCuQ.shape[0] - 1 if cutlass.const_expr(self.varlen) else mK.shape[3]
        grid = (kv_tiles, mK.shape[2], batches)
        self.kernel(
            sdp_mma, dkv_mma, dq_mma,
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_dk, tma_dk, tma_atom_dv, tma_dv, tma_atom_dq, tma_dq,
            tma_atom_lse, tma_lse, tma_atom_d, tma_d, mSem, mSeqused, mCuQ, mCuK, scale_log2, scale, left, right,
            seqlen_q, seqlen_k,
            sQ_layout, sQt_layout, sKV_layout, sKVt_layout, sdS_layout, sdSt_layout, sdQ_layout, sStat_layout,
        ).launch(
            grid=grid,
            block=[THREADS_PER_WARPGROUP * (1 + self.num_wg), 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        sdp_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        dq_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA coordinate tensors, (seqlen, d, heads, batch)
        tma_atom_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_dk: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_atom_dv: cute.CopyAtom,
        mdV: cute.Tensor,
        tma_atom_dq: cute.CopyAtom,
        mdQacc: cute.Tensor,  # TMA coordinates of the fp32 accumulator, (rows, d, heads, batch)
        tma_atom_lse: cute.CopyAtom,
        mLSE2: cute.Tensor,  # TMA coordinates, (rows, heads, batch)
        tma_atom_d: cute.CopyAtom,
        mD: cute.Tensor,
        mSem: cute.Tensor,
        mSeqused: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        left: cutlass.Int32,
        right: cutlass.Int32,
        seqlen_q: cutlass.Int32,
        seqlen_k: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sQt_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sKVt_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdSt_layout: cute.ComposedLayout,
        sdQ_layout: cute.Layout,
        sStat_layout: cute.Layout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head_kv, batch = cute.arch.block_idx()
        group = mQ.shape[2] // mK.shape[2]

        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_dk, tma_atom_dv, tma_atom_dq,
                         tma_atom_lse, tma_atom_d):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        kv_bar = storage.kv_bar.ptr
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(kv_bar, 1)
        pipeline_q, pipeline_do = self.q_do_pipelines(storage)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sQt = storage.sQ.get_tensor(sQt_layout.outer, swizzle=sQt_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdOt = storage.sdO.get_tensor(sQt_layout.outer, swizzle=sQt_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sKt = storage.sK.get_tensor(sKVt_layout.outer, swizzle=sKVt_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdSt = storage.sdS.get_tensor(sdSt_layout.outer, swizzle=sdSt_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sD = storage.sD.get_tensor(sStat_layout)

        # the batch entry's (the request's) tensors and the Q tiles this KV tile visits
        views = cta_views((mQ, mdO), (mK, mV), (mLSE2, mD, mdQacc), (mdK, mdV), n_block, head_kv, batch, group,
                          seqlen_q, seqlen_k, left, right, mSeqused, mCuQ, mCuK, self.tile_m, self.tile_n,
                          self.has_left, self.has_right, self.has_seqused, self.varlen)
        (mQ, mdO), (mK, mV), (mLSE2, mD, mdQacc), (mdK, mdV) = views[:4]
        work, k_rows = views.work, views.k_rows

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(kv_bar, pipeline_q, pipeline_do, work, tma_atom_q, mQ, sQ, tma_atom_do, mdO, sdO,
                          tma_atom_k, mK, sK, tma_atom_v, mV, sV, tma_atom_lse, mLSE2, sLSE, tma_atom_d, mD, sD)
            if warp_idx == 1:
                self.store_dq(tma_atom_dq, mdQacc, sdQ, mSem, work, batch, left)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                sdp_mma, dkv_mma, dq_mma, kv_bar, pipeline_q, pipeline_do,
                sQ, sQt, sdO, sdOt, sK, sKt, sV, sdS, sdSt, sdQ,
                tma_atom_dk, mdK, tma_atom_dv, mdV, sLSE, sD,
                scale_log2, scale, left, right, work, k_rows,
            )

    # -------------------------------------------------------------------------------
    # Producer: warp 0
    # -------------------------------------------------------------------------------

    @cute.jit
    def load(
        self,
        kv_bar: cute.Pointer,
        pipeline_q: pipeline.PipelineTmaAsync,
        pipeline_do: pipeline.PipelineTmaAsync,
        work: Visits,
        tma_atom_q: cute.CopyAtom, mQ: cute.Tensor, sQ: cute.Tensor,
        tma_atom_do: cute.CopyAtom, mdO: cute.Tensor, sdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom, mK: cute.Tensor, sK: cute.Tensor,
        tma_atom_v: cute.CopyAtom, mV: cute.Tensor, sV: cute.Tensor,
        tma_atom_lse: cute.CopyAtom, mLSE2: cute.Tensor, sLSE: cute.Tensor,
        tma_atom_d: cute.CopyAtom, mD: cute.Tensor, sD: cute.Tensor,
    ):
        """K, V of the tile once (kv_bar), then Q with its LSE2 and dO with its D for each visit,
        head-major."""
        d = self.head_dim
        gK = cute.local_tile(mK[None, None, work.head_kv], (self.tile_n, d), (None, 0))
        gV = cute.local_tile(mV[None, None, work.head_kv], (self.tile_n, d), (None, 0))
        tKsK, tKgK = tile_tma_partition(tma_atom_k, sK, gK)
        tVsV, tVgV = tile_tma_partition(tma_atom_v, sV, gV)
        if work.visits > 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(kv_bar, 2 * self.tile_n * d * self.dtype.width // 8)
            cute.copy(tma_atom_k, tKgK[None, work.n_block], tKsK[None, 0], tma_bar_ptr=kv_bar)
            cute.copy(tma_atom_v, tVgV[None, work.n_block], tVsV[None, 0], tma_bar_ptr=kv_bar)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for it in cutlass.range(work.visits, unroll=1):
            head, m_block = work.at(it)
            gQ = cute.local_tile(mQ[None, None, head], (self.tile_m, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head], (self.tile_m, d), (None, 0))
            tQsQ, tQgQ = tile_tma_partition(tma_atom_q, sQ, gQ)
            tOsdO, tOgdO = tile_tma_partition(tma_atom_do, sdO, gdO)
            gLSE = cute.local_tile(mLSE2[None, head], (self.tile_m,), (None,))
            gD = cute.local_tile(mD[None, head], (self.tile_m,), (None,))
            tLsL, tLgL = cpasync.tma_partition(tma_atom_lse, 0, cute.make_layout(1), cute.group_modes(sLSE, 0, 1),
                                               cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 1),
                                               cute.group_modes(gD, 0, 1))
            pipeline_q.producer_acquire(state)
            cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, state.index],
                      tma_bar_ptr=pipeline_q.producer_get_barrier(state))
            cute.copy(tma_atom_lse, tLgL[None, m_block], tLsL[None, state.index],
                      tma_bar_ptr=pipeline_q.producer_get_barrier(state))
            pipeline_do.producer_acquire(state)
            cute.copy(tma_atom_do, tOgdO[None, m_block], tOsdO[None, state.index],
                      tma_bar_ptr=pipeline_do.producer_get_barrier(state))
            cute.copy(tma_atom_d, tDgD[None, m_block], tDsD[None, state.index],
                      tma_bar_ptr=pipeline_do.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def store_dq(
        self,
        tma_atom_dq: cute.CopyAtom,
        mdQacc: cute.Tensor,
        sdQ: cute.Tensor,
        mSem: cute.Tensor,
        work: Visits,
        batch: cutlass.Int32,
        left: cutlass.Int32,
    ):
        """Warp 1: each visit's dQ partial sum, once the consumers have written it to sdQ, added
        into the fp32 accumulator by one TMA reduction; sdQ handed back once the reduction has read
        it (DQ_EMPTY: one arrival up front, then one per visit but the last, so that every arrival
        meets a consumer's sync).

        Deterministic: the KV tiles that visit a Q tile add their sums in KV-tile order. Counter
        mSem[b, h, m] holds how many have added; KV tile n waits (acquire) until it equals
        n - first_kv_tile(m), adds, waits for the reduction to land in global memory, and
        increments it (release). A CTA waits only for CTAs of lower block index (the KV tile is the
        grid's fastest dimension), which the GPU schedules first: no cycle."""
        if work.visits > 0:
            cute.arch.barrier_arrive(barrier_id=int(Sm90BwdBarrier.DQ_EMPTY), number_of_threads=self.dq_threads)
        for it in cutlass.range(work.visits, unroll=1):
            head, m_block = work.at(it)
            gdQ = cute.local_tile(mdQacc[None, None, head], (self.tile_m, self.head_dim), (None, 0))
            tQsdQ, tQgdQ = tile_tma_partition(tma_atom_dq, sdQ, gdQ)
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DQ_FULL), number_of_threads=self.dq_threads)
            # the reduce copy elects its own lane: inside elect_one its elect.sync would run on one
            # lane with a full mask and hang (tests/test_f_compile.py checks the PTX for it). Every
            # lane commits and waits; the lanes that issued nothing wait on empty groups.
            if cutlass.const_expr(self.deterministic):
                turns = mSem[batch, head, None].iterator + m_block
                mine = work.n_block - first_kv_tile(m_block, self.tile_n, self.tile_m, work.seqlen_q, work.seqlen_k,
                                                    left, self.has_left)
                seen = cute.arch.load(turns, cutlass.Int32, sem="acquire", scope="gpu")
                while seen != mine:
                    seen = cute.arch.load(turns, cutlass.Int32, sem="acquire", scope="gpu")
                cute.arch.fence_proxy("async.global")  # the earlier tiles' sums before this reduction
            cute.copy(tma_atom_dq, tQsdQ[None, 0], tQgdQ[None, m_block])
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0)  # the sum is in global memory, not only read
                cute.arch.fence_proxy("async.global")
                if cute.arch.lane_idx() == 0:
                    cute.arch.atomic_add(turns, cutlass.Int32(1), sem="release", scope="gpu")
                cute.arch.sync_warp()
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if it + 1 < work.visits:
                cute.arch.barrier_arrive(barrier_id=int(Sm90BwdBarrier.DQ_EMPTY), number_of_threads=self.dq_threads)

    # -------------------------------------------------------------------------------
    # Consumers: warpgroups 1, 2
    # -------------------------------------------------------------------------------

    @cute.jit
    def consume(
        self,
        sdp_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        dq_mma: cute.TiledMma,
        kv_bar: cute.Pointer,
        pipeline_q: pipeline.PipelineTmaAsync,
        pipeline_do: pipeline.PipelineTmaAsync,
        sQ: cute.Tensor, sQt: cute.Tensor, sdO: cute.Tensor, sdOt: cute.Tensor,
        sK: cute.Tensor, sKt: cute.Tensor, sV: cute.Tensor, sdS: cute.Tensor, sdSt: cute.Tensor,
        sdQ: cute.Tensor,
        tma_atom_dk: cute.CopyAtom, mdK: cute.Tensor, tma_atom_dv: cute.CopyAtom, mdV: cute.Tensor,
        sLSE: cute.Tensor, sD: cute.Tensor,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        left: cutlass.Int32,
        right: cutlass.Int32,
        work: Visits,
        k_rows: cutlass.Int32,
    ):
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        seqlen_q, seqlen_k = work.seqlen_q, work.seqlen_k
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        wg_sdp = sdp_mma.get_slice(wg * THREADS_PER_WARPGROUP)
        wg_dkv = dkv_mma.get_slice(wg * THREADS_PER_WARPGROUP)
        wg_dq = dq_mma.get_slice(wg * THREADS_PER_WARPGROUP)
        tSrK = sdp_mma.make_fragment_A(wg_sdp.partition_A(sK))[None, None, None, 0]  # (MMA, 1, d/16)
        tSrV = sdp_mma.make_fragment_A(wg_sdp.partition_A(sV))[None, None, None, 0]
        tSrQ = sdp_mma.make_fragment_B(wg_sdp.partition_B(sQ))  # (MMA, 1, d/16, stages)
        tSrdO = sdp_mma.make_fragment_B(wg_sdp.partition_B(sdO))
        tVrdO = dkv_mma.make_fragment_B(wg_dkv.partition_B(sdOt))  # (MMA, 1, tile_m/16, stages)
        tKrQ = dkv_mma.make_fragment_B(wg_dkv.partition_B(sQt))
        tQrdS = dq_mma.make_fragment_A(wg_dq.partition_A(sdSt))  # (MMA, 1, tile_n/16, DS_STAGES)
        tQrK = dq_mma.make_fragment_B(wg_dq.partition_B(sKt))[None, None, None, 0]

        thr_sdp = sdp_mma.get_slice(tidx)
        thr_dkv = dkv_mma.get_slice(tidx)
        thr_dq = dq_mma.get_slice(tidx)
        acc_s = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((tn, tm)))
        acc_dp = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((tn, tm)))
        acc_dv = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((tn, d)))
        acc_dk = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((tn, d)))
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((tm, d)))
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        r_ds = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        tVrP = as_a_operand(r_p)
        tKrdS = as_a_operand(r_ds)
        tScS = thr_sdp.partition_C(cute.make_identity_tensor((tn, tm)))  # (key, query) of each value
        leader = tidx // 32 == 0  # the warp that issues the dK / dV stores
        # column views (common/softmax.acc_cols_view): row s holds the values of one query
        s_cols, dp_cols, c_cols = acc_cols_view(acc_s), acc_cols_view(acc_dp), acc_cols_view(tScS)
        n_stats, per_stat = cute.size(s_cols, mode=[0]), cute.size(s_cols, mode=[1])
        lse = cute.make_rmem_tensor(n_stats, cutlass.Float32)
        dsum = cute.make_rmem_tensor(n_stats, cutlass.Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        offset = seqlen_k - seqlen_q  # query i sits at i + offset among the keys
        key0 = work.n_block * tn

        if work.visits > 0:
            cute.arch.mbarrier_wait(kv_bar, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for it in cutlass.range(work.visits, unroll=1):
            q0 = (work.m_lo + it % work.m_count) * tm
            pipeline_q.consumer_wait(state)
            gemm(sdp_mma, acc_s, tSrK, tSrQ[None, None, None, state.index], zero_init=True)
            if cutlass.const_expr(not self.late_dp):
                pipeline_do.consumer_wait(state)
                gemm(sdp_mma, acc_dp, tSrV, tSrdO[None, None, None, state.index], zero_init=True)
                warpgroup.wait_group(1)  # S^T complete
            else:
                warpgroup.wait_group(0)  # S^T complete (dP^T issued after P: late_dp)
            for s in cutlass.range_constexpr(n_stats):  # the slot's statistics (SMEM: read when needed)
                lse[s] = sLSE[c_cols[s, 0][1], state.index]
            for s in cutlass.range_constexpr(n_stats):
                # the query's visible keys [lo, hi): the forward's one per-row rule (common/kv_span.py)
                lo, hi = row_keys(q0 + c_cols[s, 0][1] + offset, seqlen_k, left, right, self.has_left,
                                  self.has_right)
                for j in cutlass.range_constexpr(per_stat):
                    key = key0 + c_cols[s, j][0]
                    hidden = key >= hi
                    if cutlass.const_expr(self.has_left):
                        hidden = hidden | (key < lo)
                    p = cute.math.exp2(s_cols[s, j] * scale_log2 - lse[s], fastmath=True)
                    s_cols[s, j] = cutlass.Float32(0.0) if hidden else p
            if cutlass.const_expr(self.late_dp):
                pipeline_do.consumer_wait(state)
                gemm(sdp_mma, acc_dp, tSrV, tSrdO[None, None, None, state.index], zero_init=True)
            if cutlass.const_expr(not self.dv_after_ds):
                convert_p_packed(acc_s, r_p)
                gemm(dkv_mma, acc_dv, tVrP, tVrdO[None, None, None, state.index], zero_init=False)
                warpgroup.wait_group(1)  # dP^T complete (dV may run)
            else:
                warpgroup.wait_group(0)  # dP^T complete
            for s in cutlass.range_constexpr(n_stats):
                dsum[s] = sD[c_cols[s, 0][1], state.index]
            for s in cutlass.range_constexpr(n_stats):
                for j in cutlass.range_constexpr(per_stat):
                    dp_cols[s, j] = s_cols[s, j] * (dp_cols[s, j] - dsum[s])
            convert_p_packed(acc_dp, r_ds)
            if cutlass.const_expr(self.dv_after_ds):
                convert_p_packed(acc_s, r_p)  # after dS, which reads P in fp32
            ds_slot = it % DS_STAGES
            cute.autovec_copy(r_ds, thr_sdp.partition_C(sdS[None, None, ds_slot]))  # this thread's dS^T values
            cute.arch.fence_proxy("async.shared", space="cta")  # dS^T stores -> the dQ wgmma's reads
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DS_READY), number_of_threads=self.consumer_threads)
            if cutlass.const_expr(self.dv_after_ds):
                gemm(dkv_mma, acc_dv, tVrP, tVrdO[None, None, None, state.index], zero_init=False)
            # dQ before dK: dQ's trip through sdQ below runs while the tensor cores do dK
            gemm(dq_mma, acc_dq, tQrdS[None, None, None, ds_slot], tQrK, zero_init=True)
            gemm(dkv_mma, acc_dk, tKrdS, tKrQ[None, None, None, state.index], zero_init=False)
            warpgroup.wait_group(1)  # dV, dQ complete (dK may run)
            # dQ's partial sum over this KV tile -> sdQ -> one TMA reduce-add into the fp32
            # accumulator by the dQ warp (padded rows land in its padding)
            for i in cutlass.range_constexpr(cute.size(acc_dq)):
                acc_dq[i] = acc_dq[i] * scale
            # sdQ is free once the dQ warp's reduction of the previous visit has read it
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DQ_EMPTY), number_of_threads=self.dq_threads)
            cute.autovec_copy(acc_dq, thr_dq.partition_C(sdQ[None, None, 0]))
            cute.arch.fence_proxy("async.shared", space="cta")  # the stores -> the TMA unit's reads
            cute.arch.barrier_arrive(barrier_id=int(Sm90BwdBarrier.DQ_FULL), number_of_threads=self.dq_threads)
            warpgroup.wait_group(0)  # dK complete: Q, dO read
            pipeline_q.consumer_release(state)
            pipeline_do.consumer_release(state)
            state.advance()

        # ---- epilogue: dK = scale dS^T Q, dV -> SMEM (over K and V) -> TMA -------------------
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            acc_dk[i] = acc_dk[i] * scale
        gdK = cute.local_tile(mdK[None, None, work.head_kv], (tn, d), (None, 0))
        gdV = cute.local_tile(mdV[None, None, work.head_kv], (tn, d), (None, 0))
        # a variable-length batch's tile past its rows stores nothing: its box would reach the next
        # batch's padded rows (a batched tensor's tile past seqused_k stores its zeros)
        stores = True
        if cutlass.const_expr(self.varlen):
            stores = key0 < k_rows
        if stores:
            store_o(acc_dk, sK, thr_dkv, tma_atom_dk, gdK, work.n_block, int(Sm90BwdBarrier.EPILOGUE_DK),
                    self.consumer_threads, leader)
            store_o(acc_dv, sV, thr_dkv, tma_atom_dv, gdV, work.n_block, int(Sm90BwdBarrier.EPILOGUE_DV),
                    self.consumer_threads, leader)
