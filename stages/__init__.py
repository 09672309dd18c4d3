"""The stages, in order. Each stage package exposes ``forward`` on torch tensors in
``[batch, seqlen, heads, head_dim]`` layout (dispatching to its sm90 or sm100 kernel
by the tensors' device) and the hooks the harness uses (``make_kernel``,
``example_args``, ``HEAD_DIMS``, ``DTYPES``, ``flops``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType


@dataclasses.dataclass(frozen=True)
class Stage:
    id: str
    name: str
    adds: str
    module: ModuleType

    @property
    def forward(self) -> Callable:
        return self.module.forward

    @property
    def head_dims(self):
        return self.module.HEAD_DIMS

    @property
    def dtypes(self):
        return self.module.DTYPES


def _load(pkg: str) -> Stage:
    m = importlib.import_module(f"stages.{pkg}")
    return Stage(m.ID, m.NAME, m.ADDS, m)


STAGES: list[Stage] = [
    _load(p)
    for p in ("a_qk_gemm", "b_p_onchip", "c_online_softmax", "d1_smem_p", "d2_pack_heads", "d3_lengths",
              "d4_causal_window")
]


def get(stage_id: str) -> Stage:
    for s in STAGES:
        if s.id == stage_id:
            return s
    raise ValueError(f"unknown stage {stage_id!r}; stages are {[s.id for s in STAGES]}")
