"""Compile once, launch many.

Kernels are compiled with dynamic shapes and strides (``mark_layout_dynamic``),
so one compiled function serves every batch, seqlen and head count of a
configuration. The configuration key is (kernel class, arch, dtype, head dim,
compile-time options); compiled functions live in a per-process dict, and
across processes in the library's directory of exported kernels
(common/kernel_cache.py: keyed by that configuration, the library's sources and
the DSL version; a stale entry is never served).
"""

from __future__ import annotations

import threading

import torch

from dsv4_attention.common.arch import GPU_ARCH

_compiled: dict = {}
_lock = threading.Lock()


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
    }
    return table[dtype]


def as_cute(t: torch.Tensor):
    """A torch tensor as a CuTe tensor with dynamic shape and strides (last dim contiguous)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)


def compile_kernel(kernel, args, arch: str, extra_options: str = ""):
    """cute.compile for ``arch`` ('sm90' / 'sm100'); works without a GPU."""
    import cutlass.cute as cute

    options = f"--gpu-arch={GPU_ARCH[arch]} {extra_options}".strip()
    return cute.compile(kernel, *args, options=options)


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


def current_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


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


def stage_kernel(stage_id: str, kernels: dict, arch: str, dtype, head_dim: int, args, options: dict | None = None):
    """The compiled kernel of a stage for (arch, dtype, head dim, compile-time options),
    compiled on first use."""
    from dsv4_attention.common import kernel_cache

    options = dict(options or {})
    key = (stage_id, arch, str(dtype), head_dim, tuple(sorted(options.items())))
    build = lambda: compile_kernel(kernel_class(kernels, arch)(cutlass_dtype(dtype), head_dim, **options), args, arch)
    return cached(key, lambda: kernel_cache.load_or_compile(key, build))
