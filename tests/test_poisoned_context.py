"""The test session's guard against a poisoned CUDA context (tests/conftest.py): a test that raises
a sticky CUDA error (a device-side assert, an illegal address) ends its process after its reports,
so that pytest-xdist runs the rest on a fresh worker instead of failing every later test of the
same one (on 2026-12-01 one out-of-bounds gather in a test's reference failed 14 GPU tests), and a
single-process session stops saying why. Checked without a GPU: the error is raised by hand in a
pytest run in a subprocess (with a copy of the suite's conftest) and the tests record their
process ids. Negative control: a CUDA error that leaves the context usable (out of memory) keeps
the worker."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

TESTS = '''
import os, pathlib

def record():
    with pathlib.Path(os.environ["PIDS"]).open("a") as f:
        f.write(f"{os.getpid()}\\n")

def test_1_raises():
    record()
    raise RuntimeError("CUDA error: MESSAGE")

def test_2_after():
    record()
'''


def run(tmp_path: pathlib.Path, message: str, *args) -> tuple:
    shutil.copy(pathlib.Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(TESTS.replace("MESSAGE", message))
    pids = tmp_path / "pids.txt"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          str(tmp_path / "test_cases.py"), *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=240, env={**__import__("os").environ, "PIDS": str(pids)})
    return out.stdout + out.stderr, pids.read_text().split() if pids.exists() else []


def test_a_sticky_error_ends_its_worker_and_the_rest_run_on_a_fresh_one(tmp_path):
    text, pids = run(tmp_path, "device-side assert triggered", "-n", "1", "--results-json",
                     str(tmp_path / "results.json"))
    assert "CUDA context poisoned by" in text and "1 passed" in text, text[-2000:]
    # xdist also reports the exit as a crash of the same test; the record counts the test once
    assert "crashed while running 'test_cases.py::test_1_raises'" in text, text[-2000:]
    assert len(pids) == 2 and pids[0] != pids[1], pids
    counts = json.loads((tmp_path / "results.json").read_text())["tests"]["none"]["any"]
    assert counts == {"passed": 1, "failed": 1, "skipped": 0}, counts


def test_a_usable_context_keeps_its_worker(tmp_path):
    text, pids = run(tmp_path, "out of memory", "-n", "1")
    assert "CUDA context poisoned" not in text and "1 failed, 1 passed" in text, text[-2000:]
    assert len(pids) == 2 and pids[0] == pids[1], pids


def test_a_single_process_session_stops_saying_why(tmp_path):
    text, pids = run(tmp_path, "an illegal memory access was encountered", "-p", "no:xdist")
    assert "CUDA context poisoned by" in text and "1 failed" in text and "passed" not in text, text[-2000:]
    assert len(pids) == 1


@pytest.mark.parametrize("text,sticky", [("CUDA error: device-side assert triggered", True),
                                         ("CUDA error: out of memory", False), ("shapes differ", False)])
def test_which_errors_are_sticky(text, sticky):
    import conftest

    class Info:
        value = RuntimeError(text)

    assert (conftest.sticky_cuda_error(Info) is not None) == sticky
