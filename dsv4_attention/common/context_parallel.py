"""Context parallelism: one attention over a sequence sharded across the ranks of a
``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs), the result equal to the
single-GPU kernel's.

Two schedules, one per kind of attention:

**DeepSeek-V4 (window + compressed entries, MQA, K = V): contiguous shards, a halo.**
Rank r holds tokens [s_r, s_r+1) of one sequence (any lengths, 0 included; ``dsv4_bounds`` gives
the split of equal work: later tokens see more compressed entries). Query t needs the raw
rows t - left .. t (its window) and the compressed entries j < floor((t + 1) / ratio) of the
whole sequence. So each rank sends its last ``left`` raw rows to the ranks after it (one
all-gather of fixed-size tails: a shard shorter than the window takes rows from several ranks
back) and the compressed entries are all-gathered (T / ratio rows: 1 KB each at head dim 512,
little next to the attention). Then every rank runs the fused kernel once on its own queries:

    raw keys    [halo (h rows), its own rows]: absolute positions s_r - h .. s_r+1 - 1, so the
                kernel gets kv_start = s_r - h (the absolute position of its raw key 0)
    positions   query i sits at the bottom-right aligned row h + i of those keys, absolute
                position kv_start + h + i = s_r + i: the window and the compressed visibility are
                the global ones

No merge: each query's whole key set is on its rank.

**Dense causal (GQA, any head dim): zig-zag shards, a ring.** The sequence is cut into 2W chunks
(W ranks); rank r holds chunks r and 2W - 1 - r, so every rank has the same causal work
(``zigzag_bounds``). The KV shards travel around the ring (rank r sends to r + 1, receives from
r - 1, W - 1 steps, each step's transfer posted before the step's compute so they overlap); at each
step, each local query chunk a meets each visiting key chunk b: b < a all keys visible (the
kernel without a mask), b == a causal (square: the diagonal), b > a nothing. Partial results are
combined with the exact LSE merge (``merge.merge_attention``).

Both take ``attention``: the single-device attention to run locally (default: the library's
kernels on GPU tensors; the tests pass the float64 reference to check the schedules on CPUs).

Backends: NCCL (one GPU per rank) moves GPU tensors directly. Over gloo, GPU tensors travel
through host copies (``_wire``, ``_home``): that is what lets two ranks share one GPU (NCCL refuses
two ranks on one device), so the schedules run with the real kernels wherever a GPU exists; it is
a test setup, not a fast path.
"""

from __future__ import annotations

import torch

from dsv4_attention.common.merge import merge_attention


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context parallelism needs an initialised torch.distributed process group")
    return dist


def _wire(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x`` as the backend moves it: GPU tensors go over gloo as host copies."""
    if x.is_cuda and _dist().get_backend(group) == "gloo":
        return x.cpu()
    return x


def _home(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.to(like.device, non_blocking=False) if x.device != like.device else x


def all_lengths(n: int, group=None, device=None) -> list[int]:
    """Every rank's ``n`` (its shard's token count), in rank order."""
    dist = _dist()
    t = _wire(torch.tensor([n], dtype=torch.int64, device=device), group)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [int(x) for x in out]


def gather_rows(x: torch.Tensor, lengths: list[int], group=None) -> torch.Tensor:
    """All ranks' ``x`` ([n_r, ...], n_r = lengths[r]) concatenated in rank order, on every rank
    (padded to the longest for the collective)."""
    dist = _dist()
    most = max(max(lengths), 1)
    pad = torch.zeros((most, *x.shape[1:]), dtype=x.dtype, device=x.device)
    pad[: x.shape[0]] = x
    pad = _wire(pad, group)
    out = [torch.empty_like(pad) for _ in lengths]
    dist.all_gather(out, pad, group=group)
    return _home(torch.cat([o[:n] for o, n in zip(out, lengths, strict=True)]), x)


def halo(kv: torch.Tensor, rows: int, lengths: list[int], rank: int, group=None) -> torch.Tensor:
    """The ``rows`` raw rows before this rank's first token ([min(rows, s_r), ...]): each rank's
    last ``rows`` rows gathered, the ones before s_r taken from the ranks before (several when
    shards are shorter than the window)."""
    if rows == 0:
        return kv[:0]
    tails = gather_rows(kv[max(kv.shape[0] - rows, 0):], [min(n, rows) for n in lengths], group)
    before = sum(min(n, rows) for n in lengths[:rank])
    return tails[max(before - rows, 0): before]


# Per-token cost of stage E's kernel beyond its keys, in keys: the single-H200 rows of the 2-GPU
# report fit time = a * tokens + b * (keys summed over tokens) within 0.2 % at 64k, 128k and 256k
# tokens (HCA, 128 heads, hd 512), with a / b = 206: loading a token's 128 query rows and storing
# its output cost about what 206 keys do.
TOKEN_COST_IN_KEYS = 206


def dsv4_bounds(seqlen: int, world: int, *, window_left: int = 127, compress_ratio: int | None = None,
                topk: int | None = None, token_cost: float = TOKEN_COST_IN_KEYS) -> list[int]:
    """The W + 1 boundaries of a contiguous split of ``seqlen`` tokens that gives every rank the
    same work. Token t costs ``token_cost`` + its keys: min(t + 1, window_left + 1) raw rows plus
    its compressed entries, floor((t + 1) / ratio) of them (at most ``topk`` with top-k lists).
    Equal token counts would not balance: later tokens see more compressed entries, so with HCA at
    256k tokens an even split leaves the second of 2 ranks 2.2 times the first's work."""
    import numpy as np

    t = np.arange(1, seqlen + 1, dtype=np.float64)
    cost = token_cost + np.minimum(t, window_left + 1)
    if compress_ratio:
        seen = np.floor(t / compress_ratio)
        cost += np.minimum(seen, topk) if topk else seen
    total = np.concatenate([[0.0], np.cumsum(cost)])
    cuts = [int(np.searchsorted(total, total[-1] * r / world)) for r in range(1, world)]
    return [0, *cuts, seqlen]


def dsv4_attention_cp(q, kv, *, compressed_kv=None, compress_ratio=None, topk_indices=None, window_left=127,
                      learnable_sink=None, softmax_scale=None, group=None, attention=None):
    """DeepSeek-V4's attention (window (``window_left``, 0) + compressed entries + sink) on a
    contiguous shard. This rank's q [1, n, heads, d], kv [1, n, 1, d] (its tokens' raw rows),
    compressed_kv [1, m, 1, d] (its part of the compressed entries, in order: the whole list is
    the ranks' parts concatenated) with ``compress_ratio``, topk_indices [1, n, k] (indices into
    the whole list) or None. Returns this shard's (o [1, n, heads, d], lse [1, heads, n]), equal to
    the single-device call on the whole sequence. ``attention``: stage E's ``forward`` by default."""
    dist = _dist()
    if attention is None:
        from dsv4_attention.stages.e_fused import forward as attention
    if q.shape[0] != 1 or kv.shape[0] != 1 or kv.shape[1] != q.shape[1]:
        raise ValueError(f"one sequence per call: q [1, n, heads, d] and kv [1, n, 1, d] of the same n; got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}")
    rank = dist.get_rank(group)
    lengths = all_lengths(q.shape[1], group, q.device)
    start = sum(lengths[:rank])
    h = halo(kv[0], window_left, lengths, rank, group)
    keys = torch.cat([h, kv[0]])[None]  # absolute positions start - len(h) .. start + n - 1
    kw = {}
    if compressed_kv is not None:
        counts = all_lengths(compressed_kv.shape[1], group, q.device)
        kw = {"compressed_kv": gather_rows(compressed_kv[0], counts, group)[None], "compress_ratio": compress_ratio,
              "topk_indices": topk_indices, "kv_start": start - h.shape[0]}
    if q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros((1, q.shape[2], 0), dtype=torch.float32, device=q.device)
    return attention(q, keys, causal=True, window_size=(window_left, 0), learnable_sink=learnable_sink,
                     softmax_scale=softmax_scale, **kw)


def zigzag_bounds(seqlen: int, world: int) -> list[int]:
    """The 2W + 1 chunk boundaries of a ``seqlen``-token sequence (chunks as even as integers
    allow; a chunk may be empty)."""
    chunks = 2 * world
    return [seqlen * i // chunks for i in range(chunks + 1)]


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    return rank, 2 * world - 1 - rank


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag shard of a whole sequence ``x`` (chunks r and 2W - 1 - r along ``dim``)."""
    b = zigzag_bounds(x.shape[dim], world)
    return torch.cat([x.narrow(dim, b[c], b[c + 1] - b[c]) for c in zigzag_chunks(rank, world)], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], seqlen: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (``parts`` in rank order)."""
    world = len(parts)
    b = zigzag_bounds(seqlen, world)
    chunks = [None] * (2 * world)
    for r, p in enumerate(parts):
        c0, c1 = zigzag_chunks(r, world)
        n0 = b[c0 + 1] - b[c0]
        chunks[c0], chunks[c1] = p.narrow(dim, 0, n0), p.narrow(dim, n0, p.shape[dim] - n0)
    return torch.cat(chunks, dim=dim)


def _causal_step(acc, q_parts, q_chunks, k_chunks, attention, kw):
    """Merge into ``acc`` (per local query chunk: (o, lse) or None) what each query chunk sees of
    the visiting key chunks (list of (chunk id, k slice, v slice))."""
    for i, (a, qa) in enumerate(zip(q_chunks, q_parts, strict=True)):
        if qa.shape[1] == 0:
            continue
        for b, kb, vb in k_chunks:
            if b > a or kb.shape[1] == 0:
                continue  # keys after every query of the chunk: nothing visible
            o, lse = attention(qa, kb, vb, causal=(b == a), **kw)
            o = o.float() if o.element_size() < 4 else o  # merged in fp32: one rounding to q's dtype at the end
            acc[i] = (o, lse) if acc[i] is None else merge_attention(acc[i][0], acc[i][1], o, lse)


def ring_attention_cp(q, k, v, *, seqlen: int, softmax_scale=None, group=None, attention=None):
    """Causal attention over a zig-zag sharded sequence of ``seqlen`` tokens: this rank's q
    [b, n_r, heads, d], k and v [b, n_r, kv_heads, d] (``zigzag_shard``). Returns this shard's
    (o, lse [b, heads, n_r]), equal to the single-device causal attention over the whole sequence.
    ``attention``: stage D4's ``forward`` by default."""
    dist = _dist()
    if attention is None:
        from dsv4_attention.stages.d4_causal_window import forward as attention
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = zigzag_bounds(seqlen, world)
    lens = [bounds[c + 1] - bounds[c] for c in range(2 * world)]

    def split(x, r):
        c0, _ = zigzag_chunks(r, world)
        return x[:, : lens[c0]], x[:, lens[c0]:]

    q_chunks = zigzag_chunks(rank, world)
    want = lens[q_chunks[0]] + lens[q_chunks[1]]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[1] != want:
            raise ValueError(f"{name} must be rank {rank}'s zig-zag shard of {seqlen} tokens ({want} rows); got "
                             f"{tuple(t.shape)}")
    q_parts = split(q, rank)
    kw = {"softmax_scale": softmax_scale}
    acc = [None, None]
    most = max(lens[c] + lens[2 * world - 1 - c] for c in range(world))
    kv = torch.zeros((2, k.shape[0], most, *k.shape[2:]), dtype=k.dtype, device=k.device)
    kv[0, :, : want], kv[1, :, : want] = k, v
    src = rank
    for step in range(world):
        reqs, nxt = [], None
        if step < world - 1:  # post the next transfer before this step's compute: they overlap
            out = _wire(kv, group)
            nxt = torch.empty_like(out)
            send = dist.P2POp(dist.isend, out, (rank + 1) % world, group)
            recv = dist.P2POp(dist.irecv, nxt, (rank - 1) % world, group)
            reqs = dist.batch_isend_irecv([send, recv])
        c0, c1 = zigzag_chunks(src, world)
        n0, n1 = lens[c0], lens[c1]
        visiting = [(c0, kv[0, :, :n0], kv[1, :, :n0]), (c1, kv[0, :, n0:n0 + n1], kv[1, :, n0:n0 + n1])]
        _causal_step(acc, q_parts, q_chunks, visiting, attention, kw)
        for r in reqs:
            r.wait()
        if nxt is not None:
            kv, src = _home(nxt, k), (src - 1) % world
    outs, lses = [], []
    for (o_lse, qa) in zip(acc, q_parts, strict=True):
        if o_lse is None:  # an empty chunk
            outs.append(torch.zeros_like(qa))
            lses.append(torch.zeros((qa.shape[0], qa.shape[2], 0), dtype=torch.float32, device=qa.device))
        else:
            outs.append(o_lse[0].to(q.dtype))
            lses.append(o_lse[1])
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)
