"""The stall samples of one ncu source page (``ncu --page source --csv --print-source sass``)
summed by role: the SASS instruction ranges of the kernel's setup, its producer warps and its
consumer warpgroups (found by hand in the listing: the producer's code ends at its EXIT before
the consumers' first wait for Q), each role's stall reasons and its top instructions.
``python ncu_roles.py fp8.csv.gz 300 3300``."""

import csv
import gzip
import sys

S = "Warp Stall Sampling (All Samples)"


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


rows = list(csv.reader(gzip.open(sys.argv[1], "rt")))
hdr, data = rows[1], rows[2:]
col = {h: i for i, h in enumerate(hdr)}
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
tot = sum(num(r[col[S]]) for r in data)
a, b = int(sys.argv[2]), int(sys.argv[3])
for name, (lo, hi) in {"setup": (0, a), "producer": (a, b), "consumers": (b, len(data))}.items():
    seg = data[lo:hi]
    t = sum(num(r[col[S]]) for r in seg)
    by = {s: sum(num(r[col[s]]) for r in seg) for s in stalls}
    top = sorted(by.items(), key=lambda kv: -kv[1])[:7]
    print(f"{name}: {t / tot * 100:.1f}% of samples; " + ", ".join(f"{k[6:]} {v / t * 100:.0f}%" for k, v in top))
order = sorted(range(a, b), key=lambda i: -num(data[i][col[S]]))
ptot = sum(num(data[i][col[S]]) for i in range(a, b))
print("producer's top instructions (% of its samples; the instruction before)")
for i in order[:16]:
    print(f"{num(data[i][col[S]]) / ptot * 100:5.1f}%  {data[i][col['Source']].strip()[:56]:56} | "
          f"{data[i - 1][col['Source']].strip()[:48]}")
