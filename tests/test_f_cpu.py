"""Stage F on the CPU: the float64 reference gradients, the Q-tile span, the call's checks and the
autograd routing, without a GPU.

- ``reference.attention_backward`` (the GPU tests' reference) equals torch.autograd through the
  forward reference on GQA, causal, windowed and K = V cases, with and without the sink (whose
  gradient it returns), and the forward reference itself passes torch.autograd.gradcheck (finite
  differences) on a tiny shape, the sink included; with a -inf sink and rows that see no key, the
  gradients are finite and those rows' are 0.
- ``span.q_tile_range`` visits exactly the Q tiles holding a query that sees one of the KV tile's
  keys, against every (query, key) pair; the negative control (the bottom-right offset dropped)
  is rejected by the same check. ``span.first_kv_tile`` is the first of a Q tile's visitors, which
  are consecutive; deterministic dQ's turns, played out with CTAs starting in block order, never
  deadlock (negative control: turns in reverse order do).
- ``backward`` refuses bad inputs with a ValueError naming them before any launch; ``attention``
  with inputs requiring grad goes to the autograd path where stage F serves the call and raises
  NotDifferentiableError (before any launch) where it does not.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_attention import attention
from dsv4_attention.common import reference
from dsv4_attention.common.autograd import NotDifferentiableError
from dsv4_attention.common.kv_span import row_keys
from dsv4_attention.stages import f_backward as stage
from dsv4_attention.stages.f_backward.span import first_kv_tile, key_queries, q_tile_range, visit

pytestmark = [pytest.mark.stage_f]


def leaves(seed: int, kv_shared: bool):
    """float64 q [2, 9, 4, 16], k and v [2, 13, 2, 16] (v is k where kv_shared) requiring grad, the
    generator that made them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 9, 4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 13, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = k if kv_shared else torch.randn(2, 13, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    return q, k, v, g


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window_size=(5, 3)), dict(window_size=(None, 2)),
                                  dict(kv_shared=True), dict(causal=True, kv_shared=True)],
                         ids=["full", "causal", "window", "right", "k_eq_v", "causal_k_eq_v"])
def test_reference_backward_is_autograds(case):
    kv_shared = case.pop("kv_shared", False)
    q, k, v, g = leaves(11, kv_shared)
    do = torch.randn(2, 9, 4, 16, dtype=torch.float64, generator=g)
    o, _ = reference.attention(q, k, v, 0.3, **case)
    o.backward(do)
    dq, dk, dv = reference.attention_backward(q.detach(), k.detach(), v.detach(), do, 0.3, **case)
    torch.testing.assert_close(dq, q.grad)
    torch.testing.assert_close(dk + dv if kv_shared else dk, k.grad)
    if not kv_shared:
        torch.testing.assert_close(dv, v.grad)


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window_size=(5, 3)), dict(kv_shared=True)],
                         ids=["full", "causal", "window", "k_eq_v"])
def test_reference_sink_backward_is_autograds(case):
    kv_shared = case.pop("kv_shared", False)
    q, k, v, g = leaves(12, kv_shared)
    sink = torch.tensor([0.5, -2.0, 3.0, 1.0], dtype=torch.float64, requires_grad=True)  # 3.0: the sink dominates
    do = torch.randn(2, 9, 4, 16, dtype=torch.float64, generator=g)
    o, _ = reference.attention(q, k, v, 0.3, learnable_sink=sink, **case)
    o.backward(do)
    dq, dk, dv, dsink = reference.attention_backward(q.detach(), k.detach(), v.detach(), do, 0.3,
                                                     learnable_sink=sink.detach(), **case)
    torch.testing.assert_close(dq, q.grad)
    torch.testing.assert_close(dk + dv if kv_shared else dk, k.grad)
    torch.testing.assert_close(dsink, sink.grad)
    if not kv_shared:
        torch.testing.assert_close(dv, v.grad)
    # negative control: the gradient without the sink in the normalizer is another one
    dq0, *_ = reference.attention_backward(q.detach(), k.detach(), v.detach(), do, 0.3, **case)
    assert not torch.allclose(dq0, q.grad)


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window_size=(4, 2))],
                         ids=["full", "causal", "window"])
def test_reference_backward_with_seqused_k_is_autograds(case):
    """seqused_k = [13, 11]: batch 1's last two keys hidden, its queries aligned to key 10 (the
    reference's visibility); their gradients 0. Autograd through the forward reference agrees."""
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 9, 4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 13, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 13, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    do = torch.randn(2, 9, 4, 16, dtype=torch.float64, generator=g)
    used = torch.tensor([13, 11], dtype=torch.int32)
    o, _ = reference.attention(q, k, v, 0.3, seqused_k=used, **case)
    o.backward(do)
    dq, dk, dv = reference.attention_backward(q.detach(), k.detach(), v.detach(), do, 0.3, seqused_k=used, **case)
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, theirs)
    assert (dk[1, 11:] == 0).all() and (dv[1, 11:] == 0).all()
    dq_full, *_ = reference.attention_backward(q.detach(), k.detach(), v.detach(), do, 0.3, **case)
    assert not torch.allclose(dq_full[1], dq[1])  # negative control: the lengths matter


def test_reference_sink_backward_with_empty_rows_and_a_minus_inf_sink():
    """Rows 0-2 see no key (causal, 6 queries over 3 keys); head 1's sink is -inf (FlashMLA's
    tests use it for 'no sink'): every gradient is finite, the empty rows' dQ is 0, a -inf sink's
    gradient is 0, and head 0's equals autograd's on the rows that see keys."""
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, n, 2, 8, dtype=torch.float64, generator=g) for n in (6, 3, 3, 6))
    sink = torch.tensor([0.7, -float("inf")], dtype=torch.float64)
    dq, dk, dv, dsink = reference.attention_backward(q, k, v, do, causal=True, learnable_sink=sink)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv, dsink))
    assert (dq[:, :3] == 0).all() and dsink[1] == 0
    s = sink.clone().requires_grad_(True)
    o, _ = reference.attention(q[:, 3:], k, v, causal=True, learnable_sink=s)  # the rows that see keys
    o.backward(do[:, 3:])
    torch.testing.assert_close(dsink[0], s.grad[0])


def test_forward_reference_with_sink_passes_gradcheck():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 2, 4, dtype=torch.float64, generator=g, requires_grad=True) for n in (3, 5, 5))
    sink = torch.tensor([0.2, -0.4], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: reference.attention(q, k, v, causal=True, learnable_sink=s)[0], (q, k, v, sink))


def test_reference_backward_of_an_empty_row_is_zero():
    q, k, v, do = (torch.randn(1, n, 2, 8, dtype=torch.float64) for n in (6, 3, 3, 6))
    dq, dk, dv = reference.attention_backward(q, k, v, do, causal=True)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (dq[:, :3] == 0).all()  # rows 0-2 sit before key 0 (bottom-right alignment)


def test_forward_reference_passes_gradcheck():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 2, 4, dtype=torch.float64, generator=g, requires_grad=True) for n in (3, 5, 5))
    assert torch.autograd.gradcheck(lambda q, k, v: reference.attention(q, k, v, causal=True)[0], (q, k, v))


def brute_tiles(n_block, sq, sk, left, right, tile_n=128, tile_m=64):
    off = sk - sq
    tiles = set()
    for j in range(n_block * tile_n, min((n_block + 1) * tile_n, sk)):
        for i in range(sq):
            p = i + off
            if (left is None or j >= p - left) and (right is None or j <= p + right):
                tiles.add(i // tile_m)
    return tiles


def span_failures(span) -> list:
    bad = []
    for sq, sk in ((1, 1), (64, 128), (300, 1000), (1000, 300), (129, 257), (700, 700)):
        for left, right in ((None, None), (None, 0), (0, 0), (127, 0), (50, 30), (None, 5), (0, None), (3000, 3000)):
            for n in range(-(-sk // 128) + 2):  # and tiles past the keys (seqused_k < the tensor's length)
                want = brute_tiles(n, sq, sk, left, right)
                lo, hi = span(n, 128, 64, sq, sk, left or 0, right or 0, left is not None, right is not None)
                got = set(range(lo, hi))
                # a visited tile may hold no visible pair only inside the span's hull
                if not want <= got or (want and got != set(range(min(want), max(want) + 1))) or (not want and got):
                    bad.append((sq, sk, left, right, n, sorted(want)[:3], (lo, hi)))
    return bad


def first_tile_failures(first) -> list:
    """Q tiles m whose first visiting KV tile (by q_tile_range, brute force over n) is not
    ``first(m, ...)``, over the span test's shapes and windows; also checks the visiting tiles are
    consecutive, which the deterministic order relies on."""
    bad = []
    for sq, sk in ((1, 1), (64, 128), (300, 1000), (1000, 300), (129, 257), (700, 700)):
        for left, right in ((None, None), (None, 0), (0, 0), (127, 0), (50, 30), (None, 5), (0, None), (3000, 3000)):
            visitors: dict = {}
            for n in range(-(-sk // 128)):
                lo, hi = q_tile_range(n, 128, 64, sq, sk, left or 0, right or 0, left is not None, right is not None)
                for m in range(lo, hi):
                    visitors.setdefault(m, []).append(n)
            for m, ns in visitors.items():
                got = first(m, 128, 64, sq, sk, left or 0, left is not None)
                if ns != list(range(ns[0], ns[-1] + 1)) or got != ns[0]:
                    bad.append((sq, sk, left, right, m, ns[:3], got))
    return bad


def test_first_kv_tile_is_the_first_visitor():
    assert not first_tile_failures(first_kv_tile)


def test_first_tile_checker_rejects_a_formula_without_the_offset():
    def no_offset(m, tile_n, tile_m, sq, sk, left, has_left):
        return first_kv_tile(m, tile_n, tile_m, sk, sk, left, has_left)

    assert first_tile_failures(no_offset)


def test_q_tile_range_is_the_visible_tiles():
    assert not span_failures(q_tile_range)


def test_span_checker_rejects_a_span_without_the_offset():
    def no_offset(n_block, tile_n, tile_m, sq, sk, left, right, has_left, has_right):
        return q_tile_range(n_block, tile_n, tile_m, sk, sk, left, right, has_left, has_right)

    assert span_failures(no_offset)


def cpu(d=128, grad=()):
    q = torch.randn(1, 8, 4, d).bfloat16()
    k, v = torch.randn(1, 16, 2, d).bfloat16(), torch.randn(1, 16, 2, d).bfloat16()
    for t in grad:
        {"q": q, "k": k, "v": v}[t].requires_grad_(True)
    return q, k, v


@pytest.mark.parametrize("bad", ["head_dim", "o_shape", "lse_dtype", "do_dtype", "stride", "device"])
def test_backward_names_bad_input(bad):
    q, k, v = cpu()
    o, do = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(1, 4, 8)
    args = dict(q=q, k=k, v=v, o=o, lse=lse, do=do)
    match = {"head_dim": "head_dim", "o_shape": "o must be", "lse_dtype": "lse must be", "do_dtype": "do must be",
             "stride": "k stride", "device": "CUDA"}[bad]
    if bad == "head_dim":
        args.update(q=q[..., :96].contiguous(), k=k[..., :96].contiguous(), v=v[..., :96].contiguous())
    elif bad == "o_shape":
        args["o"] = o[:, :4]
    elif bad == "lse_dtype":
        args["lse"] = lse.double()
    elif bad == "do_dtype":
        args["do"] = do.float()
    elif bad == "stride":
        args["k"] = torch.randn(1, 16, 2, 130).bfloat16()[..., :128]
    with pytest.raises(ValueError, match=match):
        stage.backward(**args)


@pytest.mark.parametrize("bad", ["rank", "seqused", "lse_shape", "do_shape"])
def test_varlen_backward_names_bad_input(bad):
    """A variable-length call: packed [total, heads, d] tensors, lse [heads, total_q] (the offsets'
    own checks, after the device's, are the GPU tests')."""
    q, k, v = (t[0] for t in cpu())
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.zeros(4, 8)
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 10, 16], dtype=torch.int32)
    args = dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    match = {"rank": "total_tokens", "seqused": "seqused_k with cu_seqlens_k", "lse_shape": "lse must be",
             "do_shape": "do must be"}[bad]
    if bad == "rank":
        args["q"] = q[None]
    elif bad == "seqused":
        args["seqused_k"] = torch.tensor([5, 6], dtype=torch.int32)
    elif bad == "lse_shape":
        args["lse"] = lse[:, :4]
    elif bad == "do_shape":
        args["do"] = do[:4]
    with pytest.raises(ValueError, match=match):
        stage.backward(**args)


def test_varlen_attention_routes_to_the_backward():
    """cu_seqlens are covered: with inputs that require grad, a variable-length call takes the
    differentiable path (on CPU tensors it names why stage F cannot serve them, not 'no backward')."""
    q, k, v = (t[0] for t in cpu())
    q.requires_grad_(True)
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 10, 16], dtype=torch.int32)
    with pytest.raises(NotDifferentiableError, match="attention cannot be differentiated here: .*CUDA"):
        attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_attention_with_grad_names_why_it_cannot_differentiate():
    q, k, v = cpu(grad=("q",))
    with pytest.raises(NotDifferentiableError, match="CUDA tensors"):
        attention(q, k, v)
    q, k, v = cpu(d=96, grad=("v",))
    with pytest.raises(NotDifferentiableError, match=r"head dims \(64, 128, 256\)"):
        attention(q, k, v)
    q, k, v = cpu(grad=("q",))
    with pytest.raises(NotDifferentiableError, match="serves"):
        attention(q.half().float(), k.float(), v.float())  # fp32: the backward serves bf16 / fp16


def test_the_sink_routes_to_the_backward():
    """A sink that requires grad (alone, q, k, v detached) takes the differentiable path: on these
    CPU tensors that path names why stage F cannot serve them, not 'no backward yet'."""
    q, k, v = cpu()
    sink = torch.zeros(4, requires_grad=True)
    with pytest.raises(NotDifferentiableError, match="attention cannot be differentiated here: .*CUDA"):
        attention(q, k, v, learnable_sink=sink)


def test_unsupported_options_are_still_refused():
    q, k, v = cpu(grad=("k",))
    with pytest.raises(NotDifferentiableError, match="attention has no backward yet, but k requires grad"):
        attention(q, k, v, out=torch.empty_like(q))
    with pytest.raises(NotDifferentiableError, match="attention has no backward yet"):
        attention(q, k, v, positions=torch.arange(8, dtype=torch.int32)[None])


def simulate_turns(sq, sk, left, right, group, resident, turn) -> bool:
    """Deterministic dQ's waits, played out: CTAs (one per KV tile, KV head 0, batch 0) start in
    block-index order, at most ``resident`` at a time; each walks its visits (``span.visit``'s
    order) and adds its dQ for (head, Q tile m) when that tile's counter equals ``turn(n, m,
    visitors[m])``, then increments it. True if every CTA finishes, False on a deadlock (no CTA
    can move)."""
    n_tiles = -(-sk // 128)
    todo, visitors = {}, {}
    for n in range(n_tiles):
        lo, hi = q_tile_range(n, 128, 64, sq, sk, left or 0, right or 0, left is not None, right is not None)
        todo[n] = [visit(it, 0, group, lo, hi - lo) for it in range(group * (hi - lo))]
        for m in range(lo, hi):
            visitors.setdefault(m, []).append(n)
    counters: dict = {}
    pending, running = list(range(n_tiles)), []
    while pending or running:
        while pending and len(running) < resident:
            running.append(pending.pop(0))
        moved = False
        for n in list(running):
            while todo[n]:
                head, m = todo[n][0]
                if counters.get((head, m), 0) != turn(n, m, visitors[m]):
                    break
                counters[(head, m)] = counters.get((head, m), 0) + 1
                todo[n].pop(0)
                moved = True
            if not todo[n]:
                running.remove(n)
                moved = True
        if not moved:
            return False
    return True


@pytest.mark.parametrize("resident", [1, 3])
def test_deterministic_turns_cannot_deadlock(resident):
    """With the kernel's turn (n - first_kv_tile(m)) every CTA finishes however few are resident,
    for causal, windowed and full masks and GQA; the negative control (turns in reverse KV-tile
    order, which waits for CTAs that start later) deadlocks with one CTA resident at a time."""
    for sq, sk, left, right, group in ((700, 1000, None, 0, 2), (300, 1300, 300, 50, 1), (640, 900, None, None, 4),
                                       (129, 1000, 0, None, 2)):
        def kernel_turn(n, m, _visitors, sq=sq, sk=sk, left=left):
            return n - first_kv_tile(m, 128, 64, sq, sk, left or 0, left is not None)

        assert simulate_turns(sq, sk, left, right, group, resident, kernel_turn)
        assert not simulate_turns(sq, sk, left, right, group, 1, lambda n, m, v: max(v) - n)


@pytest.mark.parametrize("lens", [([0, 0], [10, 6]), ([3, 5], [0, 0]), ([3, 5], [10, 6])],
                         ids=["no-query-rows", "no-keys", "control"])
def test_varlen_backward_without_rows_or_keys_launches_nothing(monkeypatch, lens):
    """A variable-length batch without a query row (or without a key) in any request has nothing to
    differentiate: the kernel's grid (KV tiles of the longest request) could be 0 CTAs, a launch
    error. Every gradient is 0, nothing launches. Control: rows and keys launch once. (The kernel is
    a recorder; sm90 is taken for CPU tensors.)"""
    from dsv4_attention.common import jit

    calls = []
    monkeypatch.setattr(stage, "arch_of_device", lambda device: "sm90")
    monkeypatch.setattr(jit, "launch", lambda *a, **k: calls.append(a))
    q_lens, k_lens = lens
    cu_q = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, k_lens[0], sum(k_lens)], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 128).bfloat16(), torch.randn(16, 2, 128).bfloat16(), torch.randn(16, 2, 128).bfloat16()
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.zeros(4, 8)
    dq, dk, dv = stage.backward(q, k, v, o, lse, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert len(calls) == (1 if all(map(sum, lens)) else 0)
    if not all(map(sum, lens)):
        assert not dq.any() and not dk.any() and not dv.any()


def key_query_failures(rule, stop_at_first: bool = False) -> list:
    """(key, p0, ...) where ``rule``'s bounds disagree with the forward's per-row rule
    (``row_keys``) on whether query q of a 64-query tile sees the key, over keys and positions on
    both sides of every bound, windows from 0 to past the sequence, and keys past seqlen_k."""
    bad = []
    for sk in (1, 100, 1000):
        for left, right in ((None, None), (None, 0), (0, 0), (127, 0), (50, 30), (None, 5), (0, None), (3000, 3000)):
            for key in (0, 63, 64, 99, 100, 101, 999, 1200):
                for p0 in (-200, -1, 0, 37, 99, 980, 1100):
                    first, last = rule(key, p0, sk, left or 0, right or 0, left is not None, right is not None, 64)
                    for q in range(64):
                        lo, hi = row_keys(p0 + q, sk, left or 0, right or 0, left is not None, right is not None)
                        sees = key < hi and (lo is None or key >= lo)
                        if sees != (first <= q <= last):
                            bad.append((sk, left, right, key, p0, q))
                            if stop_at_first:
                                return bad
    return bad


def test_key_queries_is_the_forward_rule():
    """The sm100 backward's mask (one key a thread, its queries against two bounds) hides exactly
    what the forward's per-row rule hides."""
    assert not key_query_failures(key_queries)


def test_key_query_checker_rejects_an_off_by_one():
    def late(key, p0, sk, left, right, has_left, has_right, tile_m):
        first, last = key_queries(key, p0, sk, left, right, has_left, has_right, tile_m)
        return first, last - 1

    assert key_query_failures(late, stop_at_first=True)


@pytest.mark.parametrize("head_dim,deterministic,match", [(64, False, "head dims"), (64, True, "head dims")])
def test_sm100_refuses_what_its_kernel_lacks(monkeypatch, head_dim, deterministic, match):
    """On sm100 (the device's arch patched in; nothing launches) head dim 64 is refused by name, after
    the other checks, in either mode (the deterministic one is served at head dim 128)."""
    monkeypatch.setattr(stage, "arch_of_device", lambda device: "sm100")
    q = torch.randn(1, 70, 2, head_dim, dtype=torch.bfloat16)
    k = torch.randn(1, 90, 1, head_dim, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 70)
    with pytest.raises(ValueError, match=match):
        stage.backward(q, k, k, q.clone(), lse, q.clone(), deterministic=deterministic)
