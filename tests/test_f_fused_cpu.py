"""The torch-composed backward of stage E's attention (stages/f_backward/fused.py) on the CPU: the
gradients of DeepSeek-V4's layer (a window over the raw keys, compressed entries: all visible
ones or each token's top-k list, the sink) against torch.autograd through the float64 reference
(``reference.fused_attention``): GQA, K = V and separate V, causal, windows with left and right
bounds, more queries than keys (rows with no raw key), a -inf sink (gradient 0; autograd: NaN)
and a dominant one, a top-k entry listed twice, chunks of one query and of all. Negative
control: the backward told another compress_ratio (other entries visible) fails the check."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attention.common import reference
from dsv4_attention.stages.f_backward import fused


def failures(seed: int, mode, kv_shared: bool, chunk_bytes: int, sq: int = 11, wrong_ratio: bool = False,
             hk: int | None = None, backward_drops: tuple = (), **mask) -> list:
    """Where fused_backward differs from autograd through the float64 reference. ``mask``: options of
    both (window, causal, seqused_k, positions, kv_start); ``backward_drops``: of those, the ones
    the backward is not told (a negative control)."""
    g = torch.Generator().manual_seed(seed)
    b, sk, h, d, nc = 2, 17, 4, 8, 5
    if hk is None:
        hk = 1 if mode == "csa" else 2  # the reference's top-k gather reads kv head 0 (DeepSeek-V4: one)
    q = torch.randn(b, sq, h, d, dtype=torch.float64, generator=g, requires_grad=True)
    kv = torch.randn(b, sk, hk, d, dtype=torch.float64, generator=g, requires_grad=True)
    v = kv if kv_shared else torch.randn(b, sk, hk, d, dtype=torch.float64, generator=g, requires_grad=True)
    ckv = torch.randn(b, nc, hk, d, dtype=torch.float64, generator=g, requires_grad=True)
    sink = torch.tensor([0.5, -math.inf, 3.0, -1.0], dtype=torch.float64, requires_grad=True)
    topk = None
    if mode == "csa":
        topk = torch.randint(-1, nc, (b, sq, 3), generator=g, dtype=torch.int32)
        topk[0, 5, 1] = topk[0, 5, 0]  # one entry listed twice: both count
    entries = dict(compressed_kv=ckv, compress_ratio=4, topk_indices=topk) if mode else {}
    o, lse = reference.fused_attention(q, kv, None if kv_shared else v, softmax_scale=0.3, learnable_sink=sink,
                                       **entries, **mask)
    do = torch.randn(b, sq, h, d, dtype=torch.float64, generator=g)
    (o * do).sum().backward()
    given = {n: (x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x) for n, x in entries.items()}
    if wrong_ratio:  # the negative control: the entries' visibility of another ratio
        given["compress_ratio"] = 5
    told = {n: x for n, x in mask.items() if n not in backward_drops}
    dq, dk, dv, dc, ds = fused.fused_backward(q.detach(), kv.detach(), v.detach(), o.detach(), lse.detach(), do,
                                              softmax_scale=0.3, learnable_sink=sink.detach(),
                                              chunk_bytes=chunk_bytes, **given, **told)
    checks = [("dq", dq, q.grad), ("dkv", dk + dv if kv_shared else dk, kv.grad)]
    if not kv_shared:
        checks.append(("dv", dv, v.grad))
    if mode:
        checks.append(("dcompressed", dc, ckv.grad))
    return grad_failures(checks, ds, sink)


def grad_failures(checks, ds, sink) -> list:
    """The gradients of ``checks`` ((name, ours, autograd's)) that differ from autograd's in float64,
    and the sink's (``ds`` against ``sink.grad``: equal where the sink is finite, 0 where -inf,
    where autograd gives NaN)."""
    bad = []
    for name, ours, ref in checks:
        if not torch.allclose(ours, ref, rtol=1e-9, atol=1e-12):
            bad.append((name, (ours - ref).abs().max().item()))
    finite = torch.isfinite(sink.detach())
    if not torch.allclose(ds.double()[finite], sink.grad[finite], rtol=1e-6) or ds[~finite].any():
        bad.append(("dsink", ds.tolist(), sink.grad.tolist()))
    return bad


MASKS = [dict(), dict(causal=True), dict(window_size=(3, 0)), dict(window_size=(2, 1))]


@pytest.mark.parametrize("mask", MASKS, ids=["full", "causal", "window_3_0", "window_2_1"])
@pytest.mark.parametrize("mode", [None, "hca", "csa"], ids=["window_only", "hca", "csa"])
@pytest.mark.parametrize("kv_shared", [True, False], ids=["k_eq_v", "separate_v"])
def test_fused_backward_is_autograds(mode, kv_shared, mask):
    for chunk_bytes in (1, 1 << 30):
        bad = failures(1, mode, kv_shared, chunk_bytes, **mask)
        assert not bad, (chunk_bytes, bad)


@pytest.mark.parametrize("mode", ["hca", "csa"])
def test_rows_with_no_raw_key(mode):
    """More queries than keys under causal: the first rows see no raw key (only entries, or nothing)."""
    bad = failures(3, mode, True, 1 << 30, sq=23, causal=True)
    assert not bad, bad


def test_checker_rejects_another_ratios_visibility():
    assert failures(1, "hca", True, 1 << 30, wrong_ratio=True, causal=True)


#: the queries placed in the keys' frame otherwise than bottom-right: a prefill chunk's absolute
#: positions (per batch, and with kv holding a sequence's last rows), keys per request
FRAMES = {
    "positions": dict(positions=torch.arange(11, dtype=torch.int32) + 3),
    "positions_per_batch": dict(positions=torch.stack([torch.arange(11) + 1, torch.arange(11) * 2]).int()),
    "kv_start": dict(positions=torch.arange(11, dtype=torch.int32) + 24, kv_start=20),
    "seqused_k": dict(seqused_k=torch.tensor([9, 17], dtype=torch.int32)),
    "seqused_k_positions": dict(seqused_k=torch.tensor([6, 17], dtype=torch.int32),
                                positions=torch.arange(11, dtype=torch.int32) + 2),
}


@pytest.mark.parametrize("frame", list(FRAMES), ids=list(FRAMES))
@pytest.mark.parametrize("mode", [None, "hca", "csa"], ids=["window_only", "hca", "csa"])
def test_placed_queries_go_through_the_lists(mode, frame):
    """seqused_k, positions and kv_start (DeepSeek-V4's prefill chunks, requests of fewer keys): the
    layer's backward through ``layer_as_lists`` in that frame (the torch form of index mode here;
    on Hopper at head dim 512 its kernel) equals autograd through the float64 reference, rows with
    no visible key included (positions before the first key). Negative control: the backward not
    told the frame."""
    for chunk_bytes in (1, 1 << 30):
        bad = failures(2, mode, True, chunk_bytes, hk=1, window_size=(3, 0), **FRAMES[frame])
        assert not bad, (chunk_bytes, bad)
    assert failures(2, mode, True, 1 << 30, hk=1, window_size=(3, 0), backward_drops=tuple(FRAMES[frame]),
                    **FRAMES[frame])


def test_placed_queries_outside_the_lists_form_are_refused():
    """positions where the layer lacks index mode's form (separate V; no left bound) have no backward:
    a ValueError naming the rule, never gradients in the wrong frame."""
    with pytest.raises(ValueError, match="lists_cover"):
        failures(2, "hca", False, 1 << 30, hk=1, window_size=(3, 0), **FRAMES["positions"])
    with pytest.raises(ValueError, match="lists_cover"):
        failures(2, "hca", True, 1 << 30, hk=1, causal=True, **FRAMES["positions"])


def test_composed_covers_reads_tensor_options():
    """The rule that routes a call to this backward reads its options by whether they are given:
    a tensor option (seqused_k, offsets of many requests) declines the call, it is never compared
    elementwise (``tensor in (None, 0)`` raised on the device: the call then failed instead of
    being routed); kv_start 0 and None are not given, kv_start 5 is."""
    from dsv4_attention.common.autograd import composed_covers

    q = torch.zeros(1, 4, 2, 64)
    for name in ("seqused_k", "cu_seqlens_q", "cu_seqlens_k", "positions", "out", "lse_out"):
        assert composed_covers(q, "hd 512", True, {name: torch.tensor([3, 4, 5])}) is False
    assert composed_covers(q, "hd 512", True, {"num_splits": 2}) is False
    assert composed_covers(q, "hd 512", True, {"kv_start": 5}) is False
    # every option absent or 0: only the device decides (a CPU q is never the composed backward's)
    assert composed_covers(q, "hd 512", True, {"kv_start": 0, "seqused_k": None, "num_splits": 1}) is False
    with pytest.raises(RuntimeError, match="ambiguous"):  # the comparison the rule must not make
        bool(torch.tensor([3, 4, 5]) not in (None, 0))


def test_the_queries_frame_is_covered_only_in_the_lists_form():
    """seqused_k, positions, kv_start and a variable-length batch's offsets reach the composed
    backward only where the call has index mode's form and the caller passes them on
    (``attention``: ``lists_form``); ``out`` and splits never; the ops (which do not pass them) keep
    refusing them."""
    from dsv4_attention.common.autograd import composed_options_covered

    t = torch.tensor([3, 4, 5])
    for name, value in (("seqused_k", t), ("positions", t), ("kv_start", 5), ("cu_seqlens_q", t),
                        ("cu_seqlens_k", t), ("cu_seqlens_compressed", t)):
        assert composed_options_covered({name: value}) is False
        assert composed_options_covered({name: value}, lists_form=True) is True
    for name in ("out", "lse_out"):
        assert composed_options_covered({name: t}, lists_form=True) is False
    assert composed_options_covered({"num_splits": 2}, lists_form=True) is False
    assert composed_options_covered({"kv_start": 0, "num_splits": 1}) is True


def test_lists_cover_is_index_modes_form():
    """``fused.lists_cover``: K = V in one memory, one kv head, both window bounds, lists within
    MAX_LIST; each condition broken alone declines."""
    q = torch.zeros(1, 4, 2, 8)
    kv = torch.zeros(1, 10, 1, 8)
    ckv = torch.zeros(1, 3, 1, 8)
    assert fused.lists_cover(q, kv, kv, ckv, None, True, (127, None))
    assert not fused.lists_cover(q, kv, kv.clone(), ckv, None, True, (127, None))  # V its own memory
    assert not fused.lists_cover(q, torch.zeros(1, 10, 2, 8), torch.zeros(1, 10, 2, 8), ckv, None, True, (3, 0))
    assert not fused.lists_cover(q, kv, kv, ckv, None, False, (127, None))  # no right bound
    assert not fused.lists_cover(q, kv, kv, ckv, None, True, (None, 0))  # no left bound
    assert not fused.lists_cover(q, kv, kv, torch.zeros(1, fused.MAX_LIST, 1, 8), None, True, (127, 0))
    assert fused.lists_cover(q, kv, kv, torch.zeros(1, fused.MAX_LIST, 1, 8), torch.zeros(1, 4, 512), True, (127, 0))


@pytest.mark.parametrize("mode", [None, "hca", "csa"])
@pytest.mark.parametrize("window", [(3, 0), (2, 1), (20, 0)], ids=["causal3", "left2right1", "longer_than_keys"])
def test_layer_as_lists_is_the_layer(mode, window):
    """DeepSeek-V4's layer as index mode (``fused.layer_as_lists``: every query's window keys and
    visible entries as one list into one pool), its gradients by index mode's torch form, equal to
    the layer's torch-composed backward in float64: the lists' construction (window edges, rows
    with no raw key, the entries' visibility, a top-k entry listed twice, -1) is the layer's. The
    kernel path runs this on a GPU; here the construction is what is checked. Negative control:
    the lists built for another compress_ratio differ in their gradients."""

    g = torch.Generator().manual_seed(7)
    b, sq, sk, h, d, nc = 2, 11, 17, 4, 8, 5
    q = torch.randn(b, sq, h, d, dtype=torch.float64, generator=g)
    kv = torch.randn(b, sk, 1, d, dtype=torch.float64, generator=g)
    ckv = torch.randn(b, nc, 1, d, dtype=torch.float64, generator=g) if mode else None
    topk = None
    if mode == "csa":
        topk = torch.randint(-1, nc, (b, sq, 3), generator=g, dtype=torch.int32)
        topk[0, 5, 1] = topk[0, 5, 0]
    sink = torch.tensor([0.5, -math.inf, 3.0, -1.0], dtype=torch.float64)
    left, right = window
    mask = {"window_size": (left, right)}
    entries = dict(compressed_kv=ckv, compress_ratio=4, topk_indices=topk) if mode else {}
    o, lse = reference.fused_attention(q, kv, None, softmax_scale=0.3, learnable_sink=sink, **entries, **mask)
    do = torch.randn(b, sq, h, d, dtype=torch.float64, generator=g)
    want = fused.fused_backward(q, kv, kv, o, lse, do, softmax_scale=0.3, learnable_sink=sink, **entries, **mask)

    def through_lists(ratio):
        lists = fused.layer_as_lists(q, kv, kv, ckv, ratio, topk, False, (left, right), kernel_only=False)
        assert lists is not None
        dq, dk, dv, dc, dsink = fused.by_lists(q, kv, kv, o, lse, do, ckv, lists, 0.3, sink)
        assert not dv.any()
        return dq, dk, dc, dsink

    got = through_lists(4)
    # the outputs share no memory: f_fused_backward's custom op refuses outputs that alias (a GPU
    # test caught dk and dcompressed as two views of one buffer, 2026-12-01)
    storages = [t.untyped_storage().data_ptr() for t in got if t is not None]
    assert len(set(storages)) == len(storages)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1] + want[2])  # K = V: the keys' and the values' gradients
    if mode:
        torch.testing.assert_close(got[2], want[3])
        bad = through_lists(2)  # negative control: other entries visible
        assert not torch.allclose(bad[0], want[0])
    torch.testing.assert_close(got[3], want[4])


def varlen_failures(seed: int, mode, positions: bool = False, wrong_split: bool = False) -> list:
    """A variable-length batch (requests of 5, 0, 7 and 3 queries over 9, 4, 12 and 2 keys; the
    default floor(keys / 4) entries a request, 0 for the last) through fused_backward's packed
    path against autograd through the float64 reference of each request alone (docs/function.md:
    every rule per request; top-k lists local to the request). ``wrong_split``: the backward told
    offsets that move a key to the next request (the negative control)."""
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens, h, d, ratio = [5, 0, 7, 3], [9, 4, 12, 2], 4, 8, 4
    e_lens = [k // ratio for k in k_lens]
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (q_lens, k_lens, e_lens)]
    cu_q, cu_k, cu_c = cu
    tq, tk, tc = sum(q_lens), sum(k_lens), sum(e_lens)
    q = torch.randn(tq, h, d, dtype=torch.float64, generator=g, requires_grad=True)
    kv = torch.randn(tk, 1, d, dtype=torch.float64, generator=g, requires_grad=True)
    ckv = torch.randn(tc, 1, d, dtype=torch.float64, generator=g, requires_grad=True) if mode else None
    sink = torch.tensor([0.5, -math.inf, 3.0, -1.0], dtype=torch.float64, requires_grad=True)
    topk = None
    if mode == "csa":
        topk = torch.cat([torch.randint(-1, max(e, 0), (n, 3), generator=g, dtype=torch.int32)
                          for n, e in zip(q_lens, e_lens, strict=True)])
    pos = torch.cat([torch.arange(n, dtype=torch.int32) + 2 * r for r, n in enumerate(q_lens)]) if positions else None
    outs, lses = [], []
    for r in range(len(q_lens)):
        qs, ks, cs = (slice(int(c[r]), int(c[r + 1])) for c in cu)
        if q_lens[r] == 0:
            continue
        extra = dict(compressed_kv=ckv[None, cs], compress_ratio=ratio) if mode else {}
        if topk is not None:
            extra["topk_indices"] = topk[None, qs]
        if pos is not None:
            extra["positions"] = pos[qs]
        o_r, lse_r = reference.fused_attention(q[None, qs], kv[None, ks], window_size=(3, 0), learnable_sink=sink,
                                               softmax_scale=0.3, **extra)
        outs.append(o_r[0])
        lses.append(lse_r[0])
    o, lse = torch.cat(outs), torch.cat(lses, dim=-1)
    do = torch.randn(tq, h, d, dtype=torch.float64, generator=g)
    (o * do).sum().backward()
    told_k = cu_k.clone()
    if wrong_split:
        told_k[1] += 1
    entries = dict(compressed_kv=ckv.detach(), compress_ratio=ratio, topk_indices=topk) if mode else {}
    dq, dk, dv, dc, ds = fused.fused_backward(q.detach(), kv.detach(), kv.detach(), o.detach(), lse.detach(), do,
                                              softmax_scale=0.3, window_size=(3, 0), learnable_sink=sink.detach(),
                                              cu_seqlens_q=cu_q, cu_seqlens_k=told_k, positions=pos, **entries)
    checks = [("dq", dq, q.grad), ("dkv", dk + dv, kv.grad)] + ([("dcompressed", dc, ckv.grad)] if mode else [])
    return grad_failures(checks, ds, sink)


@pytest.mark.parametrize("positions", [False, True], ids=["bottom_right", "positions"])
@pytest.mark.parametrize("mode", [None, "hca", "csa"], ids=["window_only", "hca", "csa"])
def test_variable_length_batches_go_through_the_lists(mode, positions):
    bad = varlen_failures(4, mode, positions)
    assert not bad, bad


def test_varlen_checker_rejects_other_offsets():
    assert varlen_failures(4, "hca", wrong_split=True)
