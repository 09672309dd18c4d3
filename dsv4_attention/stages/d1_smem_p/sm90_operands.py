"""The named bundles of stage D1's sm90 kernel: its global operands by seam (``GlobalTensors``:
D3's ``Lengths``, D4's ``Window``, E's ``Entries``, split-KV's ``SplitParts``), a tile's request
and views, the CTA's shared memory, and what the consumer schedules take (``ConsumerOperands``,
the seesaw's ``SeesawOperands``). Plain dataclasses: the kernel's Python builds them while it is
traced; none is carried through a runtime loop.
"""

import dataclasses

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.kv_span import KvSpan


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
    partials: SplitParts


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
