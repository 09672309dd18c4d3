"""Stage E: DeepSeek-V4's attention in one launch: the sliding window and the compressed entries in
one softmax, with the sink.

For every query token t (absolute position t' = t + seqlen_k - seqlen_q, D4's bottom-right
alignment) and head h, one softmax over the union of

1. the raw keys D4's window and D3's lengths leave visible (DeepSeek-V4: ``window_size=(127, 0)``,
   keys t' - 127 .. t'), and
2. the compressed entries j < floor((t' + 1) / compress_ratio) of ``compressed_kv`` (HCA layers:
   ratio 128, every visible entry),

then O *= sigmoid(LSE - sink[h]) (D5). Both key sets are K = V rows of the same head_dim: the
kernel streams their tiles through one SMEM ring into one online softmax (common/compressed.py),
so the result is the exact softmax over the union, not a merge of two rounded halves. Without
``compressed_kv`` this is stage D5. With ``topk_indices`` (DeepSeek-V4's CSA layers) only the
entries each token lists take part, gathered by the kernel (sm90: cp.async by the producer
warpgroup; sm100: TMA gather). ``index_attention``: FlashMLA's sparse attention (index lists as a
token's only keys) on the same kernel. ``kv_start`` places the raw keys in the sequence when they are only its last
rows; ``positions`` places each query token (non-decreasing absolute positions: a prefill chunk
anywhere in its sequence). Variable-length batches (``cu_seqlens``) pack the compressed entries
as they pack the tokens (``cu_seqlens_compressed``; common/compressed.varlen_entries).
"""

from __future__ import annotations

import math

import torch

from dsv4_attention.common import autograd, interface, jit
from dsv4_attention.common.autograd import refuse_grad
from dsv4_attention.common.validation import check_readable, check_window, value_range
from dsv4_attention.stages.d2_pack_heads import tile_rows
from dsv4_attention.stages.d4_causal_window import visible_pairs
from dsv4_attention.stages.e_fused import decode_schedule as schedule
from dsv4_attention.stages.e_fused.decode_schedule import DecodeSchedule

ID = "e"
NAME = "fused"
ADDS = "window + compressed entries in one softmax, one launch (DeepSeek-V4's HCA attention with its sink)"
HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "sm90": "dsv4_attention.stages.e_fused.sm90:FlashAttentionESm90",
    "sm100": "dsv4_attention.stages.e_fused.sm100:FlashAttentionESm100",
}
#: what the CPU demo compiles at every head dim: DeepSeek-V4's HCA layer (window, sink, compressed)
DEMO_OPTIONS = {"kv_shared": True, "pack_group": 64, "has_left": True, "has_right": True, "has_sink": True,
                "has_compressed": True}

__all__ = ["forward", "index_attention", "decode", "DecodeSchedule", "flops"]


make_kernel = jit.kernel_maker(KERNELS)
#: CPU arguments to compile against (the kernels are shape-dynamic)
example_args = interface.attention_example_args


def forward(q, k, v=None, *, compressed_kv: torch.Tensor | None = None, compress_ratio: int | None = None,
            topk_indices: torch.Tensor | None = None, softmax_scale: float | None = None,
            learnable_sink: torch.Tensor | None = None, causal: bool = False,
            window_size=(None, None), seqused_k: torch.Tensor | None = None,
            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, pack_gqa: bool | None = None,
            kv_start: int = 0, positions: torch.Tensor | None = None,
            cu_seqlens_compressed: torch.Tensor | None = None, out=None, lse_out=None, p_in_smem: bool | None = None,
            check_indices: bool = True, num_splits: int | None = 1):
    """Stage D5's attention over the window's keys plus the compressed entries.

    ``v`` None: K = V, ``k`` serves as both (DeepSeek-V4's ``kv``). ``compressed_kv``
    [batch, entries, kv_heads, head_dim] (K = V rows, k's dtype) with ``compress_ratio`` (int >= 1):
    entry j is visible to query i iff j < floor((i + seqlen_k - seqlen_q + 1) / ratio): all of them,
    or only those ``topk_indices`` [batch, seqlen_q, k] int32 lists per token (-1 padded; DeepSeek-V4's
    CSA layers; the query heads of a KV head must fill whole Q tiles: 64 or 128 heads at head dim 512
    on sm90, 128 on sm100, and 64 there too, one token a 128-row tile, half of it padding).
    ``kv_start``: the absolute position of ``k``'s row 0 when ``k`` holds only the last
    rows of a longer sequence (DeepSeek-V4's window cache; a context-parallel shard with its halo):
    the window is taken in ``k``'s rows as always, the compressed visibility at the absolute position
    kv_start + i + seqlen_k - seqlen_q. ``positions`` ([seqlen_q] or [batch, seqlen_q] int32,
    non-decreasing along a request's tokens): the query tokens' absolute positions instead of that
    alignment (a prefill chunk placed anywhere in its sequence; raw key j stays at kv_start + j):
    query i sees raw key j iff positions[i] - left <= kv_start + j <= positions[i] + right and entry j
    iff j < floor((positions[i] + 1) / ratio). Variable-length batches (``cu_seqlens_q`` /
    ``cu_seqlens_k``, q [total_q, heads, d], kv [total_k, kv_heads, d]): ``compressed_kv`` is
    packed too, [total_entries, kv_heads, d], request b's entries the rows
    ``cu_seqlens_compressed[b] .. cu_seqlens_compressed[b + 1]`` (None: floor(keys_b / ratio) each,
    in order), ``topk_indices`` [total_q, k] indexes the token's own request's entries, and
    ``positions`` [total_q] is non-decreasing within each request. ``check_indices`` (default True)
    reads the lists on the host to refuse a value outside [-1, entries) with a ValueError: one
    device synchronisation per call. False (an engine that builds its own lists): the lists are not
    read and cost no synchronisation (a ``cu_seqlens_q`` call still reads its offsets to check
    them), and a fixed-length call is planned like one without lists (common/call_plan.py); the
    kernel treats any value outside [0, the token's visible entries) as -1. ``num_splits``
    (split-KV decode, common/split_kv.py; sm90, batched tensors, head dim 384 / 512): each Q
    tile's keys cut over that many CTAs and merged exactly (fp32 parts), for a decode step of few
    requests, whose Q tiles alone would leave most SMs idle; None chooses (1 where the Q tiles
    fill half the SMs). Layouts (q, k, v, ``compressed_kv``): read in place, any strides with the
    last dim contiguous, the others multiples of 16 bytes and the data 16-byte aligned (TMA; sm90's
    top-k gather); sm100's top-k gather (TMA gather4 over one 2D view of the entries) further needs
    ``compressed_kv``'s batch stride to be entries x its entry stride (unless batch is 1) and its
    kv-head stride to be head_dim (unless one kv head), both checked before launch
    (``validation.check_gather_layout``).

    Returns / Raises: as every attention stage (``common/interface.attention_forward``); LSE is
    over both key sets and never includes the sink.
    """
    if v is None:
        v = k
    window = check_window(causal, window_size)
    return interface.masked_attention_forward(ID, KERNELS, HEAD_DIMS, q, k, v, softmax_scale, out, lse_out,
                                              tile_rows=tile_rows, p_in_smem=p_in_smem, pack_gqa=pack_gqa,
                                              seqused_k=seqused_k, window=window, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                              max_seqlen_k=max_seqlen_k, learnable_sink=learnable_sink,
                                              compressed_kv=compressed_kv, compress_ratio=compress_ratio,
                                              topk_indices=topk_indices, kv_start=kv_start, positions=positions,
                                              cu_seqlens_compressed=cu_seqlens_compressed,
                                              check_indices=check_indices, num_splits=num_splits)


def index_attention(q, kv, indices, *, topk_length=None, attn_sink=None, softmax_scale: float | None = None,
                    out=None, check_indices: bool = True, num_splits: int | None = 1):
    """Index mode: FlashMLA's ``flash_mla_sparse_fwd`` semantics on stage E's kernel. Query token t
    attends to the rows ``indices[t, 0, :topk_length[t]]`` of ``kv`` (-1 = none), its only keys.
    ``kv`` may also be an inference engine's paged FP8 cache (MODEL1, common/kv_cache.py; sm90):
    an index names slot ``block * page_block_size + offset``, and the kernel dequantizes each row
    it gathers (no bf16 copy of the cache is made).

    The query heads must fill whole Q tiles: 64 or 128 (DeepSeek-V4-Flash and -Pro) on both archs
    (sm100 runs 64 heads one token a 128-row tile, rows 64 .. 127 computed, never stored). Unlike
    FlashMLA: its d_qk = 576 / d_v = 512 split is not served (K = V rows of one head_dim), and a
    token with no valid index gets LSE = -inf (FlashMLA: +inf).

    Args:
        q: [tokens, heads, d] bf16/fp16; any layout the copy engines read (last dim contiguous,
            other strides multiples of 16 bytes, data 16-byte aligned), read in place.
        kv: [rows, 1, d] K = V rows, same layout rule (its extent-1 middle stride is never read);
            or MODEL1 FP8 pages [num_blocks, page_block_size, 1, 584] float8_e4m3fn (or uint8),
            each page's bytes contiguous, pages 16-byte aligned (``kv_cache.quantize_kv_cache``'s
            form), with bf16 q at head dim 512.
        indices: [tokens, 1, k] int32, -1 padded, any layout (copied into the kernel's form).
        topk_length: [tokens] int32 in [0, k] (default k): each token's list length.
        attn_sink: [heads] fp32 or None: O *= sigmoid(LSE - sink[h]).
        softmax_scale: default d ** -0.5.
        out: [tokens, heads, d] like q, contiguous (optional).
        check_indices: refuse an index outside [-1, rows) or a length outside [0, k] with a
            ValueError (a device synchronisation per call); False (FlashMLA's contract): not read,
            the kernel takes an index outside [0, rows) as -1 and a length past k as k.
        num_splits: as ``forward``'s (split-KV, for decode steps of few tokens).

    Returns:
        (o [tokens, heads, d] like q, lse [tokens, heads] fp32): natural log, without the sink;
        O = 0 and LSE = -inf for a token with no valid index.

    Raises:
        ValueError: before any launch, naming the argument (rank, shape, dtype, stride, index).
        NotDifferentiableError: under grad mode, an input that requires grad where no gradient
            exists (a paged FP8 cache, ``out``). Otherwise differentiable in q, kv and attn_sink
            (stage F's ``index_backward``, composed of torch operations: no kernel yet).
    """
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, kv, attn_sink)):
        why = "a paged FP8 cache has no gradient" if isinstance(kv, torch.Tensor) and kv.element_size() == 1 else \
            "out is given" if out is not None else None
        if why is None:  # differentiable: the kernel forward, stage F's torch backward (common/autograd.py)
            sink = None if attn_sink is None else attn_sink.detach()

            def run_forward():
                return index_attention(q.detach(), kv.detach(), indices, topk_length=topk_length, attn_sink=sink,
                                       softmax_scale=softmax_scale, check_indices=check_indices, num_splits=num_splits)

            return autograd.index_attention(q, kv, attn_sink, indices, topk_length, softmax_scale, run_forward)
        raise autograd.NotDifferentiableError(f"index_attention cannot be differentiated here: {why}. Call it under "
                                              f"torch.no_grad() or with detached inputs (docs/training.md)")
    kv, kv_pages, idx = index_source(q, kv, indices, topk_length, check_indices)
    return index_launch(q, kv, kv_pages, idx, attn_sink, softmax_scale, out, check_indices, num_splits)


def index_source(q, kv, indices, topk_length, check_indices):
    """Index mode's checked source: (kv as the kernel reads it, its page size or 0, the lists
    [1, tokens, k] with positions past ``topk_length`` made -1). bf16 rows [rows, 1, d] stay
    themselves; a paged FP8 cache becomes its bytes [pages, 1, page bytes] (``paged_source``)."""
    kv_pages = 0
    if isinstance(kv, torch.Tensor) and kv.dim() == 4 and kv.element_size() == 1:
        kv, kv_pages = paged_source(q, kv)
    for name, t, dim in (("q", q, 3), ("kv", kv, 3), ("indices", indices, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim:
            raise ValueError(f"{name} must be a rank-{dim} torch.Tensor; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if kv.shape[1] != 1 or indices.shape[1] != 1:
        raise ValueError(f"kv must be [rows, 1, d] and indices [tokens, 1, k]; got {tuple(kv.shape)}, "
                         f"{tuple(indices.shape)}")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must have q's {q.shape[0]} tokens; got {tuple(indices.shape)}")
    idx = indices[:, 0]
    if topk_length is not None:
        if not isinstance(topk_length, torch.Tensor) or topk_length.dtype != torch.int32 or \
                tuple(topk_length.shape) != (q.shape[0],) or topk_length.device != q.device:
            raise ValueError(f"topk_length must be a [tokens] = ({q.shape[0]},) int32 tensor on {q.device}")
        idx = cut_lists(idx, topk_length, check_indices, "topk_length")
    return kv, kv_pages, idx.contiguous()[None]


_POSITIONS: dict = {}


def list_positions(k: int, device) -> torch.Tensor:
    """0 .. k-1 as int32 on ``device``, made once per (k, device): a decode step's host work is
    launches, and an arange per call is one more."""
    t = _POSITIONS.get((k, device))
    if t is None:
        t = _POSITIONS[(k, device)] = torch.arange(k, dtype=torch.int32, device=device)
    return t


def cut_lists(idx: torch.Tensor, length: torch.Tensor, check_indices: bool, name: str) -> torch.Tensor:
    """``idx`` [n, ..., k] with every position at or past ``length[i]`` made -1 in row i (one
    compare and one select); with ``check_indices`` a length outside [0, k] is refused (one host
    read, skipped while a CUDA graph is captured: then a length past k keeps the whole list)."""
    k = idx.shape[-1]
    if check_indices and idx.shape[0] and not (length.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = value_range(length)
        if lo < 0 or hi > k:
            raise ValueError(f"{name} values must lie in [0, k = {k}]; got min {lo}, max {hi}")
    return torch.where(list_positions(k, idx.device) < length.view(-1, *(1,) * (idx.dim() - 1)), idx, -1)


def index_launch(q, kv, kv_pages, idx, attn_sink, softmax_scale, out, check_indices, num_splits,
                 split_into=None, lse_out=None, extra=None):
    """Index mode on ``index_source``'s operands: (o, lse [tokens, heads]); with ``split_into``
    (decode's share of a merge: fp32 partial views) the splits are written there and None is
    returned (``out`` / ``lse_out``: the kernel's O and LSE operands, LSE [1, heads, tokens], which
    a split launch never writes: decode hands its final ones). A paged cache's kernel
    (``kv_pages``) takes a one-row stand-in as its K operand: index mode loads no window tile (the
    descriptor is built all the same). ``extra`` (kv, kv_pages, idx) of a second paged FP8 cache:
    each token's keys are both lists, one softmax (``decode`` in one launch)."""
    if idx.shape[2] == 0 or kv.shape[0] == 0:  # no key for any token: decided without a launch
        if split_into is not None:
            split_into[0].zero_()
            split_into[1].fill_(-math.inf)
            return None
        o = torch.zeros_like(q) if out is None else out.zero_()
        return o, torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=torch.float32, device=q.device)
    # read in place, any layout the copy engines read (FlashMLA's test passes views into padded
    # buffers): q's token and head strides, kv's row stride 16-byte multiples, rows contiguous
    check_readable("q", q, ("token", "head", "d"))
    if kv_pages:
        k = _STAND_IN.get(q.device)
        if k is None:
            k = _STAND_IN[q.device] = torch.zeros(1, 1, 1, q.shape[2], dtype=q.dtype, device=q.device)
        entries = kv[None]
    else:
        check_readable("kv", kv, ("row", "kv head", "d"), skip=(1,))
        # [1, rows, 1, d] over kv's own memory (no copy); an extent-1 dim, never stepped, of a stride
        # TMA cannot take is given the row stride
        k = kv[None]
        if (kv.stride(1) * kv.element_size()) % 16:
            rows, row_stride = kv.shape[0], kv.stride(0)
            k = kv.as_strided((1, rows, 1, kv.shape[2]), (rows * row_stride, row_stride, row_stride, 1))
        entries = k
    res = interface.masked_attention_forward(ID, KERNELS, HEAD_DIMS, q[None], k, k, softmax_scale,
                                             None if out is None else out[None], lse_out,
                                             tile_rows=tile_rows, learnable_sink=attn_sink, compressed_kv=entries,
                                             compress_ratio=1, topk_indices=idx, index_mode=True,
                                             check_indices=check_indices, num_splits=num_splits, kv_pages=kv_pages,
                                             split_into=split_into,
                                             extra_pages=None if extra is None else (extra[0][None], *extra[1:]))
    if res is None:
        return None
    return res[0][0], res[1][0].transpose(0, 1)


_STAND_IN: dict = {}


def paged_source(q, cache):
    """A paged FP8 cache as index mode's kernel reads it: (its bytes as [pages, 1, page bytes]
    uint8 over the cache's own memory, tokens a page), after the checks the gather relies on."""
    from dsv4_attention.common import kv_cache

    lay = kv_cache.check_fp8_cache(cache, "kv")
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != 512:
        raise ValueError("a paged FP8 kv needs bf16 q [tokens, heads, 512] (MODEL1 rows are 512 dims); got "
                         f"{(q.dtype, tuple(q.shape)) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if cache.device != q.device:
        raise ValueError(f"kv must be on {q.device} like q; got {cache.device}")
    nb, stride = cache.shape[0], cache.stride(0)
    if cache.data_ptr() % 16 or (nb > 1 and stride % 16):
        raise ValueError(f"kv's pages must start 16-byte aligned; got data at {cache.data_ptr() % 16} mod 16, page "
                         f"stride {stride} bytes")
    raw = torch.as_strided(cache.view(torch.uint8), (nb, 1, lay.used_bytes), (stride, stride, 1))
    return raw, lay.tokens


def decode(q, k_cache, indices, *, topk_length=None, attn_sink=None, extra_k_cache=None, extra_indices=None,
           extra_topk_length=None, softmax_scale: float | None = None, check_indices: bool = True,
           num_splits: int | None = None, one_launch: bool | None = None, sched_meta=None):
    """DeepSeek-V4's sparse decode from an inference engine's paged caches: FlashMLA's
    ``flash_mla_with_kvcache(q, k_cache, None, None, 512, sched_meta, None, softmax_scale, False,
    True, indices, attn_sink, extra_k_cache, extra_indices, topk_length, extra_topk_length)``.

    Token (b, s) of q attends, in one softmax with the sink, to the cache slots
    ``indices[b, s, :topk_length[b]]`` of ``k_cache`` (the window) and
    ``extra_indices[b, s, :extra_topk_length[b]]`` of ``extra_k_cache`` (the compressed entries),
    -1 naming none. Two FP8 caches are read in one launch (index mode over both lists, resolved
    into one index space: common/compressed.TwoListSpan), split over the SMs where the batch is
    small; otherwise each list runs as index mode (``index_attention``) into fp32 partial results
    and one merge adds them exactly and applies the sink (common/split_kv.py). Either way the
    union's softmax, not a merge of rounded halves.

    Args:
        q: [batch, s_q, heads, 512] bf16 (heads 64 or 128; s_q 1-2 in decode, any).
        k_cache: MODEL1 FP8 pages [num_blocks, page_block_size, 1, 584] (common/kv_cache.py), or
            bf16 pages [num_blocks, page_block_size, 1, 512] (read in place when contiguous).
        indices: [batch, s_q, topk] int32, ``block * page_block_size + offset``, -1 padded.
        topk_length: [batch] int32 in [0, topk] or None (all of them).
        attn_sink: [heads] fp32 or None: O *= sigmoid(LSE - sink[h]).
        extra_k_cache, extra_indices, extra_topk_length: the second cache and its lists, alike
            (its own page size), or None.
        softmax_scale: default 512 ** -0.5.
        check_indices: as ``index_attention``'s (False: no host read of the lists or lengths).
        num_splits: splits of each list's keys (None: chosen from the shapes).
        one_launch: both lists in one launch, one softmax over both (two FP8 caches;
            common/compressed.TwoListSpan), split over the SMs only where the batch is small;
            False: each list its own launch into split partials, then a merge (sm90 only).
            None (default): one launch where there are two FP8 caches (1.3-1.9x faster than
            two launches on an H200, docs/serving.md), else two; on sm100 one launch is the
            only form (unsplit).
        sched_meta: a :class:`DecodeSchedule` (FlashMLA's ``sched_meta``), or None. Its first
            call decides the step (checks, form, splits, kernel) and records it; a later call
            of the same signature (shapes, strides, dtypes, options) replays it with this
            call's tensors: the host's work per step is a few views and the launch. Replayed:
            the one-launch form with ``check_indices=False``; other calls run in full.

    Returns:
        (out [batch, s_q, heads, 512] bf16, lse [batch, heads, s_q] fp32): natural log, without
        the sink; O = 0 and LSE = -inf for a token with no valid index (FlashMLA: +inf).

    Raises:
        ValueError: before any launch, naming the argument.
        NotDifferentiableError: under grad mode, an input that requires grad.
    """
    from dsv4_attention.common import split_kv
    from dsv4_attention.common.persistent import device_sms
    from dsv4_attention.common.validation import check_sink

    refuse_grad("decode", q=q, k_cache=k_cache, extra_k_cache=extra_k_cache, attn_sink=attn_sink)
    key = None
    if sched_meta is not None:
        if not isinstance(sched_meta, DecodeSchedule):
            raise ValueError(f"sched_meta must be a DecodeSchedule (e_fused.DecodeSchedule()) or None; got "
                             f"{type(sched_meta).__name__}")
        if not check_indices and one_launch is not False:  # the replayable form (decode_schedule.py)
            key = schedule.signature(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                                     extra_topk_length, softmax_scale, num_splits, one_launch)
            if key is not None and key == sched_meta.key:
                res = schedule.replay(sched_meta, q, (k_cache, extra_k_cache), (indices, extra_indices),
                                      (topk_length, extra_topk_length), attn_sink)
                if res is not None:
                    return res
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [batch, s_q, heads, 512]; got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    b, s_q, h, d = q.shape
    if d != 512 or q.dtype != torch.bfloat16:
        raise ValueError(f"q must be bf16 with head dim 512; got {q.dtype}, head dim {d}")
    if (extra_k_cache is None) != (extra_indices is None) or (extra_topk_length is not None and extra_indices is None):
        raise ValueError("extra_k_cache and extra_indices go together (extra_topk_length with them)")
    arch = interface.arch_of_device(q.device)  # a CPU tensor: refused here, naming the device
    if attn_sink is not None:
        check_sink(attn_sink, h, q.device)
    tokens = q.reshape(b * s_q, h, d)
    sources = []
    for name, length_name, cache, lists, length in (
            ("indices", "topk_length", k_cache, indices, topk_length),
            ("extra_indices", "extra_topk_length", extra_k_cache, extra_indices, extra_topk_length)):
        if cache is None:
            continue
        if not isinstance(lists, torch.Tensor) or lists.dim() != 3 or tuple(lists.shape[:2]) != (b, s_q):
            raise ValueError(f"{name} must be [batch = {b}, s_q = {s_q}, topk]; got "
                             f"{tuple(lists.shape) if isinstance(lists, torch.Tensor) else type(lists).__name__}")
        if length is not None:  # cut here, each request's lists at once (no per-token lengths)
            if not isinstance(length, torch.Tensor) or tuple(length.shape) != (b,) or length.dtype != torch.int32 \
                    or length.device != q.device:
                raise ValueError(f"{length_name} must be a [batch] = ({b},) int32 tensor on {q.device}")
            lists = cut_lists(lists, length, check_indices, length_name)
        if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.element_size() == 2:
            from dsv4_attention.common.kv_cache import cache_rows

            cache = cache_rows(cache)  # bf16 pages: the rows an index names
        kv, kv_pages, idx = index_source(tokens, cache, lists.reshape(b * s_q, 1, lists.shape[2]), None,
                                         check_indices)
        sources.append((kv, kv_pages, idx))
    two_fp8_caches = len(sources) == 2 and all(pages for _, pages, _ in sources)
    if one_launch is None:
        one_launch = two_fp8_caches
    if arch != "sm90" and not one_launch:
        raise ValueError(f"decode's two launches merge through split-KV's partial buffers, which the sm90 kernel "
                         f"writes; this device is {arch}: decode there runs in one launch (one_launch=True), "
                         f"which reads two paged FP8 caches; or call index_attention on each list")
    sms = device_sms()
    if one_launch:
        if not two_fp8_caches or not all(pages for _, pages, _ in sources):
            raise ValueError("one_launch reads two paged FP8 caches: pass k_cache and extra_k_cache as MODEL1 FP8 "
                             "pages with both lists")

        def splits(keys):  # sm100 runs unsplit (split-KV is sm90's)
            if num_splits is not None:
                return split_kv.check_num_splits(num_splits, True, False, arch)
            return split_kv.auto_splits(1, b * s_q, h, 1, keys, sms, split_kv.DECODE_MIN_TILES) if arch == "sm90" else 1

        live = [i for i, src in enumerate(sources) if src[2].shape[2] and src[0].shape[0]]
        if len(live) == 2:
            (kv, kv_pages, idx), extra = sources

            def launch():
                return index_launch(tokens, kv, kv_pages, idx, attn_sink, softmax_scale, None, check_indices,
                                    splits(idx.shape[2] + extra[2].shape[2]), extra=extra)
        else:  # one list names keys (or none): index mode on it
            kv, kv_pages, idx = sources[live[0]] if live else sources[0]

            def launch():
                return index_launch(tokens, kv, kv_pages, idx, attn_sink, softmax_scale, None, check_indices,
                                    splits(idx.shape[2]))
        if sched_meta is None:
            o, lse = launch()
        else:  # kept for the next call of this signature (key None: not replayable, recorded empty)
            o, lse = schedule.record(sched_meta, key, tuple((i, sources[i][0].shape[2]) for i in live), launch,
                                     lambda: _STAND_IN.get(q.device))
        return o.view(b, s_q, h, d), lse.view(b, s_q, h).permute(0, 2, 1)
    counts = [split_kv.auto_splits(1, b * s_q, h, 1, idx.shape[2], sms, split_kv.DECODE_MIN_TILES)
              if num_splits is None
              else split_kv.check_num_splits(num_splits, True, False, "sm90") for _, _, idx in sources]
    o_part, lse_part = split_kv.partial_buffers(sum(counts), (1, b * s_q, h, d), (1, h, b * s_q), q.device)
    o = torch.empty(1, b * s_q, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(1, h, b * s_q, dtype=torch.float32, device=q.device)
    first = 0
    for (kv, kv_pages, idx), n in zip(sources, counts, strict=True):
        index_launch(tokens, kv, kv_pages, idx, None, softmax_scale, o[0], check_indices, n,
                     split_into=(o_part[first:first + n], lse_part[first:first + n]), lse_out=lse)
        first += n
    split_kv.combine(o_part, lse_part, o, lse, attn_sink)
    return o.view(b, s_q, h, d), lse.view(h, b, s_q).permute(1, 0, 2)


def compressed_pairs(seqlen_q: int, seqlen_k: int, ratio: int, entries: int) -> int:
    """Visible (query, compressed entry) pairs of one head."""
    return sum(min(entries, max(i + seqlen_k - seqlen_q + 1, 0) // ratio) for i in range(seqlen_q))


def flops(batch, seqlen_q, seqlen_k, heads, head_dim, causal: bool = False, window_size=(None, None),
          compress_ratio: int | None = None, entries: int = 0, topk: int | None = None) -> int:
    """4 d per visible (query, key) pair; with ``topk``, k listed entries per token counted as
    computed (the kernel's work: every listed position takes part in the GEMMs)."""
    pairs = visible_pairs(seqlen_q, seqlen_k, causal, window_size)
    if topk is not None:
        pairs += seqlen_q * topk
    elif compress_ratio is not None:
        pairs += compressed_pairs(seqlen_q, seqlen_k, compress_ratio, entries)
    return 4 * batch * heads * pairs * head_dim


def demo_case(device, head_dim: int = 512):
    """bf16 DeepSeek-V4 HCA layer: 128 heads on one KV head, K = V, 4096 tokens, window (127, 0),
    32 compressed entries (ratio 128), sink."""
    from dsv4_attention.common import bench
    from dsv4_attention.common.reference import fused_attention
    from dsv4_attention.common.testing import errors, random_bshd

    s = 4096
    q = random_bshd(1, s, 128, head_dim, torch.bfloat16, device)
    kv = random_bshd(1, s, 1, head_dim, torch.bfloat16, device)
    ckv = random_bshd(1, s // 128, 1, head_dim, torch.bfloat16, device)
    sink = torch.randn(128, device=device)
    kw = {"causal": True, "window_size": (127, 0), "learnable_sink": sink, "compressed_kv": ckv,
          "compress_ratio": 128}
    o, _ = forward(q, kv, **kw)
    rows = slice(s - 256, s)  # the last tokens see the most entries
    e = errors(o[:, rows], fused_attention(q[:, rows], kv, **kw, positions=torch.arange(s - 256, s))[0])
    ms = bench.time_ms([lambda: forward(q, kv, **kw)])
    return e, ms, bench.tflops(flops(1, s, s, 128, head_dim, True, (127, 0), 128, s // 128), ms)
