"""Causal prefill at head dim 64 (stage D4's rows layout, 192 x 128 tiles), FlashAttention-4 and
cuDNN on the same tensors, for Nsight Compute: 32 x 16 heads x 1k tokens and 8 x 16 x 4k, where
stage D4's benchmark trails both peers. One launch each to warm up, then one each inside the NVTX
range ``profiled`` (``tools.profile_e.launch_profiled``):

    ncu --nvtx --nvtx-include "profiled/" --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --metrics <the pipes and stall reasons> python -m tools.profile_causal
"""

from __future__ import annotations

import torch

from dsv4_attention.common import bench
from dsv4_attention.common.testing import random_bshd
from tools.profile_e import launch_profiled


def main() -> int:
    from dsv4_attention.stages import d4_causal_window

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    calls = []
    for b, s in ((32, 1024), (8, 4096)):
        q, k, v = (random_bshd(b, s, 16, 64, torch.bfloat16, dev) for _ in range(3))
        calls += [
            (f"ours b{b} s{s}", lambda q=q, k=k, v=v: d4_causal_window.forward(q, k, v, causal=True)),
            (f"fa4 b{b} s{s}", bench.peer_fa4(q, k, v, causal=True)),
            (f"cudnn b{b} s{s}", bench.peer_cudnn(q, k, v, causal=True)),
        ]
    launch_profiled(calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
