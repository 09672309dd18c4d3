"""The main job.

On a Hopper or Blackwell GPU: run the newest stage against the float64
reference and print its error, time and TFLOP/s. On a machine without one:
compile every stage for sm_90a and sm_100a and print compile time, registers,
spills, shared memory and (sm100) TMEM columns, saying plainly that nothing
ran on a GPU.

    python -m tools.demo
"""

from __future__ import annotations

import sys

from dsv4_attention.common.arch import gpu_name, present_arch


def compile_everything() -> int:
    from dsv4_attention import stages
    from dsv4_attention.common.compile import compile_report

    print("No Hopper/Blackwell GPU here: NOTHING RAN ON A GPU. Compiling every stage for both "
          "architectures instead (file cache off).\n")
    failed = 0
    for st in stages.STAGES:
        print(f"stage {st.id} ({st.name}): {st.adds}")
        for arch in ("sm90", "sm100"):
            for hd in st.head_dims:
                rep = compile_report(st.id, arch, "bfloat16", hd, options=getattr(st.module, "DEMO_OPTIONS", None))
                failed += not rep.ok
                print("  " + rep.row(), flush=True)
    print("\nCompiled only; correctness on sm90 is evidenced by the device reports in docs/results/.")
    return 1 if failed else 0


def run_newest_stage() -> int:
    import torch

    from dsv4_attention import stages

    st = stages.STAGES[-1]
    print(f"GPU: {gpu_name()} ({present_arch()}); stage {st.id} ({st.name}): {st.adds}")
    for hd in st.head_dims:
        e, ms, tf = st.module.demo_case(torch.device("cuda", 0), head_dim=hd)
        print(f"  hd{hd:<3d}: {e}  {ms:.3f} ms  {tf:.1f} TFLOP/s", flush=True)
    return 0


def main() -> int:
    return run_newest_stage() if present_arch() else compile_everything()


if __name__ == "__main__":
    sys.exit(main())
