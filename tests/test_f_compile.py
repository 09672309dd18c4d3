"""Stage F compiles for sm_90a within the budgets every kernel keeps (common/compile.py): under
30 s with the file cache off, SMEM within the limit, a setmaxnreg split the launch holds, no
serialized wgmma, no spills (with dQ added by red.global.add per element, hd 128 spilled 12-24
bytes: the address arithmetic; the dQ warp's TMA reduction removed it), no elect.sync nested in
another's region (the dQ warp's first hang). The deterministic variant (dQ's turns) and the
per-batch key counts (seqused_k) and variable-length batches (cu_seqlens) too. The sm100 kernel
(head dim 128, no deterministic mode) compiles for sm_100a within the same budgets, with its
512-column TMEM allocation, its deterministic mode with the turn protocol in its PTX (and none of
it in the default), and its constructor refuses other head dims by name."""

import pytest

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.stages import f_backward as stage

pytestmark = [pytest.mark.stage_f]  # each test's arch mark names the status table's row


# Every option set in bf16; fp16 once per head dim (the dense kernel): the dtype enters the kernels
# only as the MMA and copy element type, the options' code is the same for both (CI's time: each
# configuration is a compile of ~10 s on its two cores)
OPTION_SETS = [pytest.param("bfloat16", {}, id="dense-bfloat16"), pytest.param("float16", {}, id="dense-float16")] + [
    pytest.param("bfloat16", options, id=f"{name}-bfloat16") for name, options in (
        ("window", {"has_left": True, "has_right": True}),
        ("window_deterministic", {"has_left": True, "has_right": True, "deterministic": True}),
        ("causal_seqused", {"has_right": True, "has_seqused": True}),
        ("causal_varlen", {"has_right": True, "varlen": True}))]


@pytest.mark.compile
@pytest.mark.arch("sm90")
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
@pytest.mark.parametrize("dtype,options", OPTION_SETS)
def test_compiles_within_budget(dtype, options, head_dim):
    assert_within_budget(stage.ID, "sm90", dtype, head_dim, options=options)


@pytest.mark.compile
@pytest.mark.arch("sm100")
@pytest.mark.parametrize("dtype,options", OPTION_SETS)
def test_sm100_compiles_within_budget(dtype, options):
    rep = assert_within_budget(stage.ID, "sm100", dtype, 128, min_tmem_columns=512, options=options)
    assert rep.tmem_columns == 512, rep.row()


@pytest.mark.arch("sm100")
def test_sm100_refuses_other_head_dims():
    import cutlass

    from dsv4_attention.stages.f_backward.sm100 import FlashAttentionBackwardSm100

    with pytest.raises(ValueError, match="head dims"):
        FlashAttentionBackwardSm100(cutlass.BFloat16, 64)
    with pytest.raises(TypeError, match="unknown options"):
        FlashAttentionBackwardSm100(cutlass.BFloat16, 128, has_sink=True)


@pytest.mark.compile
@pytest.mark.arch("sm100")
def test_sm100_ptx_turns_and_row_stores():
    """Read from the sm100 kernel's PTX. The deterministic mode's dQ turns: thread 0 polls the counter
    with acquire loads, every compute thread fences its adds at gpu scope and meets the others at the
    turn barrier, and one release increment passes the turn; the default kernel has none of it. In
    both, a thread's dK and dV rows leave in 16-byte stores (2 x 128 x 2 bytes: 32) and nothing
    narrower reaches global memory but dQ's fp32 adds."""
    import re
    import tempfile

    import torch

    from dsv4_attention import stages
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import target_arch
    from dsv4_attention.stages.f_backward.sm100 import TURN_BARRIER_ID

    mod = stages.get(stage.ID).module
    found = {}
    for deterministic in (False, True):
        args = mod.example_args(torch.bfloat16, 128, deterministic=deterministic)
        with target_arch("sm100"), tempfile.TemporaryDirectory() as dump:
            kernel = mod.make_kernel("sm100", torch.bfloat16, 128, deterministic=deterministic)
            ptx = jit.compile_ptx(kernel, args, "sm100", dump)
        stores = re.findall(r"st\.global[.a-z0-9]*", ptx)
        assert stores.count("st.global.v4.b32") == 32 and set(stores) == {"st.global.v4.b32"}, sorted(set(stores))
        found[deterministic] = {
            "acquire": "ld.acquire.gpu" in ptx,
            "fence": "fence.acq_rel.gpu" in ptx,
            "release": re.search(r"atom(\.global)?\.release(\.gpu)?\.add", ptx) is not None,
            "turn barrier": re.search(rf"bar(rier)?\.sync\s+{TURN_BARRIER_ID}\s*,", ptx) is not None,
        }
    assert all(found[True].values()), found[True]
    assert not any(found[False].values()), found[False]


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


@pytest.mark.compile
@pytest.mark.arch("sm90")
def test_index_kernel_compiles_within_budget():
    """Index mode's backward kernel (stages/f_backward/sm90_index.py, reached by the ``index_mode``
    option): within the budgets, no spill, its SMEM (Q, dO, a step's rows, two slots of P and dS:
    230400 bytes) within the limit; its constructor refuses other head dims by name."""
    import cutlass

    from dsv4_attention.stages.f_backward.sm90_index import IndexBackwardSm90

    rep = assert_within_budget(stage.ID, "sm90", "bfloat16", 512, options={"index_mode": True})
    assert rep.smem_bytes == 230400, rep.row()
    with pytest.raises(ValueError, match="head dim 512"):
        IndexBackwardSm90(cutlass.BFloat16, 128)


def test_each_architecture_names_the_head_dims_its_kernel_serves():
    """The registry's ``Stage.head_dims_for``: stage F's sm100 kernel serves head dim 128 alone, its
    sm90 kernels 64, 128 and 256 (sm90_wide.py at 256); a stage that names no narrower set serves its HEAD_DIMS on each
    architecture. ``serves`` and the compile sweep read the same table."""
    from dsv4_attention import stages

    f = stages.get("f")
    assert f.head_dims_for("sm100") == (128,) and f.head_dims_for("sm90") == (64, 128, 256) == tuple(f.head_dims)
    e = stages.get("e")
    assert e.head_dims_for("sm100") == e.head_dims_for("sm90") == e.head_dims
