"""Run the test session and the benchmarks on a GPU and write the device report.

    python -m tools.gpu_report --out DIR [--stage a ... | --stage calls | --stage decode]
                               [--tests all|stage|stage-only|gpu|cp|none] [--no-bench] [--no-sanity] [--shard K/N]
                               [--deadline-s S] [--conformance]

Writes DIR/<gpu>.json (e.g. h100.json): device, date, versions, ``sources``
(sha256 of every file under stages/ and common/), test counts per stage and
arch, the worst errors the tests recorded, the benchmark rows with their peers
measured in the same run, and the peers' sanity check against the anchors.

``--tests all`` (the default) runs the whole test session, host tests included, as a
user runs it where the kernels run (on a GPU machine CuTeDSL would take the GPU's
architecture for any host test that does not name its own); every failure is counted
in the report, and a report with failures verifies nothing (tools/status.py).
``gpu`` runs the GPU tests of the chosen stages only; ``cp`` the context-parallel tests (on a
machine of several GPUs, whose report is its own file: h200x2.json); ``none`` runs no test
(benchmarks). ``--stage cp`` is the 2-GPU context-parallel benchmark.
``--shard K/N`` runs the K-th of N parts of the session (whole test files, balanced by their
rough GPU weight), so that a session longer than the device's 10-minute command limit runs
in N calls. ``stage`` runs every test of the ``--stage`` stages (host, compile, proof and GPU
tests: the whole session's share of those stages) and the tests of no stage; ``stage-only`` the
same without the tests of no stage (a session of several calls on one GPU runs those once, in its
first call, and the later calls only the stages' own tests).
Results are kept per group (a stage, or ``none``), each with the sha256 of the files its
evidence depends on (common/scope.py): the run's results are merged into docs/results/<gpu>.json
from the tree, replacing the same parts of the same groups, and a group whose files changed since
its results ran shows as stale until it runs again (common/report.py). So after a change to one
stage's kernel, ``--tests stage --stage X`` and ``--tests none --stage X`` bring X's evidence up
to date without re-running the other stages. Copy the file into docs/results/ and commit it.
Runs made side by side, one per GPU of one machine (``CUDA_VISIBLE_DEVICES=i``, each its own
``--out``), each also write their own parts, ``<gpu>-run.json``: ``python -m tools.merge_runs``
merges them into docs/results/<gpu>.json.

``--conformance`` also runs FlashMLA's own sparse-prefill test against ``index_attention`` (the
device pack's harness, kv passed strided) and records its counts under ``conformance``.

The report is written after the tests and again after each benchmark group, so a call that
the device's 10-minute limit cuts keeps what finished; ``--deadline-s S`` starts no benchmark
group past S seconds from the start (the run's record lists the groups left out, and their
rows stay as the earlier reports left them).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from dsv4_attention.common import report, scope
from dsv4_attention.common.arch import gpu_name, present_arch

# rough weights of the test files (GPU minutes under 16 workers); any other file weighs 1
WEIGHTS = {"test_e_gpu.py": 8, "test_d1_gpu.py": 5, "test_d4_gpu.py": 5, "test_c_gpu.py": 4, "test_d3_gpu.py": 4,
           "test_d5_gpu.py": 4, "test_context_parallel.py": 4, "test_d2_gpu.py": 3, "test_b_gpu.py": 3,
           "test_a_gpu.py": 2, "test_ops.py": 3}


def shard_files(k: int, n: int, tests: pathlib.Path = pathlib.Path("tests")) -> list:
    """The test files of part ``k`` (1-based) of ``n``: heaviest first, each to the lightest part."""
    files = sorted(p.name for p in tests.glob("test_*.py"))
    parts = [[0, []] for _ in range(n)]
    for f in sorted(files, key=lambda f: (-WEIGHTS.get(f, 1), f)):
        part = min(parts, key=lambda p: p[0])
        part[0] += WEIGHTS.get(f, 1)
        part[1].append(f)
    return [str(tests / f) for f in sorted(parts[k - 1][1])]


def _pytest(select: list, workers: str, files, log) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        res = pathlib.Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *select,
               "--durations=20", f"--results-json={res}", *files]
        print("+", " ".join(cmd), flush=True)
        # streamed into the log line by line: a call cut off by the device's time limit still shows
        # how far it got and what was slow
        p = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        tail = []
        for line in p.stdout:
            log.write(line)
            log.flush()
            tail = (tail + [line])[-200:]
        p.wait()
        print("".join(tail)[-6000:], flush=True)
        summary = json.loads(res.read_text()) if res.exists() else {"tests": {}, "errors": {}}
    # pytest's 5: this pass selected no test (e.g. a shard without compile tests)
    summary["pytest_exit"] = 0 if p.returncode == 5 else p.returncode
    return summary


def combine(a: dict, b: dict) -> dict:
    """Two passes' summaries (conftest's record) as one: counts add, errors keep the worst."""
    out = {"pytest_exit": max(a["pytest_exit"], b["pytest_exit"])}
    for key in ("tests", "by_kind"):
        merged = json.loads(json.dumps(a.get(key, {})))
        for st, per_arch in b.get(key, {}).items():
            for arch, c in per_arch.items():
                dst = merged.setdefault(st, {}).setdefault(arch, {})
                if key == "by_kind":
                    for kind, counts in c.items():
                        d = dst.setdefault(kind, {})
                        for outcome, n in counts.items():
                            d[outcome] = d.get(outcome, 0) + n
                else:
                    for outcome, n in c.items():
                        dst[outcome] = dst.get(outcome, 0) + n
        out[key] = merged
    errors = json.loads(json.dumps(a.get("errors", {})))
    for st, per_arch in b.get("errors", {}).items():
        for arch, e in per_arch.items():
            w = errors.setdefault(st, {}).setdefault(arch, {"rel_fro": 0.0, "row_rel": 0.0, "max_abs": 0.0, "cases": 0})
            w["cases"] += e.get("cases", 0)
            for k in ("rel_fro", "row_rel", "max_abs"):
                w[k] = max(w[k], e.get(k, 0.0))
    out["errors"] = errors
    return out


def run_tests(stages, which: str, log, files=("tests",)) -> dict:
    """The selected tests in two passes: everything but the compile tests on every worker, then the
    compile tests, whose one timed assertion (a compile under 30 s) measures the compile only
    while few run at once (``COMPILE_WORKERS``, 4): on a machine busy with 16 workers of host
    proofs and GPU tests a 7-second compile took over 120 s (2026-11-25)."""
    marks = " or ".join(f"stage_{s}" for s in stages)
    every = " or ".join(f"stage_{s}" for s in report.groups() if s != "none")
    select = (f"gpu and ({marks})" if which == "gpu"
              else f"({marks}) or not ({every})" if which == "stage"
              else f"({marks})" if which == "stage-only" else None)
    workers = os.environ.get("PYTEST_WORKERS", "8")
    if which == "gpu":
        return _pytest(["-m", select], workers, files, log)
    both = f"({select}) and " if select else ""
    first = _pytest(["-m", f"{both}not compile"], workers, files, log)
    timed = _pytest(["-m", f"{both}compile"], os.environ.get("COMPILE_WORKERS", "4"), files, log)
    return combine(first, timed)


#: outside suites run beside the tests (``--conformance``): name -> the runner under the device
#: pack's conformance folder (``../shared/device/prepare`` copies it into .device/conformance)
CONFORMANCE = {"flashmla_sparse_prefill": "flashmla-sparse-prefill/run.sh"}
CONFORMANCE_DIR = pathlib.Path(".device/conformance")


def run_conformance(log, root: pathlib.Path = CONFORMANCE_DIR) -> dict:
    """Run each outside suite (FlashMLA's own sparse-prefill test through its shim, with kv passed
    strided: ``FLASHMLA_SHIM_STRICT=1``) and return {name: counts}: its closing line ``N passed, M
    failed, K skipped``, the exit status, the failed case numbers it printed, and the sha256 of the
    library files its evidence depends on (stage E's scope). A suite that is not there is recorded
    as not run, with the reason."""
    import re

    out = {}
    for name, rel in CONFORMANCE.items():
        script = root / rel
        rec = {"date": report.today(), "strict": True, "sources": report.scoped(report.sources(), "e", "tests")}
        if not script.exists():
            out[name] = {**rec, "ran": False, "why": f"{script} not found (run ../shared/device/prepare)"}
            continue
        env = {**os.environ, "FLASHMLA_SHIM_STRICT": "1"}
        cmd = ["bash", str(script), str(pathlib.Path.cwd())]
        print("+", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        p = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        log.write(p.stdout)
        lines = p.stdout.strip().splitlines()
        print("\n".join(lines[-15:]), flush=True)
        last = next((ln for ln in reversed(lines) if re.fullmatch(r"\d+ passed, \d+ failed, \d+ skipped", ln.strip())),
                    None)
        counts = dict(zip(("passed", "failed", "skipped"), map(int, re.findall(r"\d+", last)), strict=True)) \
            if last else {}
        failed_cases = [int(n) for n in re.findall(r"case #(\d+): FAIL", p.stdout)]
        out[name] = {**rec, "ran": True, "exit": p.returncode, "seconds": round(time.monotonic() - t0, 1),
                     **counts, "failed_cases": failed_cases}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--stage", action="append")
    ap.add_argument("--tests", choices=("all", "stage", "stage-only", "gpu", "cp", "none"), default="all")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-sanity", action="store_true")
    ap.add_argument("--conformance", action="store_true",
                    help="also run the outside suites (FlashMLA's sparse-prefill test, kv strided) and record "
                         "their counts")
    ap.add_argument("--shard", help="K/N: run part K of N of the test session")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no benchmark group after this many seconds from the start (the report names "
                         "the groups left out); the report is rewritten after the tests and after each group")
    a = ap.parse_args(argv)
    start = time.monotonic()
    shard = tuple(int(x) for x in a.shard.split("/")) if a.shard else None
    if shard and not (a.tests == "all" and 1 <= shard[0] <= shard[1]):
        ap.error("--shard K/N needs --tests all and 1 <= K <= N")
    if a.tests in ("stage", "stage-only", "gpu") and not a.stage:
        ap.error(f"--tests {a.tests} needs --stage")
    if present_arch() is None:
        print(f"gpu_report needs a Hopper or Blackwell GPU; this machine has {gpu_name() or 'none'}")
        return 2
    if a.tests in ("all", "stage") and not os.environ.get("GPU_REPORT_SKIP_STATUS_CHECK"):
        # pre-flight: the session's harness tests (of no stage: not in ``stage-only`` or ``gpu``)
        # check the rendered status page; a page rendered after the run (twice, on 2026-11-27 and
        # 2026-11-28) fails the session and leaves every stage it ran unproven. Refuse before any
        # test runs. The render takes 80-100 s on the device's machine (2026-11-29).
        from tools import status

        if not status.render(write=False):
            print("gpu_report: README.md / docs/status.md differ from a fresh render: run `python -m tools.status "
                  "render` and commit before the device session (its test_rendered_status_is_current would fail)")
            return 2

    import cutlass
    import torch

    from dsv4_attention import stages as stage_registry
    from dsv4_attention.common import bench
    from tools import bench as bench_tool

    every = [s.id for s in stage_registry.ALL_STAGES]
    # the benches of no stage are the whole-tree groups (common/scope.py: calls, decode, serving,
    # cp), which have no stage tests; cp needs two GPUs, so only `--stage cp` runs it
    no_stage = [g for g in scope.WHOLE_TREE if g in bench_tool.BENCHES]
    stage_ids = [s for s in (a.stage or every) if s not in no_stage]
    bench_ids = [s for s in (a.stage or [*(g for g in no_stage if g != "cp"), *every]) if s in bench_tool.BENCHES]
    gpus = torch.cuda.device_count()
    name = report.gpu_file_name(gpu_name()) + (f"x{gpus}" if gpus > 1 else "")  # h200x2: its own report
    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.tests == "none":
        summary = {"tests": {}, "errors": {}, "pytest_exit": None}
    else:
        with open(out_dir / f"{name}-log.txt", "a") as log:
            files = (shard_files(*shard) if shard else ["tests/test_context_parallel.py"] if a.tests == "cp"
                     else ["tests"])
            summary = run_tests(stage_ids, "all" if a.tests == "cp" else a.tests, log, files)
    srcs = report.sources()
    if a.tests in ("stage", "stage-only") and not stage_ids:
        ap.error(f"--tests {a.tests} needs a --stage that is a stage (not calls, decode or cp)")
    new = {
        "device": gpu_name(),
        "arch": present_arch(),
        "date": report.today(),
        "versions": {"torch": torch.__version__, "cutlass_dsl": cutlass.__version__,
                     "cuda": torch.version.cuda, "python": sys.version.split()[0]},
        "sources": srcs,
        "bench": [],
        "runs": [{"date": report.today(), "stages": stage_ids, "tests": a.tests, "pytest_exit": summary["pytest_exit"],
                  "bench": not a.no_bench}],
    }
    # which groups this run's tests speak for, and as what part of their evidence
    if a.tests == "all":
        part, group_ids = (a.shard if shard else "all"), report.groups()
    elif a.tests == "stage":
        part, group_ids = "stage", [*stage_ids, "none"]
    elif a.tests == "stage-only":
        part, group_ids = "stage", stage_ids
    elif a.tests == "cp":
        part, group_ids = "cp", sorted(summary["tests"])
    elif a.tests == "gpu":
        part, group_ids = "gpu", stage_ids
    else:
        part, group_ids = None, []
    if part:
        new["runs"][0]["part"] = part
        report.add_tests(new, summary, part, group_ids)
    existing = report.RESULTS / f"{name}.json"
    old = report.load(existing) if existing.exists() else None

    def write(final: bool):
        merged = report.merge(old, new)
        (out_dir / f"{name}.json").write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        # this run's own parts: runs made side by side (one per GPU of a machine, tools/merge_runs.py)
        # merge into one report
        (out_dir / f"{name}-run.json").write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        if final:
            print(f"wrote {out_dir / (name + '.json')}: tests {json.dumps(merged['tests'])}")

    if a.conformance:
        with open(out_dir / f"{name}-log.txt", "a") as log:
            new["conformance"] = run_conformance(log)
        print("conformance:", json.dumps(new["conformance"]), flush=True)
    if a.tests != "none" or a.conformance:
        write(False)  # the tests' results survive a benchmark the device's time limit cuts
    if not a.no_bench:
        new["bench_sources"] = {}
        for g in bench_ids:  # one group at a time, the report rewritten after each
            if a.deadline_s and time.monotonic() - start > a.deadline_s:
                skipped = bench_ids[bench_ids.index(g):]
                new["runs"][0]["bench_skipped"] = skipped
                print(f"deadline ({a.deadline_s:.0f} s) passed: benchmarks {skipped} not run", flush=True)
                break
            new["bench"] += bench_tool.run([g])
            new["bench_sources"][g] = report.scoped(srcs, g, "bench")
            write(False)
    if not a.no_sanity:
        new["peer_sanity"] = bench.peer_sanity()
        print("peer sanity:", json.dumps(new["peer_sanity"]), flush=True)
    write(True)
    return summary["pytest_exit"] or 0


if __name__ == "__main__":
    raise SystemExit(main())
