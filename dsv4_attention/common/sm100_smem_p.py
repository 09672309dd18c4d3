"""P staged through shared memory on Blackwell (SM100): the plan, the layouts, the P store, the
KV block ring and the TMEM map of stage D1's kernel, shared by the kernel and its host proofs.

P in SMEM, the PV MMA's A operand
---------------------------------
The PV MMA (tcgen05, cta_group::1, M = 128, K = 16 per instruction) reads A = P from SMEM through
a 64-bit descriptor (an SS MMA). P is laid out as ``make_smem_layout_a`` gives it for that MMA:
K-major (keys contiguous), 128-byte swizzle, 1024-byte aligned:

    sP   S<3,4,3> o ((128,16),1,(4,T/64),1):((64,1),0,(16,8192),0)        (T = keys of a tile)

i.e. P(m, k) at element e(m, k) = 64 m + k % 64 + 8192 (k // 64), byte b = 2 e swizzled:
b ^ ((b >> 3) & 0x70) (bits 4..6 of the byte address take the XOR of bits 7..9). Each row of a
64-key block is 128 contiguous bytes; a 16-byte chunk (8 keys) stays whole under the swizzle.
Softmax thread t owns row t of S and P (tcgen05.ld 32x32b, ``common.tmem``); it writes its row as
T / 8 16-byte stores (``store_p_row``). One warp store instruction (8 keys of 32 rows) then touches
rows 32 w .. 32 w + 31 at chunk j: the swizzle sends rows r and r' with r = r' (mod 8) to the
same 16-byte slot of their 128-byte rows only when r // 8 differ, so each group of 8 rows covers
all 32 banks once: 4 wavefronts of 128 bytes, the minimum for 512 bytes (counted on the host by
``common.layout_proof.smem_wavefronts``). Unswizzled, all 32 rows would hit the same 4 banks (32
wavefronts).

The MMA's reads: for k-phase p (keys 16 p .. 16 p + 15) the descriptor holds the start address
of element (0, 16 p) (>> 4), the stride byte offset SBO = 1024 between 8-row groups, and the
swizzle mode; the PTX ISA's canonical K-major SWIZZLE_128B layout then reads (m, k) at
start + 128 (m % 8) + SBO (m // 8) + 2 (k % 16) with the same XOR on the address
(``umma_kmajor_sw128_address``). The host proof runs the DSL's own descriptor construction
(on the CPU) and checks both sides for every (m, k).

The plan: tile, ring blocks, O split (per head dim)
----------------------------------------------------
TMEM holds S (``tile_n`` fp32 columns) and O (``o_cols`` columns) of one 128-row Q tile; SMEM holds
Q (128 x d), P (128 x tile_n) and a ring of KV blocks. A KV block is ``tile_n`` keys x ``d_block``
head-dim columns: for the QK GEMM it is one k-subtile of K (K-major), for the PV GEMM one N chunk
of V (MN-major), and both views are the same bytes (for K = V one block serves both GEMMs). With
K = V the ring needs at least d / d_block stages (one whole KV tile: a tile's blocks that PV still
needs stay held while QK waits for its later ones; see the kernel's docstring); ``plan_for`` gives
every configuration that many, and one more for overlap where SMEM allows. At head dim 512 O
alone would take all 512 TMEM columns, so two CTAs split O's columns (``o_split`` = 2, 256 each);
each computes the whole S (QK over all 512 dims) for its own half of O.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Int32
from cutlass.cute.nvgpu import tcgen05

from dsv4_attention.common.tmem import (
    ACC_DTYPE,
    MMA_INST_K,
    P_STORE_COLS,
    PV_MAX_N,
    PV_TILE_K,
    QK_TILE_M,
    TMEM_COLUMNS,
    TmemRegion,
    checked_alloc_columns,
    column_failures,
    make_acc_fragment,
    make_pv_tiled_mma,
    make_qk_tiled_mma,
    p_region,
    p_store_region,
)

#: 16-bit values per 16-byte SMEM store of P
P_VEC = 8
#: bytes of one swizzle atom row (K-major SW128: 64 16-bit values)
SW128_ROW_BYTES = 128
#: head-dim columns of one SW128 atom (16-bit)
ATOM_K = 64
#: ring stages at most (each costs two mbarriers; beyond this the overlap gains nothing)
MAX_RING_STAGES = 12
#: SMEM kept for barriers, the stats slots, the TMEM pointer and alignment
SMEM_RESERVE = 4096


# =======================================================================================
# the plan
# =======================================================================================
@dataclasses.dataclass(frozen=True)
class SmemPPlan:
    """Compile-time shape of one D1 kernel instance (see the module docstring)."""

    head_dim: int
    tile_n: int  # keys per KV tile = S columns in TMEM = K of the PV GEMM
    d_block: int  # head-dim columns per ring block = QK k-subtile = PV N chunk
    o_split: int  # CTAs sharing one Q tile's O columns (2 at head dim 512)
    ring_stages: int
    kv_shared: bool
    elem_bytes: int = 2
    p_in_smem: bool = True  # False: P over S's upper half in TMEM (stage C's TMEM-P; needs tile_n 128)

    @property
    def blocks(self) -> int:
        """Ring blocks per KV tile along the head dim (K k-subtiles)."""
        return self.head_dim // self.d_block

    @property
    def o_cols(self) -> int:
        """O columns (fp32 TMEM columns) one CTA accumulates."""
        return self.head_dim // self.o_split

    @property
    def v_blocks(self) -> int:
        """V blocks (PV N chunks) one CTA uses per KV tile."""
        return self.blocks // self.o_split

    @property
    def uses_per_tile(self) -> int:
        """Ring stages one KV tile takes: its K blocks, then (K != V) this CTA's V blocks."""
        return self.blocks if self.kv_shared else self.blocks + self.v_blocks

    @property
    def stage_bytes(self) -> int:
        return self.tile_n * self.d_block * self.elem_bytes

    def smem_bytes(self) -> dict:
        """Bytes of each SMEM buffer (tiles only; barriers and stats are in SMEM_RESERVE)."""
        return {
            "sQ": QK_TILE_M * self.head_dim * self.elem_bytes,
            "sP": QK_TILE_M * self.tile_n * self.elem_bytes if self.p_in_smem else 0,
            "ring": self.ring_stages * self.stage_bytes,
        }

    def tmem_columns_needed(self) -> int:
        return self.tile_n + self.o_cols


def default_p_in_smem(head_dim: int) -> bool:
    """P through SMEM above head dim 256 (where stage C's TMEM-P ends: from 320 on the D1 tile has
    64 keys or O leaves P no room), in TMEM at 64..256 (no SMEM traffic; stage C's proven path)."""
    return head_dim > 256


def plan_for(head_dim: int, kv_shared: bool = False, elem_bytes: int = 2, smem_limit: int | None = None,
             o_split: int | None = None, p_in_smem: bool = True) -> SmemPPlan:
    """The D1 configuration of a head dim: the largest KV tile (128 keys, else 64) whose S fits
    TMEM beside O, with the widest ring block (128, else 64 columns) for which SMEM holds a whole
    KV tile plus one block; failing that, a whole tile. ``o_split`` defaults to 2 at head dim 512
    (O alone would fill TMEM) and 1 below. ``p_in_smem`` False (P in TMEM over S's upper half)
    needs a 128-key S; raises where there is none."""
    from dsv4_attention.common.compile import SMEM_LIMIT

    smem_limit = SMEM_LIMIT if smem_limit is None else smem_limit
    if head_dim % ATOM_K or not 64 <= head_dim <= 512:
        raise ValueError(f"head_dim must be a multiple of 64 in 64..512, got {head_dim}")
    if o_split is None:
        o_split = 2 if head_dim + 64 > TMEM_COLUMNS else 1
    o_cols = head_dim // o_split
    fallback = None
    for tile_n in (128, 64) if p_in_smem else (128,):
        if tile_n + o_cols > TMEM_COLUMNS:
            continue
        p_bytes = QK_TILE_M * tile_n * elem_bytes if p_in_smem else 0
        for d_block in (128, 64):
            if head_dim % d_block or o_cols % d_block or d_block > PV_MAX_N:
                continue
            blocks = head_dim // d_block
            budget = smem_limit - SMEM_RESERVE - QK_TILE_M * head_dim * elem_bytes - p_bytes
            stages = min(MAX_RING_STAGES, budget // (tile_n * d_block * elem_bytes))
            plan = SmemPPlan(head_dim, tile_n, d_block, o_split, stages, kv_shared, elem_bytes, p_in_smem)
            if stages >= blocks + 1:
                return plan
            if stages >= blocks and fallback is None:
                fallback = plan
    if fallback is None:
        where = "SMEM" if p_in_smem else "TMEM (P needs a 128-key S beside O)"
        raise ValueError(f"no D1 configuration fits head_dim {head_dim} (o_split {o_split}) with P in {where}")
    return fallback


# =======================================================================================
# MMAs and SMEM layouts
# =======================================================================================
def make_qk_mma(dtype, plan: SmemPPlan) -> cute.TiledMma:
    """S = Q K^T: SS, M = 128, N = tile_n (``common.tmem.make_qk_tiled_mma``)."""
    return make_qk_tiled_mma(dtype, (QK_TILE_M, plan.tile_n))


def make_pv_ss_tiled_mma(dtype, n_chunk: int) -> cute.TiledMma:
    """O[:, chunk] += P V[:, chunk] with A = P from SMEM (``common.tmem.make_pv_tiled_mma``, SS)."""
    return make_pv_tiled_mma(dtype, n_chunk, tcgen05.OperandSource.SMEM)


def make_pv_ts_tiled_mma(dtype, n_chunk: int) -> cute.TiledMma:
    """The same GEMM with A = P from TMEM (stage C's TS MMA), for ``p_in_smem`` False."""
    return make_pv_tiled_mma(dtype, n_chunk, tcgen05.OperandSource.TMEM)


def make_pv_mma(dtype, plan: SmemPPlan) -> cute.TiledMma:
    """The plan's PV MMA, one N chunk (d_block columns): SS (P in SMEM) or TS (P in TMEM)."""
    if plan.p_in_smem:
        return make_pv_ss_tiled_mma(dtype, plan.d_block)
    return make_pv_ts_tiled_mma(dtype, plan.d_block)


def p_tmem_operand_region(dtype, plan: SmemPPlan) -> TmemRegion:
    """P in TMEM (``p_in_smem`` False) as the TS PV MMA's A operand ``(MMA, 1, 8)``: stage C's
    P region (S's upper half, ``common.tmem.p_region``) under the fragment of this plan's TS MMA,
    re-based onto P's offset (``make_fragment_A`` keeps the layout, not the pointer)."""
    if plan.p_in_smem or plan.tile_n != PV_TILE_K:
        raise ValueError("P in TMEM needs p_in_smem False and a 128-key tile")
    pv = make_pv_ts_tiled_mma(dtype, plan.d_block)
    frag = pv.make_fragment_A(pv.partition_shape_A((QK_TILE_M, plan.tile_n)))
    return TmemRegion(dtype, p_region(dtype, 0).offset, frag.layout)


def make_smem_layouts(dtype, plan: SmemPPlan, qk_mma, pv_mma):
    """(q_smem, k_ring, v_ring, p_smem), all ComposedLayouts (swizzle o outer):

    - q_smem ``(MMA, 1, (4, d/64), 1)``: Q, the QK A operand over the whole head dim;
    - k_ring ``(MMA, 1, (4, d_block/64), STAGES)``: each stage one K block (k-subtile), K-major;
    - v_ring ``(MMA, 1, tile_n/16, STAGES)``: the same bytes as V blocks (PV B operand, MN-major);
    - p_smem ``(MMA, 1, tile_n/16, 1)``: P, the SS PV MMA's A operand (allocated only with
      ``p_in_smem``; built from the SS MMA either way, the A layout does not depend on N).

    Raises unless the K and V views of a stage start at the same element (they share bytes)."""
    q_smem = sm100_utils.make_smem_layout_a(qk_mma, (QK_TILE_M, plan.tile_n, plan.head_dim), dtype, 1)
    k_ring = sm100_utils.make_smem_layout_b(qk_mma, (QK_TILE_M, plan.tile_n, plan.d_block), dtype, plan.ring_stages)
    v_ring = sm100_utils.make_smem_layout_b(pv_mma, (QK_TILE_M, plan.d_block, plan.tile_n), dtype, plan.ring_stages)
    p_ss = make_pv_ss_tiled_mma(dtype, plan.d_block)
    p_smem = sm100_utils.make_smem_layout_a(p_ss, (QK_TILE_M, plan.d_block, plan.tile_n), dtype, 1)
    per_stage = plan.tile_n * plan.d_block
    k_stride = cute.cosize(cute.select(k_ring.outer, mode=[0, 1, 2]))
    v_stride = cute.cosize(cute.select(v_ring.outer, mode=[0, 1, 2]))
    if not (k_stride == v_stride == per_stage and cute.cosize(k_ring) == cute.cosize(v_ring)):
        raise ValueError(f"K and V ring views differ: {k_ring} vs {v_ring}")
    return q_smem, k_ring, v_ring, p_smem


def p_mk_layout(p_outer: cute.Layout) -> cute.Layout:
    """P's SMEM layout (``p_smem.outer``, ((128,16),1,(4,T/64),1)) as a plain (m, k) layout
    (128, (16, (4, T/64))): key k splits colexicographically into (k % 16, k-phase k // 16), and
    the k-phase into (its 16-key group in a 64-key block, the block), exactly the modes the MMA
    partition uses. Element offsets only; the swizzle stays on the pointer."""
    (m_shape, k_shape), _, phase_shape, _ = p_outer.shape
    (m_stride, k_stride), _, phase_stride, _ = p_outer.stride
    return cute.make_layout((m_shape, (k_shape, phase_shape)), stride=(m_stride, (k_stride, phase_stride)))


def p_row_vectors(sP_mk: cute.Tensor, row) -> cute.Tensor:
    """Row ``row`` of the (128, tile_n) P tensor cut into 16-byte vectors: ``(P_VEC, tile_n / P_VEC)``,
    vector g = keys P_VEC g .. P_VEC g + 7."""
    return cute.zipped_divide(sP_mk[row, None], (P_VEC,))


def p_reg_vectors(p_row: cute.Tensor) -> cute.Tensor:
    """A thread's P registers (any shape; value v = key v) as ``(P_VEC, tile_n / P_VEC)`` vectors
    in value order, vector g = values P_VEC g .. P_VEC g + 7, matching ``p_row_vectors``."""
    return cute.zipped_divide(cute.make_tensor(p_row.iterator, cute.make_layout(cute.size(p_row))), (P_VEC,))


@cute.jit
def store_p_row(p_row: cute.Tensor, sP_mk: cute.Tensor, row):
    """Softmax thread: its row of P (``p_row``: tile_n 16-bit registers, value v = key v) into SMEM
    as tile_n / 8 16-byte stores (st.shared.v4.b32), vector g = keys 8 g .. 8 g + 7."""
    dtype = p_row.element_type
    store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=P_VEC * dtype.width)
    regs = p_reg_vectors(p_row)
    dst = p_row_vectors(sP_mk, row)
    for g in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        cute.copy(store, regs[None, g], dst[None, g])


# =======================================================================================
# TMEM: S (tile_n columns), then O (o_cols columns, in PV N chunks)
# =======================================================================================
class SmemPTmemMap:
    """S at ``s_col`` (fp32, S(m, n) at lane m, column s_col + n), O at ``o_col`` (O(m, n) at lane m,
    column o_col + n), O written by the PV MMA in chunks of ``d_block`` columns. Explicit columns
    exist for the negative controls; ``packed`` is the kernel's map. Lives inside a trace."""

    def __init__(self, dtype, plan: SmemPPlan, s_col: int = 0, o_col: int | None = None):
        self.dtype = dtype
        self.plan = plan
        self.s_col = s_col
        self.o_col = plan.tile_n if o_col is None else o_col

    @classmethod
    def packed(cls, dtype, plan: SmemPPlan) -> SmemPTmemMap:
        return cls(dtype, plan)

    def s(self) -> TmemRegion:
        qk = make_qk_tiled_mma(self.dtype, (QK_TILE_M, self.plan.tile_n))
        return TmemRegion(ACC_DTYPE, self.s_col, make_acc_fragment(qk, (QK_TILE_M, self.plan.tile_n)).layout)

    def o_chunk(self, c: int) -> TmemRegion:
        """The PV MMA's accumulator for N chunk c: ``(MMA, 1, 1)`` at column o_col + c d_block."""
        pv = make_pv_ss_tiled_mma(self.dtype, self.plan.d_block)
        acc = pv.make_fragment_C(pv.partition_shape_C((QK_TILE_M, self.plan.d_block)))
        return TmemRegion(ACC_DTYPE, self.o_col + c * self.plan.d_block, acc.layout)

    def o(self) -> TmemRegion:
        """All of this CTA's O as one ``((128, o_cols), 1, 1)`` accumulator for the correction warps:
        chunk 0's layout with its column mode widened to o_cols (the chunks are adjacent; the host
        proof checks that every (m, n) is chunk n // d_block's cell)."""
        frag = self.o_chunk(0).layout
        (m_shape, _), _, _ = frag.shape
        (m_stride, n_stride), _, _ = frag.stride
        layout = cute.make_layout(((m_shape, self.plan.o_cols), 1, 1), stride=((m_stride, n_stride), 0, 0))
        return TmemRegion(ACC_DTYPE, self.o_col, layout)

    def p_store(self) -> TmemRegion:
        """P over S's upper half (``p_in_smem`` False): stage C's store region (``common.tmem``)."""
        return p_store_region(self.dtype, P_STORE_COLS, self.s_col)

    def p_operand(self) -> TmemRegion:
        """P as the TS PV MMA's A operand (``p_in_smem`` False), at this map's S."""
        r = p_tmem_operand_region(self.dtype, self.plan)
        return TmemRegion(r.dtype, r.offset + self.s_col * 2, r.layout)

    def spans(self) -> list[tuple[str, int, int]]:
        out = [("S", self.s().first_column, self.s().end_column())]
        if not self.plan.p_in_smem:
            p = p_region(self.dtype, self.s_col)
            out.append(("P", p.first_column, p.end_column()))
        for c in range(self.plan.v_blocks):
            r = self.o_chunk(c)
            out.append((f"O{c}", r.first_column, r.end_column()))
        return out

    def failures(self) -> list[str]:
        """S and the O chunks pairwise disjoint and inside the 512 columns; O's chunks adjacent
        (the correction reads them as one O); P (in TMEM) inside S. Empty = sound."""
        spans = [x for x in self.spans() if x[0] != "P"]
        fails = []
        for n, a, b in self.spans():
            if n == "P" and not (spans[0][1] <= a and b <= spans[0][2]):
                fails.append(f"P (columns {a}..{b - 1}) is not inside S ({spans[0][1]}..{spans[0][2] - 1})")
        fails += column_failures(spans)
        o_spans = spans[1:]
        for (n1, _a1, b1), (n2, a2, _b2) in zip(o_spans[:-1], o_spans[1:], strict=True):
            if b1 != a2:
                fails.append(f"{n1} ends at {b1 - 1} but {n2} starts at {a2}")
        return fails

    def alloc_columns(self) -> int:
        return checked_alloc_columns(self)


# =======================================================================================
# the KV block ring: which stage holds which block (use counts)
# =======================================================================================
class KvBlockRing:
    """Ring use numbers of the blocks of KV tile ``it`` (the it-th tile visited). Use u sits in
    stage u % STAGES and is the (u // STAGES)-th fill of that stage (its full barrier's phase
    parity). The TMA warp fills uses in increasing order; the MMA warp waits for and releases
    them by these numbers, so no pipeline state is carried through the loops.

        K block kb of tile it: use  it * U + kb                      (kb < blocks)
        V block vb of tile it: use  it * U + blocks + vb             (K != V; vb < v_blocks)
                               use  it * U + v_first + vb            (K = V: the K block itself)

    with U = uses_per_tile and v_first = the first block of this CTA's O columns."""

    def __init__(self, plan: SmemPPlan):
        self.plan = plan

    def k_use(self, it, kb: int):
        return it * self.plan.uses_per_tile + kb

    def v_use(self, it, vb: int, v_first=0):
        if self.plan.kv_shared:
            return it * self.plan.uses_per_tile + v_first + vb
        return it * self.plan.uses_per_tile + self.plan.blocks + vb

    def state(self, use) -> pipeline.PipelineState:
        """The consumer state of ring use ``use`` (a DSL Int32)."""
        stages = self.plan.ring_stages
        return pipeline.PipelineState(stages, Int32(use), Int32(use % stages), Int32((use // stages) % 2))

    def k_released_after_qk(self, kb: int, v_first: int) -> bool:
        """Whether K block kb is released as soon as the QK MMAs read it (True unless K = V and the
        block is also one of this CTA's V blocks, which PV releases)."""
        return not (self.plan.kv_shared and v_first <= kb < v_first + self.plan.v_blocks)


# =======================================================================================
# the MMA's SMEM descriptor, decoded (PTX ISA: tcgen05 shared memory descriptor)
# =======================================================================================
#: bits 61..63 of a tcgen05 SMEM descriptor: swizzle mode; 2 = 128-byte swizzle
UMMA_SWIZZLE_128B = 2


def decode_umma_desc(desc: int) -> dict:
    """Fields of a 64-bit tcgen05 SMEM matrix descriptor (PTX ISA 'Shared memory descriptor'):
    start address, leading / stride byte offsets (stored >> 4), the fixed version bits 46..47
    (0b01), base offset (bits 49..51), LBO mode (bit 52) and the swizzle mode (bits 61..63)."""
    return {
        "start": (desc & 0x3FFF) << 4,
        "lbo": ((desc >> 16) & 0x3FFF) << 4,
        "sbo": ((desc >> 32) & 0x3FFF) << 4,
        "version": (desc >> 46) & 0x3,
        "base_offset": (desc >> 49) & 0x7,
        "lbo_mode": (desc >> 52) & 0x1,
        "swizzle": (desc >> 61) & 0x7,
    }


def umma_kmajor_sw128_address(fields: dict, m: int, k: int, elem_bytes: int = 2) -> int:
    """The SMEM byte the MMA reads for A(m, k) of one instruction (k < 16) from a K-major
    SWIZZLE_128B descriptor: rows of 128 bytes, 8-row groups SBO apart, then the 128-byte swizzle
    on the address (bits 4..6 ^= bits 7..9; valid with base offset 0, i.e. 1024-byte-aligned
    atoms). Raises for other modes: this kernel uses no other."""
    if fields["swizzle"] != UMMA_SWIZZLE_128B or fields["base_offset"] != 0 or fields["version"] != 1:
        raise ValueError(f"not a K-major SWIZZLE_128B sm100 descriptor: {fields}")
    if k * elem_bytes >= SW128_ROW_BYTES:
        raise ValueError("one instruction's K must stay inside a 128-byte row")
    addr = fields["start"] + (m % 8) * SW128_ROW_BYTES + (m // 8) * fields["sbo"] + k * elem_bytes
    return addr ^ ((addr >> 3) & 0x70)


# =======================================================================================
# what the MMA warp issues per KV tile (the kernel iterates these lists; the host proves them)
# =======================================================================================
def qk_subtile_schedule(plan: SmemPPlan) -> tuple[tuple[int, int, int], ...]:
    """The QK MMAs of one KV tile, in issue order: (kb, kp, q_phase) = ring block kb (head-dim
    columns kb * B ..), its k-phase kp (16 columns), and Q's k-phase over the whole head dim that
    meets it (columns 16 q_phase ..). All accumulate into the one S."""
    phases = plan.d_block // MMA_INST_K
    return tuple((kb, kp, kb * phases + kp) for kb in range(plan.blocks) for kp in range(phases))


def pv_chunk_schedule(plan: SmemPPlan, half: int = 0) -> tuple[tuple[int, int, int], ...]:
    """The PV N chunks of the CTA owning O half ``half``: (vb, o_col, d_col) = its vb-th V block,
    the first column of the chunk in this CTA's O (TMEM chunk vb), and the first head-dim column
    of V / of the output it covers (the kernel's V block is v_first + vb, v_first = half * v_blocks)."""
    return tuple(
        (vb, vb * plan.d_block, (half * plan.v_blocks + vb) * plan.d_block) for vb in range(plan.v_blocks)
    )
