"""Where a decode step's time goes: per-kernel CUDA times (torch.profiler) of ``e_fused.decode``
on FlashMLA's CONFIG shapes, over the FP8 pages and over the same pages dequantized to bf16 (the
bf16 gather: the same kernels' structure without the dequantization), and FlashMLA's.
Run on the device: ``python docs/results/experiments/issue43_fp8_gather_staged/profile_decode.py``."""

import sys

import torch

sys.path.insert(0, ".")
from dsv4_attention.common import kv_cache as kc  # noqa: E402
from dsv4_attention.stages import e_fused  # noqa: E402
from tools.bench_decode import FP8_CONFIGS, fp8_cache  # noqa: E402
from tools.bench_stages import graph_ms  # noqa: E402
from tools.profile_e import decode_pool, print_kernel_times  # noqa: E402


def case(dev, config, b):
    heads, s_q, w_tokens, w_topk, w_page, x_tokens, x_topk, x_page, x_len = FP8_CONFIGS[config]
    g = torch.Generator().manual_seed(config * 1000 + b)
    win, win_idx = fp8_cache(dev, b, s_q, w_tokens, w_page, w_topk, g)
    ext, ext_idx = fp8_cache(dev, b, s_q, x_tokens, x_page, x_topk, g)
    q = (torch.randn(b, s_q, heads, 512, generator=g) / 2).to(torch.bfloat16).to(dev)
    sink = torch.randn(heads, generator=g).to(dev)
    win16, ext16 = kc.dequantize_kv_cache(win), kc.dequantize_kv_cache(ext)
    for name, (w, x) in {"fp8": (win, ext), "bf16": (win16, ext16)}.items():
        for ns in (None, 1):
            def call(w=w, x=x, ns=ns):
                return e_fused.decode(q, w, win_idx, attn_sink=sink, extra_k_cache=x, extra_indices=ext_idx,
                                      softmax_scale=512 ** -0.55, check_indices=False, num_splits=ns,
                                      one_launch=False)  # the two launches it measured (then the only form)
            ms = graph_ms([call])
            print(f"CONFIG{config} b{b} {name} splits={ns or 'auto'}: {ms * 1e3:.1f} us (graph)", flush=True)
            print_kernel_times(call)
    # one index-mode call over both lists' rows in one bf16 pool (no split, no merge)
    pool, both = decode_pool(win, win_idx, ext, ext_idx)
    qq = q.view(b * s_q, heads, 512)

    def one():
        return e_fused.index_attention(qq, pool, both.view(b * s_q, 1, -1), attn_sink=sink,
                                       softmax_scale=512 ** -0.55, check_indices=False)
    print(f"CONFIG{config} b{b} bf16 pool, one index_attention: {graph_ms([one]) * 1e3:.1f} us (graph)", flush=True)
    print_kernel_times(one)


dev = torch.device("cuda")
for config, b in [(2, 64), (2, 2), (1, 64)]:
    case(dev, config, b)
