"""Stage E's seesaw for gathered tiles (index mode: D1's leader, follower and producer order,
over E's gathered tiles): the three roles, taken from the kernel's own methods, finish under
every interleaving, free each ring half only after the wgmma groups that read it and hand SMEM
over without a race (tests/seesaw_protocol.py says how)."""

import cutlass
import pytest
from seesaw_protocol import check_controls, check_every_interleaving

pytestmark = [pytest.mark.stage_e, pytest.mark.proof, pytest.mark.arch("sm90")]


def _kernel():
    from dsv4_attention.common.arch import target_arch
    from dsv4_attention.stages.e_fused.sm90 import FlashAttentionESm90

    with target_arch("sm90"):
        k = FlashAttentionESm90(cutlass.BFloat16, 512, kv_shared=True, pack_group=128, has_compressed=True,
                                has_topk=True, index_mode=True)
    assert k.seesaw
    return k


@pytest.mark.parametrize("n_blocks", range(1, 8))
def test_every_interleaving_finishes_and_frees_only_read_halves(n_blocks, monkeypatch):
    check_every_interleaving(_kernel(), n_blocks, monkeypatch)


def test_checker_rejects_an_early_release_and_a_missing_one(monkeypatch):
    check_controls(_kernel(), monkeypatch)
