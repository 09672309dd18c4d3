"""Print the layouts a stage's kernels rely on, built with the kernels' own builders.

    python -m tools.layouts [STAGE]

Evaluated on the host at trace time (nothing launches; no GPU needed).
"""

from __future__ import annotations

import sys


def stage_a() -> list:
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils

    from dsv4_attention.common import tmem
    from dsv4_attention.common.layout_proof import trace
    from dsv4_attention.stages.a_qk_gemm import sm90

    dt = cutlass.BFloat16

    def hopper():
        out = []
        mma90 = sm90.make_tiled_mma(dt)
        sq, sk = sm90.make_smem_layouts(dt, sm90.num_stages(512))
        out.append(("sm90 tiled MMA (2 warpgroups, wgmma 64x128x16)", str(mma90.tv_layout_C)))
        out.append(("sm90 sQ ring at hd 512 (128 x 64 x stages, 128B swizzle)", str(sq)))
        out.append(("sm90 sK ring at hd 512", str(sk)))
        thr = mma90.get_slice(0)
        ident = cute.make_identity_tensor((sm90.TILE_M, sm90.TILE_N))
        coords = thr.partition_C(ident)
        out.append(("sm90 thread 0 accumulator coordinates (first 8 values)",
                    str([tuple(int(x) for x in coords[i]) for i in range(8)])))
        return out

    def blackwell():
        out = []
        mma100 = tmem.make_qk_tiled_mma(dt)
        acc = tmem.make_acc_fragment(mma100)
        out.append(("sm100 S accumulator in TMEM (lane << 16 | column)", str(acc.layout)))
        out.append(("sm100 TMEM columns allocated for S", str(tmem.acc_tmem_columns(acc))))
        copy, acc_epi = tmem.make_acc_tmem_load(acc)
        out.append(("sm100 S cut into epilogue chunks (M, 32, 1, chunks)", str(acc_epi.layout)))
        src = copy.get_slice(5).partition_S(acc_epi[None, None, 0, 0])
        out.append(("sm100 thread 5's TMEM source, chunk 0 (tcgen05.ld 32x32b.x32)", str(src.layout)))
        ident100 = cute.make_identity_tensor((tmem.QK_TILE_M, tmem.QK_TILE_N))
        dst = copy.get_slice(5).partition_D(tmem.epi_view(ident100)[None, None, 0, 0])
        out.append(("sm100 thread 5's coordinates, chunk 0 (first 4 of 32)",
                    str([tuple(int(x) for x in dst[i]) for i in range(4)])))
        sa = sm100_utils.make_smem_layout_a(mma100, (128, 128, 64), dt, 4)
        out.append(("sm100 sQ ring (make_smem_layout_a, 4 stages)", str(sa)))
        return out

    return trace(hopper, arch="sm90") + trace(blackwell, arch="sm100")


STAGES = {"a": stage_a}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for sid in argv or list(STAGES):
        print(f"## stage {sid}\n")
        for name, text in STAGES[sid]():
            print(f"{name}:\n    {text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
