"""Helpers of the host layout proofs shared by several stages' tests.

``coords``: the (m, n) every value of a partition of an identity tile stands for, read from the
partition's base coordinate plus its layout's offset (what ``part[v]`` gives, about 3x faster;
each test that gathers with it checks it against ``part[v]`` on its own partitions).

The wrong relabellings of an sm90 accumulator as the next GEMM's A operand (negative controls
for ``common.p_staging.acc_to_a_layout``; the accumulator's value mode is (c, r, v): column
pair, row pair, column octets):

  - ``kblock_strided``: k-block j = column octets (j, j + v/2), the octet mode split the wrong
    way round;
  - ``rows_for_halves``: the row-pair mode and the column-half mode exchanged.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def stat_views(acc_layout) -> dict:
    """The softmax statistics' views of an accumulator (``common.softmax``'s row and column views),
    as lists: ``views[name][s][j]`` is the register of statistic s's j-th value, for
    ``stat_failures``."""
    from dsv4_attention.common.softmax import acc_cols_layout, acc_rows_layout

    out = {}
    for name, fn in (("rows", acc_rows_layout), ("cols", acc_cols_layout)):
        view = fn(acc_layout)
        out[name] = [[int(view((a, b))) for b in range(cute.size(view, mode=[1]))]
                     for a in range(cute.size(view, mode=[0]))]
    return out


def partition_coords(tiled_mma, thread: int, shape) -> list[tuple[int, int]]:
    """``coords`` of thread ``thread``'s accumulator values of ``tiled_mma`` over a ``shape`` tile."""
    return coords(tiled_mma.get_slice(thread).partition_C(cute.make_identity_tensor(shape)))


def coords(part) -> list[tuple[int, int]]:
    """The (m, n) of every value of ``part`` (a partition of an identity tile), in value order."""
    base = tuple(int(x) for x in part.iterator)
    out = []
    for v in range(cute.size(part)):
        off = part.layout(v)
        out.append((base[0] + int(off[0]), base[1] + int(off[1])))
    return out


def stat_failures(s_coords: list, view: list, axis: int) -> list:
    """Where a statistics view of an accumulator fails: ``view[s][j]`` is the register of
    statistic s's j-th value, ``s_coords[t]`` thread t's (m, n) per register. Each statistic's
    values must share one coordinate on ``axis`` (the row a softmax statistic scales: 0 for rows,
    1 for a transposed tile's columns), the statistics' coordinates be distinct, and the view
    cover each register once."""
    bad = []
    if sorted(i for row in view for i in row) != list(range(len(s_coords[0]))):
        bad.append("the view does not cover each value once")
    for t, values in enumerate(s_coords):
        owners = []
        for s, row in enumerate(view):
            at = {values[i][axis] for i in row}
            if len(at) != 1:
                bad.append((t, s, sorted(at)))
            owners.append(min(at))
        if len(set(owners)) != len(owners):
            bad.append((t, "statistics repeat a row"))
    return bad


def transpose_mismatches(lays, written: str, read: str, rows: int, cols: int, stages: int) -> list:
    """Where an SMEM buffer written through layout ``written`` ((rows, cols, stages), K-major) is
    not read back through ``read`` (its (cols, rows, stages) MN-major transpose) at the same
    offset, or under another swizzle. ``lays[name]`` = (swizzle, shape, stride, ...) as traced."""
    from dsv4_attention.common.layout_proof import offset_of

    wsw, wshape, wstride = lays[written][:3]
    rsw, rshape, rstride = lays[read][:3]
    bad = [("swizzle", wsw, rsw)] if wsw != rsw else []
    bad += [(r, c, s) for s in range(stages) for r in range(rows) for c in range(cols)
            if offset_of(wshape, wstride, (r, c, s)) != offset_of(rshape, rstride, (c, r, s))]
    return bad


def exchange_failures(acc_coords: list, shape, wrong: bool = False) -> list:
    """A wgmma accumulator's 16-byte reductions (``common.sm90_reduce``) replayed on coordinates:
    lane t's four values per column group n (``exchange_pairs`` on its own and lane t ^ 1's
    coordinates, ``acc_coords[t]``) must be the row and columns the kernel's address names
    (``reduced_at``, plus 8 n columns), four adjacent columns from a multiple of 4 (16-byte
    aligned), and over the threads every (row, column) of ``shape`` reduced exactly once.
    ``wrong``: the lanes keep the other pair, the negative control."""
    from dsv4_attention.common import sm90_reduce as red

    bad, seen = [], []
    for t, own_all in enumerate(acc_coords):
        partner_all = acc_coords[t ^ 1]
        odd = bool(t % 2) != wrong
        red_row, red_col = red.reduced_at(own_all, odd)
        for n in range(len(own_all) // 4):
            (x0, x1), (y0, y1) = red.value_quad(n)
            own = ((own_all[x0], own_all[x1]), (own_all[y0], own_all[y1]))
            partner = ((partner_all[x0], partner_all[x1]), (partner_all[y0], partner_all[y1]))
            got = red.exchange_pairs(odd, own, partner)
            want = tuple((red_row, red_col + 8 * n + j) for j in range(4))
            if got != want or red_col % 4:
                bad.append((t, n, got, want))
            seen += list(got)
    if sorted(seen) != sorted((r, c) for r in range(shape[0]) for c in range(shape[1])):
        bad.append("the reductions do not cover the tile once")
    return bad


def kblock_strided(acc_layout):
    """k-block j = column octets (j, j + v/2): the octet mode split (v/2, 2), not (2, v/2)."""
    (c, r, v), m, n = acc_layout.shape
    (dc, dr, dv), dm, dn = acc_layout.stride
    return cute.make_layout(((c, r, 2), m, (v // 2, n)), stride=((dc, dr, (v // 2) * dv), dm, (dv, dn)))


def rows_for_halves(acc_layout):
    """The row-pair mode and the column-half mode of the A value exchanged."""
    (c, r, v), m, n = acc_layout.shape
    (dc, dr, dv), dm, dn = acc_layout.stride
    return cute.make_layout(((c, r, 2), m, (v // 2, n)), stride=((dc, dv, dr), dm, (2 * dv, dn)))


# The store proofs' bookkeeping over coordinate views (host functions compiled for the arch and
# run on the CPU): a store's target counted and tagged where it lies inside the tensor.


@cute.jit
def inside(crd, shape):
    """Whether coordinate ``crd`` lies inside ``shape`` in every mode."""
    ok = (crd[0] >= 0) & (crd[0] < shape[0])
    for i in cutlass.range_constexpr(1, len(shape)):
        ok = ok & (crd[i] >= 0) & (crd[i] < shape[i])
    return ok


@cute.jit
def put(count: cute.Tensor, who: cute.Tensor, crd, value):
    """One store to ``crd``: counted (a second store shows as 2) and tagged with its writer."""
    count[crd] = count[crd] + 1
    who[crd] = value
