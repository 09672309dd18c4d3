"""Context parallelism on 2 GPUs (``python -m tools.bench --stage cp``): ``tools.cp_demo`` under
torchrun against the single-GPU kernel on the whole sequence.
"""

from __future__ import annotations

import json

import torch


def bench_cp(dev, seqlens=(65536, 131072, 262144)) -> list:
    """Context parallelism on 2 GPUs (``tools.cp_demo`` under torchrun, NCCL): DeepSeek-V4's HCA
    layer over contiguous shards and dense causal GQA over a zig-zag ring, each against the
    single-GPU kernel on the whole sequence in the same run; the kernels' own time and the
    communication left unhidden. Needs 2 GPUs (one process per GPU): elsewhere no row."""
    import os
    import subprocess
    import sys
    import tempfile

    if torch.cuda.device_count() < 2:
        print(f"cp bench needs 2 GPUs; this machine has {torch.cuda.device_count()}: no rows", flush=True)
        return []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for s in seqlens:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.jsonl")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                   "tools.cp_demo", "--case", "both", "--seqlen", str(s), "--json", out]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=900)
            if p.returncode != 0 or not os.path.exists(out):
                print(f"cp_demo seqlen {s} failed (exit {p.returncode}): {(p.stdout + p.stderr)[-1500:]}", flush=True)
                continue
            for line in open(out):
                r = json.loads(line)
                row = {"stage": "cp", "case": f"{r['case']}, {r['shards']} on {r['world']} GPUs ({r['backend']})",
                       "kind": "context parallel", "ours_ms": round(r["cp_ms"], 3),
                       "ours_tflops": round(r["tflop"] / (r["cp_ms"] * 1e-3), 1),
                       "peers": {"one_gpu": round(r["tflop"] / (r["single_ms"] * 1e-3), 1)},
                       "peer_ms": {"one_gpu": round(r["single_ms"], 3)},
                       "time_ratio_vs": {"one_gpu": round(r["cp_ms"] / r["single_ms"], 3)},
                       "speedup": r["speedup"], "kernels_ms": round(r["kernels_ms"], 3),
                       "unhidden_share": r["unhidden_share"], "gpus": r["gpus"],
                       "note": "cp: ours = the context-parallel call on 2 GPUs, one_gpu = the single-GPU kernel "
                               "on the whole sequence; kernels_ms and unhidden_share in the JSON"}
                rows.append(row)
                print(f"cp {row['case']}: {r['cp_ms']:.2f} ms vs one GPU {r['single_ms']:.2f} ms "
                      f"({r['speedup']:.2f}x), unhidden communication {r['unhidden_share']:.0%}", flush=True)
    return rows
