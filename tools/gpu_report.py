"""Run the test session and the benchmarks on a GPU and write the device report.

    python -m tools.gpu_report --out DIR [--stage a ... | --stage calls] [--tests all|gpu|none] [--no-bench]
                               [--no-sanity]

Writes DIR/<gpu>.json (e.g. h100.json): device, date, versions, ``sources``
(sha256 of every file under stages/ and common/), test counts per stage and
arch, the worst errors the tests recorded, the benchmark rows with their peers
measured in the same run, and the peers' sanity check against the anchors.

``--tests all`` (the default) runs the whole test session, host tests included, as a
user runs it where the kernels run (on a GPU machine CuTeDSL would take the GPU's
architecture for any host test that does not name its own); every failure is counted
in the report, and a report with failures verifies nothing (tools/status.py).
``gpu`` runs the GPU tests of the chosen stages only; ``none`` runs no test (benchmarks).
With --stage, the results are merged into docs/results/<gpu>.json from the
tree when that report ran the same code, so each call fits the device's
10-minute command limit. Copy the file into docs/results/ and commit it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from dsv4_attention.common import report
from dsv4_attention.common.arch import gpu_name, present_arch


def run_tests(stages, which: str, log) -> dict:
    marks = " or ".join(f"stage_{s}" for s in stages)
    select = ["-m", f"gpu and ({marks})"] if which == "gpu" else []
    workers = os.environ.get("PYTEST_WORKERS", "8")
    with tempfile.TemporaryDirectory() as tmp:
        res = pathlib.Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *select,
               f"--results-json={res}", "tests"]
        print("+", " ".join(cmd), flush=True)
        p = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log.write(p.stdout)
        print(p.stdout[-6000:], flush=True)
        summary = json.loads(res.read_text()) if res.exists() else {"tests": {}, "errors": {}}
    summary["pytest_exit"] = p.returncode
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--stage", action="append")
    ap.add_argument("--tests", choices=("all", "gpu", "none"), default="all")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-sanity", action="store_true")
    a = ap.parse_args(argv)
    if present_arch() is None:
        print(f"gpu_report needs a Hopper or Blackwell GPU; this machine has {gpu_name() or 'none'}")
        return 2

    import cutlass
    import torch

    from dsv4_attention import stages as stage_registry
    from dsv4_attention.common import bench
    from tools import bench as bench_tool

    every = [s.id for s in stage_registry.STAGES]
    # "calls" (host time per call, first call in a fresh process) is a bench of no stage
    stage_ids = [s for s in (a.stage or every) if s != "calls"]
    bench_ids = [s for s in (a.stage or ["calls", *every]) if s in bench_tool.BENCHES]
    name = report.gpu_file_name(gpu_name())
    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.tests == "none":
        summary = {"tests": {}, "errors": {}, "pytest_exit": None}
    else:
        with open(out_dir / f"{name}-log.txt", "a") as log:
            summary = run_tests(stage_ids, a.tests, log)
    # the whole session also counts the tests of no stage (harness, reference, status)
    keys = list(stage_ids) + (["none"] if a.tests == "all" and "none" in summary["tests"] else [])
    new = {
        "device": gpu_name(),
        "arch": present_arch(),
        "date": report.today(),
        "versions": {"torch": torch.__version__, "cutlass_dsl": cutlass.__version__,
                     "cuda": torch.version.cuda, "python": sys.version.split()[0]},
        "sources": report.sources(),
        "tests": {s: summary["tests"].get(s, {}) for s in keys if s in summary["tests"]},
        "errors": {s: summary["errors"].get(s, {}) for s in keys if s in summary["errors"]},
        "bench": [],
        "runs": [{"date": report.today(), "stages": stage_ids, "tests": a.tests, "pytest_exit": summary["pytest_exit"],
                  "bench": not a.no_bench}],
    }
    if not a.no_bench:
        new["bench"] = bench_tool.run(bench_ids)
    if not a.no_sanity:
        new["peer_sanity"] = bench.peer_sanity()
        print("peer sanity:", json.dumps(new["peer_sanity"]), flush=True)
    existing = report.RESULTS / f"{name}.json"
    merged = report.merge(report.load(existing) if existing.exists() else None, new)
    (out_dir / f"{name}.json").write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out_dir / (name + '.json')}: tests {json.dumps(merged['tests'])}")
    return summary["pytest_exit"] or 0


if __name__ == "__main__":
    raise SystemExit(main())
