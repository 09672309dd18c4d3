"""What every stage's tests share: error metrics, poisoning, inputs, architecture marks.

Error metrics compare a kernel output with a float64 reference:
- ``rel_fro``: ||out - ref||_F / ||ref||_F over the whole tensor;
- ``row_rel``: the same per row of the last dim, worst row reported, so one bad
  row cannot hide in a large tensor (the origin's statistics landed on wrong rows);
- ``max_abs``: the largest absolute difference.
NaN or Inf anywhere in the output makes every metric infinite: NaN never passes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from common.arch import ARCHS, gpu_name, present_arch

POISON = float("nan")


@dataclasses.dataclass
class Errors:
    rel_fro: float
    row_rel: float
    max_abs: float
    worst_row: tuple

    def within(self, rel: float, row: float) -> bool:
        return self.rel_fro <= rel and self.row_rel <= row

    def __str__(self) -> str:
        return (
            f"rel_fro={self.rel_fro:.3e} worst_row_rel={self.row_rel:.3e} at {self.worst_row} "
            f"max_abs={self.max_abs:.3e}"
        )


def errors(out: torch.Tensor, ref: torch.Tensor) -> Errors:
    """Errors of ``out`` against ``ref`` (any shape; rows are the last dim)."""
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64).to(o.device)
    if not torch.isfinite(o).all():
        bad = (~torch.isfinite(o)).nonzero()[0].tolist()
        return Errors(math.inf, math.inf, math.inf, tuple(bad[:-1]))
    diff = o - r
    rel = (diff.norm() / r.norm().clamp_min(1e-300)).item()
    row_num = diff.flatten(0, -2).norm(dim=-1)
    row_den = r.flatten(0, -2).norm(dim=-1).clamp_min(1e-300)
    row_err = row_num / row_den
    worst = int(row_err.argmax())
    worst_idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), r.shape[:-1]))
    return Errors(rel, row_err[worst].item(), diff.abs().max().item(), worst_idx)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN before a launch: any element left unwritten fails the check."""
    return t.fill_(POISON)


def random_bshd(batch, seqlen, heads, head_dim, dtype, device, *, magnitude=1.0, generator=None):
    """A [batch, seqlen, heads, head_dim] input with N(0, magnitude^2) entries.

    ``magnitude`` sets how large scores get: |s| grows like magnitude^2 * sqrt(head_dim) * scale.
    """
    x = torch.randn(batch, seqlen, heads, head_dim, generator=generator, dtype=torch.float32)
    return (x * magnitude).to(dtype=dtype, device=device)


def fresh_generator(seed: int | None = None) -> torch.Generator:
    """A generator with a fresh seed each call unless one is given; the seed is kept for messages."""
    g = torch.Generator()
    g.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed)
    return g


# ---- architecture marks -----------------------------------------------------------------

def gpu_arch_params():
    """pytest params, one per architecture, each marked `gpu` and skipped where that GPU is absent."""
    here = present_arch()
    params = []
    for arch in ARCHS:
        reason = (
            f"needs a {'Hopper (sm90)' if arch == 'sm90' else 'Blackwell (sm100)'} GPU; "
            f"this machine has {gpu_name() or 'no GPU'}"
        )
        params.append(
            pytest.param(arch, id=arch, marks=[pytest.mark.gpu, pytest.mark.skipif(here != arch, reason=reason)])
        )
    return params


def cuda_device():
    return torch.device("cuda", 0)
