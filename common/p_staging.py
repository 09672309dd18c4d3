"""P between the two GEMMs of attention on SM90: the QK accumulator, rounded to
16 bits, is the PV wgmma's A operand in registers (FlashAttention-3's trick).

The QK MMA (wgmma 64x128x16, per warpgroup) leaves S in a per-thread fragment

    acc   ((2, 2, 16), 1, 1):((1, 2, 4), 0, 0)   value (c, r, n) = register c + 2 r + 4 n
          holds S[16 w + l/4 + 8 r,  8 n + 2 (l%4) + c]        (w warp, l lane)

and the PV MMA (wgmma 64xDx16 with A from registers) reads, for k-block j of
16 keys, the A fragment

    A     ((2, 2, 2), 1, 8):((1, 2, 4), 0, 8)    value ((c, r, h), 0, j) = register c + 2 r + 4 h + 8 j
          is P[16 w + l/4 + 8 r,  16 j + 8 h + 2 (l%4) + c]

Both number the same (m, key) pairs of the same thread; with n = 2 j + h the
register index c + 2 r + 4 n is the same on both sides. So the reinterpretation
is a relabelling of modes, not a data movement: the third accumulator mode
(16 column octets) is split into (2 octet halves of a k-block, 8 k-blocks),
the halves join the value mode and the k-blocks become the MMA's K mode:

    ((2, 2, V), M, N):((s_c, s_r, s_v), s_m, s_n)
        -> ((2, 2, 2), M, (V/2, N)):((s_c, s_r, s_v), s_m, (2 s_v, s_n))

``acc_to_a_layout`` computes that from the accumulator's own layout;
tests/test_b_sm90_p_fragment.py checks, for every thread and register, that the
(m, n) the QK partition gives equals the (m, k) the PV A-partition reads.
16-bit only: two values per 32-bit register in column order, as the A operand
of a 16-bit wgmma packs them (8-bit types would need a lane exchange).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from common.sm90_gemm import make_tiled_mma


def make_pv_tiled_mma(dtype: type[cutlass.Numeric], head_dim: int) -> cute.TiledMma:
    """O = P V: wgmma 64 x head_dim x 16 per warpgroup, A = P from registers
    (K-major: keys are its K), B = V from SMEM, MN-major (head_dim contiguous)."""
    return make_tiled_mma(dtype, head_dim, b_major=OperandMajorMode.MN, a_source=warpgroup.OperandSource.RMEM)


def acc_to_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """The layout that reads a QK accumulator fragment's registers as the PV A
    fragment: ((2, 2, V), M, N) -> ((2, 2, 2), M, (V/2, N)), same registers."""
    (c, r, v), m, n = acc_layout.shape
    (dc, dr, dv), dm, dn = acc_layout.stride
    if v % 2:
        raise ValueError(f"an A k-block is two accumulator column octets; got {v} octets")
    return cute.make_layout(((c, r, 2), m, (v // 2, n)), stride=((dc, dr, dv), dm, (2 * dv, dn)))


def as_a_operand(p: cute.Tensor) -> cute.Tensor:
    """The 16-bit P, laid out like the QK accumulator, as the PV MMA's A fragment."""
    return cute.make_tensor(p.iterator, acc_to_a_layout(p.layout))


@cute.jit
def convert_p(acc: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    """Round the fp32 P in ``acc`` to ``dtype`` into registers laid out exactly
    like ``acc`` (register i of P is register i of acc), and return them as the
    PV A operand."""
    if cutlass.const_expr(dtype.width != 16):
        raise TypeError(f"P must be a 16-bit type (two per A register, no lane exchange); got {dtype}")
    p = cute.make_rmem_tensor(acc.layout, dtype)
    p.store(acc.load().to(dtype))
    return as_a_operand(p)
