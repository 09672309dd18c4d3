"""Stage E's seesaw for gathered tiles (index mode: D1's leader, follower and producer order,
over E's gathered tiles): the three roles, taken from the kernel's own methods, finish under
every interleaving, free each ring half only after the wgmma groups that read it and hand SMEM
over without a race (tests/seesaw_protocol.py says how)."""

import pytest
from seesaw_protocol import protocol_tests

from dsv4_attention.stages.e_fused.sm90 import FlashAttentionESm90

pytestmark = [pytest.mark.stage_e, pytest.mark.proof, pytest.mark.arch("sm90")]

test_every_interleaving_finishes_and_frees_only_read_halves, test_checker_rejects_an_early_release_and_a_missing_one = (
    protocol_tests(FlashAttentionESm90, kv_shared=True, pack_group=128, has_compressed=True, has_topk=True,
                   index_mode=True))
