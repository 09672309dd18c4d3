"""The calling convention every attention stage shares, on torch tensors.

``forward(q, k, v, *, softmax_scale=None, out=None, lse_out=None) -> (o, lse)`` with
q [batch, seqlen_q, heads, head_dim], k and v [batch, seqlen_k, kv_heads, head_dim],
o like q (contiguous) and lse [batch, heads, seqlen_q] fp32 (natural log). The steps,
in order: validate everything (ValueError before any compile or launch), pick the
architecture from the device, handle seqlen_k = 0 on the host (every row is empty:
O = 0, LSE = -inf), then launch the stage's compiled kernel with
scale_log2 = softmax_scale * log2(e), the one numeric domain of every stage.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dsv4_attention.common import call_plan, jit, seams
from dsv4_attention.common.arch import arch_of_device
from dsv4_attention.common.autograd import refuse_grad
from dsv4_attention.common.validation import check_out, check_qkv, check_scale

LOG2E = math.log2(math.e)
MAX_GRID_YZ = 65535  # attention grids are (q tiles, heads, batch)


def attention_example_args(dtype: torch.dtype, head_dim: int, seqlen_k: int = 1000, *, kv_shared: bool = False,
                           seqused_k: bool = False, has_left: bool = False, has_right: bool = False,
                           plain: bool = False, varlen: bool = False, has_sink: bool = False,
                           has_compressed: bool = False, has_topk: bool = False, has_positions: bool = False,
                           split_kv: bool = False, kv_pages: int = 0, kv_pages_extra: int = 0, **_):
    """CPU arguments of an attention kernel for the kernel options given, as a call passes them
    (common/jit.py: compiled against their dtypes and ranks, every shape dynamic): K = V (one
    tensor as K and V) and the trailing seam bundles of stage D1's kernel and those built on it
    (``plain``: a kernel without them, stages B and C). ``kv_pages``: the compressed entries are a
    paged FP8 cache's bytes, [1, pages, 1, page bytes] uint8 (stage E's serving gather);
    ``kv_pages_extra``: a second such cache and its lists (``Entries.extra``, decode's)."""
    q = torch.empty(2, 300, 4, head_dim, dtype=dtype)
    k = torch.empty(2, seqlen_k, 2, head_dim, dtype=dtype)
    lse = torch.empty(2, 4, 300, dtype=torch.float32)
    v = k if kv_shared else k.clone()
    args = [q, k, v, q.clone(), lse, 0.125 * LOG2E, jit.STREAM]
    if not plain:  # stage D1's kernel on: its seams' bundles (common/seams.py)
        cu = torch.zeros(3, dtype=torch.int32) if varlen else None
        parts = None
        if split_kv:  # two splits of each batch entry: partial O and LSE at batch index s B + b
            parts = seams.SplitParts(torch.empty(4, 300, 4, head_dim, dtype=torch.float32),
                                     torch.empty(4, 4, 300, dtype=torch.float32), 2)
        args += seams.tail(
            seams.Lengths(torch.empty(2, dtype=torch.int32) if seqused_k else None, cu, cu, 300 if varlen else 0),
            seams.Window(127 if has_left else 0, 0),
            torch.zeros(4, dtype=torch.float32) if has_sink else None,
            seams.Entries(entries_example(dtype, head_dim, kv_pages) if has_compressed else None,
                          4 if has_compressed else 0,
                          torch.zeros(2, 300, 160, dtype=torch.int32) if has_topk else None, 0,
                          torch.zeros(2, 300, dtype=torch.int32) if has_positions else None,
                          cu if varlen and has_compressed else None,
                          entries_example(dtype, head_dim, kv_pages_extra) if kv_pages_extra else None,
                          torch.zeros(2, 300, 96, dtype=torch.int32) if kv_pages_extra else None),
            parts)
    return args


def entries_example(dtype, head_dim: int, kv_pages: int) -> torch.Tensor:
    """The compressed entries' CPU stand-in: bf16 / fp16 rows, or a paged FP8 cache's bytes."""
    if kv_pages:
        from dsv4_attention.common.kv_cache import page_layout

        return torch.empty(1, 8, 1, page_layout(kv_pages).used_bytes, dtype=torch.uint8)
    return torch.empty(2, 50, 2, head_dim, dtype=dtype)


def same_memory(k: torch.Tensor, v: torch.Tensor) -> bool:
    """k and v are one tensor's memory (same start, shape, strides, dtype): K = V."""
    return (k is v) or (k.data_ptr() == v.data_ptr() and k.shape == v.shape and k.stride() == v.stride()
                        and k.dtype == v.dtype and k.device == v.device)


def check_call(head_dims, q, k, v, softmax_scale, out, lse_out, max_seqlen_k: int | None = None,
               too_long: str = "") -> tuple:
    """The checks every attention stage's call makes, in order: q, k, v (``check_qkv``), the
    scale, the grid's extents, the outputs given. Returns (arch, scale)."""
    check_qkv(q, k, v, head_dims, max_seqlen_k, too_long)
    scale = check_scale(softmax_scale, q.shape[3])
    b, sq, h, _ = q.shape
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ValueError(f"heads and batch must each be at most {MAX_GRID_YZ} (grid y, z); got {h}, {b}")
    if out is not None:
        check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if lse_out is not None:
        check_out("lse_out", lse_out, (b, h, sq), torch.float32, q.device)
    return arch_of_device(q.device), scale


def outputs(q, out, lse_out) -> tuple:
    """(o, lse) of a [batch, seqlen_q, heads, d] call: the ones given, else new (o contiguous)."""
    b, sq, h, _ = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    return o, lse


def no_keys(o, lse, cu_seqlens_q=None) -> tuple:
    """The result of a call with no key at all, decided without a launch: O = 0, LSE = -inf.
    ``cu_seqlens_q`` (a variable-length call: o [total, heads, d], lse [heads, total]): the rows of
    the requests only, rows past the last one left as they are, as the kernel leaves them (masked
    on the device: no sync, and a CUDA graph may capture it)."""
    if cu_seqlens_q is None:
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    rows = torch.arange(o.shape[0], device=o.device) < cu_seqlens_q[-1]
    o.masked_fill_(rows[:, None, None], 0.0)
    lse.masked_fill_(rows[None, :], -math.inf)
    return o, lse


def launch(stage_id: str, kernels: dict, arch: str, q, k, v, o, lse, scale: float, options: dict, tail=(),
           plan_key=None, plan_tensors=()) -> None:
    """Launch the stage's kernel for (arch, dtype, head dim, ``options``) on q, k, v, o, lse, the
    scale (as scale * log2(e)) and the trailing arguments ``tail``; keep the call's plan under
    ``plan_key`` (common/call_plan.py; ``plan_tensors``: the further tensors it may take)."""
    args = [q, k, v, o, lse, float(scale * LOG2E), jit.STREAM, *tail]
    fn = jit.stage_kernel(stage_id, kernels, arch, q.dtype, q.shape[3], args, options)
    fn(*jit.call_args(args))
    call_plan.record(plan_key, fn, args, plan_tensors)


def attention_forward(stage_id: str, kernels: dict, head_dims, q, k, v, softmax_scale, out, lse_out,
                      max_seqlen_k: int | None = None, too_long: str = "", options: dict | None = None,
                      tail=(), plan=None):
    """The call of stages B, C and D1: check, pick the architecture from the device, handle a call
    with no key on the host, launch. ``options``: the kernel's compile-time options; ``tail``: its
    arguments after the stream (D1's kernel: ``seams.tail()``, every bundle unused). ``plan``: the caller's part of
    the call's signature (its options, hashable; None: never planned): a call whose signature has
    a plan skips everything but the alignment check and the allocation of its outputs.

    What every attention stage's ``forward`` (B to E) returns and raises:

    Returns:
        (o, lse): o like q, lse [batch, heads, seqlen_q] fp32 ([heads, total_q] varlen), natural
        log; written into ``out`` / ``lse_out`` when given. A row with no visible key: O = 0,
        LSE = -inf.

    Raises:
        ValueError: before any launch, naming the argument the kernel does not serve (dtype,
            device, shape, strides, alignment, head dim, lengths, indices).
        NotDifferentiableError: under grad mode, an input that requires grad (common/autograd.py).
    """
    refuse_grad(f"stage {stage_id}'s forward", q=q, k=k, v=v)
    key = None
    if plan is not None:
        key, done = call_plan.lookup(stage_id, q, k, v, softmax_scale, out, lse_out, plan, ())
        if done is not None:
            return done
    arch, scale = check_call(head_dims, q, k, v, softmax_scale, out, lse_out, max_seqlen_k, too_long)
    o, lse = outputs(q, out, lse_out)
    if k.shape[1] == 0:
        return no_keys(o, lse)
    launch(stage_id, kernels, arch, q, k, v, o, lse, scale, dict(options or {}), tail, key)
    return o, lse


def attention_demo_case(forward, flops, device, head_dim, batch, heads, seqlen_q, seqlen_k, check_rows=1024,
                        kv_heads=None, kv_shared=False):
    """One bf16 run, timed; O of the first batch's first ``check_rows`` queries against the
    float64 reference (the whole problem's float64 scores would not fit). Returns
    (errors, milliseconds, TFLOP/s)."""
    from dsv4_attention.common import bench
    from dsv4_attention.common.reference import attention
    from dsv4_attention.common.testing import errors, random_bshd

    q = random_bshd(batch, seqlen_q, heads, head_dim, torch.bfloat16, device)
    hk = heads if kv_heads is None else kv_heads
    k = random_bshd(batch, seqlen_k, hk, head_dim, torch.bfloat16, device)
    v = k if kv_shared else random_bshd(batch, seqlen_k, hk, head_dim, torch.bfloat16, device)
    o, lse = forward(q, k, v)
    rows = slice(0, min(check_rows, seqlen_q))
    e = errors(o[:1, rows], attention(q[:1, rows], k[:1], v[:1])[0])
    ms = bench.time_ms([lambda: forward(q, k, v, out=o, lse_out=lse)])
    return e, ms, bench.tflops(flops(batch, seqlen_q, seqlen_k, heads, head_dim), ms)


@dataclasses.dataclass(frozen=True)
class MaskedCall:
    """A call of the masked stages (D2-E), resolved: every check done, what the kernel is compiled
    for and called with. ``options``: the compile-time options (sorted pairs); ``tail``: the
    kernel's seam bundles (common/seams.py); ``partials``: split-KV's fp32 partial buffers (None: one unit a Q tile),
    merged into O and LSE with ``merge_sink`` after the launch."""

    arch: str
    scale: float
    options: tuple
    tail: tuple
    splits: int = 1
    partials: tuple | None = None
    merge_sink: torch.Tensor | None = None


def masked_attention_forward(stage_id: str, kernels: dict, head_dims, q, k, v, softmax_scale, out, lse_out, *,
                             tile_rows, p_in_smem=None, pack_gqa=None, seqused_k=None, window=(None, None),
                             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                             learnable_sink=None, compressed_kv=None, compress_ratio=None, topk_indices=None,
                             kv_start=0, index_mode=False, positions=None, cu_seqlens_compressed=None,
                             check_indices=True, num_splits=1, kv_pages=0, split_into=None, extra_pages=None):
    """The call of stages D2-D4: stage D1's options (K = V from the tensors, ``p_in_smem``) plus
    the packed group (D2: ``pack_gqa``, g chosen against ``tile_rows(arch, head_dim, kv_shared,
    p_in_smem)``), per-request key counts (D3: ``seqused_k``, validated before launch) and the
    window bounds (D4: ``window`` = (left, right), already validated) and variable-length batches
    (D3: ``cu_seqlens_q`` / ``cu_seqlens_k``, q, k, v [total, heads, head_dim], o like q, lse
    [heads, total_q]) and the attention sink (D5: ``learnable_sink`` [heads] fp32) and the
    compressed entries (E: ``compressed_kv`` [batch, entries, kv_heads, head_dim], K = V, visible
    by ``compress_ratio``, all of them or the ``topk_indices`` [batch, seqlen_q, k] each token lists,
    positions counted from ``kv_start``, the absolute position of raw key 0; common/compressed.py) and
    the query tokens' absolute positions (``positions`` [seqlen_q] or [batch, seqlen_q] int32,
    non-decreasing; None: bottom-right aligned). In a variable-length batch the compressed
    entries are packed too (``compressed_kv`` [total_entries, kv_heads, head_dim], request b's
    entries the rows ``cu_seqlens_compressed[b] ..``; None: floor(keys_b / ratio) entries each),
    ``topk_indices`` [total_q, k] indexes the token's request's entries and ``positions`` is
    [total_q], non-decreasing within each request. ``check_indices`` False: the top-k values are
    not read on the host (no device sync; the kernel masks an index outside [0, visible entries)
    like -1), so such a call is planned like one without lists. ``num_splits`` (split-KV decode,
    common/split_kv.py): 1 runs each Q tile in one unit; S > 1 cuts each tile's keys over S units
    of the persistent seesaw (sm90, K = V at head dim 384 / 512, batched tensors) and merges their
    fp32 partial results on the device, the sink applied there; None chooses S from the shapes
    (``split_kv.choose_splits``: 1 where the Q tiles already fill half the SMs). A split call is
    planned like an unsplit one (``call_plan.SplitPlan``: its count chosen once per signature,
    fresh partial buffers each call; ``call_plan.last_splits`` reports the count). ``kv_pages``
    (index mode): ``compressed_kv`` is a paged MODEL1 FP8 cache's bytes [1, pages, 1, page
    bytes] (common/kv_cache.py), ``kv_pages`` tokens a page, an index naming slot
    ``page * kv_pages + offset``; the kernel dequantizes what it gathers. ``split_into`` (o_part,
    lse_part) (batched, no varlen): ``split_kv.partial_buffers``-shaped fp32 views of a larger
    buffer; the call writes its S = o_part.shape[0] / batch splits there (S = 1 too) and merges
    nothing, its caller merging them with others (``decode``'s two key lists: one exact merge).
    ``extra_pages`` (bytes, page size, lists) (index mode with ``kv_pages``): a second paged FP8
    cache, [1, pages, 1, page bytes], and its lists [1, tokens, k_b]; a token's keys are both
    lists in one softmax (``decode`` in one launch; common/compressed.TwoListSpan).

    One straight line: the plan (a repeated signature replays it), the shapes of a
    variable-length call, the common checks (``check_call``), its offsets (``resolve_varlen``),
    the options (``resolve_masks``: one frozen :class:`MaskedCall`), the launch, the split merge."""
    refuse_grad(f"stage {stage_id}'s forward", q=q, k=k, v=v, learnable_sink=learnable_sink,
                compressed_kv=compressed_kv)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    plan_key = None
    # a call whose checks read tensor values (lengths, lists, positions) is validated every time
    plan_tensors = [learnable_sink, compressed_kv, topk_indices]
    if split_into is not None:  # the caller's buffers, in the slots a split call's own take
        plan_tensors += list(split_into)
    if extra_pages is not None:
        plan_tensors += [extra_pages[0], extra_pages[2]]
    if not varlen and seqused_k is None and (topk_indices is None or not check_indices) and positions is None:
        plan = call_plan.typed(p_in_smem, pack_gqa, window[0], window[1], kv_start, compress_ratio, index_mode,
                               check_indices, num_splits, kv_pages, split_into is not None,
                               None if extra_pages is None else extra_pages[1])
        plan_key, done = call_plan.lookup(stage_id, q, k, v, softmax_scale, out, lse_out, plan, plan_tensors)
        if done is not None:
            return None if split_into is not None else done
    call_plan.note_splits(None)  # until this call launches (a call with no key launches nothing)
    compressed = compressed_kv is not None or compress_ratio is not None or topk_indices is not None
    if cu_seqlens_compressed is not None and not (varlen and compressed):
        raise ValueError("cu_seqlens_compressed places the compressed entries of a variable-length batch: pass it "
                         "with cu_seqlens_q / cu_seqlens_k and compressed_kv")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be True, False or None; got {pack_gqa!r}")
    varlen_offsets = None
    if varlen:
        # [total, heads, head_dim] tensors run as one batch of the packed rows; the kernel's grid is
        # (tiles of the longest request) x heads x requests, each CTA offsetting into its request
        check_varlen_shapes(q, k, v, out, lse_out, seqused_k, compressed_kv, topk_indices, positions)
        o, lse = (torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out,
                  torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
                  if lse_out is None else lse_out)
        q, k, v, out, lse_out = q[None], k[None], v[None], o[None], lse[None]
        compressed_kv = None if compressed_kv is None else compressed_kv[None]
        topk_indices = None if topk_indices is None else topk_indices[None]
    arch, scale = check_call(head_dims, q, k, v, softmax_scale, out, lse_out)
    if varlen:
        varlen_offsets = resolve_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        compressed_kv, compress_ratio, topk_indices, positions,
                                        cu_seqlens_compressed, check_indices)
    call = resolve_masks(arch, scale, q, k, v, tile_rows=tile_rows, p_in_smem=p_in_smem, pack_gqa=pack_gqa,
                         seqused_k=seqused_k, window=window, learnable_sink=learnable_sink,
                         compressed_kv=compressed_kv, compress_ratio=compress_ratio, topk_indices=topk_indices,
                         kv_start=kv_start, index_mode=index_mode, positions=positions,
                         check_indices=check_indices, num_splits=num_splits, varlen=varlen_offsets,
                         kv_pages=kv_pages, split_into=split_into, extra_pages=extra_pages)
    o4, lse4 = outputs(q, out, lse_out)
    result = (o, lse) if varlen else (o4, lse4)
    if k.shape[1] == 0:
        if varlen_offsets is not None:
            no_keys(o, lse, varlen_offsets.cu_seqlens_q)
        else:
            no_keys(o4, lse4)
        return result
    if varlen_offsets is not None and varlen_offsets.max_seqlen_q == 0:
        # no request has a query row: no row to write and nothing to launch (a grid of 0 CTAs is a
        # launch error, which a batch of one request without queries met on the H200, 2026-11-29)
        return result
    if call.partials is not None and split_into is None:  # slots of the plan, allocated afresh by each planned call
        plan_tensors.extend(call.partials)
    launch(stage_id, kernels, arch, q, k, v, o4, lse4, scale, dict(call.options), call.tail,
           None if varlen else plan_key, plan_tensors)
    if split_into is not None:
        return None
    if call.partials is not None:
        call_plan.record_split(plan_key, call.splits)  # the kernel's plan (if any) becomes the split call's
        from dsv4_attention.common import split_kv

        split_kv.combine(*call.partials, o4, lse4, call.merge_sink)
    return result


def check_varlen_shapes(q, k, v, out, lse_out, seqused_k, compressed_kv, topk_indices, positions) -> None:
    """A variable-length call's ranks and output shapes (D3 and E's packed operands), first."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"with cu_seqlens, {name} must be [total_tokens, heads, head_dim]; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if seqused_k is not None:
        raise ValueError("seqused_k with cu_seqlens_k is not supported: give each request's keys by cu_seqlens_k")
    packed = (("compressed_kv", compressed_kv, 3, "[total_entries, kv_heads, head_dim]"),
              ("topk_indices", topk_indices, 2, "[total_q, k]"), ("positions", positions, 1, "[total_q]"))
    for name, t, dim, shape in packed:
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != dim):
            raise ValueError(f"with cu_seqlens, {name} must be {shape}; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if out is not None:
        check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if lse_out is not None:
        check_out("lse_out", lse_out, (q.shape[1], q.shape[0]), torch.float32, q.device)


@dataclasses.dataclass(frozen=True)
class VarlenOffsets:
    """A variable-length call's checked offsets: the longest request's tokens, each request's first
    token (where positions may drop), each request's first compressed entry, and each token's
    request's entry count (top-k value checks)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    request_starts: torch.Tensor | None = None
    cu_compressed: torch.Tensor | None = None
    entry_limits: torch.Tensor | None = None


def resolve_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, compressed_kv,
                   compress_ratio, topk_indices, positions, cu_seqlens_compressed, check_indices) -> VarlenOffsets:
    """Check a variable-length call's offsets (q, k, v as one batch [1, total, heads, d]) and derive
    what the kernel and the later checks need from them."""
    from dsv4_attention.common.validation import (
        check_compressed,
        check_cu_seqlens,
        varlen_compressed_offsets,
        varlen_entry_limits,
        varlen_request_starts,
    )

    max_q, _ = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[1], k.shape[1], q.device, max_seqlen_q,
                                max_seqlen_k)
    requests = cu_seqlens_q.shape[0] - 1
    if requests > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} requests (grid z); got {requests}")
    starts = cu_compressed = limits = None
    compressed = compressed_kv is not None or compress_ratio is not None or topk_indices is not None
    if positions is not None or (compressed and compressed_kv is not None):
        starts = varlen_request_starts(cu_seqlens_q)
    if compressed and compressed_kv is not None:
        check_compressed(compressed_kv, compress_ratio, k, k if same_memory(k, v) else v)
        cu_compressed = varlen_compressed_offsets(cu_seqlens_compressed, cu_seqlens_k, compress_ratio,
                                                  compressed_kv.shape[1], q.device)
        if topk_indices is not None and check_indices:  # the value check is its only reader
            limits = varlen_entry_limits(cu_compressed, cu_seqlens_q, q.shape[1])
    return VarlenOffsets(cu_seqlens_q, cu_seqlens_k, max_q, starts, cu_compressed, limits)


def resolve_masks(arch, scale, q, k, v, *, tile_rows, p_in_smem, pack_gqa, seqused_k, window, learnable_sink,
                  compressed_kv, compress_ratio, topk_indices, kv_start, index_mode, positions, check_indices,
                  num_splits, varlen: VarlenOffsets | None, kv_pages: int = 0, split_into=None,
                  extra_pages=None) -> MaskedCall:
    """Check the masked stages' options against the (batched) inputs and the architecture, in
    order (kv_start, seqused_k, the sink, the packed group, positions, the compressed entries and
    their lists, the split count), and resolve the call: the kernel's compile-time options and
    its trailing arguments. An option that is not used is not passed to the kernel, so each
    stage's kernel compiles only what the call needs."""
    from dsv4_attention.common import split_kv
    from dsv4_attention.common.pack_heads import pack_group
    from dsv4_attention.common.validation import (
        check_compressed,
        check_gather_layout,
        check_kv_start,
        check_positions,
        check_seqused_k,
        check_sink,
        check_topk,
    )

    left, right = window
    kv_shared = same_memory(k, v)
    options = {"kv_shared": kv_shared}
    if p_in_smem is not None:
        options["p_in_smem"] = bool(p_in_smem)
    if seqused_k is not None:
        options["seqused_k"] = True
    if left is not None:
        options["has_left"] = True
    if right is not None:
        options["has_right"] = True
    check_kv_start(kv_start, k.shape[1])
    if kv_start and varlen is not None:
        raise ValueError("kv_start with cu_seqlens is not supported: pass batched tensors")
    if seqused_k is not None:
        check_seqused_k(seqused_k, q.shape[0], k.shape[1], q.device)
    if learnable_sink is not None:
        check_sink(learnable_sink, q.shape[2], q.device)
    m = tile_rows(arch, q.shape[3], kv_shared, None if p_in_smem is None else bool(p_in_smem))
    options["pack_group"] = group = pack_group(pack_gqa, q.shape[2], k.shape[2], m)
    position_rows = None  # positions as the kernel gets them: (1 or batch, seqlen_q)
    if positions is not None:
        position_rows = check_positions(positions, q.shape[0], q.shape[1], q.device,
                                        request_starts=None if varlen is None else varlen.request_starts)
        options["has_positions"] = True
    entries = (None, None, None)  # (compressed_kv, compress_ratio, topk_indices) as the kernel gets them
    if compressed_kv is not None or compress_ratio is not None or topk_indices is not None:
        if topk_indices is not None and compressed_kv is None:
            raise ValueError("topk_indices lists entries of compressed_kv: pass compressed_kv and compress_ratio")
        if compressed_kv is None or compress_ratio is None:  # before any use of either
            raise ValueError("compressed_kv and compress_ratio go together: pass both (or neither)")
        n_entries = compressed_kv.shape[1]
        if kv_pages:  # a paged FP8 cache's bytes (index_attention checked its layout): every slot a row
            n_entries *= kv_pages
        elif varlen is None:  # varlen checked them first: its entry offsets need the ratio
            check_compressed(compressed_kv, compress_ratio, k, k if kv_shared else v)
        if topk_indices is not None:
            check_topk(topk_indices, q, n_entries, group, m, arch,
                       entry_limits=None if varlen is None else varlen.entry_limits, check_values=check_indices)
        if compressed_kv.shape[1] > 0 and (topk_indices is None or topk_indices.shape[2] > 0):
            entries = (compressed_kv, compress_ratio, topk_indices)  # else: the window alone
            options["has_compressed"] = True
            if topk_indices is not None:
                if kv_pages:
                    options["kv_pages"] = int(kv_pages)
                    if extra_pages is not None:  # decode's second cache and its lists, one launch
                        extra, extra_size, extra_lists = extra_pages
                        check_topk(extra_lists, q, extra.shape[1] * extra_size, group, m, arch,
                                   check_values=check_indices, name="extra_indices")
                        options["kv_pages_extra"] = int(extra_size)
                else:  # any layout check_compressed took, but sm100's gather4 reads one 2D view of the rows
                    check_gather_layout(compressed_kv, arch)
                options["has_topk"] = True
                if index_mode:  # the lists are every key (FlashMLA's sparse attention)
                    options["index_mode"] = True
    if split_into is not None:  # the caller's share of a larger merge (``decode``'s two lists)
        splits, partials = split_into[0].shape[0] // q.shape[0], tuple(split_into)
    else:
        splits = split_count(arch, q, k, kv_shared, group, window, entries, num_splits, varlen is not None,
                             0 if extra_pages is None else extra_pages[2].shape[2])
        partials = None
        if splits > 1:
            partials = split_kv.partial_buffers(splits, tuple(q.shape), (q.shape[0], q.shape[2], q.shape[1]),
                                                q.device)
    if partials is not None:
        options["split_kv"] = True  # the sink goes to the merge, not the kernel
    elif learnable_sink is not None:
        options["has_sink"] = True
    extra = (None, None) if "kv_pages_extra" not in options else (extra_pages[0], extra_pages[2])
    ent = seams.Entries(entries[0], int(entries[1] or 0), entries[2], int(kv_start or 0), position_rows,
                        None if varlen is None or entries[0] is None else varlen.cu_compressed, *extra)
    if varlen is None:
        lengths = seams.Lengths(seqused_k)
        sink = learnable_sink if partials is None else None
    else:
        options["varlen"] = True
        lengths = seams.Lengths(None, varlen.cu_seqlens_q, varlen.cu_seqlens_k, int(varlen.max_seqlen_q))
        sink = learnable_sink
    tail = seams.tail(lengths, seams.Window(int(left or 0), int(right or 0)), sink, ent,
                      None if partials is None else seams.SplitParts(*partials, splits))
    return MaskedCall(arch, scale, tuple(sorted(options.items())), tail, splits, partials,
                      learnable_sink if partials is not None else None)


def split_count(arch, q, k, kv_shared, group, window, entries, num_splits, varlen: bool, extra_keys: int = 0) -> int:
    """The call's split-KV count (common/split_kv.py): ``num_splits`` checked, or for None the
    library's choice from the keys a row sees at most (its window and compressed keys, and
    ``extra_keys``: a second list's)."""
    from dsv4_attention.common import split_kv
    from dsv4_attention.common.persistent import device_sms
    from dsv4_attention.common.tiles import uses_seesaw

    seesaw = uses_seesaw(arch, q.shape[3], kv_shared)
    if num_splits is not None:
        return split_kv.check_num_splits(num_splits, seesaw, varlen, arch)
    if not seesaw or varlen or arch != "sm90":
        return 1
    left, right = window
    keys = k.shape[1] if left is None else min(k.shape[1], left + q.shape[1] + (right or 0))
    if entries[0] is not None:
        keys += entries[2].shape[2] if entries[2] is not None else entries[0].shape[1]
    keys += extra_keys
    return split_kv.auto_splits(q.shape[0], q.shape[1], group, k.shape[2], keys, device_sms())
