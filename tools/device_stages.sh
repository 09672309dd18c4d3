#!/usr/bin/env bash
# Stages' tests side by side, one lane of stages a GPU: each lane one `tools.gpu_report --tests
# stage(-only)` run on its own GPU (CUDA_VISIBLE_DEVICES: each run sees one GPU and writes the
# one-GPU report's parts), so two lanes on a 2-GPU machine of 32 cores finish in the time of one
# (the compiles set the pace, 16 cores a lane). Writes $OUT/lane<K>.json (each lane's parts, for
# `python -m tools.merge_runs`) and lanes.tgz (logs).
#     source .device/env.sh; DEVICE_STAGE_LANES="f a b;e" bash tools/device_stages.sh
#     source .device/env.sh; DEVICE_STAGE_LANES="d1 c;d2 d3 d4 d5" DEVICE_STAGE_NONE=0 bash tools/device_stages.sh
# (the whole session in two calls of 5-6 minutes on nvidia-h200-x2, 2026-11-30: docs/evidence.md).
# Environment: DEVICE_STAGE_LANES (lanes separated by ';', stages by spaces; required),
# DEVICE_STAGE_NONE (1, default: lane 0 also runs the tests of no stage, `--tests stage`; 0: every
# lane `--tests stage-only`, for a later call on the same code), DEVICE_STAGE_LIMIT_S (each lane's
# time limit, 575), DRY_RUN=1 (print the commands only). Lanes past the GPU count share GPUs, in turn.
set -uo pipefail
out="${OUT:?set OUT}"
lanes_spec="${DEVICE_STAGE_LANES:?set DEVICE_STAGE_LANES, e.g. \"f a b;e\"}"
with_none="${DEVICE_STAGE_NONE:-1}"
limit="${DEVICE_STAGE_LIMIT_S:-575}"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || gpus=1
IFS=';' read -r -a lanes <<< "$lanes_spec"
per_gpu=$(( (${#lanes[@]} + gpus - 1) / gpus ))
cores=$(nproc)
busy=$(( ${#lanes[@]} < gpus ? ${#lanes[@]} : gpus ))
export PYTEST_WORKERS="${PYTEST_WORKERS:-$(( cores / busy > 2 ? cores / busy - 1 : 1 ))}"
export COMPILE_WORKERS="${COMPILE_WORKERS:-8}"
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:---timeout=300}"  # a hang fails its test, not the lane
run() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "GPU ${CUDA_VISIBLE_DEVICES:-}: $*"; else "$@"; fi; }
logs=$(mktemp -d /tmp/ds.XXXXXX)  # this call's own: lanes' reports and logs
pids=()
for g in $(seq 0 $(( gpus - 1 ))); do
  (
    for k in $(seq "$g" "$gpus" $(( ${#lanes[@]} - 1 ))); do
      args=()
      for s in ${lanes[$k]}; do args+=(--stage "$s"); done
      tests=stage-only
      [ "$k" -eq 0 ] && [ "$with_none" = 1 ] && tests=stage
      CUDA_VISIBLE_DEVICES=$g run timeout "$limit" python3 -m tools.gpu_report --out "$logs/l$k" --tests "$tests" \
        --no-bench --no-sanity "${args[@]}" > "$logs/l$k.log" 2>&1
      echo "lane $k (GPU $g: ${lanes[$k]}, --tests $tests) exit $? at $(date -u +%H:%M:%S)"
    done
  ) &
  pids+=($!)
done
wait "${pids[@]}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  cat "$logs"/*.log 2>/dev/null
  echo "workers: $PYTEST_WORKERS a lane, $per_gpu lane(s) a GPU"
  rm -rf "$logs"
  exit 0
fi
for k in $(seq 0 $(( ${#lanes[@]} - 1 ))); do
  cp "$logs"/l$k/*-run.json "$out/lane$k.json" 2>/dev/null || echo "lane $k wrote no report"
  tail -n 4 "$logs/l$k.log" | cut -c1-300
done
tar czf "$out/lanes.tgz" --exclude="*.json" -C "$logs" . 2>/dev/null
ls -la "$out"
