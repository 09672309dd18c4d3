"""Host proof (CPU, no GPU): in stage A's SM100 epilogue, thread t holds row t of S.

The kernel (stages/a_qk_gemm/sm100.py) reads the 128 x 128 fp32 accumulator from TMEM
with ``common.tmem.make_acc_tmem_load`` (tcgen05.ld 32x32b, 32 columns a chunk) and
slices the tiled copy with its thread index t = 0..127 (warps 0-3). Its epilogue then
stores every register of thread t into row t of the S tile under one row predicate.
That is only right if, for every thread t and every value v it holds:

  1. the value is element (t, n) of the tile: row t, and the 128 values of a thread
     are the 128 columns, each once (partition_D of the identity tile);
  2. the TMEM address the accumulator keeps (t, n) at is lane t, column n
     (the MMA's accumulator layout, ``lane << 16 | column``);
  3. the warp-collective source of thread t's warp lies in the TMEM lanes that warp
     may reach (32 * (w % 4) .. +31), and contains every element thread t receives.

The layouts are evaluated at trace time with the *same* builders the kernel calls
(nothing is launched; only Python ints leave the trace). A deliberately wrong variant
(a 16x256b atom, and the right atom sliced with a shifted thread index) is run through
the *same* checker, which must report failures.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import partitions
import pytest
from cutlass.cute.nvgpu import tcgen05

from dsv4_attention.common.tmem import (
    EPI_COLS,
    EPI_THREADS,
    QK_TILE_M,
    QK_TILE_N,
    acc_tile,
    acc_tmem_columns,
    epi_view,
    make_acc_fragment,
    make_acc_tmem_load,
    make_qk_tiled_mma,
    tmem_alloc_columns,
)

ARCH_OPTIONS = "--gpu-arch=sm_100a"

pytestmark = [pytest.mark.stage_a, pytest.mark.proof, pytest.mark.arch("sm100")]


def _trace(fn):
    """Run ``fn`` at trace time of an empty jit function; it must return plain Python
    data (CuTe objects must not outlive the trace)."""
    box = {}

    @cute.jit
    def host():
        box["v"] = fn()

    cute.compile(host, options=ARCH_OPTIONS)
    return box["v"]


def gather_holdings(ab_dtype, op=None, slice_index=lambda t: t):
    """What each epilogue thread of the kernel holds, as the kernel builds it.

    ``op``: a function building the TMEM load atom instead (None = the kernel's 32x32b), called
    in the trace so that the atom targets sm100 whatever GPU is present; ``slice_index(t)``: the
    index the thread of epilogue position t (warp t // 32) passes to ``get_slice`` (the
    kernel passes t). Returns {"threads": [{"dst": [(m, n, tmem_addr)], "src": key}],
    "src": {key: sorted [(m, n)] its warp's tcgen05.ld reads}}.
    """

    def body():
        tiled_mma = make_qk_tiled_mma(ab_dtype)
        acc = make_acc_fragment(tiled_mma)
        tiled_copy, _ = make_acc_tmem_load(acc, EPI_COLS, op=op() if op else None)
        # the epilogue partitions S and its identity with the same chunking as the accumulator
        coords = epi_view(cute.make_identity_tensor((QK_TILE_M, QK_TILE_N)), EPI_COLS)
        acc_mn = acc_tile(acc).layout  # (m, n) -> TMEM address of S(m, n)
        threads, sources = [], {}
        for t in range(EPI_THREADS):
            thr = tiled_copy.get_slice(slice_index(t))
            src = thr.partition_S(coords)  # a tcgen05.ld source is warp-collective
            key = str(src)
            if key not in sources:
                sources[key] = sorted(set(partitions.coords(src)))
            held = [(m, n, int(cute.crd2idx((m, n), acc_mn))) for m, n in partitions.coords(thr.partition_D(coords))]
            threads.append({"dst": held, "src": key})
        return {"threads": threads, "src": sources}

    return _trace(body)


def ownership_failures(holdings, max_report: int = 8) -> list[str]:
    """Every way the holdings break "thread t holds row t, all of it, from its own
    TMEM lanes". Empty list = proven."""
    fails: list[str] = []
    covered = set()
    for t, th in enumerate(holdings["threads"]):
        warp = t // 32
        held = th["dst"]
        rows = sorted({m for m, _, _ in held})
        if rows != [t]:
            fails.append(
                f"thread {t} holds rows {rows[:6]}{'...' if len(rows) > 6 else ''}, not only row {t}"
            )
        cols = sorted(n for _, n, _ in held)
        if cols != list(range(QK_TILE_N)):
            fails.append(f"thread {t} does not hold each of the {QK_TILE_N} columns exactly once")
        for m, n, addr in held:
            if (addr >> 16, addr & 0xFFFF) != (m, n):
                fails.append(f"S({m},{n}) sits at TMEM lane {addr >> 16} column {addr & 0xFFFF}")
                break
        src = holdings["src"][th["src"]]
        quarter = range(32 * (warp % 4), 32 * (warp % 4) + 32)
        if any(m not in quarter for m, _ in src):
            fails.append(
                f"warp {warp} (thread {t}) loads TMEM lanes outside {quarter.start}..{quarter.stop - 1}"
            )
        src_set = set(src)
        if any((m, n) not in src_set for m, n, _ in held):
            fails.append(f"thread {t} holds values its warp's tcgen05.ld does not read")
        covered.update((m, n) for m, n, _ in held)
        if len(fails) >= max_report:
            break
    else:
        if len(covered) != QK_TILE_M * QK_TILE_N:
            fails.append(f"the 128 threads cover {len(covered)} of {QK_TILE_M * QK_TILE_N} elements")
    return fails


# ---------------------------------------------------------------------------------------
# the proof


@pytest.mark.stage_a
@pytest.mark.slow
def test_epilogue_thread_t_holds_row_t():
    holdings = gather_holdings(cutlass.BFloat16)
    assert len(holdings["threads"]) == EPI_THREADS
    assert all(len(th["dst"]) == QK_TILE_N for th in holdings["threads"])
    fails = ownership_failures(holdings)
    assert not fails, "\n".join(fails)


@pytest.mark.stage_a
def test_fast_coordinates_match_tensor_indexing():
    """``partitions.coords`` (used by the gather for speed) agrees with plain ``tensor[v]``."""

    def body():
        tiled_copy, _ = make_acc_tmem_load(make_acc_fragment(make_qk_tiled_mma(cutlass.BFloat16)), EPI_COLS)
        coords = epi_view(cute.make_identity_tensor((QK_TILE_M, QK_TILE_N)), EPI_COLS)
        same = True
        for t in (0, 37, 127):
            thr = tiled_copy.get_slice(t)
            for part in (thr.partition_D(coords), thr.partition_S(coords)):
                plain = [tuple(int(x) for x in part[v]) for v in range(0, cute.size(part), 7)]
                same = same and plain == partitions.coords(part)[::7]
        return same

    assert _trace(body)


@pytest.mark.stage_a
def test_fp16_builds_the_same_accumulator_path():
    """The proof runs on bf16; the fp16 kernel builds an identical TMEM path."""

    def describe(dtype):
        def body():
            acc = make_acc_fragment(make_qk_tiled_mma(dtype))
            tiled_copy, acc_epi = make_acc_tmem_load(acc, EPI_COLS)
            return str(acc.layout), str(acc_epi.layout), str(tiled_copy), acc_tmem_columns(acc)

        return _trace(body)

    bf16, fp16 = describe(cutlass.BFloat16), describe(cutlass.Float16)
    assert bf16 == fp16
    # row m -> lane m (65536 = 1 << 16), column n -> column n
    assert bf16[0] == "((128,128),1,1):((65536,1),0,0)"
    assert bf16[3] == 128


@pytest.mark.stage_a
def test_tmem_alloc_columns():
    assert [tmem_alloc_columns(n) for n in (1, 32, 33, 128, 129, 512)] == [32, 32, 64, 128, 256, 512]
    with pytest.raises(ValueError):
        tmem_alloc_columns(513)


# ---------------------------------------------------------------------------------------
# negative controls: the same checker must reject layouts that are wrong


@pytest.mark.stage_a
@pytest.mark.slow
def test_checker_rejects_16x256b_atom():
    # 16 lanes x 256 bits: a thread gets values of two rows, and a row is split over 4 threads
    fails = ownership_failures(
        gather_holdings(cutlass.BFloat16, op=lambda: tcgen05.Ld16x256bOp(tcgen05.Repetition(EPI_COLS // 8)))
    )
    assert fails, "the checker accepted the 16x256b TMEM load"
    assert any("not only row" in f for f in fails)


@pytest.mark.stage_a
@pytest.mark.slow
def test_checker_rejects_shifted_thread_index():
    # right atom, wrong slice: as if the epilogue warps were numbered from warp 1
    fails = ownership_failures(
        gather_holdings(cutlass.BFloat16, slice_index=lambda t: (t + 32) % EPI_THREADS)
    )
    assert fails, "the checker accepted a shifted thread index"
    assert any("not only row" in f for f in fails)
    assert any("outside" in f for f in fails)
