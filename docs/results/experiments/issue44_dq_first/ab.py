"""A/B of stage F's dQ-first issue order (run from a tree root): warm = compile each case's kernel
on tiny inputs (the file cache keeps them), time = our backward's median per case (no peers)."""
import sys

import torch

sys.path.insert(0, ".")
from dsv4_attention.common.testing import random_bshd  # noqa: E402
from dsv4_attention.stages import e_fused  # noqa: E402
from dsv4_attention.stages import f_backward as stage  # noqa: E402
from tools.bench_backward import backward_row  # noqa: E402

CASES = [(2, 32, 8192, 64, False), (2, 32, 8192, 64, True), (2, 16, 8192, 128, False), (2, 16, 8192, 128, True),
         (8, 16, 2048, 128, True), (2, 16, 8192, 256, False), (2, 16, 8192, 256, True), (8, 16, 2048, 256, False)]
dev = torch.device("cuda")
if sys.argv[1] == "warm":
    for _b, _h, _s, d, causal in CASES:
        q, k, v, do = (random_bshd(1, 200, 2, d, torch.bfloat16, dev) for _ in range(4))
        with torch.no_grad():
            o, lse = e_fused.forward(q, k, v, causal=causal)
        stage.backward(q, k, v, o, lse, do, causal=causal)
    for d in (128, 256):
        q, k, v, do = (random_bshd(1, 200, 2, d, torch.bfloat16, dev) for _ in range(4))
        with torch.no_grad():
            o, lse = e_fused.forward(q, k, v, causal=True)
        stage.backward(q, k, v, o, lse, do, causal=True, deterministic=True)
    torch.cuda.synchronize()
    print("warm", sys.argv[2], flush=True)
elif sys.argv[1] == "time":
    tag = sys.argv[2]
    for b, h, s, d, causal in CASES:
        r = backward_row(dev, b, h, s, d, causal, peers=())
        print(f"AB {tag} {r['case']} {r['ours_ms']} ms {r['ours_tflops']} TF", flush=True)
    for d in (128, 256):
        r = backward_row(dev, 4, 16, 4096, d, True, peers=(), deterministic=True)
        print(f"AB {tag} {r['case']} {r['ours_ms']} ms {r['ours_tflops']} TF", flush=True)

if sys.argv[1] == "index":  # index mode's call with the tree's index.py (patched or not), against cuDNN
    from tools.bench_backward import index_backward_row
    for tokens, heads, topk in ((4096, 64, 640), (8192, 128, 1152)):
        r = index_backward_row(dev, tokens, heads, topk)
        print(f"AB {sys.argv[2]} {r['case']} {r['ours_ms']} ms ratio {r['time_ratio_vs']}", flush=True)
