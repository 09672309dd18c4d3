"""Named barriers (``bar.sync`` / ``bar.arrive`` ids) of the SM90 attention kernels.

Id 0 is ``__syncthreads``. A named barrier counts arriving threads: it opens when
``number_of_threads`` (a multiple of 32) have arrived or synced, so two groups can
use one to hand over a turn (one arrives, the other syncs).
"""

import enum


class Sm90FwdBarrier(enum.IntEnum):
    # all consumer warpgroups: sO may be overwritten (every wgmma that read sQ is
    # done), then: O is in SMEM, the TMA store may read it
    EPILOGUE = 1
    # consumer warpgroup w waits here for its turn to issue its GEMMs (ping-pong);
    # the warpgroup before it in the round arrives
    SCHEDULER_WG0 = 2
    SCHEDULER_WG1 = 3
    SCHEDULER_WG2 = 4
