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
            (64 x 32 wgmmas read Q for half the keys each; SMEM bandwidth bounded that kernel
            near 64 % of the matmul rate). FlashMLA's schedule, in its own words in
            docs/20250422-new-kernel-deep-dive.md; ours is written out at ``seesaw_lead`` and
            ``seesaw_follow``. Warpgroup 0 (the leader) takes tile a of a pair, 1 (the
            follower) tile b; the leader's new row max goes to the follower, which takes the
            larger of it and its own; the leader rescales its P_a to the follower's max before
            handing it over. Each adds its own P from registers (RS wgmma) and the other's from
            SMEM (SS wgmma). After every pair both O halves, both partial row sums and both maxima
            stand at the same max; the row sums meet at the end.
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
    k-steps over chunk c wait for chunk c only (common/sm90_kv_chunks.py; on the H200 this took
    the lock-step kernel at head dim 512 from 415-441 to 511-523 TFLOP/s, when the next tile
    could load only after PV(n+1) freed its whole slot). With K != V, K and V have rings of their
    own (stage C's pipelines).

Persistent grid (the seesaw, ``run_tiles``; common/persistent.py): one CTA per SM, each running
    Q tiles c, c + grid, ... with the ring uses, handoff rounds and Q phases counted on across
    them; each role runs its own tile loop (``role_tiles``: the producer, warpgroup 0, warpgroup
    1). sQ is free once both warpgroups' last QK of a tile has completed (``release_q``, every consumer thread arrives
    on q_empty), so the producer loads the next tile's Q first, under this tile's last PVs and
    its epilogue, then the next tile's first KV pair as the PVs free the slots. O does not go
    through sQ: each warpgroup stores its 256 columns through its own 8 KiB P buffer, one 64 x 64
    TMA box at a time (``store_o_chunks``). The A/Bs (docs/results/experiments/): the grid itself
    (ab_persistent_h100.json, ab_persistent_h200.json) made the fused HCA layer 4-6 % faster, CSA
    2-3 %, the dense seesaw and index mode level; Q under the epilogue (ab_q_epilogue_h100.json)
    the HCA layer 8-17 % faster again.

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
"""

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from dsv4_attention.common.compile import SMEM_LIMIT
from dsv4_attention.common.kv_span import KvSpan, positions_row
from dsv4_attention.common.layouts import check_attention_operands, seq_major
from dsv4_attention.common.p_staging import as_a_operand, convert_p_packed, make_pv_tiled_mma
from dsv4_attention.common.pack_heads import rows
from dsv4_attention.common.persistent import grid_ctas
from dsv4_attention.common.sm90_barriers import (
    RoundHandoff,
    Sm90FwdBarrier,
    barrier_sync_unaligned,
    pingpong_pass,
    pingpong_start,
    pingpong_wait,
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
from dsv4_attention.common.softmax import OnlineSoftmax, acc_rows_view, scale_rows
from dsv4_attention.common.split_kv import split_visits
from dsv4_attention.common.tiles import ROWS_TILES, SPLIT_FROM, SPLIT_TILE, split_columns, uses_seesaw

SUPPORTED_HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
SMEM_RESERVE = 1024  # barriers (and the split row stats: + 1 KiB), rounded to the 1 KiB alignment
MAX_SLOTS = 4
PRODUCER = -1  # role_tiles: the load warps' role (the consumer warpgroups are 0 and 1)


@dataclasses.dataclass
class SeesawOperands:
    """One seesaw warpgroup's operand fragments and partitions (built once per CTA)."""
    tSrQ: cute.Tensor  # QK A: Q from SMEM
    tSrK: cute.Tensor  # QK B: the whole K tile of each slot
    tOrV: cute.Tensor  # PV B (SS MMA): this warpgroup's V columns of each slot
    tOrV_own: cute.Tensor  # PV B (RS MMA): the same columns
    tOrP_smem: cute.Tensor  # PV A (SS MMA): sP buffer w = warpgroup w's P
    tPsP: cute.Tensor  # this thread's P values in sP (acc layout, buffers)
    tScS: cute.Tensor  # (row, key) of this thread's S values
    q_empty: cute.Pointer | None  # persistent: arrived on after the warpgroup's last QK (sQ read)


@dataclasses.dataclass
class ConsumerOperands:
    """What both consumer schedules (lock step, seesaw) take from the kernel: the MMAs, Q's
    barrier, the SMEM views, the output's views and the CTA's coordinates (built once per CTA)."""
    qk_mma: cute.TiledMma
    pv_mma: cute.TiledMma
    q_bar: cute.Pointer
    sQ: cute.Tensor
    sK: cute.Tensor
    sVt: cute.Tensor
    sP: cute.Tensor
    row_stats: cute.Tensor  # (row, warpgroup, max|sum) fp32
    tma_atom_o: cute.CopyAtom
    gO: cute.Tensor  # O's tiles through TMA
    gO_mem: cute.Tensor  # the same tiles in memory (rows past the end: per-row stores)
    mLSE: cute.Tensor
    mSink: cute.Tensor | None
    scale_log2: cutlass.Float32
    m_block: cutlass.Int32
    head: cutlass.Int32
    batch: cutlass.Int32
    seqlen_q: cutlass.Int32
    span: KvSpan
    o_part: tuple | None = None  # split-KV: (the fp32 partial O tiles, partial LSE, partial batch index)


@dataclasses.dataclass
class SharedViews:
    """The CTA's SMEM, set up once (barriers initialised): what every tile's roles use."""
    q_bar: cute.Pointer  # Q landed (phase = the CTA's tile count & 1)
    q_empty: cute.Pointer  # persistent: every consumer warp's last QK has read sQ (phase per tile)
    handoffs: list  # seesaw: the three RoundHandoff barriers
    ring: object  # K = V: the KvChunkRing; else K's PipelineTmaAsync
    pipeline_v: object  # K != V: V's PipelineTmaAsync
    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    sVt: cute.Tensor
    sP: cute.Tensor
    row_stats: cute.Tensor  # (row, warpgroup, max|sum) fp32
    lists: cute.Tensor  # E top-k: (tile_n, slots) int32, each ring slot's tile of the list
    ring_base: cute.Pointer  # the ring's first byte (E top-k: rows gathered by address)


@dataclasses.dataclass
class Lengths:
    """D3's per-request key counts and variable-length offsets (None where unused)."""
    seqused_k: cute.Tensor | None
    cu_seqlens_q: cute.Tensor | None
    cu_seqlens_k: cute.Tensor | None


@dataclasses.dataclass
class Window:
    """D4's window bounds (None where unbounded: compiled out)."""
    left: cutlass.Int32 | None
    right: cutlass.Int32 | None


@dataclasses.dataclass
class Entries:
    """E's compressed entries: their TMA view and memory, the ratio, the top-k lists, the absolute
    position of raw key 0, the query positions, the varlen entry offsets (None where unused)."""
    mC: cute.Tensor
    mC_mem: cute.Tensor
    ratio: cutlass.Int32 | None
    mTopk: cute.Tensor | None
    kv_start: cutlass.Int32 | None
    mPositions: cute.Tensor | None
    mCuSeqlensC: cute.Tensor | None


@dataclasses.dataclass
class SplitParts:
    """Split-KV's partial outputs and split count (common/split_kv.py; None where unsplit)."""
    mO: cute.Tensor | None
    mLSE: cute.Tensor | None
    num_splits: cutlass.Int32 | None


@dataclasses.dataclass
class GlobalTensors:
    """The kernel's global operands by seam: Q, K, V, O (its TMA view and memory), LSE, then the
    bundles of the stages that use them."""
    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mO: cute.Tensor
    mO_mem: cute.Tensor
    mLSE: cute.Tensor
    lengths: Lengths
    window: Window
    entries: Entries
    split: SplitParts


@dataclasses.dataclass
class TileRequest:
    """The request a tile's (head, batch entry) belongs to: views to index with batch coordinate
    ``b``, its packed row count, key count and compressed entries (the D3 and E seams)."""
    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mO: cute.Tensor
    mO_mem: cute.Tensor
    mLSE: cute.Tensor
    b: cutlass.Int32
    n_rows: cutlass.Int32
    seqlen_k: cutlass.Int32
    head_kv: cutlass.Int32
    mC: cute.Tensor
    mC_mem: cute.Tensor
    n_compressed: cutlass.Int32
    topk: cute.Tensor | None
    positions: cute.Tensor | None


@dataclasses.dataclass
class TileViews:
    """One Q tile's key span and the global views its loads and stores cut."""
    m_block: cutlass.Int32
    head: cutlass.Int32
    b: cutlass.Int32
    n_rows: cutlass.Int32
    span: KvSpan
    n_blocks: cutlass.Int32
    mLSE: cute.Tensor
    gQ: cute.Tensor
    gO: cute.Tensor
    gO_mem: cute.Tensor
    mK_hb: cute.Tensor  # K's (seqlen, d) of the tile's (kv head, batch), from the span's first key
    gK: cute.Tensor
    gV: cute.Tensor
    mC_hb: cute.Tensor  # the compressed entries' (seqlen_c, d) (fused stage)
    mC_mem_hb: cute.Tensor  # their memory (E top-k gathers by address)
    o_part: tuple | None = None  # split-KV: (the fp32 partial O tiles, partial LSE, partial batch index)


def smem_buffer(dtype, elems: int, used: bool):
    """A shared-storage field: 1 KiB-aligned ``elems`` values, or 16 bytes where this
    configuration does not use the buffer."""
    if used:
        return cute.struct.Align[cute.struct.MemRange[dtype, elems], SMEM_ALIGN]
    return cute.struct.MemRange[dtype, 16 // (dtype.width // 8)]


class FlashAttentionD1Sm90:
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
        self.split = head_dim >= SPLIT_FROM
        # K = V at split head dims whose O halves are whole chunks (384, 512): the seesaw schedule
        # (each warpgroup a whole S tile of alternate KV tiles). Where the halves overlap (320, 448:
        # warpgroup 0's PV reads a chunk of half 1) the half-tile load order waits on a PV that waits
        # on a later load: those kernels hung on the H100 at >= 3 KV tiles, so they keep the
        # lock-step split, as K != V does (one K and one V slot is all that fits)
        self.seesaw = uses_seesaw("sm90", head_dim, self.kv_shared)
        if self.split:
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
        self.pingpong = not self.split and head_dim <= 128
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
        stats = 1024 if self.split else 0
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
        mSeqUsedK: cute.Tensor | None = None,
        window_left: cutlass.Int32 = None,
        window_right: cutlass.Int32 = None,
        mCuSeqlensQ: cute.Tensor | None = None,
        mCuSeqlensK: cute.Tensor | None = None,
        max_seqlen_q: cutlass.Int32 = None,
        mSink: cute.Tensor | None = None,
        mCompressed: cute.Tensor | None = None,
        compress_ratio: cutlass.Int32 = None,
        mTopk: cute.Tensor | None = None,
        kv_start: cutlass.Int32 = None,
        mPositions: cute.Tensor | None = None,
        mCuSeqlensC: cute.Tensor | None = None,
        mOPartial: cute.Tensor | None = None,
        mLSEPartial: cute.Tensor | None = None,
        num_splits: cutlass.Int32 = None,
    ):
        check_attention_operands(self.dtype, mQ, mK, mV, mO, mLSE)
        if cutlass.const_expr(self.split_kv):  # split s of batch entry b at batch index s B + b
            mOPartial = seq_major(mOPartial)
            _, mOPartial, mLSEPartial = self.row_views(mOPartial, mOPartial, mLSEPartial)
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
        # the fused stage's compressed entries: a second K = V source, the same chunked boxes (a
        # placeholder copy of K's atom where unused, compiled out)
        tma_atom_c, tma_c, mC_mem = tma_atom_k, tma_k, mO
        if cutlass.const_expr(self.has_compressed):
            mC_mem = seq_major(mCompressed)  # its memory: top-k rows are gathered by address
            tma_atom_c, tma_c = make_tma_tile_atom(load, seq_major(mCompressed), chunk_layout, self.tile_n,
                                                   CHUNK_COLS)
        # K = V: KvChunkRing's full (slot x chunk) and empty (slot) barriers; else the K and
        # V pipelines' full + empty barriers
        if cutlass.const_expr(self.kv_shared):
            bars_a, bars_b = KvChunkRing.barrier_count(self.slots, d // CHUNK_COLS, halves=self.seesaw)
        else:
            bars_a, bars_b = 2 * self.slots, 2 * self.slots
        sV_t = smem_buffer(self.dtype, cute.cosize(sKV_layout), not self.kv_shared)
        sP_t = smem_buffer(self.dtype, cute.cosize(sP_layout), self.p_in_smem)
        stats_t = smem_buffer(cutlass.Float32, 2 * 2 * WGMMA_M, self.split)
        lists_t = smem_buffer(cutlass.Int32, self.tile_n * self.slots, self.has_topk)

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
            lists: lists_t  # E top-k: each ring slot's tile of the token's list (tile_n, slots) int32

        self.shared_storage = SharedStorage
        if cutlass.const_expr(SharedStorage.size_in_bytes() > SMEM_LIMIT):
            raise ValueError(f"shared storage {SharedStorage.size_in_bytes()} B exceeds {SMEM_LIMIT} B")

        m_tiles, batches = cute.ceil_div(rows(mQ), self.tile_m), mQ.shape[3]
        if cutlass.const_expr(self.varlen):  # tiles of the longest request x heads x requests
            m_tiles, batches = cute.ceil_div(max_seqlen_q * self.pack_group, self.tile_m), mCuSeqlensQ.shape[0] - 1
        grid = (m_tiles, mQ.shape[2], batches)
        n_tiles = m_tiles * mQ.shape[2] * batches
        if cutlass.const_expr(self.split_kv):  # a unit per (Q tile, split)
            n_tiles = n_tiles * num_splits
        if cutlass.const_expr(self.persistent):  # common/persistent.py: at most one CTA per SM, looping
            grid = (cutlass.min(n_tiles, self.ctas), 1, 1)
        self.kernel(
            qk_mma, pv_mma, pv_own_mma,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o, mO,
            mLSE, scale_log2,
            sQ_layout, sKV_layout, sVt_layout, sP_layout,
            mSeqUsedK, window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSink, tma_atom_c, tma_c, compress_ratio,
            mTopk, mC_mem, kv_start, mPositions, mCuSeqlensC, m_tiles, n_tiles, mOPartial, mLSEPartial,
            num_splits if cutlass.const_expr(self.split_kv) else None,
        ).launch(
            grid=grid,
            block=[THREADS_PER_WARPGROUP * (1 + self.num_wg), 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---- seams: what later stages change (defaults: one row per token, every key visible) ----
    pack_group = 1  # D2: query heads folded into a row tile
    uses_seqused_k = False  # D3: per-request key counts
    has_left = has_right = False  # D4: window bounds (causal: right = 0)
    longest_first = False  # D4 causal: launch the Q tiles that see the most keys first
    varlen = False  # D3: requests packed along the tokens (cu_seqlens)
    has_compressed = False  # E: compressed entries, a second K = V source in the same softmax
    has_topk = False  # E: the compressed tiles are gathered list positions; SMEM keeps each slot's list
    producer_warps = 1  # warps of the producer warpgroup that load (E top-k: 4, gathering rows)
    full_arrivals = 1  # arrivals that complete a chunk's full barrier (E top-k: every producer thread)

    def kv_length(self, mSeqUsedK, batch, seqlen_k):
        """The keys of request ``batch`` (D3: seqused_k[batch])."""
        return seqlen_k

    def kv_span(self, m_block, rows, seqlen_k, window_left, window_right, compress_ratio, n_compressed,
                mTopk, kv_start=0, positions=None) -> KvSpan:
        """Which keys Q tile ``m_block`` visits and how its tiles are masked (common/kv_span.py;
        the fused stage adds compressed tiles in front, common/compressed.py, whose visibility
        counts absolute positions from ``kv_start``; ``positions``: the request's query tokens'
        absolute positions, or None for bottom-right alignment)."""
        return KvSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window_left, window_right,
                      self.has_left, self.has_right, positions, kv_start)

    def may_hide_rows(self) -> bool:
        """Whether a row can see no key at all (then O = 0, LSE = -inf)."""
        return self.uses_seqused_k or self.has_left or self.has_right or self.varlen

    def masks_inner_tiles(self) -> bool:
        """Whether tiles after the first visited one can straddle a boundary (window edges)."""
        return self.has_left or self.has_right

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

    def request_entries(self, request, b, mC, mC_mem, mTopk, mPositions, mCuSeqlensQ, mCuSeqlensC):
        """The seam where stage E's compressed entries meet D3's variable-length batches: (mC, mC_mem,
        n_compressed, topk, positions) = the compressed views to index with batch coordinate b, the
        request's entry count, its (seqlen_q, k) top-k lists (or None) and its query tokens' absolute
        positions (or None). Here a request is a batch entry of the tensors."""
        topk = None
        if cutlass.const_expr(mTopk is not None):
            topk = mTopk[b, None, None]
        return mC, mC_mem, mC.shape[0], topk, positions_row(mPositions, b)

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
        mSeqUsedK: cute.Tensor | None,
        window_left: cutlass.Int32 | None,
        window_right: cutlass.Int32 | None,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSink: cute.Tensor | None,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,  # compressed entries (seqlen_c, head_dim, kv_heads, batch); K's view where unused
        compress_ratio: cutlass.Int32 | None,
        mTopk: cute.Tensor | None,  # E top-k: (batch, seqlen_q, k) int32 lists of compressed entries
        mC_mem: cute.Tensor,  # the compressed entries' memory (seqlen_c, d, kv_heads, batch); O's where unused
        kv_start: cutlass.Int32 | None,  # E: the absolute position of raw key 0 (compressed visibility)
        mPositions: cute.Tensor | None,  # E: (batch or 1, seqlen_q) int32 query tokens' absolute positions
        mCuSeqlensC: cute.Tensor | None,  # E varlen: request b's entries are rows cu_c[b] .. cu_c[b + 1] of mC
        m_tiles: cutlass.Int32,  # Q tiles per (head, batch entry) of the launch (varlen: the longest request's)
        n_tiles: cutlass.Int32,  # m_tiles x heads x batch entries (x splits): the persistent loop's units
        mOPartial: cute.Tensor | None,  # split-KV: (rows, d, heads, splits x batch) fp32 partial O
        mLSEPartial: cute.Tensor | None,  # split-KV: (splits x batch, heads, rows) fp32 partial LSE
        num_splits: cutlass.Int32 | None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tensors = GlobalTensors(mQ, mK, mV, mO, mO_mem, mLSE, Lengths(mSeqUsedK, mCuSeqlensQ, mCuSeqlensK),
                                Window(window_left, window_right),
                                Entries(mC, mC_mem, compress_ratio, mTopk, kv_start, mPositions, mCuSeqlensC),
                                SplitParts(mOPartial, mLSEPartial, num_splits))
        atoms = (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o, tma_atom_c)
        layouts = (sQ_layout, sKV_layout, sVt_layout, sP_layout)
        mmas = (qk_mma, pv_mma, pv_own_mma)
        if cutlass.const_expr(self.persistent):
            self.run_tiles(warp_idx, tensors, atoms, layouts, mmas, mSink, scale_log2, m_tiles, n_tiles)
        else:
            m_block, head, batch = cute.arch.block_idx()
            if cutlass.const_expr(self.longest_first):  # causal: the tiles with the most keys start first
                m_block = cute.arch.grid_dim()[0] - 1 - m_block
            req = self.tile_request(head, batch, tensors)
            # a tile past its request's rows (varlen: the grid spans the longest request) has no work
            if m_block * self.tile_m < req.n_rows:
                self.prefetch_descriptors(atoms, warp_idx)
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
    def run_tiles(self, warp_idx, tensors, atoms, layouts, mmas, mSink, scale_log2, m_tiles, n_tiles):
        """The persistent seesaw (common/persistent.py): CTA c runs tiles c, c + grid, ... Each role
        walks the same tiles and keeps counters across them: ``t0``, the ring uses before the tile
        (its KV tile visits are ring uses t0 .. t0 + n_blocks - 1); ``it``, the tiles before it
        (Q's phase, and the producer's wait for the last QKs that free sQ); the consumers also
        ``r0``, the handoff rounds before it (one per pair: ceil(n_blocks / 2)). A tile past its
        request's rows (varlen: the launch spans the longest request) is skipped by every role
        alike (``tile_at``)."""
        self.prefetch_descriptors(atoms, warp_idx)
        smem = self.shared_views(layouts, warp_idx)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx < self.producer_warps:
                self.role_tiles(PRODUCER, warp_idx, tensors, atoms, mmas, smem, mSink, scale_log2, m_tiles, n_tiles)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            # each warpgroup its own tile loop: what its role keeps across tiles (the addresses of its
            # P buffer, which its epilogue stores O through) stays out of the other's loop (one loop
            # around both roles kept both buffers' addresses alive in each: 32 registers, spilled)
            if warp_idx < 8:
                self.role_tiles(0, warp_idx, tensors, atoms, mmas, smem, mSink, scale_log2, m_tiles, n_tiles)
            else:
                self.role_tiles(1, warp_idx, tensors, atoms, mmas, smem, mSink, scale_log2, m_tiles, n_tiles)

    @cute.jit
    def role_tiles(self, role: int, warp_idx, tensors, atoms, mmas, smem: "SharedViews", mSink, scale_log2, m_tiles,
                   n_tiles):
        """One role of the persistent seesaw over the CTA's tiles: ``role`` (constant) is PRODUCER
        (the load warps) or consumer warpgroup 0 / 1. The counters: ``t0`` the ring uses before the
        tile, ``it`` the tiles before it, ``r0`` (consumers) the handoff rounds before it."""
        heads = tensors.mQ.shape[2]
        t0 = cutlass.Int32(0)
        r0 = cutlass.Int32(0)
        it = cutlass.Int32(0)
        for tile_idx in cutlass.range(cute.arch.block_idx()[0], n_tiles, cute.arch.grid_dim()[0], unroll=1):
            m_block, head, req, has_rows, split = self.tile_at(tile_idx, m_tiles, heads, tensors)
            if has_rows:
                tile = self.tile_views(m_block, head, req, tensors, smem, t0, split)
                if self.has_visits(tile):
                    if cutlass.const_expr(role == PRODUCER):
                        self.load(smem, tile, atoms, warp_idx, t0, it)
                    else:
                        c = self.consumer_operands(mmas, smem, tile, atoms, mSink, scale_log2)
                        self.consume_seesaw(role, c, mmas[2], smem.ring, smem.handoffs, tile.n_blocks, t0, r0, it,
                                            smem.q_empty)
                        r0 = r0 + (tile.n_blocks + 1) // 2
                    t0 = t0 + tile.n_blocks
                    it = it + 1
                else:  # split-KV: a split past the span's tiles stores O = 0, LSE = -inf, loads nothing
                    if cutlass.const_expr(self.split_kv and role != PRODUCER):
                        self.store_empty_split(role, self.consumer_operands(mmas, smem, tile, atoms, mSink,
                                                                            scale_log2))

    @cute.jit
    def tile_at(self, tile_idx, m_tiles, heads, tensors):
        """The launch's unit ``tile_idx`` as every role of the persistent loop sees it: (m_block,
        head, its request, whether it has rows: a tile past its request's rows has no work, varlen;
        its split, split-KV, else None)."""
        m_block, head, batch, split = self.tile_coords(tile_idx, m_tiles, heads, tensors.split.num_splits)
        req = self.tile_request(head, batch, tensors)
        has_rows = cutlass.Boolean(True)
        if cutlass.const_expr(self.varlen):  # the launch spans the longest request
            has_rows = m_block * self.tile_m < req.n_rows
        return m_block, head, req, has_rows, split

    @cute.jit
    def tile_coords(self, tile_idx, m_tiles, heads, num_splits=None):
        """(m_block, head, batch, split) of the launch's unit ``tile_idx``: the Q tile fastest, then
        the split (split-KV; else None), the head, the batch entry (the non-persistent grid's x, y,
        z, in that order: a token's Q tiles, and then its splits, run side by side on the same KV
        rows); longest first where D4 asks for it."""
        m_block = tile_idx % m_tiles
        hb = tile_idx // m_tiles
        split = None
        if cutlass.const_expr(self.split_kv):
            split = hb % num_splits
            hb = hb // num_splits
        if cutlass.const_expr(self.longest_first):
            m_block = m_tiles - 1 - m_block
        return m_block, hb % heads, hb // heads, split

    def has_visits(self, tile: "TileViews"):
        """Whether a unit visits any KV tile: always, but for a split-KV unit past its span's tiles."""
        if cutlass.const_expr(self.split_kv):
            return tile.n_blocks > 0
        return True

    @cute.jit
    def prefetch_descriptors(self, atoms, warp_idx):
        tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o, tma_atom_c = atoms
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_o)
            if cutlass.const_expr(not self.kv_shared):
                cpasync.prefetch_descriptor(tma_atom_v)
            if cutlass.const_expr(self.has_compressed):
                cpasync.prefetch_descriptor(tma_atom_c)

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
                               lanes_read_slot=self.has_topk,
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
            lists=storage.lists.get_tensor(cute.make_layout((self.tile_n, self.slots))),
            ring_base=storage.sK.data_ptr(),
        )

    @cute.jit
    def tile_request(self, head, batch, tensors) -> "TileRequest":
        """The request of a tile's (head, batch entry): its views and lengths (the D3 and E seams)."""
        g, lengths, e = tensors, tensors.lengths, tensors.entries
        head_kv = head // (g.mQ.shape[2] // g.mK.shape[2])
        mQ, mK, mV, mO, mO_mem, mLSE, b, n_rows, seqlen_k = self.request_views(
            batch, g.mQ, g.mK, g.mV, g.mO, g.mO_mem, g.mLSE, lengths.seqused_k, lengths.cu_seqlens_q,
            lengths.cu_seqlens_k)
        mC, mC_mem, n_compressed, topk_b, positions_b = self.request_entries(
            batch, b, e.mC, e.mC_mem, e.mTopk, e.mPositions, lengths.cu_seqlens_q, e.mCuSeqlensC)
        return TileRequest(mQ=mQ, mK=mK, mV=mV, mO=mO, mO_mem=mO_mem, mLSE=mLSE, b=b, n_rows=n_rows,
                           seqlen_k=seqlen_k, head_kv=head_kv, mC=mC, mC_mem=mC_mem, n_compressed=n_compressed,
                           topk=topk_b, positions=positions_b)

    @cute.jit
    def tile_views(self, m_block, head, req: "TileRequest", tensors, smem: "SharedViews", t0,
                   split=None) -> "TileViews":
        """Q tile ``m_block`` of (head, req): its key span (ring uses from ``t0``: a top-k span's
        staged lists follow the ring's slots) and the global views its loads and stores cut.
        split-KV: the span's visits are split ``split``'s (common/split_kv.py), its O and LSE go to
        the partial buffers at batch index split B + b."""
        window, entries = tensors.window, tensors.entries
        d, b, head_kv = self.head_dim, req.b, req.head_kv
        span = self.kv_span(m_block, req.n_rows, req.seqlen_k, window.left, window.right, entries.ratio,
                            req.n_compressed, req.topk, entries.kv_start, req.positions)
        n_blocks = span.n_tiles
        o_part = None
        if cutlass.const_expr(self.split_kv):
            mOp, mLSEp, num_splits = tensors.split.mO, tensors.split.mLSE, tensors.split.num_splits
            span.n_end, n_blocks = split_visits(span.n_tiles, split, num_splits)
            pb = split * (mOp.shape[3] // num_splits) + b
            o_part = (cute.local_tile(mOp[None, None, head, pb], (self.tile_m, d), (None, 0)), mLSEp, pb)
        if cutlass.const_expr(self.has_topk):  # the producer stages each tile's list entries here
            span.stage_lists(smem.lists, self.slots, t0)
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
            mC_hb=req.mC[None, None, head_kv, b],
            mC_mem_hb=req.mC_mem[None, None, head_kv, b],
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
    def load(self, smem: SharedViews, tile: TileViews, atoms, warp_idx: cutlass.Int32, t0=0, it=0):
        """K[L], Q, then the tiles in the order the consumers need them: K = V, KV[n] for
        n = L-1 .. 0 (one load serves both GEMMs); otherwise (K[n - 1], V[n]) pairs as
        stage C, then V[0]. Rows past seqlen are zero-filled by TMA. The persistent seesaw's
        ring uses start at ``t0``, and ``it`` counts the CTA's earlier tiles (Q waits for the
        previous tile's epilogue to free sQ)."""
        tma_atom_q, tma_atom_k, tma_atom_v, _, tma_atom_c = atoms
        n_blocks, m_block, span = tile.n_blocks, tile.m_block, tile.span
        tQsQ, tQgQ = tile_tma_partition(tma_atom_q, smem.sQ, tile.gQ)
        q_bytes = self.tile_m * self.head_dim * self.dtype.width // 8
        q_load = (smem.q_bar, tma_atom_q, tQgQ, tQsQ, m_block, q_bytes)
        if cutlass.const_expr(self.kv_shared):
            ring = smem.ring
            n_last = n_blocks - 1
            tKsK, tKgK = chunk_views(tma_atom_k, tile.mK_hb, smem.sK, self.tile_n)
            tCgC = None
            if cutlass.const_expr(self.has_compressed):
                _, tCgC = chunk_views(tma_atom_c, tile.mC_hb, smem.sK, self.tile_n)
            gather = (smem.ring_base, tile.mC_mem_hb, warp_idx)
            srcs = (span, tma_atom_k, tKgK, tKsK, tma_atom_c, tCgC, gather)
            if cutlass.const_expr(self.seesaw):
                self.load_pairs(ring, n_blocks, srcs, q_load, warp_idx, t0, it, smem.q_empty)
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
    def load_pairs(self, ring: KvChunkRing, n_blocks, srcs, q_load, warp_idx, t0=0, it=0, q_empty=None):
        """seesaw: the tiles of pair k (a = visit 2k, the leader's; b = 2k + 1, the follower's, absent
        in the last pair of an odd count) half by half in the order their halves are freed,
        FlashMLA's order: a's first half (the leader's PV over a frees it first), b's second (the
        follower's own PV), a's second (the follower's PV over a), b's first (the leader's PV over
        b, last). The follower's QK starts on b's second half (``first_chunk``), so both warpgroups
        start on the first half-load of their tile. Ring uses count from ``t0`` (the persistent
        CTA's earlier tiles). Q goes right after the first half-load on a CTA's first tile, and
        before it where that load may wait longer than Q: on a later tile (``it`` > 0; Q waits
        for ``q_empty``, the previous tile's last QKs, which come before the PVs that free the
        slot) and where the load waits for its index list (``q_first``)."""
        n_last = n_blocks - 1
        span = srcs[0]
        q_ahead, q_after = it > 0, it == 0
        if cutlass.const_expr(self.q_first()):
            q_ahead, q_after = True, False
        for k in cutlass.range((n_blocks + 1) // 2, unroll=1):
            t_a = 2 * k
            has_b = t_a < n_last
            if k == 0:
                if q_ahead:
                    self.issue_q(q_load, warp_idx, it, q_empty)
            n_a = span.visit_tile(t_a)  # tile a (b is n_a - 1)
            self.load_kv(ring, t0 + t_a, n_a, *srcs, half=0)
            if k == 0:
                if q_after:
                    self.issue_q(q_load, warp_idx, it, q_empty)
            if has_b:
                self.load_kv(ring, t0 + t_a + 1, n_a - 1, *srcs, half=1)
            self.load_kv(ring, t0 + t_a, n_a, *srcs, half=1)
            if has_b:
                self.load_kv(ring, t0 + t_a + 1, n_a - 1, *srcs, half=0)

    @cute.jit
    def issue_q(self, q_load, warp_idx, it, q_empty):
        """Warp 0: Q's TMA; on a CTA's later tile first the wait for the previous tile's last QKs to
        have read sQ (phase it - 1 of q_empty, every consumer warp's arrival: ``release_q``)."""
        if warp_idx == 0:
            if it > 0:
                cute.arch.mbarrier_wait(q_empty, (it - 1) % 2)
            load_q(*q_load)

    def q_first(self) -> bool:
        """seesaw: issue Q's TMA before the first KV half-load. A TMA half-load is one issue, so
        here Q goes right after it (the consumers need both); a load whose issue waits on
        something (the fused stage's gathered rows, behind their index lists) goes after Q."""
        return False

    @cute.jit
    def load_kv(self, ring: KvChunkRing, t, n, span: KvSpan, tma_atom_k, tKgK, tKsK, tma_atom_c, tCgC, gather,
                half=None):
        """K = V: ring use t <- KV tile n of the span (the seesaw: only its half ``half``). The seam
        of the fused stage, whose tiles n < n_cmp come from the compressed entries (``tCgC``, or
        rows gathered by ``gather``: (ring_base, the compressed (entries, d) view, warp)); here
        every tile is K's."""
        ring.load(t, tma_atom_k, tKgK, tKsK, n, half)

    # -------------------------------------------------------------------------------
    # Consumers: warpgroups 1..W
    # -------------------------------------------------------------------------------

    @cute.jit
    def consume(self, c: ConsumerOperands, pipeline_k, pipeline_v, n_blocks: cutlass.Int32):
        qk_mma, pv_mma, span, m_block = c.qk_mma, c.pv_mma, c.span, c.m_block
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        views = self.warpgroup_views(wg, tidx, qk_mma, pv_mma, c.sQ, c.sK, c.sVt, c.sP)
        tSrQ, tSrK, tOrV, tOrP_smem, tPsP, tScS, thr_qk, thr_pv = views

        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.qk_rows(), self.wg_keys)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.qk_rows(), self.o_width)))
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)  # P, 16-bit, laid out like S
        tOrP = as_a_operand(r_p)
        softmax = OnlineSoftmax(acc_s.layout, c.scale_log2, may_be_empty=self.may_hide_rows())
        o_scale = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        # split: this thread's rows within the 64 shared rows, and whether it writes them
        stat_rows = acc_rows_view(tScS)

        if cutlass.const_expr(self.pingpong):
            pingpong_start(wg)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.slots)
        p_buf = n_blocks - 1  # sP buffer = tile index mod p_buffers

        # ---- first tile (n_blocks - 1, holds the last key) ---------------------------
        t = cutlass.Int32(0)  # K = V: tile use of the ring (tile n_blocks - 1 - t)
        cute.arch.mbarrier_wait(c.q_bar, 0)
        if cutlass.const_expr(self.kv_shared):
            pipeline_k.gemm_qk(t, qk_mma, acc_s, tSrQ, tSrK[None, None, None, 0])
        else:
            pipeline_k.consumer_wait(state)
            gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        warpgroup.wait_group(0)
        if cutlass.const_expr(not self.kv_shared):
            pipeline_k.consumer_release(state)
        self.mask_s(span, acc_s, tScS, n_blocks - 1, m_block * self.tile_m, first=True)
        softmax.update(acc_s, is_first=True, tile_max=self.tile_max(softmax, acc_s, stat_rows, c.row_stats, wg))
        self.stage_p(acc_s, r_p, tPsP, p_buf, wg)
        acc_o.fill(0.0)
        o_scale.fill(1.0)

        # ---- every further tile: QK(n) and PV(n + 1) in flight, then softmax(n) --------
        for i in cutlass.range(n_blocks - 1, unroll=1):
            v_state = state.clone()
            t_v = t
            if cutlass.const_expr(self.kv_shared):
                t = t + 1
                self.scheduler_wait(wg)
                pipeline_k.gemm_qk(t, qk_mma, acc_s, tSrQ, tSrK[None, None, None, t % self.slots])
            else:
                state.advance()
                pipeline_k.consumer_wait(state)
                self.scheduler_wait(wg)
                gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
            if cutlass.const_expr(self.rescale_o_before_pv):
                scale_rows(acc_o, o_scale)
            if cutlass.const_expr(self.kv_shared):
                self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, t_v % self.slots, p_buf)
            else:
                pipeline_v.consumer_wait(v_state)
                self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, v_state.index, p_buf)
            self.scheduler_pass(wg)
            warpgroup.wait_group(1)  # S(n) complete; PV may still run
            if cutlass.const_expr(not self.kv_shared):
                pipeline_k.consumer_release(state)
            self.mask_s(span, acc_s, tScS, n_blocks - 2 - i, m_block * self.tile_m, first=False)
            row_scale = softmax.update(
                acc_s, is_first=False, tile_max=self.tile_max(softmax, acc_s, stat_rows, c.row_stats, wg)
            )
            warpgroup.wait_group(0)  # PV(n + 1) complete: P, O and the V slot are free
            if cutlass.const_expr(self.kv_shared):
                pipeline_k.release(t_v)
            else:
                pipeline_v.consumer_release(v_state)
            p_buf = p_buf - 1
            self.stage_p(acc_s, r_p, tPsP, p_buf, wg)
            if cutlass.const_expr(self.rescale_o_before_pv):
                o_scale.store(row_scale.load())
            else:
                scale_rows(acc_o, row_scale)

        # ---- last PV (tile 0) -------------------------------------------------------
        if cutlass.const_expr(self.rescale_o_before_pv):
            scale_rows(acc_o, o_scale)
        if cutlass.const_expr(self.kv_shared):
            self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, t % self.slots, p_buf)
            warpgroup.wait_group(0)
            pipeline_k.release(t)
        else:
            pipeline_v.consumer_wait(state)
            self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, state.index, p_buf)
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(state)

        self.epilogue(c, acc_o, softmax, stat_rows, tScS, thr_pv, wg, tidx)

    # -------------------------------------------------------------------------------
    # Consumers, seesaw (K = V, head dims >= 320): warpgroup 0 leads, 1 follows
    # -------------------------------------------------------------------------------

    @cute.jit
    def consume_seesaw(self, wg: int, c: ConsumerOperands, pv_own_mma: cute.TiledMma, ring: KvChunkRing,
                       handoffs: list, n_blocks: cutlass.Int32, t0, r0, it, q_empty):
        """Warpgroup ``wg`` (a constant: 0 leads, 1 follows) on one Q tile. Pairs of KV tiles (a, b)
        = visits (2k, 2k + 1): the leader computes S_a, the follower S_b, each over the whole head
        dim, and each adds both tiles' P V to its O columns. See ``seesaw_lead`` /
        ``seesaw_follow`` for one pair; an odd tile count ends with a pair that has no b.
        ``handoffs``: [leader's max, follower's max and P, leader's P]. ``t0``, ``r0``, ``it``: the
        CTA's ring uses, handoff rounds and tiles before this one (``run_tiles``)."""
        qk_mma, pv_mma, span, row_stats = c.qk_mma, c.pv_mma, c.span, c.row_stats
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
        sub = tidx % THREADS_PER_WARPGROUP
        thr_qk = qk_mma.get_slice(sub)
        thr_pv = pv_mma.get_slice(sub)
        wg_qk, wg_pv, wg_own = qk_mma.get_slice(0), pv_mma.get_slice(0), pv_own_mma.get_slice(0)
        sVt_w = self.v_columns(c.sVt, wg)
        ops = SeesawOperands(
            tSrQ=qk_mma.make_fragment_A(wg_qk.partition_A(c.sQ))[None, None, None, 0],  # (MMA, 1, d/16)
            tSrK=qk_mma.make_fragment_B(wg_qk.partition_B(c.sK)),  # the whole tile: (MMA, 1, d/16, slots)
            tOrV=pv_mma.make_fragment_B(wg_pv.partition_B(sVt_w)),  # this warpgroup's V columns
            tOrV_own=pv_own_mma.make_fragment_B(wg_own.partition_B(sVt_w)),
            tOrP_smem=pv_mma.make_fragment_A(wg_pv.partition_A(c.sP)),  # (MMA, 1, keys/16, 2 buffers)
            tPsP=self.p_store_view(c.sP, wg, thr_qk),
            tScS=self.s_coords(wg, thr_qk),
            q_empty=q_empty,
        )
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((WGMMA_M, self.tile_n)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((WGMMA_M, self.o_width)))
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)  # own P, 16-bit: the RS wgmma's A
        softmax = OnlineSoftmax(acc_s.layout, c.scale_log2, may_be_empty=self.may_hide_rows())
        softmax.reset()
        acc_o.fill(0.0)
        stat_rows = acc_rows_view(ops.tScS)
        mmas = (qk_mma, pv_mma, pv_own_mma)
        first_row = c.m_block * self.tile_m

        cute.arch.mbarrier_wait(c.q_bar, it % 2)
        n_pairs = n_blocks // 2
        base = (t0, r0)
        if cutlass.const_expr(wg == 0):
            for k in cutlass.range(n_pairs, unroll=1):
                self.seesaw_lead(k, True, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows, row_stats,
                                 span, n_blocks, first_row, base)
            if n_blocks % 2 == 1:
                self.seesaw_lead(n_pairs, False, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows,
                                 row_stats, span, n_blocks, first_row, base)
            self.seesaw_lead_end(ring, n_blocks, t0)
            self.epilogue(c, acc_o, softmax, stat_rows, ops.tScS, thr_pv, 0, tidx, ops.tPsP)
        else:
            for k in cutlass.range(n_pairs, unroll=1):
                self.seesaw_follow(k, True, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows, row_stats,
                                   span, n_blocks, first_row, base)
            if n_blocks % 2 == 1:
                self.seesaw_follow(n_pairs, False, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows,
                                   row_stats, span, n_blocks, first_row, base)
            self.epilogue(c, acc_o, softmax, stat_rows, ops.tScS, thr_pv, 1, tidx, ops.tPsP)
        # both warpgroups hold O at the same max; the row sums meet in the epilogue, where each
        # stores its O through its own P buffer by the addresses its P stores use

    @cute.jit
    def seesaw_lead_end(self, ring: KvChunkRing, n_blocks, t0):
        """The leader after its last pair: its PV over the follower's P (sQ is overwritten next, and
        the last tile b's first half is freed here, as a pair's start frees the previous b's)."""
        warpgroup.wait_group(0)
        if n_blocks % 2 == 0:
            self.seesaw_release_b(ring, t0 + n_blocks - 1)

    @cute.jit
    def seesaw_lead(self, k, has_b: cutlass.Constexpr[bool], mmas, ring: KvChunkRing, handoffs, ops, acc_s, acc_o, r_p,
                    softmax: OnlineSoftmax, stat_rows, row_stats, span: KvSpan, n_blocks, first_row, base=(0, 0)):
        """Warpgroup 0, pair k (tile a = visit 2k, tile b = visit 2k + 1, when ``has_b``):

            S_a = Q K_a[L]^T (group); [PV_bL of pair k - 1 done: release b's first half]
            S_a += Q K_a[R]^T (group); release a's second half; mask
            m_a = max(m, rowmax S_a) -> SMEM, hand over (handoff 0)      (the follower needs it)
            P_a = exp2(S_a - m_a); l = l r_a + sum P_a; O_L = O_L r_a + P_a V_a[:, L]   (RS)
            [PV_aL done: release a's first half]
            wait for handoff 1; [release b's second half]; m_b from SMEM; r_b = exp2(m_a - m_b); l *= r_b
            P_a r_b -> sP[0], hand over (handoff 2)                  (the follower's PV_aR)
            O_L *= r_b; O_L += P_b V_b[:, L]   (SS, P_b from sP[1])

        so that after the pair O_L, l and m are all at m_b, the follower's max. QK over a is
        issued half by half so that b's first half is freed as soon as the PV before it is done,
        not after a's second half has landed (the whole QK's issue waits for it): the producer
        loads a pair's halves in the order a.L, b.R, a.R, b.L, and b.L goes into that half, so
        freeing it after a.R landed made the follower, whose QK ends on b.L, wait for two loads
        in a row each pair (FlashMLA's leader frees it between its two QK groups too).

        ``base`` = (t0, r0): the ring uses and handoff rounds of the CTA's earlier tiles (the
        persistent kernel); tile a is ring use t0 + 2k, pair k is handoff round r0 + k. Every half
        of every use counts both warpgroups' releases (``seesaw_halves``), so the leader also frees
        b's second half, which it never reads, once the follower's handoff 1 says b has landed."""
        qk_mma, pv_mma, pv_own_mma = mmas
        t = 2 * k  # tile a's visit in this tile's span
        ta = base[0] + t  # its ring use
        rnd = base[1] + k
        tSrK = ops.tSrK[None, None, None, ta % self.slots]
        ring.gemm_qk(ta, qk_mma, acc_s, ops.tSrQ, tSrK, chunks=ring.r_chunk)
        if k > 0:  # pair k - 1's PV over P_b (issued before this QK) is done: b's slot is free to us
            warpgroup.wait_group(1)
            self.seesaw_release_b(ring, ta - 1)
        ring.gemm_qk(ta, qk_mma, acc_s, ops.tSrQ, tSrK, first_chunk=ring.r_chunk, chunks=ring.chunks - ring.r_chunk,
                     accumulate=True)
        warpgroup.wait_group(0)
        if t + 2 >= n_blocks:  # the last pair: this was the leader's last QK, sQ is read
            self.release_q(ops.q_empty)
        overlap = self.o_col1 < self.o_width
        if cutlass.const_expr(not overlap):  # only this QK read the second half of tile a
            ring.release(ta, 1)
        if t == 0:
            self.mask_s(span, acc_s, ops.tScS, span.visit_tile(t), first_row, first=True)
        else:
            self.mask_s(span, acc_s, ops.tScS, span.visit_tile(t), first_row, first=False)
        tile_max = softmax.tile_max(acc_s)
        self.publish_max(softmax.new_max(tile_max), stat_rows, row_stats, 0)
        handoffs[0].arrive()
        row_scale = softmax.update(acc_s, is_first=False, tile_max=tile_max)
        convert_p_packed(acc_s, r_p)
        scale_rows(acc_o, row_scale)
        gemm(pv_own_mma, acc_o, as_a_operand(r_p), ops.tOrV_own[None, None, None, ta % self.slots], zero_init=False)
        warpgroup.wait_group(0)  # PV_aL done: a's first half (and a top-k slot's list, read by the mask) is free
        ring.release(ta, 0)
        if cutlass.const_expr(overlap):
            ring.release(ta, 1)
        # the follower's max (in the last pair without b: the leader's own, r_b = 1)
        handoffs[1].wait(rnd)
        if cutlass.const_expr(has_b):  # the follower's QK waited for all of b: its second half is not ours
            ring.release(ta + 1, 1)
        row_scale = softmax.follow(self.read_max(stat_rows, row_stats, 1))
        scale_rows(acc_s, row_scale)
        store_p(acc_s, r_p, ops.tPsP[None, None, None, self.own_p_buffer(0)])  # r_p is free: its PV is done
        handoffs[2].arrive()
        scale_rows(acc_o, row_scale)
        if cutlass.const_expr(has_b):
            ring.wait_full(ta + 1, 0, self.o_width // CHUNK_COLS)  # the follower's QK waited for them
            gemm(pv_mma, acc_o, ops.tOrP_smem[None, None, None, self.own_p_buffer(1)],
                 ops.tOrV[None, None, None, (ta + 1) % self.slots], zero_init=False)

    @cute.jit
    def seesaw_follow(self, k, has_b: cutlass.Constexpr[bool], mmas, ring: KvChunkRing, handoffs, ops, acc_s, acc_o,
                      r_p, softmax: OnlineSoftmax, stat_rows, row_stats, span: KvSpan, n_blocks, first_row,
                      base=(0, 0)):
        """Warpgroup 1, pair k:

            S_b = Q K_b^T; mask; [release b's first half]; tile max    (while the leader works on a)
            wait for handoff 0; m_a from SMEM
            m_b = max(m_a, rowmax S_b); P_b = exp2(S_b - m_b); r = exp2(m - m_b); l = l r + sum P_b
            m_b -> SMEM, P_b -> sP[1], hand over (handoff 1)
            O_R = O_R r + P_b V_b[:, R]                  (RS)
            wait for handoff 2; O_R += (P_a r_b) V_a[:, R]   (SS, from sP[0])
            wait both PVs, release their halves

        Without b (the last pair of an odd count) the follower only adopts m_a (r = exp2(m - m_a))
        and adds P_a V_a[:, R]. ``base`` as the leader's; the follower also frees a's first half,
        which it never reads, as the pair starts (it must not be the later of the two arrivals: the
        next tile a's first half-load waits for them)."""
        qk_mma, pv_mma, pv_own_mma = mmas
        t_a = 2 * k  # this tile's visits
        t_b = t_a + 1
        ra = base[0] + t_a  # their ring uses
        rb = ra + 1
        rnd = base[1] + k
        # a's first half: never read here, freed at once. The slot's previous use is done: the
        # follower passed the handoffs (or the epilogue) that follow the leader's release of it
        ring.release(ra, 0)
        tile_max = None
        if cutlass.const_expr(not has_b):
            if n_blocks == 1:  # a one-tile span: the follower computes no S, never reads sQ
                self.release_q(ops.q_empty)
        if cutlass.const_expr(has_b):
            ring.gemm_qk(rb, qk_mma, acc_s, ops.tSrQ, ops.tSrK[None, None, None, rb % self.slots],
                         first_chunk=self.o_col1 // CHUNK_COLS)  # the half its producer loads first
            warpgroup.wait_group(0)
            if t_b + 2 >= n_blocks:  # the follower's last QK (b is the last or next-to-last tile)
                self.release_q(ops.q_empty)
            self.mask_s(span, acc_s, ops.tScS, span.visit_tile(t_b), first_row, first=False)
            ring.release(rb, 0)  # after the mask: a top-k slot's staged list is read there
            tile_max = softmax.tile_max(acc_s)
        handoffs[0].wait(rnd)
        m_lead = self.read_max(stat_rows, row_stats, 0)
        if cutlass.const_expr(has_b):
            row_scale = softmax.update(acc_s, is_first=False, tile_max=tile_max, floor=m_lead)
        else:
            row_scale = softmax.follow(m_lead)
        self.publish_max(softmax.row_max, stat_rows, row_stats, 1)
        if cutlass.const_expr(has_b):
            store_p(acc_s, r_p, ops.tPsP[None, None, None, self.own_p_buffer(1)])  # r_p: also its RS operand
        handoffs[1].arrive()
        scale_rows(acc_o, row_scale)
        if cutlass.const_expr(has_b):
            gemm(pv_own_mma, acc_o, as_a_operand(r_p), ops.tOrV_own[None, None, None, rb % self.slots],
                 zero_init=False)
        handoffs[2].wait(rnd)
        ring.wait_full(ra, self.o_col1 // CHUNK_COLS, self.head_dim // CHUNK_COLS)  # the leader's QK waited
        gemm(pv_mma, acc_o, ops.tOrP_smem[None, None, None, self.own_p_buffer(0)],
             ops.tOrV[None, None, None, ra % self.slots], zero_init=False)
        if cutlass.const_expr(has_b):
            warpgroup.wait_group(1)
            ring.release(rb, 1)
        warpgroup.wait_group(0)
        ring.release(ra, 1)

    @cute.jit
    def release_q(self, q_empty):
        """persistent: this thread's QKs, all waited for, have read sQ; every consumer thread arrives
        (no one-lane branch before the next wgmma: ptxas C7519), and the next tile's Q may land."""
        if cutlass.const_expr(q_empty is not None):
            cute.arch.mbarrier_arrive(q_empty)

    @cute.jit
    def seesaw_release_b(self, ring: KvChunkRing, t_b):
        """The leader's PV over tile b (its first half, and the overlap of the second) is done."""
        ring.release(t_b, 0)
        if cutlass.const_expr(self.o_col1 < self.o_width):
            ring.release(t_b, 1)

    @cute.jit
    def publish_max(self, m, stat_rows, row_stats, wg: int):
        """Row maxima m (exp2 domain) of this thread's rows -> SMEM slot wg (one lane per quad)."""
        if stat_rows[0, 0][1] == 0:
            for i in cutlass.range_constexpr(cute.size(m)):
                row_stats[stat_rows[i, 0][0], wg, 0] = m[i]

    @cute.jit
    def read_max(self, stat_rows, row_stats, wg: int) -> cute.Tensor:
        out = cute.make_rmem_tensor(cute.size(stat_rows, mode=[0]), cutlass.Float32)
        for i in cutlass.range_constexpr(cute.size(out)):
            out[i] = row_stats[stat_rows[i, 0][0], wg, 0]
        return out

    # -------------------------------------------------------------------------------
    # Pieces of the consumer loop
    # -------------------------------------------------------------------------------

    @cute.jit
    def epilogue(self, c: ConsumerOperands, acc_o, softmax: OnlineSoftmax, stat_rows, tScS, thr_pv, wg, tidx,
                 tPsP=None):
        """[split, seesaw: the row sums of the two warpgroups added through SMEM]; O /= l (and the
        sink's seam); O over sQ, one TMA store (persistent: each warpgroup's columns through its P
        buffer, 64 at a time: the row sums' barrier says both warpgroups' PVs have read them; ``tPsP``
        the seesaw's P store view); LSE (split, seesaw: warpgroup 0's copy, both hold the same rows)."""
        total = None
        if cutlass.const_expr(self.split):
            total = self.exchange_sums(softmax, stat_rows, c.row_stats, wg)
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
            if cutlass.const_expr(self.split):  # both warpgroups hold the same rows' LSE
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

    @cute.jit
    def store_empty_split(self, wg: int, c: ConsumerOperands):
        """split-KV: a split past its span's tiles has no key: O = 0, LSE = -inf, as the empty-row
        path gives, so the merge reads every part it is given."""
        sub = (cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP) % THREADS_PER_WARPGROUP
        thr_pv = c.pv_mma.get_slice(sub)
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((WGMMA_M, self.o_width)))
        acc_o.fill(0.0)
        tScS = self.s_coords(wg, c.qk_mma.get_slice(sub))
        lse = cute.make_rmem_tensor(cute.size(acc_rows_view(tScS), mode=[0]), cutlass.Float32)
        lse.fill(-cutlass.Float32.inf)
        self.store_partial(c, acc_o, lse, tScS, thr_pv, wg)

    def make_mmas(self) -> tuple[cute.TiledMma, cute.TiledMma]:
        """(QK, PV) tiled MMAs: one warpgroup's (split) or all warpgroups stacked along M.
        PV's A is sP (SS wgmma) or the P registers (RS wgmma, stage C)."""
        warpgroups = 1 if self.split else self.num_wg
        qk_mma = make_tiled_mma(self.dtype, self.wg_keys, warpgroups=warpgroups)  # seesaw: 64 x 64 per warpgroup
        if self.p_in_smem:
            pv_mma = make_tiled_mma(self.dtype, self.o_width, b_major=OperandMajorMode.MN, warpgroups=warpgroups)
        else:
            pv_mma = make_pv_tiled_mma(self.dtype, self.head_dim, warpgroups=warpgroups)
        return qk_mma, pv_mma

    def make_pv_own_mma(self) -> cute.TiledMma:
        """seesaw: the PV MMA over a warpgroup's own P, from its registers (RS wgmma, stage C's
        trick: the QK accumulator's registers are the A fragment), 64 x width x 16."""
        return make_pv_tiled_mma(self.dtype, self.o_width, warpgroups=1)

    def seesaw_halves(self):
        """seesaw: the warps that free each half of a tile in an even and an odd ring slot: all eight,
        in both. Half 0 = chunks [0, c_1 / 64), read by the QK of the warpgroup that computes the
        tile's S and by warpgroup 0's PV; half 1 = the rest, by that QK and warpgroup 1's PV. The
        warpgroup that reads neither half (the follower for tile a's first, the leader for b's
        second) frees it too, after a handoff that follows the other warpgroup's wait for that
        use's landing. So the count does not depend on which warpgroup's S a slot holds, and a
        persistent CTA's next tile may start its ring uses at either parity (an odd tile count
        leaves the next tile's a in an odd slot)."""
        warps = THREADS_PER_WARPGROUP // 32  # of one warpgroup
        return ((2 * warps, 2 * warps), (2 * warps, 2 * warps))

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
        if cutlass.const_expr(self.split and not self.seesaw):
            return thr_qk.partition_C(cute.local_tile(sP, (WGMMA_M, self.wg_keys), (0, wg, None)))
        else:  # rows: the partition picks the rows; seesaw: warpgroup w writes buffer w (whole tile)
            return thr_qk.partition_C(sP)

    def qk_rows(self) -> int:
        """Rows of the QK / PV tiled MMAs: one warpgroup's 64 (split) or the whole tile."""
        return WGMMA_M if self.split else self.tile_m

    @cute.jit
    def warpgroup_views(self, wg, tidx, qk_mma, pv_mma, sQ, sK, sVt, sP):
        """The operand fragments and partitions of consumer warpgroup ``wg``.

        rows:  the tiled MMAs span all warpgroups along M; slice by the thread index.
        split: one-warpgroup MMAs; warpgroup w takes keys [32 w, 32 w + 32) of the K tile
               (4 KiB into each 64-column block, whole 1 KiB swizzle atoms) and V's
               columns [c_w, c_w + width) (whole 64-column blocks)."""
        if cutlass.const_expr(self.split):
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
        keys = cute.make_identity_tensor((self.qk_rows() if self.split else self.tile_m, self.tile_n))
        if cutlass.const_expr(self.split and not self.seesaw):
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
        if cutlass.const_expr(self.split):
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

    def first_key(self, wg):
        """The first key of warpgroup wg's S block (a quad's first lane holds it)."""
        return 0 if self.seesaw else wg * self.wg_keys

    @cute.jit
    def exchange_sums(self, softmax, stat_rows, row_stats, wg):
        """split: the full row sums, this half's plus the other's, through SMEM."""
        own = softmax.row_sums()
        if stat_rows[0, 0][1] == self.first_key(wg):
            for i in cutlass.range_constexpr(cute.size(own)):
                row_stats[stat_rows[i, 0][0], wg, 1] = own[i]
        # unaligned: the persistent seesaw's warpgroups reach it each from its own copy of the epilogue
        barrier_sync_unaligned(int(Sm90FwdBarrier.ROW_STATS), self.consumer_threads)
        for i in cutlass.range_constexpr(cute.size(own)):
            own[i] = own[i] + row_stats[stat_rows[i, 0][0], 1 - wg, 1]
        return own

    @cute.jit
    def stage_p(self, acc_s, r_p, tPsP, p_buf, wg):
        """P -> 16 bits, in registers (stays there) or stored to sP[p_buf % buffers],
        fenced, and the readers synced."""
        if cutlass.const_expr(self.p_in_smem):
            store_p(acc_s, r_p, tPsP[None, None, None, p_buf % self.p_buffers])
            if cutlass.const_expr(self.split):
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
        if cutlass.const_expr(self.split):
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

    @cute.jit
    def scheduler_wait(self, wg: cutlass.Int32):
        if cutlass.const_expr(self.pingpong):
            pingpong_wait(wg)

    @cute.jit
    def scheduler_pass(self, wg: cutlass.Int32):
        if cutlass.const_expr(self.pingpong):
            pingpong_pass(wg, self.num_wg)
