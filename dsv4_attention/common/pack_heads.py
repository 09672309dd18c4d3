"""Query heads packed into the rows of a Q tile (grouped-query and multi-query attention).

``g = heads // kv_heads`` query heads share one KV head. Unpacked, a CTA's Q tile holds
tile_m tokens of one query head, and each KV tile is loaded once per query head: g times
for the group. Packed, the rows of the problem of KV head hk are the (token, head) pairs
of its group, token-major:

    packed row r   <->   token r // g,  query head hk * g + r % g

    r:      0      1     ..  g-1      g      g+1   ..
    (t, h): (0, 0) (0, 1) .. (0, g-1) (1, 0) (1, 1) ..       (h within the group)

That map is one layout. The seqlen mode of Q, O and LSE becomes the two-level mode

    (g, seqlen) : (head_stride, seq_stride)

and their heads mode becomes ``kv_heads : g * head_stride``. CuTe reads a flat index into
a two-level mode colexicographically, r -> (r % g, r // g): exactly (head in group, token).
So the attention kernel runs unchanged on the folded views, as MHA with ``kv_heads`` heads
of ``g * seqlen_q`` rows: every KV tile is loaded once per group of g heads, and a decode
step (1-2 tokens, 128 heads) fills whole 64- or 128-row tiles instead of 1-2 rows.

TMA: a tile of tile_m packed rows is one box of the folded tensor when g divides tile_m
(g heads x tile_m / g tokens) or tile_m divides g (tile_m heads of one token). Tiles then
start on token boundaries, and a box that runs past the last token is zero-filled (loads)
or clipped (stores) by TMA on the token dimension: rows past the end are never written.
Any other g (e.g. 3 with 64-row tiles) would need a box that wraps mid-token; such groups
run unpacked (``pack_gqa=None``) or are refused (``pack_gqa=True``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the host's choice of group runs on every call: no DSL import for it
    import cutlass.cute as cute


def packable(group: int, tile_m: int) -> bool:
    """Whether ``group`` heads pack into tiles of ``tile_m`` rows as whole TMA boxes."""
    return group > 1 and (tile_m % group == 0 or group % tile_m == 0)


def pack_group(pack_gqa: bool | None, heads: int, kv_heads: int, tile_m: int) -> int:
    """The group the kernel folds into its rows: ``heads // kv_heads`` when packing, else 1.

    pack_gqa=None packs whenever the group forms whole boxes: packing never pads more rows
    than the unpacked grid (ceil(g s / m) m - g s <= g (ceil(s / m) m - s)) and loads each
    KV tile once per group instead of once per head. True insists (ValueError when the group
    cannot be packed); False keeps one head per tile."""
    group = heads // kv_heads
    if pack_gqa is None:
        return group if packable(group, tile_m) else 1
    if not pack_gqa:
        return 1
    if group == 1:
        return 1  # MHA: nothing to pack, as FlashAttention-4 treats it
    if not packable(group, tile_m):
        raise ValueError(
            f"pack_gqa=True needs heads / kv_heads ({group}) to divide the kernel's {tile_m}-row Q tile or be a "
            f"multiple of it; pass pack_gqa=None or False"
        )
    return group


def padded_topk_group(group: int, tile_m: int) -> bool:
    """Top-k / index mode on sm100 (one token's list gathered per Q tile): whether one token's
    ``group`` heads are served in a ``tile_m``-row tile padded, rows group .. tile_m - 1 computed but
    never stored: exactly half a tile (DeepSeek-V4-Flash's 64 heads on the 128-row tile). A smaller
    group (32: 3 / 4 of the rows wasted) is refused, as is one that does not divide the tile."""
    return 2 * group == tile_m


def fold_heads(t: cute.Tensor, seq_mode: int, head_mode: int, group: int) -> cute.Tensor:
    """``t`` with ``group`` consecutive heads folded into its seqlen mode (see the module
    docstring): mode ``seq_mode`` becomes (group, seqlen) : (head_stride, seq_stride) and
    mode ``head_mode`` becomes heads / group : group * head_stride. group = 1 returns t."""
    import cutlass.cute as cute

    if group == 1:
        return t
    shape, stride = list(t.layout.shape), list(t.layout.stride)
    seq, seq_stride = shape[seq_mode], stride[seq_mode]
    heads, head_stride = shape[head_mode], stride[head_mode]
    shape[seq_mode], stride[seq_mode] = (group, seq), (head_stride, seq_stride)
    shape[head_mode], stride[head_mode] = heads // group, head_stride * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


def rows(t: cute.Tensor, seq_mode: int = 0):
    """The number of (packed) rows of a Q / O / LSE view: size of its seqlen mode."""
    import cutlass.cute as cute

    return cute.size(t, mode=[seq_mode])


def packed_row(row: int, group: int, kv_head: int) -> tuple[int, int]:
    """The plain formula, for host proofs and tests: packed row -> (token, query head)."""
    return row // group, kv_head * group + row % group
