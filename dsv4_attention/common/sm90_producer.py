"""The TMA producer of the SM90 attention kernels (stage C on): one warp loads Q once and the
K and V tiles of one (kv head, batch) in the order the consumers need them.

KV tiles are visited from the last (the one holding key seqlen_k - 1, the only one with keys
past seqlen_k) down to 0. The consumers compute QK(n) while PV(n + 1) runs, so they need K[n]
and V[n + 1] together; with K and V on separate rings (``PipelineTmaAsync``, ``stages`` slots
each, K[n] and V[n] in the same slot index) the loads go

    K[L], Q, (K[L-1], V[L]), (K[L-2], V[L-1]), ..., (K[0], V[1]), V[0]         L = n_blocks - 1

Each acquire waits for the slot's `empty` barrier (released by the consumers after the wgmma
that read it completed); each copy completes the slot's `full` barrier transaction. Rows past
seqlen are zero-filled by TMA and still count their bytes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline


@cute.jit
def load_q(q_bar: cute.Pointer, tma_atom_q: cute.CopyAtom, tQgQ: cute.Tensor, tQsQ: cute.Tensor,
           m_block: cutlass.Int32, q_bytes: cutlass.Constexpr[int]):
    """Q tile m_block -> the one Q buffer; q_bar (one phase) completes when it landed."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(q_bar, q_bytes)
    cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, 0], tma_bar_ptr=q_bar)


@cute.jit
def load_q_k_v(
    q_bar: cute.Pointer,
    pipeline_k: pipeline.PipelineTmaAsync,
    pipeline_v: pipeline.PipelineTmaAsync,
    stages: cutlass.Constexpr[int],
    n_blocks: cutlass.Int32,
    m_block: cutlass.Int32,
    q_bytes: cutlass.Constexpr[int],
    tma_atom_q: cute.CopyAtom, tQgQ: cute.Tensor, tQsQ: cute.Tensor,
    tma_atom_k: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor,
    tma_atom_v: cute.CopyAtom, tVgV: cute.Tensor, tVsV: cute.Tensor,
):
    """The whole load sequence above (the producer warp calls it once per CTA)."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    n_last = n_blocks - 1
    pipeline_k.producer_acquire(state)
    cute.copy(tma_atom_k, tKgK[None, n_last], tKsK[None, state.index],
              tma_bar_ptr=pipeline_k.producer_get_barrier(state))
    load_q(q_bar, tma_atom_q, tQgQ, tQsQ, m_block, q_bytes)

    for i in cutlass.range(n_last, unroll=1):
        n = n_last - 1 - i
        v_state = state.clone()
        state.advance()
        pipeline_k.producer_acquire(state)
        cute.copy(tma_atom_k, tKgK[None, n], tKsK[None, state.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(state))
        pipeline_v.producer_acquire(v_state)
        cute.copy(tma_atom_v, tVgV[None, n + 1], tVsV[None, v_state.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))

    pipeline_v.producer_acquire(state)
    cute.copy(tma_atom_v, tVgV[None, 0], tVsV[None, state.index],
              tma_bar_ptr=pipeline_v.producer_get_barrier(state))
