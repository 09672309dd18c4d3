"""Where a decode step's time goes, one launch against two: per-kernel CUDA times (torch.profiler)
of ``e_fused.decode`` on FlashMLA's CONFIG shapes in both forms (two launches + merge; one
launch, ``one_launch=True``, auto splits and unsplit), and FlashMLA's FP8 decode on the same
caches. Run on the device: ``python docs/results/experiments/issue43_one_launch/profile_one_launch.py``."""

import sys

import torch

sys.path.insert(0, ".")
from dsv4_attention.stages import e_fused  # noqa: E402
from tools.bench_decode import fp8_decode_step  # noqa: E402
from tools.bench_stages import graph_ms  # noqa: E402
from tools.profile_e import print_kernel_times  # noqa: E402


def case(dev, config, b):
    q, win, win_idx, kw = fp8_decode_step(dev, config, b)
    calls = {f"{'one' if one else 'two'} splits={ns or 'auto'}":
             (lambda one=one, ns=ns: e_fused.decode(q, win, win_idx, num_splits=ns, one_launch=one, **kw))
             for one, ns in ((False, None), (True, None), (True, 1))}
    try:
        import flashmla_peer as fm  # pyright: ignore[reportMissingImports] (GPU peer)

        meta = fm.FlashMLASchedMeta()
        calls["flashmla"] = lambda: fm.with_kvcache_sparse(
            q, win, win_idx, None, kw["attn_sink"], kw["extra_k_cache"], kw["extra_indices"],
            kw["extra_topk_length"], softmax_scale=512 ** -0.55, sched_meta=meta)
    except ImportError:
        pass
    for name, call in calls.items():
        print(f"CONFIG{config} b{b} {name}: {graph_ms([call]) * 1e3:.1f} us (graph)", flush=True)
        print_kernel_times(call)


dev = torch.device("cuda")
for config, b in [(2, 64), (2, 2), (1, 64), (3, 128)]:
    case(dev, config, b)
