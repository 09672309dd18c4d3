"""Stage E's gather from a paged FP8 cache on Blackwell (index mode over common/kv_cache.py's MODEL1
pages, ``kv_pages`` tokens a page; the sm90 twin is sm90_pages.py). Compiled and proven on the host
only: no Blackwell GPU has run it.

The TMA warp fills each ring stage itself instead of issuing a gather4: K block kb of tile n is
the (T keys, 64 columns) block whose columns are NoPE tile kb (kb < 7, one ue8m0 scale) or the
RoPE dims (kb = 7). Lane l owns 16-byte unit u = l % 8 of the block's rows l / 8 + 4 p
(p < T / 4), as 8 lanes a row keep a row's 64 source bytes in one read:

    kb < 7:  8 e4m3 bytes at data + 64 kb + 8 u, times 2^(scale byte kb - 127) -> 8 bf16
    kb = 7:  16 bf16 bytes of RoPE at data + 448 + 16 u

(``kv_cache.token_bytes`` / ``unit_bytes``, the format's own map), stored at the unit's byte in the
stage (``unit_byte``: the K-major block layout the MMA reads, ``block_rows_layout``, under the
ring's 128-byte swizzle; proven on the host against the ring's own layout). The ring's stages then
complete on the 32 lanes' arrivals after a proxy fence, not on TMA bytes: its pipeline is
``PipelineAsyncUmma`` (``make_ring_pipeline``), the MMA side unchanged.
"""

import cutlass
import cutlass.cute as cute
from cutlass import pipeline

from dsv4_attention.common.fp8_dequant import load_8_bytes, load_unit, store_16_bytes
from dsv4_attention.common.kv_cache import token_bytes, unit_bytes
from dsv4_attention.common.sm100_kv import block_rows_layout

UNITS = 8  # 16-byte bf16 units of a 64-column block row
LANES = 32


def swizzled(byte_offset, bits: int, base: int, shift: int):
    """CuTe's Swizzle<bits, base, shift> on a byte offset (Python or DSL integers alike)."""
    return byte_offset ^ ((byte_offset >> shift) & (((1 << bits) - 1) << base))


class PagedFp8GatherSm100:
    """The FP8 page gather's methods, mixed into stage E's sm100 kernel class."""

    def make_ring_pipeline(self, barriers, one_thread):
        if not self.kv_pages:
            return super().make_ring_pipeline(barriers, one_thread)
        # the TMA warp's 32 lanes store each stage and arrive, each after its proxy fence
        return pipeline.PipelineAsyncUmma.create(
            num_stages=self.plan.ring_stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, LANES),
            consumer_group=one_thread, barrier_storage=barriers, defer_sync=True,
        )  # fmt: skip

    def stage_placement(self) -> tuple:
        """(a K block's row layout, (bits, base, shift) of the ring's swizzle): where a stage holds
        key r, column c (``block_rows_layout`` of ``make_smem_layouts``' k_ring; static, built once
        a block's gather)."""
        from dsv4_attention.common.sm100_smem_p import make_pv_mma, make_qk_mma, make_smem_layouts

        plan = self.plan
        k_ring = make_smem_layouts(self.dtype, plan, make_qk_mma(self.dtype, plan), make_pv_mma(self.dtype, plan))[1]
        sw = k_ring.inner
        rows = block_rows_layout(cute.select(k_ring.outer, mode=[0, 1, 2]))
        return rows, (int(sw.num_bits), int(sw.num_base), int(sw.num_shift))

    def unit_byte(self, row, unit, placement: tuple):
        """The byte, from the stage's first, of 16-byte unit ``unit`` (columns 8 unit ..) of key row
        ``row`` of a K block (``placement``: ``stage_placement()``)."""
        rows, swizzle = placement
        return swizzled(rows((row, unit * 8)) * 2, *swizzle)

    @cute.jit
    def gather_fp8_block(self, span, tile, kb: int, mPages: cute.Tensor, dst: cute.Tensor, barrier, mExtra=None):
        """K block ``kb`` of gathered tile ``tile`` -> the ring stage at ``dst``, dequantized (module
        doc), then each lane's fence and arrival on the stage's full barrier. ``mExtra``
        (``kv_pages_extra``): the second cache, its tokens named by resolved entries >= ``span.first``
        (common/compressed.TwoListSpan)."""
        lane = cute.arch.lane_idx()
        unit = lane % UNITS
        off, _, scale_tile = unit_bytes(kb, unit)
        base = mPages.iterator.toint()
        page_stride = cutlass.Int64(mPages.stride[0])
        placement = self.stage_placement()
        s_base = dst.iterator.toint()
        for p in cutlass.range_constexpr(span.tile_n * UNITS // LANES):
            row = lane // UNITS + p * (LANES // UNITS)
            j = span.listed_entry(tile, row)
            d_off, s_off = token_bytes(cutlass.Int64(cutlass.max(j, 0)), self.kv_pages, page_stride)
            start = base + d_off
            to_scales = s_off - d_off  # from the token's data to its scale bytes
            if cutlass.const_expr(mExtra is not None):  # a resolved entry >= first: the second cache's slot
                d_b, s_b = token_bytes(cutlass.Int64(cutlass.max(j - span.first, 0)), self.kv_pages_extra,
                                       cutlass.Int64(mExtra.stride[0]))
                in_b = j >= span.first
                start = mExtra.iterator.toint() + d_b if in_b else start
                to_scales = s_b - d_b if in_b else to_scales
            data = start if j >= 0 else cutlass.Int64(0)  # 0: the loads' "no token"
            scale_word = None
            if cutlass.const_expr(scale_tile is not None):
                scale_word = load_8_bytes(to_scales, data)[scale_tile // 4]
            words = load_unit(data, off, scale_tile, scale_word)
            store_16_bytes(s_base + self.unit_byte(row, unit, placement), words)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(barrier)
