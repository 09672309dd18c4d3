"""Stage A compiles for sm_90a and sm_100a on a CPU, within budget.

Each configuration compiles in a child process with CuTeDSL's file cache off
and a hard limit (a hang fails instead of stalling CI); the 30 s budget is the
one timed assertion. Resources: no spills, SMEM within 232448 bytes per CTA,
TMEM within 512 columns on sm100 (read from what the kernel allocates).
"""

import pytest

from common.compile import COMPILE_BUDGET_S, SMEM_LIMIT, TMEM_COLUMNS, compile_report
from stages import a_qk_gemm as stage

pytestmark = [pytest.mark.stage_a, pytest.mark.compile]


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
def test_compiles_within_budget(arch, dtype, head_dim):
    rep = compile_report("a", arch, dtype, head_dim, timeout=4 * COMPILE_BUDGET_S)
    assert rep.ok, rep.error
    print(rep.row())
    assert rep.seconds < COMPILE_BUDGET_S, rep.row()
    assert rep.spill_store_bytes == 0 and rep.spill_load_bytes == 0, rep.row()
    assert 0 < rep.smem_bytes <= SMEM_LIMIT, rep.row()
    assert not any("C7508" in w for w in rep.warnings), rep.warnings
    if arch == "sm100":
        assert rep.tmem_columns is not None and 32 <= rep.tmem_columns <= TMEM_COLUMNS, rep.row()
        assert rep.tmem_columns & (rep.tmem_columns - 1) == 0, "TMEM allocations are powers of two"
    else:
        assert rep.tmem_columns is None
