"""Stage F on Blackwell (SM100): the operand layouts of the backward kernel (sm100.py), proven on
the host (tests/test_f_sm100_host.py). The kernel builds its MMAs, SMEM and TMEM from these
functions and nothing else, so the proofs speak for it.

The algorithm is stage F's (sm90.py): per CTA one KV tile of TILE_N = 128 keys of one (kv head,
batch); it visits every (query head of the group, Q tile of TILE_M = 64 queries) that sees one of
its keys; dK and dV accumulate over the visits, dQ gets one partial sum per KV tile. With keys as
the rows of every per-key product (FlashAttention-3's transposed scores, and on Blackwell the
TMEM lanes: key t is lane t of every accumulator below, so the thread of lane t owns key t):

    MMA   (M x N x K)          A                          B                          D (TMEM)
    S^T   128 x 64 x d         K   SMEM, K-major          Q   SMEM, K-major          S^T
    dP^T  128 x 64 x d         V   SMEM, K-major          dO  SMEM, K-major          dP^T
    dV    128 x d x 64   +=    P^T TMEM (16-bit, in S^T)  dO  SMEM, MN-major (= sdO) dV
    dK    128 x d x 64   +=    dS^T TMEM (in dP^T)        Q   SMEM, MN-major (= sQ)  dK
    dQ^T  d x 64 x 128         K^T SMEM, MN-major (= sK)  dS^T SMEM, MN-major        dQ^T

dQ is computed transposed so that its M is the head dim (128: one full-lane accumulator) rather
than the visit's 64 queries. Head dim 128 only for now: at 64, dQ^T's M = 64 takes the half-lane
accumulator layout, a layout of its own to prove.

SMEM: every operand read twice is loaded once, and its two views are the same bytes (proven):

    sQ  (64 q, d, stages)   K-major SW128, the TMA box:   (q, j) at q * 64 + j % 64 + (j // 64) * 4096
    sQt (d, 64 q, stages)   the same bytes, MN-major:     the B of dK       (sdO / sdOt alike, for dV)
    sK  (128 keys, d)       K-major SW128:                (n, j) at n * 64 + j % 64 + (j // 64) * 8192
    sKt (d, 128 keys)       the same bytes, MN-major:     the A of dQ^T     (sV: the A of dP^T only)
    sdS (128 keys, 64 q)    row n = key n, 64 queries contiguous (128 bytes, one swizzle row):
                            the compute thread of key n writes its row; the dQ^T MMA reads it as
                            its MN-major B (N = queries contiguous, K = keys)

(element offsets before the 128-byte swizzle, 16-bit elements; stage stride 8192.)

TMEM (fp32 columns of the 512-column allocation; every accumulator spans lanes 0..127):

    column  0 ...... 127 | 128 .... 255 | 256 .. 287 | 288 .. 319 | 320 .. 351 | 352 .. 383 | 384 .. 447
            dV           | dK           | S^T        | P^T (16-b) | dP^T       | dS^T (16-b)| dQ^T
                                        | (lower)    | over S^T's | (lower)    | over dP^T's|
                                                       upper half               upper half

S^T(n, q) at lane n, column 256 + q; P^T(n, q) at lane n, column 288 + q // 2, half q % 2, written
by thread n after it has read its whole row of S^T (as stage B writes P over S); dS^T likewise over
dP^T; dQ^T(j, q) at lane j, column 384 + q.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import tcgen05
from cutlass.cute.nvgpu.common import OperandMajorMode

from dsv4_attention.common.tmem import (
    ACC_DTYPE,
    MMA_INST_K,
    TmemRegion,
    elems_per_col,
    make_p_tmem_store,
    tmem_alloc_columns,
)

TILE_N = 128  # keys per CTA: the TMEM lanes, M of S^T, dP^T, dV, dK
TILE_M = 64  # queries per visit: N of S^T, dP^T and dQ^T, K of dV and dK
HEAD_DIMS = (128,)

#: first fp32 TMEM column of each accumulator (the map above)
DV_COL, DK_COL, S_COL, DP_COL, DQ_COL = 0, 128, 256, 320, 384
#: the 16-bit P^T / dS^T sit in the upper half of their scores' columns
P_HALF = TILE_M // 2
#: 32-bit TMEM columns per tcgen05.st of P^T / dS^T (.x16: 32 16-bit values of a key a thread)
PROBS_STORE_COLS = 16


def _mma(dtype, m: int, n: int, a_source, a_major, b_major) -> cute.TiledMma:
    op = tcgen05.MmaF16BF16Op(dtype, ACC_DTYPE, (m, n, MMA_INST_K), tcgen05.CtaGroup.ONE, a_source, a_major,
                              b_major)
    return cute.make_tiled_mma(op)


def check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the sm100 backward's layouts serve head dims {HEAD_DIMS}; got {head_dim}")


class BackwardMmas:
    """The five tcgen05 MMAs of one visit (the table above). Each warp that issues one builds its
    own (a tiled MMA carries the accumulate flag as state)."""

    def __init__(self, dtype, head_dim: int):
        check_head_dim(head_dim)
        smem, tmem = tcgen05.OperandSource.SMEM, tcgen05.OperandSource.TMEM
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        self.head_dim = head_dim
        self.scores = _mma(dtype, TILE_N, TILE_M, smem, k_major, k_major)  # S^T = K Q^T, dP^T = V dO^T
        self.grads = _mma(dtype, TILE_N, head_dim, tmem, k_major, mn_major)  # dV += P^T dO, dK += dS^T Q
        self.dq = _mma(dtype, head_dim, TILE_M, smem, mn_major, mn_major)  # dQ^T = K^T dS^T

    def tilers(self):
        """(scores, grads, dq) MMA tilers (M, N, K) of one visit."""
        d = self.head_dim
        return (TILE_N, TILE_M, d), (TILE_N, d, TILE_M), (d, TILE_M, TILE_N)


class SmemLayouts:
    """The staged SMEM layouts, each from the cutlass helper for the MMA that reads it (``k``, ``q``
    the TMA-written views; ``kt``, ``qt`` the same bytes as the transposed operands; ``ds`` the
    dQ^T MMA's B; ``ds_rows`` the (key, query) view the compute threads write ``ds`` through)."""

    def __init__(self, dtype, mmas: BackwardMmas, stages: int):
        s_tiler, g_tiler, dq_tiler = mmas.tilers()
        self.k = sm100_utils.make_smem_layout_a(mmas.scores, s_tiler, dtype, 1)  # sK, sV
        self.q = sm100_utils.make_smem_layout_b(mmas.scores, s_tiler, dtype, stages)  # sQ, sdO
        self.qt = sm100_utils.make_smem_layout_b(mmas.grads, g_tiler, dtype, stages)  # B of dK, dV
        self.kt = sm100_utils.make_smem_layout_a(mmas.dq, dq_tiler, dtype, 1)  # A of dQ^T
        self.ds = sm100_utils.make_smem_layout_b(mmas.dq, dq_tiler, dtype, 1)  # B of dQ^T
        self.ds_rows = ds_rows_layout(self.ds)


def ds_rows_layout(ds: cute.ComposedLayout) -> cute.ComposedLayout:
    """The (key, query) view of sdS that compute thread n writes its row n through: element
    (n, q) at n * TILE_M + q before the swizzle, the swizzle of the dQ^T MMA's B. (That this is
    the B layout transposed, for every element, is the proof's: tests/test_f_sm100_host.py.)"""
    return cute.make_composed_layout(ds.inner, 0, cute.make_layout((TILE_N, TILE_M), stride=(TILE_M, 1)))


def scores_region(mmas: BackwardMmas, col: int) -> TmemRegion:
    """S^T or dP^T, the scores MMA's (MMA, 1, 1) accumulator at fp32 column ``col``."""
    acc = mmas.scores.make_fragment_C(mmas.scores.partition_shape_C((TILE_N, TILE_M)))
    return TmemRegion(ACC_DTYPE, col, acc.layout)


def grads_region(mmas: BackwardMmas, col: int) -> TmemRegion:
    """dV or dK, the grads MMA's (MMA, 1, 1) accumulator at fp32 column ``col``."""
    acc = mmas.grads.make_fragment_C(mmas.grads.partition_shape_C((TILE_N, mmas.head_dim)))
    return TmemRegion(ACC_DTYPE, col, acc.layout)


def dq_region(mmas: BackwardMmas, col: int = DQ_COL) -> TmemRegion:
    """dQ^T, the dq MMA's (MMA, 1, 1) accumulator at fp32 column ``col``."""
    acc = mmas.dq.make_fragment_C(mmas.dq.partition_shape_C((mmas.head_dim, TILE_M)))
    return TmemRegion(ACC_DTYPE, col, acc.layout)


def probs_region(dtype, scores_col: int, half: int = P_HALF) -> TmemRegion:
    """P^T (or dS^T) as 16-bit values ``(TILE_N, TILE_M)`` over the upper half of the scores at
    ``scores_col``: (n, q) at lane n, column scores_col + half + q // 2, half q % 2 of it."""
    per = elems_per_col(dtype)
    return TmemRegion(dtype, ((0 << 16) | (scores_col + half)) * per,
                      cute.make_layout((TILE_N, TILE_M), stride=(per << 16, 1)))


def probs_chunk_view(tile, dtype, store_cols: int = PROBS_STORE_COLS):
    """Any ``(TILE_N, TILE_M)`` tile of P^T / dS^T (the region's layout, the identity coordinates)
    cut into store chunks ``(TILE_N, vals, 1, TILE_M / vals)``, vals = the 16-bit values one
    tcgen05.st.32x32b.x<store_cols> writes a lane; chunk c is ``[.., 0, c]``."""
    return cute.flat_divide(tile, (TILE_N, store_cols * elems_per_col(dtype)))


def probs_store_region(dtype, scores_col: int, store_cols: int = PROBS_STORE_COLS, half: int = P_HALF):
    """P^T's (dS^T's) region cut into store chunks (``probs_chunk_view``)."""
    p = probs_region(dtype, scores_col, half)
    return TmemRegion(dtype, p.offset, probs_chunk_view(p.layout, dtype, store_cols))


def make_probs_store(chunks: cute.Tensor, store_cols: int = PROBS_STORE_COLS) -> cute.TiledCopy:
    """Register -> TMEM store of P^T / dS^T for the 128 compute threads, a chunk at a time
    (``chunks`` = ``probs_store_region(...).at(base)``): thread n writes lane n, its 16-bit
    values 2r, 2r + 1 in register r, low half first (stage B's P store, common/tmem.py)."""
    return make_p_tmem_store(chunks, store_cols)


def probs_operand_region(dtype, mmas: BackwardMmas, scores_col: int, half: int = P_HALF) -> TmemRegion:
    """The grads MMA's A operand over P^T / dS^T: ``(MMA, 1, K_PHASES)``, one k-phase of 16 queries
    an instruction, re-based onto the probabilities' offset (the fragment's own pointer is a
    placeholder at 0)."""
    frag = mmas.grads.make_fragment_A(mmas.grads.partition_shape_A((TILE_N, TILE_M)))
    return TmemRegion(dtype, probs_region(dtype, scores_col, half).offset, frag.layout)


def tmem_map(dtype, mmas: BackwardMmas, cols=None) -> dict:
    """{name: (first fp32 column, one past the last)} of every TMEM region of a visit, from their
    layouts; ``cols`` overrides the first columns (negative controls)."""
    c = {"dv": DV_COL, "dk": DK_COL, "s": S_COL, "dp": DP_COL, "dq": DQ_COL, **(cols or {})}
    regions = {"dv": grads_region(mmas, c["dv"]), "dk": grads_region(mmas, c["dk"]),
               "s": scores_region(mmas, c["s"]), "dp": scores_region(mmas, c["dp"]), "dq": dq_region(mmas, c["dq"]),
               "p": probs_region(dtype, c["s"]), "ds": probs_region(dtype, c["dp"])}
    return {name: (r.first_column, r.end_column()) for name, r in regions.items()}


def tmem_columns(dtype, mmas: BackwardMmas, cols=None) -> int:
    """The allocation for the map: raises if two accumulators share a column, or if P^T / dS^T
    leave their scores' columns."""
    spans = tmem_map(dtype, mmas, cols)
    accs = ["dv", "dk", "s", "dp", "dq"]
    for i, a in enumerate(accs):
        for b in accs[i + 1:]:
            if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]:
                raise ValueError(f"TMEM: {a} {spans[a]} overlaps {b} {spans[b]}")
    for inner, outer in (("p", "s"), ("ds", "dp")):
        if not (spans[outer][0] <= spans[inner][0] and spans[inner][1] <= spans[outer][1]):
            raise ValueError(f"TMEM: {inner} {spans[inner]} must lie inside {outer} {spans[outer]}")
    return tmem_alloc_columns(max(end for _, end in spans.values()))


def example_layouts(head_dim: int = 128, dtype=cutlass.BFloat16, stages: int = 2):
    """(mmas, smem) built as the kernel will (inside a trace)."""
    mmas = BackwardMmas(dtype, head_dim)
    return mmas, SmemLayouts(dtype, mmas, stages)
