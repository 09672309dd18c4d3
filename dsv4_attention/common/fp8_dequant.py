"""The instructions that turn a paged FP8 cache's bytes into bf16 operands in shared memory
(common/kv_cache.py's MODEL1 layout; Hopper and Blackwell alike).

A kernel that reads the pages moves each token's 16-byte bf16 units itself, one thread a unit:

    ld.global.nc    8 e4m3 bytes (a NoPE unit) or 16 bf16 bytes (a RoPE unit), predicated: a list
                    position that names no token reads nothing and yields zeros
    dequantize      e4m3 -> f16 (cvt.rn.f16x2.e4m3x2, exact) -> f32, times the tile's scale
                    2^(e - 127) (a ue8m0 byte e), -> bf16 (cvt.rn.bf16x2.f32): exact for every
                    value bf16 can hold, as the format promises (module doc of kv_cache)
    st.shared       the 16 bytes at the unit's swizzled place in the operand tile

then ``fence.proxy.async.shared::cta`` before the barrier arrival that hands the tile to the
tensor cores (their reads are the async proxy; these stores are the generic one).
"""

from __future__ import annotations

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

#: fp32 bits of 2^-127 (a ue8m0 byte of 0): the one scale whose fp32 form is not (e << 23)
SCALE_OF_ZERO_BYTE = 0x00400000


def _values(res, n, loc, ip):
    return tuple(cutlass.Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n))


def _int(v, cls, loc, ip):
    return cls(v).ir_value(loc=loc, ip=ip)


@dsl_user_op
def load_8_bytes(addr: cutlass.Int64, base: cutlass.Int64, *, loc=None, ip=None):
    """Two 32-bit words from global ``base + addr`` (8-byte aligned), or (0, 0) without a read
    where ``base`` is 0 (a slot that names no token: the address is the flag, one register less);
    read-only path, no L1 allocation (each byte is read once a CTA)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        [_int(addr, cutlass.Int64, loc, ip), _int(base, cutlass.Int64, loc, ip)],
        "{\n .reg .pred p;\n .reg .b64 a;\n setp.ne.b64 p, $3, 0;\n add.s64 a, $2, $3;\n mov.b32 $0, 0;\n"
        " mov.b32 $1, 0;\n @p ld.global.nc.L1::no_allocate.v2.b32 {$0, $1}, [a];\n}",
        "=r,=r,l,l", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
        ip=ip,
    )
    return _values(res, 2, loc, ip)


@dsl_user_op
def load_16_bytes(addr: cutlass.Int64, base: cutlass.Int64, *, loc=None, ip=None):
    """Four 32-bit words from global ``base + addr`` (16-byte aligned), or zeros where ``base``
    is 0 (``load_8_bytes``)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_int(addr, cutlass.Int64, loc, ip), _int(base, cutlass.Int64, loc, ip)],
        "{\n .reg .pred p;\n .reg .b64 a;\n setp.ne.b64 p, $5, 0;\n add.s64 a, $4, $5;\n mov.b32 $0, 0;\n"
        " mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [a];\n}",
        "=r,=r,=r,=r,l,l", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )
    return _values(res, 4, loc, ip)


@dsl_user_op
def dequant_e4m3x8(w0: cutlass.Int32, w1: cutlass.Int32, scale_byte: cutlass.Int32, *, loc=None, ip=None):
    """8 e4m3 values (bytes 0-3 of ``w0``, then of ``w1``; byte 0 is the lowest dim) times
    2^(scale_byte - 127), as four bf16x2 words (dims 0-1, 2-3, 4-5, 6-7; the lower dim in the
    low half, as memory holds them)."""
    body = [
        "{",
        " .reg .b16 l0, h0, l1, h1;",
        " .reg .b32 x0, x1, x2, x3, sb;",
        " .reg .f16 a0, a1, a2, a3, a4, a5, a6, a7;",
        " .reg .f32 s, f0, f1, f2, f3, f4, f5, f6, f7;",
        " .reg .pred z;",
        " shl.b32 sb, $6, 23;",
        " setp.eq.u32 z, $6, 0;",
        f" selp.b32 sb, {SCALE_OF_ZERO_BYTE}, sb, z;",
        " mov.b32 s, sb;",
        " mov.b32 {l0, h0}, $4;",
        " mov.b32 {l1, h1}, $5;",
        " cvt.rn.f16x2.e4m3x2 x0, l0;",
        " cvt.rn.f16x2.e4m3x2 x1, h0;",
        " cvt.rn.f16x2.e4m3x2 x2, l1;",
        " cvt.rn.f16x2.e4m3x2 x3, h1;",
        " mov.b32 {a0, a1}, x0;",
        " mov.b32 {a2, a3}, x1;",
        " mov.b32 {a4, a5}, x2;",
        " mov.b32 {a6, a7}, x3;",
    ]
    body += [f" cvt.f32.f16 f{i}, a{i};" for i in range(8)]
    body += [f" mul.f32 f{i}, f{i}, s;" for i in range(8)]
    body += [f" cvt.rn.bf16x2.f32 ${i}, f{2 * i + 1}, f{2 * i};" for i in range(4)]  # the first operand: high half
    body.append("}")
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_int(w0, cutlass.Int32, loc, ip), _int(w1, cutlass.Int32, loc, ip), _int(scale_byte, cutlass.Int32, loc, ip)],
        "\n".join(body), "=r,=r,=r,=r,r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    return _values(res, 4, loc, ip)


def load_unit(data, offset, tile, scale_word=None):
    """One 16-byte bf16 unit of a token whose data starts at ``data`` (0: no token, zeros), from
    ``kv_cache.unit_bytes``' (offset, _, tile): RoPE (``tile`` None) as its 16 bytes, NoPE as 8 e4m3
    bytes times the tile's scale, byte ``tile % 4`` of ``scale_word`` (the token's scale bytes
    4 (tile // 4) ..)."""
    if tile is None:
        return load_16_bytes(cutlass.Int64(offset), data)
    w0, w1 = load_8_bytes(cutlass.Int64(offset), data)
    return dequant_e4m3x8(w0, w1, (scale_word >> (8 * (tile % 4))) & 0xFF)


@dsl_user_op
def store_16_bytes(smem_addr: cutlass.Int32, words, *, loc=None, ip=None) -> None:
    """Four 32-bit words to shared-window address ``smem_addr`` (16-byte aligned)."""
    llvm.inline_asm(
        None, [_int(smem_addr, cutlass.Int32, loc, ip)] + [_int(w, cutlass.Int32, loc, ip) for w in words],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


@dsl_user_op
def load_shared_16_bytes(smem_addr: cutlass.Int32, *, loc=None, ip=None):
    """Four 32-bit words from shared-window address ``smem_addr`` (16-byte aligned): a raw piece
    a thread staged there by cp.async (after its group's wait)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [_int(smem_addr, cutlass.Int32, loc, ip)],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    return _values(res, 4, loc, ip)
