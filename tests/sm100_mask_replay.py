"""The sm100 softmax warps' masking of one Q tile, replayed on the host (shared by the D4 and E
host proofs): a host function compiled for sm_100a and run on the CPU that builds the kernel's
span (``kv_span``; stage E's with its compressed entries) and, for each of the 128 softmax threads,
its TMEM row partition (``s_row_load``), its row's visible keys (``row_keys``) and its masking of
every visit (``mask_s_row``) on a row of zeros: out[thread, visit, value] (0 kept, -inf hidden),
coords[thread, value] = (row, column) in the tile, info = (origin, n_tiles, n_cmp). With
``positions``, the span takes the query tokens' absolute positions (a 1-D int32 tensor)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import seam_calls
import torch
from cutlass import Float32, Int32

from dsv4_attention.common.tmem import EPI_THREADS

#: visits a host run records (every case of the proofs visits fewer)
MAX_VISITS = 16


def run_buffers(tile_n: int):
    return (torch.zeros(EPI_THREADS, MAX_VISITS, tile_n), torch.zeros(EPI_THREADS, tile_n, 2, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


def thread_replayer(kernel):
    """A DSL function (called while a host function is traced): every softmax thread's masking of
    every visit of ``span``'s tiles into ``out`` / ``coords``, as the kernel runs it."""
    from dsv4_attention.common.tmem import placeholder_tmem_base

    @cute.jit
    def replay_threads(span, m_blk: Int32, out: cute.Tensor, coords: cute.Tensor):
        for t in cutlass.range(EPI_THREADS, unroll=1):
            _, _, tTR_cS = kernel.s_row_load(placeholder_tmem_base(), t)
            keys = kernel.row_keys(span, m_blk, tTR_cS)
            s_row = cute.make_rmem_tensor(tTR_cS.shape, Float32)
            for i in cutlass.range_constexpr(cute.size(s_row)):
                coords[t, i, 0] = tTR_cS[i][0]
                coords[t, i, 1] = tTR_cS[i][1]
            for it in cutlass.range(cutlass.min(span.n_tiles, MAX_VISITS), unroll=1):
                s_row.fill(0.0)
                kernel.mask_s_row(s_row, tTR_cS, span, keys, it)
                for i in cutlass.range_constexpr(cute.size(s_row)):
                    out[t, it, i] = s_row[i]

    return replay_threads


def build_mask_runner(kernel, positions: bool = False):
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common.arch import GPU_ARCH, target_arch

    compressed = bool(getattr(kernel, "has_compressed", False))
    replay_threads = thread_replayer(kernel)

    @cute.jit
    def host(out: cute.Tensor, coords: cute.Tensor, info: cute.Tensor, seqused: cute.Tensor, m_blk: Int32,
             rows: Int32, seqlen_k: Int32, left: Int32, right: Int32, ratio: Int32, n_compressed: Int32,
             kv_start: Int32, pos: cute.Tensor):
        # as the kernel: request 0's keys, the Q tile's span, then per softmax thread its partition
        keys_k = kernel.kv_length(seqused, 0, seqlen_k)
        pos_row = None
        if cutlass.const_expr(positions):
            pos_row = pos
        if cutlass.const_expr(compressed):
            span = seam_calls.span(kernel, m_blk, rows, keys_k, left, right, ratio, n_compressed, None, kv_start,
                                   pos_row)
            info[2] = span.n_cmp
        else:
            span = seam_calls.span(kernel, m_blk, rows, keys_k, left, right)
            info[2] = 0
        info[0] = span.origin
        info[1] = span.n_tiles
        replay_threads(span, m_blk, out, coords)

    bufs = run_buffers(kernel.plan.tile_n)
    with target_arch("sm100"):
        return cute.compile(host, *[from_dlpack(b) for b in bufs], *[Int32(x) for x in (0, 1, 1, 0, 0, 4, 1, 0)],
                            from_dlpack(torch.zeros(4, dtype=torch.int32)), options=f"--gpu-arch={GPU_ARCH['sm100']}")


def replay(fn, tile_n: int, m_blk: int, rows: int, seqlen_k: int, seqused: int, left, right, ratio: int = 4,
           n_compressed: int = 0, kv_start: int = 0, positions=None):
    """Run a ``build_mask_runner`` function: (out, coords, (origin, n_tiles, n_cmp))."""
    from cutlass.cute.runtime import from_dlpack

    out, coords, info, su = run_buffers(tile_n)
    su[0] = seqused
    fn(*[from_dlpack(b) for b in (out, coords, info, su)],
       *[Int32(x) for x in (m_blk, rows, seqlen_k, 0 if left is None else left, 0 if right is None else right, ratio,
                            n_compressed, kv_start)],
       from_dlpack(torch.tensor([0] if positions is None else positions, dtype=torch.int32)))
    return out, coords, tuple(info.tolist())


def mismatches(m_blk, span, kept: dict, want: set) -> list:
    """What a Q tile's kept pairs (each with how often it was kept) get wrong against ``want``."""
    twice = sorted(p for p, n in kept.items() if n > 1)
    extra = sorted(set(kept) - want, key=str)
    missing = sorted(want - set(kept), key=str)
    return [f"m_blk {m_blk} span {span}: {len(pairs)} {what}, e.g. {pairs[:3]}"
            for what, pairs in (("held twice", twice), ("kept but hidden", extra), ("visible but masked", missing))
            if pairs]
