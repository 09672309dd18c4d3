"""Stage E on SM90, on the host (CPU, no GPU): the fused span's masks, run.

The consumer warpgroups' masking of one Q tile is replayed with the kernel's own code: its span
(``kv_span``: common/compressed.py's FusedSpan), every consumer thread's QK accumulator partition
(``make_mmas``, ``s_coords``) and its per-visit mask (``mask_s``: the first visit always, later ones
where the span says the tile straddles an edge), compiled into a host function for sm_90a and *run
on the CPU* on accumulators of zeros. A value left at 0 is a (row, key) the kernel keeps, one at
-inf a pair it hides. Tile n of a visit is compressed entries [n T, n T + T) for n < n_cmp and
window keys origin + (n - n_cmp) T .. otherwise (what the producer's ``load_kv`` loads there). For
several kernels (rows and seesaw layouts; pack_group 1, 8, 64, 128) and problems (ratio 4 and 128;
windows (127, 0), (5, 3), none; seqlen_q <, =, > seqlen_k; fewer entries than visible and more;
Q tiles holding several tokens), the kept pairs of the real rows (token < seqlen_q) must be exactly
those ``kv_span.visible`` (window) and ``compressed.compressed_visible`` allow, each kept once.
Negative controls the same checker rejects: a span that counts floor(t' / r) entries (the
off-by-one of the spec's floor((t' + 1) / r)), and one that masks compressed tiles on the first
visit only.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Float32, Int32
from sm90_mask_replay import (
    MAX_VISITS,
    compile_replay,
    kept_keys,
    mask_replayer,
    masking_first_tile_only,
    pair_mismatch,
    replay_buffers,
)

from dsv4_attention.common import kv_span
from dsv4_attention.common.compressed import FusedSpan, compressed_visible, compressed_visible_at

pytestmark = [pytest.mark.arch("sm90"), pytest.mark.stage_e, pytest.mark.proof]


class FloorTSpan(FusedSpan):
    """Wrong on purpose: count = floor(t' / r) (drops the + 1)."""

    def __init__(self, *args):
        super().__init__(*args)

    @cute.jit
    def mask(self, acc, tScS, n, first_row):
        if n < self.n_cmp:
            for i in cutlass.range_constexpr(cute.size(acc)):
                token = (first_row + tScS[i][0]) // self.group
                t = cutlass.max(token + self.seqlen_k - self.seqlen_q, 0)
                count = cutlass.min(t // self.ratio, self.n_compressed)
                acc[i] = -Float32.inf if n * self.tile_n + tScS[i][1] >= count else acc[i]
        else:
            kv_span.KvSpan.mask(self, acc, tScS, n, first_row)


def fused_span(kernel, m_block, rows, seqlen_k, left, right, ratio, n_c, topk, kv_start=0, positions=None):
    """The kernel's ``kv_span`` for a tile of a request with ``n_c`` entries (its seams' bundles:
    common/seams.Window and what ``request_entries`` gives, stages/e_fused/sm90.RequestEntries)."""
    from dsv4_attention.common.seams import Window
    from dsv4_attention.stages.e_fused.sm90 import RequestEntries

    return kernel.kv_span(m_block, rows, seqlen_k, Window(left, right),
                          RequestEntries(None, None, None, n_c, topk, positions, ratio, kv_start))


def kernel_class(wrong: str | None):
    from dsv4_attention.stages.e_fused.sm90 import FlashAttentionESm90

    if wrong is None:
        return FlashAttentionESm90
    if wrong == "floor_t":
        class FloorT(FlashAttentionESm90):
            def kv_span(self, m_block, rows, seqlen_k, window, entries):
                return FloorTSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window.left,
                                  window.right, self.has_left, self.has_right, entries.ratio, entries.count)

            def mask_s(self, span, acc_s, tScS, n, first_row, first):
                span.mask(acc_s, tScS, n, first_row)  # every visit: only the count is wrong
        return FloorT
    if wrong == "first_only":
        return masking_first_tile_only(FlashAttentionESm90)
    raise ValueError(wrong)


KERNELS = {  # name: (head_dim, options)
    "split-g128": (512, {"pack_group": 128}),
    "split-g8": (512, {"pack_group": 8}),
    "rows-g1": (128, {"pack_group": 1}),
    "rows-g64": (256, {"pack_group": 64}),
}


@functools.cache
def runner(name: str, window: bool, wrong: str | None = None, positions: bool = False):
    from dsv4_attention.common import jit

    head_dim, options = KERNELS[name]
    kernel = kernel_class(wrong)(jit.cutlass_dtype(torch.bfloat16), head_dim, kv_shared=True, has_compressed=True,
                                 has_left=window, has_right=window, **options)
    replay = mask_replayer(kernel)

    @cute.jit
    def host(out: cute.Tensor, coords: cute.Tensor, info: cute.Tensor, m_block: Int32, rows: Int32,
             seqlen_k: Int32, left: Int32, right: Int32, ratio: Int32, n_c: Int32, kv_start: Int32, pos: cute.Tensor):
        qk_mma, _ = kernel.make_mmas()
        pos_row = None
        if cutlass.const_expr(positions):
            pos_row = pos
        span = fused_span(kernel, m_block, rows, seqlen_k, left, right, ratio, n_c, None, kv_start, pos_row)
        info[0] = span.origin
        info[1] = span.n_tiles
        info[2] = span.n_cmp
        replay(qk_mma, span, m_block * kernel.tile_m, out, coords)

    fn, bufs = compile_replay(host, kernel, 3, 8, torch.zeros(4, dtype=torch.int32))
    return kernel, fn, bufs


def kept_pairs(name, window, wrong, m_block, seqlen_q, seqlen_k, left, right, ratio, n_c, kv_start=0,
               positions=None):
    """{(packed row, source, key): times kept} over the real rows of Q tile m_block (``positions``:
    the query tokens' absolute positions, given to the span)."""
    from cutlass.cute.runtime import from_dlpack

    kernel, fn, bufs = runner(name, window, wrong, positions is not None)
    out, coords, info = (b.zero_() for b in bufs)
    g, tile_n = kernel.pack_group, kernel.tile_n
    fn(*[from_dlpack(b) for b in (out, coords, info)], *[Int32(x) for x in (m_block, seqlen_q * g, seqlen_k,
                                                                          left, right, ratio, n_c, kv_start)],
       from_dlpack(torch.tensor([0] if positions is None else positions, dtype=torch.int32)))
    origin, n_tiles, n_cmp = info.tolist()
    assert 1 <= n_tiles <= MAX_VISITS, (origin, n_tiles, n_cmp)

    def key_of(n, row, col):
        source, first = ("c", n * tile_n) if n < n_cmp else ("w", origin + (n - n_cmp) * tile_n)
        packed = m_block * kernel.tile_m + row
        return (packed, source, first + col) if packed // g < seqlen_q else None

    kept = kept_keys(out, coords, n_tiles, key_of)
    return kept, kernel


def visible(kernel, m_block, seqlen_q, seqlen_k, left, right, ratio, n_c, kv_start=0, positions=None) -> set:
    pairs = set()
    for r in range(m_block * kernel.tile_m, (m_block + 1) * kernel.tile_m):
        token = r // kernel.pack_group
        if token < seqlen_q and positions is not None:  # absolute position positions[token], key j at kv_start + j
            p = positions[token] - kv_start  # in the keys' frame
            win = (j for j in range(seqlen_k) if kv_span.visible_at(p, j, seqlen_k, left, right))
            ent = (j for j in range(n_c) if compressed_visible_at(positions[token], j, ratio, n_c))
            pairs |= {(r, "w", j) for j in win} | {(r, "c", j) for j in ent}
        elif token < seqlen_q:
            win = (j for j in range(seqlen_k) if kv_span.visible(token, j, seqlen_q, seqlen_k, left, right))
            ent = (j for j in range(n_c) if compressed_visible(token, j, seqlen_q, seqlen_k, ratio, n_c, kv_start))
            pairs |= {(r, "w", j) for j in win} | {(r, "c", j) for j in ent}
    return pairs


PROBLEMS = [  # seqlen_q, seqlen_k, ratio, entries[, kv_start: raw key 0's absolute position, default 0]
    (300, 300, 4, 80), (300, 300, 4, 40), (40, 700, 128, 8), (700, 200, 4, 60), (129, 1000, 128, 3), (5, 9, 4, 10),
    (40, 150, 4, 300, 1000), (300, 300, 128, 9, 700),  # the last rows of a longer sequence (a window cache)
]


def failures(name, window, wrong=None, problems=PROBLEMS, windows=((127, 0), (5, 3))) -> list:
    bad = []
    g = KERNELS[name][1]["pack_group"]
    for sq, sk, ratio, n_c, *start in problems:
        kv_start = start[0] if start else 0
        for left, right in (windows if window else ((None, None),)):
            kernel = runner(name, window, wrong)[0]
            tiles = -(-sq * g // kernel.tile_m)
            for m in sorted({0, 1, tiles // 2, tiles - 1} & set(range(tiles))):
                kept, kernel = kept_pairs(name, window, wrong, m, sq, sk, left or 0, right or 0, ratio, n_c, kv_start)
                want = visible(kernel, m, sq, sk, left, right, ratio, n_c, kv_start)
                wrong_pairs = pair_mismatch(kept, want)
                if wrong_pairs:
                    bad.append(f"{name} sq{sq} sk{sk} r{ratio} nc{n_c} start{kv_start} window({left},{right}) m{m}: "
                               f"{wrong_pairs}")
    return bad


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("window", [True, False], ids=["window", "no_window"])
def test_kept_pairs_are_the_union_of_window_and_visible_entries(name, window):
    assert failures(name, window) == []


@pytest.mark.parametrize("wrong", ["floor_t", "first_only"])
def test_checker_rejects_wrong_masks(wrong):
    assert failures("rows-g1", True, wrong, problems=[(300, 300, 4, 80)], windows=((127, 0),)) != []


def test_checker_rejects_a_span_that_ignores_kv_start():
    """Negative control: the kernel's masks judged as if raw key 0 were at absolute position 0
    (the kernel got kv_start = 1000, the formula 0) must fail."""
    bad = []
    for m in (0, 1):
        kept, kernel = kept_pairs("rows-g1", True, None, m, 40, 150, 127, 0, 4, 300, 1000)
        bad += [m] if set(kept) != visible(kernel, m, 40, 150, 127, 0, 4, 300, 0) else []
    assert bad


POSITION_PROBLEMS = [  # seqlen_q, seqlen_k, ratio, entries, kv_start, positions (absolute, non-decreasing)
    (300, 1000, 4, 300, 0, [400 + (i * 3) // 2 for i in range(300)]),  # a chunk mid-sequence, with repeats
    (200, 900, 128, 8, 100, sorted((i * 37) % 800 + 100 for i in range(200))),  # jumps, a window cache
    (40, 300, 4, 80, 0, [5] * 20 + [290] * 20),  # two clusters far apart in one Q tile
]


@pytest.mark.parametrize("name", ["rows-g1", "split-g8", "rows-g64"])
def test_kept_pairs_with_positions(name):
    """Per-token positions: the kept pairs are exactly those of each token at its own position.
    Negative control: the same runs judged by bottom-right alignment must fail."""
    bad, control = [], []
    g = KERNELS[name][1]["pack_group"]
    for sq, sk, ratio, n_c, kv_start, pos in POSITION_PROBLEMS:
        for left, right in ((127, 0), (5, 3)):
            kernel = runner(name, True, None, True)[0]
            tiles = -(-sq * g // kernel.tile_m)
            for m in sorted({0, 1, tiles // 2, tiles - 1} & set(range(tiles))):
                kept, kernel = kept_pairs(name, True, None, m, sq, sk, left, right, ratio, n_c, kv_start, pos)
                want = visible(kernel, m, sq, sk, left, right, ratio, n_c, kv_start, pos)
                if set(kept) != want or any(c != 1 for c in kept.values()):
                    bad.append(f"sq{sq} sk{sk} r{ratio} window({left},{right}) m{m}: extra "
                               f"{sorted(set(kept) - want)[:3]} missing {sorted(want - set(kept))[:3]}")
                if set(kept) != visible(kernel, m, sq, sk, left, right, ratio, n_c, kv_start):
                    control.append(m)
    assert bad == []
    assert control, "bottom-right alignment judged the positions runs correct: the check cannot see positions"


def test_span_visits_only_tiles_with_visible_entries():
    """n_cmp = ceil(count(t_hi) / T): the last compressed tile holds an entry the tile's last token
    sees, and a Q tile whose tokens see no entry visits none (pure arithmetic of the span)."""
    for sq, sk, ratio, n_c, *start in PROBLEMS:
        kv_start = start[0] if start else 0
        for m in range(-(-sq // 64)):
            span = FusedSpan(m, sq, sk, 64, 64, 1, 127, 0, True, True, ratio, n_c, kv_start)
            t_hi = min(m * 64 + 63, sq - 1)
            count = min(n_c, max(kv_start + t_hi + sk - sq + 1, 0) // ratio)
            assert span.n_cmp == -(-count // 64)
            assert span.n_tiles == span.n_cmp + span.window_tiles


# ---------------------------------------------------------------------------------------
# top-k (CSA): the gathered rows, their SMEM addresses and the list masks


def test_gather_offsets_are_the_ring_layout():
    """``gather_offset`` (where a producer thread's cp.async writes unit u of row r, chunk c, slot s)
    is the byte the ring's own SMEM layout (``make_tile_smem_layout``, the layout TMA fills and the
    wgmma reads) puts there, for every (row, 16-byte unit, chunk, slot); negative control: the same
    formula without the swizzle's XOR."""
    from dsv4_attention.common.layout_proof import swizzle_bytes, trace
    from dsv4_attention.common.sm90_gemm import make_tile_smem_layout
    from dsv4_attention.common.sm90_kv_chunks import gather_offset

    tile_n, d, slots = 64, 512, 2

    def body():
        lay = make_tile_smem_layout(cutlass.BFloat16, tile_n, d, slots)
        out = {}
        for s in range(slots):
            for r in range(tile_n):
                for col in range(0, d, 8):
                    out[(r, col, s)] = int(cute.crd2idx((r, col, s), lay.outer))
        return out, str(lay.inner)

    offsets, swz = trace(body, arch="sm90")
    assert swz == "S<3,4,3>", swz
    bad, bad_plain = [], 0
    for (r, col, s), off in offsets.items():
        want = swizzle_bytes(2 * off, 3, 4, 3)
        got = 2 * gather_offset(r, (col % 64) // 8, col // 64, s, tile_n, d)
        if got != want:
            bad.append(((r, col, s), got, want))
        plain = 2 * (s * tile_n * d + (col // 64) * tile_n * 64 + r * 64 + col % 64)
        bad_plain += plain != want
    assert bad == [], bad[:5]
    assert bad_plain > 0  # the checker sees a missing swizzle


TOPK_KERNELS = {"split-g128": (512, {"pack_group": 128}), "rows-g128": (128, {"pack_group": 128})}


@functools.cache
def topk_runner(name: str, wrong: str | None = None, index_mode: bool = False):
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.stages.e_fused.sm90 import FlashAttentionESm90

    class NoCount(FlashAttentionESm90):
        """Wrong on purpose: listed entries count as visible whatever the token's position."""

        def kv_span(self, *args):
            span = super().kv_span(*args)
            span.count = span.n_compressed
            return span

    class OneSlot(FlashAttentionESm90):
        """Wrong on purpose: every tile's list staged in slot 0 (the producer, a tile ahead,
        overwrites the list the consumers are masking with)."""

        def kv_span(self, *args):
            span = super().kv_span(*args)
            span.list_slot = lambda n: 0
            return span

    @cute.jit
    def mask_by_count_only(acc, tScS, tile_list, first_pos, count, k):
        for i in cutlass.range_constexpr(cute.size(acc)):
            j = tile_list[tScS[i][1]]
            acc[i] = acc[i] if (first_pos + tScS[i][1] < k) & (j < count) else -cutlass.Float32.inf

    class KeepsMinusOne(FlashAttentionESm90):
        """Wrong on purpose: the list mask compares an entry with the count only, so -1 padding is
        kept (what ``Uint32(j) < Uint32(count)`` compiled to in the kernel, where count is a shape
        value and the DSL kept the compare signed)."""

        def kv_span(self, *args):
            span = super().kv_span(*args)
            wrong = lambda acc, tScS, n, first_row: mask_by_count_only(  # noqa: E731
                acc, tScS, span.tile_list(n), n * span.tile_n, span.count, span.k)
            span.mask = span.mask_if_needed = wrong
            return span

    head_dim, options = TOPK_KERNELS[name]
    cls = {"no_count": NoCount, "one_slot": OneSlot, "keeps_minus_one": KeepsMinusOne}.get(wrong, FlashAttentionESm90)
    kernel = cls(jit.cutlass_dtype(torch.bfloat16), head_dim, kv_shared=True, has_compressed=True, has_topk=True,
                 has_left=not index_mode, has_right=not index_mode, index_mode=index_mode, **options)

    @cute.jit
    def stage_ahead(span, it):
        """The producer's list staging (``list_copy_views``, a plain copy for its cp.async) as far
        ahead as the ring lets it be at visit it: uses it .. it + slots - 1 (use it + slots waits
        for the slot visit it still reads)."""
        for u in cutlass.range(it, cutlass.min(it + kernel.slots, span.n_tiles), unroll=1):
            n = span.n_tiles - 1 - u
            if n < span.n_cmp:
                for c in cutlass.range(kernel.tile_n, unroll=1):
                    src, dst = kernel.list_copy_views(span, n, c)
                    dst[0] = src[0]

    replay = mask_replayer(kernel, stage_ahead)

    @cute.jit
    def host(out: cute.Tensor, coords: cute.Tensor, info: cute.Tensor, rows_out: cute.Tensor, lists: cute.Tensor,
             idx: cute.Tensor, m_block: Int32, rows: Int32, seqlen_k: Int32, left: Int32, right: Int32, ratio: Int32,
             n_c: Int32, kv_start: Int32):
        qk_mma, _ = kernel.make_mmas()
        span = fused_span(kernel, m_block, rows, seqlen_k, left, right, ratio, n_c, idx, kv_start)
        span.stage_lists(lists, kernel.slots)  # as the kernel does: the masks read the staged SMEM copy
        info[0] = span.origin
        info[1] = span.n_tiles
        info[2] = span.n_cmp
        for n in cutlass.range(span.n_cmp, unroll=1):  # the producer's source row of every tile row
            for r in cutlass.range(kernel.tile_n, unroll=1):
                rows_out[n, r] = kernel.gather_source_row(span, n, r)
        replay(qk_mma, span, m_block * kernel.tile_m, out, coords)

    bufs = (*replay_buffers(kernel), torch.zeros(3, dtype=torch.int32),
            torch.zeros(MAX_VISITS, kernel.tile_n, dtype=torch.int32),
            lists_buffer(kernel), torch.zeros(10, 7, dtype=torch.int32))
    with target_arch("sm90"):
        # the list's shape is dynamic, as the kernel receives it (jit.as_cute)
        fn = cute.compile(host, *[from_dlpack(b) for b in bufs[:5]], jit.as_cute(bufs[5]), *([Int32(1)] * 8),
                          options=f"--gpu-arch={GPU_ARCH['sm90']}")
    return kernel, fn


def lists_buffer(kernel):
    """The staged lists' SMEM as the kernel lays it out, (tile_n, slots) int32 column-major, poisoned."""
    return torch.full((kernel.slots, kernel.tile_n), -9, dtype=torch.int32).t()


def topk_case(seed, seqlen_q, seqlen_k, ratio, n_c, k):
    """A random [seqlen_q, k] list per token: visible and not-yet-visible entries, -1 padding."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_c, (seqlen_q, k), generator=g, dtype=torch.int32)
    idx[torch.rand(seqlen_q, k, generator=g) < 0.2] = -1
    return idx


def topk_failures(name, wrong=None, problems=((40, 40, 4, 30, 200), (7, 300, 4, 80, 128), (5, 1000, 128, 9, 70),
                                              (7, 300, 4, 400, 128, 1000)),
                  index_mode=False, expect_index=None):
    """Every way "the masks keep exactly the visible listed entries (and the window), each once, and
    the producer gathers the listed row where visible, nothing (-1: zero-filled) elsewhere" breaks. Index mode: the
    lists are the only keys and every listed row (0 <= idx < entries) is visible."""
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common import jit
    from dsv4_attention.common.compressed import compressed_count

    kernel, fn = topk_runner(name, wrong, index_mode)
    if expect_index is not None:  # judge this kernel by the other mode's formula (negative controls)
        index_mode = expect_index
    g, tile_n, tile_m = kernel.pack_group, kernel.tile_n, kernel.tile_m
    bad = []
    for sq, sk, ratio, n_c, k, *start in problems:
        kv_start = start[0] if start else 0
        idx = topk_case(sq + k, sq, sk, ratio, n_c, k)
        tiles = sq * g // tile_m
        for m in sorted({0, 1, tiles // 2, tiles - 1}):
            out, coords = replay_buffers(kernel)
            info, rows_out = torch.zeros(3, dtype=torch.int32), torch.full((MAX_VISITS, tile_n), -7, dtype=torch.int32)
            fn(*[from_dlpack(b) for b in (out, coords, info, rows_out, lists_buffer(kernel))], jit.as_cute(idx),
               *[Int32(x) for x in (m, sq * g, sk, 127, 0, ratio, n_c, kv_start)])
            origin, n_tiles, n_cmp = info.tolist()
            token = m * tile_m // g
            count = n_c if index_mode else compressed_count(token, sq, sk, ratio, n_c, kv_start)

            def key_of(n, row, col, n_cmp=n_cmp, origin=origin, token=token, idx=idx, k=k):
                if n < n_cmp:
                    p = n * tile_n + col
                    return (row, "c", int(idx[token, p]) if p < k else None, p)
                return (row, "w", origin + (n - n_cmp) * tile_n + col, None)

            kept = kept_keys(out, coords, n_tiles, key_of)
            want = set()
            for row in range(tile_m):
                if not index_mode:
                    want |= {(row, "w", j, None) for j in range(sk) if kv_span.visible(token, j, sq, sk, 127, 0)}
                want |= {(row, "c", int(idx[token, p]), p) for p in range(k)
                         if 0 <= int(idx[token, p]) < count}
            twice = [x for x, c in kept.items() if c != 1]
            if n_cmp != max(-(-k // tile_n), 1) or set(kept) != want or twice or (index_mode and n_tiles != n_cmp):
                bad.append(f"{name} sq{sq} sk{sk} r{ratio} k{k} m{m}: n_cmp {n_cmp} extra "
                           f"{sorted(set(kept) - want, key=str)[:3]} missing {sorted(want - set(kept), key=str)[:3]}")
            # the producer's rows: list entry where visible, else -1 (zero-filled, masked)
            for n in range(n_cmp):
                for r in range(tile_n):
                    p = n * tile_n + r
                    j = int(idx[token, p]) if p < k else -1
                    want_row = j if 0 <= j < count else -1
                    if int(rows_out[n, r]) != want_row:
                        bad.append(f"{name} m{m} tile {n} row {r}: gathers {int(rows_out[n, r])}, want {want_row}")
                        break
    return bad


@pytest.mark.parametrize("name", list(TOPK_KERNELS))
def test_topk_kept_pairs_and_gathered_rows(name):
    assert topk_failures(name) == []


def test_topk_checker_rejects_a_list_mask_without_the_count():
    assert topk_failures("split-g128", "no_count") != []


@pytest.mark.parametrize("index_mode", [False, True])
def test_topk_checker_rejects_a_list_mask_that_keeps_minus_one(index_mode):
    assert topk_failures("split-g128", "keeps_minus_one", index_mode=index_mode) != []


def test_topk_checker_rejects_lists_staged_in_one_slot():
    """The masks read each tile's list from the ring slot of its visit; staging every tile in one
    slot lets the producer, a tile ahead, overwrite the list being masked with."""
    assert topk_failures("split-g128", "one_slot") != []


def test_topk_needs_whole_tiles_of_one_token():
    from dsv4_attention.common import jit
    from dsv4_attention.stages.e_fused.sm90 import FlashAttentionESm90

    with pytest.raises(ValueError, match="multiple"):
        FlashAttentionESm90(jit.cutlass_dtype(torch.bfloat16), 512, kv_shared=True, has_compressed=True,
                            has_topk=True, pack_group=32)


@pytest.mark.parametrize("name", list(TOPK_KERNELS))
def test_index_mode_keeps_exactly_the_listed_rows(name):
    """FlashMLA's semantics: no window tile, every listed row in range a key, -1 none; an empty list
    (k = 0 after topk_length) visits one wholly masked tile."""
    assert topk_failures(name, problems=((40, 40, 4, 30, 200), (7, 300, 4, 80, 1), (5, 9, 4, 9, 70)),
                         index_mode=True) == []


def test_index_mode_checker_rejects_the_visibility_rule():
    """Negative control: the top-k kernel (window tiles, entries not yet visible hidden) judged by
    index mode's formula fails, and the index-mode kernel judged by top-k's."""
    problems = ((40, 40, 4, 30, 200),)
    assert topk_failures("split-g128", problems=problems, index_mode=False, expect_index=True) != []
    assert topk_failures("split-g128", problems=problems, index_mode=True, expect_index=False) != []
