"""Where the dense backward's time goes, against FlashAttention-4's (issue 44's bar).

``python docs/results/experiments/issue44_bwd_perf/profile_bwd.py times``: per-kernel CUDA times
(torch.profiler, tools.profile_e.kernel_times) of one ``f_backward.backward`` call and of FA4's
backward on the same tensors, for the bench's shapes. ``... ncu``: the cases launched once more
inside the NVTX range ``profiled`` for Nsight Compute:

    ncu --nvtx --nvtx-include "profiled/" -k regex:FlashAttentionBackwardSm90 -c 2 \\
        --section SourceCounters --section WarpStateStats --section SpeedOfLight \\
        --import-source no -o bwd python docs/results/experiments/issue44_bwd_perf/profile_bwd.py ncu
"""

import sys

import torch

sys.path.insert(0, ".")
from dsv4_attention.common.testing import random_bshd  # noqa: E402
from dsv4_attention.stages import e_fused  # noqa: E402
from dsv4_attention.stages import f_backward as stage  # noqa: E402
from tools.bench_backward import fa4_backward  # noqa: E402
from tools.profile_e import launch_profiled, print_kernel_times  # noqa: E402

dev = torch.device("cuda")
CASES = [(8, 32, 2048, 64, False), (2, 32, 8192, 64, False), (8, 16, 2048, 128, False),
         (2, 16, 8192, 128, False), (8, 16, 2048, 128, True)]


def tensors(b, h, s, d, causal):
    q, k, v, do = (random_bshd(b, s, h, d, torch.bfloat16, dev) for _ in range(4))
    with torch.no_grad():
        o, lse = e_fused.forward(q, k, v, causal=causal)
    return q, k, v, o, lse, do


def main(mode):
    if mode == "times":
        for b, h, s, d, causal in CASES:
            t = tensors(b, h, s, d, causal)
            q, do = t[0], t[5]
            print(f"b{b} h{h} s{s} hd{d}{' causal' if causal else ''}: ours", flush=True)
            print_kernel_times(lambda t=t, c=causal: stage.backward(*t, causal=c))
            print("  fa4", flush=True)
            print_kernel_times(fa4_backward(q, t[1], t[2], do, causal))
    else:
        calls = []
        for b, h, s, d, causal in (CASES[1], CASES[3]):
            t = tensors(b, h, s, d, causal)
            calls.append((f"hd{d}", lambda t=t, c=causal: stage.backward(*t, causal=c)))
        launch_profiled(calls)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "times")
