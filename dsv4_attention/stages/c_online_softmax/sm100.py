"""Stage C on Blackwell (SM100, sm_100a): attention over any seqlen_k, online softmax, O corrected in TMEM.

What it computes
----------------
    x[i, j]      = scale_log2 * Q[b, i, h] . K[b, j, hk]           for every key j < seqlen_k
    O[b, i, h]   = sum_j exp2(x[i, j] - m[i]) V[b, j, hk] / l[i]   (m: a max of row i; l: the sum)
    LSE[b, h, i] = (m[i] + log2 l[i]) * ln 2                        fp32, natural log

with hk = h // (heads // kv_heads), any seqlen_k >= 1 (0 is answered on the host), any seqlen_q.
Q, K, V, O are (batch, seqlen, heads, head_dim), bf16 or fp16, head_dim 64 / 128 / 256 fixed per
instance; every extent is dynamic. Stage B's tile (S in TMEM, P written over S, TS PV MMA) runs
over n = ceil(seqlen_k / 128) KV tiles with a running max m and sum l per row
(``common.sm100_softmax``: lazy rescale, threshold 8 in log2 units, one vote per warp).

One CTA owns Q_TILES 128-row Q tiles (FlashAttention-4's two tiles in flight, so the tensor core
works on one tile while the softmax of the other runs): Q_TILES = 2 at head_dim 64 / 128, 1 at 256
(two S and two O would need 768 TMEM columns). grid = (ceil(seqlen_q / (128 Q_TILES)), heads, batch).
The KV tiles are visited last first, a = n - 1, n - 2, ..., 0 (iteration it visits tile n - 1 - it):
the only partial tile, the one that needs the seqlen_k mask, is then the first one every row sees,
and it holds at least one valid key, so every row's max is finite from the first iteration on.

Warp roles (Q = Q_TILES; 512 threads at Q = 2, 320 at Q = 1)
-------------------------------------------------------------
    warps 4i .. 4i+3   softmax of Q tile i: thread t (0..127) owns row t of S_i, P_i, and of m, l.
    warps 4Q .. 4Q+3   correction: thread t owns row t of every O_i: rescales it in TMEM when its
                       warp's max grew, and runs the epilogue (O / l -> SMEM -> TMA store, LSE).
    warp  4Q + 4       MMA: allocates TMEM; QK (SS) into S_i, PV (TS: A = P_i from TMEM) into O_i.
    warp  4Q + 5       TMA: Q tiles once; K and V tiles through the ring (``common.sm100_kv``).
    warps 14, 15       (Q = 2 only) idle: they complete the fourth warpgroup and give their
                       registers away. 512 threads start with 128 registers each (the whole file);
                       setmaxnreg moves them to 192 (softmax) / 80 (correction) / 48 (the rest),
                       FlashAttention-4's split: 256 x 192 + 128 x 80 + 128 x 48 = 512 x 128.
                       At Q = 1 the 320 threads start with 168 and nothing is moved.

Barriers: who arrives, who waits (use u of a barrier is waited for with parity u & 1)
-------------------------------------------------------------------------------------
    q[i]          TMA -> MMA           Q tile i landed (bytes of a whole tile). Used once.
    kv[s]         TMA <-> MMA          ring stage s full (tile bytes) / empty (tcgen05.commit
                                       after the MMAs that read it). Order: K_a V_a K_b V_b ...
    s_full[i]     MMA -> softmax i     use it: S_i(it) = Q_i K^T is in TMEM. tcgen05.commit after
                                       the QK MMAs; it also covers every earlier MMA, in particular
                                       PV_i(it - 1): once S_i(it) is full, O_i holds tiles < it.
    stats[i, w]   softmax warp 4i + w  a Handoff (full / empty) of the SMEM slots of rows
                   <-> correction      32w .. 32w + 31 of tile i: use it - 1 (it >= 1) carries the
                   warp 4Q + w         factor exp2(m_old - m_new) of iteration it; use n - 1 the
                                       final (l, m). Written before P is computed, so the
                                       correction overlaps the exp2.
    pv_ready[i]   softmax i (128) +    use it: P_i(it) is in TMEM (each softmax thread: tcgen05.st,
                  correction (128)     wait::st, fence::before_thread_sync, arrive) and O_i is
                   -> MMA              rescaled for iteration it (correction: wait::st, fence,
                                       arrive; at it = 0 at once). The MMA waits, fences
                                       (after_thread_sync) and issues PV_i(it).
    o_full[i]     MMA -> correction    tcgen05.commit after the last PV_i: O_i final. Used once.
    tmem          named barrier 1      TmemAllocator's handshake; dealloc after every softmax and
                                       correction thread's last TMEM access.
    epilogue      named barrier 2      the 128 correction threads wrote sO_i (and fenced) before
                                       one of them issues its TMA store.

One iteration (it >= 1), as the MMA warp issues it, with V' = the ring stage of V_(a+1):

    MMA:   wait pv_ready[0]; PV_0 += P_0 V' | wait K_a; S_0 = Q_0 K_a; commit s_full[0]
           wait pv_ready[1]; PV_1 += P_1 V' |           S_1 = Q_1 K_a; commit s_full[1]
           commit kv.empty(V'), kv.empty(K_a)
    softmax i: wait s_full[i]; S_i -> registers; mask (it = 0); m, scale = lazy update (vote);
           stats[i, w] <- scale; P = exp2(x - m) -> TMEM over S_i; l = l * scale + sum P;
           arrive pv_ready[i]
    correction: for i: stats[i, w] -> scale; if the warp's scale < 1 anywhere: O_i rows *= scale
           (ld, mul, st, wait::st); arrive pv_ready[i]

S_i(it + 1) overwrites S_i and P_i only after PV_i(it) was issued: the MMA warp issues the QK
after the PV, and tcgen05.mma runs in issue order (FlashAttention-4 and CUTLASS rely on it too).
Why each wait names the right phase: every barrier of a slot is used once per iteration, in
order, and cannot complete its next use before the waiter has waited (``common.sm100_sync``):
s_full[i](it + 1) needs pv_ready[i](it), which needs softmax i past its s_full wait;
pv_ready[i](it + 1) needs s_full[i](it + 1), issued after the MMA's pv_ready wait; stats uses
alternate with their releases.

TMEM (fp32 columns, lane m = row m; ``common.tmem.AttentionTmemMap.packed``)
--------------------------------------------------------------------------
    Q_TILES = 2:  0 ..... 127 | 128 ..... 255 | 256 .. 256+d-1 | 256+d .. 256+2d-1      (d = 64, 128)
                  S0 (P0 over | S1 (P1 over   | O0             | O1
                  64 .. 127)  | 192 .. 255)   |                |
    Q_TILES = 1:  0 ..... 127 | 128 .... 383                                             (d = 256)
                  S0 (P0)     | O0
    P_i(m, k) at lane m, column 128 i + 64 + k // 2, half k % 2. Allocation: 512 columns always
    (384 / 512 / 384 used, rounded to a power of two). Softmax warpgroup i addresses S_i and P_i as
    S_0 and P_0 moved by 128 i columns (i = its warpgroup, a runtime value); the host proof checks
    that this lands on the map's S_i and P_i.

SMEM
----
    sQ      Q_TILES x (128 rows x d), K-major, 128B swizzle:  S<3,4,3> o ((128,16),1,(4,d/64),Q):
            ((64,1),0,(16,8192),128 d). 16 / 32 / 32 KiB per tile.
    sO_i    over sQ_i's bytes (128 x d row-major, 128B swizzle, 64-column blocks). sQ_i's last
            reader is the last QK MMA of tile i, which has completed when o_full[i] arrives.
    ring    KV_STAGES x (128 keys x d), K and V views of the same bytes (``common.sm100_kv``):
            4 / 4 / 2 stages of 16 / 32 / 64 KiB.
    stats   fp32 (128 rows, 2, Q_TILES): [r, 0, i] = row r's rescale factor, then its l;
            [r, 1, i] = its final m. Slot r is written by the softmax thread that owns row r of S_i
            and read by the correction thread that owns row r of O_i (both index it by their
            partition's row coordinate; proven on the host, with the warp pairing of stats[i, w]).
    Total: 96 / 192 / 192 KiB of tiles + 2 to 3 KiB of barriers, stats and alignment
    (101376 / 199680 / 198656 bytes at d = 64 / 128 / 256).
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

from dsv4_attention.common.compile import SMEM_LIMIT
from dsv4_attention.common.layouts import check_attention_operands, reorder, seq_major
from dsv4_attention.common.mask import mask_seqlen_k, num_kv_tiles
from dsv4_attention.common.sm100_correction import o_row_to_smem, rescale_o_row
from dsv4_attention.common.sm100_kv import (
    KV_TILE,
    kv_ring_stages,
    load_tile,
    make_kv_ring_layouts,
    make_kv_tma_atoms,
    partition_kv_loads,
)
from dsv4_attention.common.sm100_qk import issue_qk_tile, make_qk_smem_layouts, qk_tile_tiler
from dsv4_attention.common.sm100_softmax import RESCALE_THRESHOLD, exp2_into_p, lazy_max_update, row_max
from dsv4_attention.common.sm100_sync import Handoff, UseCountedBarriers
from dsv4_attention.common.tmem import (
    EPI_COLS,
    EPI_THREADS,
    PV_TILE_K,
    QK_TILE_M,
    QK_TILE_N,
    AttentionTmemMap,
    epi_view,
    fence_after_thread_sync,
    fence_before_thread_sync,
    make_acc_tmem_load,
    make_acc_tmem_store,
    make_p_tmem_store,
    make_pv_tiled_mma,
    make_qk_tiled_mma,
    p_chunk_view,
    q_tiles_in_flight,
    uniform_stride,
)

LN2 = math.log(2.0)
# (batch, seqlen_k, kv_heads, head_dim) -> (head_dim, seqlen_k, kv_heads, batch): V as the PV B operand
V_AS_PV_B = (3, 1, 2, 0)
# (batch, heads, seqlen_q) -> (seqlen_q, heads, batch)
LSE_ROW_MAJOR = (2, 1, 0)
#: SMEM kept for barriers, the stats slots and alignment when sizing the K/V ring
SMEM_RESERVE = 4096
#: setmaxnreg targets with two Q tiles (512 threads start with 128 registers each, the whole
#: register file): 8 softmax warps x 192 + 4 correction warps x 80 + 4 other warps x 48 = 512 x 128
REGS_SOFTMAX, REGS_CORRECTION, REGS_OTHER = 192, 80, 48


class FlashAttentionSm100:
    """O = softmax(scale * Q K^T) V and LSE for any seqlen_k on SM100: KV tiles pipelined through
    SMEM, online softmax with lazy rescale, O corrected in TMEM by dedicated correction warps."""

    arch = "sm_100a"

    def __init__(self, dtype, head_dim: int):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"FlashAttentionSm100: dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in (64, 128, 256):
            raise ValueError(f"FlashAttentionSm100: head_dim must be 64, 128 or 256, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.q_tiles = q_tiles_in_flight(head_dim)
        self.cta_rows = QK_TILE_M * self.q_tiles

        # warp w reaches TMEM lanes 32 (w % 4) ..: each role's four warps start at a multiple of 4
        self.softmax_warps = tuple(range(4 * self.q_tiles))
        self.correction_warps = tuple(range(4 * self.q_tiles, 4 * self.q_tiles + 4))
        self.mma_warp = 4 * self.q_tiles + 4
        self.tma_warp = 4 * self.q_tiles + 5
        # two Q tiles: the softmax warps need more than the 128 registers each of 512 threads
        # starts with, so setmaxnreg moves registers to them. PTX wants the same setmaxnreg from
        # every warp of a warpgroup: 2 idle warps complete the fourth one (FlashAttention-4's 16)
        self.rebalance_registers = self.q_tiles == 2
        self.idle_warps = (self.tma_warp + 1, self.tma_warp + 2) if self.rebalance_registers else ()
        self.threads_per_cta = 32 * (self.tma_warp + 1 + len(self.idle_warps))
        # named barriers (0 is __syncthreads)
        self.tmem_barrier_id = 1
        self.epi_barrier_id = 2
        self.tmem_users = 32 + EPI_THREADS * (self.q_tiles + 1)  # MMA, softmax, correction

        # set when __call__ is traced
        self.shared_storage = None
        self.tmem_columns = None
        self.kv_stages = None

    def register_plan(self) -> list | None:
        """[(threads, setmaxnreg target), ...] per role with two Q tiles (None: setmaxnreg unused):
        the softmax warps, the correction warps, and every other warp (TMA, MMA, idle)."""
        if not self.rebalance_registers:
            return None
        softmax, correction = 32 * len(self.softmax_warps), 32 * len(self.correction_warps)
        return [(softmax, REGS_SOFTMAX), (correction, REGS_CORRECTION),
                (self.threads_per_cta - softmax - correction, REGS_OTHER)]

    # /////////////////////////////////////////////////////////////////////////////////////
    #  host: layouts, TMA atoms, launch
    # /////////////////////////////////////////////////////////////////////////////////////
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
        o = seq_major(mO)
        lse = reorder(mLSE, LSE_ROW_MAJOR)  # (seqlen_q, heads, batch)

        qk_mma = make_qk_tiled_mma(self.dtype)
        pv_mma = make_pv_tiled_mma(self.dtype, self.head_dim)
        tmem_map = AttentionTmemMap.packed(self.dtype, self.head_dim, self.q_tiles)
        self.tmem_columns = tmem_map.alloc_columns()

        q_smem, _ = make_qk_smem_layouts(qk_mma, self.dtype, self.q_tiles, qk_tile_tiler(self.head_dim), 1)
        q_bytes = cute.size_in_bytes(self.dtype, q_smem)
        self.kv_stages = kv_ring_stages(self.dtype, self.head_dim, SMEM_LIMIT - q_bytes - SMEM_RESERVE)
        k_smem, v_smem = make_kv_ring_layouts(qk_mma, pv_mma, self.dtype, self.head_dim, self.kv_stages)
        o_smem = sm100_utils.make_smem_layout_epi(self.dtype, LayoutEnum.ROW_MAJOR, (QK_TILE_M, self.head_dim), 1)
        # sO_i reuses sQ_i's bytes: Q tile i starts q_tile_elems * i elements into sQ
        self.q_tile_elems = cute.cosize(cute.select(q_smem.outer, mode=[0, 1, 2]))
        if const_expr(self.q_tile_elems * self.q_tiles != cute.cosize(q_smem)):
            raise ValueError(f"Q tiles are not packed back to back in {q_smem}")
        if const_expr(cute.cosize(o_smem) > self.q_tile_elems):
            raise ValueError("sO_i must fit in sQ_i's bytes, which it reuses")

        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        q_tile = cute.select(q_smem, mode=[0, 1, 2])
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_A(op, q, q_tile, qk_tile_tiler(self.head_dim), qk_mma)
        self.q_tile_bytes = cute.size_in_bytes(self.dtype, q_tile)
        tma_atom_k, tma_k, tma_atom_v, tma_v, self.kv_tile_bytes = make_kv_tma_atoms(
            qk_mma, pv_mma, k, v, k_smem, v_smem, self.head_dim
        )
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o, cute.select(o_smem, mode=[0, 1]), (QK_TILE_M, self.head_dim)
        )

        q_tiles, kv_stages, stats_slots = self.q_tiles, self.kv_stages, 4 * self.q_tiles

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[Int64, 2 * q_tiles]
            kv_mbar: cute.struct.MemRange[Int64, 2 * kv_stages]
            s_full_mbar: cute.struct.MemRange[Int64, q_tiles]
            pv_ready_mbar: cute.struct.MemRange[Int64, q_tiles]
            o_full_mbar: cute.struct.MemRange[Int64, q_tiles]
            stats_mbar: cute.struct.MemRange[Int64, 2 * stats_slots]
            tmem_base: Int32
            stats: cute.struct.MemRange[Float32, QK_TILE_M * 2 * q_tiles]
            # 1024-byte alignment: the 128B-swizzle pattern repeats every 8 rows x 128 B
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_smem)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_smem)], 1024]

        self.shared_storage = SharedStorage

        grid = (cute.ceil_div(q.shape[0], self.cta_rows), q.shape[2], q.shape[3])
        self.kernel(
            qk_mma, pv_mma, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            lse, scale_log2, q_smem, k_smem, v_smem, o_smem,
        ).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            # one CTA per SM (it takes all 512 TMEM columns): with the block size this fixes the
            # registers each thread starts with, which ptxas needs to honour setmaxnreg (no C7508)
            min_blocks_per_mp=1,
        )  # fmt: skip

    # /////////////////////////////////////////////////////////////////////////////////////
    #  device entry: barriers, SMEM views, warp roles
    # /////////////////////////////////////////////////////////////////////////////////////
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
        seqlen_k = mK.shape[0]
        n_tiles = num_kv_tiles(seqlen_k, KV_TILE)

        if warp_idx == self.tma_warp:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)

        # barriers: warp 0 initialises them all; one fence + __syncthreads below publishes them
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        q_producer, q_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=self.q_tiles, producer_group=one_thread, consumer_group=one_thread,
            tx_count=self.q_tile_bytes, barrier_storage=storage.q_mbar.data_ptr(), defer_sync=True,
        ).make_participants()  # fmt: skip
        kv_producer, kv_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=self.kv_stages, producer_group=one_thread, consumer_group=one_thread,
            tx_count=self.kv_tile_bytes, barrier_storage=storage.kv_mbar.data_ptr(), defer_sync=True,
        ).make_participants()  # fmt: skip
        s_full = UseCountedBarriers(storage.s_full_mbar.data_ptr(), self.q_tiles, 1, by_mma=True)
        pv_ready = UseCountedBarriers(storage.pv_ready_mbar.data_ptr(), self.q_tiles, 2 * EPI_THREADS)
        o_full = UseCountedBarriers(storage.o_full_mbar.data_ptr(), self.q_tiles, 1, by_mma=True)
        stats = Handoff(storage.stats_mbar.data_ptr(), 4 * self.q_tiles, 32)
        tmem_barrier = pipeline.NamedBarrier(barrier_id=self.tmem_barrier_id, num_threads=self.tmem_users)
        epi_barrier = pipeline.NamedBarrier(barrier_id=self.epi_barrier_id, num_threads=EPI_THREADS)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr, barrier_for_retrieve=tmem_barrier, allocator_warp_id=self.mma_warp
        )
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (MMA, MMA_M, MMA_K, Q_TILES)
        sK = storage.sKV.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (MMA, MMA_N, MMA_K, STAGES)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, v_smem.inner), v_smem.outer)  # same bytes
        # (128 rows, 2, Q_TILES): [row, 0, i] rescale factor, then l; [row, 1, i] final m
        sStats = storage.stats.get_tensor(cute.make_layout((QK_TILE_M, 2, self.q_tiles)))

        if const_expr(self.idle_warps):
            if warp_idx > self.tma_warp:  # idle: hand the registers over, then exit
                cute.arch.setmaxregister_decrease(REGS_OTHER)

        if warp_idx == self.tma_warp:
            if const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_decrease(REGS_OTHER)
            self.load(
                qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV,
                sQ, sK, sV, q_producer, kv_producer, m_blk, h, hk, b, n_tiles,
            )  # fmt: skip

        if warp_idx == self.mma_warp:
            if const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_decrease(REGS_OTHER)
            self.mma(
                qk_mma, pv_mma, sQ, sK, sV, tmem, tmem_barrier, q_consumer, kv_consumer,
                s_full, pv_ready, o_full, n_tiles,
            )  # fmt: skip

        if warp_idx < self.correction_warps[0]:
            if const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_increase(REGS_SOFTMAX)
            self.softmax(
                scale_log2, seqlen_k, n_tiles, tmem, tmem_barrier, s_full, pv_ready, stats, sStats,
                warp_idx // 4, tidx % EPI_THREADS, warp_idx % 4,
            )  # fmt: skip

        if warp_idx >= self.correction_warps[0] and warp_idx <= self.correction_warps[-1]:
            if const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_decrease(REGS_CORRECTION)
            self.correction(
                tma_atom_o, mO, mLSE, storage.sQ.data_ptr(), o_smem, n_tiles, tmem, tmem_barrier, epi_barrier,
                pv_ready, o_full, stats, sStats, tidx % EPI_THREADS, warp_idx % 4, m_blk, h, b,
            )  # fmt: skip

    # /////////////////////////////////////////////////////////////////////////////////////
    #  TMA warp: Q tiles once, then K and V of each KV tile, last tile first
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def load(
        self, qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV,
        sQ, sK, sV, q_producer, kv_producer, m_blk, h, hk, b, n_tiles,
    ):  # fmt: skip
        # (128, head_dim, q blocks) -> ((atom), q block) against ((atom), Q tile of this CTA)
        gQ = cute.local_tile(mQ[None, None, h, b], cute.select(qk_tile_tiler(self.head_dim), mode=[0, 2]), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
            cute.group_modes(qk_mma.get_slice(0).partition_A(gQ), 0, 3),
        )  # fmt: skip
        tKgK, tKsK, tVgV, tVsV = partition_kv_loads(
            qk_mma, pv_mma, tma_atom_k, mK[None, None, hk, b], sK, tma_atom_v, mV[None, None, hk, b], sV, self.head_dim
        )
        last = n_tiles - 1
        # Q_0 and K of the first visited tile first: the first QK MMA needs exactly these
        for i in cutlass.range_constexpr(self.q_tiles):
            stage = q_producer.acquire_and_advance()
            cute.copy(tma_atom_q, tQgQ[None, m_blk * self.q_tiles + i], tQsQ[None, i], tma_bar_ptr=stage.barrier)
            if const_expr(i == 0):
                kv_producer = load_tile(kv_producer, tma_atom_k, tKgK, tKsK, last)
        kv_producer = load_tile(kv_producer, tma_atom_v, tVgV, tVsV, last)
        for it in cutlass.range(1, n_tiles, unroll=1):
            tile = last - it  # K and V of tile `tile` come from tile `tile`
            kv_producer = load_tile(kv_producer, tma_atom_k, tKgK, tKsK, tile)
            kv_producer = load_tile(kv_producer, tma_atom_v, tVgV, tVsV, tile)
        # every stage's last release (tcgen05.commit) has arrived before this warp exits
        kv_producer.tail()

    # /////////////////////////////////////////////////////////////////////////////////////
    #  MMA warp: TMEM owner; S_i = Q_i K^T (SS), O_i += P_i V (TS, P from TMEM)
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def mma(
        self, qk_mma, pv_mma, sQ, sK, sV, tmem, tmem_barrier, q_consumer, kv_consumer,
        s_full, pv_ready, o_full, n_tiles,
    ):  # fmt: skip
        tmem.allocate(self.tmem_columns)
        tmem.relinquish_alloc_permit()  # one allocation per CTA: let co-resident CTAs allocate
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)
        tmem_map = AttentionTmemMap.packed(self.dtype, self.head_dim, self.q_tiles)
        tStS = [tmem_map.s(i).at(tmem_base) for i in range(self.q_tiles)]  # (MMA, 1, 1) fp32
        tOtO = [tmem_map.o(i).at(tmem_base) for i in range(self.q_tiles)]  # (MMA, 1, 1) fp32
        tOrP = [tmem_map.p_operand(i).at(tmem_base) for i in range(self.q_tiles)]  # (MMA, 1, 8) 16-bit

        tCrQ = qk_mma.make_fragment_A(sQ)  # (MMA, MMA_M, MMA_K, Q_TILES) SMEM descriptors
        tCrK = qk_mma.make_fragment_B(sK)  # (MMA, MMA_N, MMA_K, STAGES)
        tOrV = pv_mma.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, STAGES)

        # iteration 0: S_i = Q_i K_a for the first visited tile a
        k_stage = kv_consumer.wait_and_advance()
        for i in cutlass.range_constexpr(self.q_tiles):
            q_consumer.wait_and_advance()  # Q_i landed; never released (read until the end)
            issue_qk_tile(qk_mma, tStS[i], tCrQ[None, None, None, i], tCrK[None, None, None, k_stage.index])
            s_full.arrive(i)
        k_stage.release()

        # iteration it: O_i += P_i V of the tile visited at it - 1, then S_i = Q_i K of tile it
        for it in cutlass.range(1, n_tiles, unroll=1):
            # the accumulate flag is state of a tiled MMA: fresh ones keep it inside this body
            qk_it = make_qk_tiled_mma(self.dtype)
            pv_it = make_pv_tiled_mma(self.dtype, self.head_dim)
            v_stage = kv_consumer.wait_and_advance()
            for i in cutlass.range_constexpr(self.q_tiles):
                self.issue_pv(pv_it, tOtO[i], tOrP[i], tOrV[None, None, None, v_stage.index], pv_ready, i, it - 1)
                if const_expr(i == 0):
                    k_stage = kv_consumer.wait_and_advance()
                issue_qk_tile(qk_it, tStS[i], tCrQ[None, None, None, i], tCrK[None, None, None, k_stage.index])
                s_full.arrive(i)  # also covers PV_i just issued: O_i holds every tile visited so far
            v_stage.release()
            k_stage.release()

        # the last PV of each tile, then O_i is final
        pv_last = make_pv_tiled_mma(self.dtype, self.head_dim)
        v_stage = kv_consumer.wait_and_advance()
        for i in cutlass.range_constexpr(self.q_tiles):
            self.issue_pv(pv_last, tOtO[i], tOrP[i], tOrV[None, None, None, v_stage.index], pv_ready, i, n_tiles - 1)
            o_full.arrive(i)
        v_stage.release()

        # dealloc only after the softmax and correction warps' last TMEM access
        tmem_barrier.arrive_and_wait()
        fence_after_thread_sync()
        tmem.free(tmem_base, self.tmem_columns)

    @cute.jit
    def issue_pv(self, pv_mma, tOtO, tOrP, tOrV, pv_ready, i: cutlass.Constexpr[int], it):
        """O_i (+)= P_i V for iteration ``it``, once P_i(it) is stored and O_i rescaled: 8 TS MMAs
        of 16 keys; the first iteration's first MMA overwrites O_i (accumulate off)."""
        pv_ready.wait(i, it)
        fence_after_thread_sync()  # order the MMAs after the TMEM stores the barrier reports
        pv_mma.set(tcgen05.Field.ACCUMULATE, it > 0)
        for kp in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(pv_mma, tOtO, tOrP[None, None, kp], tOrV[None, None, kp], tOtO)
            pv_mma.set(tcgen05.Field.ACCUMULATE, True)

    # /////////////////////////////////////////////////////////////////////////////////////
    #  Softmax warpgroup i: thread t owns row t of S_i, P_i, m and l
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def softmax(
        self, scale_log2, seqlen_k, n_tiles, tmem, tmem_barrier, s_full, pv_ready, stats, sStats,
        tile, t, warp,
    ):  # fmt: skip
        tmem.wait_for_alloc()
        tmem_map = AttentionTmemMap.packed(self.dtype, self.head_dim, self.q_tiles)
        # S_i and P_i are S_0 and P_0 moved by i * 128 columns (i = this warpgroup, a runtime value)
        s_stride = uniform_stride(tmem_map.s_cols, "S")
        tile_base = tmem.retrieve_ptr(Float32) + tile * s_stride

        # row t of S: (T2R, T2R_M, T2R_N, 1, S_CHUNKS) registers, and their (m, n)
        tiled_s_load, tS_chunks = make_acc_tmem_load(tmem_map.s(0).at(tile_base), EPI_COLS)
        thr_s_load = tiled_s_load.get_slice(t)
        tTR_tS = thr_s_load.partition_S(tS_chunks)
        tTR_cS = thr_s_load.partition_D(epi_view(cute.make_identity_tensor((QK_TILE_M, QK_TILE_N)), EPI_COLS))
        tTR_rS = cute.make_rmem_tensor(tTR_cS.shape, Float32)
        # row t of P, 16-bit, over S's upper half; value v of tRT_rP is value v of tTR_rS
        tStP = tmem_map.p_store(0).at(tile_base)
        tiled_p_store = make_p_tmem_store(tStP)
        thr_p_store = tiled_p_store.get_slice(t)
        tRT_tP = thr_p_store.partition_D(tStP)
        tRT_rP = cute.make_rmem_tensor(
            thr_p_store.partition_S(p_chunk_view(cute.make_identity_tensor((QK_TILE_M, PV_TILE_K)), self.dtype)).shape,
            self.dtype,
        )
        p_row = cute.make_tensor(tRT_rP.iterator, cute.make_layout(tTR_rS.shape))

        row = tTR_cS[0][0]  # the row this thread owns (t, proven on the host)
        stats_slot = tile * 4 + warp  # rows 32 warp .. 32 warp + 31 of tile i
        m = Float32(-Float32.inf)  # max applied so far (x domain)
        row_sum = Float32(0.0)  # l: the sum of P under max m
        for it in cutlass.range(n_tiles, unroll=1):
            s_full.wait(tile, it)
            fence_after_thread_sync()  # order the loads after the MMAs that S full reports
            for c in cutlass.range_constexpr(cute.size(tTR_tS, mode=[4])):
                cute.copy(tiled_s_load, tTR_tS[None, None, None, 0, c], tTR_rS[None, None, None, 0, c])
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the row is in registers
            if it == 0:  # the first visited tile, n - 1, is the only one with keys past seqlen_k
                mask_seqlen_k(tTR_rS, tTR_cS, n_tiles - 1, KV_TILE, seqlen_k)
            m, scale = lazy_max_update(m, row_max(tTR_rS), scale_log2, RESCALE_THRESHOLD)
            if it > 0:  # O_i needs exp2(m_old - m_new) before PV_i(it): to the correction warps now
                stats.producer_acquire(stats_slot, it - 1)
                sStats[row, 0, tile] = scale
                stats.producer_commit(stats_slot)
            row_sum = row_sum * scale + exp2_into_p(tTR_rS, p_row, scale_log2, m)
            # P over S's upper half (lane t only; row t of S is all in registers), then tell the MMA
            for c in cutlass.range_constexpr(cute.size(tRT_tP, mode=[4])):
                cute.copy(tiled_p_store, tRT_rP[None, None, None, 0, c], tRT_tP[None, None, None, 0, c])
            cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st
            fence_before_thread_sync()
            pv_ready.arrive(tile)

        stats.producer_acquire(stats_slot, n_tiles - 1)
        sStats[row, 0, tile] = row_sum
        sStats[row, 1, tile] = m
        stats.producer_commit(stats_slot)
        tmem_barrier.arrive()  # every TMEM access of this thread has completed (wait::st above)

    # /////////////////////////////////////////////////////////////////////////////////////
    #  Correction warpgroup: thread t owns row t of every O_i
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def correction(
        self, tma_atom_o, mO, mLSE, sq_base, o_smem, n_tiles, tmem, tmem_barrier, epi_barrier,
        pv_ready, o_full, stats, sStats, t, warp, m_blk, h, b,
    ):  # fmt: skip
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)
        tmem_map = AttentionTmemMap.packed(self.dtype, self.head_dim, self.q_tiles)

        # row t of O_i: load and store partitions name the same cells in the same order
        tTR_tO, tRT_tO = [], []  # per Q tile: (.., .., .., 1, CHUNKS) TMEM cells of row t
        for i in cutlass.range_constexpr(self.q_tiles):
            tiled_o_load, o_chunks = make_acc_tmem_load(tmem_map.o(i).at(tmem_base), EPI_COLS)
            tiled_o_store, _ = make_acc_tmem_store(tmem_map.o(i).at(tmem_base), EPI_COLS)
            thr_o_load = tiled_o_load.get_slice(t)
            tTR_tO.append(thr_o_load.partition_S(o_chunks))
            tRT_tO.append(tiled_o_store.get_slice(t).partition_D(o_chunks))
        tTR_cO = thr_o_load.partition_D(epi_view(cute.make_identity_tensor((QK_TILE_M, self.head_dim)), EPI_COLS))
        tTR_rO = cute.make_rmem_tensor(tTR_cO[None, None, None, 0, 0].shape, Float32)
        row = tTR_cO[0][0]  # the row this thread owns in every O_i (t, proven on the host)

        # iteration 0: O_i is not written yet, nothing to rescale
        for i in cutlass.range_constexpr(self.q_tiles):
            pv_ready.arrive(i)
        for it in cutlass.range(1, n_tiles, unroll=1):
            for i in cutlass.range_constexpr(self.q_tiles):
                slot = i * 4 + warp  # the softmax warp serving the same 32 rows of tile i
                stats.consumer_wait(slot, it - 1)
                scale = sStats[row, 0, i]
                stats.consumer_release(slot)
                # the softmax saw S_i(it) full, so PV_i(it - 1) has completed: O_i is stable
                if cute.arch.vote_any_sync(scale < Float32(1.0)):
                    fence_after_thread_sync()
                    rescale_o_row(tiled_o_load, tTR_tO[i], tiled_o_store, tRT_tO[i], tTR_rO, scale)
                fence_before_thread_sync()
                pv_ready.arrive(i)

        # epilogue per Q tile: O_i / l -> sO_i (over sQ_i) -> TMA store; LSE
        lse_rows = mLSE.shape[0]
        for i in cutlass.range_constexpr(self.q_tiles):
            slot = i * 4 + warp
            stats.consumer_wait(slot, n_tiles - 1)
            row_sum = sStats[row, 0, i]
            row_max_x = sStats[row, 1, i]
            stats.consumer_release(slot)
            q_row = (m_blk * self.q_tiles + i) * QK_TILE_M + row
            if q_row < lse_rows:
                mLSE[q_row, h, b] = (row_max_x + cute.math.log2(row_sum, fastmath=True)) * Float32(LN2)

            sO = cute.make_tensor(
                cute.recast_ptr(sq_base + i * self.q_tile_elems, o_smem.inner, dtype=self.dtype), o_smem.outer
            )[None, None, 0]  # (128, head_dim) on sQ_i's bytes
            tTR_sO = thr_o_load.partition_D(epi_view(sO, EPI_COLS))
            o_full.wait(i, 0)
            fence_after_thread_sync()
            o_row_to_smem(tiled_o_load, tTR_tO[i], tTR_sO, tTR_rO, cute.arch.rcp_approx(row_sum), self.dtype)

            cute.arch.fence_view_async_shared()  # sO_i visible to the TMA (async proxy)
            epi_barrier.arrive_and_wait()
            if t == 0:  # one thread: 32 would store the tile 32 times; bulk groups are per thread
                gO = cute.local_tile(mO[None, None, h, b], (QK_TILE_M, self.head_dim), (m_blk * self.q_tiles + i, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
                )
                cute.copy(tma_atom_o, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(i == self.q_tiles - 1):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # SMEM must outlive the TMA's reads

        fence_before_thread_sync()
        tmem_barrier.arrive()  # every tcgen05.ld of O has completed (waited in o_row_to_smem)
