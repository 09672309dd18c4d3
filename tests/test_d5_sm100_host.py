"""Stage D5's attention sink on SM100, on the host (CPU, no GPU): the correction thread's per-row
scale (``row_scale``, the kernel's own method) compiled into a host function for sm100 and run on
the CPU, against the plain formula. With sink[h] = ln(h + 1), LSE = 0 and 1 / rowsum = 1, the
scale 1 / (1 + e^{sink[h]}) = 1 / (h + 2) names the query head the kernel read: it must be
hk * g + r % g for packed row r of KV head hk (D2's map). Negative control: a kernel that takes
the head as hk * g + r // g is rejected by the same check. Plus compile budgets."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Float32, Int32

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.common.softmax import sink_factor
from dsv4_attention.stages.d5_sink_merge.sm100 import FlashAttentionD5Sm100

pytestmark = [pytest.mark.arch("sm100"), pytest.mark.stage_d5]


class HeadFromTokenSm100(FlashAttentionD5Sm100):
    """Wrong on purpose: the token index as the head in the group."""

    @cute.jit
    def row_scale(self, inv_row_sum, lse, mSink, q_row, h):
        return inv_row_sum * sink_factor(lse, mSink[h * self.pack_group + q_row // self.pack_group])


def heads_read(kernel, kv_heads: int, rows: int) -> torch.Tensor:
    """[kv_heads, rows]: the query head whose sink the kernel's row_scale read, per packed row."""
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch

    @cute.jit
    def host(sink: cute.Tensor, out: cute.Tensor):
        for hk in cutlass.range(out.shape[0], unroll=1):
            for r in cutlass.range(out.shape[1], unroll=1):
                out[hk, r] = kernel.row_scale(Float32(1.0), Float32(0.0), sink, r, hk)

    heads = kv_heads * kernel.pack_group
    sink = torch.log(torch.arange(1, heads + 1, dtype=torch.float32))
    out = torch.zeros(kv_heads, rows, dtype=torch.float32)
    with target_arch("sm100"):
        fn = cute.compile(host, jit.as_cute(sink), jit.as_cute(out), options=f"--gpu-arch={GPU_ARCH['sm100']}")
    fn(jit.as_cute(sink), jit.as_cute(out))
    return (1.0 / out - 2.0).round().long()


def make(cls, group, **options):
    from dsv4_attention.common import jit

    return cls(jit.cutlass_dtype(torch.bfloat16), 512 if group >= 64 else 128, kv_shared=group >= 64,
               pack_group=group, has_sink=True, **options)


def plain_heads(kv_heads, rows, group):
    r = torch.arange(rows)
    return torch.stack([hk * group + r % group for hk in range(kv_heads)])


@pytest.mark.proof
@pytest.mark.parametrize("group", [1, 8, 64, 128])
def test_sink_reads_the_rows_head(group):
    got = heads_read(make(FlashAttentionD5Sm100, group), 2, 300)
    assert torch.equal(got, plain_heads(2, 300, group))


@pytest.mark.proof
def test_checker_rejects_the_token_as_head():
    got = heads_read(make(HeadFromTokenSm100, 8), 2, 300)
    assert not torch.equal(got, plain_heads(2, 300, 8))


@pytest.mark.proof
def test_scale_is_the_sigmoid_and_empty_rows_stay_zero():
    """The correction thread's scale, row_scale(1, LSE, sink), on every (LSE, sink) corner of
    ``sink_cases.PAIRS``: 1 / (1 + e^{sink - LSE}) for a finite LSE (1 for sink -inf, 0 for +inf);
    LSE = -inf (a row with no key) gives 0 for any sink. Negative control: the bare sigmoid as the
    scale is rejected (NaN at LSE = sink = -inf)."""
    from sink_cases import PAIRS, bare_sigmoid_factor, factor

    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch

    class BareSigmoid(FlashAttentionD5Sm100):
        @cute.jit
        def row_scale(self, inv_row_sum, lse, mSink, q_row, h):
            return inv_row_sum * bare_sigmoid_factor(lse, mSink[h * self.pack_group + q_row % self.pack_group])

    def scales(cls):
        kernel = make(cls, 1)

        @cute.jit
        def host(sink: cute.Tensor, lse: cute.Tensor, out: cute.Tensor):
            for i in cutlass.range(out.shape[0], unroll=1):
                out[i] = kernel.row_scale(Float32(1.0), lse[i], sink, Int32(0), Int32(i))

        lse = torch.tensor([p[0] for p in PAIRS], dtype=torch.float32)
        sink = torch.tensor([p[1] for p in PAIRS], dtype=torch.float32)  # head i's sink: pair i's
        out = torch.full((len(PAIRS),), float("nan"), dtype=torch.float32)
        with target_arch("sm100"):
            fn = cute.compile(host, *(jit.as_cute(t) for t in (sink, lse, out)),
                              options=f"--gpu-arch={GPU_ARCH['sm100']}")
        fn(*(jit.as_cute(t) for t in (sink, lse, out)))
        return [(p, got) for p, got in zip(PAIRS, out.tolist(), strict=True)
                if not (math.isfinite(got) and abs(got - factor(*p)) <= 2e-6 * factor(*p) + 1e-30)]

    assert scales(FlashAttentionD5Sm100) == []
    bad = scales(BareSigmoid)
    assert bad and all(p == (-math.inf, -math.inf) for p, _ in bad), bad


CASES = [
    (512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_sink": True}),
    (512, {"kv_shared": True, "pack_group": 64, "varlen": True, "has_left": True, "has_right": True,
           "has_sink": True}),
    (128, {"kv_shared": False, "pack_group": 8, "has_right": True, "has_sink": True}),
]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("head_dim,options", CASES, ids=[f"hd{d}-{o}" for d, o in CASES])
def test_sm100_compiles_within_budget(head_dim, options):
    assert_within_budget("d5", "sm100", "bfloat16", head_dim, options=options, min_tmem_columns=256)
