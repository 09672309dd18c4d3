"""Context-parallel attention on the GPUs of one node (common/context_parallel.py), checked
against the single-GPU kernel and timed against it.

    torchrun --nproc-per-node 2 -m tools.cp_demo [--case dsv4|ring|both] [--seqlen N] [--check]
                                         [--backend nccl|gloo]
    nox -s cp_demo                       (the same, on every GPU of the machine)

With fewer GPUs than ranks, ranks share GPUs (rank r on GPU r mod count) over gloo, whose GPU
tensors travel through host copies: a correctness run (``--check``), not a timing.

Every rank builds the whole problem from one seed (so no input is sent), keeps its shard, and
runs the context-parallel call; rank 0 then runs the single-GPU kernel on the whole sequence
and compares (``--check``: errors of the gathered shards against it, and of both against the
float64 reference on the last 256 queries) and prints one JSON line per case: times (median of
CUDA events, every rank synchronised), the speedup, the errors, and the kernels' own time (the
same kernel calls replayed without communication or merges; the rest of the call is the
communication the schedule did not hide).

Cases: ``dsv4``, DeepSeek-V4's HCA layer (128 heads on one K = V head, hd 512, window 127,
compressed entries of ratio 128, sink), contiguous shards of equal work (``dsv4_bounds``);
``ring``, dense causal GQA (32 heads
on 4, hd 128), zig-zag shards around a ring.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def timed(fn, iters: int = 5, group: bool = True) -> float:
    """Median milliseconds of ``fn``: across the group (every rank starts together, the slowest
    rank's time counts), or, with ``group=False``, of this rank alone (a call only rank 0 makes:
    a collective there would wait forever for the other ranks)."""
    import torch.distributed as dist

    times = []
    fn()
    for _ in range(iters):
        if group:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        if group:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank is the call's time
        times.append(float(t))
    return sorted(times)[len(times) // 2]


class Recorder:
    """An ``attention`` for the context-parallel calls that runs ``fn`` and keeps every call's
    arguments, so that the kernels alone (no communication, no merge) can be timed on the same
    inputs: the call's time beyond them is the communication the schedule did not hide."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kw):
        self.calls.append((args, kw))
        return self.fn(*args, **kw)

    def replay(self):
        for args, kw in self.calls:
            self.fn(*args, **kw)


def add_kernel_time(row: dict, call, fn) -> None:
    """row["kernels_ms"]: the slowest rank's kernels alone (``call(attention)`` once with a
    ``Recorder`` of ``fn``, then its kernel calls replayed); ``unhidden_ms``: the rest of the call."""
    rec = Recorder(fn)
    call(rec)
    row["kernels_ms"] = timed(rec.replay)
    row["unhidden_ms"] = max(0.0, row["cp_ms"] - row["kernels_ms"])
    row["unhidden_share"] = round(row["unhidden_ms"] / row["cp_ms"], 3)


def dsv4_case(seqlen: int, rank: int, world: int, check: bool) -> dict:

    from dsv4_attention.common import context_parallel as cp
    from dsv4_attention.common.reference import fused_attention
    from dsv4_attention.common.testing import errors
    from dsv4_attention.stages import e_fused

    g = torch.Generator(device="cuda").manual_seed(0)
    h, d, ratio = 128, 512, 128
    q = torch.randn(1, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, seqlen, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ckv = torch.randn(1, seqlen // ratio, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = torch.randn(h, device="cuda", generator=g)
    bounds = cp.dsv4_bounds(seqlen, world, compress_ratio=ratio)  # contiguous, equal work per rank
    cb = [(ckv.shape[1]) * r // world for r in range(world + 1)]
    s0, s1 = bounds[rank], bounds[rank + 1]
    mine = {"q": q[:, s0:s1], "kv": kv[:, s0:s1], "compressed_kv": ckv[:, cb[rank]:cb[rank + 1]]}
    call = lambda attention=None: cp.dsv4_attention_cp(  # noqa: E731
        mine["q"], mine["kv"], compressed_kv=mine["compressed_kv"], compress_ratio=ratio, learnable_sink=sink,
        attention=attention)
    kw = {"compressed_kv": ckv, "compress_ratio": ratio, "causal": True, "window_size": (127, 0),
          "learnable_sink": sink}
    row = {"case": f"dsv4 HCA h{h} hd{d} ratio {ratio} seqlen {seqlen}", "world": world,
           "shards": "contiguous, equal work", "bounds": bounds,
           "cp_ms": timed(call)}
    row["single_ms"] = timed(lambda: e_fused.forward(q, kv, **kw), group=False) if rank == 0 else None
    add_kernel_time(row, call, e_fused.forward)
    row["tflop"] = e_fused.flops(1, seqlen, seqlen, h, d, True, (127, 0), ratio, ckv.shape[1]) / 1e12
    if check:
        o_cp, _ = call()
        o_cp = cp.gather_rows(o_cp[0], [bounds[r + 1] - bounds[r] for r in range(world)])[None]
        if rank == 0:
            o_one, _ = e_fused.forward(q, kv, **kw)
            rows = slice(seqlen - 256, seqlen)
            ref, _ = fused_attention(q[:, rows], kv, **kw, positions=torch.arange(seqlen - 256, seqlen))
            row["errors_vs_reference"] = str(errors(o_cp[:, rows], ref))
            row["errors_single_vs_reference"] = str(errors(o_one[:, rows], ref))
            row["max_abs_vs_single"] = float((o_cp.float() - o_one.float()).abs().max())
            row["ok"] = errors(o_cp[:, rows], ref).within(1e-2, 2e-2)
    return row


def ring_case(seqlen: int, rank: int, world: int, check: bool) -> dict:

    from dsv4_attention.common import context_parallel as cp
    from dsv4_attention.common.reference import attention
    from dsv4_attention.common.testing import errors
    from dsv4_attention.stages import d4_causal_window

    g = torch.Generator(device="cuda").manual_seed(1)
    h, hk, d = 32, 4, 128
    q = torch.randn(1, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, seqlen, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, seqlen, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    mine = [cp.zigzag_shard(x, rank, world) for x in (q, k, v)]
    call = lambda attention=None: cp.ring_attention_cp(*mine, seqlen=seqlen, attention=attention)  # noqa: E731
    row = {"case": f"dense causal GQA h{h}/{hk} hd{d} seqlen {seqlen}", "world": world, "shards": "zig-zag ring",
           "cp_ms": timed(call)}
    row["single_ms"] = timed(lambda: d4_causal_window.forward(q, k, v, causal=True), group=False) if rank == 0 else None
    add_kernel_time(row, call, d4_causal_window.forward)
    row["tflop"] = d4_causal_window.flops(1, seqlen, seqlen, h, d, causal=True) / 1e12
    if check:
        o_cp, _ = call()
        sizes = [cp.zigzag_shard(q, r, world).shape[1] for r in range(world)]
        whole = cp.gather_rows(o_cp[0], sizes)[None]  # the shards in rank order
        parts = list(whole.split(sizes, dim=1))
        if rank == 0:
            o_cp = cp.zigzag_unshard(parts, seqlen)
            o_one, _ = d4_causal_window.forward(q, k, v, causal=True)
            rows = slice(seqlen - 256, seqlen)
            # the last queries see every key: the float64 reference over all keys, rows bottom-right aligned
            ref, _ = attention(q[:, rows], k, v, causal=True)
            row["errors_vs_reference"] = str(errors(o_cp[:, rows], ref))
            row["errors_single_vs_reference"] = str(errors(o_one[:, rows], ref))
            row["max_abs_vs_single"] = float((o_cp.float() - o_one.float()).abs().max())
            row["ok"] = errors(o_cp[:, rows], ref).within(1e-2, 2e-2)
    return row


def main(argv=None) -> int:
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["dsv4", "ring", "both"], default="both")
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", help="rank 0 appends one JSON line per case to this file")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                    help="default: nccl with a GPU per rank, gloo (ranks sharing GPUs) otherwise")
    a = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = a.backend or ("nccl" if torch.cuda.device_count() >= world else "gloo")
    torch.cuda.set_device(local % torch.cuda.device_count())
    if backend == "nccl":
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    if a.case in ("dsv4", "both"):
        rows.append(dsv4_case(a.seqlen, rank, world, a.check))
    if a.case in ("ring", "both"):
        rows.append(ring_case(a.seqlen, rank, world, a.check))
    if rank == 0:
        for r in rows:
            r["speedup"] = round(r["single_ms"] / r["cp_ms"], 3)
            line = json.dumps({**r, "backend": backend, "gpus": torch.cuda.device_count(),
                               "gpu": torch.cuda.get_device_name()})
            print(line, flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(line + "\n")
    dist.destroy_process_group()
    return 0 if all(r.get("ok", True) for r in rows) or rank != 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
