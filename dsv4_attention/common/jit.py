"""Compile once, launch many, with CuTeDSL's TVM-FFI calling convention.

A stage builds its kernel's arguments once per call, as plain values in the kernel's order:
torch tensors, ``None`` for an optional tensor the call does not use, Python floats and ints
for the scalars, and ``STREAM`` where the kernel takes its CUDA stream. From that one list,

- the compiled function is called with the list minus ``STREAM`` (a tuple argument, one of
  common/seams.py's bundles, goes in field by field): torch tensors go in as they
  are (DLPack, no per-call CuTe tensor objects), the stream is torch's current stream on the
  tensors' device (TVM-FFI's environment stream: CUDA graphs capture it), and the function's own
  wrapper checks every tensor's dtype, rank, device, 16-byte alignment and int32 dimensions
  before the launch (a second line behind each stage's ValueErrors);
- the first call of a configuration compiles against ``compile_args(list)``: each tensor a
  fake GPU tensor of its dtype and rank with every dimension and every stride but the last
  dynamic (what ``from_dlpack(t, 16).mark_layout_dynamic()`` gave, no GPU needed), floats as
  Float32, ints as Int32, ``STREAM`` as the environment stream. So one compiled function serves
  every batch, seqlen and head count of a configuration, and the CPU compiles of CI and the
  kernel cache build exactly what a GPU call runs.

The configuration key is (stage, arch, dtype, head dim, compile-time options[, a persistent
kernel's CTA count]); compiled
functions live in a per-process dict, and across processes in the library's directory of
exported kernels (common/kernel_cache.py: keyed by that configuration, the library's sources
and the DSL version; a stale entry is never served).
"""

from __future__ import annotations

import os
import threading

import torch

from dsv4_attention.common.arch import GPU_ARCH

_compiled: dict = {}
_lock = threading.Lock()


def cutlass_dtype(dtype: torch.dtype, ints: bool = False):
    import cutlass

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
    }
    if ints:  # kernel operands beside the 16-bit tensors: lists, lengths, a paged cache's bytes
        table[torch.int32] = cutlass.Int32
        table[torch.uint8] = cutlass.Uint8
    return table[dtype]


def as_cute(t: torch.Tensor):
    """A torch tensor as a CuTe tensor with dynamic shape and strides (last dim contiguous): for
    the host functions of the layout proofs, which run on the CPU."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)


class _Stream:
    def __repr__(self):
        return "STREAM"

    def __reduce__(self):  # pickled (to a warm-up worker) as the one STREAM, which call_args drops by identity
        return "STREAM"


#: where a kernel's argument list holds its CUDA stream (torch's current one at call time)
STREAM = _Stream()


def call_args(args) -> list:
    """What the compiled function is called with: the kernel's arguments without the stream."""
    return [a for a in args if a is not STREAM]


def fake_tensor(t: torch.Tensor):
    """A compile-time stand-in for ``t``: its dtype and rank, every dimension (int32) and every
    stride (int64) dynamic but the last stride, 1; in GPU memory. The [batch, seqlen, heads, dim]
    tensors (Q, K, V, O, stage A's S, the compressed entries: TMA and vector copies) are 16-byte
    aligned, as the stages check before launch; the others (LSE, lengths, offsets, sink, top-k
    lists: element accesses) 4-byte aligned, so a caller's offset view of them is served (the
    function checks what it assumes)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    n = t.dim()
    return make_fake_tensor(cutlass_dtype(t.dtype, ints=True), tuple(cute.sym_int32() for _ in range(n)),
                            tuple(cute.sym_int64() for _ in range(n - 1)) + (1,),
                            assumed_align=16 if n == 4 else 4)


def compile_args(args) -> list:
    """The arguments to compile a kernel against, from the list it is called with (module doc)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    def one(a):
        if a is STREAM:
            return make_fake_stream(use_tvm_ffi_env_stream=True)
        if isinstance(a, torch.Tensor):
            return fake_tensor(a)
        if isinstance(a, bool) or a is None:
            return a
        if isinstance(a, float):
            return cutlass.Float32(a)
        if isinstance(a, int):
            return cutlass.Int32(a)
        return a  # already a DSL value

    return [map_leaves(one, a) for a in args]


def map_leaves(fn, a):
    """``fn`` applied to ``a``, or to each field of a tuple argument (common/seams.py's bundles,
    kept as their NamedTuple type)."""
    if isinstance(a, tuple):
        values = [map_leaves(fn, x) for x in a]
        return type(a)._make(values) if hasattr(a, "_fields") else tuple(values)
    return fn(a)


def compile_kernel(kernel, args, arch: str, extra_options: str = ""):
    """cute.compile for ``arch`` ('sm90' / 'sm100') with the TVM-FFI calling convention, against
    ``compile_args(args)``; works without a GPU. Returns the function to call with
    ``call_args(args)``."""
    import cutlass.cute as cute

    options = f"--gpu-arch={GPU_ARCH[arch]} --enable-tvm-ffi {extra_options}".strip()
    compiled = cute.compile(kernel, *compile_args(args), options=options)
    return compiled


def compile_ptx(kernel, args, arch: str, dump_dir, extra_options: str = "") -> str:
    """Compile like ``compile_kernel`` and return the kernel's PTX text, for host tests that read
    the instructions the DSL emitted. Some DSL versions give the artifact as bytes, some as the
    path of the kept file; both are read here."""
    fn = compile_kernel(kernel, args, arch, f"{extra_options} --keep-ptx --dump-dir={dump_dir}".strip())
    return artifact_bytes(fn.artifacts.PTX).decode()


def artifact_bytes(value) -> bytes:
    """A kept compile artifact (``fn.artifacts.PTX`` / ``.CUBIN``) as bytes: some DSL versions give
    the content, some the kept file's path."""
    if isinstance(value, str) and not value.lstrip().startswith("//") and os.path.isfile(value):
        with open(value, "rb") as f:
            return f.read()
    return value.encode() if isinstance(value, str) else bytes(value)


def cached(key, build):
    """The compiled function for ``key``; ``build()`` compiles it the first time only."""
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                fn = build()
                _compiled[key] = fn
    return fn


def cache_size() -> int:
    return len(_compiled)


def kernel_class(kernels: dict, arch: str):
    """The kernel class for ``arch`` from a stage's {'sm90': 'module:Class', ...} table
    (imported on first use, so a stage package imports no kernel until one is needed)."""
    import importlib

    if arch not in kernels:
        raise ValueError(f"arch must be one of {sorted(kernels)}; got {arch!r}")
    module, name = kernels[arch].split(":")
    return getattr(importlib.import_module(module), name)


def kernel_maker(kernels: dict):
    """A stage's ``make_kernel(arch, dtype, head_dim, **options)`` hook: its kernel object for a
    torch dtype and the compile-time options (stages D1 on)."""

    def make_kernel(arch: str, dtype, head_dim: int, **options):
        return kernel_class(kernels, arch)(cutlass_dtype(dtype), head_dim, **options)

    return make_kernel


def config_key(stage_id: str, arch: str, dtype, head_dim: int, options: dict) -> tuple:
    """A kernel configuration's key (in this process's dict and, hashed, in the kernel cache). A
    persistent kernel's (stage D1's seesaw family: ``tiles.uses_seesaw``) ends with its CTA count
    (common/persistent.py), which is baked into the binary; the others do not depend on it. Plain
    Python: a call served from the kernel cache imports no DSL (common/kernel_cache.py)."""
    from dsv4_attention.common import persistent
    from dsv4_attention.common.tiles import uses_seesaw

    key = (stage_id, arch, str(dtype), head_dim, tuple(sorted(options.items())))
    if uses_seesaw(arch, head_dim, options.get("kv_shared", False)):
        key += (("ctas", persistent.grid_ctas()),)
    return key


def stage_kernel(stage_id: str, kernels: dict, arch: str, dtype, head_dim: int, args, options: dict | None = None):
    """The compiled kernel of a stage for (arch, dtype, head dim, compile-time options),
    compiled on first use (against ``compile_args(args)``): a TVM-FFI function taking
    ``call_args(args)`` positionally."""
    from dsv4_attention.common import kernel_cache

    options = dict(options or {})
    key = config_key(stage_id, arch, dtype, head_dim, options)
    build = lambda: compile_kernel(kernel_class(kernels, arch)(cutlass_dtype(dtype), head_dim, **options), args, arch)
    return cached(key, lambda: kernel_cache.load_or_compile(key, build))


def launch(stage_id: str, kernels: dict, arch: str, dtype, head_dim: int, args, options: dict | None = None):
    """Run a stage's kernel on ``args`` (the module doc's list), compiling it on first use."""
    stage_kernel(stage_id, kernels, arch, dtype, head_dim, args, options)(*call_args(args))
