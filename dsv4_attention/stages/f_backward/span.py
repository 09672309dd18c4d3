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
