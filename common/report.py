"""Evidence files: what ran, on which code, with which results.

CI has no GPU, so GPU results are brought into the repository as reports
written on the device machine (``docs/results/<gpu>.json``) and the CPU
suite's own record (``docs/results/cpu.json``). Each names the code it ran
by content, ``sources``: every file under ``stages/`` and ``common/`` mapped
to its sha256 (``.git`` does not travel to the GPU machine). A report whose
``sources`` differ from the tree is stale: the code changed after it ran.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
SOURCE_DIRS = ("dsv4_attention", "stages", "common")


def sources(root: pathlib.Path = ROOT) -> dict:
    """sha256 of every .py file under stages/ and common/, keyed by its repo-relative path."""
    out = {}
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


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
            out[p.stem] = load(p)
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


def add_shard(old: dict | None, new: dict, shard: tuple, summary: dict) -> None:
    """Put part ``shard`` = (K, N) of a sharded test session into ``new``: its ``shards`` are the
    parts of the same code and the same N already in ``old`` plus this one (a part that ran again
    replaces its earlier run), and its ``tests`` and ``errors`` are their sums and worst cases."""
    k, n = shard
    same = old and old.get("sources") == new.get("sources") and old.get("shard_count") == n
    shards = dict(old.get("shards", {})) if same else {}
    shards[f"{k}/{n}"] = summary
    tests, errors = {}, {}
    for part in shards.values():
        for st, per_arch in part["tests"].items():
            for arch, c in per_arch.items():
                t = tests.setdefault(st, {}).setdefault(arch, {})
                for outcome, count in c.items():
                    t[outcome] = t.get(outcome, 0) + count
        for st, per_arch in part["errors"].items():
            for arch, e in per_arch.items():
                w = errors.setdefault(st, {}).setdefault(arch, {"rel_fro": 0.0, "row_rel": 0.0, "max_abs": 0.0,
                                                                 "cases": 0})
                w["cases"] += e.get("cases", 0)
                for key in ("rel_fro", "row_rel", "max_abs"):
                    w[key] = max(w[key], e.get(key, 0.0))
    new.update(shards=shards, shard_count=n, tests=tests, errors=errors)


def missing_shards(rep: dict) -> list:
    """The parts of a sharded test session that the report lacks ([] when it is whole)."""
    n = rep.get("shard_count")
    return [f"{k}/{n}" for k in range(1, n + 1) if f"{k}/{n}" not in rep.get("shards", {})] if n else []


def merge(old: dict | None, new: dict) -> dict:
    """Merge a per-stage report into an existing one of the same code.

    Results of different code are never mixed: if the old report's ``sources``
    differ from the new one's, the old results are dropped.
    """
    if not old or old.get("sources") != new.get("sources"):
        return new
    out = dict(old)
    for key in ("device", "date", "sources", "versions", "shards", "shard_count"):
        if key in new:
            out[key] = new[key]
    for key in ("tests", "errors"):
        merged = dict(old.get(key, {}))
        merged.update(new.get(key, {}))
        out[key] = merged
    new_stages = {r["stage"] for r in new.get("bench", [])}
    out["bench"] = [r for r in old.get("bench", []) if r["stage"] not in new_stages] + new.get("bench", [])
    if new.get("peer_sanity"):
        out["peer_sanity"] = new["peer_sanity"]
    out["runs"] = old.get("runs", []) + new.get("runs", [])
    return out
