"""The seesaw's synchronisation checked over every interleaving (used by
tests/test_d1_seesaw_protocol.py and tests/test_e_seesaw_protocol.py): no deadlock, no slot
refilled while a wgmma still reads it, no handed-over SMEM read before its write or overwritten
before its read. Two thin files rather than one parametrized over both
kernels: a test file's imports are part of its stage's evidence scope (common/scope.py), and
importing E's kernel from a D1 test would tie D1's GPU evidence to E's file. Each file binds
``protocol_tests`` to its kernel.

The three roles' operation sequences are taken from the kernels' own methods, run as plain Python
with recording stand-ins for the ring, the handoffs and the wgmma calls (``seesaw_lead``,
``seesaw_follow``, ``load_pairs``; the consumer loop around them is the kernel's three lines):

    producer   load(t, half): wait until the slot half's previous use was released, issue (it lands
               later, at any time)
    warpgroup  QK over chunks of tile t (its issue waits until they landed), PV over its own
               half of a tile (an SS PV also reads an sP buffer), wait_group(n) (groups finish in
               order, at any time), release(t, half) (4 warp arrivals), handoff arrive /
               wait(round), and the SMEM handed over: write / read of a row-max slot, write of an
               sP buffer

A persistent CTA's sequence of Q tiles (``PERSISTENT``) is traced tile after tile with the ring
uses, handoff rounds and Q phases counted on, as ``run_tiles`` does, and adds Q and the epilogue
to the check: the producer's Q of tile i waits until both warpgroups of tile i - 1 freed sQ
(``release_q``, each after its last QK: ``q_empty``), the consumers wait for it, and no QK may
still read sQ when Q lands; each warpgroup's epilogue stages O in its own sP buffer after both
met at the row sums, which no PV may still read then, nor a round of P be left unread.

Every barrier is modelled as the hardware's parity wait: a wait for round r passes when the number
of completed phases has the other parity than r, and the check also asserts it is exactly r + 1
(a phase never lapped). A breadth-first search over all states of the three roles and the
asynchronous events (a load landing, a wgmma group finishing) then proves, for 1 to 7 KV tiles,
that every interleaving ends with all roles done, that each release comes after the wgmma
groups that read that half, and that each handed-over SMEM buffer (the two row-max slots, the two
sP buffers) is read exactly once per round, after that round's write and before the next (an SS
PV's read ends when its group finishes). Negative controls: a release moved before the wait for
the PV that reads the half (rejected as a read under refill), a release removed (a deadlock), a
handoff signalled before its write (a read before the write), a P_b write moved ahead of the
ring wait that orders it after the leader's PV over the previous P_b (an overwrite under read),
and P_b written after the handoff that announces it (a read before the write).
"""

from __future__ import annotations

import collections
import sys

import cutlass
import pytest
from plain_jit import plain

from dsv4_attention.common.kv_span import KvSpan

HANDOFFS = 8  # stand-ins handed to the kernel (it uses the first few; the checker counts those used)
WARPS = 4  # arrivals of one warpgroup's release (lane 0 of each warp, or every thread counted as its warp)


class _Recorder:
    """Stand-ins that write each synchronising call into ``ops``; everything else is a no-op."""

    def __init__(self, kernel, ops: list, k: int):
        self.kernel, self.ops, self.k = kernel, ops, k
        self.chunks = kernel.head_dim // 64
        self.r_chunk = kernel.o_col1 // 64
        self.slots = kernel.slots

    # the ring
    def gemm_qk(self, t, mma, acc, a, b, first_chunk=0, chunks=None, accumulate=False):
        n = self.chunks if chunks is None else chunks
        self.ops.append(("qk", t, self._halves(range(first_chunk, first_chunk + n))))

    def release(self, t, half=0):
        self.ops.append(("release", t, half))

    def wait_full(self, t, first, end):
        self.ops.append(("wait_full", t, self._halves(range(first, end))))

    def load(self, t, half):
        self.ops.append(("load", t, half))

    def _halves(self, chunks) -> tuple:
        return tuple(sorted({0 if c % self.chunks < self.r_chunk else 1 for c in chunks}))


class _Handoff:
    def __init__(self, ops, i):
        self.ops, self.i = ops, i

    def arrive(self):
        self.ops.append(("arrive", self.i))

    def wait(self, r):
        self.ops.append(("wait_h", self.i, r))


class _Span:
    """The producer's span: its tile count, visited in the kernel's own order (``KvSpan.visit_tile``,
    unsplit)."""
    n_end = None
    visit_tile = KvSpan.visit_tile

    def __init__(self, n_tiles):
        self.n_tiles = n_tiles


class _Anything:
    """ops.tOrV[...], acc tensors, the softmax: indexable, callable, attribute-bearing."""

    def __init__(self, tag=None):
        self.tag = tag

    def __getitem__(self, idx):
        return _Anything((self.tag, idx[-1] if isinstance(idx, tuple) else idx))

    def __setitem__(self, idx, value):  # a register tensor written (the FP8 gather's entries)
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name)

    def __call__(self, *args, **kwargs):
        return _Anything()


def plain_load_pairs(kernel_cls, monkeypatch):
    """``kernel_cls.load_pairs`` as plain Python; where it is a subclass's that hands over to its
    base's (stage E's, ``super()``), the base's is made plain Python too (for this test)."""
    for c in kernel_cls.__mro__[1:]:
        if "load_pairs" in vars(c):
            monkeypatch.setattr(c, "load_pairs", plain(vars(c)["load_pairs"]))
            break
    return plain(kernel_cls.load_pairs)


def trace(kernel, n_blocks, monkeypatch) -> dict:
    """{role: [op, ...]} of a persistent CTA's Q tiles with ``n_blocks`` KV tiles each (an int: one
    tile), from ``kernel``'s own methods."""
    tiles = [n_blocks] if isinstance(n_blocks, int) else list(n_blocks)
    kernel_cls = type(kernel)
    # the modules of the kernel's classes, whose globals (wgmma calls, register tensors) are stood in for
    modules = {sys.modules[c.__module__] for c in kernel_cls.__mro__ if c.__module__.startswith("dsv4_attention")}

    ops = {"producer": [], 0: [], 1: []}
    current = {"role": None, "k": 0, "t0": 0, "it": 0}

    def gemm(mma, acc, a, b, zero_init=False):  # a PV: reads the warpgroup's own half of its operand's tile
        wg = current["role"]
        slot = b.tag[1]  # the slot index of the V view, (ring use) % slots
        ta = current["t0"] + 2 * current["k"]  # the pair's a (b is ta + 1)
        t = ta + (slot - ta) % kernel.slots
        smem_p = isinstance(a, _Anything) and isinstance(a.tag, tuple) and a.tag[0] == "tOrP_smem"
        ops[wg].append(("pv", t, wg, ("p", a.tag[1]) if smem_p else None))  # an SS PV reads sP[buffer] too

    def record(*op):
        ops[current["role"]].append(op)

    class Warpgroup:
        @staticmethod
        def wait_group(n):
            ops[current["role"]].append(("wait_group", n))

        @staticmethod
        def fence():
            pass

        @staticmethod
        def commit_group():
            pass

    for mod in modules:
        for name in ("convert_p_packed", "scale_rows", "as_a_operand"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, lambda *a, **k: _Anything())
        if hasattr(mod, "store_p"):  # P -> sP[buffer] (its view's last index), fenced for the wgmma
            monkeypatch.setattr(mod, "store_p", lambda acc, r, dst: record("write", ("p", dst.tag[1])))
        monkeypatch.setattr(mod, "warpgroup", Warpgroup, raising=False)
        monkeypatch.setattr(mod, "cute", _Anything(), raising=False)  # register tensors (make_rmem_tensor)
        monkeypatch.setattr(mod, "gemm", gemm, raising=False)
    monkeypatch.setattr(cutlass, "range", lambda n, unroll=1: range(n))
    monkeypatch.setattr(cutlass, "range_constexpr", range)
    for mod in modules:
        if hasattr(mod, "load_q"):
            monkeypatch.setattr(mod, "load_q", lambda *a: None)

    k = kernel
    monkeypatch.setattr(k, "mask_s", lambda *a, **kw: _Anything(), raising=False)
    # the row-max slots in SMEM: warpgroup wg writes slot wg, the other reads it
    monkeypatch.setattr(k, "publish_max", lambda m, rows, stats, wg: record("write", ("m", wg)), raising=False)
    monkeypatch.setattr(k, "read_max", lambda rows, stats, wg: record("read", ("m", wg)) or _Anything(),
                        raising=False)
    # the kernel's own helpers that release (jit methods), run as plain Python too
    monkeypatch.setattr(k, "seesaw_release_b", lambda ring, t: plain(type(k).seesaw_release_b)(k, ring, t),
                        raising=False)
    # Q's TMA (the producer's issue_q: after both warpgroups' release_q of the previous tile)
    monkeypatch.setattr(k, "issue_q", lambda q_load, warp_idx, it, q_empty: ops["producer"].append(("q", it)),
                        raising=False)
    monkeypatch.setattr(k, "release_q", lambda q_empty: record("q_release", current["it"]), raising=False)
    rec = {role: _Recorder(k, ops[role], 0) for role in ops}

    # the producer (the kernel's load_pairs, its load_kv recording the half-loads), tile after tile;
    # the FP8 gather's pipelined loads (kv_pages) record their two steps
    monkeypatch.setattr(k, "load_kv", lambda ring, t, n, *srcs, half=None: ring.load(t, half), raising=False)
    load_pairs = plain_load_pairs(kernel_cls, monkeypatch)
    if getattr(k, "kv_pages", 0):
        monkeypatch.setattr(k, "load_pairs_fp8", lambda *a: plain(type(k).load_pairs_fp8)(k, *a), raising=False)
        monkeypatch.setattr(k, "pair_entries", lambda *a: None, raising=False)
        monkeypatch.setattr(k, "issue_fp8_half", lambda ring, t, n, span, e, i, src, half, sc: ring.ops.append(
            ("issue", t, half)), raising=False)
        monkeypatch.setattr(k, "convert_fp8_half", lambda ring, t, src, half, sc, newer: ring.ops.append(
            ("land", t, half)), raising=False)
    t0 = 0
    for it, n in enumerate(tiles):
        load_pairs(k, rec["producer"], n, (_Span(n),), (), 0, t0, it, None)
        t0 += n

    # the consumers: stage D1's consume_seesaw around seesaw_lead / seesaw_follow, tile after tile:
    # wait for Q, the pairs (whose last QKs free sQ: release_q), the leader's end, then the
    # epilogue (both warpgroups meet at the row sums' barrier; each stages O in its sP buffer)
    mmas = (_Anything(), _Anything(), _Anything())
    for wg, fn in ((0, kernel_cls.seesaw_lead), (1, kernel_cls.seesaw_follow)):
        current["role"] = wg
        handoffs = [_Handoff(ops[wg], i) for i in range(HANDOFFS)]
        t0 = r0 = 0
        for it, n in enumerate(tiles):
            # acc_s, acc_o, r_p, softmax, stat_rows, row_stats, span, then n_blocks and first_row
            rest = [_Anything() for _ in range(7)] + [n, _Anything()]
            current["t0"], current["it"] = t0, it
            ops[wg].append(("wait_q", it))
            for pair in range(n // 2 + n % 2):
                current["k"] = pair
                has_b = pair < n // 2
                plain(fn)(k, pair, has_b, mmas, rec[wg], handoffs, _Anything("ops"), *rest, (t0, r0))
            if wg == 0:
                plain(kernel_cls.seesaw_lead_end)(k, rec[0], n, t0)
            ops[wg].append(("epilogue", it))  # the row sums' barrier
            ops[wg].append(("o_stage", ("p", kernel.own_p_buffer(wg)), it))  # O through sP[wg], stores read
            t0 += n
            r0 += (n + 1) // 2
    return ops


def check(kernel, ops: dict, stats: dict | None = None) -> str | None:
    """None if every interleaving of ``ops`` ends with all roles done and every release follows
    the reads it frees; else what went wrong, in words."""
    slots = kernel.slots
    need = kernel.seesaw_halves()  # [slot parity][half]: warps that release a half
    roles = ("producer", 0, 1)
    n_handoffs = 1 + max(op[1] for role in roles for op in ops[role] if op[0] in ("arrive", "wait_h"))
    # Q: (tiles landed, warpgroup releases of sQ: two a tile); index of each consumer's epilogue
    epi_at = {wg: [i for i, op in enumerate(ops[wg]) if op[0] == "epilogue"] for wg in (0, 1)}
    start = ((0, 0, 0), (), (), frozenset(), ((), ()), (0,) * n_handoffs, (), (0, 0))
    # state: pcs, landed[(slot, half)] counts as a sorted tuple, empty arrivals likewise,
    # loads in flight, groups in flight per warpgroup (each: its ring reads, the sP buffer it reads
    # or None), handoff completions, and per SMEM handoff buffer (a row-max slot, an sP buffer)
    # (rounds written, rounds read): a round is read once, synchronously (read_max) or by an SS PV
    # when its group finishes

    def get(pairs, key):
        return dict(pairs).get(key, 0)

    def get_wr(pairs, key):
        return dict(pairs).get(key, (0, 0))

    def put(pairs, key, value):
        d = dict(pairs)
        d[key] = value
        return tuple(sorted(d.items()))

    seen, todo = {start}, collections.deque([start])
    while todo:
        pcs, landed, empty, flying, groups, hand, bufs, qs = todo.popleft()
        succ = []
        # asynchronous events: a load lands; the oldest group of a warpgroup finishes
        for t, h in flying:
            s = t % slots
            succ.append((pcs, put(landed, (s, h), get(landed, (s, h)) + 1), empty, flying - {(t, h)}, groups, hand,
                         bufs, qs))
        for wg in (0, 1):
            if groups[wg]:
                g = list(groups)
                g[wg] = groups[wg][1:]
                buf = groups[wg][0][1]
                done_bufs = bufs if buf is None else put(bufs, buf, (get_wr(bufs, buf)[0], get_wr(bufs, buf)[1] + 1))
                succ.append((pcs, landed, empty, flying, tuple(g), hand, done_bufs, qs))
        for i, role in enumerate(roles):
            if pcs[i] == len(ops[role]):
                continue
            op = ops[role][pcs[i]]
            nxt = list(pcs)
            nxt[i] += 1
            nxt = tuple(nxt)
            kind = op[0]
            if kind in ("load", "issue"):  # "issue": the FP8 gather's step one, landing at its "land"
                t, h = op[1], op[2]
                s, use = t % slots, t // slots
                phases = get(empty, (s, h)) // need[s % 2][h]
                if phases % 2 != (use ^ 1) % 2 or use == 0:
                    if use > 0 and phases != use:
                        return f"load of tile {t} half {h}: empty barrier lapped ({phases} phases, use {use})"
                    for wg in (0, 1):
                        for reads, _, _ in groups[wg]:
                            if any(r[0] % slots == s and r[0] < t and r[1] == h for r in reads):
                                return f"load of tile {t} half {h} while warpgroup {wg} still reads it"
                    succ.append((nxt, landed, empty, flying | {(t, h)} if kind == "load" else flying, groups, hand,
                                 bufs, qs))
            elif kind == "land":  # the FP8 gather's step two: its stores and full arrivals, in program order
                s = op[1] % slots
                succ.append((nxt, put(landed, (s, op[2]), get(landed, (s, op[2])) + 1), empty, flying, groups, hand,
                             bufs, qs))
            elif kind in ("qk", "wait_full"):
                t, halves = op[1], op[2]
                s, use = t % slots, t // slots
                ok = all(get(landed, (s, h)) % 2 != use % 2 for h in halves)
                if ok:
                    if any(get(landed, (s, h)) != use + 1 for h in halves):
                        return f"{kind} of tile {t}: full barrier lapped"
                    g = list(groups)
                    if kind == "qk":  # a QK group reads sQ as well
                        g[role] = groups[role] + ((tuple((t, h) for h in halves), None, True),)
                    succ.append((nxt, landed, empty, flying, tuple(g), hand, bufs, qs))
            elif kind == "pv":
                buf = op[3]
                if buf is not None and get_wr(bufs, buf)[0] != get_wr(bufs, buf)[1] + 1:
                    return f"warpgroup {role}'s PV reads {buf} before its round is written ({get_wr(bufs, buf)})"
                g = list(groups)
                g[role] = groups[role] + ((((op[1], op[2]),), buf, False),)
                succ.append((nxt, landed, empty, flying, tuple(g), hand, bufs, qs))
            elif kind == "wait_group":
                if len(groups[role]) <= op[1]:
                    succ.append((nxt, landed, empty, flying, groups, hand, bufs, qs))
            elif kind == "release":
                t, h = op[1], op[2]
                if any((t, h) in reads for reads, _, _ in groups[role]):
                    return f"warpgroup {role} releases tile {t} half {h} while its wgmma still reads it"
                s = t % slots
                succ.append((nxt, landed, put(empty, (s, h), get(empty, (s, h)) + WARPS), flying, groups, hand, bufs,
                             qs))
            elif kind == "write":
                written, read = get_wr(bufs, op[1])
                if read < written:
                    return f"warpgroup {role} overwrites {op[1]} before its round {written - 1} was read"
                succ.append((nxt, landed, empty, flying, groups, hand, put(bufs, op[1], (written + 1, read)), qs))
            elif kind == "read":
                written, read = get_wr(bufs, op[1])
                if written != read + 1:
                    return f"warpgroup {role} reads {op[1]} before its round is written ({written}, {read} read)"
                succ.append((nxt, landed, empty, flying, groups, hand, put(bufs, op[1], (written, read + 1)), qs))
            elif kind == "arrive":
                hd = list(hand)
                hd[op[1]] += 1
                succ.append((nxt, landed, empty, flying, groups, tuple(hd), bufs, qs))
            elif kind == "wait_h":
                i_h, r = op[1], op[2]
                if hand[i_h] % 2 != r % 2:
                    if hand[i_h] != r + 1:
                        return f"handoff {i_h} round {r}: lapped ({hand[i_h]} rounds)"
                    succ.append((nxt, landed, empty, flying, groups, hand, bufs, qs))
            elif kind == "q":  # the producer's Q TMA (lands at once: the consumers' wait is the check)
                it, freed = op[1], qs[1] // 2  # q_empty's phases: both warpgroups' releases
                if it == 0 or freed % 2 != (it - 1) % 2:
                    if it > 0 and freed != it:
                        return f"Q of tile {it}: q_empty lapped ({freed} tiles freed)"
                    if any(q for wg in (0, 1) for _, _, q in groups[wg]):
                        return f"Q of tile {it} loaded while a QK still reads sQ"
                    succ.append((nxt, landed, empty, flying, groups, hand, bufs, (qs[0] + 1, qs[1])))
            elif kind == "wait_q":
                it = op[1]
                if qs[0] % 2 != it % 2:
                    if qs[0] != it + 1:
                        return f"Q of tile {it}: q_bar lapped ({qs[0]} landed)"
                    succ.append((nxt, landed, empty, flying, groups, hand, bufs, qs))
            elif kind == "q_release":  # release_q: one of q_empty's two arrivals of the tile
                succ.append((nxt, landed, empty, flying, groups, hand, bufs, (qs[0], qs[1] + 1)))
            elif kind == "epilogue":  # both warpgroups meet (the row sums)
                it, other = op[1], 1 - role
                if pcs[1 + other] >= epi_at[other][it]:
                    succ.append((nxt, landed, empty, flying, groups, hand, bufs, qs))
            elif kind == "o_stage":  # O written into the warpgroup's sP buffer; its stores read it at once
                buf, it = op[1], op[2]
                for wg in (0, 1):
                    if any(b == buf for _, b, _ in groups[wg]):
                        return f"O of tile {it} staged in {buf} while warpgroup {wg}'s PV still reads it"
                written, read = get_wr(bufs, buf)
                if read < written:
                    return f"O of tile {it} staged in {buf} before its round {written - 1} of P was read"
                succ.append((nxt, landed, empty, flying, groups, hand, bufs, qs))
        done = all(pcs[i] == len(ops[r]) for i, r in enumerate(roles)) and not flying and not any(groups)
        if done and any(w != r for _, (w, r) in bufs):
            return f"a handoff buffer written but never read: {bufs}"
        if not succ and not done:
            at = {r: ops[r][pcs[i]] if pcs[i] < len(ops[r]) else "done" for i, r in enumerate(roles)}
            return f"deadlock: {at}"
        for n in succ:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    if stats is not None:
        stats["states"] = len(seen)
    return None


def check_every_interleaving(kernel, n_blocks, monkeypatch) -> None:
    """``n_blocks``: one tile's KV tile count, or a persistent CTA's tiles' counts."""
    tiles = [n_blocks] if isinstance(n_blocks, int) else list(n_blocks)
    ops = trace(kernel, tiles, monkeypatch)
    loads = sorted(op[1:] for op in ops["producer"] if op[0] in ("load", "issue"))
    assert loads == [(t, h) for t in range(sum(tiles)) for h in (0, 1)]
    lands = [op[1:] for op in ops["producer"] if op[0] == "land"]  # the FP8 gather: each issue lands once
    assert sorted(lands) == (loads if lands else [])
    assert [op for op in ops["producer"] if op[0] == "q"] == [("q", it) for it in range(len(tiles))]
    for wg in (0, 1):  # each warpgroup frees sQ once a tile
        assert [op for op in ops[wg] if op[0] == "q_release"] == [("q_release", it) for it in range(len(tiles))]
    stats = {}
    assert check(kernel, ops, stats) is None
    assert stats["states"] > 40 * sum(tiles)  # the search did explore the interleavings


def check_controls(kernel, monkeypatch) -> None:
    """Negative controls: the follower frees a's second half before waiting for its PV over it
    (a read under refill), the leader never frees b's first half of the first pair (the
    producer's fourth load of the second pair waits forever), and two on the SMEM handed over
    (below)."""
    ops = trace(kernel, 4, monkeypatch)
    follower = ops[1]
    last = max(i for i, op in enumerate(follower) if op[0] == "release")
    assert follower[last - 1] == ("wait_group", 0)
    early = follower[:last - 1] + [follower[last], follower[last - 1]] + follower[last + 1:]
    assert "still reads" in check(kernel, {**ops, 1: early})
    leader = ops[0]
    first_b = next(i for i, op in enumerate(leader) if op == ("release", 1, 0))
    assert "deadlock" in check(kernel, {**ops, 0: leader[:first_b] + leader[first_b + 1:]})
    # the SMEM handed over: the follower signals its max before writing it (read before written),
    # and writes P_b of pair 1 as soon as pair 0 is done, before its QK over tile 3 (whose load
    # waits for the leader's PV over P_b of pair 0, as does handoff 0 of pair 1): overwritten
    # while being read
    i_max = follower.index(("write", ("m", 1)))
    i_arrive = follower.index(("arrive", 1), i_max)
    early_max = follower[:i_max] + [("arrive", 1)] + follower[i_max:i_arrive] + follower[i_arrive + 1:]
    assert "before its round is written" in check(kernel, {**ops, 1: early_max})
    qk_3 = next(i for i, op in enumerate(follower) if op[:2] == ("qk", 3))
    write_p = next(i for i in range(qk_3, len(follower)) if follower[i] == ("write", ("p", 1)))
    early_p = follower[:qk_3] + [follower[write_p]] + follower[qk_3:write_p] + follower[write_p + 1:]
    assert "overwrites ('p', 1)" in check(kernel, {**ops, 1: early_p})
    # P_b announced before it is written: the follower's write of sP[1] moved past the handoff
    # that announces it (1, with its max): the leader's SS PV reads it first
    announce = ("arrive", 1)
    i_p = follower.index(("write", ("p", 1)))
    i_announce = follower.index(announce, i_p)
    late_p = follower[:i_p] + follower[i_p + 1:i_announce + 1] + [follower[i_p]] + follower[i_announce + 1:]
    assert "reads ('p', 1) before its round is written" in check(kernel, {**ops, 1: late_p})


PERSISTENT = ([1, 1], [2, 1], [1, 2], [3, 2], [2, 3], [1, 1, 1], [3, 3])  # a persistent CTA's tiles' KV tile counts


def check_persistent_controls(kernel, monkeypatch) -> None:
    """Negative controls of the persistent protocol (tiles of 2 then 3 KV tiles): without the
    follower's release of a's first half (a half it never reads), or without the leader's release
    of the last b's first half at the end of a tile, the next tile's loads wait forever; with the
    leader's release of sQ before the wait for its last QK, the next Q can land under that QK;
    without the row sums' meeting, the leader stages O in sP[0] while the follower's PV reads P_a
    there."""
    ops = trace(kernel, [2, 3], monkeypatch)
    follower, leader = ops[1], ops[0]
    at = follower.index(("wait_q", 0))
    assert follower[at + 1] == ("release", 0, 0)  # the follower frees a's first half as its pair starts
    # that line taken out of the kernel: every pair's (tiles a are ring uses 0, 2 and 4). One use's
    # missing arrivals alone would be made up by the next use's early ones
    without = [op for op in follower if op not in {("release", t, 0) for t in (0, 2, 4)}]
    assert "deadlock" in check(kernel, {**ops, 1: without})
    end = leader.index(("epilogue", 0))
    assert leader[end - 1] == ("release", 1, 0)  # seesaw_lead_end: the last b's first half
    assert "deadlock" in check(kernel, {**ops, 0: leader[:end - 1] + leader[end:]})
    rel = leader.index(("q_release", 0))
    assert leader[rel - 1] == ("wait_group", 0) and leader[rel - 2][0] == "qk"  # right after its last QK's wait
    early = leader[:rel - 1] + [leader[rel], leader[rel - 1]] + leader[rel + 1:]
    assert "Q of tile 1 loaded while a QK still reads sQ" in check(kernel, {**ops, 0: early})
    # (the search meets the follower's P_a round still unread, or its PV reading it)
    assert "O of tile 0 staged in ('p', 0)" in check(kernel, {**ops, 0: leader[:end] + leader[end + 1:]})


def make_seesaw(kernel_cls, **options):
    """``kernel_cls``'s sm90 seesaw kernel object at head dim 512, bf16, ``options`` (K = V among them)."""
    from dsv4_attention.common.arch import target_arch

    with target_arch("sm90"):
        k = kernel_cls(cutlass.BFloat16, 512, **options)
    assert k.seesaw
    return k


def protocol_tests(kernel_cls, **options):
    """The two tests of one seesaw kernel (hd 512, bf16, ``options``), for a stage's test file to
    bind at module level under its own marks: every interleaving for one Q tile of 1-7 KV tiles and
    for persistent CTAs' sequences of Q tiles, and the negative controls."""

    def make():
        return make_seesaw(kernel_cls, **options)

    @pytest.mark.parametrize("n_blocks", [*range(1, 8), *PERSISTENT], ids=str)
    def every_interleaving(n_blocks, monkeypatch):
        check_every_interleaving(make(), n_blocks, monkeypatch)

    def controls(monkeypatch):
        check_controls(make(), monkeypatch)
        check_persistent_controls(make(), monkeypatch)

    return every_interleaving, controls

