"""The named bundles of stage D1's sm90 kernel: its global operands by seam (``GlobalTensors``,
with the later stages' bundles of common/seams.py as the kernel got them), a tile's request
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
    stage_words: object  # the int32 words a later stage asked for (``stage_words``)
    ring_base: cute.Pointer  # the ring's first byte (a gathering source writes rows by address)


@dataclasses.dataclass
class GlobalTensors:
    """The kernel's global operands by seam: Q, K, V, O (its TMA view and memory), LSE, then the
    bundles of the stages that use them (common/seams.py; ``entries``: what the stage's
    ``entry_operands`` made of its bundle, None in D1)."""
    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mO: cute.Tensor
    mO_mem: cute.Tensor
    mLSE: cute.Tensor
    lengths: tuple
    window: tuple
    entries: object
    partials: tuple


@dataclasses.dataclass
class TileRequest:
    """The request a tile's (head, batch entry) belongs to: views to index with batch coordinate
    ``b``, its packed row count, key count and the entries seam's part of it (``request_entries``)."""
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
    entries: object  # ``request_entries``'s (None in D1)


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
    entries: object  # ``entry_views``'s (None in D1)
    o_part: tuple | None = None  # split-KV: (the fp32 partial O tiles, partial LSE, partial batch index)
