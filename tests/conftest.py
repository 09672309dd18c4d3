"""Test-suite plumbing: the results record behind the reports and the README status.

``pytest --results-json PATH`` writes, after the run, the outcome counts per
stage, architecture and kind of test, and the worst errors the GPU tests saw
(recorded through the ``record_errors`` fixture). Works under pytest-xdist:
the controller aggregates the reports its workers send.

A test that poisons its process's CUDA context (a device-side assert, an illegal address) ends
that process after its reports (``pytest_runtest_protocol`` below; tests/test_poisoned_context.py),
so that the rest of the session runs on a fresh pytest-xdist worker.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import tempfile

import pytest

STAGE_PREFIX = "stage_"
KINDS = ("gpu", "compile", "proof")


def pytest_addoption(parser):
    parser.addoption("--results-json", default=None, help="write per-stage/arch outcome counts here")


def _arch_of(item) -> str:
    callspec = getattr(item, "callspec", None)
    arch = callspec.params.get("arch") if callspec else None
    marker = item.get_closest_marker("arch")
    return arch or (marker.args[0] if marker else "any")


def pytest_collection_modifyitems(config, items):
    # tagged at collection, so that tests skipped before their fixtures run keep their arch
    for item in items:
        item.user_properties.append(("arch", _arch_of(item)))


_GPU_LOCK = os.path.join(tempfile.gettempdir(), f"dsv4_attention_gpu_tests_{os.getuid()}.lock")


@pytest.fixture(autouse=True)
def _gpu_memory_turns(request):
    """GPU tests share the GPU (a shared lock across pytest-xdist workers); a ``big_memory`` test
    (e.g. tensors past 2^31 elements) takes it alone (the exclusive lock), so that the workers'
    concurrent tests cannot push it out of memory, nor it them. Each GPU test hands its cached
    blocks back to the driver when it ends, so an idle worker holds only its context."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    exclusive = request.node.get_closest_marker("big_memory") is not None
    with open(_GPU_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def recorded_launches(monkeypatch):
    """A stage's compiled function replaced by a recorder: the list of the argument tuples each
    launch would have handed the kernel; sm90 taken for CPU tensors, the call plans cleared before
    and after (host tests of what a call launches, and whether it launches)."""
    from dsv4_attention.common import call_plan, interface, jit

    calls = []
    monkeypatch.setattr(interface, "arch_of_device", lambda device: "sm90")
    monkeypatch.setattr(jit, "stage_kernel", lambda *a, **k: (lambda *args: calls.append(args)))
    call_plan.clear()
    yield calls
    call_plan.clear()


@pytest.fixture
def record_errors(request):
    """record_errors(errors_obj, **case): keep a GPU test's error metrics for the report."""

    def record(errs, **case):
        # plain values only: xdist sends user_properties between processes (a tensor there, e.g.
        # a case's seqused_k, crashed a whole device session with an INTERNALERROR)
        case = {k: (v.tolist() if hasattr(v, "tolist") and not isinstance(v, (list, tuple, str)) else v)
                for k, v in case.items()}
        request.node.user_properties.append(
            ("errors", {"rel_fro": errs.rel_fro, "row_rel": errs.row_rel, "max_abs": errs.max_abs, **case})
        )

    return record


class _Collector:
    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.rows = {}

    def pytest_runtest_logreport(self, report):
        props = dict(p for p in report.user_properties if p[0] == "arch")
        arch = props.get("arch", "any")
        stages = [k[len(STAGE_PREFIX):] for k in report.keywords if k.startswith(STAGE_PREFIX)]
        kind = next((k for k in KINDS if k in report.keywords), "host")
        row = self.rows.setdefault(report.nodeid, {"stages": stages, "arch": arch, "kind": kind,
                                                   "outcome": None, "errors": []})
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            row["outcome"] = report.outcome
        if report.when == "call" and report.outcome != "passed" and report.failed:
            row["outcome"] = "failed"
        if report.when == "teardown" and report.failed:
            row["outcome"] = "failed"
        row["errors"] += [p[1] for p in report.user_properties if p[0] == "errors"]

    def summary(self) -> dict:
        tests, kinds, errors = {}, {}, {}
        for row in self.rows.values():
            outcome = row["outcome"] or "failed"
            for st in row["stages"] or ["none"]:
                t = tests.setdefault(st, {}).setdefault(row["arch"], {"passed": 0, "failed": 0, "skipped": 0})
                t[outcome] = t.get(outcome, 0) + 1
                k = kinds.setdefault(st, {}).setdefault(row["arch"], {}).setdefault(
                    row["kind"], {"passed": 0, "failed": 0, "skipped": 0})
                k[outcome] = k.get(outcome, 0) + 1
                for e in row["errors"]:
                    worst = errors.setdefault(st, {}).setdefault(row["arch"], {"rel_fro": 0.0, "row_rel": 0.0,
                                                                               "max_abs": 0.0, "cases": 0})
                    worst["cases"] += 1
                    for key in ("rel_fro", "row_rel", "max_abs"):
                        worst[key] = max(worst[key], e[key])
        return {"tests": tests, "by_kind": kinds, "errors": errors}

    def pytest_sessionfinish(self, session):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.summary(), indent=1, sort_keys=True))


#: CUDA errors after which a process's context is unusable: every later launch of the process
#: fails with the same error, whatever its test does
STICKY_CUDA_ERRORS = ("device-side assert triggered", "an illegal memory access was encountered",
                      "unspecified launch failure", "misaligned address", "an illegal instruction was encountered")


def sticky_cuda_error(excinfo) -> str | None:
    """The sticky CUDA error a test raised (torch's AcceleratorError, a RuntimeError), or None."""
    if excinfo is None or not isinstance(excinfo.value, RuntimeError):
        return None
    text = str(excinfo.value)
    return next((e for e in STICKY_CUDA_ERRORS if e in text), None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    error = sticky_cuda_error(call.excinfo)
    if error is not None:
        item.stash[_POISONED] = f"{item.nodeid}: CUDA error: {error}"


_POISONED = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test whose CUDA error poisoned its process's context (a device-side assert, an illegal
    address) ends that process once its reports are written: under pytest-xdist the worker exits
    (xdist reports that as a crash of the same test) and a fresh one runs the rest, so one kernel's
    fault is one failure, not a failure of every later test on the same worker (2026-12-01: one
    out-of-bounds gather failed 14 tests); in a single process the session stops, saying why."""
    yield
    why = item.stash.get(_POISONED, None)
    if why is None:
        return
    if hasattr(item.config, "workerinput"):
        import sys

        sys.stderr.write(f"\n[{item.config.workerinput.get('workerid')}] CUDA context poisoned by {why}; this "
                         f"worker exits and pytest-xdist starts a fresh one for the remaining tests\n")
        sys.stderr.flush()
        os._exit(3)
    pytest.exit(f"CUDA context poisoned by {why}: every later GPU test of this process would fail for it", 3)


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # One pytest-xdist worker per core already fills the machine; torch's CPU thread pool
        # (one thread per core in each worker) on top of that oversubscribes it N-fold, and its
        # spinning threads made small-tensor host proofs 200x slower on the 16-core GPU machine
        # (A's store proofs: 250-290 s beside 16 workers, 1.4 s alone).
        import torch

        workers = int(config.workerinput.get("workercount", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    path = config.getoption("--results-json")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Collector(path), "dsv4-results")
