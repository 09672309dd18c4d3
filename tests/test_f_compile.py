"""Stage F compiles for sm_90a within the budgets every kernel keeps (common/compile.py): under
30 s with the file cache off, SMEM within the limit, a setmaxnreg split the launch holds, no
serialized wgmma, no spills (with dQ added by red.global.add per element, hd 128 spilled 12-24
bytes: the address arithmetic; the dQ warp's TMA reduction removed it), no elect.sync nested in
another's region (the dQ warp's first hang). The deterministic variant (dQ's turns) and the
per-batch key counts (seqused_k) and variable-length batches (cu_seqlens) too. The sm100 kernel
(head dim 128, no deterministic mode) compiles for sm_100a within the same budgets, with its
512-column TMEM allocation, and its constructor refuses the deterministic mode by name."""

import pytest

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.stages import f_backward as stage

pytestmark = [pytest.mark.stage_f]  # each test's arch mark names the status table's row


@pytest.mark.compile
@pytest.mark.arch("sm90")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
@pytest.mark.parametrize("options", [{}, {"has_left": True, "has_right": True},
                                     {"has_left": True, "has_right": True, "deterministic": True},
                                     {"has_right": True, "has_seqused": True}, {"has_right": True, "varlen": True}],
                         ids=["dense", "window", "window_deterministic", "causal_seqused", "causal_varlen"])
def test_compiles_within_budget(dtype, head_dim, options):
    assert_within_budget(stage.ID, "sm90", dtype, head_dim, options=options)


@pytest.mark.compile
@pytest.mark.arch("sm100")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("options", [{}, {"has_left": True, "has_right": True},
                                     {"has_right": True, "has_seqused": True}, {"has_right": True, "varlen": True}],
                         ids=["dense", "window", "causal_seqused", "causal_varlen"])
def test_sm100_compiles_within_budget(dtype, options):
    rep = assert_within_budget(stage.ID, "sm100", dtype, 128, min_tmem_columns=512, options=options)
    assert rep.tmem_columns == 512, rep.row()


@pytest.mark.arch("sm100")
def test_sm100_refuses_the_deterministic_mode():
    import cutlass

    from dsv4_attention.stages.f_backward.sm100 import FlashAttentionBackwardSm100

    with pytest.raises(ValueError, match="deterministic"):
        FlashAttentionBackwardSm100(cutlass.BFloat16, 128, deterministic=True)
    with pytest.raises(ValueError, match="head dims"):
        FlashAttentionBackwardSm100(cutlass.BFloat16, 64)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_preprocess_compiles_with_vector_loads(arch):
    """The row statistics' kernel (preprocess.py) compiles for either architecture within the
    budget, and reads O and dO 16 bytes a load (the strides it assumes divisible by 8 are a
    contiguous tensor's, which the host checks); a head dim it cannot split evenly is refused."""
    import re
    import tempfile
    import time

    import torch

    from dsv4_attention.common import jit
    from dsv4_attention.common.compile import COMPILE_BUDGET_S
    from dsv4_attention.stages.f_backward.preprocess_kernel import BackwardPreprocess

    for head_dim in (64, 128, 512):
        for row_map in (False, True):
            o = torch.empty(2, 100, 4, head_dim, dtype=torch.bfloat16)
            args = [o, o, torch.empty(2, 4, 100), torch.empty(2, 4, 128), torch.empty(2, 4, 128),
                    torch.empty(100, dtype=torch.int32) if row_map else None, jit.STREAM]
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as dump:
                ptx = jit.compile_ptx(BackwardPreprocess(jit.cutlass_dtype(torch.bfloat16), head_dim,
                                                         row_map=row_map), args, arch, dump)
            assert time.perf_counter() - start < COMPILE_BUDGET_S
            loads = re.findall(r"ld\.global(?:\.[a-z0-9:]+)*", ptx)
            assert loads.count("ld.global.v4.b32") == 2 * (head_dim // 8 // min(32, head_dim // 8)), loads
    with pytest.raises(ValueError, match="head dims"):
        BackwardPreprocess(jit.cutlass_dtype(torch.bfloat16), 320)
