"""Stage D5 on a GPU: the attention sink (O *= sigmoid(LSE - sink[h]), LSE without it) against the
float64 reference with the same sink, over every mask of stage D4 and variable-length batches;
sink outliers (+-30 in bf16, +-9 in fp16, far above and below the rows' LSE); empty rows stay O = 0, LSE = -inf with a
sink. The exact merge of two attentions over disjoint key sets against one softmax over their
union, with and without a sink."""

import pytest
import torch

from dsv4_attention.common.reference import attention as reference
from dsv4_attention.common.testing import (
    LSE_ABS,
    O_REL,
    attention_inputs,
    check_attention,
    check_varlen,
    errors,
    fresh_generator,
    gpu_arch_params,
    sanitizer_test,
    sinks_with_infinities,
    varlen_inputs,
)
from dsv4_attention.stages import d5_sink_merge as stage

pytestmark = [pytest.mark.stage_d5]


def sinks(heads, g, outliers=True, dtype=torch.bfloat16):
    """[heads] fp32: N(0, 2^2), with +big and -big among them (a sink that swallows its rows, one
    that is negligible): big = 30 for bf16, 9 for fp16. At 9 a row that sees one key of score
    -4.6 has O = 1.5e-6 v, subnormal in fp16: ``common.testing.errors`` measures such a row
    against what fp16 can represent (its subnormal step), not against the float64 value."""
    s = torch.randn(heads, generator=g) * 2
    if outliers and heads >= 2:
        big = 9.0 if dtype == torch.float16 else 30.0
        s[0], s[-1] = big, -big
    return s.cuda()


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("group", [1, 16, 128])
@pytest.mark.parametrize("masks", [{}, {"causal": True}, {"causal": True, "window_size": (127, 0)}],
                         ids=["dense", "causal", "window"])
def test_sink(arch, head_dim, group, masks, record_errors):
    q, k, v, g = attention_inputs(2, 150 if group < 128 else 3, 300, group, 1, head_dim, torch.bfloat16,
                                  kv_shared=head_dim == 512)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"learnable_sink": sinks(group, g), **masks})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sink_with_empty_rows_and_lengths(arch, dtype, record_errors):
    """seqused_k 0 (every row of request 0 empty) and a window that hides every key of some rows."""
    q, k, v, g = attention_inputs(3, 200, 100, 8, 2, 128, dtype)
    n = torch.tensor([0, 100, 37], dtype=torch.int32, device="cuda")
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"learnable_sink": sinks(8, g, dtype=dtype), "seqused_k": n, "window_size": (0, 0)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [128, 512])
def test_infinite_sinks_on_empty_and_full_rows(arch, head_dim, record_errors):
    """FlashMLA's sink draw (a third of the heads -inf, a third +inf) on rows with no key (request 0:
    seqused_k 0) and rows with keys: against the reference; O = 0 on every empty row whatever the
    sink and on every head whose sink is +inf; LSE bitwise that of the call without a sink."""
    group = 64 if head_dim == 512 else 8
    q, k, v, g = attention_inputs(3, 150, 300, group, 1, head_dim, torch.bfloat16, kv_shared=head_dim == 512)
    n = torch.tensor([0, 300, 41], dtype=torch.int32, device="cuda")
    s = sinks_with_infinities(group, g)
    masks = {"seqused_k": n, "causal": True, "window_size": (127, 0)}
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch, options={"learnable_sink": s, **masks})
    o, lse = stage.forward(q, k, v, learnable_sink=s, **masks)
    _, lse0 = stage.forward(q, k, v, **masks)
    assert bool(torch.isfinite(o).all())
    assert bool((o[0] == 0).all()) and bool((o[:, :, torch.isposinf(s)] == 0).all())
    assert torch.equal(lse, lse0)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [128, 512])
def test_sink_varlen(arch, head_dim, record_errors):
    q, k, v, cu_q, cu_k, g = varlen_inputs([0, 130, 1, 300], [5, 400, 0, 300], 64, 1, head_dim, torch.bfloat16,
                                           kv_shared=head_dim == 512, pad=2)
    check_varlen(stage.forward, q, k, v, cu_q, cu_k, record_errors, g, arch=arch,
                 options={"learnable_sink": sinks(64, g), "causal": True, "window_size": (127, 0)})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_no_sink_equals_stage_d4(arch):
    from dsv4_attention.stages import d4_causal_window

    q, k, v, _ = attention_inputs(2, 100, 333, 16, 2, 128, torch.bfloat16)
    o1, l1 = stage.forward(q, k, v, causal=True)
    o2, l2 = d4_causal_window.forward(q, k, v, causal=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
def test_merge_of_disjoint_key_sets(arch, head_dim, with_sink, record_errors):
    """Keys [0, n1) and [n1, seqlen_k) as two calls, merged, against one softmax over all keys;
    a third split leaves one side empty for the first rows (causal over the first part)."""
    q, k, v, g = attention_inputs(2, 200, 700, 64, 1, head_dim, torch.bfloat16, kv_shared=head_dim == 512)
    sink = sinks(64, g) if with_sink else None
    n1 = 250
    o1, l1 = stage.forward(q, k[:, :n1], v[:, :n1])
    o2, l2 = stage.forward(q, k[:, n1:], v[:, n1:])
    o, lse = stage.merge_attention(o1, l1, o2, l2)
    if with_sink:
        o = stage.apply_sink(o, lse, sink)
    o_ref, lse_ref = reference(q, k, v, learnable_sink=sink)
    e = errors(o, o_ref)
    record_errors(e, arch=arch, head_dim=head_dim, case="merge", sink=with_sink)
    tol = O_REL[q.dtype]
    assert e.within(2 * tol, 6 * tol), e  # two roundings to bf16 (each side, then the merge)
    assert (lse.double() - lse_ref).abs().max().item() <= 2 * LSE_ABS


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_apply_sink_after_merge_with_infinite_sinks(arch):
    """Both sides empty for request 0: the merge gives O = 0, LSE = -inf, and apply_sink keeps O = 0
    for sinks of -inf and +inf (no NaN); non-empty rows: -inf changes nothing, +inf gives 0."""
    q, k, v, g = attention_inputs(2, 50, 100, 6, 1, 128, torch.bfloat16)
    none = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    s = sinks_with_infinities(6, g)
    o1, l1 = stage.forward(q, k[:, :40], v[:, :40], seqused_k=none.clamp(max=40))
    o2, l2 = stage.forward(q, k[:, 40:], v[:, 40:], seqused_k=(none - 40).clamp(min=0))
    o_merged, lse_merged = stage.merge_attention(o1, l1, o2, l2)
    o = stage.apply_sink(o_merged, lse_merged, s)
    o_ref, _ = reference(q, k, v, seqused_k=none, learnable_sink=s)
    assert bool(torch.isfinite(o).all()) and bool((o[0] == 0).all())
    assert bool((o[:, :, torch.isposinf(s)] == 0).all())
    e = errors(o, o_ref)
    assert e.within(2 * O_REL[q.dtype], 6 * O_REL[q.dtype]), e


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_merge_with_empty_side(arch):
    """One side empty for some rows (seqused_k 0 for request 0): the merge returns the other side
    exactly (weight 1 and 0), both empty gives O = 0, LSE = -inf."""
    q, k, v, _ = attention_inputs(2, 50, 100, 4, 1, 128, torch.bfloat16)
    none = torch.tensor([0, 0], dtype=torch.int32, device="cuda")
    o1, l1 = stage.forward(q, k, v)
    o0, l0 = stage.forward(q, k, v, seqused_k=none)
    o, lse = stage.merge_attention(o1, l1, o0, l0)
    assert torch.equal(lse, l1) and torch.equal(o, o1)
    o, lse = stage.merge_attention(o0, l0, o0, l0)
    assert bool((o == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bad_sink_is_refused_before_launch(arch):
    q, k, v, _ = attention_inputs(1, 10, 50, 4, 1, 128, torch.bfloat16)
    for bad, match in [(torch.zeros(3, device="cuda"), "shape"), (torch.zeros(4, device="cuda").half(), "float32"),
                       (torch.zeros(4), "must be on"), ([0.0] * 4, "torch.Tensor"),
                       (torch.zeros(8, device="cuda")[::2], "contiguous")]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, k, v, learnable_sink=bad)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, k, v, g = attention_inputs(2, 300, 700, 128, 1, 512, torch.bfloat16, kv_shared=True)
    s = sinks(128, fresh_generator())
    kw = {"learnable_sink": s, "causal": True, "window_size": (127, 0)}
    o1, l1 = stage.forward(q, k, v, **kw)
    o2, l2 = stage.forward(q, k, v, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import d5_sink_merge as stage
q = torch.randn(2, 130, 128, 512, device="cuda").bfloat16()
kv = torch.randn(2, 300, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, kv, learnable_sink=torch.randn(128, device="cuda"), causal=True, window_size=(127, 0))
q8 = torch.randn(2, 77, 16, 128, device="cuda").bfloat16()
k8 = torch.randn(2, 150, 2, 128, device="cuda").bfloat16()
stage.forward(q8, k8, k8.clone(), learnable_sink=torch.randn(16, device="cuda"))
"""

test_compute_sanitizer = sanitizer_test(SANITIZER_CASE)
