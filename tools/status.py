"""The status table (stage x architecture), generated from the evidence, never typed.

    python -m tools.status record   # run the CPU suite, write docs/results/cpu.json
    python -m tools.status render   # README.md status block and docs/status.md from the results
    python -m tools.status check    # exit 1 if README.md / docs/status.md differ from a fresh render

Columns: compiles (the compile tests of that stage and arch), layouts proven
on host (its proof tests), verified on a GPU (the GPU tests in a device
report of the stage's current code), measured (benchmark rows of that code).
A stage's results are stale when a file its evidence depends on (its scope,
common/scope.py) changed after they ran; the CPU record is stale when any
source file changed.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

from dsv4_attention.common import report

ROOT = report.ROOT
README = ROOT / "README.md"
STATUS_PAGE = ROOT / "docs" / "status.md"
RESULTS_PAGE = ROOT / "docs" / "results.md"
CPU = report.RESULTS / "cpu.json"
BEGIN, END = "<!-- status:begin (tools/status.py render) -->", "<!-- status:end -->"
ARCHS = ("sm90", "sm100")


def record() -> int:
    render()  # the suite checks the rendered status: render what the current evidence says first
    with tempfile.TemporaryDirectory() as tmp:
        res = pathlib.Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
               "-n", "auto", f"--results-json={res}", "tests"]
        p = subprocess.run(cmd, cwd=ROOT)
        data = json.loads(res.read_text())
    data = {"date": report.today(), "sources": report.sources(), "pytest_exit": p.returncode, **data}
    CPU.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {CPU.relative_to(ROOT)} (pytest exit {p.returncode})")
    return p.returncode


def _counts(c: dict | None) -> tuple:
    c = c or {}
    return c.get("passed", 0), c.get("failed", 0), c.get("skipped", 0)


def _kind_cell(cpu: dict, stage: str, arch: str, kind: str, none: str) -> str:
    passed, failed, _ = _counts(cpu.get("by_kind", {}).get(stage, {}).get(arch, {}).get(kind))
    if failed:
        return f"FAILING ({failed} of {passed + failed})"
    return f"yes ({passed} {'configs' if kind == 'compile' else 'proofs'})" if passed else none


def _session_failed(rep: dict) -> int:
    """Failures in the current evidence of any group: any failure in the session leaves the
    whole report unproven (host tests, other stages)."""
    failed = 0
    for g in rep.get("parts", {}):
        state, parts = report.test_state(rep, g)
        if state == "current":
            failed += sum(_counts(c)[1] for c in report.totals(rep, g, parts)[0].values())
    return failed


def _changed(rep: dict, stage: str, parts, root=report.ROOT) -> str:
    """The files of the stage's scope that changed since its chosen parts ran (the first three)."""
    now = report.scoped(report.sources(root), stage, "tests", root)
    # the files of today's scope the record does not cover (``report.covers``, file by file): files
    # the record holds beyond today's scope are no reason
    files = sorted({f for p in parts for f, h in now.items()
                    if not report.covers(rep["parts"][stage][p]["sources"], {f: h})})
    return ", ".join(files[:3]) + (f" (+{len(files) - 3})" if len(files) > 3 else "") if files else "code"


def _tests_date(rep: dict, stage: str, parts) -> str:
    """When the chosen parts of a stage's tests ran (the latest), else the report's date."""
    recs = rep.get("parts", {}).get(stage, {})
    dates = [recs[p]["date"] for p in parts or () if recs.get(p, {}).get("date")]
    return max(dates) if dates else rep.get("date", "?")


def _bench_date(rep: dict, stage: str) -> str:
    """When the stage's benchmark rows last ran (the report's runs naming it), else the report's
    date: a report merges runs of several days, and its own date is the last one's. A run whose
    stage list is empty benchmarked no stage (``--stage calls`` / ``decode``)."""
    dates = [r["date"] for r in rep.get("runs", []) if r.get("bench") and r.get("date")
             and stage in (r.get("stages") or ())]
    return max(dates) if dates else rep.get("date", "?")


def _gpu_cells(reports: dict, stage: str, arch: str) -> tuple:
    verified, measured = [], []
    for name, rep in reports.items():
        if rep.get("arch") != arch:
            continue
        state, parts = report.test_state(rep, stage)
        tag = f"{name.upper()}, {_tests_date(rep, stage, parts)[:10]}"
        tests, errors = report.totals(rep, stage, parts) if state else ({}, {})
        passed, failed, _ = _counts(tests.get(arch))
        if passed or failed:
            if state == "stale":
                verified.append(f"stale: {tag} ran older {_changed(rep, stage, parts)}")
            elif state == "partial":
                verified.append(f"unproven: {tag} lacks part {', '.join(report.missing_parts(rep, stage))}")
            elif failed:
                verified.append(f"FAILING on {tag}: {failed} of {passed + failed}")
            elif _session_failed(rep):
                verified.append(f"unproven: {tag}'s session had {_session_failed(rep)} failing tests")
            else:
                err = errors.get(arch, {})
                e = f", worst rel {err['rel_fro']:.1e}" if err else ""
                verified.append(f"yes: {tag}, {passed} tests{e}")
        rows = [r for r in rep.get("bench", []) if r["stage"] == stage and "ours_tflops" in r]
        if rows:
            best = max(r["ours_tflops"] for r in rows)
            stale = not report.bench_current(rep, stage)
            when = f"{name.upper()}, {_bench_date(rep, stage)[:10]}"
            measured.append(("stale: " if stale else "") + f"{when}: {len(rows)} cases, up to {best:.0f} TFLOP/s")
    none = "not run: no Blackwell GPU is lent" if arch == "sm100" else "not run"
    if any(not v.startswith(("stale", "unproven")) for v in verified):  # a report of the current code says it all
        verified = [v for v in verified if not v.startswith(("stale", "unproven"))]
    if any(not m.startswith("stale") for m in measured):
        measured = [m for m in measured if not m.startswith("stale")]
    return "; ".join(verified) or none, "; ".join(measured) or none


def _staleness(rep: dict) -> str:
    """'' when every group of the report is of the tree's code, else which are not."""
    stale = report.stale_groups(rep)
    have = set(rep.get("parts", {})) | set(rep.get("bench_sources", {}))
    if not stale:
        return ""
    return "STALE" if set(stale) >= have else "stale for " + " ".join(stale)


def table() -> str:
    from dsv4_attention import stages

    cpu = report.load(CPU) if CPU.exists() else {}
    reports = report.gpu_reports()
    lines = ["| stage | arch | compiles | layouts proven on host | verified on a GPU | measured |",
             "| --- | --- | --- | --- | --- | --- |"]
    for st in stages.ALL_STAGES:
        for arch in ARCHS:
            ver, meas = _gpu_cells(reports, st.id, arch)
            lines.append(f"| {st.id} {st.name} | {arch} | "
                         f"{_kind_cell(cpu, st.id, arch, 'compile', 'no')} | "
                         f"{_kind_cell(cpu, st.id, arch, 'proof', 'none at this stage')} | {ver} | {meas} |")
    cpu_note = "no CPU record" if not cpu else (
        f"CPU record {cpu.get('date', '?')}" + (" (STALE: code changed since)" if report.is_stale(cpu) else ""))
    notes = {n: _staleness(r) for n, r in reports.items()}
    rep_note = ("GPU reports: " + ", ".join(
        f"{n} ({r.get('device')}, {r.get('date')}{', ' + notes[n] if notes[n] else ''})" for n, r in reports.items())
        if reports else "no GPU report yet")
    return "\n".join(lines) + f"\n\n_Generated by `python -m tools.status render` from {cpu_note}; {rep_note}._\n"


def render_readme(text: str, tbl: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{tbl}{END}{tail}"


def render_page(tbl: str) -> str:
    return ("# Hardware status\n\nWhat has been shown for each stage on each architecture, generated from the "
            "test suite's record (`docs/results/cpu.json`) and the device reports (`docs/results/<gpu>.json`). "
            "CI and the development machines have no GPU; the device tool lends Hopper GPUs only, so no sm100 "
            "kernel has run anywhere: its evidence is compilation, budgets and host layout proofs.\n\n" + tbl)


def _report_section(name: str, rep: dict) -> str:
    out = [f"## {name}: {rep.get('device')} ({rep.get('arch')})", "",
           f"Last run {rep.get('date')}; versions {json.dumps(rep.get('versions', {}))}.", ""]
    stale = report.stale_groups(rep)
    if stale:
        out += [f"**Stale**: the results of {', '.join(stale)} ran code that has changed since (a file their "
                "evidence depends on differs from the tree); they describe older code.", ""]
    else:
        out += ["Every result here ran the code in the tree (each group's files match).", ""]
    out += ["| stage | arch | passed | failed | skipped | worst rel. error | worst row error | cases | evidence |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for st in sorted(rep.get("parts", {})):
        state, parts = report.test_state(rep, st)
        tests, errors = report.totals(rep, st, parts)
        for arch, c in sorted(tests.items()):
            e = errors.get(arch, {})
            rel = f"{e['rel_fro']:.2e} | {e['row_rel']:.2e}" if e else "not run | not run"
            out.append(f"| {st} | {arch} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('skipped', 0)} | "
                       f"{rel} | {e.get('cases', 0)} | {state} ({', '.join(parts)}) |")
    calls = [r for r in rep.get("bench", []) if r["stage"] == "calls"]
    rows = [r for r in rep.get("bench", []) if r["stage"] != "calls"]
    for r in calls:
        if r["kind"] == "host time":
            out += ["", f"Host time per call ({r['case']}): "
                    + ", ".join(f"{k} {v} us" for k, v in r["us_per_call"].items()) + "."]
        else:
            out += ["", f"First call of a configuration in a {r['case']}: "
                    + ", ".join(f"{k} {v['s']} s ({v['compiled']} compiled, {v['loaded']} loaded"
                                + "".join(f", {n} {v[n]} s" for n in ("dsl_import_s", "load_s", "compile_s",
                                                                       "second_call_s", "imports_s") if n in v)
                                + ("" if "dsl_imported" not in v
                                   else ", CuTeDSL imported" if v["dsl_imported"] else ", CuTeDSL not imported")
                                + ")"
                                for k, v in r["first_call"].items()) + "."]
    if rows:
        peers = sorted({p for r in rows for p in r.get("peers", {})})
        out += ["", "| stage | case | ours ms | ours TFLOP/s | " + " | ".join(f"{p} TFLOP/s" for p in peers)
                + " | time ratio (ours / peer) | GB/s ours / peer |", "| --- " * (6 + len(peers)) + "|"]
        for r in rows:
            parts = [", ".join(f"{v:.2f}x {k}" for k, v in r.get("time_ratio_vs", {}).items())]
            if r.get("eager_ms"):  # decode rows: replayed from CUDA graphs; the eager call beside
                parts.append(f"eager call {r['eager_ms']} ms" + (
                    f" ({r['eager_unchecked_ms']} ms with check_indices=False)" if r.get("eager_unchecked_ms") else ""))
            if r.get("unchecked_ms"):  # index mode without the host's read of the lists
                parts.append(f"check_indices=False: {r['unchecked_ms']} ms"
                             + "".join(f", {v:.2f}x {k}" for k, v in r.get("unchecked_ratio_vs", {}).items()))
            if r.get("unsplit_ms"):  # split-KV decode: the chosen split count against one unit a Q tile
                parts.append(f"{r['num_splits']} splits; unsplit {r['unsplit_ms']} ms ({r['split_speedup']}x)")
            if r.get("graph_ms"):  # kernels alone, replayed from CUDA graphs (varlen rows)
                parts.append("graph-replayed ms: " + ", ".join(f"{k} {v}" for k, v in r["graph_ms"].items()))
            ratio = "; ".join(p for p in parts if p)
            gbps = (f"{r['ours_gbps']} / " + ", ".join(f"{v} {k}" for k, v in r.get("peer_gbps", {}).items())
                    if "ours_gbps" in r else "")
            out.append(f"| {r['stage']} | {r['case']} | {r.get('ours_ms', '')} | {r.get('ours_tflops', '')} | "
                       + " | ".join(str(r["peers"].get(p, "")) for p in peers) + f" | {ratio} | {gbps} |")
        notes = sorted({r["note"] for r in rows if r.get("note")})
        out += [""] + [f"- {n}" for n in notes]
    conf = rep.get("conformance")
    if conf:
        out += ["", "Outside suites (another project's own tests run against the library, unchanged; "
                "`tools/gpu_report.py --conformance`):", "",
                "| suite | date | passed | failed | skipped | failed cases | evidence |", "| --- " * 7 + "|"]
        for suite, v in sorted(conf.items()):
            current = "current" if report.is_current(v.get("sources", {}), "e") else "STALE: stage E's code changed"
            if not v.get("ran"):
                out.append(f"| {suite} | {v.get('date')} | not run: {v.get('why')} | | | | |")
                continue
            failed = ", ".join(map(str, v.get("failed_cases", []))) or "-"
            out.append(f"| {suite}{' (kv strided)' if v.get('strict') else ''} | {v.get('date')} | {v.get('passed')} | "
                       f"{v.get('failed')} | {v.get('skipped')} | {failed} | {current} |")
    sanity = rep.get("peer_sanity")
    if sanity:
        out += ["", "Peer sanity (each peer on its anchor case from `shared/notes/anchors.md`):", "",
                "| peer | case | measured TFLOP/s | anchor (H200) | ok |", "| --- | --- | --- | --- | --- |"]
        for peer, v in sorted(sanity.items()):
            tf = "error: " + v.get("error", "") if v.get("tflops") is None else f"{v['tflops']:.0f}"
            out.append(f"| {peer} | {v.get('anchor_case')} | {tf} | {v.get('anchor_tflops')} | "
                       f"{'yes' if v.get('ok') else 'NO'} |")
    return "\n".join(out) + "\n"


def charts(reports: dict) -> dict:
    """{svg path: text} for every report with stage rows that sweep seqlen (stage C onward)."""
    from tools.plot import attention_chart, ratio_chart

    out = {}
    for name, rep in reports.items():
        # the serving group's cases (FlashMLA's decode configs and batches, prefill chunks) sweep
        # no one axis: their time against FlashMLA's, with issue 43's decode bar (1.1x faster)
        serving = [r for r in rep.get("bench", []) if r["stage"] == "serving"]
        if serving:
            stale = "" if report.bench_current(rep, "serving") else " (STALE)"
            out[report.RESULTS / f"plot_serving_{name}.svg"] = ratio_chart(
                serving, "flashmla", f"serving, {rep.get('device')}{stale}", bar=1 / 1.1)
        # rows with a TFLOP/s figure (split-KV decode rows give times: the results table has them)
        charted = [r for r in rep.get("bench", []) if "seqlen" in r and "ours_tflops" in r]
        for st in sorted({r["stage"] for r in charted} - {"serving"}):
            rows = [r for r in charted if r["stage"] == st]
            if len({r["seqlen"] for r in rows}) > 1:
                stale = "" if report.bench_current(rep, st) else " (STALE)"
                out[report.RESULTS / f"plot_{st}_{name}.svg"] = attention_chart(
                    rows, f"stage {st}, {rep.get('device')}{stale}")
    return out


def render_results() -> str:
    reports = report.gpu_reports()
    head = ("# GPU results\n\nRendered from the device reports in `docs/results/` by `python -m tools.status "
            "render`. Each report names the code it ran by the sha256 of every file under `stages/` and "
            "`common/`; each stage's results name the files they depend on (common/scope.py) and are marked "
            "stale when one of those changed after they ran. The device tool lends "
            "Hopper GPUs only: no sm100 result exists.\n\n")
    if not reports:
        return head + "No GPU report yet.\n"
    plots = "".join(f"![{p.stem}](results/{p.name})\n\n" for p in charts(reports))
    return head + plots + "\n".join(_report_section(n, r) for n, r in reports.items())


def render(write: bool = True) -> bool:
    tbl = table()
    want = {README: render_readme(README.read_text(), tbl), STATUS_PAGE: render_page(tbl),
            RESULTS_PAGE: render_results(), **charts(report.gpu_reports())}
    same = all(p.exists() and p.read_text() == t for p, t in want.items())
    if write:
        for p, t in want.items():
            p.write_text(t)
    return same


def main(argv=None) -> int:
    cmd = (argv or sys.argv[1:] or ["render"])[0]
    if cmd == "record":
        rc = record()
        render()
        return rc
    if cmd == "render":
        render()
        return 0
    if cmd == "check":
        ok = render(write=False)
        print("status is current" if ok else "README.md / docs/status.md are out of date: run "
              "`python -m tools.status render`")
        return 0 if ok else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
