"""The SM90 row gather's one instruction: a 16-byte cp.async with the hints a scattered read wants.

Hopper's TMA has no gather, so stage E's producer warpgroup copies each listed row by cp.async,
16 bytes a thread (stages/e_fused/sm90.py, ``gather_tile``). CuTeDSL's ``CopyG2SOp`` emits the
plain form; the gather wants three things the plain form lacks (FlashMLA's sparse prefill uses
the same three):

    cp.async.cg.shared.global.L2::cache_hint.L2::256B [smem], [gmem], 16, src_bytes, policy

- ``.L2::256B``: the first 16 bytes of a row's 128-byte chunk ask L2 for the 256 bytes around
  them, so the row's next chunk (the same thread's next copy) finds its sectors on the way;
- ``src_bytes`` 0 zero-fills the 16 bytes without reading (a list position that is not a visible
  entry: its score is masked, and a zero V row times P = 0 adds exactly 0);
- ``policy`` evict-last (``createpolicy``): listed rows are re-read by the other head tiles of the
  same token and by neighbouring tokens' lists, so they should outlive streamed Q and O in L2.
"""

from __future__ import annotations

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

ROW_UNIT_BYTES = 16  # one cp.async


@dsl_user_op
def l2_evict_last_policy(*, loc=None, ip=None) -> cutlass.Int64:
    """An L2 cache policy (a 64-bit operand for ``.L2::cache_hint``): evict last, whole access."""
    return cutlass.Int64(
        llvm.inline_asm(
            T.i64(), [], "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;", "=l",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
        )
    )


@dsl_user_op
def cp_async_row_unit(smem_addr: cutlass.Int32, gmem_addr: cutlass.Int64, src_bytes: cutlass.Int32,
                      policy: cutlass.Int64, *, loc=None, ip=None) -> None:
    """16 bytes global -> shared, asynchronous (completion: cp.async.mbarrier.arrive), L2 256-byte
    prefetch and cache policy; ``src_bytes`` (16 or 0) of them read, the rest zero-filled.
    ``smem_addr`` is a shared-window address (32 bits), ``gmem_addr`` a global one."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(smem_addr).ir_value(loc=loc, ip=ip), cutlass.Int64(gmem_addr).ir_value(loc=loc, ip=ip),
         cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip), cutlass.Int64(policy).ir_value(loc=loc, ip=ip)],
        f"cp.async.cg.shared.global.L2::cache_hint.L2::256B [$0], [$1], {ROW_UNIT_BYTES}, $2, $3;",
        "r,l,r,l,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
