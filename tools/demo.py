"""The main job: DeepSeek-V4's attention, where it runs, in about a minute.

On a Hopper or Blackwell GPU: DeepSeek-V4's prefill (the HCA and CSA layer calls, and FlashMLA's
index mode at 64 and 128 heads) and decode shapes, each against the float64 reference (on its
last rows: the reference of a whole prefill would take minutes) and, for index mode, against
FlashMLA's sparse prefill on the same tensors where the device pack's ``flashmla_peer`` imports;
on Hopper also a decode step from paged FP8 caches beside FlashMLA's FP8 decode;
time (median of CUDA-event timings) and TFLOP/s. On a machine without one: compile the final
kernel's DeepSeek-V4 configurations for sm_90a and sm_100a, one worker a core (file cache off), and
print compile time, registers, stack frame (0 bytes: no spill), shared memory and TMEM columns,
saying plainly that nothing ran on a GPU. The full sweep (every stage, every head dim) is ``nox -s compile_sweep``.

    python -m tools.demo            # the main job
    python -m tools.demo --sweep    # every stage at every head dim, both architectures
"""

from __future__ import annotations

import os
import sys
import time

from dsv4_attention.common.arch import gpu_name, present_arch

ARCHS = ("sm90", "sm100")


def dsv4_configurations() -> list:
    """(arch, stage id, dtype name, head dim, options) of every kernel DeepSeek-V4's calls take,
    found by running the calls with the kernel lookup recorded (common/warmup.py's dsv4 preset)."""
    from dsv4_attention.common import warmup

    out = []
    for arch in ARCHS:
        refused = []
        for _, stage_id, _, dtype, head_dim, _, options in warmup.configurations(warmup.dsv4_calls(), arch, refused):
            out.append((arch, stage_id, str(dtype).removeprefix("torch."), head_dim, options))
        for name, why in refused:
            print(f"  {arch}: {name} refused: {why}")
    return out


def _compile_one(config):
    """Worker (a spawned process, file cache off): compile one configuration once, registers and
    the stack frame read from its cubin (``compile_here(once=True)``; the compile tests run ptxas's
    full report), and return its CompileReport as JSON."""
    import dataclasses
    import json

    from dsv4_attention.common.compile import CompileReport, compile_here

    arch, stage_id, dtype_name, head_dim, options = config
    try:
        rep = compile_here(stage_id, arch, dtype_name, head_dim, dict(options), once=True)
    except Exception as e:  # noqa: BLE001 - reported as a failed row
        rep = CompileReport(stage_id, arch, dtype_name, head_dim, options=dict(options))
        rep.error = f"{type(e).__name__}: {e}"
    return json.dumps(dataclasses.asdict(rep))


def compile_dsv4() -> int:
    import json
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from dsv4_attention.common.compile import CompileReport

    print("No Hopper/Blackwell GPU here: NOTHING RAN ON A GPU. Compiling the final kernel's DeepSeek-V4 "
          "configurations for both architectures instead (file cache off; `nox -s compile_sweep` compiles "
          "every stage).\n", flush=True)
    t0 = time.perf_counter()
    configs = dsv4_configurations()
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"  # the workers inherit it: every kernel really compiles
    workers = max(1, min(len(configs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        reports = [CompileReport(**json.loads(r)) for r in pool.map(_compile_one, configs)]
    failed = spilled = 0
    for rep in reports:
        failed += not rep.ok
        spilled += bool(rep.ok and (rep.spill_store_bytes or rep.spill_load_bytes or rep.stack_bytes))
        print("  " + rep.row(), flush=True)
    print(f"\n{len(reports)} configurations compiled in {time.perf_counter() - t0:.0f} s ({workers} at a time), "
          f"{failed} failed, {spilled} with a stack frame (where spills would live). Compiled only: correctness "
          "and speed on sm90 are evidenced by "
          "the device reports in docs/results/; no sm100 kernel has run on a GPU.")
    return 1 if failed or spilled else 0


def compile_sweep() -> int:
    from dsv4_attention import stages
    from dsv4_attention.common.compile import compile_report

    print("NOTHING RUNS ON A GPU here: every stage compiled for the architectures it has a kernel for, at "
          "the head dims that architecture's kernel serves (file cache off).\n")
    failed, spilled, t0 = 0, [], time.perf_counter()
    for st in stages.ALL_STAGES:
        print(f"stage {st.id} ({st.name}): {st.adds}")
        for arch in (a for a in ARCHS if a in st.module.KERNELS):
            for hd in st.head_dims_for(arch):  # fewer where that architecture's kernel says so (F's sm100)
                rep = compile_report(st.id, arch, "bfloat16", hd, options=getattr(st.module, "DEMO_OPTIONS", None))
                failed += not rep.ok
                if rep.ok and (rep.spill_store_bytes or rep.spill_load_bytes or rep.stack_bytes):
                    spilled.append(f"{st.id} {arch} hd{hd}")
                print("  " + rep.row(), flush=True)
    print(f"\ncompiled in {time.perf_counter() - t0:.0f} s, {failed} failed; spills or a stack frame: "
          f"{', '.join(spilled) or 'none'} (the one known, d4 sm100 hd320, is explained on stage D4's page)")
    return 1 if failed else 0


def run_dsv4() -> int:
    import torch

    from dsv4_attention.common import bench
    from dsv4_attention.common.reference import dsv4_index_attention, fused_attention
    from dsv4_attention.common.testing import O_REL, errors, random_bshd, random_index_lists
    from dsv4_attention.stages import e_fused
    from tools.bench_stages import graph_ms

    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    tol = O_REL[torch.bfloat16]
    print(f"GPU: {gpu_name()} ({present_arch()}). DeepSeek-V4's attention: hd 512, K = V, bf16, window (127, 0), "
          "sink; errors against the float64 reference on the rows named; time = median of CUDA events.\n")
    bad = 0

    def show(name, e, ms, flop, extra=""):
        nonlocal bad
        ok = e.within(tol, 3 * tol)
        bad += not ok
        print(f"  {name:44s} rel {e.rel_fro:.1e} worst row {e.row_rel:.1e} {'ok' if ok else 'FAIL'}  "
              f"{ms:7.3f} ms {bench.tflops(flop, ms):6.1f} TFLOP/s{extra}", flush=True)

    def layer(name, b, sq, sk, ratio, topk, checked):
        """One V4 layer call (128 heads; window, sink, entries of ``ratio``, ``topk`` lists or all),
        checked against the reference on ``checked``: (request slice, token slice)."""
        heads, n_c = 128, sk // ratio
        q = random_bshd(b, sq, heads, 512, torch.bfloat16, dev, generator=g)
        kv = random_bshd(b, sk, 1, 512, torch.bfloat16, dev, generator=g)
        kw = {"causal": True, "window_size": (127, 0), "learnable_sink": torch.randn(heads, generator=g).to(dev),
              "compressed_kv": random_bshd(b, n_c, 1, 512, torch.bfloat16, dev, generator=g), "compress_ratio": ratio}
        if topk:
            kw["topk_indices"] = torch.stack([random_index_lists(sq, topk, n_c, g, pad=0.05) for _ in range(b)]).to(dev)
        o, _ = e_fused.forward(q, kv, **kw)
        reqs, toks = checked
        ref_kw = dict(kw, compressed_kv=kw["compressed_kv"][reqs],
                      positions=torch.arange(sk - sq, sk, device=dev)[toks])  # bottom-right: token t at sk - sq + t
        if topk:
            ref_kw["topk_indices"] = kw["topk_indices"][reqs, toks]
        o_ref, _ = fused_attention(q[reqs, toks], kv[reqs], **ref_kw)
        ms = bench.time_ms([lambda q=q, kv=kv, kw=kw: e_fused.forward(q, kv, **kw)])
        show(name, errors(o[reqs, toks], o_ref), ms,
             e_fused.flops(b, sq, sk, heads, 512, True, (127, 0), ratio, n_c, topk))
        del q, kv, kw, o, o_ref
        torch.cuda.empty_cache()

    def index(heads, k, s_q=4096, s_kv=8192):
        q = random_bshd(1, s_q, heads, 512, torch.bfloat16, dev, generator=g)[0]
        kv = random_bshd(1, s_kv, 1, 512, torch.bfloat16, dev, generator=g)[0]
        idx = torch.rand(s_q, s_kv, generator=g).topk(k, dim=1).indices.int()[:, None].to(dev)
        sink = torch.randn(heads, generator=g).to(dev)
        o, _ = e_fused.index_attention(q, kv, idx, attn_sink=sink, check_indices=False)
        rows = slice(s_q - 256, s_q)
        length = torch.full((256,), k, dtype=torch.int32, device=dev)
        o_ref, _ = dsv4_index_attention(q[rows], kv[:, 0], idx[rows, 0], length, sink)
        ms = bench.time_ms([lambda: e_fused.index_attention(q, kv, idx, attn_sink=sink, check_indices=False)])
        try:
            import flashmla_peer  # pyright: ignore[reportMissingImports] (the device pack's FlashMLA)

            peer = lambda: flashmla_peer.sparse_prefill_fwd(q, kv, idx, 512 ** -0.5, 512, sink, None)  # noqa: E731
            diff = float((peer()[0].float() - o.float()).abs().max())
            peer_ms = bench.time_ms([peer])
            extra = f"  FlashMLA {peer_ms:.3f} ms: ours / FlashMLA {ms / peer_ms:.2f}x (max|diff| {diff:.1e})"
        except Exception as e:  # noqa: BLE001 - FlashMLA is a peer of the device pack, not a dependency
            extra = f"  (FlashMLA not run: {type(e).__name__})"
        show(f"index mode h{heads} top-{k}, {s_q} tokens (last 256 checked)", errors(o[rows], o_ref), ms,
             4 * s_q * k * heads * 512, extra)

    print("prefill")
    last = slice(0, 1)
    layer("HCA layer, 4096 tokens (last 256 checked)", 1, 4096, 4096, 128, None, (last, slice(4096 - 256, 4096)))
    layer("CSA layer, 4096 tokens, top-512 (last 128 checked)", 1, 4096, 4096, 4, 512, (last, slice(4096 - 128, 4096)))
    index(64, 512)
    index(128, 1024)
    print("decode (batch 64, 2 tokens each, 8192 keys; eager calls: CSA's includes the default check of its "
          "lists, one device synchronisation)")
    # the float64 reference of 4 requests: all 64 would expand K to 128 heads (256 GB)
    layer("HCA decode (4 requests checked)", 64, 2, 8192, 128, None, (slice(0, 4), slice(None)))
    layer("CSA decode, top-512 (4 requests checked)", 64, 2, 8192, 4, 512, (slice(0, 4), slice(None)))

    def fp8_decode(heads, extra_topk, extra_page, b=64, s_q=2):
        """``e_fused.decode`` from two MODEL1 FP8 caches (FlashMLA's CONFIG shapes: a window top-128
        in pages of 256, the extra list in pages of ``extra_page``), 4 requests checked against the
        float64 reference on the dequantized caches, timed eager and replayed from a CUDA graph (as an
        engine runs decode), each beside FlashMLA's decode timed alike."""
        from dsv4_attention.common import kv_cache
        from tools.bench_decode import flashmla_decode, fp8_cache

        win, win_idx = fp8_cache(dev, b, s_q, 4096, 256, 128, g)
        ext, ext_idx = fp8_cache(dev, b, s_q, 4096, extra_page, extra_topk, g)
        q = random_bshd(b, s_q, heads, 512, torch.bfloat16, dev, generator=g)
        sink = torch.randn(heads, generator=g).to(dev)
        kw = {"attn_sink": sink, "extra_k_cache": ext, "extra_indices": ext_idx, "check_indices": False}
        o, _ = e_fused.decode(q, win, win_idx, **kw)
        rows_w = kv_cache.dequantize_kv_cache(win).view(-1, 512)
        pool = torch.cat([rows_w, kv_cache.dequantize_kv_cache(ext).view(-1, 512)])
        lists = torch.cat([win_idx, torch.where(ext_idx >= 0, ext_idx + rows_w.shape[0], -1)], dim=2)[:4]
        length = torch.full((4 * s_q,), lists.shape[2], dtype=torch.int32, device=dev)
        o_ref, _ = dsv4_index_attention(q[:4].flatten(0, 1), pool, lists.flatten(0, 1), length, sink)
        sched = e_fused.DecodeSchedule()  # an engine's sched_meta: decided once, replayed each step
        ours = lambda: e_fused.decode(q, win, win_idx, sched_meta=sched, **kw)  # noqa: E731
        ms = bench.time_ms([ours])
        # an engine replays decode from a CUDA graph: the host's work per call is not in it
        ours_graph = graph_ms([ours])
        replayed = f" (graph-replayed {ours_graph:.3f} ms"
        try:
            import flashmla_peer  # pyright: ignore[reportMissingImports] (the device pack's FlashMLA)

            peer = flashmla_decode(flashmla_peer, q, win, win_idx, kw)
            peer()
            peer_ms, peer_graph = bench.time_ms([peer]), graph_ms([peer])
            extra = (f"{replayed}, FlashMLA's {peer_graph:.3f} ms: {ours_graph / peer_graph:.2f}x)  "
                     f"FlashMLA eager {peer_ms:.3f} ms: ours / FlashMLA {ms / peer_ms:.2f}x")
        except Exception as e:  # noqa: BLE001 - FlashMLA is a peer of the device pack, not a dependency
            extra = f"{replayed})  (FlashMLA not run: {type(e).__name__})"
        show(f"FP8 decode h{heads} top-128 + {extra_topk} (pages of {extra_page})", errors(o[:4].flatten(0, 1), o_ref),
             ms, 2 * heads * b * s_q * (128 + extra_topk) * 1024, extra)

    if present_arch() == "sm90":  # decode's exact merge of its two lists is built on sm90
        print("decode from paged FP8 caches (FlashMLA's MODEL1 layout; batch 64, 2 tokens; eager, and replayed from a "
              "CUDA graph in parentheses; 4 requests checked)")
        fp8_decode(64, 512, 64)
        fp8_decode(128, 1024, 2)
    else:
        print("decode from paged FP8 caches: sm90 only (its merge needs split-KV's partials); not run here")
    print("\nTraining (docs/training.md): dense attention's backward is a kernel (stage F, Hopper, head dims "
          "64 / 128) and for index mode (Hopper, head dim 512); DeepSeek-V4's layer differentiates through a "
          "torch-composed backward (correct, 20-30x the time of a kernel: issue 44). Not run by this demo.")
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--sweep" in argv:
        return compile_sweep()
    return run_dsv4() if present_arch() else compile_dsv4()


if __name__ == "__main__":
    sys.exit(main())
