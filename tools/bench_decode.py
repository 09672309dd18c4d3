"""The decode benchmarks (GPU only), latency and bandwidth rather than a stage's arithmetic:
DeepSeek-V4 decode steps with the fused kernel and split-KV (``python -m tools.bench --stage
decode``), and serving from the paged FP8 caches against FlashMLA (``--stage serving``).
"""

from __future__ import annotations

import torch

from dsv4_attention.common import bench
from tools.bench_stages import add_peer, dsv4_layer, graph_ms, guarded

# FlashMLA's MODEL1 decode cases (its tests/test_flash_mla_sparse_decoding.py, the device pack's
# check_decode.py): heads, s_q, window tokens, window top-k, its page size, extra tokens, extra
# top-k, its page size, whether the extra list has per-request lengths
FP8_CONFIGS = {1: (64, 2, 16384, 128, 256, 16384, 512, 64, False),
               2: (128, 2, 16384, 128, 256, 16384, 1024, 64, False),
               3: (64, 2, 16384, 128, 256, 16384, 1024, 2, True),
               4: (128, 2, 16384, 128, 256, 16384, 1024, 2, True)}
FP8_BATCHES = (2, 64, 128)


def bench_decode(dev) -> list:
    """DeepSeek-V4 decode with the fused kernel from bf16 tensors (``decode_row``) and split-KV over
    long spans: a bench of its own, like ``calls``, since it measures latency and bandwidth rather
    than a stage's arithmetic, and re-runs alone. The paged FP8 caches are group ``serving``."""
    copy = bench.copy_gbps(dev)
    rows = []
    for topk in (None, 512):
        for sq in (1, 2):
            for sk in (4096, 65536):
                rows += guarded(decode_row, dev, sq, sk, topk, copy)
                torch.cuda.empty_cache()
    # few requests with long spans: split-KV (common/split_kv.py) against one unit per Q tile
    for mode, sk in (("dense", 8192), ("dense", 65536), ("hca", 1 << 20)):
        for b in (1, 4, 16):
            rows += guarded(split_decode_row, dev, mode, b, sk)
            torch.cuda.empty_cache()
    return rows


def bench_serving(dev) -> list:
    """Serving from the paged FP8 caches (issue 43): FlashMLA's MODEL1 decode cases and prefill
    chunks over the cache, ours and FlashMLA's kernels on the same caches. Split from ``decode``
    (2026-12-04): the two together passed a device call's 10 minutes."""
    copy = bench.copy_gbps(dev)
    rows = []
    for config in FP8_CONFIGS:
        for b in FP8_BATCHES:
            rows += guarded(fp8_decode_row, dev, config, b, copy)
            torch.cuda.empty_cache()
    # serving prefill: index mode over the FP8 cache against the engines' path (dequantize, then
    # FlashMLA's bf16 sparse prefill); V4-Flash (64 heads, 640 keys a token) and V4-Pro (128, 1152)
    for heads, topk in ((64, 640), (128, 1152)):
        for tokens in (4096, 32768):
            rows += guarded(fp8_prefill_row, dev, heads, topk, tokens)
            torch.cuda.empty_cache()
    return rows


def decode_layer_kwargs(c: dict, mode: str) -> dict:
    """Stage E's forward keywords for a ``dsv4_layer`` case ``c`` run as ``mode``: "dense" (MQA
    decode over every key, the sink), "hca" (window (127, 0) + every visible entry) or "csa"
    (window + the case's top-k lists, unchecked). The split count such a call runs with is the
    library's to choose and report (``call_plan.last_splits``), not recomputed here."""
    kw = {"learnable_sink": c["learnable_sink"]}
    if mode == "dense":
        return kw
    kw.update(compressed_kv=c["compressed_kv"], compress_ratio=c["compress_ratio"], causal=True,
              window_size=(127, 0))
    if mode == "csa":
        kw.update(topk_indices=c["topk_indices"], check_indices=False)
    return kw


def split_decode_row(dev, mode: str, b: int, sk: int) -> dict:
    """Decode of ``b`` requests x 1 token x 128 heads, hd 512 K = V, sink: every one of ``sk`` keys
    (``mode`` dense: MQA decode) or DeepSeek-V4's HCA layer (window (127, 0) + the sk / 128
    entries). The split count the library chooses (``num_splits=None``) against one unit per Q
    tile (``num_splits=1``), both replayed from CUDA graphs in the same run, same inputs."""
    from dsv4_attention.common import call_plan
    from dsv4_attention.stages import e_fused

    c = dsv4_layer(dev, b, 1, sk, None)
    kw = decode_layer_kwargs(c, mode)
    ms = {n: graph_ms([lambda n=n: e_fused.forward(c["q"], c["kv"], num_splits=n, **kw)])
          for n in (1, None)}
    split_o = e_fused.forward(c["q"], c["kv"], num_splits=None, **kw)[0].float()
    splits = call_plan.last_splits()  # the count the library chose for this call
    diff = (split_o - e_fused.forward(c["q"], c["kv"], **kw)[0].float()).abs().max().item()
    what = "every key" if mode == "dense" else f"window(127, 0) + {c['compressed_kv'].shape[1]} entries (ratio 128)"
    row = {"stage": "decode", "case": f"split-KV decode b{b} h128 hk1 sq1 sk{sk} {what} hd512 k_eq_v sink bf16",
           "head_dim": 512, "seqlen": sk, "kind": "split-KV decode (CUDA graph replay)", "num_splits": splits,
           "ours_ms": round(ms[None], 4), "unsplit_ms": round(ms[1], 4), "split_speedup": round(ms[1] / ms[None], 2),
           "max_abs_diff_vs_unsplit": diff, "peers": {}, "peer_ms": {}, "time_ratio_vs": {}}
    print(f"decode {row['case']}: split {splits} ways {ms[None] * 1e3:.1f} us, unsplit {ms[1] * 1e3:.1f} us "
          f"({row['split_speedup']}x), max|diff| {diff:.3g}", flush=True)
    return row


def decode_row(dev, sq: int, sk: int, topk: int | None, copy: float) -> dict:
    """DeepSeek-V4 decode: 64 requests x ``sq`` tokens, 128 heads, one K = V head of hd 512, window
    (127, 0) + compressed entries (HCA: all visible at ratio 128; CSA: ``topk`` at ratio 4). Small
    and latency-bound: bandwidth over the bytes that must move (each request's window rows, the
    compressed rows it reads once, Q, O, LSE) against a same-run device copy.

    ``ours_ms`` is the kernels' time, replayed from a CUDA graph over input sets rotated past L2
    (``graph_ms``). A 40-200 us kernel timed per eager call also times the host: events bracket
    the whole Python call, its validation (for top-k lists a bounds check read back to the host)
    and argument packing before the launch. That per-call time is kept as ``eager_ms``."""
    from dsv4_attention.stages import e_fused

    b = 64
    c = dsv4_layer(dev, b, sq, sk, topk)
    window_rows = min(sk, 128 + sq - 1)
    if topk is None:
        c_rows = b * int(c["count"].max())
    else:
        lists = c["topk_indices"].reshape(b, -1).sort(-1).values
        distinct = (lists[:, 1:] != lists[:, :-1]) & (lists[:, 1:] >= 0)
        c_rows = int(distinct.sum()) + int((lists[:, 0] >= 0).sum())
    moved = (b * window_rows + c_rows) * 512 * 2 + 2 * b * sq * 128 * 512 * 2 + b * 128 * sq * 4

    def call_of(case, check=True):
        kw = {"compressed_kv": case["compressed_kv"], "compress_ratio": case["compress_ratio"],
              "topk_indices": case["topk_indices"], "learnable_sink": case["learnable_sink"], "causal": True,
              "window_size": (127, 0), "check_indices": check}
        return lambda: e_fused.forward(case["q"], case["kv"], **kw)

    eager_ms = bench.time_ms([call_of(c)])
    # top-k lists read by the host on each eager call (a synchronisation) unless check_indices=False
    eager_unchecked_ms = bench.time_ms([call_of(c, False)]) if topk else None
    # further input sets (other seeds, same shapes and counts) until the rotation exceeds L2
    cases = [c] + [dsv4_layer(dev, b, sq, sk, topk, seed=i) for i in range(1, bench.rotation_count(moved))]
    ms = graph_ms([call_of(x) for x in cases])
    ckv = c["compressed_kv"]
    flop = e_fused.flops(b, sq, sk, 128, 512, True, (127, 0), c["compress_ratio"], ckv.shape[1], topk=topk)
    what = f"top-{topk} of {ckv.shape[1]} (ratio 4)" if topk else f"{ckv.shape[1]} entries (ratio 128)"
    row = {"stage": "decode",
           "case": f"decode b{b} h128 hk1 sq{sq} sk{sk} window(127, 0) + {what} hd512 k_eq_v sink bf16",
           "head_dim": 512, "seqlen": sk, "kind": "decode (CUDA graph replay, L2 rotated)",
           "ours_ms": round(ms, 4), "eager_ms": round(eager_ms, 4), "input_sets": len(cases),
           **({"eager_unchecked_ms": round(eager_unchecked_ms, 4)} if topk else {}),
           "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {}, "peer_ms": {}, "time_ratio_vs": {},
           "gbps": round(moved / (ms * 1e-3) / 1e9), "copy_gbps": round(copy)}
    row["fraction_of_copy"] = round(row["gbps"] / copy, 3)
    row["ours_gbps"], row["peer_gbps"] = row["gbps"], {"copy": row["copy_gbps"]}  # the results table's columns
    print(f"decode {row['case']}: {ms:.4f} ms replayed ({eager_ms:.4f} ms per eager call), {row['gbps']} GB/s "
          f"({row['fraction_of_copy']:.0%} of copy), {len(cases)} input sets", flush=True)
    del cases
    return row


def fp8_cache(dev, b: int, s_q: int, tokens: int, page: int, topk: int, g):
    """A MODEL1 FP8 cache of ``b`` requests x ``tokens`` tokens on shuffled pages, and each token's
    ``topk`` listed slots, distinct where the draw fits in 2^28 floats (common/kv_cache.py;
    FlashMLA's test builds them alike)."""
    from dsv4_attention.common import kv_cache

    pages = -(-tokens // page)
    table = torch.randperm(b * pages, generator=g).int().view(b, pages).to(dev)
    bf16 = (torch.randn(b * pages, page, 1, 512, generator=g) / 10).to(torch.bfloat16).to(dev)
    cache = kv_cache.quantize_kv_cache(bf16)
    del bf16
    if b * s_q * tokens <= 1 << 28:  # distinct slots a token (a top-k selector's lists)
        logical = torch.rand(b * s_q, tokens, device=dev).topk(topk, dim=1).indices.int().view(b, s_q, topk)
    else:  # a prefill chunk's lists: drawn with repeats (both kernels compute the same function on them)
        logical = torch.randint(0, tokens, (b, s_q, topk), device=dev, dtype=torch.int32)
    return cache, kv_cache.cache_indices(logical, table, page)


def fp8_decode_step(dev, config: int, b: int):
    """FlashMLA's MODEL1 CONFIG ``config`` decode step at batch ``b`` (fixed seed): (q, window cache,
    its lists, ``e_fused.decode``'s other arguments: the extra cache, its lists and lengths, the
    sink, FlashMLA's test's scale, the engine's unchecked lists)."""
    heads, s_q, w_tokens, w_topk, w_page, x_tokens, x_topk, x_page, x_len = FP8_CONFIGS[config]
    g = torch.Generator().manual_seed(config * 1000 + b)
    win, win_idx = fp8_cache(dev, b, s_q, w_tokens, w_page, w_topk, g)
    ext, ext_idx = fp8_cache(dev, b, s_q, x_tokens, x_page, x_topk, g)
    ext_len = torch.randint(0, x_topk + 1, (b,), generator=g).int().to(dev) if x_len else None
    q = (torch.randn(b, s_q, heads, 512, generator=g) / 2).to(torch.bfloat16).to(dev)
    sink = torch.randn(heads, generator=g).to(dev)
    kw = {"attn_sink": sink, "extra_k_cache": ext, "extra_indices": ext_idx, "extra_topk_length": ext_len,
          "softmax_scale": 512 ** -0.55, "check_indices": False}
    return q, win, win_idx, kw


def flashmla_decode(fm, q, win, win_idx, kw: dict):
    """FlashMLA's FP8 decode (the device pack's ``with_kvcache_sparse``, module ``fm``) on the
    arguments of ``e_fused.decode(q, win, win_idx, **kw)``, with a ``sched_meta`` of its own: the
    call to time beside ours (every optional argument of ``kw`` it lacks is FlashMLA's default)."""
    meta = fm.FlashMLASchedMeta()
    return lambda: fm.with_kvcache_sparse(q, win, win_idx, kw.get("topk_length"), kw.get("attn_sink"),
                                          kw.get("extra_k_cache"), kw.get("extra_indices"),
                                          kw.get("extra_topk_length"), softmax_scale=kw.get("softmax_scale"),
                                          sched_meta=meta)


def fp8_decode_row(dev, config: int, b: int, copy: float) -> dict:
    """FlashMLA's MODEL1 CONFIG ``config`` decode step at batch ``b``: our ``e_fused.decode`` and
    FlashMLA's ``flash_mla_with_kvcache`` (the device pack's ``with_kvcache_sparse``) on the same
    FP8 caches, both replayed from CUDA graphs (``graph_ms``; the same inputs each call, so the
    listed rows of a small batch stay in L2 for both alike). FLOPs as FlashMLA counts them (2 h
    (512 + 512) per attended key); bytes: the distinct listed tokens' 584 bytes, Q and O."""
    from dsv4_attention.stages import e_fused

    heads, s_q, w_tokens, w_topk, w_page, x_tokens, x_topk, x_page, x_len = FP8_CONFIGS[config]
    q, win, win_idx, kw = fp8_decode_step(dev, config, b)
    ext_idx, ext_len = kw["extra_indices"], kw["extra_topk_length"]
    attended = b * s_q * w_topk + (int(ext_len.sum()) * s_q if x_len else b * s_q * x_topk)
    flop = 2 * heads * attended * (512 + 512)
    distinct = sum(int(i[i >= 0].unique().numel()) for i in (win_idx, ext_idx))
    moved = distinct * 584 + 2 * b * s_q * heads * 512 * 2
    ours = lambda: e_fused.decode(q, win, win_idx, **kw)  # noqa: E731
    o, _ = ours()
    ms = graph_ms([ours])
    case = (f"fp8 decode flashmla MODEL1 CONFIG{config} b{b} h{heads} sq{s_q} top-{w_topk} (pages of {w_page}) + "
            f"extra top-{x_topk} (pages of {x_page}{', lengths' if x_len else ''}) hd512 sink")
    row = {"stage": "serving", "case": case, "head_dim": 512, "seqlen": w_tokens,
           "kind": "fp8 decode from paged caches (CUDA graph replay)", "ours_ms": round(ms, 4),
           "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {}, "peer_ms": {}, "time_ratio_vs": {},
           "gbps": round(moved / (ms * 1e-3) / 1e9), "copy_gbps": round(copy)}
    try:
        import flashmla_peer as fm  # pyright: ignore[reportMissingImports] (GPU peer)

        peer = flashmla_decode(fm, q, win, win_idx, kw)
        o_peer, _ = peer()
        row["max_abs_diff_vs_flashmla"] = float((o_peer.float() - o.float()).abs().max())
        add_peer(row, "flashmla", graph_ms([peer]), flop)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported
        print(f"peer flashmla failed: {type(e).__name__}: {e}"[:300], flush=True)
    print(f"decode {case}: ours {ms * 1e3:.1f} us ({row['ours_tflops']} TFLOP/s, {row['gbps']} GB/s), "
          f"flashmla {row['peer_ms'].get('flashmla')} ms, time ratio {row['time_ratio_vs'].get('flashmla')}, "
          f"max|diff| {row.get('max_abs_diff_vs_flashmla')}", flush=True)
    return row


def fp8_prefill_row(dev, heads: int, topk: int, tokens: int) -> dict:
    """A prefill chunk of ``tokens`` tokens reading a MODEL1 FP8 cache (pages of 64, 2 x tokens
    slots, each token's ``topk`` distinct listed slots): ours, ``index_attention`` over the pages
    (dequantized in the gather, no workspace), against the engines' path, the cache dequantized
    into a bf16 workspace (``kv_cache.dequantize_kv_cache``: torch, an upper bound on an engine's
    fused dequantize) then FlashMLA's bf16 sparse prefill on it. Each part timed alone (events,
    median); the ratio is end to end. FLOPs as FlashMLA counts them (4 tokens topk heads 512)."""
    from dsv4_attention.common import kv_cache
    from dsv4_attention.stages import e_fused

    g = torch.Generator().manual_seed(heads * 7 + tokens)
    page = 64
    cache, idx = fp8_cache(dev, 1, tokens, 2 * tokens, page, topk, g)
    idx = idx.view(tokens, 1, topk)
    q = (torch.randn(tokens, heads, 512, generator=g) / 2).to(torch.bfloat16).to(dev)
    sink = torch.randn(heads, generator=g).to(dev)
    scale = 512 ** -0.5
    flop = 4 * tokens * topk * heads * 512
    ours = lambda: e_fused.index_attention(q, cache, idx, attn_sink=sink, softmax_scale=scale,  # noqa: E731
                                           check_indices=False)
    o, _ = ours()
    ms = bench.time_ms([ours])
    row = {"stage": "serving", "case": f"fp8 prefill flashmla h{heads} top-{topk} tokens{tokens} pages of {page} "
                                      f"hd512 sink", "head_dim": 512, "seqlen": tokens,
           "kind": "fp8 prefill from a paged cache (eager, end to end)", "ours_ms": round(ms, 4),
           "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {}, "peer_ms": {}, "time_ratio_vs": {}}
    dequant = lambda: kv_cache.dequantize_kv_cache(cache)  # noqa: E731
    row["dequantize_ms"] = round(bench.time_ms([dequant]), 4)
    try:
        import flashmla_peer as fm  # pyright: ignore[reportMissingImports] (GPU peer)

        rows = kv_cache.cache_rows(dequant())
        attend = lambda: fm.sparse_prefill_fwd(q, rows, idx, scale, 512, sink, None)  # noqa: E731
        row["max_abs_diff_vs_flashmla"] = float((attend()[0].float() - o.float()).abs().max())
        row["flashmla_attention_ms"] = round(bench.time_ms([attend]), 4)
        add_peer(row, "flashmla", row["dequantize_ms"] + row["flashmla_attention_ms"], flop)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported
        print(f"peer flashmla failed: {type(e).__name__}: {e}"[:300], flush=True)
    print(f"prefill {row['case']}: ours {ms:.3f} ms, engines' path {row['peer_ms'].get('flashmla')} ms "
          f"(dequantize {row['dequantize_ms']}), ratio {row['time_ratio_vs'].get('flashmla')}", flush=True)
    return row
