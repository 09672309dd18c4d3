"""Compile ahead of the first call: every configuration a set of calls needs, in parallel, into
the kernel cache (common/kernel_cache.py), so that no later process compiles.

A configuration is what the call path hands ``jit.stage_kernel``: (stage, arch, dtype, head dim,
compile-time options). Rather than restate how a call's arguments become options (the packed
group, K = V, the window's sides, the sink, the compressed branch...), the warm-up *runs the call
path* on small CPU tensors of the call's form, with the architecture fixed and the kernel lookup
replaced by a recorder: the options recorded are the ones a GPU call of that form builds, by the
same code. Each recorded configuration is then compiled by a worker process (``--jobs``, default
one per CPU), with CuTeDSL's file cache off, and written to the kernel cache directory. No GPU is
needed (the DSL compiles for sm_90a and sm_100a on the host), but the cache directory is per
machine: warm up where the calls will run, or point ``DSV4_ATTENTION_CACHE_DIR`` at shared storage.

    python -m dsv4_attention.common.warmup [--preset dsv4|dense|serving|all] [--arch sm90|sm100] [--jobs N]
    nox -s warmup -- --preset dsv4

Presets: ``dsv4``: DeepSeek-V4's attention at head dim 512, K = V, MQA with 64 or 128 query
heads, bf16: its window with the sink (SWA layers), plus the dense compressed entries (HCA) or a
top-k list (CSA), and index mode (FlashMLA's sparse attention). ``dense``: the plain attention of
the earlier stages at head dims 64, 128 and 256, bf16 and fp16, causal or not, MHA and GQA groups
4 and 8. A configuration outside them compiles on its first call, once per machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time

import torch

#: kernel lookups a warm-up records: (stage_id, kernels, arch, dtype, head_dim, args, options)
_recorded: list = []


def _bshd(b, s, h, d, dtype):
    return torch.zeros(b, s, h, d, dtype=dtype)


def dsv4_calls(heads=(64, 128)):
    """DeepSeek-V4's calls: (description, function) pairs, each making one call on CPU tensors."""
    import dsv4_attention
    from dsv4_attention.stages import e_fused

    bf = torch.bfloat16
    calls = []
    for h in heads:
        q, kv = _bshd(1, 256, h, 512, bf), _bshd(1, 256, 1, 512, bf)
        ckv, sink = _bshd(1, 64, 1, 512, bf), torch.zeros(h)
        topk = torch.full((1, 256, 512), -1, dtype=torch.int32)
        win = {"window_size": (127, 0), "learnable_sink": sink}
        calls += [
            (f"SWA h{h}", lambda q=q, kv=kv, win=win: dsv4_attention.attention(q, kv, **win)),
            (f"HCA h{h}", lambda q=q, kv=kv, ckv=ckv, win=win: dsv4_attention.attention(
                q, kv, compressed_kv=ckv, compress_ratio=128, **win)),
            (f"CSA h{h}", lambda q=q, kv=kv, ckv=ckv, topk=topk, win=win: dsv4_attention.attention(
                q, kv, compressed_kv=ckv, compress_ratio=4, topk_indices=topk, **win)),
            (f"index mode h{h}", lambda q=q, kv=kv, h=h: e_fused.index_attention(
                q[0], kv[0], torch.zeros(256, 1, 512, dtype=torch.int32), attn_sink=torch.zeros(h))),
        ]
    return calls


def dense_calls():
    """The earlier stages' plain attention through the library's entry."""
    import dsv4_attention

    calls = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128, 256):
            for kv_heads in (16, 4, 2):  # MHA, GQA groups 4 and 8 of 16 query heads
                for causal in (False, True):
                    q, k, v = _bshd(1, 256, 16, d, dtype), _bshd(1, 256, kv_heads, d, dtype), _bshd(
                        1, 256, kv_heads, d, dtype)
                    calls.append((f"{str(dtype)[6:]} hd{d} kv_heads {kv_heads} causal {causal}",
                                  lambda q=q, k=k, v=v, causal=causal: dsv4_attention.attention(q, k, v,
                                                                                                causal=causal)))
    return calls


def serving_calls(heads=(64, 128)):
    """Serving from paged MODEL1 FP8 caches (common/kv_cache.py): FlashMLA's decode cases (a window
    list in pages of 256 with an extra list in pages of 64, or of 2: one launch over both, split
    for a small batch and unsplit for a full one) and index mode over the pages (prefill from the
    cache)."""
    from dsv4_attention.common import kv_cache
    from dsv4_attention.stages import e_fused

    bf = torch.bfloat16
    pages = {n: kv_cache.quantize_kv_cache(torch.zeros(2, n, 1, 512, dtype=bf)) for n in (256, 64, 2)}
    lists = {n: torch.full((1, 2, 128), -1, dtype=torch.int32) for n in pages}
    calls = []
    for h in heads:
        q, sink = _bshd(1, 2, h, 512, bf), torch.zeros(h)
        for extra in (64, 2):
            for splits in (None, 1):  # a step of one request splits (sm90); num_splits=1: a full batch
                calls.append((f"decode h{h} pages 256 + {extra}{' unsplit' if splits else ''}",
                              lambda q=q, sink=sink, extra=extra, splits=splits: e_fused.decode(
                                  q, pages[256], lists[256], attn_sink=sink, extra_k_cache=pages[extra],
                                  extra_indices=lists[extra], check_indices=False, num_splits=splits)))
        calls.append((f"index mode over FP8 pages h{h}", lambda q=q, sink=sink: e_fused.index_attention(
            q[0], pages[64], lists[64][0, :, None], attn_sink=sink, check_indices=False)))
    return calls


PRESETS = {"dsv4": dsv4_calls, "dense": dense_calls, "serving": serving_calls}


def configurations(calls, arch: str, refused: list | None = None) -> list:
    """The kernel configurations ``calls`` need on ``arch``: each call runs the library's call path
    on its CPU tensors with the architecture fixed and the kernel lookup recorded, not compiled.
    Returns [(key, stage_id, kernels, dtype, head_dim, args, options)], one per distinct key; a
    call the architecture does not serve (its ValueError) goes to ``refused`` as (name, message)."""
    from dsv4_attention.common import call_plan, interface, jit

    saved = interface.arch_of_device, jit.stage_kernel

    def record(stage_id, kernels, arch_, dtype, head_dim, args, options=None):
        _recorded.append((stage_id, kernels, arch_, dtype, head_dim, args, dict(options or {})))
        return lambda *a: None

    interface.arch_of_device = lambda device: arch
    jit.stage_kernel = record
    _recorded.clear()
    try:
        for name, call in calls:
            call_plan.clear()  # every call takes the full path (a plan would skip the lookup)
            try:
                call()
            except ValueError as e:  # e.g. top-k lists with 64 heads on sm100's 128-row tiles
                if refused is None:
                    raise
                refused.append((name, str(e)))
    finally:
        interface.arch_of_device, jit.stage_kernel = saved
        call_plan.clear()
    found = {}
    for stage_id, kernels, arch_, dtype, head_dim, args, options in _recorded:
        key = jit.config_key(stage_id, arch_, dtype, head_dim, options)
        # the compile reads a tensor's dtype and rank only: a one-element stand-in travels to the worker
        args = [jit.map_leaves(_stand_in, a) for a in args]
        found.setdefault(key, (key, stage_id, kernels, dtype, head_dim, args, options))
    return list(found.values())


def _stand_in(a):
    return torch.empty((1,) * a.dim(), dtype=a.dtype) if isinstance(a, torch.Tensor) else a


def _compile_one(config, arch):
    """Worker: compile one configuration into the kernel cache (a fresh process: spawn)."""
    from dsv4_attention.common import jit, kernel_cache
    from dsv4_attention.common.arch import target_arch

    key, stage_id, kernels, dtype, head_dim, args, options = config
    t0 = time.perf_counter()
    with target_arch(arch):
        jit.stage_kernel(stage_id, kernels, arch, dtype, head_dim, args, options)
    return key, time.perf_counter() - t0, dict(kernel_cache.stats)


def warm(calls, arch: str, jobs: int | None = None, log=print) -> dict:
    """Compile (or find in the cache) every configuration ``calls`` need on ``arch``, ``jobs``
    processes at a time. Returns {"configs", "compiled", "loaded", "seconds"}."""
    from dsv4_attention.common import kernel_cache

    if kernel_cache.directory() is None:
        raise SystemExit(f"the kernel cache is disabled ({kernel_cache.ENV_DISABLE}): nothing to warm")
    refused = []
    configs = configurations(calls, arch, refused)
    for name, why in refused:
        log(f"not served on {arch}: {name}: {why}")
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(configs) or 1))
    t0 = time.perf_counter()
    totals = {"configs": len(configs), "compiled": 0, "loaded": 0}
    env = {"CUTE_DSL_DISABLE_FILE_CACHING": "1"}  # the library's cache is the one that serves calls
    os.environ.update(env)
    ctx = multiprocessing.get_context("spawn")  # no CUDA or DSL state inherited
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_compile_one, c, arch): c for c in configs}
        for f in concurrent.futures.as_completed(futures):
            key, seconds, stats = f.result()
            how = "compiled" if stats["compiled"] else "loaded"
            totals[how] += 1
            log(f"{how:8s} {seconds:6.2f} s  {key[0]} {key[1]} {key[2]} hd{key[3]} {dict(key[4])}")
    totals["seconds"] = round(time.perf_counter() - t0, 1)
    return totals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_attention.common.warmup", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    p.add_argument("--arch", choices=["sm90", "sm100"], default=None,
                   help="default: the GPU's, else sm90")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per CPU)")
    a = p.parse_args(argv)
    from dsv4_attention.common import kernel_cache
    from dsv4_attention.common.arch import present_arch

    arch = a.arch or present_arch() or "sm90"
    calls = [c for name in (PRESETS if a.preset == "all" else [a.preset]) for c in PRESETS[name]()]
    print(f"warming {len(calls)} calls for {arch} into {kernel_cache.directory()}", flush=True)
    totals = warm(calls, arch, a.jobs, log=lambda s: print(s, flush=True))
    print(f"{totals['configs']} configurations: {totals['compiled']} compiled, {totals['loaded']} already cached, "
          f"{totals['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
