"""Compiled kernels across processes: a directory of exported shared libraries, keyed so that a
stale one is never served, and loaded without importing CuTeDSL.

CuTeDSL's own file cache (``CUTE_DSL_CACHE_DIR``) serves ``@cute.jit`` functions called
directly; the ``cute.compile`` results this library launches never reach it (its directory
stays empty), so a fresh process recompiled every configuration (1.4-2.1 s on the H100).
Here each compiled kernel is exported with the DSL's AOT path (``export_to_c``: an object file
holding the host launcher, TVM-FFI calling convention, and the cubin) and linked at once into a
shared library against the two runtime libraries it calls (CuTeDSL's ``libcute_dsl_runtime`` and
``libtvm_ffi``, found by the DSL that compiled it and named by absolute run path). A later
process loads it with ``tvm_ffi.load_module`` (tens of milliseconds) and never imports CuTeDSL,
whose import alone took 3.0 s of the 3.2 s a loaded first call cost on the H100. Where no C
compiler links (``$CC``, else ``cc``), the entry is the object file, loaded through the DSL
(``cutlass.cute.runtime.load_module``: it imports the DSL). An entry that fails to load (a
damaged file, a runtime library moved away) is recompiled and rewritten.

The entry's name is a hash of everything the binary depends on:

    sha256(kernel (stage, arch, dtype, head dim, compile-time options),
           the source of every .py file of the library (common/ and stages/),
           the CuTeDSL version (from the installed package's metadata: no import))

so editing any kernel source, or upgrading the DSL, changes every name: the old entries are
never looked up again (``clear`` deletes them). Entries are written to a temporary name and
renamed into place, so a reader never sees half a file.

Directory: ``$DSV4_ATTENTION_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsv4_attention``, else
``~/.cache/dsv4_attention``. ``DSV4_ATTENTION_DISABLE_CACHE=1`` turns it off (every process
compiles). ``python -m dsv4_attention.common.kernel_cache [info|clear]``.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ENV_DIR = "DSV4_ATTENTION_CACHE_DIR"
ENV_DISABLE = "DSV4_ATTENTION_DISABLE_CACHE"

#: what this process did: entries loaded from the directory (of them, shared libraries loaded
#: without the DSL), kernels compiled, entries written, and the seconds loading and compiling
#: (with exporting and linking) took
stats = {"loaded": 0, "loaded_so": 0, "compiled": 0, "written": 0, "load_s": 0.0, "compile_s": 0.0}
_digest: list = []
_modules: list = []  # loaded libraries stay loaded: their functions run from them


def directory() -> pathlib.Path | None:
    """The cache directory, or None when the cache is disabled."""
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return None
    if os.environ.get(ENV_DIR):
        return pathlib.Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "dsv4_attention"


def hash_sources(roots, dsl_version: str) -> str:
    """sha256 over the .py files under ``roots`` ({name: directory}: paths and contents) and the DSL version."""
    h = hashlib.sha256(f"cutlass-dsl {dsl_version}\n".encode())
    for name, root in sorted(roots.items()):
        root = pathlib.Path(root)
        for p in sorted(root.rglob("*.py")):
            if "__pycache__" not in p.parts:
                h.update(f"{name}/{p.relative_to(root).as_posix()}\n".encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def source_digest() -> str:
    """This library's sources and CuTeDSL version, hashed once per process."""
    if not _digest:
        from importlib.util import find_spec

        # where the packages are, without importing them (stages imports every stage package)
        roots = {name: find_spec(name).submodule_search_locations[0]
                 for name in ("dsv4_attention.common", "dsv4_attention.stages")}
        _digest.append(hash_sources(roots, dsl_version()))
    return _digest[0]


def dsl_version() -> str:
    """The installed CuTeDSL's version, read from its package metadata (importing it takes seconds)."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # a build without the wheel's metadata
        import cutlass

        return getattr(cutlass, "__version__", "?")


def link_shared(obj: str, out: str) -> bool:
    """Link the exported object ``obj`` into the shared library ``out`` against the runtime
    libraries the DSL found (absolute run paths); False where there is no C compiler or it fails."""
    from cutlass.cute.runtime import find_runtime_libraries

    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        return False
    cmd = [cc, "-shared", "-o", out, obj]
    for lib in find_runtime_libraries(enable_tvm_ffi=True):
        d, base = os.path.split(os.path.realpath(lib))
        cmd += [f"-L{d}", f"-l:{base}", f"-Wl,-rpath,{d}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        print(f"dsv4_attention: linking {obj} failed ({p.stderr.strip()[-300:]}); the entry stays an object file",
              file=sys.stderr)
    return p.returncode == 0


def load_entry(path: pathlib.Path, name: str):
    """The TVM-FFI function of an entry: a shared library through TVM-FFI alone, an object file
    through the DSL."""
    if path.suffix == ".so":
        import tvm_ffi

        module = tvm_ffi.load_module(str(path))
        fn = module[name]
        _modules.append(module)
        stats["loaded_so"] += 1
        return fn
    from cutlass.cute.runtime import load_module

    return load_module(str(path), enable_tvm_ffi=True)[name]


def entry_name(key) -> str:
    """The entry's name (a C identifier: it is also the exported symbol prefix)."""
    return "dsv4_" + hashlib.sha256(f"{key!r}\n{source_digest()}".encode()).hexdigest()[:40]


def raw_function(compiled):
    """The TVM-FFI function of a ``cute.compile`` result: called positionally, without the DSL's
    Python keyword-argument wrapper in front of it (what a loaded entry is already)."""
    return compiled.__tvm_ffi_object__()


def load_or_compile(key, compile_fn):
    """The compiled function for ``key`` (a repr-stable tuple), as a TVM-FFI function taking the
    kernel's arguments positionally: loaded from the directory if an entry of this key and these
    sources exists, else ``compile_fn()`` (a ``jit.compile_kernel`` result), then exported there."""
    t0 = time.perf_counter()
    d = directory()
    if d is None:
        stats["compiled"] += 1
        fn = raw_function(compile_fn())
        stats["compile_s"] += time.perf_counter() - t0
        return fn
    name = entry_name(key)
    for path in (d / f"{name}.so", d / f"{name}.o"):
        if path.is_file():
            try:
                fn = load_entry(path, name)
                stats["loaded"] += 1
                stats["load_s"] += time.perf_counter() - t0
                return fn
            except Exception as e:  # noqa: BLE001 - a damaged entry is recompiled, never fatal
                print(f"dsv4_attention: cache entry {path} did not load ({type(e).__name__}: {e}); recompiling",
                      file=sys.stderr)
    fn = compile_fn()
    stats["compiled"] += 1
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d, prefix=".tmp-") as tmp:
            obj = os.path.join(tmp, f"{name}.o")
            fn.export_to_c(obj, name)  # TVM-FFI export: the object file's path
            if link_shared(obj, os.path.join(tmp, f"{name}.so")):
                os.replace(os.path.join(tmp, f"{name}.so"), d / f"{name}.so")
                (d / f"{name}.o").unlink(missing_ok=True)  # an older object entry of this name
            else:
                os.replace(obj, d / f"{name}.o")
        stats["written"] += 1
    except Exception as e:  # noqa: BLE001 - a read-only disk or a kernel the DSL cannot export costs a
        # recompile in the next process, nothing more
        print(f"dsv4_attention: could not write cache entry {d / name}: {type(e).__name__}: {str(e)[-300:]}",
              file=sys.stderr)
    stats["compile_s"] += time.perf_counter() - t0
    return raw_function(fn)


def entries(d: pathlib.Path | None = None) -> list[pathlib.Path]:
    d = directory() if d is None else d
    if d is None or not d.is_dir():
        return []
    return sorted([*d.glob("dsv4_*.so"), *d.glob("dsv4_*.o")])


def clear() -> int:
    """Delete every entry; returns how many."""
    found = entries()
    for p in found:
        p.unlink(missing_ok=True)
    return len(found)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else "info"
    d = directory()
    if cmd == "clear":
        print(f"removed {clear()} entries from {d}")
    elif cmd == "info":
        found = entries()
        size = sum(p.stat().st_size for p in found)
        print(f"directory: {d if d is not None else f'(disabled by {ENV_DISABLE})'}")
        print(f"entries:   {len(found)} ({size / 2**20:.1f} MiB)")
        print(f"sources:   {source_digest()[:16]} (entries of other sources are never served)")
    else:
        print("usage: python -m dsv4_attention.common.kernel_cache [info|clear]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
