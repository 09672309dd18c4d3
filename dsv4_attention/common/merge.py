"""Two attentions over disjoint key sets, merged exactly (stage D5's branch merge).

With (O1, LSE1) over keys K1 and (O2, LSE2) over keys K2 (K1 and K2 disjoint), the attention
over K1 u K2 is

    LSE = log(exp(LSE1) + exp(LSE2))                     (logaddexp)
    O   = exp(LSE1 - LSE) O1 + exp(LSE2 - LSE) O2

because each O_i is its keys' softmax-weighted sum normalised by exp(LSE_i). An empty side
(LSE_i = -inf, O_i = 0) has weight 0; both empty gives O = 0, LSE = -inf (never NaN: the
weights are taken where LSE is finite). Computed in fp32 (the weights are in [0, 1] and sum
to 1, so fp32 loses nothing the bf16 output keeps), O returned in O1's dtype.
"""

from __future__ import annotations

import torch


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                    *, lse_layout: str = "bhs"):
    """(O, LSE) of the union of two disjoint key sets (torch: differentiable).

    Args:
        o1, o2: [batch, seqlen, heads, d] (``lse_layout="bhs"``, the stages' convention) or
            [total, heads, d] (``"ht"``, variable-length batches), the same shape.
        lse1, lse2: [batch, heads, seqlen] ("bhs") or [heads, total] ("ht"), natural log;
            -inf for a row with no key on that side.
        lse_layout: "bhs" or "ht".

    Returns:
        (o in o1's dtype, lse fp32); O = 0, LSE = -inf where both sides are empty.

    Raises:
        ValueError: shapes that do not match, or an unknown layout.
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape:
        raise ValueError(f"the two sides must match: o {tuple(o1.shape)} vs {tuple(o2.shape)}, "
                         f"lse {tuple(lse1.shape)} vs {tuple(lse2.shape)}")
    if lse_layout not in ("bhs", "ht"):
        raise ValueError(f"lse_layout must be 'bhs' or 'ht'; got {lse_layout!r}")
    want = (o1.shape[0], o1.shape[2], o1.shape[1]) if lse_layout == "bhs" else (o1.shape[1], o1.shape[0])
    if tuple(lse1.shape) != want:
        raise ValueError(f"lse must be {want} for o {tuple(o1.shape)} ({lse_layout}); got {tuple(lse1.shape)}")
    l1, l2 = lse1.float(), lse2.float()
    lse = torch.logaddexp(l1, l2)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w1 = torch.where(finite, torch.exp(l1 - safe), torch.zeros_like(lse))
    w2 = torch.where(finite, torch.exp(l2 - safe), torch.zeros_like(lse))
    # weights per (row, head) onto o's layout
    w1, w2 = (w.transpose(1, 2)[..., None] if lse_layout == "bhs" else w.transpose(0, 1)[..., None] for w in (w1, w2))
    o = (w1 * o1.float() + w2 * o2.float()).to(o1.dtype)
    return o, lse


def sink_scale(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The attention sink's factor on O, sigmoid(LSE - sink) in fp32 (``lse`` and ``sink``
    broadcast against each other; the kernels' ``softmax.sink_factor`` in torch): 1 for a sink of
    -inf, 0 for +inf, and 0 on a row with no visible key (LSE = -inf) whatever the sink, where the
    bare sigmoid is NaN for a sink of -inf."""
    lse = lse.float()
    scale = torch.sigmoid(lse - sink.float())
    return torch.where(torch.isneginf(lse), torch.zeros_like(scale), scale)
