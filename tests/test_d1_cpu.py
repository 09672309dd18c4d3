"""Stage D1 on the CPU: the SM90 kernel's compile budgets (compile time under 30 s with the
file cache off, no spills, SMEM within the limit) at every head dim, K = V and not, and input
validation. (The SM100 kernel's budgets are in tests/test_d1_sm100_host.py.)"""

import pytest
import torch

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.common.testing import BAD_QKV, assert_long_keys_reach_dispatch
from dsv4_attention.stages import d1_smem_p as stage

pytestmark = [pytest.mark.stage_d1]

CASES = (
    [("bfloat16", d, {"kv_shared": s}) for d in stage.HEAD_DIMS for s in (True, False)]
    + [("float16", 512, {"kv_shared": True})]  # fp16: the same code but the element type, once
    + [("bfloat16", d, {"p_in_smem": True}) for d in (64, 256)]
)


@pytest.mark.compile
@pytest.mark.arch("sm90")
@pytest.mark.parametrize("dtype,head_dim,options", CASES, ids=[f"{c[0]}-hd{c[1]}-{c[2]}" for c in CASES])
def test_sm90_compiles_within_budget(dtype, head_dim, options):
    # no spills anywhere: at 512 a split warpgroup holds O (64 x 256 fp32 = 128 registers), S (16), P (8)
    assert_within_budget("d1", "sm90", dtype, head_dim, options=options)


def test_same_memory_selects_k_eq_v():
    from dsv4_attention.common.interface import same_memory

    kv = torch.randn(1, 10, 2, 64)
    assert same_memory(kv, kv) and same_memory(kv[:, :, :1], kv[:, :, :1])
    assert not same_memory(kv, kv.clone())
    assert not same_memory(kv[:, :, :1], kv[:, :, 1:])


def test_long_sequences_are_accepted_up_to_dispatch():
    assert_long_keys_reach_dispatch(stage.forward, 512)


@pytest.mark.parametrize(
    "make, match",
    BAD_QKV + [
        (lambda q, k: (q[..., :32], k[..., :32], k[..., :32]), r"q head_dim must be one of"),
        (lambda q, k: (torch.cat([q, q[..., :64]], -1), k, k), r"q head_dim must be one of"),
    ],
)
def test_bad_inputs(make, match):
    q = torch.randn(1, 8, 2, 512).bfloat16()
    k = torch.randn(1, 300, 1, 512).bfloat16()
    with pytest.raises(ValueError, match=match):
        stage.forward(*make(q, k))


def test_only_persistent_kernels_key_their_cta_count():
    """The seesaw (hd 384 / 512, K = V) bakes its CTA count into the binary, so its configuration
    key carries it; the other kernels' keys do not move with it (no recompile per SM count). The
    key's rule (plain Python, no DSL import) is the kernel's own: every sm90 configuration's
    kernel object says it runs persistent exactly where the key carries the count."""
    from dsv4_attention.common import jit, persistent
    from dsv4_attention.common.arch import target_arch

    configs = [(arch, d, kv) for arch in ("sm90", "sm100") for d in stage.HEAD_DIMS for kv in (True, False)]

    def keys():
        return {c: jit.config_key("d1", c[0], torch.bfloat16, c[1], {"kv_shared": c[2]}) for c in configs}

    base = keys()
    with persistent.cta_limit(5):
        limited = keys()
    moved = {c for c in configs if base[c] != limited[c]}
    assert moved == {("sm90", 384, True), ("sm90", 512, True)}
    assert limited[("sm90", 512, True)][-1] == ("ctas", 5)
    with target_arch("sm90"):
        runs_persistent = {("sm90", d, kv) for _, d, kv in configs
                           if stage.make_kernel("sm90", torch.bfloat16, d, kv_shared=kv).persistent}
    assert runs_persistent == moved
