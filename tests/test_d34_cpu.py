"""Stages D3 and D4 on the CPU: the sm90 kernels' compile budgets, argument validation (lengths,
windows) before anything launches, and the span arithmetic of common/kv_span.py against the
plain visibility formula and the reference's mask. (The sm100 kernels' budgets and mask proofs
are in tests/test_d34_sm100_host.py.)"""

import math
import random

import cutlass
import pytest
import torch

from dsv4_attention.common import kv_span
from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.common.reference import visibility
from dsv4_attention.common.validation import check_cu_seqlens, check_seqused_k, check_window
from dsv4_attention.stages import d3_lengths, d4_causal_window

CASES = [
    ("d3", 512, {"kv_shared": True, "pack_group": 128, "seqused_k": True}),
    ("d3", 128, {"kv_shared": False, "pack_group": 8, "seqused_k": True}),
    ("d4", 512, {"kv_shared": True, "pack_group": 128, "seqused_k": True, "has_left": True, "has_right": True}),
    ("d4", 256, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True}),
    ("d4", 128, {"kv_shared": False, "has_right": True}),
    ("d4", 64, {"kv_shared": False, "has_right": True}),
    ("d4", 384, {"kv_shared": False, "has_left": True, "has_right": True}),
    # variable-length batches (cu_seqlens): request offsets and the row-by-row O store of a straddling tile
    ("d3", 512, {"kv_shared": True, "pack_group": 128, "varlen": True}),
    ("d3", 128, {"kv_shared": False, "pack_group": 8, "varlen": True}),
    ("d3", 384, {"kv_shared": False, "varlen": True}),
    ("d4", 512, {"kv_shared": True, "pack_group": 64, "varlen": True, "has_left": True, "has_right": True}),
    ("d4", 64, {"kv_shared": False, "varlen": True, "has_right": True}),
]


@pytest.mark.compile
@pytest.mark.arch("sm90")
@pytest.mark.parametrize("stage_id,head_dim,options", [
    pytest.param(s, d, o, id=f"{s}-hd{d}-{o}", marks=getattr(pytest.mark, f"stage_{s}")) for s, d, o in CASES])
def test_sm90_compiles_within_budget(stage_id, head_dim, options):
    assert_within_budget(stage_id, "sm90", "bfloat16", head_dim, options=options)


@pytest.mark.stage_d3
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_kernels_refuse_seqused_k_with_varlen(arch):
    import importlib

    from dsv4_attention.common.arch import target_arch

    cls = getattr(importlib.import_module(f"dsv4_attention.stages.d3_lengths.{arch}"),
                  f"FlashAttentionD3{arch.capitalize()}")
    with target_arch(arch):
        with pytest.raises(ValueError, match="seqused_k with varlen"):
            cls(cutlass.BFloat16, 128, seqused_k=True, varlen=True)
        assert cls(cutlass.BFloat16, 128, seqused_k=True).uses_seqused_k  # either alone is served
        assert cls(cutlass.BFloat16, 128, varlen=True).varlen


@pytest.mark.stage_d3
@pytest.mark.parametrize("bad, match", [
    (torch.tensor([3, 51], dtype=torch.int32), "values must lie"),
    (torch.tensor([3, -1], dtype=torch.int32), "values must lie"),
    (torch.tensor([3, 4], dtype=torch.int64), "int32"),
    (torch.tensor([3], dtype=torch.int32), "shape"),
    ([3, 4], "torch.Tensor"),
])
def test_seqused_k_checks(bad, match):
    with pytest.raises(ValueError, match=match):
        check_seqused_k(bad, 2, 50, torch.device("cpu"))
    check_seqused_k(torch.tensor([0, 50], dtype=torch.int32), 2, 50, torch.device("cpu"))  # both ends legal


@pytest.mark.stage_d4
@pytest.mark.parametrize("causal, window, match", [
    (False, (-1, 0), "left must be an int >= 0"),
    (False, (0, -1), "right must be an int >= 0"),
    (False, (1.5, 0), "left must be an int"),
    (False, (True, 0), "left must be an int"),
    (False, (3,), "pair"),
    (True, (3, 2), "causal=True means window right = 0"),
    (1, (None, None), "causal must be a bool"),
])
def test_window_checks(causal, window, match):
    with pytest.raises(ValueError, match=match):
        check_window(causal, window)
    assert check_window(True, (127, None)) == (127, 0) and check_window(False, None) == (None, None)


@pytest.mark.stage_d4
def test_bad_windows_are_refused_before_the_device_check():
    q = torch.randn(1, 8, 2, 128).bfloat16()
    k = torch.randn(1, 30, 1, 128).bfloat16()
    with pytest.raises(ValueError, match="window_size left"):
        d4_causal_window.forward(q, k, k, window_size=(-1, 0))
    with pytest.raises(ValueError, match="CUDA device"):  # every argument check passed; only the device is wrong
        d4_causal_window.forward(q, k, k, causal=True, window_size=(127, 0))
    with pytest.raises(ValueError, match="CUDA device"):
        d3_lengths.forward(q, k, k, seqused_k=torch.tensor([5], dtype=torch.int32))


def brute_span(t_lo, t_hi, sq, sk, left, right):
    keys = [j for i in range(t_lo, t_hi + 1) for j in range(sk) if kv_span.visible(i, j, sq, sk, left, right)]
    return (min(keys), max(keys) + 1) if keys else None


@pytest.mark.stage_d4
def test_span_covers_every_visible_key_and_unmasked_tiles_are_all_visible():
    rnd = random.Random(1234)
    for _ in range(400):
        sq, sk = rnd.randint(1, 300), rnd.randint(1, 300)
        left = rnd.choice([None, 0, 3, 127, 1000])
        right = rnd.choice([None, 0, 2, 1000])
        group, tile_m, tile_n = rnd.choice([(1, 128, 128), (8, 128, 128), (128, 64, 64), (4, 192, 128), (2, 128, 80)])
        rows = sq * group
        for m in range(-(-rows // tile_m)):
            t_lo, t_hi = kv_span.tile_tokens(m, tile_m, group, sq)
            origin, n = kv_span.key_span(t_lo, t_hi, sq, sk, tile_n, left or 0, right or 0, left is not None,
                                         right is not None)
            want = brute_span(t_lo, t_hi, sq, sk, left, right)
            if want is None:
                assert n == 1  # one wholly masked tile: O = 0, LSE = -inf
                continue
            assert origin <= want[0] and origin + n * tile_n >= want[1] and origin + (n - 1) * tile_n < want[1]
            assert origin == want[0] or left is None and origin == 0
            for t in range(n):
                a = origin + t * tile_n
                needs = kv_span.tile_needs_mask(a, t_lo, t_hi, sq, sk, tile_n, left or 0, right or 0,
                                                left is not None, right is not None)
                if not needs:
                    assert all(kv_span.visible(i, j, sq, sk, left, right)
                               for i in range(t_lo, t_hi + 1) for j in range(a, a + tile_n))


@pytest.mark.stage_d4
def test_span_checker_rejects_a_span_that_ignores_the_alignment():
    """Negative control: a span computed as if seqlen_q == seqlen_k misses visible keys."""
    sq, sk, left, right = 10, 200, 5, 0
    t_lo, t_hi = kv_span.tile_tokens(0, 128, 1, sq)
    origin, n = kv_span.key_span(t_lo, t_hi, sk, sk, 64, left, right, True, True)  # wrong seqlen_q
    want = brute_span(t_lo, t_hi, sq, sk, left, right)
    assert not (origin <= want[0] and origin + n * 64 >= want[1])


@pytest.mark.stage_d4
def test_visibility_formula_matches_reference_mask_and_flops():
    for sq, sk, causal, window in [(5, 9, True, (None, None)), (9, 5, False, (2, 1)), (7, 7, True, (3, None))]:
        left, right = check_window(causal, window)
        ref = visibility(sq, sk, None, (left, right))[0, 0]
        mine = torch.tensor([[kv_span.visible(i, j, sq, sk, left, right) for j in range(sk)] for i in range(sq)])
        assert torch.equal(ref, mine)
        assert d4_causal_window.visible_pairs(sq, sk, causal, window) == int(mine.sum())


def i32(*x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.stage_d3
@pytest.mark.parametrize("cu_q, cu_k, kwargs, match", [
    (i32(0, 3, 7), None, {}, "go together"),
    (i32(0, 4, 3), i32(0, 5, 11), {}, "non-decreasing"),
    (i32(1, 3, 7), i32(0, 5, 11), {}, r"\[0\] must be 0"),
    (i32(0, 3, 8), i32(0, 5, 11), {}, "exceeds"),
    (i32(0, 3, 7).long(), i32(0, 5, 11), {}, "int32"),
    (i32(0, 7), i32(0, 5, 11), {}, "both be"),
    (i32(0), i32(0), {}, "batch >= 1"),
    (i32(0, 3, 7), i32(0, 5, 11), {"max_seqlen_q": 3}, "less than the longest"),
    (i32(0, 3, 7), i32(0, 5, 11), {"max_seqlen_k": -1}, "int >= 0"),
    ([0, 3, 7], i32(0, 5, 11), {}, "torch.Tensor"),
])
def test_cu_seqlens_checks(cu_q, cu_k, kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_cu_seqlens(cu_q, cu_k, 7, 11, torch.device("cpu"), **kwargs)


@pytest.mark.stage_d3
def test_cu_seqlens_maxima():
    assert check_cu_seqlens(i32(0, 3, 3, 7), i32(0, 0, 5, 11), 7, 12, torch.device("cpu")) == (4, 6)
    assert check_cu_seqlens(i32(0, 3, 3, 7), i32(0, 0, 5, 11), 7, 12, torch.device("cpu"), 9, 6) == (9, 6)


@pytest.mark.stage_d3
@pytest.mark.parametrize("q_lens", [[0], [0, 0, 0], [0, 1]], ids=["one-empty", "three-empty", "control"])
def test_requests_without_query_rows_launch_nothing(recorded_launches, q_lens):
    """A variable-length batch whose requests have no query row has no tile to run: the kernel's grid
    (tiles of the longest request) would be 0 CTAs, which CUDA refuses as an invalid launch (a
    single empty request did on the H200, 2026-11-29). The call returns without a launch, every
    row left as it was (rows past the last request are never written). Control: one query row
    launches once."""
    pad = 5  # rows past the last request, as a caller's packed buffer may have
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.arange(len(q_lens) + 1, dtype=torch.int32) * 70
    q = torch.randn(int(cu_q[-1]) + pad, 16, 128, dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]) + pad, 2, 128, dtype=torch.bfloat16)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((16, q.shape[0]), float("nan"))
    d3_lengths.forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=o, lse_out=lse)
    assert len(recorded_launches) == (1 if sum(q_lens) else 0)
    if not sum(q_lens):
        assert bool(o.isnan().all()) and bool(lse.isnan().all())


def no_key_row_errors(o, lse, rows: int) -> list:
    """What is wrong with a no-key variable-length result whose requests hold ``rows`` rows: a
    request's row not O = 0 / LSE = -inf, or a row past the last request written (still NaN)."""
    bad = []
    if not (bool((o[:rows] == 0).all()) and bool((lse[:, :rows] == -math.inf).all())):
        bad.append("a request's row is not O = 0, LSE = -inf")
    if not (bool(o[rows:].isnan().all()) and bool(lse[:, rows:].isnan().all())):
        bad.append("a row past the last request was written")
    return bad


@pytest.mark.stage_d3
def test_no_key_varlen_call_writes_only_the_requests_rows(recorded_launches):
    """A variable-length call with no key at all (k of 0 rows) is decided without a launch: each
    request's rows get O = 0, LSE = -inf, and rows past the last request are left as they are, as
    the kernel leaves them. Negative control: the batched call's fill (every row) is rejected."""
    from dsv4_attention.common import interface

    pad = 4
    cu_q = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    cu_k = torch.zeros(4, dtype=torch.int32)
    q = torch.randn(5 + pad, 16, 128, dtype=torch.bfloat16)
    k = torch.randn(0, 2, 128, dtype=torch.bfloat16)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((16, q.shape[0]), float("nan"))
    d3_lengths.forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=o, lse_out=lse)
    assert not recorded_launches
    assert not no_key_row_errors(o, lse, 5)
    o.fill_(float("nan"))
    lse.fill_(float("nan"))
    interface.no_keys(o, lse)
    assert no_key_row_errors(o, lse, 5) == ["a row past the last request was written"]
