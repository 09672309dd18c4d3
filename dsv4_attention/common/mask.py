"""Masks on a score tile in registers: which (row, key) of an S accumulator a
softmax may see. Stage C needs one, the tail of the keys; later stages add the
sliding window and causality here.

A thread's accumulator values carry their (row, key) coordinates in a
partition of the identity tile (``thr_mma.partition_C(make_identity_tensor(
(tile_m, tile_n)))``, the same partition that laid out the accumulator); the key
of value i in KV tile n is ``n * tile_n + tScS[i][1]``.

Why keys past seqlen_k need a mask at all: TMA zero-fills the K rows past the
end of the tensor, so their raw score is 0, not -inf, and would enter the row
max and the row sum.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def num_kv_tiles(seqlen_k, tile_n: int):
    """KV tiles that cover seqlen_k keys (Python or DSL integers). Tile
    num_kv_tiles - 1 holds key seqlen_k - 1 and is the only one with keys past
    seqlen_k: the kernels visit it first, so its mask is the only one and every
    row sees at least one key in the first tile it visits."""
    return (seqlen_k + tile_n - 1) // tile_n


def key_limit(n_block, tile_n: int, seqlen_k):
    """The first tile-local key of KV tile ``n_block`` that is past seqlen_k
    (may be <= 0 or >= tile_n): key j of the tile is visible iff j < key_limit."""
    return seqlen_k - n_block * tile_n


@cute.jit
def mask_seqlen_k(acc: cute.Tensor, tScS: cute.Tensor, n_block: cutlass.Int32, tile_n: cutlass.Constexpr[int],
                  seqlen_k: cutlass.Int32):
    """Scores of keys >= seqlen_k in KV tile ``n_block`` -> -inf (in place).

    One compare-and-select per value against this thread's limit on the
    tile-local key, seqlen_k - n_block * tile_n (any value, negative or past
    tile_n, is handled the same way)."""
    limit = key_limit(n_block, tile_n, seqlen_k)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = -cutlass.Float32.inf if tScS[i][1] >= limit else acc[i]
