"""Stage A on a GPU: the QK GEMM against the float64 reference.

The same bodies run the sm90 kernel on Hopper and the sm100 kernel on
Blackwell; each skips, saying why, where its architecture is absent.
Bounds: S is fp32 from exact bf16/fp16 products, so the relative Frobenius
error stays at fp32 summation level (<= 1e-5) and no row may exceed 1e-4.
Every element is also held to fp32 summation accuracy, |err| <= 1e-5 x scale x
sum_d |q_d k_d|: that is the bound a dot product can promise, and the only
meaningful one where few elements make up the output, since one dot product's
error relative to its own (cancelled) value is unbounded (seen: hd 512, a 1 x 1
S of 0.011 from terms summing to ~14 in magnitude, off by 2.4e-7).
"""

import pytest
import torch

from dsv4_attention.common import jit
from dsv4_attention.common.reference import qk_scores
from dsv4_attention.common.testing import cuda_device, errors, fresh_generator, gpu_arch_params, poison_, random_bshd
from dsv4_attention.stages import a_qk_gemm as stage

pytestmark = [pytest.mark.stage_a]

REL, ROW = 1e-5, 1e-4

# (batch, seqlen_q, seqlen_k, heads, kv_heads): tails off the 128 tile, grids of several CTAs, GQA
SHAPES = [
    (1, 1, 1, 1, 1),
    (2, 300, 200, 4, 2),
    (3, 129, 1000, 2, 1),
    (1, 1024, 257, 8, 8),
    (2, 77, 4096, 3, 3),
]


def run_case(arch, dtype, head_dim, shape, magnitude=1.0, record=None, scale=None):
    b, sq, sk, h, hk = shape
    dev = cuda_device()
    g = fresh_generator()
    q = random_bshd(b, sq, h, head_dim, dtype, dev, magnitude=magnitude, generator=g)
    k = random_bshd(b, sk, hk, head_dim, dtype, dev, magnitude=magnitude, generator=g)
    out = poison_(torch.empty(b, h, sq, sk, dtype=torch.float32, device=dev))
    s = stage.forward(q, k, softmax_scale=scale, out=out)
    torch.cuda.synchronize()
    assert s.data_ptr() == out.data_ptr()
    ref = qk_scores(q, k, scale)
    e = errors(s, ref)
    if record:
        record(e, arch=arch, dtype=str(dtype), head_dim=head_dim, shape=list(shape))
    msg = f"{arch} {dtype} hd{head_dim} {shape}: {e} (seed {g.initial_seed()})"
    terms = qk_scores(q.abs(), k.abs(), scale)  # scale * sum_d |q_d k_d| per element
    assert ((s.double() - ref).abs() <= 1e-5 * terms).all(), msg
    if b * h * sq * sk >= 128 * 128:  # enough elements for the norms to average out cancellation
        assert e.within(REL, ROW), msg


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(arch, dtype, head_dim, shape, record_errors):
    run_case(arch, dtype, head_dim, shape, record=record_errors)


@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("head_dim", [128, 512])
def test_large_scores(arch, head_dim, record_errors):
    """Entries of magnitude ~4 give scores of several hundred before scaling."""
    run_case(arch, torch.bfloat16, head_dim, (2, 200, 300, 2, 1), magnitude=4.0, scale=0.5,
             record=record_errors)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_strided_inputs(arch, record_errors):
    """q and k as views into larger tensors (head slices): strides are the user's, not assumed."""
    dev = cuda_device()
    g = fresh_generator()
    big_q = random_bshd(2, 190, 6, 128, torch.bfloat16, dev, generator=g)
    big_k = random_bshd(2, 333, 4, 128, torch.bfloat16, dev, generator=g)
    q, k = big_q[:, :, 1:5], big_k[:, :, 2:4]
    s = stage.forward(q, k)
    e = errors(s, qk_scores(q, k))
    record_errors(e, arch=arch, case="strided")
    assert e.within(REL, ROW), str(e)


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_compiles_once_per_configuration(arch):
    """New shapes reuse the compiled kernel: no recompile per seqlen, batch or head count."""
    dev = cuda_device()
    q = random_bshd(1, 64, 2, 64, torch.bfloat16, dev)
    k = random_bshd(1, 64, 2, 64, torch.bfloat16, dev)
    stage.forward(q, k)
    n = jit.cache_size()
    for shape in [(2, 333, 4, 64), (1, 5, 8, 64)]:
        stage.forward(random_bshd(*shape, torch.bfloat16, dev), random_bshd(shape[0], 100, 1, 64, torch.bfloat16, dev))
    assert jit.cache_size() == n
