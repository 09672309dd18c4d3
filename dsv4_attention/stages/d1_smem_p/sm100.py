"""Stage D1 on Blackwell (SM100, sm_100a): P staged through SMEM, head dims 64..512, K = V loaded once.

What it computes
----------------
Stage C's attention (``stages/c_online_softmax/sm100.py``): for every key j < seqlen_k,

    x[i, j] = scale_log2 * Q[b, i, h] . K[b, j, hk],   O[b, i, h] = sum_j exp2(x - m) V[b, j, hk] / l,
    LSE[b, h, i] = (m + log2 l) * ln 2,

now for any head dim d that is a multiple of 64 up to 512, with P handed from the softmax to the PV
GEMM through SMEM (``p_in_smem``; the default above head dim 256, selectable down to 64) or, where
a 128-key S fits beside O (d <= 384), kept in TMEM over S as in stage C (``p_in_smem=False``, the
default at 64..256). ``kv_shared``: the caller passes one tensor as K and V (DeepSeek-V4's latent
KV); each KV block is loaded once and serves both GEMMs, mV is never read.

The plan per head dim (``common.sm100_smem_p.plan_for``; T = keys per KV tile, B = ring block
columns = QK k-subtile = PV N chunk, X = CTAs splitting O's columns; * = the default)
---------------------------------------------------------------------------------------------
    P in SMEM (sP: the SS PV MMA's A operand)
    d     T    B    X  stages  S          O             alloc   sQ    sP    ring          total
    64    128  64   1  10      0..127     128..191      256     16K   32K   10 x 16K      208K
    128   128  128  1  4       0..127     128..255      256     32K   32K    4 x 32K      192K
    192   128  64   1  8       0..127     128..319      512     48K   32K    8 x 16K      208K
    256   128  128  1  3       0..127     128..383      512     64K   32K    3 x 32K      192K
    320*  128  64   1  6       0..127     128..447      512     80K   32K    6 x 16K      208K
    384*  64   128  1  6       0..63      64..447       512     96K   16K    6 x 16K      208K
    448*  64   64   1  11      0..63      64..511       512    112K   16K   11 x  8K      216K
    512*  64   64   2  9       0..63      64..319       512    128K   16K    9 x  8K      216K

    P in TMEM (P(m, k) at lane m, column 64 + k // 2, half k % 2: S's upper half; TS PV MMA)
    d     T    B    X  stages  S (P)             O          alloc   sQ    ring          total
    64*   128  64   1  12      0..127 (64..127)  128..191   256     16K   12 x 16K      208K
    128*  128  128  1  5       0..127 (64..127)  128..255   256     32K    5 x 32K      192K
    192*  128  64   1  10      0..127 (64..127)  128..319   512     48K   10 x 16K      208K
    256*  128  128  1  4       0..127 (64..127)  128..383   512     64K    4 x 32K      192K
    320   128  64   1  8       0..127 (64..127)  128..447   512     80K    8 x 16K      208K
    384   128  64   1  7       0..127 (64..127)  128..511   512     96K    7 x 16K      208K

(K = KiB of tiles; the SharedStorage adds 2 to 6 KiB of barriers, stats, the TMEM pointer and
1024-byte alignment: 198656 to 223232 bytes, asserted by the compile tests; ``tests/
test_d1_sm100_host.py`` checks both tables against ``plan_for``.) S needs T columns and O its
o_cols = d / X. With P in SMEM at d = 384, SMEM (Q 96K + P 32K + one whole KV tile 96K = 224K +
barriers) is too tight for T = 128; at d = 448 TMEM is (T = 64: 64 + 448 = 512), and a 64-key S
has no room for P in TMEM. At d = 512 O alone would take all 512 columns, leaving none for S: O's
columns are split over two CTAs (X = 2, grid x = 2 per Q tile; CTA half c owns O[:, 256 c ..
256 c + 255]), and each computes the whole S (QK over all 512 dims) for its half: 1.5 x the FLOPs
of a one-CTA tile and K read twice per Q tile, in exchange for a 1-CTA design whose every layout
the host proves (FlashAttention-4's MLA kernel instead pairs two CTAs in one cta_group::2 MMA).

Algorithm (per CTA: one 128-row Q tile, O columns [X-half])
-----------------------------------------------------------
KV tiles are visited last first (a = n - 1, ..., 0; only the first visited one needs the seqlen_k
mask) with stage C's online softmax (lazy rescale, one vote per warp). KV tile a holds keys
origin + a T .. (origin = 0 here; ``kv_span``, below). Per tile:

    QK   S = sum over the d / B k-subtiles kb of Q[:, kb] K[kb]^T: B / 16 MMAs each, accumulated into
         the one S in TMEM (first MMA accumulate off); one tcgen05.commit after all of them. Partial
         softmaxes are never merged: the softmax sees S only when all k-subtiles are in.
    P    softmax thread t: row t of S (tcgen05.ld 32x32b) -> m, l -> P = exp2(x - m) in 16 bits ->
         T / 8 16-byte st.shared into sP (the PV A operand: K-major, 128B swizzle, byte-proven);
         TMEM-P: tcgen05.st 32x32b into S's upper half (stage C's store, proven by stage B's checker)
    PV   for each of this CTA's o_cols / B N chunks c: O[:, c] (+)= P V[:, c], T / 16 MMAs
         (A = P by descriptor from sP (SS), or from TMEM (TS); B = V block c of the tile by
         descriptor from the ring).

Seams for later stages (class attributes and methods, defaults: one row per token, every key seen)
------------------------------------------------------------------------------------------------
    row_views        D2: query heads folded into the rows (``pack_group``).
    kv_length        D3: the request's keys, seqused_k[b] (``uses_seqused_k``).
    request_views    D3 varlen (``varlen``): the views of request b (grid z) offset to its first row and
                     key, the batch coordinate to index them with (0), its packed row count and key
                     count (cu_seqlens); the grid runs the longest request's Q tiles (``varlen_grid_x``)
                     and a CTA whose tile holds none of its request's rows does nothing
                     (``tile_has_rows``). The tile that straddles a request's end is stored row by row
                     (``o_by_tma``, ``row_stored``), not by TMA: the box would overwrite the next
                     request's rows.
    kv_span          the Q tile's keys (common/kv_span.py: ``origin``, ``n_tiles``), the same for both
                     O halves of a tile: the TMA warp offsets K's key mode (V's: its second mode) by
                     origin, the MMA, softmax and correction warps iterate n_tiles.
    window           D4 (common/seams.Window; its ``kv_span`` and ``masks_inner_tiles``): the softmax
                     thread of row t computes its keys [lo, hi) once
                     (``common.sm100_softmax.visible_keys``) and per visit masks the keys past hi
                     and before lo, each only where it cuts the tile (without bounds: the first
                     visit's seqlen_k tail only); causal reverses the tile order (``q_tile_of``).
    may_hide_rows    D3, D4: a row may see no key: its max stays -inf, exp2 subtracts 0 instead, its
                     rescale factor is 1 and the correction writes O = 0 (1 / l := 0), LSE = -inf.
                     Compiled in only then.
    entries          E (common/seams.Entries): a second K = V source (its own TMA atom, K's box) whose
                     tiles come first in the span's index space: ``entry_operands`` builds its atom,
                     ``request_entries`` its per-request views, ``entry_sources`` the TMA warp's
                     partitions, ``load_k_block`` picks each tile's source; the softmax its columns
                     (``row_keys``, ``tile_columns``).
    owned_rows       E top-k with 64 heads: a tile owns 64 rows (``padded``): tile m starts at packed
                     row 64 m (``q_tile``, grid, ``o_tile``), rows 64 .. 127 are padding, taken as row
                     r % 64 by every per-row decision (``packed_row``) and never stored (``row_stored``,
                     ``lse_stored``; O row by row). QK_TILE_M elsewhere: those kernels are unchanged.

Warp roles (320 threads; setmaxnreg not used: stage C's one-Q-tile budget, 168 registers each)
---------------------------------------------------------------------------------------------
    warps 0..3   softmax: thread t owns row t of S, P, m, l.
    warps 4..7   correction: thread t owns row t of O: rescales it in TMEM when its warp's max grew;
                 epilogue (O / l -> sO over sQ -> TMA store; LSE by the X-half 0 CTA). Varlen, a
                 tile that straddles its request's end: after the epilogue barrier each thread
                 copies its own row of sO to global memory (16-byte stores), the request's rows only.
    warp  8      MMA: allocates TMEM; QK (SS) into S; PV (SS: A = P from sP; TS: from TMEM) into
                 O's chunks.
    warp  9      TMA: Q once; the ring's KV blocks in use order (``common.sm100_smem_p.KvBlockRing``).

Barriers: who arrives, who waits (use u of a barrier is waited for with parity u & 1)
-------------------------------------------------------------------------------------
    q          TMA -> MMA            Q landed. Used once.
    ring[s]    TMA <-> MMA           stage s full (block bytes) / empty (tcgen05.commit after the
                                     MMAs that read it). Uses per tile: K blocks 0 .. d/B - 1, then
                                     (K != V) this CTA's V blocks; K = V: the K blocks only, and a
                                     block in this CTA's O half is released after its PV, the others
                                     after their QK. The MMA names a stage by its use number (stage
                                     u % STAGES, parity (u // STAGES) & 1), carrying no state.
    s_full     MMA -> softmax        use it: S(it) in TMEM; the commit follows PV(it - 1) in issue
                                     order, so it also says PV(it - 1) completed: sP is free again
                                     and O holds tiles < it.
    stats[w]   softmax warp w <->    stage C's Handoff (rescale factor of iteration it at use it - 1,
               correction warp 4+w   final (l, m) at use n - 1).
    pv_ready   softmax (128) +       use it: P(it) is in sP (each softmax thread: st.shared, then
               correction (128)      fence.proxy.async.shared::cta, so the async proxy (the MMA)
               -> MMA                sees the generic-proxy stores; tcgen05.fence::before_thread_sync
                                     for its S loads; arrive) or, TMEM-P, in TMEM (tcgen05.st,
                                     wait::st, fence::before_thread_sync, arrive); and O is
                                     rescaled for iteration it (correction: wait::st, fence,
                                     arrive). The MMA waits, fences (fence::after_thread_sync) and
                                     issues PV(it).
    o_full     MMA -> correction     tcgen05.commit after the last PV: O final. Used once.
    tmem       named barrier 1       TmemAllocator handshake; dealloc after every TMEM access.
    epilogue   named barrier 2       the 128 correction threads wrote sO (and fenced) before one of
                                     them issues the TMA store.

The MMA warp's order per iteration it >= 1: wait pv_ready(it - 1); PV(it - 1) (V blocks of tile
it - 1, released after); QK(it) (K blocks of tile it, waited block by block, released after their
MMAs unless PV still needs them); commit s_full. S(it) overwrites S only after the softmax read
S(it - 1) (pv_ready(it - 1) precedes the QK in the MMA's program order). Why the ring cannot
deadlock: the ring is FIFO (use u needs use u - STAGES released). K != V: the MMA reads the blocks
in load order (K(0), V(0) at PV(0), K(1), ...) and releases each right after its MMAs, so any
stage count works. K = V: the blocks of this CTA's O half stay held from QK(it) to PV(it), while
QK(it) waits for the tile's later blocks; the oldest held use is then at most d / B - 1 uses back,
so STAGES >= d / B suffices (``plan_for`` guarantees it; the host model in the tests replays the
traffic, and stalls with one stage fewer).

TMEM (fp32 columns, lane m = row m; ``common.sm100_smem_p.SmemPTmemMap``)
-------------------------------------------------------------------------
    S(m, n) at lane m, column n (n < T); O(m, n) at lane m, column T + n (n < o_cols), written in
    N chunks of B columns (chunk c at T + B c). TMEM-P: P(m, k) at lane m, column 64 + k // 2, half
    k % 2 (inside S; S(it + 1) overwrites it only after PV(it) was issued, and tcgen05.mma runs in
    issue order, as in stage C); SMEM-P: P is not in TMEM. Allocation: the power of two >= T + o_cols.

SMEM (1024-byte aligned tiles; swizzle S<3,4,3> on the pointer)
---------------------------------------------------------------
    sQ    (128 x d) K-major:  ((128,16),1,(4,d/64),1):((64,1),0,(16,8192),0)
    sO    over sQ's bytes (128 x o_cols row-major, 64-column blocks); sQ's last reader is the last
          QK MMA, complete when o_full arrives.
    sP    (SMEM-P only) (128 x T) K-major:  ((128,16),1,(4,T/64),1):((64,1),0,(16,8192),0); P(m, k) at
          element e = 64 m + k % 64 + 8192 (k // 64), byte 2 e with bits 4..6 ^= bits 7..9.
    ring  STAGES x (T keys x B columns): as K  ((T,16),1,(4,B/64),S):((64,1),0,(16,64T),TB),
          as V (((64,B/64),16),1,T/16,S):(((1,64T),64),0,1024,TB): K(key, j) and V(j, key) are the
          same element (proven on the host), which is what lets one load serve both GEMMs.
    stats fp32 (128, 2): stage C's rescale factor / l and m slots.
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

from dsv4_attention.common.kv_span import KvSpan
from dsv4_attention.common.layouts import check_attention_operands, reorder, seq_major, with_row_vectors
from dsv4_attention.common.pack_heads import rows
from dsv4_attention.common.sm100_correction import (
    o_row_smem_to_gmem,
    o_row_to_smem,
    rescale_o_row,
)
from dsv4_attention.common.sm100_smem_p import (
    KvBlockRing,
    SmemPTmemMap,
    default_p_in_smem,
    make_pv_mma,
    make_qk_mma,
    make_smem_layouts,
    p_mk_layout,
    plan_for,
    pv_chunk_schedule,
    qk_subtile_schedule,
    store_p_row,
)
from dsv4_attention.common.sm100_softmax import (
    RESCALE_THRESHOLD,
    exp2_into_p,
    lazy_max_update,
    mask_below,
    mask_from,
    max_to_subtract,
    row_max,
    visible_columns,
    visible_keys,
)
from dsv4_attention.common.sm100_sync import Handoff, UseCountedBarriers
from dsv4_attention.common.tmem import (
    EPI_COLS,
    EPI_THREADS,
    MMA_INST_K,
    QK_TILE_M,
    epi_view,
    fence_after_thread_sync,
    fence_before_thread_sync,
    make_acc_tmem_load,
    make_acc_tmem_store,
    make_p_tmem_store,
    p_chunk_view,
)

LN2 = math.log(2.0)
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
# (batch, seqlen_k, kv_heads, head_dim) -> (head_dim, seqlen_k, kv_heads, batch): V as the PV B operand
V_AS_PV_B = (3, 1, 2, 0)
# (batch, heads, seqlen_q) -> (seqlen_q, heads, batch)
LSE_ROW_MAJOR = (2, 1, 0)


class FlashAttentionD1Sm100:
    """O = softmax(scale * Q K^T) V and LSE on SM100 for head dims 64..512: P through a swizzled SMEM
    buffer read by an SS PV MMA, QK in k-subtiles into one S, PV in N chunks, K = V loaded once."""

    arch = "sm_100a"

    def __init__(self, dtype, head_dim: int, *, kv_shared: bool = False, p_in_smem: bool | None = None):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"FlashAttentionD1Sm100: dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"FlashAttentionD1Sm100: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.kv_shared = bool(kv_shared)
        self.p_in_smem = default_p_in_smem(head_dim) if p_in_smem is None else bool(p_in_smem)
        # raises where P cannot stay in TMEM (p_in_smem False from head dim 384 on: a 64-key S)
        self.plan = plan_for(head_dim, self.kv_shared, dtype.width // 8, p_in_smem=self.p_in_smem)
        self.ring = KvBlockRing(self.plan)

        self.softmax_warps = (0, 1, 2, 3)
        self.correction_warps = (4, 5, 6, 7)
        self.mma_warp = 8
        self.tma_warp = 9
        self.threads_per_cta = 32 * (self.tma_warp + 1)
        self.tmem_barrier_id = 1
        self.epi_barrier_id = 2
        self.tmem_users = 32 + 2 * EPI_THREADS  # MMA, softmax, correction

        # set when __call__ is traced
        self.shared_storage = None
        self.tmem_columns = None

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
        lengths: tuple,  # the later stages' seams (common/seams.py): D3's Lengths,
        window: tuple,  # D4's Window,
        mSink: cute.Tensor | None,  # D5's sink,
        entries: tuple,  # E's Entries,
        partials: tuple,  # split-KV's SplitParts: sm90 only, refused on the host before a split call gets here
    ):
        check_attention_operands(self.dtype, mQ, mK, mV, mO, mLSE)
        plan = self.plan

        q = seq_major(mQ)  # (seqlen_q, head_dim, heads, batch)
        k = seq_major(mK)  # (seqlen_k, head_dim, kv_heads, batch)
        o = seq_major(mO)
        lse = reorder(mLSE, LSE_ROW_MAJOR)  # (seqlen_q, heads, batch)
        q, o, lse = self.row_views(q, o, lse)

        qk_mma = make_qk_mma(self.dtype, plan)
        pv_mma = make_pv_mma(self.dtype, plan)
        self.tmem_columns = SmemPTmemMap.packed(self.dtype, plan).alloc_columns()
        q_smem, k_ring, v_ring, p_smem = make_smem_layouts(self.dtype, plan, qk_mma, pv_mma)
        o_smem = sm100_utils.make_smem_layout_epi(self.dtype, LayoutEnum.ROW_MAJOR, (QK_TILE_M, plan.o_cols), 1)
        if const_expr(cute.cosize(o_smem) > cute.cosize(q_smem)):
            raise ValueError("sO must fit in sQ's bytes, which it reuses")

        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        q_tile = cute.select(q_smem, mode=[0, 1, 2])
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_A(
            op, q, q_tile, (QK_TILE_M, plan.tile_n, plan.head_dim), qk_mma
        )
        self.q_bytes = cute.size_in_bytes(self.dtype, q_tile)
        k_block = cute.select(k_ring, mode=[0, 1, 2])
        tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(
            op, k, k_block, (QK_TILE_M, plan.tile_n, plan.d_block), qk_mma
        )
        self.block_bytes = cute.size_in_bytes(self.dtype, k_block)
        if const_expr(self.kv_shared):
            # K = V: the V view of each K block is the PV operand; mV is never loaded
            tma_atom_v, tma_v = tma_atom_k, tma_k
        else:
            v = reorder(mV, V_AS_PV_B)  # (head_dim, seqlen_k, kv_heads, batch)
            v_block = cute.select(v_ring, mode=[0, 1, 2])
            tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(
                op, v, v_block, (QK_TILE_M, plan.d_block, plan.tile_n), pv_mma
            )
            if const_expr(cute.size_in_bytes(self.dtype, v_block) != self.block_bytes):
                raise ValueError("K and V blocks must have the same byte count (one ring barrier count)")
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o, cute.select(o_smem, mode=[0, 1]), (QK_TILE_M, plan.o_cols)
        )
        entries = self.entry_operands(entries, op, k_ring, qk_mma)

        fields = {
            "q_mbar": cute.struct.MemRange[Int64, 2],
            "ring_mbar": cute.struct.MemRange[Int64, 2 * plan.ring_stages],
            "s_full_mbar": cute.struct.MemRange[Int64, 1],
            "pv_ready_mbar": cute.struct.MemRange[Int64, 1],
            "o_full_mbar": cute.struct.MemRange[Int64, 1],
            "stats_mbar": cute.struct.MemRange[Int64, 2 * 4],
            "tmem_base": Int32,
            "stats": cute.struct.MemRange[Float32, QK_TILE_M * 2],
            # 1024-byte alignment: the 128B-swizzle pattern repeats every 8 rows x 128 B
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_smem)], 1024],
        }
        if const_expr(plan.p_in_smem):  # TMEM-P allocates no sP
            fields["sP"] = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(p_smem)], 1024]
        fields["sKV"] = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_ring)], 1024]
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        self.shared_storage = SharedStorage

        if const_expr(self.varlen):  # the tiles of the longest request x heads x requests
            grid = (self.varlen_grid_x(lengths.max_seqlen_q), q.shape[2], lengths.cu_seqlens_q.shape[0] - 1)
        else:
            grid = (cute.ceil_div(rows(q), self.owned_rows) * plan.o_split, q.shape[2], q.shape[3])
        # varlen: O's memory as well, for the row-by-row store of the tile that straddles a request's end
        # (a padded tile: for the row-by-row store of its owned rows)
        o_mem = with_row_vectors(o) if const_expr(self.varlen or self.padded()) else None
        self.kernel(
            qk_mma, pv_mma, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o, o_mem,
            lse, scale_log2, q_smem, k_ring, v_ring, p_smem, o_smem, lengths, window, mSink, entries,
        ).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    def row_scale(self, inv_row_sum, lse, mSink, q_row, h):
        """The seam of the epilogue's per-row scale: this thread's row's 1 / rowsum, which
        normalises O, may be scaled further given the row's LSE (natural log), its packed row
        q_row and head index h. Unchanged here; stage D5 multiplies by the sink's sigmoid."""
        return inv_row_sum

    def row_views(self, q: cute.Tensor, o: cute.Tensor, lse: cute.Tensor):
        """The seam where later stages change what a Q row is: (Q, O, LSE) as the kernel
        tiles them, Q and O (rows, head_dim, heads, batch), LSE (rows, heads, batch). One
        row per token here; stage D2 folds query heads into the rows."""
        return q, o, lse

    # ---- seams: what later stages change (defaults: one row per token, every key visible) ----
    pack_group = 1  # D2: query heads folded into a row tile
    uses_seqused_k = False  # D3: per-request key counts
    varlen = False  # D3: requests packed along the tokens (cu_seqlens_q / cu_seqlens_k)
    #: packed rows a Q tile owns, and the step between Q tiles' first rows. QK_TILE_M but for E's top-k
    #: with 64 heads (a padded tile, ``padded``): tile m holds packed rows m * 64 .. m * 64 + 127, owns
    #: rows 0 .. 63 (its token's heads) and stores only those
    owned_rows = QK_TILE_M

    def padded(self) -> bool:
        """Whether a Q tile owns fewer rows than it computes (compile-time): rows owned_rows ..
        QK_TILE_M - 1 are padding, computed (on the next token's Q, or TMA's zeros past the end) but
        never stored; every per-row decision (keys, entries, LSE, sink) takes them as row
        ``row % owned_rows`` (``packed_row``)."""
        return self.owned_rows < QK_TILE_M

    def packed_row(self, m_blk, row):
        """The packed row whose keys, LSE and sink tile row ``row`` of Q tile m_blk takes: m_blk *
        QK_TILE_M + row; padded, m_blk * owned_rows + row % owned_rows (padding rows repeat the owned
        rows' decisions)."""
        if const_expr(self.padded()):
            return m_blk * self.owned_rows + row % self.owned_rows
        return m_blk * QK_TILE_M + row

    def q_tile(self, mQ, m_blk, h, b):
        """(tiles, index): the Q view the TMA warp partitions, (QK_TILE_M, head_dim, tiles), and the
        index of Q tile m_blk in it. Padded: the view starts at packed row m_blk * owned_rows (a TMA
        box starts at any row; rows past the tensor's tokens are zero-filled)."""
        tiler = (QK_TILE_M, self.plan.head_dim)
        if const_expr(self.padded()):
            return cute.local_tile(cute.domain_offset((m_blk * self.owned_rows, 0, 0, 0), mQ)[None, None, h, b],
                                   tiler, (None, 0)), 0
        return cute.local_tile(mQ[None, None, h, b], tiler, (None, 0)), m_blk

    def q_tile_of(self, bx, grid_x):
        """(m_blk, half): the Q tile of CTA ``bx`` and which o_cols-wide part of O it owns. Both
        halves (o_split) of a Q tile get the same m_blk, hence the same span (D4's causal kernels
        reverse the order)."""
        return bx // self.plan.o_split, bx % self.plan.o_split

    def kv_length(self, mSeqUsedK, batch, seqlen_k):
        """The keys of request ``batch`` (D3: seqused_k[batch])."""
        return seqlen_k

    def request_views(self, batch, mQ, mK, mV, mO, mO_mem, mLSE, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK):
        """The seam where stage D3's variable-length batches change what a request is. Takes the
        kernel's views (TMA views mQ, mO (rows, head_dim, heads, batch), mK (seqlen_k, head_dim,
        kv_heads, batch), mV (head_dim, seqlen_k, kv_heads, batch; K's view when kv_shared); O's
        memory mO_mem like mO, or None; LSE (rows, heads, batch)) and returns
        (mQ, mK, mV, mO, mO_mem, mLSE, b, rows, seqlen_k): the request's views, the batch
        coordinate to index them with, its (packed) row count and its key count. Here request
        ``batch`` is a batch entry of the tensors."""
        return mQ, mK, mV, mO, mO_mem, mLSE, batch, rows(mQ), self.kv_length(mSeqUsedK, batch, mK.shape[0])

    def kv_span(self, m_block, rows, seqlen_k, window, entries) -> KvSpan:
        """Which keys Q tile ``m_block`` visits and how its tiles are masked (common/kv_span.py):
        here every key of the request, masked past ``seqlen_k`` only. D4 bounds it by ``window``
        (common/seams.Window); E adds its entries in front (``entries``: what its
        ``request_entries`` gave for the CTA's request; None here)."""
        return KvSpan(m_block, rows, seqlen_k, QK_TILE_M, self.plan.tile_n, self.pack_group, 0, 0, False, False)

    # the entries seam (E: a second K = V source in the same softmax); nothing here

    def entry_operands(self, entries, load_op, k_ring, qk_mma):
        """Host side (traced in ``__call__``): the kernel's operand for the ``entries`` bundle
        (common/seams.Entries), or None where the stage has no second source."""
        return None

    def request_entries(self, request, b, entries, lengths):
        """The entries of request ``request`` (batch coordinate ``b``; ``lengths``: D3's bundle),
        as ``kv_span`` and ``entry_sources`` take them."""
        return None

    def prefetch_entries(self, entries):
        """The TMA warp, with the CTA's descriptors: the entries' descriptors."""

    def entry_sources(self, qk_mma, entries, sK, hk, b):
        """What ``load_k_block`` takes besides K's views to load a block (None: K's tiles only)."""
        return None

    def may_hide_rows(self) -> bool:
        """Whether a row can see no key at all (then O = 0, LSE = -inf)."""
        return self.uses_seqused_k or self.varlen

    def varlen_grid_x(self, max_seqlen_q):
        """Grid x of a variable-length batch: the Q tiles (x o_split) of its longest request."""
        return (max_seqlen_q * self.pack_group + self.owned_rows - 1) // self.owned_rows * self.plan.o_split

    def tile_has_rows(self, m_blk, n_rows):
        """Whether Q tile m_blk holds any of its request's ``n_rows`` rows (varlen: the grid spans
        the longest request; a CTA whose tile has none does nothing)."""
        return m_blk * self.owned_rows < n_rows

    def o_load(self, tmem_base):
        """The correction threads' tcgen05.ld of O in EPI_COLS-column chunks: (tiled copy, O in chunks).
        Slice t of the copy is correction thread t, which holds row t of the tile."""
        return make_acc_tmem_load(SmemPTmemMap.packed(self.dtype, self.plan).o().at(tmem_base), EPI_COLS)

    def o_row_part(self, thr_o_load, tile: cute.Tensor) -> cute.Tensor:
        """This correction thread's values of a (QK_TILE_M, o_cols) tile (its row, in the order of its
        O loads): of sO, of O's memory, of identity coordinates."""
        return thr_o_load.partition_D(epi_view(tile, EPI_COLS))

    def o_tile(self, mO: cute.Tensor, m_blk, half, h, b) -> cute.Tensor:
        """The (QK_TILE_M, o_cols) part of O that the CTA of Q tile m_blk, O half ``half`` stores: of
        the TMA view (the box the TMA store writes) or of O's memory (the row-by-row store). Padded: from
        packed row m_blk * owned_rows on (stored row by row, the owned rows only)."""
        if const_expr(self.padded()):
            return cute.local_tile(cute.domain_offset((m_blk * self.owned_rows, 0, 0, 0), mO)[None, None, h, b],
                                   (QK_TILE_M, self.plan.o_cols), (0, half))
        return cute.local_tile(mO[None, None, h, b], (QK_TILE_M, self.plan.o_cols), (m_blk, half))

    def o_by_tma(self, rows_left):
        """Whether the tile goes out as one TMA box: every row of it is the request's (``rows_left``:
        its request's rows from the tile's first on). Only varlen asks: elsewhere the rows past the
        tensor's end are clipped by TMA, and there is no next request to overwrite. A padded tile never
        (its padding rows are the next token's)."""
        if const_expr(self.padded()):
            return False
        return rows_left >= QK_TILE_M

    def row_stored(self, row, rows_left):
        """Whether row ``row`` of a tile stored row by row is written (one of its request's rows; padded:
        one of the tile's owned rows too)."""
        if const_expr(self.padded()):
            return (row < self.owned_rows) & (row < rows_left)
        return row < rows_left

    def lse_stored(self, row, q_row, n_rows):
        """Whether the correction thread of tile row ``row`` (packed row ``q_row``) writes its LSE: a
        row of the request (padded: an owned row)."""
        if const_expr(self.padded()):
            return (row < self.owned_rows) & (q_row < n_rows)
        return q_row < n_rows

    def masks_inner_tiles(self) -> bool:
        """Whether tiles after the first visited one can straddle a boundary (D4's window edges)."""
        return False

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
        mV: cute.Tensor,  # TMA view (head_dim, seqlen_k, kv_heads, batch); K's when kv_shared (unused)
        tma_atom_o: cute.CopyAtom,
        mO: cute.Tensor,  # TMA view (seqlen_q, head_dim, heads, batch)
        mO_mem: cute.Tensor | None,  # varlen: O's memory like mO, for the straddling tile's rows
        mLSE: cute.Tensor,  # (seqlen_q, heads, batch) fp32
        scale_log2: Float32,
        q_smem: cute.ComposedLayout,
        k_ring: cute.ComposedLayout,
        v_ring: cute.ComposedLayout,
        p_smem: cute.ComposedLayout,
        o_smem: cute.ComposedLayout,
        lengths: tuple,  # D3's Lengths (common/seams.py)
        window: tuple,  # D4's Window
        mSink: cute.Tensor | None,  # D5: (heads,) fp32 attention sink
        entries,  # E's operands (``entry_operands``), or None
    ):
        bx, h, request = cute.arch.block_idx()
        m_blk, half = self.q_tile_of(bx, cute.arch.grid_dim()[0])
        hk = h // (mQ.shape[2] // mK.shape[2])  # GQA: `heads // kv_heads` query heads share a KV head
        mQ, mK, mV, mO, mO_mem, mLSE, b, n_rows, seqlen_k = self.request_views(
            request, mQ, mK, mV, mO, mO_mem, mLSE, lengths.seqused_k, lengths.cu_seqlens_q, lengths.cu_seqlens_k)
        args = (qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, tma_atom_o, mO, mO_mem, mLSE,
                scale_log2, q_smem, k_ring, v_ring, p_smem, o_smem, window, m_blk, half, h, hk, b, n_rows, seqlen_k,
                mSink, self.request_entries(request, b, entries, lengths))
        if const_expr(self.varlen):
            # the grid spans the longest request: a tile past its request's rows loads and stores
            # nothing (uniform per CTA: no thread reaches a barrier)
            if self.tile_has_rows(m_blk, n_rows):
                self.tile(*args)
        else:
            self.tile(*args)

    @cute.jit
    def tile(
        self, qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV, tma_atom_o, mO, mO_mem, mLSE,
        scale_log2, q_smem, k_ring, v_ring, p_smem, o_smem, window, m_blk, half, h, hk, b, n_rows, seqlen_k, mSink,
        entries,
    ):  # fmt: skip
        """One CTA's work: Q tile m_blk (O half ``half``) of head h (KV head hk) of request b, on the
        request's views (``request_views``: n_rows packed rows, seqlen_k keys; ``entries``: the
        request's, ``request_entries``)."""
        plan = self.plan
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        # the Q tile's keys: KV tile n holds keys span.origin + n * tile_n ..; both O halves of a
        # Q tile (o_split) compute the same span from the same m_blk
        span = self.kv_span(m_blk, n_rows, seqlen_k, window, entries)
        n_tiles = span.n_tiles

        if warp_idx == self.tma_warp:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            if const_expr(not self.kv_shared):
                cpasync.prefetch_descriptor(tma_atom_v)
            cpasync.prefetch_descriptor(tma_atom_o)
            self.prefetch_entries(entries)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)

        # barriers: warp 0 initialises them all; one fence + __syncthreads below publishes them
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        q_producer, q_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=one_thread, consumer_group=one_thread,
            tx_count=self.q_bytes, barrier_storage=storage.q_mbar.data_ptr(), defer_sync=True,
        ).make_participants()  # fmt: skip
        ring_pipeline = self.make_ring_pipeline(storage.ring_mbar.data_ptr(), one_thread)
        ring_producer, _ = ring_pipeline.make_participants()
        s_full = UseCountedBarriers(storage.s_full_mbar.data_ptr(), 1, 1, by_mma=True)
        pv_ready = UseCountedBarriers(storage.pv_ready_mbar.data_ptr(), 1, 2 * EPI_THREADS)
        o_full = UseCountedBarriers(storage.o_full_mbar.data_ptr(), 1, 1, by_mma=True)
        stats = Handoff(storage.stats_mbar.data_ptr(), 4, 32)
        tmem_barrier = pipeline.NamedBarrier(barrier_id=self.tmem_barrier_id, num_threads=self.tmem_users)
        epi_barrier = pipeline.NamedBarrier(barrier_id=self.epi_barrier_id, num_threads=EPI_THREADS)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr, barrier_for_retrieve=tmem_barrier, allocator_warp_id=self.mma_warp
        )
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (MMA, 1, (4, d/64), 1)
        sP = None
        if const_expr(plan.p_in_smem):
            sP = storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)  # (MMA, 1, T/16, 1)
        sK = storage.sKV.get_tensor(k_ring.outer, swizzle=k_ring.inner)  # (MMA, 1, (4, B/64), STAGES)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, v_ring.inner), v_ring.outer)  # same bytes
        sStats = storage.stats.get_tensor(cute.make_layout((QK_TILE_M, 2)))

        if warp_idx == self.tma_warp:
            self.load(
                qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV,
                sQ, sK, sV, q_producer, ring_producer, m_blk, half, h, hk, b, span, entries,
            )  # fmt: skip

        if warp_idx == self.mma_warp:
            self.mma(
                qk_mma, pv_mma, sQ, sK, sV, sP, tmem, tmem_barrier, q_consumer, ring_pipeline,
                s_full, pv_ready, o_full, n_tiles, half,
            )  # fmt: skip

        if warp_idx < self.correction_warps[0]:
            self.softmax(
                scale_log2, span, m_blk, tmem, tmem_barrier, s_full, pv_ready, stats, sStats, sP,
                tidx % EPI_THREADS, warp_idx % 4,
            )  # fmt: skip

        if warp_idx >= self.correction_warps[0] and warp_idx <= self.correction_warps[-1]:
            self.correction(
                tma_atom_o, mO, mO_mem, mLSE, storage.sQ.data_ptr(), o_smem, n_tiles, tmem, tmem_barrier,
                epi_barrier, pv_ready, o_full, stats, sStats, tidx % EPI_THREADS, warp_idx % 4, m_blk, half, h, b,
                n_rows, mSink,
            )  # fmt: skip

    def make_ring_pipeline(self, barriers, one_thread):
        """The ring's pipeline (a seam): stages filled by TMA (one arrival and the block's bytes),
        emptied by the MMA's commit. A later stage whose loads are not TMA's changes the producer."""
        return pipeline.PipelineTmaUmma.create(
            num_stages=self.plan.ring_stages, producer_group=one_thread, consumer_group=one_thread,
            tx_count=self.block_bytes, barrier_storage=barriers, defer_sync=True,
        )  # fmt: skip

    # /////////////////////////////////////////////////////////////////////////////////////
    #  TMA warp: Q once, then the ring's blocks in use order, last KV tile first
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def load(
        self, qk_mma, pv_mma, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mV,
        sQ, sK, sV, q_producer, ring_producer, m_blk, half, h, hk, b, span, entries,
    ):  # fmt: skip
        plan = self.plan
        n_tiles = span.n_tiles
        gQ, q_index = self.q_tile(mQ, m_blk, h, b)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
            cute.group_modes(qk_mma.get_slice(0).partition_A(gQ), 0, 3),
        )  # fmt: skip
        tKsK, tKgK, tVsV, tVgV = self.kv_tma_views(qk_mma, pv_mma, tma_atom_k, mK, tma_atom_v, mV, sK, sV, hk, b,
                                                   span.origin)
        sources = self.entry_sources(qk_mma, entries, sK, hk, b)

        stage = q_producer.acquire_and_advance()
        cute.copy(tma_atom_q, tQgQ[None, q_index], tQsQ[None, 0], tma_bar_ptr=stage.barrier)
        v_first = half * plan.v_blocks
        for it in cutlass.range(n_tiles, unroll=1):
            tile = n_tiles - 1 - it
            for kb in cutlass.range_constexpr(plan.blocks):  # ring uses it * U + kb
                stage = ring_producer.acquire_and_advance()
                self.load_k_block(span, tile, kb, tma_atom_k, tKgK, sources, tKsK[None, stage.index], stage.barrier)
            if const_expr(not self.kv_shared):  # K != V: never with compressed entries (K = V rows)
                for vb in cutlass.range_constexpr(plan.v_blocks):  # ring uses it * U + blocks + vb
                    stage = ring_producer.acquire_and_advance()
                    cute.copy(
                        tma_atom_v, tVgV[None, v_first + vb, tile], tVsV[None, stage.index], tma_bar_ptr=stage.barrier
                    )
        # every stage's last release (tcgen05.commit) has arrived before this warp exits
        ring_producer.tail()

    @cute.jit
    def load_k_block(self, span, tile, kb, tma_atom_k, tKgK, sources, dst, barrier):
        """K block kb of KV tile ``tile`` of the span -> ring stage ``dst``. The seam of a second
        source (``sources``: what ``entry_sources`` gave; E's tiles below span.n_cmp are its
        entries); here every tile is K's."""
        cute.copy(tma_atom_k, tKgK[None, tile, kb], dst, tma_bar_ptr=barrier)

    def kv_tma_views(self, qk_mma, pv_mma, tma_atom_k, mK, tma_atom_v, mV, sK, sV, hk, b, origin):
        """The ring's TMA partitions: tKgK[None, tile, kb] is K block kb of KV tile ``tile``, a
        (tile_n, d_block) box of (seqlen_k, head_dim) at key origin + tile * tile_n (a TMA box starts at
        any row; keys past the tensor are zero-filled); K != V: tVgV[None, vb, tile] is V block vb, a
        (d_block, tile_n) box of (head_dim, seqlen_k) at the same keys (None, None when K = V)."""
        plan = self.plan
        gK = cute.local_tile(cute.domain_offset((origin, 0), mK[None, None, hk, b]), (plan.tile_n, plan.d_block),
                             (None, None))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
            cute.group_modes(qk_mma.get_slice(0).partition_B(gK), 0, 3),
        )  # fmt: skip
        tVsV = tVgV = None
        if not self.kv_shared:
            gV = cute.local_tile(cute.domain_offset((0, origin), mV[None, None, hk, b]),
                                 (plan.d_block, plan.tile_n), (None, None))
            tVsV, tVgV = cpasync.tma_partition(
                tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                cute.group_modes(pv_mma.get_slice(0).partition_B(gV), 0, 3),
            )  # fmt: skip
        return tKsK, tKgK, tVsV, tVgV

    # /////////////////////////////////////////////////////////////////////////////////////
    #  MMA warp: TMEM owner; S = sum_kb Q_kb K_kb^T (SS); O_c += P V_c (SS, P from sP)
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def mma(
        self, qk_mma, pv_mma, sQ, sK, sV, sP, tmem, tmem_barrier, q_consumer, ring_pipeline,
        s_full, pv_ready, o_full, n_tiles, half,
    ):  # fmt: skip
        plan = self.plan
        tmem.allocate(self.tmem_columns)
        tmem.relinquish_alloc_permit()  # one allocation per CTA: let co-resident CTAs allocate
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)
        tmem_map = SmemPTmemMap.packed(self.dtype, plan)
        tStS = tmem_map.s().at(tmem_base)  # (MMA, 1, 1) fp32
        tOtO = [tmem_map.o_chunk(c).at(tmem_base) for c in range(plan.v_blocks)]  # (MMA, 1, 1) each

        tCrQ = qk_mma.make_fragment_A(sQ)  # (MMA, 1, (4, d/64), 1) SMEM descriptors
        tCrK = qk_mma.make_fragment_B(sK)  # (MMA, 1, (4, B/64), STAGES)
        if const_expr(plan.p_in_smem):
            tOrP = pv_mma.make_fragment_A(sP)[None, None, None, 0]  # (MMA, 1, T/16) SMEM descriptors
        else:
            tOrP = tmem_map.p_operand().at(tmem_base)  # (MMA, 1, T/16) 16-bit TMEM, over S's upper half
        tOrV = pv_mma.make_fragment_B(sV)  # (MMA, 1, T/16, STAGES)
        v_first = half * plan.v_blocks

        q_consumer.wait_and_advance()  # Q landed; never released (read until the end)
        self.issue_qk(make_qk_mma(self.dtype, plan), tStS, tCrQ, tCrK, ring_pipeline, 0, v_first)
        s_full.arrive(0)
        for it in cutlass.range(1, n_tiles, unroll=1):
            # the accumulate flag is state of a tiled MMA: fresh ones keep it inside this body
            self.issue_pv(make_pv_mma(self.dtype, plan), tOtO, tOrP, tOrV, ring_pipeline, pv_ready, it - 1, v_first)
            self.issue_qk(make_qk_mma(self.dtype, plan), tStS, tCrQ, tCrK, ring_pipeline, it, v_first)
            s_full.arrive(0)  # also covers PV(it - 1): sP is free, O holds every tile visited so far
        self.issue_pv(make_pv_mma(self.dtype, plan), tOtO, tOrP, tOrV, ring_pipeline, pv_ready, n_tiles - 1, v_first)
        o_full.arrive(0)

        # dealloc only after the softmax and correction warps' last TMEM access
        tmem_barrier.arrive_and_wait()
        fence_after_thread_sync()
        tmem.free(tmem_base, self.tmem_columns)

    @cute.jit
    def issue_qk(self, qk_mma, tStS, tCrQ, tCrK, ring_pipeline, it, v_first):
        """S = Q K^T of KV tile ``it`` in d / B k-subtiles, each waited for in the ring and
        accumulated into the one S (the first MMA overwrites it); K-only blocks released at once."""
        plan = self.plan
        last_kp = plan.d_block // MMA_INST_K - 1
        qk_mma.set(tcgen05.Field.ACCUMULATE, False)
        for kb, kp, q_phase in qk_subtile_schedule(plan):  # compile-time list: d / 16 MMAs
            if const_expr(kp == 0):
                state = self.ring.state(self.ring.k_use(it, kb))
                ring_pipeline.consumer_wait(state)
            cute.gemm(qk_mma, tStS, tCrQ[None, None, q_phase, 0], tCrK[None, None, kp, state.index], tStS)
            qk_mma.set(tcgen05.Field.ACCUMULATE, True)
            if const_expr(kp == last_kp):
                if const_expr(not plan.kv_shared):
                    ring_pipeline.consumer_release(state)  # tcgen05.commit -> empty once these MMAs read it
                else:
                    if kb < v_first or kb >= v_first + plan.v_blocks:  # K = V: not one of this CTA's V blocks
                        ring_pipeline.consumer_release(state)

    @cute.jit
    def issue_pv(self, pv_mma, tOtO, tOrP, tOrV, ring_pipeline, pv_ready, it, v_first):
        """O_c (+)= P V_c of KV tile ``it`` for each N chunk c, once P(it) is in sP and O rescaled:
        T / 16 SS MMAs per chunk (the first iteration's first MMA of a chunk overwrites it)."""
        pv_ready.wait(0, it)
        fence_after_thread_sync()  # order the MMAs after what the barrier reports
        for vb, _o_col, _d_col in pv_chunk_schedule(self.plan):  # chunk vb: TMEM O chunk vb, V block v_first + vb
            state = self.ring.state(self.ring.v_use(it, vb, v_first))
            ring_pipeline.consumer_wait(state)  # K = V: waited by QK(it) already; passes at once
            pv_mma.set(tcgen05.Field.ACCUMULATE, it > 0)
            for kp in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(pv_mma, tOtO[vb], tOrP[None, None, kp], tOrV[None, None, kp, state.index], tOtO[vb])
                pv_mma.set(tcgen05.Field.ACCUMULATE, True)
            ring_pipeline.consumer_release(state)

    # /////////////////////////////////////////////////////////////////////////////////////
    #  Softmax warpgroup: thread t owns row t of S, P, m and l; P goes to sP
    # /////////////////////////////////////////////////////////////////////////////////////
    def s_row_load(self, tmem_base, t):
        """Softmax thread t's S load: (tiled copy, its TMEM source chunks, the (row, key) within the
        tile of each register value). One row per thread: every value's row is t (host-proven)."""
        tmem_map = SmemPTmemMap.packed(self.dtype, self.plan)
        tiled_s_load, tS_chunks = make_acc_tmem_load(tmem_map.s().at(tmem_base), EPI_COLS)
        thr_s_load = tiled_s_load.get_slice(t)
        tTR_tS = thr_s_load.partition_S(tS_chunks)
        ids = epi_view(cute.make_identity_tensor((QK_TILE_M, self.plan.tile_n)), EPI_COLS)
        return tiled_s_load, tTR_tS, thr_s_load.partition_D(ids)

    def row_keys(self, span: KvSpan, m_blk, tTR_cS: cute.Tensor):
        """The keys [lo, hi) this softmax thread's row sees (its row: value 0's, the same for every value)."""
        return visible_keys(span, self.packed_row(m_blk, tTR_cS[0][0]))

    def tile_columns(self, span: KvSpan, keys, n):
        """(lo, hi): the columns lo <= c < hi of KV tile n this row sees (lo None: no lower bound), from
        its ``row_keys``. Stage E's seam (a compressed tile's columns are its entries below the row's count)."""
        return visible_columns(keys, span.first_key(n))

    @cute.jit
    def mask_s_row(self, s_row: cute.Tensor, tTR_cS: cute.Tensor, span: KvSpan, keys, it):
        """Keys of visit ``it`` (KV tile n_tiles - 1 - it) outside the row's ``keys`` -> -inf
        (common/sm100_softmax.py; run on the host for every thread in tests/test_d34_sm100_host.py)."""
        lo, hi = self.tile_columns(span, keys, span.n_tiles - 1 - it)
        if const_expr(self.masks_inner_tiles()):
            # any visit may straddle a window edge: each bound is applied where it cuts this row's
            # tile (kv_span.tile_needs_mask per row: a tile that passes it cuts no row)
            if hi < span.tile_n:
                mask_from(s_row, tTR_cS, hi)
            if const_expr(lo is not None):
                if lo > 0:
                    mask_below(s_row, tTR_cS, lo)
        else:
            if it == 0:  # the first visit holds the span's last key: the only keys past seqlen_k
                mask_from(s_row, tTR_cS, hi)

    @cute.jit
    def softmax(
        self, scale_log2, span, m_blk, tmem, tmem_barrier, s_full, pv_ready, stats, sStats, sP, t, warp,
    ):  # fmt: skip
        plan = self.plan
        n_tiles = span.n_tiles
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)
        tmem_map = SmemPTmemMap.packed(self.dtype, plan)
        tiled_s_load, tTR_tS, tTR_cS = self.s_row_load(tmem_base, t)
        tTR_rS = cute.make_rmem_tensor(tTR_cS.shape, Float32)
        if const_expr(plan.p_in_smem):
            p_row = cute.make_rmem_tensor(tTR_cS.shape, self.dtype)  # value v = key v of this row
            # P as a (128, T) tensor over sP's swizzled bytes: P(m, k) where the PV MMA reads A(m, k)
            sP_mk = cute.make_tensor(sP.iterator, p_mk_layout(sP.layout))
        else:
            # P over S's upper half in TMEM (stage C): value v of tRT_rP is value v of tTR_rS
            tStP = tmem_map.p_store().at(tmem_base)
            tiled_p_store = make_p_tmem_store(tStP)
            thr_p_store = tiled_p_store.get_slice(t)
            tRT_tP = thr_p_store.partition_D(tStP)
            p_ids = p_chunk_view(cute.make_identity_tensor((QK_TILE_M, plan.tile_n)), self.dtype)
            tRT_rP = cute.make_rmem_tensor(thr_p_store.partition_S(p_ids).shape, self.dtype)
            p_row = cute.make_tensor(tRT_rP.iterator, cute.make_layout(tTR_rS.shape))

        row = tTR_cS[0][0]  # the row this thread owns (t, proven on the host)
        keys = self.row_keys(span, m_blk, tTR_cS)
        m = Float32(-Float32.inf)
        row_sum = Float32(0.0)
        for it in cutlass.range(n_tiles, unroll=1):
            s_full.wait(0, it)  # also: PV(it - 1) completed, so sP may be overwritten
            fence_after_thread_sync()
            for c in cutlass.range_constexpr(cute.size(tTR_tS, mode=[4])):
                cute.copy(tiled_s_load, tTR_tS[None, None, None, 0, c], tTR_rS[None, None, None, 0, c])
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
            self.mask_s_row(tTR_rS, tTR_cS, span, keys, it)
            m, scale = lazy_max_update(m, row_max(tTR_rS), scale_log2, RESCALE_THRESHOLD, self.may_hide_rows())
            if it > 0:
                stats.producer_acquire(warp, it - 1)
                sStats[row, 0] = scale
                stats.producer_commit(warp)
            row_sum = row_sum * scale + exp2_into_p(tTR_rS, p_row, scale_log2,
                                                    max_to_subtract(m, self.may_hide_rows()))
            if const_expr(plan.p_in_smem):
                store_p_row(p_row, sP_mk, row)
                cute.arch.fence_view_async_shared()  # fence.proxy.async.shared::cta: P visible to the MMA
            else:
                for c in cutlass.range_constexpr(cute.size(tRT_tP, mode=[4])):
                    cute.copy(tiled_p_store, tRT_rP[None, None, None, 0, c], tRT_tP[None, None, None, 0, c])
                cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st
            fence_before_thread_sync()  # the S loads (and P stores) are ordered before the arrive
            pv_ready.arrive(0)

        stats.producer_acquire(warp, n_tiles - 1)
        sStats[row, 0] = row_sum
        sStats[row, 1] = m
        stats.producer_commit(warp)
        tmem_barrier.arrive()  # every TMEM access of this thread has completed (wait::ld above)

    # /////////////////////////////////////////////////////////////////////////////////////
    #  Correction warpgroup: thread t owns row t of O (this CTA's o_cols columns)
    # /////////////////////////////////////////////////////////////////////////////////////
    @cute.jit
    def correction(
        self, tma_atom_o, mO, mO_mem, mLSE, sq_base, o_smem, n_tiles, tmem, tmem_barrier, epi_barrier,
        pv_ready, o_full, stats, sStats, t, warp, m_blk, half, h, b, n_rows, mSink,
    ):  # fmt: skip
        plan = self.plan
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)
        tmem_map = SmemPTmemMap.packed(self.dtype, plan)
        tO = tmem_map.o().at(tmem_base)
        tiled_o_load, o_chunks = self.o_load(tmem_base)
        tiled_o_store, _ = make_acc_tmem_store(tO, EPI_COLS)
        thr_o_load = tiled_o_load.get_slice(t)
        tTR_tO = thr_o_load.partition_S(o_chunks)
        tRT_tO = tiled_o_store.get_slice(t).partition_D(o_chunks)
        tTR_cO = self.o_row_part(thr_o_load, cute.make_identity_tensor((QK_TILE_M, plan.o_cols)))
        tTR_rO = cute.make_rmem_tensor(tTR_cO[None, None, None, 0, 0].shape, Float32)
        row = tTR_cO[0][0]

        pv_ready.arrive(0)  # iteration 0: O is not written yet, nothing to rescale
        for it in cutlass.range(1, n_tiles, unroll=1):
            stats.consumer_wait(warp, it - 1)
            scale = sStats[row, 0]
            stats.consumer_release(warp)
            # the softmax saw S(it) full, so PV(it - 1) has completed: O is stable
            if cute.arch.vote_any_sync(scale < Float32(1.0)):
                fence_after_thread_sync()
                rescale_o_row(tiled_o_load, tTR_tO, tiled_o_store, tRT_tO, tTR_rO, scale)
            fence_before_thread_sync()
            pv_ready.arrive(0)

        stats.consumer_wait(warp, n_tiles - 1)
        row_sum = sStats[row, 0]
        row_max_x = sStats[row, 1]
        stats.consumer_release(warp)
        q_row = self.packed_row(m_blk, row)
        lse = (row_max_x + cute.math.log2(row_sum, fastmath=True)) * Float32(LN2)
        if half == 0 and self.lse_stored(row, q_row, n_rows):  # both halves of O compute the same LSE; one writes it
            mLSE[q_row, h, b] = lse

        sO = cute.make_tensor(cute.recast_ptr(sq_base, o_smem.inner, dtype=self.dtype), o_smem.outer)[None, None, 0]
        tTR_sO = self.o_row_part(thr_o_load, sO)
        o_full.wait(0, 0)
        fence_after_thread_sync()
        inv_row_sum = cute.arch.rcp_approx(row_sum)
        if const_expr(self.may_hide_rows()):  # a row that saw no key: O = 0 (not 0 * inf); LSE is -inf already
            inv_row_sum = Float32(0.0) if row_sum == Float32(0.0) else inv_row_sum
        inv_row_sum = self.row_scale(inv_row_sum, lse, mSink, q_row, h)
        o_row_to_smem(tiled_o_load, tTR_tO, tTR_sO, tTR_rO, inv_row_sum, self.dtype)

        cute.arch.fence_view_async_shared()  # sO visible to the TMA (async proxy)
        epi_barrier.arrive_and_wait()
        if const_expr(self.padded()):  # the owned rows only, row by row: a box would overwrite the next token's
            if self.row_stored(row, n_rows - m_blk * self.owned_rows):
                o_row_smem_to_gmem(tTR_sO, self.o_row_part(thr_o_load, self.o_tile(mO_mem, m_blk, half, h, b)))
        elif const_expr(self.varlen):
            rows_left = n_rows - m_blk * QK_TILE_M
            if self.o_by_tma(rows_left):  # uniform per CTA
                self.store_o_tma(tma_atom_o, mO, sO, t, m_blk, half, h, b)
            else:  # the tile straddles the request's end: the next request's rows must stay untouched
                if self.row_stored(row, rows_left):
                    o_row_smem_to_gmem(tTR_sO, self.o_row_part(thr_o_load, self.o_tile(mO_mem, m_blk, half, h, b)))
        else:
            self.store_o_tma(tma_atom_o, mO, sO, t, m_blk, half, h, b)

        fence_before_thread_sync()
        tmem_barrier.arrive()  # every tcgen05.ld of O has completed (waited in o_row_to_smem)

    @cute.jit
    def store_o_tma(self, tma_atom_o, mO, sO, t, m_blk, half, h, b):
        """The staged O tile (sO, complete: after the epilogue barrier) -> one TMA store of its
        (QK_TILE_M, o_cols) box; rows past the tensor's end are clipped by TMA."""
        if t == 0:  # one thread issues the store; bulk groups are per thread
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                cute.group_modes(self.o_tile(mO, m_blk, half, h, b), 0, 2),
            )  # fmt: skip
            cute.copy(tma_atom_o, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # SMEM must outlive the TMA's reads
