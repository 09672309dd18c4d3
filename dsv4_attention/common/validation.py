"""Input checks that turn bad input into a ValueError before any compile or launch.

Each message names the argument and what is accepted. The kernels rely on
what is checked here: 16-byte aligned base pointers and row strides (TMA),
head_dim contiguous, one dtype for all inputs, kv heads dividing query heads.
"""

from __future__ import annotations

import math

import torch

DTYPES = (torch.bfloat16, torch.float16)


def _name_dtypes() -> str:
    return ", ".join(str(d).replace("torch.", "") for d in DTYPES)


def check_scale(softmax_scale, head_dim: int) -> float:
    """None -> 1/sqrt(head_dim); otherwise a positive finite number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    return float(softmax_scale)


def check_readable(name: str, t: torch.Tensor, dims: tuple, skip: tuple = ()) -> None:
    """What the copy engines read of ``t``, rows of its last dim, whatever its other strides are (a
    view into a padded buffer included): the last dim contiguous (stride 1: a row is one run of
    bytes), every other stride a whole number of 16-byte units (TMA takes each outer global stride in
    16-byte units, an extent-1 dim's too; the sm90 top-k gather copies a row 16 bytes at a time with
    cp.async, each copy 16-byte aligned) and a 16-byte aligned data pointer (TMA's global address,
    cp.async's source). Nothing else is assumed: no dense relation between the strides, no order
    among them. ``dims`` names t's dims in the messages; ``skip``: dims whose stride is not read (an
    extent-1 dim the caller gives another stride before the launch)."""
    strides, elem = t.stride(), t.element_size()
    if strides[-1] != 1:
        raise ValueError(f"{name} must have {dims[-1]} contiguous (stride 1); got strides {strides}")
    for dim, s in enumerate(strides[:-1]):
        if (s * elem) % 16 and dim not in skip:
            raise ValueError(f"{name} stride of dim {dim} must be a multiple of 16 bytes (TMA and the top-k gather "
                             f"read 16-byte aligned rows): its {dims[dim]} stride is {s} elements = {s * elem} bytes; "
                             f"got strides {strides}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} data pointer must be 16-byte aligned (TMA); got {t.data_ptr():#x}")


def check_bshd(name: str, t, head_dims, min_seqlen: int = 1,
               dims: tuple = ("batch", "seqlen", "head", "head_dim")) -> None:
    """One [batch, seqlen, heads, head_dim] input, in any layout ``check_readable`` accepts
    (``dims``: its dims' names in the messages)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name}.dtype must be one of {_name_dtypes()}; got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must have rank 4 [batch, seqlen, heads, head_dim]; got shape {tuple(t.shape)}"
        )
    b, s, h, d = t.shape
    if d not in head_dims:
        raise ValueError(f"{name} head_dim must be one of {sorted(head_dims)}; got {d}")
    if b < 1 or h < 1:
        raise ValueError(f"{name} needs batch >= 1 and heads >= 1; got shape {tuple(t.shape)}")
    if s < min_seqlen:
        raise ValueError(f"{name} needs seqlen >= {min_seqlen}; got shape {tuple(t.shape)}")
    check_readable(name, t, dims)


def check_same(ref_name: str, ref, name: str, t) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}.dtype must equal {ref_name}.dtype ({ref.dtype}); got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device ({ref.device}); got {t.device}")


def check_qk(q, k, head_dims, min_seqlen_k: int = 1) -> None:
    """q [b, sq, h, d], k [b, sk, hk, d]: same dtype, device, batch, head_dim; hk divides h."""
    check_bshd("q", q, head_dims)
    check_bshd("k", k, head_dims, min_seqlen_k)
    check_same("q", q, "k", k)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch must equal q batch ({q.shape[0]}); got {k.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k head_dim must equal q head_dim ({q.shape[3]}); got {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"k heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")


def check_out(name: str, t, shape, dtype, device) -> None:
    """A caller-provided output: exactly this shape and dtype, contiguous, on the inputs' device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)}; got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}; got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")


def check_qkv(q, k, v, head_dims, max_seqlen_k: int | None = None, too_long: str = "") -> None:
    """q, k, v of an attention stage: q/k as ``check_qk`` (seqlen_k = 0 allowed: every row is
    empty), v of k's shape, dtype and device, and seqlen_k at most ``max_seqlen_k``."""
    check_qk(q, k, head_dims, min_seqlen_k=0)
    check_bshd("v", v, head_dims, min_seqlen=0)
    check_same("k", k, "v", v)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}; got {tuple(v.shape)}")
    if max_seqlen_k is not None and k.shape[1] > max_seqlen_k:
        raise ValueError(f"seqlen_k must be at most {max_seqlen_k} for this stage; got {k.shape[1]}{too_long}")


def value_range(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor: one reduction and one device-to-host copy (the one
    sync a value check costs)."""
    lo, hi = torch.aminmax(t)
    return tuple(int(x) for x in torch.stack([lo, hi]).tolist())


def check_seqused_k(seqused_k, batch: int, seqlen_k: int, device) -> None:
    """[batch] int32 on the inputs' device, every value in [0, seqlen_k] (reads the values: one
    device sync, before any launch; skipped while a CUDA graph is captured, where the kernel's
    clamp to [0, seqlen_k] is what holds)."""
    if not isinstance(seqused_k, torch.Tensor):
        raise ValueError(f"seqused_k must be a torch.Tensor or None; got {type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32:
        raise ValueError(f"seqused_k.dtype must be int32; got {seqused_k.dtype}")
    if tuple(seqused_k.shape) != (batch,):
        raise ValueError(f"seqused_k must have shape [batch] = ({batch},); got {tuple(seqused_k.shape)}")
    if seqused_k.device != device:
        raise ValueError(f"seqused_k must be on {device} like q; got {seqused_k.device}")
    if seqused_k.stride(0) != 1 and batch > 1:
        raise ValueError(f"seqused_k must be contiguous; got stride {seqused_k.stride()}")
    if seqused_k.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # reading the values would synchronize inside a CUDA graph capture; the kernel clamps them
    lo, hi = value_range(seqused_k)
    if lo < 0 or hi > seqlen_k:
        raise ValueError(f"seqused_k values must lie in [0, seqlen_k = {seqlen_k}]; got min {lo}, max {hi}")


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, device, max_seqlen_q=None,
                     max_seqlen_k=None) -> tuple[int, int]:
    """Variable-length batches in FlashAttention's convention: [batch + 1] int32 offsets on the
    inputs' device, starting at 0, non-decreasing, the last at most the packed tensor's length
    (lengths of 0 are legal). Returns (max_seqlen_q, max_seqlen_k): the given ones, checked
    against the offsets, or the offsets' (one device sync, before any launch; inside a CUDA graph
    capture the values cannot be read, so the maxima must be given and are trusted)."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together: pass both (or neither)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name}.dtype must be int32; got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape [batch + 1] with batch >= 1; got {tuple(cu.shape)}")
        if cu.device != device:
            raise ValueError(f"{name} must be on {device} like q; got {cu.device}")
        if cu.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous; got stride {cu.stride()}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be [batch + 1]; got {tuple(cu_seqlens_q.shape)} "
                         f"and {tuple(cu_seqlens_k.shape)}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"{name} must be an int >= 0 or None; got {m!r}")
    if cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing():
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("inside a CUDA graph capture pass max_seqlen_q and max_seqlen_k (the offsets cannot be "
                             "read there)")
        return max_seqlen_q, max_seqlen_k
    found = []
    both = torch.stack([cu_seqlens_q, cu_seqlens_k]).cpu()  # one copy, one sync for both offsets
    for name, c, total, given in (("cu_seqlens_q", both[0], total_q, max_seqlen_q),
                                  ("cu_seqlens_k", both[1], total_k, max_seqlen_k)):
        lengths = c[1:] - c[:-1]
        if int(c[0]) != 0:
            raise ValueError(f"{name}[0] must be 0; got {int(c[0])}")
        if bool((lengths < 0).any()):
            raise ValueError(f"{name} must be non-decreasing; got {c.tolist()}")
        if int(c[-1]) > total:
            raise ValueError(f"{name}[-1] = {int(c[-1])} exceeds the packed tensor's {total} rows")
        longest = int(lengths.max())
        if given is not None and given < longest:
            raise ValueError(f"max_seqlen_{name[-1]} = {given} is less than the longest request ({longest})")
        found.append(longest if given is None else given)
    return found[0], found[1]


def check_sink(learnable_sink, heads: int, device) -> None:
    """The attention sink: [heads] float32 on the inputs' device, contiguous."""
    if not isinstance(learnable_sink, torch.Tensor):
        raise ValueError(f"learnable_sink must be a torch.Tensor or None; got {type(learnable_sink).__name__}")
    if tuple(learnable_sink.shape) != (heads,):
        raise ValueError(f"learnable_sink must have shape [heads] = ({heads},); got {tuple(learnable_sink.shape)}")
    if learnable_sink.dtype != torch.float32:
        raise ValueError(f"learnable_sink.dtype must be float32; got {learnable_sink.dtype}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink must be on {device} like q; got {learnable_sink.device}")
    if learnable_sink.stride(0) != 1 and heads > 1:
        raise ValueError(f"learnable_sink must be contiguous; got stride {learnable_sink.stride()}")


def check_compressed(compressed_kv, compress_ratio, k, v) -> None:
    """DeepSeek-V4's compressed entries: [batch, entries, kv_heads, head_dim] like k (dtype, device,
    batch, kv heads, head_dim, TMA strides; 0 entries allowed), K = V like the window's keys (k and
    v one tensor), and a compression ratio that is an int >= 1."""
    if compressed_kv is None or compress_ratio is None:
        raise ValueError("compressed_kv and compress_ratio go together: pass both (or neither)")
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int) or not 1 <= compress_ratio < 2**31:
        raise ValueError(f"compress_ratio must be a positive int; got {compress_ratio!r}")
    check_bshd("compressed_kv", compressed_kv, (k.shape[3],), min_seqlen=0,
               dims=("batch", "entry", "kv head", "head_dim"))
    check_same("k", k, "compressed_kv", compressed_kv)
    b, _, hk, _ = k.shape
    if compressed_kv.shape[0] != b or compressed_kv.shape[2] != hk:
        raise ValueError(f"compressed_kv must be [batch = {b}, entries, kv_heads = {hk}, head_dim]; got "
                         f"{tuple(compressed_kv.shape)}")
    if v is not None and not (v is k or (v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
                                         and v.shape == k.shape)):
        raise ValueError("compressed entries are K = V rows: pass the window's keys as one tensor (k is v)")


def check_gather_layout(compressed_kv, arch: str, name: str = "compressed_kv") -> None:
    """What the top-k gather reads of ``compressed_kv`` [batch, entries, kv_heads, head_dim], past
    ``check_readable`` (checked by ``check_compressed``). sm90: nothing more; its producer warps
    address every row by the tensor's own (batch, entry, kv head) strides (cp.async, 16 bytes a copy).
    sm100: TMA gather4 reads one 2D tensor (``common.sm100_kv.gather_view``: batch x entries rows of
    the entry stride, kv_heads x head_dim unit-stride columns), where batch b's entry j is row
    b * entries + j and kv head hk's columns start at hk * head_dim; that is the tensor's element
    (b, j, hk, x) for every coordinate iff the batch stride is entries x the entry stride (or there is
    one batch entry, or no entry) and the kv-head stride is head_dim (or there is one kv head).
    Index mode (one batch entry, one kv head) and a variable-length batch's packed entries (one
    batch) need neither."""
    if arch != "sm100":
        return
    b, n, hk, d = compressed_kv.shape
    s_b, s_n, s_h, _ = compressed_kv.stride()
    if hk > 1 and s_h != d:
        raise ValueError(f"{name}'s kv-head stride ({s_h} elements) must equal its head_dim ({d}) for the sm100 "
                         f"top-k gather, which reads an entry's {hk} kv heads as one row of {hk} x {d} columns; "
                         f"got strides {compressed_kv.stride()}")
    if b > 1 and n > 0 and s_b != n * s_n:
        raise ValueError(f"{name}'s batch stride ({s_b} elements) must be entries x its entry stride ({n} x {s_n} = "
                         f"{n * s_n}) for the sm100 top-k gather, which reads batch b's entry j as row b * entries + "
                         f"j of one 2D view; got strides {compressed_kv.stride()}")


def check_kv_start(kv_start, seqlen_k: int) -> None:
    """``kv_start``: the absolute position of raw key 0 (the keys passed are the last rows of a longer
    sequence: a window cache, a context-parallel shard), an int >= 0 with kv_start + seqlen_k < 2^31."""
    if isinstance(kv_start, bool) or not isinstance(kv_start, int) or kv_start < 0 or kv_start + seqlen_k >= 2**31:
        raise ValueError(f"kv_start must be an int >= 0 with kv_start + seqlen_k < 2^31; got {kv_start!r}")


def check_topk(topk_indices, q, n_compressed: int, group: int, tile_m: int, arch: str,
               entry_limits: torch.Tensor | None = None, check_values: bool = True, name: str = "topk_indices") -> None:
    """Top-k compressed entries: [batch, seqlen_q, k] int32 on q's device, the last dim contiguous,
    every value -1 or an entry index in [0, n_compressed) (reads the values: one device sync, skipped
    inside a CUDA graph capture and where ``check_values`` is False: the kernel's own bound check
    then treats what lies outside as -1). The
    kernels gather one token's list per Q tile, so the query heads of a KV head must fill whole
    tiles (``group`` a multiple of the kernel's ``tile_m`` rows), or, on sm100, half of one (64
    heads on the 128-row tile: ``pack_heads.padded_topk_group``, rows 64 .. 127 padding).
    ``entry_limits`` (a variable-length batch, [seqlen_q] int32): token t's indices lie in
    [0, entry_limits[t]) instead, its request's entries. ``name``: the argument the errors name."""
    if not isinstance(topk_indices, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or None; got {type(topk_indices).__name__}")
    if topk_indices.dtype != torch.int32:
        raise ValueError(f"{name}.dtype must be int32; got {topk_indices.dtype}")
    b, sq = q.shape[0], q.shape[1]
    if topk_indices.dim() != 3 or tuple(topk_indices.shape[:2]) != (b, sq):
        raise ValueError(f"{name} must be [batch = {b}, seqlen_q = {sq}, k]; got {tuple(topk_indices.shape)}")
    if topk_indices.device != q.device:
        raise ValueError(f"{name} must be on {q.device} like q; got {topk_indices.device}")
    if topk_indices.shape[2] > 1 and topk_indices.stride(2) != 1:
        raise ValueError(f"{name} must have its last dim contiguous; got strides {topk_indices.stride()}")
    from dsv4_attention.common.pack_heads import padded_topk_group

    padded = arch == "sm100" and padded_topk_group(group, tile_m)  # 64 heads: one token a tile, half padding
    if group % tile_m and not padded:
        raise ValueError(f"{name}: each Q tile gathers one token's list, so the query heads per KV head "
                         f"({group}) must be a multiple of the {arch} kernel's {tile_m}-row tile"
                         + (f" or {tile_m // 2} (one token a tile, half of it padding)" if arch == "sm100" else ""))
    if not check_values or topk_indices.numel() == 0 or \
            (topk_indices.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if entry_limits is not None:
        idx = topk_indices[0]
        bad = (idx < -1) | (idx >= entry_limits[:, None])
        if bool(bad.any()):
            t, p = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name} values must be -1 or in [0, entries of the token's request); token {t} "
                             f"lists {int(idx[t, p])} at position {p}, its request has {int(entry_limits[t])} entries")
        return
    lo, hi = value_range(topk_indices)
    if lo < -1 or hi >= n_compressed:
        raise ValueError(f"{name} values must be -1 or in [0, {n_compressed}) (compressed_kv's entries); "
                         f"got min {lo}, max {hi}")


def varlen_request_starts(cu_seqlens_q) -> list | None:
    """A variable-length batch's first token of each request (host ints; None inside a CUDA graph
    capture, where values cannot be read)."""
    if cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return cu_seqlens_q[:-1].tolist()


def varlen_compressed_offsets(cu_seqlens_compressed, cu_seqlens_k, ratio: int, total_entries: int,
                              device) -> torch.Tensor:
    """Where each request's compressed entries start in a variable-length batch's packed
    compressed_kv ([requests + 1] int32 on the device): the given ``cu_seqlens_compressed``, checked
    like cu_seqlens (from 0, non-decreasing, the last at most ``total_entries``), or, when None,
    floor(keys / ratio) entries per request (DeepSeek-V4's compressor keeps one entry per ``ratio``
    raw tokens), accumulated from cu_seqlens_k on the device. Reads the values (one sync), except
    inside a CUDA graph capture."""
    if cu_seqlens_compressed is None:
        counts = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]) // ratio
        cu = torch.zeros_like(cu_seqlens_k)
        torch.cumsum(counts, 0, out=cu[1:])
        name = "the entries cu_seqlens_k implies (floor(keys / compress_ratio) per request)"
    else:
        cu = cu_seqlens_compressed
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != device \
                or cu.stride(0) != 1:
            raise ValueError(f"cu_seqlens_compressed must be a contiguous [requests + 1] int32 tensor on {device}; "
                             f"got {tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__}"
                             + (f" {cu.dtype} on {cu.device}" if isinstance(cu, torch.Tensor) else ""))
        if cu.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_compressed must have cu_seqlens_k's shape {tuple(cu_seqlens_k.shape)}; got "
                             f"{tuple(cu.shape)}")
        name = "cu_seqlens_compressed"
    if cu.is_cuda and torch.cuda.is_current_stream_capturing():
        return cu
    c = cu.cpu()
    if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must start at 0 and be non-decreasing; got {c.tolist()}")
    if int(c[-1]) > total_entries:
        raise ValueError(f"{name} end at entry {int(c[-1])}, past compressed_kv's {total_entries} rows")
    return cu


def varlen_entry_limits(cu_compressed: torch.Tensor, cu_seqlens_q: torch.Tensor, total_q: int):
    """Each query token's request's compressed entry count ([total_q] int32; None inside a CUDA
    graph capture): the bound of its top-k indices."""
    if cu_compressed.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    counts = (cu_compressed[1:] - cu_compressed[:-1]).long()
    tokens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    limits = torch.full((total_q,), 2**31 - 1, dtype=torch.long, device=cu_compressed.device)  # tokens of no request
    used = int(cu_seqlens_q[-1])
    limits[:used] = torch.repeat_interleave(counts, tokens, output_size=used)
    return limits


def check_positions(positions, batch: int, seqlen_q: int, device, request_starts=None) -> torch.Tensor:
    """The query tokens' absolute positions: [seqlen_q] (shared by every request) or [batch, seqlen_q]
    int32 on q's device, contiguous, every value in [0, 2^30) and non-decreasing along a request's
    tokens (a kernel bounds a Q tile's keys by its first and last token). Returns the (1 or batch,
    seqlen_q) view the kernels take. Reads the values (one device sync), except inside a CUDA graph
    capture: a decreasing list there hides keys from some rows, it never reads out of bounds.
    ``request_starts`` (a variable-length batch: [total_q] positions, each request's first token):
    a request's first position may lie below the previous request's last."""
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions must be a torch.Tensor or None; got {type(positions).__name__}")
    if positions.dtype != torch.int32:
        raise ValueError(f"positions.dtype must be int32; got {positions.dtype}")
    if tuple(positions.shape) not in ((seqlen_q,), (batch, seqlen_q)):
        raise ValueError(f"positions must be [seqlen_q] = ({seqlen_q},) or [batch, seqlen_q] = ({batch}, {seqlen_q}); "
                         f"got {tuple(positions.shape)}")
    if positions.device != device:
        raise ValueError(f"positions must be on {device} like q; got {positions.device}")
    if not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous; got strides {positions.stride()}")
    rows = positions.view(-1, seqlen_q)
    if positions.numel() == 0 or (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
        return rows
    lo, hi = torch.aminmax(rows)
    steps = rows[:, 1:] < rows[:, :-1]
    if request_starts is not None:  # a new request starts over
        starts = torch.tensor([t - 1 for t in request_starts if 0 < t < seqlen_q], dtype=torch.long)
        steps[:, starts.to(steps.device)] = False
    drops = steps.sum()
    lo, hi, drops = (int(x) for x in torch.stack([lo.long(), hi.long(), drops.long()]).tolist())
    if lo < 0 or hi >= 2**30:
        raise ValueError(f"positions must lie in [0, 2^30); got min {lo}, max {hi}")
    if drops:
        raise ValueError(f"positions must be non-decreasing along each request's tokens; {drops} steps decrease")
    return rows


def check_window(causal, window_size) -> tuple:
    """(left, right) with None for an unbounded side; causal means right = 0. Bounds are
    non-negative ints: no sentinel (such as -1) stands for "no window"."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool; got {causal!r}")
    if window_size is None:
        window_size = (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints >= 0 or None; got {window_size!r}")
    left, right = window_size
    for name, w in (("left", left), ("right", right)):
        if w is None:
            continue
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"window_size {name} must be an int >= 0 or None (unbounded); got {w!r}")
        if w > 2**31 - 1:
            raise ValueError(f"window_size {name} must be below 2**31; got {w}")
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True means window right = 0; got window_size {tuple(window_size)}")
        right = 0
    return left, right
