"""The install a user gets: the wheel holds one import name, ``dsv4_attention`` (nothing generic
such as ``common`` or ``stages`` at the top of site-packages), and from outside the repository a
fresh virtual environment with only the wheel installed imports the final kernel and compiles a
stage's kernel from the installed files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OUTSIDE = r"""
import importlib.util, json, os, sys
import dsv4_attention
from dsv4_attention import STAGES, attention
from dsv4_attention.common.compile import compile_report
import dsv4_attention.stages.d4_causal_window.sm90, dsv4_attention.stages.d4_causal_window.sm100
rep = compile_report("a", "sm90", "bfloat16", 64)
print(json.dumps({"file": dsv4_attention.__file__, "path": list(dsv4_attention.__path__),
                  "stages": [s.id for s in STAGES], "attention": attention.__module__,
                  "common": importlib.util.find_spec("common") is not None,
                  "stages_top": importlib.util.find_spec("stages") is not None,
                  "compiled": rep.ok, "error": rep.error}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # the build backend (setuptools) is a test dependency (pyproject's [test] extra) and in the
    # GPU machine's environment: without it this test fails, it does not skip
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("dsv4_attention", "tools"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("common", "stages"):  # the checkout's top-level links to the package's folders, as links
        os.symlink(os.readlink(os.path.join(ROOT, name)), src / name)
    dist = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(dist)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = dist.glob("dsv4_attention-*.whl")
    return whl


def test_wheel_claims_one_import_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"dsv4_attention", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for module in ("dsv4_attention/__init__.py", "dsv4_attention/common/kernel_cache.py",
                   "dsv4_attention/stages/__init__.py", "dsv4_attention/stages/d4_causal_window/sm90.py",
                   "dsv4_attention/stages/d4_causal_window/sm100.py"):
        assert module in names, module
    # every stage package of the checkout ships (an editable install here would hide a missing one)
    stages_dir = os.path.join(ROOT, "dsv4_attention", "stages")
    packages = [d for d in os.listdir(stages_dir) if os.path.isfile(os.path.join(stages_dir, d, "__init__.py"))]
    for stage in sorted(packages):
        kernels = [f for f in ("sm90.py", "sm100.py") if os.path.isfile(os.path.join(stages_dir, stage, f))]
        assert "sm90.py" in kernels, stage  # every stage has its Hopper kernel (stage F no sm100 one yet)
        for f in ("__init__.py", *kernels):
            assert f"dsv4_attention/stages/{stage}/{f}" in names, (stage, f)
    # and so does every module of dsv4_attention.common and dsv4_attention.stages, each once, from the
    # package's own folders (the top-level links common and stages add no package of their own)
    package = os.path.join(ROOT, "dsv4_attention")
    modules = sorted(os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
                     for d, _, files in os.walk(package) if "__pycache__" not in d for f in files if f.endswith(".py"))
    assert "dsv4_attention/common/softmax.py" in modules and "dsv4_attention/stages/e_fused/sm90.py" in modules
    shipped = sorted(n for n in names if n.endswith(".py"))
    assert shipped == modules, sorted(set(shipped) ^ set(modules))
    assert not any(n.startswith(("tests/", "tools/")) or "/tests/" in n for n in names)


def test_fresh_environment_imports_and_compiles(wheel, tmp_path):
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site,
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # the dependencies (torch, CuTeDSL) come from this environment, after the wheel's own directory
    outer = [d for d in sys.path if d.endswith("-packages") and os.path.isdir(d)]
    with open(os.path.join(site, "zz_outer_dependencies.pth"), "w") as f:
        f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in outer))
    # PYTHONPATH may carry the dependencies (the GPU machine's pack does), never the repository
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.realpath(p) != os.path.realpath(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    env["DSV4_ATTENTION_DISABLE_CACHE"] = "1"
    p = subprocess.run([str(py), "-c", OUTSIDE], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(site), f"imported {out['file']}, not the installed wheel"
    assert out["path"] == [os.path.join(site, "dsv4_attention")], out["path"]
    assert out["stages"][:7] == ["a", "b", "c", "d1", "d2", "d3", "d4"]
    assert out["attention"] == "dsv4_attention.stages"
    assert not out["common"] and not out["stages_top"], "the install must not claim 'common' or 'stages'"
    assert out["compiled"], out["error"]
