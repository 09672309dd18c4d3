"""Stage D3 on a GPU: per-request key counts (seqused_k) and variable-length batches (cu_seqlens),
against the float64 reference with the same keys masked (varlen: each request's own reference).
Stage B's bounds, NaN-poisoned outputs, fresh random inputs and lengths; rows of a request with
no key must come back O = 0 and LSE = -inf exactly; rows past the last request never written."""

import math

import pytest
import torch

from dsv4_attention.common.testing import (
    attention_inputs,
    check_attention,
    check_varlen,
    fresh_generator,
    gpu_arch_params,
    poison_,
    sanitizer_test,
    varlen_inputs,
)
from dsv4_attention.stages import d3_lengths as stage

pytestmark = [pytest.mark.stage_d3]


def lengths(batch, seqlen_k, g, extremes=True):
    """Random seqused_k in [0, seqlen_k], with 0 and seqlen_k among them when ``extremes``."""
    n = torch.randint(0, seqlen_k + 1, (batch,), generator=g, dtype=torch.int32)
    if extremes and batch >= 2:
        n[0], n[1] = 0, seqlen_k
    return n.cuda()


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [64, 128, 256, 320, 512])
@pytest.mark.parametrize("kv_shared", [True, False], ids=["k_eq_v", "k_ne_v"])
@pytest.mark.parametrize("group", [1, 8, 64])
def test_random_lengths(arch, head_dim, kv_shared, group, record_errors):
    q, k, v, g = attention_inputs(5, 77, 900, 2 * group, 2, head_dim, torch.bfloat16, kv_shared=kv_shared)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"seqused_k": lengths(5, 900, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_request_empty(arch, dtype, record_errors):
    q, k, v, g = attention_inputs(3, 130, 300, 4, 1, 128, dtype)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"seqused_k": torch.zeros(3, dtype=torch.int32, device="cuda")})


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("seqlen_k", [1, 64, 65, 3000])
def test_decode_mqa_128_heads(arch, seqlen_k, record_errors):
    """DeepSeek-V4's decode: 2 tokens x 128 heads on one latent KV head (K = V, hd 512), one KV
    tensor of seqlen_k rows per request and each request using a random prefix of it."""
    b = 6 if seqlen_k <= 100 else 2  # the float64 reference expands K to all 128 heads: ~5 GB at 3000 keys
    q, k, v, g = attention_inputs(b, 2, seqlen_k, 128, 1, 512, torch.bfloat16, kv_shared=True)
    check_attention(stage.forward, q, k, v, record_errors, g, arch=arch,
                    options={"seqused_k": lengths(b, seqlen_k, g)})


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_full_lengths_equal_no_lengths(arch):
    """seqused_k = seqlen_k everywhere gives stage D2's bits."""
    from dsv4_attention.stages import d2_pack_heads

    q, k, v, _ = attention_inputs(2, 100, 777, 16, 2, 256, torch.bfloat16)
    o1, l1 = stage.forward(q, k, v, seqused_k=torch.full((2,), 777, dtype=torch.int32, device="cuda"))
    o2, l2 = d2_pack_heads.forward(q, k, v)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bad_lengths_are_refused_before_launch(arch):
    q, k, v, _ = attention_inputs(2, 10, 50, 2, 1, 128, torch.bfloat16)
    for bad, match in [(torch.tensor([3, 51], dtype=torch.int32, device="cuda"), "values must lie"),
                       (torch.tensor([3, -1], dtype=torch.int32, device="cuda"), "values must lie"),
                       (torch.tensor([3, 4], dtype=torch.int64, device="cuda"), "int32"),
                       (torch.tensor([3, 4], dtype=torch.int32), "must be on"),
                       (torch.tensor([3], dtype=torch.int32, device="cuda"), "shape")]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, k, v, seqused_k=bad)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bitwise_repeatable(arch):
    q, k, v, g = attention_inputs(4, 33, 3000, 128, 1, 512, torch.bfloat16, kv_shared=True)
    n = lengths(4, 3000, fresh_generator())
    o1, l1 = stage.forward(q, k, v, seqused_k=n)
    o2, l2 = stage.forward(q, k, v, seqused_k=n)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def uneven_lengths(g, n, longest_q=300, longest_k=700):
    """n requests' (q_lens, k_lens): random, with a request of no query, one of no key and one of
    both longer than a 128-row tile among them when n allows."""
    q_lens = torch.randint(0, longest_q + 1, (n,), generator=g).tolist()
    k_lens = torch.randint(0, longest_k + 1, (n,), generator=g).tolist()
    if n >= 3:
        q_lens[0], k_lens[1], q_lens[2], k_lens[2] = 0, 0, longest_q, longest_k
    return q_lens, k_lens


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [64, 128, 256, 384, 512])
@pytest.mark.parametrize("group", [1, 8, 64])
@pytest.mark.parametrize("requests", [1, 3, 16])
def test_varlen_batches(arch, head_dim, group, requests, record_errors):
    """1-16 requests of uneven lengths (0 among them), query and key lengths independent; heads
    packed (group 8, 64) and not (1); K = V at head dim 512."""
    q_lens, k_lens = uneven_lengths(fresh_generator(), requests)
    q, k, v, cu_q, cu_k, g = varlen_inputs(q_lens, k_lens, 2 * group, 2, head_dim, torch.bfloat16,
                                           kv_shared=head_dim == 512, pad=5)
    check_varlen(stage.forward, q, k, v, cu_q, cu_k, record_errors, g, arch=arch)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("q_lens", [[0], [0, 0, 0]], ids=["one", "three"])
def test_requests_without_query_rows(arch, q_lens):
    """Requests without a query row (keys present): nothing to launch, where a grid of 0 CTAs was
    a launch error (test_varlen_batches drew one such request on the H200, 2026-11-29); the packed
    buffer's rows, past every request, are never written."""
    q, k, v, cu_q, cu_k, _ = varlen_inputs(q_lens, [300] * len(q_lens), 16, 2, 512, torch.bfloat16, kv_shared=True,
                                           pad=5)
    o = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(16, q.shape[0], dtype=torch.float32, device=q.device))
    stage.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=o, lse_out=lse)
    torch.cuda.synchronize()
    assert o.shape[0] == 5 and bool(o.isnan().all()) and bool(lse.isnan().all())


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_no_key_varlen_call(arch):
    """No key at all (k of 0 rows): each request's rows O = 0, LSE = -inf, without a launch, on the
    device and without a sync (masked fills); the 4 rows past the last request untouched."""
    cu_q = torch.tensor([0, 3, 3, 5], dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(4, dtype=torch.int32, device="cuda")
    q = torch.randn(9, 16, 512, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(0, 1, 512, dtype=torch.bfloat16, device="cuda")
    o = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(16, 9, dtype=torch.float32, device="cuda"))
    stage.forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=o, lse_out=lse)
    torch.cuda.synchronize()
    assert bool((o[:5] == 0).all()) and bool((lse[:, :5] == -math.inf).all())
    assert bool(o[5:].isnan().all()) and bool(lse[:, 5:].isnan().all())


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_decode_mqa_128_heads(arch, dtype, record_errors):
    """DeepSeek-V4's decode as a variable-length batch: 1-2 tokens x 128 heads per request, K = V."""
    q_lens = [1, 2, 2, 1, 2, 1, 2, 2]
    k_lens = [1, 64, 65, 500, 0, 129, 2000, 3]
    q, k, v, cu_q, cu_k, g = varlen_inputs(q_lens, k_lens, 128, 1, 512, dtype, kv_shared=True)
    check_varlen(stage.forward, q, k, v, cu_q, cu_k, record_errors, g, arch=arch)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_varlen_equals_padded_batch(arch):
    """Requests of equal length as a varlen batch give the batched call's bits."""
    q, k, v, _ = attention_inputs(3, 100, 333, 16, 2, 128, torch.bfloat16)
    o1, l1 = stage.forward(q, k, v)
    cu_q = torch.tensor([0, 100, 200, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 333, 666, 999], dtype=torch.int32, device="cuda")
    o2, l2 = stage.forward(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(o1.flatten(0, 1), o2)
    assert torch.equal(l1.transpose(0, 1).flatten(1, 2), l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_varlen_bitwise_repeatable(arch):
    q, k, v, cu_q, cu_k, _ = varlen_inputs([5, 300, 0, 77], [700, 1, 300, 0], 64, 1, 512, torch.bfloat16,
                                           kv_shared=True)
    o1, l1 = stage.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o2, l2 = stage.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_bad_cu_seqlens_are_refused_before_launch(arch):
    q, k, v, cu_q, cu_k, _ = varlen_inputs([3, 4], [5, 6], 2, 1, 128, torch.bfloat16)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    for kwargs, match in [
        ({"cu_seqlens_q": cu_q}, "go together"),
        ({"cu_seqlens_q": i32(0, 4, 3), "cu_seqlens_k": cu_k}, "non-decreasing"),
        ({"cu_seqlens_q": i32(1, 3, 7), "cu_seqlens_k": cu_k}, r"\[0\] must be 0"),
        ({"cu_seqlens_q": i32(0, 3, 8), "cu_seqlens_k": cu_k}, "exceeds"),
        ({"cu_seqlens_q": cu_q.long(), "cu_seqlens_k": cu_k}, "int32"),
        ({"cu_seqlens_q": cu_q.cpu(), "cu_seqlens_k": cu_k}, "must be on"),
        ({"cu_seqlens_q": i32(0, 7), "cu_seqlens_k": cu_k}, "both be"),
        ({"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 3}, "less than the longest"),
        ({"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "seqused_k": i32(1, 1)}, "not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            stage.forward(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="total_tokens"):
        stage.forward(q[None], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


SANITIZER_CASE = """
import torch
from dsv4_attention.stages import d3_lengths as stage
q = torch.randn(3, 3, 128, 512, device="cuda").bfloat16()
kv = torch.randn(3, 300, 1, 512, device="cuda").bfloat16()
stage.forward(q, kv, kv, seqused_k=torch.tensor([0, 77, 300], dtype=torch.int32, device="cuda"))
q8 = torch.randn(2, 77, 16, 128, device="cuda").bfloat16()
k8 = torch.randn(2, 150, 2, 128, device="cuda").bfloat16()
stage.forward(q8, k8, k8.clone(), seqused_k=torch.tensor([1, 150], dtype=torch.int32, device="cuda"))
cu = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")
qv = torch.randn(380, 128, 512, device="cuda").bfloat16()
kvv = torch.randn(900, 1, 512, device="cuda").bfloat16()
stage.forward(qv, kvv, kvv, cu_seqlens_q=cu(0, 2, 2, 379), cu_seqlens_k=cu(0, 300, 301, 900))
qg = torch.randn(300, 16, 128, device="cuda").bfloat16()
kg = torch.randn(500, 2, 128, device="cuda").bfloat16()
stage.forward(qg, kg, kg.clone(), cu_seqlens_q=cu(0, 130, 130, 299), cu_seqlens_k=cu(0, 0, 250, 500))
"""

test_compute_sanitizer = sanitizer_test(SANITIZER_CASE)
