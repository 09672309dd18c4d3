"""A/B of index mode's dq store through sQ by one TMA store (run from a tree root, patched or not):
check = the kernel's three gradients against the torch form on fresh inputs (tokens not a multiple
of anything, -1 padding, a sink; dq poisoned first), time = the call's median per case (cuDNN too)."""
import sys

import torch

sys.path.insert(0, ".")
from dsv4_attention.common.testing import errors, random_index_lists  # noqa: E402
from dsv4_attention.stages import e_fused  # noqa: E402
from dsv4_attention.stages.f_backward import index  # noqa: E402
from tools.bench_backward import index_backward_row  # noqa: E402

dev = torch.device("cuda")
tag = sys.argv[2]
if sys.argv[1] == "check":
    g = torch.Generator(device="cpu").manual_seed(int(torch.randint(1 << 30, ()).item()))
    for tokens, heads, k, rows in ((300, 128, 200, 1000), (77, 64, 640, 5000)):
        q = (torch.randn(tokens, heads, 512, generator=g) / 2).to(torch.bfloat16).to(dev)
        kv = (torch.randn(rows, 1, 512, generator=g) / 2).to(torch.bfloat16).to(dev)
        idx = random_index_lists(tokens, k, rows, g, pad=0.2).view(tokens, 1, k).to(dev)
        sink = torch.randn(heads, generator=g).to(dev)
        do = torch.randn(tokens, heads, 512, generator=g).to(torch.bfloat16).to(dev)
        with torch.no_grad():
            o, lse = e_fused.index_attention(q, kv, idx, attn_sink=sink)
        assert index.kernel_serves(q, kv, idx) is None
        # NaN into the block the kernel's dq (torch.empty_like) is likely to reuse: a dq value left
        # unwritten shows as NaN
        nan = torch.full_like(q, float("nan"))
        del nan
        got = index.index_backward_kernel(q, kv, idx, o, lse, do, attn_sink=sink)
        ref = index.index_backward_torch(q.double(), kv.double(), idx, o.double(), lse.double(), do.double(),
                                         attn_sink=sink.double())
        for name, a, b in zip(("dq", "dkv", "dsink"), got, ref, strict=True):
            e = errors(a, b, row_floor=0.05)
            print(f"AB {tag} check tokens{tokens} h{heads} k{k} {name}: {e} ok={e.within(1e-2, 3e-2)}", flush=True)
elif sys.argv[1] == "time":
    for tokens, heads, topk in ((4096, 64, 640), (8192, 128, 1152), (16384, 64, 640)):
        r = index_backward_row(dev, tokens, heads, topk)
        print(f"AB {tag} {r['case']} {r['ours_ms']} ms ratio {r['time_ratio_vs']}", flush=True)
