"""Stage D4 on SM90, on the host (CPU, no GPU): the causal and window masks, run.

The consumer warpgroups' masking of one Q tile is replayed with the kernel's own code
(``tests/sm90_mask_replay.py``: the D4 kernel's ``kv_span``, ``make_mmas``, ``s_coords`` and
``mask_s``), compiled for sm_90a and run on the CPU for every consumer thread and every visit.
Tile n of a visit holds keys origin + n T .. origin + n T + T - 1 (what the producer's TMA box
loads there: the span is cut from its first key). For the three consumer layouts (rows, one
token a row; the lock-step split at hd 512, K != V, 8 heads a token; the seesaw at hd 512, K = V,
DeepSeek-V4's 128 heads a token), the compile-time bounds (none, right only, left only, both)
with several runtime windows, and problems with seqlen_q <, =, > seqlen_k and lengths that are
not tile multiples, the kept (row, key) pairs of the real rows must be exactly the plain
formula's (``kv_span.visible``, bottom-right aligned), each kept once.
Negative controls the same checker rejects: a kernel that masks only the first tile it visits
(a left window's edge then leaks into the later tiles), and a span aligned top-left (i' = i: it
visits the wrong keys whenever seqlen_q != seqlen_k).
"""

from __future__ import annotations

import functools

import cutlass.cute as cute
import pytest
import seam_calls
import torch
from cutlass import Int32
from sm90_mask_replay import (
    MAX_VISITS,
    compile_replay,
    kept_keys,
    mask_replayer,
    masking_first_tile_only,
    pair_mismatch,
)

from dsv4_attention.common import kv_span

pytestmark = [pytest.mark.arch("sm90"), pytest.mark.stage_d4, pytest.mark.proof]

KERNELS = {  # name: (head_dim, options); the layout each must have is asserted in ``runner``
    "rows-g1": (128, {"pack_group": 1, "kv_shared": False}),
    "split-g8": (512, {"pack_group": 8, "kv_shared": False}),
    "seesaw-g128": (512, {"pack_group": 128, "kv_shared": True}),
}
LAYOUT = {"rows-g1": (False, False), "split-g8": (True, False), "seesaw-g128": (True, True)}  # (split, seesaw)

# (has_left, has_right) -> runtime (left, right) windows; None where the bound is absent. A bound of
# 2**31 - 1 (the largest the calls accept: "wider than any sequence") must not wrap a position sum
# (common/kv_span.py's module doc; the code before 2026-11-27 lost keys to it)
HUGE = 2**31 - 1
WINDOWS = {
    (False, False): [(None, None)],
    (False, True): [(None, 0), (None, 3), (None, HUGE)],  # causal, causal shifted right, unbounded
    (True, False): [(7, None), (127, None), (HUGE, None)],
    (True, True): [(127, 0), (5, 3), (0, 0), (HUGE, HUGE), (HUGE, 0)],
}
BOUNDS = {"rows-g1": list(WINDOWS), "split-g8": [(False, True), (True, True)],
          "seesaw-g128": [(False, True), (True, True)]}

PROBLEMS = [(300, 300), (40, 700), (700, 200), (129, 1000), (5, 9), (64, 65)]  # (seqlen_q, seqlen_k)


class TopLeftSpan(kv_span.KvSpan):
    """Wrong on purpose: query token i sits at key position i (top-left), not i + seqlen_k - seqlen_q.
    Its masks are the kernel's (bottom-right); only the keys it visits move."""

    def token_position(self, token):
        return token


def kernel_class(wrong: str | None):
    from dsv4_attention.stages.d4_causal_window.sm90 import FlashAttentionD4Sm90

    if wrong is None:
        return FlashAttentionD4Sm90
    if wrong == "first_only":
        return masking_first_tile_only(FlashAttentionD4Sm90)
    if wrong == "top_left":
        class TopLeft(FlashAttentionD4Sm90):
            def kv_span(self, m_block, rows, seqlen_k, window, entries):
                return TopLeftSpan(m_block, rows, seqlen_k, self.tile_m, self.tile_n, self.pack_group, window.left,
                                   window.right, self.has_left, self.has_right)
        return TopLeft
    raise ValueError(wrong)


@functools.cache
def runner(name: str, has_left: bool, has_right: bool, wrong: str | None = None):
    from dsv4_attention.common import jit

    head_dim, options = KERNELS[name]
    kernel = kernel_class(wrong)(jit.cutlass_dtype(torch.bfloat16), head_dim, has_left=has_left,
                                 has_right=has_right, **options)
    assert (kernel.col_split, kernel.seesaw) == LAYOUT[name], f"{name} is not the layout it is named for"
    replay = mask_replayer(kernel)

    @cute.jit
    def host(out: cute.Tensor, coords: cute.Tensor, info: cute.Tensor, m_block: Int32, rows: Int32,
             seqlen_k: Int32, left: Int32, right: Int32):
        qk_mma, _ = kernel.make_mmas()
        span = seam_calls.span(kernel, m_block, rows, seqlen_k, left, right)
        info[0] = span.origin
        info[1] = span.n_tiles
        replay(qk_mma, span, m_block * kernel.tile_m, out, coords)

    fn, bufs = compile_replay(host, kernel, 2, 5)
    return kernel, fn, bufs


def kept_pairs(name, bounds, wrong, m_block, seqlen_q, seqlen_k, left, right):
    """({(packed row, key): times kept} over the real rows of Q tile m_block, the kernel)."""
    from cutlass.cute.runtime import from_dlpack

    kernel, fn, bufs = runner(name, *bounds, wrong)
    out, coords, info = (b.zero_() for b in bufs)
    g, tile_n = kernel.pack_group, kernel.tile_n
    fn(*[from_dlpack(b) for b in (out, coords, info)],
       *[Int32(x) for x in (m_block, seqlen_q * g, seqlen_k, left or 0, right or 0)])
    origin, n_tiles = info.tolist()
    assert 1 <= n_tiles <= MAX_VISITS, (origin, n_tiles)

    def key_of(n, row, col):  # tile n holds keys origin + n T ..
        packed = m_block * kernel.tile_m + row
        return (packed, origin + n * tile_n + col) if packed // g < seqlen_q else None

    return kept_keys(out, coords, n_tiles, key_of), kernel


def visible(kernel, m_block, seqlen_q, seqlen_k, left, right) -> set:
    pairs = set()
    for r in range(m_block * kernel.tile_m, (m_block + 1) * kernel.tile_m):
        token = r // kernel.pack_group
        if token < seqlen_q:
            pairs |= {(r, j) for j in range(seqlen_k) if kv_span.visible(token, j, seqlen_q, seqlen_k, left, right)}
    return pairs


def failures(name, bounds, wrong=None, problems=PROBLEMS) -> list:
    bad = []
    g = KERNELS[name][1]["pack_group"]
    kernel = runner(name, *bounds, wrong)[0]
    for sq, sk in problems:
        tiles = -(-sq * g // kernel.tile_m)
        for left, right in WINDOWS[bounds]:
            for m in sorted({0, 1, tiles // 2, tiles - 1} & set(range(tiles))):
                kept, kernel = kept_pairs(name, bounds, wrong, m, sq, sk, left, right)
                want = visible(kernel, m, sq, sk, left, right)
                wrong_pairs = pair_mismatch(kept, want)
                if wrong_pairs:
                    bad.append(f"{name} bounds{bounds} sq{sq} sk{sk} window({left},{right}) m{m}: {wrong_pairs}")
    return bad


@pytest.mark.parametrize("name, bounds", [(n, b) for n in KERNELS for b in BOUNDS[n]],
                         ids=lambda x: x if isinstance(x, str) else f"left{int(x[0])}-right{int(x[1])}")
def test_kept_pairs_are_the_window(name, bounds):
    assert failures(name, bounds) == []


def test_checker_rejects_a_kernel_that_masks_only_the_first_tile():
    # a (5, 3) window on 64-128 rows spans 2-3 tiles: the earliest tiles straddle the left edge
    assert failures("rows-g1", (True, True), "first_only")


def test_checker_rejects_a_span_aligned_top_left():
    bad = failures("rows-g1", (False, True), "top_left")
    assert bad and not any(f" sq{sq} sk{sq} " in b for b in bad for sq, _ in PROBLEMS)  # only where sq != sk
