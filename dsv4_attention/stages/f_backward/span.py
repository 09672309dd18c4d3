"""Which Q tiles a KV tile's backward visits: those with a query that sees one of its keys.

Visibility is the forward's (common/kv_span.py, bottom-right aligned): query i sits at
p = i + seqlen_k - seqlen_q and sees key j iff j < seqlen_k, p - left <= j (left bound) and
j <= p + right (right bound; causal is right = 0). So key j is seen by the queries with
j - right <= p <= j + left, and the keys [k_lo, k_hi] of a KV tile by the queries

    i_lo = max(0, k_lo - right - offset)                       (0 without a right bound)
    i_end = min(seqlen_q, k_hi + left - offset + 1)            (seqlen_q without a left bound)

offset = seqlen_k - seqlen_q. The KV tile visits Q tiles [i_lo // tile_m, ceil(i_end / tile_m)),
none when i_end <= i_lo (or when the tile starts past the keys: with ``seqused_k``, seqlen_k is
the batch's key count, and the grid covers the tensor's): its dK and dV are then 0. The host
clamps left and right to at most
seqlen_q + seqlen_k (a wider bound hides nothing), so no sum here leaves int32.

The other way round (deterministic dQ, ``first_kv_tile``): m_lo and m_hi grow with the KV tile,
so the KV tiles that visit Q tile m are consecutive, from the first whose i_end passes m tile_m:
k_hi + left - offset + 1 > m tile_m, i.e. n >= floor((m tile_m - left + offset) / tile_n)
(0 without a left bound, or when that is negative).

Plain integer arithmetic (``cutlass.min`` / ``cutlass.max`` on Python ints and DSL integers
alike): the kernel traces it and tests/test_f_span.py checks it against every (query, key).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute


class Visits(NamedTuple):
    """A CTA's share of the backward: KV tile ``n_block`` of KV head ``head_kv`` visits, for each of
    the ``group`` query heads that share it, Q tiles m_lo .. m_lo + m_count - 1: ``visits`` =
    group * m_count visits in ``visit``'s order, in a batch of ``seqlen_q`` queries and
    ``seqlen_k`` keys (the request's, in a variable-length batch). Kernel-side values."""

    n_block: object
    head_kv: object
    group: object
    m_lo: object
    m_count: object
    visits: object
    seqlen_q: object
    seqlen_k: object

    def at(self, it):
        """(query head, Q tile) of visit ``it``."""
        return visit(it, self.head_kv, self.group, self.m_lo, self.m_count)


def visit(it, head_kv, group, m_lo, m_count):
    """(query head, Q tile) of a CTA's visit ``it``: head-major over the KV head's group, Q tiles
    m_lo .. m_lo + m_count - 1 within a head. The producer and the consumers both call it, so they
    agree on what a pipeline slot holds."""
    return head_kv * group + it // m_count, m_lo + it % m_count


def q_tile_range(n_block, tile_n: int, tile_m: int, seqlen_q, seqlen_k, left, right, has_left: bool,
                 has_right: bool):
    """(m_lo, m_hi): KV tile n_block's backward visits Q tiles m_lo <= m < m_hi (m_hi >= m_lo)."""
    offset = seqlen_k - seqlen_q
    k_lo = n_block * tile_n
    k_hi = cutlass.min(k_lo + tile_n, seqlen_k) - 1
    i_lo = 0
    # a tile past the keys (seqused_k shorter than the tensor) holds none: no query sees it
    i_end = seqlen_q * cutlass.max(cutlass.min(k_hi - k_lo + 1, 1), 0)
    if has_right:
        i_lo = cutlass.max(k_lo - right - offset, 0)
    if has_left:
        i_end = cutlass.min(k_hi + left - offset + 1, i_end)
    m_lo = i_lo // tile_m
    # i_end may be negative (every query hidden): any rounding of it then stays <= m_lo
    m_hi = cutlass.max((i_end + tile_m - 1) // tile_m, m_lo)
    return m_lo, m_hi


def first_kv_tile(m_block, tile_n: int, tile_m: int, seqlen_q, seqlen_k, left, has_left: bool):
    """The first KV tile whose backward visits Q tile ``m_block`` (the visiting tiles are
    consecutive from it): deterministic dQ adds KV tile n's partial sum n - first_kv_tile(m) th."""
    first = 0
    if has_left:
        first = cutlass.max(m_block * tile_m - left + seqlen_k - seqlen_q, 0) // tile_n
    return first


def key_queries(key, p0, seqlen_k, left, right, has_left: bool, has_right: bool, tile_m: int):
    """(q_first, q_last): the queries q = 0 .. tile_m - 1 of a Q tile whose query q sits at
    position p0 + q among the keys that see ``key``, as q_first <= q <= q_last: the forward's
    per-row rule (common/kv_span.row_keys) solved for q, so that a kernel holding one key and a
    row of queries (sm100.py: TMEM lane = key) compares each query index, a constant, with two
    bounds. With d = key - p0: a right bound hides q < d - right, a left bound q > d + left, and
    a key past seqlen_k hides every query. Clamped as row_keys clamps (to -1 and tile_m), with no
    sum that can leave int32; tests/test_f_cpu.py checks it against row_keys for every pair."""
    d = key - p0
    q_first = -1
    q_last = tile_m
    if has_right:
        q_first = d - cutlass.min(right, d + 1)  # max(d - right, -1)
    if has_left:
        q_last = d + cutlass.min(left, tile_m - d)  # min(d + left, tile_m)
    # a key past seqlen_k: q_last = -1 (arithmetic, not a branch: traced with runtime values)
    seen = cutlass.max(cutlass.min(seqlen_k - key, 1), 0)
    return q_first, (q_last + 1) * seen - 1


class CtaViews(NamedTuple):
    """A CTA's tensors of its batch entry (or request) and its ``Visits``; ``k_rows``: the rows
    its dK / dV may store (the request's keys; the tensor's otherwise)."""

    q_rows: tuple
    k_rows_views: tuple
    q_padded: tuple
    k_padded: tuple
    work: Visits
    k_rows: object


def cta_views(q_rows: tuple, k_rows: tuple, q_padded: tuple, k_padded: tuple, n_block, head_kv, batch, group,
              seqlen_q, seqlen_k, left, right, mSeqused, mCuQ, mCuK, tile_m: int, tile_n: int, has_left: bool,
              has_right: bool, has_seqused: bool, varlen: bool) -> CtaViews:
    """Both architectures' kernels (traced inside them): batch entry ``batch``'s slice of each
    tensor, rows first and batch last; in a variable-length batch (``varlen``) the packed tensors
    offset to the request's first row (``q_rows``: Q, dO; ``k_rows``: K, V) and the padded ones to
    its padded start (``q_padded``: LSE2, D, dQacc by tile_m; ``k_padded``: dK, dV by tile_n:
    common/varlen.py), with the request's lengths; ``seqused_k`` clamps the keys (as the forward
    does: a CUDA graph's capture skips the host's check). Then the Q tiles the KV tile visits."""
    from dsv4_attention.common.varlen import batch_rows, padded_start

    tb, rows_k = batch, seqlen_k
    if varlen:
        tb = 0
        q_start, k_start = mCuQ[batch], mCuK[batch]
        seqlen_q, seqlen_k = mCuQ[batch + 1] - q_start, mCuK[batch + 1] - k_start
        rows_k = seqlen_k
        q_pad, k_pad = padded_start(q_start, batch, tile_m), padded_start(k_start, batch, tile_n)
        views = ([batch_rows(t, tb, q_start) for t in q_rows], [batch_rows(t, tb, k_start) for t in k_rows],
                 [batch_rows(t, tb, q_pad) for t in q_padded], [batch_rows(t, tb, k_pad) for t in k_padded])
    else:
        views = tuple([batch_rows(t, tb) for t in group_] for group_ in (q_rows, k_rows, q_padded, k_padded))
    if has_seqused:
        seqlen_k = cutlass.min(cutlass.max(mSeqused[batch], 0), seqlen_k)
    m_lo, m_hi = q_tile_range(n_block, tile_n, tile_m, seqlen_q, seqlen_k, left, right, has_left, has_right)
    work = Visits(n_block, head_kv, group, m_lo, m_hi - m_lo, group * (m_hi - m_lo), seqlen_q, seqlen_k)
    return CtaViews(*(tuple(v) for v in views), work, rows_k)


def kernel_views(dtype, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV) -> tuple:
    """Both kernels' ``__call__`` (traced): the launch arguments' element types checked (Q, K, V, dO,
    dK, dV of ``dtype``; LSE2, D, dQacc fp32), then (seqlen_q, seqlen_k, mQ, mK, mV, mdO, mdK, mdV,
    mdQacc) rows first and batch last (common/layouts.seq_major) and (mLSE2, mD) as (rows, heads,
    batch)."""
    from dsv4_attention.common.layouts import reorder, seq_major

    for name, t in (("Q", mQ), ("K", mK), ("V", mV), ("dO", mdO), ("dK", mdK), ("dV", mdV)):
        if t.element_type != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.element_type}")
    for name, t in (("LSE2", mLSE2), ("D", mD), ("dQacc", mdQacc)):
        if t.element_type != cutlass.Float32:
            raise TypeError(f"{name} must be Float32, got {t.element_type}")
    seqlen_q, seqlen_k = mQ.shape[1], mK.shape[1]
    rows_first = [seq_major(t) for t in (mQ, mK, mV, mdO, mdK, mdV, mdQacc)]
    return (seqlen_q, seqlen_k, *rows_first, *[reorder(t, (2, 1, 0)) for t in (mLSE2, mD)])


@cute.jit
def wait_turn(turns, work: Visits, m_block, left, tidx, tile_n: cutlass.Constexpr[int], tile_m: cutlass.Constexpr[int],
              has_left: cutlass.Constexpr[bool], barrier_id: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """(deterministic, kernel side) Until the KV tiles before this one that visit Q tile ``m_block``
    have added their dQ: thread 0 of the ``threads`` that add polls the counter ``turns``
    (acquire) until it reads this tile's place among them, then they meet it at ``barrier_id``."""
    if tidx == 0:
        mine = work.n_block - first_kv_tile(m_block, tile_n, tile_m, work.seqlen_q, work.seqlen_k, left, has_left)
        seen = cute.arch.load(turns, cutlass.Int32, sem="acquire", scope="gpu")
        while seen != mine:
            seen = cute.arch.load(turns, cutlass.Int32, sem="acquire", scope="gpu")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)


@cute.jit
def pass_turn(turns, tidx, barrier_id: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """(deterministic, kernel side) Every adding thread's dQ reductions fenced at gpu scope, then
    thread 0 hands the Q tile to the next KV tile (release)."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if tidx == 0:
        cute.arch.atomic_add(turns, cutlass.Int32(1), sem="release", scope="gpu")
