"""A/B of stage F's 128-query visits at head dim 64 with a window bound (dP's GEMM issued after P):
time = our backward's median per case, FA4's in the same process."""
import sys

import torch

sys.path.insert(0, ".")
from tools.bench_backward import backward_row  # noqa: E402

CASES = [(2, 32, 8192, 64, True), (4, 32, 4096, 64, True), (8, 32, 2048, 64, True), (16, 16, 1024, 64, True),
         (2, 32, 8192, 64, False)]
dev = torch.device("cuda")
tag = sys.argv[1]
for b, h, s, d, causal in CASES:
    r = backward_row(dev, b, h, s, d, causal, peers=("fa4",))
    print(f"AB {tag} {r['case']} {r['ours_ms']} ms {r['ours_tflops']} TF ratio {r.get('time_ratio_vs')}", flush=True)
