"""Barriers counted by use: which phase of an mbarrier a role waits for, written down once.

An mbarrier completes one phase each time its expected arrivals are in; a waiter names the phase
by its parity. The origin carried phase bits by hand through nested loops and lost track of them
on multi-tile runs (seeds/002). Here every barrier of a slot is used in a fixed order, so use u
of a slot (u = 0, 1, 2, ...) completes phase u and is waited for with parity ``u & 1``; the
caller passes the use count (usually its loop counter), never a phase bit.

``UseCountedBarriers``: one mbarrier per slot, arrived on either by threads (``mbarrier.arrive``,
release semantics at CTA scope, so SMEM written before it is visible to a waiter) or by the MMA
warp (``tcgen05.commit``: arrives once every tcgen05 operation the thread issued before it has
completed). Waiting for use u is sound only if the barrier cannot complete use u + 1 before
the waiter has waited (after that, parity u & 1 names the phase in progress and the wait would
hang); each protocol in a kernel's docstring says why that holds.

``Handoff``: a one-slot producer/consumer exchange (full and empty barriers per slot). The
producer's use u waits until the consumer has released use u - 1 (for u = 0 it passes at once:
a fresh barrier's phase "-1" counts as complete), writes, arrives on full; the consumer waits
for full's use u, reads, arrives on empty. A slot is therefore never overwritten before it was
read, and a producer can never be more than one use ahead.
"""

from __future__ import annotations

import cutlass
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import tcgen05

from dsv4_attention.common.dsl_state import DslState


class UseCountedBarriers(DslState):
    """``slots`` mbarriers in SMEM at ``storage`` (``MemRange[Int64, slots]``), each expecting
    ``arrivals`` arrivals per phase. ``by_mma``: the arrival is a ``tcgen05.commit`` by one thread
    of the MMA warp (``arrivals`` must be 1). Initialised by warp 0 when constructed; publish with
    ``pipeline_init_arrive`` / ``pipeline_init_wait`` like any pipeline."""

    def __init__(self, storage, slots: int, arrivals: int, by_mma: bool = False):
        if by_mma and arrivals != 1:
            raise ValueError("a tcgen05.commit is one arrival")
        op = pipeline.PipelineOp.TCGen05Mma if by_mma else pipeline.PipelineOp.AsyncThread
        group = pipeline.CooperativeGroup(pipeline.Agent.Thread, arrivals)
        self.by_mma = by_mma
        self.slots = slots
        self.bars = pipeline.MbarrierArray(storage, slots, (op, group))

    # a runtime loop carries the barrier pointer through its iterations
    _DYNAMIC = ("bars",)

    def arrive(self, slot):
        """This thread's arrival on ``slot`` (by_mma: one tcgen05.commit, elected in the warp)."""
        if cutlass.const_expr(self.by_mma):
            self.bars.arrive(slot, None, tcgen05.CtaGroup.ONE)
        else:
            self.bars.arrive(slot, None)

    def wait(self, slot, use):
        """Block until use ``use`` (0, 1, ...) of ``slot`` has completed."""
        self.bars.wait(slot, use & 1)

    def wait_released(self, slot, use):
        """Block until use ``use - 1`` of ``slot`` has completed (a producer's wait on its empty
        barrier before its use ``use``; passes at once for use 0)."""
        self.bars.wait(slot, (use & 1) ^ 1)


class Handoff(DslState):
    """One-slot producer -> consumer exchanges, ``slots`` of them, each between ``arrivals``
    producer threads and ``arrivals`` consumer threads. ``storage`` holds 2 * slots mbarriers
    (full, then empty)."""

    def __init__(self, storage, slots: int, arrivals: int):
        self.full = UseCountedBarriers(storage, slots, arrivals)
        self.empty = UseCountedBarriers(storage + slots, slots, arrivals)

    _DYNAMIC = ("full", "empty")

    def producer_acquire(self, slot, use):
        self.empty.wait_released(slot, use)

    def producer_commit(self, slot):
        self.full.arrive(slot)

    def consumer_wait(self, slot, use):
        self.full.wait(slot, use)

    def consumer_release(self, slot):
        self.empty.arrive(slot)

