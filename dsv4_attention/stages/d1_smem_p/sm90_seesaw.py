"""Stage D1's persistent seesaw schedule on Hopper (head dims 320-512 with K = V; every later
stage's DeepSeek-V4 shape), apart from the row-split schedule (sm90_rows.py) as CUTLASS keeps a
persistent GEMM apart from its plain one.

One CTA per SM loops over the launch's units (common/tile_scheduler.py's static persistent
order). Each role (the producer warps, consumer warpgroup 0, consumer warpgroup 1) runs its own
copy of the tile loop (``role_tiles``) and keeps its counters across tiles: ``uses_before``, the
ring uses before the tile; ``tiles_before``, the tiles before it; the consumers'
``rounds_before``, the handoff rounds before it.

Within a tile the two consumer warpgroups take turns (the seesaw): warpgroup w computes the whole
S = Q K^T of KV visits 2k + w, 64 x 64 per wgmma, and both accumulate their half of O's columns.
The leader publishes its row max and P, the follower combines and publishes its own; three
``RoundHandoff`` mbarriers order each round (the barrier table: docs/stages/d1_smem_p.md).
"""


import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.nvgpu import warpgroup

from dsv4_attention.common.kv_span import KvSpan
from dsv4_attention.common.p_staging import as_a_operand, convert_p_packed, make_pv_tiled_mma
from dsv4_attention.common.sm90_gemm import (
    THREADS_PER_WARPGROUP,
    WGMMA_M,
    gemm,
)
from dsv4_attention.common.sm90_kv_chunks import CHUNK_COLS, KvChunkRing
from dsv4_attention.common.smem_p import store_p
from dsv4_attention.common.softmax import OnlineSoftmax, acc_rows_view, scale_rows
from dsv4_attention.stages.d1_smem_p.sm90_operands import ConsumerOperands, SeesawOperands, SharedViews, TileViews

PRODUCER = -1  # role_tiles: the load warps' role (the consumer warpgroups are 0 and 1)


class SeesawSchedule:
    """The persistent seesaw's methods, mixed into stage D1's sm90 kernel class."""

    @cute.jit
    def run_tiles(self, warp_idx, tensors, atoms, layouts, mmas, mSink, scale_log2, m_tiles, n_tiles):
        """The persistent seesaw (common/persistent.py): CTA c runs tiles c, c + grid, ... Each role
        walks the same tiles and keeps counters across them: ``uses_before``, the ring uses before
        the tile (its KV tile visits are ring uses uses_before .. uses_before + n_blocks - 1);
        ``tiles_before``, the tiles before it (Q's phase, and the producer's wait for the last QKs
        that free sQ); the consumers also ``rounds_before``, the handoff rounds before it (one per
        pair: ceil(n_blocks / 2)). A tile past its request's rows
        (varlen: the launch spans the longest request) is skipped by every role
        alike (``tile_at``)."""
        self.prefetch_descriptors(atoms, tensors.entries, warp_idx)
        smem = self.shared_views(layouts, warp_idx)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx < self.producer_warps:
                self.role_tiles(PRODUCER, warp_idx, tensors, atoms, mmas, smem, mSink, scale_log2, m_tiles, n_tiles)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            # each warpgroup its own tile loop: what its role keeps across tiles (the addresses of its
            # P buffer, which its epilogue stores O through) stays out of the other's loop (one loop
            # around both roles kept both buffers' addresses alive in each: 32 registers, spilled)
            if warp_idx < 8:
                self.role_tiles(0, warp_idx, tensors, atoms, mmas, smem, mSink, scale_log2, m_tiles, n_tiles)
            else:
                self.role_tiles(1, warp_idx, tensors, atoms, mmas, smem, mSink, scale_log2, m_tiles, n_tiles)

    @cute.jit
    def role_tiles(self, role: int, warp_idx, tensors, atoms, mmas, smem: "SharedViews", mSink, scale_log2, m_tiles,
                   n_tiles):
        """One role of the persistent seesaw over the CTA's tiles: ``role`` (constant) is PRODUCER
        (the load warps) or consumer warpgroup 0 / 1. The counters: ``uses_before`` the ring uses before the
        tile, ``tiles_before`` the tiles before it, ``rounds_before`` (consumers) the handoff rounds before it."""
        heads = tensors.mQ.shape[2]
        uses_before = cutlass.Int32(0)
        rounds_before = cutlass.Int32(0)
        tiles_before = cutlass.Int32(0)
        for tile_idx in cutlass.range(cute.arch.block_idx()[0], n_tiles, cute.arch.grid_dim()[0], unroll=1):
            m_block, head, req, has_rows, kv_part = self.tile_at(tile_idx, m_tiles, heads, tensors)
            if has_rows:
                tile = self.tile_views(m_block, head, req, tensors, smem, uses_before, kv_part)
                if cutlass.const_expr(role == PRODUCER):
                    if self.has_visits(tile):  # split-KV: a split past the span's tiles loads nothing, not Q
                        self.load(smem, tile, atoms, warp_idx, uses_before, tiles_before)
                else:  # (split-KV: such a split goes straight to the epilogue, consume_seesaw)
                    c = self.consumer_operands(mmas, smem, tile, atoms, mSink, scale_log2)
                    self.consume_seesaw(role, c, mmas[2], smem.ring, smem.handoffs, tile.n_blocks, uses_before,
                                        rounds_before, tiles_before, smem.q_empty)
                    rounds_before = rounds_before + (tile.n_blocks + 1) // 2
                uses_before = uses_before + tile.n_blocks
                if cutlass.const_expr(self.split_kv):  # Q's phase counts the tiles whose Q was loaded
                    if self.has_visits(tile):
                        tiles_before = tiles_before + 1
                else:
                    tiles_before = tiles_before + 1

    @cute.jit
    def tile_at(self, tile_idx, m_tiles, heads, tensors):
        """The launch's unit ``tile_idx`` as every role of the persistent loop sees it: (m_block,
        head, its request, whether it has rows: a tile past its request's rows has no work, varlen;
        its split, split-KV, else None)."""
        m_block, head, batch, kv_part = self.tile_coords(tile_idx, m_tiles, heads, tensors.partials.num_splits)
        req = self.tile_request(head, batch, tensors)
        has_rows = cutlass.Boolean(True)
        if cutlass.const_expr(self.varlen):  # the launch spans the longest request
            has_rows = m_block * self.tile_m < req.n_rows
        return m_block, head, req, has_rows, kv_part

    def has_visits(self, tile: "TileViews"):
        """Whether a unit visits any KV tile: always, but for a split-KV unit past its span's tiles."""
        if cutlass.const_expr(self.split_kv):
            return tile.n_blocks > 0
        return True

    @cute.jit
    def consume_seesaw(self, wg: int, c: ConsumerOperands, pv_own_mma: cute.TiledMma, ring: KvChunkRing,
                       handoffs: list, n_blocks: cutlass.Int32, uses_before, rounds_before, tiles_before, q_empty):
        """Warpgroup ``wg`` (a constant: 0 leads, 1 follows) on one Q tile. Pairs of KV tiles (a, b)
        = visits (2k, 2k + 1): the leader computes S_a, the follower S_b, each over the whole head
        dim, and each adds both tiles' P V to its O columns. See ``seesaw_lead`` /
        ``seesaw_follow`` for one pair; an odd tile count ends with a pair that has no b.
        ``handoffs``: [leader's max, follower's max and P, leader's P]. ``uses_before``,
        ``rounds_before``, ``tiles_before``: the CTA's ring uses, handoff rounds and tiles before
        this one (``run_tiles``)."""
        qk_mma, pv_mma, span, row_stats = c.qk_mma, c.pv_mma, c.span, c.row_stats
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
        sub = tidx % THREADS_PER_WARPGROUP
        thr_qk = qk_mma.get_slice(sub)
        thr_pv = pv_mma.get_slice(sub)
        wg_qk, wg_pv, wg_own = qk_mma.get_slice(0), pv_mma.get_slice(0), pv_own_mma.get_slice(0)
        sVt_w = self.v_columns(c.sVt, wg)
        ops = SeesawOperands(
            tSrQ=qk_mma.make_fragment_A(wg_qk.partition_A(c.sQ))[None, None, None, 0],  # (MMA, 1, d/16)
            tSrK=qk_mma.make_fragment_B(wg_qk.partition_B(c.sK)),  # the whole tile: (MMA, 1, d/16, slots)
            tOrV=pv_mma.make_fragment_B(wg_pv.partition_B(sVt_w)),  # this warpgroup's V columns
            tOrV_own=pv_own_mma.make_fragment_B(wg_own.partition_B(sVt_w)),
            tOrP_smem=pv_mma.make_fragment_A(wg_pv.partition_A(c.sP)),  # (MMA, 1, keys/16, 2 buffers)
            tPsP=self.p_store_view(c.sP, wg, thr_qk),
            tScS=self.s_coords(wg, thr_qk),
            q_empty=q_empty,
        )
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((WGMMA_M, self.tile_n)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((WGMMA_M, self.o_width)))
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)  # own P, 16-bit: the RS wgmma's A
        softmax = OnlineSoftmax(acc_s.layout, c.scale_log2, may_be_empty=self.may_hide_rows())
        softmax.reset()
        acc_o.fill(0.0)
        stat_rows = acc_rows_view(ops.tScS)
        mmas = (qk_mma, pv_mma, pv_own_mma)
        first_row = c.m_block * self.tile_m

        pairs = (mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows, row_stats, span, n_blocks,
                 first_row, (uses_before, rounds_before), c.q_bar, tiles_before)
        visited = None
        if cutlass.const_expr(self.split_kv):
            # a split past its span's tiles (n_blocks = 0) has no key: no Q, no pair; the epilogue
            # of a row that saw no key gives its part O = 0, LSE = -inf, so the merge reads every
            # part it is given (one epilogue in the kernel, not a second for the empty parts)
            visited = n_blocks > 0
            if visited:
                self.seesaw_pairs(wg, *pairs)
        else:
            self.seesaw_pairs(wg, *pairs)
        self.epilogue(c, acc_o, softmax, stat_rows, ops.tScS, thr_pv, wg, tidx, ops.tPsP, visited)

    @cute.jit
    def seesaw_pairs(self, wg: int, mmas, ring: KvChunkRing, handoffs, ops, acc_s, acc_o, r_p, softmax: OnlineSoftmax,
                     stat_rows, row_stats, span: KvSpan, n_blocks, first_row, base, q_bar, tiles_before):
        """Warpgroup ``wg``'s pairs of one tile: Q landed, then ``seesaw_lead`` / ``seesaw_follow``
        for pairs 0 .. n_blocks / 2 (an odd count ends with a pair without b)."""
        cute.arch.mbarrier_wait(q_bar, tiles_before % 2)
        n_pairs = n_blocks // 2
        if cutlass.const_expr(wg == 0):
            for k in cutlass.range(n_pairs, unroll=1):
                self.seesaw_lead(k, True, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows, row_stats,
                                 span, n_blocks, first_row, base)
            if n_blocks % 2 == 1:
                self.seesaw_lead(n_pairs, False, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows,
                                 row_stats, span, n_blocks, first_row, base)
            self.seesaw_lead_end(ring, n_blocks, base[0])
        else:
            for k in cutlass.range(n_pairs, unroll=1):
                self.seesaw_follow(k, True, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows, row_stats,
                                   span, n_blocks, first_row, base)
            if n_blocks % 2 == 1:
                self.seesaw_follow(n_pairs, False, mmas, ring, handoffs, ops, acc_s, acc_o, r_p, softmax, stat_rows,
                                   row_stats, span, n_blocks, first_row, base)

    @cute.jit
    def seesaw_lead_end(self, ring: KvChunkRing, n_blocks, uses_before):
        """The leader after its last pair: its PV over the follower's P (sQ is overwritten next, and
        the last tile b's first half is freed here, as a pair's start frees the previous b's)."""
        warpgroup.wait_group(0)
        if n_blocks % 2 == 0:
            self.seesaw_release_b(ring, uses_before + n_blocks - 1)

    @cute.jit
    def seesaw_lead(self, k, has_b: cutlass.Constexpr[bool], mmas, ring: KvChunkRing, handoffs, ops, acc_s, acc_o, r_p,
                    softmax: OnlineSoftmax, stat_rows, row_stats, span: KvSpan, n_blocks, first_row, base=(0, 0)):
        """Warpgroup 0, pair k (tile a = visit 2k, tile b = visit 2k + 1, when ``has_b``):

            S_a = Q K_a[L]^T (group); [PV_bL of pair k - 1 done: release b's first half]
            S_a += Q K_a[R]^T (group); release a's second half; mask
            m_a = max(m, rowmax S_a) -> SMEM, hand over (handoff 0)      (the follower needs it)
            P_a = exp2(S_a - m_a); l = l r_a + sum P_a; O_L = O_L r_a + P_a V_a[:, L]   (RS)
            [PV_aL done: release a's first half]
            wait for handoff 1; [release b's second half]; m_b from SMEM; r_b = exp2(m_a - m_b); l *= r_b
            P_a r_b -> sP[0], hand over (handoff 2)                  (the follower's PV_aR)
            O_L *= r_b; O_L += P_b V_b[:, L]   (SS, P_b from sP[1])

        so that after the pair O_L, l and m are all at m_b, the follower's max. QK over a is
        issued half by half so that b's first half is freed as soon as the PV before it is done,
        not after a's second half has landed (the whole QK's issue waits for it): the producer
        loads a pair's halves in the order a.L, b.R, a.R, b.L, and b.L goes into that half, so
        freeing it after a.R landed made the follower, whose QK ends on b.L, wait for two loads
        in a row each pair (FlashMLA's leader frees it between its two QK groups too).

        ``base`` = (uses_before, rounds_before): the ring uses and handoff rounds of the CTA's
        earlier tiles (the persistent kernel); tile a is ring use uses_before + 2k, pair k is
        handoff round rounds_before + k. Every half
        of every use counts both warpgroups' releases (``seesaw_halves``), so the leader also frees
        b's second half, which it never reads, once the follower's handoff 1 says b has landed."""
        qk_mma, pv_mma, pv_own_mma = mmas
        t = 2 * k  # tile a's visit in this tile's span
        ta = base[0] + t  # its ring use
        rnd = base[1] + k
        tSrK = ops.tSrK[None, None, None, ta % self.slots]
        ring.gemm_qk(ta, qk_mma, acc_s, ops.tSrQ, tSrK, chunks=ring.r_chunk)
        if k > 0:  # pair k - 1's PV over P_b (issued before this QK) is done: b's slot is free to us
            warpgroup.wait_group(1)
            self.seesaw_release_b(ring, ta - 1)
        ring.gemm_qk(ta, qk_mma, acc_s, ops.tSrQ, tSrK, first_chunk=ring.r_chunk, chunks=ring.chunks - ring.r_chunk,
                     accumulate=True)
        warpgroup.wait_group(0)
        if t + 2 >= n_blocks:  # the last pair: this was the leader's last QK, sQ is read
            self.release_q(ops.q_empty)
        overlap = self.o_col1 < self.o_width
        if cutlass.const_expr(not overlap):  # only this QK read the second half of tile a
            ring.release(ta, 1)
        if t == 0:
            self.mask_s(span, acc_s, ops.tScS, span.visit_tile(t), first_row, first=True)
        else:
            self.mask_s(span, acc_s, ops.tScS, span.visit_tile(t), first_row, first=False)
        tile_max = softmax.tile_max(acc_s)
        self.publish_max(softmax.new_max(tile_max), stat_rows, row_stats, 0)
        handoffs[0].arrive()
        row_scale = softmax.update(acc_s, is_first=False, tile_max=tile_max)
        convert_p_packed(acc_s, r_p)
        scale_rows(acc_o, row_scale)
        gemm(pv_own_mma, acc_o, as_a_operand(r_p), ops.tOrV_own[None, None, None, ta % self.slots], zero_init=False)
        warpgroup.wait_group(0)  # PV_aL done: a's first half (and a top-k slot's list, read by the mask) is free
        ring.release(ta, 0)
        if cutlass.const_expr(overlap):
            ring.release(ta, 1)
        # the follower's max (in the last pair without b: the leader's own, r_b = 1)
        handoffs[1].wait(rnd)
        if cutlass.const_expr(has_b):  # the follower's QK waited for all of b: its second half is not ours
            ring.release(ta + 1, 1)
        row_scale = softmax.follow(self.read_max(stat_rows, row_stats, 1))
        scale_rows(acc_s, row_scale)
        store_p(acc_s, r_p, ops.tPsP[None, None, None, self.own_p_buffer(0)])  # r_p is free: its PV is done
        handoffs[2].arrive()
        scale_rows(acc_o, row_scale)
        if cutlass.const_expr(has_b):
            ring.wait_full(ta + 1, 0, self.o_width // CHUNK_COLS)  # the follower's QK waited for them
            gemm(pv_mma, acc_o, ops.tOrP_smem[None, None, None, self.own_p_buffer(1)],
                 ops.tOrV[None, None, None, (ta + 1) % self.slots], zero_init=False)

    @cute.jit
    def seesaw_follow(self, k, has_b: cutlass.Constexpr[bool], mmas, ring: KvChunkRing, handoffs, ops, acc_s, acc_o,
                      r_p, softmax: OnlineSoftmax, stat_rows, row_stats, span: KvSpan, n_blocks, first_row,
                      base=(0, 0)):
        """Warpgroup 1, pair k:

            S_b = Q K_b^T; mask; [release b's first half]; tile max    (while the leader works on a)
            wait for handoff 0; m_a from SMEM
            m_b = max(m_a, rowmax S_b); P_b = exp2(S_b - m_b); r = exp2(m - m_b); l = l r + sum P_b
            m_b -> SMEM, P_b -> sP[1], hand over (handoff 1)
            O_R = O_R r + P_b V_b[:, R]                  (RS)
            wait for handoff 2; O_R += (P_a r_b) V_a[:, R]   (SS, from sP[0])
            wait both PVs, release their halves

        Without b (the last pair of an odd count) the follower only adopts m_a (r = exp2(m - m_a))
        and adds P_a V_a[:, R]. ``base`` as the leader's; the follower also frees a's first half,
        which it never reads, as the pair starts (it must not be the later of the two arrivals: the
        next tile a's first half-load waits for them)."""
        qk_mma, pv_mma, pv_own_mma = mmas
        t_a = 2 * k  # this tile's visits
        t_b = t_a + 1
        use_a = base[0] + t_a  # their ring uses
        use_b = use_a + 1
        rnd = base[1] + k
        # a's first half: never read here, freed at once. The slot's previous use is done: the
        # follower passed the handoffs (or the epilogue) that follow the leader's release of it
        ring.release(use_a, 0)
        tile_max = None
        if cutlass.const_expr(not has_b):
            if n_blocks == 1:  # a one-tile span: the follower computes no S, never reads sQ
                self.release_q(ops.q_empty)
        if cutlass.const_expr(has_b):
            ring.gemm_qk(use_b, qk_mma, acc_s, ops.tSrQ, ops.tSrK[None, None, None, use_b % self.slots],
                         first_chunk=self.o_col1 // CHUNK_COLS)  # the half its producer loads first
            warpgroup.wait_group(0)
            if t_b + 2 >= n_blocks:  # the follower's last QK (b is the last or next-to-last tile)
                self.release_q(ops.q_empty)
            self.mask_s(span, acc_s, ops.tScS, span.visit_tile(t_b), first_row, first=False)
            ring.release(use_b, 0)  # after the mask: a top-k slot's staged list is read there
            tile_max = softmax.tile_max(acc_s)
        handoffs[0].wait(rnd)
        m_lead = self.read_max(stat_rows, row_stats, 0)
        if cutlass.const_expr(has_b):
            row_scale = softmax.update(acc_s, is_first=False, tile_max=tile_max, floor=m_lead)
        else:
            row_scale = softmax.follow(m_lead)
        self.publish_max(softmax.row_max, stat_rows, row_stats, 1)
        if cutlass.const_expr(has_b):
            store_p(acc_s, r_p, ops.tPsP[None, None, None, self.own_p_buffer(1)])  # r_p: also its RS operand
        handoffs[1].arrive()
        scale_rows(acc_o, row_scale)
        if cutlass.const_expr(has_b):
            gemm(pv_own_mma, acc_o, as_a_operand(r_p), ops.tOrV_own[None, None, None, use_b % self.slots],
                 zero_init=False)
        handoffs[2].wait(rnd)
        ring.wait_full(use_a, self.o_col1 // CHUNK_COLS, self.head_dim // CHUNK_COLS)  # the leader's QK waited
        gemm(pv_mma, acc_o, ops.tOrP_smem[None, None, None, self.own_p_buffer(0)],
             ops.tOrV[None, None, None, use_a % self.slots], zero_init=False)
        if cutlass.const_expr(has_b):
            warpgroup.wait_group(1)
            ring.release(use_b, 1)
        warpgroup.wait_group(0)
        ring.release(use_a, 1)

    @cute.jit
    def release_q(self, q_empty):
        """persistent: this thread's QKs, all waited for, have read sQ; every consumer thread arrives
        (no one-lane branch before the next wgmma: ptxas C7519), and the next tile's Q may land."""
        if cutlass.const_expr(q_empty is not None):
            cute.arch.mbarrier_arrive(q_empty)

    @cute.jit
    def seesaw_release_b(self, ring: KvChunkRing, t_b):
        """The leader's PV over tile b (its first half, and the overlap of the second) is done."""
        ring.release(t_b, 0)
        if cutlass.const_expr(self.o_col1 < self.o_width):
            ring.release(t_b, 1)

    @cute.jit
    def publish_max(self, m, stat_rows, row_stats, wg: int):
        """Row maxima m (exp2 domain) of this thread's rows -> SMEM slot wg (one lane per quad)."""
        if stat_rows[0, 0][1] == 0:
            for i in cutlass.range_constexpr(cute.size(m)):
                row_stats[stat_rows[i, 0][0], wg, 0] = m[i]

    @cute.jit
    def read_max(self, stat_rows, row_stats, wg: int) -> cute.Tensor:
        out = cute.make_rmem_tensor(cute.size(stat_rows, mode=[0]), cutlass.Float32)
        for i in cutlass.range_constexpr(cute.size(out)):
            out[i] = row_stats[stat_rows[i, 0][0], wg, 0]
        return out

    def make_pv_own_mma(self) -> cute.TiledMma:
        """seesaw: the PV MMA over a warpgroup's own P, from its registers (RS wgmma, stage C's
        trick: the QK accumulator's registers are the A fragment), 64 x width x 16."""
        return make_pv_tiled_mma(self.dtype, self.o_width, warpgroups=1)

    def seesaw_halves(self):
        """seesaw: the warps that free each half of a tile in an even and an odd ring slot: all eight,
        in both. Half 0 = chunks [0, c_1 / 64), read by the QK of the warpgroup that computes the
        tile's S and by warpgroup 0's PV; half 1 = the rest, by that QK and warpgroup 1's PV. The
        warpgroup that reads neither half (the follower for tile a's first, the leader for b's
        second) frees it too, after a handoff that follows the other warpgroup's wait for that
        use's landing. So the count does not depend on which warpgroup's S a slot holds, and a
        persistent CTA's next tile may start its ring uses at either parity (an odd tile count
        leaves the next tile's a in an odd slot)."""
        warps = THREADS_PER_WARPGROUP // 32  # of one warpgroup
        return ((2 * warps, 2 * warps), (2 * warps, 2 * warps))
