"""Bad input to stage A raises a ValueError naming the argument, before any compile or launch.

These run on the CPU: every check precedes the device dispatch, and a CPU
tensor that passes every other check is refused by the dispatch itself.
"""

import math

import pytest
import torch

from dsv4_attention.common import jit
from dsv4_attention.stages import a_qk_gemm as stage

pytestmark = [pytest.mark.stage_a]


def qk(b=1, sq=8, sk=8, h=2, hk=1, d=64, dtype=torch.bfloat16):
    return torch.randn(b, sq, h, d).to(dtype), torch.randn(b, sk, hk, d).to(dtype)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (qk()[0].float(), qk()[1]), r"q\.dtype must be one of bfloat16, float16"),
        (lambda: (qk()[0], qk()[1].half()), r"k\.dtype must equal q\.dtype"),
        (lambda: (qk()[0][0], qk()[1]), r"q must have rank 4"),
        (lambda: qk(d=96), r"q head_dim must be one of \[64, 128, 256, 512\]"),
        (lambda: (qk()[0], qk(d=128)[1]), r"k head_dim must equal q head_dim"),
        (lambda: qk(h=3, hk=2), r"k heads \(2\) must divide q heads \(3\)"),
        (lambda: (qk(b=2)[0], qk(b=3)[1]), r"k batch must equal q batch"),
        (lambda: (qk()[0].transpose(1, 3).contiguous().transpose(1, 3), qk()[1]),
         r"q must have head_dim contiguous"),
        (lambda: (torch.randn(1, 8, 2, 68).bfloat16()[..., :64], qk()[1]),
         r"q stride of dim 2 must be a multiple of 16 bytes"),
        (lambda: (qk(sq=0)[0], qk()[1]), r"q needs seqlen >= 1"),
        (lambda: ([[1.0]], qk()[1]), r"q must be a torch\.Tensor"),
    ],
)
def test_bad_inputs(make, match):
    q, k = make()
    before = jit.cache_size()
    with pytest.raises(ValueError, match=match):
        stage.forward(q, k)
    assert jit.cache_size() == before, "nothing may compile for bad input"


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan, "0.1", True])
def test_bad_softmax_scale(scale):
    q, k = qk()
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite float"):
        stage.forward(q, k, softmax_scale=scale)


def test_cpu_tensors_name_the_device():
    q, k = qk()
    with pytest.raises(ValueError, match="CUDA device"):
        stage.forward(q, k)


def test_bad_out():
    q, k = qk()
    with pytest.raises(ValueError, match="out must be torch.float32 of shape"):
        stage.forward(q, k, out=torch.empty(1, 2, 8, 9))  # wrong seqlen_k
