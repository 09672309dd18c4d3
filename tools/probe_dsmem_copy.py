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

The probe then compiles that form, ``bulk_copy_to_peer`` below (``mapa`` of the destination and of
the barrier, then the copy), through ptxas for sm_90a, and checks the same two operands of its
copy: both mapped (2026-11-27, CuTeDSL 4.8.1). That is the instruction the cluster-shared gather
would use; whether it delivers, and at what latency, only a GPU run can say.
Nothing launches; no GPU is needed.
"""

import re
import sys
import tempfile

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def bulk_copy_to_peer(dst: cutlass.Int32, src: cutlass.Int32, bar: cutlass.Int32, peer: cutlass.Int32,
                      nbytes: int, *, loc=None, ip=None) -> None:
    """``nbytes`` of this CTA's SMEM at ``src`` to the same-window address ``dst`` in cluster CTA
    ``peer``, completing the bytes on ``peer``'s mbarrier at ``bar`` (``dst``, ``src``, ``bar``:
    32-bit shared-window addresses of this CTA's layout; both ``dst`` and ``bar`` are mapped to the
    peer with ``mapa``, as the PTX ISA requires of the destination and of the barrier)."""
    ops = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for x in (dst, src, bar, peer)]
    llvm.inline_asm(
        None, ops,
        "{\n.reg .b32 d, b;\n"
        "mapa.shared::cluster.u32 d, $0, $3;\n"
        "mapa.shared::cluster.u32 b, $2, $3;\n"
        f"cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [d], [$1], {int(nbytes)}, [b];\n}}",
        "r,r,r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


def probe(inline: bool = False) -> tuple[str, bool]:
    """(the bulk copy's PTX line, whether its mbarrier operand is a ``mapa`` result), compiled
    through the library's own path (``common.jit.compile_kernel``, ``common.arch.target_arch``):
    the DSL's ``CopyBulkS2SOp``, or with ``inline`` this module's ``bulk_copy_to_peer``."""
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
            if cutlass.const_expr(inline):
                addr = buf.iterator.toint()
                bulk_copy_to_peer(addr, addr, bar.toint(), peer, 4096)
            else:
                atom = cute.make_copy_atom(cpasync.CopyBulkS2SOp(), cutlass.BFloat16, num_bits_per_copy=4096 * 8)
                cute.copy(atom, buf, buf, mbar_ptr=bar, cta_rank=peer)
        cute.arch.mbarrier_wait(bar, 0)
        g[tidx] = buf[tidx]

    @cute.jit
    def launch(g: cute.Tensor):
        kernel(g).launch(grid=(2, 1, 1), block=(128, 1, 1), cluster=(2, 1, 1))

    with target_arch("sm90"), tempfile.TemporaryDirectory() as d:
        ptx = jit.compile_ptx(launch, [torch.zeros(2048, dtype=torch.bfloat16)], "sm90", d)
    line = next(x.strip() for x in ptx.splitlines() if "cp.async.bulk.shared::cluster.shared::cta" in x)
    mapped = set(re.findall(r"mapa\.shared::cluster\.u32\s+(%?\w+),", ptx))
    operands = re.search(r"\[(%?\w+)\],\s*\[(%?\w+)\],\s*[^,]+,\s*\[(%?\w+)\];$", line)
    dst, mbar = operands.group(1), operands.group(3)
    return line, mbar in mapped and dst in mapped


def main() -> int:
    for inline, name in ((False, "CuTeDSL's CopyBulkS2SOp"), (True, "bulk_copy_to_peer (inline PTX)")):
        line, mapped = probe(inline)
        print(f"{name}: {line}")
        print("  destination and barrier both mapped to the peer" if mapped else
              "  the barrier operand is the issuing CTA's own address: the bytes would complete on the wrong barrier")
    return 0


if __name__ == "__main__":
    sys.exit(main())
