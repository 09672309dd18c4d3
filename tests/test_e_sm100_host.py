"""Stage E on SM100, on the host (CPU, no GPU): the softmax warps' masks over window + compressed
tiles, the TMA warp's source per tile, and the compile budgets.

1. Masks, run. As tests/test_d34_sm100_host.py does for D4: the kernel's own code (``s_row_load``,
   ``kv_length`` / ``kv_span`` (a ``FusedSpan``) / ``row_keys`` / ``mask_s_row`` with its
   ``tile_columns``) is compiled into a host function and *run on the CPU* for every softmax thread
   and every visit of a Q tile, on a register row of zeros (0: kept, -inf: hidden). Visit it is tile
   n = n_tiles - 1 - it: a compressed tile (n < n_cmp, entries n T ..) or window tile n - n_cmp (keys
   origin + (n - n_cmp) T ..). For kernels with pack_group 1, 64, 128 (Q tiles of 128, 2 and 1
   tokens), ratios 4 and 128, window (127, 0) and none, seqlen_q <, =, > seqlen_k and n_compressed
   below and above the rows' counts, the kept (row, source, key) triples of the real rows must be
   exactly ``common.kv_span.visible`` (window) union ``common.compressed.compressed_visible``
   (compressed), each held once. Negative controls the same checker rejects: the count taken as
   floor(t' / r) instead of floor((t' + 1) / r), and a compressed tile's columns counted from the
   window's first key.
2. TMA sources, traced. The TMA warp's ``load_k_block`` (with ``kv_tma_views`` and
   ``entry_sources`` on atoms built as ``__call__`` builds them) runs for every tile and K
   block of a span (its source as plain Python on Python ints inside a trace, cute.copy recorded: a
   traced `if` would emit both branches), recording the atom and the box start each copy gets:
   compressed tile n from the compressed atom at entry n T, window tile n from K's atom at key
   origin + (n - n_cmp) T. Negative controls: a compressed tile indexed from the window's origin, a
   window tile not shifted by n_cmp.
3. Seams: D1..D5 unchanged (no compressed source), the E kernel's options and refusals.
4. Compile budgets (marked compile / slow): head dim 512 with every option of DeepSeek-V4's HCA
   layer, and head dim 128; 64 heads with lists (the padded tile).
5. Top-k and index mode: the list masks and the gathered rows, run (64 heads included).
6. 64 query heads with lists, one token a 128-row tile, rows 64 .. 127 padding: each tile row's Q
   source, span list, O / LSE stores and sink, replayed for every CTA; negative controls (the old
   two-tokens-a-tile map, padding rows stored).
"""

from __future__ import annotations

import functools
import itertools

import cutlass
import cutlass.cute as cute
import pytest
import seam_calls
import torch
from cutlass import Int32
from partitions import inside, put
from plain_jit import plain
from sm100_mask_replay import MAX_VISITS, build_mask_runner, mismatches, replay, run_buffers, thread_replayer

from dsv4_attention.common import kv_span
from dsv4_attention.common.compressed import compressed_visible, compressed_visible_at
from dsv4_attention.common.layout_proof import first_mismatches
from dsv4_attention.common.seams import Lengths, Window
from dsv4_attention.common.sm100_softmax import visible_columns
from dsv4_attention.common.tmem import QK_TILE_M
from dsv4_attention.stages.e_fused.sm100 import EntryOperands, FlashAttentionESm100

pytestmark = [pytest.mark.arch("sm100"), pytest.mark.stage_e]

BF16 = cutlass.BFloat16


def make_kernel(head_dim: int, cls=FlashAttentionESm100, **options):
    from dsv4_attention.common import jit

    return cls(jit.cutlass_dtype(torch.bfloat16), head_dim, **options)


# ---------------------------------------------------------------------------------------
# 1. the masks, run on the host


@functools.cache
def mask_runner(name: str, positions: bool = False):
    kernel = KERNELS[name]()
    return kernel, build_mask_runner(kernel, positions)


def kept_triples(name: str, m_blk: int, case: dict):
    """{(packed row, source, key): times kept} over the real rows of Q tile m_blk, every visit and
    every thread / value, as the kernel's masks leave them (source 'c': compressed entry, 'w': raw
    key); and (origin, n_tiles, n_cmp)."""

    kernel, fn = mask_runner(name, "positions" in case)
    g, tile_n = kernel.pack_group, kernel.plan.tile_n
    sq, sk = case["seqlen_q"], case["seqlen_k"]
    left, right = case.get("window", (None, None))
    out, coords, (origin, n_tiles, n_cmp) = replay(fn, tile_n, m_blk, sq * g, sk, sk, left, right, case["ratio"],
                                                   case["entries"], case.get("kv_start", 0), case.get("positions"))
    assert 1 <= n_tiles <= MAX_VISITS, (origin, n_tiles, n_cmp)
    kept = {}
    for it in range(n_tiles):
        n = n_tiles - 1 - it
        source, first = ("c", n * tile_n) if n < n_cmp else ("w", origin + (n - n_cmp) * tile_n)
        vals = out[:, it, :]
        assert bool(torch.all((vals == 0) | (vals == -float("inf")))), "a value neither kept nor -inf"
        t_idx, v_idx = torch.nonzero(vals == 0, as_tuple=True)
        for t, v in zip(t_idx.tolist(), v_idx.tolist(), strict=True):
            row, col = coords[t, v].tolist()
            packed = m_blk * QK_TILE_M + row
            if packed // g < sq:  # rows past the last token are never stored
                key = (packed, source, first + col)
                kept[key] = kept.get(key, 0) + 1
    return kept, (origin, n_tiles, n_cmp)


def visible_triples(m_blk: int, group: int, case: dict, left, right) -> set:
    """The plain formulas' triples for the real rows of Q tile m_blk (``kv_start``: the absolute
    position of raw key 0, default 0; ``judge_kv_start`` overrides it for negative controls)."""
    sq, sk, ratio, entries = case["seqlen_q"], case["seqlen_k"], case["ratio"], case["entries"]
    start = case.get("judge_kv_start", case.get("kv_start", 0))
    positions = case.get("judge_positions", case.get("positions"))
    want = set()
    for r in range(m_blk * QK_TILE_M, (m_blk + 1) * QK_TILE_M):
        token = r // group
        if token < sq and positions is None:
            want |= {(r, "w", j) for j in range(sk) if kv_span.visible(token, j, sq, sk, left, right)}
            want |= {(r, "c", j) for j in range(entries)
                     if compressed_visible(token, j, sq, sk, ratio, entries, start)}
        elif token < sq:  # the token at absolute position positions[token], raw key j at start + j
            want |= {(r, "w", j) for j in range(sk)
                     if kv_span.visible_at(positions[token] - start, j, sk, left, right)}
            want |= {(r, "c", j) for j in range(entries)
                     if compressed_visible_at(positions[token], j, ratio, entries)}
    return want


def mask_failures(name: str, case: dict) -> list[str]:
    """Every way "the kernel keeps exactly the visible triples of the real rows, each once" breaks."""
    kernel, _ = mask_runner(name)
    left, right = case.get("window", (None, None))
    want_left = left if kernel.has_left else None
    want_right = right if kernel.has_right else None
    fails = []
    for m_blk in case["m_blocks"]:
        kept, span = kept_triples(name, m_blk, case)
        want = visible_triples(m_blk, kernel.pack_group, case, want_left, want_right)
        fails += mismatches(m_blk, span, kept, want)
    return fails


class CountOfPosition(FlashAttentionESm100):
    """Wrong: the row's count taken as floor(t' / r) (off by one position)."""

    def row_keys(self, span, m_blk, tTR_cS):
        window, _ = super().row_keys(span, m_blk, tTR_cS)
        token = (m_blk * QK_TILE_M + tTR_cS[0][0]) // span.group
        t = cutlass.max(token + span.seqlen_k - span.seqlen_q, 0)
        return window, cutlass.min(t // span.ratio, span.n_compressed)


class CompressedColumnsFromWindowOrigin(FlashAttentionESm100):
    """Wrong: a compressed tile's columns counted from the window's first key (origin + n T)."""

    @cute.jit
    def fused_columns(self, span, keys, n):
        window_keys, count = keys
        first = span.origin + n * span.tile_n
        lo, hi = visible_columns(window_keys, span.first_key(n))
        compressed = n < span.n_cmp
        hi = (count - first) if compressed else hi
        if cutlass.const_expr(lo is not None):
            lo = Int32(0) if compressed else lo
        return lo, hi


HCA_512 = {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True, "has_sink": True,
           "has_compressed": True}
WIN_512_G1 = {"kv_shared": True, "has_left": True, "has_right": True, "has_compressed": True}

KERNELS = {
    "e-hd512-g128": lambda: make_kernel(512, **HCA_512),
    "e-hd512-g1": lambda: make_kernel(512, **WIN_512_G1),
    "e-hd256-g64": lambda: make_kernel(256, kv_shared=True, pack_group=64, has_left=True, has_right=True,
                                       has_compressed=True),
    "e-hd128-g1-nowin": lambda: make_kernel(128, kv_shared=True, has_compressed=True),
    "e-hd128-g64-nowin": lambda: make_kernel(128, kv_shared=True, pack_group=64, has_sink=True,
                                             has_compressed=True),
    "wrong-count-of-position": lambda: make_kernel(512, cls=CountOfPosition, **HCA_512),
    "wrong-columns-from-window-origin": lambda: make_kernel(512, cls=CompressedColumnsFromWindowOrigin, **WIN_512_G1),
}

W127 = (127, 0)
MASK_CASES = {  # name -> cases; m_blocks: the Q tiles replayed
    "e-hd512-g128": [  # DeepSeek-V4's HCA layer: 128 heads of one token per tile, 64-key tiles
        dict(seqlen_q=2, seqlen_k=1000, window=W127, ratio=4, entries=300, m_blocks=[0, 1]),  # 4 compressed tiles
        dict(seqlen_q=2, seqlen_k=1000, window=W127, ratio=4, entries=100, m_blocks=[1]),  # entries < counts
        dict(seqlen_q=5, seqlen_k=5, window=W127, ratio=4, entries=50, m_blocks=[0, 2, 3, 4]),  # counts 0, 0, 1, 1
        dict(seqlen_q=300, seqlen_k=200, window=W127, ratio=4, entries=50, m_blocks=[0, 100, 102, 103, 299]),
        dict(seqlen_q=4, seqlen_k=1024, window=W127, ratio=128, entries=8, m_blocks=[0, 3]),  # t' + 1 = 1024
        dict(seqlen_q=3, seqlen_k=1023, window=W127, ratio=128, entries=5, m_blocks=[0, 1, 2]),  # 5 < 7, 7 | 1024
        # a window cache: the raw keys are the last 130 rows of a 2130-token sequence
        dict(seqlen_q=2, seqlen_k=130, window=W127, ratio=4, entries=600, kv_start=2000, m_blocks=[0, 1]),
        # per-token positions: a chunk of 3 tokens placed mid-sequence (not at the keys' end)
        dict(seqlen_q=3, seqlen_k=1000, window=W127, ratio=4, entries=300, positions=[500, 501, 640],
             m_blocks=[0, 1, 2]),
    ],
    "e-hd512-g1": [  # 128 tokens per tile: counts grow along the tile, windows cut 64-key tiles
        dict(seqlen_q=300, seqlen_k=300, window=W127, ratio=4, entries=100, m_blocks=[0, 1, 2]),
        dict(seqlen_q=200, seqlen_k=1000, window=W127, ratio=128, entries=10, m_blocks=[0, 1]),
        dict(seqlen_q=300, seqlen_k=100, window=W127, ratio=4, entries=30, m_blocks=[0, 1, 2]),  # tokens < 200 empty
        dict(seqlen_q=200, seqlen_k=330, window=W127, ratio=128, entries=12, kv_start=1000, m_blocks=[0, 1]),
        # per-token positions with repeats and jumps, raw keys from absolute position 100 on
        dict(seqlen_q=200, seqlen_k=900, window=W127, ratio=4, entries=300, kv_start=100,
             positions=sorted((i * 37) % 800 + 100 for i in range(200)), m_blocks=[0, 1]),
    ],
    "e-hd256-g64": [  # two tokens per tile, 128-key tiles
        dict(seqlen_q=10, seqlen_k=500, window=W127, ratio=4, entries=200, m_blocks=[0, 4]),
        dict(seqlen_q=10, seqlen_k=10, window=W127, ratio=4, entries=3, m_blocks=[0, 1, 4]),
        dict(seqlen_q=10, seqlen_k=7, window=W127, ratio=4, entries=3, m_blocks=[0, 2, 4]),
    ],
    "e-hd128-g1-nowin": [  # no window: every raw key, plus the entries
        dict(seqlen_q=150, seqlen_k=300, ratio=4, entries=80, positions=list(range(10, 310, 2)), m_blocks=[0, 1]),
        dict(seqlen_q=300, seqlen_k=300, ratio=4, entries=80, m_blocks=[0, 1, 2]),
        dict(seqlen_q=300, seqlen_k=200, ratio=4, entries=60, m_blocks=[0, 2]),
        dict(seqlen_q=100, seqlen_k=300, ratio=128, entries=3, m_blocks=[0]),
    ],
    "e-hd128-g64-nowin": [
        dict(seqlen_q=7, seqlen_k=600, ratio=128, entries=10, m_blocks=[0, 3]),
        dict(seqlen_q=7, seqlen_k=520, ratio=4, entries=200, m_blocks=[1, 3]),
    ],
}


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("name,case", [
    pytest.param(n, c, id=f"{n}-{i}") for n, cs in MASK_CASES.items() for i, c in enumerate(cs)
])  # fmt: skip
def test_masks_keep_exactly_the_visible_triples(name, case):
    assert mask_failures(name, case) == []


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("name,case", [
    ("wrong-count-of-position", dict(seqlen_q=2, seqlen_k=1000, window=W127, ratio=4, entries=300, m_blocks=[1])),
    ("wrong-columns-from-window-origin",
     dict(seqlen_q=300, seqlen_k=300, window=W127, ratio=4, entries=100, m_blocks=[2])),
])  # fmt: skip
def test_mask_checker_rejects_wrong_masks(name, case):
    assert mask_failures(name, case) != []


@pytest.mark.proof
@pytest.mark.slow
def test_mask_checker_rejects_positions_the_kernel_did_not_get():
    """Negative controls: a positions case judged by bottom-right alignment, and judged by other
    positions (each token one later), must fail."""
    case = MASK_CASES["e-hd512-g1"][-1]
    pos = case["positions"]
    bottom_right = [100 + i + 700 for i in range(200)]  # kv_start + i + seqlen_k - seqlen_q
    assert mask_failures("e-hd512-g1", {**case, "m_blocks": [1], "judge_positions": bottom_right}) != []
    assert mask_failures("e-hd512-g1", {**case, "m_blocks": [0], "judge_positions": [p + 1 for p in pos]}) != []


@pytest.mark.proof
@pytest.mark.slow
def test_mask_checker_rejects_a_kv_start_the_kernel_did_not_get():
    """Negative control: the window cache case judged as if raw key 0 were at position 0."""
    case = dict(seqlen_q=2, seqlen_k=130, window=W127, ratio=4, entries=600, kv_start=2000, m_blocks=[0],
                judge_kv_start=0)
    assert mask_failures("e-hd512-g128", case) != []


@pytest.mark.proof
@pytest.mark.slow
def test_hca_token_sees_its_window_and_entries():
    """128 heads of token 999 of 1000, window (127, 0), ratio 4: window keys 872 .. 999 (two unmasked
    64-key tiles) and entries 0 .. 249 (four tiles, the last cut at 250 - 192 = 58 columns)."""
    case = dict(seqlen_q=1000, seqlen_k=1000, window=W127, ratio=4, entries=400)
    kept, (origin, n_tiles, n_cmp) = kept_triples("e-hd512-g128", 999, case)
    assert (origin, n_tiles, n_cmp) == (872, 6, 4)
    assert len(kept) == 128 * (128 + 250)


# ---------------------------------------------------------------------------------------
# 2. the TMA warp's source per tile


class CompressedFromWindowOrigin(FlashAttentionESm100):
    """Wrong: compressed tile n loaded at the window's key map (origin + n T)."""

    @cute.jit
    def load_k_block(self, span, tile, kb, tma_atom_k, tKgK, sources, dst, barrier):
        tma_atom_c, _ = sources
        if tile < span.n_cmp:
            cute.copy(tma_atom_c, tKgK[None, tile, kb], dst, tma_bar_ptr=barrier)
        else:
            cute.copy(tma_atom_k, tKgK[None, span.window_tile(tile), kb], dst, tma_bar_ptr=barrier)


class WindowNotShifted(FlashAttentionESm100):
    """Wrong: window tile n taken as K's tile n (not n - n_cmp)."""

    @cute.jit
    def load_k_block(self, span, tile, kb, tma_atom_k, tKgK, sources, dst, barrier):
        tma_atom_c, tCgC = sources
        if tile < span.n_cmp:
            cute.copy(tma_atom_c, tCgC[None, tile, kb], dst, tma_bar_ptr=barrier)
        else:
            cute.copy(tma_atom_k, tKgK[None, tile, kb], dst, tma_bar_ptr=barrier)


def tma_sources(head_dim: int, span_args: tuple, cls=FlashAttentionESm100, hk: int = 1, b: int = 1, **options):
    """{(tile, kb): (atom, first coordinate of the box)} through the kernel's ``load_k_block`` (cute.copy
    recorded, not issued), on views from ``kv_tma_views`` / ``entry_sources`` over TMA atoms
    built as ``__call__`` builds them from [batch, seqlen, kv_heads, head_dim] K and compressed
    tensors. TMA coordinates run (column, key or entry, kv head, batch). Also the span."""
    from cutlass.cute.nvgpu import cpasync, tcgen05

    from dsv4_attention.common.layout_proof import as_ints, trace
    from dsv4_attention.common.layouts import seq_major
    from dsv4_attention.common.sm100_smem_p import make_pv_mma, make_qk_mma, make_smem_layouts

    kernel = make_kernel(head_dim, cls=cls, **options)
    plan = kernel.plan
    S, C, HK, B = 1000, 300, 2, 2

    def bshd(seqlen, base):
        ptr = cute.make_ptr(BF16, base, cute.AddressSpace.gmem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout((B, seqlen, HK, head_dim),
                                                      stride=(seqlen * HK * head_dim, HK * head_dim, head_dim, 1)))

    def body():
        qk, pv = make_qk_mma(BF16, plan), make_pv_mma(BF16, plan)
        _, k_ring, v_ring, _ = make_smem_layouts(BF16, plan, qk, pv)
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        k_block = cute.select(k_ring, mode=[0, 1, 2])
        box = (QK_TILE_M, plan.tile_n, plan.d_block)
        atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(op, seq_major(bshd(S, 0)), k_block, box, qk)
        atom_c, tma_c = cute.nvgpu.make_tiled_tma_atom_B(op, seq_major(bshd(C, 1 << 30)), k_block, box, qk)
        smem = cute.make_ptr(BF16, 1024, cute.AddressSpace.smem, assumed_align=1024)
        sK = cute.make_tensor(cute.recast_ptr(smem, k_ring.inner), k_ring.outer)
        sV = cute.make_tensor(cute.recast_ptr(smem, v_ring.inner), v_ring.outer)
        span = seam_calls.span(kernel, *span_args)
        _, tKgK, _, _ = kernel.kv_tma_views(qk, pv, atom_k, tma_k, atom_k, tma_k, sK, sV, hk, b, span.origin)
        ratio = seam_calls.span_arguments(span_args)["ratio"]
        req = kernel.request_entries(b, b, EntryOperands(atom_c, tma_c, ratio, None, 0, None, None), Lengths())
        sources = kernel.entry_sources(qk, req, sK, hk, b)
        names = {id(atom_k): "k", id(atom_c): "c"}
        got = {}
        real_copy = cute.copy

        def record(atom, src, dst, **_):
            got[current] = (names[id(atom)], as_ints(tuple(src.iterator)))

        # the method's own source as plain Python: a traced `if` emits both branches (an scf.if),
        # so the recorder could not tell which one a tile takes; with Python ints Python picks it
        load_k_block = plain(type(kernel).load_k_block)
        cute.copy = record
        try:
            for n in range(span.n_tiles):
                for kb in range(plan.blocks):
                    current = (n, kb)
                    load_k_block(kernel, span, n, kb, atom_k, tKgK, sources, sK[None, None, None, 0], None)
        finally:
            cute.copy = real_copy
        return got, (span.origin, span.n_tiles, span.n_cmp)

    got, span = trace(body)
    origin, n_tiles, n_cmp = span
    want = {(n, kb): ("c", (kb * plan.d_block, n * plan.tile_n, hk, b)) if n < n_cmp
            else ("k", (kb * plan.d_block, origin + (n - n_cmp) * plan.tile_n, hk, b))
            for n in range(n_tiles) for kb in range(plan.blocks)}
    return got, want, span


#: (m_block, rows, seqlen_k, left, right, ratio, n_compressed) of kv_span: the g128 kernel's token 1 of 2
HCA_SPAN = (1, 2 * 128, 1000, 127, 0, 4, 300)


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("head_dim,options,span_args", [
    (512, HCA_512, HCA_SPAN),  # origin 872, 4 compressed tiles of 64, 2 window tiles
    (512, WIN_512_G1, (2, 300, 300, 127, 0, 4, 100)),  # tokens 256 .. 299: origin 129, 2 + 3 tiles
    (128, {"kv_shared": True, "has_compressed": True}, (1, 300, 1000, 0, 0, 128, 30)),  # no window: origin 0
])  # fmt: skip
def test_tma_loads_each_tile_from_its_source(head_dim, options, span_args):
    got, want, span = tma_sources(head_dim, span_args, **options)
    origin, n_tiles, n_cmp = span
    assert n_cmp >= 1 and n_tiles > n_cmp, span
    assert first_mismatches(want, got) == []


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("cls", [CompressedFromWindowOrigin, WindowNotShifted])
def test_tma_checker_rejects_wrong_sources(cls):
    got, want, _ = tma_sources(512, HCA_SPAN, cls=cls, **HCA_512)
    assert first_mismatches(want, got) != []


# ---------------------------------------------------------------------------------------
# 5. top-k (CSA) and index mode: the softmax's list masks, run on the host


def build_topk_mask_runner(kernel):
    """``build_mask_runner`` for a top-k kernel: the span gets the token lists (seqlen_q, k) of one
    request; the mask's warp ballots are assembled by a loop over the 32 lanes (``topk_words_on_host``)."""
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.jit import as_cute

    kernel.topk_words_on_host = True
    replay_threads = thread_replayer(kernel)

    @cute.jit
    def host(out: cute.Tensor, coords: cute.Tensor, info: cute.Tensor, topk: cute.Tensor, m_blk: Int32,
             rows: Int32, seqlen_k: Int32, left: Int32, right: Int32, ratio: Int32, n_compressed: Int32):
        span = seam_calls.span(kernel, m_blk, rows, seqlen_k, left, right, ratio, n_compressed, topk)
        info[0] = span.origin
        info[1] = span.n_tiles
        info[2] = span.n_cmp
        replay_threads(span, m_blk, out, coords)

    bufs = run_buffers(kernel.plan.tile_n)[:3]
    with target_arch("sm100"):
        return cute.compile(host, *[from_dlpack(b) for b in bufs], as_cute(torch.zeros(2, 70, dtype=torch.int32)),
                            *[Int32(x) for x in (0, 1, 1, 0, 0, 4, 1)], options=f"--gpu-arch={GPU_ARCH['sm100']}")


@functools.cache
def topk_mask_runner(name: str):
    kernel = TOPK_KERNELS[name]()
    return kernel, build_topk_mask_runner(kernel)


def topk_lists(seqlen_q: int, k: int, entries: int, seed: int) -> torch.Tensor:
    """[seqlen_q, k] int32: distinct entries in random order, about a quarter of the positions -1
    (anywhere in the list, and a -1 tail), every value in [-1, entries)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((seqlen_q, k), -1, dtype=torch.int32)
    for t in range(seqlen_q):
        n = min(entries, k - k // 8)
        out[t, :n] = torch.randperm(entries, generator=gen)[:n].to(torch.int32)
        out[t, :n][torch.rand(n, generator=gen) < 0.25] = -1
    return out


def owned_packed_row(m_blk: int, row: int, g: int):
    """The checker's own row map of a top-k Q tile (one token a tile, plain formula): packed row
    m_blk * 128 + row (g a multiple of 128); g = 64 (sm100's padded tile), m_blk * 64 + row for the
    token's heads, rows < 64, and None for the padding rows 64 .. 127 (never stored)."""
    if g >= QK_TILE_M:
        return m_blk * QK_TILE_M + row
    return m_blk * g + row if row < g else None


def topk_tiles(seqlen_q: int, g: int) -> int:
    """The Q tiles of a top-k problem of one KV head by the checker's map: one token a tile (g >= 128:
    g / 128 tiles a token)."""
    return seqlen_q * g // min(g, QK_TILE_M)


def topk_kept_triples(name: str, m_blk: int, case: dict, topk: torch.Tensor):
    """{(packed row, source, key): times kept} as ``kept_triples``, a compressed tile's column c of
    visit n being list position p = n T + c, its key the entry topk[token, p]."""
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common.jit import as_cute

    kernel, fn = topk_mask_runner(name)
    g, tile_n = kernel.pack_group, kernel.plan.tile_n
    sq, sk = case["seqlen_q"], case["seqlen_k"]
    left, right = case["window"]
    out, coords, info = run_buffers(tile_n)[:3]
    fn(*[from_dlpack(b) for b in (out, coords, info)], as_cute(topk),
       *[Int32(x) for x in (m_blk, sq * g, sk, left, right, case["ratio"], case["entries"])])
    origin, n_tiles, n_cmp = info.tolist()
    assert 1 <= n_tiles <= MAX_VISITS and n_cmp == -(-topk.shape[1] // tile_n), (origin, n_tiles, n_cmp)
    kept = {}
    for it in range(n_tiles):
        n = n_tiles - 1 - it
        vals = out[:, it, :]
        assert bool(torch.all((vals == 0) | (vals == -float("inf")))), "a value neither kept nor -inf"
        t_idx, v_idx = torch.nonzero(vals == 0, as_tuple=True)
        for t, v in zip(t_idx.tolist(), v_idx.tolist(), strict=True):
            row, col = coords[t, v].tolist()
            packed = owned_packed_row(m_blk, row, g)
            if packed is None:  # a padded tile's padding row: never stored
                continue
            token = packed // g
            if n < n_cmp:
                p = n * tile_n + col
                key = (packed, "c", int(topk[token, p]) if p < topk.shape[1] else ("past k", p))
            else:
                key = (packed, "w", origin + (n - n_cmp) * tile_n + col)
            kept[key] = kept.get(key, 0) + 1
    return kept, (origin, n_tiles, n_cmp)


def topk_mask_failures(name: str, case: dict, expect_index: bool | None = None) -> list[str]:
    """Every way "the kernel keeps exactly the visible listed entries and the window's keys of the
    real rows, each once" breaks. Index mode (``expect_index``, default the kernel's own mode): the
    lists are the only keys, every listed entry in [0, entries) visible, no window tile."""
    from dsv4_attention.common.compressed import topk_visible

    kernel, _ = topk_mask_runner(name)
    index = kernel.index_mode if expect_index is None else expect_index
    g = kernel.pack_group
    sq, sk, ratio, entries, k = case["seqlen_q"], case["seqlen_k"], case["ratio"], case["entries"], case["k"]
    left, right = case["window"]
    left, right = (left if kernel.has_left else None), (right if kernel.has_right else None)
    topk = topk_lists(sq, k, entries, case.get("seed", 0))
    fails = []
    for m_blk in range(topk_tiles(sq, g)):
        kept, span = topk_kept_triples(name, m_blk, case, topk)
        want = set()
        for r in {owned_packed_row(m_blk, row, g) for row in range(QK_TILE_M)} - {None}:
            token = r // g
            if index:
                want |= {(r, "c", int(topk[token, p])) for p in range(k) if 0 <= int(topk[token, p]) < entries}
                continue
            want |= {(r, "w", j) for j in range(sk) if kv_span.visible(token, j, sq, sk, left, right)}
            want |= {(r, "c", int(topk[token, p])) for p in range(k)
                     if topk_visible(token, p, int(topk[token, p]), sq, sk, ratio, entries, k)}
        if index and span[1] != span[2]:
            fails.append(f"m_blk {m_blk} span {span}: index mode visits a window tile")
        fails += mismatches(m_blk, span, kept, want)
    return fails


class TopkCountIgnored(FlashAttentionESm100):
    """Wrong: a listed entry taken as visible whatever the token's count (n_compressed instead)."""

    def row_keys(self, span, m_blk, tTR_cS):
        window, _ = super().row_keys(span, m_blk, tTR_cS)
        return window, span.n_compressed


class TopkPositionOffByOne(FlashAttentionESm100):
    """Wrong: column c of compressed tile n read as list position n T + c + 1."""

    @cute.jit
    def mask_s_row(self, s_row, tTR_cS, span, keys, it):
        from dsv4_attention.common.sm100_softmax import mask_topk_row, topk_tile_words

        n = span.n_tiles - 1 - it
        if n < span.n_cmp:
            _, count = keys
            words = topk_tile_words(span.idx_row, n * span.tile_n + 1, count, span.k, span.tile_n, 0, True)
            mask_topk_row(s_row, tTR_cS, words)
        else:
            FlashAttentionESm100.mask_s_row(self, s_row, tTR_cS, span, keys, it)


TOPK_512 = dict(HCA_512, has_topk=True)
TOPK_512_G64 = dict(TOPK_512, pack_group=64)
INDEX_512_G64 = {"kv_shared": True, "pack_group": 64, "has_sink": True, "has_compressed": True, "has_topk": True,
                 "index_mode": True}


class TwoTokensPerTile(FlashAttentionESm100):
    """Wrong: 64 heads packed as D2 packs them without lists, two tokens a 128-row tile (tile m: packed
    rows 128 m ..), the tile gathering its first token's list and storing all 128 rows by TMA."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.owned_rows = QK_TILE_M
TOPK_KERNELS = {
    "topk-hd512-g128": lambda: make_kernel(512, **TOPK_512),
    "topk-hd512-g256": lambda: make_kernel(512, **dict(TOPK_512, pack_group=256)),
    "topk-hd128-g128": lambda: make_kernel(128, kv_shared=True, pack_group=128, has_right=True,
                                           has_compressed=True, has_topk=True),
    "index-hd512-g128": lambda: make_kernel(512, kv_shared=True, pack_group=128, has_sink=True, has_compressed=True,
                                            has_topk=True, index_mode=True),
    "wrong-topk-count-ignored": lambda: make_kernel(512, cls=TopkCountIgnored, **TOPK_512),
    "wrong-topk-position-off-by-one": lambda: make_kernel(512, cls=TopkPositionOffByOne, **TOPK_512),
    # 64 heads (DeepSeek-V4-Flash): one token a 128-row tile, rows 64 .. 127 padding (section 6)
    "topk-hd512-g64": lambda: make_kernel(512, **TOPK_512_G64),
    "index-hd512-g64": lambda: make_kernel(512, **INDEX_512_G64),
    "wrong-g64-two-tokens-per-tile": lambda: make_kernel(512, cls=TwoTokensPerTile, **TOPK_512_G64),
}
TOPK_CASES = {  # entries / counts: tokens 994 .. 999 see 248 .. 250 of 300 entries; lists name all 300
    "topk-hd512-g128": [
        dict(seqlen_q=6, seqlen_k=1000, window=W127, ratio=4, entries=300, k=128),  # 2 compressed tiles
        dict(seqlen_q=6, seqlen_k=1000, window=W127, ratio=4, entries=300, k=200, seed=1),  # 4, the last cut
        dict(seqlen_q=4, seqlen_k=3, window=W127, ratio=4, entries=20, k=200, seed=2),  # counts 0, 0, 0, 1
        dict(seqlen_q=3, seqlen_k=500, window=W127, ratio=4, entries=100, k=128, seed=3),  # count = entries
    ],
    "topk-hd512-g256": [  # two Q tiles per token
        dict(seqlen_q=3, seqlen_k=1000, window=W127, ratio=4, entries=300, k=200, seed=4),
        dict(seqlen_q=3, seqlen_k=1000, window=W127, ratio=4, entries=300, k=128, seed=5),
    ],
    "index-hd512-g128": [  # FlashMLA's semantics: lists of rows of one tensor, no window, no count
        dict(seqlen_q=6, seqlen_k=1000, window=(0, 0), ratio=1, entries=300, k=200, seed=7),
        dict(seqlen_q=3, seqlen_k=5, window=(0, 0), ratio=1, entries=100, k=70, seed=8),
    ],
    "topk-hd512-g64": [  # a padded tile a token: its 64 heads see its list and window
        dict(seqlen_q=6, seqlen_k=1000, window=W127, ratio=4, entries=300, k=200, seed=11),
        dict(seqlen_q=4, seqlen_k=3, window=W127, ratio=4, entries=20, k=70, seed=12),  # counts 0, 0, 0, 1
    ],
    "index-hd512-g64": [
        dict(seqlen_q=5, seqlen_k=1000, window=(0, 0), ratio=1, entries=300, k=200, seed=13),
    ],
    "topk-hd128-g128": [  # 128-key tiles: 4 ballot words; causal only (window (0, 0) ignored on the left)
        dict(seqlen_q=4, seqlen_k=700, window=(0, 0), ratio=4, entries=300, k=200, seed=6),
    ],
}


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("name,case", [
    pytest.param(n, c, id=f"{n}-{i}") for n, cs in TOPK_CASES.items() for i, c in enumerate(cs)
])  # fmt: skip
def test_topk_masks_keep_exactly_the_listed_visible_entries(name, case):
    assert topk_mask_failures(name, case) == []


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("name", ["wrong-topk-count-ignored", "wrong-topk-position-off-by-one"])
def test_topk_mask_checker_rejects_wrong_masks(name):
    case = dict(seqlen_q=6, seqlen_k=1000, window=W127, ratio=4, entries=300, k=200, seed=1)
    assert topk_mask_failures(name, case) != []


class GatherRowsNotClamped(FlashAttentionESm100):
    """Wrong: an entry the token cannot see yet (idx >= count) gathered as listed."""

    @cute.jit
    def gather_rows(self, span, tile, row0, first=0, n=None):
        rows = cute.make_rmem_tensor((span.tile_n,), Int32)
        for c in cutlass.range_constexpr(span.tile_n):
            p = tile * span.tile_n + c
            j = span.idx_row[cutlass.min(p, span.k - 1)]
            rows[c] = row0 + (j if (p < span.k) & (j >= 0) else Int32(0))
        return rows


def gather_recorder(kernel):
    """A jit helper (closing over ``kernel``) that records what the TMA warp's ``gather_rows``
    gives a span: info[0] = its compressed tile count, out[tile, r] = the 2D row of box row r of
    compressed tile ``tile`` (first row ``row0``)."""

    @cute.jit
    def record(span, row0, out: cute.Tensor, info: cute.Tensor):
        info[0] = span.n_cmp
        for tile in cutlass.range(span.n_cmp, unroll=1):
            got = kernel.gather_rows(span, tile, row0)
            for r in cutlass.range_constexpr(span.tile_n):
                out[tile, r] = got[r]

    return record


def gathered_rows(head_dim: int, options: dict, case: dict, cls=FlashAttentionESm100):
    """Run the TMA warp's ``gather_rows`` on the CPU for every compressed tile of every Q tile:
    {(m_blk, tile): [2D row of box row r]} and what the lists say: row0 + idx[tile T + r] where
    visible, row0 (entry 0) elsewhere (row0 = b * entries, b = 1 here)."""
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.compressed import topk_visible
    from dsv4_attention.common.jit import as_cute

    kernel = make_kernel(head_dim, cls=cls, **options)
    record = gather_recorder(kernel)
    tile_n, g = kernel.plan.tile_n, kernel.pack_group
    sq, sk, ratio, entries, k = case["seqlen_q"], case["seqlen_k"], case["ratio"], case["entries"], case["k"]
    max_tiles = 8

    @cute.jit
    def host(out: cute.Tensor, info: cute.Tensor, topk: cute.Tensor, m_blk: Int32, rows: Int32, seqlen_k: Int32,
             ratio: Int32, n_compressed: Int32, row0: Int32):
        span = seam_calls.span(kernel, m_blk, rows, seqlen_k, 127, 0, ratio, n_compressed, topk)
        record(span, row0, out, info)

    topk = topk_lists(sq, k, entries, case.get("seed", 0))
    out, info = torch.zeros(max_tiles, tile_n, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with target_arch("sm100"):
        fn = cute.compile(host, from_dlpack(out), from_dlpack(info), as_cute(topk), *[Int32(0)] * 6,
                          options=f"--gpu-arch={GPU_ARCH['sm100']}")
    got, want = {}, {}
    row0 = entries  # batch 1
    for m_blk in range(topk_tiles(sq, g)):
        fn(from_dlpack(out), from_dlpack(info), as_cute(topk),
           *[Int32(x) for x in (m_blk, sq * g, sk, ratio, entries, row0)])
        n_cmp = int(info[0])
        assert n_cmp == -(-k // tile_n) <= max_tiles
        token = owned_packed_row(m_blk, 0, g) // g
        for tile in range(n_cmp):
            got[(m_blk, tile)] = out[tile].tolist()
            want[(m_blk, tile)] = [
                row0 + (int(topk[token, p]) if p < k and topk_visible(token, p, int(topk[token, p]), sq, sk, ratio,
                                                                      entries, k) else 0)
                for p in range(tile * tile_n, tile * tile_n + tile_n)]
    return got, want


GATHER_CASE = dict(seqlen_q=4, seqlen_k=1000, ratio=4, entries=300, k=200, seed=7)


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("head_dim,options", [(512, TOPK_512), (512, dict(TOPK_512, pack_group=256)),
                                              (512, TOPK_512_G64),  # a padded tile a token: m's own list
                                              (128, {"kv_shared": True, "pack_group": 128, "has_compressed": True,
                                                     "has_topk": True})])
def test_topk_gathered_rows_are_the_listed_entries(head_dim, options):
    got, want = gathered_rows(head_dim, options, GATHER_CASE)
    assert first_mismatches(want, got) == []


@pytest.mark.proof
@pytest.mark.slow
def test_topk_gathered_rows_checker_rejects_unclamped_rows():
    got, want = gathered_rows(512, TOPK_512, GATHER_CASE, cls=GatherRowsNotClamped)
    assert first_mismatches(want, got) != []


class VarlenEntriesOfRequestZero(FlashAttentionESm100):
    """Wrong: a variable-length request's entries read from the packed tensor's first row (request
    0's entries) instead of its own."""

    def request_entries(self, request, b, entries, lengths):
        return super().request_entries(request, b, entries, lengths)._replace(c_row0=Int32(0))


# the last request has no entry and starts at the tensor's end: its masked positions gather the last row
VARLEN_CASE = dict(q_lens=[3, 2, 4, 1], k_lens=[1000, 600, 5, 2], entries=[300, 150, 1, 0], k=200, ratio=4, seed=3)


def varlen_gathered_rows(case: dict, cls=FlashAttentionESm100):
    """A variable-length batch's top-k gather on the CPU: the kernel's ``request_entries`` (request
    r's entries at packed row cu_c[r], its lists at token cu_q[r], indices local to the request),
    ``kv_span`` and ``gather_rows`` for every compressed tile of every Q tile of every request:
    {(request, m_blk, tile): [2D row of box row r]}, and what the plain formula says:
    cu_c[r] + idx where the token sees that entry, cu_c[r] (its first entry; the last row where the
    request has none at the tensor's end) elsewhere."""
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.compressed import topk_visible
    from dsv4_attention.common.jit import as_cute

    kernel = make_kernel(512, cls=cls, **dict(TOPK_512, varlen=True))
    record = gather_recorder(kernel)
    tile_n, g = kernel.plan.tile_n, kernel.pack_group
    q_lens, k_lens, counts, k, ratio = case["q_lens"], case["k_lens"], case["entries"], case["k"], case["ratio"]
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    cu_c = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
    lists = [topk_lists(n, k, c, case["seed"] + r) for r, (n, c) in enumerate(zip(q_lens, counts, strict=True))]
    topk = torch.cat(lists)[None]
    max_tiles = 8

    @cute.jit
    def host(out: cute.Tensor, info: cute.Tensor, topk: cute.Tensor, cu_q: cute.Tensor, cu_c: cute.Tensor,
             rows_2d: cute.Tensor, request: Int32, m_blk: Int32, rows: Int32, seqlen_k: Int32, ratio: Int32):
        # rows_2d: the gather view's (entries, columns) extent (what the kernel's atom view spans)
        req = kernel.request_entries(request, 0, EntryOperands(None, rows_2d, ratio, topk, 0, None, cu_c),
                                     Lengths(None, cu_q, None, 0))
        span = kernel.kv_span(m_blk, rows, seqlen_k, Window(127, 0), req)
        record(span, req.c_row0, out, info)

    out, info = torch.zeros(max_tiles, tile_n, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    rows_2d = torch.zeros(int(cu_c[-1]), 1, dtype=torch.int32)
    tensors = lambda: (from_dlpack(out), from_dlpack(info), as_cute(topk), from_dlpack(cu_q),  # noqa: E731
                       from_dlpack(cu_c), from_dlpack(rows_2d))
    with target_arch("sm100"):
        fn = cute.compile(host, *tensors(), *[Int32(0)] * 5, options=f"--gpu-arch={GPU_ARCH['sm100']}")
    got, want = {}, {}
    for r, (sq, sk, n_c) in enumerate(zip(q_lens, k_lens, counts, strict=True)):
        c0 = min(int(cu_c[r]), int(cu_c[-1]) - 1)
        for m_blk in range(sq * g // QK_TILE_M):
            fn(*tensors(), *[Int32(x) for x in (r, m_blk, sq * g, sk, ratio)])
            n_cmp = int(info[0])
            assert n_cmp == -(-k // tile_n) <= max_tiles
            token = m_blk * QK_TILE_M // g
            lists = topk[0, int(cu_q[r]) + token]
            for tile in range(n_cmp):
                got[(r, m_blk, tile)] = out[tile].tolist()
                want[(r, m_blk, tile)] = [
                    c0 + (int(lists[p]) if p < k and topk_visible(token, p, int(lists[p]), sq, sk, ratio, n_c, k)
                          else 0)
                    for p in range(tile * tile_n, tile * tile_n + tile_n)]
    return got, want


@pytest.mark.proof
@pytest.mark.slow
def test_varlen_topk_gathers_each_requests_own_entries():
    got, want = varlen_gathered_rows(VARLEN_CASE)
    assert first_mismatches(want, got) == []


@pytest.mark.proof
@pytest.mark.slow
def test_varlen_gather_checker_rejects_request_zeros_entries():
    got, want = varlen_gathered_rows(VARLEN_CASE, cls=VarlenEntriesOfRequestZero)
    assert first_mismatches(want, got) != []


class GatherColumnsOfHeadZero(FlashAttentionESm100):
    """Wrong: the gather's columns not shifted to kv head hk's head_dim slice."""

    def entry_sources(self, qk_mma, entries, sK, hk, b):
        atom, (gC, _, row0) = super().entry_sources(qk_mma, entries, sK, hk, b)
        return atom, (gC, 0, row0)


def topk_gather_copies(head_dim: int, options: dict, cls=FlashAttentionESm100, hk: int = 1, b: int = 1):
    """The TMA warp's ``load_k_block`` traced (as ``tma_sources``) on a top-k span: for every tile and
    K block, the atom, the box's first coordinate (column, row) and, for a gather, which registers
    of the tile's ``gather_rows`` each gather4 instruction takes (offsets into them: instruction z
    must take box rows 4 z .. 4 z + 3, each group once per 64 columns). Window tiles: K's atom at
    origin + (n - n_cmp) T."""
    from cutlass.cute.nvgpu import cpasync, tcgen05

    from dsv4_attention.common.layout_proof import as_ints, trace
    from dsv4_attention.common.layouts import seq_major
    from dsv4_attention.common.sm100_kv import block_rows_layout
    from dsv4_attention.common.sm100_smem_p import make_pv_mma, make_qk_mma, make_smem_layouts

    kernel = make_kernel(head_dim, cls=cls, **options)
    plan = kernel.plan
    S, C, HK, B, SQ, K = 1000, 300, 2, 2, 4, 200

    def bshd(seqlen, base):
        ptr = cute.make_ptr(BF16, base, cute.AddressSpace.gmem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout((B, seqlen, HK, head_dim),
                                                      stride=(seqlen * HK * head_dim, HK * head_dim, head_dim, 1)))

    def body():
        qk, pv = make_qk_mma(BF16, plan), make_pv_mma(BF16, plan)
        _, k_ring, v_ring, _ = make_smem_layouts(BF16, plan, qk, pv)
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        k_block = cute.select(k_ring, mode=[0, 1, 2])
        atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(op, seq_major(bshd(S, 0)), k_block,
                                                         (QK_TILE_M, plan.tile_n, plan.d_block), qk)
        iptr = cute.make_ptr(Int32, 1 << 31, cute.AddressSpace.gmem, assumed_align=16)
        topk = cute.make_tensor(iptr, cute.make_layout((B, SQ, K), stride=(SQ * K, K, 1)))
        atom_c, tma_c = kernel.compressed_tma_atom(op, bshd(C, 1 << 30), k_ring, qk, topk)
        smem = cute.make_ptr(BF16, 1024, cute.AddressSpace.smem, assumed_align=1024)
        sK = cute.make_tensor(cute.recast_ptr(smem, k_ring.inner), k_ring.outer)
        sV = cute.make_tensor(cute.recast_ptr(smem, v_ring.inner), v_ring.outer)
        req = kernel.request_entries(b, b, EntryOperands(atom_c, tma_c, 4, topk, 0, None, None), Lengths())
        span = kernel.kv_span(1, SQ * kernel.pack_group, S, Window(127, 0), req)
        _, tKgK, _, _ = kernel.kv_tma_views(qk, pv, atom_k, tma_k, atom_k, tma_k, sK, sV, hk, b, span.origin)
        sources = kernel.entry_sources(qk, req, sK, hk, b)
        tCgC = sources[1]
        _, tKsK = cpasync.tma_partition(atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                        cute.group_modes(qk.get_slice(0).partition_B(
                                            cute.local_tile(tma_k[None, None, 0, 0], (plan.tile_n, plan.d_block),
                                                            (None, None))), 0, 3))[::-1]
        names = {id(atom_k): "k", id(atom_c): "c"}
        got = {}
        real_copy = cute.copy
        sC = block_rows_layout(cute.select(kernel.k_block_outer(), mode=[0, 1, 2]))

        def record(atom, src, dst, **_):
            if isinstance(src, list):
                coord, idx = src
                # one gather4 instruction: a run of 4 rows x 64 columns (128 bytes) of the index values
                # (colexicographic: the atom's value mode first); the registers each reads, in any order
                run = 4 * 64
                per_inst = sorted(sorted({int(idx.layout(e)) for e in range(z * run, z * run + run)})
                                  for z in range(cute.size(idx) // run))
                got.setdefault(current, []).append((names[id(atom)], as_ints(tuple(coord.iterator)), per_inst))
            else:
                got[current] = (names[id(atom)], as_ints(tuple(src.iterator)))

        def record_rows(span_, tile, row0, first=0, n=None):
            got.setdefault(current, []).append(("rows", int(tile), int(first), n))
            return real_gather_rows(span_, tile, row0, first, n)

        load_k_block = plain(type(kernel).load_k_block)
        gather_group = plain(type(kernel).gather_group)
        real_gather_rows = kernel.gather_rows
        cute.copy, kernel.gather_rows = record, record_rows
        try:
            for n in range(span.n_tiles):
                for kb in range(plan.blocks):
                    current = (n, kb)
                    if n < span.n_cmp:  # the method's own source as plain Python (see tma_sources)
                        views = kernel.gather_views(span, kb, atom_c, tCgC, tKsK[None, 0])
                        # the SMEM view: instruction value (column i, row y) of group g, part h at box
                        # row 4 g + y, column 64 h + i
                        smem = views[2].layout
                        parts = plan.d_block // 64
                        got[(n, kb, "smem")] = all(
                            int(smem(i + 64 * y + 256 * g + 256 * (plan.tile_n // 4) * h))
                            == int(sC((4 * g + y, 64 * h + i)))
                            for i in range(64) for y in range(4) for g in range(plan.tile_n // 4)
                            for h in range(parts))
                        for g in range(plan.tile_n // 4):
                            gather_group(kernel, span, n, g, tCgC[2], views, atom_c, None)
                    else:
                        load_k_block(kernel, span, n, kb, atom_k, tKgK, sources, tKsK[None, 0], None)
        finally:
            cute.copy = real_copy
            del kernel.gather_rows
        return got, (span.origin, span.n_tiles, span.n_cmp)

    got, (origin, n_tiles, n_cmp) = trace(body)
    # group g of the box: its 4 rows computed (list positions n T + 4 g ..) into the 4 index registers, then
    # one instruction per 64-column part of the K block (128-byte TMA rows), each reading all 4 registers,
    # from the group's coordinates (column, box row 4 g); the SMEM view puts them at box rows 4 g ..
    inst = [[0, 1, 2, 3]] * (plan.d_block // 64)
    want = {(n, kb): [x for g in range(plan.tile_n // 4)
                      for x in (("rows", n, 4 * g, 4), ("c", (hk * head_dim + kb * plan.d_block, 4 * g), inst))]
            if n < n_cmp else ("k", (kb * plan.d_block, origin + (n - n_cmp) * plan.tile_n, hk, b))
            for n in range(n_tiles) for kb in range(plan.blocks)}
    want.update({(n, kb, "smem"): True for n in range(n_cmp) for kb in range(plan.blocks)})
    return got, want, (origin, n_tiles, n_cmp)


TOPK_128 = {"kv_shared": True, "pack_group": 128, "has_compressed": True, "has_topk": True}


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("head_dim,options", [(512, TOPK_512), (128, TOPK_128)])
def test_topk_gather_copies_take_the_tiles_rows(head_dim, options):
    got, want, span = topk_gather_copies(head_dim, options)
    assert span[2] >= 2 and span[1] > span[2], span
    assert first_mismatches(want, got) == []


@pytest.mark.proof
@pytest.mark.slow
def test_topk_gather_checker_rejects_wrong_columns():
    """The control at hd 128 (kv head 1's columns start at 128, head 0's at 0: the same mistake the
    hd 512 trace would show, at a quarter of its K blocks and trace time)."""
    got, want, _ = topk_gather_copies(128, TOPK_128, cls=GatherColumnsOfHeadZero)
    assert first_mismatches(want, got) != []


# ---------------------------------------------------------------------------------------
# 3. seams


def test_seams():
    from dsv4_attention import stages

    for stage in ("d1", "d2", "d3", "d4", "d5"):  # the entries seam is E's: the others return nothing
        k = stages.get(stage).module.make_kernel("sm100", torch.bfloat16, 512, kv_shared=True)
        assert not hasattr(k, "has_compressed") and k.entry_operands(None, None, None, None) is None
    plain = make_kernel(512, kv_shared=True, pack_group=128)  # stage E without entries is stage D5
    assert not plain.has_compressed and not plain.masks_inner_tiles()
    e = make_kernel(128, kv_shared=True, has_compressed=True)
    assert e.has_compressed and e.masks_inner_tiles() and not e.may_hide_rows()
    with pytest.raises(ValueError, match="K = V"):
        make_kernel(128, has_compressed=True)
    assert make_kernel(128, kv_shared=True, varlen=True, has_compressed=True).varlen  # packed entries
    with pytest.raises(ValueError, match="index mode takes flat"):
        make_kernel(512, kv_shared=True, pack_group=128, varlen=True, has_compressed=True, has_topk=True,
                    index_mode=True)
    with pytest.raises(ValueError, match="no meaning in index mode"):
        make_kernel(512, kv_shared=True, pack_group=128, has_compressed=True, has_topk=True, index_mode=True,
                    has_positions=True)


# ---------------------------------------------------------------------------------------
# 4. compile budgets


COMPILE_CASES = [
    (512, HCA_512),
    (512, dict(HCA_512, has_topk=True)),
    (512, dict(HCA_512, has_topk=True, has_positions=True)),
    (512, dict(HCA_512, has_positions=True)),
    (512, dict(HCA_512, varlen=True)),
    (512, dict(HCA_512, has_topk=True, has_positions=True, varlen=True)),
    (512, {"kv_shared": True, "pack_group": 128, "has_sink": True, "has_compressed": True, "has_topk": True,
           "index_mode": True}),
    (128, {"kv_shared": True, "pack_group": 8, "has_right": True, "has_sink": True, "has_compressed": True}),
    (128, {"kv_shared": True, "pack_group": 128, "has_right": True, "has_compressed": True, "has_topk": True}),
    # 64 heads with lists (DeepSeek-V4-Flash): the padded tile, one token a 128-row tile
    (512, INDEX_512_G64),
    (512, TOPK_512_G64),
    (512, dict(TOPK_512_G64, has_positions=True, varlen=True)),
    # serving: index mode over a paged FP8 cache (pages of 64 at 128 heads; pages of 2 on the padded tile)
    (512, {"kv_shared": True, "pack_group": 128, "has_sink": True, "has_compressed": True, "has_topk": True,
           "index_mode": True, "kv_pages": 64}),
    (512, dict(INDEX_512_G64, kv_pages=2)),
    # decode in one launch: the window cache (pages of 256) and the extra cache (pages of 64 / 2)
    (512, {"kv_shared": True, "pack_group": 128, "has_sink": True, "has_compressed": True, "has_topk": True,
           "index_mode": True, "kv_pages": 256, "kv_pages_extra": 64}),
    (512, dict(INDEX_512_G64, kv_pages=256, kv_pages_extra=2)),
]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("head_dim,options", COMPILE_CASES, ids=[f"hd{d}-{o}" for d, o in COMPILE_CASES])
def test_sm100_compiles_within_budget(head_dim, options):
    from dsv4_attention.common.compile import assert_within_budget

    assert_within_budget("e", "sm100", "bfloat16", head_dim, options=options, min_tmem_columns=256)


@pytest.mark.proof
@pytest.mark.slow
def test_index_mode_checker_rejects_the_other_mode():
    """Negative control: the top-k kernel judged by index mode's formula, and the index-mode kernel
    by top-k's, both fail."""
    topk_case = dict(seqlen_q=6, seqlen_k=1000, window=W127, ratio=4, entries=300, k=200, seed=1)
    assert topk_mask_failures("topk-hd512-g128", topk_case, expect_index=True) != []
    index_case = dict(seqlen_q=6, seqlen_k=1000, window=(0, 0), ratio=4, entries=300, k=200, seed=7)
    assert topk_mask_failures("index-hd512-g128", index_case, expect_index=False) != []


# ---------------------------------------------------------------------------------------
# 6. 64 query heads (DeepSeek-V4-Flash) with top-k lists / index mode: the padded tile
#
# One token a 128-row Q tile: rows 0 .. 63 its 64 heads, rows 64 .. 127 padding (computed on the
# next token's Q, or TMA's zeros past the last token; never stored). The masks and gathers of such
# tiles are proven in section 5 (``topk-hd512-g64``, ``index-hd512-g64``, the gathered rows); here
# the rest of each row's path, with the kernel's own code (``row_views``, ``q_tile_of``, ``q_tile``,
# ``kv_span``, ``o_load`` / ``o_row_part``, ``o_tile``, ``o_by_tma`` / ``row_stored``,
# ``packed_row``, ``lse_stored``, ``row_scale``) compiled into a host function and run on the CPU
# over coordinate views of Q, O and LSE (an element of such a view is the (batch, token, head,
# column) / (batch, head, token) it addresses), for every CTA of the grid: where each Q tile row
# loads from, which token's list its span holds, where its O and LSE go (each correction thread
# its own row, as the epilogue stores them: row by row on a padded tile, one TMA box otherwise,
# rows past the tensor clipped) and whose sink it reads (sink[h] = ln(h + 1), LSE 0: the scale
# 1 / (h + 2) names the head, as tests/test_d5_sm100_host.py reads it).


def build_row_map_runner(kernel):
    """A host function replaying, for every CTA, the Q load's rows, the span's list, the epilogue's
    O / LSE stores and the sink each row reads (see the section's comment)."""
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.layouts import reorder, seq_major
    from dsv4_attention.common.pack_heads import rows
    from dsv4_attention.common.tmem import EPI_THREADS, placeholder_tmem_base
    from dsv4_attention.stages.d1_smem_p.sm100 import LSE_ROW_MAJOR

    o_cols = kernel.plan.o_cols

    @cute.jit
    def host(count: cute.Tensor, who: cute.Tensor, lse_count: cute.Tensor, lse_who: cute.Tensor,
             q_src: cute.Tensor, sink_head: cute.Tensor, span_list: cute.Tensor, topk: cute.Tensor,
             sink: cute.Tensor, grid_x: Int32, seqlen_k: Int32):
        ids = cute.make_identity_tensor(count.shape)
        q, o, lse = kernel.row_views(seq_major(ids), seq_major(ids),
                                     reorder(cute.make_identity_tensor(lse_count.shape), LSE_ROW_MAJOR))
        tiled_o_load, _ = kernel.o_load(placeholder_tmem_base())
        tile_ids = cute.make_identity_tensor((QK_TILE_M, o_cols))
        for b in cutlass.range(count.shape[0], unroll=1):
            for h in cutlass.range(q.shape[2], unroll=1):
                n_rows = rows(q)  # g heads x seqlen_q tokens, as request_views gives it
                for bx in cutlass.range(grid_x, unroll=1):
                    m_blk, half = kernel.q_tile_of(bx, grid_x)
                    tag0 = ((b * q.shape[2] + h) * grid_x + bx) * QK_TILE_M
                    # the TMA warp's Q box: row r of the tile, column 0
                    tiles, index = kernel.q_tile(q, m_blk, h, b)
                    for r in cutlass.range(QK_TILE_M, unroll=1):
                        crd = tiles[r, 0, index]
                        q_src[tag0 + r, 0] = crd[1]
                        q_src[tag0 + r, 1] = crd[2]
                    # the span's list: (its first entry, the list's length) of the token the tile gathers
                    span = seam_calls.span(kernel, m_blk, n_rows, seqlen_k, 127, 0, 4, 300, topk[b, None, None])
                    span_list[b, h, bx] = span.idx_row[0]
                    for t in cutlass.range(EPI_THREADS, unroll=1):  # the correction threads
                        thr = tiled_o_load.get_slice(t)
                        row = kernel.o_row_part(thr, tile_ids)[0][0]
                        q_row = kernel.packed_row(m_blk, row)
                        sink_head[tag0 + row] = kernel.row_scale(cutlass.Float32(1.0), cutlass.Float32(0.0), sink,
                                                                 q_row, h)
                        if half == 0 and kernel.lse_stored(row, q_row, n_rows):
                            crd = lse[q_row, h, b]
                            if inside(crd, lse_count.shape):
                                put(lse_count, lse_who, crd, tag0 + row)
                    if cutlass.const_expr(not kernel.padded()):  # one box, clipped by TMA (a batched call)
                        box = kernel.o_tile(o, m_blk, half, h, b)
                        for i in cutlass.range(QK_TILE_M, unroll=1):
                            for j in cutlass.range(o_cols, unroll=1):
                                crd = box[i, j]
                                if inside(crd, count.shape):
                                    put(count, who, crd, (tag0 + i) * 1024 + half * o_cols + j)
                    else:  # row by row: each correction thread its own row, where row_stored
                        for t in cutlass.range(EPI_THREADS, unroll=1):
                            thr = tiled_o_load.get_slice(t)
                            rids = kernel.o_row_part(thr, tile_ids)
                            if kernel.row_stored(rids[0][0], n_rows - m_blk * kernel.owned_rows):
                                dst = kernel.o_row_part(thr, kernel.o_tile(o, m_blk, half, h, b))
                                for i in cutlass.range(cute.size(dst), unroll_full=True):
                                    crd = dst[i]
                                    if inside(crd, count.shape):
                                        put(count, who, crd, (tag0 + rids[i][0]) * 1024 + half * o_cols + rids[i][1])
                                    else:
                                        count[0, 0, 0, 0] = count[0, 0, 0, 0] + 1000000  # outside the tensor

    bufs = row_map_buffers(kernel, 1, 1, 1, 1)
    with target_arch("sm100"):
        return cute.compile(host, *[jit.as_cute(x) for x in bufs], Int32(1), Int32(1),
                            options=f"--gpu-arch={GPU_ARCH['sm100']}")


def row_map_buffers(kernel, batch: int, seqlen_q: int, kv_heads: int, grid_x: int, k: int = 8):
    """count, who (O's shape), lse_count, lse_who (LSE's), q_src, sink_head (per CTA and tile row),
    span_list (per CTA), topk (token t's list starts with entry 1000 b + t), sink (ln(h + 1))."""
    heads = kv_heads * kernel.pack_group
    i32 = dict(dtype=torch.int32)
    o_shape, lse_shape = (batch, seqlen_q, heads, kernel.head_dim), (batch, heads, seqlen_q)
    ctas = batch * kv_heads * grid_x * QK_TILE_M
    topk = torch.full((batch, seqlen_q, k), -1, **i32)
    topk[:, :, 0] = 1000 * torch.arange(batch, **i32)[:, None] + torch.arange(seqlen_q, **i32)[None]
    return (torch.zeros(o_shape, **i32), torch.full(o_shape, -1, **i32), torch.zeros(lse_shape, **i32),
            torch.full(lse_shape, -1, **i32), torch.full((ctas, 2), -1, **i32), torch.zeros(ctas),
            torch.full((batch, kv_heads, grid_x), -1, **i32), topk,
            torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))


@functools.cache
def row_map_runner(cls, options: tuple):
    kernel = make_kernel(512, cls=cls, **dict(options))
    return kernel, build_row_map_runner(kernel)


def row_map_failures(cls, options: dict, batch: int = 2, seqlen_q: int = 5, kv_heads: int = 2) -> list[str]:
    """Every way the replay breaks, by the checker's own map (one token a tile, ``owned_packed_row``:
    tile m serves token m, row r < g its head hk g + r): tile m's Q row r loads (token m, head hk g + r),
    its padding rows (r >= g) only heads of its KV head's group (the next token's, or TMA's zero
    fill past the last); its span holds token m's list; element (b, token, hk g + j, column) of O is
    stored exactly once, from CTA (b, hk, token)'s row j at that column, and nothing else is (the
    padding rows never); LSE likewise; row r's sink is head hk g + r % g."""
    from dsv4_attention.common import jit

    kernel, fn = row_map_runner(cls, tuple(sorted(options.items())))
    g, o_split, d = kernel.pack_group, kernel.plan.o_split, kernel.head_dim
    grid_x = -(-seqlen_q * g // kernel.owned_rows) * o_split  # as __call__ sizes the grid
    bufs = row_map_buffers(kernel, batch, seqlen_q, kv_heads, grid_x)
    fn(*[jit.as_cute(x) for x in bufs], Int32(grid_x), Int32(1000))
    count, who, lse_count, lse_who, q_src, sink_head, span_list, topk, _ = bufs
    fails = []
    tiles = topk_tiles(seqlen_q, g)
    if grid_x != tiles * o_split:
        fails.append(f"grid x {grid_x}: {tiles} tiles x {o_split} O parts wanted")
    want = torch.full_like(who, -1)
    want_lse = torch.full_like(lse_who, -1)
    col = torch.arange(d, dtype=torch.int32)
    q_wrong, list_wrong, sink_wrong = [], [], []
    for b in range(batch):
        for hk in range(kv_heads):
            for bx in range(min(grid_x, tiles * o_split)):
                m, half = bx // o_split, bx % o_split  # no causal reversal: no right bound with lists here
                tag0 = ((b * kv_heads + hk) * grid_x + bx) * QK_TILE_M
                token = owned_packed_row(m, 0, g) // g
                if int(span_list[b, hk, bx]) != int(topk[b, token, 0]):
                    list_wrong.append((b, hk, bx, int(span_list[b, hk, bx])))
                for r in range(QK_TILE_M):
                    packed = owned_packed_row(m, r, g)
                    src = q_src[tag0 + r].tolist()
                    if packed is None:  # padding: a head of this KV head's group, any token
                        ok = hk * g <= src[1] < (hk + 1) * g
                    else:
                        ok = src == [packed // g, hk * g + packed % g]
                    if not ok:
                        q_wrong.append((b, hk, bx, r, src))
                    if round(1.0 / float(sink_head[tag0 + r]) - 2.0) != hk * g + r % g:
                        sink_wrong.append((b, hk, bx, r, float(sink_head[tag0 + r])))
                    if packed is None or packed // g >= seqlen_q:
                        continue
                    t, j = packed // g, packed % g
                    want[b, t, hk * g + j, half * (d // o_split):(half + 1) * (d // o_split)] = \
                        (tag0 + r) * 1024 + half * (d // o_split) + col[:d // o_split]
                    if half == 0:
                        want_lse[b, hk * g + j, t] = tag0 + r
    for what, bad in (("Q rows loaded from elsewhere", q_wrong), ("spans on another token's list", list_wrong),
                      ("rows reading another head's sink", sink_wrong)):
        if bad:
            fails.append(f"{len(bad)} {what}, e.g. {bad[:3]}")
    for name, c, w, x in (("O", count, who, want), ("LSE", lse_count, lse_who, want_lse)):
        stored = x >= 0
        for what, where in (("stored more than once", c > 1), ("never stored", stored & (c == 0)),
                            ("stored outside every token's heads", ~stored & (c > 0)),
                            ("stored from another row", stored & (c > 0) & (w != x))):
            idx = torch.nonzero(where).tolist()
            if idx:
                fails.append(f"{name}: {len(idx)} elements {what}, e.g. {idx[:3]}")
    return fails


class PaddingRowsStored(FlashAttentionESm100):
    """Wrong: a padded tile stores every row it computed (its padding rows over the next token's O)."""

    def row_stored(self, row, rows_left):
        return row < rows_left


class PaddingLseStored(FlashAttentionESm100):
    """Wrong: a padded tile writes the LSE of its padding rows (packed row m 64 + r % 64: twice a head)."""

    def lse_stored(self, row, q_row, n_rows):
        return q_row < n_rows


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("options", [INDEX_512_G64, TOPK_512_G64], ids=["index", "csa"])
def test_64_heads_padded_tile_rows_load_gather_store_and_sink_by_head(options):
    kernel = make_kernel(512, **options)
    assert kernel.padded() and kernel.owned_rows == 64 and kernel.plan.o_split == 2
    assert row_map_failures(FlashAttentionESm100, options) == []


@pytest.mark.proof
@pytest.mark.slow
@pytest.mark.parametrize("cls", [TwoTokensPerTile, PaddingRowsStored, PaddingLseStored])
def test_64_heads_row_map_checker_rejects_wrong_maps(cls):
    """Negative controls: the old map (two tokens a tile, the first one's list, a TMA box of 128 rows),
    the padding rows' O stored, their LSE stored."""
    assert row_map_failures(cls, INDEX_512_G64) != []


@pytest.mark.proof
@pytest.mark.slow
def test_64_heads_mask_and_gather_checkers_reject_two_tokens_per_tile():
    """Negative controls of section 5's checkers at 64 heads: the old map's masks and gathers (tile m
    on token 2 m's list and window) are rejected."""
    case = TOPK_CASES["topk-hd512-g64"][0]
    assert topk_mask_failures("wrong-g64-two-tokens-per-tile", case) != []
    got, want = gathered_rows(512, TOPK_512_G64, GATHER_CASE, cls=TwoTokensPerTile)
    assert first_mismatches(want, got) != []


def test_64_heads_padded_seams():
    """The padded tile is a compile-time property of the options (pack_group 64 with lists): the
    kernel cache's key; 32 and 96 heads are refused, sm90's kernels untouched (no padding there)."""
    index = make_kernel(512, **INDEX_512_G64)
    assert index.padded() and index.owned_rows == 64 and index.may_hide_rows()
    assert not make_kernel(512, **dict(HCA_512, pack_group=64)).padded()  # no lists: two tokens a tile
    assert not make_kernel(512, **TOPK_512).padded()
    assert [index.packed_row(3, r) for r in (0, 63, 64, 127)] == [192, 255, 192, 255]
    assert index.o_by_tma(64) is False and index.varlen_grid_x(5) == 5 * 2
    with pytest.raises(ValueError, match=r"multiple of the 128-row tile or 64 \(a padded tile\)"):
        make_kernel(512, **dict(INDEX_512_G64, pack_group=32))
    with pytest.raises(ValueError, match="does not pack"):
        make_kernel(512, **dict(INDEX_512_G64, pack_group=96))


# ---- serving: the FP8 page gather (stages/e_fused/sm100_pages.py) ----------------------------------

FP8_PAGES = {"kv_shared": True, "pack_group": 128, "has_compressed": True, "has_topk": True, "index_mode": True,
             "kv_pages": 64}


def fp8_stage_bytes(unit_byte=None) -> dict:
    """{(key row, column): byte from the stage's first} of every element the FP8 gather stores in a K
    block, from the kernel's own ``unit_byte`` (or a stand-in: the negative controls)."""
    from dsv4_attention.common.layout_proof import trace

    kernel = make_kernel(512, **FP8_PAGES)
    unit_byte = unit_byte or kernel.unit_byte

    def body():
        placement = kernel.stage_placement()
        return {(r, 8 * u + i): int(unit_byte(r, u, placement)) + 2 * i
                for r in range(kernel.plan.tile_n) for u in range(8) for i in range(8)}

    return trace(body)


def mma_stage_bytes() -> dict:
    """{(key row, column): byte} where the QK MMA reads K[row, column] of ring stage 0: the ring's own
    layout (``make_smem_layouts``' k_ring: ((T, 16), 1, 4, stages) elements at B = 64) at its
    coordinate, under the ring's swizzle, written out here, apart from ``block_rows_layout``."""
    from dsv4_attention.common.layout_proof import swizzle_bytes, trace
    from dsv4_attention.common.sm100_smem_p import make_pv_mma, make_qk_mma, make_smem_layouts

    kernel = make_kernel(512, **FP8_PAGES)
    plan = kernel.plan

    def body():
        _, k_ring, _, _ = make_smem_layouts(BF16, plan, make_qk_mma(BF16, plan), make_pv_mma(BF16, plan))
        sw = k_ring.inner
        bits, base, shift = int(sw.num_bits), int(sw.num_base), int(sw.num_shift)
        assert plan.d_block == 64  # one 64-column block a stage (hd 512): its k-phase mode is 4, not (4, 1)
        return {(r, c): swizzle_bytes(2 * int(k_ring.outer(((r, c % 16), 0, c // 16, 0))), bits, base, shift)
                for r in range(plan.tile_n) for c in range(plan.d_block)}

    return trace(body)


@pytest.mark.proof
def test_fp8_gather_stores_each_value_where_the_mma_reads_it():
    """Every (key, column) of a K block the dequantizing gather writes lands on the byte the QK MMA
    reads that element from (the T x 64 block of the ring stage); the block's 64 columns are one
    scale tile (kv_cache.unit_bytes, proven against the format in tests/test_kv_cache.py)."""
    got, want = fp8_stage_bytes(), mma_stage_bytes()
    assert len(got) == len(want) == 64 * 64 and len(set(got.values())) == len(got)
    assert got == want, first_mismatches(want, got)


@pytest.mark.proof
def test_fp8_gather_checker_rejects_wrong_placements():
    """Negative controls: the units stored without the ring's swizzle, and rows taken as columns."""
    want = mma_stage_bytes()
    kernel = make_kernel(512, **FP8_PAGES)
    from dsv4_attention.stages.e_fused.sm100_pages import swizzled

    unswizzled = fp8_stage_bytes(lambda r, u, placement: 2 * (r * 64 + 8 * u))
    T = kernel.plan.tile_n  # units column-major: unit u of row r after the units 0 .. u - 1 of every row
    transposed = fp8_stage_bytes(lambda r, u, placement: swizzled(16 * (u * T + r), *placement[1]))
    assert unswizzled != want and transposed != want


def test_fp8_gather_lanes_cover_each_unit_once():
    """The TMA warp's lanes and passes (row = lane / 8 + 4 p, unit = lane % 8) store every 16-byte
    unit of a T-row block once; the control (rows stepped by 8 a pass) misses some."""
    from dsv4_attention.stages.e_fused.sm100_pages import LANES, UNITS

    T = make_kernel(512, **FP8_PAGES).plan.tile_n

    def cover(step):
        units = [(lane // UNITS + p * step, lane % UNITS) for p in range(T * UNITS // LANES) for lane in range(LANES)]
        return sorted(units) == sorted(itertools.product(range(T), range(UNITS)))

    assert cover(LANES // UNITS) and not cover(2 * LANES // UNITS)
