"""Stage D5 on SM90, on the host (CPU, no GPU): the sink's factor reaches each row's own query head.

The epilogue's per-row scale (``row_scale``, D5's only code) is replayed with the kernel's own
code: a host function, compiled for sm_90a and run on the CPU, takes every consumer thread's QK
partition (``make_mmas``, ``s_coords``, the rows its softmax statistics are kept for:
``acc_rows_view``), gives each of its rows i a 1 / row sum and an LSE that depend on the tile row
only, calls ``row_scale(inv_sum, lse, mSink, tScS, m_block, head)`` as the epilogue does, and
records what it made of inv_sum. For the three consumer layouts (rows, the lock-step split, the
seesaw) and pack groups 1, 8, 128, every Q tile of a short problem and both KV heads, each row's
result must be its input times sigmoid(LSE - sink[query head]), where packed row r of KV head hk
is query head hk g + r % g (D2's map, ``pack_heads.packed_row``), to fp32 rounding; a row whose
LSE is -inf (no visible key) must come out 0.
Negative controls the same checker rejects: a sink read at the token (r // g) instead of the head
in the group, and one read at the KV head alone (hk, the map without the group).
"""

from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Float32, Int32
from sm90_mask_replay import consumer_s_coords

from dsv4_attention.common.pack_heads import packed_row
from dsv4_attention.common.softmax import acc_rows_view

pytestmark = [pytest.mark.arch("sm90"), pytest.mark.stage_d5, pytest.mark.proof]

KERNELS = {  # name: (head_dim, options, (split, seesaw))
    "rows-g1": (128, {"pack_group": 1, "kv_shared": False}, (False, False)),
    "rows-g8": (128, {"pack_group": 8, "kv_shared": False}, (False, False)),
    "split-g8": (512, {"pack_group": 8, "kv_shared": False}, (True, False)),
    "seesaw-g128": (512, {"pack_group": 128, "kv_shared": True}, (True, True)),
}
HK = 2  # KV heads (heads = HK * g)
TOKENS = 3  # query tokens: with g = 1 part of one tile, with g = 128 three tiles and more


def kernel_class(wrong: str | None):
    from sink_cases import bare_sigmoid_factor

    from dsv4_attention.common.softmax import sink_factor
    from dsv4_attention.stages.d5_sink_merge.sm90 import FlashAttentionD5Sm90

    if wrong is None:
        return FlashAttentionD5Sm90

    class WrongHead(FlashAttentionD5Sm90):
        """Wrong on purpose: the sink indexed by the token (r // g) or by the KV head alone, or the
        bare sigmoid (no empty-row case)."""

        @cute.jit
        def row_scale(self, inv_sum, lse, mSink, tScS, m_block, head):
            rows_c = acc_rows_view(tScS)
            g = self.pack_group
            for i in cutlass.range_constexpr(cute.size(inv_sum)):
                r = m_block * self.tile_m + rows_c[i, 0][0]
                if cutlass.const_expr(wrong == "bare_sigmoid"):
                    inv_sum[i] = inv_sum[i] * bare_sigmoid_factor(lse[i], mSink[head * g + r % g])
                else:
                    q_head = head * g + r // g if cutlass.const_expr(wrong == "token") else head
                    inv_sum[i] = inv_sum[i] * sink_factor(lse[i], mSink[q_head % mSink.shape[0]])

    return WrongHead


def row_input(row: int) -> tuple[float, float]:
    """(1 / row sum, LSE) given to tile row ``row``: distinct per row, every fifth row empty."""
    return 1.0 + 0.01 * row, (-math.inf if row % 5 == 3 else 0.3 * (row % 11) - 1.0)


@functools.cache
def runner(name: str, wrong: str | None = None):
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch

    head_dim, options, layout = KERNELS[name]
    kernel = kernel_class(wrong)(jit.cutlass_dtype(torch.bfloat16), head_dim, has_sink=True, **options)
    assert (kernel.col_split, kernel.seesaw) == layout, f"{name} is not the layout it is named for"

    @cute.jit
    def host(out: cute.Tensor, rows_out: cute.Tensor, sink: cute.Tensor, inv_in: cute.Tensor, lse_in: cute.Tensor,
             m_block: Int32, head: Int32):
        qk_mma, _ = kernel.make_mmas()
        for tidx in cutlass.range(kernel.consumer_threads, unroll=1):
            _, tScS = consumer_s_coords(kernel, qk_mma, tidx)
            rows_c = acc_rows_view(tScS)
            n = cute.size(rows_c, mode=[0])
            inv_sum = cute.make_rmem_tensor(n, Float32)
            lse = cute.make_rmem_tensor(n, Float32)
            for i in cutlass.range_constexpr(n):
                row = rows_c[i, 0][0]
                rows_out[tidx, i] = row
                inv_sum[i] = inv_in[row]
                lse[i] = lse_in[row]
            kernel.row_scale(inv_sum, lse, sink, tScS, m_block, head)
            for i in cutlass.range_constexpr(n):
                out[tidx, i] = inv_sum[i]

    rows_per_thread = 2  # a wgmma m64 accumulator: each thread holds rows r and r + 8 of its warp's 16
    g = options["pack_group"]
    bufs = (torch.zeros(kernel.consumer_threads, rows_per_thread), torch.zeros(kernel.consumer_threads,
                                                                                rows_per_thread, dtype=torch.int32),
            torch.zeros(HK * g), torch.zeros(kernel.tile_m), torch.zeros(kernel.tile_m))
    with target_arch("sm90"):
        fn = cute.compile(host, *[from_dlpack(b) for b in bufs], Int32(0), Int32(0),
                          options=f"--gpu-arch={GPU_ARCH['sm90']}")
    return kernel, fn, bufs


def mismatches(name: str, wrong: str | None = None, infinite: bool = False) -> list:
    """``infinite``: a third of the heads' sinks -inf and a third +inf (FlashMLA's draw), so every
    empty row (every fifth) meets sinks of -inf, +inf and finite ones."""
    from cutlass.cute.runtime import from_dlpack

    kernel, fn, (out, rows_out, sink, inv_in, lse_in) = runner(name, wrong)
    g = kernel.pack_group
    gen = torch.Generator().manual_seed(5)
    sink.copy_(torch.randn(HK * g, generator=gen) * 2)
    if infinite:
        sink[0::3], sink[1::3] = -math.inf, math.inf
    for row in range(kernel.tile_m):
        inv_in[row], lse_in[row] = row_input(row)
    bad = []
    for hk in range(HK):
        for m in range(-(-TOKENS * g // kernel.tile_m)):
            out.fill_(float("nan"))
            fn(*[from_dlpack(b) for b in (out, rows_out, sink, inv_in, lse_in)], Int32(m), Int32(hk))
            assert sorted(set(rows_out.flatten().tolist())) == list(range(kernel.tile_m)), "rows a tile does not have"
            for t in range(kernel.consumer_threads):
                for i in range(rows_out.shape[1]):
                    row = int(rows_out[t, i])
                    token, q_head = packed_row(m * kernel.tile_m + row, g, hk)
                    inv, lse = row_input(row)
                    want = 0.0 if lse == -math.inf else inv / (1.0 + math.exp(float(sink[q_head]) - lse))
                    got = float(out[t, i])
                    if not abs(got - want) <= 1e-5 * abs(want) + 1e-30:
                        bad.append(f"{name} hk{hk} m{m} thread {t} row {row} (token {token}, head {q_head}): "
                                   f"{got} want {want}")
    return bad[:5]


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("infinite", [False, True], ids=["finite", "inf_sinks"])
def test_sink_factor_reaches_each_rows_query_head(name, infinite):
    assert mismatches(name, infinite=infinite) == []


@pytest.mark.parametrize("wrong", ["token", "kv_head", "bare_sigmoid"])
def test_checker_rejects_a_sink_read_at_the_wrong_head(wrong):
    """bare_sigmoid: the right head, but the factor without its empty-row case (NaN where a row
    with no key meets a sink of -inf): rejected with infinite sinks."""
    assert mismatches("rows-g8", wrong, infinite=wrong == "bare_sigmoid")
