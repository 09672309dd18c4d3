"""Adding an fp32 wgmma accumulator into global memory by 16-byte reductions (sm90).

A wgmma C fragment holds, per column group n of 8 columns, four values of a thread: value index
c + 2 r + 4 n is (row 16 w' + l / 4 + 8 r, column 8 n + 2 (l % 4) + c) of the warp w', lane l's
share (``value_quad``). Lanes l and l ^ 1 hold the same two rows and together four adjacent
columns of each. One shuffle of a pair each way (``exchange_pairs``) leaves the even lane row
r = 0's four columns and the odd lane row r = 1's: one ``red.global.add.v4.f32`` each per n,
half the reductions of v2 (``reduce_pairs``). Stage F's two sm90 kernels add their atomically
shared gradients this way (index mode's dkv, the wide dense kernel's dQ); their host proofs replay
the exchange on the kernel's own partitions (tests/test_f_index_sm90_host.py,
tests/test_f_wide_sm90_host.py)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def red_add_v4_f32(gmem_addr: cutlass.Int64, a: cutlass.Float32, b: cutlass.Float32, c: cutlass.Float32,
                   d: cutlass.Float32, *, loc=None, ip=None) -> None:
    """Four adjacent fp32 values added to global memory in one reduction (16-byte aligned)."""
    llvm.inline_asm(
        None,
        [cutlass.Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
        + [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


def value_quad(n: int) -> tuple:
    """The accumulator's value indices of column group n (value index c + 2 r + 4 n): (row r = 0's
    pair, row r = 1's pair)."""
    return (4 * n, 4 * n + 1), (4 * n + 2, 4 * n + 3)


def exchange_pairs(odd: bool, own: tuple, partner: tuple) -> tuple:
    """One lane's four values after the exchange with lane ^ 1, from (row 0 pair, row 1 pair) of its
    own and of its partner's column group (host Python on coordinates in the proofs, the same
    selections on values in the kernels): the even lane keeps its row-0 pair and receives the odd
    lane's; the odd lane receives the even lane's row-1 pair, then its own. What each lane sends
    is what the other receives: the even lane its row-1 pair, the odd lane its row-0 pair."""
    if odd:
        return partner[1] + own[1]
    return own[0] + partner[0]


def reduce_targets(coords) -> tuple:
    """(row, first column) that the even and the odd lane reduce for column group 0 after the
    exchange, from a lane's own values' coordinates (``coords[i]`` = (row, column) of value i;
    group n adds 8 n columns): the kernels pick one by lane parity (``x if odd else y``), the host
    proofs through ``reduced_at``."""
    (a0, _), (b0, _) = value_quad(0)
    return (coords[a0][0], coords[a0][1]), (coords[b0][0], coords[a0][1] - 2)


def reduced_at(coords, odd: bool) -> tuple:
    """``reduce_targets``' pick for a lane of parity ``odd`` (host Python)."""
    even_at, odd_at = reduce_targets(coords)
    return odd_at if odd else even_at


@cute.jit
def reduce_pairs(acc: cute.Tensor, addr: cutlass.Int64, odd: cutlass.Boolean, ok: cutlass.Boolean):
    """``acc`` (a wgmma accumulator fragment, fp32) added at ``addr`` (this lane's row and first
    column, ``reduced_at``; columns contiguous): per column group n, a pair exchanged with lane ^ 1
    (every lane of the warp takes part), then one 16-byte reduction where ``ok``."""
    for n in cutlass.range_constexpr(cute.size(acc) // 4):
        (a0, a1), (b0, b1) = value_quad(n)
        # send the pair the partner keeps: the even lane its row-1 pair, the odd its row-0
        got0 = cute.arch.shuffle_sync_bfly(acc[a0] if odd else acc[b0], offset=1)
        got1 = cute.arch.shuffle_sync_bfly(acc[a1] if odd else acc[b1], offset=1)
        if ok:
            if odd:
                red_add_v4_f32(addr + 8 * n * 4, got0, got1, acc[b0], acc[b1])
            else:
                red_add_v4_f32(addr + 8 * n * 4, acc[a0], acc[a1], got0, got1)
