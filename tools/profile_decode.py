"""Where an eager ``e_fused.decode`` call spends its time: FlashMLA's MODEL1 CONFIG decode steps
(``tools.bench_decode.fp8_decode_step``) at small and large batch, each call timed four ways:

- ``eager``: CUDA events around the call, median (host work the GPU waits for included);
- ``host``: the call's own CPU time (``tools.host_breakdown.host_us_per_call``: the fastest of 9
  loops of 300 calls, the GPU left to run: validation, planning, argument packing, launches);
- ``graph``: replayed from a CUDA graph (``graph_ms``: the kernels only);
- and the CUDA kernels one call launches, with their GPU time (``tools.profile_e.kernel_times``),
  so a gap between ``eager`` and ``graph`` is named: host time the GPU waited for, or extra kernels.

Our call is timed twice: as a call without a schedule, and with a ``DecodeSchedule`` (``sched_meta``:
decided on its first call, replayed after). FlashMLA's ``with_kvcache_sparse`` is timed alike
(with its ``sched_meta``) where the device pack's ``flashmla_peer`` imports.

``--cprofile N`` also prints, for each of our calls, the N functions of the host path with the
most cumulative time over 200 calls (``cProfile``), to name where the host time goes.

    python -m tools.profile_decode [--configs 1,2] [--batches 2,64] [--cprofile 25]
"""

from __future__ import annotations

import argparse

import torch


def host_profile(call, top: int, n: int = 200) -> None:
    """The ``top`` functions of ``n`` calls by cumulative time, the GPU synchronised before."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main(argv=None) -> int:
    from dsv4_attention.common import bench
    from dsv4_attention.stages import e_fused
    from tools.bench_decode import flashmla_decode, fp8_decode_step
    from tools.bench_stages import graph_ms
    from tools.host_breakdown import host_us_per_call
    from tools.profile_e import kernel_times

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1,2")
    ap.add_argument("--batches", default="2,64")
    ap.add_argument("--cprofile", type=int, default=0)
    a = ap.parse_args(argv)
    dev = torch.device("cuda", 0)
    try:
        import flashmla_peer  # pyright: ignore[reportMissingImports] (the device pack's FlashMLA)
    except ImportError:
        flashmla_peer = None
    for config in map(int, a.configs.split(",")):
        for b in map(int, a.batches.split(",")):
            q, win, win_idx, kw = fp8_decode_step(dev, config, b)
            sched = e_fused.DecodeSchedule()
            calls = {"ours": lambda q=q, win=win, win_idx=win_idx, kw=kw: e_fused.decode(q, win, win_idx, **kw),
                     "ours, scheduled": lambda q=q, win=win, win_idx=win_idx, kw=kw, sched=sched:
                         e_fused.decode(q, win, win_idx, sched_meta=sched, **kw)}
            if flashmla_peer is not None:
                calls["flashmla"] = flashmla_decode(flashmla_peer, q, win, win_idx, kw)
            for name, call in calls.items():
                call()
                eager = bench.time_ms([call]) * 1e3
                host = host_us_per_call(call)
                graph = graph_ms([call]) * 1e3
                ks = kernel_times(call)
                print(f"CONFIG{config} b{b} {name}: eager {eager:.1f} us, host {host:.1f} us, graph {graph:.1f} us, "
                      f"{sum(n for _, n, _ in ks)} kernels {sum(t for _, _, t in ks):.1f} us of GPU", flush=True)
                for k, n, t in ks:
                    print(f"    {t:8.1f} us  x{n}  {k}")
                if a.cprofile and name.startswith("ours"):
                    host_profile(call, a.cprofile)
            del q, win, win_idx, kw, calls
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
