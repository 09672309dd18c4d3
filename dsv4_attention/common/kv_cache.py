"""DeepSeek-V4's KV caches as inference engines keep them: paged, FP8 ("MODEL1") or bf16.

A cache holds pages ("blocks") of ``page_block_size`` tokens, one latent row of 512 dims a token
(K = V). A token is addressed by one int32, ``block * page_block_size + offset`` (-1: none): the
convention of FlashMLA's sparse decode and of the V4 backends of vLLM and SGLang, which keep a
window cache (the raw rows) and an extra cache (the compressed entries) this way.

**bf16 pages**: [num_blocks, page_block_size, 1, 512] bf16. ``cache_rows`` views them as the
[num_blocks * page_block_size, 1, 512] rows that an index addresses, without a copy, so
``index_attention(q, cache_rows(pages), indices)`` reads a bf16 paged cache directly.

**MODEL1 FP8 pages** (FlashMLA's layout for DeepSeek-V4; bytes of one page of B tokens):

    [0, 576 B)          token t's data at 576 t:
                            [0, 448)    dims 0-447 (NoPE), float8_e4m3fn: tile j (dims 64 j .. 64 j + 63)
                                        divided by its scale
                            [448, 576)  dims 448-511 (RoPE), bf16, not quantized (64 x 2 bytes)
    [576 B, 584 B)      token t's scales at 576 B + 8 t: 7 ue8m0 bytes, one a NoPE tile
                        (byte e: the power of two 2^(e - 127)), then one pad byte
    [584 B, P)          padding: the page is P = ceil(584 B / 576) * 576 bytes

    scale_j = 2^ceil(log2(max(amax_j / 448, 1e-4)))    amax_j = max |x| over tile j (in fp32)

so every quantized value lies in e4m3's finite range (|x / scale| <= 448), a scale is exact in
bf16, and dequantizing (e4m3 value times a power of two) is exact: 584 bytes a token instead of
1024. The tensor is [num_blocks, B, 1, 584] float8_e4m3fn with page stride P (the shape engines
pass to FlashMLA; its rows of 584 bytes are not tokens: the page is the unit). ``page_layout``
gives every byte's place; quantize and dequantize below, and the kernels that will read the
pages, use it and nothing else.
"""

from __future__ import annotations

import dataclasses

import torch

HEAD_DIM = 512
NOPE_DIMS = 448
ROPE_DIMS = 64
TILE = 64  # NoPE dims that share one scale
TILES = NOPE_DIMS // TILE  # 7
TOKEN_DATA_BYTES = NOPE_DIMS + 2 * ROPE_DIMS  # 576: e4m3 NoPE, bf16 RoPE
TOKEN_SCALE_BYTES = TILES + 1  # 8: seven ue8m0 scales and a pad byte
BYTES_PER_TOKEN = TOKEN_DATA_BYTES + TOKEN_SCALE_BYTES  # 584
PAGE_ALIGN = 576
E4M3_MAX = 448.0
MIN_SCALE_INV = 1e-4  # amax / 448 is clamped here before its power of two: an all-zero tile's scale is 2^-13


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """Byte offsets inside one MODEL1 page of ``tokens`` tokens (module doc)."""

    tokens: int

    @property
    def data_bytes(self) -> int:
        return self.tokens * TOKEN_DATA_BYTES

    @property
    def used_bytes(self) -> int:
        return self.tokens * BYTES_PER_TOKEN

    @property
    def page_bytes(self) -> int:
        return -(-self.used_bytes // PAGE_ALIGN) * PAGE_ALIGN

    def nope_byte(self, t: int, dim: int) -> int:
        """The e4m3 byte of NoPE dim ``dim`` (0 .. 447) of token ``t``."""
        return t * TOKEN_DATA_BYTES + dim

    def rope_byte(self, t: int, dim: int) -> int:
        """The first of the two bf16 bytes of RoPE dim ``dim`` (448 .. 511) of token ``t``."""
        return t * TOKEN_DATA_BYTES + NOPE_DIMS + 2 * (dim - NOPE_DIMS)

    def scale_byte(self, t: int, tile: int) -> int:
        """The ue8m0 byte of NoPE tile ``tile`` (0 .. 6: dims 64 tile ..) of token ``t``."""
        return self.data_bytes + t * TOKEN_SCALE_BYTES + tile


def token_bytes(j, page_block_size: int, page_stride):
    """(data, scales): the byte offsets, from the cache's first byte, of token ``j``'s 576 data
    bytes and of its 8 scale bytes, in pages of ``page_block_size`` tokens ``page_stride`` bytes
    apart (the module doc's layout). Plain integer arithmetic: the kernels that read the pages
    call it on their runtime integers, the host proofs on Python ints."""
    block, t = j // page_block_size, j % page_block_size
    page = block * page_stride
    return page + t * TOKEN_DATA_BYTES, page + page_block_size * TOKEN_DATA_BYTES + t * TOKEN_SCALE_BYTES


def unit_bytes(chunk: int, unit):
    """Where the 8 dims 64 ``chunk`` + 8 ``unit`` .. + 7 of a token (the kernels' 16-byte bf16
    unit ``unit`` of column chunk ``chunk``) lie in its 576 data bytes: (offset, bytes, scale):
    NoPE chunks 0-6 are 8 e4m3 bytes dequantized with scale byte ``scale`` (= the chunk: a scale
    tile is one 64-column chunk), chunk 7 is 16 bytes of bf16 RoPE (scale None)."""
    if chunk < TILES:
        return chunk * TILE + unit * 8, 8, chunk
    return NOPE_DIMS + unit * 16, 16, None


def page_layout(page_block_size: int) -> PageLayout:
    if isinstance(page_block_size, bool) or not isinstance(page_block_size, int) or page_block_size < 1:
        raise ValueError(f"page_block_size must be a positive int; got {page_block_size!r}")
    return PageLayout(page_block_size)


def _pages_shape(name: str, t: torch.Tensor) -> tuple:
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[2] != 1:
        raise ValueError(f"{name} must be a [num_blocks, page_block_size, 1, ...] torch.Tensor; got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t.shape[0], t.shape[1]


def ue8m0_scales(tiles: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of each tile (the last dim), fp32: 2^ceil(log2(max(amax / 448, 1e-4)))."""
    amax = tiles.abs().amax(dim=-1).float()
    return torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / E4M3_MAX, MIN_SCALE_INV))))


def quantize_kv_cache(kv: torch.Tensor) -> torch.Tensor:
    """bf16 pages [num_blocks, page_block_size, 1, 512] -> MODEL1 FP8 pages [num_blocks,
    page_block_size, 1, 584] float8_e4m3fn with page stride ``page_layout(B).page_bytes``
    (padding bytes zero), on kv's device.

    Args:
        kv: bf16, the last dim contiguous; one latent row a token (K = V).
    Returns:
        The FP8 pages, byte for byte the layout of the module doc."""
    nb, b = _pages_shape("kv", kv)
    if kv.dtype != torch.bfloat16 or kv.shape[3] != HEAD_DIM:
        raise ValueError(f"kv must be bf16 with head_dim {HEAD_DIM}; got {kv.dtype}, {tuple(kv.shape)}")
    lay = page_layout(b)
    rows = kv[:, :, 0]  # [nb, B, 512]
    nope = rows[..., :NOPE_DIMS].float().reshape(nb, b, TILES, TILE)
    scale = ue8m0_scales(nope)  # [nb, B, 7]
    pages = torch.zeros(nb, lay.page_bytes, dtype=torch.uint8, device=kv.device)
    data = pages[:, :lay.data_bytes].view(nb, b, TOKEN_DATA_BYTES)
    quantized = (nope / scale[..., None]).to(torch.float8_e4m3fn)  # |x / scale| <= 448: e4m3's finite range
    data[..., :NOPE_DIMS] = quantized.reshape(nb, b, NOPE_DIMS).view(torch.uint8)
    data[..., NOPE_DIMS:] = rows[..., NOPE_DIMS:].contiguous().view(torch.uint8)
    scales = pages[:, lay.data_bytes:lay.used_bytes].view(nb, b, TOKEN_SCALE_BYTES)
    scales[..., :TILES] = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    return pages.view(torch.float8_e4m3fn)[:, :lay.used_bytes].view(nb, b, 1, BYTES_PER_TOKEN)


def check_fp8_cache(cache: torch.Tensor, name: str = "cache") -> PageLayout:
    """A MODEL1 cache as ``quantize_kv_cache`` makes it: [num_blocks, B, 1, 584] of one-byte elements
    (float8_e4m3fn or uint8), each page's bytes contiguous and ``page_layout(B).page_bytes`` apart or
    more. Returns the page layout; a ValueError names what is off."""
    nb, b = _pages_shape(name, cache)
    if cache.element_size() != 1 or cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"{name} must be float8_e4m3fn (or uint8) bytes; got {cache.dtype}")
    if cache.shape[3] != BYTES_PER_TOKEN:
        raise ValueError(f"{name} must have {BYTES_PER_TOKEN} bytes a token (MODEL1: 448 e4m3 + 64 bf16 + 8 scale "
                         f"bytes); got {tuple(cache.shape)}")
    lay = page_layout(b)
    s0, s1, _, s3 = cache.stride()
    if s3 != 1 or (b > 1 and s1 != BYTES_PER_TOKEN):
        raise ValueError(f"{name}: a page's {lay.used_bytes} bytes must be contiguous (strides (P, 584, *, 1)); "
                         f"got strides {cache.stride()}")
    if nb > 1 and s0 < lay.page_bytes:
        raise ValueError(f"{name}: pages must be at least {lay.page_bytes} bytes apart (page_block_size {b}); "
                         f"got a page stride of {s0}")
    return lay


def dequantize_kv_cache(cache: torch.Tensor) -> torch.Tensor:
    """MODEL1 FP8 pages -> bf16 pages [num_blocks, page_block_size, 1, 512] (exact: e4m3 times a
    power of two). Args: cache as ``check_fp8_cache`` accepts it. Returns: a new bf16 tensor."""
    lay = check_fp8_cache(cache)
    nb, b = cache.shape[0], cache.shape[1]
    raw = torch.as_strided(cache.view(torch.uint8), (nb, lay.used_bytes), (cache.stride(0), 1))
    data = raw[:, :lay.data_bytes].reshape(nb, b, TOKEN_DATA_BYTES)
    nope = data[..., :NOPE_DIMS].view(torch.float8_e4m3fn).float().reshape(nb, b, TILES, TILE)
    scale = raw[:, lay.data_bytes:].reshape(nb, b, TOKEN_SCALE_BYTES)[..., :TILES].contiguous()
    scale = scale.view(torch.float8_e8m0fnu).float()
    out = torch.empty(nb, b, 1, HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    out[:, :, 0, :NOPE_DIMS] = (nope * scale[..., None]).reshape(nb, b, NOPE_DIMS).to(torch.bfloat16)
    out[:, :, 0, NOPE_DIMS:] = data[..., NOPE_DIMS:].contiguous().view(torch.bfloat16)
    return out


def cache_rows(pages: torch.Tensor) -> torch.Tensor:
    """bf16 pages [num_blocks, page_block_size, 1, d] as the [num_blocks * page_block_size, 1, d]
    rows that ``block * page_block_size + offset`` addresses: a view when the pages are contiguous
    (``index_attention`` then reads the cache in place), else a copy."""
    nb, b = _pages_shape("pages", pages)
    return pages.reshape(nb * b, 1, pages.shape[3])


def cache_indices(abs_indices: torch.Tensor, block_table: torch.Tensor, page_block_size: int) -> torch.Tensor:
    """Logical token positions -> cache indices: position p of request i (-1: none) is row
    ``block_table[i, p // page_block_size] * page_block_size + p % page_block_size``.

    Args:
        abs_indices: [batch, ...] int32 positions in each request's sequence, -1 for none.
        block_table: [batch, max_blocks] int32, each request's pages in order.
        page_block_size: tokens a page.
    Returns:
        int32 like ``abs_indices``, -1 where it is -1."""
    page_block_size = page_layout(page_block_size).tokens
    if abs_indices.dim() < 1 or block_table.dim() != 2 or abs_indices.shape[0] != block_table.shape[0]:
        raise ValueError(f"abs_indices [batch, ...] and block_table [batch, max_blocks] must agree on batch; got "
                         f"{tuple(abs_indices.shape)}, {tuple(block_table.shape)}")
    none = abs_indices < 0
    p = abs_indices.clamp(min=0).long()
    page = p // page_block_size
    if bool((page[~none] >= block_table.shape[1]).any()):
        raise ValueError(f"abs_indices reach past block_table's {block_table.shape[1]} pages a request")
    flat = page.reshape(page.shape[0], -1)
    blocks = torch.gather(block_table.long(), 1, flat).reshape(page.shape)
    rows = blocks * page_block_size + p % page_block_size
    return torch.where(none, torch.full_like(rows, -1), rows).to(torch.int32)
