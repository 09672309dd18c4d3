#!/usr/bin/env bash
# Every benchmark group on the device, one call: the groups dealt over the machine's GPUs, one
# tools.gpu_report run per GPU side by side (each GPU its own groups, peers in the same process).
# Writes $OUT/bench<K>.json (each run's own parts, for `python -m tools.merge_runs`) and blogs.tgz.
#     source .device/env.sh; bash tools/device_bench.sh
# DEVICE_BENCH_GROUPS="e d1 ..." runs only those groups (a call has 10 minutes: on a machine of
# one or two GPUs deal the groups over several calls); DRY_RUN=1 prints the plan only.
set -uo pipefail
out="${OUT:?set OUT}"
gpus=$(nvidia-smi -L | wc -l)
limit="${DEVICE_BENCH_LIMIT_S:-570}"
# heaviest first, each to the GPU with the least so far (rough minutes on an H200)
plan=$(python3 - "$gpus" <<'PY'
import sys
n = int(sys.argv[1])
weights = {"e": 3, "d1": 2, "decode": 1, "serving": 2, "f": 2, "c": 1.5, "d4": 1.5, "calls": 1.5, "d2": 1, "d3": 1, "d5": 1, "a": .5, "b": .5}
from tools import bench
import os
chosen = os.environ.get("DEVICE_BENCH_GROUPS", "").split()
groups = [g for g in sorted(bench.BENCHES, key=lambda g: -weights.get(g, 1)) if g != "cp" and (not chosen or g in chosen)]
load = [[0, []] for _ in range(n)]
for g in groups:
    part = min(load, key=lambda p: p[0]); part[0] += weights.get(g, 1); part[1].append(g)
print("\n".join(" ".join(p[1]) for p in load))
PY
)
if [ "${DRY_RUN:-0}" = 1 ]; then echo "$plan"; exit 0; fi
mkdir -p /tmp/db
k=0; pids=()
while read -r groups; do
  [ -n "$groups" ] || continue
  args=(); for g in $groups; do args+=(--stage "$g"); done
  sanity=--no-sanity; [ "$k" -eq 0 ] && sanity=
  echo "GPU $k: $groups"
  CUDA_VISIBLE_DEVICES=$k timeout "$limit" python3 -m tools.gpu_report --out "/tmp/db/b$k" --tests none \
    --deadline-s $(( limit - 120 )) $sanity "${args[@]}" > "/tmp/db/b$k.log" 2>&1 &
  pids+=($!); k=$(( k + 1 ))
done <<< "$plan"
wait "${pids[@]}"
for i in $(seq 0 $(( k - 1 ))); do
  cp /tmp/db/b$i/*-run.json "$out/bench$i.json" 2>/dev/null || echo "GPU $i wrote no report"
  tail -n 6 "/tmp/db/b$i.log"
done
tar czf "$out/blogs.tgz" --exclude="*.json" -C /tmp db 2>/dev/null
ls -la "$out"
