"""The QK GEMM main loop on Blackwell (SM100), shared by the stages that compute S = Q K^T.

One 128 x 128 tile of S accumulates in TMEM (fp32, ``common.tmem``) over the head dim, consumed
in k-blocks of K_BLOCK = 64 elements: 128 bytes of 16-bit data, one 128B-swizzle atom wide, so
any head dim up to 512 fits SMEM through a ring of stages. Each k-block is one stage of a
``PipelineTmaUmma``:

    TMA warp  acquire stage s (empty[s] free; full[s] expects the Q + K bytes of a stage), issue
              the TMA loads of k-block kb of Q's and K's row tiles onto full[s]. TMA zero-fills
              rows past the sequence ends and still counts the whole box: the byte count is fixed.
    MMA warp  wait full[s], issue K_BLOCK / 16 tcgen05.mma (SS: Q and K K-major in SMEM) into the
              accumulator, the first one with accumulate off (zero-initialises it); optionally
              tcgen05.commit -> empty[s] to hand the stage back (needed when the ring wraps).

SMEM per stage and operand: 128 rows x 64 elements, K-major, 128B swizzle (atom 8 rows x 128 B,
Swizzle<3,4,3>): S<3,4,3> o ((128,16),1,4,STAGES):((64,1),0,16,8192), 16 KiB, 1024-byte aligned.

Kernels that stream many K tiles (stage C on) keep whole tiles instead: ``qk_tile_tiler(head_dim)``
as the tiler gives one 128 x head_dim block per stage, ((128,16),1,(4,D/64),STAGES) with the
64-element swizzle atoms side by side, and ``issue_qk_tile`` issues one tile's head_dim / 16 MMAs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from dsv4_attention.common.tmem import QK_TILE_M, QK_TILE_N

#: head-dim elements per k-block (pipeline stage): 128 bytes of 16-bit data, one SW128 atom
K_BLOCK = 64
#: the MMA tiler of one k-block: (M, N, K)
QK_MMA_TILER = (QK_TILE_M, QK_TILE_N, K_BLOCK)


def qk_tile_tiler(head_dim: int):
    """The MMA tiler of a whole 128 x 128 S tile over the full head dim, (M, N, K = head_dim):
    for kernels that keep a whole Q / K tile per stage instead of k-blocks (stage C on)."""
    return (QK_TILE_M, QK_TILE_N, head_dim)


def make_qk_smem_layouts(tiled_mma: cute.TiledMma, dtype, num_stages: int, tiler=QK_MMA_TILER, k_stages=None):
    """(q_smem, k_smem): the staged SMEM layouts of Q and K, ``(MMA, MMA_M/N, MMA_K, STAGE)``, one
    ``tiler`` (M, N, K) block per stage: a k-block (the default) or a whole tile (``qk_tile_tiler``).
    ``k_stages`` gives K its own stage count (default: ``num_stages``)."""
    q_smem = sm100_utils.make_smem_layout_a(tiled_mma, tiler, dtype, num_stages)
    k_smem = sm100_utils.make_smem_layout_b(tiled_mma, tiler, dtype, num_stages if k_stages is None else k_stages)
    return q_smem, k_smem


def make_qk_tma_atoms(tiled_mma: cute.TiledMma, q: cute.Tensor, k: cute.Tensor, q_smem, k_smem, dtype,
                      tiler=QK_MMA_TILER):
    """TMA loads of one ``tiler`` block (a k-block by default) of Q's and of K's row tile, for
    ``q`` / ``k`` in the (seqlen, head_dim, heads, batch) view. Returns (tma_atom_q, tma_q,
    tma_atom_k, tma_k, stage_bytes), stage_bytes being one Q block's plus one K block's bytes."""
    q_stage = cute.select(q_smem, mode=[0, 1, 2])
    k_stage = cute.select(k_smem, mode=[0, 1, 2])
    op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
    tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_A(op, q, q_stage, tiler, tiled_mma)
    tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(op, k, k_stage, tiler, tiled_mma)
    stage_bytes = cute.size_in_bytes(dtype, q_stage) + cute.size_in_bytes(dtype, k_stage)
    return tma_atom_q, tma_q, tma_atom_k, tma_k, stage_bytes


@cute.jit
def load_qk_kblocks(
    tiled_mma: cute.TiledMma,
    tma_atom_q: cute.CopyAtom,
    gQ: cute.Tensor,
    sQ: cute.Tensor,
    tma_atom_k: cute.CopyAtom,
    gK: cute.Tensor,
    sK: cute.Tensor,
    producer,
    num_k_blocks: cutlass.Constexpr[int],
):
    """TMA warp: k-blocks 0 .. num_k_blocks - 1 of the tiles ``gQ`` / ``gK`` ((128, 64, KB) views
    of the TMA tensors, ``local_tile`` with QK_MMA_TILER) into the stages of ``sQ`` / ``sK``,
    through the ``PipelineTmaUmma`` producer ``producer``. Returns the advanced producer: a
    helper's rebinds do not reach its caller, so a caller that goes on using the producer (its
    ``tail()``) must take this one."""
    thr_mma = tiled_mma.get_slice(0)
    # ((atom_v, rest_v), STAGE) and ((atom_v, rest_v), KB)
    tQsQ, tQgQ = cpasync.tma_partition(
        tma_atom_q,
        0,
        cute.make_layout(1),
        cute.group_modes(sQ, 0, 3),
        cute.group_modes(thr_mma.partition_A(gQ), 0, 3),
    )
    tKsK, tKgK = cpasync.tma_partition(
        tma_atom_k,
        0,
        cute.make_layout(1),
        cute.group_modes(sK, 0, 3),
        cute.group_modes(thr_mma.partition_B(gK), 0, 3),
    )
    for kb in cutlass.range(num_k_blocks, unroll=1):
        stage = producer.acquire_and_advance()  # empty[s] free, full[s] expects the bytes
        cute.copy(tma_atom_q, tQgQ[None, kb], tQsQ[None, stage.index], tma_bar_ptr=stage.barrier)
        cute.copy(tma_atom_k, tKgK[None, kb], tKsK[None, stage.index], tma_bar_ptr=stage.barrier)
    return producer


@cute.jit
def issue_qk_mmas(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    sQ: cute.Tensor,
    sK: cute.Tensor,
    consumer,
    num_k_blocks: cutlass.Constexpr[int],
    release_stages: cutlass.Constexpr[bool],
):
    """MMA warp: acc = Q K^T over ``num_k_blocks`` k-blocks, each waited for on the
    ``PipelineTmaUmma`` consumer ``consumer``; with ``release_stages`` each stage is handed back
    (tcgen05.commit -> empty[s]) once its MMAs have read it. The caller commits the accumulator.
    Returns the advanced consumer (see ``load_qk_kblocks``)."""
    # (MMA, MMA_M/N, MMA_K, STAGE) SMEM descriptors
    tCrQ = tiled_mma.make_fragment_A(sQ)
    tCrK = tiled_mma.make_fragment_B(sK)
    num_k_phases = cute.size(tCrQ, mode=[2])
    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
    for _kb in cutlass.range(num_k_blocks, unroll=1):
        stage = consumer.wait_and_advance()
        for kp in cutlass.range_constexpr(num_k_phases):
            coord = (None, None, kp, stage.index)
            cute.gemm(tiled_mma, acc, tCrQ[coord], tCrK[coord], acc)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
        if const_expr(release_stages):
            stage.release()  # tcgen05.commit -> empty[s] once these MMAs have read SMEM
    return consumer


@cute.jit
def issue_qk_tile(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrQ: cute.Tensor, tCrK: cute.Tensor):
    """MMA warp: acc = Q K^T for one whole tile, ``tCrQ`` / ``tCrK`` being one stage's SMEM
    descriptors ``(MMA, MMA_M/N, MMA_K)`` over the full head dim: head_dim / 16 tcgen05.mma, the
    first with accumulate off (it zero-initialises acc). The caller waits for the operands and
    commits the accumulator."""
    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
    for kp in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):
        cute.gemm(tiled_mma, acc, tCrQ[None, None, kp], tCrK[None, None, kp], acc)
        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
