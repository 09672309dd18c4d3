"""Named barriers (``bar.sync`` / ``bar.arrive`` ids) of the SM90 attention kernels.

Id 0 is ``__syncthreads``. A named barrier counts arriving threads: it opens when
``number_of_threads`` (a multiple of 32) have arrived or synced, so two groups can
use one to hand over a turn (one arrives, the other syncs).
"""

import enum

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from dsv4_attention.common.dsl_state import DslState


class Sm90FwdBarrier(enum.IntEnum):
    # all consumer warpgroups: sO may be overwritten (every wgmma that read sQ is
    # done), then: O is in SMEM, the TMA store may read it
    EPILOGUE = 1
    # consumer warpgroup w waits here for its turn to issue its GEMMs (ping-pong);
    # the warpgroup before it in the round arrives
    SCHEDULER_WG0 = 2
    SCHEDULER_WG1 = 3
    SCHEDULER_WG2 = 4
    # stage D1: the warpgroups that share rows exchange their row maxima (and, at the
    # end, their row sums) through SMEM: both sync here between write and read
    ROW_STATS = 5
    # stage D1: P of this KV tile is in SMEM (stores fenced) for every warpgroup that
    # reads it: split warpgroups sync together; otherwise warpgroup w on its own id
    P_READY = 6
    P_READY_WG0 = 7
    P_READY_WG1 = 8
    P_READY_WG2 = 9
    # the persistent seesaw's epilogue: warpgroup w's O chunk is in its P buffer (write, then the
    # one-lane TMA store), and the previous chunk's store has read it (common/sm90_epilogue.py)
    EPILOGUE_WG0 = 10
    EPILOGUE_WG1 = 11
    # stage E's FP8 page gather (the producer warpgroup, 128 threads): every raw piece of a slot
    # half has been read before its upper chunks' bf16 overwrite them (stages/e_fused/sm90_pages.py)
    FP8_GATHER = 12


class Sm90BwdBarrier(enum.IntEnum):
    """The backward's (stages/f_backward/sm90.py), over its two consumer warpgroups."""
    # dS^T of both warpgroups' keys is in SMEM (stores fenced): the dQ wgmma may read it
    DS_READY = 1
    # (2 was DS_FREE: sdS's two slots made it unnecessary, stages/f_backward/sm90.py)
    # dK's and dV's epilogues, one id each (common/sm90_epilogue.store_o: sync, then the store warp
    # syncs while the others arrive): on one id the second store's sync would count into the first
    # store's arrive phase and hang the CTA
    EPILOGUE_DK = 3
    EPILOGUE_DV = 4
    # the dQ warp (producer warpgroup, warp 1) and the consumers: dQ's partial sum is in sdQ
    # (consumers arrive, the dQ warp syncs), and sdQ is free again (the other way round)
    DQ_FULL = 5
    DQ_EMPTY = 6
    # (deterministic, the head-dim-256 kernel stages/f_backward/sm90_wide.py) the consumers meet
    # thread 0 at dQ's turn, before their reductions and after them
    DQ_TURN = 7


@dsl_user_op
def barrier_sync_unaligned(barrier_id: int, number_of_threads: int, *, loc=None, ip=None) -> None:
    """``barrier.sync id, n`` without ``.aligned``: the warps may reach it at different barrier
    instructions. ``bar.sync`` (CuTeDSL's ``cute.arch.barrier``) is ``barrier.sync.aligned``, which
    PTX leaves undefined when the threads of the CTA reach it from different code, and synccheck
    reports as "divergent thread(s) in block": the persistent seesaw's two warpgroups meet at the
    row sums each from its own copy of the epilogue."""
    llvm.inline_asm(None, [], f"barrier.sync {int(barrier_id)}, {int(number_of_threads)};", "~{memory}",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


# ---- ping-pong turns between consumer warpgroups that own different rows (stage C on) ----
# Warpgroup w syncs on SCHEDULER_WG0 + w before issuing a tile's GEMMs and, once they are
# issued, arrives on the next warpgroup's (count 2 x 128: the syncing group and the arriving
# one). Warpgroup 0 arrives on its own barrier once at the start, so it goes first (that extra
# arrival is the one left pending at exit).

PINGPONG_THREADS = 2 * 128


@cute.jit
def pingpong_start(wg: cutlass.Int32):
    """Give the first turn to warpgroup 0 (every consumer thread calls it)."""
    if wg == 0:
        cute.arch.barrier_arrive(barrier_id=int(Sm90FwdBarrier.SCHEDULER_WG0), number_of_threads=PINGPONG_THREADS)


@cute.jit
def pingpong_wait(wg: cutlass.Int32):
    """Wait for warpgroup wg's turn to issue its GEMMs."""
    cute.arch.barrier(barrier_id=int(Sm90FwdBarrier.SCHEDULER_WG0) + wg, number_of_threads=PINGPONG_THREADS)


@cute.jit
def pingpong_pass(wg: cutlass.Int32, num_wg: cutlass.Constexpr[int]):
    """Hand the turn to the next consumer warpgroup (round robin over num_wg)."""
    nxt = (wg + 1) % num_wg
    if cutlass.const_expr(num_wg == 2):
        nxt = 1 - wg
    cute.arch.barrier_arrive(barrier_id=int(Sm90FwdBarrier.SCHEDULER_WG0) + nxt, number_of_threads=PINGPONG_THREADS)


class PingPong:
    """Mixin of the consumer schedules with ping-pong (stage C, D1's rows): ``self.pingpong``
    (compile-time) and ``self.num_wg`` say whether and over how many warpgroups the GEMM turns
    rotate; without ping-pong both calls compile to nothing."""

    @cute.jit
    def scheduler_wait(self, wg: cutlass.Int32):
        """Wait for this warpgroup's turn to issue its GEMMs."""
        if cutlass.const_expr(self.pingpong):
            pingpong_wait(wg)

    @cute.jit
    def scheduler_pass(self, wg: cutlass.Int32):
        """Hand the turn to the next consumer warpgroup (round robin)."""
        if cutlass.const_expr(self.pingpong):
            pingpong_pass(wg, self.num_wg)


# ---- one warpgroup hands data in SMEM to another, once per round (stage D1's seesaw) ----


class RoundHandoff(DslState):
    """An mbarrier that the 128 threads of one warpgroup arrive on once their SMEM writes of a
    round are done (each thread's arrive releases its own writes: the PTX memory model's
    mbarrier.arrive.release), and that the other warpgroup waits for (acquire) before reading
    them. Round r completes phase r, so the waiter passes parity r & 1. A round's writer may only
    start round r + 1 once the reader is done with round r: the seesaw orders that through the
    handoff going the other way (see stage D1's sm90 kernel).

    Named barriers (bar.arrive / bar.sync) order the same, but compute-sanitizer's racecheck
    reports false hazards around bar.arrive (one even across a bar.sync of all 256 threads;
    the count varied between runs of the same launch), so the kernel uses what the tool checks."""

    def __init__(self, bar: cute.Pointer):
        self.bar = bar

    _DYNAMIC = ("bar",)

    @cute.jit
    def init(self):
        cute.arch.mbarrier_init(self.bar, 128)

    @cute.jit
    def arrive(self):
        """Every thread of the writing warpgroup, after its writes (and their proxy fence)."""
        cute.arch.mbarrier_arrive(self.bar)

    @cute.jit
    def wait(self, round_):
        """The reading warpgroup, before its reads of round ``round_``."""
        cute.arch.mbarrier_wait(self.bar, round_ & 1)
