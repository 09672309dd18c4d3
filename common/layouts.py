"""Global-memory views shared by every stage.

Users hand over tensors in the torch / FlashAttention layout ``[batch, seqlen,
heads, head_dim]`` (head_dim contiguous). The kernels tile the sequence and the
head dim, so they see the same memory with the modes reordered:

    q, k, v : (batch, seqlen, heads, head_dim)   -> (seqlen, head_dim, heads, batch)
    s       : (batch, heads, seqlen_q, seqlen_k) -> (seqlen_q, seqlen_k, heads, batch)

The first two modes are the tile modes (what TMA boxes and ``local_tile`` cut),
the last two pick the (head, batch) a CTA works on. Only the layout changes;
the pointer and the strides are the user's.
"""

import cutlass.cute as cute

# mode orders: new mode i is old mode ORDER[i]
BSHD_TO_SDHB = (1, 3, 2, 0)
BHQK_TO_QKHB = (2, 3, 1, 0)


def reorder(t: cute.Tensor, order) -> cute.Tensor:
    """The same tensor with its modes permuted (new mode i = old mode order[i])."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(order)))


def seq_major(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, head_dim) -> (seqlen, head_dim, heads, batch)."""
    return reorder(t, BSHD_TO_SDHB)


def scores_major(t: cute.Tensor) -> cute.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) -> (seqlen_q, seqlen_k, heads, batch)."""
    return reorder(t, BHQK_TO_QKHB)
