"""Host proofs (CPU, no GPU) for stage D1's SM100 kernel (stages/d1_smem_p/sm100.py): P through SMEM,
head dims 64..512 in k-subtiles and N chunks, K = V loaded once; and its compile budgets.

Everything is built with the kernel's own functions (common/sm100_smem_p.py, common/tmem.py); only
Python ints leave a trace. The MMA's SMEM descriptors are made by the DSL itself in a host function
that is compiled and *run on the CPU* (a ``@cute.jit`` function without a kernel runs on the host),
then decoded by the PTX ISA's field layout.

1. Plan: tile, ring block, O split, ring stages and TMEM allocation per head dim, as the docstring's
   table says; the ring never needs more than it has (a use-count model of the TMA and MMA warps'
   ring traffic: every wait reads the block it names and is deadlock-free with the kernel's stage
   count; with K = V and one stage fewer than a KV tile's blocks it stalls: the negative control).
2. SMEM-P, per head dim: for every (m, k) of P the byte the softmax's 16-byte store writes (the swizzle
   applied to byte addresses) is the byte the PV MMA reads through its descriptor; every element
   written exactly once, no two on one byte; each warp store instruction takes the minimum number of
   128-byte wavefronts. Negative controls the same checkers reject: the swizzle applied to element
   indices, the rows handed to the wrong threads, no swizzle at all (bank conflicts counted).
3. TMEM map per head dim: S and O's chunks disjoint and inside the allocation; the correction's one
   O view is the PV MMA's chunks cell by cell. Negative controls: O moved over S; head dim 512 with
   O unsplit (no tile fits).
4. Coverage: the QK k-subtiles meet each head-dim column of Q and K once and at the same column, into
   one S; the PV chunks cover each O column once over the CTAs of a Q tile, at most 256 wide, at the
   TMEM chunk the MMA writes. Negative controls: Q phases without the block offset, both O halves on
   the first half of V.
5. K = V: the V view of a ring stage reads, for every (key, column), the byte the K view (the K TMA's
   box layout) put there. Negative control: V read as if K-major.
6. PTX: between the last P store and the arrive the MMA waits on sits fence.proxy.async.shared::cta;
   the MMAs appear once per loop (runtime loops, not unrolled), PV's A from SMEM or TMEM as set.
7. Compile budgets (marked compile / slow): every head dim in bf16, both K = V variants at 512, fp16 once.
"""

from __future__ import annotations

import functools
import re

import cutlass
import cutlass.cute as cute
import pytest
from test_b_sm100_tmem_p import _Coords

from dsv4_attention.common.layout_proof import (
    as_ints,
    first_mismatches,
    min_smem_wavefronts,
    offset_of,
    smem_wavefronts,
    swizzle_bytes,
    trace,
)
from dsv4_attention.common.sm100_smem_p import (
    P_VEC,
    KvBlockRing,
    SmemPTmemMap,
    decode_umma_desc,
    make_pv_mma,
    make_qk_mma,
    make_smem_layouts,
    p_mk_layout,
    p_reg_vectors,
    p_row_vectors,
    plan_for,
    pv_chunk_schedule,
    qk_subtile_schedule,
    umma_kmajor_sw128_address,
)
from dsv4_attention.common.tmem import (
    EPI_COLS,
    EPI_THREADS,
    QK_TILE_M,
    TMEM_COLUMNS,
    epi_view,
    make_acc_tmem_load,
    placeholder_tmem_base,
)

pytestmark = [pytest.mark.stage_d1, pytest.mark.proof, pytest.mark.arch("sm100")]

HEAD_DIMS = (64, 128, 192, 256, 320, 384, 448, 512)
BF16 = cutlass.BFloat16
#: where the host places sP (any 1024-byte-aligned SMEM address; the kernel's struct aligns it so)
SP_BASE = 1024

# ---------------------------------------------------------------------------------------
# 1. the plan

#: (head dim, P in SMEM) -> (tile_n, d_block, o_split, ring stages, TMEM allocation): the
#: kernel docstring's two tables
PLAN_TABLE = {
    (64, True): (128, 64, 1, 10, 256),
    (128, True): (128, 128, 1, 4, 256),
    (192, True): (128, 64, 1, 8, 512),
    (256, True): (128, 128, 1, 3, 512),
    (320, True): (128, 64, 1, 6, 512),
    (384, True): (64, 128, 1, 6, 512),
    (448, True): (64, 64, 1, 11, 512),
    (512, True): (64, 64, 2, 9, 512),
    (64, False): (128, 64, 1, 12, 256),
    (128, False): (128, 128, 1, 5, 256),
    (192, False): (128, 64, 1, 10, 512),
    (256, False): (128, 128, 1, 4, 512),
    (320, False): (128, 64, 1, 8, 512),
    (384, False): (128, 64, 1, 7, 512),
}
#: SharedStorage bytes the compile reports, per (head dim, P in SMEM) (tiles + barriers + alignment)
SMEM_BYTES = {
    (64, True): 215040, (128, True): 198656, (192, True): 215040, (256, True): 198656,
    (320, True): 215040, (384, True): 215040, (448, True): 223232, (512, True): 223232,
    (64, False): 215040, (128, False): 198656, (192, False): 215040, (256, False): 198656,
    (384, False): 215040,
}  # fmt: skip
TMEM_P_HEAD_DIMS = (64, 128, 192, 256, 320, 384)


@pytest.mark.parametrize("head_dim,p_in_smem", sorted(PLAN_TABLE))
def test_plan_matches_the_docstring_table(head_dim, p_in_smem):
    p = plan_for(head_dim, p_in_smem=p_in_smem)
    alloc = trace(lambda: SmemPTmemMap.packed(BF16, p).alloc_columns())
    assert (p.tile_n, p.d_block, p.o_split, p.ring_stages, alloc) == PLAN_TABLE[(head_dim, p_in_smem)]
    assert p.tile_n + p.o_cols <= TMEM_COLUMNS
    assert p.ring_stages >= p.blocks  # one whole KV tile (see the ring model below)
    assert plan_for(head_dim, kv_shared=True, p_in_smem=p_in_smem).ring_stages == p.ring_stages


def test_p_in_tmem_only_where_a_128_key_s_fits():
    from dsv4_attention.stages.d1_smem_p.sm100 import FlashAttentionD1Sm100

    for head_dim in (448, 512):
        with pytest.raises(ValueError, match="P in TMEM"):
            FlashAttentionD1Sm100(BF16, head_dim, p_in_smem=False)
    assert [FlashAttentionD1Sm100(BF16, d).p_in_smem for d in HEAD_DIMS] == [d > 256 for d in HEAD_DIMS]
    assert all(FlashAttentionD1Sm100(BF16, d, p_in_smem=True).plan.p_in_smem for d in HEAD_DIMS)
    with pytest.raises(ValueError, match="head_dim"):
        FlashAttentionD1Sm100(BF16, 96)


def ring_model(plan, n_tiles: int, stages: int | None = None, half: int = 0):
    """Play the TMA and MMA warps' ring traffic (kernel docstring, ``KvBlockRing``) with use counts:
    the producer fills uses in order (use u needs use u - STAGES released); the MMA warp waits,
    reads and releases exactly as ``issue_qk`` / ``issue_pv`` do. Returns (reads, stuck): the
    (tile, kind, block) the MMA read at each wait, and None or where it would wait forever."""
    stages = plan.ring_stages if stages is None else stages
    ring = KvBlockRing(plan)
    v_first = half * plan.v_blocks
    content = []  # use -> (tile, kind, block), the producer's order
    for it in range(n_tiles):
        content += [(it, "K", kb) for kb in range(plan.blocks)]
        if not plan.kv_shared:
            content += [(it, "V", v_first + vb) for vb in range(plan.v_blocks)]
    released: set[int] = set()
    reads = []

    def wait(use):
        # the producer can have filled use u iff uses < u were filled and u - STAGES was released
        for u in range(use + 1):
            if u >= stages and (u - stages) not in released:
                return f"use {use} waits for use {u - stages}, never released before"
        return None

    def qk(it):
        for kb, kp, _ in qk_subtile_schedule(plan):
            if kp:
                continue
            use = ring.k_use(it, kb)
            if (stuck := wait(use)) is not None:
                return stuck
            reads.append(("QK", it, content[use]))
            if ring.k_released_after_qk(kb, v_first):
                released.add(use)
        return None

    def pv(it):
        for vb, _, _ in pv_chunk_schedule(plan, half):
            use = ring.v_use(it, vb, v_first)
            if (stuck := wait(use)) is not None:
                return stuck
            reads.append(("PV", it, content[use]))
            released.add(use)
        return None

    stuck = qk(0)
    for it in range(1, n_tiles):
        stuck = stuck or pv(it - 1) or qk(it)
    stuck = stuck or pv(n_tiles - 1)
    return reads, stuck


@pytest.mark.parametrize("kv_shared", [False, True])
@pytest.mark.parametrize("head_dim,p_in_smem", sorted(PLAN_TABLE))
def test_ring_reads_the_right_blocks_and_never_stalls(head_dim, p_in_smem, kv_shared):
    plan = plan_for(head_dim, kv_shared, p_in_smem=p_in_smem)
    for half in range(plan.o_split):
        reads, stuck = ring_model(plan, n_tiles=5, half=half)
        assert stuck is None, stuck
        v_first = half * plan.v_blocks
        for gemm, it, (tile, kind, block) in reads:
            assert tile == it, (gemm, it, tile)
            if gemm == "QK":
                assert kind == "K"
            else:
                assert (kind == "K") == kv_shared and v_first <= block < v_first + plan.v_blocks
        qk = [(it, b) for g, it, (_, _, b) in reads if g == "QK"]
        assert sorted(qk) == [(it, kb) for it in range(5) for kb in range(plan.blocks)]


@pytest.mark.parametrize("head_dim", [256, 512])
def test_ring_model_rejects_fewer_stages_than_a_tile_when_k_is_v(head_dim):
    # K = V: a tile's V blocks stay held from its QK to its PV while the ring (FIFO) must reach the
    # tile's last block, so fewer than d / B stages stall. K != V: each block is released by the MMA
    # that reads it, in load order, so even one stage cannot stall (slow, but correct).
    plan = plan_for(head_dim, kv_shared=True)
    _, stuck = ring_model(plan, n_tiles=3, stages=plan.blocks - 1)
    assert stuck is not None
    _, stuck = ring_model(plan_for(head_dim, kv_shared=False), n_tiles=3, stages=1)
    assert stuck is None


# ---------------------------------------------------------------------------------------
# 2. SMEM-P: store bytes = MMA descriptor bytes


@functools.cache
def softmax_row_coords(dtype, tile_n: int):
    """Per softmax thread t: the (m, k) of each value of its S row (= of its P registers, value v of
    p_row being value v of the S load), as the kernel's S load partition gives them."""
    plan = plan_for(256 if tile_n == 128 else 448)
    assert plan.tile_n == tile_n

    def body():
        coords = _Coords()
        s_load, _ = make_acc_tmem_load(SmemPTmemMap.packed(dtype, plan).s().at(placeholder_tmem_base()), EPI_COLS)
        ids = epi_view(cute.make_identity_tensor((QK_TILE_M, tile_n)), EPI_COLS)
        return [coords(s_load.get_slice(t).partition_D(ids)) for t in range(EPI_THREADS)]

    return trace(body)


def _flat_offsets(vec) -> list[list[int]]:
    """offsets[g][j] of a (P_VEC, G) tensor on an integer iterator (trace side)."""
    base = int(vec.iterator)
    shape, stride = as_ints(vec.layout.shape), as_ints(vec.layout.stride)
    g_count = cute.size(vec, mode=[1])
    return [[base + offset_of(shape, stride, (j, g)) for j in range(P_VEC)] for g in range(g_count)]


@functools.cache
def p_store_and_read(dtype, head_dim: int):
    """Both sides of P's SMEM hand-off for a head dim's plan, by the kernel's functions:
    'rows': per row r, offsets[g][j] of element j of store vector g (``p_row_vectors`` on P's
    (m, k) view); 'regs': offsets[g][j] of the register value in that vector slot (``p_reg_vectors``);
    'swizzle': the (bits, base, shift) on sP's pointer; 'descs': the DSL's descriptor of each PV
    k-phase (A = ``make_fragment_A(sP)[None, None, kp, 0]``, sP at SP_BASE), computed on the CPU;
    'partition': (m, k) of the MMA's A partition at sample points."""
    import torch
    from cutlass.cute.nvgpu.tcgen05.helpers import smem_descriptor_to_int
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common.arch import GPU_ARCH

    plan = plan_for(head_dim)
    box = {}

    @cute.jit
    def host(out: cute.Tensor):
        qk_mma, pv_mma = make_qk_mma(dtype, plan), make_pv_mma(dtype, plan)
        _, _, _, p_smem = make_smem_layouts(dtype, plan, qk_mma, pv_mma)
        mk = p_mk_layout(p_smem.outer)
        box["rows"] = [_flat_offsets(p_row_vectors(cute.make_tensor(0, mk), r)) for r in range(QK_TILE_M)]
        box["regs"] = _flat_offsets(p_reg_vectors(cute.make_tensor(0, cute.make_layout(plan.tile_n))))
        sw = p_smem.inner
        box["swizzle"] = (int(sw.num_bits), int(sw.num_base), int(sw.num_shift))
        ids = pv_mma.get_slice(0).partition_A(cute.make_identity_tensor((QK_TILE_M, plan.tile_n)))
        box["partition"] = {
            (m, kk, kp): tuple(int(x) for x in ids[((m, kk), 0, kp)])
            for m in (0, 1, 7, 8, 127) for kk in (0, 1, 8, 15) for kp in range(plan.tile_n // 16)
        }  # fmt: skip
        ptr = cute.make_ptr(dtype, SP_BASE, cute.AddressSpace.smem, assumed_align=1024)
        sP = cute.make_tensor(cute.recast_ptr(ptr, p_smem.inner), p_smem.outer)
        tOrP = pv_mma.make_fragment_A(sP)
        for kp in cutlass.range_constexpr(plan.tile_n // 16):
            out[kp] = cutlass.Int64(smem_descriptor_to_int(tOrP[None, None, kp, 0].iterator))

    descs = torch.zeros(plan.tile_n // 16, dtype=torch.int64)
    fn = cute.compile(host, from_dlpack(descs), options=f"--gpu-arch={GPU_ARCH['sm100']}")
    fn(from_dlpack(descs))  # runs on the CPU
    box["descs"] = [d & (2**64 - 1) for d in descs.tolist()]
    box["tile_n"] = plan.tile_n
    return box


def p_writes(dtype, head_dim, swizzle=None, row_of=lambda t: t):
    """Per softmax thread t and store instruction g: [(m, k, byte)] of its 8 values, the kernel's
    way: the thread's row is its S row (value 0's m), ``row_of`` picks the P row its store addresses
    (the kernel: that same row; negative controls: another), ``swizzle(byte offset)`` the physical
    byte (the kernel: CuTe's Swizzle on the byte address)."""
    data = p_store_and_read(dtype, head_dim)
    bits, base, shift = data["swizzle"]
    swizzle = swizzle or (lambda b: swizzle_bytes(b, bits, base, shift))
    coords = softmax_row_coords(dtype, data["tile_n"])
    elem = dtype.width // 8
    out = []
    for t in range(EPI_THREADS):
        row = coords[t][0][0]  # the kernel: row = tTR_cS[0][0]
        vecs = data["rows"][row_of(row)]
        out.append([
            [(*coords[t][data["regs"][g][j]], SP_BASE + swizzle(elem * vecs[g][j])) for j in range(P_VEC)]
            for g in range(len(vecs))
        ])  # fmt: skip
    return out


def p_reads(dtype, head_dim):
    """(m, k) -> the byte the PV MMA reads for A(m, k): k-phase k // 16's descriptor, decoded."""
    data = p_store_and_read(dtype, head_dim)
    elem = dtype.width // 8
    reads = {}
    for kp, desc in enumerate(data["descs"]):
        fields = decode_umma_desc(desc)
        for m in range(QK_TILE_M):
            for kk in range(16):
                reads[(m, 16 * kp + kk)] = umma_kmajor_sw128_address(fields, m, kk, elem)
    return reads


def smem_p_failures(writes, reads, elem_bytes: int = 2) -> list[str]:
    """Every way "each P(m, k) is stored exactly once, at the byte the MMA reads for A(m, k), no two
    elements on one byte, and each 16-byte store is one aligned contiguous vector" breaks."""
    fails = []
    written: dict = {}
    for t, instrs in enumerate(writes):
        for g, vec in enumerate(instrs):
            b0 = vec[0][2]
            if b0 % 16 or [b for _, _, b in vec] != [b0 + elem_bytes * j for j in range(len(vec))]:
                fails.append(f"thread {t} store {g} is not one aligned 16-byte vector: {[b for *_, b in vec]}")
            for m, k, b in vec:
                written.setdefault((m, k), []).append(b)
    twice = [mk for mk, bs in written.items() if len(bs) != 1]
    if twice:
        fails.append(f"{len(twice)} elements written more than once, e.g. {twice[:3]}")
    if set(written) != set(reads):
        fails.append(f"written (m, k) != read (m, k): {len(set(reads) - set(written))} never written")
    bytes_used: dict = {}
    for mk, bs in written.items():
        for b in bs:
            bytes_used.setdefault(b, []).append(mk)
    clash = [b for b, mks in bytes_used.items() if len(mks) > 1]
    if clash:
        fails.append(f"{len(clash)} bytes hold two elements, e.g. {bytes_used[clash[0]]}")
    bad = first_mismatches(reads, {mk: bs[0] for mk, bs in written.items()})
    if bad:
        fails.append(f"stored at a byte the MMA does not read for it (m, k), read, written: {bad}")
    return fails


def store_wavefronts(writes) -> list[int]:
    """128-byte wavefronts of every warp store instruction (lanes in order, 16 bytes each)."""
    out = []
    for w in range(EPI_THREADS // 32):
        for g in range(len(writes[0])):
            out.append(smem_wavefronts([writes[32 * w + lane][g][0][2] for lane in range(32)], 16))
    return out


@pytest.mark.slow  # one host compile + CPU run per head dim, about 5 s each
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_p_stored_where_the_pv_mma_reads_it(head_dim):
    writes, reads = p_writes(BF16, head_dim), p_reads(BF16, head_dim)
    assert smem_p_failures(writes, reads) == []
    assert len(reads) == QK_TILE_M * plan_for(head_dim).tile_n
    data = p_store_and_read(BF16, head_dim)
    for (m, kk, kp), mk in data["partition"].items():  # A(m, kk) of k-phase kp is P(m, 16 kp + kk)
        assert mk == (m, 16 * kp + kk)
    fields = decode_umma_desc(data["descs"][0])
    assert fields["start"] == SP_BASE and fields["sbo"] == 1024 and fields["swizzle"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_p_stores_take_the_fewest_wavefronts(head_dim):
    counts = store_wavefronts(p_writes(BF16, head_dim))
    assert counts == [min_smem_wavefronts(32, 16)] * len(counts)  # 4: conflict-free


def test_p_store_proof_fp16_as_bf16():
    assert smem_p_failures(p_writes(cutlass.Float16, 512), p_reads(cutlass.Float16, 512)) == []


def test_checker_rejects_element_index_swizzle():
    bits, base, shift = p_store_and_read(BF16, 128)["swizzle"]
    wrong = p_writes(BF16, 128, swizzle=lambda b: 2 * swizzle_bytes(b // 2, bits, base, shift))
    assert any("does not read" in f for f in smem_p_failures(wrong, p_reads(BF16, 128)))
    assert max(store_wavefronts(wrong)) > min_smem_wavefronts(32, 16)


def test_checker_rejects_rows_on_the_wrong_threads():
    wrong = p_writes(BF16, 256, row_of=lambda r: r ^ 1)
    assert any("does not read" in f for f in smem_p_failures(wrong, p_reads(BF16, 256)))


def test_wavefront_counter_rejects_unswizzled_p():
    wrong = p_writes(BF16, 64, swizzle=lambda b: b)
    assert smem_p_failures(wrong, p_reads(BF16, 64))
    assert store_wavefronts(wrong) == [32] * len(wrong[0]) * 4  # every row on the same 4 banks


@pytest.mark.slow  # stage B's checker, about 15 s for the writes (shared by the head dims)
@pytest.mark.parametrize("head_dim", TMEM_P_HEAD_DIMS)
def test_tmem_p_written_where_the_ts_pv_mma_reads_it(head_dim):
    from test_b_sm100_tmem_p import gather_p_reads, tmem_p_failures

    plan = plan_for(head_dim, p_in_smem=False)
    writes = _tmem_p_writes()
    reads = gather_p_reads(BF16, None, operand=lambda: SmemPTmemMap.packed(BF16, plan).p_operand())
    assert tmem_p_failures(writes, reads, (0, plan.tile_n)) == []


def test_tmem_p_checker_rejects_operand_not_rebased():
    from test_b_sm100_tmem_p import gather_p_reads, tmem_p_failures

    plan = plan_for(128, p_in_smem=False)

    def unrebased():  # the TS MMA's fragment as make_fragment_A leaves it: at column 0, not P's 64
        r = SmemPTmemMap.packed(BF16, plan).p_operand()
        return type(r)(r.dtype, 0, r.layout)

    assert tmem_p_failures(_tmem_p_writes(), gather_p_reads(BF16, None, operand=unrebased), (0, plan.tile_n))


@functools.cache
def _tmem_p_writes():
    """The softmax's TMEM-P stores as the kernel builds them: stage B's gatherer with the store
    region of this kernel's map (``SmemPTmemMap.p_store``, S at column 0)."""
    from test_b_sm100_tmem_p import gather_p_writes

    plan = plan_for(128, p_in_smem=False)
    return gather_p_writes(BF16, p_store=lambda: SmemPTmemMap.packed(BF16, plan).p_store())


def test_wavefront_counter_basics():
    assert smem_wavefronts([16 * lane for lane in range(32)], 16) == 4
    assert smem_wavefronts([128 * lane for lane in range(32)], 16) == 32
    assert smem_wavefronts([4 * lane for lane in range(32)], 4) == 1
    assert smem_wavefronts([0] * 32, 4) == 1  # one word, broadcast
    assert smem_wavefronts([128 * lane for lane in range(32)], 4) == 32


# ---------------------------------------------------------------------------------------
# 3. TMEM map


def describe_map(make_map):
    def body():
        m = make_map()
        out = {"spans": m.spans(), "failures": m.failures()}
        if not out["failures"]:
            out["alloc"] = m.alloc_columns()
            full = m.o()
            chunk_bad = []
            for c in range(m.plan.v_blocks):
                r = m.o_chunk(c)
                for row in (0, 1, 31, 32, 127):
                    for n in range(m.plan.d_block):
                        a = full.element(((row, c * m.plan.d_block + n), 0, 0))
                        b = r.element(((row, n), 0, 0))
                        if a != b and len(chunk_bad) < 4:
                            chunk_bad.append((row, c, n, a, b))
            out["o_vs_chunks"] = chunk_bad
            out["o_end"] = full.end_column()
        return out

    return trace(body)


@pytest.mark.parametrize("head_dim,p_in_smem", sorted(PLAN_TABLE))
def test_tmem_map_fits_without_overlap(head_dim, p_in_smem):
    plan = plan_for(head_dim, p_in_smem=p_in_smem)
    got = describe_map(lambda: SmemPTmemMap.packed(BF16, plan))
    assert got["failures"] == []
    assert got["spans"][0] == ("S", 0, plan.tile_n)
    if not p_in_smem:
        assert got["spans"].pop(1) == ("P", 64, 128)  # S's upper half
    assert got["spans"][1:] == [
        (f"O{c}", plan.tile_n + c * plan.d_block, plan.tile_n + (c + 1) * plan.d_block) for c in range(plan.v_blocks)
    ]
    assert got["o_vs_chunks"] == []
    assert got["o_end"] == plan.tile_n + plan.o_cols <= got["alloc"] <= TMEM_COLUMNS


def test_tmem_map_rejects_o_over_s():
    plan = plan_for(256)
    got = describe_map(lambda: SmemPTmemMap(BF16, plan, o_col=plan.tile_n - 32))
    assert any("overlaps" in f for f in got["failures"])


def test_tmem_map_rejects_past_512():
    plan = plan_for(448)
    got = describe_map(lambda: SmemPTmemMap(BF16, plan, o_col=plan.tile_n + 64))
    assert any("past the 512" in f for f in got["failures"])


def test_tmem_map_rejects_p_outside_s():
    import dataclasses

    # TMEM-P with a 64-key S (what plan_for refuses): P's 64 columns 64..127 lie past S's 0..63
    plan = dataclasses.replace(plan_for(128, p_in_smem=False), tile_n=64)
    got = describe_map(lambda: SmemPTmemMap.packed(BF16, plan))
    assert any(f.startswith("P (columns 64..127) is not inside S") for f in got["failures"])


def test_hd512_unsplit_has_no_tile():
    with pytest.raises(ValueError, match="no D1 configuration"):
        plan_for(512, o_split=1)


# ---------------------------------------------------------------------------------------
# 4. k-subtile QK and N-chunked PV coverage


def qk_columns(plan, schedule):
    """Per scheduled QK MMA: (head-dim column of Q's k-phase, head-dim column of K's), from the MMA
    partitions of identity tiles (Q over the whole head dim; K over one ring block + kb * B)."""

    def body():
        qk = make_qk_mma(BF16, plan)
        q_ids = qk.get_slice(0).partition_A(cute.make_identity_tensor((QK_TILE_M, plan.head_dim)))
        k_ids = qk.get_slice(0).partition_B(cute.make_identity_tensor((plan.tile_n, plan.d_block)))
        out = []
        for kb, kp, q_phase in schedule:
            q0 = [int(q_ids[((m, kk), 0, q_phase)][1]) for m in (0, 127) for kk in range(16)]
            k0 = [kb * plan.d_block + int(k_ids[((n, kk), 0, kp)][1]) for n in (0, plan.tile_n - 1) for kk in range(16)]
            out.append((q0, k0))
        return out

    return trace(body)


def qk_failures(plan, cols) -> list[str]:
    fails = []
    seen = []
    for q, k in cols:
        if q != k:
            fails.append(f"Q columns {q[:3]}.. meet K columns {k[:3]}..")
        seen += q[:16]
    if sorted(seen) != list(range(plan.head_dim)):
        fails.append("the k-subtiles do not cover each head-dim column once")
    return fails


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_qk_k_subtiles_cover_the_head_dim_once(head_dim):
    plan = plan_for(head_dim)
    sched = qk_subtile_schedule(plan)
    assert len(sched) == head_dim // 16 and sched[0][1] == 0  # one S: the first MMA zero-initialises it
    assert qk_failures(plan, qk_columns(plan, sched)) == []


def test_qk_checker_rejects_q_phase_without_block_offset():
    plan = plan_for(256)
    wrong = tuple((kb, kp, kp) for kb, kp, _ in qk_subtile_schedule(plan))
    assert qk_failures(plan, qk_columns(plan, wrong))


def pv_failures(plan, schedules) -> list[str]:
    fails = []
    cols = []
    for half, sched in enumerate(schedules):
        o_cols = []
        for vb, o_col, d_col in sched:
            if plan.d_block > 256:
                fails.append(f"chunk {vb} is {plan.d_block} wide")
            if o_col != vb * plan.d_block:  # TMEM O chunk vb, where the kernel's tOtO[vb] sits
                fails.append(f"chunk {vb} lands at O column {o_col}")
            if d_col != half * plan.o_cols + o_col:
                fails.append(f"half {half} chunk {vb}: O column {o_col} computed from V column {d_col}")
            o_cols += range(o_col, o_col + plan.d_block)
            cols += range(d_col, d_col + plan.d_block)
        if sorted(o_cols) != list(range(plan.o_cols)):
            fails.append(f"half {half}: O columns not covered once")
    if sorted(cols) != list(range(plan.head_dim)):
        fails.append("the CTAs of a Q tile do not cover V's columns once")
    return fails


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_pv_chunks_cover_o_once(head_dim):
    plan = plan_for(head_dim)
    assert plan.d_block <= 256
    assert pv_failures(plan, [pv_chunk_schedule(plan, h) for h in range(plan.o_split)]) == []


def test_pv_checker_rejects_both_halves_on_the_first():
    plan = plan_for(512)
    assert pv_failures(plan, [pv_chunk_schedule(plan, 0)] * 2)


# ---------------------------------------------------------------------------------------
# 5. K = V: one ring stage, two views


def kv_views(head_dim, v_major_k=False):
    """(k_bytes, v_bytes): for every (key, column j) of a ring block, the swizzled byte of K(key, j)
    by the K view and of V(j, key) by the V view (stage 0), each through its MMA's partition
    convention (checked at sample points). ``v_major_k``: V read K-major (negative control)."""
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from dsv4_attention.common.tmem import ACC_DTYPE, MMA_INST_K

    plan = plan_for(head_dim, kv_shared=True)

    def body():
        import cutlass.utils.blackwell_helpers as sm100_utils

        qk, pv = make_qk_mma(BF16, plan), make_pv_mma(BF16, plan)
        _, k_ring, v_ring, _ = make_smem_layouts(BF16, plan, qk, pv)
        if v_major_k:
            op = tcgen05.MmaF16BF16Op(BF16, ACC_DTYPE, (QK_TILE_M, plan.d_block, MMA_INST_K), tcgen05.CtaGroup.ONE,
                                      tcgen05.OperandSource.SMEM, OperandMajorMode.K, OperandMajorMode.K)
            pv = cute.make_tiled_mma(op)
            v_ring = sm100_utils.make_smem_layout_b(pv, (QK_TILE_M, plan.d_block, plan.tile_n), BF16, plan.ring_stages)
        k_ids = qk.get_slice(0).partition_B(cute.make_identity_tensor((plan.tile_n, plan.d_block)))
        v_ids = pv.get_slice(0).partition_B(cute.make_identity_tensor((plan.d_block, plan.tile_n)))
        for n, kk, kp in ((0, 0, 0), (5, 3, 1), (plan.tile_n - 1, 15, plan.d_block // 16 - 1)):
            assert tuple(int(x) for x in k_ids[((n, kk), 0, kp)]) == (n, 16 * kp + kk)
        for n, kk, kp in ((0, 0, 0), (9, 3, 1), (plan.d_block - 1, 15, plan.tile_n // 16 - 1)):
            assert tuple(int(x) for x in v_ids[((n, kk), 0, kp)]) == (n, 16 * kp + kk)
        sw = k_ring.inner
        return {
            "k": (as_ints(k_ring.outer.shape), as_ints(k_ring.outer.stride)),
            "v": (as_ints(v_ring.outer.shape), as_ints(v_ring.outer.stride)),
            "swizzle": (int(sw.num_bits), int(sw.num_base), int(sw.num_shift)),
        }

    lay = trace(body)
    bits, base, shift = lay["swizzle"]
    k_bytes, v_bytes = {}, {}
    for key in range(plan.tile_n):
        for j in range(plan.d_block):
            ek = offset_of(*lay["k"], ((key, j % 16), 0, j // 16, 0))
            ev = offset_of(*lay["v"], ((j, key % 16), 0, key // 16, 0))
            k_bytes[(key, j)] = swizzle_bytes(2 * ek, bits, base, shift)
            v_bytes[(key, j)] = swizzle_bytes(2 * ev, bits, base, shift)
    return k_bytes, v_bytes


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_v_view_reads_the_bytes_the_k_tma_wrote(head_dim):
    k_bytes, v_bytes = kv_views(head_dim)
    assert first_mismatches(k_bytes, v_bytes) == []
    assert len(set(k_bytes.values())) == len(k_bytes)  # one element per byte pair


def test_kv_checker_rejects_v_read_k_major():
    k_bytes, v_bytes = kv_views(128, v_major_k=True)
    assert first_mismatches(k_bytes, v_bytes)


# ---------------------------------------------------------------------------------------
# 6. fences between the P stores and the MMA (PTX)


_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16[\w:.]*\s+\[[^\]]+\],\s*(\S+?),")


@pytest.mark.compile
@pytest.mark.slow  # one compile, about 3 s
@pytest.mark.parametrize("head_dim,p_in_smem", [(128, True), (512, True), (128, False)])
def test_ptx_fences_and_one_copy_of_each_loop(tmp_path, head_dim, p_in_smem):
    """SMEM-P: the last P store, then fence.proxy.async.shared::cta, then the arrive the MMA waits
    on. Every variant: the MMAs appear once for iteration 0 / the loop / the last PV, i.e. the KV
    loop is a runtime loop (d / 16 QK MMAs twice, T / 16 per PV chunk twice), PV's A from SMEM
    descriptors (SS) or from TMEM (TS) as configured."""
    import torch

    from dsv4_attention.common import jit
    from dsv4_attention.stages import d1_smem_p as stage

    kernel = stage.make_kernel("sm100", torch.bfloat16, head_dim, kv_shared=True, p_in_smem=p_in_smem)
    ptx = jit.compile_ptx(kernel, stage.example_args(torch.bfloat16, head_dim, kv_shared=True), "sm100",
                          tmp_path)
    plan = plan_for(head_dim, kv_shared=True, p_in_smem=p_in_smem)

    a_operands = _MMA.findall(ptx)
    pv_count = 2 * plan.v_blocks * plan.tile_n // 16
    assert len(a_operands) == 2 * head_dim // 16 + pv_count, len(a_operands)
    from_tmem = [a for a in a_operands if a.startswith("[")]
    assert len(from_tmem) == (0 if p_in_smem else pv_count)

    stores = [m.end() for m in re.finditer(r"st\.shared\.v4\.(?:b32|u32)", ptx)]
    if not p_in_smem:
        return
    # the softmax's P stores come first in the PTX (the TMA and MMA warps store nothing); the
    # correction's O stores follow
    n_p = plan.tile_n // P_VEC
    assert len(stores) == n_p + plan.o_cols // P_VEC, len(stores)
    p_end = stores[n_p - 1]
    fence = ptx.find("fence.proxy.async.shared::cta", p_end)
    arrive = ptx.find("mbarrier.arrive", p_end)
    assert 0 <= fence < arrive, "no fence.proxy.async.shared::cta between the P stores and the arrive"
    assert fence < stores[n_p], "the fence does not follow the P stores"


# ---------------------------------------------------------------------------------------
# 7. compile budgets


COMPILE_CASES = (
    [("bfloat16", hd, {}) for hd in HEAD_DIMS]  # the defaults: TMEM-P at 64..256, SMEM-P above
    + [("bfloat16", hd, {"p_in_smem": True}) for hd in (64, 128, 192, 256)]  # SMEM-P forced
    + [("bfloat16", 384, {"p_in_smem": False})]  # TMEM-P at its widest (S 128 + O 384 = 512 columns)
    + [("bfloat16", 512, {"kv_shared": True}), ("bfloat16", 128, {"kv_shared": True})]
    + [("float16", 512, {"kv_shared": True})]  # fp16: the same code but the element type, once
)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("dtype_name,head_dim,options", COMPILE_CASES, ids=str)
def test_compiles_within_budget(dtype_name, head_dim, options):
    from dsv4_attention.common.compile import assert_within_budget
    from dsv4_attention.common.sm100_smem_p import default_p_in_smem

    # no spills at any head dim (measured: 0 bytes at 64..512, bf16 and fp16, every variant), so the
    # bound is 0 throughout, 512 included
    rep = assert_within_budget("d1", "sm100", dtype_name, head_dim, min_tmem_columns=256,
                               options=options, max_spill_bytes=0)
    key = (head_dim, options.get("p_in_smem", default_p_in_smem(head_dim)))
    assert rep.tmem_columns == PLAN_TABLE[key][4]
    assert rep.smem_bytes == SMEM_BYTES[key]
