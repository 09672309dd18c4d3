"""Stage D1 on Hopper (SM90): P through SMEM, head dims up to 512, K = V loaded once.

    O[b, i, h, :] = sum_j softmax_j(scale * q_i . k_j) v_j          (input dtype)
    LSE[b, h, i]  = log sum_j exp(scale * q_i . k_j)                 (fp32, natural log)

Stage C's schedule (a TMA producer warp, consumer warpgroups with setmaxnreg, KV tiles
visited last-first, the next QK overlapping the softmax) with what head dims past 256 need.

Three layouts of the consumer warpgroups (W = 2, or 3 at head dim 64)
    rows    (head_dim <= 256, stage C's): warpgroup w owns Q rows [64 w, 64 w + 64) of a
            64 W-row tile, all keys of each KV tile and all head_dim columns of O. P stays
            in registers (RS wgmma, stage C) or, with p_in_smem, goes through SMEM (SS wgmma).
    From head_dim 320 on, O's 64 x head_dim fp32 is 256 registers a thread at 512, more than a
    warpgroup has: both warpgroups own the same 64 Q rows and split O's columns, warpgroup w
    holding [c_w, c_w + width), width = round_up(head_dim / 2, 64), c_0 = 0, c_1 = head_dim -
    width (64-aligned, so V's column view starts on a swizzle atom; at 320 and 448 the halves
    overlap by 64 columns, computed by both and stored by warpgroup 0). The PV wgmma is
    64 x width x 16, width <= 256. Each P tile is every warpgroup's A operand.
    seesaw  (K = V): warpgroup w computes the whole S = Q K^T of every other KV tile (visits
            2k + w), 64 x 64 per wgmma, so Q is read from SMEM once per tile instead of twice
            (64 x 32 wgmmas read Q for half the keys each: SMEM-bandwidth bound). FlashMLA's
            schedule; ours is written out at ``seesaw_lead`` and ``seesaw_follow``. Warpgroup 0 (the
            leader) takes tile a of a pair, 1 (the follower) tile b; the leader's new row max goes
            to the follower, which takes the larger of it and its own; the leader rescales its P_a
            to the follower's max before handing it over. Each adds its own P from registers (RS
            wgmma) and the other's from SMEM (SS wgmma). After every pair both O halves, both
            partial row sums and both maxima stand at the same max; the row sums meet at the end.
    split   (K != V, lock step): warpgroup w computes S for keys [32 w, 32 w + 32) of each
            64-key tile and the row max is exchanged through SMEM each tile (ROW_STATS). With
            separate K and V tiles only one of each fits SMEM at 512, too few for two tiles in
            flight, which the seesaw needs.

Per consumer warpgroup, per Q tile (rows and split; intra-warpgroup overlap, as stage C)
    first:  S = Q K[L]^T (L = n_blocks - 1); mask keys >= seqlen_k; [split: max exchange];
            m, P, l; P -> registers or sP[buffer of L]; O = 0.
    tile n = L-1 .. 0:
            issue S = Q K[n]^T                                 (wgmma group 1)
            [head_dim > 128: O *= r of the previous tile]
            issue O += P V[n+1]                                 (group 2, A = P regs or sP)
            wait group 1; [release K slot]; tile max; [split: write max, sync ROW_STATS,
            read the other half's]; m, P, l, r
            wait group 2; release V[n+1] (K = V: the shared slot)
            P -> registers, or -> sP[n % 2], fence, sync P_READY
            [head_dim <= 128: O *= r]
    last:   [O *= r]; O += P V[0]; wait; release.
    end:    [split: row sums through SMEM (ROW_STATS)]; O /= l; LSE; epilogue (O over sQ,
            one TMA store; the persistent seesaw: through each warpgroup's P buffer, 64 columns a
            box).

Why the SMEM buffers are free when written (split; two P buffers):
    sP[b] is written in tile n's iteration and last read by PV(n + 2) in both warpgroups.
    This warpgroup waited for its PV(n + 2) (wait group 2, previous iteration); the other
    warpgroup waited for its PV(n + 2) before it arrived at P_READY of tile n + 1, which
    this warpgroup has passed. The row-max slots: the other warpgroup reads this one's slot
    before it arrives at P_READY of the same tile, which the writer passes before writing
    the next max. rows + p_in_smem: each warpgroup owns its rows of sP and writes them after
    its own wait for the PV that read them, so one buffer suffices.

Why the seesaw's SMEM is free when written (one buffer each):
    sP[1] (P_b) is rewritten in pair k + 1 after the follower waited for handoff 0 of pair
    k + 1, which the leader gives after waiting for its PV over P_b(k) (wait_group at the top of
    its pair). sP[0] (P_a) is rewritten after the leader waited for handoff 1 of the same pair,
    which the follower gives after waiting for its PV over P_a(k) (the end of its pair k). The
    max slots: the follower reads the leader's before handing over 1, after which the leader
    writes the next; the leader reads the follower's before handing over 0 of the next pair,
    after which the follower writes again. The pair without b (odd tile count) keeps every
    handoff (the follower hands over its max unchanged), so the protocol never changes shape.
    Persistent: in the epilogue sP[w] holds warpgroup w's O, 64 columns at a time, written after
    the row sums' barrier (both warpgroups past their last PV, the last reads of either buffer);
    each box is written after the previous one's TMA store read it, and the warpgroup leaves the
    epilogue only after the last one's read, so the next tile's P finds its buffer free.

K = V (kv_shared): one ring of KV slots, each tile loaded once; QK reads a slot K-major, PV
    reads the same bytes MN-major; the slot is released after PV, so the ring needs >= 2 slots
    (QK(n) and PV(n+1) hold two; the seesaw's pair a, b), and at head dim 512 two is all that
    fits. The seesaw's ring has an even slot count and frees each tile in two halves, chunks
    [0, c_1 / 64) and the rest, each counting all eight consumer warps (``seesaw_halves``: the
    warpgroup that reads neither half of a tile arrives too, so a count does not depend on which
    warpgroup's S the slot holds): the leader's PV frees the first half of tile a while the
    follower's PV still reads the second, so the next tile's first chunks land early.
    In either ring a tile lands in 64-column chunks, each with its own full barrier, and QK's
    k-steps over chunk c wait for chunk c only (common/sm90_kv_chunks.py), so the next tile lands
    chunk by chunk as PV frees its slot. With K != V, K and V have rings of their own (stage C's
    pipelines).

Persistent grid (the seesaw, ``run_tiles``; common/persistent.py): one CTA per SM, each running
    Q tiles c, c + grid, ... with the ring uses, handoff rounds and Q phases counted on across
    them; each role runs its own tile loop (``role_tiles``: the producer, warpgroup 0, warpgroup
    1). sQ is free once both warpgroups' last QK of a tile has completed (``release_q``, every consumer thread arrives
    on q_empty), so the producer loads the next tile's Q first, under this tile's last PVs and
    its epilogue, then the next tile's first KV pair as the PVs free the slots. O does not go
    through sQ: each warpgroup stores its 256 columns through its own 8 KiB P buffer, one 64 x 64
    TMA box at a time (``store_o_chunks``). What the grid and Q under the epilogue measured:
    docs/stages/d1_smem_p.md.

Pipelines and barriers
    q_bar          TMA -> consumers: Q landed (one phase per tile).
    q_empty        persistent: every consumer thread after its warpgroup's last QK of the tile ->
                   producer: sQ read, the next Q may land.
    K = V ring     KvChunkRing: full[slot, chunk] (TMA transaction), empty[slot] (one arrive per
                   consumer warp after the PV that read the slot).
    pipeline_k/v   K != V: PipelineTmaAsync, full/empty per slot; one release arrive per
                   consumer warp.
    ROW_STATS      split: 256 consumer threads, between the row-max (row-sum) writes and reads;
                   seesaw: the final row sums.
    handoffs       seesaw: three mbarriers (common/sm90_barriers.RoundHandoff), one warpgroup's 128
                   threads arrive after their SMEM writes, the other waits (parity = pair & 1):
                   the leader's max; the follower's max and P_b; the leader's rescaled P_a.
    P_READY(_WGw)  after the P stores and their async-proxy fence, before any PV reads them.
    EPILOGUE       sQ free for O, then O in SMEM for the TMA store (common/sm90_epilogue.py).
    EPILOGUE_WGw   persistent: warpgroup w's O chunk in sP[w] for its TMA box, and the box before
                   it read (common/sm90_epilogue.store_o_chunks).

Default tiles (tile_m x tile_n; SMEM = Q + ring + sP, limit 227 KiB)
    head dim   64: 192 x 128   128: 128 x 128   192: 128 x 96   256: 128 x 80   (rows)
    320 .. 512: 64 x 64 (seesaw, split); ring slots of 64 x head_dim: K = V 4 / 2 / 2 / 2 slots
    at 320 / 384 / 448 / 512 (even), K and V 2 + 2 / 1 + 1 / 1 + 1 / 1 + 1.
    p_in_smem (rows) takes tile_n = 128 at head dims <= 128, 64 above (whole swizzled rows).

This file holds the kernel (options, shared storage, ``__call__``, ``kernel``, the producer, the
epilogue); the schedules live beside it, ``sm90_rows.py`` (rows and split) and ``sm90_seesaw.py``
(the persistent seesaw), the named operand bundles in ``sm90_operands.py``, and the tile order in
``common/tile_scheduler.py``.
"""


import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu.common import OperandMajorMode

from dsv4_attention.common.compile import SMEM_LIMIT
from dsv4_attention.common.kv_span import KvSpan
from dsv4_attention.common.layouts import check_attention_operands, seq_major
from dsv4_attention.common.p_staging import convert_p_packed, make_pv_tiled_mma
from dsv4_attention.common.pack_heads import rows
from dsv4_attention.common.persistent import grid_ctas
from dsv4_attention.common.seams import SplitParts
from dsv4_attention.common.sm90_barriers import (
    RoundHandoff,
    Sm90FwdBarrier,
    barrier_sync_unaligned,
)
from dsv4_attention.common.sm90_epilogue import store_lse, store_o_rows
from dsv4_attention.common.sm90_epilogue import store_o as epilogue_store_o
from dsv4_attention.common.sm90_epilogue import store_o_chunks as epilogue_store_o_chunks
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
from dsv4_attention.common.sm90_kv_chunks import CHUNK_COLS, KvChunkRing, chunk_views
from dsv4_attention.common.sm90_producer import load_q, load_q_k_v
from dsv4_attention.common.smem_p import make_p_smem_layout, store_p
from dsv4_attention.common.softmax import OnlineSoftmax, scale_rows
from dsv4_attention.common.split_kv import split_visits
from dsv4_attention.common.tile_scheduler import TileScheduler
from dsv4_attention.common.tiles import ROWS_TILES, SPLIT_FROM, SPLIT_TILE, split_columns, uses_seesaw
from dsv4_attention.stages.d1_smem_p.sm90_operands import (
    ConsumerOperands,
    GlobalTensors,
    SharedViews,
    TileRequest,
    TileViews,
)
from dsv4_attention.stages.d1_smem_p.sm90_rows import RowSplitSchedule
from dsv4_attention.stages.d1_smem_p.sm90_seesaw import SeesawSchedule

SUPPORTED_HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
SMEM_RESERVE = 1024  # barriers (and the split row stats: + 1 KiB), rounded to the 1 KiB alignment
MAX_SLOTS = 4


def smem_buffer(dtype, elems: int, used: bool):
    """A shared-storage field: 1 KiB-aligned ``elems`` values, or 16 bytes where this
    configuration does not use the buffer."""
    if used:
        return cute.struct.Align[cute.struct.MemRange[dtype, elems], SMEM_ALIGN]
    return cute.struct.MemRange[dtype, 16 // (dtype.width // 8)]


class FlashAttentionD1Sm90(SeesawSchedule, RowSplitSchedule, TileScheduler):
    arch = "sm_90a"

    register_plan = register_plan  # the setmaxnreg split, checked against the launch (common/compile.py)

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        *,
        kv_shared: bool = False,
        p_in_smem: bool | None = None,
        split_kv: bool = False,
    ):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be BFloat16 or Float16, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.kv_shared = bool(kv_shared)
        self.col_split = head_dim >= SPLIT_FROM
        # K = V at split head dims whose O halves are whole chunks (384, 512): the seesaw schedule
        # (each warpgroup a whole S tile of alternate KV tiles). Where the halves overlap (320, 448:
        # warpgroup 0's PV reads a chunk of half 1) the half-tile load order waits on a PV that waits
        # on a later load: those kernels hung on the H100 at >= 3 KV tiles, so they keep the
        # lock-step split, as K != V does (one K and one V slot is all that fits)
        self.seesaw = uses_seesaw("sm90", head_dim, self.kv_shared)
        if self.col_split:
            if p_in_smem is False:
                raise ValueError(f"head_dim {head_dim}: two warpgroups share P, so P must go through SMEM")
            self.p_in_smem = True
            self.tile_m, self.tile_n = SPLIT_TILE
            self.num_wg = 2
            self.wg_keys = self.tile_n if self.seesaw else self.tile_n // 2
            self.o_width, self.o_col1 = split_columns(head_dim)
            self.p_buffers = 2
        else:
            self.p_in_smem = bool(p_in_smem)
            self.tile_m, self.tile_n = ROWS_TILES[head_dim]
            if self.p_in_smem:
                self.tile_n = 128 if head_dim <= 128 else 64
            self.num_wg = self.tile_m // WGMMA_M
            self.wg_keys = self.tile_n
            self.o_width, self.o_col1 = head_dim, 0
            self.p_buffers = 1
        self.consumer_regs, self.producer_regs = REGISTERS[self.num_wg]
        self.consumer_threads = self.num_wg * THREADS_PER_WARPGROUP
        # ping-pong between warpgroups with their own rows where the softmax is a large
        # share of a tile (stage C's choice); split warpgroups run in lock step instead
        self.pingpong = not self.col_split and head_dim <= 128
        self.rescale_o_before_pv = head_dim > 128
        self.slots = self._ring_slots()
        # the seesaw runs a persistent grid (common/persistent.py): its CTA count is baked in, and
        # part of the configuration key where tiles.uses_seesaw says so (common/jit.config_key)
        self.persistent = self.seesaw
        self.ctas = grid_ctas()
        # split-KV (common/split_kv.py): each Q tile's span cut over num_splits units of the
        # persistent loop, each storing its partial O (fp32) and LSE; the host merges them
        self.split_kv = bool(split_kv)
        if self.split_kv and not self.seesaw:
            raise ValueError("split_kv needs the persistent seesaw (K = V at head dim 384 or 512)")
        self.shared_storage = None  # set when __call__ is traced

    def smem_bytes_fixed(self) -> int:
        q = self.tile_m * self.head_dim * 2
        p = self.p_buffers * self.tile_m * self.tile_n * 2 if self.p_in_smem else 0
        stats = 1024 if self.col_split else 0
        return q + p + stats + SMEM_RESERVE

    def _ring_slots(self) -> int:
        """K = V: slots of the one KV ring (>= 2: QK(n) and PV(n+1) hold two); otherwise
        slots of each of the K and V rings (>= 1)."""
        slot = self.tile_n * self.head_dim * 2
        fit = (SMEM_LIMIT - self.smem_bytes_fixed()) // slot
        if self.kv_shared:
            slots = min(MAX_SLOTS, fit)
            if self.seesaw:  # slot parity = the warpgroup whose S tile it holds (the halves' counts)
                slots -= slots % 2
            need = 2
        else:
            slots = min(2, fit // 2)
            need = 1
        if slots < need:
            raise ValueError(f"head_dim {self.head_dim}: the K/V ring does not fit SMEM ({fit} tile slots)")
        return slots

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
        partials: tuple,  # split-KV's SplitParts
    ):
        check_attention_operands(self.dtype, mQ, mK, mV, mO, mLSE)
        parts = SplitParts(None, None, None)
        if cutlass.const_expr(self.split_kv):  # split s of batch entry b at batch index s B + b
            mOPartial = seq_major(partials.o)
            _, mOPartial, mLSEPartial = self.row_views(mOPartial, mOPartial, partials.lse)
            parts = SplitParts(mOPartial, mLSEPartial, partials.num_splits)
        mQ, mK, mV, mO = [seq_major(t) for t in (mQ, mK, mV, mO)]
        mQ, mO, mLSE = self.row_views(mQ, mO, mLSE)

        d = self.head_dim
        qk_mma, pv_mma = self.make_mmas()
        pv_own_mma = self.make_pv_own_mma() if self.seesaw else pv_mma
        sQ_layout = make_tile_smem_layout(self.dtype, self.tile_m, d, 1)
        sKV_layout = make_tile_smem_layout(self.dtype, self.tile_n, d, self.slots)
        sVt_layout = make_tile_smem_layout_mn(self.dtype, self.tile_n, d, self.slots)
        sP_layout = self.p_smem_layout()
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_q, tma_q = make_tma_tile_atom(load, mQ, sQ_layout, self.tile_m, d)
        chunk_layout = None
        if cutlass.const_expr(self.kv_shared):  # (tile_n, 64) chunks, one barrier each
            chunk_layout = make_tile_smem_layout(self.dtype, self.tile_n, CHUNK_COLS, 1)
            tma_atom_k, tma_k = make_tma_tile_atom(load, mK, chunk_layout, self.tile_n, CHUNK_COLS)
        else:
            tma_atom_k, tma_k = make_tma_tile_atom(load, mK, sKV_layout, self.tile_n, d)
        if cutlass.const_expr(self.kv_shared):  # mV is mK: no second descriptor
            tma_atom_v, tma_v = tma_atom_k, tma_k
        else:
            tma_atom_v, tma_v = make_tma_tile_atom(load, mV, sKV_layout, self.tile_n, d)
        if cutlass.const_expr(self.persistent):  # O leaves through the P buffers, 64 columns a box
            tma_atom_o, tma_o = make_tma_tile_atom(store, mO, sP_layout, WGMMA_M, CHUNK_COLS)
        else:  # O over sQ, one box
            tma_atom_o, tma_o = make_tma_tile_atom(store, mO, sQ_layout, self.tile_m, d)
        entries = self.entry_operands(entries, load, chunk_layout)
        # K = V: KvChunkRing's full (slot x chunk) and empty (slot) barriers; else the K and
        # V pipelines' full + empty barriers
        if cutlass.const_expr(self.kv_shared):
            bars_a, bars_b = KvChunkRing.barrier_count(self.slots, d // CHUNK_COLS, halves=self.seesaw)
        else:
            bars_a, bars_b = 2 * self.slots, 2 * self.slots
        sV_t = smem_buffer(self.dtype, cute.cosize(sKV_layout), not self.kv_shared)
        sP_t = smem_buffer(self.dtype, cute.cosize(sP_layout), self.p_in_smem)
        stats_t = smem_buffer(cutlass.Float32, 2 * 2 * WGMMA_M, self.col_split)
        words_t = smem_buffer(cutlass.Int32, self.stage_words(), self.stage_words() > 0)

        @cute.struct
        class SharedStorage:
            q_bar: cutlass.Int64
            q_empty: cutlass.Int64  # persistent: sQ free for the next tile's Q (the last QKs have read it)
            # seesaw: the leader's max, the follower's max and P, the leader's P (RoundHandoff)
            handoffs: cute.struct.MemRange[cutlass.Int64, 3]
            k_bars: cute.struct.MemRange[cutlass.Int64, bars_a]
            v_bars: cute.struct.MemRange[cutlass.Int64, bars_b]
            # split: [warpgroup, row] row max, then row sum, of the 64 shared rows
            row_stats: stats_t
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], SMEM_ALIGN]
            sV: sV_t
            sP: sP_t
            stage_words: words_t  # int32 words a later stage asks for (``stage_words``)

        self.shared_storage = SharedStorage
        if cutlass.const_expr(SharedStorage.size_in_bytes() > SMEM_LIMIT):
            raise ValueError(f"shared storage {SharedStorage.size_in_bytes()} B exceeds {SMEM_LIMIT} B")

        m_tiles, batches = cute.ceil_div(rows(mQ), self.tile_m), mQ.shape[3]
        if cutlass.const_expr(self.varlen):  # tiles of the longest request x heads x requests
            m_tiles = cute.ceil_div(lengths.max_seqlen_q * self.pack_group, self.tile_m)
            batches = lengths.cu_seqlens_q.shape[0] - 1
        grid = (m_tiles, mQ.shape[2], batches)
        n_tiles = m_tiles * mQ.shape[2] * batches
        if cutlass.const_expr(self.split_kv):  # a unit per (Q tile, split)
            n_tiles = n_tiles * partials.num_splits
        if cutlass.const_expr(self.persistent):  # common/persistent.py: at most one CTA per SM, looping
            grid = (cutlass.min(n_tiles, self.ctas), 1, 1)
        self.kernel(
            qk_mma, pv_mma, pv_own_mma,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o, mO,
            mLSE, scale_log2,
            sQ_layout, sKV_layout, sVt_layout, sP_layout,
            lengths, window, mSink, entries, parts, m_tiles, n_tiles,
        ).launch(
            grid=grid,
            block=[THREADS_PER_WARPGROUP * (1 + self.num_wg), 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---- seams: what later stages change (defaults: one row per token, every key visible) ----
    pack_group = 1  # D2: query heads folded into a row tile
    uses_seqused_k = False  # D3: per-request key counts
    varlen = False  # D3: requests packed along the tokens (cu_seqlens)
    producer_warps = 1  # warps of the producer warpgroup that load (a gathering source: all four)
    full_arrivals = 1  # arrivals that complete a chunk's full barrier (a gathering source: every producer thread)
    lanes_read_slot = False  # every producer lane reads the slot's chunks (a gathering source)

    def kv_length(self, mSeqUsedK, batch, seqlen_k):
        """The keys of request ``batch`` (D3: seqused_k[batch])."""
        return seqlen_k

    def kv_span(self, m_block, rows, seqlen_k, window, entries) -> KvSpan:
        """Which keys Q tile ``m_block`` visits and how its tiles are masked (common/kv_span.py):
        here every key of the request, masked past ``seqlen_k`` only. D4 bounds it by ``window``
        (common/seams.Window); E adds its entries in front (``entries``: what its
        ``request_entries`` gave for the tile's request; None here)."""
        return KvSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, 0, 0, False, False)

    def may_hide_rows(self) -> bool:
        """Whether a row can see no key at all (then O = 0, LSE = -inf)."""
        return self.uses_seqused_k or self.varlen or self.split_kv  # split-KV: a split may hold no key

    def masks_inner_tiles(self) -> bool:
        """Whether tiles after the first visited one can straddle a boundary (D4's window edges)."""
        return False

    def row_views(self, mQ: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        """The seam where later stages change what a Q row is: (Q, O, LSE) as the kernel
        tiles them, Q and O (rows, head_dim, heads, batch), LSE (batch, heads, rows). One
        row per token here; stage D2 folds query heads into the rows."""
        return mQ, mO, mLSE

    def row_scale(self, inv_sum, lse, mSink, tScS, m_block, head):
        """The seam of the epilogue's per-row scale: ``inv_sum[i]`` (1 / row sum, which
        normalises O) of this thread's row i may be scaled further, given its LSE (natural log).
        Nothing here; stage D5 multiplies by the attention sink's sigmoid."""

    def request_views(self, batch, mQ, mK, mV, mO, mO_mem, mLSE, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK):
        """The seam where stage D3's variable-length batches change what a request is:
        (mQ, mK, mV, mO, mO_mem, mLSE, b, rows, seqlen_k) = the views to index with batch
        coordinate b, the request's (packed) row count and its key count. Here a request is a
        batch entry of the tensors (b = batch)."""
        return mQ, mK, mV, mO, mO_mem, mLSE, batch, rows(mQ), self.kv_length(mSeqUsedK, batch, mK.shape[0])

    # the entries seam (E: a second K = V source in the same softmax); nothing here

    def entry_operands(self, entries, load_op, chunk_layout):
        """Host side (traced in ``__call__``): the kernel's operand for the ``entries`` bundle
        (common/seams.Entries), or None where the stage has no second source."""
        return None

    def stage_words(self) -> int:
        """int32 words of shared memory a later stage asks for (E top-k: each ring slot's list)."""
        return 0

    def stage_words_view(self, words):
        """The view of the ``stage_words`` the later stage works with (None here)."""
        return None

    def prefetch_entries(self, entries):
        """Warp 0, with the CTA's TMA descriptors: the entries' descriptors."""

    def request_entries(self, request, b, entries, lengths):
        """The entries of request ``request`` (batch coordinate ``b``; ``lengths``: D3's bundle),
        as ``kv_span`` and ``entry_views`` take them."""
        return None

    def entry_views(self, req: "TileRequest", head_kv, b):
        """The entries' global views of a tile's (kv head, request), for the producer."""
        return None

    def stage_span(self, span, smem: "SharedViews", uses_before):
        """A tile's span meets the CTA's SMEM (E top-k: its list tiles follow the ring slots)."""

    def entry_sources(self, smem: "SharedViews", tile: "TileViews", warp_idx):
        """What ``load_kv`` takes besides K's TMA views to load a tile (None: K's tiles only)."""
        return None

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        pv_own_mma: cute.TiledMma,  # seesaw: PV over the warpgroup's own P in registers (else pv_mma)
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_o: cute.CopyAtom,
        mO: cute.Tensor,
        mO_mem: cute.Tensor,  # O's memory (mO is the TMA view): D3 varlen's predicated stores
        mLSE: cute.Tensor,
        scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        lengths: tuple,  # D3's Lengths (common/seams.py)
        window: tuple,  # D4's Window
        mSink: cute.Tensor | None,  # D5's sink
        entries,  # E's operands (``entry_operands``), or None
        partials: SplitParts,  # split-KV: (rows, d, heads, splits x batch) fp32 O, (splits x batch, heads, rows) LSE
        m_tiles: cutlass.Int32,  # Q tiles per (head, batch entry) of the launch (varlen: the longest request's)
        n_tiles: cutlass.Int32,  # m_tiles x heads x batch entries (x splits): the persistent loop's units
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tensors = GlobalTensors(mQ, mK, mV, mO, mO_mem, mLSE, lengths, window, entries, partials)
        atoms = (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o)
        layouts = (sQ_layout, sKV_layout, sVt_layout, sP_layout)
        mmas = (qk_mma, pv_mma, pv_own_mma)
        if cutlass.const_expr(self.persistent):
            self.run_tiles(warp_idx, tensors, atoms, layouts, mmas, mSink, scale_log2, m_tiles, n_tiles)
        else:
            m_block, head, batch = self.grid_tile()
            req = self.tile_request(head, batch, tensors)
            # a tile past its request's rows (varlen: the grid spans the longest request) has no work
            if m_block * self.tile_m < req.n_rows:
                self.prefetch_descriptors(atoms, tensors.entries, warp_idx)
                smem = self.shared_views(layouts, warp_idx)
                tile = self.tile_views(m_block, head, req, tensors, smem, 0)
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp_idx < self.producer_warps:
                        self.load(smem, tile, atoms, warp_idx)
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    c = self.consumer_operands(mmas, smem, tile, atoms, mSink, scale_log2)
                    self.consume(c, smem.ring, smem.pipeline_v, tile.n_blocks)  # the seesaw is persistent

    @cute.jit
    def prefetch_descriptors(self, atoms, entries, warp_idx):
        tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o = atoms
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_o)
            if cutlass.const_expr(not self.kv_shared):
                cpasync.prefetch_descriptor(tma_atom_v)
            self.prefetch_entries(entries)

    @cute.jit
    def shared_views(self, layouts, warp_idx) -> "SharedViews":
        """The CTA's SMEM: barriers initialised (then fenced, and the CTA synced), buffers viewed."""
        sQ_layout, sKV_layout, sVt_layout, sP_layout = layouts
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        q_bar = storage.q_bar.ptr
        q_empty = storage.q_empty.ptr
        handoffs = [RoundHandoff(storage.handoffs.data_ptr() + i) for i in range(3)]
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(q_bar, 1)
                if cutlass.const_expr(self.persistent):  # every consumer thread, after its last QK
                    cute.arch.mbarrier_init(q_empty, self.consumer_threads)
                if cutlass.const_expr(self.seesaw):
                    for h in handoffs:
                        h.init()
        tile_bytes = self.tile_n * self.head_dim * self.dtype.width // 8
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads // 32)
        if cutlass.const_expr(self.kv_shared):
            chunks = self.head_dim // CHUNK_COLS
            ring = KvChunkRing(storage.k_bars.data_ptr(), storage.v_bars.data_ptr(), self.slots, chunks,
                               tile_bytes // chunks, self.consumer_threads // 32, self.full_arrivals,
                               lanes_read_slot=self.lanes_read_slot,
                               halves=self.seesaw_halves() if self.seesaw else None,
                               r_chunk=self.o_col1 // CHUNK_COLS)
            pipeline_v = None
            self.init_ring(ring, warp_idx)
        else:
            ring = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.k_bars.data_ptr(), num_stages=self.slots, producer_group=producer,
                consumer_group=consumers, tx_count=tile_bytes, defer_sync=True,
            )
            pipeline_v = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.v_bars.data_ptr(), num_stages=self.slots, producer_group=producer,
                consumer_group=consumers, tx_count=tile_bytes, defer_sync=True,
            )
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # K = V: V's views are K's bytes
        v_buf = storage.sK if self.kv_shared else storage.sV
        return SharedViews(
            q_bar=q_bar, q_empty=q_empty, handoffs=handoffs, ring=ring, pipeline_v=pipeline_v,
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sK=storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner),
            sV=v_buf.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner),
            sVt=v_buf.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner),
            sP=storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner),
            row_stats=storage.row_stats.get_tensor(cute.make_layout((WGMMA_M, 2, 2))),  # (row, warpgroup, max|sum)
            stage_words=self.stage_words_view(storage.stage_words),
            ring_base=storage.sK.data_ptr(),
        )

    @cute.jit
    def tile_request(self, head, batch, tensors) -> "TileRequest":
        """The request of a tile's (head, batch entry): its views and lengths (the D3 and E seams)."""
        g, lengths = tensors, tensors.lengths
        head_kv = head // (g.mQ.shape[2] // g.mK.shape[2])
        mQ, mK, mV, mO, mO_mem, mLSE, b, n_rows, seqlen_k = self.request_views(
            batch, g.mQ, g.mK, g.mV, g.mO, g.mO_mem, g.mLSE, lengths.seqused_k, lengths.cu_seqlens_q,
            lengths.cu_seqlens_k)
        return TileRequest(mQ=mQ, mK=mK, mV=mV, mO=mO, mO_mem=mO_mem, mLSE=mLSE, b=b, n_rows=n_rows,
                           seqlen_k=seqlen_k, head_kv=head_kv,
                           entries=self.request_entries(batch, b, g.entries, lengths))

    @cute.jit
    def tile_views(self, m_block, head, req: "TileRequest", tensors, smem: "SharedViews", uses_before,
                   kv_part=None) -> "TileViews":
        """Q tile ``m_block`` of (head, req): its key span (ring uses from ``uses_before``) and the
        global views its loads and stores cut. split-KV: the span's visits are part ``kv_part``'s
        (common/split_kv.py), its O and LSE go to the partial buffers at batch index kv_part B + b."""
        d, b, head_kv = self.head_dim, req.b, req.head_kv
        span = self.kv_span(m_block, req.n_rows, req.seqlen_k, tensors.window, req.entries)
        n_blocks = span.n_tiles
        o_part = None
        if cutlass.const_expr(self.split_kv):
            mOp, mLSEp, num_splits = tensors.partials.o, tensors.partials.lse, tensors.partials.num_splits
            span.n_end, n_blocks = split_visits(span.n_tiles, kv_part, num_splits)
            pb = kv_part * (mOp.shape[3] // num_splits) + b
            o_part = (cute.local_tile(mOp[None, None, head, pb], (self.tile_m, d), (None, 0)), mLSEp, pb)
        self.stage_span(span, smem, uses_before)
        # KV tiles are cut from the span's first key (any row: TMA boxes start anywhere)
        mK_hb = cute.domain_offset((span.origin, 0), req.mK[None, None, head_kv, b])
        mV_hb = cute.domain_offset((span.origin, 0), req.mV[None, None, head_kv, b])
        return TileViews(
            m_block=m_block, head=head, b=b, n_rows=req.n_rows, span=span, n_blocks=n_blocks, mLSE=req.mLSE,
            gQ=cute.local_tile(req.mQ[None, None, head, b], (self.tile_m, d), (None, 0)),
            gO=cute.local_tile(req.mO[None, None, head, b], (self.tile_m, d), (None, 0)),
            gO_mem=cute.local_tile(req.mO_mem[None, None, head, b], (self.tile_m, d), (None, 0)),
            mK_hb=mK_hb,
            gK=cute.local_tile(mK_hb, (self.tile_n, d), (None, 0)),
            gV=cute.local_tile(mV_hb, (self.tile_n, d), (None, 0)),
            entries=self.entry_views(req, head_kv, b),
            o_part=o_part,
        )

    def consumer_operands(self, mmas, smem: "SharedViews", tile: "TileViews", atoms, mSink, scale_log2):
        return ConsumerOperands(mmas[0], mmas[1], smem.q_bar, smem.sQ, smem.sK, smem.sVt, smem.sP, smem.row_stats,
                                atoms[3], tile.gO, tile.gO_mem, tile.mLSE, mSink, scale_log2, tile.m_block, tile.head,
                                tile.b, tile.n_rows, tile.span, tile.o_part)

    @cute.jit
    def init_ring(self, ring: KvChunkRing, warp_idx: cutlass.Int32):
        if warp_idx == 0:
            with cute.arch.elect_one():
                ring.init()

    # -------------------------------------------------------------------------------
    # Producer: warp 0
    # -------------------------------------------------------------------------------

    @cute.jit
    def load(self, smem: SharedViews, tile: TileViews, atoms, warp_idx: cutlass.Int32, uses_before=0, tiles_before=0):
        """K[L], Q, then the tiles in the order the consumers need them: K = V, KV[n] for
        n = L-1 .. 0 (one load serves both GEMMs); otherwise (K[n - 1], V[n]) pairs as
        stage C, then V[0]. Rows past seqlen are zero-filled by TMA. The persistent seesaw's
        ring uses start at ``uses_before``, and ``tiles_before`` counts the CTA's earlier tiles (Q waits for the
        previous tile's epilogue to free sQ)."""
        tma_atom_q, tma_atom_k, tma_atom_v, _ = atoms
        n_blocks, m_block, span = tile.n_blocks, tile.m_block, tile.span
        tQsQ, tQgQ = tile_tma_partition(tma_atom_q, smem.sQ, tile.gQ)
        q_bytes = self.tile_m * self.head_dim * self.dtype.width // 8
        q_load = (smem.q_bar, tma_atom_q, tQgQ, tQsQ, m_block, q_bytes)
        if cutlass.const_expr(self.kv_shared):
            ring = smem.ring
            n_last = n_blocks - 1
            tKsK, tKgK = chunk_views(tma_atom_k, tile.mK_hb, smem.sK, self.tile_n)
            srcs = (span, tma_atom_k, tKgK, tKsK, self.entry_sources(smem, tile, warp_idx))
            if cutlass.const_expr(self.seesaw):
                self.load_pairs(ring, n_blocks, srcs, q_load, warp_idx, uses_before, tiles_before, smem.q_empty)
            else:
                self.load_kv(ring, 0, n_last, *srcs)
                if warp_idx == 0:
                    load_q(*q_load)
                for i in cutlass.range(n_last, unroll=1):
                    self.load_kv(ring, i + 1, n_last - 1 - i, *srcs)
        else:  # stage C's order (common/sm90_producer.py)
            tKsK, tKgK = tile_tma_partition(tma_atom_k, smem.sK, tile.gK)
            tVsV, tVgV = tile_tma_partition(tma_atom_v, smem.sV, tile.gV)
            load_q_k_v(smem.q_bar, smem.ring, smem.pipeline_v, self.slots, n_blocks, m_block, q_bytes,
                       tma_atom_q, tQgQ, tQsQ, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV)

    @cute.jit
    def load_pairs(self, ring: KvChunkRing, n_blocks, srcs, q_load, warp_idx, uses_before=0, tiles_before=0,
                   q_empty=None):
        """seesaw: the tiles of pair k (a = visit 2k, the leader's; b = 2k + 1, the follower's, absent
        in the last pair of an odd count) half by half in the order their halves are freed,
        FlashMLA's order: a's first half (the leader's PV over a frees it first), b's second (the
        follower's own PV), a's second (the follower's PV over a), b's first (the leader's PV over
        b, last). The follower's QK starts on b's second half (``first_chunk``), so both warpgroups
        start on the first half-load of their tile. Ring uses count from ``uses_before`` (the persistent
        CTA's earlier tiles). Q goes right after the first half-load on a CTA's first tile, and
        before it where that load may wait longer than Q: on a later tile (``tiles_before`` > 0; Q waits
        for ``q_empty``, the previous tile's last QKs, which come before the PVs that free the
        slot) and where the load waits for its index list (``q_first``)."""
        n_last = n_blocks - 1
        span = srcs[0]
        q_ahead, q_after = tiles_before > 0, tiles_before == 0
        if cutlass.const_expr(self.q_first()):
            q_ahead, q_after = True, False
        for k in cutlass.range((n_blocks + 1) // 2, unroll=1):
            t_a = 2 * k
            has_b = t_a < n_last
            if k == 0:
                if q_ahead:
                    self.issue_q(q_load, warp_idx, tiles_before, q_empty)
            n_a = span.visit_tile(t_a)  # tile a (b is n_a - 1)
            self.load_kv(ring, uses_before + t_a, n_a, *srcs, half=0)
            if k == 0:
                if q_after:
                    self.issue_q(q_load, warp_idx, tiles_before, q_empty)
            if has_b:
                self.load_kv(ring, uses_before + t_a + 1, n_a - 1, *srcs, half=1)
            self.load_kv(ring, uses_before + t_a, n_a, *srcs, half=1)
            if has_b:
                self.load_kv(ring, uses_before + t_a + 1, n_a - 1, *srcs, half=0)

    @cute.jit
    def issue_q(self, q_load, warp_idx, tiles_before, q_empty):
        """Warp 0: Q's TMA; on a CTA's later tile first the wait for the previous tile's last QKs to
        have read sQ (phase it - 1 of q_empty, every consumer warp's arrival: ``release_q``)."""
        if warp_idx == 0:
            if tiles_before > 0:
                cute.arch.mbarrier_wait(q_empty, (tiles_before - 1) % 2)
            load_q(*q_load)

    def q_first(self) -> bool:
        """seesaw: issue Q's TMA before the first KV half-load. A TMA half-load is one issue, so
        here Q goes right after it (the consumers need both); a load whose issue waits on
        something (the fused stage's gathered rows, behind their index lists) goes after Q."""
        return False

    @cute.jit
    def load_kv(self, ring: KvChunkRing, t, n, span: KvSpan, tma_atom_k, tKgK, tKsK, sources, half=None):
        """K = V: ring use t <- KV tile n of the span (the seesaw: only its half ``half``). The seam
        of a second source (``sources``: what ``entry_sources`` gave; E's tiles n < n_cmp are its
        entries); here every tile is K's."""
        ring.load(t, tma_atom_k, tKgK, tKsK, n, half)

    # -------------------------------------------------------------------------------
    # Consumers: warpgroups 1..W
    # -------------------------------------------------------------------------------

    # -------------------------------------------------------------------------------
    # Consumers, seesaw (K = V, head dims >= 320): warpgroup 0 leads, 1 follows
    # -------------------------------------------------------------------------------

        # both warpgroups hold O at the same max; the row sums meet in the epilogue, where each
        # stores its O through its own P buffer by the addresses its P stores use

    # -------------------------------------------------------------------------------
    # Pieces of the consumer loop
    # -------------------------------------------------------------------------------

    @cute.jit
    def epilogue(self, c: ConsumerOperands, acc_o, softmax: OnlineSoftmax, stat_rows, tScS, thr_pv, wg, tidx,
                 tPsP=None, visited=None):
        """[split, seesaw: the row sums of the two warpgroups added through SMEM]; O /= l (and the
        sink's seam); O over sQ, one TMA store (persistent: each warpgroup's columns through its P
        buffer, 64 at a time: the row sums' barrier says both warpgroups' PVs have read them; ``tPsP``
        the seesaw's P store view); LSE (split, seesaw: warpgroup 0's copy, both hold the same rows).
        ``visited``: split-KV, whether the unit visited a KV tile (None: always)."""
        total = None
        if cutlass.const_expr(self.col_split):
            total = self.exchange_sums(softmax, stat_rows, c.row_stats, wg, visited)
        inv_sum = softmax.finalize(total)
        self.row_scale(inv_sum, softmax.lse, c.mSink, tScS, c.m_block, c.head)
        scale_rows(acc_o, inv_sum)
        first_row = c.m_block * self.tile_m
        if cutlass.const_expr(self.split_kv):  # a split's part: O in fp32 and its LSE, no sink (the merge's)
            self.store_partial(c, acc_o, softmax.lse, tScS, thr_pv, wg)
        else:
            if cutlass.const_expr(self.persistent):  # the seesaw: wg is a constant here
                self.store_o_chunks(acc_o, c, tPsP, wg, tidx, c.seqlen_q - first_row)
            else:
                self.store_o(acc_o, c.sQ, thr_pv, c.tma_atom_o, c.gO, c.gO_mem, c.m_block, wg, tidx,
                             c.seqlen_q - first_row)
            if cutlass.const_expr(self.col_split):  # both warpgroups hold the same rows' LSE
                if wg == 0:
                    store_lse(c.mLSE, softmax.lse, tScS, first_row, c.head, c.batch, c.seqlen_q)
            else:
                store_lse(c.mLSE, softmax.lse, tScS, first_row, c.head, c.batch, c.seqlen_q)

    @cute.jit
    def store_partial(self, c: ConsumerOperands, acc_o, lse, tScS, thr_pv, wg: int):
        """split-KV: warpgroup ``wg``'s O columns (normalised within the split, fp32) straight from the
        accumulator to the partial O, rows < seqlen_q only, and (warpgroup 0) the rows' LSE to the
        partial LSE, at batch index split B + b (``c.o_part``). No SMEM: the P buffers are the next
        unit's, untouched."""
        gOp, mLSEp, pb = c.o_part
        first_row = c.m_block * self.tile_m
        gO_w = cute.local_tile(cute.domain_offset((0, wg * self.o_col1), gOp[None, None, c.m_block]),
                               (WGMMA_M, self.o_width), (0, 0))
        store_o_rows(acc_o, thr_pv, gO_w, c.seqlen_q - first_row)
        if cutlass.const_expr(wg == 0):
            store_lse(mLSEp, lse, tScS, first_row, c.head, pb, c.seqlen_q)
        cute.arch.sync_warp()  # reconverged before the next unit's wgmma (ptxas C7519)

    def make_mmas(self) -> tuple[cute.TiledMma, cute.TiledMma]:
        """(QK, PV) tiled MMAs: one warpgroup's (split) or all warpgroups stacked along M.
        PV's A is sP (SS wgmma) or the P registers (RS wgmma, stage C)."""
        warpgroups = 1 if self.col_split else self.num_wg
        qk_mma = make_tiled_mma(self.dtype, self.wg_keys, warpgroups=warpgroups)  # seesaw: 64 x 64 per warpgroup
        if self.p_in_smem:
            pv_mma = make_tiled_mma(self.dtype, self.o_width, b_major=OperandMajorMode.MN, warpgroups=warpgroups)
        else:
            pv_mma = make_pv_tiled_mma(self.dtype, self.head_dim, warpgroups=warpgroups)
        return qk_mma, pv_mma

    def p_smem_layout(self) -> cute.ComposedLayout:
        """sP (tile_m, tile_n, p_buffers) (common/smem_p.py); a 64-key placeholder view
        where P stays in registers (no bytes are allocated for it then)."""
        if self.p_in_smem:
            return make_p_smem_layout(self.dtype, self.tile_m, self.tile_n, self.p_buffers)
        return make_p_smem_layout(self.dtype, self.tile_m, 64, 1)

    @cute.jit
    def p_store_view(self, sP: cute.Tensor, wg, thr_qk: cute.ThrMma) -> cute.Tensor:
        """This thread's P values in sP, (acc_s's layout, buffers): the QK accumulator
        partition of the warpgroup's (64 rows, its 32 keys) block (split) or of the whole
        (tile_m, tile_n) tile (rows; the partition picks the warpgroup's rows)."""
        if cutlass.const_expr(self.col_split and not self.seesaw):
            return thr_qk.partition_C(cute.local_tile(sP, (WGMMA_M, self.wg_keys), (0, wg, None)))
        else:  # rows: the partition picks the rows; seesaw: warpgroup w writes buffer w (whole tile)
            return thr_qk.partition_C(sP)

    def qk_rows(self) -> int:
        """Rows of the QK / PV tiled MMAs: one warpgroup's 64 (split) or the whole tile."""
        return WGMMA_M if self.col_split else self.tile_m

    @cute.jit
    def warpgroup_views(self, wg, tidx, qk_mma, pv_mma, sQ, sK, sVt, sP):
        """The operand fragments and partitions of consumer warpgroup ``wg``.

        rows:  the tiled MMAs span all warpgroups along M; slice by the thread index.
        split: one-warpgroup MMAs; warpgroup w takes keys [32 w, 32 w + 32) of the K tile
               (4 KiB into each 64-column block, whole 1 KiB swizzle atoms) and V's
               columns [c_w, c_w + width) (whole 64-column blocks)."""
        if cutlass.const_expr(self.col_split):
            sub = tidx % THREADS_PER_WARPGROUP
            thr_qk = qk_mma.get_slice(sub)
            thr_pv = pv_mma.get_slice(sub)
            wg_qk = qk_mma.get_slice(0)
            wg_pv = pv_mma.get_slice(0)
            sK_w, sVt_w = self.split_operand_views(sK, sVt, wg)
        else:
            thr_qk = qk_mma.get_slice(tidx)
            thr_pv = pv_mma.get_slice(tidx)
            wg_qk = qk_mma.get_slice(wg * THREADS_PER_WARPGROUP)
            wg_pv = pv_mma.get_slice(wg * THREADS_PER_WARPGROUP)
            sK_w = sK
            sVt_w = sVt
        tSrQ = qk_mma.make_fragment_A(wg_qk.partition_A(sQ))[None, None, None, 0]  # (MMA, 1, d/16)
        tSrK = qk_mma.make_fragment_B(wg_qk.partition_B(sK_w))  # (MMA, 1, d/16, slots)
        tOrV = pv_mma.make_fragment_B(wg_pv.partition_B(sVt_w))  # (MMA, 1, N/16, slots)
        tOrP_smem = None
        tPsP = None
        if cutlass.const_expr(self.p_in_smem):
            tOrP_smem = pv_mma.make_fragment_A(wg_pv.partition_A(sP))  # (MMA, 1, N/16, buffers)
            tPsP = self.p_store_view(sP, wg, thr_qk)
        tScS = self.s_coords(wg, thr_qk)
        return tSrQ, tSrK, tOrV, tOrP_smem, tPsP, tScS, thr_qk, thr_pv

    def s_coords(self, wg, thr_qk: cute.ThrMma) -> cute.Tensor:
        """(row, key) within the (tile_m, tile_n) tile of every S value of this thread: its QK
        partition of the whole tile (rows) or of its warpgroup's keys [32 w, 32 w + 32) (split)."""
        keys = cute.make_identity_tensor((self.qk_rows() if self.col_split else self.tile_m, self.tile_n))
        if cutlass.const_expr(self.col_split and not self.seesaw):
            keys = cute.local_tile(keys, (WGMMA_M, self.wg_keys), (0, wg))
        return thr_qk.partition_C(keys)

    @cute.jit
    def mask_s(self, span: KvSpan, acc_s: cute.Tensor, tScS: cute.Tensor, n, first_row,
               first: cutlass.Constexpr[bool]):
        """Scores of KV tile n that a row may not see -> -inf: on the first tile visited always (it
        holds the span's last key, the only keys past seqlen_k), on later ones where the span says
        the tile straddles an edge (windows, compressed entries)."""
        if cutlass.const_expr(first):
            span.mask(acc_s, tScS, n, first_row)
        elif cutlass.const_expr(self.masks_inner_tiles()):
            span.mask_if_needed(acc_s, tScS, n, first_row)

    @cute.jit
    def split_operand_views(self, sK: cute.Tensor, sVt: cute.Tensor, wg):
        """split (lock step): warpgroup w's QK B operand, keys [32 w, 32 w + 32) of each K slot
        (keys, d, slots), and its PV B operand (``v_columns``)."""
        sK_w = cute.local_tile(sK, (self.wg_keys, self.head_dim), (wg, 0, None))
        return sK_w, self.v_columns(sVt, wg)

    @cute.jit
    def v_columns(self, sVt: cute.Tensor, wg):
        """split and seesaw: warpgroup w's PV B operand, V's columns [c_w, c_w + width) of each
        slot (width, keys, slots)."""
        return cute.local_tile(
            cute.domain_offset((wg * self.o_col1, 0, 0), sVt), (self.o_width, self.tile_n), (0, 0, None)
        )

    def own_p_buffer(self, wg: int) -> int:
        """seesaw: the sP buffer warpgroup wg stores its P into (the other warpgroup's SS PV reads it)."""
        return wg

    @cute.jit
    def tile_max(self, softmax, acc_s, stat_rows, row_stats, wg):
        """The rows' raw max over the whole KV tile. split: this half's max to SMEM (one
        lane per quad), sync ROW_STATS, max with the other half's; else None (local)."""
        if cutlass.const_expr(self.col_split):
            own = softmax.tile_max(acc_s)
            if stat_rows[0, 0][1] == wg * self.wg_keys:  # the quad's first lane
                for i in cutlass.range_constexpr(cute.size(own)):
                    row_stats[stat_rows[i, 0][0], wg, 0] = own[i]
            cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.ROW_STATS), number_of_threads=self.consumer_threads)
            for i in cutlass.range_constexpr(cute.size(own)):
                own[i] = cute.arch.fmax(own[i], row_stats[stat_rows[i, 0][0], 1 - wg, 0])
            return own
        else:
            return None

    def s_block_first_key(self, wg):
        """The first key of warpgroup wg's S block (a quad's first lane holds it)."""
        return 0 if self.seesaw else wg * self.wg_keys

    @cute.jit
    def exchange_sums(self, softmax, stat_rows, row_stats, wg, visited=None):
        """split: the full row sums, this half's plus the other's, through SMEM. ``visited`` False
        (split-KV, a unit without keys): both halves' sums are 0, and nothing is exchanged: the
        slots may still hold the previous unit's sums, unread (no handoff came between)."""
        own = softmax.row_sums()
        if cutlass.const_expr(visited is None):
            self.add_other_sums(own, stat_rows, row_stats, wg)
        else:
            if visited:
                self.add_other_sums(own, stat_rows, row_stats, wg)
        return own

    @cute.jit
    def add_other_sums(self, own, stat_rows, row_stats, wg):
        if stat_rows[0, 0][1] == self.s_block_first_key(wg):
            for i in cutlass.range_constexpr(cute.size(own)):
                row_stats[stat_rows[i, 0][0], wg, 1] = own[i]
        # unaligned: the persistent seesaw's warpgroups reach it each from its own copy of the epilogue
        barrier_sync_unaligned(int(Sm90FwdBarrier.ROW_STATS), self.consumer_threads)
        for i in cutlass.range_constexpr(cute.size(own)):
            own[i] = own[i] + row_stats[stat_rows[i, 0][0], 1 - wg, 1]

    @cute.jit
    def stage_p(self, acc_s, r_p, tPsP, p_buf, wg):
        """P -> 16 bits, in registers (stays there) or stored to sP[p_buf % buffers],
        fenced, and the readers synced."""
        if cutlass.const_expr(self.p_in_smem):
            store_p(acc_s, r_p, tPsP[None, None, None, p_buf % self.p_buffers])
            if cutlass.const_expr(self.col_split):
                cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.P_READY), number_of_threads=self.consumer_threads)
            else:
                cute.arch.barrier(
                    barrier_id=int(Sm90FwdBarrier.P_READY_WG0) + wg, number_of_threads=THREADS_PER_WARPGROUP
                )
        else:
            convert_p_packed(acc_s, r_p)

    @cute.jit
    def pv(self, pv_mma, acc_o, tOrP, tOrP_smem, tOrV, v_index, p_buf):
        """Issue O += P V with P from registers or from sP[p_buf % buffers]."""
        if cutlass.const_expr(self.p_in_smem):
            gemm(pv_mma, acc_o, tOrP_smem[None, None, None, p_buf % self.p_buffers],
                 tOrV[None, None, None, v_index], zero_init=False)
        else:
            gemm(pv_mma, acc_o, tOrP, tOrV[None, None, None, v_index], zero_init=False)

    @cute.jit
    def store_o(self, acc_o, sQ, thr_pv, tma_atom_o, gO, gO_mem, m_block, wg, tidx, rows_left):
        """O (normalized) -> 16 bits -> SMEM over sQ -> one TMA store (common/sm90_epilogue.py).
        split: warpgroup w writes its columns; where the halves overlap (320, 448) warpgroup 1
        skips the columns warpgroup 0 writes. varlen: a tile with fewer than tile_m rows left in
        its request goes from sO to global memory row by row, rows < rows_left only (the TMA box
        would write the next request's rows); the choice is uniform per CTA."""
        if cutlass.const_expr(self.varlen):
            if rows_left < self.tile_m:
                self.store_o_tma(acc_o, sQ, thr_pv, tma_atom_o, gO, m_block, wg, tidx,
                                 gO_rows=gO_mem[None, None, m_block], rows_left=rows_left)
            else:
                self.store_o_tma(acc_o, sQ, thr_pv, tma_atom_o, gO, m_block, wg, tidx)
        else:
            self.store_o_tma(acc_o, sQ, thr_pv, tma_atom_o, gO, m_block, wg, tidx)

    @cute.jit
    def store_o_tma(self, acc_o, sQ, thr_pv, tma_atom_o, gO, m_block, wg, tidx, gO_rows=None, rows_left=None):
        barrier_id = int(Sm90FwdBarrier.EPILOGUE)
        is_store_warp = tidx // 32 == 0
        rows = {"gO_rows": gO_rows, "rows_left": rows_left, "tidx": tidx}
        if cutlass.const_expr(self.col_split):
            sO_w = cute.local_tile(cute.domain_offset((0, wg * self.o_col1), sQ[None, None, 0]),
                                   (WGMMA_M, self.o_width), (0, 0))
            if cutlass.const_expr(self.o_col1 == self.o_width):
                epilogue_store_o(acc_o, sQ, thr_pv, tma_atom_o, gO, m_block, barrier_id, self.consumer_threads,
                                 is_store_warp, sO_mine=sO_w, **rows)
            else:
                overlap = self.o_width - self.o_col1
                epilogue_store_o(acc_o, sQ, thr_pv, tma_atom_o, gO, m_block, barrier_id, self.consumer_threads,
                                 is_store_warp, sO_mine=sO_w, skip_cols=wg * overlap, **rows)
        else:
            epilogue_store_o(acc_o, sQ, thr_pv, tma_atom_o, gO, m_block, barrier_id, self.consumer_threads,
                             is_store_warp, **rows)

    @cute.jit
    def store_o_chunks(self, acc_o, c: ConsumerOperands, tPsP, wg: int, tidx, rows_left):
        """The persistent seesaw: warpgroup ``wg``'s O columns [c_w, c_w + width) through its P
        buffer sP[wg], one 64-column TMA box at a time (common/sm90_epilogue.store_o_chunks), on its
        own named barrier; written through ``tPsP``, the view its P stores use (a second view's
        addresses, kept alive across the tile loop, spilled). varlen: as ``store_o``, a tile with
        fewer than tile_m rows left in its request goes row by row, rows < rows_left only."""
        buf = self.own_p_buffer(wg)
        sO = cute.local_tile(c.sP, (WGMMA_M, self.tile_n, 1), (0, 0, buf))  # (64, 64, 1)
        tOsO = tPsP[None, None, None, buf]
        gO_chunks = cute.local_tile(c.gO[None, None, c.m_block], (WGMMA_M, CHUNK_COLS), (0, None))  # (64, 64, d / 64)
        first = wg * (self.o_col1 // CHUNK_COLS)
        barrier_id = int(Sm90FwdBarrier.EPILOGUE_WG0) + wg
        # from the warp's uniform index: derived from tidx, a value kept across the tile loop spilled
        is_store_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0
        args = (acc_o, sO, tOsO, c.tma_atom_o, gO_chunks, first, barrier_id, is_store_warp)
        if cutlass.const_expr(self.varlen):
            if rows_left < self.tile_m:
                epilogue_store_o_chunks(*args, gO_rows=c.gO_mem[None, None, c.m_block], rows_left=rows_left,
                                        tidx=tidx % THREADS_PER_WARPGROUP)
            else:
                epilogue_store_o_chunks(*args)
        else:
            epilogue_store_o_chunks(*args)
