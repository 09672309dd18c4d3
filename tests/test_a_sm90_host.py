"""Stage A on SM90, on the host (CPU, no GPU): every accumulator value lands on its own S element.

The truth is the PTX ISA's wgmma accumulator fragment (m64nNk16, f32 D), independent of CuTe:
register 4 j + 2 r + c of lane l in warp w of warpgroup g holds

    S[64 g + 16 w + l / 4 + 8 r,  8 j + 2 (l % 4) + c]            (of the CTA's 128 x 128 tile)

1. The kernel's tiled MMA (``make_tiled_mma``), partitioned as the kernel partitions it
   (``get_slice(tidx).partition_C``), gives every thread exactly those coordinates.
2. The epilogue's ``store_tile`` is compiled into a host function for sm_90a and *run on the CPU*
   for every thread of every tile of S [2, 2, seqlen_q, seqlen_k] at (head, batch) = (1, 1) and
   (0, 1) (lengths that are not multiples of 128; S padded by 3 rows and 3 columns): each
   thread's accumulator holds the tag of the element the PTX formula gives it, and stores into its
   own NaN-filled copy of S. Each copy must hold exactly that thread's in-bounds elements of that
   (batch, head), each with its own tag; nothing in the padding, past seqlen_q / seqlen_k or in
   another head or batch. Both store forms run: column pairs as one 8-byte store (even strides)
   and single stores (odd). The kernel builds the epilogue's coordinate tile (``cS``) and picks
   the store form inline in ``kernel``; the host function restates those few lines (the
   accumulator scaling before them is not replayed).
Negative controls the same checker rejects: a store that swaps each column pair, one whose column
or row predicate is off by one (col <= seqlen_k, row <= seqlen_q), and one into S[head, batch]
instead of S[batch, head].
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Float32, Int32

pytestmark = [pytest.mark.arch("sm90"), pytest.mark.stage_a, pytest.mark.proof]

THREADS, TILE = 256, 128
PAD = 3  # columns of S past seqlen_k that must stay untouched


def ptx_coord(t: int, i: int) -> tuple[int, int]:
    """(row, col) in the tile of register i of thread t, from the PTX ISA's fragment figure."""
    c, r, j = i % 2, (i // 2) % 2, i // 4
    g, w, lane = t // 128, (t % 128) // 32, t % 32
    return 64 * g + 16 * w + lane // 4 + 8 * r, 8 * j + 2 * (lane % 4) + c


def tag(row: int, col: int) -> float:
    return float(row * 4096 + col + 1)  # exact in fp32 below 2**24


def kernel_class(wrong: str | None):
    from dsv4_attention.stages.a_qk_gemm.sm90 import TILE_M, TILE_N, QKGemmSm90

    if wrong is None:
        return QKGemmSm90

    class Wrong(QKGemmSm90):
        @cute.jit
        def store_tile(self, acc, tScS, thr_mma, mS, head, batch, m_block, n_block, pair_stores):
            seqlen_q, seqlen_k = mS.shape[0], mS.shape[1]
            if cutlass.const_expr(wrong == "head_batch_swapped"):
                head, batch = batch, head
            gS = cute.local_tile(mS[None, None, head, batch], (TILE_M, TILE_N), (m_block, n_block))
            tSgS = thr_mma.partition_C(gS)
            row_end = seqlen_q + 1 if wrong == "row_off_by_one" else seqlen_q  # Python: fixed per class
            col_end = seqlen_k + 1 if wrong == "off_by_one" else seqlen_k
            a, b = (1, 0) if wrong == "swapped_pair" else (0, 1)
            for p in cutlass.range_constexpr(cute.size(acc) // 2):
                row, col = tScS[2 * p]
                if row < row_end:
                    if col < col_end:
                        tSgS[2 * p] = acc[2 * p + a]
                    if col + 1 < col_end:
                        tSgS[2 * p + 1] = acc[2 * p + b]

    return Wrong


def test_partition_is_the_ptx_fragment():
    from dsv4_attention.common.layout_proof import trace
    from dsv4_attention.common.sm90_gemm import make_tiled_mma

    def fn():
        tiled = make_tiled_mma(cutlass.BFloat16)
        ids = cute.make_identity_tensor((TILE, TILE))
        out = {}
        for t in range(THREADS):
            part = tiled.get_slice(t).partition_C(ids)
            out[t] = [tuple(int(x) for x in part[i]) for i in range(cute.size(part))]
        return out

    got = trace(fn, arch="sm90")
    bad = [(t, i, got[t][i], ptx_coord(t, i)) for t in range(THREADS) for i in range(len(got[t]))
           if got[t][i] != ptx_coord(t, i)]
    assert len(got[0]) == 64 and not bad, bad[:3]


@functools.cache
def store_runner(pair_stores: bool, wrong: str | None = None):
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.layouts import scores_major
    from dsv4_attention.common.sm90_gemm import make_tiled_mma

    kernel = kernel_class(wrong)(cutlass.BFloat16, 128)

    @cute.jit
    def host(s_all: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32, n_block: Int32, head: Int32,
             batch: Int32):
        tiled_mma = make_tiled_mma(kernel.dtype)
        for tidx in cutlass.range(THREADS, unroll=1):
            thr_mma = tiled_mma.get_slice(tidx)
            acc = thr_mma.make_fragment_C(thr_mma.partition_shape_C((TILE, TILE)))
            g, w, lane = tidx // 128, (tidx % 128) // 32, tidx % 32
            for i in cutlass.range_constexpr(cute.size(acc)):  # the PTX fragment's tags
                row = m_block * TILE + 64 * g + 16 * w + lane // 4 + 8 * ((i // 2) % 2)
                col = n_block * TILE + 8 * (i // 4) + 2 * (lane % 4) + i % 2
                acc[i] = Float32(row * 4096 + col + 1)
            cS = cute.local_tile(cute.make_identity_tensor((seqlen_q, seqlen_k)), (TILE, TILE), (m_block, n_block))
            tScS = thr_mma.partition_C(cS)
            # this thread's copy of S [batch, heads, seqlen_q, seqlen_k] (rows and columns padded),
            # as the kernel sees it: (seqlen_q, seqlen_k, heads, batch)
            mine = cute.domain_offset((tidx, 0, 0, 0, 0), s_all)
            mS = scores_major(cute.make_tensor(mine.iterator, cute.make_layout(
                (s_all.shape[1], s_all.shape[2], seqlen_q, seqlen_k),
                stride=(s_all.stride[1], s_all.stride[2], s_all.stride[3], 1))))
            if cutlass.const_expr(pair_stores):  # the kernel's even-stride view (its epilogue's dispatch)
                s0, s1, s2, s3 = mS.stride
                mS = cute.make_tensor(mS.iterator, cute.make_layout(mS.shape, stride=(
                    cute.assume(s0, divby=2), s1, cute.assume(s2, divby=2), cute.assume(s3, divby=2))))
            kernel.store_tile(acc, tScS, thr_mma, mS, head, batch, m_block, n_block, pair_stores)

    example = torch.zeros(2, 2, 2, 4 + PAD, 8 + PAD)
    with target_arch("sm90"):
        fn = cute.compile(host, jit.as_cute(example), *([Int32(1)] * 6), options=f"--gpu-arch={GPU_ARCH['sm90']}")
    return fn


def store_mismatches(seqlen_q: int, seqlen_k: int, pair_stores: bool, wrong: str | None = None) -> list:
    from dsv4_attention.common import jit

    fn = store_runner(pair_stores, wrong)
    width = seqlen_k + PAD
    assert (width % 2 == 0) == pair_stores, "pair stores need even row strides"
    bad = []
    for head, batch in ((1, 1), (0, 1)):
        for mb in range(-(-seqlen_q // TILE)):
            for nb in range(-(-seqlen_k // TILE)):
                s_all = torch.full((THREADS, 2, 2, seqlen_q + PAD, width), float("nan"))
                fn(jit.as_cute(s_all), *[Int32(x) for x in (seqlen_q, seqlen_k, mb, nb, head, batch)])
                for t in range(THREADS):
                    want = torch.full((2, 2, seqlen_q + PAD, width), float("nan"))
                    for i in range(64):
                        row, col = ptx_coord(t, i)
                        row, col = mb * TILE + row, nb * TILE + col
                        if row < seqlen_q and col < seqlen_k:
                            want[batch, head, row, col] = tag(row, col)
                    got = s_all[t]
                    same = (got == want) | (got.isnan() & want.isnan())
                    if not bool(same.all()):
                        at = tuple(torch.nonzero(~same)[0].tolist())
                        bad.append(f"sq{seqlen_q} sk{seqlen_k} (h{head}, b{batch}) tile ({mb}, {nb}) thread {t}: "
                                   f"S[b, h, i, j = {at}] = {float(got[at])}, want {float(want[at])}")
                        break
    return bad[:5]


@pytest.mark.parametrize("seqlen_q,seqlen_k,pair_stores", [(200, 133, True), (130, 250, False), (64, 96, False)],
                         ids=["even-strides-pairs", "odd-strides-singles", "one-tile-singles"])
def test_every_value_lands_on_its_element(seqlen_q, seqlen_k, pair_stores):
    assert store_mismatches(seqlen_q, seqlen_k, pair_stores) == []


@pytest.mark.parametrize("wrong", ["swapped_pair", "off_by_one", "head_batch_swapped", "row_off_by_one"])
def test_checker_rejects_wrong_stores(wrong):
    assert store_mismatches(130, 250, False, wrong)
