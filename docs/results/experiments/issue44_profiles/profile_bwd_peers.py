"""Where the backward's time goes against its peers' (issue 44's bars), for Nsight Compute.

``python docs/results/experiments/issue44_profiles/profile_bwd_peers.py times``: per-kernel CUDA
times (torch.profiler) of one call of each; ``... ncu``: each call once to compile, then once more
inside the NVTX range ``profiled``:

    ncu --nvtx --nvtx-include "profiled/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        --section ComputeWorkloadAnalysis -o bwd python .../profile_bwd_peers.py ncu

FA4's backward runs on autograd's device thread, whose NVTX stack lacks ``profiled``: for it,
``ncu --profile-from-start off -k regex:Backward ... profile_bwd_peers.py ncu-range`` (the
profiler started and stopped around the second launches).

Cases: index mode (V4-Flash: 4096 tokens, 64 heads, top-640, d 512) ours (stage F's
``index_backward``: its kernel) against cuDNN-frontend's sparse backward on the same lists, O and
LSE; dense hd 64 non-causal (2 x 8192, 32 heads, the bar's widest gap), hd 128 causal (2 x 8192,
16 heads) and hd 256 non-causal (1 x 8192, 16 heads: ``sm90_wide.py``) ours against FA4's backward.
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


def index_calls(tokens=4096, heads=64, topk=640):
    import cudnn.deepseek_sparse_attention as dsa  # pyright: ignore[reportMissingImports] (GPU peer)

    g = torch.Generator(device=dev).manual_seed(7)
    q = (torch.randn(tokens, heads, 512, device=dev, generator=g) / 4).bfloat16()
    kv = (torch.randn(tokens, 1, 512, device=dev, generator=g) / 4).bfloat16()
    idx = torch.randint(0, tokens, (tokens, 1, topk), device=dev, generator=g, dtype=torch.int32)
    sink = torch.randn(heads, device=dev, generator=g)
    do = torch.randn(tokens, heads, 512, device=dev, generator=g).bfloat16()
    with torch.no_grad():
        o, lse = e_fused.index_attention(q, kv, idx, attn_sink=sink)
    rows = idx[:, 0].contiguous()
    return [("index ours", lambda: stage.index_backward(q, kv, idx, o, lse, do, attn_sink=sink)),
            ("index cudnn_dsa", lambda: dsa.sparse_attention_backward_wrapper(q, kv[:, 0], o, do, lse.contiguous(),
                                                                              sink, rows))]


def dense_calls(b=2, h=32, s=8192, d=64, causal=False):
    q, k, v, do = (random_bshd(b, s, h, d, torch.bfloat16, dev) for _ in range(4))
    with torch.no_grad():
        o, lse = e_fused.forward(q, k, v, causal=causal)
    return [(f"dense hd{d} ours", lambda: stage.backward(q, k, v, o, lse, do, causal=causal)),
            (f"dense hd{d} fa4", fa4_backward(q, k, v, do, causal))]


def main(mode):
    calls = (index_calls() + dense_calls() + dense_calls(h=16, d=128, causal=True)
             + dense_calls(b=1, h=16, d=256))
    if mode == "times":
        for name, call in calls:
            print(name, flush=True)
            print_kernel_times(call)
    elif mode == "ncu":
        launch_profiled(calls)
    else:  # "ncu-range": FA4's backward runs on autograd's device thread, outside an NVTX range
        for _, call in calls:
            call()
        torch.cuda.synchronize()
        print("profiled, in order:", [n for n, _ in calls], flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        for _, call in calls:
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "times")
