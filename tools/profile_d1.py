"""Stage D1's dense seesaw for Nsight Compute: head dim 512, K = V, 128 query heads on one KV
head (DeepSeek-V4's dense shape), seqlen 4096, bf16. One launch to warm up (compile, first
launch), then one inside the NVTX range ``profiled``:

    ncu --nvtx --nvtx-include "profiled/" -k regex:FlashAttentionD1Sm90 -c 1 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \\
        --import-source no -o d1 python -m tools.profile_d1
    ncu -i d1.ncu-rep --page source --csv --print-source sass > d1.csv
    python -m tools.ncu_stalls d1.csv 30

(stage E's kernels: ``tools.profile_e``).
"""

from __future__ import annotations

import torch

from dsv4_attention.common.testing import random_bshd
from tools.profile_e import launch_profiled


def main() -> int:
    from dsv4_attention.stages import d1_smem_p

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    q = random_bshd(1, 4096, 128, 512, torch.bfloat16, dev)
    kv = random_bshd(1, 4096, 1, 512, torch.bfloat16, dev)
    launch_profiled([("D1 hd512 K = V s4096", lambda: d1_smem_p.forward(q, kv, kv))])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
