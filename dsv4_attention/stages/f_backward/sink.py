"""The sink in the backward (one place for the kernel's host side and the torch-composed backwards).

The sink is one more key of value 0 in a head's softmax: with LSE' = logaddexp(LSE, sink[h]) in
place of LSE (and the sink-scaled O, from which D = rowsum(dO * O)), P and dS are the gradients
with the sink, and

    d sink[h] = - sum over every row of head h of exp(sink[h] - LSE') D

(0 where LSE' = -inf: a row with neither a key nor a finite sink).
"""

from __future__ import annotations

import torch

# LSE is [batch, heads, seqlen_q] or [tokens, heads] wherever the backward reads it: heads on mode 1
HEADS = 1


def _per_head(sink: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    shape = [1] * like.dim()
    shape[HEADS] = -1
    return sink.to(like.dtype).view(shape)


def normalizer(lse: torch.Tensor, sink) -> torch.Tensor:
    """LSE' = logaddexp(LSE, sink[h]) (LSE itself without a sink)."""
    return lse if sink is None else torch.logaddexp(lse, _per_head(sink, lse))


def gradient(sink: torch.Tensor, lse_all: torch.Tensor, dsum: torch.Tensor) -> torch.Tensor:
    """d sink [heads] fp32 from LSE' and D (same shape)."""
    p_sink = torch.exp(_per_head(sink, lse_all) - lse_all).nan_to_num(0.0)
    dims = tuple(a for a in range(lse_all.dim()) if a != HEADS)
    return -(p_sink * dsum).sum(dims).to(torch.float32)
