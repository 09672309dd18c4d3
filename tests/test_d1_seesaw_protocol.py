"""Stage D1's seesaw (head dim 512, K = V): its producer, leader and follower, taken from the
kernel's own methods, finish under every interleaving, free each ring half only after the
wgmma groups that read it and hand SMEM over without a race (tests/seesaw_protocol.py says how)."""

import pytest
from seesaw_protocol import protocol_tests

from dsv4_attention.stages.d1_smem_p.sm90 import FlashAttentionD1Sm90

pytestmark = [pytest.mark.stage_d1, pytest.mark.proof, pytest.mark.arch("sm90")]

test_every_interleaving_finishes_and_frees_only_read_halves, test_checker_rejects_an_early_release_and_a_missing_one = (
    protocol_tests(FlashAttentionD1Sm90, kv_shared=True))
