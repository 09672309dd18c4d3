"""Stage D2 on the host: the packed-row map, proven with the kernels' own views.

For each architecture the kernel class's ``row_views`` (the fold of common/pack_heads.py) is
applied to a contiguous [batch, seqlen, heads, head_dim] Q / O and [batch, heads, seqlen] LSE, as
the kernel's ``__call__`` does; then every packed row r of every KV head and batch, and every
row of every Q tile the kernel cuts (``local_tile`` with the kernel's tile_m), must address
token r // g, head hk * g + r % g: Q/O element (token, head, column) and LSE (head, token).
Negative controls: a head-major fold (token fastest) and a fold that forgets to scale the
KV-head stride by g must both be rejected by the same checker.
"""

import pytest

from dsv4_attention.common.layout_proof import first_mismatches, trace
from dsv4_attention.common.pack_heads import pack_group, packable, packed_row

pytestmark = [pytest.mark.stage_d2, pytest.mark.proof]

B, S, HK = 2, 5, 2  # batch, tokens, KV heads (heads = HK * g)
COLS = (0, 17)

CASES = [  # (arch, head_dim, group): every tile shape the two kernels cut, groups below and above it
    ("sm90", 512, 128), ("sm90", 512, 8), ("sm90", 128, 8), ("sm90", 128, 128), ("sm90", 64, 4),
    ("sm100", 512, 128), ("sm100", 128, 8), ("sm100", 256, 2),
]


def kernel_for(arch, head_dim, group):
    import cutlass

    if arch == "sm90":
        from dsv4_attention.stages.d2_pack_heads.sm90 import FlashAttentionD2Sm90 as K
    else:
        from dsv4_attention.stages.d2_pack_heads.sm100 import FlashAttentionD2Sm100 as K
    return K(cutlass.BFloat16, head_dim, kv_shared=True, pack_group=group)


def folded_offsets(arch, head_dim, group, fold=None):
    """{(b, hk, r, c): (q offset, lse offset)} through the kernel's views, and
    {(b, hk, m, i, c): q offset} through its Q tiles."""
    import cutlass
    import cutlass.cute as cute

    from dsv4_attention.common.layouts import reorder, seq_major

    kernel = kernel_for(arch, head_dim, group)
    tile_m = kernel.tile_m
    h, d = HK * group, head_dim

    def fn():
        ptr = cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.gmem, assumed_align=16)
        q = cute.make_tensor(ptr, cute.make_layout((B, S, h, d), stride=(S * h * d, h * d, d, 1)))
        lse = cute.make_tensor(ptr, cute.make_layout((B, h, S), stride=(h * S, S, 1)))
        lse_k = lse if arch == "sm90" else reorder(lse, (2, 1, 0))  # sm100 tiles LSE as (rows, heads, batch)
        views = kernel.row_views if fold is None else (lambda a, b_, c: fold(a, b_, c, group, arch))
        mq, mo, ml = views(seq_major(q), seq_major(q), lse_k)
        rows = {}
        for b in range(B):
            for hk in range(HK):
                for r in range(group * S):
                    lse_crd = (b, hk, r) if arch == "sm90" else (r, hk, b)
                    for c in COLS:
                        rows[(b, hk, r, c)] = (cute.crd2idx((r, c, hk, b), mq.layout),
                                               cute.crd2idx(lse_crd, ml.layout),
                                               cute.crd2idx((r, c, hk, b), mo.layout))
        tiles = {}
        for b in range(B if fold is None else 0):  # a wrong fold need not even tile; its rows already differ
            for hk in range(HK):
                g_q = cute.local_tile(mq[None, None, hk, b], (tile_m, d), (None, 0))
                base = cute.crd2idx((0, 0, hk, b), mq.layout)
                for m in range(-(-group * S // tile_m)):
                    for i in range(tile_m):
                        if m * tile_m + i < group * S:
                            tiles[(b, hk, m, i, 0)] = base + cute.crd2idx((i, 0, m), g_q.layout)
        return rows, tiles

    return trace(fn, arch=arch), tile_m


def expected(group, tile_m, head_dim):
    h, d = HK * group, head_dim
    rows, tiles = {}, {}
    for b in range(B):
        for hk in range(HK):
            for r in range(group * S):
                t, head = packed_row(r, group, hk)
                for c in COLS:
                    off = b * S * h * d + t * h * d + head * d + c
                    rows[(b, hk, r, c)] = (off, b * h * S + head * S + t, off)
                m, i = divmod(r, tile_m)
                tiles[(b, hk, m, i, 0)] = b * S * h * d + t * h * d + head * d
    return rows, tiles


def mismatches(arch, head_dim, group, fold=None):
    (rows, tiles), tile_m = folded_offsets(arch, head_dim, group, fold)
    want_rows, want_tiles = expected(group, tile_m, head_dim)
    if fold is not None:
        want_tiles = {}
    return first_mismatches(want_rows, rows) + first_mismatches(want_tiles, tiles)


@pytest.mark.slow
@pytest.mark.parametrize("arch,head_dim,group", CASES, ids=[f"{a}-hd{d}-g{g}" for a, d, g in CASES])
def test_packed_rows_address_token_and_head(arch, head_dim, group):
    assert mismatches(arch, head_dim, group) == []


def head_major_fold(q, o, lse, group, arch):
    """Wrong: token fastest within the packed rows (r -> token r % S ...)."""
    import cutlass.cute as cute

    def fold(t, seq_mode, head_mode):
        shape, stride = list(t.layout.shape), list(t.layout.stride)
        shape[seq_mode], stride[seq_mode] = (shape[seq_mode], group), (stride[seq_mode], stride[head_mode])
        shape[head_mode], stride[head_mode] = shape[head_mode] // group, stride[head_mode] * group
        return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))

    lse_modes = (2, 1) if arch == "sm90" else (0, 1)
    return fold(q, 0, 2), fold(o, 0, 2), fold(lse, *lse_modes)


def unscaled_kv_head_fold(q, o, lse, group, arch):
    """Wrong: the KV-head stride left as one query head's stride."""
    import cutlass.cute as cute

    def fold(t, seq_mode, head_mode):
        shape, stride = list(t.layout.shape), list(t.layout.stride)
        shape[seq_mode], stride[seq_mode] = (group, shape[seq_mode]), (stride[head_mode], stride[seq_mode])
        shape[head_mode] = shape[head_mode] // group
        return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))

    lse_modes = (2, 1) if arch == "sm90" else (0, 1)
    return fold(q, 0, 2), fold(o, 0, 2), fold(lse, *lse_modes)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("fold", [head_major_fold, unscaled_kv_head_fold], ids=["head_major", "unscaled_kv_head"])
def test_checker_rejects_wrong_folds(arch, fold):
    assert mismatches(arch, 128, 8, fold) != []


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_unpackable_group_is_refused_by_the_kernel(arch):
    with pytest.raises(ValueError, match="does not pack"):
        kernel_for(arch, 512, 3)


def test_pack_choice():
    assert [pack_group(None, h, 1, 64) for h in (1, 2, 3, 8, 64, 128, 192)] == [1, 2, 1, 8, 64, 128, 192]
    assert pack_group(None, 128, 1, 192) == 1 and pack_group(None, 96, 1, 192) == 96
    assert pack_group(False, 128, 1, 64) == 1 and pack_group(True, 16, 2, 64) == 8
    assert pack_group(True, 4, 4, 64) == 1  # MHA: nothing to pack
    with pytest.raises(ValueError, match="pack_gqa=True"):
        pack_group(True, 3, 1, 64)
    assert packable(2, 128) and packable(256, 128) and not packable(1, 64) and not packable(96, 64)
