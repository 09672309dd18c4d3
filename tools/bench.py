"""Benchmarks (GPU only), one module a question, as FlashAttention-4's benchmarks/:

    tools/bench_stages.py   each stage against its peers (groups a .. e)
    tools/bench_backward.py the backward against FlashAttention-4's (group f)
    tools/bench_decode.py   DeepSeek-V4 decode steps (group decode), the paged FP8 caches (group serving)
    tools/bench_calls.py    host time per call, first call of a configuration (group calls)
    tools/bench_cp.py       context parallelism on 2 GPUs (group cp)

This module is the registry (``BENCHES``: group -> function) and the command line:

    python -m tools.bench [--stage a] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from dsv4_attention.common.arch import present_arch
from tools.bench_backward import bench_stage_f
from tools.bench_calls import bench_calls
from tools.bench_cp import bench_cp
from tools.bench_decode import bench_decode, bench_serving, decode_layer_kwargs
from tools.bench_stages import (
    attention_row,
    bench_stage_a,
    bench_stage_b,
    bench_stage_c,
    bench_stage_d1,
    bench_stage_d2,
    bench_stage_d3,
    bench_stage_d4,
    bench_stage_d5,
    bench_stage_e,
    dsv4_layer,
    fused_row,
    graph_ms,
    index_inputs,
    index_row,
    topk_row,
    varlen_row,
)

#: what other tools import from here (the row builders live in the modules above)
__all__ = ["BENCHES", "run", "main", "attention_row", "decode_layer_kwargs", "dsv4_layer", "fused_row", "graph_ms",
           "index_inputs", "index_row", "topk_row", "varlen_row"]


BENCHES = {"calls": bench_calls, "a": bench_stage_a, "b": bench_stage_b, "c": bench_stage_c, "d1": bench_stage_d1,
           "d2": bench_stage_d2, "d3": bench_stage_d3, "d4": bench_stage_d4, "d5": bench_stage_d5,
           "e": bench_stage_e, "f": bench_stage_f, "decode": bench_decode, "serving": bench_serving,
           "cp": bench_cp}


def run(stages=None) -> list:
    if present_arch() is None:
        raise SystemExit("bench needs a Hopper or Blackwell GPU; this machine has none")
    dev = torch.device("cuda", 0)
    rows = []
    for sid in stages or list(BENCHES):
        rows += BENCHES[sid](dev)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", action="append")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = run(a.stage)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
