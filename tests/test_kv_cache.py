"""DeepSeek-V4's paged caches (common/kv_cache.py): the MODEL1 FP8 layout byte by byte against its
definition, quantize / dequantize, the bf16 pages as index rows, the index conversion. CPU; the
GPU half compares the bytes with FlashMLA's own quantizer (the device pack's ``flashmla_peer``)
and reads a bf16 paged cache with ``index_attention``."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch

from dsv4_attention.common import kv_cache as kc
from dsv4_attention.common.testing import fresh_generator


def pages(nb, b, g, magnitude=1.0):
    x = torch.randn(nb, b, 1, 512, generator=g) * magnitude
    x[:, :, 0, 3 * 64:4 * 64] *= 1000.0  # one tile far larger: per-tile scales must differ
    return x.to(torch.bfloat16)


def expected_bytes(kv: torch.Tensor) -> torch.Tensor:
    """The page bytes written from the definition, one byte at a time through ``PageLayout``'s
    offsets (slow and plain: the specification the vectorised quantizer is checked against)."""
    nb, b = kv.shape[:2]
    lay = kc.page_layout(b)
    out = torch.zeros(nb, lay.page_bytes, dtype=torch.uint8)
    for n in range(nb):
        for t in range(b):
            row = kv[n, t, 0]
            for j in range(kc.TILES):
                tile = row[64 * j:64 * j + 64].float()
                amax = float(tile.abs().max())
                e = math.ceil(math.log2(max(amax / 448.0, 1e-4)))
                out[n, lay.scale_byte(t, j)] = e + 127
                q = (tile / 2.0 ** e).to(torch.float8_e4m3fn).view(torch.uint8)
                for i in range(64):
                    out[n, lay.nope_byte(t, 64 * j + i)] = q[i]
            rope = row[448:].contiguous().view(torch.uint8)
            for k in range(64):
                first = lay.rope_byte(t, 448 + k)
                out[n, first:first + 2] = rope[2 * k:2 * k + 2]
    return out


def page_bytes(cache: torch.Tensor) -> torch.Tensor:
    lay = kc.check_fp8_cache(cache)
    raw = torch.as_strided(cache.view(torch.uint8), (cache.shape[0], lay.page_bytes), (cache.stride(0), 1))
    return raw.clone()


@pytest.mark.parametrize("nb,b", [(3, 2), (2, 64), (1, 5)])
def test_quantized_bytes_follow_the_layout(nb, b):
    g = fresh_generator()
    kv = pages(nb, b, g)
    cache = kc.quantize_kv_cache(kv)
    lay = kc.page_layout(b)
    assert cache.shape == (nb, b, 1, 584) and cache.dtype == torch.float8_e4m3fn
    assert (nb == 1 or cache.stride(0) == lay.page_bytes) and lay.page_bytes % 576 == 0
    assert lay.page_bytes >= 584 * b > lay.page_bytes - 576
    assert torch.equal(page_bytes(cache), expected_bytes(kv))


def test_layout_checker_rejects_interleaved_scales():
    """Negative control: the same values with each token's 8 scale bytes right after its 576 data
    bytes (a 584-byte record a token) are not the layout."""
    g = fresh_generator()
    kv = pages(1, 4, g)
    want = expected_bytes(kv)
    lay = kc.page_layout(4)
    wrong = torch.zeros_like(want)
    for t in range(4):
        wrong[0, 584 * t:584 * t + 576] = want[0, 576 * t:576 * t + 576]
        wrong[0, 584 * t + 576:584 * t + 584] = want[0, lay.data_bytes + 8 * t:lay.data_bytes + 8 * t + 8]
    assert not torch.equal(wrong, want)


def kernel_view(cache: torch.Tensor, token_map=None, unit_map=None) -> torch.Tensor:
    """Every cache slot's 512 dims as the paged gather reads them: for each token j, chunk c and
    16-byte unit u, the bytes ``kv_cache.token_bytes`` / ``unit_bytes`` (the kernel's own address
    map; stand-ins for the negative controls) name, dequantized with the scale byte they name."""
    token_map, unit_map = token_map or kc.token_bytes, unit_map or kc.unit_bytes
    nb, b = cache.shape[:2]
    raw = torch.as_strided(cache.view(torch.uint8), (cache.stride(0) * (nb - 1) + kc.page_layout(b).used_bytes,),
                           (1,))
    out = torch.empty(nb * b, 512, dtype=torch.bfloat16)
    for j in range(nb * b):
        data, scales = token_map(j, b, cache.stride(0))
        for c in range(8):
            for u in range(8):
                off, n, tile = unit_map(c, u)
                bytes_ = raw[data + off:data + off + n]
                if tile is None:
                    vals = bytes_.view(torch.bfloat16)
                else:
                    e = int(raw[scales + tile])
                    vals = (bytes_.view(torch.float8_e4m3fn).float() * 2.0 ** (e - 127)).to(torch.bfloat16)
                out[j, 64 * c + 8 * u:64 * c + 8 * u + 8] = vals
    return out


@pytest.mark.proof
@pytest.mark.parametrize("nb,b", [(3, 2), (2, 64), (1, 5)])
def test_gather_address_map_reads_the_format(nb, b):
    """The paged gather's address map (kv_cache.token_bytes / unit_bytes, which
    stages/e_fused/sm90_pages.py calls) reads every dim of every slot, each NoPE unit with its own
    tile's scale, as the format defines them (``dequantize_kv_cache``, bit for bit); a padded page
    stride too."""
    g = fresh_generator()
    cache = kc.quantize_kv_cache(pages(nb, b, g))
    want = kc.dequantize_kv_cache(cache).view(-1, 512)
    assert torch.equal(kernel_view(cache), want)
    lay = kc.page_layout(b)
    roomy = torch.zeros(nb, lay.page_bytes + 576, dtype=torch.uint8)
    roomy[:, :lay.page_bytes] = page_bytes(cache)
    padded = roomy.view(torch.float8_e4m3fn)[:, :lay.used_bytes].view(nb, b, 1, kc.BYTES_PER_TOKEN)
    assert torch.equal(kernel_view(padded), want)


@pytest.mark.proof
def test_gather_address_map_checker_rejects_wrong_maps():
    """Negative controls: a map that takes the next tile's scale, one that puts the scales right
    after each token's data (a 584-byte record), and one that ignores the page stride all read
    values the format does not hold."""
    g = fresh_generator()
    cache = kc.quantize_kv_cache(pages(3, 4, g))
    want = kc.dequantize_kv_cache(cache).view(-1, 512)

    def next_scale(c, u):
        off, n, tile = kc.unit_bytes(c, u)
        return off, n, None if tile is None else (tile + 1) % kc.TILES

    def interleaved(j, b, stride):
        page, t = divmod(j, b)
        return page * stride + 584 * t, page * stride + 584 * t + 576

    def dense_pages(j, b, stride):
        return kc.token_bytes(j, b, kc.page_layout(b).used_bytes)

    assert not torch.equal(kernel_view(cache, unit_map=next_scale), want)
    assert not torch.equal(kernel_view(cache, token_map=interleaved), want)
    assert not torch.equal(kernel_view(cache, token_map=dense_pages), want)


def test_dequantize_inverts_within_e4m3_rounding():
    g = fresh_generator()
    kv = pages(2, 16, g)
    back = kc.dequantize_kv_cache(kc.quantize_kv_cache(kv))
    assert back.dtype == torch.bfloat16 and back.shape == kv.shape
    assert torch.equal(back[..., 448:], kv[..., 448:])  # RoPE is not quantized
    x, y = kv[..., :448].float().reshape(-1, 64), back[..., :448].float().reshape(-1, 64)
    scale = kc.ue8m0_scales(x)[:, None]
    # e4m3: 3 mantissa bits, so within half an ulp, 2^-4 of the value; below e4m3's smallest normal
    # (2^-6 in scaled units) the step is 2^-9 of the scale
    assert bool(((x - y).abs() <= torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -9) * 1.0001).all())
    assert torch.equal(kc.dequantize_kv_cache(kc.quantize_kv_cache(back)), back)  # exact on its own output


def test_scales_at_the_ends_of_the_range():
    """A zero tile takes the clamp's scale 2^-13 (byte 114) and stays 0; a huge one 2^ceil(log2(amax / 448))."""
    kv = torch.zeros(1, 2, 1, 512, dtype=torch.bfloat16)
    kv[0, 1, 0, :64] = 3.0e30
    kv[0, 1, 0, 64:128] = -1.0e-30
    cache = kc.quantize_kv_cache(kv)
    lay = kc.page_layout(2)
    raw = page_bytes(cache)[0]
    assert int(raw[lay.scale_byte(0, 0)]) == 127 - 13
    assert int(raw[lay.scale_byte(1, 0)]) == 127 + math.ceil(math.log2(float(kv[0, 1, 0, 0]) / 448.0))
    assert int(raw[lay.scale_byte(1, 1)]) == 127 - 13  # 1e-30 / 448 is below the clamp
    back = kc.dequantize_kv_cache(cache)
    assert bool((back[0, 0] == 0).all()) and torch.isfinite(back.float()).all()
    assert (back[0, 1, 0, :64].float() / 3.0e30 - 1).abs().max() < 2 ** -4


def test_checks_name_what_is_wrong():
    kv = torch.zeros(2, 4, 1, 512, dtype=torch.bfloat16)
    cache = kc.quantize_kv_cache(kv)
    for bad, match in [(kv.float(), "bf16"), (kv[..., :256], "head_dim"), (kv[:, :, 0], r"\[num_blocks")]:
        with pytest.raises(ValueError, match=match):
            kc.quantize_kv_cache(bad)
    with pytest.raises(ValueError, match="584 bytes"):
        kc.dequantize_kv_cache(cache[..., :576])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kc.dequantize_kv_cache(torch.zeros(2, 4, 1, 584, dtype=torch.bfloat16))
    squeezed = torch.as_strided(cache, cache.shape, (584 * 4 - 576, 584, 584, 1))
    with pytest.raises(ValueError, match="apart"):
        kc.dequantize_kv_cache(squeezed)
    with pytest.raises(ValueError, match="page_block_size"):
        kc.page_layout(0)


def test_cache_indices_match_a_loop():
    g = fresh_generator()
    b, s, k, bs, blocks = 3, 5, 7, 4, 6
    table = torch.stack([torch.randperm(20, generator=g)[:blocks] for _ in range(b)]).int()
    pos = torch.randint(-1, blocks * bs, (b, s, k), generator=g).int()
    got = kc.cache_indices(pos, table, bs)
    for i in range(b):
        for j in range(s):
            for m in range(k):
                p = int(pos[i, j, m])
                want = -1 if p < 0 else int(table[i, p // bs]) * bs + p % bs
                assert int(got[i, j, m]) == want
    with pytest.raises(ValueError, match="past block_table"):
        kc.cache_indices(torch.full((b, 1), blocks * bs, dtype=torch.int32), table, bs)


def test_cache_rows_is_a_view():
    x = torch.randn(3, 8, 1, 512).to(torch.bfloat16)
    rows = kc.cache_rows(x)
    assert rows.shape == (24, 1, 512) and rows.data_ptr() == x.data_ptr()
    assert torch.equal(rows[2 * 8 + 5], x[2, 5])


def assert_flashmla_bytes(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """The same bytes in every page's data and scales; not the pad bytes, which FlashMLA leaves
    uninitialised (a token's eighth scale byte, the page's tail)."""
    b = ours.shape[1]
    lay = kc.page_layout(b)
    assert theirs.shape == ours.shape and (ours.shape[0] == 1 or theirs.stride() == ours.stride())
    meant = torch.ones(lay.used_bytes, dtype=torch.bool, device=ours.device)
    meant[[lay.scale_byte(t, kc.TILES) for t in range(b)]] = False
    used = slice(0, lay.used_bytes)
    assert torch.equal(page_bytes(ours)[:, used][:, meant], page_bytes(theirs)[:, used][:, meant])


def _flashmla_quant():
    """FlashMLA's own quantizer (its tests/quant.py): the file ``FLASHMLA_QUANT_PY`` names (a
    FlashMLA checkout's), else the copy in the device pack's conformance suite (``.device/``, or
    the pack beside the checkout); None where none is there."""
    import os

    here = pathlib.Path(__file__).resolve().parents[1]
    suite = pathlib.Path("conformance") / "flashmla-sparse-prefill" / "tests" / "quant.py"
    given = os.environ.get("FLASHMLA_QUANT_PY")
    for path in ([pathlib.Path(given)] if given else []) + [here / ".device" / suite, here.parent / "shared" / suite]:
        if path.exists():
            spec = importlib.util.spec_from_file_location("flashmla_quant", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    return None


def test_same_bytes_as_flashmla_quantizer():
    """Against FlashMLA's own quantize_k_cache (MODEL1) on the same input: the same bytes in every
    page's data and scales (not the pad bytes: FlashMLA leaves a token's eighth scale byte and the
    page's tail uninitialised), and the same dequantized values."""
    fm = _flashmla_quant()
    if fm is None:
        pytest.skip("FlashMLA's reference quantizer (its tests/quant.py) is not on this machine: point "
                    "FLASHMLA_QUANT_PY at a FlashMLA checkout's copy to compare bytes with it (the layout itself "
                    "is checked against its definition by the tests above)")
    g = fresh_generator()
    for nb, b in [(2, 64), (3, 2), (1, 256)]:
        kv = pages(nb, b, g, magnitude=3.0)
        ours = kc.quantize_kv_cache(kv)
        theirs = fm.quantize_k_cache(kv, fm.FP8KVCacheLayout.MODEL1_FP8Sparse)
        assert_flashmla_bytes(ours, theirs)
        assert torch.equal(kc.dequantize_kv_cache(ours),
                           fm.dequantize_k_cache(theirs, fm.FP8KVCacheLayout.MODEL1_FP8Sparse))


# ---- on a GPU: against FlashMLA's own quantizer and decode, and index_attention on bf16 pages ----------

from dsv4_attention.common.testing import O_REL, errors, gpu_arch_params, random_index_lists  # noqa: E402


def _peer():
    """FlashMLA built from the device pack (``flashmla_peer``), or None where it is not installed:
    it is a peer to compare with, not a dependency of the library."""
    try:
        import flashmla_peer  # pyright: ignore[reportMissingImports] (the device pack's FlashMLA)
    except ImportError:
        return None
    return flashmla_peer


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_same_bytes_as_flashmla_on_the_gpu_and_its_decode_reads_them(arch):
    """FlashMLA's quantize_k_cache and ours on the same CUDA tensor: the same bytes (pad bytes
    aside); FlashMLA's FP8 sparse decode over our cache and over its own gives the same bits."""
    fm = _peer()
    if fm is None:
        pytest.skip("FlashMLA (the flashmla_peer package, a peer to compare with, not a dependency) is not "
                    "installed here: its quantizer and FP8 decode are what this test compares against")
    g = fresh_generator()
    for nb, b in [(8, 64), (40, 2), (3, 256)]:
        kv = pages(nb, b, g, magnitude=3.0).cuda()
        ours, theirs = kc.quantize_kv_cache(kv), fm.quantize_k_cache(kv, "MODEL1")
        assert_flashmla_bytes(ours, theirs)
        assert torch.equal(kc.dequantize_kv_cache(ours), fm.dequantize_k_cache(theirs, "MODEL1"))
    # decode: 2 requests x 2 tokens x 64 heads over 128 listed rows of the last cache (3 pages of 256)
    q = torch.randn(2, 2, 64, 512, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([random_index_lists(2, 128, nb * b, g, pad=0.1) for _ in range(2)]).cuda()
    o1, l1 = fm.with_kvcache_sparse(q, ours, idx)
    o2, l2 = fm.with_kvcache_sparse(q, theirs, idx)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_index_attention_reads_bf16_pages_in_place(arch):
    """A bf16 paged cache (shuffled page table, -1 padding) read by index_attention through
    cache_rows and cache_indices, against the float64 reference on the logical rows; and the
    engines' FP8 path (dequantize, then index_attention) against FlashMLA's FP8 decode on the same
    cache, where the peer is there."""
    from dsv4_attention.common.reference import dsv4_index_attention
    from dsv4_attention.stages import e_fused

    g = fresh_generator()
    batch, s_q, heads, k, bs, n_pages = 2, 2, 64, 256, 64, 10  # k a multiple of 64: FlashMLA's block of lists
    seq = n_pages * bs
    table = torch.stack([torch.randperm(batch * n_pages, generator=g)[i * n_pages:(i + 1) * n_pages]
                         for i in range(batch)]).int().cuda()
    cache = torch.randn(batch * n_pages, bs, 1, 512, generator=g).to(torch.bfloat16).cuda()
    logical = torch.stack([random_index_lists(s_q, k, seq, g, pad=0.1) for _ in range(batch)]).cuda()
    idx = kc.cache_indices(logical, table, bs)  # [batch, s_q, k]
    q = torch.randn(batch, s_q, heads, 512, generator=g).to(torch.bfloat16).cuda()
    sink = torch.randn(heads, generator=g).cuda()
    rows = kc.cache_rows(cache)
    assert rows.data_ptr() == cache.data_ptr()
    o, lse = e_fused.index_attention(q.flatten(0, 1), rows, idx.flatten(0, 1)[:, None], attn_sink=sink)
    full = torch.full((batch * s_q,), k, dtype=torch.int32, device="cuda")
    o_ref, _ = dsv4_index_attention(q.flatten(0, 1), rows[:, 0], idx.flatten(0, 1), full, sink)
    e = errors(o, o_ref)
    assert e.within(O_REL[torch.bfloat16], 3 * O_REL[torch.bfloat16]), e
    fm = _peer()
    if fm is None:  # the bf16 half above is the library's own; the FP8 half compares with FlashMLA
        return
    fp8 = kc.quantize_kv_cache(cache)
    o_fp8, _ = e_fused.index_attention(q.flatten(0, 1), kc.cache_rows(kc.dequantize_kv_cache(fp8)),
                                       idx.flatten(0, 1)[:, None], attn_sink=sink)
    o_peer, _ = fm.with_kvcache_sparse(q, fp8, idx, None, sink)
    e = errors(o_fp8, o_peer.flatten(0, 1))
    assert e.within(2 * O_REL[torch.bfloat16], 6 * O_REL[torch.bfloat16]), e
