"""The Q and KV tile shapes of the kernels from stage D1 on, as plain Python: the host picks a
packed group against the Q tile's rows on every call (common/pack_heads.py), before it has a
kernel in hand, and must not import CuTeDSL for that (a call served from the kernel cache never
imports it; common/kernel_cache.py). The kernels take their tiles from here too, so the host's
figure and the kernel's are one number.

sm90 (stage D1's kernel and those built on it)::

    head dim    64      128     192     256     320 .. 512
    tile        192x128 128x128 128x96  128x80  64x64 (two warpgroups split O's columns)

sm100: 128-row tiles (the TMEM lanes, the MMA's M) at every head dim.
"""

from __future__ import annotations

#: sm90: head dims from which two warpgroups split O's columns (64 x 64 tiles)
SPLIT_FROM = 320
#: sm90: (tile_m, tile_n) below SPLIT_FROM, where each warpgroup owns whole rows
ROWS_TILES = {64: (192, 128), 128: (128, 128), 192: (128, 96), 256: (128, 80)}
#: sm90: (tile_m, tile_n) from SPLIT_FROM on
SPLIT_TILE = (64, 64)
#: sm100: rows of the QK tile = TMEM lanes = MMA M (cta_group::1)
SM100_TILE_M = 128


def split_columns(head_dim: int) -> tuple[int, int]:
    """sm90, split head dims: (width, c_1), each warpgroup's O columns and warpgroup 1's first column."""
    width = -(-head_dim // 2 // 64) * 64
    return width, head_dim - width


def uses_seesaw(arch: str, head_dim: int, kv_shared: bool) -> bool:
    """Whether stage D1's kernel (and those built on it) runs the seesaw schedule on its persistent
    grid: sm90, K = V, at a split head dim whose O halves are whole 64-column chunks (384, 512). Its
    CTA count is then baked into the binary (common/persistent.py, common/jit.config_key)."""
    width, c1 = split_columns(head_dim)
    return arch == "sm90" and head_dim >= SPLIT_FROM and bool(kv_shared) and c1 == width


def q_tile_rows(arch: str, head_dim: int) -> int:
    """Rows of the Q tile of stage D1's kernel (and those built on it) for ``arch`` and ``head_dim``."""
    if arch == "sm100":
        return SM100_TILE_M
    if arch != "sm90":
        raise ValueError(f"arch must be 'sm90' or 'sm100'; got {arch!r}")
    return SPLIT_TILE[0] if head_dim >= SPLIT_FROM else ROWS_TILES[head_dim][0]
