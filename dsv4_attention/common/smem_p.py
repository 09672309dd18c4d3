"""P through shared memory on SM90: the softmax's registers -> a swizzled SMEM buffer
-> the A operand of an SMEM-sourced PV wgmma.

Where P cannot stay in registers (stage D1: two warpgroups that split O's columns both
need every P of their rows), each thread stores the 16-bit P values it holds in the QK
accumulator layout into ``sP``, a (rows, keys, buffers) tile laid out exactly like a
K-major wgmma operand (keys are the PV GEMM's K):

    sP   S<3,4,3> o ((8, rows/8), (64, keys/64), buffers) : ((64, 512), (1, 64 rows), rows keys)

(``common.sm90_gemm.make_tile_smem_layout``, the layout TMA gives Q and K). The swizzle
acts on byte addresses: byte 2 * offset of element (m, k) has bits [4, 7) XORed with
bits [7, 10), i.e. the 16-byte chunk of a 128-byte row is XORed with the row index mod 8.

Who writes what (wgmma 64 x N accumulator, warp w' of the warpgroup, lane l):
thread (w', l) holds P[16 w' + l/4 + 8 r, 8 n + 2 (l % 4) + c] for r, c in {0, 1} and
each column octet n; it stores the pair (c = 0, 1) as one 32-bit word. One store
instruction of a warp (fixed r, n) writes rows 16 w' + 8 r + (0..7), four words of one
16-byte chunk per row: 8 rows x 16 bytes, and because the chunk index is XORed with the
row mod 8, the 8 rows land in 8 distinct chunks of the 128-byte bank window. That is one
wavefront per instruction, the minimum (tests/test_d1_sm90_smem_p.py counts it).

The PV wgmma reads sP through its SMEM descriptor (``partition_A`` of the same layout):
tests/test_d1_sm90_smem_p.py proves, for every (m, k), that the byte the store writes is
the byte the MMA reads, that every byte is written exactly once, and that the checker
rejects the element-index swizzle (swizzling element offsets instead of bytes).

Ordering (generic-proxy stores, async-proxy reads): every writer fences
(fence.proxy.async.shared::cta) after its stores, then syncs on a named barrier with
every thread whose P the reading warpgroups need; only then is the PV wgmma issued.
Reuse of a buffer waits for the wgmma that read it (warpgroup.wait_group) in every
reading warpgroup, which the kernels order through the same barriers (see stage D1).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from dsv4_attention.common.p_staging import convert_p_packed
from dsv4_attention.common.sm90_gemm import make_tile_smem_layout

P_KEYS_ALIGN = 64  # keys per 128-byte swizzled row of 16-bit P


def make_p_smem_layout(dtype: type[cutlass.Numeric], rows: int, keys: int, buffers: int) -> cute.ComposedLayout:
    """(rows, keys, buffers): P as a K-major, 128B-swizzled wgmma A operand."""
    if keys % P_KEYS_ALIGN:
        raise ValueError(f"SMEM-P needs a multiple of {P_KEYS_ALIGN} keys per tile (one swizzled row); got {keys}")
    return make_tile_smem_layout(dtype, rows, keys, buffers)


@cute.jit
def store_p(acc_s: cute.Tensor, r_p: cute.Tensor, tPsP: cute.Tensor):
    """Round the fp32 P in ``acc_s`` to 16 bits (``r_p``, laid out like ``acc_s``) and store
    it through ``tPsP`` (the QK accumulator partition of this thread's sP view), then make
    the stores visible to the async proxy. The caller syncs the readers after this."""
    convert_p_packed(acc_s, r_p)
    cute.autovec_copy(r_p, tPsP)
    cute.arch.fence_proxy("async.shared", space="cta")
