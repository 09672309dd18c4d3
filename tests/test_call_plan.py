"""Validate once per signature (common/call_plan.py), on the CPU: the kernel is a recorder, so
what is checked is what a planned call hands the compiled function against what the full path
hands it for the same tensors, and which calls must never be planned."""

import gc
import weakref

import pytest
import torch

import dsv4_attention
from dsv4_attention.common import call_plan, interface, seams, split_kv
from dsv4_attention.stages import c_online_softmax, d1_smem_p, e_fused


@pytest.fixture
def kernel(recorded_launches):
    """The compiled function as a recorder of its arguments (conftest's ``recorded_launches``)."""
    return recorded_launches


def bshd(b, s, h, d, offset=0):
    """A fresh bf16 tensor; ``offset`` elements into its storage (8 bf16 = 16 bytes)."""
    t = torch.randn(b * s * h * d + offset, dtype=torch.bfloat16)
    return t[offset:].view(b, s, h, d)


def same_args(a, b, same=lambda x, y: x is y) -> bool:
    """The same tensors (by identity, or as ``same`` compares them) and values (with their types),
    the seams' bundles field by field."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple) and isinstance(y, tuple):
            if type(x) is not type(y) or not same_args(x, y, same):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not same(x, y):
                return False
        elif not (x == y and type(x) is type(y)):
            return False
    return True


def same_view(x, y) -> bool:
    """Two tensors over the same memory with the same shape, strides and dtype."""
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.data_ptr() == y.data_ptr()
            and x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype)


def inputs(kind):
    q = bshd(2, 100, 8, 128)
    kv = bshd(2, 300, 2, 128)
    if kind == "kv_shared":
        return (q, kv, kv), {}
    if kind == "window_sink":
        return (q, kv, bshd(2, 300, 2, 128)), {"causal": True, "window_size": (63, 0), "learnable_sink": torch.randn(8)}
    if kind == "compressed":
        return (q, kv, kv), {"causal": True, "window_size": (127, 0), "compressed_kv": bshd(2, 20, 2, 128),
                             "compress_ratio": 4, "learnable_sink": torch.randn(8), "kv_start": 1000}
    return (q, kv, bshd(2, 300, 2, 128)), {"softmax_scale": 0.1}


def fresh_like(args, kw):
    """Other tensors of the same signature (K = V kept as one tensor)."""
    q, k, v = args
    k2 = bshd(*k.shape)
    v2 = k2 if v is k else bshd(*v.shape)
    kw2 = {n: (bshd(*x.shape) if x.dim() == 4 else torch.randn(x.shape)) if isinstance(x, torch.Tensor) else x
           for n, x in kw.items()}
    return (bshd(*q.shape), k2, v2), kw2


def planned_and_full(call, kernel, args, kw):
    """(what ``call(*args, **kw)``, a planned call, handed the kernel; what the full path hands it
    for the same tensors and outputs; the outputs)."""
    o, lse = call(*args, **kw)
    planned = kernel[-1]
    call_plan.clear()
    call(*args, **kw, out=o, lse_out=lse)
    return planned, kernel[-1], o, lse


@pytest.mark.parametrize("kind", ["plain", "kv_shared", "window_sink", "compressed"])
def test_a_planned_call_hands_the_kernel_what_the_full_path_does(kernel, kind):
    args, kw = inputs(kind)
    e_fused.forward(*args, **kw)
    assert call_plan.size() == 1
    args2, kw2 = fresh_like(args, kw)
    planned, full, o, lse = planned_and_full(e_fused.forward, kernel, args2, kw2)  # planned: the same signature
    assert planned[3] is o and planned[4] is lse and o.shape == args2[0].shape and lse.shape == (2, 8, 100)
    assert same_args(planned, full), (planned[5:], full[5:])


def test_the_comparison_rejects_a_plan_that_keeps_the_first_calls_tensor(kernel):
    """Negative control: a plan that did not put the call's sink in its slot hands the kernel
    the first call's sink, and the comparison above must see it."""
    args, kw = inputs("window_sink")
    e_fused.forward(*args, **kw)
    (plan,) = call_plan._PLANS.values()
    first_sink = kw["learnable_sink"]
    plan.tail, plan.slots = [first_sink if i == plan.slots[0][0] else a for i, a in enumerate(plan.tail)], ()
    planned, full, _, _ = planned_and_full(e_fused.forward, kernel, *fresh_like(args, kw))
    assert not same_args(planned, full)


def test_stages_c_and_d1_are_planned_too(kernel):
    for fwd, kw in ((c_online_softmax.forward, {}), (d1_smem_p.forward, {"p_in_smem": True})):
        call_plan.clear()
        q, k, v = bshd(1, 64, 4, 128), bshd(1, 64, 4, 128), bshd(1, 64, 4, 128)
        fwd(q, k, v, **kw)
        q2, k2, v2 = bshd(1, 64, 4, 128), bshd(1, 64, 4, 128), bshd(1, 64, 4, 128)
        o, lse = fwd(q2, k2, v2, **kw)
        planned = kernel[-1]
        call_plan.clear()
        fwd(q2, k2, v2, **kw, out=o, lse_out=lse)
        assert call_plan.size() == 1 and same_args(planned, kernel[-1])


def test_bad_input_after_a_good_call_is_still_refused(kernel):
    args, kw = inputs("window_sink")
    e_fused.forward(*args, **kw)
    q, k, v = args
    with pytest.raises(ValueError, match="16-byte aligned"):  # same signature, misaligned data pointer
        e_fused.forward(bshd(*q.shape, offset=1), k, v, **kw)
    with pytest.raises(ValueError, match="pack_gqa"):  # 1 is not True: the type is in the signature
        e_fused.forward(q, k, v, **kw, pack_gqa=1)
    e_fused.forward(q, k, v, **kw, pack_gqa=True)
    with pytest.raises(ValueError, match="pack_gqa"):
        e_fused.forward(q, k, v, **kw, pack_gqa=1)
    with pytest.raises(ValueError, match="learnable_sink"):
        e_fused.forward(q, k, v, **{**kw, "learnable_sink": torch.randn(8, dtype=torch.float64)})
    with pytest.raises(ValueError, match="out must be"):
        e_fused.forward(q, k, v, **kw, out=torch.empty(1))


def test_calls_whose_checks_read_values_are_never_planned(kernel):
    q, k = bshd(2, 100, 8, 128), bshd(2, 300, 2, 128)
    e_fused.forward(q, k, k, seqused_k=torch.tensor([300, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_k values"):  # checked again on every call
        e_fused.forward(q, k, k, seqused_k=torch.tensor([301, 10], dtype=torch.int32))
    assert call_plan.size() == 0


def test_a_plan_keeps_no_tensor_of_the_call_alive(kernel):
    args, kw = inputs("compressed")
    e_fused.forward(*args, **kw)
    refs = [weakref.ref(t) for t in (*args, *[x for x in kw.values() if isinstance(x, torch.Tensor)])]
    del args, kw
    kernel.clear()  # the recorder's own references
    gc.collect()
    assert call_plan.size() == 1 and all(r() is None for r in refs)


# ---- the library's entry (dsv4_attention.attention): plans keyed by the arguments as given ----

def entry_inputs(kind):
    args, kw = inputs(kind)
    kw.pop("kv_start", None)  # not an argument of the library's entry
    if kind == "kv_shared":
        args = args[:2] + (None,)  # v None: K = V
    return args, kw


@pytest.mark.parametrize("kind", ["plain", "kv_shared", "window_sink", "compressed"])
def test_the_entry_hands_the_kernel_what_the_full_path_does(kernel, kind):
    args, kw = entry_inputs(kind)
    dsv4_attention.attention(*args, **kw)
    assert len(call_plan._ENTRY) == 1
    args2, kw2 = fresh_like(args[:2] + (args[1] if args[2] is None else args[2],), kw)
    if args[2] is None:
        args2 = args2[:2] + (None,)
    planned, full, o, lse = planned_and_full(dsv4_attention.attention, kernel, args2, kw2)  # the entry's plan
    assert planned[3] is o and planned[4] is lse
    assert same_args(planned, full), (planned[5:], full[5:])


def test_the_entry_comparison_rejects_another_signatures_plan(kernel):
    """Negative control: the plan of a call with another window, filed under this call's key,
    hands the kernel that window's bounds, and the comparison above must see it."""
    args, kw = entry_inputs("window_sink")
    dsv4_attention.attention(*args, **{**kw, "window_size": (31, 0)})
    (wrong,) = call_plan._ENTRY.values()
    dsv4_attention.attention(*args, **kw)
    (key,) = [key for key, plan in call_plan._ENTRY.items() if plan is not wrong]
    call_plan._ENTRY[key] = wrong
    planned, full, _, _ = planned_and_full(dsv4_attention.attention, kernel, *fresh_like(args, kw))
    assert not same_args(planned, full)


def test_the_entry_still_refuses_bad_input_after_a_good_call(kernel):
    args, kw = entry_inputs("window_sink")
    q, k, v = args
    dsv4_attention.attention(q, k, v, **kw)
    dsv4_attention.attention(q, k, v, **kw)
    with pytest.raises(ValueError, match="16-byte aligned"):
        dsv4_attention.attention(bshd(*q.shape, offset=1), k, v, **kw)
    kw_int = {**kw, "window_size": (63, 0)}
    dsv4_attention.attention(q, k, v, **kw_int)
    with pytest.raises(ValueError, match="window_size left"):  # True is not 63, nor 1: types are in the key
        dsv4_attention.attention(q, k, v, **{**kw, "window_size": (True, 0)})
    dsv4_attention.attention(q, k, v, **{**kw, "window_size": (1, 0)})
    with pytest.raises(ValueError, match="window_size left"):
        dsv4_attention.attention(q, k, v, **{**kw, "window_size": (True, 0)})
    dsv4_attention.attention(q, k, v, **kw, pack_gqa=True)
    with pytest.raises(ValueError, match="pack_gqa"):
        dsv4_attention.attention(q, k, v, **kw, pack_gqa=1)
    with pytest.raises(ValueError, match="causal"):
        dsv4_attention.attention(q, k, v, **{**kw, "causal": 1})
    with pytest.raises(ValueError, match="out must be"):
        dsv4_attention.attention(q, k, v, **kw, out=torch.empty(1))
    dsv4_attention.attention(q, k, v, **{**kw, "window_size": [63, 0]})  # a list: no key, the full path serves it


def test_the_entry_files_a_plan_the_stage_made(kernel):
    """A signature first planned by the final stage's own forward is filed at the entry on its
    first entry call (the replayed plan), not recorded twice."""
    args, kw = entry_inputs("compressed")
    e_fused.forward(*args, **kw)
    (plan,) = call_plan._PLANS.values()
    dsv4_attention.attention(*args, **kw)
    assert list(call_plan._ENTRY.values()) == [plan] and call_plan.size() == 1


def test_the_entry_never_plans_calls_whose_checks_read_values(kernel):
    q, k = bshd(2, 100, 8, 128), bshd(2, 300, 2, 128)
    dsv4_attention.attention(q, k, seqused_k=torch.tensor([300, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_k values"):
        dsv4_attention.attention(q, k, seqused_k=torch.tensor([301, 10], dtype=torch.int32))
    assert call_plan.size() == 0 and not call_plan._ENTRY


# ---- split-KV calls (common/split_kv.py): planned as a SplitPlan, fresh partial buffers each call ----

# the kernel's arguments: q, k, v, o, lse, scale, then the seams' bundles (common/seams.py; call_args
# drops the stream): split-KV's SplitParts is the last
PARTS = 6 + seams.TAIL.index("partials")


def split_case():
    """A decode step: 2 requests x 1 token x 128 heads over 2048 keys, hd 512, K = V, a sink."""
    return bshd(2, 1, 128, 512), bshd(2, 2048, 1, 512), torch.randn(128)


def without_partials(args):
    return [a._replace(o=None, lse=None) if i == PARTS else a for i, a in enumerate(args)]


@pytest.mark.parametrize("num_splits", [3, None])
def test_a_split_call_is_planned_with_fresh_partial_buffers(kernel, num_splits):
    q, kv, sink = split_case()
    e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=num_splits)
    first = kernel[-1]
    chosen = call_plan.last_splits()
    # None: the library's choice for these shapes (4 units of 64 rows, 32 KV tiles, 132 SMs): 4
    expected = 3 if num_splits == 3 else split_kv.auto_splits(2, 1, 128, 1, 2048, 132)
    assert expected in (3, 4) and chosen == expected
    assert call_plan.size() == 1 and isinstance(next(iter(call_plan._PLANS.values())), call_plan.SplitPlan)
    q2, kv2, sink2 = bshd(*q.shape), bshd(*kv.shape), torch.randn(128)
    o, lse = e_fused.forward(q2, kv2, kv2, learnable_sink=sink2, num_splits=num_splits)  # planned
    planned = kernel[-1]
    assert call_plan.last_splits() == chosen and planned[3] is o and planned[4] is lse
    for f in ("o", "lse"):  # the plan's own buffers, new for each call, shaped as the full path's
        new, old = getattr(planned[PARTS], f), getattr(first[PARTS], f)
        assert new is not old and new.shape == old.shape
        assert new.shape[0] == chosen * 2 and new.dtype == torch.float32
    call_plan.clear()
    e_fused.forward(q2, kv2, kv2, learnable_sink=sink2, num_splits=num_splits, out=o, lse_out=lse)  # full path
    assert same_args(without_partials(planned), without_partials(kernel[-1]))
    assert planned[PARTS].num_splits == chosen


def test_a_planned_split_call_keeps_its_merge(kernel, monkeypatch):
    """The merge of a planned split call is resolved once (split_kv.merge_for, the compiled merge's
    lookup) and kept in its SplitPlan: the full path's call looks it up, the first replay once
    more, later replays never."""
    looked_up = []
    real = split_kv.merge_for
    monkeypatch.setattr(split_kv, "merge_for", lambda *a: looked_up.append(1) or real(*a))
    q, kv, sink = split_case()
    for _ in range(4):
        e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=3)
    (plan,) = call_plan._PLANS.values()
    assert isinstance(plan, call_plan.SplitPlan) and plan.merge is not None
    assert len(looked_up) == 2


def test_the_split_comparison_rejects_a_plan_with_another_split_count(kernel):
    """Negative control: a plan whose split count is not the call's hands the kernel partial
    buffers of the wrong size, and the comparison above must see it."""
    q, kv, sink = split_case()
    e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=3)
    (plan,) = call_plan._PLANS.values()
    plan.splits = 5
    o, lse = e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=3)
    planned = kernel[-1]
    assert planned[PARTS].o.shape[0] == 10  # 5 x 2: not the 3 x 2 the kernel's count asks for
    call_plan.clear()
    e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=3, out=o, lse_out=lse)
    assert planned[PARTS].o.shape != kernel[-1][PARTS].o.shape


def test_split_counts_are_part_of_the_signature(kernel):
    q, kv, sink = split_case()
    for n, expect in ((3, 3), (1, 1), (None, 4), (3, 3), (None, 4), (1, 1)):
        e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=n)
        assert call_plan.last_splits() == expect, n
    assert call_plan.size() == 3
    with pytest.raises(ValueError, match="num_splits"):  # refused before any launch, planned or not
        e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=True)


def test_the_entry_plans_split_calls(kernel):
    q, kv, sink = split_case()
    dsv4_attention.attention(q, kv, learnable_sink=sink, num_splits=None)
    assert call_plan.last_splits() == 4 and len(call_plan._ENTRY) == 1
    q2, kv2 = bshd(*q.shape), bshd(*kv.shape)
    o, lse = dsv4_attention.attention(q2, kv2, learnable_sink=sink, num_splits=None)  # the entry's plan
    planned = kernel[-1]
    assert planned[0] is q2 and planned[1] is kv2 and planned[3] is o and call_plan.last_splits() == 4
    assert planned[PARTS].o.shape[0] == 8


def test_a_split_plan_keeps_no_tensor_of_the_call_alive(kernel):
    q, kv, sink = split_case()
    e_fused.forward(q, kv, kv, learnable_sink=sink, num_splits=3)
    first = kernel[-1]
    refs = [weakref.ref(t) for t in (q, kv, sink, first[PARTS].o, first[PARTS].lse)]
    del q, kv, sink, first
    kernel.clear()
    gc.collect()
    assert call_plan.size() == 1 and all(r() is None for r in refs)


def decode_case():
    """A decode step over two MODEL1 FP8 caches (pages of 64 and of 2): 2 requests x 2 tokens x 64
    heads, each token's 64 + 128 listed slots."""
    from dsv4_attention.common import kv_cache

    win = kv_cache.quantize_kv_cache((torch.randn(3, 64, 1, 512) / 4).bfloat16())
    ext = kv_cache.quantize_kv_cache((torch.randn(40, 2, 1, 512) / 4).bfloat16())
    q = torch.randn(2, 2, 64, 512).bfloat16()
    return q, win, torch.randint(-1, 192, (2, 2, 64), dtype=torch.int32), ext, \
        torch.randint(-1, 80, (2, 2, 128), dtype=torch.int32)


def test_a_decode_step_is_planned_once_its_lists_are_the_engines(kernel, monkeypatch):
    """``decode`` in two launches (one_launch=False) with check_indices=False (an engine's own
    lists): its second step of the same shapes skips the checks (``resolve_masks`` is not reached)
    and hands the kernel the same arguments as the full path, the partial buffers being that
    step's own (each list's splits its slice of one buffer); with the lists checked, every step is
    validated."""
    q, win, idx, ext, ext_idx = decode_case()
    resolved = []
    real = interface.resolve_masks
    monkeypatch.setattr(interface, "resolve_masks", lambda *a, **k: resolved.append(1) or real(*a, **k))
    kw = {"extra_k_cache": ext, "extra_indices": ext_idx, "attn_sink": torch.randn(64), "num_splits": 2,
          "check_indices": False, "one_launch": False}
    e_fused.decode(q, win, idx, **kw)
    assert len(resolved) == 2 and call_plan.size() == 2  # one plan a list
    first = kernel[-2:]
    e_fused.decode(q, win, idx, **kw)  # planned: no checks
    assert len(resolved) == 2
    planned = kernel[-2:]
    for new, old in zip(planned, first, strict=True):
        assert new[PARTS].o is not old[PARTS].o and new[PARTS].o.shape == old[PARTS].o.shape
    window_part, extra_part = planned[0][PARTS].o, planned[1][PARTS].o
    assert extra_part.data_ptr() - window_part.data_ptr() == 2 * window_part[0].numel() * 4, "one buffer"
    call_plan.clear()
    e_fused.decode(q, win, idx, **kw)  # the full path on the same tensors
    for p_args, f_args in zip(planned, kernel[-2:], strict=True):  # decode's views are new each step
        assert same_args(without_partials(p_args)[:3] + without_partials(p_args)[5:],
                         without_partials(f_args)[:3] + without_partials(f_args)[5:], same_view)
    assert len(resolved) == 4
    call_plan.clear()
    for _ in range(2):
        e_fused.decode(q, win, idx, **{**kw, "check_indices": True})
    assert len(resolved) == 4 + 2 * 2  # every checked step resolves both lists


def test_decode_in_one_launch_hands_both_caches_to_one_kernel(kernel, monkeypatch):
    """``decode(one_launch=True)``: one launch whose entries bundle carries both caches' bytes and
    both lists (``Entries.extra`` / ``extra_topk``: the second cache's pages and lists as given, no
    copy), the sink in the kernel where it does not split (no partial buffers), and the engine's
    repeated step planned (no second resolve)."""
    from dsv4_attention.common import seams

    q, win, idx, ext, ext_idx = decode_case()
    resolved = []
    real = interface.resolve_masks
    monkeypatch.setattr(interface, "resolve_masks", lambda *a, **k: resolved.append(1) or real(*a, **k))
    sink = torch.randn(64)
    kw = {"extra_k_cache": ext, "extra_indices": ext_idx, "attn_sink": sink, "num_splits": 1,
          "check_indices": False, "one_launch": True}
    e_fused.decode(q, win, idx, **kw)
    assert len(kernel) == 1 and len(resolved) == 1
    args = kernel[-1]
    entries = args[6 + seams.TAIL.index("entries")]
    assert entries.extra.data_ptr() == ext.data_ptr() and entries.extra.shape[1] == ext.shape[0]
    assert entries.compressed.data_ptr() == win.data_ptr()
    assert torch.equal(entries.topk[0].view(2, 2, 64), idx) and torch.equal(entries.extra_topk[0].view(2, 2, 128),
                                                                            ext_idx)
    assert args[PARTS].o is None and args[6 + seams.TAIL.index("sink")] is sink
    e_fused.decode(q, win, idx, **kw)  # planned: no checks
    assert len(kernel) == 2 and len(resolved) == 1
    a, b = kernel  # decode's views and outputs are new each step: the same memory, O and LSE aside
    assert same_args(a[:3] + a[5:], b[:3] + b[5:], same_view)
