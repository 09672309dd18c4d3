"""Stage E without a GPU: the float64 reference of the fused softmax against the spec's own form
(one gathered index list per token) and against the exact merge of its two halves; the compressed
entries' validation; the FLOP count; the sm90 kernel's compile budgets."""

import itertools

import pytest
import torch

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.common.compressed import compressed_count, compressed_visible
from dsv4_attention.common.merge import merge_attention
from dsv4_attention.common.reference import attention, dsv4_index_attention, fused_attention
from dsv4_attention.common.validation import check_compressed, check_topk
from dsv4_attention.stages import e_fused as stage

pytestmark = [pytest.mark.stage_e]


def spec_index_list(T: int, window: int, ratio: int, n_c: int):
    """[T, window + n_c] int32 rows of cat(kv, compressed): token t's window rows t - window + 1 .. t
    then its visible entries j < (t + 1) / ratio (offset by T), -1 elsewhere (the spec's padding)."""
    t = torch.arange(T)[:, None]
    k = torch.arange(window + n_c)[None, :]
    win = t - (window - 1) + k
    return torch.where(k < window, torch.where(win >= 0, win, -1),
                       torch.where(k - window < torch.clamp((t + 1) // ratio, max=n_c), T + k - window, -1)).int()


@pytest.mark.parametrize("T,H,ratio,n_c", [(200, 4, 4, 50), (300, 2, 128, 2), (130, 3, 4, 10)])
def test_fused_reference_is_the_spec_function(T, H, ratio, n_c):
    g = torch.Generator().manual_seed(T + ratio)
    d = 64
    q, kv, ckv = (torch.randn(1, n, h, d, generator=g, dtype=torch.float64) for n, h in ((T, H), (T, 1), (n_c, 1)))
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    o, lse = fused_attention(q, kv, compressed_kv=ckv, compress_ratio=ratio, causal=True, window_size=(127, 0),
                             learnable_sink=sink, softmax_scale=d ** -0.5)
    idx = spec_index_list(T, 128, ratio, n_c)
    o_ref, lse_ref = dsv4_index_attention(q[0], torch.cat([kv[0, :, 0], ckv[0, :, 0]]), idx,
                                          torch.full((T,), idx.shape[1]), sink, scale=d ** -0.5)
    assert torch.allclose(o[0], o_ref, atol=1e-12), (o[0] - o_ref).abs().max()
    assert torch.allclose(lse[0].transpose(0, 1), lse_ref, atol=1e-12)


def test_checker_rejects_an_off_by_one_spec_list():
    """Negative control of the test above: entries j < t / r (not (t + 1) / r) change the result."""
    T, H, ratio, n_c, d = 64, 2, 4, 20, 32
    g = torch.Generator().manual_seed(1)
    q, kv, ckv = (torch.randn(1, n, h, d, generator=g, dtype=torch.float64) for n, h in ((T, H), (T, 1), (n_c, 1)))
    o, _ = fused_attention(q, kv, compressed_kv=ckv, compress_ratio=ratio, causal=True, window_size=(127, 0),
                           softmax_scale=d ** -0.5)
    idx = spec_index_list(T, 128, ratio, n_c)
    t = torch.arange(T)[:, None]
    j = torch.arange(n_c)[None]
    off = idx.clone()
    off[:, 128:] = torch.where(j < torch.clamp(t // ratio, max=n_c), T + j, -1).int()
    o_bad, _ = dsv4_index_attention(q[0], torch.cat([kv[0, :, 0], ckv[0, :, 0]]), off, torch.full((T,), off.shape[1]),
                                    None, scale=d ** -0.5)
    assert not torch.allclose(o[0], o_bad, atol=1e-6)


def test_topk_reference_is_the_spec_function():
    """Top-k: the spec's list is each token's window rows then its listed entries (the reference
    drops the ones not yet visible; the spec's list would not hold them)."""
    T, H, ratio, n_c, k, d = 150, 3, 4, 37, 20, 32
    g = torch.Generator().manual_seed(3)
    q, kv, ckv = (torch.randn(1, n, h, d, generator=g, dtype=torch.float64) for n, h in ((T, H), (T, 1), (n_c, 1)))
    idx = torch.randint(-1, n_c, (1, T, k), generator=g, dtype=torch.int32)
    o, lse = fused_attention(q, kv, compressed_kv=ckv, compress_ratio=ratio, topk_indices=idx, causal=True,
                             window_size=(127, 0), softmax_scale=d ** -0.5)
    t = torch.arange(T)[:, None]
    win = spec_index_list(T, 128, ratio, 0)  # window rows only
    listed = torch.where((idx[0] >= 0) & (idx[0] < (t + 1) // ratio), T + idx[0], -1).int()
    full = torch.cat([win, listed], dim=1)
    o_ref, lse_ref = dsv4_index_attention(q[0], torch.cat([kv[0, :, 0], ckv[0, :, 0]]), full,
                                          torch.full((T,), full.shape[1]), None, scale=d ** -0.5)
    assert torch.allclose(o[0], o_ref, atol=1e-12) and torch.allclose(lse[0].transpose(0, 1), lse_ref, atol=1e-12)


def test_topk_reference_reads_each_heads_kv_head():
    """With kv_heads > 1, head h's listed entries are those of kv head h // (heads / kv_heads): a
    list naming every entry gives the all-entries reference (whose entries expand per kv head).
    Negative control: kv head 1 replaced by kv head 0 (what a gather of kv head 0 alone reads)
    changes the result, so the equality sees which kv head was read."""
    b, T, H, hk, ratio, n_c, d = 2, 40, 4, 2, 4, 10, 32
    g = torch.Generator().manual_seed(11)
    q, kv, ckv = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n, h in ((T, H), (T, hk), (n_c, hk)))
    every = torch.arange(n_c, dtype=torch.int32).expand(b, T, n_c).contiguous()
    kw = dict(compress_ratio=ratio, causal=True, window_size=(15, 0), softmax_scale=d ** -0.5)
    o, lse = fused_attention(q, kv, compressed_kv=ckv, topk_indices=every, **kw)
    o_all, lse_all = fused_attention(q, kv, compressed_kv=ckv, **kw)
    assert torch.allclose(o, o_all, atol=1e-12) and torch.allclose(lse, lse_all, atol=1e-12)
    head0 = ckv[:, :, :1].expand(b, n_c, hk, d)
    o_head0, _ = fused_attention(q, kv, compressed_kv=head0, topk_indices=every, **kw)
    assert not torch.allclose(o_head0, o_all, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(2, 5, 4, dtype=torch.int64), "int32"),
    (torch.zeros(2, 6, 4, dtype=torch.int32), "seqlen_q"),
    (torch.zeros(5, 4, dtype=torch.int32), "batch"),
    (torch.full((2, 5, 4), 8, dtype=torch.int32), "values"),
    (torch.full((2, 5, 4), -2, dtype=torch.int32), "values"),
    (torch.zeros(2, 5, 8, dtype=torch.int32)[..., ::2], "contiguous"),
    ([0, 1], "torch.Tensor"),
])
def test_topk_checks(bad, match):
    q = kv_like(2, 5, 128, 512)
    with pytest.raises(ValueError, match=match):
        check_topk(bad, q, 8, 128, 64, "sm90")


def test_unchecked_topk_reads_no_value_but_still_checks_the_layout():
    """check_values=False (``check_indices=False``): the values are not read (no device sync), so
    out-of-range lists pass, while what the kernel's addressing needs is still refused."""
    q = kv_like(2, 5, 128, 512)
    for values in (8, -2, 2**31 - 1):
        check_topk(torch.full((2, 5, 4), values, dtype=torch.int32), q, 8, 128, 64, "sm90", check_values=False)
    for bad, match in ((torch.zeros(2, 5, 4, dtype=torch.int64), "int32"), (torch.zeros(2, 6, 4, dtype=torch.int32),
                       "seqlen_q"), (torch.zeros(2, 5, 8, dtype=torch.int32)[..., ::2], "contiguous")):
        with pytest.raises(ValueError, match=match):
            check_topk(bad, q, 8, 128, 64, "sm90", check_values=False)
    with pytest.raises(ValueError, match="values"):  # the default reads them
        check_topk(torch.full((2, 5, 4), 8, dtype=torch.int32), q, 8, 128, 64, "sm90")


def test_topk_needs_whole_tiles_of_one_token():
    q = kv_like(2, 5, 32, 512)
    with pytest.raises(ValueError, match="multiple"):
        check_topk(torch.zeros(2, 5, 4, dtype=torch.int32), q, 8, 32, 64, "sm90")
    check_topk(torch.full((2, 5, 4), -1, dtype=torch.int32), q, 8, 128, 64, "sm90")  # -1 everywhere is legal


def test_topk_64_heads_fill_half_an_sm100_tile():
    """sm100 serves a token's 64 heads in its 128-row tile, padded (stages/e_fused/sm100.py); other
    groups below the tile stay refused there, and sm90's 128-row tiles do not pad."""
    idx = torch.zeros(2, 5, 4, dtype=torch.int32)
    q = kv_like(2, 5, 64, 512)
    check_topk(idx, q, 8, 64, 128, "sm100")
    for group in (32, 96, 192):
        with pytest.raises(ValueError, match="multiple of the sm100 kernel's 128-row tile or 64"):
            check_topk(idx, q, 8, group, 128, "sm100")
    with pytest.raises(ValueError, match="multiple of the sm90 kernel's 128-row tile$"):
        check_topk(idx, q, 8, 64, 128, "sm90")


def test_fused_reference_is_the_merge_of_its_halves():
    g = torch.Generator().manual_seed(5)
    T, n_c, d = 150, 40, 32
    q, kv, ckv = (torch.randn(2, n, h, d, generator=g, dtype=torch.float64) for n, h in ((T, 4), (T, 1), (n_c, 1)))
    o, lse = fused_attention(q, kv, compressed_kv=ckv, compress_ratio=4, window_size=(31, 0))
    o1, l1 = attention(q, kv, kv, window_size=(31, 0))
    # the compressed half alone: entry j visible to token t iff j < (t + 1) / 4, as a key mask
    s_vis = torch.tensor([[compressed_visible(i, j, T, T, 4, n_c) for j in range(n_c)] for i in range(T)])
    scores = torch.einsum("bihd,bjd->bhij", q, ckv[:, :, 0]) * d ** -0.5
    scores = scores.masked_fill(~s_vis, float("-inf"))
    l2 = torch.logsumexp(scores, -1)
    o2 = torch.einsum("bhij,bjd->bihd", torch.exp(scores - l2[..., None]).nan_to_num(0.0), ckv[:, :, 0])
    o_m, l_m = merge_attention(o1, l1, o2, l2)
    # merge_attention computes in fp32 (its contract): agreement to fp32 rounding
    assert torch.allclose(o, o_m.double(), atol=2e-6) and torch.allclose(lse, l_m.double(), atol=2e-6)


def test_count_is_the_formula():
    for sq, sk in ((10, 10), (5, 300), (300, 5)):
        for ratio in (1, 4, 128):
            for n_c in (0, 3, 1000):
                for i in range(sq):
                    c = compressed_count(i, sq, sk, ratio, n_c)
                    assert c == sum(compressed_visible(i, j, sq, sk, ratio, n_c) for j in range(n_c + 2))


def test_flops_count_both_key_sets():
    want = sum(min(9, (i + 1) // 4) + min(i + 1, 128) for i in range(40))
    assert stage.flops(1, 40, 40, 1, 1, True, (127, 0), 4, 9) == 4 * want


def kv_like(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("args,match", [
    ((None, 4), "go together"),
    ((kv_like(2, 8, 1, 512), None), "go together"),
    ((kv_like(2, 8, 1, 512), 0), "positive int"),
    ((kv_like(2, 8, 1, 512), 2.0), "positive int"),
    ((kv_like(2, 8, 1, 512), False), "positive int"),
    ((kv_like(2, 8, 1, 512, dtype=torch.float16), 4), "dtype"),
    ((kv_like(1, 8, 1, 512), 4), "batch"),
    ((kv_like(2, 8, 2, 512), 4), "kv_heads"),
    ((kv_like(2, 8, 1, 256), 4), "head_dim"),
    ((kv_like(2, 8, 512), 4), "rank 4"),
    ((kv_like(2, 8, 1, 1024)[..., ::2], 4), "contiguous"),
])
def test_compressed_checks(args, match):
    k = kv_like(2, 50, 1, 512)
    with pytest.raises(ValueError, match=match):
        check_compressed(*args, k, k)


def test_compressed_needs_k_equal_v():
    k = kv_like(2, 50, 1, 512)
    with pytest.raises(ValueError, match="K = V"):
        check_compressed(kv_like(2, 8, 1, 512), 4, k, k.clone())
    check_compressed(kv_like(2, 0, 1, 512), 4, k, k)  # 0 entries are legal


CASES = [
    (512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_sink": True,
           "has_compressed": True}),
    (512, {"kv_shared": True, "pack_group": 64, "has_compressed": True}),
    (128, {"kv_shared": True, "pack_group": 8, "has_right": True, "has_compressed": True}),
    (512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_sink": True,
           "has_compressed": True, "has_topk": True}),
    (128, {"kv_shared": True, "pack_group": 128, "has_right": True, "has_compressed": True, "has_topk": True}),
    (512, {"kv_shared": True, "pack_group": 64, "has_sink": True, "has_compressed": True, "has_topk": True,
           "index_mode": True}),
    (512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_sink": True,
           "has_compressed": True, "has_topk": True, "has_positions": True}),
    (512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_compressed": True,
           "has_positions": True}),
    (512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_sink": True,
           "has_compressed": True, "varlen": True}),
    (512, {"kv_shared": True, "pack_group": 64, "has_left": True, "has_right": True, "has_sink": True,
           "has_compressed": True, "has_topk": True, "varlen": True, "has_positions": True}),
    # serving: index mode over a paged FP8 cache (pages of 64, the sink)
    (512, {"kv_shared": True, "pack_group": 64, "has_sink": True, "has_compressed": True, "has_topk": True,
           "index_mode": True, "kv_pages": 64}),
    # decode in one launch: the window cache (pages of 256) and the extra cache (pages of 64)
    (512, {"kv_shared": True, "pack_group": 128, "has_sink": True, "has_compressed": True, "has_topk": True,
           "index_mode": True, "kv_pages": 256, "kv_pages_extra": 64}),
]


@pytest.mark.compile
@pytest.mark.arch("sm90")
@pytest.mark.parametrize("head_dim,options", CASES, ids=[f"hd{d}-{o}" for d, o in CASES])
def test_sm90_compiles_within_budget(head_dim, options):
    assert_within_budget("e", "sm90", "bfloat16", head_dim, options=options)


def test_kv_start_places_a_window_cache_in_its_sequence():
    """The reference with kv_start: the last tokens of a sequence over only its last rows (a window
    cache, raw key 0 at kv_start) equal the same tokens over the whole sequence; without kv_start
    (the negative control) the compressed visibility is wrong."""
    from dsv4_attention.common.reference import fused_attention

    g = torch.Generator().manual_seed(3)
    T, H, d, r, tail, rows = 600, 4, 32, 4, 3, 130
    q = torch.randn(1, T, H, d, generator=g, dtype=torch.float64)
    kv = torch.randn(1, T, 1, d, generator=g, dtype=torch.float64)
    ckv = torch.randn(1, T // r, 1, d, generator=g, dtype=torch.float64)
    kw = {"compressed_kv": ckv, "compress_ratio": r, "causal": True, "window_size": (127, 0)}
    o_all, lse_all = fused_attention(q[:, T - tail:], kv, **kw)
    o_cache, lse_cache = fused_attention(q[:, T - tail:], kv[:, T - rows:], kv_start=T - rows, **kw)
    assert torch.allclose(o_all, o_cache, atol=1e-12) and torch.allclose(lse_all, lse_cache, atol=1e-12)
    o_wrong, _ = fused_attention(q[:, T - tail:], kv[:, T - rows:], **kw)
    assert not torch.allclose(o_all, o_wrong, atol=1e-3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, 2**31])
def test_kv_start_checks(bad):
    from dsv4_attention.common.validation import check_kv_start

    with pytest.raises(ValueError, match="kv_start"):
        check_kv_start(bad, 10)


def test_positions_place_a_chunk_in_its_sequence():
    """The reference with positions: a chunk of a sequence's tokens, given their absolute positions,
    equals the same rows of the whole sequence (window and entries); over a window cache too
    (kv_start); judged at bottom-right alignment instead (the negative control) it differs."""
    g = torch.Generator().manual_seed(5)
    T, H, d, r = 600, 4, 32, 4
    q = torch.randn(1, T, H, d, generator=g, dtype=torch.float64)
    kv = torch.randn(1, T, 1, d, generator=g, dtype=torch.float64)
    ckv = torch.randn(1, T // r, 1, d, generator=g, dtype=torch.float64)
    kw = {"compressed_kv": ckv, "compress_ratio": r, "causal": True, "window_size": (127, 0)}
    o_all, lse_all = fused_attention(q, kv, **kw)
    a, b = 200, 330  # the chunk: tokens 200 .. 329 of 600
    pos = torch.arange(a, b, dtype=torch.int32)
    o, lse = fused_attention(q[:, a:b], kv, positions=pos, **kw)
    assert torch.allclose(o, o_all[:, a:b], atol=1e-12) and torch.allclose(lse, lse_all[..., a:b], atol=1e-12)
    o_cache, _ = fused_attention(q[:, a:b], kv[:, 50:], positions=pos[None], kv_start=50, **kw)  # keys 50 on
    assert torch.allclose(o_cache, o_all[:, a:b], atol=1e-12)
    o_wrong, _ = fused_attention(q[:, a:b], kv, **kw)
    assert not torch.allclose(o_wrong, o_all[:, a:b], atol=1e-3)


@pytest.mark.parametrize("bad,match", [
    (torch.arange(10), "int32"), (torch.arange(9, dtype=torch.int32), "seqlen_q"),
    (torch.arange(10, dtype=torch.int32).flip(0), "non-decreasing"),
    (torch.arange(10, dtype=torch.int32) - 1, "0, 2"), (torch.full((10,), 2**30, dtype=torch.int32), "0, 2"),
    (torch.arange(20, dtype=torch.int32).view(10, 2).T, "contiguous"), ([0] * 10, "torch.Tensor"),
])  # fmt: skip
def test_positions_checks(bad, match):
    from dsv4_attention.common.validation import check_positions

    with pytest.raises(ValueError, match=match):
        check_positions(bad, 2, 10, torch.device("cpu"))


def test_positions_check_returns_the_kernels_rows():
    from dsv4_attention.common.validation import check_positions

    pos = torch.tensor([3, 3, 7, 9], dtype=torch.int32)
    assert check_positions(pos, 2, 4, torch.device("cpu")).shape == (1, 4)
    assert check_positions(torch.stack([pos, pos + 1]), 2, 4, torch.device("cpu")).shape == (2, 4)


def test_varlen_entries_default_to_floor_of_keys_over_ratio():
    from dsv4_attention.common.validation import varlen_compressed_offsets

    cu_k = torch.tensor([0, 400, 481, 481, 1000], dtype=torch.int32)
    got = varlen_compressed_offsets(None, cu_k, 4, 300, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == [0, 100, 120, 120, 249]
    with pytest.raises(ValueError, match="past compressed_kv"):
        varlen_compressed_offsets(None, cu_k, 4, 248, torch.device("cpu"))


@pytest.mark.parametrize("given,match", [
    ([0, 5, 3], "non-decreasing"), ([1, 5, 9], "start at 0"), ([0, 5, 11], "past compressed_kv"),
    ([0, 5], "shape"), (torch.tensor([0, 5, 9]), "int32"),
])  # fmt: skip
def test_varlen_entry_offsets_checks(given, match):
    from dsv4_attention.common.validation import varlen_compressed_offsets

    cu = given if isinstance(given, torch.Tensor) else torch.tensor(given, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        varlen_compressed_offsets(cu, torch.tensor([0, 8, 16], dtype=torch.int32), 4, 10, torch.device("cpu"))
    ok = torch.tensor([0, 5, 9], dtype=torch.int32)
    assert varlen_compressed_offsets(ok, torch.tensor([0, 8, 16], dtype=torch.int32), 4, 10,
                                     torch.device("cpu")) is ok


def test_varlen_topk_indices_are_local_to_the_tokens_request():
    """Token t's indices must lie below its own request's entry count: an index valid in the packed
    tensor but past the request's entries is refused, naming the token; -1 is always fine."""
    from dsv4_attention.common.validation import varlen_entry_limits

    cu_c = torch.tensor([0, 100, 120], dtype=torch.int32)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    limits = varlen_entry_limits(cu_c, cu_q, 6)  # token 5 belongs to no request
    assert limits[:5].tolist() == [100, 100, 100, 20, 20] and limits[5] >= 2**31 - 1
    q = kv_like(1, 6, 128, 512)
    idx = torch.full((1, 6, 4), -1, dtype=torch.int32)
    idx[0, :3, 0], idx[0, 3:5, 0] = 99, 19
    check_topk(idx, q, 120, 128, 64, "sm90", entry_limits=limits)
    idx[0, 4, 2] = 20  # in the packed tensor, past request 1's 20 entries
    with pytest.raises(ValueError, match="token 4 lists 20 at position 2"):
        check_topk(idx, q, 120, 128, 64, "sm90", entry_limits=limits)


def test_varlen_positions_start_over_at_each_request():
    from dsv4_attention.common.validation import check_positions

    pos = torch.tensor([7, 8, 9, 0, 1, 4], dtype=torch.int32)
    assert check_positions(pos, 1, 6, torch.device("cpu"), request_starts=[0, 3]).shape == (1, 6)
    with pytest.raises(ValueError, match="non-decreasing"):  # the drop is inside a request
        check_positions(pos, 1, 6, torch.device("cpu"), request_starts=[0, 2])
    with pytest.raises(ValueError, match="non-decreasing"):  # batched: no request starts
        check_positions(pos, 1, 6, torch.device("cpu"))


# ---------------------------------------------------------------------------------------
# Strided inputs (issue 41): every layout the copy engines read reaches the launch in place, as
# FlashMLA's test passes them (views into buffers padded in every dim); what they cannot read is
# refused before, naming the tensor and the stride. The launch is intercepted (no GPU): the
# architecture query answers sm90 or sm100 and ``jit.stage_kernel`` hands back the kernel's
# arguments instead of compiling.


class ReachedLaunch(Exception):
    pass


@pytest.fixture
def launch(monkeypatch):
    """``launch(arch, fn, *args, **kw)``: run ``fn`` with the device taken for ``arch``; returns
    (the kernel's arguments by name, its compile-time options) where the kernel would have run."""
    from dsv4_attention.common import call_plan, interface, jit, seams

    names = ["q", "k", "v", "o", "lse", "scale_log2", "stream", *seams.TAIL]
    arch = ["sm90"]

    def stage_kernel(stage_id, kernels, a, dtype, head_dim, args, options=None):
        raise ReachedLaunch(dict(zip(names, args, strict=True)), dict(options or {}))

    monkeypatch.setattr(interface, "arch_of_device", lambda device: arch[0])
    monkeypatch.setattr(jit, "stage_kernel", stage_kernel)
    call_plan.clear()

    def run(a, fn, *args, **kw):
        arch[0] = a
        with pytest.raises(ReachedLaunch) as e:
            fn(*args, **kw)
        return e.value.args

    yield run
    call_plan.clear()


def flashmla_inputs(s_q=6, s_kv=40, heads=128, topk=24):
    """q [s_q, heads, 512], kv [s_kv, 1, 512] bf16 and indices [s_q, 1, topk] int32, each a view
    into a buffer padded in every dim (FlashMLA's kernelkit.non_contiguousify)."""
    from dsv4_attention.common.testing import padded_view

    g = torch.Generator().manual_seed(11)
    q = padded_view(torch.randn(s_q, heads, 512, generator=g).bfloat16())
    kv = padded_view(torch.randn(s_kv, 1, 512, generator=g).bfloat16())
    idx = padded_view(torch.randint(-1, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32))
    return q, kv, idx


def in_place(view: torch.Tensor, t: torch.Tensor) -> bool:
    """``view`` reads ``t``'s own memory: the same storage and first element, the same values."""
    return (view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            and view.data_ptr() == t.data_ptr() and torch.equal(view.reshape(t.shape), t))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_index_mode_takes_flashmla_strided_inputs_in_place(launch, arch):
    q, kv, idx = flashmla_inputs()
    assert kv.stride() == (1280, 640, 1) and q.stride() == (129 * 640, 640, 1) and idx.stride()[2] == 1
    for check in (True, False):
        args, options = launch(arch, stage.index_attention, q, kv, idx, softmax_scale=0.5, check_indices=check)
        kv4 = args["entries"].compressed
        assert args["k"] is kv4 and args["v"] is kv4, "K, V and the gathered rows are one tensor"
        assert in_place(kv4, kv) and kv4.shape == (1, 40, 1, 512) and kv4.stride()[1:] == kv.stride()
        assert in_place(args["q"], q) and args["q"].stride()[1:] == q.stride()
        assert torch.equal(args["entries"].topk[0], idx[:, 0]) and args["entries"].ratio == 1
        assert options["index_mode"] and options["has_topk"] and options["kv_shared"]


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_index_mode_reads_no_stride_of_kvs_middle_dim(launch, arch):
    """kv's extent-1 middle dim is never stepped: any stride there is taken (here 3 elements, 6
    bytes, which TMA could not take as a stride), the launch getting the row stride in its place."""
    q, kv, idx = flashmla_inputs()
    odd = kv.as_strided(kv.shape, (kv.stride(0), 3, 1))
    args, _ = launch(arch, stage.index_attention, q, odd, idx)
    assert in_place(args["entries"].compressed, kv) and args["entries"].compressed.stride()[1:] == (1280, 1280, 1)


def compressed_layout(layout: str, batch: int, n: int, hk: int, d: int = 512) -> torch.Tensor:
    """[batch, n, hk, d] bf16 compressed entries: ``dense``; ``flashmla``: padded in every dim;
    ``rows``: only each entry's row padded (+ 128 columns, one kv head: the batch stride stays
    entries x the entry stride); ``heads``: each kv head padded (+ 64 columns)."""
    from dsv4_attention.common.testing import padded_view

    c = torch.randn(batch, n, hk, d, generator=torch.Generator().manual_seed(batch * 100 + hk)).bfloat16()
    if layout == "dense":
        return c
    if layout == "flashmla":
        return padded_view(c)
    nan = float("nan")
    if layout == "rows":  # strides (n (hk d + 128), hk d + 128, d, 1)
        view = torch.full((batch, n, hk * d + 128), nan, dtype=torch.bfloat16)[..., :hk * d].view(batch, n, hk, d)
    else:  # heads: strides (n hk (d + 64), hk (d + 64), d + 64, 1)
        view = torch.full((batch, n, hk, d + 64), nan, dtype=torch.bfloat16)[..., :d]
    view.copy_(c)
    return view


#: (layout, batch, kv heads) -> the sm100 refusal's match, or None where both archs read it
TOPK_LAYOUTS = {
    ("flashmla", 1, 1): None,  # FlashMLA's padding, one batch entry: any entry stride
    ("rows", 2, 1): None,  # padded rows, dense batches
    ("dense", 2, 2): None,
    ("flashmla", 2, 1): "batch stride",  # the padding row between batch entries: sm100's 2D view misses it
    ("heads", 1, 2): "kv-head stride",  # padded kv heads: sm100's row of hk x d columns misses them
}


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("layout,batch,hk", list(TOPK_LAYOUTS), ids=[f"{a}-b{b}-hk{h}" for a, b, h in TOPK_LAYOUTS])
def test_topk_takes_strided_compressed_kv_in_place(launch, arch, layout, batch, hk):
    """forward(..., compressed_kv=strided, topk_indices=...): sm90's gather addresses each row by the
    tensor's own strides, so it takes every layout in place; sm100's gather4 reads one 2D view and
    refuses, before launch and naming the stride, the layouts that view would misread (see
    test_sm100_gather_view_reads_exactly_the_layouts_the_check_accepts)."""
    from dsv4_attention.common.testing import padded_view

    sq, n, heads = 5, 30, 128 * hk
    g = torch.Generator().manual_seed(4)
    q = padded_view(torch.randn(batch, sq, heads, 512, generator=g).bfloat16())
    kv = padded_view(torch.randn(batch, 50, hk, 512, generator=g).bfloat16())
    ckv = compressed_layout(layout, batch, n, hk)
    idx = padded_view(torch.randint(-1, n, (batch, sq, 8), generator=g, dtype=torch.int32))
    kw = {"compressed_kv": ckv, "compress_ratio": 4, "topk_indices": idx, "causal": True, "window_size": (127, 0)}
    refused = TOPK_LAYOUTS[(layout, batch, hk)] if arch == "sm100" else None
    if refused:
        with pytest.raises(ValueError, match=f"compressed_kv's {refused}"):
            launch(arch, stage.forward, q, kv, **kw)
        return
    args, options = launch(arch, stage.forward, q, kv, **kw)
    assert args["entries"].compressed is ckv and args["k"] is kv and args["q"] is q and args["entries"].topk is idx
    assert options["has_topk"] and options["kv_shared"]


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_unreadable_layouts_are_refused_naming_why(launch, arch):
    """What no copy engine reads, refused before launch with the tensor, the dim and the stride:
    a row stride that is not a whole number of 16-byte units, a last dim that is not contiguous, a
    data pointer off 16 bytes; in index mode (kv, q) and as compressed_kv."""
    q, kv, idx = flashmla_inputs()
    s_kv = kv.shape[0]

    def offset_by_one(t):  # the same shape, one element past a 16-byte boundary
        return torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)

    index_cases = [
        ((q, torch.zeros(s_kv, 1, 516, dtype=torch.bfloat16)[..., :512], idx),
         r"kv stride of dim 0 must be a multiple of 16 bytes .*row stride is 516 elements = 1032 bytes"),
        ((q, torch.zeros(s_kv, 1, 1024, dtype=torch.bfloat16)[..., ::2], idx), r"kv must have d contiguous"),
        ((q, offset_by_one(kv), idx), r"kv data pointer must be 16-byte aligned"),
        ((torch.zeros(6, 128, 516, dtype=torch.bfloat16)[..., :512], kv, idx),
         r"q stride of dim 1 must be a multiple of 16 bytes .*head stride is 516 elements"),
        ((torch.zeros(6, 128, 1024, dtype=torch.bfloat16)[..., ::2], kv, idx), r"q must have d contiguous"),
    ]
    for args, match in index_cases:
        with pytest.raises(ValueError, match=match):
            launch(arch, stage.index_attention, *args)
    qf, kvf = torch.zeros(1, 5, 128, 512, dtype=torch.bfloat16), torch.zeros(1, 50, 1, 512, dtype=torch.bfloat16)
    idx4 = torch.zeros(1, 5, 8, dtype=torch.int32)
    compressed_cases = [
        (torch.zeros(1, 30, 1, 516, dtype=torch.bfloat16)[..., :512],
         r"compressed_kv stride of dim 1 must be a multiple of 16 bytes .*entry stride is 516 elements"),
        (torch.zeros(1, 30, 1, 1024, dtype=torch.bfloat16)[..., ::2], r"compressed_kv must have head_dim contiguous"),
        (offset_by_one(torch.zeros(1, 30, 1, 512, dtype=torch.bfloat16)), r"compressed_kv data pointer"),
    ]
    for ckv, match in compressed_cases:
        for topk in (idx4, None):
            with pytest.raises(ValueError, match=match):
                launch(arch, stage.forward, qf, kvf, compressed_kv=ckv, compress_ratio=4, topk_indices=topk)


@pytest.mark.proof
@pytest.mark.arch("sm100")
def test_sm100_gather_view_reads_exactly_the_layouts_the_check_accepts():
    """Proof (host, the kernel's own builder): ``common.sm100_kv.gather_view`` traced on the
    compressed entries' real layouts ([batch, entries, kv_heads, head_dim] torch strides, seq_major
    as the kernel takes them); the 2D row and column it gives entry j of batch b, kv head hk, column
    x (row b * entries + j, column hk * head_dim + x) must address the tensor's element (b, j, hk, x),
    for every coordinate, exactly where ``validation.check_gather_layout(.., 'sm100')`` accepts the
    layout. The refused layouts are the negative control: the same checker finds them misread."""
    import cutlass
    import cutlass.cute as cute

    from dsv4_attention.common.layout_proof import trace
    from dsv4_attention.common.layouts import seq_major
    from dsv4_attention.common.sm100_kv import gather_view
    from dsv4_attention.common.validation import check_gather_layout

    d = 64
    layouts = [(layout, b, hk) for layout in ("dense", "flashmla", "rows", "heads") for b in (1, 2) for hk in (1, 2)]
    tensors = [compressed_layout(layout, b, 3, hk, d) for layout, b, hk in layouts]

    def coords(shape):
        b, n, hk, d = shape
        return list(itertools.product(range(b), range(n), range(hk), (0, 1, d - 1)))

    def body(cases):
        out = []
        for shape, stride in cases:
            ptr = cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.gmem, assumed_align=16)
            rows_2d, _ = gather_view(seq_major(cute.make_tensor(ptr, cute.make_layout(shape, stride=stride))), 128)
            n, d = shape[1], shape[3]
            extent = [int(e) for e in rows_2d.shape]
            out.append({c: (int(cute.crd2idx((c[0] * n + c[1], c[2] * d + c[3]), rows_2d.layout)),
                            c[0] * n + c[1] < extent[0] and c[2] * d + c[3] < extent[1]) for c in coords(shape)})
        return out

    got = trace(body, [(tuple(t.shape), tuple(t.stride())) for t in tensors])
    verdicts = {}
    for (layout, b, hk), t, offsets in zip(layouts, tensors, got, strict=True):
        want = {c: (sum(i * s for i, s in zip(c, t.stride(), strict=True)), True) for c in coords(t.shape)}
        try:
            check_gather_layout(t, "sm100")
            accepted = True
        except ValueError:
            accepted = False
        verdicts[(layout, b, hk)] = (accepted, offsets == want)
    assert all(accepted == exact for accepted, exact in verdicts.values()), verdicts
    assert sum(not a for a, _ in verdicts.values()) >= 3, "negative control: some layouts must be misread"
    assert all(a for (layout, b, hk), (a, _) in verdicts.items() if b == 1 and hk == 1), "one batch, one head: any"


def fp8_pages(nb=3, b=64, seed=5):
    from dsv4_attention.common import kv_cache as kc

    g = torch.Generator().manual_seed(seed)
    return kc.quantize_kv_cache((torch.randn(nb, b, 1, 512, generator=g) / 4).bfloat16())


@pytest.mark.parametrize("page", [64, 2])
def test_index_mode_reads_fp8_pages_in_place(launch, page):
    """A MODEL1 FP8 cache goes to the kernel as its own bytes ([1, pages, 1, used bytes] uint8 over
    the cache's memory, the page stride kept), with ``kv_pages`` = its page size; K and V are a
    one-row stand-in (index mode loads no window tile) and an index may name any slot."""
    cache = fp8_pages(b=page)
    slots = cache.shape[0] * page
    q = torch.randn(4, 64, 512).bfloat16()
    idx = torch.randint(-1, slots, (4, 1, 64), dtype=torch.int32)
    args, options = launch("sm90", stage.index_attention, q, cache, idx)
    raw = args["entries"].compressed
    assert raw.dtype == torch.uint8 and raw.data_ptr() == cache.data_ptr()
    assert raw.shape == (1, cache.shape[0], 1, 584 * page) and raw.stride()[1] == cache.stride(0)
    assert args["k"].shape == (1, 1, 1, 512) and args["v"] is args["k"]
    assert options["kv_pages"] == page and options["index_mode"] and options["has_topk"]
    with pytest.raises(ValueError, match="values"):
        launch("sm90", stage.index_attention, q, cache, idx.clamp(min=slots))


def test_sm100_reads_fp8_pages_and_decodes_in_one_launch(launch):
    """sm100's index mode takes the pages as sm90's does (its own gather, sm100_pages.py). decode's
    two launches merge through split-KV's partial buffers, which only sm90 writes: on sm100 they
    are refused before launch, naming the way around; one launch (the default with two FP8
    caches) runs there, one unsplit kernel over both caches (the sink in the kernel, both pages and
    lists on the entries seam)."""
    q = torch.randn(4, 128, 512).bfloat16()
    args, options = launch("sm100", stage.index_attention, q, fp8_pages(), torch.zeros(4, 1, 8, dtype=torch.int32))
    assert options["kv_pages"] == 64 and args["entries"].compressed.dtype == torch.uint8
    with pytest.raises(ValueError, match="one_launch=True"):  # the launch fixture's device: sm100 still
        stage.decode(q.view(2, 2, 128, 512), fp8_pages(), torch.zeros(2, 2, 8, dtype=torch.int32))
    win, ext = fp8_pages(b=64), fp8_pages(nb=40, b=2, seed=6)
    idx, ext_idx = torch.randint(-1, 192, (2, 2, 64), dtype=torch.int32), torch.randint(-1, 80, (2, 2, 128),
                                                                                      dtype=torch.int32)
    sink = torch.zeros(128)
    with pytest.raises(ValueError, match="one_launch=True"):
        stage.decode(q.view(2, 2, 128, 512), win, idx, extra_k_cache=ext, extra_indices=ext_idx, one_launch=False)
    args, options = launch("sm100", stage.decode, q.view(2, 2, 128, 512), win, idx, extra_k_cache=ext,
                           extra_indices=ext_idx, attn_sink=sink)
    assert options["kv_pages"] == 64 and options["kv_pages_extra"] == 2 and options["has_sink"]
    assert "split_kv" not in options and args["sink"] is sink
    assert args["entries"].extra.data_ptr() == ext.data_ptr()
    assert torch.equal(args["entries"].extra_topk[0], ext_idx.reshape(4, 128))
    with pytest.raises(ValueError, match="sm90 only"):  # split-KV is sm90's
        stage.decode(q.view(2, 2, 128, 512), win, idx, extra_k_cache=ext, extra_indices=ext_idx, one_launch=True,
                     num_splits=2)


@pytest.mark.parametrize("args,match", [
    (lambda c, q: (q.half(), c), "bf16"),
    (lambda c, q: (q[..., :256], c), "512"),
    (lambda c, q: (q, c.view(torch.uint8)[..., :576]), "584"),
    (lambda c, q: (q, torch.as_strided(c, (2,) + tuple(c.shape[1:]), (c.stride(0) - 576,) + tuple(c.stride()[1:]))),
     "apart"),
    (lambda c, q: (q, c.float()[..., :512].bfloat16()), "rank-3"),
])
def test_fp8_pages_checks(args, match):
    cache = fp8_pages()
    q = torch.randn(4, 64, 512).bfloat16()
    with pytest.raises(ValueError, match=match):
        stage.index_attention(*args(cache, q), torch.zeros(4, 1, 8, dtype=torch.int32))


def test_decode_writes_both_lists_into_one_merge(launch):
    """decode in two launches (one_launch=False), its first: the window list of FP8 pages into
    the first splits of one fp32 partial buffer the extra list shares (an exact merge of both, the
    sink in the merge only)."""
    win, ext = fp8_pages(b=64), fp8_pages(nb=40, b=2, seed=6)
    q = torch.randn(2, 2, 64, 512).bfloat16()
    idx = torch.randint(-1, 192, (2, 2, 64), dtype=torch.int32)
    ext_idx = torch.randint(-1, 80, (2, 2, 128), dtype=torch.int32)
    args, options = launch("sm90", stage.decode, q, win, idx, extra_k_cache=ext, extra_indices=ext_idx,
                           attn_sink=torch.zeros(64), num_splits=3, one_launch=False)
    parts = args["partials"]
    assert parts.num_splits == 3 and parts.o.shape == (3, 4, 64, 512) and parts.lse.shape == (3, 64, 4)
    whole = parts.o.untyped_storage().nbytes() // 4
    assert whole == 6 * 4 * 64 * 512, "one buffer for both lists' splits"
    assert options["split_kv"] and options["kv_pages"] == 64 and "has_sink" not in options
    assert args["sink"] is None
    assert torch.equal(args["entries"].topk[0], idx.reshape(4, 64))
