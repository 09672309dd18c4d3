"""Evidence files: what ran, on which code, with which results.

CI has no GPU, so GPU results are brought into the repository as reports
written on the device machine (``docs/results/<gpu>.json``) and the CPU
suite's own record (``docs/results/cpu.json``). Each names the code it ran
by content, ``sources``: every file under ``stages/`` and ``common/`` mapped
to its sha256 (``.git`` does not travel to the GPU machine). A report whose
``sources`` differ from the tree is stale: the code changed after it ran.

A GPU report's results are kept per *group* (a stage, or ``none``: the tests of no stage) and
each group's evidence names only the files it depends on (its scope, common/scope.py): a stage's
results stay current while its scope is unchanged, whatever else in the tree changed. So a
change to one stage's kernel needs that stage's tests and benchmarks run again, not every stage's.

    parts[group][part]   one run of the group's tests: {"sources": the scope's sha256 when it ran,
                         "tests": {arch: counts}, "errors": {arch: worst}, "date"}; part is "all"
                         (a whole session), "K/N" (one of N parts of a session, by file), "stage"
                         (every test of the stage plus those of no stage), "cp" (the
                         context-parallel tests) or "gpu" (GPU tests only: never enough)
    bench_sources[group] the scope's sha256 when the group's benchmark rows ran
    tests, errors        the counts and worst errors of each group's chosen parts (``settle``)

A group's tests are *current* when a complete set of its parts ("all", "stage", "cp", or every
"K/N" of one N) all ran its scope as it is in the tree; *partial* when parts of this code exist
but no complete set (a part still to run, or GPU tests only); *stale* otherwise.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib

from dsv4_attention.common import scope

ROOT = scope.ROOT
RESULTS = ROOT / "docs" / "results"


def sources(root: pathlib.Path = ROOT) -> dict:
    """sha256 of every .py file of the library (dsv4_attention/, stages/ and common/), keyed by its
    repo-relative path in the design card's layout (``common/x.py``: ``scope.source_name``)."""
    return {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in scope.source_files(root).items()}


def stale_files(report: dict, root: pathlib.Path = ROOT) -> list:
    """Files whose content differs between the report and the tree (added, removed or changed)."""
    now = sources(root)
    then = report.get("sources", {})
    return sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))


def is_stale(report: dict, root: pathlib.Path = ROOT) -> bool:
    return bool(stale_files(report, root))


def load(path) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def gpu_reports(results: pathlib.Path = RESULTS) -> dict:
    """{name: report} for every GPU report (every results JSON but cpu.json)."""
    out = {}
    for p in sorted(results.glob("*.json")):
        if p.stem != "cpu":
            out[p.stem] = upgrade(load(p))
    return out


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def gpu_file_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'NVIDIA H200' -> 'h200'."""
    low = device_name.lower()
    for key in ("h200", "h100", "h800", "h20", "b200", "b300", "gb200"):
        if key in low:
            return key
    return "".join(c for c in low.replace("nvidia", "") if c.isalnum())[:16] or "gpu"


COMPLETE = ("all", "stage", "cp")  # a part that is a group's whole test set by itself


def groups(root: pathlib.Path = ROOT) -> list:
    """Every group of test results: the stage ids and ``none``."""
    return [*scope.stage_ids(root), "none"]


def scoped(srcs: dict, group: str, kind: str = "tests", root: pathlib.Path = ROOT) -> dict:
    """The part of a run's ``sources`` that ``group``'s ``kind`` evidence depends on (None for a
    file of the scope that the run did not have)."""
    return {f: srcs.get(f) for f in scope.scope(group, kind, root)}


def covers(recorded: dict, now: dict) -> bool:
    """Whether a record of scope hashes ``recorded`` covers the scope ``now``: every file of
    ``now`` ran with its hash. Files the record has beyond ``now`` do not matter: the scope is
    computed on the tree, and if every file in it has the recorded hash, the imports in those
    files are the ones that ran; a record can only hold more files where the scope rule itself
    narrowed since (a test file no longer counted in the stage)."""
    return all(f in recorded and recorded[f] == h for f, h in now.items())


def is_current(recorded: dict, group: str, kind: str = "tests", root: pathlib.Path = ROOT) -> bool:
    """Whether evidence recorded with scope hashes ``recorded`` describes the tree's code."""
    return covers(recorded, scoped(sources(root), group, kind, root))


def add_tests(rep: dict, summary: dict, part: str, group_ids, root: pathlib.Path = ROOT) -> None:
    """Record one run's test results (``summary``: conftest's per-stage record) as part ``part``
    of each group in ``group_ids`` (a group with no test in this part is recorded too, empty:
    the part ran and found none of its tests)."""
    srcs = rep["sources"]
    parts = rep.setdefault("parts", {})
    for g in group_ids:
        parts.setdefault(g, {})[part] = {"sources": scoped(srcs, g, "tests", root), "date": rep.get("date"),
                                         "tests": summary["tests"].get(g, {}), "errors": summary["errors"].get(g, {})}


def _candidates(group_parts: dict) -> list:
    """The complete sets of parts: each COMPLETE part alone, and every "K/N" of one N."""
    out = [[p] for p in COMPLETE if p in group_parts]
    shards = {}
    for p in group_parts:
        if "/" in p:
            k, n = (int(x) for x in p.split("/"))
            shards.setdefault(n, set()).add(k)
    out += [[f"{k}/{n}" for k in range(1, n + 1)] for n, ks in sorted(shards.items()) if ks == set(range(1, n + 1))]
    return out


def test_state(rep: dict, group: str, root: pathlib.Path = ROOT) -> tuple:
    """(state, parts): ``group``'s test evidence in ``rep`` against the tree. state is "current",
    "stale", "partial" or None (no test of the group ran); parts are the chosen parts' names."""
    have = rep.get("parts", {}).get(group, {})
    if not have:
        return None, []
    now = scoped(sources(root), group, "tests", root)

    def newest(c):
        return max(have[p].get("date") or "" for p in c)

    cands = sorted(_candidates(have), key=newest, reverse=True)
    for c in cands:
        if all(covers(have[p]["sources"], now) for p in c):
            return "current", c
    if cands:
        return "stale", cands[0]
    # no complete set: what there is, partial if of this code (a part still to run), else stale
    return ("partial" if any(covers(rec["sources"], now) for rec in have.values()) else "stale"), sorted(have)


def missing_parts(rep: dict, group: str) -> list:
    """The parts of a sharded session that ``group`` lacks ([] when it has a complete set)."""
    have = rep.get("parts", {}).get(group, {})
    if _candidates(have):
        return []
    ns = sorted({int(p.split("/")[1]) for p in have if "/" in p})
    return [f"{k}/{n}" for n in ns for k in range(1, n + 1) if f"{k}/{n}" not in have] or ["a whole session"]


def totals(rep: dict, group: str, parts) -> tuple:
    """({arch: counts}, {arch: worst errors}) over ``parts`` of ``group``."""
    tests, errors = {}, {}
    for p in parts:
        rec = rep["parts"][group][p]
        for arch, c in rec["tests"].items():
            t = tests.setdefault(arch, {})
            for outcome, count in c.items():
                t[outcome] = t.get(outcome, 0) + count
        for arch, e in rec["errors"].items():
            w = errors.setdefault(arch, {"rel_fro": 0.0, "row_rel": 0.0, "max_abs": 0.0, "cases": 0})
            w["cases"] += e.get("cases", 0)
            for key in ("rel_fro", "row_rel", "max_abs"):
                w[key] = max(w[key], e.get(key, 0.0))
    return tests, errors


def settle(rep: dict, root: pathlib.Path = ROOT) -> dict:
    """Set ``tests`` and ``errors`` to each group's chosen parts (current ones where they exist)."""
    rep["tests"], rep["errors"] = {}, {}
    for g in sorted(rep.get("parts", {})):
        _, parts = test_state(rep, g, root)
        t, e = totals(rep, g, parts)
        if t:
            rep["tests"][g] = t
        if e:
            rep["errors"][g] = e
    return rep


def bench_current(rep: dict, group: str, root: pathlib.Path = ROOT) -> bool:
    rec = rep.get("bench_sources", {}).get(group)
    return rec is not None and is_current(rec, group, "bench", root)


def stale_groups(rep: dict, root: pathlib.Path = ROOT) -> list:
    """The groups whose tests or benchmark rows in ``rep`` describe other code than the tree's."""
    out = {g for g in rep.get("parts", {}) if test_state(rep, g, root)[0] == "stale"}
    out |= {g for g in rep.get("bench_sources", {}) if not bench_current(rep, g, root)}
    return sorted(out)


def upgrade(rep: dict, root: pathlib.Path = ROOT) -> dict:
    """A report written before results were kept per group, in today's form: every group's
    evidence is of the report's one ``sources``."""
    if "parts" in rep:
        return rep
    rep = dict(rep)
    srcs = rep.get("sources", {})
    shards = rep.pop("shards", None) or {}
    rep.pop("shard_count", None)
    rep["parts"] = {}
    if shards:
        for part, summary in shards.items():
            add_tests(rep, summary, part, groups(root), root)
    elif rep.get("tests"):
        kinds = [r.get("tests") for r in rep.get("runs", []) if r.get("tests") not in (None, "none")]
        part = kinds[-1] if kinds and kinds[-1] in COMPLETE else "gpu"
        add_tests(rep, {"tests": rep["tests"], "errors": rep.get("errors", {})}, part, list(rep["tests"]), root)
    benched = sorted({r["stage"] for r in rep.get("bench", [])})
    rep["bench_sources"] = {g: scoped(srcs, g, "bench", root) for g in benched}
    return settle(rep, root)


def merge(old: dict | None, new: dict, root: pathlib.Path = ROOT) -> dict:
    """Merge a run's report ``new`` into the existing one of the same GPU.

    Each group keeps its own evidence: the new run's parts replace the same parts of the old
    report, and its benchmark rows replace the old rows of the same group. A group's older
    parts stay, and ``settle`` chooses the parts of the tree's code (a group whose scope the new
    run changed and that did not run again shows as stale). Parts of other code than the new
    run's are dropped where the new run recorded the group afresh.
    """
    if not old:
        return settle(dict(new), root)
    old = upgrade(old, root)
    out = dict(old)
    for key in ("device", "arch", "date", "sources", "versions"):
        if key in new:
            out[key] = new[key]
    parts = {g: dict(p) for g, p in old.get("parts", {}).items()}
    for g, got in new.get("parts", {}).items():
        fresh = next(iter(got.values()))["sources"]
        kept = {p: rec for p, rec in parts.get(g, {}).items() if rec["sources"] == fresh}
        parts[g] = {**kept, **got}
    out["parts"] = parts
    new_groups = {r["stage"] for r in new.get("bench", [])}
    out["bench"] = [r for r in old.get("bench", []) if r["stage"] not in new_groups] + new.get("bench", [])
    out["bench_sources"] = {**old.get("bench_sources", {}), **new.get("bench_sources", {})}
    if new.get("peer_sanity"):
        out["peer_sanity"] = new["peer_sanity"]
    out["conformance"] = {**old.get("conformance", {}), **new.get("conformance", {})}
    out["runs"] = old.get("runs", []) + new.get("runs", [])
    return settle(out, root)
