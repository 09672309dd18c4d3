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


def check_attention_operands(dtype, mQ, mK, mV, mO, mLSE) -> None:
    """Trace-time check of an attention kernel's operands: Q, K, V, O in the kernel's
    16-bit dtype, LSE in fp32. (The host validation in common/validation.py has already
    named any user error; this guards a kernel compiled against the wrong tensors.)"""
    import cutlass

    for name, t in (("Q", mQ), ("K", mK), ("V", mV), ("O", mO)):
        if cutlass.const_expr(t.element_type != dtype):
            raise TypeError(f"{name} must be {dtype}, got {t.element_type}")
    if cutlass.const_expr(mLSE.element_type != cutlass.Float32):
        raise TypeError(f"LSE must be Float32, got {mLSE.element_type}")


def request_rows(mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, batch, group: int):
    """Variable-length batches (FlashAttention's cu_seqlens): request ``batch``'s first packed Q row
    and first key in the packed tensors, and its packed row and key counts,
    (q0 * g, k0, n_q * g, n_k), with g query heads folded into each token's rows (stage D2; 1
    unpacked). Both architectures' ``request_views`` offset their views by these."""
    q0, k0 = mCuSeqlensQ[batch], mCuSeqlensK[batch]
    return q0 * group, k0, (mCuSeqlensQ[batch + 1] - q0) * group, mCuSeqlensK[batch + 1] - k0


def with_row_vectors(t: cute.Tensor, elems: int = 8) -> cute.Tensor:
    """``t`` with each dynamic stride declared a multiple of ``elems`` (unit strides kept), so that
    ``elems`` consecutive elements of a row form one aligned vector (8 16-bit values: 16 bytes).
    For the caller to guarantee: the sm100 epilogues' O (``sm100_correction.o_row_smem_to_gmem``;
    TMA, their other O store, requires 16-byte-aligned strides too), stage F's dK / dV and its
    preprocess's O and dO, all contiguous with a head dim that is a multiple of 8, as the hosts
    check."""

    def declared(stride):
        if isinstance(stride, tuple):
            return tuple(declared(s) for s in stride)
        return stride if isinstance(stride, int) else cute.assume(stride, divby=elems)

    return cute.make_tensor(t.iterator, cute.make_layout(t.layout.shape, stride=declared(t.layout.stride)))
