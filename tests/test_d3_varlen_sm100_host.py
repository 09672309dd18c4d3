"""Stage D3's variable-length batches on SM100, on the host (CPU, no GPU): what each CTA stores, and
the compile budgets.

1. Stores, run. The kernel's own code (``row_views``, ``request_views``, ``q_tile_of``,
   ``tile_has_rows``, ``o_by_tma``, ``o_tile``, ``o_load`` / ``o_row_part``: the correction threads'
   row partition, ``row_stored``) is compiled into a host function and *run on the CPU* on
   coordinate tensors of O's and LSE's shapes ([1, total, heads, d] and [1, heads, total]): an
   element of such a view is the (batch, token, head, column) / (batch, head, token) it addresses.
   For every request b, KV head hk and CTA of the varlen grid, the run replays the epilogue's
   stores: a tile of only the request's rows as one TMA box (rows past the tensor clipped, as TMA
   does), the tile that straddles the request's end row by row, each correction thread its own row
   if ``row_stored``, and LSE by the O-half-0 CTA for the rows < the request's. Each store counts at
   the coordinate it addresses, tagged with what the kernel meant to store there (b, hk, packed row
   of the request, column). The checker asserts: every element of every request's tokens is stored
   exactly once, by its request, as (token cu_q[b] + r // g, head hk g + r % g, column); nothing
   outside a request's tokens (the padding after the last) is stored; no row-by-row store leaves the
   tensor; LSE likewise. The request's row and key counts and its K / V views' first key are
   checked too. Random cu_seqlens with requests of 0 queries, 0 keys, full tiles and straddling
   ones, for pack groups 1, 8, 64, 128 and O split over two CTAs (head dim 512), the reversed
   tile order of causal D4, and stage E's padded tile (top-k with 64 heads: one token a 128-row
   tile, rows 64 .. 127 never stored). Negative controls the same checker rejects: a request
   offset by cu_q[b] packed rows (the * g forgotten), the TMA box used on the straddling tile, a
   row-by-row store that keeps every row, and a padded tile that stores its padding rows.
2. Compile budgets (marked compile / slow): D3 varlen at head dims 128 and 512, D4 varlen with
   window bounds.
"""

from __future__ import annotations

import functools
import random

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32
from partitions import inside, put

from dsv4_attention.common.tmem import EPI_THREADS, QK_TILE_M
from dsv4_attention.stages.d3_lengths.sm100 import FlashAttentionD3Sm100
from dsv4_attention.stages.d4_causal_window.sm100 import FlashAttentionD4Sm100
from dsv4_attention.stages.e_fused.sm100 import FlashAttentionESm100

pytestmark = [pytest.mark.arch("sm100"), pytest.mark.stage_d3]

#: a store's tag: ((b * KV_HEADS_MAX + hk) * ROWS_MAX + packed row) * COLS_MAX + column
KV_HEADS_MAX, ROWS_MAX, COLS_MAX = 4, 1 << 14, 512


def tag(b, hk, row, col):
    return ((b * KV_HEADS_MAX + hk) * ROWS_MAX + row) * COLS_MAX + col


def make_kernel(head_dim: int, cls=FlashAttentionD3Sm100, **options):
    from dsv4_attention.common import jit

    return cls(jit.cutlass_dtype(torch.bfloat16), head_dim, varlen=True, **options)


def build_store_runner(kernel):
    """A host function (compiled for sm100, run on the CPU) that replays every store of the varlen
    kernel's epilogue over coordinate views, with the kernel's own seams and builders."""
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.layouts import reorder, seq_major
    from dsv4_attention.common.tmem import placeholder_tmem_base
    from dsv4_attention.stages.d1_smem_p.sm100 import LSE_ROW_MAJOR, V_AS_PV_B

    o_cols = kernel.plan.o_cols

    @cute.jit
    def host(count: cute.Tensor, who: cute.Tensor, lse_count: cute.Tensor, lse_who: cute.Tensor,
             info: cute.Tensor, oob: cute.Tensor, cu_q: cute.Tensor, cu_k: cute.Tensor, total_k: Int32,
             grid_x: Int32):
        # O's and LSE's views as __call__ builds them, over coordinates instead of memory
        o_ids = cute.make_identity_tensor(count.shape)
        q, o, lse = kernel.row_views(seq_major(o_ids), seq_major(o_ids),
                                     reorder(cute.make_identity_tensor(lse_count.shape), LSE_ROW_MAJOR))
        kv_ids = cute.make_identity_tensor((1, total_k, q.shape[2], count.shape[3]))
        k = seq_major(kv_ids)
        v = k if cutlass.const_expr(kernel.kv_shared) else reorder(kv_ids, V_AS_PV_B)  # mV is K's view when K = V
        tiled_o_load, _ = kernel.o_load(placeholder_tmem_base())
        tile_ids = cute.make_identity_tensor((QK_TILE_M, o_cols))
        for r in cutlass.range(cu_q.shape[0] - 1, unroll=1):
            for h in cutlass.range(q.shape[2], unroll=1):
                mQ, mK, mV, mO, mO_mem, mLSE, bi, n_rows, n_keys = kernel.request_views(
                    r, q, k, v, o, o, lse, None, cu_q, cu_k)
                info[r, h, 0] = n_rows
                info[r, h, 1] = n_keys
                info[r, h, 2] = mK[0, 0, h, bi][1]  # K's first key: a token of the K tensor
                info[r, h, 3] = mV[0, 0, h, bi][1]
                info[r, h, 4] = mQ[0, 0, h, bi][1]  # Q's first row: a token of the Q tensor
                for bx in cutlass.range(grid_x, unroll=1):
                    m_blk, half = kernel.q_tile_of(bx, grid_x)
                    if kernel.tile_has_rows(m_blk, n_rows):
                        rows_left = n_rows - m_blk * kernel.owned_rows  # owned_rows: QK_TILE_M but padded
                        if kernel.o_by_tma(rows_left):  # one box; TMA clips what lies past the tensor
                            box = kernel.o_tile(mO, m_blk, half, h, bi)
                            for i in cutlass.range(QK_TILE_M, unroll=1):
                                for j in cutlass.range(o_cols, unroll=1):
                                    crd = box[i, j]
                                    if inside(crd, count.shape):
                                        put(count, who, crd, tag(r, h, m_blk * QK_TILE_M + i, half * o_cols + j))
                        else:  # row by row: each correction thread its own row, when row_stored
                            for t in cutlass.range(EPI_THREADS, unroll=1):
                                thr = tiled_o_load.get_slice(t)
                                ids = kernel.o_row_part(thr, tile_ids)
                                if kernel.row_stored(ids[0][0], rows_left):
                                    dst = kernel.o_row_part(thr, kernel.o_tile(mO_mem, m_blk, half, h, bi))
                                    for i in cutlass.range(cute.size(dst), unroll_full=True):
                                        crd = dst[i]
                                        if inside(crd, count.shape):
                                            put(count, who, crd, tag(r, h, m_blk * kernel.owned_rows + ids[i][0],
                                                                     half * o_cols + ids[i][1]))
                                        else:
                                            oob[0] = oob[0] + 1
                        for t in cutlass.range(EPI_THREADS, unroll=1):  # LSE: as the correction threads
                            row = kernel.o_row_part(tiled_o_load.get_slice(t), tile_ids)[0][0]
                            q_row = kernel.packed_row(m_blk, row)
                            if half == 0 and kernel.lse_stored(row, q_row, n_rows):
                                crd = mLSE[q_row, h, bi]
                                if inside(crd, lse_count.shape):
                                    put(lse_count, lse_who, crd, tag(r, h, q_row, 0))
                                else:
                                    oob[0] = oob[0] + 1

    bufs = store_buffers(kernel, [0, 1, 1], [0, 1, 1], 1)
    with target_arch("sm100"):
        fn = cute.compile(host, *[jit.as_cute(b) for b in bufs], Int32(1), Int32(1),
                          options=f"--gpu-arch={GPU_ARCH['sm100']}")
    return fn


def store_buffers(kernel, cu_q, cu_k, total_q, kv_heads=2):
    """count, who (O's shape), lse_count, lse_who (LSE's), info, oob, cu_q, cu_k."""
    heads = kv_heads * kernel.pack_group
    o_shape, lse_shape = (1, total_q, heads, kernel.head_dim), (1, heads, total_q)
    i32 = dict(dtype=torch.int32)
    return (torch.zeros(o_shape, **i32), torch.full(o_shape, -1, **i32), torch.zeros(lse_shape, **i32),
            torch.full(lse_shape, -1, **i32), torch.zeros(len(cu_q) - 1, kv_heads, 5, **i32), torch.zeros(1, **i32),
            torch.tensor(cu_q, **i32), torch.tensor(cu_k, **i32))


def random_cu(rnd, requests: int, max_len: int, zeros: bool = True):
    lengths = [rnd.choice([0, rnd.randint(1, max_len), max_len]) if zeros else rnd.randint(1, max_len)
               for _ in range(requests)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@functools.cache
def store_runner(cls, head_dim: int, options: tuple):
    kernel = make_kernel(head_dim, cls=cls, **dict(options))
    return kernel, build_store_runner(kernel)


def store_failures(cls, head_dim, options: dict, cu_q, cu_k, pad: int = 3, kv_heads: int = 2) -> list[str]:
    """Every way the replayed stores break "each element of request b's tokens is stored exactly once,
    by request b, as (token cu_q[b] + r // g, head hk g + r % g, column); nothing else is stored"."""
    from dsv4_attention.common import jit

    kernel, fn = store_runner(cls, head_dim, tuple(sorted(options.items())))
    g, d = kernel.pack_group, kernel.head_dim
    total_q = cu_q[-1] + pad  # tokens after the last request: nobody's
    bufs = store_buffers(kernel, cu_q, cu_k, total_q, kv_heads)
    count, who, lse_count, lse_who, info, oob = bufs[:6]
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False))
    grid_x = kernel.varlen_grid_x(max_q)
    fn(*[jit.as_cute(b) for b in bufs], Int32(cu_k[-1] + pad), Int32(grid_x))

    want = torch.full_like(who, -1)
    want_lse = torch.full_like(lse_who, -1)
    col = torch.arange(d, dtype=torch.int32)
    fails = []
    for b in range(len(cu_q) - 1):
        n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for hk in range(kv_heads):
            got = info[b, hk].tolist()
            if got != [n_q * g, n_k, cu_k[b], cu_k[b], cu_q[b]]:
                fails.append(f"request {b}, kv head {hk}: (rows, keys, K key 0, V key 0, Q token 0) = {got}")
            for token in range(cu_q[b], cu_q[b + 1]):
                for hg in range(g):
                    r = (token - cu_q[b]) * g + hg
                    want[0, token, hk * g + hg] = tag(b, hk, r, 0) + col
                    want_lse[0, hk * g + hg, token] = tag(b, hk, r, 0)
    stored = want >= 0
    for name, c, w, x, s in (("O", count, who, want, stored), ("LSE", lse_count, lse_who, want_lse, want_lse >= 0)):
        twice = torch.nonzero(c > 1).tolist()
        missing = torch.nonzero(s & (c == 0)).tolist()
        foreign = torch.nonzero(~s & (c > 0)).tolist()
        wrong = torch.nonzero(s & (c > 0) & (w != x)).tolist()
        for what, where in (("stored more than once", twice), ("never stored", missing),
                            ("stored outside every request", foreign), ("stored with another row's value", wrong)):
            if where:
                fails.append(f"{name}: {len(where)} elements {what}, e.g. {where[:3]}")
    if oob.item():
        fails.append(f"{oob.item()} row-by-row stores outside the tensor")
    return fails


class RowsNotPacked(FlashAttentionD3Sm100):
    """Wrong: request b offset by cu_q[b] packed rows, the * g forgotten (g heads per token)."""

    def request_views(self, batch, mQ, mK, mV, mO, mO_mem, mLSE, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK):
        _, mK, mV, _, _, _, b, n_rows, n_keys = super().request_views(
            batch, mQ, mK, mV, mO, mO_mem, mLSE, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK)
        row0 = mCuSeqlensQ[batch]
        mQ, mO, mO_mem = (cute.domain_offset((row0, 0, 0, 0), t) for t in (mQ, mO, mO_mem))
        return mQ, mK, mV, mO, mO_mem, cute.domain_offset((row0, 0, 0), mLSE), b, n_rows, n_keys


class TmaOnStraddlingTile(FlashAttentionD3Sm100):
    """Wrong: every tile stored as one TMA box, the straddling one too."""

    def o_by_tma(self, rows_left):
        return rows_left > 0


class EveryRowStored(FlashAttentionD3Sm100):
    """Wrong: the straddling tile stored row by row, but every row of it."""

    def row_stored(self, row, rows_left):
        return row >= 0


class PaddingRowsStored(FlashAttentionESm100):
    """Wrong: stage E's padded tile (64 heads with lists) stores its padding rows too."""

    def row_stored(self, row, rows_left):
        return row < rows_left


HD128 = {"kv_shared": False}
E_PADDED = {"kv_shared": True, "pack_group": 64, "has_right": True, "has_compressed": True, "has_topk": True}
HD512 = {"kv_shared": True, "pack_group": 128}
#: (class, head dim, options, requests, longest request): pack groups 1, 8, 64, 128; O split at 512
CASES = {
    "hd128-g1": (FlashAttentionD3Sm100, 128, HD128, 6, 300),
    "hd128-g8": (FlashAttentionD3Sm100, 128, {"kv_shared": False, "pack_group": 8}, 6, 40),
    "hd512-g128": (FlashAttentionD3Sm100, 512, HD512, 6, 3),
    "hd512-g64": (FlashAttentionD3Sm100, 512, {"kv_shared": True, "pack_group": 64}, 5, 5),
    "d4-hd128-causal": (FlashAttentionD4Sm100, 128, {"kv_shared": False, "has_right": True}, 5, 300),
    # stage E's top-k with 64 heads: one token a 128-row tile, rows 64 .. 127 padding, never stored
    "e-topk-hd512-g64-padded": (FlashAttentionESm100, 512, E_PADDED, 5, 5),
}


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_stores_hit_exactly_each_requests_rows(name):
    cls, head_dim, options, requests, max_len = CASES[name]
    rnd = random.Random(hash(name) % 1000)
    cases = [
        (random_cu(rnd, requests, max_len), random_cu(rnd, requests, 700)),
        (random_cu(rnd, requests, max_len, zeros=False), random_cu(rnd, requests, 70)),
        ([0, max_len, max_len, 2 * max_len], [0, 0, 5, 5]),  # empty requests of queries and of keys
    ]
    if cls is not FlashAttentionD3Sm100:
        assert make_kernel(head_dim, cls=cls, **options).longest_first  # the reversed tile order
    if cls is FlashAttentionESm100:
        assert make_kernel(head_dim, cls=cls, **options).padded()
    for cu_q, cu_k in cases:
        fails = store_failures(cls, head_dim, options, cu_q, cu_k)
        assert fails == [], (cu_q, cu_k, fails[:4])


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("cls,head_dim,options,cu_q", [
    (RowsNotPacked, 512, HD512, [0, 2, 3, 3, 6]),
    (TmaOnStraddlingTile, 128, HD128, [0, 200, 330, 400]),
    (TmaOnStraddlingTile, 512, HD512, [0, 3, 4, 6]),  # 128 rows a token: a token's rows never straddle
    (EveryRowStored, 128, HD128, [0, 200, 330, 400]),
    (PaddingRowsStored, 512, E_PADDED, [0, 3, 4, 6]),
])  # fmt: skip
def test_store_checker_rejects_wrong_stores(cls, head_dim, options, cu_q):
    fails = store_failures(cls, head_dim, options, cu_q, [0, 10, 20, 30, 40][:len(cu_q)])
    if cls is TmaOnStraddlingTile and options is HD512:
        assert fails == []  # g = 128: every tile is whole tokens of one request, the TMA box is right
    else:
        assert fails != []


def test_varlen_seams():
    k = make_kernel(512, **HD512)
    assert k.varlen and k.may_hide_rows()  # a request with no key: O = 0, LSE = -inf
    assert k.varlen_grid_x(3) == 3 * 2  # 3 tokens x 128 heads = 3 tiles, two O halves each
    assert [k.tile_has_rows(m, 300) for m in (0, 2, 3)] == [True, True, False]
    assert (k.o_by_tma(128), k.o_by_tma(127)) == (True, False)
    assert (k.row_stored(126, 127), k.row_stored(127, 127)) == (True, False)
    with pytest.raises(ValueError, match="seqused_k"):
        make_kernel(128, seqused_k=True)


# ---------------------------------------------------------------------------------------
# 2. compile budgets

COMPILE_CASES = [
    ("d3", 128, {"kv_shared": False, "pack_group": 8, "varlen": True}),
    ("d3", 512, {"kv_shared": True, "pack_group": 128, "varlen": True}),
    ("d3", 512, {"kv_shared": True, "pack_group": 64, "varlen": True}),
    ("d4", 512, {"kv_shared": True, "pack_group": 128, "varlen": True, "has_left": True, "has_right": True}),
    ("d4", 128, {"kv_shared": False, "varlen": True, "has_right": True}),
]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("stage_id,head_dim,options", [
    pytest.param(s, d, o, id=f"{s}-hd{d}-{o}", marks=getattr(pytest.mark, f"stage_{s}")) for s, d, o in COMPILE_CASES
])  # fmt: skip
def test_varlen_compiles_within_budget(stage_id, head_dim, options):
    from dsv4_attention.common.compile import assert_within_budget

    assert_within_budget(stage_id, "sm100", "bfloat16", head_dim, min_tmem_columns=128, options=options)
