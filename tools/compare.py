"""One row per stage: what it adds, per arch compile time and resources, and on a GPU its
max error and time (bf16, head dim 128).

    python -m tools.compare
"""

from __future__ import annotations

import sys

from dsv4_attention.common.arch import present_arch
from dsv4_attention.common.compile import compile_report

HD = 128


def gpu_columns(st):
    import torch

    e, ms, tf = st.module.demo_case(torch.device("cuda", 0), head_dim=HD)
    return f"rel err {e.rel_fro:.2e} (worst row {e.row_rel:.2e}), {ms:.3f} ms, {tf:.0f} TFLOP/s"


def main() -> int:
    from dsv4_attention import stages

    print(f"{'stage':6s} {'adds':60s} | per arch (hd {HD}, bf16): compile s / regs / spills / smem / tmem")
    for st in stages.STAGES:
        cells = []
        for arch in ("sm90", "sm100"):
            r = compile_report(st.id, arch, "bfloat16", HD)
            cells.append(f"{arch}: ERROR" if not r.ok else
                         f"{arch}: {r.seconds:.1f}s {r.registers}r {r.spill_store_bytes}B "
                         f"{r.smem_bytes // 1024}KiB" + (f" {r.tmem_columns}c" if r.tmem_columns else ""))
        gpu = gpu_columns(st) if present_arch() else "no GPU here: not run"
        print(f"{st.id:6s} {st.adds[:60]:60s} | {' | '.join(cells)} | {gpu}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
