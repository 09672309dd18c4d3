"""Sessions. Each (but lint and docs) is a thin wrapper over a command that runs the same
way on the GPU machine, where it is called as ``nox -fb none --no-install -s NAME``
(no virtualenv, nothing installed: the machine brings torch, the pack brings CuTeDSL).

    tests       all tests (GPU tests skip, saying why, where their architecture is absent)
    stage_<id>  one stage's tests (CPU part here, GPU part on a GPU): stage_a, stage_b, stage_c
    bench       benchmarks against the peers (GPU)
    demo        the main job: DeepSeek-V4's shapes on a GPU, or their kernels compiled without one
    compile_sweep  every stage at every head dim compiled for both architectures
    compare     one row per stage: what it adds, compile time and resources, GPU error and time
    gpu_report  GPU tests + benchmarks -> $OUT/<gpu>.json (`-- --tests stage --stage e`: one stage's tests)
    cp_demo     context-parallel attention over the machine's GPUs (torchrun)
    status      record the CPU suite and render the README / docs status table
    lint, docs  ruff and pyright (every import resolves); mkdocs build --strict (this machine only)
"""

import os
import shutil
import sys

import nox  # pyright: ignore[reportMissingImports] (there when nox runs this)

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

# On the CPU machines `pip install torch==2.13.0` takes the CPU build from a local file;
# a looser request would download a multi-GB CUDA build. A machine with an NVIDIA driver
# gets the CUDA build the project's range selects.
CPU_TORCH = "torch==2.13.0"
GPU_TORCH = "torch>=2.11,<2.14"


def _install(session, extras="test"):
    if session.virtualenv.venv_backend == "none":
        return  # GPU machine: everything is already importable
    session.install(GPU_TORCH if shutil.which("nvidia-smi") else CPU_TORCH)
    session.install("-e", f".[{extras}]")


def _python(session):
    return "python" if session.virtualenv.venv_backend != "none" else sys.executable


def _pytest(session, *args):
    _install(session)
    session.run(_python(session), "-m", "pytest", *args, *session.posargs)


@nox.session
def tests(session):
    _pytest(session, "-n", os.environ.get("PYTEST_WORKERS", "auto"), "tests")


# one session per stage: `nox -s stage_b` runs stage B's tests (CPU part here, GPU part on a GPU)
STAGE_IDS = ("a", "b", "c", "d1", "d2", "d3", "d4", "d5", "e", "f")


def _stage_session(stage_id):
    def run(session):
        _pytest(session, "-n", os.environ.get("PYTEST_WORKERS", "auto"), "-m", f"stage_{stage_id}", "tests")

    run.__doc__ = f"stage {stage_id.upper()}'s tests"
    return nox.session(name=f"stage_{stage_id}")(run)


for _sid in STAGE_IDS:
    _stage_session(_sid)


@nox.session
def bench(session):
    _install(session)
    session.run(_python(session), "-m", "tools.bench", *session.posargs)


@nox.session
def warmup(session):
    """Compile every configuration of the presets into the kernel cache, in parallel (no GPU needed):
    `nox -s warmup -- --preset dsv4 --arch sm90`."""
    _install(session)
    session.run(_python(session), "-m", "dsv4_attention.common.warmup", *session.posargs)


@nox.session
def demo(session):
    _install(session)
    session.run(_python(session), "-m", "tools.demo", *session.posargs)


@nox.session
def compile_sweep(session):
    """every stage at every head dim compiled for sm_90a and sm_100a (no GPU needed; tens of minutes)"""
    _install(session)
    session.run(_python(session), "-m", "tools.demo", "--sweep", *session.posargs)


@nox.session
def compare(session):
    _install(session)
    session.run(_python(session), "-m", "tools.compare", *session.posargs)


@nox.session
def gpu_report(session):
    _install(session)
    session.run(_python(session), "-m", "tools.gpu_report", *session.posargs)


@nox.session
def cp_demo(session):
    """context-parallel attention on every GPU of this machine (torchrun; common/context_parallel.py)"""
    _install(session)
    import torch

    gpus = str(max(torch.cuda.device_count(), 1)) if torch.cuda.is_available() else "1"
    session.run(_python(session), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", gpus, "-m",
                "tools.cp_demo", *session.posargs)


@nox.session
def status(session):
    _install(session)
    session.run(_python(session), "-m", "tools.status", *(session.posargs or ["record"]))


@nox.session
def lint(session):
    """ruff, and pyright's import check: every import resolves (tests/test_static_imports.py; the
    project's install brings pyright, from the [test] extra, and the packages it resolves against)"""
    _install(session)
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run(_python(session), "tests/test_static_imports.py")


@nox.session
def docs(session):
    session.install("mkdocs-material")
    session.run("mkdocs", "build", "--strict")
