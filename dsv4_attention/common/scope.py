"""Which source files a stage's evidence depends on (its scope), found from the imports.

A device report names the code it ran by the sha256 of every source file (common/report.py).
A stage's results in it stay true while the files its tests and benchmarks execute are unchanged,
whatever else changes. This module finds those files statically, importing nothing (the status
render runs in CI, without a GPU or the DSL's import time):

    tests of stage G   the files of G's package, the test files that mark tests ``stage_G``
                       (``pytest.mark.stage_G`` in the code, not the name in a string: a test
                       of the session's selection expressions is not stage G's), and
                       tests/conftest.py
    bench of stage G   the files of G's package and the imports of G's function (``BENCHES[G]``
                       in tools/bench.py, defined in a tools/bench_*.py module) and of every
                       module-level function it names, and the benchmark modules' own

then everything those reach, transitively:

- ``import a.b.c`` and ``from a.b import c`` reach the file of ``a.b.c`` (or of ``a.b`` where
  ``c`` is a name in it) and the ``__init__.py`` of every package above it: Python runs them.
- A string naming a kernel, ``"dsv4_attention.stages.x.sm90:Class"`` (a stage's ``KERNELS``
  table; ``common/jit.kernel_class`` imports it when the stage's kernel runs), reaches that module.
- ``stages/__init__.py`` loads every stage package (the registry, by name). That reaches each
  stage's ``__init__.py`` and what it imports, but not its kernels: a kernel string is followed
  only from a file an import reached, not from one the registry merely loaded.

Results of no stage (the harness tests, host time per call, decode, context parallel) depend on
the whole tree: ``scope`` returns every source file for them.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: this file is dsv4_attention/common/scope.py
PACKAGE = "dsv4_attention"
# A report names each source file by its path in the design card's layout (``common/x.py``,
# ``stages/s/x.py``, ``dsv4_attention/__init__.py``): the top-level ``common`` and ``stages`` are
# links to the package's own folders, ``dsv4_attention/common`` and ``dsv4_attention/stages``,
# which are the ones read (a copy that drops the links loses no source file).
SOURCE_DIRS = ("dsv4_attention", "stages", "common")
WHOLE_TREE = ("none", "calls", "decode", "serving", "cp")
KERNEL_STRING = re.compile(r"^(dsv4_attention(?:\.\w+)+):\w+$")
NORMAL, REGISTERED = 2, 1  # how a file was reached: by an import, or only by the stage registry


def stages_dir(root: pathlib.Path = ROOT) -> pathlib.Path:
    return root / PACKAGE / "stages"


def source_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    """A file's name in a report: its repo-relative path, a file of the package's ``common`` or
    ``stages`` named by the top-level link (``dsv4_attention/common/x.py`` -> ``common/x.py``)."""
    parts = pathlib.Path(path).resolve().relative_to(pathlib.Path(root).resolve()).parts
    if len(parts) > 2 and parts[0] == PACKAGE and parts[1] in ("common", "stages"):
        parts = parts[1:]
    return "/".join(parts)


def source_files(root: pathlib.Path = ROOT) -> dict:
    """{name in a report: file} for every .py file of the library, read from the package's folders,
    in SOURCE_DIRS' order."""
    files = [p for p in (root / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts]
    named = sorted((source_name(p, root), p) for p in files)
    return dict(sorted(named, key=lambda item: SOURCE_DIRS.index(item[0].split("/")[0])))


def all_sources(root: pathlib.Path = ROOT) -> list:
    """Every .py file of the library, by its name in a report (what a report hashes), sorted."""
    return sorted(source_files(root))


def module_file(name: str, root: pathlib.Path, importer: pathlib.Path | None = None) -> pathlib.Path | None:
    """The file of module ``name`` in this repository, or None (a module from elsewhere).
    ``dsv4_attention.common.x`` is dsv4_attention/common/x.py; a bare name imported by a test file
    may be a helper beside it in tests/ (pytest puts that folder on sys.path)."""
    parts = name.split(".")
    bases = [root]
    if importer is not None and importer.parent.name == "tests":
        bases.append(importer.parent)
    for base in bases:
        path = base.joinpath(*parts)
        if (path / "__init__.py").is_file():
            return path / "__init__.py"
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py")
    return None


def _package_of(path: pathlib.Path, root: pathlib.Path) -> list:
    rel = path.relative_to(root).with_suffix("").parts
    return list(rel[:-1])  # __init__.py's package is its folder, a module's is its folder too


def import_targets(nodes, path: pathlib.Path, root: pathlib.Path) -> list:
    """The repository files that the import statements ``nodes`` (found in ``path``) run."""
    out = []

    def reach(name: str):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # every package above runs first
            f = module_file(".".join(parts[:i]), root, path)
            if f is not None:
                out.append(f)

    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                reach(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package_of(path, root)
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module
            reach(base)
            for alias in node.names:
                f = module_file(f"{base}.{alias.name}", root, path)
                if f is not None:
                    out.append(f)
    return out


@functools.cache
def _parsed(path: pathlib.Path, stamp: float) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _tree(path: pathlib.Path) -> ast.Module:
    return _parsed(path, path.stat().st_mtime_ns)


def edges(path: pathlib.Path, root: pathlib.Path) -> tuple:
    """(imported files, kernel-string files, registry files) of one file (found once per version of
    the file: a status render asks for ~250 scopes, each walking the same files)."""
    return _edges(path, root, path.stat().st_mtime_ns)


@functools.cache
def _edges(path: pathlib.Path, root: pathlib.Path, stamp: int) -> tuple:
    tree = _parsed(path, stamp)
    imports = import_targets([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], path, root)
    strings = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            m = KERNEL_STRING.match(n.value)
            if m and (f := module_file(m.group(1), root)) is not None:
                strings.append(f)
    registry = []
    if path == (stages_dir(root) / "__init__.py").resolve():
        registry = sorted(stages_dir(root).glob("*/__init__.py"))
    return imports, strings, registry


def closure(seeds, root: pathlib.Path = ROOT) -> set:
    """Every file reached from ``seeds`` ({path: NORMAL or REGISTERED}), by its name in a report."""
    mode = {}
    todo = list(seeds.items())
    while todo:
        path, how = todo.pop()
        path = pathlib.Path(path).resolve()
        if mode.get(path, 0) >= how:
            continue
        mode[path] = how
        imports, strings, registry = edges(path, root)
        todo += [(f, how) for f in imports]
        todo += [(f, REGISTERED) for f in registry]
        if how == NORMAL:
            todo += [(f, NORMAL) for f in strings]
    return {source_name(p, root) for p in mode}


def stage_folder(stage_id: str, root: pathlib.Path = ROOT) -> pathlib.Path:
    """The package of stage ``stage_id`` (the one whose __init__.py says ``ID = "<id>"``)."""
    for init in sorted(stages_dir(root).glob("*/__init__.py")):
        for node in _tree(init).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ID" for t in node.targets)
                    and isinstance(node.value, ast.Constant) and node.value.value == stage_id):
                return init.parent
    raise ValueError(f"no stage with ID {stage_id!r} under stages/")


def _tools_module(name: str | None, root: pathlib.Path) -> pathlib.Path | None:
    """The file of a ``tools.*`` module (the benchmark modules import each other), else None."""
    if not name or not name.startswith("tools."):
        return None
    path = root / (name.replace(".", "/") + ".py")
    return path if path.is_file() else None


def bench_imports(group: str, root: pathlib.Path = ROOT) -> list:
    """The import statements that ``BENCHES[group]`` runs (tools/bench.py, the registry, and the
    benchmark modules it imports, tools/bench_*.py): every module's own (importing the registry
    runs them all) and those inside every module-level function the group's function reaches,
    transitively, within a module or through a name imported from another benchmark module."""
    registry = root / "tools" / "bench.py"
    modules: dict = {}  # path -> (tree, its functions, names imported from tools modules -> (path, name))

    def load(path):
        if path not in modules:
            tree = _tree(path)
            funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
            imported = {}
            for n in tree.body:
                target = _tools_module(n.module, root) if isinstance(n, ast.ImportFrom) else None
                if target is not None:
                    imported.update({a.asname or a.name: (target, a.name) for a in n.names})
            modules[path] = (tree, funcs, imported)
        return modules[path]

    todo_modules, loaded = [registry], []
    while todo_modules:
        path = todo_modules.pop()
        if path in loaded:
            continue
        loaded.append(path)
        todo_modules += [target for target, _ in load(path)[2].values()]
    nodes = {path: [n for n in modules[path][0].body if isinstance(n, (ast.Import, ast.ImportFrom))
                    and _tools_module(getattr(n, "module", None), root) is None] for path in loaded}
    tree, funcs, imported = modules[registry]
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "BENCHES" for t in n.targets))
    start = next(v.id for k, v in zip(table.keys, table.values, strict=True)
                 if isinstance(k, ast.Constant) and k.value == group)
    seen, todo = set(), [imported.get(start, (registry, start))]
    while todo:
        path, name = todo.pop()
        if (path, name) in seen:
            continue
        seen.add((path, name))
        _, funcs, imported = load(path)
        if name not in funcs:
            continue
        for n in ast.walk(funcs[name]):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                nodes.setdefault(path, []).append(n)
            elif isinstance(n, ast.Name) and n.id in funcs:
                todo.append((path, n.id))
            elif isinstance(n, ast.Name) and n.id in imported:
                todo.append(imported[n.id])
    out = []
    for path, found in nodes.items():
        out += [f for f in import_targets(found, path, root) if f not in out]
    return out


def scope(group: str, kind: str = "tests", root: pathlib.Path = ROOT) -> list:
    """The source files (repo-relative, sorted) that the ``kind`` ("tests" or "bench") evidence of
    ``group`` (a stage id, or a group of no stage: the whole tree) depends on. Found once per
    version of the tree's Python files (a status render asks ~250 times)."""
    root = pathlib.Path(root)
    files = (f for d in (PACKAGE, "tests", "tools") for f in sorted((root / d).rglob("*.py")))
    stamps = tuple((str(f), f.stat().st_mtime_ns) for f in files if "__pycache__" not in f.parts)
    return list(_scope(group, kind, root, stamps))


@functools.cache
def _scope(group: str, kind: str, root: pathlib.Path, stamps: tuple) -> tuple:
    if group in WHOLE_TREE:
        return tuple(all_sources(root))
    folder = stage_folder(group, root)
    seeds = {p: NORMAL for p in sorted(folder.glob("*.py"))}
    if kind == "tests":
        for t in sorted((root / "tests").glob("test_*.py")):
            if marks_stage(t, group):
                seeds[t] = NORMAL
        seeds[root / "tests" / "conftest.py"] = NORMAL
    elif kind == "bench":
        seeds.update({f: NORMAL for f in bench_imports(group, root)})
    else:
        raise ValueError(f"kind must be 'tests' or 'bench'; got {kind!r}")
    inside = set(all_sources(root))
    return tuple(sorted(f for f in closure(seeds, root) if f in inside))


def marks_stage(path: pathlib.Path, group: str) -> bool:
    """Whether the test file marks tests ``stage_<group>``: an attribute ``mark.stage_<group>``
    (``pytest.mark.stage_x``, or ``mark.stage_x`` after ``from pytest import mark``) anywhere in
    its code."""
    name = f"stage_{group}"
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Attribute) and node.attr == name:
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "mark") or \
                    (isinstance(owner, ast.Name) and owner.id == "mark"):
                return True
    return False


def stage_ids(root: pathlib.Path = ROOT) -> list:
    """Every stage's ID, in the order of its package's name (a_..., b_..., ..., e_...)."""
    out = []
    for init in sorted(stages_dir(root).glob("*/__init__.py")):
        for node in _tree(init).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ID" for t in node.targets)
                    and isinstance(node.value, ast.Constant)):
                out.append(node.value.value)
    return out
