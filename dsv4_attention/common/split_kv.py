"""Split-KV: one Q tile's KV tiles cut over several CTAs, and the partial results merged.

A decode step of few requests leaves most SMs idle: at 128 heads a token is two 64-row Q tiles,
so batch 4 is 8 work units on 132 SMs, each walking its 10-20 KV tiles alone, one after another
(the seesaw's time per tile is latency, not throughput, at that occupancy). With ``num_splits`` S,
the persistent seesaw (stage D1's skeleton) runs S work units per Q tile instead of one:

    unit (m_block, split s, head, batch):  visits v = 0 .. n_s - 1 of the tile's span, the tiles
                                           n_end_s - 1 - v, where (``split_visits``)
        per   = 2 ceil(ceil(n_tiles / S) / 2)        (even: the seesaw takes tiles in pairs)
        lo_s  = s per                                (visits before this split's first)
        n_s   = max(min(per, n_tiles - lo_s), 0)     (0: an empty split)
        n_end_s = n_tiles - lo_s

so the splits of a span take its tiles in the kernel's visit order (last first), each exactly
once (``tests/test_split_kv.py`` proves it over random spans with the kernel's own function,
against an off-by-one control). Every unit writes (no sink) its normalised O in fp32 and its LSE
(natural log) to partial buffers

    o_part   [S, batch, seqlen_q, heads, head_dim] fp32     (split s at batch index s B + b)
    lse_part [S, batch, heads, seqlen_q] fp32

an empty split O = 0 and LSE = -inf (its consumers load nothing and run the epilogue of rows
that saw no key: every element is written). ``combine`` then merges the S parts of each row
exactly as ``common/merge.py`` merges two (the splits' key sets are disjoint):

    G = max_s lse_s;  w_s = exp(lse_s - G);  LSE = G + log sum_s w_s
    O = sum_s (w_s / sum w) O_s,  times sigmoid(LSE - sink[h]) (D5's sink, applied once here)

a row whose parts are all -inf gives O = 0, LSE = -inf. ``choose_splits`` picks S for a call
that asks for it (``num_splits=None`` at the stage's entry): enough units to fill the SMs, each
split at least ``MIN_TILES`` tiles (a pair of pairs: the prologue, Q's load and the epilogue, is
a unit's fixed cost), at most ``MAX_SPLITS``. FlashMLA's decode does the same (its scheduler
metadata, a fixed cost of 5 blocks a request); ours cuts each Q tile evenly instead of walking
the batch's tiles in order, which keeps every unit's coordinates two divisions from its index.
"""

from __future__ import annotations

import torch

MAX_SPLITS = 64
AUTO_SPLITS = 32  # the most ``choose_splits`` takes (the merge reads S parts of each row)
MIN_TILES = 8  # a split's least KV tiles when the splits are chosen
# decode from FP8 pages (``e_fused.decode``): a list of 2-16 tiles whose gather, not the unit's
# fixed cost, is the time; one seesaw pair a split (tools/split_sweep.py --fp8, docs/serving.md)
DECODE_MIN_TILES = 2


def split_visits(n_tiles, split, num_splits):
    """(n_end, n_visits) of split ``split`` of a span of ``n_tiles`` tiles cut into ``num_splits``:
    its visits v = 0 .. n_visits - 1 are tiles n_end - 1 - v. Python or DSL integers alike (the
    kernel and the host proof call this one function)."""
    import cutlass  # here: a call that only merges (a loaded kernel's) must not import the DSL

    per = (n_tiles + num_splits - 1) // num_splits
    per = per + per % 2  # whole seesaw pairs: an odd split leaves the follower a tile short
    lo = split * per
    return n_tiles - lo, cutlass.max(cutlass.min(per, n_tiles - lo), 0)


def choose_splits(units: int, n_tiles: int, sms: int, min_tiles: int = MIN_TILES) -> int:
    """S for ``units`` Q tiles of about ``n_tiles`` KV tiles each on ``sms`` SMs: the most that
    keeps every unit in one wave (units S <= sms) and each split at least MIN_TILES tiles, at most
    AUTO_SPLITS. Measured on the H100 (tools/split_sweep.py, docs/stages/e_fused.md): the best
    count lies there for dense decode at 8k and 64k keys and the HCA layer at 1M tokens, batch
    1-64; a unit's fixed cost (launch, Q, the epilogue, the merge) is about that of 8 tiles, so
    DeepSeek-V4's 64k-token spans (10 tiles) are not split."""
    if units <= 0:
        return 1
    return max(1, min(AUTO_SPLITS, sms // units, n_tiles // min_tiles))


def auto_splits(batch: int, seqlen_q: int, group: int, kv_heads: int, keys: int, sms: int,
                min_tiles: int = MIN_TILES) -> int:
    """``choose_splits`` for a call's shapes: 64-row Q tiles (the seesaw's) of ``group`` packed
    heads per token, ``keys`` a row sees at most (its window and compressed keys), ``sms`` SMs."""
    units = -(-seqlen_q * group // 64) * kv_heads * batch
    return choose_splits(units, -(-keys // 64), sms, min_tiles)


def check_num_splits(num_splits, seesaw: bool, varlen: bool, arch: str) -> int:
    """The call's split count (1: no split), refused with a ValueError before any launch where the
    kernel cannot split: only the sm90 persistent seesaw (K = V at head dims 384 and 512) has the
    split units and the partial store, and a variable-length batch's partial rows are not placed."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}] (or None: chosen); got {num_splits!r}")
    if num_splits > 1:
        if arch != "sm90":
            raise ValueError(f"num_splits > 1 (split-KV decode) is built for sm90 only; this call runs on {arch}")
        if not seesaw:
            raise ValueError("num_splits > 1 needs the persistent seesaw kernel: K = V (one tensor as k and v) at "
                             "head dim 384 or 512")
        if varlen:
            raise ValueError("num_splits > 1 with cu_seqlens is not supported: pass batched tensors (seqused_k "
                             "gives each request's keys)")
    return num_splits


def partial_buffers(num_splits: int, o_shape: tuple, lse_shape: tuple, device):
    """(o_part, lse_part): the kernel's fp32 partial outputs for O of ``o_shape`` [B, seqlen_q,
    heads, d] and LSE of ``lse_shape`` [B, heads, seqlen_q], split s of batch entry b at batch
    index s B + b. Left unset: the kernel writes every element, an empty split's too."""
    b = o_shape[0]
    o_part = torch.empty((num_splits * b, *o_shape[1:]), dtype=torch.float32, device=device)
    lse_part = torch.empty((num_splits * b, *lse_shape[1:]), dtype=torch.float32, device=device)
    return o_part, lse_part


def combine_torch(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  sink: torch.Tensor | None = None):
    """``combine`` in torch: the parts folded through ``common/merge.merge_attention`` (the
    project's exact merge of disjoint key sets, in fp32), then the sink. The CPU's form of the
    merge and the specification the kernel's merge is tested against."""
    from dsv4_attention.common.merge import merge_attention, sink_scale

    b = o.shape[0]
    acc_o, acc_l = o_part[:b], lse_part[:b]
    for i in range(1, o_part.shape[0] // b):
        acc_o, acc_l = merge_attention(acc_o, acc_l, o_part[i * b:(i + 1) * b], lse_part[i * b:(i + 1) * b])
    if sink is not None:  # O *= sigmoid(LSE - sink[h]); an empty row (LSE = -inf) stays 0, any sink
        acc_o = acc_o * sink_scale(acc_l, sink[None, :, None]).transpose(1, 2)[..., None]
    o.copy_(acc_o)
    lse.copy_(acc_l)
    return o, lse


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
            sink: torch.Tensor | None = None):
    """Merge the S partial attentions (``partial_buffers``' layout) of each row into ``o`` (its
    dtype) and ``lse`` in place, the sink's sigmoid applied to O: one launch of
    ``common/split_combine.SplitCombine`` on a GPU (a decode step's merge is a few microseconds;
    torch's dozen kernels cost more than the split saved), ``combine_torch`` on the CPU."""
    return merge_for(o_part, lse_part, o, lse, sink)(o_part, lse_part, o, lse, sink)


def merge_for(o_part, lse_part, o, lse, sink):
    """The merge a call of this signature runs (called as ``combine``): the compiled one
    (:class:`Merge`) on a GPU, ``combine_torch`` on the CPU."""
    return Merge(o_part, lse_part, o, lse, sink) if o.is_cuda else combine_torch


class Merge:
    """The compiled merge for one call signature (O's dtype, head dim and device; with or without
    a sink), looked up once from a call's buffers: a planned split call (``call_plan.SplitPlan``)
    keeps its ``Merge`` and calls it with each call's buffers, no lookup repeated per call."""

    __slots__ = ("fn",)

    def __init__(self, o_part, lse_part, o, lse, sink):
        from dsv4_attention.common import jit
        from dsv4_attention.common.arch import arch_of_device

        args = [o_part, lse_part, o, lse, sink, o_part.shape[0] // o.shape[0], jit.STREAM]
        self.fn = jit.stage_kernel("split_combine", COMBINE_KERNELS, arch_of_device(o.device), o.dtype, o.shape[3],
                                   args, {"has_sink": sink is not None})

    def __call__(self, o_part, lse_part, o, lse, sink):
        from dsv4_attention.common import jit

        self.fn(*jit.call_args([o_part, lse_part, o, lse, sink, o_part.shape[0] // o.shape[0], jit.STREAM]))
        return o, lse


#: the merge kernel (common/split_combine.py), architecture-neutral: plain loads and stores
COMBINE_KERNELS = {"sm90": "dsv4_attention.common.split_combine:SplitCombine",
                   "sm100": "dsv4_attention.common.split_combine:SplitCombine"}
