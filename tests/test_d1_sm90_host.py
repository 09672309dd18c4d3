"""Host proofs (CPU, no GPU) for stage D1's SM90 kernel: P through SMEM, split warpgroups.

The PV wgmma reads sP through a K-major, 128B-swizzle SMEM descriptor. The PTX ISA defines
what such a descriptor reads (the canonical K-major SWIZZLE_128B layout, 16-bit elements):

    byte(m, k) = swz(base + (k // 64) * 128 * rows + (m // 8) * 1024 + (m % 8) * 128 + (k % 64) * 2)
    swz(a)     = a ^ ((a >> 3) & 0x70)           (bits 7-9 of the byte address into bits 4-6)

with 8-row core groups 1024 bytes apart (the descriptor's stride byte offset) and the next
64 keys one (rows x 128 B) block further (the kernel's k-steps advance the start address).
``reader`` below is that formula, written from the ISA and nothing else. Proven, per
configuration the kernel runs P through SMEM (split at head dims 320..512, rows with
p_in_smem at 64..256), with the kernel's own builders (``p_smem_layout``, ``make_mmas``,
``p_store_view``):

1. For every consumer thread and every P register, the byte the store writes is
   reader(row, key) of the (row, key) that register holds (the QK accumulator's coordinate);
   every byte of a buffer is written exactly once, by exactly the warpgroup(s) that own it.
2. The sP layout itself is ``reader`` on every (m, k, buffer).
3. Bank conflicts, counted: each warp store instruction (fixed register pair) takes the
   minimal number of 128-byte wavefronts (``common.layout_proof.smem_wavefronts``).
4. Negative controls the same checker rejects: the swizzle applied to element offsets
   (the origin's class of bug), the split warpgroups' key offset dropped (two warpgroups
   writing the same keys), and the swizzle dropped (correct addresses, 8-way conflicts).
5. The split views: warpgroup w's K rows are keys [32 w, 32 w + 32) of the slot, its V
   columns [c_w, c_w + width) cover head_dim with 64-aligned starts, width <= 256.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest

from dsv4_attention.common.compile import SMEM_LIMIT
from dsv4_attention.common.layout_proof import (
    as_ints,
    min_smem_wavefronts,
    offset_of,
    smem_wavefronts,
    swizzle_bytes,
    trace,
)
from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP
from dsv4_attention.stages.d1_smem_p.sm90 import SUPPORTED_HEAD_DIMS, FlashAttentionD1Sm90, split_columns

pytestmark = [pytest.mark.stage_d1, pytest.mark.proof, pytest.mark.arch("sm90")]

SPLIT = [d for d in SUPPORTED_HEAD_DIMS if d >= 320]
#: the seesaw's head dims: split, with O halves of whole 64-column chunks
SEESAW = [d for d in SPLIT if d % 128 == 0]
ROWS = [d for d in SUPPORTED_HEAD_DIMS if d < 320]


def kernel_for(head_dim: int, kv_shared: bool = True) -> FlashAttentionD1Sm90:
    """K = V: the seesaw at split head dims; K != V there: the lock-step split."""
    return FlashAttentionD1Sm90(cutlass.BFloat16, head_dim, kv_shared=kv_shared, p_in_smem=True)


def reader(m: int, k: int, buf: int, rows: int, keys: int) -> int:
    """The byte the SS wgmma reads for P(m, k) of buffer ``buf`` (PTX ISA canonical layout)."""
    a = buf * rows * keys * 2 + (k // 64) * 128 * rows + (m // 8) * 1024 + (m % 8) * 128 + (k % 64) * 2
    return a ^ ((a >> 3) & 0x70)


def writes(head_dim: int, wrong: str | None = None, kv_shared: bool = True) -> dict:
    """Per consumer thread: [(row, key, buf, byte)] of every P value it stores, in register order,
    through the kernel's own sP layout and store partition. ``wrong`` builds a known-bad variant."""
    k = kernel_for(head_dim, kv_shared)

    def body():
        qk_mma, _ = k.make_mmas()
        lay = k.p_smem_layout()
        shape, stride = as_ints(lay.outer.shape), as_ints(lay.outer.stride)
        sw = lay.inner
        coords = cute.make_identity_tensor((k.tile_m, k.tile_n, k.p_buffers))
        out = {}
        for tidx in range(k.consumer_threads):
            wg = tidx // THREADS_PER_WARPGROUP
            if wrong == "no_key_offset":
                wg = 0
            thr = qk_mma.get_slice(tidx % THREADS_PER_WARPGROUP if k.col_split else tidx)
            part = k.p_store_view(coords, wg, thr)
            vals = []
            # the seesaw: warpgroup w stores its whole S tile's P into its own buffer
            for buf in ([k.own_p_buffer(wg)] if k.seesaw else range(k.p_buffers)):
                view = part[None, None, None, buf]
                for i in range(cute.size(view)):
                    c = as_ints(view[i])
                    vals.append((c[0], c[1], c[2], offset_of(shape, stride, c)))
            out[tidx] = vals
        return out, str(sw)

    per_thread, swz = trace(body, arch="sm90")
    assert swz == "S<3,4,3>", swz
    out = {}
    for t, vals in per_thread.items():
        rows = []
        for m, key, buf, off in vals:
            if wrong == "element_swizzle":
                byte = 2 * swizzle_bytes(off, 3, 4, 3)
            elif wrong == "no_swizzle":
                byte = 2 * off
            else:
                byte = swizzle_bytes(2 * off, 3, 4, 3)
            rows.append((m, key, buf, byte))
        out[int(t)] = rows
    return out


def smem_p_failures(head_dim: int, wrong: str | None = None, kv_shared: bool = True) -> list:
    k = kernel_for(head_dim, kv_shared)
    w = writes(head_dim, wrong, kv_shared)
    bad = []
    seen: dict[int, tuple] = {}
    for t, vals in w.items():
        for m, key, buf, byte in vals:
            if byte != reader(m, key, buf, k.tile_m, k.tile_n):
                bad.append(("address", t, (m, key, buf), byte, reader(m, key, buf, k.tile_m, k.tile_n)))
            for b in (byte, byte + 1):
                if b in seen:
                    bad.append(("written twice", b, seen[b], (t, m, key)))
                seen[b] = (t, m, key)
            if len(bad) > 5:
                return bad
    want = set(range(k.tile_m * k.tile_n * 2 * k.p_buffers))
    if set(seen) != want:
        bad.append(("bytes not written", len(want - set(seen))))
    # wavefronts: one warp instruction stores the 32-bit pair (registers 2i, 2i + 1) of every lane
    for warp in range(k.consumer_threads // 32):
        lanes = [w[warp * 32 + lane] for lane in range(32)]
        for i in range(0, len(lanes[0]), 2):
            addrs = [lane_vals[i][3] for lane_vals in lanes]
            if any(lane_vals[i + 1][3] != lane_vals[i][3] + 2 for lane_vals in lanes):
                bad.append(("pair not one 32-bit word", warp, i))
                return bad
            wf = smem_wavefronts(addrs, 4)
            if wf != min_smem_wavefronts(32, 4):
                bad.append(("bank conflict", warp, i, wf))
                return bad
    return bad


# K = V at every head dim (the seesaw from 320 on), and the lock-step split of K != V
STAGING = [(d, True) for d in SUPPORTED_HEAD_DIMS] + [(d, False) for d in SPLIT]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,kv_shared", STAGING)
def test_p_store_lands_where_the_wgmma_reads(head_dim, kv_shared):
    assert not smem_p_failures(head_dim, kv_shared=kv_shared)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_p_layout_is_the_canonical_sw128_layout(head_dim):
    k = kernel_for(head_dim)

    def body():
        lay = k.p_smem_layout()
        return as_ints(lay.outer.shape), as_ints(lay.outer.stride), str(lay.inner)

    shape, stride, swz = trace(body, arch="sm90")
    assert swz == "S<3,4,3>"
    for buf in range(k.p_buffers):
        for m in range(k.tile_m):
            for key in range(k.tile_n):
                got = swizzle_bytes(2 * offset_of(shape, stride, (m, key, buf)), 3, 4, 3)
                assert got == reader(m, key, buf, k.tile_m, k.tile_n), (m, key, buf)


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["element_swizzle", "no_key_offset", "no_swizzle"])
@pytest.mark.parametrize("kv_shared", [True, False])
def test_checker_rejects_wrong_staging(wrong, kv_shared):
    """no_key_offset: every thread stores as warpgroup 0 (lock step: its keys; seesaw: its buffer)."""
    bad = smem_p_failures(512, wrong, kv_shared)
    assert bad, wrong
    kinds = {b[0] for b in bad}
    expected = {"element_swizzle": "address", "no_key_offset": "written twice", "no_swizzle": "address"}[wrong]
    assert expected in kinds, bad


def test_wavefront_counter_sees_conflicts():
    """The counter itself: 32 lanes storing 4 bytes at a 128-byte stride hit one bank 32 times."""
    assert smem_wavefronts([128 * i for i in range(32)], 4) == 32
    assert smem_wavefronts([4 * i for i in range(32)], 4) == 1


@pytest.mark.parametrize("head_dim", SPLIT)
def test_split_columns_cover_head_dim(head_dim):
    width, c1 = split_columns(head_dim)
    assert width <= 256 and width % 64 == 0 and c1 % 64 == 0
    assert c1 <= width and c1 + width == head_dim  # halves cover [0, d) (overlap where c1 < width)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("kv_shared", [True, False])
def test_smem_budget_and_ring(head_dim, kv_shared):
    k = FlashAttentionD1Sm90(cutlass.BFloat16, head_dim, kv_shared=kv_shared)
    assert k.slots >= (2 if kv_shared else 1)
    ring = k.slots * k.tile_n * head_dim * 2 * (1 if kv_shared else 2)
    assert k.smem_bytes_fixed() + ring <= SMEM_LIMIT
    assert k.col_split == (head_dim >= 320) and k.p_in_smem == k.col_split


def test_split_rejects_p_in_registers():
    with pytest.raises(ValueError, match="P must go through SMEM"):
        FlashAttentionD1Sm90(cutlass.BFloat16, 512, p_in_smem=False)


@pytest.mark.parametrize("head_dim", SPLIT)
def test_split_operand_views(head_dim):
    """Lock-step split (K != V): warpgroup w's K view holds keys 32 w + j (every column, every
    slot) and its V view columns c_w + c: the kernel's ``split_operand_views`` on coordinate
    tensors. The seesaw's V view is the same ``v_columns`` (checked below)."""
    k = FlashAttentionD1Sm90(cutlass.BFloat16, head_dim, kv_shared=False)
    d, n, slots = head_dim, k.tile_n, k.slots
    width, c1 = split_columns(head_dim)

    def body():
        out = {}
        for wg in range(2):
            kc = cute.make_identity_tensor((n, d, slots))
            vc = cute.make_identity_tensor((d, n, slots))
            kw, vw = k.split_operand_views(kc, vc, wg)
            out[wg] = (as_ints(kw.shape), as_ints(vw.shape),
                       [as_ints(kw[j, c, s]) for j in (0, 31) for c in (0, d - 1) for s in range(slots)],
                       [as_ints(vw[c, j, s]) for c in (0, width - 1) for j in (0, n - 1) for s in range(slots)])
        return out

    views = trace(body, arch="sm90")
    for wg in range(2):
        kshape, vshape, kvals, vvals = views[wg]
        assert kshape == (32, d, slots) and vshape == (width, n, slots)
        assert kvals == [(32 * wg + j, c, s) for j in (0, 31) for c in (0, d - 1) for s in range(slots)]
        assert vvals == [(c1 * wg + c, j, s) for c in (0, width - 1) for j in (0, n - 1) for s in range(slots)]


def seesaw_pv_chunks(k: FlashAttentionD1Sm90) -> dict:
    """{warpgroup: the 64-column chunks of a KV tile its PV reads}, from the kernel's own
    ``v_columns`` view evaluated on a coordinate tensor (every column of every slot)."""
    d, n, slots = k.head_dim, k.tile_n, k.slots

    def body():
        out = {}
        for wg in range(2):
            vw = k.v_columns(cute.make_identity_tensor((d, n, slots)), wg)
            out[wg] = sorted({as_ints(vw[c, 0, 0])[0] // 64 for c in range(cute.size(vw, mode=[0]))})
        return out

    return trace(body, arch="sm90")


def seesaw_half_readers(k: FlashAttentionD1Sm90, pv_chunks: dict) -> tuple:
    """Warps that read half h of a tile whose S warpgroup (the slot's parity) is p: that
    warpgroup's QK reads every chunk; each warpgroup's PV reads the chunks ``pv_chunks`` lists."""
    r = k.o_col1 // 64
    halves = (set(range(r)), set(range(r, k.head_dim // 64)))
    warps = THREADS_PER_WARPGROUP // 32
    return tuple(tuple(warps * len({p} | {wg for wg in (0, 1) if set(pv_chunks[wg]) & halves[h]}) for h in (0, 1))
                 for p in (0, 1))


def uniform_and_covering(counts: tuple, readers: tuple) -> bool:
    """The persistent seesaw's rule for the halves' counts: the same in both slot parities (a tile's
    ring uses may start at either), and no lower than the warps that read each half."""
    pairs = zip(counts, readers, strict=True)
    return counts[0] == counts[1] and all(c >= r for cs, rs in pairs for c, r in zip(cs, rs, strict=True))


@pytest.mark.parametrize("head_dim", SEESAW)
def test_seesaw_ring_halves_count_every_reader(head_dim):
    """The seesaw's ring frees each tile in two halves (chunks below c_1 / 64, the rest), each
    mbarrier counting the warps that arrive on it. The counts the kernel compiles in
    (``seesaw_halves``) must cover every warp its own V views say reads the half (fewer: a slot is
    refilled under a PV still reading it), and be the same whichever warpgroup's S the slot holds:
    a persistent CTA's next Q tile starts its ring uses at the parity the last one left. So the
    warpgroup that reads neither half arrives too (the follower on tile a's first half, the leader
    on b's second: tests/seesaw_protocol.py proves those arrivals come in order and complete every
    phase). The leader's PV never reads half 1, the follower's never half 0 (where they would
    overlap, 320 and 448, the kernels keep the lock-step split:
    ``test_seesaw_only_where_the_halves_are_whole_chunks``)."""
    k = kernel_for(head_dim)
    assert k.seesaw and k.slots % 2 == 0
    chunks = seesaw_pv_chunks(k)
    assert chunks[0][0] == 0 and chunks[1][-1] == head_dim // 64 - 1
    assert min(chunks[1]) == k.o_col1 // 64  # the follower's PV starts at half 1
    readers = seesaw_half_readers(k, chunks)
    assert readers == ((4, 8), (8, 4))  # a's first half and b's second have one reading warpgroup
    assert uniform_and_covering(k.seesaw_halves(), readers)
    # negative controls: counts of the readers only (the non-persistent kernel's) differ by parity;
    # counts of one warpgroup miss a reader
    assert not uniform_and_covering(readers, readers)
    assert not uniform_and_covering(((4, 4), (4, 4)), readers)


def test_seesaw_only_where_the_halves_are_whole_chunks():
    """The seesaw runs at 384 and 512 (K = V); at 320 and 448 the O halves share a chunk, the
    half-tile load order then deadlocks (seen on the H100), so those keep the lock-step split."""
    for head_dim in SPLIT:
        assert kernel_for(head_dim).seesaw == (head_dim in SEESAW) and SEESAW == [384, 512]


def test_halved_ring_loads_one_half_at_a_time():
    """A ring with halves has an empty barrier per half, so a load of the whole tile would wait for
    only one of them: the ring refuses it. Halves split the chunks at r_chunk; a ring without
    halves loads whole tiles."""
    from dsv4_attention.common.sm90_kv_chunks import KvChunkRing

    halved = KvChunkRing(None, None, 2, 8, 8192, 8, halves=((4, 8), (8, 4)), r_chunk=4)
    assert halved.chunk_range(0) == range(4) and halved.chunk_range(1) == range(4, 8)
    with pytest.raises(ValueError, match="one half at a time"):
        halved.chunk_range()
    assert KvChunkRing(None, None, 2, 8, 8192, 8).chunk_range() == range(8)
