"""Stages D3 and D4 on SM100, on the host (CPU, no GPU): the softmax warps' masks, the span
arithmetic behind them, and the compile budgets.

1. Masks, run. The kernel's own mask code (``s_row_load``: the softmax thread's TMEM load partition;
   ``kv_length`` / ``kv_span`` / ``row_keys`` / ``mask_s_row``; common/sm100_softmax.py) is compiled
   into a host function and *run on the CPU* for every softmax thread t and every visit ``it`` of a
   Q tile, on a register row of zeros: a value left at 0 is a (row, key) pair the kernel keeps, one
   at -inf a pair it hides; the partition's own (row, column) of each value, the span's origin and
   n_tiles come back with it. For several kernels (pack_group 1, 64, 128; K tiles of 64 and 128 keys;
   windows (127, 0), (5, 3), (None, 0), (0, 0), none; seqlen_q <, =, > seqlen_k; seqused_k below
   seqlen_k and 0) and several Q tiles of each, the kept pairs of the real rows (token < seqlen_q)
   must be exactly the pairs ``common.kv_span.visible`` allows, each held once. Negative controls
   the same checker rejects: a row mask that forgets the pack_group division, one aligned with
   seqlen_q in place of seqlen_k (top-left), and a window kernel that masks the first visit only.
   TMA boxes: the TMA warp's K and V partitions (``kv_tma_views``, on atoms built as ``__call__``
   builds them) start KV tile t's block at key origin + t T, on K's key mode and on V's (its second).
   Negative control: V offset on its head-dim mode.
2. Spans (pure Python on common/kv_span.py and common/sm100_softmax.py, many random problems): the
   KV tiles [origin + n T, ..) for n < n_tiles hold every key a real row of the Q tile sees, and no
   wholly invisible tile is visited; a tile ``tile_needs_mask`` passes is wholly visible to every
   row; the softmax's per-row bounds (``visible_keys`` / ``visible_columns``) are exactly each row's
   visible columns, so a row skips a tile's mask iff the mask would change nothing. Negative
   controls: Q tiles taken as group-1 tokens, a tile test that forgets seqlen_k.
3. Seams: D1 and D2 keep every key visible (no window, no empty rows); both O halves of a head-dim-512
   Q tile get one Q tile (one span); causal without a left bound schedules the tiles longest first.
4. Compile budgets (marked compile / slow): the D3 and D4 kernels at head dims 128, 256 and 512.
"""

from __future__ import annotations

import copy
import functools
import random

import cutlass
import cutlass.cute as cute
import pytest
import torch
from sm100_mask_replay import MAX_VISITS, build_mask_runner, mismatches, replay

from dsv4_attention.common import kv_span
from dsv4_attention.common.kv_span import KvSpan, tile_needs_mask, tile_tokens
from dsv4_attention.common.layout_proof import first_mismatches
from dsv4_attention.common.sm100_softmax import visible_columns, visible_keys
from dsv4_attention.common.tmem import QK_TILE_M
from dsv4_attention.stages.d4_causal_window.sm100 import FlashAttentionD4Sm100

pytestmark = [pytest.mark.arch("sm100"), pytest.mark.proof]

BF16 = cutlass.BFloat16
#: visits a host run records (every case here visits fewer)


# ---------------------------------------------------------------------------------------
# 1. the masks, run on the host


def make_kernel(stage: str, head_dim: int, cls=None, **options):
    """The stage's sm100 kernel object (or ``cls``, a variant of it, built with the same options)."""
    from dsv4_attention import stages
    from dsv4_attention.common import jit

    if cls is None:
        return stages.get(stage).module.make_kernel("sm100", torch.bfloat16, head_dim, **options)
    return cls(jit.cutlass_dtype(torch.bfloat16), head_dim, **options)


@functools.cache
def mask_runner(name: str):
    kernel = KERNELS[name]()
    return kernel, build_mask_runner(kernel)


def kept_pairs(name: str, m_blk: int, seqlen_q: int, seqlen_k: int, seqused, left, right):
    """{(packed row, key): times kept} over the real rows of Q tile m_blk, every visit and every
    thread / value, as the kernel's masks leave them; and (origin, n_tiles)."""

    kernel, fn = mask_runner(name)
    g, tile_n = kernel.pack_group, kernel.plan.tile_n
    out, coords, (origin, n_tiles, _) = replay(fn, tile_n, m_blk, seqlen_q * g, seqlen_k,
                                               seqlen_k if seqused is None else seqused, left, right)
    assert 1 <= n_tiles <= MAX_VISITS, (origin, n_tiles)
    kept = {}
    for it in range(n_tiles):
        first_key = origin + (n_tiles - 1 - it) * tile_n
        t_idx, v_idx = torch.nonzero(out[:, it, :] == 0, as_tuple=True)
        assert bool(torch.all((out[:, it, :] == 0) | (out[:, it, :] == -float("inf")))), "a value neither kept nor -inf"
        for t, v in zip(t_idx.tolist(), v_idx.tolist(), strict=True):
            row, col = coords[t, v].tolist()
            packed = m_blk * QK_TILE_M + row
            if packed // g < seqlen_q:  # rows past the last token are never stored
                kept[(packed, first_key + col)] = kept.get((packed, first_key + col), 0) + 1
    return kept, (origin, n_tiles)


def visible_pairs(m_blk: int, group: int, seqlen_q: int, used: int, left, right) -> set:
    """The plain formula's pairs for the real rows of Q tile m_blk (keys < used: seqused_k or seqlen_k)."""
    pairs = set()
    for r in range(m_blk * QK_TILE_M, (m_blk + 1) * QK_TILE_M):
        token = r // group
        if token < seqlen_q:
            pairs |= {(r, j) for j in range(used) if kv_span.visible(token, j, seqlen_q, used, left, right)}
    return pairs


def mask_failures(name: str, case: dict) -> list[str]:
    """Every way "the kernel keeps exactly the visible pairs of the real rows, each once" breaks,
    for each Q tile of the case."""
    kernel, _ = mask_runner(name)
    sq, sk, su = case["seqlen_q"], case["seqlen_k"], case.get("seqused")
    left, right = case.get("window", (None, None))
    used = sk if su is None else min(su, sk)
    # the formula the kernel must implement: its own compile-time bounds, a seqused_k it reads
    # D4's bounds (D1-D3 kernels have no window seam: every key up to seqlen_k)
    want_left = left if getattr(kernel, "has_left", False) else None
    want_right = right if getattr(kernel, "has_right", False) else None
    want_used = used if kernel.uses_seqused_k else sk
    fails = []
    for m_blk in case["m_blocks"]:
        kept, span = kept_pairs(name, m_blk, sq, sk, su, left, right)
        want = visible_pairs(m_blk, kernel.pack_group, sq, want_used, want_left, want_right)
        fails += mismatches(m_blk, span, kept, want)
    return fails


class ForgetsGroup(FlashAttentionD4Sm100):
    """Wrong: the row's token taken as its packed row (no division by pack_group)."""

    def row_keys(self, span, m_blk, tTR_cS):
        return visible_keys(span, (m_blk * QK_TILE_M + tTR_cS[0][0]) * span.group)


class TopLeft(FlashAttentionD4Sm100):
    """Wrong: the window aligned with seqlen_q in place of seqlen_k (token' = token)."""

    def row_keys(self, span, m_blk, tTR_cS):
        top_left = copy.copy(span)
        top_left.seqlen_q = span.seqlen_k
        return visible_keys(top_left, m_blk * QK_TILE_M + tTR_cS[0][0])


class FirstVisitOnly(FlashAttentionD4Sm100):
    """Wrong: a window kernel that masks only the first visit (stage D1's rule)."""

    def masks_inner_tiles(self) -> bool:
        return False


D4_512 = {"kv_shared": True, "pack_group": 128, "seqused_k": True, "has_left": True, "has_right": True}
D4_128_BOTH = {"kv_shared": False, "has_left": True, "has_right": True}

#: name -> kernel (the stage's own class unless a negative control)
KERNELS = {
    "d1-hd128": lambda: make_kernel("d1", 128),
    "d2-hd512-g128": lambda: make_kernel("d2", 512, kv_shared=True, pack_group=128),
    "d3-hd512-g128": lambda: make_kernel("d3", 512, kv_shared=True, pack_group=128, seqused_k=True),
    "d4-hd512-g128": lambda: make_kernel("d4", 512, **D4_512),
    "d4-hd512-g1": lambda: make_kernel("d4", 512, kv_shared=True, has_left=True, has_right=True),
    "d4-hd256-g64": lambda: make_kernel("d4", 256, kv_shared=True, pack_group=64, has_left=True, has_right=True),
    "d4-hd128-right": lambda: make_kernel("d4", 128, kv_shared=False, has_right=True),
    "d4-hd128-both": lambda: make_kernel("d4", 128, **D4_128_BOTH),
    "wrong-forgets-group": lambda: make_kernel("d4", 512, cls=ForgetsGroup, **D4_512),
    "wrong-top-left": lambda: make_kernel("d4", 128, cls=TopLeft, **D4_128_BOTH),
    "wrong-first-visit-only": lambda: make_kernel("d4", 128, cls=FirstVisitOnly, **D4_128_BOTH),
}

CAUSAL_127 = (127, 0)
MASK_CASES = {  # name -> cases; m_blocks: the Q tiles replayed
    "d4-hd512-g128": [  # DeepSeek-V4's window branch: 128 heads of one token per tile, 64-key tiles
        dict(seqlen_q=2, seqlen_k=1000, seqused=700, window=CAUSAL_127, m_blocks=[0, 1]),
        dict(seqlen_q=5, seqlen_k=5, window=CAUSAL_127, m_blocks=[0, 2, 4]),
        dict(seqlen_q=300, seqlen_k=200, window=CAUSAL_127, m_blocks=[0, 99, 100, 150, 299]),  # tokens < 100 empty
        dict(seqlen_q=3, seqlen_k=40, seqused=17, window=(5, 3), m_blocks=[0, 1, 2]),
        dict(seqlen_q=2, seqlen_k=300, seqused=0, window=CAUSAL_127, m_blocks=[0, 1]),  # no key at all
        dict(seqlen_q=4, seqlen_k=300, window=(0, 0), m_blocks=[0, 3]),
    ],
    "d4-hd512-g1": [  # one token per row: windows cut tiles of 64 keys in the middle
        dict(seqlen_q=300, seqlen_k=300, window=(5, 3), m_blocks=[0, 1, 2]),
        dict(seqlen_q=200, seqlen_k=1000, window=CAUSAL_127, m_blocks=[0, 1]),
        dict(seqlen_q=300, seqlen_k=100, window=(20, 10), m_blocks=[0, 1, 2]),
    ],
    "d4-hd256-g64": [  # two tokens per tile
        dict(seqlen_q=4, seqlen_k=500, window=CAUSAL_127, m_blocks=[0, 1]),
        dict(seqlen_q=10, seqlen_k=10, window=(5, 3), m_blocks=[0, 2, 4]),
        dict(seqlen_q=10, seqlen_k=3, window=(1, 0), m_blocks=[0, 4]),
    ],
    "d4-hd128-right": [  # causal, no left bound: 128-key tiles, every key before the diagonal
        dict(seqlen_q=300, seqlen_k=1000, window=(None, 0), m_blocks=[0, 2]),
        dict(seqlen_q=1000, seqlen_k=300, window=(None, 0), m_blocks=[0, 5, 7]),  # tokens < 700 empty
        dict(seqlen_q=300, seqlen_k=300, window=(None, 3), m_blocks=[0, 1, 2]),
        dict(seqlen_q=1000, seqlen_k=300, window=(None, 2**31 - 1), m_blocks=[0, 5]),  # no sum may wrap
    ],
    "d4-hd128-both": [
        dict(seqlen_q=400, seqlen_k=400, window=(5, 3), m_blocks=[0, 1, 3]),
        dict(seqlen_q=200, seqlen_k=1000, window=CAUSAL_127, m_blocks=[0, 1]),
        dict(seqlen_q=50, seqlen_k=700, window=(300, 200), m_blocks=[0]),
        dict(seqlen_q=300, seqlen_k=1000, window=(2**31 - 1, 2**31 - 1), m_blocks=[0, 2]),
        dict(seqlen_q=1000, seqlen_k=300, window=(2**31 - 1, 0), m_blocks=[0, 7]),
    ],
    "d3-hd512-g128": [  # no window: the seqused_k tail only
        dict(seqlen_q=2, seqlen_k=1000, seqused=700, m_blocks=[0, 1]),
        dict(seqlen_q=2, seqlen_k=300, seqused=0, m_blocks=[0]),
        dict(seqlen_q=3, seqlen_k=256, seqused=256, m_blocks=[2]),
    ],
    "d2-hd512-g128": [dict(seqlen_q=2, seqlen_k=300, m_blocks=[0, 1])],  # every key; seqlen_k's tail
    "d1-hd128": [dict(seqlen_q=300, seqlen_k=300, m_blocks=[0, 2]), dict(seqlen_q=5, seqlen_k=256, m_blocks=[0])],
}


def _stage_mark(name):
    """stage_d3 for the D3 kernel; the D4 mask proof otherwise (D1 / D2's cases check that the
    generalized mask still hides only the seqlen_k tail)."""
    return pytest.mark.stage_d3 if name.startswith("d3") else pytest.mark.stage_d4


@pytest.mark.slow
@pytest.mark.parametrize("name,case", [
    pytest.param(n, c, id=f"{n}-{i}", marks=_stage_mark(n)) for n, cs in MASK_CASES.items() for i, c in enumerate(cs)
])  # fmt: skip
def test_masks_keep_exactly_the_visible_pairs(name, case):
    assert mask_failures(name, case) == []


@pytest.mark.stage_d4
@pytest.mark.slow
@pytest.mark.parametrize("name,case", [
    ("wrong-forgets-group", dict(seqlen_q=2, seqlen_k=1000, seqused=700, window=CAUSAL_127, m_blocks=[1])),
    ("wrong-top-left", dict(seqlen_q=200, seqlen_k=1000, window=CAUSAL_127, m_blocks=[0])),
    ("wrong-first-visit-only", dict(seqlen_q=400, seqlen_k=400, window=(5, 3), m_blocks=[1])),
])  # fmt: skip
def test_mask_checker_rejects_wrong_masks(name, case):
    assert mask_failures(name, case) != []


@pytest.mark.stage_d4
@pytest.mark.slow
def test_window_of_one_token_is_two_unmasked_tiles():
    """128 heads of one token, window (127, 0), 64-key tiles: the span is the token's 128 keys, two
    tiles from its first key, and no value is masked (the window is the span)."""
    kept, (origin, n_tiles) = kept_pairs("d4-hd512-g128", 1, 2, 1000, 700, 127, 0)
    assert (origin, n_tiles) == (700 - 2 + 1 - 127, 2)  # token 1 at 699: keys 572 .. 699
    assert len(kept) == 128 * 128  # every value of every visit kept


# ---------------------------------------------------------------------------------------
# 1b. the TMA warp's boxes start at the span's origin


class VOffsetOnHeadDim(FlashAttentionD4Sm100):
    """Wrong: V's origin put on its first mode, as if V were (seqlen_k, head_dim) like K."""

    def kv_tma_views(self, qk_mma, pv_mma, tma_atom_k, mK, tma_atom_v, mV, sK, sV, hk, b, origin):
        tKsK, tKgK, tVsV, _ = super().kv_tma_views(qk_mma, pv_mma, tma_atom_k, mK, tma_atom_v, mV, sK, sV, hk, b,
                                                   origin)
        gV = cute.local_tile(cute.domain_offset((origin, 0), mV[None, None, hk, b]),
                             (self.plan.d_block, self.plan.tile_n), (None, None))
        _, tVgV = cute.nvgpu.cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
            cute.group_modes(pv_mma.get_slice(0).partition_B(gV), 0, 3),
        )  # fmt: skip
        return tKsK, tKgK, tVsV, tVgV


def tma_box_starts(head_dim: int, origin: int, cls=FlashAttentionD4Sm100, tiles: int = 3, hk: int = 1, b: int = 1):
    """{('k', tile, kb) / ('v', tile, vb): the first coordinate of the box} through the kernel's
    ``kv_tma_views`` (K != V, so V has boxes of its own), on TMA atoms built as ``__call__`` builds
    them over a [batch, seqlen_k, kv_heads, head_dim] K and V. TMA coordinates run over the tensor's
    modes contiguous first: (column, key, kv head, batch)."""
    from cutlass.cute.nvgpu import cpasync, tcgen05

    from dsv4_attention.common.layout_proof import as_ints, trace
    from dsv4_attention.common.layouts import reorder
    from dsv4_attention.common.sm100_smem_p import make_pv_mma, make_qk_mma, make_smem_layouts
    from dsv4_attention.stages.d1_smem_p.sm100 import V_AS_PV_B

    kernel = make_kernel("d4", head_dim, cls=cls, kv_shared=False, has_left=True, has_right=True)
    plan = kernel.plan
    S, HK, B = 1000, 2, 2

    def body():
        qk, pv = make_qk_mma(BF16, plan), make_pv_mma(BF16, plan)
        _, k_ring, v_ring, _ = make_smem_layouts(BF16, plan, qk, pv)
        ptr = cute.make_ptr(BF16, 0, cute.AddressSpace.gmem, assumed_align=16)
        bshd = cute.make_tensor(ptr, cute.make_layout((B, S, HK, head_dim), stride=(S * HK * head_dim, HK * head_dim,
                                                                                    head_dim, 1)))
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(
            op, reorder(bshd, (1, 3, 2, 0)), cute.select(k_ring, mode=[0, 1, 2]),
            (QK_TILE_M, plan.tile_n, plan.d_block), qk)
        atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(
            op, reorder(bshd, V_AS_PV_B), cute.select(v_ring, mode=[0, 1, 2]),
            (QK_TILE_M, plan.d_block, plan.tile_n), pv)
        smem = cute.make_ptr(BF16, 1024, cute.AddressSpace.smem, assumed_align=1024)
        sK = cute.make_tensor(cute.recast_ptr(smem, k_ring.inner), k_ring.outer)
        sV = cute.make_tensor(cute.recast_ptr(smem, v_ring.inner), v_ring.outer)
        _, tKgK, _, tVgV = kernel.kv_tma_views(qk, pv, atom_k, tma_k, atom_v, tma_v, sK, sV, hk, b, origin)
        starts = {}
        for t in range(tiles):
            for kb in range(plan.blocks):
                starts[("k", t, kb)] = as_ints(tuple(tKgK[None, t, kb].iterator))
            for vb in range(plan.blocks):
                starts[("v", t, vb)] = as_ints(tuple(tVgV[None, vb, t].iterator))
        return starts

    got = trace(body)
    want = {(which, t, blk): (blk * plan.d_block, origin + t * plan.tile_n, hk, b) for which, t, blk in got}
    return got, want


@pytest.mark.stage_d4
@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("origin", [0, 37, 999])
def test_kv_boxes_start_at_the_span_origin(head_dim, origin):
    got, want = tma_box_starts(head_dim, origin)
    assert first_mismatches(want, got) == []


@pytest.mark.stage_d4
@pytest.mark.slow
def test_box_checker_rejects_v_offset_on_its_head_dim_mode():
    got, want = tma_box_starts(512, 37, cls=VOffsetOnHeadDim)
    assert first_mismatches(want, got) != []
    assert all(got[k] == want[k] for k in got if k[0] == "k")  # K's boxes are the kernel's


# ---------------------------------------------------------------------------------------
# 2. span arithmetic (pure Python)


def span_failures(sq, sk, left, right, group, tile_n, key_span=kv_span.key_span, needs=tile_needs_mask,
                  tile_m=QK_TILE_M, m_blocks=None) -> list[str]:
    """Every way the KV tiles of the Q tiles fail the kernels' contract: (a) they hold every key a real
    row sees, (b) no visited tile is invisible to every row (a span that sees nothing visits one
    tile), (c) a tile ``needs`` passes is wholly visible to every real row, (d) the softmax's per-row
    bounds are exactly the row's visible columns of each tile."""
    has_left, has_right = left is not None, right is not None
    rows = sq * group
    fails = []
    for m in range(-(-rows // tile_m)) if m_blocks is None else m_blocks:
        t_lo, t_hi = tile_tokens(m, tile_m, group, sq)
        origin, n_tiles = key_span(t_lo, t_hi, sq, sk, tile_n, left, right, has_left, has_right)
        span = KvSpan(m, rows, sk, tile_m, tile_n, group, left, right, has_left, has_right)
        first_rows = {t: max(t * group, m * tile_m) for t in range(t_lo, t_hi + 1)}  # one row per token
        seen = {t: {j for j in range(sk) if kv_span.visible(t, j, sq, sk, left, right)} for t in first_rows}
        every = set().union(*seen.values())
        lo_tile, hi_tile = origin, origin + n_tiles * tile_n
        if n_tiles < 1 or any(not lo_tile <= j < hi_tile for j in every):
            fails.append(f"m {m}: tiles [{lo_tile}, {hi_tile}) miss keys of {sorted(every)[:1]}..{sorted(every)[-1:]}")
        for n in range(n_tiles):
            a = origin + n * tile_n
            keys = set(range(a, a + tile_n))
            if not keys & every and (every or n_tiles > 1):
                fails.append(f"m {m}: tile {n} [{a}, {a + tile_n}) holds no visible key")
            if not needs(a, t_lo, t_hi, sq, sk, tile_n, left, right, has_left, has_right):
                if any(not keys <= s for s in seen.values()):
                    fails.append(f"m {m}: tile {n} [{a}, {a + tile_n}) passes tile_needs_mask, hides keys")
            for t, r in first_rows.items():
                lo, hi = visible_columns(visible_keys(span, r), a)
                cols = {c for c in range(tile_n) if (lo is None or c >= lo) and c < hi}
                if cols != {j - a for j in seen[t] & keys}:
                    fails.append(f"m {m}: tile {n}, token {t}: bounds ({lo}, {hi}) are not its visible columns")
                    break
    return fails


@pytest.mark.stage_d4
def test_spans_cover_the_visible_keys_and_masks_skip_only_whole_tiles():
    rnd = random.Random(2024)
    for _ in range(120):
        group = rnd.choice([1, 2, 8, 64, 128, 256])
        tile_n = rnd.choice([64, 128])
        sq = rnd.randint(1, max(1, 600 // group))
        sk = rnd.randint(1, 200)
        left = rnd.choice([None, 0, 5, 127, 1000, 2**31 - 1])
        right = rnd.choice([None, 0, 3, 1000, 2**31 - 1])
        tiles = -(-sq * group // QK_TILE_M)
        m_blocks = sorted({0, tiles - 1, rnd.randrange(tiles)})
        fails = span_failures(sq, sk, left, right, group, tile_n, m_blocks=m_blocks)
        assert fails == [], (sq, sk, left, right, group, tile_n, fails[:3])


@pytest.mark.stage_d4
def test_span_checker_rejects_tiles_of_group_one_tokens():
    """Negative control: a span computed as if every packed row were a token (no division by the group)."""

    def wrong_span(t_lo, t_hi, sq, sk, tile_n, left, right, has_left, has_right):
        t_lo, t_hi = tile_tokens(1, QK_TILE_M, 1, sq * 128)  # Q tile 1's packed rows as tokens
        return kv_span.key_span(t_lo, t_hi, sq * 128, sk, tile_n, left, right, has_left, has_right)

    assert span_failures(2, 1000, 127, 0, 128, 64, key_span=wrong_span, m_blocks=[1]) != []


@pytest.mark.stage_d4
def test_span_checker_rejects_a_tile_test_that_forgets_seqlen_k():
    def wrong_needs(a, t_lo, t_hi, sq, sk, tile_n, left, right, has_left, has_right):
        return tile_needs_mask(a, t_lo, t_hi, sq, sk, tile_n, left, right, has_left, has_right) & (a + tile_n <= sk)

    assert span_failures(3, 100, None, None, 1, 64, needs=wrong_needs) != []
    assert span_failures(3, 100, None, None, 1, 64) == []


# ---------------------------------------------------------------------------------------
# 3. seams


@pytest.mark.stage_d4
def test_seams_per_stage():
    d1, d2 = make_kernel("d1", 512, kv_shared=True), make_kernel("d2", 512, kv_shared=True, pack_group=128)
    d3 = make_kernel("d3", 512, kv_shared=True, pack_group=128, seqused_k=True)
    d4 = make_kernel("d4", 512, **D4_512)
    causal = make_kernel("d4", 128, has_right=True)
    for k in (d1, d2):  # every key visible: no empty row, only the first visit masked, no window seam
        assert not k.may_hide_rows() and not k.masks_inner_tiles() and not hasattr(k, "longest_first")
    assert d3.may_hide_rows() and not d3.masks_inner_tiles() and not hasattr(d3, "longest_first")
    assert d4.may_hide_rows() and d4.masks_inner_tiles() and not d4.longest_first
    assert causal.longest_first and causal.may_hide_rows()
    assert (d1.pack_group, d2.pack_group, d4.pack_group) == (1, 128, 128)


@pytest.mark.stage_d4
@pytest.mark.parametrize("longest_first", [False, True])
def test_both_o_halves_of_a_q_tile_get_one_tile(longest_first):
    """Head dim 512 (o_split 2): CTAs 2 m and 2 m + 1 are the two O halves of one Q tile, and every Q
    tile is some CTA pair's, in order or (causal) reversed."""
    k = make_kernel("d4", 512, **D4_512)
    k.longest_first = longest_first
    tiles = 7
    grid_x = tiles * k.plan.o_split
    got = [k.q_tile_of(bx, grid_x) for bx in range(grid_x)]
    assert k.plan.o_split == 2
    assert [h for _, h in got] == [0, 1] * tiles
    assert all(got[2 * i][0] == got[2 * i + 1][0] for i in range(tiles))
    order = [got[2 * i][0] for i in range(tiles)]
    assert order == (list(range(tiles))[::-1] if longest_first else list(range(tiles)))


# ---------------------------------------------------------------------------------------
# 4. compile budgets


COMPILE_CASES = [
    ("d3", 512, {"kv_shared": True, "pack_group": 128, "seqused_k": True}),
    ("d4", 512, {"kv_shared": True, "pack_group": 128, "seqused_k": True, "has_left": True, "has_right": True}),
    ("d4", 128, {"kv_shared": False, "has_right": True}),
    ("d4", 256, {"kv_shared": True, "pack_group": 64, "has_left": True, "has_right": True}),
]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("stage_id,head_dim,options", [
    pytest.param(s, d, o, id=f"{s}-hd{d}-{o}", marks=_stage_mark(s)) for s, d, o in COMPILE_CASES
])  # fmt: skip
def test_compiles_within_budget(stage_id, head_dim, options):
    from dsv4_attention.common.compile import assert_within_budget

    assert_within_budget(stage_id, "sm100", "bfloat16", head_dim, min_tmem_columns=128, options=options)
