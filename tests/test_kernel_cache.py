"""Compiled kernels across processes (common/kernel_cache.py). On the CPU: an entry written by
one process is loaded by the next instead of compiling, as a shared library without importing
CuTeDSL (where a C compiler links it; else as an object file through the DSL), a damaged entry
is recompiled, entries of other sources are never looked up (negative control: one changed byte
changes the name), and the cache can be turned off. On a GPU: a fresh process that finds the
entry runs the kernel with the same bits as the process that compiled it, without importing the
DSL, and says how long its first call took."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dsv4_attention.common import kernel_cache
from dsv4_attention.common.testing import gpu_arch_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE_CHILD = r"""
import json, torch
from dsv4_attention import stages
from dsv4_attention.common import jit, kernel_cache
from dsv4_attention.common.arch import target_arch
mod = stages.get("a").module
key = ("test_kernel_cache", "sm90", 64)
with target_arch("sm90"):
    args = mod.example_args(torch.bfloat16, 64)
    fn = kernel_cache.load_or_compile(
        key, lambda: jit.compile_kernel(mod.make_kernel("sm90", torch.bfloat16, 64), args, "sm90"))
print(json.dumps({**kernel_cache.stats, "type": type(fn).__name__, "name": kernel_cache.entry_name(key)}))
"""


LOAD_CHILD = r"""
import json, sys
from dsv4_attention.common import kernel_cache
def refuse():
    raise AssertionError("compiled: the entry was not found")
fn = kernel_cache.load_or_compile(("test_kernel_cache", "sm90", 64), refuse)
print(json.dumps({**kernel_cache.stats, "type": type(fn).__name__, "dsl_imported": "cutlass" in sys.modules}))
"""
LINKS = shutil.which(os.environ.get("CC") or "cc") is not None
SUFFIX = ".so" if LINKS else ".o"


def run_child(code: str, cache_dir, **env) -> dict:
    e = dict(os.environ, DSV4_ATTENTION_CACHE_DIR=str(cache_dir), **env)
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    out["stderr"] = p.stderr
    return out


@pytest.mark.arch("sm90")
@pytest.mark.compile
def test_second_process_loads_instead_of_compiling(tmp_path):
    first = run_child(COMPILE_CHILD, tmp_path)
    assert (first["compiled"], first["written"], first["loaded"]) == (1, 1, 0)
    entry = tmp_path / f"{first['name']}{SUFFIX}"
    assert entry.is_file() and entry.stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == [entry.name], "no temporary file left behind"

    second = run_child(COMPILE_CHILD, tmp_path)
    assert (second["compiled"], second["loaded"]) == (0, 1)
    assert second["type"] == first["type"]

    entry.write_bytes(b"not an object file")  # damaged: recompiled and rewritten, never fatal
    third = run_child(COMPILE_CHILD, tmp_path)
    assert (third["compiled"], third["written"], third["loaded"]) == (1, 1, 0)
    assert "did not load" in third["stderr"]
    assert run_child(COMPILE_CHILD, tmp_path)["loaded"] == 1


@pytest.mark.arch("sm90")
@pytest.mark.compile
@pytest.mark.skipif(not LINKS, reason="no C compiler ($CC or cc) to link entries: they stay object files, loaded "
                                      "through the DSL")
def test_a_loaded_entry_does_not_import_the_dsl(tmp_path):
    assert run_child(COMPILE_CHILD, tmp_path)["written"] == 1
    loaded = run_child(LOAD_CHILD, tmp_path)
    assert (loaded["loaded"], loaded["loaded_so"], loaded["compiled"]) == (1, 1, 0)
    assert loaded["type"] == "Function" and loaded["dsl_imported"] is False
    # negative control: the object-file entry (no linker) loads only through the DSL, which it imports
    (so,) = tmp_path.glob("*.so")
    so.unlink()
    assert run_child(COMPILE_CHILD, tmp_path, CC="/nonexistent/cc")["written"] == 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".o"]
    loaded = run_child(LOAD_CHILD, tmp_path)
    assert (loaded["loaded"], loaded["loaded_so"]) == (1, 0) and loaded["dsl_imported"] is True


@pytest.mark.arch("sm90")
@pytest.mark.compile
def test_disabled_cache_writes_nothing(tmp_path):
    out = run_child(COMPILE_CHILD, tmp_path, DSV4_ATTENTION_DISABLE_CACHE="1")
    assert (out["compiled"], out["written"], out["loaded"]) == (1, 0, 0)
    assert not any(tmp_path.iterdir())


def test_a_changed_source_changes_every_name(tmp_path):
    """Negative control for staleness: the digest sees every byte of every source file."""
    roots = {}
    for name in ("common", "stages"):
        shutil.copytree(os.path.join(ROOT, name), tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        roots[f"dsv4_attention.{name}"] = tmp_path / name
    base = kernel_cache.hash_sources(roots, "4.8.1")
    assert base == kernel_cache.hash_sources(roots, "4.8.1")
    assert base != kernel_cache.hash_sources(roots, "4.8.2"), "a DSL upgrade invalidates every entry"
    victim = tmp_path / "stages" / "d4_causal_window" / "sm90.py"
    victim.write_bytes(victim.read_bytes().replace(b"def ", b"def  ", 1))
    assert kernel_cache.hash_sources(roots, "4.8.1") != base
    (tmp_path / "common" / "new_module.py").write_text("")
    assert kernel_cache.hash_sources(roots, "4.8.1") != base


def test_directory_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(kernel_cache.ENV_DISABLE, raising=False)
    assert kernel_cache.directory() == tmp_path
    monkeypatch.setenv(kernel_cache.ENV_DISABLE, "1")
    assert kernel_cache.directory() is None
    monkeypatch.delenv(kernel_cache.ENV_DIR)
    monkeypatch.delenv(kernel_cache.ENV_DISABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.directory() == tmp_path / "xdg" / "dsv4_attention"


# ---- on a GPU: the loaded kernel runs, with the compiled one's bits -------------------------

RUN_CHILD = r"""
import hashlib, json, sys, time, torch
import dsv4_attention
from dsv4_attention.common import kernel_cache
from dsv4_attention.common.reference import attention as reference
from dsv4_attention.common.testing import errors
g = torch.Generator(device="cuda").manual_seed(7)
q = torch.randn(2, 300, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(2, 500, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn(2, 500, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
torch.cuda.synchronize()
t0 = time.perf_counter()
o, lse = dsv4_attention.attention(q, k, v, causal=True, window_size=(100, 0))
torch.cuda.synchronize()
first = time.perf_counter() - t0
dsl = "cutlass" in sys.modules  # after the two calls, before anything else runs
e = errors(o, reference(q, k, v, causal=True, window_size=(100, 0))[0])
bits = hashlib.sha256(o.view(torch.int16).cpu().numpy().tobytes() + lse.cpu().numpy().tobytes()).hexdigest()
print(json.dumps({**kernel_cache.stats, "first_call_s": first, "rel_fro": e.rel_fro, "bits": bits,
                  "dsl_imported": dsl}))
"""


@pytest.mark.stage_d4
@pytest.mark.parametrize("arch", gpu_arch_params())
def test_fresh_process_runs_the_loaded_kernel(arch, tmp_path):
    compiled = run_child(RUN_CHILD, tmp_path)
    loaded = run_child(RUN_CHILD, tmp_path)
    assert compiled["compiled"] >= 1 and compiled["loaded"] == 0
    assert loaded["compiled"] == 0 and loaded["loaded"] == compiled["compiled"]
    assert compiled["rel_fro"] < 4e-3 and loaded["bits"] == compiled["bits"]
    if LINKS:  # the loaded process ran the kernel without importing CuTeDSL
        assert loaded["loaded_so"] == loaded["loaded"] and loaded["dsl_imported"] is False
    print(f"first call: {compiled['first_call_s']:.3f} s compiling, {loaded['first_call_s']:.3f} s loading")
