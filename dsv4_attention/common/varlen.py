"""Variable-length batches (FlashAttention's ``cu_seqlens``): the packed tensors and the padded
rows of the workspaces a kernel writes whole tiles into.

A variable-length batch packs its requests' rows one after another: request b's rows are
[cu[b], cu[b + 1]) of a [total, heads, d] tensor. A kernel reads a request's tile with a TMA box
that may run into the next request's rows (they are masked), but it must not *write* a whole
tile there. So the arrays a kernel writes tile by tile (the backward's LSE, D and dQ accumulator
per Q tile, its dK and dV per KV tile) are padded per request: request b's rows start at

    padded_start(cu[b], b, tile) = (cu[b] // tile + b) * tile

and the next request's start is at least ceil((cu[b + 1] - cu[b]) / tile) tiles later, since
cu[b + 1] // tile - cu[b] // tile >= (cu[b + 1] - cu[b]) // tile. The last request's rows end
before ``padded_total(total, batch, tile)``. (FlashAttention-3's padded offsets.)
"""

from __future__ import annotations

import torch


def padded_start(start, batch, tile: int):
    """Where request ``batch``, whose packed rows start at ``start``, starts in a padded array."""
    return (start // tile + batch) * tile


def padded_total(total: int, batch: int, tile: int) -> int:
    """Rows of a padded array for ``batch`` requests of ``total`` packed rows (a bound: see above)."""
    return (total // tile + batch + 1) * tile


def batch_rows(t, batch, start=None):
    """Kernel side: the cute tensor ``t``'s batch ``batch`` (its last mode; rows its first), offset
    to start at row ``start`` when given (a variable-length batch's packed or padded tensor). The DSL
    is imported here, not with the module: the host path (``padded_index``) serves a process that
    loads cached kernels without it (tests/test_warmup.py)."""
    import cutlass.cute as cute

    view = t[(None,) * (cute.rank(t) - 1) + (batch,)]
    if start is not None:
        view = cute.domain_offset((start,) + (0,) * (cute.rank(view) - 1), view)
    return view


def padded_index(cu: torch.Tensor, total: int, tile: int) -> torch.Tensor:
    """Host side: [total] int64, the padded row of each packed row (no device synchronisation)."""
    rows = torch.arange(total, device=cu.device)
    request = torch.searchsorted(cu.long(), rows, right=True) - 1  # an empty request's row belongs to none
    starts = cu.long()[request]
    return rows + (starts // tile + request) * tile - starts
