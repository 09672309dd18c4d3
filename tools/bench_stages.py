"""Benchmarks of the stages (GPU only): each stage against its peers, measured in one process
(``python -m tools.bench --stage <id>``), and the row builders the other benchmark modules share
(``attention_row``, ``dsv4_layer``, ``graph_ms``, ``guarded``, ``add_peer``).

Stage A: S = scale * Q K^T in fp32 against torch.matmul (cuBLAS) of the same bf16 tensors, whose
output is bf16, i.e. half our output's bytes: at these sizes both are bound by writing S, so the
time ratio is dominated by that 2x.
"""

from __future__ import annotations

import torch

from dsv4_attention.common import bench
from dsv4_attention.common.testing import random_bshd


def bench_stage_a(dev) -> list:
    from dsv4_attention.stages import a_qk_gemm as stage

    rows = []
    b, h, sq, sk = 1, 16, 4096, 4096
    for d in stage.HEAD_DIMS:
        per_set = (b * sq * h * d + b * sk * d * h) * 2 + b * h * sq * sk * 4
        n = bench.rotation_count(per_set, maximum=4)
        sets = [(random_bshd(b, sq, h, d, torch.bfloat16, dev), random_bshd(b, sk, h, d, torch.bfloat16, dev))
                for _ in range(n)]
        outs = [torch.empty(b, h, sq, sk, dtype=torch.float32, device=dev) for _ in range(n)]
        ours = [lambda q=q, k=k, o=o: stage.forward(q, k, out=o) for (q, k), o in zip(sets, outs, strict=True)]
        del outs
        ms = bench.time_ms(ours)
        mm = bench.time_ms([bench.peer_matmul_qk(q, k) for q, k in sets])
        flop = stage.flops(b, sq, sk, h, d)
        in_bytes = (b * sq * h * d + b * sk * h * d) * 2
        ours_bytes, mm_bytes = in_bytes + b * h * sq * sk * 4, in_bytes + b * h * sq * sk * 2
        rows.append({
            "stage": "a", "case": f"b{b} h{h} sq{sq} sk{sk} hd{d} bf16",
            "ours_ms": round(ms, 4), "ours_tflops": round(bench.tflops(flop, ms), 1),
            "peers": {"matmul": round(bench.tflops(flop, mm), 1)},
            "peer_ms": {"matmul": round(mm, 4)},
            "time_ratio_vs": {"matmul": round(ms / mm, 3)},
            "ours_gbps": round(ours_bytes / (ms * 1e-3) / 1e9),
            "peer_gbps": {"matmul": round(mm_bytes / (mm * 1e-3) / 1e9)},
            "note": "S is fp32 here and bf16 from torch.matmul, so we write twice the bytes; both are bound "
                    "by writing S at these sizes: compare ours_gbps with peer_gbps",
        })
        print(f"stage a hd{d}: ours {ms:.3f} ms ({rows[-1]['ours_tflops']} TFLOP/s)  "
              f"matmul {mm:.3f} ms  ratio {ms / mm:.2f}x  "
              f"({rows[-1]['ours_gbps']} vs {rows[-1]['peer_gbps']['matmul']} GB/s)", flush=True)
        del sets, ours
        torch.cuda.empty_cache()
    return rows


def peer_unpacked(q, k, v):
    """Stage D2's kernel with pack_gqa=False: one query head per tile (stage D1's grid)."""
    from dsv4_attention.stages import d2_pack_heads

    return lambda: d2_pack_heads.forward(q, k, v, pack_gqa=False)


PEERS = {"fa4": bench.peer_fa4, "cudnn": bench.peer_cudnn, "sdpa_mem_efficient": bench.peer_sdpa_mem_efficient,
         "unpacked": peer_unpacked}


SLOW_PEERS = {"sdpa_mem_efficient"}  # timed with fewer iterations


def attention_row(stage, dev, b, h, sq, sk, d, *, kv_heads=None, kv_shared=False, peers=("fa4", "cudnn"),
                  extra=None, causal=False, window_size=None) -> dict:
    """One attention case: ours against ``peers`` on the same rotated tensors. ``kv_heads``
    (default h) KV heads; ``kv_shared``: one tensor as K and V (the stage's K = V path);
    ``causal`` / ``window_size`` (stage D4 on): passed to ours and to the peers that take them
    (cuDNN takes causal only), and the FLOPs count only the visible pairs."""
    masks = {}
    if causal:
        masks["causal"] = True
    if window_size is not None:
        masks["window_size"] = window_size
    hk = h if kv_heads is None else kv_heads
    per_set = 2 * (2 * b * sq * h * d + (1 if kv_shared else 2) * b * sk * hk * d)
    n = bench.rotation_count(per_set, maximum=8)
    sets = []
    for _ in range(n):
        q, k = random_bshd(b, sq, h, d, torch.bfloat16, dev), random_bshd(b, sk, hk, d, torch.bfloat16, dev)
        sets.append((q, k, k if kv_shared else random_bshd(b, sk, hk, d, torch.bfloat16, dev)))
    ms = bench.time_ms([lambda q=q, k=k, v=v: stage.forward(q, k, v, **masks) for q, k, v in sets])
    flop = stage.flops(b, sq, sk, h, d, **masks)
    tf, peer_ms = {}, {}
    for name in peers:
        try:
            slow = name in SLOW_PEERS
            kw = masks if name == "fa4" else {"causal": True} if causal and name == "cudnn" else {}
            t = bench.time_ms([PEERS[name](q, k, v, **kw) for q, k, v in sets], warmup=2 if slow else 5,
                              iters=10 if slow else 30)
            tf[name], peer_ms[name] = round(bench.tflops(flop, t), 1), round(t, 4)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported
            print(f"peer {name} failed: {type(e).__name__}: {e}"[:300], flush=True)
    kv = "" if kv_heads is None else f" hk{hk}"
    kv += (" causal" if causal else "") + (f" window{tuple(window_size)}" if window_size is not None else "")
    kind = {True: " k_eq_v", False: " k_ne_v"}[kv_shared] if stage.ID in ("d1", "d2", "d3", "d4", "d5") else ""
    row = {
        "stage": stage.ID, "case": f"b{b} h{h}{kv} sq{sq} sk{sk} hd{d}{kind} bf16", "head_dim": d, "seqlen": sk,
        "ours_ms": round(ms, 4), "ours_tflops": round(bench.tflops(flop, ms), 1),
        "peers": tf, "peer_ms": peer_ms,
        "time_ratio_vs": {k: round(ms / v, 3) for k, v in peer_ms.items()},
        **(extra or {}),
    }
    print(f"stage {stage.ID} {row['case']}: ours {ms:.3f} ms ({row['ours_tflops']} TFLOP/s)  peers {tf}",
          flush=True)
    del sets
    torch.cuda.empty_cache()
    return row


def bench_stage_b(dev) -> list:
    """One KV tile (seqlen_k = 128) against FlashAttention-4 and cuDNN on the same tensors."""
    from dsv4_attention.stages import b_p_onchip as stage

    return [attention_row(stage, dev, 4, 16, 8192, stage.KV_TILE, d) for d in stage.HEAD_DIMS]


def bench_stage_c(dev) -> list:
    """Non-causal, seqlen 1k-16k, 32k tokens x 16 heads per launch (fills the GPU)."""
    from dsv4_attention.stages import c_online_softmax as stage

    return [attention_row(stage, dev, max(1, 32768 // s), 16, s, s, d)
            for d in stage.HEAD_DIMS for s in (1024, 2048, 4096, 8192, 16384)]


def bench_stage_d1(dev) -> list:
    """DeepSeek-V4-Pro's prefill shape: head dim 512, K = V, MQA with 128 query heads, dense,
    seqlen 4k-16k, against torch's memory-efficient SDPA (the one SM90 peer at 512) and the
    bf16 matmul ceiling measured in the same run; K != V on the same shape (the cost of the
    K = V ring's exposed loads, docs/stages/d1_smem_p.md; the peer's time does not depend on
    K = V, so it is measured on the K = V rows only); and head dim 256 K = V MQA against
    FlashAttention-4 and cuDNN (their widest head dim)."""
    from dsv4_attention.stages import d1_smem_p as stage

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ceiling = bench.tflops(2 * 8192**3, bench.time_ms([lambda a=a: torch.matmul(a, a)], warmup=3, iters=10))
    del a
    print(f"matmul ceiling (bf16 8192^3): {ceiling:.0f} TFLOP/s", flush=True)
    rows = []
    cases = [(512, s, shared) for s in (4096, 8192, 16384) for shared in (True, False)] + [(256, 8192, True)]
    for d, s, shared in cases:
        peers = ("fa4", "cudnn") if d == 256 else ("sdpa_mem_efficient",) if shared else ()
        row = attention_row(stage, dev, 1, 128, s, s, d, kv_heads=1, kv_shared=shared, peers=peers,
                            extra={"kv": "k_eq_v" if shared else "k_ne_v", "matmul_ceiling_tflops": round(ceiling, 1)})
        row["fraction_of_ceiling"] = round(row["ours_tflops"] / ceiling, 3)
        rows.append(row)
    return rows


def bench_stage_d2(dev) -> list:
    """Heads packed into M. Decode (DeepSeek-V4: 128 heads on one latent KV head, hd 512, K = V,
    1-2 query tokens, 64 requests): bandwidth over the bytes that must move (K/V once, Q, O, LSE)
    against a device copy measured in the same run, and against the same kernel unpacked where
    that finishes in reasonable time. hd 128 / 256 MQA decode against FlashAttention-4 (which packs
    too). GQA prefill (hd 128, 32 heads on 4 KV heads): packed against unpacked, FA4 and cuDNN."""
    from dsv4_attention.stages import d2_pack_heads as stage

    copy = bench.copy_gbps(dev)
    print(f"device copy: {copy:.0f} GB/s (read + write)", flush=True)
    rows = []
    cases = [(512, sq, sk) for sq in (1, 2) for sk in (4096, 16384, 65536)] + [(256, 1, 16384), (128, 2, 16384)]
    for d, sq, sk in cases:
        b, h = 64, 128
        peers = ("fa4",) if d <= 256 else ("unpacked",) if sk <= 4096 else ()
        row = attention_row(stage, dev, b, h, sq, sk, d, kv_heads=1, kv_shared=d == 512, peers=peers,
                            extra={"kind": "decode", "copy_gbps": round(copy)})
        moved = (b * sk * d * (1 if d == 512 else 2) + 2 * b * sq * h * d) * 2 + b * h * sq * 4
        row["gbps"] = round(moved / (row["ours_ms"] * 1e-3) / 1e9)
        row["fraction_of_copy"] = round(row["gbps"] / copy, 3)
        rows.append(row)
    for s in (2048, 8192):
        rows.append(attention_row(stage, dev, max(1, 16384 // s), 32, s, s, 128, kv_heads=4,
                                  peers=("unpacked", "fa4", "cudnn"), extra={"kind": "gqa prefill"}))
    return rows


def bench_stage_d3(dev) -> list:
    """DeepSeek-V4 decode with per-request lengths: 64 requests x 2 tokens x 128 heads on one latent
    KV head (hd 512, K = V), each request using a random 50-100 % of a 16k / 64k KV buffer: bandwidth
    over the K/V rows actually read (seqused_k), Q, O and LSE, against a same-run device copy."""
    from dsv4_attention.stages import d3_lengths as stage

    copy = bench.copy_gbps(dev)
    rows = []
    for sk in (16384, 65536):
        b, h, sq, d = 64, 128, 2, 512
        g = torch.Generator().manual_seed(sk)
        n = torch.randint(sk // 2, sk + 1, (b,), generator=g, dtype=torch.int32).to(dev)
        q = random_bshd(b, sq, h, d, torch.bfloat16, dev)
        kv = random_bshd(b, sk, 1, d, torch.bfloat16, dev)
        ms = bench.time_ms([lambda q=q, kv=kv, n=n: stage.forward(q, kv, kv, seqused_k=n)])
        used = int(n.sum())
        moved = (used * d + 2 * b * sq * h * d) * 2 + b * h * sq * 4
        flop = 4 * sq * h * used * d
        row = {"stage": "d3", "case": f"b{b} h{h} hk1 sq{sq} seqused_k {sk // 2}-{sk} hd{d} k_eq_v bf16",
               "head_dim": d, "seqlen": sk, "kind": "decode", "ours_ms": round(ms, 4),
               "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {}, "peer_ms": {}, "time_ratio_vs": {},
               "gbps": round(moved / (ms * 1e-3) / 1e9), "copy_gbps": round(copy)}
        row["fraction_of_copy"] = round(row["gbps"] / copy, 3)
        print(f"stage d3 {row['case']}: {ms:.3f} ms {row['ours_tflops']} TFLOP/s {row['gbps']} GB/s "
              f"({row['fraction_of_copy']:.0%} of copy)", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def bench_stage_d4(dev) -> list:
    """Causal prefill (MHA hd 64/128/256, GQA hd 128) against FlashAttention-4 and cuDNN, and
    DeepSeek-V4's window branch (128 heads on one KV head, causal window (127, 0), K = V) at hd 256
    (FA4 runs it) and hd 512 (it does not): TFLOP/s over the visible keys and the bandwidth of
    Q, K/V (once), O and LSE against a same-run device copy."""
    from dsv4_attention.stages import d4_causal_window as stage

    copy = bench.copy_gbps(dev)
    print(f"device copy: {copy:.0f} GB/s (read + write)", flush=True)
    rows = []
    for d in (64, 128, 256):
        for s in (1024, 4096, 16384):
            rows.append(attention_row(stage, dev, max(1, 32768 // s), 16, s, s, d, causal=True,
                                      extra={"kind": "causal prefill"}))
    rows.append(attention_row(stage, dev, 2, 32, 8192, 8192, 128, kv_heads=4, causal=True,
                              extra={"kind": "causal prefill gqa"}))
    for d in (256, 512):
        for s in (8192, 32768):
            row = attention_row(stage, dev, 1, 128, s, s, d, kv_heads=1, kv_shared=True, causal=True,
                                window_size=(127, 0), peers=("fa4",) if d <= 256 else (),
                                extra={"kind": "window branch", "copy_gbps": round(copy)})
            moved = (2 * s * 128 * d + s * d) * 2 + 128 * s * 4
            row["gbps"] = round(moved / (row["ours_ms"] * 1e-3) / 1e9)
            row["fraction_of_copy"] = round(row["gbps"] / copy, 3)
            if "fa4" in row["peer_ms"]:
                row["fa4_fraction_of_copy"] = round(moved / (row["peer_ms"]["fa4"] * 1e-3) / 1e9 / copy, 3)
            print(f"  window branch hd{d} s{s}: {row['gbps']} GB/s = {row['fraction_of_copy']:.0%} of copy", flush=True)
            rows.append(row)
    for d, h, hk in ((128, 32, 4), (128, 16, 16), (64, 16, 16)):
        rows.append(varlen_row(stage, dev, d, h, hk))
    return rows


def bench_stage_d5(dev) -> list:
    """DeepSeek-V4's window branch (128 heads on one K = V head, hd 512, causal window (127, 0))
    with its attention sink against the same call without one (stage D4, same run): what the
    sink's epilogue costs; and the torch merge of two such results (the unfused branch merge)."""
    rows = [sink_row(dev, s) for s in (8192, 32768)]
    torch.cuda.empty_cache()
    return rows


def sink_row(dev, s: int) -> dict:
    from dsv4_attention.stages import d4_causal_window, d5_sink_merge

    q = random_bshd(1, s, 128, 512, torch.bfloat16, dev)
    kv = random_bshd(1, s, 1, 512, torch.bfloat16, dev)
    sink = torch.randn(128, device=dev)
    kw = {"causal": True, "window_size": (127, 0)}
    ms = bench.time_ms([lambda: d5_sink_merge.forward(q, kv, kv, learnable_sink=sink, **kw)])
    ms_d4 = bench.time_ms([lambda: d4_causal_window.forward(q, kv, kv, **kw)])
    o, lse = d5_sink_merge.forward(q, kv, kv, **kw)
    ms_merge = bench.time_ms([lambda: d5_sink_merge.merge_attention(o, lse, o, lse)])
    flop = d5_sink_merge.flops(1, s, s, 128, 512, True, (127, 0))
    row = {"stage": "d5", "case": f"b1 h128 hk1 causal window(127, 0) sq{s} sk{s} hd512 k_eq_v sink bf16",
           "head_dim": 512, "seqlen": s, "kind": "window branch + sink", "ours_ms": round(ms, 4),
           "ours_tflops": round(bench.tflops(flop, ms), 1),
           "peers": {"d4_no_sink": round(bench.tflops(flop, ms_d4), 1)}, "peer_ms": {"d4_no_sink": round(ms_d4, 4)},
           "time_ratio_vs": {"d4_no_sink": round(ms / ms_d4, 3)}, "torch_merge_ms": round(ms_merge, 4)}
    print(f"stage d5 {row['case']}: {ms:.3f} ms vs D4 {ms_d4:.3f} ms; torch merge {ms_merge:.3f} ms", flush=True)
    return row


def bench_stage_e(dev) -> list:
    """DeepSeek-V4's HCA and CSA layers in one launch (stage E: window (127, 0) + the compressed
    entries, all of them at ratio 128 or each token's top-k at ratio 4, + sink; 128 heads on one
    K = V head, hd 512) against the window branch alone (stage D5, same run): what the compressed
    entries cost inside the one softmax. No public Hopper kernel computes these (window +
    compressed) functions; the index mode, FlashMLA's sparse prefill's function, runs against
    FlashMLA itself (``index_row``)."""
    rows = [fused_row(dev, s) for s in (8192, 32768)]
    rows += [topk_row(dev, s, k) for s in (8192, 32768) for k in (512, 1024)]
    for h, k in ((64, 512), (128, 1024)):
        for s_kv in (8192, 32768):
            rows.append(index_row(dev, h, k, s_kv))
            torch.cuda.empty_cache()
    for topk in (None, 512):
        for s in (8192, 32768):
            rows += guarded(unfused_row, dev, s, topk)
    return rows


def guarded(make_row, *args) -> list:
    """[make_row(*args)], or [] with the error printed: a case that fails leaves the others standing."""
    try:
        return [make_row(*args)]
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
        print(f"{make_row.__name__}{args[1:]} failed: {type(e).__name__}: {e}"[:400], flush=True)
        return []


def dsv4_layer(dev, b: int, sq: int, sk: int, topk: int | None, seed: int = 0) -> dict:
    """DeepSeek-V4's attention inputs: 128 heads on one K = V head of hd 512, window (127, 0), a
    sink, and compressed entries: all visible ones at ratio 128 (HCA, ``topk`` None) or ``topk``
    distinct visible entries per token at ratio 4 (CSA; -1 past a token's count). Query i sits at
    position sk - sq + i (bottom-right aligned)."""
    torch.manual_seed(seed)
    ratio = 128 if topk is None else 4
    n_c = sk // ratio
    def rnd(*shape):  # drawn on the device: a 64 x 64k x 512 KV buffer would take seconds on the host
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16)

    case = {"q": rnd(b, sq, 128, 512), "kv": rnd(b, sk, 1, 512), "compressed_kv": rnd(b, n_c, 1, 512),
            "compress_ratio": ratio,
            "learnable_sink": torch.randn(128, device=dev), "topk_indices": None}
    count = ((torch.arange(sk - sq, sk, device=dev) + 1) // ratio).clamp(max=n_c)  # visible entries per token
    if topk is not None:
        # as an indexer picks them: the k best of random scores over the token's visible entries,
        # so min(k, count) distinct visible entries, then -1
        visible = torch.arange(n_c, device=dev)[None, None] < count[None, :, None]
        score = torch.rand(b, sq, n_c, device=dev).masked_fill(~visible, -1.0)
        best = score.topk(min(topk, n_c), dim=-1).indices
        best = torch.where(best < count[None, :, None], best, -1).sort(-1, descending=True).values
        case["topk_indices"] = torch.nn.functional.pad(best, (0, topk - best.shape[-1]), value=-1).int().contiguous()
    case["count"] = count
    return case


def unfused_row(dev, s: int, topk: int | None) -> dict:
    """The fused launch against the unfused path built from this library's own pieces: the window
    branch (stage D4), the compressed branch (index mode over the compressed rows: each token's
    visible entries, or its top-k list), ``merge_attention`` and the sink applied in torch. The
    two outputs are compared (max |diff|), so the rows measure the same function."""
    from dsv4_attention.common.merge import merge_attention, sink_scale
    from dsv4_attention.stages import d4_causal_window, e_fused

    c = dsv4_layer(dev, 1, s, s, topk)
    q, kv, ckv, sink = c["q"], c["kv"], c["compressed_kv"], c["learnable_sink"]
    n_c = ckv.shape[1]
    if topk is None:
        ar = torch.arange(n_c, device=dev, dtype=torch.int32)
        idx = torch.where(ar[None] < c["count"][:, None], ar[None], -1)
    else:
        idx = c["topk_indices"][0]
    idx = idx[:, None].contiguous()
    kw = {"causal": True, "window_size": (127, 0)}

    def unfused():
        o1, lse1 = d4_causal_window.forward(q, kv, kv, **kw)
        o2, lse2 = e_fused.index_attention(q[0], ckv[0], idx)
        o, lse = merge_attention(o1, lse1, o2[None], lse2.t()[None])
        scale = sink_scale(lse, sink[None, :, None]).transpose(1, 2)[..., None]  # [b, s, h, 1]
        return (o.float() * scale).to(q.dtype)

    def fused():
        return e_fused.forward(q, kv, compressed_kv=ckv, compress_ratio=c["compress_ratio"],
                               topk_indices=c["topk_indices"], learnable_sink=sink, **kw)[0]

    diff = float((unfused().float() - fused().float()).abs().max())
    ms = bench.time_ms([fused])
    ms_u = bench.time_ms([unfused])
    flop = e_fused.flops(1, s, s, 128, 512, True, (127, 0), c["compress_ratio"], n_c, topk=topk)
    what = f"top-{topk} of {n_c} (ratio 4)" if topk else f"{n_c} entries (ratio 128)"
    row = {"stage": "e", "case": f"b1 h128 hk1 window(127, 0) + {what} sq{s} hd512 k_eq_v sink bf16, fused vs unfused",
           "head_dim": 512, "seqlen": s, "kind": "fused vs unfused (D4 window + index-mode compressed + torch merge)",
           "ours_ms": round(ms, 4), "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {}, "peer_ms": {},
           "time_ratio_vs": {}, "max_abs_vs_unfused": diff}
    add_peer(row, "unfused", ms_u, flop)
    print(f"stage e {row['case']}: fused {ms:.3f} ms, unfused {ms_u:.3f} ms ({ms_u / ms:.2f}x), max|diff| {diff:.4g}",
          flush=True)
    return row


def graph_ms(calls: list, per_graph: int = 16) -> float:
    """Median milliseconds of one call replayed from a CUDA graph, the way a decode engine runs it.
    ``per_graph`` calls, cycling through ``calls`` (one per rotated input set, so L2 does not carry
    one call's rows into the next), are captured in one graph: the replay's own launch cost is
    spread over them, and the library's host work (validation, argument packing) is not in it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()  # compiled and warm: the capture records launches only
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    ms = bench.time_ms([graph.replay], warmup=2, iters=15) / per_graph
    del graph
    return ms


def replayed_ms(calls: dict, what: str) -> dict:
    """{name: ms of one call replayed from a CUDA graph (4 a graph)} for each named call, beside a
    row's eager times; a call that cannot be captured is reported and left out."""
    out = {}
    for name, call in calls.items():
        try:
            out[name] = round(graph_ms([call], per_graph=4), 4)
        except Exception as e:  # noqa: BLE001 - reported; the eager row stands
            print(f"graph replay of {name} {what} failed: {type(e).__name__}: {e}"[:300], flush=True)
    return out


def index_inputs(dev, heads: int, k: int, s_kv: int, s_q: int) -> tuple:
    """Index mode's inputs as FlashMLA's sparse prefill takes them: q [s_q, heads, 512], kv [s_kv,
    1, 512] (K = V), indices [s_q, 1, k] (k distinct random rows per token), a sink, the scale."""
    q = random_bshd(1, s_q, heads, 512, torch.bfloat16, dev)[0]
    kv = random_bshd(1, s_kv, 1, 512, torch.bfloat16, dev)[0]
    idx = torch.rand(s_q, s_kv, device=dev).topk(k, dim=1).indices.int()[:, None].contiguous()  # distinct rows
    return q, kv, idx, torch.randn(heads, device=dev), 512 ** -0.5


def index_row(dev, heads: int, k: int, s_kv: int, s_q: int = 4096) -> dict:
    """Index mode against FlashMLA's sparse prefill (``flashmla_peer``, DeepSeek's kernel for this
    attention) on the same tensors: q [s_q, heads, 512], kv [s_kv, 1, 512] (K = V, FlashMLA's d_qk =
    512 build), k distinct random rows per token, a sink; FLOPs as FlashMLA counts them (4 s_q k
    heads 512). The two outputs are compared (max |difference|) so the ratio is between two
    kernels that compute the same thing."""
    from dsv4_attention.stages import e_fused

    q, kv, idx, sink, scale = index_inputs(dev, heads, k, s_kv, s_q)
    o = torch.empty_like(q)
    calls = {"ours": lambda: e_fused.index_attention(q, kv, idx, attn_sink=sink, softmax_scale=scale, out=o)}
    ms = bench.time_ms([calls["ours"]])
    # an engine's own lists (check_indices=False): no host read of the indices, no synchronisation
    unchecked_ms = bench.time_ms([lambda: e_fused.index_attention(q, kv, idx, attn_sink=sink, softmax_scale=scale,
                                                                  out=o, check_indices=False)])
    flop = 4 * s_q * k * heads * 512
    row = {"stage": "e", "case": f"index mode h{heads} top-{k} sq{s_q} s_kv{s_kv} hd512 k_eq_v sink bf16",
           "head_dim": 512, "seqlen": s_kv, "kind": "index mode (FlashMLA sparse prefill's function)",
           "ours_ms": round(ms, 4), "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {}, "peer_ms": {},
           "time_ratio_vs": {}, "unchecked_ms": round(unchecked_ms, 4), "unchecked_ratio_vs": {}}
    try:
        import flashmla_peer  # pyright: ignore[reportMissingImports] (GPU peer)

        call = lambda: flashmla_peer.sparse_prefill_fwd(q, kv, idx, scale, 512, sink, None)  # noqa: E731
        o_peer = call()[0]
        row["max_abs_diff_vs_flashmla"] = float((o_peer.float() - o.float()).abs().max())
        add_peer(row, "flashmla", bench.time_ms([call]), flop)
        row["unchecked_ratio_vs"]["flashmla"] = round(unchecked_ms / row["peer_ms"]["flashmla"], 3)
        calls["flashmla"] = call
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported
        print(f"peer flashmla failed: {type(e).__name__}: {e}"[:300], flush=True)
    # The eager times bracket each call's host work: ours checks the indices' bounds with a read-back
    # (a synchronisation that leaves the GPU idle while the host packs the launch), FlashMLA's call
    # checks nothing, nor does ours with check_indices=False (``unchecked_ms``). Replayed from CUDA
    # graphs (the value checks are skipped under capture) the two kernels are timed alone.
    row["graph_ms"] = replayed_ms(calls, "index mode")
    print(f"stage e {row['case']}: ours {ms:.3f} ms ({row['ours_tflops']} TFLOP/s), unchecked {unchecked_ms:.3f} ms  "
          f"peers {row['peers']} "
          f"max|diff| {row.get('max_abs_diff_vs_flashmla')}  graph-replayed ms {row['graph_ms']}", flush=True)
    return row


def topk_row(dev, s: int, k: int) -> dict:
    """DeepSeek-V4's CSA layer: window (127, 0) + k listed entries per token (ratio 4, distinct
    entries the token sees, -1 padded: ``dsv4_layer``), gathered in the kernel; FLOPs count every
    listed position."""
    from dsv4_attention.stages import d5_sink_merge, e_fused

    c = dsv4_layer(dev, 1, s, s, k)
    q, kv, ckv, ratio = c["q"], c["kv"], c["compressed_kv"], c["compress_ratio"]
    kw = {"causal": True, "window_size": (127, 0), "learnable_sink": c["learnable_sink"]}
    ms = bench.time_ms([lambda: e_fused.forward(q, kv, compressed_kv=ckv, compress_ratio=ratio,
                                                topk_indices=c["topk_indices"], **kw)])
    ms_w = bench.time_ms([lambda: d5_sink_merge.forward(q, kv, kv, **kw)])
    flop = e_fused.flops(1, s, s, 128, 512, True, (127, 0), ratio, ckv.shape[1], topk=k)
    row = {"stage": "e", "case": f"b1 h128 hk1 window(127, 0) + top-{k} of {ckv.shape[1]} entries (ratio {ratio}) "
           f"sq{s} hd512 k_eq_v sink bf16", "head_dim": 512, "seqlen": s, "kind": "fused window + top-k (CSA)",
           "ours_ms": round(ms, 4), "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {},
           "peer_ms": {"d5_window_only": round(ms_w, 4)}, "time_ratio_vs": {"d5_window_only": round(ms / ms_w, 3)}}
    print(f"stage e {row['case']}: {ms:.3f} ms ({row['ours_tflops']} TFLOP/s)", flush=True)
    return row


def fused_row(dev, s: int) -> dict:
    """DeepSeek-V4's HCA layer: window (127, 0) + every visible entry at ratio 128 (``dsv4_layer``)."""
    from dsv4_attention.stages import d5_sink_merge, e_fused

    c = dsv4_layer(dev, 1, s, s, None)
    q, kv, ckv, ratio = c["q"], c["kv"], c["compressed_kv"], c["compress_ratio"]
    kw = {"causal": True, "window_size": (127, 0), "learnable_sink": c["learnable_sink"]}
    ms = bench.time_ms([lambda: e_fused.forward(q, kv, compressed_kv=ckv, compress_ratio=ratio, **kw)])
    ms_w = bench.time_ms([lambda: d5_sink_merge.forward(q, kv, kv, **kw)])
    flop = e_fused.flops(1, s, s, 128, 512, True, (127, 0), ratio, ckv.shape[1])
    flop_w = d5_sink_merge.flops(1, s, s, 128, 512, True, (127, 0))
    row = {"stage": "e", "case": f"b1 h128 hk1 window(127, 0) + {ckv.shape[1]} entries (ratio {ratio}) sq{s} hd512 "
           f"k_eq_v sink bf16", "head_dim": 512, "seqlen": s, "kind": "fused window + compressed (HCA)",
           "ours_ms": round(ms, 4), "ours_tflops": round(bench.tflops(flop, ms), 1),
           "peers": {"d5_window_only": round(bench.tflops(flop_w, ms_w), 1)},
           "peer_ms": {"d5_window_only": round(ms_w, 4)}, "time_ratio_vs": {"d5_window_only": round(ms / ms_w, 3)}}
    print(f"stage e {row['case']}: {ms:.3f} ms ({row['ours_tflops']} TFLOP/s) vs window only {ms_w:.3f} ms",
          flush=True)
    return row


def add_peer(row: dict, name: str, peer_ms: float, flop: int) -> None:
    """A peer measured on the row's case: its TFLOP/s, ms and our time over its."""
    row["peers"][name], row["peer_ms"][name] = round(bench.tflops(flop, peer_ms), 1), round(peer_ms, 4)
    row["time_ratio_vs"][name] = round(row["ours_ms"] / row["peer_ms"][name], 3)


def varlen_row(stage, dev, d, h, hk, requests=16, seed=0) -> dict:
    """A causal prefill batch of ``requests`` uneven requests (256-4096 tokens each, random with a
    fixed seed) as one variable-length call, ours against FlashAttention-4's varlen call on the
    same tensors; FLOPs over each request's visible (causal) pairs."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(256, 4097, (requests,), generator=g).tolist()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    total, longest = sum(lens), max(lens)
    q = random_bshd(1, total, h, d, torch.bfloat16, dev)[0]
    k, v = (random_bshd(1, total, hk, d, torch.bfloat16, dev)[0] for _ in range(2))
    kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest, "max_seqlen_k": longest, "causal": True}
    ms = bench.time_ms([lambda: stage.forward(q, k, v, **kw)])
    flop = sum(stage.flops(1, n, n, h, d, causal=True) for n in lens)
    row = {"stage": stage.ID, "case": f"varlen {requests} requests 256-4096 (total {total}) h{h} hk{hk} causal hd{d} "
           f"k_ne_v bf16", "head_dim": d, "kind": "varlen causal prefill", "ours_ms": round(ms, 4),
           "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": {}, "peer_ms": {}, "time_ratio_vs": {}}
    calls = {"ours": lambda: stage.forward(q, k, v, **kw)}
    try:
        from flash_attn.cute import flash_attn_varlen_func  # pyright: ignore[reportMissingImports] (GPU peer)

        calls["fa4"] = lambda: flash_attn_varlen_func(q, k, v, **kw)
        add_peer(row, "fa4", bench.time_ms([calls["fa4"]]), flop)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported
        print(f"peer fa4 varlen failed: {type(e).__name__}: {e}"[:300], flush=True)
    # The eager times above bracket each call's host work; ours validates the offsets with a read-back
    # (a synchronisation, which exposes the host time after it), FlashAttention-4 does not. Replayed
    # from CUDA graphs (max_seqlen given, so both capture) the two kernels are timed alone.
    row["graph_ms"] = replayed_ms(calls, "varlen")
    print(f"stage {stage.ID} {row['case']}: ours {ms:.3f} ms ({row['ours_tflops']} TFLOP/s)  peers {row['peers']}  "
          f"graph-replayed ms {row['graph_ms']}", flush=True)
    return row
