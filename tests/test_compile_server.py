"""The compile harness's server (common/compile.py): a compile forked from the server reports what
a compile in a fresh interpreter reports (the resources ptxas printed, the shared storage, the
PTX checks), a compile past its time limit is killed and reported as such, and a configuration
the kernel refuses comes back as an error, never as a hang or a lost server."""

from __future__ import annotations

import pytest

from dsv4_attention.common import compile as harness


def _report(monkeypatch, served: bool, *args, **kw):
    monkeypatch.setenv("DSV4_COMPILE_SERVER", "1" if served else "0")
    return harness.compile_report(*args, **kw)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_served_compile_reports_what_a_fresh_interpreter_reports(monkeypatch, arch):
    fresh = _report(monkeypatch, False, "b", arch, "bfloat16", 128)
    served = _report(monkeypatch, True, "b", arch, "bfloat16", 128)
    assert fresh.ok and served.ok, (fresh.error, served.error)
    keep = ("registers", "spill_store_bytes", "spill_load_bytes", "stack_bytes", "smem_bytes", "tmem_columns",
            "warnings", "register_plan", "nested_elects")
    assert {k: getattr(served, k) for k in keep} == {k: getattr(fresh, k) for k in keep}
    assert served.registers > 0 and served.seconds > 0


def test_server_kills_a_compile_past_its_limit_and_serves_the_next(monkeypatch):
    late = _report(monkeypatch, True, "e", "sm90", "bfloat16", 512, timeout=2,
                   options={"kv_shared": True, "pack_group": 128, "has_compressed": True})
    assert late.error == "compile exceeded 2 s"
    bad = _report(monkeypatch, True, "a", "sm90", "bfloat16", 100)
    assert bad.error and "head_dim" in bad.error
    ok = _report(monkeypatch, True, "a", "sm90", "bfloat16", 64)
    assert ok.ok and ok.registers > 0
