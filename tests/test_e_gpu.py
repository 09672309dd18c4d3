"""Stage E on a GPU: the window and the compressed entries in one softmax (DeepSeek-V4's HCA layer)
against the float64 reference (common/reference.fused_attention), and against the spec's own
index-list form (reference.dsv4_index_attention: the window's rows and the visible entries as one
gathered key list). Head dims 128-512, packed groups 8-128, ratios 4 and 128, sequence lengths that
are not tile multiples, seqlen_q below, at and above seqlen_k, more entries than any row sees
(poisoned with huge values: a mask that lets one through fails loudly), requests with no key,
bitwise repeatability, compute-sanitizer. Bad compressed inputs are refused before launch."""

import pytest
import torch

from dsv4_attention.common.reference import dsv4_index_attention
from dsv4_attention.common.testing import (
    LSE_ABS,
    O_REL,
    attention_inputs,
    check_attention,
    errors,
    fresh_generator,
    gpu_arch_params,
    random_bshd,
    run_compute_sanitizer,
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


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, kv, _, g = attention_inputs(2, 300, 700, 128, 1, 512, torch.bfloat16, kv_shared=True)
    kw = {"compressed_kv": entries(2, 175, 512, g), "compress_ratio": 4, "causal": True, "window_size": (127, 0),
          "learnable_sink": sink(128, g)}
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
torch.cuda.synchronize()
print("sanitized case ran")
"""


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(arch, tool):
    run_compute_sanitizer(tool, SANITIZER_CASE)
