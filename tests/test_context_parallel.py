"""Context parallelism (common/context_parallel.py) on CPUs: the two schedules run in 2 and 3
processes over gloo, each rank computing its shard with the float64 reference standing in for the
kernel, and the gathered shards must equal the reference over the whole sequence. What this
checks is the schedule: which rows each rank receives (the halo, including shards shorter than
the window; the compressed entries; the ring's visiting chunks), which chunk pairs are masked,
full or skipped, and the merges. Sequence lengths are not multiples of the rank count, and a
rank may hold no token. Negative control: a ring that treats the diagonal chunk as fully visible
is rejected."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4_attention.common import context_parallel as cp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys, torch
import torch.distributed as dist
from dsv4_attention.common import context_parallel as cp, reference
cfg = json.loads(sys.argv[1]); rank = int(sys.argv[2]); world = cfg["world"]
dist.init_process_group("gloo", init_method="file://" + cfg["rdv"], rank=rank, world_size=world)
g = torch.Generator().manual_seed(cfg["seed"])
T, H, d = cfg["T"], cfg["heads"], cfg["d"]
q = torch.randn(1, T, H, d, generator=g, dtype=torch.float64)
if cfg["kind"] == "ring":
    hk = cfg["kv_heads"]
    k = torch.randn(1, T, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, hk, d, generator=g, dtype=torch.float64)
    def attn(q, k, v, causal, softmax_scale=None):
        if cfg.get("wrong") == "diagonal_full":
            causal = False
        return reference.attention(q, k, v, softmax_scale, causal=causal)
    o, lse = cp.ring_attention_cp(*(cp.zigzag_shard(x, rank, world) for x in (q, k, v)), seqlen=T, attention=attn)
else:
    kv = torch.randn(1, T, 1, d, generator=g, dtype=torch.float64)
    ratio = cfg["ratio"]
    ckv = torch.randn(1, T // ratio, 1, d, generator=g, dtype=torch.float64)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    topk = None
    if cfg["topk"]:
        topk = torch.randint(-1, max(T // ratio, 1), (1, T, cfg["topk"]), generator=g, dtype=torch.int32)
    lens, cl = cfg["lengths"], cfg["c_lengths"]
    s, cs = sum(lens[:rank]), sum(cl[:rank])
    attn = lambda q, kv, **kw: reference.fused_attention(q, kv, **kw)
    if cfg.get("wrong") == "no_halo":
        cp.halo = lambda kv, rows, *a, **k: kv[:0]
    o, lse = cp.dsv4_attention_cp(q[:, s:s + lens[rank]], kv[:, s:s + lens[rank]],
                                  compressed_kv=ckv[:, cs:cs + cl[rank]], compress_ratio=ratio,
                                  topk_indices=None if topk is None else topk[:, s:s + lens[rank]],
                                  window_left=cfg["left"], learnable_sink=sink, attention=attn)
torch.save({"o": o, "lse": lse}, cfg["out"] + f".{rank}")
dist.destroy_process_group()
print("rank done")
"""


def run_ranks(cfg: dict, tmp_path) -> list[dict]:
    cfg = {**cfg, "rdv": str(tmp_path / "rdv"), "out": str(tmp_path / "out")}
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                               else ""), CUDA_VISIBLE_DEVICES="")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cfg), str(r)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(cfg["world"])]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return [torch.load(cfg["out"] + f".{r}") for r in range(cfg["world"])]


def whole_inputs(cfg):
    g = torch.Generator().manual_seed(cfg["seed"])
    T, H, d = cfg["T"], cfg["heads"], cfg["d"]
    q = torch.randn(1, T, H, d, generator=g, dtype=torch.float64)
    return g, q


def ring_case(world, T, wrong=None, seed=0):
    return {"kind": "ring", "world": world, "T": T, "heads": 4, "kv_heads": 2, "d": 16, "seed": seed, "wrong": wrong}


def ring_error(cfg, tmp_path) -> float:
    from dsv4_attention.common.reference import attention

    parts = run_ranks(cfg, tmp_path)
    g, q = whole_inputs(cfg)
    k = torch.randn(1, cfg["T"], cfg["kv_heads"], cfg["d"], generator=g, dtype=torch.float64)
    v = torch.randn(1, cfg["T"], cfg["kv_heads"], cfg["d"], generator=g, dtype=torch.float64)
    o_ref, lse_ref = attention(q, k, v, causal=True)
    o = cp.zigzag_unshard([p["o"] for p in parts], cfg["T"])
    lse = cp.zigzag_unshard([p["lse"] for p in parts], cfg["T"], dim=2)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    return max(float((o - o_ref).abs().max()), float((lse - lse_ref).abs().max()))


@pytest.mark.parametrize("world,T", [(2, 50), (3, 61), (2, 3)])
def test_ring_equals_single_device_causal(world, T, tmp_path):
    """Zig-zag chunks of uneven (and, at T = 3, empty) lengths; the merges run in fp32."""
    assert ring_error(ring_case(world, T), tmp_path) < 1e-5


def test_ring_checker_rejects_a_diagonal_without_its_mask(tmp_path):
    assert ring_error(ring_case(2, 50, wrong="diagonal_full"), tmp_path) > 1e-2


def dsv4_case(world, lengths, c_lengths, left, ratio=4, topk=0, seed=1, wrong=None):
    return {"kind": "dsv4", "world": world, "T": sum(lengths), "heads": 4, "d": 16, "seed": seed,
            "lengths": lengths, "c_lengths": c_lengths, "left": left, "ratio": ratio, "topk": topk, "wrong": wrong}


def dsv4_error(lengths, c_lengths, left, topk, tmp_path, wrong=None) -> float:
    from dsv4_attention.common.reference import fused_attention

    cfg = dsv4_case(len(lengths), lengths, c_lengths, left, topk=topk, wrong=wrong)
    parts = run_ranks(cfg, tmp_path)
    g, q = whole_inputs(cfg)
    T, d, H = cfg["T"], cfg["d"], cfg["heads"]
    kv = torch.randn(1, T, 1, d, generator=g, dtype=torch.float64)
    ckv = torch.randn(1, T // 4, 1, d, generator=g, dtype=torch.float64)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    idx = torch.randint(-1, max(T // 4, 1), (1, T, topk), generator=g, dtype=torch.int32) if topk else None
    o_ref, lse_ref = fused_attention(q, kv, compressed_kv=ckv, compress_ratio=4, topk_indices=idx, causal=True,
                                     window_size=(left, 0), learnable_sink=sink)
    o = torch.cat([p["o"] for p in parts], dim=1)
    lse = torch.cat([p["lse"] for p in parts], dim=2)
    assert o.shape == o_ref.shape and not torch.isnan(o).any()
    return max(float((o - o_ref).abs().max()), float((lse - lse_ref).abs().max()))


@pytest.mark.parametrize("lengths,c_lengths,left,topk", [
    ([30, 41], [7, 10], 127, 0),       # window wider than the shards: the whole prefix is the halo
    ([3, 40, 27], [0, 10, 7], 5, 0),    # a shard shorter than the window: its halo spans ranks
    ([0, 33, 20], [5, 8, 0], 7, 0),     # a rank with no token
    ([25, 30], [6, 7], 9, 6),           # top-k lists (indices into the whole list, -1 padded)
])
def test_dsv4_shards_equal_the_whole_sequence(lengths, c_lengths, left, topk, tmp_path):
    assert dsv4_error(lengths, c_lengths, left, topk, tmp_path) < 1e-9


def test_dsv4_checker_rejects_shards_without_their_halo(tmp_path):
    assert dsv4_error([3, 40, 27], [0, 10, 7], 5, 0, tmp_path, wrong="no_halo") > 1e-3


def _work(a: int, b: int, left: int, ratio: int, topk: int) -> float:
    """Tokens a..b-1's cost, counted one by one (an independent count of dsv4_bounds' model)."""
    w = 0.0
    for t in range(a + 1, b + 1):
        seen = t // ratio
        w += cp.TOKEN_COST_IN_KEYS + min(t, left + 1) + (min(seen, topk) if topk else seen)
    return w


@pytest.mark.parametrize("seqlen,world,ratio,topk", [(20000, 2, 128, 0), (9001, 3, 4, 512), (5, 2, 4, 0)])
def test_dsv4_bounds_give_every_rank_the_same_work(seqlen, world, ratio, topk):
    b = cp.dsv4_bounds(seqlen, world, compress_ratio=ratio, topk=topk or None)
    assert b[0] == 0 and b[-1] == seqlen and b == sorted(b)
    work = [_work(b[r], b[r + 1], 127, ratio, topk) for r in range(world)]
    most_per_token = cp.TOKEN_COST_IN_KEYS + 128 + seqlen
    assert max(work) - min(work) <= most_per_token, (b, work)  # equal within one token
    if seqlen > 1000 and not topk:  # negative control: the even split is unbalanced
        even = [seqlen * r // world for r in range(world + 1)]
        w_even = [_work(even[r], even[r + 1], 127, ratio, topk) for r in range(world)]
        assert max(w_even) - min(w_even) > 10 * most_per_token


def test_zigzag_shards_cover_the_sequence_once():
    x = torch.arange(23)[None]
    for world in (1, 2, 3, 5):
        parts = [cp.zigzag_shard(x, r, world) for r in range(world)]
        assert torch.equal(cp.zigzag_unshard(parts, 23), x)
        assert sorted(torch.cat(parts, dim=1)[0].tolist()) == list(range(23))


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(gpus() < 1, reason="needs a GPU; this machine has none")
@pytest.mark.parametrize("case", ["dsv4", "ring"])
def test_two_ranks_equal_the_single_gpu_kernel(case):
    """The kernels under both schedules in 2 ranks (``tools.cp_demo --check``): NCCL on 2 GPUs, or
    gloo with both ranks sharing one GPU. The gathered shards against the float64 reference on the
    last 256 queries (stage B's bounds) and against the single-GPU call. 3001 tokens: neither a
    multiple of the ranks nor of the tiles."""
    from dsv4_attention.common.arch import present_arch

    if present_arch() is None:
        pytest.skip("needs Hopper or Blackwell GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "tools.cp_demo", "--case", case, "--seqlen", "3001", "--check"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and rows, (p.stdout + p.stderr)[-3000:]
    assert rows[0]["ok"], rows[0]
    assert rows[0]["max_abs_vs_single"] < 0.05, rows[0]
