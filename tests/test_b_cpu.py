"""Stage B on the CPU: compile budgets for both architectures and input validation."""

import pytest
import torch

from dsv4_attention.common.testing import compile_budget_test
from dsv4_attention.stages import b_p_onchip as stage

pytestmark = [pytest.mark.stage_b]


# sm100: S (128 columns, P aliased inside it) + O (head_dim columns), rounded to a power of two
test_compiles_within_budget = compile_budget_test("b", stage.HEAD_DIMS, lambda d: 128 + d)


def qkv(sk=8, d=64, dtype=torch.bfloat16):
    q = torch.randn(1, 8, 2, d).to(dtype)
    k = torch.randn(1, sk, 1, d).to(dtype)
    return q, k, k.clone()


def test_longer_than_one_tile_points_to_stage_c():
    q, k, v = qkv(sk=129)
    with pytest.raises(ValueError, match="seqlen_k must be at most 128.*stage C"):
        stage.forward(q, k, v)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: qkv(d=512), r"q head_dim must be one of \[64, 128, 256\]"),
        (lambda: (qkv()[0], qkv()[1], qkv(sk=9)[2]), r"v must have k's shape"),
        (lambda: (qkv()[0], qkv()[1], qkv()[2].half()), r"v\.dtype must equal k\.dtype"),
        (lambda: (qkv()[0], qkv()[1], "v"), r"v must be a torch\.Tensor"),
    ],
)
def test_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        stage.forward(*make())


def test_cpu_tensors_name_the_device():
    with pytest.raises(ValueError, match="CUDA device"):
        stage.forward(*qkv())


def test_bad_outputs():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="lse_out must be torch.float32 of shape"):
        stage.forward(q, k, v, lse_out=torch.empty(1, 2, 9))
