"""Host time per call, measured in a fresh process (``python -m tools.host_breakdown``): the
library's entry and FlashAttention-4 on the same tiny problem (batch 1, seqlen 128, 2 heads, hd
128, causal, bf16), in one process that imports nothing else, and the entry's steps timed apart.
Microseconds per call, each the fastest of 9 loops of 300 calls after warm-up (``host_us_per_call``:
the GPU finishes each launch long before the host issues the next, so a loop's wall time is the
calls' host time; the fastest loop, because the GPU machine's host is shared and its noise only
ever adds time: FlashAttention-4's figure ranged 90-188 us between medians of runs on one day).
``tools.bench``'s calls row runs this as a child process: a benchmark process that has compiled
and imported the other stages and peers measured every call 20-50 % slower."""

from __future__ import annotations

import json
import time

import torch

import dsv4_attention
from dsv4_attention.common import bench, call_plan
from dsv4_attention.stages import c_online_softmax


def host_us_per_call(call, n: int = 300) -> float:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return min(times)


def measure() -> dict:
    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, 128, 2, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    o, lse = dsv4_attention.attention(q, k, v, causal=True)
    # the key the entry recorded for that call (a fresh process: the only one), taken apart into the
    # arguments that rebuild it, so the "entry_key" step times exactly the entry's own key
    (key, plan), = call_plan._ENTRY.items()
    scalars, window = key[-4], key[-2]
    assert call_plan.entry_key(q, k, v, None, None, None, None, scalars, window) == key
    noop = call_plan.Plan(lambda *a: None, plan.tail, plan.slots, plan.lse_shape, plan.device)
    calls = {
        "attention": lambda: dsv4_attention.attention(q, k, v, causal=True),
        "attention_out": lambda: dsv4_attention.attention(q, k, v, causal=True, out=o, lse_out=lse),
        "stage_c": lambda: c_online_softmax.forward(q, k, v),
        "fa4": bench.peer_fa4(q, k, v, causal=True),
    }
    steps = {  # the entry's planned call, step by step
        "kernel_function_only": lambda: plan.fn(q, k, v, o, lse, *plan.tail),
        "output_allocations": lambda: (torch.empty_like(q), torch.empty(1, 2, 128, device=dev)),
        "entry_key": lambda: call_plan.entry_key(q, k, v, None, None, None, None, scalars, window),
        "entry_lookup": lambda: call_plan._ENTRY.get(key),
        "plan_without_kernel": lambda: noop(q, k, v, None, None, (None, None)),
    }
    us = {}
    for name, call in {**calls, **steps}.items():
        try:
            us[name] = round(host_us_per_call(call), 1)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported
            print(f"host time {name} failed: {type(e).__name__}: {e}"[:300], flush=True)
    return us


if __name__ == "__main__":
    print(json.dumps(measure()))
