"""Split-KV decode (common/split_kv.py; stage D1's persistent seesaw, called through stage E).

On the host: the splits of a span visit each of its tiles exactly once, in the kernel's order
(``split_visits`` and ``KvSpan.visit_tile``, the kernel's own functions, over every span length
and split count up to 64), and a top-k unit's staged lists land in the ring slots of its own
uses (``TopkSpan.list_slot``), each with a negative control the check must reject; the merge
of the parts against ``merge_attention`` folded over them and against float64, -inf parts and
all-empty rows included; the choice of the split count; the refusals; the split kernel's
compile (time, registers, no spill, no serialized wgmma).

On a GPU: DeepSeek-V4's decode shapes (1-2 tokens of 128 heads, and index mode at 64 heads) at
batch 1-3, HCA, CSA and index mode, split 2 to 16 ways (more splits than tiles: empty splits),
against the float64 reference into poisoned outputs; the split result against the unsplit one;
bitwise repeatable; the count chosen by ``num_splits=None``. On sm100 a split call is refused
before launch (built for sm90 only), which the same tests assert there.
"""

import math
import random

import pytest
import torch

from dsv4_attention.common import split_kv
from dsv4_attention.common.compressed import TopkSpan
from dsv4_attention.common.kv_span import KvSpan
from dsv4_attention.common.merge import merge_attention

pytestmark = [pytest.mark.stage_e]


def visits_of(n_tiles, num_splits, split_fn=split_kv.split_visits):
    """{split: [tiles in visit order]} as the kernel's units walk them."""
    out = {}
    for s in range(num_splits):
        span = object.__new__(KvSpan)
        span.n_tiles = n_tiles
        span.n_end, n = split_fn(n_tiles, s, num_splits)
        out[s] = [span.visit_tile(v) for v in range(n)]
    return out


def partition_errors(n_tiles, num_splits, split_fn=split_kv.split_visits) -> list:
    """What is wrong with the splits of an ``n_tiles`` span: tiles visited twice or never, a split
    out of the kernel's last-first order, an odd split before the last non-empty one."""
    units = visits_of(n_tiles, num_splits, split_fn)
    seen = [t for s in range(num_splits) for t in units[s]]
    bad = []
    if sorted(seen) != list(range(n_tiles)):
        bad.append(f"tiles {sorted(seen)} != 0..{n_tiles - 1}")
    if seen != list(range(n_tiles - 1, -1, -1)):
        bad.append("not the unsplit visit order when the splits are read in turn")
    sizes = [len(units[s]) for s in range(num_splits) if units[s]]
    if any(n % 2 for n in sizes[:-1]):
        bad.append(f"an odd split before the last: {sizes}")
    return bad


def test_splits_visit_each_tile_once():
    for n_tiles in range(1, 70):
        for num_splits in range(1, split_kv.MAX_SPLITS + 1):
            assert not partition_errors(n_tiles, num_splits), (n_tiles, num_splits)


def test_partition_check_rejects_an_off_by_one():
    """Negative controls: a split that starts one tile late, or whose first tile is one too high."""
    def late(n_tiles, s, S):
        n_end, n = split_kv.split_visits(n_tiles, s, S)
        return n_end - (1 if s else 0), n

    def high(n_tiles, s, S):
        n_end, n = split_kv.split_visits(n_tiles, s, S)
        return n_end + 1, n

    assert partition_errors(20, 3, late)
    assert partition_errors(20, 3, high)


def staged_slot_errors(n_tiles, num_splits, slots, base, end_shift=None) -> list:
    """Each unit's gathered tile n goes to ring use base + (its visit), slot (base + visit) % slots;
    the consumers read its list from ``list_slot(n)``: they must be the same slot. ``end_shift``
    (a control): the consumers' span counts from n_end + shift (None: the unsplit rule, no n_end)."""
    bad = []
    for s in range(num_splits):
        n_end, n = split_kv.split_visits(n_tiles, s, num_splits)
        span = object.__new__(TopkSpan)
        span.n_tiles, span.slots, span.list_base, span.n_end = n_tiles, slots, base, n_end
        reader = object.__new__(TopkSpan)
        reader.__dict__.update(span.__dict__)
        if end_shift is None or end_shift:
            reader.n_end = None if end_shift is None else n_end + end_shift
        for v in range(n):
            tile = span.visit_tile(v)
            if reader.list_slot(tile) != (base + v) % slots:
                bad.append((s, v, tile))
    return bad


@pytest.mark.parametrize("slots", [2, 4])
def test_topk_lists_are_staged_in_the_units_own_slots(slots):
    rng = random.Random(7)
    for _ in range(400):
        n_tiles, num_splits, base = rng.randint(1, 40), rng.randint(1, 12), rng.randint(0, 1000)
        assert not staged_slot_errors(n_tiles, num_splits, slots, base, end_shift=0), (n_tiles, num_splits, base)
    # negative controls: a reader one tile off; with 4 slots, the unsplit rule (splits start at even
    # visits, so with the kernel's 2 slots that rule lands on the same slot by parity alone)
    assert staged_slot_errors(20, 3, slots, 1, end_shift=1)
    if slots == 4:
        assert staged_slot_errors(20, 2, slots, 1, end_shift=None)  # split 1 starts at visit 10


def random_parts(s, b, sq, h, d, empty_share=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    o_part = torch.randn(s * b, sq, h, d, generator=g)
    lse_part = torch.randn(s * b, h, sq, generator=g) * 3
    drop = torch.rand(lse_part.shape, generator=g) < empty_share
    lse_part[drop] = -math.inf
    o_part.transpose(1, 2)[drop] = 0.0  # an empty part is O = 0, as the kernel writes it
    lse_part.view(s, b, h, sq)[:, 0, 0, 0] = -math.inf  # one row with every part empty
    o_part.view(s, b, sq, h, d)[:, 0, 0, 0] = 0.0
    return o_part, lse_part


@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
def test_combine_equals_the_merge_folded_over_the_parts(with_sink):
    s, b, sq, h, d = 5, 2, 3, 4, 64
    o_part, lse_part = random_parts(s, b, sq, h, d)
    sink = torch.randn(h) * 2 if with_sink else None
    o = torch.full((b, sq, h, d), math.nan)
    lse = torch.full((b, h, sq), math.nan)
    split_kv.combine(o_part, lse_part, o, lse, sink)
    # the two-sided merge, folded over the splits
    parts_o, parts_l = o_part.view(s, b, sq, h, d), lse_part.view(s, b, h, sq)
    ref_o, ref_l = parts_o[0], parts_l[0]
    for i in range(1, s):
        ref_o, ref_l = merge_attention(ref_o, ref_l, parts_o[i], parts_l[i])
    if sink is not None:
        ref_o = ref_o * torch.sigmoid(ref_l - sink[None, :, None]).transpose(1, 2)[..., None]
    assert torch.isneginf(lse[0, 0, 0]) and bool((o[0, 0, 0] == 0).all())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    finite = torch.isfinite(ref_l)
    assert (lse[finite] - ref_l[finite]).abs().max() < 1e-5
    assert (o - ref_o).abs().max() < 1e-5
    # float64, from the definition: sum_s exp(lse_s) O_s / sum_s exp(lse_s)
    w = torch.exp(parts_l.double())
    o64 = torch.einsum("sbhq,sbqhd->bqhd", w, parts_o.double()) / w.sum(0).transpose(1, 2)[..., None]
    if sink is not None:
        o64 = o64 * torch.sigmoid(torch.log(w.sum(0)) - sink.double()[None, :, None]).transpose(1, 2)[..., None]
    o64 = torch.nan_to_num(o64, nan=0.0)
    assert (o.double() - o64).abs().max() < 1e-5


def test_combine_check_rejects_a_dropped_part():
    """Negative control: merging all but one part is caught by the same comparison."""
    s, b, sq, h, d = 4, 1, 2, 2, 32
    o_part, lse_part = random_parts(s, b, sq, h, d, empty_share=0.0)
    o, lse = torch.empty(b, sq, h, d), torch.empty(b, h, sq)
    split_kv.combine(o_part[: (s - 1) * b], lse_part[: (s - 1) * b], o, lse)
    ref_o, ref_l = o_part[0:1], lse_part[0:1]
    for i in range(1, s):
        ref_o, ref_l = merge_attention(ref_o, ref_l, o_part[i:i + 1], lse_part[i:i + 1])
    assert (o - ref_o).abs().max() > 1e-3


def test_choose_splits():
    """The counts the H100 sweep found best (docs/stages/e_fused.md's split-KV table)."""
    assert split_kv.choose_splits(units=128, n_tiles=1024, sms=132) == 1  # batch 64: one wave already
    assert split_kv.choose_splits(units=2, n_tiles=1024, sms=132) == 32  # batch 1, 64k keys
    assert split_kv.choose_splits(units=8, n_tiles=1024, sms=132) == 16  # batch 4
    assert split_kv.choose_splits(units=32, n_tiles=1024, sms=132) == 4  # batch 16
    assert split_kv.choose_splits(units=2, n_tiles=128, sms=132) == 16  # batch 1, 8k keys
    assert split_kv.choose_splits(units=2, n_tiles=10, sms=132) == 1  # DeepSeek-V4's 64k spans: too short
    assert split_kv.choose_splits(units=0, n_tiles=10, sms=132) == 1


def test_decode_splits():
    """Decode's lists (``DECODE_MIN_TILES``): the counts the H200 sweep of FlashMLA's CONFIG1-4
    found best or within 4 % of it (tools/split_sweep.py --fp8, docs/serving.md). 128 heads, s_q 2:
    a token is 2 Q tiles, so batch b is 4 b units."""
    auto = lambda b, keys: split_kv.auto_splits(1, 2 * b, 128, 1, keys, 132, split_kv.DECODE_MIN_TILES)  # noqa: E731
    assert auto(2, 1024) == 8 and auto(2, 128) == 1  # the extra list in 8 pairs; the window's 2 tiles whole
    assert auto(8, 1024) == 4 and auto(32, 1024) == 1 and auto(64, 1024) == 1
    # the prefill default would leave batch 2's 1024 keys in 2 splits (16 of 132 SMs busy)
    assert split_kv.auto_splits(1, 4, 128, 1, 1024, 132) == 2


def test_bad_split_requests_are_refused():
    for bad in (0, -1, 65, 2.0, True, "4"):
        with pytest.raises(ValueError, match="num_splits"):
            split_kv.check_num_splits(bad, True, False, "sm90")
    with pytest.raises(ValueError, match="sm90 only"):
        split_kv.check_num_splits(2, True, False, "sm100")
    with pytest.raises(ValueError, match="seesaw"):
        split_kv.check_num_splits(2, False, False, "sm90")
    with pytest.raises(ValueError, match="cu_seqlens"):
        split_kv.check_num_splits(2, True, True, "sm90")
    assert split_kv.check_num_splits(1, False, True, "sm100") == 1  # unsplit: every kernel


@pytest.mark.compile
@pytest.mark.parametrize("mode", ["hca", "csa", "index"])
def test_split_kernel_compiles(mode):
    """The split kernels (sm90) in the compile budget, without spills or serialized wgmma (the
    default kernels' SASS is unchanged by the split path: docs/stages/e_fused.md)."""
    from dsv4_attention.common.compile import assert_within_budget

    options = {"kv_shared": True, "pack_group": 64, "has_compressed": True, "split_kv": True}
    if mode == "hca":
        options.update(has_left=True, has_right=True)
    elif mode == "csa":
        options.update(has_left=True, has_right=True, has_topk=True)
    else:
        options.update(has_topk=True, index_mode=True)
    # every stage kernel's budgets (time, spills, SMEM, the setmaxnreg plan, no C7508 / C7519), and
    # no ptxas warning at all
    r = assert_within_budget("e", "sm90", "bfloat16", 512, options=options)
    assert not r.warnings, r.row()


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_combine_kernel_compiles(arch):
    """The merge kernel (``SplitCombine``) compiles for either architecture on the host, with and
    without the sink; what it emits per lane: 16 fp32 loads a part, 16 stores, the LSE's store."""
    from dsv4_attention.common import jit
    from dsv4_attention.common.split_combine import SplitCombine

    for has_sink in (False, True):
        args = [torch.empty(4, 1, 128, 512), torch.empty(4, 128, 1), torch.empty(2, 1, 128, 512, dtype=torch.bfloat16),
                torch.empty(2, 128, 1), torch.empty(128) if has_sink else None, 2, jit.STREAM]
        jit.compile_kernel(SplitCombine(jit.cutlass_dtype(torch.bfloat16), 512, has_sink=has_sink), args, arch)
    with pytest.raises(ValueError, match="multiples of 128"):
        SplitCombine(jit.cutlass_dtype(torch.bfloat16), 320)


# ---- on a GPU ---------------------------------------------------------------------------------

from dsv4_attention.common.testing import (  # noqa: E402 - the GPU half of the file
    LSE_ABS,
    O_REL,
    check_attention,
    errors,
    fresh_generator,
    gpu_arch_params,
    poison_,
    random_bshd,
    random_index_lists,
    sinks_with_infinities,
)
from dsv4_attention.stages import e_fused as stage  # noqa: E402

#: the split kernels exist on sm90 only (sm100 refuses a split call before launch, asserted by the
#: tests over every architecture): the tests of what a split computes run where a Hopper GPU is
SPLIT_ARCH = [p for p in gpu_arch_params() if p.id == "sm90"]


def decode_case(mode, batch, sq, heads, g, keys=1500):
    """DeepSeek-V4 decode: ``sq`` newest tokens of ``keys``-key requests, window (127, 0), sink;
    HCA (ratio 128: 11 entries), CSA (ratio 4, top-200 lists with -1 padding and entries not yet
    visible) or index mode (top-300 of 900 rows)."""
    dev = "cuda"
    q = random_bshd(batch, sq, heads, 512, torch.bfloat16, dev, generator=g)
    kv = random_bshd(batch, keys, 1, 512, torch.bfloat16, dev, generator=g)
    sink = (torch.randn(heads, generator=g) * 2).to(dev)
    opts = {"causal": True, "window_size": (127, 0), "learnable_sink": sink}
    if mode == "hca":
        opts.update(compressed_kv=random_bshd(batch, keys // 128, 1, 512, torch.bfloat16, dev, generator=g),
                    compress_ratio=128)
    elif mode == "csa":
        n_c = keys // 4
        idx = torch.stack([random_index_lists(sq, 200, n_c, g, pad=0.2) for _ in range(batch)])
        opts.update(compressed_kv=random_bshd(batch, n_c, 1, 512, torch.bfloat16, dev, generator=g),
                    compress_ratio=4, topk_indices=idx.to(dev))
    return q, kv, opts


def index_case(tokens, heads, g, k=300, rows=900):
    q = random_bshd(1, tokens, heads, 512, torch.bfloat16, "cuda", generator=g)[0]
    kv = random_bshd(1, rows, 1, 512, torch.bfloat16, "cuda", generator=g)[0]
    idx = random_index_lists(tokens, k, rows, g, pad=0.1)
    idx[0] = -1  # a token with no key: O = 0, LSE = -inf through the merge
    return q, kv, idx[:, None].cuda(), (torch.randn(heads, generator=g) * 2).cuda()


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("mode", ["hca", "csa"])
@pytest.mark.parametrize("batch,sq", [(1, 1), (3, 2)])
@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_decode(arch, mode, batch, sq, num_splits, record_errors):
    """Spans of 4-6 tiles (HCA: 2-3 window tiles and one of entries; CSA: 2-3 window tiles and 4
    of lists): 16 splits leave most units empty, 5 splits some."""
    g = fresh_generator()
    q, kv, opts = decode_case(mode, batch, sq, 128, g)
    if arch != "sm90":
        with pytest.raises(ValueError, match="sm90 only"):
            stage.forward(q, kv, num_splits=num_splits, **opts)
        return
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={**opts, "num_splits": num_splits})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("num_splits", [3, 8])
def test_split_index_mode(arch, heads, num_splits, record_errors):
    from dsv4_attention.common.reference import dsv4_index_attention

    g = fresh_generator()
    q, kv, idx, sink = index_case(4, heads, g)
    if arch != "sm90":
        with pytest.raises(ValueError, match="sm90 only"):
            stage.index_attention(q, kv, idx, attn_sink=sink, num_splits=num_splits)
        return
    o = torch.full_like(q, float("nan"))
    _, lse = stage.index_attention(q, kv, idx, attn_sink=sink, out=o, num_splits=num_splits)
    length = torch.full((q.shape[0],), idx.shape[2], dtype=torch.int32, device="cuda")
    o_ref, lse_ref = dsv4_index_attention(q, kv[:, 0], idx[:, 0], length, sink)
    e = errors(o, o_ref)
    record_errors(e, arch=arch, case="split index mode", heads=heads, num_splits=num_splits)
    assert e.within(O_REL[torch.bfloat16], 3 * O_REL[torch.bfloat16]), e
    empty = torch.isneginf(lse_ref)
    assert bool(empty[0].all()) and bool(torch.isneginf(lse[empty]).all()) and bool((o[empty] == 0).all())
    assert (lse[~empty].double() - lse_ref[~empty]).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("arch", SPLIT_ARCH)
@pytest.mark.parametrize("mode", ["hca", "index"])
def test_split_merge_with_infinite_sinks(arch, mode, record_errors):
    """The merge kernel applies the sink: FlashMLA's draw (a third -inf, a third +inf) on rows empty
    in every split (index mode: token 0 lists nothing; HCA: request 0 has seqused_k 0) and full rows;
    O = 0 there for any sink, +inf heads O = 0, the rest against the reference."""
    from dsv4_attention.common.reference import dsv4_index_attention

    g = fresh_generator()
    if mode == "index":
        q, kv, idx, _ = index_case(4, 128, g)
        s = sinks_with_infinities(128, g)
        o = torch.full_like(q, float("nan"))
        _, lse = stage.index_attention(q, kv, idx, attn_sink=s, out=o, num_splits=3)
        length = torch.full((q.shape[0],), idx.shape[2], dtype=torch.int32, device="cuda")
        o_ref, lse_ref = dsv4_index_attention(q, kv[:, 0], idx[:, 0], length, s)
        e = errors(o, o_ref)
        record_errors(e, arch=arch, case="split index mode, infinite sinks", num_splits=3)
        assert e.within(O_REL[torch.bfloat16], 3 * O_REL[torch.bfloat16]), e
        assert bool((o[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
        assert bool((o[:, torch.isposinf(s)] == 0).all())
        return
    q, kv, opts = decode_case("hca", 2, 2, 128, g)
    opts["learnable_sink"] = sinks_with_infinities(128, g)
    opts["seqused_k"] = torch.tensor([0, kv.shape[1]], dtype=torch.int32, device="cuda")
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch, options={**opts, "num_splits": 4})


@pytest.mark.parametrize("arch", SPLIT_ARCH)
def test_split_equals_unsplit_and_repeats_bitwise(arch):
    """The merge of fp32 parts against the one-unit result: within a bf16 rounding of each other
    (O to 1 ulp of its scale, LSE to fp32 rounding); two split runs bitwise equal."""
    g = fresh_generator()
    q, kv, opts = decode_case("csa", 2, 2, 128, g, keys=4000)
    o1, l1 = stage.forward(q, kv, **opts)
    o4, l4 = stage.forward(q, kv, num_splits=4, **opts)
    o4b, l4b = stage.forward(q, kv, num_splits=4, **opts)
    torch.cuda.synchronize()
    assert torch.equal(o4, o4b) and torch.equal(l4, l4b)
    assert (l1 - l4).abs().max().item() < 1e-4
    assert (o1.float() - o4.float()).abs().max().item() <= 2 * o1.float().abs().max().item() / 128


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_chosen_split_count(arch, record_errors):
    """``num_splits=None``: batch 1 of an HCA layer at 40k tokens (7-8 tiles a Q tile: not split)
    and of dense decode at 3000 keys (47 tiles: 5 splits on sm90; on sm100, which has no split
    kernel, None chooses 1), each the reference's."""
    g = fresh_generator()
    q, kv, opts = decode_case("hca", 1, 1, 128, g, keys=40000)
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch, options={**opts, "num_splits": None})
    q = random_bshd(1, 1, 128, 512, torch.bfloat16, "cuda", generator=g)
    kv = random_bshd(1, 3000, 1, 512, torch.bfloat16, "cuda", generator=g)
    sink = (torch.randn(128, generator=g) * 2).cuda()
    check_attention(stage.forward, q, kv, kv, record_errors, g, arch=arch,
                    options={"learnable_sink": sink, "num_splits": None})


@pytest.mark.parametrize("arch", SPLIT_ARCH)
@pytest.mark.parametrize("mode", ["dense", "csa"])
def test_planned_split_calls_equal_the_full_path(arch, mode):
    """A repeated split signature replays its plan (``call_plan.SplitPlan``: fresh partial buffers,
    then the merge with the sink): on new inputs of the same shapes, into poisoned outputs, bitwise
    the full path's result on the same inputs. ``num_splits=None`` over dense decode at 4000 keys
    (2 requests x 2 tokens: 8 Q tiles, 63 KV tiles; 7 splits on 132 SMs), 4 splits of a CSA layer
    with unchecked lists (the only planned top-k calls); the count each ran with is reported."""
    from dsv4_attention.common import call_plan
    from dsv4_attention.common.persistent import device_sms

    g = fresh_generator()

    def case():
        if mode == "dense":
            q = random_bshd(2, 2, 128, 512, torch.bfloat16, "cuda", generator=g)
            kv = random_bshd(2, 4000, 1, 512, torch.bfloat16, "cuda", generator=g)
            return q, kv, {"learnable_sink": (torch.randn(128, generator=g) * 2).cuda(), "num_splits": None}
        q, kv, opts = decode_case("csa", 2, 2, 128, g, keys=4000)
        return q, kv, {**opts, "check_indices": False, "num_splits": 4}

    def poisoned(q):  # fresh O and LSE, NaN before the launch
        return (poison_(torch.empty_like(q)),
                poison_(torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device="cuda")))

    call_plan.clear()
    q, kv, opts = case()
    o1, lse1 = poisoned(q)
    stage.forward(q, kv, out=o1, lse_out=lse1, **opts)  # the full path: records the plan
    chosen = call_plan.last_splits()
    assert chosen == (split_kv.auto_splits(2, 2, 128, 1, 4000, device_sms()) if mode == "dense" else 4) and chosen > 1
    q2, kv2, opts2 = case()
    o, lse = poisoned(q2)
    stage.forward(q2, kv2, out=o, lse_out=lse, **opts2)
    assert call_plan.last_splits() == chosen and call_plan.size() >= 1
    call_plan.clear()  # the same call again by the full path
    o_full, lse_full = poisoned(q2)
    stage.forward(q2, kv2, out=o_full, lse_out=lse_full, **opts2)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(o, o_full) and torch.equal(lse, lse_full)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_split_refusals_before_launch(arch):
    """A split where the kernel cannot split: head dim 128 (no seesaw), cu_seqlens."""
    g = fresh_generator()
    q = random_bshd(1, 2, 64, 128, torch.bfloat16, "cuda", generator=g)
    kv = random_bshd(1, 500, 1, 128, torch.bfloat16, "cuda", generator=g)
    with pytest.raises(ValueError, match="seesaw|sm90 only"):
        stage.forward(q, kv, num_splits=2)
    q5 = random_bshd(1, 2, 64, 512, torch.bfloat16, "cuda", generator=g)[0]
    kv5 = random_bshd(1, 500, 1, 512, torch.bfloat16, "cuda", generator=g)[0]
    cu_q = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 500], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens|sm90 only"):
        stage.forward(q5, kv5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2, max_seqlen_k=500, num_splits=2)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [384, 512])
def test_combine_kernel_equals_torch(arch, head_dim):
    """The merge kernel against ``combine_torch`` (itself proven against ``merge_attention`` on
    the host): random parts with empty ones and an all-empty row, with and without the sink, into
    poisoned outputs."""
    s, b, sq, h = 7, 3, 2, 64
    o_part, lse_part = random_parts(s, b, sq, h, head_dim, seed=11)
    o_part, lse_part = o_part.cuda(), lse_part.cuda()
    for sink in (None, (torch.randn(h) * 2).cuda()):
        o = torch.full((b, sq, h, head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, h, sq), math.nan, device="cuda")
        split_kv.combine(o_part, lse_part, o, lse, sink)
        o_ref, lse_ref = torch.empty(b, sq, h, head_dim, device="cuda"), torch.empty(b, h, sq, device="cuda")
        split_kv.combine_torch(o_part, lse_part, o_ref, lse_ref, sink)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)) and not torch.isnan(lse).any()
        finite = torch.isfinite(lse_ref)
        assert (lse[finite] - lse_ref[finite]).abs().max().item() < 1e-5
        assert not torch.isnan(o).any()
        assert (o.float() - o_ref).abs().max().item() <= o_ref.abs().max().item() / 128  # bf16 rounding


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import e_fused as stage
q = torch.randn(3, 2, 128, 512, device="cuda").bfloat16()
kv = torch.randn(3, 1500, 1, 512, device="cuda").bfloat16()
c = torch.randn(3, 375, 1, 512, device="cuda").bfloat16()
sink = torch.randn(128, device="cuda")
idx = torch.randint(-1, 375, (3, 2, 200), device="cuda", dtype=torch.int32)
for n in (3, 16):  # some units empty at 16
    stage.forward(q, kv, learnable_sink=sink, num_splits=n)
    stage.forward(q, kv, compressed_kv=c, compress_ratio=4, topk_indices=idx, learnable_sink=sink, causal=True,
                  window_size=(127, 0), num_splits=n)
torch.cuda.synchronize()
print("sanitized case ran")
"""


@pytest.mark.parametrize("arch", SPLIT_ARCH)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_split_compute_sanitizer(arch, tool):
    """The split kernels (dense and CSA, empty units included) and the merge under memcheck (the
    partial stores' bounds) and racecheck (the persistent loop's SMEM across units)."""
    from dsv4_attention.common.testing import run_compute_sanitizer

    run_compute_sanitizer(tool, SANITIZER_CASE)
