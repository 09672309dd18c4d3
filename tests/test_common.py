"""The shared testing and evidence pieces fail when they should."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from dsv4_attention.common import report, testing
from dsv4_attention.common.layout_proof import swizzle_bytes
from dsv4_attention.common.testing import errors, poison_

pytestmark = [pytest.mark.stage_a]


def test_nan_never_passes():
    ref = torch.ones(4, 8, dtype=torch.float64)
    out = ref.clone()
    out[2, 3] = float("nan")
    e = errors(out, ref)
    assert math.isinf(e.rel_fro) and not e.within(1.0, 1.0)


def test_unwritten_poison_fails():
    ref = torch.ones(3, 5, dtype=torch.float64)
    out = poison_(torch.empty(3, 5))
    out[:2] = 1.0
    assert not errors(out, ref).within(1e-3, 1e-3)


def test_one_bad_row_is_seen():
    ref = torch.randn(1000, 64, dtype=torch.float64)
    out = ref.clone()
    out[617] *= 1.01
    e = errors(out, ref)
    assert e.rel_fro < 1e-3 < e.row_rel and e.worst_row == (617,)


def test_vectors_and_scalars_are_one_row():
    """A sink's gradient [heads] (and a scalar) is one row: the measures read it whole (a 1-D
    input raised IndexError on the device, 2026-11-29), and a wrong entry still fails."""
    ref = torch.randn(64, dtype=torch.float64)
    assert errors(ref.clone(), ref).within(1e-12, 1e-12) and errors(ref.clone(), ref).worst_row == ()
    bad = ref.clone()
    bad[5] += 1.0
    assert not errors(bad, ref).within(1e-3, 1e-3)
    assert not errors(torch.tensor(2.0), torch.tensor(1.0, dtype=torch.float64)).within(1e-3, 1e-3)


def test_subnormal_rows_measure_the_kernel_not_the_format():
    """An fp16 row of subnormal values (a sink that swallows its row: O = 1.5e-6 v), exactly
    rounded, is error-free; the same row three steps off, and a normal row 1 % off, still fail
    (the negative controls: the step forgives only what fp16 cannot show)."""
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(4, 512, generator=g, dtype=torch.float64) * 1.5e-6
    rounded = ref.to(torch.float16)
    step = testing.subnormal_step(torch.float16)
    assert step == 2.0 ** -24
    raw_row = ((rounded.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert raw_row > 1e-2  # what the plain measure saw on the device (D5, 2026-12-03)
    assert errors(rounded, ref).within(1e-12, 1e-12)
    off = rounded.clone()
    off[2] = (off[2].double() + 3 * step).half()
    assert not errors(off, ref).within(1e-2, 3e-2) and errors(off, ref).worst_row == (2,)
    normal = torch.randn(4, 512, generator=g, dtype=torch.float64)
    assert not errors((normal * 1.01).half(), normal).within(1e-3, 3e-3)
    assert testing.subnormal_step(torch.float64) == 0.0 and testing.subnormal_step(torch.bfloat16) < 1e-40


def test_swizzle_acts_on_bytes():
    # S<3,4,3>: bits 7..9 of the byte address XOR into bits 4..6 (16-byte chunks within 128 B)
    assert swizzle_bytes(0x80, 3, 4, 3) == 0x90
    assert swizzle_bytes(0x3F0, 3, 4, 3) == 0x3F0 ^ 0x70
    assert all(swizzle_bytes(a, 3, 4, 3) // 128 == a // 128 for a in range(0, 4096, 16))


def test_register_split_error():
    """The setmaxnreg check (common/compile.py, run by every compile test) passes the library's
    splits and rejects the split that hung every launch of a 384-thread kernel at 168 registers:
    producer 64 + 2 x 224 per thread (65,536 > 64,512), and a target that is not a multiple of 8."""
    from dsv4_attention.common.compile import register_split_error
    from dsv4_attention.common.sm90_gemm import REGISTERS

    for wg, (consumer, producer) in REGISTERS.items():
        threads = 128 * (1 + wg)
        entry = 65536 // threads // 8 * 8
        assert register_split_error([(128, producer), (128 * wg, consumer)], entry) is None
    assert register_split_error([(128, 56), (256, 224)], 168) is None  # the gathering producer's split
    assert register_split_error([(128, 72), (256, 216)], 168) is None
    assert "wait for ever" in register_split_error([(128, 64), (256, 224)], 168)
    assert "multiples of 8" in register_split_error([(128, 60), (256, 224)], 168)
    assert register_split_error(None, 168) is None


# stage F's dQ warp as it hung on an H200: elect_one around a TMA reduce-add that elects a lane itself
_NESTED_ELECT_PTX = """\
\tbar.sync \t5, 288;
\telect.sync \t%r798|%p66, -1;
\tnot.pred \t%p67, %p66;
\t@%p67 bra \t$L__BB0_57;
\telect.sync \t%r799|%p68, -1;
\tnot.pred \t%p69, %p68;
\t@%p69 bra \t$L__BB0_56;
\tcp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%rd114, {%r804, %r801}], [%r21];
$L__BB0_56:
\tcp.async.bulk.commit_group;
\tcp.async.bulk.wait_group.read \t0;
$L__BB0_57:
\tbar.arrive 6, 288;
"""


def test_nested_elects():
    """The PTX check run by every compile test (common/compile.py) flags the elect.sync that hung
    stage F's first dQ warp (negative control) and passes its fix and the TMA-store epilogue's
    single elect (the same copy with one elect, and two regions one after the other)."""
    from dsv4_attention.common.compile import nested_elects

    assert nested_elects(_NESTED_ELECT_PTX) == [5]
    lines = _NESTED_ELECT_PTX.splitlines()
    fixed = "\n".join(lines[:1] + lines[4:])  # the copy's own elect only
    assert nested_elects(fixed) == []
    store = "\n".join(lines[4:9] + [ln.replace("BB0_56", "BB0_58") for ln in lines[4:9]])  # two regions in a row
    assert nested_elects(store) == []
    # an if-else's elected arm ending in bra.uni to the join, the other arm (with its own regions) after
    # it, as in stage E's producer: not nested
    arms = "\n".join(lines[4:8] + ["\tbra.uni \t$L__BB0_56;", "$L__BB0_60:"] +
                     [ln.replace("BB0_56", "BB0_58") for ln in lines[4:9]] + ["$L__BB0_56:"])
    assert nested_elects(arms) == []


def test_report_staleness(tmp_path):
    (tmp_path / "dsv4_attention" / "common").mkdir(parents=True)
    (tmp_path / "dsv4_attention" / "stages").mkdir()
    f = tmp_path / "dsv4_attention" / "common" / "x.py"  # named common/x.py, as in the design card
    f.write_text("a = 1\n")
    rep = {"sources": report.sources(tmp_path)}
    assert not report.is_stale(rep, tmp_path)
    f.write_text("a = 2\n")
    assert report.stale_files(rep, tmp_path) == ["common/x.py"]
    json.dumps(rep)


def test_merge_keeps_each_group_of_its_own_code():
    """A run's results replace the same parts of the same groups; other groups keep theirs."""
    srcs = report.sources()
    old = report.settle({"sources": srcs, "bench": [{"stage": "a"}], "runs": [], "date": "1"})
    report.add_tests(old, {"tests": {"a": {"sm90": {"passed": 2}}}, "errors": {}}, "all", ["a", "b"])
    old["bench_sources"] = {"a": report.scoped(srcs, "a", "bench")}
    new = {"sources": srcs, "bench": [], "runs": [], "date": "2"}
    report.add_tests(new, {"tests": {"b": {"sm90": {"passed": 3}}}, "errors": {}}, "stage", ["b"])
    merged = report.merge(old, new)
    assert merged["tests"] == {"a": {"sm90": {"passed": 2}}, "b": {"sm90": {"passed": 3}}}
    assert report.test_state(merged, "b") == ("current", ["stage"])  # the newer complete part wins
    assert merged["bench"] == [{"stage": "a"}] and report.bench_current(merged, "a")


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run_with_gpu_arch(env_arch: str, cmd: list) -> subprocess.CompletedProcess:
    # a GPU machine's architecture, as CuTeDSL sees it: CUTE_DSL_ARCH wins over detection
    env = dict(os.environ, CUTE_DSL_ARCH=env_arch)
    return subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


# issue 12: host proofs must target the architecture they are about, not the GPU present. An sm100
# negative control built its atom outside the trace, and failed on a Hopper machine.
@pytest.mark.parametrize("env_arch,node", [
    ("sm_90a", "tests/test_b_sm100_tmem_p.py::test_checker_rejects_s_rows_spread_over_threads"),
    ("sm_100a", "tests/test_c_sm90_host.py::test_v_ring_checker_rejects_wrong_views"),
])
def test_host_proofs_ignore_the_gpu_arch(env_arch, node):
    p = _run_with_gpu_arch(env_arch, ["-m", "pytest", "-q", "-p", "no:cacheprovider", node])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]


def test_target_arch_overrides_the_gpu_arch_and_restores_it():
    script = """
from cutlass.base_dsl.common import DSLUserCodeError
from cutlass.cute.nvgpu import tcgen05
from dsv4_attention.common.arch import target_arch
with target_arch("sm100"):
    tcgen05.Ld16x256bOp(tcgen05.Repetition(4))
try:
    tcgen05.Ld16x256bOp(tcgen05.Repetition(4))
except DSLUserCodeError:
    print("restored")
"""
    p = _run_with_gpu_arch("sm_90a", ["-c", script])
    assert p.returncode == 0 and "restored" in p.stdout, (p.stdout + p.stderr)[-3000:]


def test_record_errors_keeps_plain_values(record_errors, request):
    """A case argument that is a tensor (a test's seqused_k) is recorded as a list: under xdist a
    tensor in user_properties cannot be sent to the controller, and the INTERNALERROR it raised
    ended a whole device session."""
    from dsv4_attention.common.testing import Errors

    record_errors(Errors(0.1, 0.2, 0.3, ()), seqused_k=torch.tensor([3, 0], dtype=torch.int32), causal=True)
    (_, row), = [p for p in request.node.user_properties if p[0] == "errors"]
    assert row["seqused_k"] == [3, 0] and row["causal"] is True
    json.dumps(row)
