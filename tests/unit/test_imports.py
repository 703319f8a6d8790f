"""The import graph, read from the source with ``ast`` (imports inside functions included;
``if TYPE_CHECKING:`` blocks are annotations only and left out): no cycles, and the
boundaries that the folder list promises."""
from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[2]

# Which module belongs to which part of pfs: the longest matching prefix wins.
GROUPS: dict[str, tuple[str, ...]] = {
    "api": ("pfs",),  # pfs/__init__.py: the public API
    "core": ("pfs.core",),
    "client": ("pfs.client",),
    "loader": ("pfs.loader",),
    "tools": ("pfs.tools",),
    "bench": ("pfs.bench",),
    "metaserver": ("pfs.metaserver",),
    "dataserver": ("pfs.dataserver",),
    "mount": ("pfs.fuse",),
}
# The layers the folder list promises: what each group may import (itself included).
# The servers share only the core with the rest (what they share with the client lives
# there, their process helpers too) and never import each other; the client sits on the
# core alone; the loader and the mount on the client; the tools start servers as
# processes and may import anything but the benchmarks, which may import anything.
MAY_IMPORT: dict[str, set[str]] = {
    "core": {"core"},
    "client": {"core", "client"},
    "loader": {"core", "client", "loader"},
    "mount": {"core", "client", "mount"},
    "metaserver": {"core", "metaserver"},
    "dataserver": {"core", "dataserver"},
    "api": {"api", "core", "client", "loader"},
    "tools": set(GROUPS) - {"bench"},
    "bench": set(GROUPS),
}
# What each group may never import.
FORBIDDEN: dict[str, set[str]] = {g: set(GROUPS) - MAY_IMPORT[g] for g in GROUPS}
# Names pfs installed before its folders moved under the pfs namespace: imported by
# nothing (``fuse`` is fusepy's; the others were ours alone only by luck).
TOP_LEVEL_NAMES = {"metaserver", "dataserver", "fuse"}


def package_dirs() -> dict[str, str]:
    """Source folder -> the package name it is installed as: its own name, or a name under
    pfs given by pyproject's package-dir or by a link pfs/NAME -> ../NAME."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    dirs = {"pfs": "pfs", "metaserver": "metaserver", "dataserver": "dataserver", "fuse": "fuse"}
    for package, folder in mapping.items():
        if package and folder in dirs:
            dirs[folder] = package
    for folder in dirs:
        link = ROOT / "pfs" / folder
        if link.is_symlink() and link.resolve() == (ROOT / folder).resolve():
            dirs[folder] = f"pfs.{folder}"
    return dirs


def modules() -> dict[str, Path]:
    """Every project module by its import name."""
    out: dict[str, Path] = {}
    for folder, package in package_dirs().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def group_of(module: str) -> str:
    best, best_len = "", -1
    for group, prefixes in GROUPS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = group, len(p)
    return best


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that module ``name`` (at ``path``) imports."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_group() -> None:
    assert [m for m in modules() if not group_of(m)] == []


def test_no_import_cycles() -> None:
    assert find_cycles(graph()) == []


def test_boundaries() -> None:
    bad = []
    for name, targets in sorted(graph().items()):
        src = group_of(name)
        for t in sorted(targets):
            if group_of(t) in FORBIDDEN.get(src, set()):
                bad.append(f"{name} ({src}) imports {t} ({group_of(t)})")
    assert bad == []


def test_the_layers_hold_as_the_architecture_says() -> None:
    """A few of the rules spelled out, so a change to the table above is a visible one."""
    assert FORBIDDEN["core"] == set(GROUPS) - {"core"}
    assert FORBIDDEN["client"] == set(GROUPS) - {"core", "client"}
    for server in ("metaserver", "dataserver"):
        assert FORBIDDEN[server] >= {"client", "loader", "mount", "tools", "bench", "api",
                                     *({"metaserver", "dataserver"} - {server})}
    assert all("bench" in FORBIDDEN[g] for g in GROUPS if g != "bench")
    assert all(set(MAY_IMPORT[g]) <= set(GROUPS) for g in GROUPS) and set(MAY_IMPORT) == set(GROUPS)


def test_nothing_imports_the_top_level_names() -> None:
    """``import fuse`` / ``metaserver`` / ``dataserver`` (and ``from`` forms) appear in no
    source or test file: those folders are imported as pfs.NAME only."""
    bad = []
    files = [p for f in [*package_dirs(), "tests"] for p in (ROOT / f).rglob("*.py")]
    for path in files:
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if not node.level else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] in TOP_LEVEL_NAMES]
    assert bad == []


def test_the_installed_packages_are_every_package_folder_under_pfs() -> None:
    """What pyproject installs (its package list, or what setuptools' find makes of its
    find rules, links followed as at build time) is exactly the package folders, each by
    its pfs name: a new folder is not left out, and nothing is installed at top level
    but ``pfs``."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("tool", {}).get(
        "setuptools", {})
    packages = tool.get("packages")
    if isinstance(packages, list):
        installed = set(packages)
    else:
        rules = packages.get("find", {}) if isinstance(packages, dict) else {}
        where = rules.get("where", ["."])
        assert len(where) == 1, where
        installed = set(setuptools.find_packages(
            str(ROOT / where[0]), include=rules.get("include", ["*"]),
            exclude=rules.get("exclude", [])))
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert sorted(installed ^ folders) == []
    assert {name.split(".")[0] for name in installed} == {"pfs"}


def test_folders_installed_under_pfs_are_imported_by_that_name() -> None:
    """A folder installed as pfs.NAME imported as NAME works from a checkout (the checkout
    is on sys.path) and nowhere else."""
    mapped = {f for f, package in package_dirs().items() if package != f}
    alternatives = "|".join(mapped) or "$^"
    run_m = re.compile(r"""-m["']?,?\s*["']?(""" + alternatives + r""")\b(?![.\w-])""")
    bad = []
    files = [p for f in [*package_dirs(), "tests"] for p in (ROOT / f).rglob("*.py")]
    for path in files:
        text = path.read_text()
        for node in _import_nodes(ast.parse(text, str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if not node.level else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] in mapped]
        bad += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in run_m.finditer(text)]
    assert bad == []


@pytest.mark.parametrize("src,expected", [
    ("import pfs.wire.rpc\nfrom pfs import cluster\n", {"pfs.wire.rpc", "pfs.cluster"}),
    ("def f():\n    from .rpc import Request\n", {"pfs.wire.rpc"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pfs import cli\n", set()),
])
def test_the_walker_sees_every_kind_of_import(tmp_path: Path, src: str,
                                              expected: set[str]) -> None:
    f = tmp_path / "m.py"
    f.write_text(src)
    known = {"pfs", "pfs.wire", "pfs.wire.rpc", "pfs.wire.x", "pfs.cluster", "pfs.cli"}
    assert imports_of("pfs.wire.x", f, known) == expected
