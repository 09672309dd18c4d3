"""Index mode's backward on Hopper (SM90): the gradients of FlashMLA's sparse prefill function
(``e_fused.index_attention``), DeepSeek-V4's attention over each token's list of K = V rows.

Token t's heads share its list idx[t, :] of rows of kv (-1: none; a row outside [0, rows) counts
as none). With LSE' the forward's LSE joined with the sink (+inf where no key: P = 0) and
D = rowsum(dO * O), per token (``index.py``'s torch form is the definition):

    P  = exp(scale q k^T - LSE')          dP = dO k^T          dS = P (dP - D)
    dq = scale dS k                       dkv[idx[t, j]] += scale dS^T q + P^T dO   (K = V)

Work decomposition
    grid  = (tokens, heads / 64): one CTA per (token, 64 heads). The heads are the M of every
            GEMM that reduces over the list (as stage D2 packs heads into rows); the CTA walks
            the token's list 64 rows a step. dq (64 heads x 512) accumulates in the consumers'
            registers over the whole list and is stored once, complete, through sQ by one TMA
            store; dkv, which other tokens' CTAs touch too, leaves every step through 16-byte
            fp32 reductions (``red.global.add.v4.f32``, after a lane exchange) into an fp32
            accumulator the host rounds.
    block = 128 x 3 threads:
            warpgroup 0      producer (setmaxnreg 24): warp 0 loads Q and dO of the CTA's heads
                             once (TMA); all 128 threads gather each step's 64 listed rows by
                             cp.async (Hopper's TMA has no gather; common/sm90_gather.py), 16 bytes
                             a copy, a position that names no row zero-filled without a read.
            warpgroups 1, 2  consumers (240): warpgroup w computes S and dP for the step's rows
                             [32 w, 32 w + 32), dq's columns [256 w, 256 w + 256) and dkv's
                             columns [256 w, 256 w + 256) of every row of the step.

Consumer warpgroup w, per step i (rows 64 i .. 64 i + 63 of the list)
    wait KV_FULL(i)
    issue S = Q K^T, dP = dO K^T                      (SS; M 64 heads, N 32 rows, K 512)
    P = exp2(S scale log2 e - LSE2), 0 where the row is none; dS = scale P (dP - D)
    P, dS -> 16 bits -> sP, sdS slot i % 2; DS_READY (both warpgroups' rows are there)
    issue dq += dS K                                  (SS; sdS K-major, K read MN-major)
    wait; arrive KV_EMPTY (the rows' slot may be refilled: the producer gathers step i + 1)
    for each 64-column chunk c of the warpgroup's half:
        issue acc[c % 2] = dS^T Q[:, c] + P^T dO[:, c]  (SS; sdS / sP read MN-major; M 64 rows)
        wait for chunk c - 1's GEMMs only; acc[(c - 1) % 2] -> dkv[idx[t, 64 i + r], c - 1] by
        v4 reductions (rows that name none: skipped), while chunk c's GEMMs run
    wait; the last chunk's reductions
    end: DQ_STAGED (sQ's last reader done); dq -> 16 bits -> sQ; DQ_STAGED; one TMA store.
    The scale rides in dS: dq = (scale dS) K and the key part of dkv = (scale dS)^T Q.

Why two slots of sP / sdS and no barrier freeing them: warpgroup w writes slot i % 2 again at
step i + 2, after passing DS_READY of step i + 1, which the other warpgroup reaches only after
finishing step i, including its dkv GEMMs, the last reads of slot i % 2 (stage F's dense kernel
argues the same for its sdS).

Barriers
    Q_BAR       mbarrier, one phase: Q and dO (TMA, expect-tx).
    KV_FULL     mbarrier, count 128: every producer thread's cp.asyncs of the step have landed
                (cp.async.mbarrier.arrive.noinc). Phase i % 2 at step i.
    KV_EMPTY    mbarrier, count 256: every consumer thread is past the step's dq GEMM, the last
                read of the rows. The producer waits phase (i - 1) % 2 before step i's gather.
    DS_READY    named barrier 1 (256 consumer threads): sP and sdS of the step are written
                (their stores fenced for the async proxy).
    DQ_STAGED   named barrier 2 (256 consumer threads), twice at the end: both warpgroups past
                their last GEMM (sQ free), then every thread's dq in sQ (fenced) before the
                store warp's TMA store of the (64 heads, 512) box Q was loaded by.

Layouts (consumer warpgroup w, warp w' in it, lane l)
    sQ, sdO   (64 heads, 512, 1) K-major SW128 (TMA); sQt, sdOt the same bytes (512, 64, 1)
              MN-major: the B of dkv's GEMMs, cut into (64, 64) column chunks.
    sKV       (64 rows, 512, 1) K-major SW128, filled by the gather (``gather_offset``:
              row r's 16-byte unit u of chunk c at unit u ^ (r % 8)); sKVt (512, 64, 1)
              MN-major: the B of dq.
    sP, sdS   (64 heads, 64 rows, 2) K-major SW128, written from S's partition; sPt, sdSt the
              same bytes (64 rows, 64 heads, 2) MN-major: the A of dkv's GEMMs.
    S, dP     value (c, r, n) of thread (w', l) = S[16 w' + l/4 + 8 r, 32 w + 8 n + 2 (l%4) + c]:
              heads 16 w' + l/4 + 8 r, so a thread's rows statistics are two values (r = 0, 1).
    dkv acc   value (c, r, n) = dkv[16 w' + l/4 + 8 r, 8 n + 2 (l%4) + c] of the chunk, value
              index c + 2 r + 4 n (``common.sm90_reduce.value_quad``). Lanes l and l ^ 1 hold the same two rows and
              together four adjacent columns of each; one shuffle of a pair each way leaves the
              even lane row r = 0's four columns and the odd lane row r = 1's, one 16-byte
              reduction each per n (``common.sm90_reduce``: half the reductions of v2; the
              exchange, its cover and alignment proven on the host:
              tests/test_f_index_sm90_host.py).
"""

from __future__ import annotations

import dataclasses
import enum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from dsv4_attention.common import sm90_gemm as gm
from dsv4_attention.common.p_staging import convert_p_packed
from dsv4_attention.common.sm90_epilogue import store_o
from dsv4_attention.common.sm90_gather import ROW_UNIT_BYTES, cp_async_row_unit, l2_evict_last_policy
from dsv4_attention.common.sm90_kv_chunks import CHUNK_COLS, gather_offset
from dsv4_attention.common.sm90_reduce import reduce_pairs, reduce_targets
from dsv4_attention.common.softmax import acc_rows_view

HEAD_DIM = 512
HEADS_PER_CTA = 64  # the M of every GEMM over the list
ROWS_PER_STEP = 64  # listed rows a step
NUM_WG = 2
DS_STAGES = 2
DKV_CHUNK = 64  # dkv columns per GEMM + reduction round (a warpgroup's half in 4 of them)
UNITS = CHUNK_COLS * 2 // ROW_UNIT_BYTES  # 16-byte units of a 64-column chunk row (8)
CONSUMER_REGS, PRODUCER_REGS = 240, 24


class IndexBwdBarrier(enum.IntEnum):
    DS_READY = 1
    DQ_STAGED = 2  # both warpgroups: past their last GEMM (sQ free), then dq written into sQ


def make_sdp_tiled_mma(dtype) -> cute.TiledMma:
    """S = Q K^T and dP = dO K^T: wgmma 64 x 32 x 16, the two warpgroups side by side along N (the
    step's rows); A (Q, dO) and B (the gathered rows) K-major from SMEM."""
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
                                             (1, NUM_WG, 1), tiler_mn=(gm.WGMMA_M, ROWS_PER_STEP // NUM_WG))


def make_dq_tiled_mma(dtype) -> cute.TiledMma:
    """dq += dS K: wgmma 64 x 256 x 16, the warpgroups side by side along N (dq's columns);
    A = dS K-major (rows are its K), B = the rows MN-major (head dims contiguous)."""
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32,
                                             (1, NUM_WG, 1), tiler_mn=(gm.WGMMA_M, HEAD_DIM // NUM_WG))


def make_dkv_tiled_mma(dtype) -> cute.TiledMma:
    """One warpgroup's dkv chunk, dS^T Q + P^T dO: wgmma 64 x 64 x 16, M = the step's rows;
    A = dS^T / P^T and B = Q / dO, all MN-major from SMEM (the bytes S's layout wrote)."""
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, cutlass.Float32,
                                             (1, 1, 1), tiler_mn=(gm.WGMMA_M, DKV_CHUNK))


def smem_layouts(dtype) -> dict:
    """Every SMEM buffer's layout, by name (see the module doc): each written K-major and read
    through its MN-major transpose too (the ``t`` names)."""
    h, d, n = HEADS_PER_CTA, HEAD_DIM, ROWS_PER_STEP
    out = {}
    for name, rows, cols, stages in (("sQ", h, d, 1), ("sKV", n, d, 1), ("sP", h, n, DS_STAGES)):
        out[name] = gm.make_tile_smem_layout(dtype, rows, cols, stages)
        out[name + "t"] = gm.make_tile_smem_layout_mn(dtype, rows, cols, stages)
    return out


#: the SMEM buffers, and the layout (of ``smem_layouts``) each is read through
VIEWS = {"sQ": ("sQ", "sQ"), "sQt": ("sQ", "sQt"), "sdO": ("sdO", "sQ"), "sdOt": ("sdO", "sQt"),
         "sKV": ("sKV", "sKV"), "sKVt": ("sKV", "sKVt"), "sP": ("sP", "sP"), "sPt": ("sP", "sPt"),
         "sdS": ("sdS", "sP"), "sdSt": ("sdS", "sPt")}


@dataclasses.dataclass
class Smem:
    """The CTA's SMEM views (``VIEWS``) and its three mbarriers (initialised)."""
    q_bar: cute.Pointer
    kv_full: cute.Pointer
    kv_empty: cute.Pointer
    sQ: cute.Tensor
    sQt: cute.Tensor
    sdO: cute.Tensor
    sdOt: cute.Tensor
    sKV: cute.Tensor
    sKVt: cute.Tensor
    sP: cute.Tensor
    sPt: cute.Tensor
    sdS: cute.Tensor
    sdSt: cute.Tensor


@dataclasses.dataclass
class Grads:
    """The token's global operands of the consumers: its list, statistics and gradients' homes."""
    mIdx: cute.Tensor
    mLSE2: cute.Tensor
    mD: cute.Tensor
    mdQ: cute.Tensor
    mdKV: cute.Tensor
    token: cutlass.Int32
    head_block: cutlass.Int32
    steps: cutlass.Int32


class IndexBackwardSm90:
    arch = "sm_90a"

    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int = HEAD_DIM):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim != HEAD_DIM:
            raise ValueError(f"index mode's backward kernel serves head dim {HEAD_DIM}; got {head_dim}")
        self.dtype, self.head_dim, self.num_wg = dtype, head_dim, NUM_WG
        self.consumer_regs, self.producer_regs = CONSUMER_REGS, PRODUCER_REGS
        self.consumer_threads = NUM_WG * gm.THREADS_PER_WARPGROUP
        self.shared_storage = None

    register_plan = gm.register_plan  # the setmaxnreg split, checked against the launch (common/compile.py)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (tokens, heads, d)
        mdO: cute.Tensor,  # (tokens, heads, d)
        mKV: cute.Tensor,  # (rows, d): K = V
        mIdx: cute.Tensor,  # (tokens, k) int32: -1 (or a row outside [0, rows)) names none
        mLSE2: cute.Tensor,  # (tokens, heads) fp32: LSE' log2(e), +inf where no key
        mD: cute.Tensor,  # (tokens, heads) fp32: rowsum(dO * O)
        mdQ: cute.Tensor,  # (tokens, heads, d) like mQ: written whole
        mdKV: cute.Tensor,  # (rows, d) fp32, zeroed: dkv accumulates here
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        lay = smem_layouts(self.dtype)
        sdp_mma, dq_mma, dkv_mma = make_sdp_tiled_mma(self.dtype), make_dq_tiled_mma(self.dtype), \
            make_dkv_tiled_mma(self.dtype)
        # Q and dO as (heads, d, tokens): a CTA's (64, d) tile by one TMA box a 64-column chunk
        q_htd = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        do_htd = cute.make_tensor(mdO.iterator, cute.select(mdO.layout, mode=[1, 2, 0]))
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = gm.make_tma_tile_atom(load, q_htd, lay["sQ"], HEADS_PER_CTA, self.head_dim)
        tma_atom_do, tma_do = gm.make_tma_tile_atom(load, do_htd, lay["sQ"], HEADS_PER_CTA, self.head_dim)
        # dq leaves through sQ by the TMA store of the box Q came in by (same layout, same box)
        dq_htd = cute.make_tensor(mdQ.iterator, cute.select(mdQ.layout, mode=[1, 2, 0]))
        tma_atom_dq, tma_dq = gm.make_tma_tile_atom(cpasync.CopyBulkTensorTileS2GOp(), dq_htd, lay["sQ"],
                                                    HEADS_PER_CTA, self.head_dim)

        @cute.struct
        class SharedStorage:
            q_bar: cutlass.Int64
            kv_full: cutlass.Int64
            kv_empty: cutlass.Int64
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sQ"])], gm.SMEM_ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sQ"])], gm.SMEM_ALIGN]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sKV"])], gm.SMEM_ALIGN]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sP"])], gm.SMEM_ALIGN]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sP"])], gm.SMEM_ALIGN]

        self.shared_storage = SharedStorage
        grid = (mQ.shape[0], mQ.shape[1] // HEADS_PER_CTA, 1)
        self.kernel(sdp_mma, dq_mma, dkv_mma, tma_atom_q, tma_q, tma_atom_do, tma_do, mKV, mIdx, mLSE2, mD,
                    tma_atom_dq, tma_dq, mdKV, scale_log2, scale, lay).launch(
            grid=grid, block=[gm.THREADS_PER_WARPGROUP * (1 + NUM_WG), 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        sdp_mma: cute.TiledMma,
        dq_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA coordinates, (heads, d, tokens)
        tma_atom_do: cute.CopyAtom,
        mdO: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLSE2: cute.Tensor,
        mD: cute.Tensor,
        tma_atom_dq: cute.CopyAtom,
        mdQ: cute.Tensor,  # TMA coordinates, (heads, d, tokens)
        mdKV: cute.Tensor,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        lay: dict,  # smem_layouts(dtype), compile-time
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        token, head_block, _ = cute.arch.block_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_do)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        bars = (storage.q_bar.ptr, storage.kv_full.ptr, storage.kv_empty.ptr)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for bar, count in zip(bars, (1, gm.THREADS_PER_WARPGROUP, self.consumer_threads), strict=True):
                    cute.arch.mbarrier_init(bar, count)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        views = {name: getattr(storage, buf).get_tensor(lay[layout].outer, swizzle=lay[layout].inner)
                 for name, (buf, layout) in VIEWS.items()}
        smem = Smem(*bars, **views)
        steps = cute.ceil_div(mIdx.shape[1], ROWS_PER_STEP)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:  # Q and dO of the CTA's heads, once
                gQ = cute.local_tile(mQ[None, None, token], (HEADS_PER_CTA, self.head_dim), (None, 0))
                gdO = cute.local_tile(mdO[None, None, token], (HEADS_PER_CTA, self.head_dim), (None, 0))
                tQsQ, tQgQ = gm.tile_tma_partition(tma_atom_q, smem.sQ, gQ)
                tOsdO, tOgdO = gm.tile_tma_partition(tma_atom_do, smem.sdO, gdO)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(
                        smem.q_bar, 2 * HEADS_PER_CTA * self.head_dim * self.dtype.width // 8)
                cute.copy(tma_atom_q, tQgQ[None, head_block], tQsQ[None, 0], tma_bar_ptr=smem.q_bar)
                cute.copy(tma_atom_do, tOgdO[None, head_block], tOsdO[None, 0], tma_bar_ptr=smem.q_bar)
            self.gather(mKV, mIdx, smem, storage.sKV.data_ptr(), token, steps)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(sdp_mma, dq_mma, dkv_mma, smem, Grads(mIdx, mLSE2, mD, mdQ, mdKV, token, head_block, steps),
                         scale_log2, scale, tma_atom_dq)

    @cute.jit
    def gather(self, mKV: cute.Tensor, mIdx: cute.Tensor, smem: Smem, kv_base: cute.Pointer, token: cutlass.Int32,
               steps: cutlass.Int32):
        """The producer warpgroup: step i's rows 64 i .. 64 i + 63 of the token's list into sKV once
        the consumers have released it. Thread i copies 16-byte unit i % 8 of rows i / 8 + 16 p
        (p = 0 .. 3) of every 64-column chunk to ``gather_offset`` (stage E's proven map), then
        arrives on KV_FULL when its copies have landed."""
        tidx = cute.arch.thread_idx()[0]  # 0 .. 127
        unit = tidx % UNITS
        passes = ROWS_PER_STEP * UNITS // gm.THREADS_PER_WARPGROUP
        elem = self.dtype.width // 8
        k, rows = mIdx.shape[1], mKV.shape[0]
        g_base = mKV.iterator.toint() + unit * ROW_UNIT_BYTES
        row_stride = cutlass.Int64(mKV.stride[0] * elem)
        src_addr = cute.make_rmem_tensor(passes, cutlass.Int64)
        src_bytes = cute.make_rmem_tensor(passes, cutlass.Int32)
        policy = l2_evict_last_policy()
        s_base = kv_base.toint()  # the slot's first byte: gather_offset swizzles the rest
        for i in cutlass.range(steps, unroll=1):
            for p in cutlass.range_constexpr(passes):
                j = i * ROWS_PER_STEP + tidx // UNITS + p * (gm.THREADS_PER_WARPGROUP // UNITS)
                e = cutlass.Int32(-1)
                if j < k:
                    e = mIdx[token, j]
                ok = (e >= 0) & (e < rows)
                src_addr[p] = g_base + cutlass.Int64(cutlass.max(e, 0) if ok else 0) * row_stride
                src_bytes[p] = cutlass.Int32(ROW_UNIT_BYTES) if ok else cutlass.Int32(0)
            if i > 0:
                cute.arch.mbarrier_wait(smem.kv_empty, (i - 1) & 1)
            for c in cutlass.range_constexpr(self.head_dim // CHUNK_COLS):
                for p in cutlass.range_constexpr(passes):
                    row = tidx // UNITS + p * (gm.THREADS_PER_WARPGROUP // UNITS)
                    s_off = gather_offset(row, unit, c, 0, ROWS_PER_STEP, self.head_dim) * elem
                    cp_async_row_unit(s_base + s_off, src_addr[p] + c * CHUNK_COLS * elem, src_bytes[p], policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(smem.kv_full)

    @cute.jit
    def consume(
        self,
        sdp_mma: cute.TiledMma,
        dq_mma: cute.TiledMma,
        dkv_mma: cute.TiledMma,
        smem: Smem,
        g: Grads,
        scale_log2: cutlass.Float32,
        scale: cutlass.Float32,
        tma_atom_dq: cute.CopyAtom,
    ):
        d, n = self.head_dim, ROWS_PER_STEP
        mIdx, mLSE2, mD, mdQ, mdKV, token, head_block = g.mIdx, g.mLSE2, g.mD, g.mdQ, g.mdKV, g.token, g.head_block
        tidx = cute.arch.thread_idx()[0] - gm.THREADS_PER_WARPGROUP  # 0 .. 255
        wg = cute.arch.make_warp_uniform(tidx // gm.THREADS_PER_WARPGROUP)
        k, rows = mIdx.shape[1], mdKV.shape[0]
        # S, dP: this warpgroup's 32 rows of the step
        wg_sdp = sdp_mma.get_slice(wg * gm.THREADS_PER_WARPGROUP)
        tSrQ = sdp_mma.make_fragment_A(wg_sdp.partition_A(smem.sQ))[None, None, None, 0]
        tSrdO = sdp_mma.make_fragment_A(wg_sdp.partition_A(smem.sdO))[None, None, None, 0]
        tSrKV = sdp_mma.make_fragment_B(wg_sdp.partition_B(smem.sKV))[None, None, None, 0]
        thr_sdp = sdp_mma.get_slice(tidx)
        acc_s = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((HEADS_PER_CTA, n)))
        acc_dp = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((HEADS_PER_CTA, n)))
        tScS = thr_sdp.partition_C(cute.make_identity_tensor((HEADS_PER_CTA, n)))  # (head, row) of each value
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        r_ds = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        # dq: this warpgroup's 256 columns, the whole list
        wg_dq = dq_mma.get_slice(wg * gm.THREADS_PER_WARPGROUP)
        tQrdS = dq_mma.make_fragment_A(wg_dq.partition_A(smem.sdS))  # (MMA, 1, n/16, DS_STAGES)
        tQrKV = dq_mma.make_fragment_B(wg_dq.partition_B(smem.sKVt))[None, None, None, 0]
        thr_dq = dq_mma.get_slice(tidx)
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((HEADS_PER_CTA, d)))
        acc_dq.fill(0.0)
        # dkv: one warpgroup's GEMM, over 64-column chunks of Q^T and dO^T
        wg_dkv = dkv_mma.get_slice(0)
        tDrdS = dkv_mma.make_fragment_A(wg_dkv.partition_A(smem.sdSt))  # (MMA, 1, heads/16, DS_STAGES)
        tDrP = dkv_mma.make_fragment_A(wg_dkv.partition_A(smem.sPt))
        chunks_q = cute.flat_divide(smem.sQt[None, None, 0], (DKV_CHUNK, HEADS_PER_CTA))  # (64, 64, d/64, 1)
        chunks_do = cute.flat_divide(smem.sdOt[None, None, 0], (DKV_CHUNK, HEADS_PER_CTA))
        tDrQ = dkv_mma.make_fragment_B(wg_dkv.partition_B(chunks_q))  # (MMA, 1, heads/16, d/64, 1)
        tDrdO = dkv_mma.make_fragment_B(wg_dkv.partition_B(chunks_do))
        thr_dkv = dkv_mma.get_slice(tidx % gm.THREADS_PER_WARPGROUP)
        acc_dkv = [thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((n, DKV_CHUNK))) for _ in range(2)]
        tDcD = thr_dkv.partition_C(cute.make_identity_tensor((n, DKV_CHUNK)))  # (row, column) of each value
        # the rows statistics of this thread's two heads, for the whole list
        s_rows, dp_rows, c_rows = acc_rows_view(acc_s), acc_rows_view(acc_dp), acc_rows_view(tScS)
        n_stats, per_stat = cute.size(s_rows, mode=[0]), cute.size(s_rows, mode=[1])
        lse = cute.make_rmem_tensor(n_stats, cutlass.Float32)
        dsum = cute.make_rmem_tensor(n_stats, cutlass.Float32)
        head0 = head_block * HEADS_PER_CTA
        for s in cutlass.range_constexpr(n_stats):
            lse[s] = mLSE2[token, head0 + c_rows[s, 0][0]]
            dsum[s] = mD[token, head0 + c_rows[s, 0][0]]
        half = wg * (d // NUM_WG)
        dkv_base = mdKV.iterator.toint()
        dkv_row_bytes = cutlass.Int64(mdKV.stride[0] * 4)
        odd = (tidx % 2) == 1  # lane parity: which row of the pair's two this lane reduces
        # after the exchange: the row (within the step) and first column this lane reduces, per n
        (row_e, col_e), (row_o, col_o) = reduce_targets(tDcD)
        red_row = row_o if odd else row_e
        red_col = col_o if odd else col_e

        cute.arch.mbarrier_wait(smem.q_bar, 0)
        for i in cutlass.range(g.steps, unroll=1):
            row0 = i * n
            cute.arch.mbarrier_wait(smem.kv_full, i & 1)
            gm.gemm(sdp_mma, acc_s, tSrQ, tSrKV, zero_init=True)
            gm.gemm(sdp_mma, acc_dp, tSrdO, tSrKV, zero_init=True)
            warpgroup.wait_group(0)
            for s in cutlass.range_constexpr(n_stats):
                for j in cutlass.range_constexpr(per_stat):
                    r = row0 + c_rows[s, j][1]
                    e = cutlass.Int32(-1)
                    if r < k:
                        e = mIdx[token, r]
                    p = cute.math.exp2(s_rows[s, j] * scale_log2 - lse[s], fastmath=True)
                    p = p if (e >= 0) & (e < rows) else cutlass.Float32(0.0)
                    s_rows[s, j] = p
                    dp_rows[s, j] = p * (dp_rows[s, j] - dsum[s]) * scale
            slot = i % DS_STAGES
            convert_p_packed(acc_s, r_p)
            convert_p_packed(acc_dp, r_ds)
            cute.autovec_copy(r_p, thr_sdp.partition_C(smem.sP[None, None, slot]))
            cute.autovec_copy(r_ds, thr_sdp.partition_C(smem.sdS[None, None, slot]))
            cute.arch.fence_proxy("async.shared", space="cta")  # the stores -> the wgmmas' reads
            cute.arch.barrier(barrier_id=int(IndexBwdBarrier.DS_READY), number_of_threads=self.consumer_threads)
            gm.gemm(dq_mma, acc_dq, tQrdS[None, None, None, slot], tQrKV, zero_init=False)
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(smem.kv_empty)  # the rows are read: the producer may gather the next step
            # the list entry of the row this lane reduces, once a step (a red's memory clobber would
            # reload it after every reduction)
            e_red = cutlass.Int32(-1)
            if row0 + red_row < k:
                e_red = mIdx[token, row0 + red_row]
            red_ok = (e_red >= 0) & (e_red < rows)
            red_addr = dkv_base + cutlass.Int64(cutlass.max(e_red, 0)) * dkv_row_bytes \
                + cutlass.Int64((half + red_col) * 4)
            # dkv a 64-column chunk at a time, the GEMMs of chunk c issued before chunk c - 1's
            # reductions (two accumulators): the reductions overlap the tensor cores' next chunk
            chunks = d // NUM_WG // DKV_CHUNK
            for c in cutlass.range_constexpr(chunks):
                acc = acc_dkv[c % 2]
                chunk = wg * chunks + c
                gm.gemm(dkv_mma, acc, tDrdS[None, None, None, slot], tDrQ[None, None, None, chunk, 0], zero_init=True)
                gm.gemm(dkv_mma, acc, tDrP[None, None, None, slot], tDrdO[None, None, None, chunk, 0], zero_init=False)
                if cutlass.const_expr(c > 0):
                    warpgroup.wait_group(2)  # chunk c - 1's two groups are done, chunk c's may run
                    reduce_pairs(acc_dkv[(c - 1) % 2], red_addr + (c - 1) * DKV_CHUNK * 4, odd, red_ok)
            warpgroup.wait_group(0)
            reduce_pairs(acc_dkv[(chunks - 1) % 2], red_addr + (chunks - 1) * DKV_CHUNK * 4, odd, red_ok)
        # dq (scale already in dS) -> 16 bits -> sQ -> one TMA store of the CTA's (64 heads, d) box
        # (common/sm90_epilogue.store_o: the first DQ_STAGED waits for both warpgroups' last dkv
        # GEMM, sQ's last reader; the second orders the fenced stores before the store warp's TMA).
        # Written straight from the fragment, a thread's 4-byte pieces left in 8-row x 16-byte
        # fragments (4x cuDNN's L2 write sectors, 2026-12-03 profile).
        gdQ = cute.local_tile(mdQ[None, None, token], (HEADS_PER_CTA, d), (None, 0))
        store_o(acc_dq, smem.sQ, thr_dq, tma_atom_dq, gdQ, head_block, int(IndexBwdBarrier.DQ_STAGED),
                self.consumer_threads, cute.arch.make_warp_uniform(tidx // 32) == 0)
