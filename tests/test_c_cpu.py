"""Stage C on the CPU: compile budgets for both architectures and input validation."""

import pytest
import torch

from dsv4_attention.common.testing import BAD_QKV, assert_long_keys_reach_dispatch, compile_budget_test
from dsv4_attention.stages import c_online_softmax as stage

pytestmark = [pytest.mark.stage_c]


# sm100: at least one S tile (128 columns, P inside it) and O (head_dim columns)
test_compiles_within_budget = compile_budget_test("c", stage.HEAD_DIMS, lambda d: 128 + d)


def test_long_sequences_are_accepted_up_to_dispatch():
    assert_long_keys_reach_dispatch(stage.forward, 64)


@pytest.mark.parametrize(
    "make, match",
    BAD_QKV + [
        (lambda q, k: (q[..., :32], k, k), r"q head_dim must be one of \[64, 128, 256\]"),
    ],
)
def test_bad_inputs(make, match):
    q = torch.randn(1, 8, 2, 64).bfloat16()
    k = torch.randn(1, 300, 1, 64).bfloat16()
    with pytest.raises(ValueError, match=match):
        stage.forward(*make(q, k))
