"""Property test: validation raises ValueError (and nothing else) or accepts, for any input shape.

Random ranks, extents, head dims, dtypes and slicings: the checks either name a problem
in a ValueError or let the input through; they never crash with another exception type,
and what they accept satisfies what the kernels rely on.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_attention.common.validation import check_qkv

pytestmark = [pytest.mark.stage_a]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@settings(max_examples=150, deadline=None)
@given(
    b=st.integers(1, 3), sq=st.integers(1, 40), sk=st.integers(0, 40), h=st.integers(1, 6), hk=st.integers(1, 6),
    d=st.sampled_from([32, 64, 96, 128, 256, 512]), pad=st.sampled_from([0, 4, 8, 64]),
    dtype=st.sampled_from(DTYPES), rank_drop=st.booleans(),
)
def test_accepts_or_names_the_problem(b, sq, sk, h, hk, d, pad, dtype, rank_drop):
    q = torch.zeros(b, sq, h, d + pad, dtype=dtype)[..., :d]
    k = torch.zeros(b, sk, hk, d + pad, dtype=dtype)[..., :d]
    if rank_drop:
        q = q[0]
    try:
        check_qkv(q, k, k, (64, 128, 256))
    except ValueError as e:
        assert str(e)
        return
    # accepted: everything the kernels assume holds
    assert q.dim() == 4 and q.dtype in (torch.bfloat16, torch.float16) and d in (64, 128, 256)
    assert h % hk == 0 and q.stride(3) == 1
    # the TMA descriptor takes every outer stride, in 16-byte units
    assert all(s * q.element_size() % 16 == 0 for s in q.stride()[:3])
