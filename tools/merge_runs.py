"""Merge the runs of ``tools/gpu_report`` made side by side (one per GPU of one machine, each its
own ``--out``) into the tree's report: ``python -m tools.merge_runs DIR/h100-run.json ...``.

Each file is one run's own parts (``<gpu>-run.json``: its tests' groups, its benchmark groups);
they are merged in turn into docs/results/<gpu>.json with ``common/report.merge``, exactly as one
run merges into the report it finds, so runs of disjoint groups give the report that one run of
all of them would."""

from __future__ import annotations

import json
import pathlib
import sys

from dsv4_attention.common import report


def main(paths) -> int:
    if not paths:
        print(__doc__)
        return 2
    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    names = {report.gpu_file_name(r["device"]) for r in runs}
    if len(names) != 1:
        print(f"the runs are of different GPUs: {sorted(names)}")
        return 2
    target = report.RESULTS / f"{names.pop()}.json"
    merged = report.load(target) if target.exists() else None
    for r in runs:
        merged = report.merge(merged, r)
    target.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    print(f"merged {len(runs)} runs into {target}: tests {json.dumps(merged['tests'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
