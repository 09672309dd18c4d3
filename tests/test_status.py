"""The README status table and the docs status/results pages are what the evidence renders to, and
the evidence of each stage goes stale with its own files only."""

import os

import pytest

from tools import status


def test_rendered_status_is_current():
    assert status.render(write=False), "run `python -m tools.status render` (or `nox -s status`) and commit"


def _summary(group, passed, failed=0, rel=1e-3):
    return {"tests": {group: {"sm90": {"passed": passed, "failed": failed, "skipped": 1}}},
            "errors": {group: {"sm90": {"rel_fro": rel, "row_rel": rel, "max_abs": rel, "cases": 2}}}}


def _tree(root):
    """A repository of two stages, p and q, whose kernels (reached through their kernel strings)
    import common/shared.py and common/other.py, their tests and benches."""
    files = {
        "common/__init__.py": "",
        "common/shared.py": "X = 1\n",
        "common/other.py": "Y = 1\n",
        "common/unused.py": "Z = 1\n",
        "stages/__init__.py": "import importlib\n",
        "stages/p_one/__init__.py": 'ID = "p"\nKERNELS = {"sm90": "dsv4_attention.stages.p_one.sm90:K"}\n',
        "stages/p_one/sm90.py": "from dsv4_attention.common import shared\n",
        "stages/q_two/__init__.py": 'ID = "q"\nKERNELS = {"sm90": "dsv4_attention.stages.q_two.sm90:K"}\n',
        "stages/q_two/sm90.py": "from dsv4_attention.common.other import Y\n",
        "tests/conftest.py": "",
        "tests/test_p.py": "import pytest\npytestmark = pytest.mark.stage_p\nfrom dsv4_attention.stages import p_one\n",
        "tests/test_q.py": "import pytest\npytestmark = pytest.mark.stage_q\nfrom dsv4_attention.stages import q_two\n",
        "tools/bench.py": ("def bench_p(dev):\n    from dsv4_attention.stages import p_one\n\n"
                           "def bench_q(dev):\n    from dsv4_attention.stages import q_two\n\n"
                           'BENCHES = {"p": bench_p, "q": bench_q}\n'),
    }
    for rel, text in files.items():  # common/ and stages/ are the package's, linked at the top as in the repo
        path = root / ("dsv4_attention/" + rel if rel.startswith(("common/", "stages/")) else rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for name in ("common", "stages"):
        (root / name).symlink_to(f"dsv4_attention/{name}")


def test_each_stage_evidence_goes_stale_with_its_own_files_only(tmp_path):
    """A change to the file of one stage's scope leaves that stage's results stale and the other's
    current (negative control: the same change does reach the stage that imports it); a file no
    stage imports changes only the groups of the whole tree."""
    from dsv4_attention.common import report, scope

    _tree(tmp_path)
    # the registry (stages/__init__.py) loads q's package but not q's kernel
    assert scope.scope("p", "tests", tmp_path) == ["common/__init__.py", "common/shared.py", "stages/__init__.py",
                                                    "stages/p_one/__init__.py", "stages/p_one/sm90.py",
                                                    "stages/q_two/__init__.py"]
    assert "common/other.py" in scope.scope("q", "bench", tmp_path)
    rep = {"sources": report.sources(tmp_path), "date": "1"}
    report.add_tests(rep, {"tests": {**_summary("p", 3)["tests"], **_summary("q", 4)["tests"]}, "errors": {}},
                     "all", ["p", "q", "none"], tmp_path)
    rep["bench_sources"] = {g: report.scoped(rep["sources"], g, "bench", tmp_path) for g in ("p", "q")}
    assert report.stale_groups(rep, tmp_path) == []
    (tmp_path / "common" / "other.py").write_text("Y = 2\n")
    assert report.test_state(rep, "p", tmp_path)[0] == "current" and report.bench_current(rep, "p", tmp_path)
    assert report.stale_groups(rep, tmp_path) == ["none", "q"]
    (tmp_path / "common" / "other.py").write_text("Y = 1\n")
    (tmp_path / "stages" / "p_one" / "sm90.py").write_text("from dsv4_attention.common import shared  # changed\n")
    assert report.stale_groups(rep, tmp_path) == ["none", "p"]
    (tmp_path / "stages" / "p_one" / "sm90.py").write_text("from dsv4_attention.common import shared\n")
    (tmp_path / "common" / "unused.py").write_text("Z = 2\n")
    assert report.stale_groups(rep, tmp_path) == ["none"]


def test_a_stage_name_in_a_string_does_not_join_the_stage(tmp_path):
    """A test file joins stage p's scope by marking tests ``stage_p``, not by naming it in a string
    (a test of the session's selection expression, as tests/test_status.py has, is no test of
    p): what that file imports stays out of p's scope. Control: the same file with the mark
    joins, and brings its import."""
    from dsv4_attention.common import scope

    _tree(tmp_path)
    (tmp_path / "tests" / "test_harness.py").write_text(
        "from dsv4_attention.common import other\n\ndef test_x():\n    assert 'stage_p or stage_q'\n")
    assert "common/other.py" not in scope.scope("p", "tests", tmp_path)
    (tmp_path / "tests" / "test_harness.py").write_text(
        "import pytest\nfrom dsv4_attention.common import other\n\n@pytest.mark.stage_p\ndef test_x():\n    pass\n")
    assert "common/other.py" in scope.scope("p", "tests", tmp_path)


def test_evidence_of_a_wider_scope_stays_current_when_the_scope_narrows(tmp_path):
    """A record holding more files than the stage's scope now (a test file no longer marked for
    the stage) still describes the code: every file of the scope ran with its hash. Control: a
    scope that widens past the record (a newly marked test file's import) is stale."""
    from dsv4_attention.common import report

    _tree(tmp_path)
    extra = tmp_path / "tests" / "test_extra.py"
    extra.write_text(
        "import pytest\nfrom dsv4_attention.common import other\n\n@pytest.mark.stage_p\ndef test_x():\n    pass\n")
    rep = {"sources": report.sources(tmp_path), "date": "1"}
    report.add_tests(rep, _summary("p", 3), "all", ["p"], tmp_path)
    assert "common/other.py" in rep["parts"]["p"]["all"]["sources"]
    extra.write_text("from dsv4_attention.common import other\n\ndef test_x():\n    pass\n")
    assert report.test_state(rep, "p", tmp_path)[0] == "current"
    (tmp_path / "common" / "new.py").write_text("W = 1\n")
    (tmp_path / "tests" / "test_more.py").write_text(
        "import pytest\nfrom dsv4_attention.common import new\npytestmark = pytest.mark.stage_p\n")
    assert report.test_state(rep, "p", tmp_path)[0] == "stale"


def test_stale_reasons_name_only_files_of_todays_scope(tmp_path):
    """The status page's reason for stale evidence lists the files of the stage's scope that the
    record does not cover, not files the record holds beyond today's scope (changed or not).
    Control: a changed file of the scope is named."""
    from dsv4_attention.common import report
    from tools import status

    _tree(tmp_path)
    extra = tmp_path / "tests" / "test_extra.py"
    extra.write_text("import pytest\nfrom dsv4_attention.common import other\npytestmark = pytest.mark.stage_p\n")
    rep = {"sources": report.sources(tmp_path), "date": "1"}
    report.add_tests(rep, _summary("p", 3), "all", ["p"], tmp_path)
    extra.write_text("from dsv4_attention.common import other\n")  # other.py leaves p's scope
    (tmp_path / "common" / "other.py").write_text("Y = 3\n")
    (tmp_path / "stages" / "p_one" / "sm90.py").write_text("from dsv4_attention.common import shared  # changed\n")
    assert status._changed(rep, "p", ["all"], tmp_path) == "stages/p_one/sm90.py"


def test_bench_scope_follows_the_benchmark_modules(tmp_path):
    """A group's function defined in a tools/bench_*.py module (the registry imports it): its own
    imports and those of a helper it imports from a sibling module are in the group's bench scope;
    a sibling's function it does not call, and another group's function, are not (negative
    controls)."""
    from dsv4_attention.common import scope

    _tree(tmp_path)
    (tmp_path / "tools" / "bench_rows.py").write_text(
        "def helper():\n    from dsv4_attention.common import other\n\n"
        "def unused():\n    from dsv4_attention.common import unused\n")
    (tmp_path / "tools" / "bench_p.py").write_text(
        "from tools.bench_rows import helper\n\n"
        "def bench_p(dev):\n    from dsv4_attention.stages import p_one\n    return helper()\n")
    (tmp_path / "tools" / "bench.py").write_text(
        "from tools.bench_p import bench_p\n\n"
        "def bench_q(dev):\n    from dsv4_attention.stages import q_two\n\n"
        'BENCHES = {"p": bench_p, "q": bench_q}\n')
    got = scope.scope("p", "bench", tmp_path)
    assert "common/other.py" in got and "stages/p_one/sm90.py" in got
    assert "common/unused.py" not in got
    assert "stages/p_one/sm90.py" not in scope.scope("q", "bench", tmp_path)


def test_session_parts_sum_per_group(tmp_path):
    """A session run in parts (gpu_report --shard) sums per group; a group whose files changed
    between parts keeps only the parts of its current code (a part missing shows), while the other
    group's parts of both runs still make one whole; a stage run replaces a group's evidence."""
    from dsv4_attention.common import report

    _tree(tmp_path)
    groups = ["p", "q", "none"]

    def run(summary, part, ids=groups, date="1"):
        new = {"sources": report.sources(tmp_path), "date": date, "bench": [], "runs": []}
        report.add_tests(new, summary, part, ids, tmp_path)
        return new

    rep = report.merge(None, run(_summary("p", 3, 0, 1e-3), "1/2"), tmp_path)
    assert report.test_state(rep, "p", tmp_path) == ("partial", ["1/2"])
    assert report.missing_parts(rep, "p") == ["2/2"]
    rep = report.merge(rep, run(_summary("p", 4, 1, 2e-3), "2/2"), tmp_path)
    assert report.test_state(rep, "p", tmp_path) == ("current", ["1/2", "2/2"])
    assert rep["tests"]["p"]["sm90"] == {"passed": 7, "failed": 1, "skipped": 2}
    assert rep["errors"]["p"]["sm90"]["rel_fro"] == 2e-3 and rep["errors"]["p"]["sm90"]["cases"] == 4
    rep = report.merge(rep, run(_summary("p", 5, 0, 1e-4), "2/2"), tmp_path)  # ran again: replaces, not adds
    assert rep["tests"]["p"]["sm90"] == {"passed": 8, "failed": 0, "skipped": 2}
    (tmp_path / "common" / "other.py").write_text("Y = 2\n")  # q's code changes, p's does not
    rep = report.merge(rep, run(_summary("q", 6), "1/2"), tmp_path)
    assert report.test_state(rep, "p", tmp_path)[0] == "current"  # p's 2/2 of the old tree still counts
    assert report.test_state(rep, "q", tmp_path) == ("partial", ["1/2"])  # q's 2/2 of the old tree is gone
    rep = report.merge(rep, run(_summary("q", 2), "stage", ["q", "none"], date="2"), tmp_path)
    assert report.test_state(rep, "q", tmp_path) == ("current", ["stage"]) and rep["tests"]["q"]["sm90"]["passed"] == 2
    gpu_only = report.merge(None, run(_summary("p", 3), "gpu", ["p"]), tmp_path)
    assert report.test_state(gpu_only, "p", tmp_path)[0] == "partial"  # GPU tests alone verify nothing


def test_scope_of_the_real_stages():
    """Anchors of the real import graph: stage C's evidence does not depend on the kernels that
    came after it, stage E's depends on the skeleton it inherits (D1) and on its gather."""
    from dsv4_attention.common import scope

    c, e = scope.scope("c"), scope.scope("e")
    assert "stages/e_fused/sm90.py" not in c and "stages/d1_smem_p/sm90.py" not in c
    assert {"stages/d1_smem_p/sm90.py", "stages/d5_sink_merge/sm90.py", "common/sm90_gather.py",
            "common/sm90_kv_chunks.py"} <= set(e)
    assert "stages/c_online_softmax/sm90.py" not in scope.scope("e", "bench")
    assert scope.scope("none") == scope.all_sources()


DYNAMIC = """
import json, pathlib, sys
from dsv4_attention.common.compile import compile_here
rep = compile_here("e", "sm90", "bfloat16", 512, {"kv_shared": True, "pack_group": 128, "has_compressed": True,
                                                  "has_topk": True, "index_mode": True}, once=True)
root = pathlib.Path(sys.argv[1])
paths = [pathlib.Path(m.__file__).resolve() for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
from dsv4_attention.common import scope  # after the compile: names the files as a report does
files = sorted({scope.source_name(p, root) for p in paths if p.is_relative_to(root)})
print(json.dumps({"error": rep.error, "files": files}))
"""


@pytest.mark.timeout(300)
def test_scope_covers_what_a_compile_loads():
    """Compile stage E's index-mode kernel for sm_90a in a fresh process: every source file the
    process loaded is in E's static scope. Negative control: the closure of E's __init__.py as the
    registry loads it (no kernel string followed) misses the kernel module the compile loaded."""
    import json
    import subprocess
    import sys

    from dsv4_attention.common import scope

    root = scope.ROOT
    p = subprocess.run([sys.executable, "-c", DYNAMIC, str(root)], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["error"] is None, out["error"]
    loaded = set(out["files"]) & set(scope.all_sources())
    assert "stages/e_fused/sm90.py" in loaded and "common/sm90_gather.py" in loaded
    assert loaded <= set(scope.scope("e")) and loaded <= set(scope.scope("e", "bench"))
    registered = scope.closure({root / "stages" / "e_fused" / "__init__.py": scope.REGISTERED})
    assert loaded - registered, "the control closure should miss the kernel"


def test_session_parts_cover_every_test_file_once():
    import pathlib

    from tools.gpu_report import shard_files

    every = sorted(str(p) for p in pathlib.Path("tests").glob("test_*.py"))
    parts = [shard_files(k, 3) for k in (1, 2, 3)]
    assert sorted(f for p in parts for f in p) == every
    assert all(parts)


def test_ncu_stall_summary_attributes_samples(tmp_path):
    """tools.ncu_stalls on a two-instruction source page: shares by reason and by instruction, the
    spinning branch listed first with the try_wait before it (the barrier it waits on)."""
    from tools import ncu_stalls

    cols = ["Address", "Source", ncu_stalls.SAMPLES, "Instructions Executed", "stall_long_sb", "stall_barrier",
            "stall_long_sb (Not Issued)"]
    rows = [["Kernel Name", "k"], cols,
            ["0x0", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x20], R2", "10", "64", "0", "10", "0"],
            ["0x10", "@!P0 BRA 0x0", "30", "64", "30", "0", "30"]]
    path = tmp_path / "src.csv"
    path.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows))
    text = ncu_stalls.summary(str(path), 2).splitlines()
    assert "samples 40" in text[1] and "long_sb 75.0, barrier 25.0" in text[2]
    assert text[4].startswith("75.00%") and "BRA" in text[4] and "[long_sb 100%]" in text[4]
    assert "after: SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x20]" in text[4]
    assert text[5].startswith("25.00%") and "[barrier 100%]" in text[5]


def test_two_passes_combine_into_one_record():
    """gpu_report runs the compile tests in a pass of their own: the two records add up."""
    from tools.gpu_report import combine

    a = {"pytest_exit": 0, "tests": {"e": {"sm90": {"passed": 3, "failed": 0}}},
         "by_kind": {"e": {"sm90": {"gpu": {"passed": 3}}}},
         "errors": {"e": {"sm90": {"rel_fro": 1e-3, "row_rel": 2e-3, "max_abs": 1e-2, "cases": 3}}}}
    b = {"pytest_exit": 1, "tests": {"e": {"sm90": {"passed": 2, "failed": 1}}, "a": {"sm90": {"passed": 1}}},
         "by_kind": {"e": {"sm90": {"compile": {"passed": 2, "failed": 1}}}}, "errors": {}}
    c = combine(a, b)
    assert c["pytest_exit"] == 1
    assert c["tests"] == {"e": {"sm90": {"passed": 5, "failed": 1}}, "a": {"sm90": {"passed": 1}}}
    assert c["by_kind"]["e"]["sm90"] == {"gpu": {"passed": 3}, "compile": {"passed": 2, "failed": 1}}
    assert c["errors"] == a["errors"]


def test_stage_selections(monkeypatch):
    """``--tests stage`` selects the stages' tests and those of no stage; ``stage-only`` the
    stages' alone (both in a timed pass of compile tests and a pass of the rest)."""
    from tools import gpu_report

    seen = []
    monkeypatch.setattr(gpu_report, "_pytest", lambda select, *a: seen.append(select[1]) or {"pytest_exit": 0})
    monkeypatch.setattr(gpu_report, "combine", lambda a, b: a)
    gpu_report.run_tests(["e", "f"], "stage-only", None)
    gpu_report.run_tests(["e"], "stage", None)
    assert seen[:2] == ["((stage_e or stage_f)) and not compile", "((stage_e or stage_f)) and compile"]
    assert seen[2].startswith("((stage_e) or not (stage_a or ") and seen[2].endswith(")) and not compile")


def test_bench_date_counts_only_runs_that_benchmarked_the_stage():
    """A stage's measured cell carries the date of the last run that benchmarked it: a later run of
    the calls or decode benchmark (stages []) or of other stages does not move it."""
    rep = {"date": "2026-11-26 14:48 UTC", "runs": [
        {"bench": True, "date": "2026-11-25 09:30 UTC", "stages": ["d1", "e"]},
        {"bench": False, "date": "2026-11-25 18:00 UTC", "stages": ["d1"]},  # tests only
        {"bench": True, "date": "2026-11-26 10:00 UTC", "stages": ["c"]},
        {"bench": True, "date": "2026-11-26 14:48 UTC", "stages": []},
    ]}
    assert status._bench_date(rep, "d1") == "2026-11-25 09:30 UTC"
    assert status._bench_date(rep, "c") == "2026-11-26 10:00 UTC"
    assert status._bench_date(rep, "d4") == rep["date"]  # never benchmarked: the report's date


def test_report_survives_a_cut_benchmark(tmp_path, monkeypatch):
    """gpu_report rewrites the report after each benchmark group: when the second group dies (as a
    call cut by the device's time limit does), the file holds the first group's rows; with
    ``--deadline-s`` passed before a group starts, the group is not run and the run's record
    names it. The tests and the GPU are stood in for; the merge, scope and write are the tool's."""
    import json

    from dsv4_attention.common import report
    from tools import bench as bench_tool
    from tools import gpu_report

    monkeypatch.setattr(gpu_report, "present_arch", lambda: "sm90")
    monkeypatch.setattr(gpu_report, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")  # no earlier report
    ran = []

    def fake_run(groups):
        (g,) = groups
        ran.append(g)
        if g == "d4":
            raise RuntimeError("cut")
        return [{"stage": g, "case": f"{g} case", "ours_ms": 1.0}]

    monkeypatch.setattr(bench_tool, "run", fake_run)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="cut"):
        gpu_report.main(["--tests", "none", "--no-sanity", "--stage", "c", "--stage", "d4", "--out", str(out)])
    got = json.loads((out / "h100.json").read_text())
    assert [r["stage"] for r in got["bench"]] == ["c"] and set(got["bench_sources"]) == {"c"}

    ran.clear()
    clock = iter([0.0, 0.0, 50.0, 50.0])  # the start, group c's check, then past the deadline
    monkeypatch.setattr(gpu_report.time, "monotonic", lambda: next(clock))
    assert gpu_report.main(["--tests", "none", "--no-sanity", "--stage", "c", "--stage", "d4", "--deadline-s", "10",
                            "--out", str(out)]) == 0
    got = json.loads((out / "h100.json").read_text())
    assert ran == ["c"]
    assert got["runs"][-1]["bench_skipped"] == ["d4"]
    assert [r["stage"] for r in got["bench"]] == ["c"]
