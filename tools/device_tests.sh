#!/usr/bin/env bash
# The whole test session and the outside suites on the device, one call: on a machine of N GPUs,
# shards 1..N-1 of the test session side by side (one GPU each) and FlashMLA's sparse-prefill test
# (kv strided) on the last GPU; on one GPU, everything in turn. Writes to $OUT: run<K>.json (each
# run's own parts, for `python -m tools.merge_runs`) and logs.tgz.
#     source .device/env.sh && bash tools/device_tests.sh
set -uo pipefail
out="${OUT:?set OUT}"
gpus=$(nvidia-smi -L | wc -l)
shards=$(( gpus > 1 ? gpus - 1 : 1 ))
limit="${DEVICE_TESTS_LIMIT_S:-560}"
export PYTEST_WORKERS="${PYTEST_WORKERS:-12}" COMPILE_WORKERS="${COMPILE_WORKERS:-4}"
mkdir -p /tmp/dt
pids=()
for k in $(seq 1 "$shards"); do
  CUDA_VISIBLE_DEVICES=$(( k - 1 )) timeout "$limit" python3 -m tools.gpu_report --out "/tmp/dt/s$k" \
    --shard "$k/$shards" --no-bench --no-sanity > "/tmp/dt/s$k.log" 2>&1 &
  pids+=($!)
done
conf_gpu=$(( gpus > 1 ? gpus - 1 : 0 ))
[ "$gpus" -gt 1 ] || wait "${pids[@]}"
CUDA_VISIBLE_DEVICES=$conf_gpu timeout "$limit" python3 -m tools.gpu_report --out /tmp/dt/conf --tests none \
  --no-bench --no-sanity --conformance > /tmp/dt/conf.log 2>&1
wait "${pids[@]}"
for k in $(seq 1 "$shards"); do
  cp /tmp/dt/s$k/*-run.json "$out/run$k.json" 2>/dev/null || echo "shard $k wrote no report"
  tail -n 25 "/tmp/dt/s$k.log"
done
cp /tmp/dt/conf/*-run.json "$out/runconf.json" 2>/dev/null || echo "conformance wrote no report"
tail -n 20 /tmp/dt/conf.log
tar czf "$out/logs.tgz" --exclude="*.json" -C /tmp dt 2>/dev/null
ls -la "$out"
