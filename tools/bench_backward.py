"""Stage F's benchmark (group f): the backward against FlashAttention-4's on the same tensors.

Dense attention, bf16, 16k tokens x 16 heads per launch (batch = 16384 / seqlen; 32 heads at hd 64),
head dims 64 / 128, causal and not, seqlen 2k-16k. Timed: the whole backward call each library
makes for one loss.backward() (ours: D and the LSE padding, the kernel, dQ's rounding; FA4's:
its preprocess, kernel and postprocess), given the forward's O and LSE; median of CUDA events
over rotated input sets. FLOPs: 2.5x the forward's over the visible pairs (FlashAttention's count).
Two rows in deterministic mode (``deterministic=True`` for both libraries: dQ summed in a fixed
order), hd 128 causal at 4k and 16k: what bitwise repeatability costs. Head dim 256 through
stages/f_backward/sm90_wide.py (64-key tiles, dK and dV split by columns), 16 heads.

DeepSeek-V4's backwards (stages/f_backward/index.py, fused.py): index mode (V4-Flash: 64 heads,
top-640; V4-Pro: 128 heads, top-1152; d 512, 4k-32k tokens: the kernel at every size, its
torch-composed form at 4k and 8k) against cuDNN-frontend's CuTe DSL sparse backward
(``sparse_attention_backward_wrapper``, the device pack's peer; FLOPs as its benchmark counts them:
2 T H K (3 x 512 + 2 x 512)), and the HCA layer (window 128, every visible entry at ratio 128, the
sink; 64 heads, d 512; 4k-32k tokens, the torch form at 4k and 8k), whose kernel form (index mode on
every query's list, ``fused.layer_as_lists``) is timed against cuDNN's sparse backward on the same
pool and lists. Index mode's whole training step (forward + backward) against FlashMLA's sparse
prefill then cuDNN's backward (the pairing Megatron-LM uses), 4k and 8k tokens. Ours timed over 5
calls after one warm-up (the torch forms are slow).
"""

from __future__ import annotations

import torch

from dsv4_attention.common import bench
from dsv4_attention.common.testing import random_bshd


def fa4_backward(q, k, v, do, causal, deterministic=False):
    """FA4's backward alone: its forward once (outside the timing), then torch.autograd.grad of
    its output, which runs exactly FA4's backward kernels."""
    from flash_attn.cute import flash_attn_func  # pyright: ignore[reportMissingImports] (GPU peer)

    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    extra = {"deterministic": True} if deterministic else {}
    r = flash_attn_func(qq, kk, vv, causal=causal, **extra)
    o = r[0] if isinstance(r, tuple) else r
    return lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)


def time_peer(name: str, calls, flop: int, tf: dict, peer_ms: dict) -> None:
    """A peer's median time over ``calls()`` (its callables; built inside, so that a peer missing
    or refusing the case is reported, not raised) into ``tf`` (TFLOP/s) and ``peer_ms``."""
    try:
        t = bench.time_ms(calls())
        tf[name], peer_ms[name] = round(bench.tflops(flop, t), 1), round(t, 4)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported
        print(f"peer {name} failed: {type(e).__name__}: {e}"[:300], flush=True)


def _dense_sets(dev, b, h, s, d, causal) -> list:
    """Rotated input sets (q, k, v, o, lse, do) of a dense row, O and LSE from stage E's forward."""
    from dsv4_attention.stages import e_fused

    per_set = 2 * 4 * b * s * h * d
    sets = []
    for _ in range(bench.rotation_count(per_set, maximum=6)):
        q, k, v, do = (random_bshd(b, s, h, d, torch.bfloat16, dev) for _ in range(4))
        with torch.no_grad():
            o, lse = e_fused.forward(q, k, v, causal=causal)
        sets.append((q, k, v, o, lse, do))
    return sets


def backward_row(dev, b, h, s, d, causal, peers=("fa4",), deterministic=False) -> dict:
    from dsv4_attention.stages import f_backward as stage

    sets = _dense_sets(dev, b, h, s, d, causal)
    ms = bench.time_ms([lambda a=a: stage.backward(*a, causal=causal, deterministic=deterministic) for a in sets])
    flop = stage.flops(b, s, s, h, d, causal=causal)
    tf, peer_ms = {}, {}
    for name in peers:
        time_peer(name, lambda: [fa4_backward(q, k, v, do, causal, deterministic) for q, k, v, _, _, do in sets],
                  flop, tf, peer_ms)
    row = {
        "stage": stage.ID, "case": f"bwd b{b} h{h} sq{s} sk{s} hd{d}{' causal' if causal else ''} bf16"
                                   f"{' deterministic' if deterministic else ''}",
        "head_dim": d, "seqlen": s, "ours_ms": round(ms, 4), "ours_tflops": round(bench.tflops(flop, ms), 1),
        "peers": tf, "peer_ms": peer_ms, "time_ratio_vs": {k: round(ms / v, 3) for k, v in peer_ms.items()},
    }
    print(f"stage f {row['case']}: ours {ms:.3f} ms ({row['ours_tflops']} TFLOP/s)  peers {tf}", flush=True)
    return row


def bench_stage_f(dev) -> list:
    """hd 64 / 128 / 256, causal and not, seqlen 2k-16k (the issue's range), against FA4's backward;
    DeepSeek-V4's index mode and HCA layer at 4k-32k tokens
    against cuDNN's sparse backward (their torch forms at 4k and 8k only); index mode's training
    step (forward + backward) against FlashMLA's forward + cuDNN's backward at 4k and 8k."""
    rows = []
    for d in (64, 128, 256):
        for causal in (False, True):
            for s in (2048, 4096, 8192, 16384):
                h = 32 if d == 64 else 16
                rows.append(backward_row(dev, max(1, 16384 // s), h, s, d, causal))
    for s in (4096, 16384):
        rows.append(backward_row(dev, 16384 // s, 16, s, 128, True, deterministic=True))
    for tokens in (4096, 8192, 16384, 32768):
        torch_form = tokens <= 8192  # the torch forms' time and memory grow past the group's budget
        for heads, topk in ((64, 640), (128, 1152)):
            rows.append(index_backward_row(dev, tokens, heads, topk))
            if torch_form:
                rows.append(index_backward_row(dev, tokens, heads, topk, torch_form=True))
        rows.append(hca_backward_row(dev, tokens))
        if torch_form:
            rows.append(hca_backward_row(dev, tokens, torch_form=True))
    for tokens in (4096, 8192):
        for heads, topk in ((64, 640), (128, 1152)):
            rows.append(index_step_row(dev, tokens, heads, topk))
    return rows


def _index_tensors(dev, tokens, heads, topk) -> tuple:
    """Index mode's inputs (q [tokens, heads, 512], kv [tokens, 1, 512] K = V, lists [tokens, 1,
    topk] of random rows, the sink, dO), seeded by the case."""
    g = torch.Generator(device=dev).manual_seed(tokens + heads)
    q = (torch.randn(tokens, heads, 512, device=dev, generator=g) / 4).bfloat16()
    kv = (torch.randn(tokens, 1, 512, device=dev, generator=g) / 4).bfloat16()
    idx = torch.randint(0, tokens, (tokens, 1, topk), device=dev, generator=g, dtype=torch.int32)
    sink = torch.randn(heads, device=dev, generator=g)
    do = torch.randn(tokens, heads, 512, device=dev, generator=g).bfloat16()
    return q, kv, idx, sink, do


def index_backward_row(dev, tokens, heads, topk, torch_form: bool = False) -> dict:
    """Index mode's backward (ours: ``index_backward``, its kernel on Hopper; ``torch_form``: the
    torch-composed ``index_backward_torch``) against cuDNN's sparse backward on the same q, kv,
    lists, O and LSE (timing only: the two take the forward's LSE in their own conventions)."""
    from dsv4_attention.stages import e_fused
    from dsv4_attention.stages import f_backward as stage
    from dsv4_attention.stages.f_backward.index import index_backward_torch

    q, kv, idx, sink, do = _index_tensors(dev, tokens, heads, topk)
    with torch.no_grad():
        o, lse = e_fused.index_attention(q, kv, idx, attn_sink=sink)
    ours = index_backward_torch if torch_form else stage.index_backward
    ms = bench.time_ms([lambda: ours(q, kv, idx, o, lse, do, attn_sink=sink)], warmup=1, iters=5)
    flop = 2 * tokens * heads * topk * (3 * 512 + 2 * 512)
    tf, peer_ms = {}, {}
    time_peer("cudnn_dsa", lambda: [_cudnn_backward(q, kv, o, do, lse, sink, idx[:, 0])], flop, tf, peer_ms)
    form = "torch-composed" if torch_form else "kernel"
    return _v4_row(f"bwd index {form} tokens{tokens} h{heads} topk{topk} hd512 bf16", ms, flop, tf, peer_ms)


def hca_backward_row(dev, tokens, heads=64, torch_form: bool = False) -> dict:
    """DeepSeek-V4's HCA layer's backward (ours: ``fused_backward``, on Hopper through index mode's
    kernel on every query's list; ``torch_form``: the torch-composed ``fused_backward_torch``):
    window 128, every visible entry at ratio 128, the sink. No peer computes the layer; the kernel
    form's row has cuDNN's sparse backward on the same pool and lists (``layer_as_lists``: -1 where
    a query sees fewer keys), O and LSE in index mode's shapes (timing only: ours builds its lists
    in each call, the peer is given them)."""
    from dsv4_attention.stages import e_fused
    from dsv4_attention.stages import f_backward as stage
    from dsv4_attention.stages.f_backward.fused import fused_backward_torch, layer_as_lists

    g = torch.Generator(device=dev).manual_seed(tokens)
    q = (torch.randn(1, tokens, heads, 512, device=dev, generator=g) / 4).bfloat16()
    kv = (torch.randn(1, tokens, 1, 512, device=dev, generator=g) / 4).bfloat16()
    ckv = (torch.randn(1, tokens // 128, 1, 512, device=dev, generator=g) / 4).bfloat16()
    sink = torch.randn(heads, device=dev, generator=g)
    do = torch.randn(1, tokens, heads, 512, device=dev, generator=g).bfloat16()
    opts = dict(compressed_kv=ckv, compress_ratio=128, causal=True, window_size=(127, 0), learnable_sink=sink)
    with torch.no_grad():
        o, lse = e_fused.forward(q, kv, **opts)
    ours = fused_backward_torch if torch_form else stage.fused_backward
    ms = bench.time_ms([lambda: ours(q, kv, kv, o, lse, do, **opts)], warmup=1, iters=5)
    t = torch.arange(tokens, dtype=torch.float64)
    pairs = float((torch.clamp(t + 1, max=128) + torch.floor((t + 1) / 128)).sum())
    flop = int(10 * heads * 512 * pairs)
    tf, peer_ms = {}, {}
    if not torch_form:
        def peer_calls():
            made = layer_as_lists(q, kv, kv, ckv, 128, None, True, (127, 0))
            if made is None:
                raise ValueError("layer_as_lists: index mode's kernel does not serve this layer here")
            pool, lists = made  # lists [tokens, 1, n] int32, -1 for none
            flat = [x.reshape(tokens, heads, 512) for x in (q, o, do)]
            lse_flat = lse.permute(0, 2, 1).reshape(tokens, heads)  # [1, h, s] -> [tokens, h]
            return [_cudnn_backward(flat[0], pool, flat[1], flat[2], lse_flat, sink, lists[:, 0])]

        time_peer("cudnn_dsa", peer_calls, flop, tf, peer_ms)
    form = "torch-composed" if torch_form else "kernel-lists"
    return _v4_row(f"bwd v4 hca {form} tokens{tokens} h{heads} hd512 window128 ratio128 bf16", ms, flop, tf,
                   peer_ms)


def index_step_row(dev, tokens, heads, topk) -> dict:
    """Index mode's whole training step (forward + backward: ``index_attention`` then
    ``index_backward`` on its O and LSE) against FlashMLA's sparse prefill then cuDNN's sparse
    backward on FlashMLA's O and LSE (the pairing Megatron-LM uses), same q, kv, lists, sink and dO
    (timing only: no gradient is compared). FLOPs: FlashMLA's forward count plus cuDNN's backward
    count, 2 T H K (512 + 512) + 2 T H K (3 x 512 + 2 x 512)."""
    from dsv4_attention.stages import e_fused
    from dsv4_attention.stages import f_backward as stage

    q, kv, idx, sink, do = _index_tensors(dev, tokens, heads, topk)

    def ours():
        o, lse = e_fused.index_attention(q, kv, idx, attn_sink=sink)
        return stage.index_backward(q, kv, idx, o, lse, do, attn_sink=sink)

    with torch.no_grad():
        ms = bench.time_ms([ours], warmup=1, iters=5)
    flop = 2 * tokens * heads * topk * (512 + 512) + 2 * tokens * heads * topk * (3 * 512 + 2 * 512)
    tf, peer_ms = {}, {}

    def peer_calls():
        import flashmla_peer  # pyright: ignore[reportMissingImports] (GPU peer)

        rows = idx[:, 0].contiguous()

        def peer():
            # FlashMLA's (O, max logits, LSE [tokens, heads]: natural log, without the sink)
            o, _, lse = flashmla_peer.sparse_prefill_fwd(q, kv, idx, 512 ** -0.5, 512, sink, None)
            return _cudnn_backward(q, kv, o, do, lse, sink, rows)()

        return [peer]

    time_peer("flashmla+cudnn_dsa", peer_calls, flop, tf, peer_ms)
    return _v4_row(f"step fwd+bwd index tokens{tokens} h{heads} topk{topk} hd512 bf16", ms, flop, tf, peer_ms)


def _cudnn_backward(q, kv, o, do, lse, sink, rows):
    """cuDNN-frontend's sparse backward (the device pack's peer) on index mode's operands: q, o, do
    [tokens, heads, 512], kv [rows, 1, 512] K = V, lse [tokens, heads], rows [tokens, k] int32
    (-1: none), as a call to time."""
    import cudnn.deepseek_sparse_attention as dsa  # pyright: ignore[reportMissingImports] (GPU peer)

    rows, lse = rows.contiguous(), lse.contiguous()  # once, outside the timed call
    return lambda: dsa.sparse_attention_backward_wrapper(q, kv[:, 0], o, do, lse, sink, rows)


def _v4_row(case, ms, flop, tf, peer_ms) -> dict:
    row = {"stage": "f", "case": case, "head_dim": 512, "ours_ms": round(ms, 4),
           "ours_tflops": round(bench.tflops(flop, ms), 1), "peers": tf, "peer_ms": peer_ms,
           "time_ratio_vs": {k: round(ms / v, 3) for k, v in peer_ms.items()}}
    print(f"stage f {case}: ours {ms:.3f} ms ({row['ours_tflops']} TFLOP/s)  peers {tf}", flush=True)
    return row
