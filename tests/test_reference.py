"""The float64 references against independent formulations."""

import pytest
import torch

from dsv4_attention.common.reference import attention, qk_scores

pytestmark = [pytest.mark.stage_a]


def test_qk_scores_loop_and_gqa():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64).bfloat16()
    k = torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64).bfloat16()
    s = qk_scores(q, k, 0.3)
    assert s.shape == (2, 4, 5, 7) and s.dtype == torch.float64
    for b in range(2):
        for h in range(4):
            ref = 0.3 * q[b, :, h].double() @ k[b, :, h // 2].double().T
            torch.testing.assert_close(s[b, h], ref, rtol=0, atol=1e-12)


def test_default_scale():
    q = torch.randn(1, 3, 1, 64).half()
    torch.testing.assert_close(qk_scores(q, q), qk_scores(q, q, 0.125))


def test_attention_rows_and_lse():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 6, 2, 16, generator=g).bfloat16()
    k = torch.randn(1, 9, 1, 16, generator=g).bfloat16()
    v = torch.randn(1, 9, 1, 16, generator=g).bfloat16()
    o, lse = attention(q, k, v, 0.25)
    s = qk_scores(q, k, 0.25)
    torch.testing.assert_close(lse, torch.log(torch.exp(s).sum(-1)))
    p = torch.softmax(s, -1)
    torch.testing.assert_close(o[0, :, 0], p[0, 0] @ v[0, :, 0].double())
