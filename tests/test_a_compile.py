"""Stage A compiles for sm_90a and sm_100a on a CPU, within budget.

Each configuration compiles in a child process with CuTeDSL's file cache off
and a hard limit (a hang fails instead of stalling CI); the 30 s budget is the
one timed assertion. Resources: no spills, SMEM within 232448 bytes per CTA,
TMEM within 512 columns on sm100 (read from what the kernel allocates).
"""

import pytest

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.stages import a_qk_gemm as stage

pytestmark = [pytest.mark.stage_a, pytest.mark.compile]


# every head dim in bf16; fp16 is the same kernel but the element type, compiled once per arch
CASES = [("bfloat16", d) for d in stage.HEAD_DIMS] + [("float16", 128)]


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("dtype,head_dim", CASES)
def test_compiles_within_budget(arch, dtype, head_dim):
    assert_within_budget("a", arch, dtype, head_dim)
