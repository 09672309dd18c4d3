"""What a call costs besides its kernel (``python -m tools.bench --stage calls``): host time per
call against FlashAttention-4 in a fresh process, and a configuration's first call (compiling,
then loading the kernel cache's entry) in fresh processes.
"""

from __future__ import annotations

import json

FIRST_CALL = r"""
import json, sys, time
t_start = time.perf_counter()
import torch
import dsv4_attention
from dsv4_attention.common import kernel_cache
t_imports = time.perf_counter() - t_start
q = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
v = k.clone()
torch.cuda.synchronize()
t0 = time.perf_counter()
dsv4_attention.attention(q, k, v, causal=True)
torch.cuda.synchronize()
t1 = time.perf_counter()
dsl = "cutlass" in sys.modules  # whether serving the call imported CuTeDSL
dsv4_attention.attention(q, k, v, causal=True)
torch.cuda.synchronize()
print(json.dumps({"s": t1 - t0, "second_call_s": time.perf_counter() - t1, "imports_s": t_imports,
                  "dsl_imported": dsl, **kernel_cache.stats}))
"""


def bench_calls(dev) -> list:
    """What a call costs besides the kernel: host time per call of a tiny problem (batch 1, seqlen
    128, 2 heads, hd 128: validation, argument packing, launch), ours (``dsv4_attention.attention``,
    stage C's plain forward) against FlashAttention-4 in one fresh process (tools/host_breakdown.py,
    with the entry's steps timed apart); and the first call of a
    configuration in a fresh process, compiling (empty kernel cache) and loading (the entry the
    first process wrote)."""
    import os
    import subprocess
    import sys
    import tempfile

    import dsv4_attention

    root = os.path.dirname(os.path.dirname(os.path.abspath(dsv4_attention.__file__)))
    # host time in a fresh process (tools/host_breakdown.py): ours and FA4 side by side, nothing else loaded
    p = subprocess.run([sys.executable, "-m", "tools.host_breakdown"], capture_output=True, text=True, cwd=root,
                       timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    us = json.loads(line[-1]) if p.returncode == 0 and line else {}
    if not us:
        print(f"host time failed: {p.stderr[-500:]}", flush=True)
    rows = [{"stage": "calls", "kind": "host time", "case": "b1 h2 sq128 sk128 hd128 causal bf16, fresh process",
             "us_per_call": us}]
    print(f"host us per call: {us}", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, DSV4_ATTENTION_CACHE_DIR=cache)
        first = {}
        for label in ("compile", "load"):
            p = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, env=env, cwd=root,
                               timeout=300)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not line:
                print(f"first call ({label}) failed: {p.stderr[-500:]}", flush=True)
                continue
            r = json.loads(line[-1])
            first[label] = {"s": round(r["s"], 3), "compiled": r["compiled"], "loaded": r["loaded"],
                            "loaded_so": r["loaded_so"], "dsl_imported": r["dsl_imported"],
                            **{n: round(r[n], 3) for n in ("load_s", "compile_s", "second_call_s", "imports_s")}}
    rows.append({"stage": "calls", "kind": "first call", "case": "fresh process, b1 h2 s128 hd128 causal bf16",
                 "first_call": first})
    print(f"first call in a fresh process: {first}", flush=True)
    return rows
