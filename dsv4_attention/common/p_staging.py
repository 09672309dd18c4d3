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
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode
from cutlass.cutlass_dsl import T, dsl_user_op

from dsv4_attention.common.sm90_gemm import NUM_MMA_WARPGROUPS, make_tiled_mma


def make_pv_tiled_mma(
    dtype: type[cutlass.Numeric], head_dim: int, warpgroups: int = NUM_MMA_WARPGROUPS
) -> cute.TiledMma:
    """O = P V: wgmma 64 x head_dim x 16 per warpgroup, A = P from registers
    (K-major: keys are its K), B = V from SMEM, MN-major (head_dim contiguous)."""
    return make_tiled_mma(
        dtype, head_dim, b_major=OperandMajorMode.MN, a_source=warpgroup.OperandSource.RMEM, warpgroups=warpgroups
    )


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


@dsl_user_op
def _cvt_pair(
    lo: cutlass.Float32, hi: cutlass.Float32, dtype: cutlass.Constexpr, *, loc=None, ip=None
) -> cutlass.Int32:
    """Two fp32 values rounded (to nearest even) into one 32-bit register of two
    16-bit values, ``lo`` in the low half (the lower column, as the A operand packs them)."""
    name = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [cutlass.Float32(lo).ir_value(loc=loc, ip=ip), cutlass.Float32(hi).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{name}.f32 $0, $2, $1;",  # cvt d, a, b puts a in the high half
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_p_packed(acc: cute.Tensor, p: cute.Tensor):
    """``convert_p`` into an existing 16-bit fragment ``p`` (laid out like ``acc``),
    one ``cvt.rn.{bf16,f16}x2.f32`` per register pair whatever the tile width (the
    generic conversion falls back to one value at a time for widths other than 128)."""
    if cutlass.const_expr(p.element_type.width != 16):
        raise TypeError(f"P must be a 16-bit type; got {p.element_type}")
    pairs = cute.recast_tensor(p, cutlass.Int32)
    for i in cutlass.range_constexpr(cute.size(pairs)):
        pairs[i] = _cvt_pair(acc[2 * i], acc[2 * i + 1], p.element_type)
