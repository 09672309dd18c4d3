"""The backward's row statistics on the host: D = rowsum(dO * O) and the LSE in the exp2 domain
into the kernel's padded rows, by one launch of ``preprocess_kernel.BackwardPreprocess`` (the
DSL is imported only where it compiles: a cached kernel loads without it), or in torch.
"""

from __future__ import annotations

import math

import torch

from dsv4_attention.common import jit
from dsv4_attention.common.arch import arch_of_device
from dsv4_attention.common.interface import LOG2E

#: the preprocess kernel, architecture-neutral (loads, shuffles and stores)
PREPROCESS_KERNELS = {"sm90": "dsv4_attention.stages.f_backward.preprocess_kernel:BackwardPreprocess",
                      "sm100": "dsv4_attention.stages.f_backward.preprocess_kernel:BackwardPreprocess"}


def statistics_torch(o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, lse2: torch.Tensor,
                     dsum: torch.Tensor, rows: torch.Tensor | None) -> None:
    """``statistics`` in torch: its specification and the CPU's form."""
    where = slice(0, o.shape[1]) if rows is None else rows.long()
    lse2[..., where] = torch.where(torch.isneginf(lse), math.inf, lse * LOG2E)
    dsum[..., where] = (do.float() * o.float()).sum(-1).transpose(1, 2)


def statistics(o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, lse2: torch.Tensor, dsum: torch.Tensor,
               rows: torch.Tensor | None = None) -> None:
    """Write D = rowsum(dO * O) and LSE log2(e) (+inf for -inf) of every row of ``o`` [batch,
    seqlen, heads, d] (contiguous, like ``do``) into ``dsum`` and ``lse2`` [batch, heads, padded
    rows] fp32, at row ``rows[i]`` ([seqlen] int32) or i; one launch of ``BackwardPreprocess`` on a
    GPU, ``statistics_torch`` elsewhere."""
    if not o.is_cuda:
        statistics_torch(o, do, lse, lse2, dsum, rows)
        return
    jit.launch("f_preprocess", PREPROCESS_KERNELS, arch_of_device(o.device), o.dtype, o.shape[3],
               [o, do, lse, lse2, dsum, rows, jit.STREAM], {"row_map": rows is not None})
