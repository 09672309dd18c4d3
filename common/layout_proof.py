"""Host-side layout proofs: evaluate the kernels' own layouts and partitions on the CPU.

Static layout algebra folds while a ``@cute.jit`` function is traced, so a
function that is compiled but never launched can compute, for every thread and
value, which logical coordinate it holds and where that lands in memory:

    rows = trace(lambda: [...ints computed from the kernel's builders...])

Rules that keep a proof honest:
- Build the copy and the MMA with the same builder functions the kernel calls,
  so the proof tests the kernel and not a twin.
- Convert everything to ints/tuples inside the traced function; a CuTe object
  that escapes the trace can crash the process.
- Swizzle acts on byte addresses: the physical byte of coordinate c in a
  swizzled SMEM layout ``S<B,M,S> o outer`` is
  ``swizzle(sizeof(T) * crd2idx(c, outer))`` (see ``swizzle_bytes``).
- Every proof has a negative control: a deliberately wrong variant the same
  checker must reject.
"""

from __future__ import annotations


def trace(fn, *args, arch: str = "sm100"):
    """Run ``fn(*args)`` inside a compiled-but-never-launched ``@cute.jit`` and return its value.

    ``fn`` must return plain Python data (ints, tuples, lists, dicts, str). ``arch``
    ('sm90' / 'sm100') is the target the builders are checked against.
    """
    import cutlass.cute as cute

    from common.arch import GPU_ARCH

    box = {}

    @cute.jit
    def _host():
        box["value"] = fn(*args)

    cute.compile(_host, options=f"--gpu-arch={GPU_ARCH[arch]}")
    if "value" not in box:
        raise RuntimeError("traced function returned nothing")
    return box["value"]


def swizzle_bytes(addr: int, bits: int, base: int, shift: int) -> int:
    """CuTe's Swizzle<B, M, S> applied to a byte address: a ^ ((a >> S) & (((1 << B) - 1) << M))."""
    mask = ((1 << bits) - 1) << base
    return addr ^ ((addr >> shift) & mask)


def first_mismatches(expected: dict, actual: dict, limit: int = 5) -> list:
    """Keys whose values differ (or are missing), at most ``limit`` of them, for messages."""
    bad = []
    for key in sorted(set(expected) | set(actual)):
        if expected.get(key) != actual.get(key):
            bad.append((key, expected.get(key), actual.get(key)))
            if len(bad) >= limit:
                break
    return bad


def as_ints(x):
    """A (nested) tuple of CuTe integers as plain Python ints, for leaving a trace."""
    return tuple(as_ints(y) for y in x) if isinstance(x, tuple) else int(x)


def size_of(shape) -> int:
    """The number of elements of a (nested) shape given as plain ints."""
    if isinstance(shape, tuple):
        out = 1
        for s in shape:
            out *= size_of(s)
        return out
    return shape


def offset_of(shape, stride, coord) -> int:
    """A layout's offset of a (possibly nested) coordinate, in plain Python: the same
    arithmetic as ``cute.crd2idx``, outside a trace. An integer given for a nested mode
    is split colexicographically, as CuTe does."""
    if isinstance(shape, tuple):
        if not isinstance(coord, tuple):
            parts = []
            for s in shape:
                size = size_of(s)
                parts.append(coord % size)
                coord //= size
            coord = tuple(parts)
        return sum(offset_of(s, d, c) for s, d, c in zip(shape, stride, coord, strict=True))
    return coord * stride
