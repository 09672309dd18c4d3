"""Stage D5 without a GPU: the exact merge (common/merge.py) against one float64 softmax over the
union of two disjoint key sets, empty sides, the sink's torch form against the reference, the
sink's validation, and the sm90 kernel's compile budgets with the sink on."""

import math

import pytest
import torch

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.common.merge import merge_attention
from dsv4_attention.common.reference import attention
from dsv4_attention.common.validation import check_sink
from dsv4_attention.stages import d5_sink_merge as stage

pytestmark = [pytest.mark.stage_d5]


def inputs(b=2, sq=40, sk=90, h=4, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, hh, d, generator=g, dtype=torch.float64) for s, hh in ((sq, h), (sk, h), (sk, h))]


@pytest.mark.parametrize("split", [1, 45, 89])
def test_merge_equals_one_softmax_over_the_union(split):
    q, k, v = inputs()
    o1, l1 = attention(q, k[:, :split], v[:, :split])
    o2, l2 = attention(q, k[:, split:], v[:, split:])
    o, lse = merge_attention(o1, l1, o2, l2)
    o_ref, lse_ref = attention(q, k, v)
    assert (o.double() - o_ref).abs().max().item() < 1e-5  # fp32 weights
    assert (lse.double() - lse_ref).abs().max().item() < 1e-5


def test_merge_with_empty_sides():
    q, k, v = inputs()
    o1, l1 = attention(q, k, v)
    none = torch.zeros(2, dtype=torch.int32)
    o0, l0 = attention(q, k, v, seqused_k=none)
    assert bool(torch.isneginf(l0).all()) and bool((o0 == 0).all())
    o, lse = merge_attention(o1.float(), l1.float(), o0.float(), l0.float())
    assert torch.equal(lse, l1.float()) and torch.equal(o, o1.float())
    o, lse = merge_attention(o0, l0, o0, l0)
    assert not o.isnan().any() and bool((o == 0).all()) and bool(torch.isneginf(lse).all())


def test_merge_varlen_layout():
    q, k, v = inputs(b=1)
    o1, l1 = attention(q, k[:, :30], v[:, :30])
    o2, l2 = attention(q, k[:, 30:], v[:, 30:])
    o, lse = merge_attention(o1[0], l1[0], o2[0], l2[0], lse_layout="ht")
    o_ref, lse_ref = attention(q, k, v)
    assert (o.double() - o_ref[0]).abs().max().item() < 1e-5
    assert (lse.double() - lse_ref[0]).abs().max().item() < 1e-5


def test_merge_refuses_mismatched_sides():
    q, k, v = inputs()
    o1, l1 = attention(q, k, v)
    with pytest.raises(ValueError, match="must match"):
        merge_attention(o1, l1, o1[:, :3], l1[:, :, :3])
    with pytest.raises(ValueError, match="lse must be"):
        merge_attention(o1, l1.transpose(1, 2), o1, l1.transpose(1, 2))
    with pytest.raises(ValueError, match="lse_layout"):
        merge_attention(o1, l1, o1, l1, lse_layout="hb")


def test_apply_sink_equals_reference_sink():
    q, k, v = inputs()
    sink = torch.tensor([30.0, -30.0, 0.5, -1.0], dtype=torch.float64)
    o, lse = attention(q, k, v)
    o_ref, lse_ref = attention(q, k, v, learnable_sink=sink)
    assert torch.equal(lse, lse_ref)
    assert (stage.apply_sink(o, lse, sink).double() - o_ref).abs().max().item() < 1e-6
    # the sink's definition: one more logit in the denominator only
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(32)
    denom = torch.exp(s).sum(-1) + torch.exp(sink)[None, :, None]
    o_def = torch.einsum("bhij,bjhd->bihd", torch.exp(s) / denom[..., None], v)
    assert (o_def - o_ref).abs().max().item() < 1e-9


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3), "shape"), (torch.zeros(4, dtype=torch.float16), "float32"), ([0.0] * 4, "torch.Tensor"),
    (torch.zeros(8)[::2], "contiguous"), (torch.zeros(1, 4), "shape"),
])
def test_sink_checks(bad, match):
    with pytest.raises(ValueError, match=match):
        check_sink(bad, 4, torch.device("cpu"))


CASES = [
    (512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_sink": True}),
    (512, {"kv_shared": True, "pack_group": 64, "varlen": True, "has_left": True, "has_right": True,
           "has_sink": True}),
    (128, {"kv_shared": False, "pack_group": 8, "has_right": True, "has_sink": True}),
    (64, {"kv_shared": False, "has_sink": True}),
    (384, {"kv_shared": False, "has_sink": True}),
]


@pytest.mark.compile
@pytest.mark.arch("sm90")
@pytest.mark.parametrize("head_dim,options", CASES, ids=[f"hd{d}-{o}" for d, o in CASES])
def test_sm90_compiles_within_budget(head_dim, options):
    assert_within_budget("d5", "sm90", "bfloat16", head_dim, options=options)
