"""Static tools resolve every import of the repository (issue 42): pyright, with the project's
pyrightconfig.json (dsv4_attention, tools, tests and noxfile.py; type checking off), reports no
import it cannot resolve, and no name imported from a first-party module that is not there. The
package is real on disk, so this holds without running anything: no ``__path__`` manipulation.

Also a script: ``python tests/test_static_imports.py`` prints the unresolved imports and exits
non-zero if there is one (``nox -s lint`` runs it). Skips where pyright (the PyPI package, a test
dependency) is not installed; pyright fetches its Node.js package on its first run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_PARTY = ("dsv4_attention", "tools")

# what pyright says of an import it cannot follow
UNRESOLVED = re.compile(r'^Import "[\w.]+" could not be resolved')
UNKNOWN_SYMBOL = re.compile(r'^"\w+" is unknown import symbol')
MISSING_ATTRIBUTE = re.compile(rf'^"\w+" is not a known attribute of module "(?:{"|".join(FIRST_PARTY)})\b')


def pyright_command() -> list | None:
    exe = shutil.which("pyright", path=os.path.dirname(sys.executable)) or shutil.which("pyright")
    return None if exe is None else [exe]


def import_diagnostics(cmd: list) -> tuple[dict, list]:
    """pyright's summary and its diagnostics about imports, run at the repository's root with this
    interpreter's packages (torch, CuTeDSL)."""
    p = subprocess.run([*cmd, "--outputjson", "--pythonpath", sys.executable], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        tail = (p.stderr or p.stdout)[-3000:]
        raise AssertionError(f"pyright gave no report (exit {p.returncode}): {tail}") from None
    bad = [d for d in out["generalDiagnostics"]
           if (d.get("rule") == "reportMissingImports" or UNRESOLVED.match(d["message"])
               or UNKNOWN_SYMBOL.match(d["message"]) or MISSING_ATTRIBUTE.match(d["message"]))]
    return out["summary"], bad


def _show(d: dict) -> str:
    start = d["range"]["start"]
    return f"{os.path.relpath(d['file'], ROOT)}:{start['line'] + 1}:{start['character'] + 1} - {d['message']}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pyright_resolves_every_import():
    cmd = pyright_command()
    if cmd is None:
        pytest.skip("pyright is not installed (pip install pyright; it is in the [test] extra)")
    summary, bad = import_diagnostics(cmd)
    assert summary["filesAnalyzed"] > 100, summary  # the config found the sources
    assert not bad, f"{len(bad)} unresolved imports:\n" + "\n".join(map(_show, bad))


def test_the_package_has_no_path_manipulation():
    """A checkout imports dsv4_attention from its own folders only: nothing else is reachable under
    its name (the repository's tools/ is not dsv4_attention.tools)."""
    code = ("import importlib.util, json, dsv4_attention, dsv4_attention.common.report, dsv4_attention.stages.ops; "
            "print(json.dumps([dsv4_attention.__path__, importlib.util.find_spec('dsv4_attention.tools') is None, "
            "dsv4_attention.common.report.__file__]))")
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    path, no_tools, report_file = json.loads(p.stdout.strip().splitlines()[-1])
    assert path == [os.path.join(ROOT, "dsv4_attention")], path
    assert no_tools, "dsv4_attention.tools must not be importable"
    assert report_file == os.path.join(ROOT, "dsv4_attention", "common", "report.py"), report_file


def main() -> int:
    cmd = pyright_command()
    if cmd is None:
        print("pyright is not installed", file=sys.stderr)
        return 2
    summary, bad = import_diagnostics(cmd)
    for d in bad:
        print(_show(d))
    print(f"pyright: {summary['filesAnalyzed']} files, {len(bad)} unresolved imports")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
