"""Where a kernel's warps wait: the per-instruction warp-stall samples of an Nsight Compute report,
summed by reason and listed for the instructions that hold the most samples.

On the GPU machine (``tools.profile_e`` launches the kernels inside the NVTX range ``profiled``):

    ncu --nvtx --nvtx-include "profiled/" -k regex:FlashAttentionESm90 -c 1 \\
        --section SourceCounters --section WarpStateStats --import-source no -o e python -m tools.profile_e
    ncu -i e.ncu-rep --page source --csv --print-source sass > e.csv

then here: ``python -m tools.ncu_stalls e.csv [top]``. An ``@!P BRA`` right after a
``SYNCS.PHASECHK.TRANS64.TRYWAIT [bar]`` is a warp spinning on that mbarrier: the context column
shows the barrier's offset in SMEM (the kernel's ``SharedStorage`` order gives its name)."""

from __future__ import annotations

import csv
import gzip
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def summary(path: str, top: int = 20) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    hdr, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r[col[SAMPLES]]) for r in data) or 1.0
    out = [f"{rows[0][1][:100]}",
           f"samples {int(total)}, SASS instructions {len(data)}, "
           f"warp instructions executed {int(sum(_num(r[col['Instructions Executed']]) for r in data))}"]
    by_reason = {s: sum(_num(r[col[s]]) for r in data) / total * 100 for s in stalls}
    out.append("by reason (% of samples): " + ", ".join(f"{k[6:]} {v:.1f}" for k, v in
                                                        sorted(by_reason.items(), key=lambda kv: -kv[1]) if v >= 0.1))
    out.append(f"top {top} instructions: % of samples, executions, main reasons; the instruction before it")
    order = sorted(range(len(data)), key=lambda i: -_num(data[i][col[SAMPLES]]))[:top]
    for i in order:
        r = data[i]
        n = _num(r[col[SAMPLES]])
        reasons = ", ".join(f"{s[6:]} {_num(r[col[s]]) / n:.0%}" for s in stalls if _num(r[col[s]]) >= 0.1 * n)
        before = data[i - 1][col["Source"]].strip() if i else ""
        out.append(f"{n / total * 100:5.2f}%  {int(_num(r[col['Instructions Executed']])):>8}  "
                   f"{r[col['Source']].strip()[:44]:44}  [{reasons}]  after: {before[:60]}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20))
