"""Stage F on Hopper (SM90) at head dim 256: the dense backward with dK and dV split by columns.

The same gradients as sm90.py (its module doc has the algorithm), for a head dim whose dK and dV
do not fit that kernel's registers: there a warpgroup holds dK and dV of its 64 keys over every
head dim, 2 x 64 x 256 fp32 = 256 registers a thread at head dim 256, past the 240 it can have,
and 128 keys of K and V with two stages of Q and dO are 256 KB of SMEM. Here (FlashAttention-3's
configuration at 256: 64 x 64 tiles, two warpgroups):

Work decomposition
    grid  = (ceil(seqlen_k / 64), kv_heads, batch): one CTA per 64-key KV tile of one (kv head,
            batch), visiting every (query head of the group, 64-query tile) that sees one of its
            keys (``span.q_tile_range``), as sm90.py's, at tile_n = 64.
    block = 128 x 3 threads:
            warpgroup 0      producer (setmaxnreg 24): warp 0 issues every TMA load (sm90.py's
                             ``load``: K, V once; Q with its LSE2, dO with its D each visit).
            warpgroups 1, 2  consumers (240): warpgroup w computes S and dP for keys
                             [32 w, 32 w + 32) of the tile (the scores are not transposed: rows are
                             queries), then dV, dK and dQ for head-dim columns [128 w, 128 w + 128).

Consumer warpgroup w, per visit (Q tile m of head h)
    issue S = Q K^T, dP = dO V^T                 (SS; M 64 queries, N 32 keys, K 256)
    wait S; P = exp2(S scale log2 e - LSE2), 0 where hidden; wait dP; dS = P (dP - D)
    P, dS -> 16 bits -> sP, sdS slot i % 2; DS_READY (both warpgroups' keys are there)
    issue dQ = dS K[:, w]                        (SS; sdS K-major, K read MN-major, N 128)
    issue dV += P^T dO[:, w], dK += dS^T Q[:, w]   (SS; sP / sdS read MN-major, M 64 keys, N 128)
    wait dQ; dQ * scale -> dQacc by 16-byte reductions (red.global.add.v4.f32 after a lane
    exchange, common/sm90_reduce.py), straight from the registers while dV and dK run: no sdQ,
    whose 64 KB the two stages of Q and dO need
    wait all; release Q, dO
    end: dK *= scale; dK, dV -> SMEM (over K and V) -> TMA stores, each warpgroup its columns.

Why two slots of sP / sdS and no barrier freeing them: warpgroup w writes slot i % 2 again at
visit i + 2, after passing DS_READY of visit i + 1, which the other warpgroup reaches only after
waiting for its GEMMs of visit i, the last reads of slot i % 2 (sm90.py argues the same).

SMEM (bf16, 2 stages): sQ, sdO 2 x 2 x 32 KB, sK, sV 2 x 32 KB, sP, sdS 2 x 2 x 8 KB, LSE2 / D
1 KB: 225 KB of the 227 KB a CTA may have.

Layouts (consumer warpgroup w, warp w' in it, lane l)
    sQ, sdO   (64, 256, stages) K-major SW128 (TMA); sQt, sdOt the same bytes as (256, 64, stages)
              MN-major: the B of dK / dV (a warpgroup's 128 columns).
    sK, sV    (64, 256, 1) K-major SW128; sKt (256, 64, 1) MN-major: the B of dQ.
    sP, sdS   (64 queries, 64 keys, 2) K-major SW128, written from S's partition; sPt, sdSt the
              same bytes as (64 keys, 64 queries, 2) MN-major: the A of dV / dK.
    S, dP     value (c, r, n) = S[16 w' + l/4 + 8 r, 32 w + 8 n + 2 (l%4) + c]: a thread's rows
              statistics are two queries' (r = 0, 1): LSE2 and D from the slot, per row.
    dQ        value (c, r, n) = dQ[16 w' + l/4 + 8 r, 128 w + 8 n + 2 (l%4) + c] (value index
              c + 2 r + 4 n): lanes l and l ^ 1 exchange a pair so that each reduces four
              adjacent columns of one row (``common.sm90_reduce``; the proof is in
              tests/test_f_wide_sm90_host.py).

Deterministic mode (sm90.py's rule, ``span.first_kv_tile``): before a visit's reductions thread 0
of the consumers waits for the KV tile's turn at the Q tile, the 256 consumers meet it
(``span.wait_turn``), add, fence their adds at gpu scope and meet again, and thread 0 passes the
turn (``span.pass_turn``; sm100.py's protocol). Variable-length batches as sm90.py's, their dK /
dV rows padded per request by this kernel's 64-key tile (``TILE_N``: the host pads by it).
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from dsv4_attention.common.kv_span import row_keys
from dsv4_attention.common.p_staging import convert_p_packed
from dsv4_attention.common.sm90_barriers import Sm90BwdBarrier
from dsv4_attention.common.sm90_epilogue import store_o
from dsv4_attention.common.sm90_gemm import (
    SMEM_ALIGN,
    THREADS_PER_WARPGROUP,
    WGMMA_M,
    gemm,
    make_tile_smem_layout,
    make_tile_smem_layout_mn,
)
from dsv4_attention.common.sm90_reduce import reduce_pairs, reduce_targets
from dsv4_attention.common.softmax import acc_rows_view
from dsv4_attention.stages.f_backward.sm90 import (
    CONSUMER_REGS,
    DS_STAGES,
    NUM_WG,
    PRODUCER_REGS,
    FlashAttentionBackwardSm90,
)
from dsv4_attention.stages.f_backward.span import Visits, cta_views, kernel_views, pass_turn, wait_turn

WIDE_HEAD_DIMS = (256,)
TILE_N = 64  # keys per CTA


def make_sdp_tiled_mma(dtype: type[cutlass.Numeric]) -> cute.TiledMma:
    """S = Q K^T, dP = dO V^T: wgmma 64 x 32 x 16, the two warpgroups side by side along N (the
    tile's keys); A (Q, dO) and B (K, V) K-major from SMEM."""
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
                                             (1, NUM_WG, 1), tiler_mn=(WGMMA_M, TILE_N // NUM_WG))


def make_dkv_tiled_mma(dtype: type[cutlass.Numeric], head_dim: int) -> cute.TiledMma:
    """One warpgroup's dV += P^T dO and dK += dS^T Q over its half of the head dims: wgmma
    64 x (d/2) x 16, M = the tile's keys; A (sPt, sdSt) and B (sdOt, sQt) MN-major from SMEM."""
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, cutlass.Float32,
                                             (1, 1, 1), tiler_mn=(WGMMA_M, head_dim // NUM_WG))


def make_dq_tiled_mma(dtype: type[cutlass.Numeric], head_dim: int) -> cute.TiledMma:
    """dQ = dS K: wgmma 64 x (d/2) x 16, the warpgroups side by side along N (dQ's columns);
    A = sdS K-major (keys are its K), B = sKt MN-major (head dims contiguous)."""
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32,
                                             (1, NUM_WG, 1), tiler_mn=(WGMMA_M, head_dim // NUM_WG))


def smem_layouts(dtype: type[cutlass.Numeric], head_dim: int, tile_m: int, stages: int) -> dict:
    """Every SMEM buffer's layout, by name (the module doc): each written K-major and read through
    its MN-major transpose too (the ``t`` names)."""
    out = {}
    for name, rows, cols, n in (("sQ", tile_m, head_dim, stages), ("sK", TILE_N, head_dim, 1),
                                ("sP", tile_m, TILE_N, DS_STAGES)):
        out[name] = make_tile_smem_layout(dtype, rows, cols, n)
        out[name + "t"] = make_tile_smem_layout_mn(dtype, rows, cols, n)
    return out


#: the SMEM buffers, and the layout (of ``smem_layouts``) each is read through
VIEWS = {"sQ": ("sQ", "sQ"), "sQt": ("sQ", "sQt"), "sdO": ("sdO", "sQ"), "sdOt": ("sdO", "sQt"),
         "sK": ("sK", "sK"), "sKt": ("sK", "sKt"), "sV": ("sV", "sK"), "sP": ("sP", "sP"), "sPt": ("sP", "sPt"),
         "sdS": ("sdS", "sP"), "sdSt": ("sdS", "sPt")}


class FlashAttentionBackwardSm90Wide(FlashAttentionBackwardSm90):
    """sm90.py's kernel class at head dim 256: its producer (``load``), its grid and visits; its own
    layouts, MMAs and consumers (the module doc)."""

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
        stages: int = 2,
    ):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in WIDE_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {WIDE_HEAD_DIMS}, got {head_dim}")
        self.dtype, self.head_dim = dtype, head_dim
        self.has_left, self.has_right, self.deterministic = has_left, has_right, deterministic
        self.has_seqused, self.varlen = has_seqused, varlen
        self.tile_m, self.tile_n, self.stages = WGMMA_M, TILE_N, stages
        self.num_wg = NUM_WG
        self.consumer_regs, self.producer_regs = CONSUMER_REGS, PRODUCER_REGS
        self.consumer_threads = NUM_WG * THREADS_PER_WARPGROUP
        self.shared_storage = None

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mSem, mSeqused, mCuQ, mCuK, max_seqlen_k,
                 scale_log2, scale, left, right, stream):
        """sm90.py's launch arguments."""
        seqlen_q, seqlen_k, mQ, mK, mV, mdO, mdK, mdV, mdQacc, mLSE2, mD = kernel_views(
            self.dtype, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV)
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        lay = smem_layouts(self.dtype, d, tm, self.stages)
        sdp_mma, dkv_mma, dq_mma = make_sdp_tiled_mma(self.dtype), make_dkv_tiled_mma(self.dtype, d), \
            make_dq_tiled_mma(self.dtype, d)
        (tma_atom_q, tma_q), (tma_atom_do, tma_do), (tma_atom_k, tma_k), (tma_atom_v, tma_v), \
            (tma_atom_dk, tma_dk), (tma_atom_dv, tma_dv), (tma_atom_lse, tma_lse), (tma_atom_d, tma_d) = \
            self.tile_tma_atoms(mQ, mdO, mK, mV, mdK, mdV, mLSE2, mD, lay["sQ"], lay["sK"])
        sStat_layout = cute.make_layout((tm, self.stages))

        @cute.struct
        class SharedStorage:
            kv_bar: cutlass.Int64
            q_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]  # full, then empty
            do_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sQ"])], SMEM_ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sQ"])], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sK"])], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sK"])], SMEM_ALIGN]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sP"])], SMEM_ALIGN]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sP"])], SMEM_ALIGN]
            sLSE: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sStat_layout)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sStat_layout)], 128]

        self.shared_storage = SharedStorage
        kv_tiles = cute.ceil_div(max_seqlen_k if cutlass.const_expr(self.varlen) else seqlen_k, tn)
        batches = mCuQ.shape[0] - 1 if cutlass.const_expr(self.varlen) else mK.shape[3]
        grid = (kv_tiles, mK.shape[2], batches)
        self.kernel(
            sdp_mma, dkv_mma, dq_mma,
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_dk, tma_dk, tma_atom_dv, tma_dv, tma_atom_lse, tma_lse, tma_atom_d, tma_d,
            mdQacc, mSem, mSeqused, mCuQ, mCuK, scale_log2, scale, left, right, seqlen_q, seqlen_k, lay, sStat_layout,
        ).launch(grid=grid, block=[THREADS_PER_WARPGROUP * (1 + self.num_wg), 1, 1], stream=stream,
                 min_blocks_per_mp=1)

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
        tma_atom_lse: cute.CopyAtom,
        mLSE2: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        mD: cute.Tensor,
        mdQacc: cute.Tensor,  # (rows, d, heads, batch) fp32: the reductions' addresses
        mSem: cute.Tensor,  # (batch, heads, Q tiles) int32: dQ's turns (deterministic only)
        mSeqused: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        left: cutlass.Int32,
        right: cutlass.Int32,
        seqlen_q: cutlass.Int32,
        seqlen_k: cutlass.Int32,
        lay: dict,  # smem_layouts(...), compile-time
        sStat_layout: cute.Layout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head_kv, batch = cute.arch.block_idx()
        group = mQ.shape[2] // mK.shape[2]
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_dk, tma_atom_dv, tma_atom_lse,
                         tma_atom_d):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        kv_bar = storage.kv_bar.ptr
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(kv_bar, 1)
        pipeline_q, pipeline_do = self.q_do_pipelines(storage)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        s = {name: getattr(storage, buf).get_tensor(lay[layout].outer, swizzle=lay[layout].inner)
             for name, (buf, layout) in VIEWS.items()}
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sD = storage.sD.get_tensor(sStat_layout)
        views = cta_views((mQ, mdO), (mK, mV), (mLSE2, mD, mdQacc), (mdK, mdV), n_block, head_kv, batch, group,
                          seqlen_q, seqlen_k, left, right, mSeqused, mCuQ, mCuK, self.tile_m, self.tile_n,
                          self.has_left, self.has_right, self.has_seqused, self.varlen)
        (mQ, mdO), (mK, mV), (mLSE2, mD, mdQacc), (mdK, mdV) = views[:4]
        work, k_rows = views.work, views.k_rows

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(kv_bar, pipeline_q, pipeline_do, work, tma_atom_q, mQ, s["sQ"], tma_atom_do, mdO, s["sdO"],
                          tma_atom_k, mK, s["sK"], tma_atom_v, mV, s["sV"], tma_atom_lse, mLSE2, sLSE, tma_atom_d, mD,
                          sD)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume_wide(sdp_mma, dkv_mma, dq_mma, kv_bar, pipeline_q, pipeline_do, s, sLSE, sD, mdQacc, mSem,
                              tma_atom_dk, mdK, tma_atom_dv, mdV, scale_log2, scale, left, right, work, k_rows, batch)

    @cute.jit
    def consume_wide(
        self,
        sdp_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        dq_mma: cute.TiledMma,
        kv_bar: cute.Pointer,
        pipeline_q: pipeline.PipelineTmaAsync,
        pipeline_do: pipeline.PipelineTmaAsync,
        s: dict,  # the SMEM views (VIEWS)
        sLSE: cute.Tensor,
        sD: cute.Tensor,
        mdQacc: cute.Tensor,  # the batch's (rows, d, heads) fp32 accumulator
        mSem: cute.Tensor,
        tma_atom_dk: cute.CopyAtom, mdK: cute.Tensor, tma_atom_dv: cute.CopyAtom, mdV: cute.Tensor,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        left: cutlass.Int32,
        right: cutlass.Int32,
        work: Visits,
        k_rows: cutlass.Int32,
        batch: cutlass.Int32,
    ):
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        half = d // NUM_WG
        seqlen_q, seqlen_k = work.seqlen_q, work.seqlen_k
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP  # 0 .. 255
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # S, dP: this warpgroup's 32 keys
        wg_sdp = sdp_mma.get_slice(wg * THREADS_PER_WARPGROUP)
        tSrQ = sdp_mma.make_fragment_A(wg_sdp.partition_A(s["sQ"]))  # (MMA, 1, d/16, stages)
        tSrdO = sdp_mma.make_fragment_A(wg_sdp.partition_A(s["sdO"]))
        tSrK = sdp_mma.make_fragment_B(wg_sdp.partition_B(s["sK"]))[None, None, None, 0]
        tSrV = sdp_mma.make_fragment_B(wg_sdp.partition_B(s["sV"]))[None, None, None, 0]
        thr_sdp = sdp_mma.get_slice(tidx)
        acc_s = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((tm, tn)))
        acc_dp = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((tm, tn)))
        tScS = thr_sdp.partition_C(cute.make_identity_tensor((tm, tn)))  # (query, key) of each value
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        r_ds = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        # dV, dK: this warpgroup's half of the head dims, every key of the tile
        wg_dkv = dkv_mma.get_slice(0)
        tDrP = dkv_mma.make_fragment_A(wg_dkv.partition_A(s["sPt"]))  # (MMA, 1, tm/16, DS_STAGES)
        tDrdS = dkv_mma.make_fragment_A(wg_dkv.partition_A(s["sdSt"]))
        halves_q = cute.flat_divide(s["sQt"], (half, tm))  # (d/2, tm, 2, 1, stages)
        halves_do = cute.flat_divide(s["sdOt"], (half, tm))
        tDrQ = dkv_mma.make_fragment_B(wg_dkv.partition_B(halves_q))  # (MMA, 1, tm/16, 2, 1, stages)
        tDrdO = dkv_mma.make_fragment_B(wg_dkv.partition_B(halves_do))
        thr_dkv = dkv_mma.get_slice(tidx % THREADS_PER_WARPGROUP)
        acc_dv = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((tn, half)))
        acc_dk = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((tn, half)))
        # dQ: this warpgroup's half of the head dims
        wg_dq = dq_mma.get_slice(wg * THREADS_PER_WARPGROUP)
        tQrdS = dq_mma.make_fragment_A(wg_dq.partition_A(s["sdS"]))  # (MMA, 1, tn/16, DS_STAGES)
        tQrK = dq_mma.make_fragment_B(wg_dq.partition_B(s["sKt"]))[None, None, None, 0]
        thr_dq = dq_mma.get_slice(tidx)
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((tm, d)))
        tQcQ = thr_dq.partition_C(cute.make_identity_tensor((tm, d)))  # (query, column) of each value
        # the rows statistics: two queries a thread (``acc_rows_view``)
        s_rows, dp_rows, c_rows = acc_rows_view(acc_s), acc_rows_view(acc_dp), acc_rows_view(tScS)
        n_stats, per_stat = cute.size(s_rows, mode=[0]), cute.size(s_rows, mode=[1])
        lse = cute.make_rmem_tensor(n_stats, cutlass.Float32)
        dsum = cute.make_rmem_tensor(n_stats, cutlass.Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        offset = seqlen_k - seqlen_q  # query i sits at i + offset among the keys
        key0 = work.n_block * tn
        odd = (tidx % 2) == 1  # lane parity: which row of the pair's two this lane reduces
        (row_e, col_e), (row_o, col_o) = reduce_targets(tQcQ)  # where this lane's reductions go
        red_row = row_o if odd else row_e
        red_col = col_o if odd else col_e
        dq_base = mdQacc.iterator.toint()
        dq_row_bytes = cutlass.Int64(mdQacc.stride[0] * 4)
        dq_head_bytes = cutlass.Int64(mdQacc.stride[2] * 4)

        if work.visits > 0:
            cute.arch.mbarrier_wait(kv_bar, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for it in cutlass.range(work.visits, unroll=1):
            head, m_block = work.at(it)
            q0 = m_block * tm
            pipeline_q.consumer_wait(state)
            gemm(sdp_mma, acc_s, tSrQ[None, None, None, state.index], tSrK, zero_init=True)
            pipeline_do.consumer_wait(state)
            gemm(sdp_mma, acc_dp, tSrdO[None, None, None, state.index], tSrV, zero_init=True)
            for r in cutlass.range_constexpr(n_stats):  # the slot's statistics of this thread's queries
                lse[r] = sLSE[c_rows[r, 0][0], state.index]
                dsum[r] = sD[c_rows[r, 0][0], state.index]
            warpgroup.wait_group(1)  # S complete
            for r in cutlass.range_constexpr(n_stats):
                # the query's visible keys [lo, hi): the forward's one per-row rule (common/kv_span.py)
                lo, hi = row_keys(q0 + c_rows[r, 0][0] + offset, seqlen_k, left, right, self.has_left,
                                  self.has_right)
                for j in cutlass.range_constexpr(per_stat):
                    key = key0 + c_rows[r, j][1]
                    hidden = key >= hi
                    if cutlass.const_expr(self.has_left):
                        hidden = hidden | (key < lo)
                    p = cute.math.exp2(s_rows[r, j] * scale_log2 - lse[r], fastmath=True)
                    s_rows[r, j] = cutlass.Float32(0.0) if hidden else p
            warpgroup.wait_group(0)  # dP complete
            for r in cutlass.range_constexpr(n_stats):
                for j in cutlass.range_constexpr(per_stat):
                    dp_rows[r, j] = s_rows[r, j] * (dp_rows[r, j] - dsum[r])
            slot = it % DS_STAGES
            convert_p_packed(acc_s, r_p)
            convert_p_packed(acc_dp, r_ds)
            cute.autovec_copy(r_p, thr_sdp.partition_C(s["sP"][None, None, slot]))
            cute.autovec_copy(r_ds, thr_sdp.partition_C(s["sdS"][None, None, slot]))
            cute.arch.fence_proxy("async.shared", space="cta")  # the stores -> the wgmmas' reads
            cute.arch.barrier(barrier_id=int(Sm90BwdBarrier.DS_READY), number_of_threads=self.consumer_threads)
            # dQ first: its reductions below run while the tensor cores do dV and dK
            gemm(dq_mma, acc_dq, tQrdS[None, None, None, slot], tQrK, zero_init=True)
            gemm(dkv_mma, acc_dv, tDrP[None, None, None, slot], tDrdO[None, None, None, wg, 0, state.index],
                 zero_init=False)
            gemm(dkv_mma, acc_dk, tDrdS[None, None, None, slot], tDrQ[None, None, None, wg, 0, state.index],
                 zero_init=False)
            warpgroup.wait_group(2)  # dQ complete (dV, dK may run)
            # dQ's partial sum over this KV tile into the fp32 accumulator (padded rows land in its
            # padding: rows are padded to the Q tile)
            for i in cutlass.range_constexpr(cute.size(acc_dq)):
                acc_dq[i] = acc_dq[i] * scale
            addr = dq_base + cutlass.Int64(q0 + red_row) * dq_row_bytes + cutlass.Int64(head) * dq_head_bytes \
                + cutlass.Int64(red_col * 4)
            if cutlass.const_expr(self.deterministic):  # the KV tiles' sums in KV-tile order (sm90.py)
                turns = mSem[batch, head, None].iterator + m_block
                wait_turn(turns, work, m_block, left, tidx, tn, tm, self.has_left, int(Sm90BwdBarrier.DQ_TURN),
                          self.consumer_threads)
            reduce_pairs(acc_dq, addr, odd, True)
            if cutlass.const_expr(self.deterministic):
                pass_turn(turns, tidx, int(Sm90BwdBarrier.DQ_TURN), self.consumer_threads)
            warpgroup.wait_group(0)  # dV, dK complete: Q, dO and the P / dS slot are read
            pipeline_q.consumer_release(state)
            pipeline_do.consumer_release(state)
            state.advance()

        # ---- epilogue: dK = scale dS^T Q, dV -> SMEM (over K and V, each warpgroup its columns) -> TMA
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            acc_dk[i] = acc_dk[i] * scale
        gdK = cute.local_tile(mdK[None, None, work.head_kv], (tn, d), (None, 0))
        gdV = cute.local_tile(mdV[None, None, work.head_kv], (tn, d), (None, 0))
        leader = tidx // 32 == 0  # the warp that issues the dK / dV stores
        # a variable-length batch's tile past its rows stores nothing: its box would reach the next
        # batch's padded rows (a batched tensor's tile past seqused_k stores its zeros)
        stores = True
        if cutlass.const_expr(self.varlen):
            stores = key0 < k_rows
        if stores:
            self.store_halves(acc_dk, acc_dv, s, thr_dkv, tma_atom_dk, gdK, tma_atom_dv, gdV, work.n_block, wg, leader)

    @cute.jit
    def store_halves(self, acc_dk, acc_dv, s, thr_dkv, tma_atom_dk, gdK, tma_atom_dv, gdV, n_block, wg, leader):
        """dK and dV of the tile -> SMEM over K and V, each warpgroup its half of the head dims, then
        one TMA store each (common/sm90_epilogue.store_o)."""
        tn, half = self.tile_n, self.head_dim // NUM_WG
        sK_mine = cute.local_tile(cute.domain_offset((0, wg * half), s["sK"][None, None, 0]), (tn, half), (0, 0))
        sV_mine = cute.local_tile(cute.domain_offset((0, wg * half), s["sV"][None, None, 0]), (tn, half), (0, 0))
        store_o(acc_dk, s["sK"], thr_dkv, tma_atom_dk, gdK, n_block, int(Sm90BwdBarrier.EPILOGUE_DK),
                self.consumer_threads, leader, sO_mine=sK_mine)
        store_o(acc_dv, s["sV"], thr_dkv, tma_atom_dv, gdV, n_block, int(Sm90BwdBarrier.EPILOGUE_DV),
                self.consumer_threads, leader, sO_mine=sV_mine)
