"""The README status table and the docs status/results pages are what the evidence renders to."""

from tools import status


def test_rendered_status_is_current():
    assert status.render(write=False), "run `python -m tools.status render` (or `nox -s status`) and commit"


def _part(passed, failed, rel):
    return {"tests": {"c": {"sm90": {"passed": passed, "failed": failed, "skipped": 1}}},
            "errors": {"c": {"sm90": {"rel_fro": rel, "row_rel": rel, "max_abs": rel, "cases": 2}}},
            "pytest_exit": 1 if failed else 0}


def test_session_parts_sum_into_one_report():
    """A session run in parts (gpu_report --shard): counts add up, errors keep the worst, a part
    that ran again replaces itself, parts of other code are dropped, and a missing part shows."""
    from common import report

    src = {"sources": {"a.py": "1"}}
    first = dict(src)
    report.add_shard(None, first, (1, 2), _part(3, 0, 1e-3))
    assert report.missing_shards(first) == ["2/2"]
    second = dict(src)
    report.add_shard(first, second, (2, 2), _part(4, 1, 2e-3))
    assert report.missing_shards(second) == []
    assert second["tests"]["c"]["sm90"] == {"passed": 7, "failed": 1, "skipped": 2}
    assert second["errors"]["c"]["sm90"]["rel_fro"] == 2e-3 and second["errors"]["c"]["sm90"]["cases"] == 4
    again = dict(src)
    report.add_shard(second, again, (2, 2), _part(5, 0, 1e-4))  # part 2 ran again: replaces, not adds
    assert again["tests"]["c"]["sm90"] == {"passed": 8, "failed": 0, "skipped": 2}
    other = {"sources": {"a.py": "2"}}
    report.add_shard(again, other, (2, 2), _part(5, 0, 1e-4))  # other code: part 1 is not carried over
    assert report.missing_shards(other) == ["1/2"] and other["tests"]["c"]["sm90"]["passed"] == 5
    merged = report.merge(again, {**src, "tests": {}, "errors": {}, "bench": [], "runs": []})
    assert merged["shards"] == again["shards"]  # a bench-only run keeps the session's parts


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
