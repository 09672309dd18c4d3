"""Stage E's seesaw for gathered tiles (index mode: D1's leader, follower and producer order,
over E's gathered tiles): the three roles, taken from the kernel's own methods, finish under
every interleaving, free each ring half only after the wgmma groups that read it and hand SMEM
over without a race (tests/seesaw_protocol.py says how)."""

import cutlass
import pytest
from plain_jit import plain
from seesaw_protocol import _Span, make_seesaw, plain_load_pairs, protocol_tests

from dsv4_attention.stages.e_fused.sm90 import EntrySources, FlashAttentionESm90

pytestmark = [pytest.mark.stage_e, pytest.mark.proof, pytest.mark.arch("sm90")]

test_every_interleaving_finishes_and_frees_only_read_halves, test_checker_rejects_an_early_release_and_a_missing_one = (
    protocol_tests(FlashAttentionESm90, kv_shared=True, pack_group=128, has_compressed=True, has_topk=True,
                   index_mode=True))


# ---- the gathering producer's four warps (CSA layers: window tiles by TMA, entries gathered) ----
# A window tile is one TMA issue, warp 0's; a gathered tile is every producer warp's (each copies
# rows and arrives on the chunk barriers). Each warp waits on the ring's empty barriers by parity:
# a wait for use t of a slot half passes once the phase of use t - slots' release has the other
# parity, so it passes wrongly when the barrier is still two phases behind (use t - 2 slots not yet
# released). A warp that waited for use t - slots of the same half cannot be that far behind: so
# each warp must wait for every use of each half in turn. Checked on the kernel's own
# ``load_pairs`` and ``load_kv`` for persistent CTAs whose Q tiles alternate window and gathered
# tiles; the negative control is the earlier ``load_kv``, whose warps 1-3 skipped the window's
# tiles (the persistent grid's launch failure on the H200, 2026-11-26).

# a persistent CTA's Q tiles: (window tiles, gathered tiles); the top-k kernel visits the window first
CSA_TILES = ([(2, 1), (3, 1), (2, 2)], [(3, 2), (1, 1), (3, 3)], [(2, 3)] * 3, [(1, 2), (3, 1)] * 2)


class _FusedSpan(_Span):
    """A fused span: D1's stand-in with its count of gathered (compressed) tiles first."""

    def __init__(self, n_cmp, n_tiles):
        super().__init__(n_tiles)
        self.n_cmp = n_cmp


class _WaitRecorder:
    def __init__(self, slots):
        self.slots, self.waits = slots, []

    def wait_load(self, t, half=None):
        self.waits.append((t, half))

    def load(self, t, atom, src, dst, n, half=None):  # the ring's TMA load waits for its slot half first
        self.wait_load(t, half)


def producer_waits(kernel, tiles, warp, monkeypatch, load_kv=None) -> list:
    """[(ring use, half), ...] producer warp ``warp`` waits for, in order, over ``tiles``."""
    k = kernel
    monkeypatch.setattr(cutlass, "range", lambda n, unroll=1: range(n))
    monkeypatch.setattr(k, "issue_q", lambda *a: None, raising=False)
    # a gathered half-load: its first step is the wait for the slot half (stages/e_fused/sm90.py)
    monkeypatch.setattr(k, "gather_tile", lambda ring, t, n, span, base, rows, half=None: ring.wait_load(t, half),
                        raising=False)
    load_kv = plain(type(k).load_kv) if load_kv is None else load_kv  # the kernel's own, as plain Python
    monkeypatch.setattr(k, "load_kv", lambda *a, **kw: load_kv(k, *a, **kw), raising=False)
    ring = _WaitRecorder(k.slots)
    load_pairs = plain_load_pairs(type(k), monkeypatch)
    t0 = 0
    for it, (window, gathered) in enumerate(tiles):
        n = window + gathered
        srcs = (_FusedSpan(gathered, n), None, None, None, EntrySources(None, None, None, None, warp))
        load_pairs(k, ring, n, srcs, None, warp, t0, it, None)
        t0 += n
    return ring.waits


def parity_lapping(waits, slots) -> str | None:
    """None if every wait for use t >= 2 slots of a half follows this warp's wait for use t - slots."""
    seen = set()
    for t, half in waits:
        if t >= 2 * slots and (t - slots, half) not in seen:
            return f"waits for use {t} half {half} without having waited for use {t - slots}"
        seen.add((t, half))
    return None


def skipping_load_kv(self, ring, t, n, span, tma_atom_k, tKgK, tKsK, sources, half=None):
    """The earlier load_kv: a TMA tile was warp 0's alone (warps 1-3 went on to the next gather)."""
    if n < span.n_cmp:
        self.gather_tile(ring, t, n, span, None, None, half)
    elif sources.warp_idx == 0:
        ring.load(t, None, None, None, n - span.n_cmp, half)


def make_csa():
    k = make_seesaw(FlashAttentionESm90, kv_shared=True, pack_group=128, has_left=True, has_right=True,
                    has_compressed=True, has_topk=True)
    assert k.producer_warps == 4
    return k


@pytest.mark.parametrize("tiles", CSA_TILES, ids=str)
def test_every_producer_warp_waits_for_every_use_of_a_half(tiles, monkeypatch):
    k = make_csa()
    uses = sum(w + g for w, g in tiles)
    for warp in range(k.producer_warps):
        waits = producer_waits(k, tiles, warp, monkeypatch)
        assert sorted(waits) == [(t, h) for t in range(uses) for h in (0, 1)]  # each half-use once
        assert parity_lapping(waits, k.slots) is None


def test_lapping_check_rejects_warps_that_skip_the_window(monkeypatch):
    """Negative control: with the window's TMA tiles left to warp 0, warps 1-3 lap a barrier
    (warp 0, which still waits for every use, passes)."""
    k = make_csa()
    waits = producer_waits(k, CSA_TILES[0], 1, monkeypatch, load_kv=skipping_load_kv)
    assert "without having waited" in parity_lapping(waits, k.slots)
    assert parity_lapping(producer_waits(k, CSA_TILES[0], 0, monkeypatch, load_kv=skipping_load_kv), k.slots) is None


# ---- the FP8 page gather's pipelined loads (stages/e_fused/sm90_pages.py, kv_pages) ------------
# Each half-load is two steps, issue (its slot wait) and land (its stores and full arrivals), the
# next half-load's issue before this one's land: the producer waits for a slot while a tile it
# has not yet handed over is still with it. The same search proves that this lookahead of one
# half-load never deadlocks (a Q tile of 1-7 KV tiles, persistent CTAs); its negative control
# holds a land back one more issue, past the wait for a slot that only its own data frees.

FP8 = {"kv_shared": True, "pack_group": 128, "has_sink": True, "has_compressed": True, "has_topk": True,
       "index_mode": True, "kv_pages": 256, "kv_pages_extra": 64}

test_fp8_gather_every_interleaving_finishes, test_fp8_gather_checker_rejects_an_early_release_and_a_missing_one = (
    protocol_tests(FlashAttentionESm90, **FP8))


def test_fp8_gather_lands_one_issue_behind_and_no_further(monkeypatch):
    from seesaw_protocol import check, trace

    k = make_seesaw(FlashAttentionESm90, **FP8)
    ops = trace(k, 4, monkeypatch)
    prod = [op for op in ops["producer"] if op[0] != "q"]
    # a0 b1 a1 b0 | a0' ..: each land right after the next half-load's issue
    assert prod[:6] == [("issue", 0, 0), ("issue", 1, 1), ("land", 0, 0), ("issue", 0, 1), ("land", 1, 1),
                        ("issue", 1, 0)]
    assert prod[-1] == ("land", 3, 0)
    assert check(k, ops) is None
    # negative control: tile 0's first half lands only after the next pair's a0 is issued (whose
    # slot half the leader frees after its PV over tile 0, which needs tile 0 landed)
    p = ops["producer"]
    land = p.index(("land", 0, 0))
    nxt = p.index(("issue", 2, 0))
    late = p[:land] + p[land + 1:nxt + 1] + [p[land]] + p[nxt + 1:]
    assert "deadlock" in check(k, {**ops, "producer": late})
