#!/usr/bin/env bash
# The whole test session and the outside suites on the device: the test session in parts
# (gpu_report --shard K/N, whole test files balanced by their size), dealt over the machine's GPUs
# and run side by side, and FlashMLA's sparse-prefill test (kv strided) on the last GPU. Writes to
# $OUT: run<K>.json (each part's report, for `python -m tools.merge_runs`), runconf.json and logs.tgz.
#     source .device/env.sh; bash tools/device_tests.sh
# A call has at most 10 minutes: on a machine of few GPUs run the parts over several calls, e.g.
# on one GPU `DEVICE_TEST_SHARDS=4 DEVICE_TEST_PARTS="1 2" DEVICE_TEST_CONFORMANCE=0`, then
# `DEVICE_TEST_SHARDS=4 DEVICE_TEST_PARTS="3 4"` (a part took 4-6 minutes on a 4-GPU H200 machine and
# 8.5 minutes on a one-GPU H200 machine of 16 cores, 2026-11-29: four parts there exceed a session's
# 30 minutes; `gpu_report --tests stage --stage X` runs one stage's tests and those of no stage, 5 min;
# tools/device_stages.sh runs such stage groups side by side, one GPU each: the 2-GPU renewal).
# Environment: DEVICE_TEST_SHARDS (N; default: GPUs - 1, at least 1), DEVICE_TEST_PARTS (which of
# 1..N this call runs; default all), DEVICE_TEST_CONFORMANCE (1: run it, default), DRY_RUN=1
# (print the commands only).
# Note for hand-written calls: `a && b && (c) & (d) &` backgrounds the whole `a && b && (c)` list,
# so (d) runs without what a and b set up (env.sh's PYTHONPATH); end setup lines with `;`.
set -uo pipefail
out="${OUT:?set OUT}"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || gpus=1
shards="${DEVICE_TEST_SHARDS:-$(( gpus > 1 ? gpus - 1 : 1 ))}"
parts="${DEVICE_TEST_PARTS:-$(seq -s ' ' 1 "$shards")}"
conformance="${DEVICE_TEST_CONFORMANCE:-1}"
limit="${DEVICE_TESTS_LIMIT_S:-560}"
export PYTEST_WORKERS="${PYTEST_WORKERS:-12}" COMPILE_WORKERS="${COMPILE_WORKERS:-4}"
# a test that hangs fails alone after 5 minutes instead of taking its part's whole time limit
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:---timeout=300}"
run() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "GPU ${CUDA_VISIBLE_DEVICES:-}: $*"; else "$@"; fi; }
mkdir -p /tmp/dt
# the GPUs that run parts: all but the last where the conformance run takes it
if [ "$conformance" = 1 ] && [ "$gpus" -gt 1 ]; then lanes=$(( gpus - 1 )); else lanes=$gpus; fi
declare -a lane_parts
i=0
for k in $parts; do
  lane_parts[$(( i % lanes ))]+="$k "
  i=$(( i + 1 ))
done
pids=()
for g in $(seq 0 $(( lanes - 1 ))); do
  mine="${lane_parts[$g]:-}"
  [ -n "$mine" ] || continue
  (
    for k in $mine; do
      CUDA_VISIBLE_DEVICES=$g run timeout "$limit" python3 -m tools.gpu_report --out "/tmp/dt/s$k" \
        --shard "$k/$shards" --no-bench --no-sanity > "/tmp/dt/s$k.log" 2>&1
    done
  ) &
  pids+=($!)
done
if [ "$conformance" = 1 ]; then
  conf_gpu=$(( gpus > 1 ? gpus - 1 : 0 ))
  [ "$gpus" -gt 1 ] || wait "${pids[@]}"
  CUDA_VISIBLE_DEVICES=$conf_gpu run timeout "$limit" python3 -m tools.gpu_report --out /tmp/dt/conf --tests none \
    --no-bench --no-sanity --conformance > /tmp/dt/conf.log 2>&1
fi
wait "${pids[@]}"
[ "${DRY_RUN:-0}" = 1 ] && { cat /tmp/dt/*.log 2>/dev/null; exit 0; }
for k in $parts; do
  cp /tmp/dt/s$k/*-run.json "$out/run$k.json" 2>/dev/null || echo "part $k wrote no report"
  tail -n 25 "/tmp/dt/s$k.log"
done
if [ "$conformance" = 1 ]; then
  cp /tmp/dt/conf/*-run.json "$out/runconf.json" 2>/dev/null || echo "conformance wrote no report"
  tail -n 20 /tmp/dt/conf.log
fi
tar czf "$out/logs.tgz" --exclude="*.json" -C /tmp dt 2>/dev/null
ls -la "$out"
