"""Stage E's cases for Nsight Compute: each kernel launched once to warm up (compile, first
launch), then once more inside the NVTX range ``profiled``, so that

    ncu --nvtx --nvtx-include "profiled/" --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --metrics <...> python -m tools.profile_e

profiles, in order: index mode (128 heads, top-1024 of 32k rows, 4096 tokens), FlashMLA's sparse
prefill on the same tensors (the device pack's ``flashmla_peer``), DeepSeek-V4 HCA decode
(64 requests x 1 token, 64k keys, 512 entries) and the HCA prefill layer (8k tokens, window
(127, 0) + 64 entries). ``-k regex:FlashAttentionESm90 --launch-skip N -c 1`` picks the N-th of
our three (index mode 0, decode 1, HCA prefill 2).
"""

from __future__ import annotations

import torch

from tools.bench import dsv4_layer, index_inputs


def main() -> int:
    from dsv4_attention.stages import e_fused

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    q, kv, idx, sink, scale = index_inputs(dev, 128, 1024, 32768, 4096)  # index_row's inputs
    c = dsv4_layer(dev, 64, 1, 65536, None)
    kw = {"compressed_kv": c["compressed_kv"], "compress_ratio": c["compress_ratio"],
          "learnable_sink": c["learnable_sink"], "causal": True, "window_size": (127, 0)}
    calls = [("index mode", lambda: e_fused.index_attention(q, kv, idx, attn_sink=sink, softmax_scale=scale))]
    try:
        import flashmla_peer  # pyright: ignore[reportMissingImports] (GPU peer)

        calls.append(("flashmla sparse prefill", lambda: flashmla_peer.sparse_prefill_fwd(q, kv, idx, scale, 512,
                                                                                           sink, None)))
    except ImportError as e:
        print(f"no FlashMLA: {e}")
    calls.append(("HCA decode b64 sk64k", lambda: e_fused.forward(c["q"], c["kv"], **kw)))
    h = dsv4_layer(dev, 1, 8192, 8192, None)
    kw_h = {"compressed_kv": h["compressed_kv"], "compress_ratio": h["compress_ratio"],
            "learnable_sink": h["learnable_sink"], "causal": True, "window_size": (127, 0)}
    calls.append(("HCA prefill s8k", lambda: e_fused.forward(h["q"], h["kv"], **kw_h)))
    launch_profiled(calls)
    return 0


def launch_profiled(calls: list) -> None:
    """[(name, call)]: each call once to warm up (compile, first launch), then each once more inside
    the NVTX range ``profiled`` that ``ncu --nvtx-include "profiled/"`` selects (tools.profile_d1
    uses it too)."""
    for _, call in calls:
        call()
    torch.cuda.synchronize()
    print("profiled, in order:", [n for n, _ in calls], flush=True)
    torch.cuda.nvtx.range_push("profiled")
    for _, call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def kernel_times(fn, reps: int = 5) -> list:
    """Per-kernel CUDA times of one call of ``fn`` (torch.profiler over ``reps`` calls after a
    warm one): [(kernel name, launches a call, us a call)], longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:70], e.count // reps, round(e.device_time_total / reps, 1))
            for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count]
    return sorted(rows, key=lambda r: -r[2])


def print_kernel_times(fn, reps: int = 5) -> None:
    for name, count, us in kernel_times(fn, reps):
        print(f"    {us:8.1f} us  x{count}  {name}", flush=True)


def decode_pool(win, win_idx, ext, ext_idx):
    """Both of a decode step's caches dequantized into one bf16 pool of rows, and each token's two
    lists as one list into it (the extra cache's slots after the window cache's, -1 kept):
    (pool [slots, 1, 512], lists [batch, s_q, k_a + k_b]), for ``index_attention`` over the same
    keys as ``e_fused.decode`` (the bf16 gather's reference point in the FP8 profiles)."""
    from dsv4_attention.common import kv_cache as kc

    win16, ext16 = kc.dequantize_kv_cache(win), kc.dequantize_kv_cache(ext)
    pool = torch.cat([kc.cache_rows(win16), kc.cache_rows(ext16)])
    first = win16.shape[0] * win16.shape[1]
    return pool, torch.cat([win_idx, torch.where(ext_idx >= 0, ext_idx + first, ext_idx)], -1)


if __name__ == "__main__":
    raise SystemExit(main())
