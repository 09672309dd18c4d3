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

    from dsv4_attention.common.arch import GPU_ARCH

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


#: bytes shared memory serves per wavefront (32 banks x 4 bytes)
SMEM_WAVEFRONT_BYTES = 128
#: shared-memory banks, 4 bytes wide
SMEM_BANKS = 32


def smem_wavefronts(byte_addresses, bytes_per_thread: int) -> int:
    """128-byte shared-memory wavefronts one warp instruction takes, the threads' byte addresses
    given in lane order. The model: a warp's accesses are served in phases of
    128 / bytes_per_thread consecutive lanes (a whole warp for 4-byte or narrower accesses, 8 lanes
    for 16-byte ones); within a phase, a bank serves one distinct 4-byte word per wavefront (lanes
    reading the same word share it), so the phase takes as many wavefronts as its busiest bank has
    distinct words. The minimum for a warp is ceil(lanes * bytes_per_thread / 128)."""
    addrs = list(byte_addresses)
    if bytes_per_thread <= 0 or any(a % min(bytes_per_thread, 16) for a in addrs):
        raise ValueError("accesses must be aligned to their size")
    per_phase = max(1, min(len(addrs), SMEM_WAVEFRONT_BYTES // bytes_per_thread))
    total = 0
    for p in range(0, len(addrs), per_phase):
        words_per_bank: dict[int, set] = {}
        for a in addrs[p:p + per_phase]:
            for word in range(a // 4, (a + bytes_per_thread + 3) // 4):
                words_per_bank.setdefault(word % SMEM_BANKS, set()).add(word)
        total += max(len(w) for w in words_per_bank.values())
    return total


def min_smem_wavefronts(lanes: int, bytes_per_thread: int) -> int:
    """The fewest wavefronts ``lanes`` accesses of ``bytes_per_thread`` bytes can take."""
    return -(-lanes * bytes_per_thread // SMEM_WAVEFRONT_BYTES)
