"""Serving (issue 43) on a GPU: ``e_fused.decode`` and ``index_attention`` reading an inference
engine's paged FP8 cache (common/kv_cache.py's MODEL1 layout) with the kernel's dequantizing
gather, against the float64 reference on the dequantized cache: FlashMLA's decode shapes (64 /
128 heads, s_q 1-2, a window list in pages of 256 and an extra list in pages of 64 or 2 with
its lengths), random page tables, -1 padding, lengths of 0 and of the full list, tokens with no
valid key, sinks of +-inf, NaN in every unused cache slot (never read), the dequantization bit
for bit at the ends of ue8m0's range, CUDA-graph replay, bitwise repeatability, FlashMLA's own
FP8 decode on the same caches (where the peer is installed), bad input refused before launch."""

import pytest
import torch

from dsv4_attention.common import kv_cache as kc
from dsv4_attention.common.reference import dsv4_index_attention
from dsv4_attention.common.testing import (
    O_REL,
    check_index_result,
    errors,
    fresh_generator,
    gpu_arch_params,
    random_index_lists,
    run_compute_sanitizer,
    sinks_with_infinities,
)
from dsv4_attention.stages import e_fused as stage

pytestmark = [pytest.mark.stage_e]

# decode's two launches merge through split-KV's partial buffers, which only the sm90 kernel writes
# (refused by name on sm100: tests/test_e_cpu.py); its one launch and index mode over FP8 pages run
# on both
ARCHS = [p for p in gpu_arch_params() if p.values[0] == "sm90"]


def paged_cache(batch: int, s_q: int, tokens: int, page: int, topk: int, g, length=None):
    """One cache as an engine keeps it (FlashMLA's test's generator): each request's ``tokens``
    tokens on pages of a shuffled table, the ``topk`` lists of its s_q tokens drawn from them
    (-1 padded), every slot no list uses set to NaN before quantizing. Returns (fp8 cache, its
    dequantized rows [slots, 512] with NaN kept, lists [batch, s_q, topk])."""
    pages_per = -(-tokens // page)
    table = torch.randperm(batch * pages_per, generator=g).int().view(batch, pages_per)
    bf16 = (torch.randn(batch * pages_per, page, 1, 512, generator=g) / 4).to(torch.bfloat16)
    logical = torch.stack([random_index_lists(s_q, topk, tokens, g, pad=0.1) for _ in range(batch)])
    idx = kc.cache_indices(logical, table, page)
    used = idx.clone()
    if length is not None:
        used[torch.arange(topk)[None, None] >= length[:, None, None].expand_as(used)] = -1
    unused = torch.ones(batch * pages_per * page, dtype=torch.bool)
    unused[used[used >= 0].long()] = False
    bf16.view(-1, 512)[unused] = float("nan")
    fp8 = kc.quantize_kv_cache(bf16.cuda())
    return fp8, kc.dequantize_kv_cache(fp8).view(-1, 512), idx.cuda()


def reference(q, sources, sink):
    """FlashMLA's decode function in float64 through the spec's index-list form: both caches'
    dequantized rows as one pool (unused NaN slots zeroed: never listed), each token's two lists
    (cut at their lengths) as one list into it."""
    b, s_q, h, d = q.shape
    pools, lists, base = [], [], 0
    for rows, idx, length in sources:
        if length is not None:
            cut = torch.arange(idx.shape[2], device=idx.device)[None, None] >= length[:, None, None].cuda()
            idx = torch.where(cut, -1, idx)
        lists.append(torch.where(idx >= 0, idx + base, -1))
        pools.append(torch.nan_to_num(rows.float(), nan=0.0))
        base += rows.shape[0]
    lst = torch.cat(lists, dim=2).reshape(b * s_q, -1)
    full = torch.full((b * s_q,), lst.shape[1], dtype=torch.int32, device=q.device)
    o, lse = dsv4_index_attention(q.reshape(b * s_q, h, d), torch.cat(pools), lst, full, sink)
    return o.view(b, s_q, h, d), lse.view(b, s_q, h).transpose(1, 2)


def _peer():
    try:
        import flashmla_peer  # pyright: ignore[reportMissingImports] (the device pack's FlashMLA)
    except ImportError:
        return None
    return flashmla_peer


# (heads, s_q, window topk in pages of 256, extra topk, extra page size, extra lengths): FlashMLA's
# MODEL1 CONFIG1-4 shapes at small batch, and a window-only step of one token
CASES = [(64, 2, 128, 512, 64, False), (128, 2, 128, 1024, 64, False), (64, 2, 128, 1024, 2, True),
         (128, 1, 128, 0, 0, False)]


def decode_forms():
    """(arch, case, one_launch) of the decode reference test: the two launches on sm90 (every case),
    one launch on both archs (the cases with two caches: it reads both)."""
    out = []
    for arch in gpu_arch_params():
        for c in CASES:
            name = f"h{c[0]}-sq{c[1]}-top{c[2]}+{c[3]}p{c[4]}{'-len' * c[5]}"
            for one in (False, True):
                if (one and c[3]) or (not one and arch.values[0] == "sm90"):
                    out.append(pytest.param(arch.values[0], c, one, marks=arch.marks,
                                            id=f"{arch.id}-{name}-{'one_launch' if one else 'two_launches'}"))
    return out


@pytest.mark.parametrize("arch,case,one_launch", decode_forms())
@pytest.mark.parametrize("batch", [3, 9, 70])  # 70: more Q tiles than SMs, a CTA runs several
def test_decode_from_fp8_pages_is_the_reference(arch, case, batch, one_launch, record_errors):
    heads, s_q, topk, ex_topk, ex_page, ex_len = case
    g = fresh_generator()
    length = torch.randint(0, topk + 1, (batch,), generator=g).int()
    length[:2] = torch.tensor([0, topk])  # a request whose window list is cut to nothing, one full
    win, win_rows, win_idx = paged_cache(batch, s_q, 700, 256, topk, g, length)
    sources = [(win_rows, win_idx, length)]
    kw = {"topk_length": length.cuda()}
    if ex_topk:
        ex_length = torch.randint(0, ex_topk + 1, (batch,), generator=g).int() if ex_len else None
        if ex_length is not None:
            ex_length[:2] = torch.tensor([0, ex_topk])  # request 0: no key at all (both lists cut to 0)
        ext, ext_rows, ext_idx = paged_cache(batch, s_q, ex_topk + 300, ex_page, ex_topk, g, ex_length)
        sources.append((ext_rows, ext_idx, ex_length))
        kw.update(extra_k_cache=ext, extra_indices=ext_idx,
                  extra_topk_length=None if ex_length is None else ex_length.cuda())
    q = (torch.randn(batch, s_q, heads, 512, generator=g)).to(torch.bfloat16).cuda()
    sink = sinks_with_infinities(heads, g)
    kw["one_launch"] = one_launch
    o, lse = stage.decode(q, win, win_idx, attn_sink=sink, **kw)
    o_ref, lse_ref = reference(q, sources, sink)
    # rows as the LSE indexes them: (batch, head, token)
    check_index_result(o.transpose(1, 2), lse, o_ref.transpose(1, 2), lse_ref, record_errors, arch=arch,
                       case="decode fp8 pages", heads=heads, s_q=s_q, topk=f"{topk}+{ex_topk}", batch=batch)
    assert not torch.isnan(o).any()
    o2, lse2 = stage.decode(q, win, win_idx, attn_sink=sink, **kw)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)  # bitwise repeatable
    fm = _peer() if arch == "sm90" else None  # the device pack's FlashMLA build is sm90's
    if fm is not None:  # FlashMLA's own FP8 decode on the same caches (its LSE: +inf on empty rows)
        kw.pop("one_launch")
        o_p, lse_p = fm.with_kvcache_sparse(q, win, win_idx, length.cuda(), sink, kw.get("extra_k_cache"),
                                            kw.get("extra_indices"), kw.get("extra_topk_length"))
        e = errors(o, o_p.double())
        assert e.within(2 * O_REL[torch.bfloat16], 6 * O_REL[torch.bfloat16]), e


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("page", [256, 2])
@pytest.mark.parametrize("topk", [200, 300])  # 4 and 5 key tiles: the gather's pairs, and a lone last tile
def test_index_attention_reads_fp8_pages(arch, heads, page, topk, record_errors):
    """Prefill from the cache: index mode (one list, per-token lengths, the sink) with the FP8 pages
    as kv, no bf16 copy, against the float64 reference on the dequantized cache; poisoned output."""
    g = fresh_generator()
    batch, s_q = 5, 3
    cache, rows, idx = paged_cache(batch, s_q, 900, page, topk, g)
    q = torch.randn(batch * s_q, heads, 512, generator=g).to(torch.bfloat16).cuda()
    length = torch.randint(0, topk + 1, (batch * s_q,), generator=g).int().cuda()
    sink = sinks_with_infinities(heads, g)
    o = torch.full_like(q, float("nan"))
    _, lse = stage.index_attention(q, cache, idx.view(batch * s_q, 1, topk), topk_length=length, attn_sink=sink, out=o)
    o_ref, lse_ref = dsv4_index_attention(q, torch.nan_to_num(rows.float(), nan=0.0), idx.view(batch * s_q, topk),
                                          length, sink)
    check_index_result(o, lse, o_ref, lse_ref, record_errors, arch=arch, case="index mode over fp8 pages",
                       heads=heads, page=page, topk=topk)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("page", [64, 2])
def test_dequantization_is_exact_at_the_ends_of_the_scale_range(arch, page):
    """q = 0 and one listed token a query: P = 1, so O is that token's row as the kernel
    dequantized it, bit for bit against ``dequantize_kv_cache``: scale bytes 0 (2^-127), 1, 126,
    127, 128, 253 and 254 (2^127) with e4m3 values that keep every product a normal bf16, every
    unit of every chunk (RoPE too). A token whose list is -1: O = 0, LSE = -inf."""
    g = fresh_generator()
    slots = 6 * page if page > 2 else 96
    nb = slots // page
    # built on the GPU: a copy there would pack the pages (their stride is padded to 576 bytes)
    cache = kc.quantize_kv_cache(torch.zeros(nb, page, 1, 512, dtype=torch.bfloat16, device="cuda"))
    lay = kc.page_layout(page)
    raw = torch.as_strided(cache.view(torch.uint8), (nb, lay.page_bytes), (cache.stride(0), 1))
    byte_choices = torch.tensor([0, 1, 126, 127, 128, 253, 254])
    for t in range(page):
        data = raw[:, 576 * t:576 * t + 448]
        e = byte_choices[torch.randint(0, 7, (nb, 7), generator=g)]
        # |e4m3| in [2, 3.75] under byte 0, [1, 1.875] under 254 (bf16's max is 2^128 (1 - 2^-8))
        mags = torch.where(e[..., None] == 0, 2.0, 1.0) * (1 + torch.randint(0, 8, (nb, 7, 64), generator=g) / 8)
        mags = torch.where(e[..., None] == 254, mags.clamp(max=1.875), mags)
        signs = torch.where(torch.rand(nb, 7, 64, generator=g) < 0.5, -1.0, 1.0)
        data.copy_((mags * signs).to(torch.float8_e4m3fn).view(torch.uint8).view(nb, 448).cuda())
        raw[:, lay.data_bytes + 8 * t:lay.data_bytes + 8 * t + 7] = e.to(torch.uint8).cuda()
        rope = (torch.randn(nb, 64, generator=g) * 100).to(torch.bfloat16)
        raw[:, 576 * t + 448:576 * t + 576] = rope.view(torch.uint8).view(nb, 128).cuda()
    rows = kc.dequantize_kv_cache(cache).view(-1, 512)
    assert torch.isfinite(rows.float()).all()
    tokens = slots + 1
    idx = torch.full((tokens, 1, 64), -1, dtype=torch.int32)
    idx[:slots, 0, 5] = torch.randperm(slots, generator=g).int()  # one listed token each, mid-list
    q = torch.zeros(tokens, 64, 512, dtype=torch.bfloat16, device="cuda")
    o, lse = stage.index_attention(q, cache, idx.cuda())
    want = rows[idx[:slots, 0, 5].long().cuda()]
    assert torch.equal(o[:slots], want[:, None].expand(-1, 64, -1))
    assert bool((o[slots:] == 0).all()) and bool(torch.isneginf(lse[slots:]).all())
    assert bool((lse[:slots] == 0).all())


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_reads_bf16_pages_as_it_reads_their_fp8_form(arch):
    """bf16 pages (an engine that keeps bf16 caches) holding exactly the FP8 cache's dequantized
    values: the gathered tiles are the same bits, so the outputs are too (the FP8 gather's
    dequantization is exact). Both in two launches: bf16 pages have no one-launch form, and FP8
    caches take it by default (a different order of the same sums)."""
    g = fresh_generator()
    win, _, win_idx = paged_cache(3, 2, 700, 256, 128, g)
    ext, _, ext_idx = paged_cache(3, 2, 900, 64, 512, g)
    q = torch.randn(3, 2, 64, 512, generator=g).to(torch.bfloat16).cuda()
    sink = torch.randn(64, generator=g).cuda()
    o8, lse8 = stage.decode(q, win, win_idx, attn_sink=sink, extra_k_cache=ext, extra_indices=ext_idx, num_splits=2,
                            one_launch=False)
    o16, lse16 = stage.decode(q, kc.dequantize_kv_cache(win), win_idx, attn_sink=sink,
                              extra_k_cache=kc.dequantize_kv_cache(ext), extra_indices=ext_idx, num_splits=2)
    assert torch.equal(o8, o16) and torch.equal(lse8, lse16)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("one_launch", [False, True], ids=["two_launches", "one_launch"])
def test_decode_replays_in_a_cuda_graph(arch, one_launch):
    """A decode step captured once (check_indices=False: no host read) and replayed after the
    caches and q change in place gives the eager call's bits."""
    g = fresh_generator()
    batch, s_q, heads = 4, 2, 64
    win, _, win_idx = paged_cache(batch, s_q, 600, 256, 128, g)
    ext, _, ext_idx = paged_cache(batch, s_q, 800, 64, 512, g)
    q = torch.randn(batch, s_q, heads, 512, generator=g).to(torch.bfloat16).cuda()
    sink = torch.randn(heads, generator=g).cuda()
    kw = {"attn_sink": sink, "extra_k_cache": ext, "extra_indices": ext_idx, "check_indices": False,
          "one_launch": one_launch}
    stage.decode(q, win, win_idx, **kw)  # compiles and plans outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = stage.decode(q, win, win_idx, **kw)
    fresh = (torch.randn(win.shape[0], win.shape[1], 1, 512, generator=g) / 4).to(torch.bfloat16)
    win.copy_(kc.quantize_kv_cache(fresh.cuda()))  # new rows in every slot, the same layout
    q.copy_(torch.randn(batch, s_q, heads, 512, generator=g).to(torch.bfloat16).cuda())
    graph.replay()
    o, lse = stage.decode(q, win, win_idx, **kw)
    assert torch.equal(o_g, o) and torch.equal(lse_g, lse)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["h64-top128+512p64", "h64-top128+1024p2-len"])
def test_decode_schedule_replays_the_full_path(arch, case, monkeypatch):
    """A ``DecodeSchedule`` recorded by the first step replays the next ones (new q, caches, lists
    and lengths, in new tensors of the same shapes) bit for bit as the full path computes them,
    without the full path (index_launch not called); a step of another batch records anew; a call
    that reads its lists on the host (check_indices=True) is never recorded and still right."""
    heads, s_q, w_topk, x_topk, x_page, lengths = case
    g = fresh_generator()
    schedule = stage.DecodeSchedule()
    launches = []
    full_launch = stage.index_launch
    monkeypatch.setattr(stage, "index_launch", lambda *a, **k: launches.append(1) or full_launch(*a, **k))

    def one_step(batch):
        win, _, win_idx = paged_cache(batch, s_q, 600, 256, w_topk, g)
        ext, _, ext_idx = paged_cache(batch, s_q, x_topk + 300, x_page, x_topk, g)
        length = torch.randint(0, x_topk + 1, (batch,), generator=g, dtype=torch.int32).cuda() if lengths else None
        q = torch.randn(batch, s_q, heads, 512, generator=g).to(torch.bfloat16).cuda()
        kw = {"attn_sink": torch.randn(heads, generator=g).cuda(), "extra_k_cache": ext, "extra_indices": ext_idx,
              "extra_topk_length": length, "check_indices": False}
        return q, win, win_idx, kw

    for i, batch in enumerate([5, 5, 5, 7, 7]):
        q, win, win_idx, kw = one_step(batch)
        o_full, lse_full = stage.decode(q, win, win_idx, **kw)
        before = len(launches)
        o, lse = stage.decode(q, win, win_idx, sched_meta=schedule, **kw)
        replayed = len(launches) == before
        assert replayed == (i not in (0, 3)), (i, batch)  # recorded at the first step of each batch size
        assert schedule.plan is not None
        assert torch.equal(o, o_full) and torch.equal(lse, lse_full), (i, batch)
        assert o.shape == (batch, s_q, heads, 512) and lse.shape == (batch, heads, s_q)
    checked = {**kw, "check_indices": True}
    fresh = stage.DecodeSchedule()
    o, lse = stage.decode(q, win, win_idx, sched_meta=fresh, **checked)
    assert fresh.plan is None and torch.equal(o, o_full) and torch.equal(lse, lse_full)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_decode_schedule_replays_in_a_cuda_graph(arch):
    """A scheduled step captured in a graph (recorded before the capture) replays the eager step's
    bits after q and the cache change in place."""
    g = fresh_generator()
    batch, s_q, heads = 4, 2, 128
    win, _, win_idx = paged_cache(batch, s_q, 600, 256, 128, g)
    ext, _, ext_idx = paged_cache(batch, s_q, 1324, 64, 1024, g)
    q = torch.randn(batch, s_q, heads, 512, generator=g).to(torch.bfloat16).cuda()
    schedule = stage.DecodeSchedule()
    kw = {"attn_sink": torch.randn(heads, generator=g).cuda(), "extra_k_cache": ext, "extra_indices": ext_idx,
          "check_indices": False, "sched_meta": schedule}
    stage.decode(q, win, win_idx, **kw)  # compiles and records outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = stage.decode(q, win, win_idx, **kw)
    fresh = (torch.randn(win.shape[0], win.shape[1], 1, 512, generator=g) / 4).to(torch.bfloat16)
    win.copy_(kc.quantize_kv_cache(fresh.cuda()))
    q.copy_(torch.randn(batch, s_q, heads, 512, generator=g).to(torch.bfloat16).cuda())
    graph.replay()
    o, lse = stage.decode(q, win, win_idx, **{**kw, "sched_meta": None})
    assert torch.equal(o_g, o) and torch.equal(lse_g, lse)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_refuses_bad_input(arch):
    g = fresh_generator()
    win, _, idx = paged_cache(2, 2, 300, 64, 64, g)
    q = torch.zeros(2, 2, 64, 512, dtype=torch.bfloat16, device="cuda")
    slots = win.shape[0] * win.shape[1]
    squeezed = torch.as_strided(win, (win.shape[0] - 1,) + tuple(win.shape[1:]),
                                (kc.page_layout(64).page_bytes - 576,) + tuple(win.stride()[1:]))
    cases = [((q, win, idx + slots), {}, "values"), ((q.half(), win, idx), {}, "bf16"),
             ((q[..., :256], win, idx), {}, "512"), ((q, win.view(torch.uint8)[..., :576], idx), {}, "584"),
             ((q, squeezed, idx), {}, "apart"), ((q, win, idx[:, :1]), {}, "s_q"),
             ((q, win, idx), {"topk_length": torch.full((2,), 65, dtype=torch.int32, device="cuda")}, "topk_length"),
             ((q, win, idx), {"extra_k_cache": win}, "together"),
             ((q, win, idx), {"attn_sink": torch.zeros(3, device="cuda")}, "sink"),
             ((q, win, idx), {"one_launch": True}, "two paged FP8 caches"),
             ((q, kc.dequantize_kv_cache(win), idx), {"extra_k_cache": win, "extra_indices": idx, "one_launch": True},
              "two paged FP8 caches"),
             ((q, win, idx), {"extra_k_cache": win, "extra_indices": idx + slots, "one_launch": True}, "extra_indices")]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            stage.decode(*args, **kw)


SANITIZED = """
import torch
from dsv4_attention.common import kv_cache as kc
from dsv4_attention.stages import e_fused as stage
g = torch.Generator().manual_seed(0)


def cache(batch, tokens, page, topk):
    pages = -(-tokens // page)
    table = torch.randperm(batch * pages, generator=g).int().view(batch, pages)
    rows = (torch.randn(batch * pages, page, 1, 512, generator=g) / 4).to(torch.bfloat16)
    logical = torch.randint(-1, tokens, (batch, 2, topk), generator=g, dtype=torch.int32)
    return kc.quantize_kv_cache(rows.cuda()), kc.cache_indices(logical, table, page).cuda()


# FlashMLA's CONFIG1 / CONFIG3 forms: window top-128 in pages of 256, extra top-512 in pages of 64,
# or in pages of 2 with lengths; batch 2 (split over the SMs, then the merge) and 9
for batch, x_page, lengths in ((2, 64, False), (9, 2, True)):
    win, w_idx = cache(batch, 700, 256, 128)
    ext, x_idx = cache(batch, 812, x_page, 512)
    q = torch.randn(batch, 2, 64, 512, device="cuda").bfloat16()
    x_len = torch.randint(0, 513, (batch,), device="cuda", dtype=torch.int32) if lengths else None
    stage.decode(q, win, w_idx, topk_length=torch.randint(0, 129, (batch,), device="cuda", dtype=torch.int32),
                 attn_sink=torch.randn(64, device="cuda"), extra_k_cache=ext, extra_indices=x_idx,
                 extra_topk_length=x_len, check_indices=False)
# prefill from the FP8 pages: index mode, one list a token, lengths
pages, idx = cache(5, 900, 64, 200)
qp = torch.randn(10, 128, 512, device="cuda").bfloat16()
stage.index_attention(qp, pages, idx.view(10, 1, 200), topk_length=torch.randint(0, 201, (10,), device="cuda",
                      dtype=torch.int32), attn_sink=torch.randn(128, device="cuda"), check_indices=False)
"""

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(arch, tool):
    """compute-sanitizer over the FP8 paths (the serving page listed them as open): decode at batch
    2 (split, then the merge) and 9 with lengths over pages of 2, and index mode over FP8 pages."""
    run_compute_sanitizer(tool, SANITIZED)
