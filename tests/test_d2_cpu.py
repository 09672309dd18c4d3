"""Stage D2 on the CPU: both kernels' compile budgets (time under 30 s with the file cache off,
no spills, SMEM and TMEM within their limits) for packed groups below, at and above the tile
rows, and input validation of ``pack_gqa``."""

import pytest
import torch

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.stages import d2_pack_heads as stage
from dsv4_attention.stages import e_fused

pytestmark = [pytest.mark.stage_d2]

CASES = [  # (arch, head dim, options): groups that pack into every tile shape the kernels cut
    ("sm90", 512, {"kv_shared": True, "pack_group": 128}),
    ("sm90", 512, {"kv_shared": False, "pack_group": 8}),
    ("sm90", 256, {"kv_shared": True, "pack_group": 64}),
    ("sm90", 128, {"kv_shared": False, "pack_group": 8}),
    ("sm90", 64, {"kv_shared": False, "pack_group": 4}),
    ("sm100", 512, {"kv_shared": True, "pack_group": 128}),
    ("sm100", 256, {"kv_shared": True, "pack_group": 64}),
    ("sm100", 128, {"kv_shared": False, "pack_group": 8}),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch,head_dim,options", CASES, ids=[f"{a}-hd{d}-{o}" for a, d, o in CASES])
def test_compiles_within_budget(arch, head_dim, options):
    assert_within_budget("d2", arch, "bfloat16", head_dim, min_tmem_columns=128, options=options)


@pytest.mark.parametrize("pack_gqa", [1, "yes", 0.5])
def test_pack_gqa_must_be_bool_or_none(pack_gqa):
    q = torch.randn(1, 8, 8, 128).bfloat16()
    k = torch.randn(1, 30, 1, 128).bfloat16()
    with pytest.raises(ValueError, match="pack_gqa must be"):
        stage.forward(q, k, k, pack_gqa=pack_gqa)


def test_tile_rows_are_the_kernels():
    """The host's table (common/tiles.py, read without importing a kernel) against the tile_m of
    every kernel object the calls build, for every head dim and option that changes the tiles."""
    import cutlass

    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import target_arch

    assert stage.tile_rows("sm90", 512, True, None) == 64
    assert stage.tile_rows("sm90", 64, False, None) == 192
    checked = 0
    for arch in ("sm90", "sm100"):
        with target_arch(arch):
            for d in stage.HEAD_DIMS:
                for kv_shared in (False, True):
                    for p_in_smem in (None, True, False):
                        opts = {"kv_shared": kv_shared} if p_in_smem is None else {"kv_shared": kv_shared,
                                                                                   "p_in_smem": p_in_smem}
                        for kernels in (stage.KERNELS, e_fused.KERNELS):
                            try:
                                kernel = jit.kernel_class(kernels, arch)(cutlass.BFloat16, d, **opts)
                            except ValueError:  # a configuration the kernel refuses (e.g. P in TMEM at 448)
                                continue
                            assert stage.tile_rows(arch, d, kv_shared, p_in_smem) == kernel.tile_m, (arch, d, opts)
                            checked += 1
    assert checked >= 80
