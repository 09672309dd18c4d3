"""Nsight Compute cases for the one-launch FP8 decode (FlashMLA's CONFIG2 at batch 64): each call
once to warm up, then once inside the NVTX range ``profiled`` (tools.profile_e.launch_profiled),
in order: ours over the FP8 pages (one launch, unsplit), ours over the same keys dequantized into
one bf16 pool (index_attention: the bf16 gather), FlashMLA's FP8 decode on the same caches.

    ncu --nvtx --nvtx-include "profiled/" -k regex:FlashAttentionESm90 --launch-skip 0 -c 1 \\
        --section SourceCounters --section WarpStateStats --import-source no -o fp8 \\
        python docs/results/experiments/issue43_one_launch/ncu_decode.py
"""

import sys

import torch

sys.path.insert(0, ".")
from dsv4_attention.stages import e_fused  # noqa: E402
from tools.bench_decode import fp8_decode_step  # noqa: E402
from tools.profile_e import decode_pool, launch_profiled  # noqa: E402

dev = torch.device("cuda")
q, win, win_idx, kw = fp8_decode_step(dev, 2, 64)
ext, ext_idx, sink = kw["extra_k_cache"], kw["extra_indices"], kw["attn_sink"]
pool, both = decode_pool(win, win_idx, ext, ext_idx)
b, s_q, h, d = q.shape
calls = [("fp8 one launch", lambda: e_fused.decode(q, win, win_idx, num_splits=1, one_launch=True, **kw)),
         ("bf16 pool index_attention", lambda: e_fused.index_attention(
             q.view(b * s_q, h, d), pool, both.view(b * s_q, 1, -1), attn_sink=sink, softmax_scale=512 ** -0.55,
             check_indices=False))]
try:
    import flashmla_peer as fm  # pyright: ignore[reportMissingImports] (GPU peer)

    meta = fm.FlashMLASchedMeta()
    calls.append(("flashmla", lambda: fm.with_kvcache_sparse(q, win, win_idx, None, sink, ext, ext_idx, None,
                                                             softmax_scale=512 ** -0.55, sched_meta=meta)))
except ImportError as e:
    print(f"no FlashMLA: {e}")
launch_profiled(calls)
