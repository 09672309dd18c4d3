"""Benchmarking: CUDA-event timing, FLOP counts, and the peers we measure beside our kernels.

Method (see the device notes): warm up, then time each launch with a pair of
CUDA events and report the median; rotate among several input sets whose
total size is at least twice the GPU's L2 (its own figure) so repeated launches
do not read a warm cache; count FLOPs by formula (2 per multiply-add of each
GEMM), never from the profiler. Why not the libraries' timers:
``cutlass.testing.benchmark`` rotates workspaces as this does, but times the
whole loop with one pair of events (a mean over back-to-back launches, whose
tails overlap); ``triton.testing.do_bench`` times one input set, flushing L2
with a memset before each launch. The reports compare the median of
per-launch events over rotated real inputs (CUDA-graph replay, where host time
must go: tools/bench_decode.py).

Peers are measured in the same process, on the same inputs:
- ``matmul``: torch.matmul (cuBLAS) in the inputs' dtype;
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``, CuTeDSL);
- ``cudnn``: torch SDPA forced onto cuDNN (``SDPBackend.CUDNN_ATTENTION``).
``peer_sanity`` re-measures each peer on a case from ``shared/notes/anchors.md``
and flags it when it lands far under the anchor: a peer run badly (wrong
backend, a fallback, a cold cache) makes every ratio against it meaningless.
"""

from __future__ import annotations

import statistics

import torch

#: the L2 size assumed without a GPU to ask (above H100's 50 MB and H200's 60 MB)
L2_FALLBACK_BYTES = 64 << 20


def l2_bytes() -> int:
    """The current GPU's L2 cache size (the device's own figure), or ``L2_FALLBACK_BYTES``."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    return L2_FALLBACK_BYTES


def rotation_count(bytes_per_set: int, minimum: int = 2, maximum: int = 16) -> int:
    """How many input sets to rotate among so that together they are at least twice L2."""
    n = -(-2 * l2_bytes() // max(bytes_per_set, 1))
    return max(minimum, min(maximum, n))


def time_ms(calls, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of one launch. ``calls`` is a list of zero-argument callables
    (one per rotated input set); iteration i runs ``calls[i % len(calls)]``."""
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def tflops(flop: int, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, head_dim_v=None) -> int:
    """Dense forward attention: QK^T and PV, 2 FLOPs per multiply-add each."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 2 * batch * heads * seqlen_q * seqlen_k * (head_dim + dv)


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(None, None)) -> int:
    """Visible (query, key) pairs of one head, bottom-right aligned (the FLOP counts over the
    visible keys, forward and backward), host Python."""
    from dsv4_attention.common.validation import check_window

    left, right = check_window(causal, window_size)
    total = 0
    for i in range(seqlen_q):
        ip = i + seqlen_k - seqlen_q
        lo = 0 if left is None else max(0, ip - left)
        hi = seqlen_k if right is None else min(seqlen_k, ip + right + 1)
        total += max(0, hi - lo)
    return total


# ---- peers -------------------------------------------------------------------------------

def peer_matmul_qk(q, k):
    """S = Q K^T per head through cuBLAS, output in the input dtype (half our fp32 bytes)."""
    h, hk = q.shape[2], k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2)
    if hk != h:
        kt = kt.repeat_interleave(h // hk, dim=1)
    return lambda: torch.matmul(qt, kt.transpose(-1, -2))


def peer_fa4(q, k, v, softmax_scale=None, causal=False, window_size=(None, None)):
    from flash_attn.cute import flash_attn_func  # pyright: ignore[reportMissingImports] (GPU peer)

    def run():
        r = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
        return r[0] if isinstance(r, tuple) else r

    return run


def peer_cudnn(q, k, v, softmax_scale=None, causal=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    enable_gqa = k.shape[2] != q.shape[2]

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, scale=softmax_scale, is_causal=causal, enable_gqa=enable_gqa)

    return run


def peer_sdpa_mem_efficient(q, k, v, softmax_scale=None):
    """torch's memory-efficient SDPA (the only SM90 peer that runs head dim 512); KV heads
    broadcast to the query heads as stride-0 views (no copy)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    h = q.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (x.transpose(1, 2).expand(x.shape[0], h, x.shape[1], x.shape[3]) for x in (k, v))

    def run():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return sdpa(qt, kt, vt, scale=softmax_scale)

    return run


# Anchor cases (shared/notes/anchors.md, H200, bf16): peer -> (case, TFLOP/s measured there)
ANCHORS = {
    "matmul": ("bf16 8192^3", 692.0),
    "fa4": ("4x16x8192 hd128 non-causal", 665.0),
    "cudnn": ("4x16x8192 hd128 non-causal", 607.0),
}
SANE_FRACTION = 0.6  # a peer under 60% of its anchor is flagged (H100 is slower than H200)


def peer_sanity(device="cuda") -> dict:
    """Each peer on its anchor case; returns {peer: {tflops, anchor, ok, error?}}."""
    out = {}
    dt = torch.bfloat16
    a = torch.randn(8192, 8192, dtype=dt, device=device)
    b = torch.randn(8192, 8192, dtype=dt, device=device)
    ms = time_ms([lambda: torch.matmul(a, b)], warmup=3, iters=10)
    out["matmul"] = {"tflops": tflops(2 * 8192**3, ms)}
    q, k, v = (torch.randn(4, 8192, 16, 128, dtype=dt, device=device) for _ in range(3))
    flop = attention_flops(4, 16, 8192, 8192, 128)
    for name, make in (("fa4", peer_fa4), ("cudnn", peer_cudnn)):
        try:
            ms = time_ms([make(q, k, v)], warmup=3, iters=10)
            out[name] = {"tflops": tflops(flop, ms)}
        except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
            out[name] = {"tflops": None, "error": f"{type(e).__name__}: {e}"[:300]}
    for name, rec in out.items():
        case, anchor = ANCHORS[name]
        rec["anchor_case"] = case
        rec["anchor_tflops"] = anchor
        rec["ok"] = rec["tflops"] is not None and rec["tflops"] >= SANE_FRACTION * anchor
    return out


def copy_gbps(device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time), the memory roof a
    bandwidth-bound kernel is compared with in the same run."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms([lambda: dst.copy_(src)], warmup=3, iters=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9
