"""A ring of K = V tiles on SM90 whose tiles land in 64-column chunks, each with its own
`full` barrier, so the QK GEMM of a tile starts on its first chunk while the rest stream in.

Why (stage D1, K = V at head dim 512): one KV tile serves QK(n) and, a tile later, PV(n);
QK(n) and PV(n + 1) are in flight together, so the ring holds two tiles, and at head dim
512 two is all that fits beside Q. Tile n - 1 can then only be loaded once PV(n + 1) has
released its slot, and with one barrier per tile the next QK waits for all 64 KiB. With a
barrier per 64-column chunk (8 KiB at 64 keys), QK(n - 1)'s k-steps over chunk c wait only
for chunk c: the load of the later chunks overlaps the GEMM on the earlier ones.

Barriers (mbarriers in SMEM; slot s of the ring, tile use t of the ring: s = t % slots,
phase = (t // slots) & 1):

    full[s, c]   arrive count 1: the producer's arrive_and_expect_tx(chunk bytes); the TMA
                 of chunk c completes the transaction. Consumers wait (phase) before the
                 k-steps that read chunk c. Stage E's top-k gather: arrive count 128, one per
                 producer thread (its cp.async rows' cp.async.mbarrier.arrive.noinc), or for a
                 TMA tile one expect_tx and one arrive of count 128.
    empty[s]     arrive count = consumer warps: lane 0 of each consumer warp arrives once
                 the wgmma that read the slot last (PV) has completed. Where the threads also
                 read the slot's SMEM themselves (stage E's staged top-k lists), every consumer
                 thread arrives (count = consumer threads): an arrive releases its own thread's
                 reads only. The producer waits
                 (phase ^ 1: the first use of every slot passes at once) before loading.
    empty[s, h]  with ``halves`` (stage D1's seesaw): two empties per slot, h = 0 guarding
                 chunks [0, r_chunk) (and a top-k slot's staged list), h = 1 chunks
                 [r_chunk, chunks); each counts the warps that read that half of a tile in
                 slot s (``halves[s % 2][h]``: the seesaw's slot parity is the warpgroup that
                 computes the tile's S). Such a ring is loaded one half at a time, each load
                 waiting for its own half, so the next tile's first chunks land while the
                 last PV that reads the second half still runs.

Chunk c of slot s is the (tile_n, 64) block at columns 64 c of the slot's (tile_n, d) tile
in ``common.sm90_gemm.make_tile_smem_layout`` (the layout the QK and PV views read); the
TMA atom moves one (tile_n, 64) box.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from dsv4_attention.common.dsl_state import DslState
from dsv4_attention.common.sm90_gemm import tile_tma_partition

CHUNK_COLS = 64  # one 128-byte swizzle row of 16-bit elements


class KvChunkRing(DslState):
    def __init__(self, full: cute.Pointer, empty: cute.Pointer, slots: int, chunks: int, chunk_bytes: int,
                 consumer_warps: int, full_arrivals: int = 1, lanes_read_slot: bool = False,
                 halves: tuple | None = None, r_chunk: int = 0):
        self.full = full
        # halves: ((warps reading half 0, half 1) of an even slot, (...) of an odd slot), or None
        self.halves = halves
        self.r_chunk = r_chunk if halves is not None else 0
        self.lanes_read_slot = lanes_read_slot
        self.full_arrivals = full_arrivals
        self.empty = empty
        self.slots = slots
        self.chunks = chunks
        self.chunk_bytes = chunk_bytes
        self.consumer_warps = consumer_warps

    # DSL control flow carries the object through its two barrier pointers (the rest is static)
    _DYNAMIC = ("full", "empty")

    @staticmethod
    def barrier_count(slots: int, chunks: int, halves: bool = False) -> tuple[int, int]:
        """(full, empty) mbarriers a ring needs."""
        return slots * chunks, slots * (2 if halves else 1)

    def empty_halves(self) -> int:
        return 1 if self.halves is None else 2

    def empty_count(self, s: int, h: int) -> int:
        """Arrivals that free half h of slot s (the whole slot without halves)."""
        warps = self.consumer_warps if self.halves is None else self.halves[s % 2][h]
        return warps * (32 if self.lanes_read_slot else 1)

    def empty_bar(self, s, h: int = 0):
        return self.empty + (s * self.empty_halves() + h)

    def chunk_range(self, half: int | None = None) -> range:
        """The chunks one load covers: the whole tile (``half`` None, a ring without halves), or
        half h of a halved ring, which is loaded half by half (each half has its own empty)."""
        if half is None:
            if self.halves is not None:
                raise ValueError("a ring with halves is loaded one half at a time")
            return range(self.chunks)
        return range(self.r_chunk) if half == 0 else range(self.r_chunk, self.chunks)

    @cute.jit
    def wait_load(self, t: cutlass.Int32, half: int | None = None):
        """Producer, before a load of tile use t (the whole tile, or its half ``half``): wait until
        the previous use of the slot released what this load overwrites."""
        phase = (t // self.slots) & 1
        cute.arch.mbarrier_wait(self.empty_bar(t % self.slots, 0 if half is None else half), phase ^ 1)

    @cute.jit
    def wait_full(self, t: cutlass.Int32, first_chunk: int, end_chunk: int):
        """Consumer: wait until chunks [first_chunk, end_chunk) of tile use t have landed (a
        warpgroup that reads a tile another warpgroup's QK already waited for)."""
        s = t % self.slots
        phase = (t // self.slots) & 1
        for c in cutlass.range_constexpr(first_chunk, end_chunk):
            cute.arch.mbarrier_wait(self.full + (s * self.chunks + c), phase)

    @cute.jit
    def init(self):
        """One thread initialises every barrier (the caller fences and syncs the CTA)."""
        for i in cutlass.range_constexpr(self.slots * self.chunks):
            cute.arch.mbarrier_init(self.full + i, self.full_arrivals)
        for s in cutlass.range_constexpr(self.slots):
            for h in cutlass.range_constexpr(self.empty_halves()):
                cute.arch.mbarrier_init(self.empty_bar(s, h), self.empty_count(s, h))

    @cute.jit
    def load(self, t: cutlass.Int32, tma_atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor,
             n_block: cutlass.Int32, half: int | None = None):
        """Producer (one warp): tile use t <- KV tile n_block (with halves: only half ``half``
        when given, after waiting for it). ``src`` (atom, tiles, chunks) and ``dst`` (atom, 1,
        chunks, slots) are the TMA partitions of the chunked global and SMEM views."""
        s = t % self.slots
        chunks = self.chunk_range(half)
        self.wait_load(t, half)
        for c in cutlass.range_constexpr(chunks.start, chunks.stop):
            bar = self.full + (s * self.chunks + c)
            with cute.arch.elect_one():
                if cutlass.const_expr(self.full_arrivals == 1):
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, self.chunk_bytes)
                else:  # the gathering producer's barriers: this one arrival stands for every producer thread
                    cute.arch.mbarrier_expect_tx(bar, self.chunk_bytes)
                    cute.arch.mbarrier_arrive(bar, arrive_count=self.full_arrivals)
            cute.copy(tma_atom, src[None, n_block, c], dst[None, 0, c, s], tma_bar_ptr=bar)

    @cute.jit
    def release(self, t: cutlass.Int32, half: int = 0):
        """Consumer (every thread of every consumer warp calls it): tile use t's slot (with
        halves: its half ``half``) is free.
        ``lanes_read_slot`` (stage E top-k: the masks read the slot's staged list with ordinary
        loads): every thread arrives, since an arrive releases only its own thread's reads (the
        PTX memory model; racecheck flags a lane-0 release, with or without a warp sync)."""
        if cutlass.const_expr(self.lanes_read_slot):
            cute.arch.mbarrier_arrive(self.empty_bar(t % self.slots, half))
        elif cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(self.empty_bar(t % self.slots, half))

    @cute.jit
    def gemm_qk(self, t: cutlass.Int32, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor,
                tCrB: cute.Tensor, first_chunk: int = 0, chunks: int | None = None, accumulate: bool = False):
        """Issue acc (+)= A B as one wgmma group over tile use t's slot (``tCrB`` already indexed
        by slot), waiting for chunk c's barrier before the k-steps that read it. The k-steps run
        over ``chunks`` chunks (all by default) from chunk ``first_chunk`` on, wrapping around (the
        seesaw's follower starts on the half its producer loads first); ``accumulate`` adds to acc
        (the second group of a QK issued half by half, the seesaw's leader)."""
        s = t % self.slots
        phase = (t // self.slots) & 1
        k_steps = cute.size(tCrA, mode=[2])
        per_chunk = k_steps // self.chunks
        n_steps = k_steps if chunks is None else chunks * per_chunk
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, accumulate)
        for i in cutlass.range_constexpr(n_steps):
            k = (i + first_chunk * per_chunk) % k_steps
            if cutlass.const_expr(k % per_chunk == 0):
                cute.arch.mbarrier_wait(self.full + (s * self.chunks + k // per_chunk), phase)
            cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()


def gather_offset(row, unit, chunk, slot, tile_n: int, head_dim: int):
    """Element offset in the ring of the 16-byte unit ``unit`` (columns 8 unit .. 8 unit + 7) of
    chunk ``chunk`` of row ``row`` of slot ``slot``: where a thread gathering that row by cp.async
    writes it. The ring's layout, written out: slot s is tile_n x head_dim; chunk c (columns
    64 c ..) is a (tile_n, 64) K-major block of tile_n 128-byte rows; the 128B swizzle moves unit u
    of row r to unit u ^ (r % 8). Proven against ``make_tile_smem_layout`` on the host
    (tests/test_e_sm90_host.py)."""
    return slot * tile_n * head_dim + chunk * tile_n * CHUNK_COLS + row * CHUNK_COLS + (unit ^ (row % 8)) * 8


def chunk_views(tma_atom: cute.CopyAtom, gKV: cute.Tensor, sKV: cute.Tensor, tile_n: int):
    """TMA partitions of one (kv head, batch)'s (seqlen, d) tensor cut into (tile_n, 64)
    chunks, (atom, tiles, chunks), and of the ring (tile_n, d, slots) cut the same way,
    (atom, 1, chunks, slots)."""
    g = cute.local_tile(gKV, (tile_n, CHUNK_COLS), (None, None))  # (tile_n, 64, tiles, chunks)
    s = cute.flat_divide(sKV, (tile_n, CHUNK_COLS))  # (tile_n, 64, 1, chunks, slots)
    return tile_tma_partition(tma_atom, s, g)
