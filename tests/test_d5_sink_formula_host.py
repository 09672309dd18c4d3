"""The attention sink's factor, on the host (CPU, no GPU): ``softmax.sink_factor`` (the one form
every architecture's epilogue and the split-KV merge call) compiled into a host function for each
architecture and run on the CPU over every (LSE, sink) corner (``sink_cases.PAIRS``: rows empty or
not, sinks -inf, +inf, finite and outliers), against the definition exp(LSE) / (exp(LSE) +
exp(sink)) with a row of no key giving 0. Negative control: the bare sigmoid (no empty-row case)
is rejected by the same check: it is NaN at LSE = sink = -inf. The torch forms (``merge.sink_scale``,
``apply_sink``, the reference) are checked against the same table."""

from __future__ import annotations

import math

import cutlass.cute as cute
import pytest
import torch
from sink_cases import PAIRS, bare_sigmoid_factor, factor

from dsv4_attention.common.softmax import sink_factor

pytestmark = [pytest.mark.stage_d5]


def run_formula(fn, arch: str) -> list:
    """fn(lse, sink) for every pair of PAIRS, computed by a host function compiled for ``arch``."""
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch

    @cute.jit
    def host(lse: cute.Tensor, sink: cute.Tensor, out: cute.Tensor):
        for i in range(len(PAIRS)):
            out[i] = fn(lse[i], sink[i])

    lse = torch.tensor([p[0] for p in PAIRS], dtype=torch.float32)
    sink = torch.tensor([p[1] for p in PAIRS], dtype=torch.float32)
    out = torch.full((len(PAIRS),), float("nan"), dtype=torch.float32)
    with target_arch(arch):
        compiled = cute.compile(host, *(jit.as_cute(t) for t in (lse, sink, out)),
                                options=f"--gpu-arch={GPU_ARCH[arch]}")
    compiled(*(jit.as_cute(t) for t in (lse, sink, out)))
    return out.tolist()


def mismatches(values) -> list:
    bad = []
    for (lse, sink), got in zip(PAIRS, values, strict=True):
        want = factor(lse, sink)
        if not (math.isfinite(got) and abs(got - want) <= 2e-6 * want + 1e-30):
            bad.append(f"LSE {lse}, sink {sink}: {got}, want {want}")
    return bad


@pytest.mark.proof
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_sink_factor_on_every_corner(arch):
    assert mismatches(run_formula(sink_factor, arch)) == []


@pytest.mark.proof
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_checker_rejects_the_bare_sigmoid(arch):
    bad = mismatches(run_formula(bare_sigmoid_factor, arch))
    assert bad and all("LSE -inf, sink -inf" in b for b in bad), bad


def test_torch_forms_on_every_corner():
    """merge.sink_scale (fp32), apply_sink and the float64 reference's scale agree with the table;
    the bare torch.sigmoid does not (the control)."""
    from dsv4_attention.common.merge import sink_scale
    from dsv4_attention.common.reference import _sink_scale
    from dsv4_attention.stages.d5_sink_merge import apply_sink

    lse = torch.tensor([p[0] for p in PAIRS], dtype=torch.float64)
    sink = torch.tensor([p[1] for p in PAIRS], dtype=torch.float64)
    want = [factor(a, b) for a, b in PAIRS]
    assert mismatches(sink_scale(lse, sink).tolist()) == []
    assert mismatches(_sink_scale(lse, sink).tolist()) == []
    # apply_sink on O = 1: one head per pair, [1, 1, heads, 1] with lse [1, heads, 1]
    o = apply_sink(torch.ones(1, 1, len(PAIRS), 1), lse.float()[None, :, None], sink.float())
    assert mismatches(o.flatten().tolist()) == []
    o = apply_sink(torch.ones(1, len(PAIRS), 1), lse.float()[:, None], sink.float(), lse_layout="ht")
    assert mismatches(o.flatten().tolist()) == []
    assert mismatches(torch.sigmoid(lse - sink).tolist()), "the control must fail"
    assert len(want) == len(PAIRS)


def test_combine_torch_empty_rows_with_infinite_sinks():
    """split-KV's torch merge: a row every part of which is empty stays O = 0, LSE = -inf for sinks
    of -inf and +inf; a non-empty row with a -inf sink equals the merge without a sink."""
    from dsv4_attention.common import split_kv

    g = torch.Generator().manual_seed(3)
    b, s, h, d, parts = 1, 4, 3, 8, 2
    o_part = torch.randn(parts * b, s, h, d, generator=g)
    lse_part = torch.randn(parts * b, h, s, generator=g)
    lse_part[:, :, 0] = -math.inf  # token 0: empty in every part
    o_part[:, 0] = 0.0
    sink = torch.tensor([-math.inf, math.inf, 0.5])
    o, lse = torch.empty(b, s, h, d), torch.empty(b, h, s)
    split_kv.combine_torch(o_part, lse_part, o, lse, sink)
    o_plain, lse_plain = torch.empty(b, s, h, d), torch.empty(b, h, s)
    split_kv.combine_torch(o_part, lse_part, o_plain, lse_plain, None)
    assert torch.isfinite(o).all()
    assert bool((o[:, 0] == 0).all()) and bool(torch.isneginf(lse[:, :, 0]).all())
    assert torch.equal(lse, lse_plain)
    assert torch.equal(o[:, 1:, 0], o_plain[:, 1:, 0])  # sink -inf: nothing changes
    assert bool((o[:, :, 1] == 0).all())  # sink +inf: O = 0
