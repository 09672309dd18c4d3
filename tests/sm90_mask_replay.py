"""The sm90 consumer warpgroups' masking of one Q tile, replayed on the host (shared by the D4 and E
host proofs): a DSL function, called while a host function for sm_90a is traced and then run on the
CPU, that takes the kernel's own QK partition (``make_mmas``, ``s_coords``) and per-visit mask
(``mask_s``: the first visit always, later ones where the span says a tile straddles an edge) over
every consumer thread and every visit of a span, on accumulators of zeros. A value left at 0 is a
(row, key) the kernel keeps, one at -inf a pair it hides."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from dsv4_attention.common.sm90_gemm import THREADS_PER_WARPGROUP

#: visits a host run records (every case of the proofs visits fewer)
MAX_VISITS = 24


def pair_mismatch(kept: dict, want: set) -> str | None:
    """None where the kept pairs ({pair: times kept}) are exactly ``want``, each once; else what
    differs (a few pairs of each kind)."""
    twice = [p for p, c in kept.items() if c != 1]
    if set(kept) == want and not twice:
        return None
    return f"extra {sorted(set(kept) - want)[:3]} missing {sorted(want - set(kept))[:3]} twice {twice[:3]}"


def kept_keys(out: torch.Tensor, coords: torch.Tensor, n_tiles: int, key_of) -> dict:
    """{key: times kept} over the kept values (0) of a replay's visits 0 .. n_tiles - 1 (visit it
    holds tile n_tiles - 1 - it): ``key_of(n, row, col)`` names the pair tile row ``row`` and
    column ``col`` of tile n stand for, or None for a value not counted (a padding row)."""
    assert bool(torch.all((out[:, :n_tiles] == 0) | (out[:, :n_tiles] == -float("inf")))), \
        "a value neither kept nor -inf"
    kept = {}
    for it in range(n_tiles):
        n = n_tiles - 1 - it
        t_idx, v_idx = torch.nonzero(out[:, it, :] == 0, as_tuple=True)
        for t, v in zip(t_idx.tolist(), v_idx.tolist(), strict=True):
            key = key_of(n, *coords[t, v].tolist())
            if key is not None:
                kept[key] = kept.get(key, 0) + 1
    return kept


def masking_first_tile_only(kernel_cls):
    """Wrong on purpose (a negative control): ``kernel_cls`` masking only the first tile it visits,
    as if no later tile could straddle an edge (a left window, compressed entries)."""

    class FirstOnly(kernel_cls):
        def masks_inner_tiles(self):
            return False

    return FirstOnly


def values_per_thread(kernel) -> int:
    """S values a consumer thread holds of a tile: the seesaw's warpgroup holds the whole tile,
    the other layouts' threads share it."""
    return kernel.tile_m * kernel.tile_n // (THREADS_PER_WARPGROUP if kernel.seesaw else kernel.consumer_threads)


def replay_buffers(kernel) -> tuple:
    """(out, coords): zeroed buffers for ``mask_replayer``'s run, out[thread, visit, value] and
    coords[thread, value] = (row, column)."""
    threads, vals = kernel.consumer_threads, values_per_thread(kernel)
    return torch.zeros(threads, MAX_VISITS, vals), torch.zeros(threads, vals, 2, dtype=torch.int32)


def compile_replay(host, kernel, info_len: int, n_ints: int, *extra: torch.Tensor) -> tuple:
    """(fn, bufs): ``host`` compiled for sm90 on the host, taking the replay buffers, an int32
    ``info`` vector of ``info_len``, ``n_ints`` Int32 scalars and then the ``extra`` tensors;
    bufs = (out, coords, info)."""
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common.arch import GPU_ARCH, target_arch

    bufs = (*replay_buffers(kernel), torch.zeros(info_len, dtype=torch.int32))
    with target_arch("sm90"):
        fn = cute.compile(host, *[from_dlpack(b) for b in bufs], *([Int32(1)] * n_ints),
                          *[from_dlpack(t) for t in extra], options=f"--gpu-arch={GPU_ARCH['sm90']}")
    return fn, bufs


def consumer_s_coords(kernel, qk_mma: cute.TiledMma, tidx):
    """(warpgroup, tScS) of consumer thread ``tidx`` (0 .. consumer_threads - 1): its warpgroup
    and the (row, key) tile coordinates of its S values, from the kernel's QK partition as its
    consumer loop takes it (the split layouts slice the MMA per warpgroup). Called while tracing."""
    wg = tidx // THREADS_PER_WARPGROUP
    thr = qk_mma.get_slice(tidx % THREADS_PER_WARPGROUP if kernel.col_split else tidx)
    return wg, kernel.s_coords(wg, thr)


def mask_replayer(kernel, stage=None):
    """A DSL function (called while a host function is traced) replaying every consumer thread's
    masking of every visit of a span's tiles, as the kernel's consumer loop runs it (``mask_s``:
    first visit, then the rest), on accumulators of zeros: out[thread, visit, value] (0 kept, -inf
    hidden) and coords[thread, value] = (row, column) in the tile. The seesaw's visit it is
    computed and masked by warpgroup it % 2 alone: the other's threads report the tile hidden.
    ``stage(span, it)``, when given, runs before visit it: what the producer may have written to
    SMEM by then."""

    @cute.jit
    def replay(qk_mma: cute.TiledMma, span, first_row: Int32, out: cute.Tensor, coords: cute.Tensor):
        for tidx in cutlass.range(kernel.consumer_threads, unroll=1):
            wg, tScS = consumer_s_coords(kernel, qk_mma, tidx)
            acc = cute.make_rmem_tensor(tScS.shape, Float32)
            for i in cutlass.range_constexpr(cute.size(acc)):
                coords[tidx, i, 0] = tScS[i][0]
                coords[tidx, i, 1] = tScS[i][1]
            acc.fill(0.0)
            if cutlass.const_expr(stage is not None):
                stage(span, 0)
            kernel.mask_s(span, acc, tScS, span.n_tiles - 1, first_row, first=True)
            if cutlass.const_expr(kernel.seesaw):
                if wg != 0:
                    acc.fill(-Float32.inf)
            for i in cutlass.range_constexpr(cute.size(acc)):
                out[tidx, 0, i] = acc[i]
            for it in cutlass.range(1, cutlass.min(span.n_tiles, MAX_VISITS), unroll=1):
                acc.fill(0.0)
                if cutlass.const_expr(stage is not None):
                    stage(span, it)
                kernel.mask_s(span, acc, tScS, span.n_tiles - 1 - it, first_row, first=False)
                if cutlass.const_expr(kernel.seesaw):
                    if wg != it % 2:
                        acc.fill(-Float32.inf)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    out[tidx, it, i] = acc[i]

    return replay
