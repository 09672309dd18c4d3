"""Compile harness: build any stage kernel for either architecture without a GPU.

``compile_report(stage, arch, dtype, head_dim)`` compiles in a child process
with CuTeDSL's file cache off and a hard time limit (a compile that hangs, as
the origin's head-dim-512 kernel did for hours, fails instead of hanging the
suite), and returns what the compiler made:

- ``seconds``: wall time of ``cute.compile`` (trace + MLIR + ptxas), file cache off. The
  budget tests' compile prints ptxas's report (``remarks{ptx}``), whose diagnostics only add work
  (35-100 % more than the plain compile a user waits for): its time is an upper bound of the plain
  one's (``timed_with_report``), and ``assert_within_budget`` times a plain compile only where
  the bound misses the budget. One compile instead of a plain one and a second with the report:
  CI's ~190 compile tests each did both;
- ``queued_seconds``: of ``seconds``, the time the compiling thread sat runnable while the machine
  ran other work (the scheduler's run delay). The budget bounds ``seconds - queued_seconds``, the
  compile's time on a core of its own (``CompileReport.own_core_seconds``): CI runs two pytest
  workers on two cores, and an E hd 512 compile of 24.8 s of CPU took 31 s of wall there;
- ``registers``, ``spill_store_bytes``, ``spill_load_bytes``, ``stack_bytes``: from
  ptxas's own report (or, in the one plain compile of ``once``, from the cubin);
- ``smem_bytes``: the kernel's shared-storage struct (dynamic SMEM is not in the cubin);
- ``tmem_columns`` (sm100): the column count the kernel passes to its TMEM allocation;
- ``warnings``: ptxas warnings and its coded remarks, which it prints as info lines: C7508
  (setmaxnreg ignored) and C7519 ("wgmma.mma_async instructions are serialized": every wgmma
  waited for before the next issues; the persistent seesaw's first build ran 27 % slower on the
  H200 with it), and others.
- ``nested_elects``: PTX lines of an ``elect.sync`` inside another's one-lane region (a hang).

Run directly: ``python -m common.compile STAGE ARCH DTYPE HEAD_DIM [OPTIONS_JSON] [--once]`` prints
one JSON line (OPTIONS_JSON: the kernel's keyword options, e.g. '{"kv_shared": true}').

Without a GPU, ``compile_report`` hands its compiles to a **compile server**, one child per
calling process (``--serve``) that imports torch, the DSL and every stage's kernel modules once
and forks a fresh process per compile: what each compile does and what it is timed on are those of
a fresh process (the server never compiles, so the fork holds no compiled kernel and no traced
function), minus the 2-4 s of imports a fresh interpreter spends before its compile starts, which
CI's ~190 compile tests paid each. A GPU machine keeps one interpreter per compile (a fork after
the CUDA driver started is undefined; the server would not start it, but nothing here enforces it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

SMEM_LIMIT = 232448  # bytes of dynamic shared memory per CTA, sm90 and sm100
TMEM_COLUMNS = 512
COMPILE_BUDGET_S = 30.0  # seconds of one compile on a core of its own, file cache off (the brief's bound)
#: CPU seconds of one compile (this process and its children): what the compile costs whatever else
#: the machine runs (the figures: docs/history.md).
COMPILE_CPU_BUDGET_S = 30.0


@dataclasses.dataclass
class CompileReport:
    stage: str
    arch: str
    dtype: str
    head_dim: int
    seconds: float | None = None
    cpu_seconds: float | None = None  # user + system, this process and its children
    #: of ``seconds``, the time the compiling thread sat runnable while the machine ran other work
    #: (the scheduler's run delay, /proc/thread-self/schedstat); None where the kernel does not say
    queued_seconds: float | None = None
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    stack_bytes: int | None = None
    smem_bytes: int | None = None
    tmem_columns: int | None = None
    warnings: list = dataclasses.field(default_factory=list)
    error: str | None = None
    options: dict = dataclasses.field(default_factory=dict)  # the kernel's compile-time keyword options
    register_plan: list | None = None  # [(threads, setmaxnreg target), ...] per role; None: setmaxnreg unused
    nested_elects: list = dataclasses.field(default_factory=list)  # PTX lines (``nested_elects``); [] = none
    timed_with_report: bool = False  # ``seconds`` of the compile that printed ptxas's report: an upper bound

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def own_core_seconds(self) -> float:
        """The compile's time on a core of its own, what the budget bounds: its wall time less the
        time it sat queued. A busy machine (CI's two pytest workers on two cores) lengthens the wall
        time by what it gives to other processes, not by the compile's work; a compile that blocks
        (on a file, a lock) is charged for it."""
        return self.seconds - (self.queued_seconds or 0.0)

    def row(self) -> str:
        if self.error:
            return f"{self.stage} {self.arch} {self.dtype} hd{self.head_dim} {self.options}: ERROR {self.error}"
        opts = "".join(f" {k}={v}" for k, v in sorted(self.options.items()))
        tmem = f" tmem={self.tmem_columns}cols" if self.tmem_columns is not None else ""
        return (
            f"{self.stage} {self.arch:5s} {self.dtype:8s} hd{self.head_dim:<3d} "
            f"compile{'<=' if self.timed_with_report else '='}{self.seconds:5.2f}s "
            + (f"(queued {self.queued_seconds:.2f}s) " if self.queued_seconds else "")
            + f"cpu={self.cpu_seconds if self.cpu_seconds is None else round(self.cpu_seconds, 2)}s "
            f"regs={self.registers} "
            + (f"spill={self.spill_store_bytes}/{self.spill_load_bytes}B " if self.spill_store_bytes is not None
               else f"stack={self.stack_bytes}B ")
            + f"smem={self.smem_bytes}B{tmem}{opts}"
        )


_PTXAS_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers",
    re.S,
)


def parse_ptxas(text: str) -> dict:
    """Worst case over the kernels ptxas reported (one per stage kernel)."""
    out = {"stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0, "registers": 0}
    found = False
    for m in _PTXAS_RE.finditer(text):
        found = True
        stack, st, ld, regs = map(int, m.groups())
        out["stack_bytes"] = max(out["stack_bytes"], stack)
        out["spill_store_bytes"] = max(out["spill_store_bytes"], st)
        out["spill_load_bytes"] = max(out["spill_load_bytes"], ld)
        out["registers"] = max(out["registers"], regs)
    if not found:
        raise RuntimeError("no ptxas resource report found in the compiler output")
    # ptxas's warnings, and its coded remarks, which it prints as info lines: (C7508) setmaxnreg
    # ignored, (C7519) wgmma serialized, ...
    out["warnings"] = sorted(set(re.findall(r"ptxas warning\s*:\s*(.*)", text))
                             | set(re.findall(r"ptxas info\s*:\s*(\(C\d+\)[^\n']*)", text)))
    return out


_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT = 0x11, 0x2F  # attributes of a cubin's .nv.info section


def cubin_resources(cubin: bytes) -> dict:
    """Registers and stack frame from a cubin's ``.nv.info`` section (what ptxas records for the
    driver), for a compile without ptxas's printed report: ``registers`` the largest register count
    of a function that has one (the kernel's), ``stack_bytes`` the largest frame of any function.
    Spills live in the frame, so a frame of 0 bytes means none; a nonzero frame does not say how much
    of it is spill (ptxas's report does). ELF64 little-endian; .nv.info holds 4-byte entries
    (format, attribute, 2 bytes), a format-4 entry followed by as many bytes as those 2 say:
    (symbol, value) for these two attributes."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = headers[names][4]
    out = {"registers": 0, "stack_bytes": 0}
    for h in headers:
        name = cubin[strtab + h[0]:cubin.index(b"\0", strtab + h[0])]
        if name != b".nv.info":
            continue
        data, i = cubin[h[4]:h[4] + h[5]], 0
        while i + 4 <= len(data):
            fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
            if fmt == 4 and size == 8 and attr in (_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT):
                value = struct.unpack_from("<I", data, i + 8)[0]
                key = "registers" if attr == _EIATTR_REGCOUNT else "stack_bytes"
                out[key] = max(out[key], value)
            i += 4 + (size if fmt == 4 else 0)
    return out


_ELECT = re.compile(r"^\s*elect\.sync\s+%\w+\|(%p\d+)")
_SKIP = re.compile(r"^\s*@!?%p\d+\s+bra(?:\.uni)?\s+(\$?\w+);")
_BRANCH = re.compile(r"^bra(?:\.uni)?\s")  # unpredicated


def nested_elects(ptx: str) -> list:
    """PTX line numbers (1-based) of ``elect.sync`` instructions inside another's one-lane region.

    ``elect_one`` lowers to ``elect.sync`` with the full mask and a branch that sends the other
    lanes to a label past the region. Some DSL copies (the TMA reduce-add, ``cp.reduce.async.bulk``)
    elect a lane themselves; inside ``elect_one`` that second ``elect.sync`` runs on one lane with a
    full mask, and the warp hangs (stage F's dQ warp did, on an H200). A region is the straight-line
    code after an ``elect.sync`` and its skip branch (within the next three lines), up to the label
    that branch jumps to or an unconditional branch (ptxas places an if-else's arms one after the
    other: the elected arm ends with ``bra.uni`` to the join)."""
    lines = ptx.splitlines()
    out = []
    for i, ln in enumerate(lines):
        if not _ELECT.match(ln):
            continue
        skip = next((m.group(1) for m in map(_SKIP.match, lines[i + 1:i + 4]) if m), None)
        if skip is None:
            continue
        for j in range(i + 1, len(lines)):
            text = lines[j].strip()
            if text.startswith(skip + ":") or _BRANCH.match(text):
                break
            if _ELECT.match(lines[j]):
                out.append(j + 1)
    return sorted(set(out))


class _CaptureStderr:
    """Capture standard error: file descriptor 2 (native code writes there) and ``sys.stderr``
    (the DSL prints ptxas's report through it; under pytest that is not descriptor 2)."""

    def __enter__(self):
        self._file = tempfile.TemporaryFile(mode="w+b")
        sys.stderr.flush()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self._py, sys.stderr = sys.stderr, open(self._file.fileno(), "w", closefd=False)  # noqa: SIM115
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = self._py
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()
        return False


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _queued_seconds() -> float | None:
    """Seconds this thread has sat runnable waiting for a CPU (the second field of
    /proc/thread-self/schedstat, nanoseconds); None where the kernel keeps no such count."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def timed_compile(kernel, args, arch: str, once: bool = False) -> dict:
    """One compile of ``kernel`` against ``args`` (``jit.compile_kernel``), timed, its PTX kept:
    ``seconds``, ``cpu_seconds``, ``queued_seconds``, ``nested_elects`` and, by default, what ptxas's report says
    (``parse_ptxas``: registers, frame, spills, ``warnings``), captured from standard error while
    the compile prints it; ``once``: a plain compile, registers and frame from its cubin."""
    import contextlib

    from dsv4_attention.common import jit

    flags = "--keep-ptx --keep-cubin" if once else "remarks{ptx} --keep-ptx"
    with tempfile.TemporaryDirectory() as d, (contextlib.nullcontext() if once else _CaptureStderr()) as cap:
        t0, c0, q0 = time.perf_counter(), _cpu_seconds(), _queued_seconds()
        fn = jit.compile_kernel(kernel, args, arch, f"{flags} --dump-dir={d}")
        q1 = _queued_seconds()
        out = {"seconds": round(time.perf_counter() - t0, 3), "cpu_seconds": round(_cpu_seconds() - c0, 3),
               "queued_seconds": None if q0 is None or q1 is None else round(q1 - q0, 3),
               "nested_elects": nested_elects(jit.artifact_bytes(fn.artifacts.PTX).decode())}
        if once:
            out.update(cubin_resources(jit.artifact_bytes(fn.artifacts.CUBIN)))
    if not once:
        out.update(parse_ptxas(cap.text))
    return out


def compile_here(stage_id: str, arch: str, dtype_name: str, head_dim: int,
                 options: dict | None = None, once: bool = False) -> CompileReport:
    """Compile in this process (the child side of ``compile_report``), once, timed, the PTX kept.
    By default the compile prints ptxas's report (``remarks{ptx}``: registers, stack frame, spills,
    its remarks), captured from standard error; its time is an upper bound of a plain compile's
    (``timed_with_report``). ``once``: a plain compile, its cubin kept: registers and the stack
    frame from the cubin (``cubin_resources``), no spill counts (a frame of 0 bytes has none) and
    no ptxas warnings (the demo's, and the plain time ``assert_within_budget`` asks for where the
    bound misses the budget)."""
    import torch

    from dsv4_attention import stages
    from dsv4_attention.common.arch import target_arch

    dtype = getattr(torch, dtype_name)
    mod = stages.get(stage_id).module
    options = dict(options or {})
    rep = CompileReport(stage_id, arch, dtype_name, head_dim, options=options, timed_with_report=not once)
    args = mod.example_args(dtype, head_dim, **options)

    # the target is this call's arch, not the GPU's or CUTE_DSL_ARCH's, also for what the kernel
    # builds outside cute.compile (its constructor, shared_storage); nothing here is launched
    with target_arch(arch):
        kernel = mod.make_kernel(arch, dtype, head_dim, **options)
        res = timed_compile(kernel, args, arch, once)
        rep.smem_bytes = int(kernel.shared_storage.size_in_bytes())
        tmem = getattr(kernel, "tmem_columns", None)
        rep.tmem_columns = None if tmem is None else int(tmem)
        plan = getattr(kernel, "register_plan", None)
        rep.register_plan = None if plan is None else plan()
    for k, v in res.items():
        setattr(rep, k, v)
    return rep


def _child_env() -> tuple:
    """(environment, working directory) of a compile's process: the file cache off, the package's
    own directory first on the path (the repository, or site-packages when installed)."""
    import dsv4_attention

    env = dict(os.environ, CUTE_DSL_DISABLE_FILE_CACHING="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(dsv4_attention.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env, root


_server: list = []  # this process's compile server (a Popen), started on first use


def _use_server() -> bool:
    flag = os.environ.get("DSV4_COMPILE_SERVER")
    if flag is not None:
        return flag == "1"
    import shutil

    return shutil.which("nvidia-smi") is None  # no GPU driver here: forking cannot meet a CUDA context


def _served(request: list, timeout: float) -> dict | None:
    """The server's answer to ``request``, or None where the server cannot answer (then the caller
    compiles in a fresh interpreter): started once per process, restarted once if it died."""
    for _ in range(2):
        if not _server or _server[0].poll() is not None:
            env, root = _child_env()
            _server[:] = [subprocess.Popen([sys.executable, "-m", "dsv4_attention.common.compile", "--serve"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                           text=True, env=env, cwd=root)]
        srv = _server[0]
        try:
            srv.stdin.write(json.dumps([*request, timeout]) + "\n")
            srv.stdin.flush()
            line = srv.stdout.readline()  # the server enforces the time limit on its child
        except (BrokenPipeError, OSError):
            line = ""
        if line.startswith("{"):
            return json.loads(line)
        srv.kill()
    return None


def compile_report(stage_id: str, arch: str, dtype_name: str, head_dim: int, timeout: float = 120.0,
                   options: dict | None = None, once: bool = False) -> CompileReport:
    """Compile in a child process (forked by the compile server, or a fresh interpreter) with the
    file cache off and a time limit (``compile_here`` says what ``once`` changes)."""
    options = dict(options or {})
    if _use_server():
        res = _served([stage_id, arch, dtype_name, head_dim, options, once], timeout)
        if res is not None:
            return CompileReport(**res)
    env, root = _child_env()
    cmd = [sys.executable, "-m", "dsv4_attention.common.compile", stage_id, arch, dtype_name, str(head_dim),
           json.dumps(options)] + (["--once"] if once else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        return CompileReport(stage_id, arch, dtype_name, head_dim, error=f"compile exceeded {timeout:.0f} s",
                             options=options)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-15:]
        return CompileReport(stage_id, arch, dtype_name, head_dim, error="\n".join(tail) or f"exit {p.returncode}",
                             options=options)
    return CompileReport(**json.loads(lines[-1]))


def _report(stage_id, arch, dtype_name, hd, options, once=False) -> CompileReport:
    try:
        return compile_here(stage_id, arch, dtype_name, int(hd), options, once)
    except Exception as e:  # noqa: BLE001 - reported to the parent as data
        return CompileReport(stage_id, arch, dtype_name, int(hd), error=f"{type(e).__name__}: {e}", options=options)


def serve() -> int:
    """The compile server: one request a line on stdin ([stage, arch, dtype, head_dim, options, once,
    timeout]), one CompileReport a line on stdout. Each compile runs in a child forked from this
    process, which has imported what every compile imports and compiled nothing; the child reports
    through a file (stdout is the protocol's), and one past ``timeout`` is killed and reported so."""
    import importlib
    import signal

    import cutlass.cute  # noqa: F401 - imported once here, inherited by every fork
    import torch  # noqa: F401

    from dsv4_attention import stages

    for st in stages.ALL_STAGES:
        for target in getattr(st.module, "KERNELS", {}).values():
            importlib.import_module(target.split(":")[0])
    for line in sys.stdin:
        stage_id, arch, dtype_name, hd, options, once, timeout = json.loads(line)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        pid = os.fork()
        if pid == 0:  # the child: stdout is the protocol's; leave without the parent's exit code
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            with open(path, "w") as out:
                out.write(json.dumps(dataclasses.asdict(_report(stage_id, arch, dtype_name, hd, options, once))))
            os._exit(0)
        deadline = time.monotonic() + timeout
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        with open(path) as inp:
            text = inp.read()
        os.unlink(path)
        if not text.startswith("{"):
            text = json.dumps(dataclasses.asdict(CompileReport(
                stage_id, arch, dtype_name, int(hd), options=options,
                error=f"compile exceeded {timeout:.0f} s" if time.monotonic() > deadline else "compile child died")))
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve()
    stage_id, arch, dtype_name, hd = argv[:4]
    once = "--once" in argv
    argv = [a for a in argv if a != "--once"]
    rep = _report(stage_id, arch, dtype_name, hd, json.loads(argv[4]) if len(argv) > 4 else {}, once)
    print(json.dumps(dataclasses.asdict(rep)))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())


def register_split_error(plan: list | None, registers: int) -> str | None:
    """None if a setmaxnreg plan fits the CTA it runs in, else what is wrong. A launch gives each
    thread ``registers`` (ptxas's count); ``setmaxnreg.inc`` takes registers only from the CTA's
    pool of threads x registers, and a warp whose target the pool cannot meet waits for ever (a
    hang, no error). So the roles' targets, each a multiple of 8 in [24, 256], must sum to at most
    the pool. A warpgroup that decreases (its target under ``registers``) releases the rest."""
    if not plan:
        return None
    threads = sum(t for t, _ in plan)
    for t, r in plan:
        if t % 128 or r % 8 or not 24 <= r <= 256:
            return f"role of {t} threads at {r} registers: setmaxnreg takes warpgroups, multiples of 8 in [24, 256]"
    need, pool = sum(t * r for t, r in plan), threads * registers
    if need > pool:
        return (f"setmaxnreg plan {plan} needs {need} registers; the launch gives {threads} threads x "
                f"{registers} = {pool}: the increasing warps wait for ever")
    return None


def assert_within_budget(stage_id: str, arch: str, dtype_name: str, head_dim: int, min_tmem_columns: int = 32,
                         options: dict | None = None, max_spill_bytes: int = 0):
    """Compile and assert the budgets every stage kernel keeps: compile time under
    COMPILE_BUDGET_S on a core of its own (``CompileReport.own_core_seconds``: the wall time less
    the time the compile sat queued behind other work) and COMPILE_CPU_BUDGET_S of CPU (file cache
    off), spills (stores and loads) at most ``max_spill_bytes``
    (0: none; a stage that allows some says why beside the number), SMEM within SMEM_LIMIT,
    no ignored setmaxnreg (C7508), a setmaxnreg split the launch's registers hold
    (``register_split_error``), no serialized wgmma (C7519), and on sm100 a power-of-two TMEM allocation of at least
    ``min_tmem_columns`` and at most 512 columns, and no ``elect.sync`` nested in another's region
    (``nested_elects``: a hang). The time is that of the compile with ptxas's report, an upper bound
    of the plain compile's; where it misses a budget, one plain compile is timed and decides.
    Returns the report."""
    rep = compile_report(stage_id, arch, dtype_name, head_dim, timeout=4 * COMPILE_BUDGET_S, options=options)
    assert rep.ok, rep.error

    def within(r):
        return r.own_core_seconds < COMPILE_BUDGET_S and r.cpu_seconds < COMPILE_CPU_BUDGET_S

    if not within(rep):  # the bound misses: the plain compile a user waits for decides
        print(rep.row())
        plain = compile_report(stage_id, arch, dtype_name, head_dim, timeout=4 * COMPILE_BUDGET_S, options=options,
                               once=True)
        assert plain.ok, plain.error
        rep.seconds, rep.cpu_seconds, rep.queued_seconds = plain.seconds, plain.cpu_seconds, plain.queued_seconds
        rep.timed_with_report = False
    print(rep.row())
    assert rep.own_core_seconds < COMPILE_BUDGET_S, rep.row()
    assert rep.cpu_seconds < COMPILE_CPU_BUDGET_S, rep.row()
    assert rep.spill_store_bytes <= max_spill_bytes and rep.spill_load_bytes <= max_spill_bytes, rep.row()
    assert 0 < rep.smem_bytes <= SMEM_LIMIT, rep.row()
    assert not any("C7508" in w or "C7519" in w for w in rep.warnings), rep.warnings
    assert not rep.nested_elects, f"elect.sync inside an elect_one region (a hang) at PTX lines {rep.nested_elects}"
    assert register_split_error(rep.register_plan, rep.registers) is None, register_split_error(
        rep.register_plan, rep.registers)
    if arch == "sm100":
        cols = rep.tmem_columns
        assert cols is not None and min_tmem_columns <= cols <= TMEM_COLUMNS, rep.row()
        assert cols & (cols - 1) == 0, f"TMEM allocations are powers of two: {rep.row()}"
    else:
        assert rep.tmem_columns is None, rep.row()
    return rep
