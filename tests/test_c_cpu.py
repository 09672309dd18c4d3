"""Stage C on the CPU: compile budgets for both architectures and input validation."""

import pytest
import torch

from dsv4_attention.common.compile import assert_within_budget
from dsv4_attention.stages import c_online_softmax as stage

pytestmark = [pytest.mark.stage_c]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", stage.HEAD_DIMS)
def test_compiles_within_budget(arch, dtype, head_dim):
    # sm100: at least one S tile (128 columns, P inside it) and O (head_dim columns)
    assert_within_budget("c", arch, dtype, head_dim, min_tmem_columns=128 + head_dim)


def test_long_sequences_are_accepted_up_to_dispatch():
    q = torch.randn(1, 8, 2, 64).bfloat16()
    k = torch.randn(1, 20000, 1, 64).bfloat16()
    with pytest.raises(ValueError, match="CUDA device"):  # every check passed; only the device is wrong
        stage.forward(q, k, k)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda q, k: (q, k, k[:, :-1]), r"v must have k's shape"),
        (lambda q, k: (q.float(), k, k), r"q\.dtype must be one of"),
        (lambda q, k: (q[..., :32], k, k), r"q head_dim must be one of \[64, 128, 256\]"),
    ],
)
def test_bad_inputs(make, match):
    q = torch.randn(1, 8, 2, 64).bfloat16()
    k = torch.randn(1, 300, 1, 64).bfloat16()
    with pytest.raises(ValueError, match=match):
        stage.forward(*make(q, k))
