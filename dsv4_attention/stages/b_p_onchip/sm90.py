"""Stage B on Hopper (SM90): attention over one KV tile, P kept in registers.

    O[b, i, h, :] = sum_j softmax_j(scale * q_i . k_j) v_j          (input dtype)
    LSE[b, h, i]  = log sum_j exp(scale * q_i . k_j)                 (fp32, natural log)
    j < seqlen_k <= 128 (one KV tile), hk = h // (heads / kv_heads)

Q, K, V, O are bf16 or fp16 (batch, seqlen, heads, head_dim), head_dim
contiguous; LSE is fp32 (batch, heads, seqlen_q), contiguous. head_dim
(64/128/256) is fixed at construction; batch, heads, kv_heads, seqlen_q and
seqlen_k are runtime values. The caller guarantees 1 <= seqlen_k <= 128.

Numerics (one domain, common/softmax.py): x = s * scale_log2 with scale_log2 =
softmax_scale * log2(e) passed in (the scale is applied once, to s); keys
j >= seqlen_k get x = -inf; m = max_j x; P = exp2(x - m); rowsum is the sum of
the fp32 P *before* P is rounded to 16 bits; O = (P16 @ V) / rowsum in fp32,
rounded once; LSE = (m + log2(rowsum)) * ln 2.

Work decomposition
    grid  = (ceil(seqlen_q / 128), heads, batch); one CTA per 128-row Q tile of
            one (head, batch), all seqlen_k keys.
    block = 256 threads = 2 consumer warpgroups; warpgroup w owns Q rows
            [64 w, 64 w + 64) of the tile, end to end (QK, softmax, PV, epilogue).
            Warp 0's elected lane also issues the TMA loads and the O store:
            every buffer is used once, so there is no ring to keep fed and no
            room for a producer warpgroup to pay for itself.

Barriers (each used for exactly one phase, parity 0)
    qk_bar  Q and K of all head-dim k-blocks (transaction bytes 2 x 128 x d x 2)
    v_bar   V (128 x d x 2 bytes) -- separate, so QK and the softmax run while
            V is still in flight.
    CTA barrier 0 after the mbarrier init, before O overwrites sQ (every wgmma
    that read sQ, in both warpgroups, is done), and between the O writes to
    SMEM (followed by fence.proxy.async.shared::cta) and the TMA store.

Per warpgroup
    1. S = Q K^T: SS wgmma 64x128x16, 4 per k-block, over d/64 k-blocks, into
       64 fp32 registers per thread (acc ((2,2,16),1,1), see below).
    2. Mask keys >= seqlen_k (TMA zero-filled their K rows: their raw score
       is 0, not -inf), then the quad-shuffle softmax of common/softmax.py.
    3. P -> 16 bits in registers laid out like the accumulator, relabelled as
       the A fragment of the PV MMA (common/p_staging.py), no data movement.
    4. O = P V: RS wgmma 64xdx16, 8 k-steps over the 128 keys, A = P from
       registers, B = V from SMEM (MN-major view of the same bytes TMA wrote).
    5. O * (1 / rowsum), round, store to SMEM over this warpgroup's Q rows;
       TMA store of the 128 x d tile (rows past seqlen_q are clipped by TMA).
       LSE: the lane of each quad that holds column 0 writes its 2 rows,
       predicated on row < seqlen_q.

Layouts (per warpgroup: w = warp in the warpgroup, l = lane)
    sQ, sK, sV  (128 rows, 64, d/64 k-blocks), K-major, 128B swizzle (common/sm90_gemm.py):
                  S<3,4,3> o ((8,16),(64,1),(1,kb)):((64,512),(1,0),(0,8192))
                row r, col c of k-block b -> element (r%8)*64 + (r/8)*512 + c + 8192 b;
                sQ is reused for O (same layout, so the TMA store reads it like the load wrote Q).
    sVt         the same bytes as sV viewed (head_dim, keys), MN-major for the PV B operand:
                  S<3,4,3> o ((64,kb),(8,16)):((1,8192),(64,512))
    S / P acc   ((2,2,16),1,1):((1,2,4),0,0); value (c, r, n) is S[16w + l/4 + 8r, 8n + 2(l%4) + c]
    P as A      ((2,2,2),1,(8,1)):((1,2,4),0,(8,0)); value ((c, r, h), 0, j) is
                P[16w + l/4 + 8r, 16j + 8h + 2(l%4) + c] -- the same register as acc value
                (c, r, 2j + h): the A fragment of k-block j is accumulator octets 2j, 2j+1.
    O acc       ((2,2,d/8),1,1); value (c, r, n) is O[16w + l/4 + 8r, 8n + 2(l%4) + c].
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.nvgpu import cpasync, warpgroup

from dsv4_attention.common.layouts import check_attention_operands, seq_major
from dsv4_attention.common.p_staging import convert_p, make_pv_tiled_mma
from dsv4_attention.common.sm90_gemm import (
    NUM_THREADS,
    THREADS_PER_WARPGROUP,
    TILE_K,
    TILE_M,
    TILE_N,
    make_kmajor_smem_layout,
    make_mn_major_smem_layout,
    make_tiled_mma,
    make_tma_load,
    make_tma_store,
    num_k_blocks,
    tile_tma_partition,
)
from dsv4_attention.common.softmax import acc_rows_view, log_sum_exp, softmax_rows

SUPPORTED_HEAD_DIMS = (64, 128, 256)


class AttentionOneTileSm90:
    arch = "sm_90a"

    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.k_blocks = num_k_blocks(head_dim)
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

        qk_mma = make_tiled_mma(self.dtype)
        pv_mma = make_pv_tiled_mma(self.dtype, self.head_dim)
        sQ_layout = make_kmajor_smem_layout(self.dtype, TILE_M, self.k_blocks)
        sKV_layout = make_kmajor_smem_layout(self.dtype, TILE_N, self.k_blocks)
        sVt_layout = make_mn_major_smem_layout(self.dtype, self.head_dim, TILE_N)
        tma_atom_q, tma_q = make_tma_load(mQ, sQ_layout, TILE_M)
        tma_atom_k, tma_k = make_tma_load(mK, sKV_layout, TILE_N)
        tma_atom_v, tma_v = make_tma_load(mV, sKV_layout, TILE_N)
        tma_atom_o, tma_o = make_tma_store(mO, sQ_layout, TILE_M)

        @cute.struct
        class SharedStorage:
            qk_bar: cutlass.Int64
            v_bar: cutlass.Int64
            # 1024 B alignment: the 128B swizzle repeats every 8 rows (1 KiB)
            # and the wgmma descriptors assume atoms start on it.
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        self.shared_storage = SharedStorage

        grid = (cute.ceil_div(mQ.shape[0], TILE_M), mQ.shape[2], mQ.shape[3])
        self.kernel(
            qk_mma, pv_mma,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            mLSE, scale_log2,
            sQ_layout, sKV_layout, sVt_layout,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

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
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_block, head, batch = cute.arch.block_idx()
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]

        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        qk_bar = storage.qk_bar.ptr
        v_bar = storage.v_bar.ptr
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(qk_bar, 1)
                cute.arch.mbarrier_init(v_bar, 1)
            cute.arch.mbarrier_init_fence()
        # Nobody may wait on (or TMA complete on) a barrier before it is initialised.
        cute.arch.barrier()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sVt = storage.sV.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)

        # (TILE, TILE_K, k_blocks) tiles of this CTA; the KV tile is the first (and only) one.
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, TILE_K), (m_block, None))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, TILE_K), (0, None))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (TILE_N, TILE_K), (0, None))
        gO = cute.local_tile(mO[None, None, head, batch], (TILE_M, TILE_K), (m_block, None))

        if warp_idx == 0:
            self.load(qk_bar, v_bar, tma_atom_q, gQ, sQ, tma_atom_k, gK, sK, tma_atom_v, gV, sV)

        # ---------------------------------------------------------------
        # S = Q K^T (per warpgroup: 64 x 128, fp32 in registers)
        # ---------------------------------------------------------------
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # wgmma operands are per warpgroup: slice by the warpgroup's first thread.
        wg_qk = qk_mma.get_slice(warpgroup_idx * THREADS_PER_WARPGROUP)
        wg_pv = pv_mma.get_slice(warpgroup_idx * THREADS_PER_WARPGROUP)
        tSrQ = qk_mma.make_fragment_A(wg_qk.partition_A(sQ))  # (MMA, 1, 4, k_blocks)
        tSrK = qk_mma.make_fragment_B(wg_qk.partition_B(sK))  # (MMA, 1, 4, k_blocks)
        tOrV = pv_mma.make_fragment_B(wg_pv.partition_B(sVt))  # (MMA, 1, 8)

        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_M, TILE_N)))
        acc_s.fill(0.0)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)

        cute.arch.mbarrier_wait(qk_bar, 0)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(self.k_blocks):
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k, kb], tSrK[None, None, k, kb], acc_s)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # ---------------------------------------------------------------
        # Softmax in registers; P as the A operand of the PV MMA
        # ---------------------------------------------------------------
        # (row, key) of every accumulator value, partitioned like acc_s.
        tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        self.mask_keys(acc_s, tScS, seqlen_k)
        row_max, row_sum = softmax_rows(acc_s, scale_log2)
        tOrP = convert_p(acc_s, self.dtype)

        # ---------------------------------------------------------------
        # O = P V (per warpgroup: 64 x d, fp32 in registers)
        # ---------------------------------------------------------------
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE_M, self.head_dim)))
        acc_o.fill(0.0)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        cute.arch.mbarrier_wait(v_bar, 0)
        # Orders the register writes of P and of the zeroed O before the wgmmas read them.
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(pv_mma, acc_o, tOrP[None, None, k], tOrV[None, None, k], acc_o)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # ---------------------------------------------------------------
        # Epilogue: O / rowsum -> sQ -> TMA store; LSE from the row owners.
        # ---------------------------------------------------------------
        o_rows = acc_rows_view(acc_o)
        for i in cutlass.range_constexpr(cute.size(o_rows, mode=[0])):
            inv_sum = cutlass.Float32(1.0) / row_sum[i]
            for j in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
                o_rows[i, j] = o_rows[i, j] * inv_sum
        r_o = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))

        # sO aliases sQ: wait until both warpgroups' QK wgmmas (which read all
        # of sQ through the async proxy) have completed.
        cute.arch.barrier()
        # sQ as one (128, d) tile: column c is element c % 64 of k-block c / 64.
        sO = cute.group_modes(sQ, 1, 3)
        tOsO = thr_pv.partition_C(sO)  # like acc_o
        cute.autovec_copy(r_o, tOsO)
        # Generic-proxy SMEM writes must be visible to the TMA (async proxy) store.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()
        if warp_idx == 0:
            tOsO_tma, tOgO = tile_tma_partition(tma_atom_o, sQ, gO)
            # One lane issues, commits and waits (bulk groups are per thread;
            # a TMA store, unlike the load, is not elected for us).
            with cute.arch.elect_one():
                for kb in cutlass.range_constexpr(self.k_blocks):
                    cute.copy(tma_atom_o, tOsO_tma[None, kb], tOgO[None, kb])
                cute.arch.cp_async_bulk_commit_group()
                # SMEM must outlive the store's reads of it: wait before the CTA exits.
                cute.arch.cp_async_bulk_wait_group(0, read=True)

        self.store_lse(mLSE, row_max, row_sum, tScS, m_block, head, batch, seqlen_q)

    @cute.jit
    def load(
        self,
        qk_bar: cute.Pointer,
        v_bar: cute.Pointer,
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
        """Warp 0: arm each barrier with its transaction bytes, then TMA every
        (128, 64) k-block box of Q and K onto qk_bar and of V onto v_bar. Rows
        past seqlen are zero-filled and still count their bytes."""
        tQsQ, tQgQ = tile_tma_partition(tma_atom_q, sQ, gQ)
        tKsK, tKgK = tile_tma_partition(tma_atom_k, sK, gK)
        tVsV, tVgV = tile_tma_partition(tma_atom_v, sV, gV)
        qk_bytes = cute.size_in_bytes(self.dtype, sQ.layout) + cute.size_in_bytes(self.dtype, sK.layout)
        v_bytes = cute.size_in_bytes(self.dtype, sV.layout)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(qk_bar, qk_bytes)
        for kb in cutlass.range_constexpr(self.k_blocks):
            cute.copy(tma_atom_q, tQgQ[None, kb], tQsQ[None, kb], tma_bar_ptr=qk_bar)
            cute.copy(tma_atom_k, tKgK[None, kb], tKsK[None, kb], tma_bar_ptr=qk_bar)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(v_bar, v_bytes)
        for kb in cutlass.range_constexpr(self.k_blocks):
            cute.copy(tma_atom_v, tVgV[None, kb], tVsV[None, kb], tma_bar_ptr=v_bar)

    @cute.jit
    def mask_keys(self, acc_s: cute.Tensor, tScS: cute.Tensor, seqlen_k: cutlass.Int32):
        """Keys j >= seqlen_k (zero-filled K rows, score 0) -> -inf."""
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            # a select, not a branch: one instruction per value
            acc_s[i] = -cutlass.Float32.inf if tScS[i][1] >= seqlen_k else acc_s[i]

    @cute.jit
    def store_lse(
        self,
        mLSE: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        tScS: cute.Tensor,
        m_block: cutlass.Int32,
        head: cutlass.Int32,
        batch: cutlass.Int32,
        seqlen_q: cutlass.Int32,
    ):
        """Every lane of a quad holds its rows' statistics; the lane holding
        column 0 writes them (one writer per row), rows < seqlen_q only."""
        rows_c = acc_rows_view(tScS)
        if rows_c[0, 0][1] == 0:
            for i in cutlass.range_constexpr(cute.size(rows_c, mode=[0])):
                row = m_block * TILE_M + rows_c[i, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, row] = log_sum_exp(row_max[i], row_sum[i])
