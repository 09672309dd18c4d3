"""A decode step's schedule, decided once and replayed: FlashMLA's ``sched_meta`` for ``decode``.

An engine calls decode every step with tensors of the same shapes: the same two caches, new q and
lists in buffers of fixed size. What the call decides from those shapes (the checks, the one-launch
form, the split count, the compiled kernel and its argument list) is the same each step, so
``decode(..., sched_meta=s)`` decides it on its first call and records it in ``s``; a later call
whose *signature* equals the recorded one (every tensor's shape, strides, dtype and device, the
scalar options with their types) only rebuilds the views the kernel reads of this call's tensors
(the caches' bytes, the lists cut at their lengths) and launches: no checks repeated, no plan
looked up. A call with another signature runs the full path and records anew.

What is replayed: the one-launch form (two paged FP8 caches, ``one_launch`` None or True) with
``check_indices=False`` (the lists and lengths are not read on the host, as engines call it and as
FlashMLA never does). Any other call runs the full path every time, correct and unscheduled:
reading values on the host is validation that a shape cannot stand in for.

The views, as the full path builds them (``e_fused.index_source`` / ``paged_source`` /
``index_launch``), for a step of ``n = batch * s_q`` tokens::

    q      [batch, s_q, heads, 512]  ->  [1, n, heads, 512]                (tokens, then a unit dim)
    cache  [pages, page, 1, bytes]   ->  [1, pages, 1, used bytes] uint8   (its own memory)
    lists  [batch, s_q, k] (+ length [batch])  ->  [1, n, k] int32, -1 past the length
    kernel extra tensors: sink, window bytes, window lists (, extra bytes, extra lists)
"""

from __future__ import annotations

import torch

from dsv4_attention.common import call_plan


class DecodeSchedule:
    """What ``decode`` decided for one signature of its call (empty until its first call).

    Create one per decode configuration of an engine (as FlashMLA's ``FlashMLASchedMeta``) and pass
    it as ``sched_meta`` to every step's call. It holds no tensor of a call: only the compiled
    kernel's plan (``common/call_plan``), the byte counts of the caches' rows and which lists were
    read. Not thread-safe: one schedule per calling thread."""

    __slots__ = ("key", "plan", "live", "stand_in")

    def __init__(self):
        self.key = None  # the recorded call's signature
        self.plan = None  # the kernel's plan (call_plan.Plan / SplitPlan)
        self.live = ()  # ((source 0 window / 1 extra, used bytes a page), ...) in the kernel's order
        self.stand_in = None  # the kernel's one-row K operand (index mode reads no window tile)

    def __repr__(self):
        return f"DecodeSchedule({'recorded' if self.plan is not None else 'empty'})"


def signature(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
              softmax_scale, num_splits, one_launch):
    """The call's signature as a planned call's (``call_plan.meta`` of each tensor, the scalars
    ``typed``), or None where one cannot be formed (an argument that is not a tensor: the full path
    says why)."""
    try:
        return (tuple(map(call_plan.meta, (q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                                           extra_topk_length))),
                call_plan.typed(softmax_scale, num_splits, one_launch))
    except (AttributeError, TypeError):
        return None


def cache_bytes(cache: torch.Tensor, used: int) -> torch.Tensor:
    """A paged cache's bytes as the kernel reads them: [1, pages, 1, used] uint8 over its memory
    (``e_fused.paged_source``'s view, with its leading unit dim)."""
    nb, stride = cache.shape[0], cache.stride(0)
    return torch.as_strided(cache.view(torch.uint8), (nb, 1, used), (stride, stride, 1))[None]


def step_lists(lists: torch.Tensor, length, n: int) -> torch.Tensor:
    """A token's list as the kernel reads it: [1, n, k], positions at or past the request's length
    -1 (``e_fused.cut_lists`` without its host check), contiguous."""
    from dsv4_attention.stages.e_fused import list_positions

    if length is not None:
        k = lists.shape[-1]
        lists = torch.where(list_positions(k, lists.device) < length.view(-1, 1, 1), lists, -1)
    return lists.reshape(n, 1, lists.shape[-1])[:, 0].contiguous()[None]


def replay(s: DecodeSchedule, q, caches: tuple, lists: tuple, lengths: tuple, attn_sink):
    """The recorded call on this call's tensors: (out, lse) as ``decode`` returns them, or None
    where a data pointer breaks the recorded 16-byte alignment (the full path then refuses it)."""
    if (q.data_ptr() | caches[0].data_ptr() | (0 if caches[1] is None else caches[1].data_ptr())) & 15:
        return None
    b, s_q, h, d = q.shape
    n = b * s_q
    extra = [attn_sink]
    for source, used in s.live:
        extra.append(cache_bytes(caches[source], used))
        extra.append(step_lists(lists[source], lengths[source], n))
    call_plan.note_splits(getattr(s.plan, "splits", 1))
    # q as the full path hands it on (its tokens, then a unit dim): the same strides, the unit dim's too
    o4, lse4 = s.plan(q.reshape(n, h, d)[None], s.stand_in, s.stand_in, None, None, extra)
    return o4[0].view(b, s_q, h, d), lse4[0].transpose(0, 1).view(b, s_q, h).permute(0, 2, 1)


def record(s: DecodeSchedule, key, live: tuple, full_path, stand_in_of):
    """Run the full path (a one-launch call) and keep what it planned in ``s`` under ``key``
    (``stand_in_of()``: the K operand the launch used, made by its first call on the device)."""
    call_plan.forget_last_plan()
    result = full_path()
    plan, stand_in = call_plan.last_plan(), stand_in_of()
    if key is not None and plan is not None and live and stand_in is not None:
        s.key, s.plan, s.live, s.stand_in = key, plan, live, stand_in
    else:
        s.key = s.plan = s.stand_in = None
        s.live = ()
    return result
