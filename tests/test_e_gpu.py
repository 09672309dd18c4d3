"""Stage E on a GPU: the window and the compressed entries in one softmax (DeepSeek-V4's HCA layer)
against the float64 reference (common/reference.fused_attention), and against the spec's own
index-list form (reference.dsv4_index_attention: the window's rows and the visible entries as one
gathered key list). Head dims 128-512, packed groups 8-128, ratios 4 and 128, sequence lengths that
are not tile multiples, seqlen_q below, at and above seqlen_k, more entries than any row sees
(poisoned with huge values: a mask that lets one through fails loudly), requests with no key,
bitwise repeatability, compute-sanitizer. Top-k lists (CSA): random distinct entries with -1 padding
and entries not yet visible, k not a tile multiple; lists that name only invisible entries (valued
100) leak nothing; listing every entry equals the dense mode. Variable-length batches: each request
its own window, entries and lists (packed), positions starting over per request. Bad inputs refused
before launch."""

import itertools

import pytest
import torch

from dsv4_attention.common.persistent import cta_limit
from dsv4_attention.common.reference import dsv4_index_attention
from dsv4_attention.common.testing import (
    LSE_ABS,
    O_REL,
    attention_inputs,
    check_attention,
    check_index_result,
    check_varlen,
    errors,
    fresh_generator,
    gpu_arch_params,
    padded_view,
    random_bshd,
    random_index_lists,
    sanitizer_test,
    sinks_with_infinities,
    varlen_inputs,
)
from dsv4_attention.stages import e_fused as stage

pytestmark = [pytest.mark.stage_e]


def entries(batch, n, head_dim, g, dtype=torch.bfloat16, poison_from=None):
    """[batch, n, 1, head_dim] compressed entries; rows from ``poison_from`` on set to 100 (scores of
    ~100^2 d: any leak into a row's softmax dominates it)."""
    c = random_bshd(batch, n, 1, head_dim, dtype, "cuda", generator=g)
    if poison_from is not None:
        c[:, poison_from:] = 100.0
    return c


def sink(heads, g):
    return (torch.randn(heads, generator=g) * 2).cuda()


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("group", [8, 64, 128])
@pytest.mark.parametrize("ratio", [4, 128])
def test_window_and_entries(arch, head_dim, group, ratio, record_errors):
    sq = 300 if group < 128 else 130
    q, kv, _, g = attention_inputs(2, sq, sq, group, 1, head_dim, torch.bfloat16, kv_shared=True)
    ckv = entries(2, sq // ratio + 3, head_dim, g)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"compressed_kv": ckv, "compress_ratio": ratio, "causal": True, "window_size": (127, 0),
                             "learnable_sink": sink(group, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("seqlens", [(2, 1000), (77, 700), (700, 200)], ids=["decode", "q<k", "q>k"])
@pytest.mark.parametrize("window", [(127, 0), (None, None), (5, 3)], ids=["w127", "dense", "w5_3"])
def test_alignment_and_windows(arch, seqlens, window, record_errors):
    sq, sk = seqlens
    q, kv, _, g = attention_inputs(2, sq, sk, 64, 1, 512, torch.bfloat16, kv_shared=True)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"compressed_kv": entries(2, 300, 512, g), "compress_ratio": 4, "window_size": window})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_invisible_entries_never_leak(arch, record_errors):
    """Entries past every row's count are 100-valued: a mask off by one lets them dominate a row."""
    sq = 333
    q, kv, _, g = attention_inputs(1, sq, sq, 128, 1, 512, torch.bfloat16, kv_shared=True)
    visible_max = sq // 4
    ckv = entries(1, visible_max + 70, 512, g, poison_from=visible_max)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"compressed_kv": ckv, "compress_ratio": 4, "causal": True, "window_size": (127, 0)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_empty_rows_and_lengths(arch, dtype, record_errors):
    """seqused_k 0 (request 0: no key and, its positions negative, no entry: O = 0, LSE = -inf) and
    37 (entries by the shifted positions)."""
    q, kv, _, g = attention_inputs(2, 200, 100, 8, 1, 256, dtype, kv_shared=True)
    n = torch.tensor([0, 37], dtype=torch.int32, device="cuda")
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"compressed_kv": entries(2, 40, 256, g, dtype), "compress_ratio": 4, "seqused_k": n,
                             "causal": True, "window_size": (15, 0), "learnable_sink": sink(8, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("mode", ["hca", "csa"])
def test_infinite_sinks_on_empty_and_full_rows(arch, mode, record_errors):
    """The V4 layer call with FlashMLA's sink draw (a third of the heads -inf, a third +inf): request 0
    has no key and no entry (seqused_k 0), request 1 keys and entries (HCA: all visible, CSA: top-k
    lists with -1 padding). Against the reference; O = 0 on every empty row for any sink and on
    every head whose sink is +inf; LSE bitwise that of the call without a sink."""
    heads = 128
    q, kv, _, g = attention_inputs(2, 130, 300, heads, 1, 512, torch.bfloat16, kv_shared=True)
    ratio = 128 if mode == "hca" else 4
    opts = {"compressed_kv": entries(2, 300 // ratio, 512, g), "compress_ratio": ratio, "causal": True,
            "window_size": (127, 0), "seqused_k": torch.tensor([0, 300], dtype=torch.int32, device="cuda")}
    if mode == "csa":
        opts["topk_indices"] = torch.stack([random_index_lists(130, 40, 75, g, pad=0.2) for _ in range(2)]).cuda()
    s = sinks_with_infinities(heads, g)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch, options={**opts, "learnable_sink": s})
    o, lse = stage.forward(q, kv, learnable_sink=s, **opts)
    _, lse0 = stage.forward(q, kv, **opts)
    assert bool(torch.isfinite(o).all())
    assert bool((o[0] == 0).all()) and bool((o[:, :, torch.isposinf(s)] == 0).all())
    assert torch.equal(lse, lse0)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("heads", [64, 128])
def test_index_mode_infinite_sinks_on_empty_rows(arch, heads, record_errors):
    """Index mode with FlashMLA's sink draw: rows of topk_length 0 and rows whose every index is -1
    or out of range (unchecked) are empty: O = 0, LSE = -inf for sinks of -inf, +inf and finite;
    the rest against the spec's reference; +inf heads O = 0; LSE bitwise that of the call without."""
    T, N, k = 90, 700, 200
    g = fresh_generator()
    q = random_bshd(1, T, heads, 512, torch.bfloat16, "cuda", generator=g)[0]
    kv = random_bshd(1, N, 1, 512, torch.bfloat16, "cuda", generator=g)[0]
    idx = random_index_lists(T, k, N, g, pad=0.1)
    idx[1] = -1
    idx[2] = N + 5  # out of range: read as -1 with check_indices=False
    length = torch.randint(0, k + 1, (T,), generator=g).int()
    length[0], length[1], length[2] = 0, k, k
    s = sinks_with_infinities(heads, g)
    o = torch.full_like(q, float("nan"))
    _, lse = stage.index_attention(q, kv, idx[:, None].cuda(), topk_length=length.cuda(), attn_sink=s, out=o,
                                   check_indices=False)
    _, lse0 = stage.index_attention(q, kv, idx[:, None].cuda(), topk_length=length.cuda(), check_indices=False)
    o_ref, lse_ref = dsv4_index_attention(q, kv[:, 0], torch.where(idx < N, idx, -1).cuda(), length.cuda(), s)
    e = errors(o, o_ref)
    record_errors(e, arch=arch, case="index mode, infinite sinks", heads=heads)
    assert e.within(O_REL[torch.bfloat16], 3 * O_REL[torch.bfloat16]), e
    empty = torch.isneginf(lse_ref)
    assert bool(empty[:3].all()) and bool(torch.isneginf(lse[empty]).all()) and bool((o[empty] == 0).all())
    assert bool((o[:, torch.isposinf(s)] == 0).all())
    assert torch.equal(lse, lse0)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_equals_the_spec_index_form(arch, record_errors):
    """The spec's reference gathers, per token, its window's rows then its visible entries from one
    [N, 512] tensor: the same function, computed another way."""
    T, H, r = 260, 64, 4
    g = fresh_generator()
    q = random_bshd(1, T, H, 512, torch.bfloat16, "cuda", generator=g)
    kv = random_bshd(1, T, 1, 512, torch.bfloat16, "cuda", generator=g)
    ckv = entries(1, T // r, 512, g)
    s = sink(H, g)
    o, lse = stage.forward(q, kv, compressed_kv=ckv, compress_ratio=r, causal=True, window_size=(127, 0),
                           learnable_sink=s)
    rows = torch.cat([kv[0, :, 0], ckv[0, :, 0]])  # [T + T / r, 512]
    t = torch.arange(T, device="cuda")[:, None]
    k = torch.arange(128 + T // r, device="cuda")[None, :]
    win = t - 127 + k  # window rows t - 127 .. t, then entries j < (t + 1) / r
    idx = torch.where(k < 128, torch.where(win >= 0, win, -1),
                      torch.where(k - 128 < (t + 1) // r, T + k - 128, -1)).int()
    o_ref, lse_ref = dsv4_index_attention(q[0], rows, idx, torch.full((T,), idx.shape[1], device="cuda"), s)
    e = errors(o[0], o_ref)
    record_errors(e, arch=arch, case="spec index form")
    assert e.within(O_REL[torch.bfloat16], 3 * O_REL[torch.bfloat16]), e
    assert (lse[0].double().transpose(0, 1) - lse_ref).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("topk", [False, True], ids=["hca", "csa"])
def test_window_cache_with_kv_start(arch, topk, record_errors):
    """DeepSeek-V4 decode on a window cache: the raw keys are the last 200 rows of a 5000-token
    sequence (``kv_start`` = 4800), the compressed entries cover the whole sequence, so a token's
    visible entries follow its absolute position; some entries past every count are 100-valued."""
    sq, sk, start, heads = 2, 200, 4800, 128
    q, kv, _, g = attention_inputs(1, sq, sk, heads, 1, 512, torch.bfloat16, kv_shared=True)
    visible_max = (start + sk) // 4
    ckv = entries(1, visible_max + 40, 512, g, poison_from=visible_max)
    options = {"compressed_kv": ckv, "compress_ratio": 4, "kv_start": start, "causal": True,
               "window_size": (127, 0), "learnable_sink": sink(heads, g)}
    if topk:
        options["topk_indices"] = topk_lists(1, sq, 300, visible_max + 40, g)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch, options=options)


def chunk_positions(batch, seqlen_q, lo, hi, g):
    """[batch, seqlen_q] int32 absolute positions, sorted random draws from [lo, hi): repeats, jumps,
    tokens before the raw keys' first position and past their last."""
    return torch.sort(torch.randint(lo, hi, (batch, seqlen_q), generator=g), dim=1).values.int().cuda()


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("mode", ["hca", "csa", "window"])
@pytest.mark.parametrize("per_request", [False, True], ids=["shared", "per_request"])
def test_positions_place_each_token(arch, mode, per_request, record_errors):
    """A prefill chunk placed by per-token absolute positions (sorted, with repeats and jumps) over
    raw keys that start at absolute position ``kv_start`` = 300: each token's window and entries
    follow its own position; entries past every token's count are 100-valued (a leak fails loudly).
    ``shared``: one [seqlen_q] list for both requests; ``per_request``: [batch, seqlen_q]."""
    b, sq, sk, heads, start, ratio = 2, 150, 900, 128, 300, 4
    q, kv, _, g = attention_inputs(b, sq, sk, heads, 1, 512, torch.bfloat16, kv_shared=True)
    pos = chunk_positions(b if per_request else 1, sq, start - 40, start + sk + 40, g)
    visible_max = (int(pos.max()) + 1) // ratio
    options = {"positions": pos if per_request else pos[0], "kv_start": start, "causal": True,
               "window_size": (127, 0), "learnable_sink": sink(heads, g)}
    if mode != "window":
        options["compressed_kv"] = entries(b, visible_max + 40, 512, g, poison_from=visible_max)
        options["compress_ratio"] = ratio
    if mode == "csa":
        options["topk_indices"] = topk_lists(b, sq, 200, visible_max + 40, g)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch, options=options)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_positions_of_bottom_right_alignment_change_nothing(arch):
    """Positions equal to the default alignment (kv_start + i + seqlen_k - seqlen_q) give the same
    bits as no positions, window and entries alike."""
    sq, sk, start = 77, 700, 1000
    q, kv, _, g = attention_inputs(2, sq, sk, 64, 1, 512, torch.bfloat16, kv_shared=True)
    kw = {"compressed_kv": entries(2, 600, 512, g), "compress_ratio": 4, "kv_start": start, "causal": True,
          "window_size": (127, 0)}
    pos = torch.arange(sq, dtype=torch.int32, device="cuda") + start + sk - sq
    o1, l1 = stage.forward(q, kv, **kw)
    o2, l2 = stage.forward(q, kv, positions=pos, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bad_positions_are_refused_before_launch(arch):
    q, kv, _, _ = attention_inputs(2, 10, 50, 64, 1, 512, torch.bfloat16, kv_shared=True)
    pos = torch.arange(10, dtype=torch.int32, device="cuda")
    for bad, match in [(pos.long(), "int32"), (pos[:9], "seqlen_q"), (pos.flip(0), "non-decreasing"),
                       (pos - 5, r"\[0, 2\^30\)"), (pos.cpu(), "like q"), (torch.stack([pos, pos], 1).T, "contiguous")]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, kv, positions=bad, causal=True)


def topk_lists(batch, seqlen_q, k, n_c, g, pad=0.2):
    """[batch, seqlen_q, k] int32 distinct entries per token (a random permutation's head, so no
    duplicates), some not yet visible, a share -1."""
    return torch.stack([random_index_lists(seqlen_q, k, n_c, g, pad=pad) for _ in range(batch)]).cuda()


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("k", [64, 200, 512])
@pytest.mark.parametrize("heads", [64, 128])
def test_topk_entries(arch, head_dim, k, heads, record_errors):
    """DeepSeek-V4's CSA layer: the window and each token's listed entries (ratio 4), some listed
    entries not yet visible (the kernel must hide them), -1 padding, k not a tile multiple."""
    sq = 133
    q, kv, _, g = attention_inputs(2, sq, sq, heads, 1, head_dim, torch.bfloat16, kv_shared=True)
    n_c = max(k, sq // 4 + 20)
    ckv = entries(2, n_c, head_dim, g)
    if heads == 64 and arch == "sm90" and head_dim != 512:
        # sm90's 128-row tiles below head dim 512 do not pad: one token's 64 heads do not fill one, and
        # the kernel gathers one token's list per tile: refused before launch (sm100 pads its 128-row
        # tile: rows 64 .. 127 computed, never stored; sm90's head-dim-512 tiles hold 64 rows)
        with pytest.raises(ValueError, match="multiple"):
            stage.forward(q, kv, compressed_kv=ckv, compress_ratio=4, topk_indices=topk_lists(2, sq, k, n_c, g))
        return
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"compressed_kv": ckv, "compress_ratio": 4, "topk_indices": topk_lists(2, sq, k, n_c, g),
                             "causal": True, "window_size": (127, 0), "learnable_sink": sink(heads, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("branch", ["hca", "csa", "index"])
@pytest.mark.parametrize("sq", [130, 77])
def test_persistent_ctas_run_many_tiles(arch, branch, sq, record_errors):
    """The persistent grid held to 5 CTAs (about 30-100 Q tiles each, common/persistent.py): the
    HCA layer, whose tiles' KV counts differ along the sequence (the window's first tokens see
    fewer keys, the visible entries grow with the position), so a CTA's ring uses and handoff
    rounds start at either parity; the CSA layer, whose window tiles (warp 0's TMA) and gathered
    tiles (every producer warp) alternate from Q tile to Q tile; index mode, every tile gathered,
    lists of 70 positions (two tiles, the second partly past the list)."""
    q, kv, _, g = attention_inputs(2, sq, sq, 128, 1, 512, torch.bfloat16, kv_shared=True)
    s = sink(128, g)
    with cta_limit(5):
        if branch == "index":
            n = 300
            rows = random_bshd(1, n, 1, 512, torch.bfloat16, "cuda", generator=g)[0]
            idx = topk_lists(1, sq, 70, n, g)[0]
            o = torch.full_like(q[0], float("nan"))
            _, lse = stage.index_attention(q[0], rows, idx[:, None], attn_sink=s, out=o)
            o_ref, lse_ref = dsv4_index_attention(q[0], rows[:, 0], idx, torch.full((sq,), 70).int().cuda(), s)
            e = errors(o, o_ref)
            record_errors(e, arch=arch, case="index mode, persistent", heads=128, k=70)
            assert e.within(O_REL[torch.bfloat16], 3 * O_REL[torch.bfloat16]), e
            assert (lse.double() - lse_ref).abs().max().item() <= LSE_ABS
            return
        n_c = sq // 4 + 3
        options = {"causal": True, "window_size": (127, 0), "learnable_sink": s,
                   "compressed_kv": entries(2, n_c, 512, g), "compress_ratio": 4}
        if branch == "csa":
            options["topk_indices"] = topk_lists(2, sq, 24, n_c, g)
        check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch, options=options)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("mode", ["index", "csa"])
def test_unchecked_lists_sync_nothing_and_hide_what_lies_outside(arch, mode, monkeypatch):
    """``check_indices=False`` (an engine's own lists): values outside [-1, entries) (past the
    entries, below -1) give bitwise the output of the same lists with -1 there (the kernel's own
    bound check); the call synchronises nothing (torch's sync debug mode, which refuses the checked
    call: the control); a repeated signature replays its plan (the list check is not reached)."""
    from dsv4_attention.common import validation

    sq, heads = 90, 128
    q, kv, _, g = attention_inputs(1, sq, sq, heads, 1, 512, torch.bfloat16, kv_shared=True)
    s = sink(heads, g)
    if mode == "index":
        n = 300
        rows = random_bshd(1, n, 1, 512, torch.bfloat16, "cuda", generator=g)[0]
        idx = topk_lists(1, sq, 70, n, g)[0]

        def call(lists, check, o):
            return stage.index_attention(q[0], rows, lists[:, None], attn_sink=s, out=o[0], check_indices=check)
    else:
        n = sq // 4 + 3
        ckv = entries(1, n, 512, g)
        idx = topk_lists(1, sq, 24, n, g)

        def call(lists, check, o):
            return stage.forward(q, kv, compressed_kv=ckv, compress_ratio=4, topk_indices=lists, causal=True,
                                 window_size=(127, 0), learnable_sink=s, out=o, check_indices=check)
    bad = idx.clone()
    where = (torch.rand(idx.shape, generator=g) < 0.25).cuda()
    far = torch.randint(n, 2**31 - 1, idx.shape, generator=g, dtype=torch.int64).int().cuda()
    bad[where] = torch.where(far[where] % 3 == 0, -5 - far[where] % 1000, far[where])
    clean = torch.where((bad >= 0) & (bad < n), bad, -1)
    assert bool((bad != clean).any())
    o_ref = torch.full_like(q, float("nan"))
    lse_ref = call(clean, True, o_ref)[1].clone()
    with pytest.raises(ValueError, match="values"):
        call(bad, True, torch.empty_like(q))
    o = torch.full_like(q, float("nan"))
    lse = call(bad, False, o)[1]  # the full path: records the call's plan
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    o2 = torch.full_like(q, float("nan"))
    bad2 = bad.clone()  # another tensor of the same signature
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):  # the control: a checked call reads the lists
            call(clean, True, torch.empty_like(q))
        monkeypatch.setattr(validation, "check_topk", lambda *a, **kw: pytest.fail("the plan re-checked the lists"))
        lse2 = call(bad2, False, o2)[1]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(o2, o_ref) and torch.equal(lse2, lse_ref)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim,heads", [(512, 128), (128, 256)])
def test_topk_entries_of_two_kv_heads(arch, head_dim, heads, record_errors):
    """Two kv heads: one list a token, each packed group reading its own kv head's entries (the
    reference gathers per kv head; kv head 0's entries for every head would be wrong by O(1))."""
    sq, k, hk = 97, 96, 2
    q, kv, _, g = attention_inputs(2, sq, sq, heads, hk, head_dim, torch.bfloat16, kv_shared=True)
    n_c = sq // 4 + 20
    ckv = random_bshd(2, n_c, hk, head_dim, torch.bfloat16, "cuda", generator=g)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"compressed_kv": ckv, "compress_ratio": 4, "topk_indices": topk_lists(2, sq, k, n_c, g),
                             "causal": True, "window_size": (127, 0), "learnable_sink": sink(heads, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_topk_hides_listed_entries_not_yet_visible(arch, record_errors):
    """Every list names only entries past the token's count, valued 100: nothing of them may leak."""
    sq, n_c = 100, 64
    q, kv, _, g = attention_inputs(1, sq, sq, 64, 1, 512, torch.bfloat16, kv_shared=True)
    ckv = entries(1, n_c, 512, g, poison_from=0)
    t = torch.arange(sq)[:, None]
    idx = (torch.clamp((t + 1) // 4, max=n_c - 1) + torch.arange(16)[None] % 8).clamp(max=n_c - 1)
    idx = torch.where(idx >= (t + 1) // 4, idx, -1).int()[None].cuda()
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"compressed_kv": ckv, "compress_ratio": 4, "topk_indices": idx, "causal": True,
                             "window_size": (127, 0)})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_topk_equals_dense_when_every_visible_entry_is_listed(arch):
    """Listing every entry 0 .. n_c - 1 (the kernel hides the ones not yet visible) is the HCA
    layer's function: the two modes agree to rounding (different tile orders of the same keys)."""
    sq, n_c = 200, 50
    q, kv, _, g = attention_inputs(1, sq, sq, 128, 1, 512, torch.bfloat16, kv_shared=True)
    ckv = entries(1, n_c, 512, g)
    idx = torch.arange(n_c, dtype=torch.int32).expand(1, sq, n_c).contiguous().cuda()
    kw = {"compressed_kv": ckv, "compress_ratio": 4, "causal": True, "window_size": (127, 0)}
    o1, l1 = stage.forward(q, kv, topk_indices=idx, **kw)
    o2, l2 = stage.forward(q, kv, **kw)
    assert (o1.float() - o2.float()).abs().max().item() < 2e-2 and (l1 - l2).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bad_topk_is_refused_before_launch(arch):
    q, kv, _, _ = attention_inputs(2, 10, 50, 128, 1, 512, torch.bfloat16, kv_shared=True)
    c = torch.zeros(2, 8, 1, 512, device="cuda", dtype=torch.bfloat16)
    good = torch.zeros(2, 10, 4, dtype=torch.int32, device="cuda")
    for idx, match in [(good.long(), "int32"), (good[:, :5], "seqlen_q"), (good + 8, "values"),
                       (good.cpu(), "must be on")]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, kv, compressed_kv=c, compress_ratio=4, topk_indices=idx)
    with pytest.raises(ValueError, match="pass compressed_kv"):
        stage.forward(q, kv, topk_indices=good)
    q32, _, _, _ = attention_inputs(2, 10, 50, 32, 1, 512, torch.bfloat16, kv_shared=True)
    with pytest.raises(ValueError, match="multiple"):
        stage.forward(q32, kv, compressed_kv=c, compress_ratio=4, topk_indices=good)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("k", [128, 640, 70])
def test_index_mode_is_the_spec_function(arch, heads, k, record_errors):
    """FlashMLA's sparse attention semantics (``index_attention``) against the spec's reference on
    the same lists: random rows with -1 padding, per-token topk_length (0 included: O = 0,
    LSE = -inf), sink."""
    T, N = 150, 900
    g = fresh_generator()
    q = random_bshd(1, T, heads, 512, torch.bfloat16, "cuda", generator=g)[0]
    kv = random_bshd(1, N, 1, 512, torch.bfloat16, "cuda", generator=g)[0]
    idx = random_index_lists(T, k, N, g, pad=0.1)
    length = torch.randint(0, k + 1, (T,), generator=g).int()
    length[:3] = torch.tensor([0, k, 1])
    s = sink(heads, g)
    # 64 heads: sm90's head-dim-512 tiles hold 64 rows; sm100 serves them in a padded 128-row tile
    o = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    _, lse = stage.index_attention(q, kv, idx[:, None].cuda(), topk_length=length.cuda(), attn_sink=s, out=o)
    o_ref, lse_ref = dsv4_index_attention(q, kv[:, 0], idx.cuda(), length.cuda(), s)
    check_index_result(o, lse, o_ref, lse_ref, record_errors, arch=arch, case="index mode", heads=heads, k=k)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_index_mode_refuses_bad_input(arch):
    q = torch.zeros(10, 64, 512, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(20, 1, 512, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(10, 1, 8, device="cuda", dtype=torch.int32)
    for args, kw, match in [((q, kv, idx + 20), {}, "values"), ((q, kv, idx[:5]), {}, "tokens"),
                            ((q, kv[:, :, :256], idx), {}, "head_dim"), ((q, kv, idx.long()), {}, "int32"),
                            ((q, kv, idx), {"topk_length": torch.full((10,), 9, dtype=torch.int32, device="cuda")},
                             "topk_length"),
                            ((q[:, :32], kv, idx), {}, "multiple"), ((q, kv[:, 0], idx), {}, "rank-3")]:
        with pytest.raises(ValueError, match=match):
            stage.index_attention(*args, **kw)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_index_mode_reads_flashmla_strided_inputs(arch, record_errors):
    """FlashMLA's layouts (its test's kernelkit.non_contiguousify): q, kv and indices views into
    buffers padded in every dim (each + 1, the last + 128; kv's strides (1280, 640, 1)), the padding
    NaN (and 2^30 in the lists): read in place, against the spec's reference, and bitwise the
    result of the same values passed contiguous, lists checked or not."""
    T, N, k, heads = 150, 900, 200, 128
    g = fresh_generator()
    q = random_bshd(1, T, heads, 512, torch.bfloat16, "cuda", generator=g)[0]
    kv = random_bshd(1, N, 1, 512, torch.bfloat16, "cuda", generator=g)[0]
    idx = random_index_lists(T, k, N, g, pad=0.1)[:, None].cuda()
    length = torch.randint(0, k + 1, (T,), generator=g).int().cuda()
    s = sink(heads, g)
    qs, kvs, idxs = padded_view(q), padded_view(kv), padded_view(idx)
    assert kvs.stride() == (1280, 640, 1) and not qs.is_contiguous() and not idxs.is_contiguous()
    o = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    _, lse = stage.index_attention(qs, kvs, idxs, topk_length=length, attn_sink=s, out=o)
    o_ref, lse_ref = dsv4_index_attention(q, kv[:, 0], idx[:, 0], length, s)
    check_index_result(o, lse, o_ref, lse_ref, record_errors, arch=arch, case="index mode, FlashMLA's strided inputs",
                       heads=heads, k=k)
    o_dense, lse_dense = stage.index_attention(q, kv, idx, topk_length=length, attn_sink=s)
    assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)
    o_unchecked, lse_unchecked = stage.index_attention(qs, kvs, idxs, topk_length=length, attn_sink=s,
                                                       check_indices=False)
    assert torch.equal(o_unchecked, o_dense) and torch.equal(lse_unchecked, lse_dense)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("layout", ["flashmla-b1", "rows-b2", "flashmla-b2"])
def test_topk_reads_strided_compressed_kv(arch, layout, record_errors):
    """DeepSeek-V4's CSA layer on strided tensors: ``flashmla``: q, kv, compressed_kv and the lists
    padded in every dim as FlashMLA's test pads them (the padding NaN / 2^30); ``rows``: only the
    compressed rows padded (+ 128 columns: the batch stride stays entries x the entry stride). Read
    in place: against the float64 reference and bitwise the call on the same values contiguous.
    sm100's gather reads one 2D view of the entries, which a padded batch does not fit: refused
    before launch there (common/validation.check_gather_layout)."""
    batch = int(layout[-1])
    sq, heads, n_c, k = 133, 128, 60, 64
    q, kv, _, g = attention_inputs(batch, sq, sq, heads, 1, 512, torch.bfloat16, kv_shared=True)
    ckv = entries(batch, n_c, 512, g)
    idx = topk_lists(batch, sq, k, n_c, g)
    kw = {"compress_ratio": 4, "causal": True, "window_size": (127, 0), "learnable_sink": sink(heads, g)}
    if layout.startswith("flashmla"):
        qs, kvs, ckvs, idxs = (padded_view(t) for t in (q, kv, ckv, idx))
    else:
        qs, kvs, idxs = q, kv, idx
        ckvs = torch.full((batch, n_c, 640), float("nan"), dtype=ckv.dtype, device="cuda")[..., :512]
        ckvs = ckvs.view(batch, n_c, 1, 512).copy_(ckv)
    strided = {"compressed_kv": ckvs, "topk_indices": idxs, **kw}
    if arch == "sm100" and layout == "flashmla-b2":
        with pytest.raises(ValueError, match="compressed_kv's batch stride"):
            stage.forward(qs, kvs, **strided)
        return
    check_attention(stage.forward, qs, kvs, kvs, record_errors, g, arch=arch, layout=layout, options=strided)
    o, lse = stage.forward(qs, kvs, **strided)
    o_dense, lse_dense = stage.forward(q, kv, compressed_kv=ckv, topk_indices=idx, **kw)
    assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_without_entries_equals_stage_d5(arch):
    from dsv4_attention.stages import d5_sink_merge

    q, kv, _, g = attention_inputs(2, 100, 333, 64, 1, 512, torch.bfloat16, kv_shared=True)
    kw = {"causal": True, "window_size": (127, 0), "learnable_sink": sink(64, g)}
    o1, l1 = stage.forward(q, kv, **kw)
    o2, l2 = d5_sink_merge.forward(q, kv, kv, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    o3, l3 = stage.forward(q, kv, compressed_kv=kv[:, :0], compress_ratio=4, **kw)  # 0 entries
    assert torch.equal(o1, o3) and torch.equal(l1, l3)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bad_compressed_input_is_refused_before_launch(arch):
    q, kv, _, _ = attention_inputs(2, 10, 50, 64, 1, 512, torch.bfloat16, kv_shared=True)
    c = torch.zeros(2, 8, 1, 512, device="cuda", dtype=torch.bfloat16)
    for kw, match in [({"compressed_kv": c}, "go together"), ({"compress_ratio": 4}, "go together"),
                      ({"compressed_kv": c, "compress_ratio": 0}, "positive int"),
                      ({"compressed_kv": c, "compress_ratio": True}, "positive int"),
                      ({"compressed_kv": c.half(), "compress_ratio": 4}, "dtype"),
                      ({"compressed_kv": c[:1], "compress_ratio": 4}, "batch"),
                      ({"compressed_kv": c.cpu(), "compress_ratio": 4}, "device"),
                      ({"compressed_kv": c[..., :256], "compress_ratio": 4}, "head_dim")]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, kv, **kw)
    with pytest.raises(ValueError, match="K = V"):
        stage.forward(q, kv, kv.clone(), compressed_kv=c, compress_ratio=4)


def request_lists(q_lens, counts, k, g, pad=0.2):
    """[total_q, k] int32 top-k lists of a variable-length batch, indices local to each token's
    request (distinct, some -1, some not yet visible): request r's tokens list entries of its own
    ``counts[r]``."""
    lists = []
    for n, c in zip(q_lens, counts, strict=True):
        idx = random_index_lists(n, k, max(c, k), g, pad=pad)
        idx[idx >= c] = -1
        lists.append(idx)
    return torch.cat(lists).cuda()


def packed_entries(counts, visible, head_dim, g, pad=0):
    """[sum(counts) + pad, 1, head_dim] compressed entries of a variable-length batch, request r's
    the rows from sum(counts[:r]); rows past a request's ``visible[r]`` (entries no token of it can
    see yet) and the ``pad`` rows past the last request are 100-valued: a leak fails loudly."""
    parts = []
    for c, v in zip(counts, visible, strict=True):
        part = random_bshd(1, c, 1, head_dim, torch.bfloat16, "cuda", generator=g)[0]
        part[v:] = 100.0
        parts.append(part)
    parts.append(torch.full((pad, 1, head_dim), 100.0, dtype=torch.bfloat16, device="cuda"))
    return torch.cat(parts)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("mode", ["hca", "csa"])
@pytest.mark.parametrize("layout", ["derived", "given"])
@pytest.mark.parametrize("heads", [128, 64])
def test_varlen_requests(arch, mode, layout, heads, record_errors):
    """DeepSeek-V4 requests of different lengths in one variable-length batch (prefill longer and
    shorter than its keys, decode, a request with no query, one with no entry): each request sees
    its own window and its own compressed entries, packed like its tokens. ``derived``: floor(keys
    / ratio) entries a request (no cu_seqlens_compressed); ``given``: cu_seqlens_compressed with
    entries past what any token of the request sees (100-valued). Each request against its own
    float64 reference; rows past the batch never written. 64 heads (DeepSeek-V4-Flash): csa on
    sm100 runs a padded tile a token, whose padding rows (the next request's first token) are never
    stored."""
    q_lens, k_lens = [130, 2, 0, 257, 64, 3], [1100, 700, 50, 257, 3, 900]
    q, kv, _, cu_q, cu_k, g = varlen_inputs(q_lens, k_lens, heads, 1, 512, torch.bfloat16, kv_shared=True, pad=5)
    ratio = 4 if mode == "csa" else 128
    visible = [n // ratio for n in k_lens]
    counts = visible if layout == "derived" else [v + 9 for v in visible]
    options = {"compressed_kv": packed_entries(counts, visible, 512, g, pad=7), "compress_ratio": ratio,
               "causal": True, "window_size": (127, 0), "learnable_sink": sink(heads, g)}
    if layout == "given":
        options["cu_seqlens_compressed"] = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32,
                                                        device="cuda")
    if mode == "csa":
        options["topk_indices"] = request_lists(q_lens, counts, 200, g)
        options["topk_indices"] = torch.cat([options["topk_indices"],
                                             torch.full((5, 200), -1, dtype=torch.int32, device="cuda")])
    check_varlen(stage.forward, q, kv, kv, cu_q, cu_k, record_errors, g, arch=arch, options=options)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("mode", ["hca", "csa"])
def test_varlen_positions(arch, mode, record_errors):
    """A variable-length batch of prefill chunks placed by absolute positions ([total_q], sorted
    within each request, starting over at each request): each token's window and entries follow
    its own position and its own request's keys and entries."""
    q_lens, k_lens, heads, ratio = [90, 40, 1], [600, 900, 300], 128, 4
    q, kv, _, cu_q, cu_k, g = varlen_inputs(q_lens, k_lens, heads, 1, 512, torch.bfloat16, kv_shared=True)
    pos = torch.cat([torch.sort(torch.randint(0, n + 40, (t,), generator=g)).values
                     for t, n in zip(q_lens, k_lens, strict=True)]).int().cuda()
    counts = [(n + 41) // ratio for n in k_lens]  # enough for every position
    options = {"compressed_kv": packed_entries(counts, counts, 512, g), "compress_ratio": ratio, "positions": pos,
               "cu_seqlens_compressed": torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32,
                                                     device="cuda"),
               "causal": True, "window_size": (127, 0), "learnable_sink": sink(heads, g)}
    if mode == "csa":
        options["topk_indices"] = request_lists(q_lens, counts, 150, g)
    check_varlen(stage.forward, q, kv, kv, cu_q, cu_k, record_errors, g, arch=arch, options=options)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_varlen_bad_entries_are_refused_before_launch(arch):
    q_lens, k_lens = [3, 2], [400, 80]
    q, kv, _, cu_q, cu_k, g = varlen_inputs(q_lens, k_lens, 128, 1, 512, torch.bfloat16, kv_shared=True)
    c = torch.zeros(120, 1, 512, device="cuda", dtype=torch.bfloat16)
    kw = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "compress_ratio": 4}
    lists = torch.full((5, 8), -1, dtype=torch.int32, device="cuda")
    bad_lists = lists.clone()
    bad_lists[3, 2] = 20  # request 1 has 80 // 4 = 20 entries: 20 is past them
    cu = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    for extra, match in [({"compressed_kv": c[None]}, "total_entries"),
                         ({"compressed_kv": c[:110]}, "past compressed_kv"),
                         ({"compressed_kv": c, "topk_indices": lists[None]}, r"\[total_q, k\]"),
                         ({"compressed_kv": c, "topk_indices": bad_lists}, "token 3 lists 20"),
                         ({"compressed_kv": c, "cu_seqlens_compressed": cu(0, 100, 90)}, "non-decreasing"),
                         ({"compressed_kv": c, "cu_seqlens_compressed": cu(0, 100, 130)}, "past compressed_kv"),
                         ({"compressed_kv": c, "cu_seqlens_compressed": cu(0, 100)}, "shape"),
                         ({"compressed_kv": c, "positions": cu(5, 4, 0, 1, 2)}, "non-decreasing")]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, kv, **kw, **extra)
    with pytest.raises(ValueError, match="cu_seqlens_compressed places"):
        stage.forward(q[None], kv[None], compressed_kv=c[None], compress_ratio=4, cu_seqlens_compressed=cu(0, 100))


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("topk", [False, True], ids=["hca", "topk"])
def test_bitwise_repeatable(arch, topk):
    q, kv, _, g = attention_inputs(2, 300, 700, 128, 1, 512, torch.bfloat16, kv_shared=True)
    kw = {"compressed_kv": entries(2, 175, 512, g), "compress_ratio": 4, "causal": True, "window_size": (127, 0),
          "learnable_sink": sink(128, g)}
    if topk:
        kw["topk_indices"] = topk_lists(2, 300, 128, 175, g)
    o1, l1 = stage.forward(q, kv, **kw)
    o2, l2 = stage.forward(q, kv, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import e_fused as stage
q = torch.randn(2, 130, 128, 512, device="cuda").bfloat16()
kv = torch.randn(2, 300, 1, 512, device="cuda").bfloat16()
c = torch.randn(2, 80, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, compressed_kv=c, compress_ratio=4, learnable_sink=torch.randn(128, device="cuda"),
              causal=True, window_size=(127, 0))
q8 = torch.randn(2, 77, 8, 128, device="cuda").bfloat16()
k8 = torch.randn(2, 150, 1, 128, device="cuda").bfloat16()
stage.forward(q8, k8, compressed_kv=torch.randn(2, 9, 1, 128, device="cuda").bfloat16(), compress_ratio=16)
idx = torch.randint(-1, 80, (2, 130, 200), device="cuda", dtype=torch.int32)
stage.forward(q, kv, compressed_kv=c, compress_ratio=4, topk_indices=idx, causal=True, window_size=(127, 0))
# 64 heads with lists (sm100: a padded tile a token, its last tile's padding rows past the tensor)
stage.forward(q[:, :, :64].contiguous(), kv, compressed_kv=c, compress_ratio=4, topk_indices=idx, causal=True,
              window_size=(127, 0), learnable_sink=torch.randn(64, device="cuda"))
"""

test_compute_sanitizer = sanitizer_test(SANITIZER_CASE)
