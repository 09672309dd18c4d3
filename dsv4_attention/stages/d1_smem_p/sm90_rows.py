"""Stage D1's row-split schedule on Hopper (the non-persistent grid, one Q tile a CTA): stage C's
lock-step consumers, with O's columns split between the warpgroups from head dim 320 on.

Three layouts of the consumer warpgroups: ``rows`` (head dim <= 256: warpgroup w owns Q rows
[64 w, 64 w + 64)), ``split`` (both warpgroups own the same 64 rows and split O's columns), and
the persistent seesaw, which lives in sm90_seesaw.py. KV tiles are visited last first, the next
QK overlapping the softmax; with pingpong the warpgroups take turns at the tensor cores
(common/sm90_barriers.PingPong).
"""


import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import warpgroup

from dsv4_attention.common.p_staging import as_a_operand
from dsv4_attention.common.sm90_barriers import PingPong, pingpong_start
from dsv4_attention.common.sm90_gemm import (
    THREADS_PER_WARPGROUP,
    gemm,
)
from dsv4_attention.common.softmax import OnlineSoftmax, acc_rows_view, scale_rows
from dsv4_attention.stages.d1_smem_p.sm90_operands import ConsumerOperands


class RowSplitSchedule(PingPong):
    """The row-split schedule's consumer loop, mixed into stage D1's sm90 kernel class."""

    @cute.jit
    def consume(self, c: ConsumerOperands, pipeline_k, pipeline_v, n_blocks: cutlass.Int32):
        qk_mma, pv_mma, span, m_block = c.qk_mma, c.pv_mma, c.span, c.m_block
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        views = self.warpgroup_views(wg, tidx, qk_mma, pv_mma, c.sQ, c.sK, c.sVt, c.sP)
        tSrQ, tSrK, tOrV, tOrP_smem, tPsP, tScS, thr_qk, thr_pv = views

        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.qk_rows(), self.wg_keys)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.qk_rows(), self.o_width)))
        r_p = cute.make_rmem_tensor(acc_s.layout, self.dtype)  # P, 16-bit, laid out like S
        tOrP = as_a_operand(r_p)
        softmax = OnlineSoftmax(acc_s.layout, c.scale_log2, may_be_empty=self.may_hide_rows())
        o_scale = cute.make_rmem_tensor(cute.size(softmax.row_max), cutlass.Float32)
        # split: this thread's rows within the 64 shared rows, and whether it writes them
        stat_rows = acc_rows_view(tScS)

        if cutlass.const_expr(self.pingpong):
            pingpong_start(wg)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.slots)
        p_buf = n_blocks - 1  # sP buffer = tile index mod p_buffers

        # ---- first tile (n_blocks - 1, holds the last key) ---------------------------
        t = cutlass.Int32(0)  # K = V: tile use of the ring (tile n_blocks - 1 - t)
        cute.arch.mbarrier_wait(c.q_bar, 0)
        if cutlass.const_expr(self.kv_shared):
            pipeline_k.gemm_qk(t, qk_mma, acc_s, tSrQ, tSrK[None, None, None, 0])
        else:
            pipeline_k.consumer_wait(state)
            gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        warpgroup.wait_group(0)
        if cutlass.const_expr(not self.kv_shared):
            pipeline_k.consumer_release(state)
        self.mask_s(span, acc_s, tScS, n_blocks - 1, m_block * self.tile_m, first=True)
        softmax.update(acc_s, is_first=True, tile_max=self.tile_max(softmax, acc_s, stat_rows, c.row_stats, wg))
        self.stage_p(acc_s, r_p, tPsP, p_buf, wg)
        acc_o.fill(0.0)
        o_scale.fill(1.0)

        # ---- every further tile: QK(n) and PV(n + 1) in flight, then softmax(n) --------
        for i in cutlass.range(n_blocks - 1, unroll=1):
            v_state = state.clone()
            t_v = t
            if cutlass.const_expr(self.kv_shared):
                t = t + 1
                self.scheduler_wait(wg)
                pipeline_k.gemm_qk(t, qk_mma, acc_s, tSrQ, tSrK[None, None, None, t % self.slots])
            else:
                state.advance()
                pipeline_k.consumer_wait(state)
                self.scheduler_wait(wg)
                gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
            if cutlass.const_expr(self.rescale_o_before_pv):
                scale_rows(acc_o, o_scale)
            if cutlass.const_expr(self.kv_shared):
                self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, t_v % self.slots, p_buf)
            else:
                pipeline_v.consumer_wait(v_state)
                self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, v_state.index, p_buf)
            self.scheduler_pass(wg)
            warpgroup.wait_group(1)  # S(n) complete; PV may still run
            if cutlass.const_expr(not self.kv_shared):
                pipeline_k.consumer_release(state)
            self.mask_s(span, acc_s, tScS, n_blocks - 2 - i, m_block * self.tile_m, first=False)
            row_scale = softmax.update(
                acc_s, is_first=False, tile_max=self.tile_max(softmax, acc_s, stat_rows, c.row_stats, wg)
            )
            warpgroup.wait_group(0)  # PV(n + 1) complete: P, O and the V slot are free
            if cutlass.const_expr(self.kv_shared):
                pipeline_k.release(t_v)
            else:
                pipeline_v.consumer_release(v_state)
            p_buf = p_buf - 1
            self.stage_p(acc_s, r_p, tPsP, p_buf, wg)
            if cutlass.const_expr(self.rescale_o_before_pv):
                o_scale.store(row_scale.load())
            else:
                scale_rows(acc_o, row_scale)

        # ---- last PV (tile 0) -------------------------------------------------------
        if cutlass.const_expr(self.rescale_o_before_pv):
            scale_rows(acc_o, o_scale)
        if cutlass.const_expr(self.kv_shared):
            self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, t % self.slots, p_buf)
            warpgroup.wait_group(0)
            pipeline_k.release(t)
        else:
            pipeline_v.consumer_wait(state)
            self.pv(pv_mma, acc_o, tOrP, tOrP_smem, tOrV, state.index, p_buf)
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(state)

        self.epilogue(c, acc_o, softmax, stat_rows, tScS, thr_pv, wg, tidx)
