"""Which mbarrier CuTeDSL's CTA-to-cluster bulk copy signals, read from the PTX it emits (host only).

    python -m tools.probe_dsmem_copy

Stage E's next step 4 (docs/stages/e_fused.md) forwards gathered rows to the peer CTA of a
cluster of two with ``cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes``.
The PTX ISA completes its bytes on an mbarrier *in the destination CTA*, so both the destination
and the barrier must be mapped to the peer (``mapa``). This compiles a two-CTA kernel for sm_90a
that copies 4 KiB to the peer with ``cpasync.CopyBulkS2SOp`` (``cta_rank`` = the peer) and
prints the copy's PTX line and whether its barrier operand is mapped. With CuTeDSL 4.8.1
(2026-11-26) it is not: the destination is mapped, the barrier is the issuing CTA's own address
(and passing a barrier already mapped with ``cute.arch.map_dsmem_ptr`` fails to lower), so the
copy would complete bytes on the wrong CTA's barrier; the kernel must emit this instruction itself
(inline PTX with both addresses mapped, as common/sm90_gather.py does for its cp.async).
Nothing launches; no GPU is needed.
"""

import re
import sys
import tempfile


def probe() -> tuple[str, bool]:
    """(the bulk copy's PTX line, whether its mbarrier operand is a ``mapa`` result), compiled
    through the library's own path (``common.jit.compile_kernel``, ``common.arch.target_arch``)."""
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.nvgpu import cpasync

    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import target_arch

    @cute.kernel
    def kernel(g: cute.Tensor):
        smem = cutlass.memory.SmemAllocator()
        buf = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(2048), byte_alignment=128)
        bar = smem.allocate_array(cutlass.Int64, 1)
        tidx = cute.arch.thread_idx()[0]
        peer = 1 - cute.arch.block_idx_in_cluster()
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, 4096)
            atom = cute.make_copy_atom(cpasync.CopyBulkS2SOp(), cutlass.BFloat16, num_bits_per_copy=4096 * 8)
            cute.copy(atom, buf, buf, mbar_ptr=bar, cta_rank=peer)
        cute.arch.mbarrier_wait(bar, 0)
        g[tidx] = buf[tidx]

    @cute.jit
    def launch(g: cute.Tensor):
        kernel(g).launch(grid=(2, 1, 1), block=(128, 1, 1), cluster=(2, 1, 1))

    with target_arch("sm90"), tempfile.TemporaryDirectory() as d:
        fn = jit.compile_kernel(launch, [torch.zeros(2048, dtype=torch.bfloat16)], "sm90",
                                f"--keep-ptx --dump-dir={d}")
        ptx = fn.artifacts.PTX
        ptx = ptx if isinstance(ptx, str) else ptx.decode()
        if not ptx.lstrip().startswith("//") and ptx.endswith(".ptx"):  # some versions return the file's path
            with open(ptx) as f:
                ptx = f.read()
    line = next(x.strip() for x in ptx.splitlines() if "cp.async.bulk.shared::cluster.shared::cta" in x)
    mapped = set(re.findall(r"mapa\.shared::cluster\.u32\s+(%r\d+)", ptx))
    mbar = re.search(r"\[(%r\d+)\];$", line).group(1)
    return line, mbar in mapped


def main() -> int:
    line, mapped = probe()
    print(line)
    print("the barrier operand is mapped to the peer" if mapped else
          "the barrier operand is the issuing CTA's own address: the bytes would complete on the wrong barrier")
    return 0


if __name__ == "__main__":
    sys.exit(main())
